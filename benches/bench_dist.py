"""Coordination overhead of a collective put_snapshot at 32 and 64 ranks.

Simulates a data-parallel/FSDP job on one machine: W forked ranks (gloo on
127.0.0.1, the c10d TCPStore hosted by this launcher), each holding a few
hundred KB of state (a row shard of two global tensors, its share of a
replicated tensor, rank-local values), all writing into one local store.

What is measured, per snapshot, from outside the package (nothing in
tensorstore_ck is edited; the ranks wrap two methods of their own Store object
to take timestamps):

  done_r      when rank r's last storage sync of its own writes returned
              (store.assets.sync is called once per rank, right after its
              blocks and manifest nodes are written; rank 0 calls it again
              for the commit object, which is not counted here)
  ref_moved   when rank 0's compare-and-swap of the ref returned
  overhead    ref_moved - max_r done_r: from the slowest rank finishing its
              writes to the ref moving (done/add keys in the c10d store, rank 0
              polling for them, reading every rank's manifest root, writing the
              top node and the commit, syncing, LMDB CAS)
  gather      rank 0 entering Publisher.commit - max_r done_r (the coordination part)
  returned    max_r (put_snapshot returned on rank r) - ref_moved (result fan-out)
  total       max_r return - min_r entry of put_snapshot (the whole collective)

Then each rank checks out its own pieces (into= Sharded targets, a collective checkout),
from the snapshot as written (with the chunk index rank 0 writes at commit) and from the
same rank trees committed without the index (what older builds wrote: every rank merges
every rank's tree, O(W^2) node reads in all): slowest rank's time and nodes read.

--store-bytes: instead, the bytes each rank sends and reads through the c10d Store per
snapshot (a counting wrapper around the store the collective calls use), forked gloo
ranks each holding --tensors sharded pieces of --kb KiB (blocks, not inlined), every value
changed in every snapshot: the first snapshot sends each rank's layout once, a repeated one
a constant few hundred bytes per rank, whatever N and whatever changed.

Usage (about 2 minutes on 2 cores):
    .venv/bin/python benches/bench_dist.py | tee benches/results/dist.txt
    .venv/bin/python benches/bench_dist.py --ranks 8 --repeats 3     # smoke run
    .venv/bin/python benches/bench_dist.py --store-bytes --ranks 8 --tensors 600 --kb 20 --repeats 2
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tensorstore_ck as tsck  # noqa: E402

REF = "bench/main"
REF_OLD = "bench/unindexed"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def make_state(rank: int, world: int, rep: int, args) -> dict:
    g = torch.Generator()
    g.manual_seed(rep * 100003 + rank)
    cols = 256
    rows_w = args.kb * 1024 // (4 * cols)      # the big shard: args.kb KiB of float32
    rows_b = max(1, rows_w // 4)
    emb = torch.Generator()
    emb.manual_seed(rep)                       # the same on every rank
    return {
        "model": {
            "w": tsck.Sharded(torch.randn(rows_w, cols, generator=g), (rows_w * world, cols), (rows_w * rank, 0)),
            "b": tsck.Sharded(torch.randn(rows_b, cols, generator=g), (rows_b * world, cols), (rows_b * rank, 0)),
            "emb": tsck.Replicated(torch.randn(args.kb * 1024 // (4 * 128), 128, generator=emb)),
        },
        "rng": torch.randn(2048, generator=g),
        "rank": rank,
        "step": rep,
    }


def _own_pieces(state: dict) -> dict:
    """The into= tree of a checkout of this rank's own pieces (zeroed Sharded targets)."""
    return {"model": {k: tsck.Sharded(torch.zeros_like(v.local), v.global_shape, v.offsets)
                      for k, v in state["model"].items() if isinstance(v, tsck.Sharded)}}


