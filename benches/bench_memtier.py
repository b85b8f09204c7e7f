#!/usr/bin/env python
"""The memory tier's overhead and memory bound, on 2 (and 4) forked gloo ranks.

Each rank opens `open_store(file://REMOTE, memory=/dev/shm/..., replicas=1, durable_every=N)`,
its node simulated by $TSCK_NODE (2 ranks: a, b; 4 ranks: a, a, b, b), so each rank's part is
copied to a rank of the other node; the remote is a file:// store under --dir (the temp dir).
Every figure is measured against its peer in the same run, on the same ranks, interleaved
(only same-run ratios mean anything on this shared machine):

1. Stall and blocking put. Each rank holds its own GPT-style state (bench_core's, fp32 weights +
   AdamW moments, --mb MB per rank, seeded by rank: every rank's part differs), every tensor
   changed before each snapshot. Per round, in an order rotated every round, with a pause and a
   barrier before each:
     copy        a plain copy of the state into preallocated, touched tensors (the floor);
     mem async   put_snapshot(blocking=False) through the memory tier: the call's time is the stall;
     none async  the same into a plain file:// store (no tier): the same staging without a tier;
     mem block   put_snapshot() (blocking) through the memory tier, call to return;
     mem0 block  the same through a memory tier with replicas=0 (no copies: the tier alone);
     disk block  the same through a disk tier (local= under --dir, replicas=1, same durable_every);
     none block  the same into the plain file:// store.
   The tiers' schedules count every put of their ref; the blocking figures are the tier-only
   snapshots' (a tier-only put returns once its part's copies are sent), and a ratio of two
   tiered puts pairs rounds where both are tier-only. After each put every rank waits until its
   snapshot is quiet (the future's result, wait_durable: copies sent, uploads done) and a
   barrier: the process CPU from the call to then is what the snapshot cost this rank (its
   writes, hashing, copies sent, the copies it received from its peer, the upload of a durable
   one), with the replica objects it sent (Peers.sent: objects, not bytes).

2. Training throughput. Each rank trains three DDP copies of a small GPT side by side: with
   CheckpointManager(every_steps=E) over a memory tier (replicas=1, durable_every=N,
   asynchronous), with the same manager over a plain file:// store, and without snapshots; a
   segment of --seg steps each per round, the order rotated every round, a segment ending with
   mgr.wait(). Steps/s ÷ none, per round. (Under DDP every rank's part is the same bytes, so a
   holder already has the blocks of the part it holds: the copies cost nodes only here.)

3. Memory bound. After part 1 (and after part 2), the bytes under each rank's memory tier on
   /dev/shm (the file sizes, and du -sb) against (k+1) x the rank's share of the state (its
   bytes in memory; the tier keeps them lz4-framed), with the snapshots its tier catalog keeps
   (durable and tier-only); after part 1 also after a store.gc() of each memory tier, and
   whether each holder's tier has the blocks of the newest tier-only snapshot's part it holds.
   --budget F opens the memory tiers with local_budget = F x share.

All of it runs once per --packs configuration (every store of the run opened with that
pack_size): "default" (64 MiB packs of small tensors with a tier) and 0 (no packs). The
package's warnings on the ranks are counted by kind and printed with where the first of
each kind was logged (a copy to a peer that fails is a warning, not an error).

Two tiered stores with replicas in one process share the c10d keys tsck/peer/<rank> (the last
to join overwrites them); each Peers caches a peer's address on its first connection, so the
stores here are warmed one at a time (first put, copies sent, barrier) and each store's cached
addresses are checked against its peers' own servers at the end (a mismatch fails the run).
Part 2's store opens after part 1's are closed.

    .venv/bin/python benches/bench_memtier.py | tee benches/results/memtier.txt        # ~3 min
    .venv/bin/python benches/bench_memtier.py --packs 0 --budget 2                   # the bound with a budget
    .venv/bin/python benches/bench_memtier.py --worlds 4 --packs 0 --d 256 --mb 128  # 4 ranks on 2 nodes
    .venv/bin/python benches/bench_memtier.py --small                                # smoke, ~1 min
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_core import GPT, build_state, iter_tensors  # noqa: E402
from bench_dist_async import launch_ranks, log, med, pause, rotated_rounds, train_steps  # noqa: E402

REF = "bench/main"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
MODES = ("copy", "mem_async", "none_async", "mem_block", "mem0_block", "disk_block", "none_block")
PUTS = {"mem_async": ("mem", False), "none_async": ("none", False), "mem_block": ("mem", True),
        "mem0_block": ("mem0", True),
        "disk_block": ("disk", True), "none_block": ("none", True)}


def nodes_for(world: int) -> list[str]:
    """Ranks 0..W/2-1 on node a, the others on node b (2 ranks: a, b)."""
    return ["a" if r < world // 2 else "b" for r in range(world)]


def packs(args) -> dict:
    """open_store's pack_size for this configuration: {} (the default: 64 MiB packs with a tier) or the size."""
    return {} if args.pack_size is None else {"pack_size": args.pack_size}