def _unindexed_copy(store, ref: str, to: str) -> None:
    """Commit the snapshot at `ref` again without its chunk index, on `to` (the same rank trees:
    what a build before the index wrote)."""
    from tensorstore_ck.format.manifest import decode_commit, decode_node
    root = bytes.fromhex(store.resolve(ref))
    c = decode_commit(store.assets.get_commit(root))
    top = decode_node(store.assets.get_node(c["tree"]))
    w = dict(top["W"])
    w.pop("ix", None)
    tree_top, _ = store.publisher.write_nodes({"W": w})
    info = store.show(ref)
    stats = {"bytes_total": info.bytes_total, "bytes_new": 0, "blocks_total": info.blocks_total, "blocks_new": 0}
    store.commit_tree(tree_top, ref=to, job="bench", step=info.step, metrics={}, meta={"world": w["world"]},
                      stats=stats)


def rank_main(rank: int, world: int, port: int, args, out: str) -> None:
    rec = {"rank": rank, "reps": []}
    code = 1
    try:
        import torch.distributed as dist
        torch.set_num_threads(1)
        t0 = time.time()
        kv = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=300))
        dist.init_process_group("gloo", store=kv, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        dist.barrier()
        rec["init_s"] = time.time() - t0
        store = tsck.open_store(os.path.join(out, "store"), block_size=args.block_kb * 1024, workers=2)
        syncs: list[float] = []
        orig_sync = store.assets.sync

        def timed_sync():
            orig_sync()
            syncs.append(time.time())
        store.assets.sync = timed_sync
        marks: dict = {}
        if rank == 0:
            orig_cas, orig_commit = store.reftable.compare_and_swap, store.publisher.commit

            def timed_cas(*a, **k):
                r = orig_cas(*a, **k)
                marks["ref"] = time.time()
                return r

            def timed_commit(*a, **k):
                marks["commit_in"] = time.time()
                return orig_commit(*a, **k)
            store.reftable.compare_and_swap = timed_cas
            store.publisher.commit = timed_commit
        for rep in range(args.repeats + 1):  # repeat 0 is a warm-up
            state = make_state(rank, world, rep, args)
            dist.barrier()
            syncs.clear()
            marks.clear()
            t_in = time.time()
            info = store.put_snapshot(state, REF, step=rep, timeout=120)
            t_out = time.time()
            rec["reps"].append({"rep": rep, "in": t_in, "out": t_out, "done": syncs[0] if syncs else None,
                                "ref": marks.get("ref"), "commit_in": marks.get("commit_in"), "root": info.root,
                                "blocks_new": info.blocks_new, "bytes_new": info.bytes_new})
        dist.barrier()
        # Checkout: each rank reads its own pieces back (into= Sharded), from the snapshot as
        # written (with its chunk index) and from the same snapshot without the index (what
        # an older build wrote, so every rank merges every rank's tree).
        if rank == 0:
            _unindexed_copy(store, REF, REF_OLD)
        dist.barrier()
        nodes = {"n": 0}
        orig_get_node = store.assets.get_node

        def counted_get_node(*a, **k):
            nodes["n"] += 1
            return orig_get_node(*a, **k)
        store.assets.get_node = counted_get_node
        rec["checkout"] = {}
        for name, ref in (("indexed", REF), ("unindexed", REF_OLD)):
            times, counts = [], []
            for _ in range(args.repeats + 1):
                into = _own_pieces(make_state(rank, world, args.repeats, args))
                dist.barrier()
                nodes["n"] = 0
                t_in = time.time()
                store.checkout(ref, into=into, timeout=120)
                times.append(time.time() - t_in)
                counts.append(nodes["n"])
            rec["checkout"][name] = {"s": times[1:], "nodes": counts[1:]}
        dist.barrier()
        store.close()
        code = 0
    except BaseException:  # noqa: BLE001
        rec["error"] = traceback.format_exc()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    os._exit(code)


def fork_ranks(target, world: int, args, out: str) -> None:
    """Fork `world` gloo ranks running target(rank, world, port, args, out) beside a c10d
    TCPStore hosted here; ranks still alive past args.limit are killed."""
    from torch.distributed import TCPStore
    port = free_port()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_stacks_on_usr1, args=(target, r, world, port, args, out))
             for r in range(world)]
    for p in procs:
        p.start()
    master = TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=300),
                      wait_for_workers=False)
    deadline = time.monotonic() + args.limit
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    stuck = [p for p in procs if p.is_alive()]
    for p in stuck:  # its threads' stacks first (stack{r}.txt), so a hang shows where it is
        os.kill(p.pid, signal.SIGUSR1)
    for p in stuck:
        p.join(5)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join()
    del master


def _stacks_on_usr1(target, rank: int, world: int, port: int, args, out: str) -> None:
    """A forked rank that writes its threads' stacks to out/stack{rank}.txt on SIGUSR1 and
    exits, then runs target."""
    import faulthandler
    f = open(os.path.join(out, f"stack{rank}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
    target(rank, world, port, args, out)


def _left_no_result(world: int, rank: int, out: str) -> str:
    """What a rank that wrote no result left behind: every stuck rank's stacks, or that it died."""
    msg = f"{world} ranks: rank {rank} left no result"
    stacks = []
    for r in range(world):
        try:
            text = open(os.path.join(out, f"stack{r}.txt")).read()
        except OSError:
            continue
        if text:
            stacks.append(f"--- rank {r}, stuck past the limit:\n{text}")
    return "\n".join([msg, *stacks]) if stacks else f"{msg} (it died without a traceback)"


def run_world(world: int, args, base: str) -> dict:
    out = os.path.join(base, f"w{world}")
    os.makedirs(out)
    t0 = time.time()
    fork_ranks(rank_main, world, args, out)
    wall = time.time() - t0
    recs = []
    for r in range(world):
        path = os.path.join(out, f"rank{r}.json")
        if not os.path.exists(path):
            raise SystemExit(_left_no_result(world, r, out))
        d = json.load(open(path))
        if "error" in d:
            raise SystemExit(f"{world} ranks: rank {r} failed:\n{d['error']}")
        recs.append(d)
    rows = []
    for i in range(1, args.repeats + 1):
        reps = [d["reps"][i] for d in recs]
        assert len({x["root"] for x in reps}) == 1, "ranks returned different roots"
        r0 = reps[0]
        slowest = max(x["done"] for x in reps)
        rows.append({
            "overhead": r0["ref"] - slowest,
            "gather": r0["commit_in"] - slowest,
            "returned": max(x["out"] for x in reps) - r0["ref"],
            "total": max(x["out"] for x in reps) - min(x["in"] for x in reps),
            "write_max": max(x["done"] - x["in"] for x in reps),
            "blocks_new": r0["blocks_new"], "bytes_new": r0["bytes_new"],
        })
    shutil.rmtree(os.path.join(out, "store"), ignore_errors=True)
    co = {}
    for name in ("indexed", "unindexed"):
        n = len(recs[0]["checkout"][name]["s"])
        co[name] = {"s": [max(d["checkout"][name]["s"][i] for d in recs) for i in range(n)],
                    "nodes_per_rank": max(max(d["checkout"][name]["nodes"]) for d in recs),
                    "nodes_total": sum(d["checkout"][name]["nodes"][0] for d in recs)}
    return {"world": world, "init_s": max(d["init_s"] for d in recs), "wall_s": wall, "reps": rows,
            "checkout": co}


class CountingStore:
    """A rank's client of the c10d Store as the collective calls use it (what
    torch.distributed's default store returns): forwards every call and counts the
    requests and payload bytes (keys and values sent, values got back), as
    benches/bench_scale.py's CountingKV does for its threads."""

    def __init__(self, inner):
        self.inner = inner
        self.requests = self.bytes = 0

    def _n(self, n: int) -> None:
        self.requests += 1
        self.bytes += n

    def set(self, key, value):
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, value)
        self._n(len(key) + len(value))

    def get(self, key):
        v = self.inner.get(key)
        self._n(len(key) + len(v))
        return v

    def add(self, key, n):
        self._n(len(key) + 16)  # the increment out, the count back
        return self.inner.add(key, n)

    def check(self, keys):
        self._n(sum(len(k) for k in keys) + 1)
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        v = self.inner.compare_set(key, expected, desired)
        self._n(len(key) + len(expected) + len(desired) + len(v))
        return v

    def delete_key(self, key):
        self._n(len(key) + 1)
        return self.inner.delete_key(key)

    def wait(self, keys, *args):
        self._n(sum(len(k) for k in keys))
        return self.inner.wait(keys, *args)

    def multi_get(self, keys):
        v = self.inner.multi_get(keys)
        self._n(sum(len(k) for k in keys) + sum(len(x) for x in v))
        return v

    def multi_set(self, keys, values):
        self._n(sum(len(k) for k in keys) + sum(len(v) for v in values))
        return self.inner.multi_set(keys, values)


def changed_state(rank: int, world: int, rep: int, tensors: int, kib: int) -> dict:
    """Rank `rank`'s row piece of each of `tensors` global float32 tensors (kib KiB a piece:
    above the 16 KiB inline threshold, so each is a block of its own), every value new in
    each rep."""
    cols = 256
    rows = max(1, kib * 1024 // (4 * cols))
    g = torch.Generator()
    g.manual_seed(rep * 1000003 + rank)
    return {"t": {f"p{i:05d}": tsck.Sharded(torch.randn(rows, cols, generator=g), (rows * world, cols),
                                            (rows * rank, 0)) for i in range(tensors)}, "step": rep}


def store_bytes_rank(rank: int, world: int, port: int, args, out: str) -> None:
    """One gloo rank of store_bytes_world: its collective puts, each one's requests and
    bytes through the c10d Store and its SnapshotInfo."""
    rec = {"rank": rank, "reps": []}
    code = 1
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        torch.set_num_threads(1)
        kv = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=300))
        dist.init_process_group("gloo", store=kv, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        counted = CountingStore(c10d._get_default_store())
        c10d._get_default_store = lambda: counted  # what the collective calls talk through, counted
        tier = os.path.join(out, f"tier{rank}") if getattr(args, "tiers", False) else None
        store = tsck.open_store(os.path.join(out, "store"), workers=2, local=tier)
        for rep in range(args.repeats + 1):  # rep 0: the first snapshot (the layouts sent)
            state = changed_state(rank, world, rep, args.tensors, args.kb)
            dist.barrier()
            counted.requests = counted.bytes = 0
            info = store.put_snapshot(state, REF, step=rep, timeout=300)
            rec["reps"].append({"requests": counted.requests, "bytes": counted.bytes, "root": info.root,
                                "bytes_new": info.bytes_new, "blocks_new": info.blocks_new,
                                "bytes_total": info.bytes_total, "blocks_total": info.blocks_total})
            dist.barrier()
        store.close()
        code = 0
    except BaseException:  # noqa: BLE001
        rec["error"] = traceback.format_exc()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(rec, f)
    os._exit(code)


def store_bytes_world(world: int, args, base: str) -> list:
    """Forked gloo ranks making repeated collective puts with every value changed (the
    c10d TCPStore hosted here) -> each rank's record (store_bytes_rank)."""
    out = tempfile.mkdtemp(prefix=f"bytes_w{world}_", dir=base)
    fork_ranks(store_bytes_rank, world, args, out)
    recs = []
    for r in range(world):
        path = os.path.join(out, f"rank{r}.json")
        if not os.path.exists(path):
            raise RuntimeError(_left_no_result(world, r, out))
        d = json.load(open(path))
        if "error" in d:
            raise RuntimeError(f"{world} ranks: rank {r} failed:\n{d['error']}")
        recs.append(d)
    shutil.rmtree(out, ignore_errors=True)
    return recs


def store_bytes_main(args, base: str) -> None:
    got = {}
    for w in args.ranks:
        recs = got[w] = store_bytes_world(w, args, base)
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(got, f)
        print(f"\n{w} gloo ranks x {args.tensors} sharded tensors of {args.kb} KiB a piece, every value changed "
              f"each snapshot{', each rank through a local tier of its own' if args.tiers else ''}: through the c10d "
              "Store, per rank")
        print("| snapshot | bytes: rank 0 | bytes: other ranks, max (mean) | in all | requests per rank: max "
              "| bytes_new | blocks_new |")
        print("|---|---|---|---|---|---|---|")
        for i in range(args.repeats + 1):
            reps = [d["reps"][i] for d in recs]
            b = [x["bytes"] for x in reps]
            rest = b[1:] or [0]
            print(f"| {'first' if i == 0 else f'repeat {i}'} | {b[0]} | {max(rest)} ({sum(rest) / len(rest):.0f}) "
                  f"| {sum(b)} | {max(x['requests'] for x in reps)} | {reps[0]['bytes_new']} "
                  f"| {reps[0]['blocks_new']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--store-bytes", action="store_true",
                    help="instead: bytes per rank through the c10d Store per snapshot, --tensors sharded "
                         "tensors of --kb KiB per rank, every value changed each snapshot")
    ap.add_argument("--tensors", type=int, default=600, help="--store-bytes: sharded tensors per rank")
    ap.add_argument("--tiers", action="store_true", help="--store-bytes: each rank puts through a local tier of its own")
    ap.add_argument("--ranks", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--kb", type=int, default=256, help="KiB of the main shard per rank (default 256)")
    ap.add_argument("--block-kb", type=int, default=64, help="store block size in KiB (default 64)")
    ap.add_argument("--dir", default=None, help="where the stores go (default: a temp dir under /work)")
    ap.add_argument("--limit", type=float, default=500.0, help="seconds before a world size is given up")
    ap.add_argument("--json-out", default=None, help="also write the records here (JSON)")
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="bench_dist_", dir=args.dir or ("/work" if os.path.isdir("/work") else None))
    if args.store_bytes:
        print(f"# bench_dist --store-bytes: {platform.node()} {os.cpu_count()} CPUs, torch {torch.__version__}, "
              f"tensorstore_ck {tsck.__version__}; store under {base}")
        try:
            store_bytes_main(args, base)
        finally:
            shutil.rmtree(base, ignore_errors=True)
        return
    print(f"# bench_dist: {platform.node()} {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"tensorstore_ck {tsck.__version__}; per rank: {args.kb} KiB + {args.kb // 4} KiB shards, "
          f"1/W of a {args.kb} KiB replicated tensor, 8 KiB rank-local; block {args.block_kb} KiB; "
          f"{args.repeats} repeats after 1 warm-up; store under {base}")
    results = []
    try:
        for w in args.ranks:
            results.append(run_world(w, args, base))
            print(f"# {w} ranks done: init {results[-1]['init_s']:.1f} s, wall {results[-1]['wall_s']:.1f} s",
                  flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    ms = lambda xs: f"{1000 * statistics.median(xs):.0f}"  # noqa: E731
    mx = lambda xs: f"{1000 * max(xs):.0f}"  # noqa: E731
    print()
    print("| ranks | ref moved − slowest rank done, median (max) ms | of which gather: median (max) ms "
          "| ref moved → all ranks returned: median (max) ms | slowest rank's writes: median ms "
          "| total put: median (max) ms | new blocks per put |")
    print("|---|---|---|---|---|---|---|")
    for res in results:
        rs = res["reps"]
        col = lambda k: [x[k] for x in rs]  # noqa: E731
        print(f"| {res['world']} | {ms(col('overhead'))} ({mx(col('overhead'))}) | {ms(col('gather'))} "
              f"({mx(col('gather'))}) | {ms(col('returned'))} ({mx(col('returned'))}) | {ms(col('write_max'))} "
              f"| {ms(col('total'))} ({mx(col('total'))}) | {rs[0]['blocks_new']} |")
    print()
    print("| ranks | checkout of own pieces, slowest rank, median (max) ms: with the chunk index "
          "| without (every rank merges every tree) | nodes read per rank: with / without "
          "| nodes read in all: with / without |")
    print("|---|---|---|---|---|")
    for res in results:
        a, b = res["checkout"]["indexed"], res["checkout"]["unindexed"]
        print(f"| {res['world']} | {ms(a['s'])} ({mx(a['s'])}) | {ms(b['s'])} ({mx(b['s'])}) "
              f"| {a['nodes_per_rank']} / {b['nodes_per_rank']} | {a['nodes_total']} / {b['nodes_total']} |")
    worst = max((x["overhead"] for res in results for x in res["reps"]), default=0.0)
    print(f"\nworst ref-moved − slowest-done over all repeats: {1000 * worst:.0f} ms "
          f"({'under' if worst < 1.0 else 'OVER'} the 1 s target)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