class Warnings:
    """A logging handler that counts the package's warnings on this rank, by message shape."""

    def __init__(self):
        import logging
        import re
        self.seen: dict[str, list] = {}
        shape = re.compile(r"[0-9a-f]{8,}|\d+")

        class H(logging.Handler):
            def emit(h, rec):  # noqa: N805
                try:
                    msg = rec.getMessage()
                except Exception:  # noqa: BLE001
                    msg = str(rec.msg)
                key = shape.sub("#", msg)[:90]
                if key not in self.seen:  # where the first of its kind came from (thread and frames)
                    import threading
                    import traceback as tb

                    def where(f):
                        name = f.filename
                        return os.path.relpath(name, ROOT) if name.startswith(ROOT) else os.path.basename(name)
                    frames = [f"{where(f)}:{f.lineno} {f.name}" for f in tb.extract_stack()[:-1]
                              if "logging" not in f.filename]
                    self.seen[key] = [0, msg[:400], threading.current_thread().name, frames[-14:]]
                self.seen[key][0] += 1
        self.handler = H(logging.WARNING)
        logging.getLogger("tensorstore_ck").addHandler(self.handler)


def budget(args, share: int) -> dict:
    """open_store's local_budget for the memory tiers: --budget x the rank's share, or none."""
    return {} if args.budget is None else {"local_budget": int(args.budget * share)}


def tier_bytes(path: str) -> dict:
    """Bytes under `path`: the files' sizes, du's allocated blocks, per top folder."""
    size = alloc = 0
    by: dict[str, int] = {}
    for d, _s, fs in os.walk(path):
        top = os.path.relpath(d, path).split(os.sep)[0]
        for f in fs:
            try:
                st = os.lstat(os.path.join(d, f))
            except OSError:
                continue
            size += st.st_size
            alloc += st.st_blocks * 512
            by[top] = by.get(top, 0) + st.st_size
    try:
        du = int(subprocess.run(["du", "-sb", path], capture_output=True, text=True).stdout.split()[0])
    except (ValueError, IndexError, OSError):
        du = -1
    return {"size": size, "alloc": alloc, "du_b": du, "by": by}


def kept_rows(store) -> dict:
    """The snapshots the store's tier catalog keeps, by kind."""
    out = {"durable_kept": 0, "tier_only_kept": 0}
    try:
        for _root, row in store._tier.core.refs.catalog_iter(bad=[]):
            meta = row.get("meta") or {}
            out["tier_only_kept" if meta.get("tier_only") else "durable_kept"] += 1
    except Exception as e:  # noqa: BLE001 - a figure missing, reported
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def copies_held(store, root_hex: str, dist, kv, rank: int, world: int, tag: str) -> dict:
    """Whether this rank's tier holds the blocks of the part of snapshot `root_hex` of each rank
    that chose it as a holder -> {owner rank: [blocks here, blocks of its part]}."""
    from tensorstore_ck.core.walk import walk_tree
    tier = store._tier
    assets, root = tier.core.assets, bytes.fromhex(root_hex)
    part = tier.core.refs.tier_rows.parts().get(root)
    mine = [] if part is None else [o.digest.hex() for o in walk_tree(assets, part, snapshot=root_hex, verify=False)
                                    if o.kind == "block" and assets.block_exists(o.digest)]
    kv.set(f"bench/part/{tag}/{rank}", json.dumps({"holders": tier.peers.holders(), "blocks": mine,
                                                   "found": part is not None}))
    dist.barrier()
    out = {}
    for q in range(world):
        got = json.loads(kv.get(f"bench/part/{tag}/{q}").decode())
        if q != rank and rank in got["holders"]:
            out[q] = [sum(assets.block_exists(bytes.fromhex(d)) for d in got["blocks"]), len(got["blocks"]),
                      got["found"]]
    dist.barrier()
    return out


def peer_port(store) -> int | None:
    p = store._tier.peers
    return None if p is None or p._sock is None else p._sock.getsockname()[1]


def quiet(store, fut, dist) -> None:
    """The snapshot done on this rank (result, copies sent, uploads), then on every rank."""
    if fut is not None:
        fut.result()
    store.wait_durable(timeout=600)
    dist.barrier()


def part_puts(tsck, dist, rank, world, args, base, shm, kv) -> dict:
    state, _m, _o = build_state(args.mb * 1e6, d=args.d, seed=rank, vocab=8192, log=lambda *a: None)
    src = [t for _, t in iter_tensors(state)]
    dst = [torch.zeros_like(t) for t in src]
    for a, b in zip(dst, src):
        a.copy_(b)
    nbytes = sum(t.numel() * t.element_size() for t in src)
    out = {"bytes": nbytes, "tensors": len(src), "samples": [], "warm": {}}
    opened = {
        "mem": lambda: tsck.open_store(os.path.join(base, "remote_mem"), refs=os.path.join(base, "refs_mem.lmdb"),
                                       memory=os.path.join(shm, f"mem{rank}"), replicas=1,
                                       durable_every=args.durable_every, **packs(args), **budget(args, nbytes)),
        "disk": lambda: tsck.open_store(os.path.join(base, "remote_disk"), refs=os.path.join(base, "refs_disk.lmdb"),
                                        local=os.path.join(base, f"disk{rank}"), replicas=1,
                                        durable_every=args.durable_every, **packs(args)),
        "mem0": lambda: tsck.open_store(os.path.join(base, "remote_mem0"), refs=os.path.join(base, "refs_mem0.lmdb"),
                                        memory=os.path.join(shm, f"mem0_{rank}"), durable_every=args.durable_every,
                                        **packs(args)),
        "none": lambda: tsck.open_store(os.path.join(base, "remote_none"), refs=os.path.join(base, "refs_none.lmdb"),
                                        **packs(args)),
    }
    stores: dict = {}
    step = {"mem": 0, "mem0": 0, "disk": 0, "none": 0}
    k_bump = [0]

    def bump():
        k_bump[0] += 1
        with torch.no_grad():
            for t in src:
                if t.dtype.is_floating_point:
                    t.add_(1e-3 * k_bump[0])

    def put(name, blocking):
        store = stores[name]
        bump()
        pause(dist, args.rest)
        peers = store._tier.peers if name in ("mem", "disk") else None
        sent0 = peers.sent if peers else 0
        c0, t0 = time.process_time(), time.perf_counter()
        if blocking:
            info, fut = store.put_snapshot(state, REF, step=step[name]), None
        else:
            fut = store.put_snapshot(state, REF, step=step[name], blocking=False)
        t1 = time.perf_counter()
        sent1 = peers.sent if peers else 0
        if fut is not None:
            info = fut.result()
        t2 = time.perf_counter()
        quiet(store, None, dist)
        t3, c3 = time.perf_counter(), time.process_time()
        step[name] += 1
        return {"ret": t1 - t0, "result": t2 - t0, "quiet": t3 - t0, "cpu": c3 - c0,
                "tier_only": bool((info.meta or {}).get("tier_only")),
                "sent_at_return": sent1 - sent0,
                "sent": (peers.sent if peers else 0) - sent0, "root": info.root}

    try:
        # Warm-up, one store at a time: its first put (durable, the staging buffer made),
        # its copies sent and every rank past it before the next store joins the peers.
        for name, blocking in (("mem", False), ("disk", True), ("mem0", True), ("none", False)):
            stores[name] = opened[name]()
            out["warm"][name] = put(name, blocking)
            if name in ("mem", "disk"):
                stores[name]._tier.peers.wait()
                kv.set(f"bench/port/{name}/{rank}", str(peer_port(stores[name])))
            dist.barrier()
        order = list(MODES)
        for r in range(args.rounds):
            k = r % len(order)
            for mode in order[k:] + order[:k]:
                if mode == "copy":
                    bump()
                    pause(dist, args.rest)
                    t0 = time.perf_counter()
                    for a, b in zip(dst, src):
                        a.copy_(b)
                    out["samples"].append({"mode": mode, "round": r, "ret": time.perf_counter() - t0})
                    dist.barrier()
                else:
                    out["samples"].append({"mode": mode, "round": r, **put(*PUTS[mode])})
        dist.barrier()
        # Untimed: memory-tier puts until the newest is tier-only, then whether its copies are held.
        out["final_puts"] = 0
        for _ in range(args.durable_every):
            out["final"] = put("mem", True)
            out["final_puts"] += 1
            if out["final"]["tier_only"]:
                break
        out["copies"] = copies_held(stores["mem"], out["final"]["root"], dist, kv, rank, world, "main")
        # The addresses each tier's Peers used: its peers' own servers (see the docstring).
        out["addr_ok"] = {}
        for name in ("mem", "disk"):
            p = stores[name]._tier.peers
            want = {q: int(kv.get(f"bench/port/{name}/{q}").decode()) for q in p._addrs}
            out["addr_ok"][name] = all(p._addrs[q][1] == want[q] for q in p._addrs) and bool(p._addrs)
        out["mem_tier"] = {**tier_bytes(os.path.join(shm, f"mem{rank}")), **kept_rows(stores["mem"])}
        out["disk_tier"] = {**tier_bytes(os.path.join(base, f"disk{rank}")), **kept_rows(stores["disk"])}
        out["counters"] = {n: {"sent": stores[n]._tier.peers.sent, "refused": stores[n]._tier.peers.refused}
                           for n in ("mem", "disk")}
        dist.barrier()
        if args.gc:  # what a gc of each rank's memory tier leaves (held copies included)
            t0 = time.perf_counter()
            try:
                stores["mem"].gc()
                out["gc"] = "ran"
            except Exception as e:  # noqa: BLE001 - reported
                out["gc"] = f"{type(e).__name__}: {e}"
            out["gc_s"] = time.perf_counter() - t0
            dist.barrier()
            out["mem_tier_after_gc"] = {**tier_bytes(os.path.join(shm, f"mem{rank}")), **kept_rows(stores["mem"])}
            dist.barrier()
    finally:
        for s in stores.values():
            s.close()
    # No rank closes its peer server while another may still send to it.
    dist.barrier()
    if rank == 0:  # which of the tiers' snapshots the remotes hold (a tier-only one there: uploaded after all)
        out["remote_roots"] = {}
        for name in ("mem", "disk"):
            with tsck.open_store(os.path.join(base, f"remote_{name}"), refs=os.path.join(base, f"refs_{name}.lmdb"),
                                 read_only=True) as r:
                out["remote_roots"][name] = sorted(root.hex() for root, _row in r.core.refs.catalog_iter(bad=[]))
    dist.barrier()
    return out


class TrainRun:
    """One DDP training run on this rank: "none", "mem" (a CheckpointManager over a memory tier) or
    "plain" (the same manager over a plain file:// store, no tier)."""

    def __init__(self, tsck, mode, args, base, shm, rank):
        from torch.nn.parallel import DistributedDataParallel as DDP
        self.mode, self.args, self.rank = mode, args, rank
        torch.manual_seed(0)
        self.model = DDP(GPT(args.vocab, args.ctx, args.train_d, args.train_layers, max(1, args.train_d // 64)))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1)
        self.ts = tsck.TrainState(model=self.model, optimizer=self.opt)
        self.store = self.mgr = None
        self.tier = os.path.join(shm, f"train{rank}")
        share = 3 * sum(p.numel() * p.element_size() for p in self.model.parameters())  # weights + 2 moments
        if mode == "mem":
            self.store = tsck.open_store(os.path.join(base, "remote_train"), refs=os.path.join(base, "refs_train.lmdb"),
                                         memory=self.tier, replicas=1, durable_every=args.durable_every,
                                         **packs(args), **budget(args, share))
        elif mode == "plain":
            self.store = tsck.open_store(os.path.join(base, "remote_plain"), refs=os.path.join(base, "refs_plain.lmdb"),
                                         **packs(args))
        if self.store is not None:
            self.mgr = tsck.CheckpointManager(self.store, job=f"train-{mode}", state=self.ts, every_steps=args.every)
        self.step = args.every  # each segment starts with the step that snapshots
        self.snapshots = 0
        self.in_step: list[float] = []

    def segment(self) -> float:
        return train_steps(self, self.args.seg)

    def close(self, dist) -> dict:
        out = {"snapshots": self.snapshots, "in_step": self.in_step}
        if self.mode == "plain":
            self.mgr.close()
            out["failed"] = self.mgr.failed_snapshots
            self.store.close()
        if self.mode == "mem":
            self.store.wait_durable(timeout=600)
            dist.barrier()
            out["state_bytes"] = sum(t.numel() * t.element_size() for t in self.model.state_dict().values()) + sum(
                t.numel() * t.element_size() for s in self.opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
            out["tier"] = {**tier_bytes(self.tier), **kept_rows(self.store)}
            out["sent"] = self.store._tier.peers.sent
            self.mgr.close()
            out["failed"] = self.mgr.failed_snapshots
            dist.barrier()
            self.store.close()
        return out


def part_train(tsck, dist, rank, world, args, base, shm) -> dict:
    runs = {m: TrainRun(tsck, m, args, base, shm, rank) for m in ("none", "mem", "plain")}
    per_round = rotated_rounds(dist, runs, args.train_rounds, args.rest / 5)
    return {"rounds": per_round, **{m: run.close(dist) for m, run in runs.items()}}


def rank_main(rank, world, port, args, base, shm, out_path):
    res = {"rank": rank}
    warned = Warnings()
    try:
        os.environ["TSCK_NODE"] = nodes_for(world)[rank]
        import torch.distributed as dist
        import tensorstore_ck as tsck
        torch.set_num_threads(1)
        kv = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("gloo", store=kv, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        if rank == 0:  # each remote created once, before the others open it
            for name in ("mem", "mem0", "disk", "none", "train", "plain"):
                tsck.open_store(os.path.join(base, f"remote_{name}"),
                                refs=os.path.join(base, f"refs_{name}.lmdb")).close()
        dist.barrier()
        if "puts" in args.parts:
            res["puts"] = part_puts(tsck, dist, rank, world, args, base, shm, kv)
        if "train" in args.parts:
            res["train"] = part_train(tsck, dist, rank, world, args, base, shm)
        res["ok"] = True
    except BaseException:  # noqa: BLE001 - reported by the launcher
        res["ok"], res["error"] = False, traceback.format_exc()
    res["warnings"] = warned.seen
    with open(out_path, "w") as f:
        json.dump(res, f)
    os._exit(0)


def run_world(world, args) -> list[dict]:
    base = tempfile.mkdtemp(prefix=f"tsck-bench-memtier{world}-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix=f"tsck-bench-memtier{world}-", dir="/dev/shm")
    try:
        return launch_ranks(world, rank_main, (args, base, shm), base, args.limit)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def rng(xs, f=1e3, fmt="{:.0f}"):
    if not xs:
        return "n/a"
    return f"{fmt.format(med(xs) * f)} ({fmt.format(min(xs) * f)}-{fmt.format(max(xs) * f)})"


def ratio_rng(xs):
    return f"{med(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})" if xs else "n/a"


def mb(x):
    return f"{x / 1e6:.0f}"


def report(world, res, args) -> dict:
    summary = {"world": world}
    warned: dict = {}
    for r in res:
        for key, (n, example, thread, frames) in r.get("warnings", {}).items():
            got = warned.setdefault(key, [0, example, [], thread, frames])
            got[0] += n
            got[2].append(r["rank"])
    summary["warnings"] = sum(v[0] for v in warned.values())
    if "puts" in args.parts:
        pu = [r["puts"] for r in res]
        bad = {n: [r["rank"] for r in res if not r["puts"]["addr_ok"][n]] for n in ("mem", "disk")}
        if any(bad.values()):
            raise SystemExit(f"W={world}: a tier's Peers sent to another store's server: ranks {bad}")
        share = pu[0]["bytes"]
        log(f"\n## W = {world} ranks on nodes {','.join(nodes_for(world))}, {mb(share)} MB of state per rank in "
            f"{pu[0]['tensors']} tensors, replicas=1, durable_every={args.durable_every}, {args.rounds} rounds"
            + ("" if args.budget is None else f", memory tiers' local_budget = {args.budget:g} x share"))

        def samples(mode, only=None, key="ret"):
            return [s[key] for p in pu for s in p["samples"]
                    if s["mode"] == mode and (only is None or s.get("tier_only") == only)]

        def per_round_ratio(a, b, only=False, key="ret"):
            """a / b per rank and round (the samples of one round on one rank); only: both tier-only
            where they are tiered (a round where either is durable is left out)."""
            out = []
            for p in pu:
                by = {}
                for s in p["samples"]:
                    by.setdefault(s["round"], {})[s["mode"]] = s
                for r in by.values():
                    if a in r and b in r and not (only and any(m[:4] in ("mem_", "mem0", "disk") and
                                                               not r[m].get("tier_only") for m in (a, b))):
                        out.append(r[a][key] / r[b][key])
            return out

        st_mem = per_round_ratio("mem_async", "copy")
        st_none = per_round_ratio("none_async", "copy")
        b_disk = per_round_ratio("mem_block", "disk_block", only=True)
        b_none = per_round_ratio("mem_block", "none_block", only=True)
        b_mem0 = per_round_ratio("mem_block", "mem0_block", only=True)
        b_mem0none = per_round_ratio("mem0_block", "none_block", only=True)
        log("\n| what (per rank, per snapshot) | median ms (range over ranks x rounds) | ÷ peer, median (range) |")
        log("|---|---|---|")
        log(f"| plain copy into preallocated, touched tensors | {rng(samples('copy'))} | 1 |")
        log(f"| **memory tier: put_snapshot(blocking=False) returns (the stall)** | {rng(samples('mem_async'))} | "
            f"**{ratio_rng(st_mem)}** of the copy (target ≤ 1.2x) |")
        log(f"| no tier: put_snapshot(blocking=False) returns | {rng(samples('none_async'))} | "
            f"{ratio_rng(st_none)} of the copy |")
        log(f"| memory tier, blocking put of a tier-only snapshot, call to return | "
            f"{rng(samples('mem_block', True))} | {ratio_rng(b_disk)} of the disk tier's, "
            f"{ratio_rng(b_none)} of no tier's, {ratio_rng(b_mem0)} of replicas=0's (same round, both tier-only) |")
        log(f"| memory tier with replicas=0 (no copies), blocking put of a tier-only snapshot | "
            f"{rng(samples('mem0_block', True))} | {ratio_rng(b_mem0none)} of no tier's |")
        log(f"| disk tier (local=), blocking put of a tier-only snapshot | {rng(samples('disk_block', True))} | |")
        log(f"| no tier (file:// store), blocking put | {rng(samples('none_block'))} | |")
        log(f"| memory tier, blocking put of a durable snapshot (its upload queued) | "
            f"{rng(samples('mem_block', False))} | |")
        log(f"| memory tier, async: call to result, tier-only / durable | {rng(samples('mem_async', True, 'result'))}"
            f" / {rng(samples('mem_async', False, 'result'))} | |")
        log(f"\nBackground work per snapshot (process CPU of a rank from the call until every rank's snapshot is quiet:"
            f" result, copies sent and received, uploads done; wall time to then):")
        log("| store | snapshots | CPU ms, median (range) | CPU ms, mean over the schedule | wall to quiet, ms | "
            "replica objects sent at return / in all, median |")
        log("|---|---|---|---|---|---|")
        cpu, cpu_mean = {}, {}
        for mode, label in (("mem_block", "memory tier (blocking puts)"), ("mem_async", "memory tier (async puts)"),
                            ("mem0_block", "memory tier, replicas=0 (blocking)"),
                            ("disk_block", "disk tier (blocking)"), ("none_block", "no tier (blocking)"),
                            ("none_async", "no tier (async)")):
            tiered = mode[:4] in ("mem_", "mem0", "disk")
            kinds = [(True, "tier-only"), (False, "durable")] if tiered else [(None, "all")]
            for only, kind in kinds:
                c = samples(mode, only, "cpu")
                if not c:
                    continue
                allc = samples(mode, None, "cpu")
                mean_sched = sum(allc) / len(allc)
                sr = samples(mode, only, "sent_at_return")
                sa = samples(mode, only, "sent")
                log(f"| {label}, {kind} | {len(c)} | {rng(c)} | {mean_sched * 1e3:.0f} (all {len(allc)}) | "
                    f"{rng(samples(mode, only, 'quiet'))} | {med(sr):.0f} / {med(sa):.0f} |")
                cpu[f"{mode}:{kind}"] = med(c)
                cpu_mean[mode] = mean_sched
        n_mem = sum(1 for s in pu[0]["samples"] if s["mode"] in ("mem_async", "mem_block")) + 1 + pu[0]["final_puts"]
        log(f"\nMemory bound: each rank's memory tier (replicas=1) after its {n_mem} puts (1 warm-up, "
            f"{n_mem - 1 - pu[0]['final_puts']} timed, {pu[0]['final_puts']} more until the newest is tier-only), "
            f"against (k+1) x share = 2 x {mb(share)} MB = {mb(2 * share)} MB:")
        log("| rank | memory tier MB (files; du -sb) | ÷ 2 x share | snapshots its catalog keeps (durable / tier-only)"
            " | disk tier MB | by folder (memory tier), MB |")
        log("|---|---|---|---|---|---|")
        over = []
        for p, r in zip(pu, res):
            t, dk = p["mem_tier"], p["disk_tier"]
            x = t["size"] / (2 * p["bytes"])
            over.append(x)
            log(f"| {r['rank']} | {mb(t['size'])} ({mb(t['du_b'])}) | {x:.2f} | {t['durable_kept']} / "
                f"{t['tier_only_kept']} | {mb(dk['size'])} | "
                f"{', '.join(f'{k} {mb(v)}' for k, v in sorted(t['by'].items()))} |")
        if args.gc:
            for p, r in zip(pu, res):
                t = p.get("mem_tier_after_gc")
                if t:
                    log(f"| {r['rank']}, after store.gc() ({p['gc']}, {p['gc_s']:.1f} s) | {mb(t['size'])} | "
                        f"{t['size'] / (2 * p['bytes']):.2f} | {t['durable_kept']} / {t['tier_only_kept']} | | |")
        remote = pu[0].get("remote_roots", {})
        for name, modes in (("mem", ("mem_async", "mem_block")), ("disk", ("disk_block",))):
            only = {x["root"] for x in pu[0]["samples"] if x["mode"] in modes and x.get("tier_only")}
            if name == "mem" and pu[0]["final"]["tier_only"]:
                only.add(pu[0]["final"]["root"])
            there = only & set(remote.get(name, []))
            summary[f"{name}_tier_only_in_remote"] = [len(there), len(only)]
        log(f"(tier-only snapshots the remote store holds after the run, uploaded after all: memory tier "
            f"{'/'.join(map(str, summary['mem_tier_only_in_remote']))}, disk tier "
            f"{'/'.join(map(str, summary['disk_tier_only_in_remote']))}; the durable ones are there by schedule)")
        held = "; ".join(f"rank {r['rank']} holds {n}/{m} of rank {q}'s" + ("" if found else " (part not found)")
                         for p, r in zip(pu, res) for q, (n, m, found) in sorted(p["copies"].items()))
        log(f"(the newest snapshot {pu[0]['final']['root'][:12]}, tier-only {pu[0]['final']['tier_only']}: "
            f"blocks of each part held by its holder: {held})")
        summary["copies_held"] = {r["rank"]: p["copies"] for p, r in zip(pu, res)}
        log(f"(bound (k+1) x share {'exceeded' if max(over) > 1.0 else 'held'}: largest rank {max(over):.2f}x; "
            f"replica objects sent in all by the memory tiers: {[p['counters']['mem']['sent'] for p in pu]}, "
            f"refused {[p['counters']['mem']['refused'] for p in pu]})")
        summary.update({"share_mb": share / 1e6, "stall_ms": med(samples("mem_async")), "copy_ms": med(samples("copy")),
                        "mem_block_ms": med(samples("mem_block", True)), "cpu_mean": cpu_mean,
                        "sent_per_snapshot": med(samples("mem_block", True, "sent")),
                        "stall_vs_copy": med(st_mem), "none_stall_vs_copy": med(st_none),
                        "mem_block_vs_disk": med(b_disk), "mem_block_vs_none": med(b_none),
                        "mem_block_vs_replicas0": med(b_mem0), "replicas0_vs_none": med(b_mem0none), "cpu_s": cpu,
                        "tier_vs_bound": over})
    if "train" in args.parts:
        tr = res[0]["train"]
        rounds = tr["rounds"]
        ratio = [r["none"] / r["mem"] for r in rounds]
        ratio_plain = [r["none"] / r["plain"] for r in rounds]
        ratio_vs_plain = [r["plain"] / r["mem"] for r in rounds]
        log(f"\nTraining throughput (DDP, GPT d={args.train_d} x{args.train_layers} layers, vocab {args.vocab}, "
            f"ctx {args.ctx}, batch {args.batch}; CheckpointManager(every_steps={args.every}) asynchronous over a "
            f"memory tier, replicas=1, durable_every={args.durable_every}; {args.train_rounds} rounds of "
            f"{args.seg} steps per run):")
        log("| run | steps/s ÷ no snapshots, median (range) | "
            "time inside mgr.step() per snapshot, rank 0, median ms |")
        log("|---|---|---|")
        log(f"| memory tier, every {args.every} steps | **{ratio_rng(ratio)}** ({ratio_rng(ratio_vs_plain)} of the "
            f"plain store's) | {med(tr['mem']['in_step']) * 1e3:.1f} |")
        log(f"| plain file:// store (no tier), every {args.every} steps | {ratio_rng(ratio_plain)} | "
            f"{med(tr['plain']['in_step']) * 1e3:.1f} |")
        none_s = [r["none"] for r in rounds]
        log(f"(no snapshots: {args.seg / med(none_s):.1f} steps/s on rank 0; snapshots per rank "
            f"{tr['mem']['snapshots']} / {tr['plain']['snapshots']}, failed on any rank "
            f"{sum(r['train']['mem']['failed'] for r in res)} / {sum(r['train']['plain']['failed'] for r in res)})")
        log(f"\nMemory bound after training (the training state, {mb(tr['mem']['state_bytes'])} MB per rank, "
            f"DDP: every rank's part is the whole state):")
        log("| rank | memory tier MB | ÷ 2 x state | snapshots kept (durable / tier-only) | replica objects sent |")
        log("|---|---|---|---|---|")
        tov = []
        for r in res:
            m = r["train"]["mem"]
            x = m["tier"]["size"] / (2 * m["state_bytes"])
            tov.append(x)
            log(f"| {r['rank']} | {m['tier']['size'] / 1e6:.1f} | {x:.2f} | {m['tier']['durable_kept']} / "
                f"{m['tier']['tier_only_kept']} | {m['sent']} |")
        summary.update({"throughput": med(ratio), "throughput_plain": med(ratio_plain),
                        "throughput_mem_vs_plain": med(ratio_vs_plain), "train_tier_vs_bound": tov})
    log(f"\nWarnings logged by tensorstore_ck on the ranks: {summary['warnings']}" + ("" if warned else " (none)"))
    for n, example, ranks, thread, frames in sorted(warned.values(), key=lambda v: -v[0]):
        log(f"- {n}x (ranks {sorted(set(ranks))}), e.g.: {example}")
        if args.stacks:
            log(f"  first logged on thread {thread} at: {' <- '.join(reversed(frames[-8:]))}")
    return summary


def headline(summary: list, args) -> None:
    """One row per configuration: the figures for docs/PERFORMANCE.md."""
    log(f"\n## Headline (memory tier: replicas=1, durable_every={args.durable_every}; ratios per rank and round, "
        f"medians; CPU: mean per snapshot over the schedule)")
    log("| W | MB/rank | pack_size | budget | stall ÷ copy (stall / copy) | tier-only blocking put, ms: ÷ no tier, "
        "÷ disk tier, ÷ replicas=0 | CPU ms/snapshot: memory tier / replicas=0 / disk tier / no tier | replica "
        "objects per snapshot | newest tier-only part's blocks held by its holder | tier-only snapshots uploaded "
        "after all | tier ÷ (k+1) x share, after part 1 / training | training steps/s ÷ none (÷ plain store), "
        f"every {args.every} steps |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        if "stall_vs_copy" not in s:
            continue
        c = s["cpu_mean"]
        held = [v for per in s["copies_held"].values() for v in per.values()]
        held_s = f"{sum(v[0] for v in held)}/{sum(v[1] for v in held)}"
        train = ("n/a", "n/a")
        if "throughput" in s:
            train = (f"{max(s['train_tier_vs_bound']):.2f}",
                     f"{s['throughput']:.2f} ({s['throughput_mem_vs_plain']:.2f})")
        log(f"| {s['world']} | {s['share_mb']:.0f} | {'default' if s['pack_size'] is None else s['pack_size']} | "
            f"{'none' if args.budget is None else f'{args.budget:g} x share'} | **{s['stall_vs_copy']:.2f}x** "
            f"({s['stall_ms'] * 1e3:.0f} / {s['copy_ms'] * 1e3:.0f} ms) | {s['mem_block_ms'] * 1e3:.0f}: "
            f"{s['mem_block_vs_none']:.2f}x, {s['mem_block_vs_disk']:.2f}x, "
            f"{s['mem_block_vs_replicas0']:.2f}x | " + " / ".join(f"{c.get(m, 0) * 1e3:.0f}" for m in (
                "mem_block", "mem0_block", "disk_block", "none_block")) + " | "
            f"{s['sent_per_snapshot']:.0f} | {held_s} | {'/'.join(map(str, s['mem_tier_only_in_remote']))} | "
            f"{max(s['tier_vs_bound']):.2f} / {train[0]} | {train[1]} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2", help="comma-separated rank counts (2 on nodes a,b; 4 on a,a,b,b)")
    ap.add_argument("--mb", type=float, default=256, help="MB of state per rank in part 1")
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=6, help="part 1: rounds of the six modes")
    ap.add_argument("--durable-every", type=int, default=4)
    ap.add_argument("--every", type=int, default=2, help="part 2: a snapshot every this many steps")
    ap.add_argument("--seg", type=int, default=8, help="part 2: steps per segment")
    ap.add_argument("--train-rounds", type=int, default=8)
    ap.add_argument("--train-d", type=int, default=128)
    ap.add_argument("--train-layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rest", type=float, default=0.3)
    ap.add_argument("--parts", default="puts,train")
    ap.add_argument("--no-gc", dest="gc", action="store_false", help="skip the gc of the memory tiers after part 1")
    ap.add_argument("--limit", type=float, default=900)
    ap.add_argument("--dir", default=None, help="where the remote stores and disk tiers go (default: the temp dir)")
    ap.add_argument("--budget", type=float, default=None,
                    help="the memory tiers' local_budget, in multiples of the rank's share (default: none)")
    ap.add_argument("--no-stacks", dest="stacks", action="store_false",
                    help="leave out where each kind of warning was first logged")
    ap.add_argument("--packs", default="default,0",
                    help="open_store(pack_size=) of every store, one configuration each: 'default' (64 MiB with a "
                         "tier) or bytes (0: no packs)")
    ap.add_argument("--small", action="store_true", help="smoke run: 63 MB (d=256), 3 rounds, 3 training rounds")
    args = ap.parse_args()
    if args.small:
        args.mb, args.d, args.rounds, args.train_rounds, args.rest = 16, 256, 3, 3, 0.1
    log(f"# bench_memtier: {platform.node()} {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, loadavg {os.getloadavg()[0]:.1f}")
    log(f"# command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    try:
        commit = subprocess.run(["git", "-C", ROOT, "log", "-1", "--format=%h %ad", "--date=iso"],
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    log(f"# tensorstore_ck from {ROOT}, commit {commit or 'unknown'} (uncommitted edits not shown)")
    log(f"# args: {vars(args)}")
    summary = []
    t0 = time.perf_counter()
    for pk in args.packs.split(","):
        a = argparse.Namespace(**vars(args))
        a.pack_size = None if pk == "default" else int(pk)
        for w in [int(x) for x in args.worlds.split(",")]:
            t1 = time.perf_counter()
            packed = "default (64 MiB with a tier)" if a.pack_size is None else a.pack_size
            log(f"\n# ===== W = {w}, pack_size={packed}")
            summary.append({"pack_size": a.pack_size, **report(w, run_world(w, a), a)})
            log(f"\n({time.perf_counter() - t1:.0f} s)")
    log(f"\n# {time.perf_counter() - t0:.0f} s, loadavg at the end {os.getloadavg()[0]:.1f}")
    headline(summary, args)
    log("# summary " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
