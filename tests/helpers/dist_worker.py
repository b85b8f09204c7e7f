"""Multi-process torch.distributed scenarios for tests/collective/test_dist.py.

    python dist_worker.py SCENARIO OUTDIR [ARG]

SCENARIO is one of: sharded, replicated, kill (ARG: victim rank), stall, mismatch,
desync, notfound, exit (ARG: rounds), diverged (ARG: odd rank), tiling,
newstore (ARG: rounds), slowcommit, deadcommit, stopped, nonmember, cotarget,
gcphase (ARG: world), gcfail, unknown, pgunknown (env TSCK_DIST_PG_DSN), ddpnew,
samebytes, packrestart.
The store lives in OUTDIR/store. Every rank writes OUTDIR/<phase>_rank<r>.json
(observations: roots, timings, block keys read or written, errors) and, for
checkouts, OUTDIR/<phase>_rank<r>.pt with what it read; the launcher writes
OUTDIR/<phase>_launcher.json (exit codes, kill time). The test judges; this
script only observes, so the oracle (expected data, expected block sets) stays
in the test.

Ranks are forked (gloo on 127.0.0.1). The c10d TCPStore is hosted here, in the
launcher, so any rank, rank 0 included, may be killed without taking the
store down with it (see /work/shared/notes/servers.md, section 3).

The shared data definitions (tensor specs, deterministic contents, row
splits) are also imported by the test.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import datetime  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import zlib  # noqa: E402

# tests/ (appended: tests/helpers stays first) holds _util, whose launcher_main is this
# script's __main__ and that of the scripts that launch through it.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _pgserver import free_port  # noqa: E402
from _util import launcher_main  # noqa: E402,F401

import torch  # noqa: E402

BLOCK = 4096
INLINE = 256
REF = "j/m"

# FSDP-style row-sharded 2-D tensors of different sizes, dtypes and row widths:
# path -> (rows, cols, dtype). Rows of "proj" (6000 bytes) do not fit in a block,
# so its blocks are element-aligned rather than row-aligned; "proj" also leaves
# ranks 6 and 7 of an 8-rank checkout with an empty shard.
SHARDED = {
    ("model", "layers.0.w"): (203, 48, torch.float32),
    ("model", "layers.0.b"): (37, 130, torch.bfloat16),
    ("model", "embed"): (1000, 7, torch.int64),
    ("model", "proj"): (6, 1500, torch.float32),
    ("model", "moe.x"): (64, 1024, torch.float16),
    ("optim", "layers.0.w", "exp_avg"): (203, 48, torch.float32),
}
LOCAL_NUMEL = 3000  # the rank-local tensor: 12000 bytes -> 3 blocks


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def global_tensor(path: tuple, version: int = 0) -> torch.Tensor:
    rows, cols, dtype = SHARDED[path]
    g = _gen(zlib.crc32("/".join(path).encode()) + 7919 * version)
    if dtype.is_floating_point:
        return torch.randn(rows, cols, generator=g).to(dtype)
    return torch.randint(-(2 ** 40), 2 ** 40, (rows, cols), generator=g, dtype=dtype)


def row_split(n: int, world: int, r: int) -> tuple[int, int]:
    """Rows [a, b) of rank r when n rows are split over `world` ranks (torch.tensor_split)."""
    q, m = divmod(n, world)
    a = r * q + min(r, m)
    return a, a + q + (1 if r < m else 0)


def rank_local(r: int, version: int = 0) -> dict:
    return {"rank": r, "name": f"rank-{r}", "rng": torch.randn(LOCAL_NUMEL, generator=_gen(1000 + r + 100 * version))}


def _set(d: dict, path: tuple, v) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = v


def get_path(d, path: tuple):
    for k in path:
        d = d[k]
    return d


def sharded_state(r: int, world: int, version: int = 0) -> dict:
    import tensorstore_ck as tsck
    st: dict = {}
    for path, (rows, cols, _dt) in SHARDED.items():
        a, b = row_split(rows, world, r)
        _set(st, path, tsck.Sharded(global_tensor(path, version)[a:b].clone(), (rows, cols), (a, 0)))
    st["local"] = rank_local(r, version)
    st["step"] = 100 + version
    return st


def replicated_tensors() -> dict:
    # emb: 256-byte rows -> 16 rows per block, 32 blocks (the last one shorter);
    # head: 20000-byte rows -> element-aligned 4096-byte blocks, 15 of them.
    return {"emb": torch.randn(500, 64, generator=_gen(5)),
            "head": torch.randn(3, 10000, generator=_gen(6)).to(torch.bfloat16)}


# -- storage wrappers (instrumentation only: they forward every call) -----------

def _wrapped_base():
    from tensorstore_ck.storage.wrappers import WrappedStore
    return WrappedStore


def counting_store_class():
    WrappedStore = _wrapped_base()

    class Counting(WrappedStore):
        """Records every blocks/ key this process reads, checks or writes."""

        def __init__(self, inner):
            super().__init__(inner)
            self.lock = threading.Lock()
            self.reset()

        def reset(self):
            with self.lock:
                self.reads, self.exists_calls, self.puts = [], [], []

        def open_read(self, key, max_bytes=None):
            if key.startswith("blocks/"):
                with self.lock:
                    self.reads.append(key)
            return self.inner.open_read(key, max_bytes)

        def get(self, key, max_bytes=None):
            if key.startswith("blocks/"):
                with self.lock:
                    self.reads.append(key)
            return self.inner.get(key, max_bytes)

        def exists(self, key):
            if key.startswith("blocks/"):
                with self.lock:
                    self.exists_calls.append(key)
            return self.inner.exists(key)

        def size_of(self, key):  # a put's existence check (it also reads the size)
            if key.startswith("blocks/"):
                with self.lock:
                    self.exists_calls.append(key)
            return self.inner.size_of(key)

        def put_if_absent(self, key, bufs):
            created = self.inner.put_if_absent(key, bufs)
            if key.startswith("blocks/"):
                with self.lock:
                    self.puts.append([key, bool(created)])
            return created

    return Counting


def trap_store_class():
    WrappedStore = _wrapped_base()

    class Trap(WrappedStore):
        """When armed, the first block write announces itself (a marker file) and then
        sleeps `stall` seconds: the rank is stuck in the middle of its snapshot writes
        (the launcher SIGKILLs it there, or it wakes up late)."""

        def __init__(self, inner, marker: str, stall: float):
            super().__init__(inner)
            self.marker, self.stall = marker, stall
            self.armed = False
            self.lock = threading.Lock()

        def put_if_absent(self, key, bufs):
            fire = False
            if key.startswith("blocks/"):
                with self.lock:
                    fire, self.armed = self.armed, False
            if fire:
                with open(self.marker, "w") as f:
                    f.write(str(time.time()))
                time.sleep(self.stall)
            return self.inner.put_if_absent(key, bufs)

    return Trap


# -- launcher ---------------------------------------------------------------------


def _dump(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def _rank_main(rank, world, port, phase, body, out, arg):
    res = {"rank": rank, "world": world, "phase": phase, "pid": os.getpid()}
    code = 1
    try:
        import torch.distributed as dist
        torch.set_num_threads(1)
        kv = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=kv, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=30))
        body(rank, world, out, res, arg)
        res["ok"] = True
        code = 0
    except BaseException:  # noqa: BLE001 - reported to the test
        res["ok"] = False
        res["error"] = traceback.format_exc()
    _dump(os.path.join(out, f"{phase}_rank{rank}.json"), res)
    # No teardown: after a peer was killed, gloo/c10d destructors may block on it.
    _exit_now(code)


def _exit_now(code: int) -> None:
    """The rank's end: its streams flushed, then os._exit (no interpreter teardown)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _env_rank_main(rank, world, port, phase, body, out, arg):
    """A rank as a training script starts it: init_process_group from MASTER_ADDR/PORT
    (env://), so rank 0 hosts the c10d TCPStore; the body's collective is the last thing
    the script does: destroy_process_group() and exit at once."""
    res = {"rank": rank, "world": world, "phase": phase, "pid": os.getpid()}
    code = 1
    try:
        import torch.distributed as dist
        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=30))
        try:
            body(rank, world, out, res, arg)
            res["ok"] = True
            code = 0
        finally:
            _dump(os.path.join(out, f"{phase}_rank{rank}.json"), res)
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the test
        if "ok" not in res:
            res["ok"] = False
            res["error"] = traceback.format_exc()
            _dump(os.path.join(out, f"{phase}_rank{rank}.json"), res)
    _exit_now(code)


def launch_env(phase, world, body, out, arg=None, *, limit=60.0) -> dict:
    """Fork `world` ranks that rendezvous through env:// (rank 0 hosts the store)."""
    port = free_port()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_env_rank_main, args=(r, world, port, phase, body, out, arg)) for r in range(world)]
    for p in procs:
        p.start()
    info = {"phase": phase, "world": world, "pids": [p.pid for p in procs]}
    reap(procs, info, time.monotonic() + limit)
    _dump(os.path.join(out, f"{phase}_launcher.json"), info)
    return info


def reap(procs, info: dict, deadline: float) -> None:
    """Join the ranks until the deadline, SIGKILL those still running; info gets
    "timed_out" (their ranks) and "exitcodes"."""
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    info["timed_out"] = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join()
    info["exitcodes"] = [p.exitcode for p in procs]


def launch(phase, world, body, out, arg=None, *, kill_rank=None, kill_job=False, limit=60.0) -> dict:
    """Fork `world` ranks running body(rank, world, out, res, arg) with the c10d
    store hosted here. kill_rank: SIGKILL that rank as soon as its trap fires (kill_job:
    every rank then, as torchrun takes a job down)."""
    from torch.distributed import TCPStore
    port = free_port()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, phase, body, out, arg)) for r in range(world)]
    for p in procs:
        p.start()
    # Created after the fork (no server thread is copied into the ranks); clients retry until it is up.
    master = TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=60),
                      wait_for_workers=False)
    info = {"phase": phase, "world": world, "pids": [p.pid for p in procs]}
    deadline = time.monotonic() + limit
    if kill_rank is not None:
        marker = os.path.join(out, f"trap_rank{kill_rank}")
        while not os.path.exists(marker) and time.monotonic() < deadline and procs[kill_rank].is_alive():
            time.sleep(0.005)
        if os.path.exists(marker):
            for p in (procs if kill_job else [procs[kill_rank]]):
                os.kill(p.pid, signal.SIGKILL)
            info["killed"] = kill_rank
            info["kill_time"] = time.time()
    reap(procs, info, deadline)
    _dump(os.path.join(out, f"{phase}_launcher.json"), info)
    del master
    return info


# -- rank bodies --------------------------------------------------------------------

def _open(out, **kw):
    import tensorstore_ck as tsck
    return tsck.open_store(os.path.join(out, "store"), block_size=BLOCK, inline_threshold=INLINE, **kw)


def sharded_save(rank, world, out, res, _arg):
    with _open(out) as store:
        info = store.put_snapshot(sharded_state(rank, world), REF, step=100, timeout=60)
        res["root"] = info.root


def sharded_load(rank, world, out, res, _arg):
    import tensorstore_ck as tsck
    holder = {}
    Counting = counting_store_class()
    with _open(out, wrap_storage=lambda s: holder.setdefault("w", Counting(s))) as store:
        into: dict = {}
        for path, (rows, cols, dtype) in SHARDED.items():
            a, b = row_split(rows, world, rank)
            _set(into, path, tsck.Sharded(torch.zeros(b - a, cols, dtype=dtype), (rows, cols), (a, 0)))
        into["local"] = into["step"] = None  # into= names what is read: these are replaced
        holder["w"].reset()
        t0 = time.monotonic()
        got = store.checkout(REF, into=into, timeout=30)
        res["elapsed"] = time.monotonic() - t0
        res["reads"] = list(holder["w"].reads)
        res["same_object"] = got is into
        res["types"] = {"/".join(p): type(get_path(got, p)).__name__ for p in SHARDED}
        dump = {"sharded": {"/".join(p): get_path(got, p).local for p in SHARDED},
                "local": got["local"], "step": got["step"]}
        if world == 2 and rank == 1:
            # Non-collective read while the process group is up: must not wait for anyone
            # (a collective one would wait for rank 0 and abort after 5 s).
            t0 = time.monotonic()
            full = store.checkout(REF, group=False, timeout=5)
            res["full_elapsed"] = time.monotonic() - t0
            res["full_types"] = {"/".join(p): type(get_path(full, p)).__name__ for p in SHARDED}
            dump["full"] = {"/".join(p): get_path(full, p) for p in SHARDED}
            dump["full_local"] = full["local"]
        torch.save(dump, os.path.join(out, f"load{world}_rank{rank}.pt"))


def index_load(rank, world, out, res, _arg):
    """Each rank checks out its own pieces of the sharded tensors (into= Sharded) and records
    how many manifest nodes it read."""
    import tensorstore_ck as tsck
    from _util import Watched

    class NodeCounting(Watched):
        def __init__(self, inner):
            super().__init__(inner)
            self.nodes = 0

        def on_read(self, key):
            if key.startswith("nodes/"):
                self.nodes += 1

    holder = {}
    with _open(out, wrap_storage=lambda s: holder.setdefault("w", NodeCounting(s))) as store:
        into: dict = {}
        for path, (rows, cols, dtype) in SHARDED.items():
            a, b = row_split(rows, world, rank)
            _set(into, path, tsck.Sharded(torch.zeros(b - a, cols, dtype=dtype), (rows, cols), (a, 0)))
        holder["w"].nodes = 0
        got = store.checkout(REF, into=into, timeout=60)
        res["nodes"] = holder["w"].nodes
        res["mismatches"] = [
            "/".join(p) for p, (rows, _c, _d) in SHARDED.items()
            if not torch.equal(get_path(got, p).local, global_tensor(p)[slice(*row_split(rows, world, rank))])]


def replicated(rank, world, out, res, _arg):
    import torch.distributed as dist
    import tensorstore_ck as tsck
    holder = {}
    Counting = counting_store_class()
    with _open(out, wrap_storage=lambda s: holder.setdefault("w", Counting(s))) as store:
        reps = replicated_tensors()
        st = {"emb": tsck.Replicated(reps["emb"]), "head": tsck.Replicated(reps["head"]), "rank": rank}
        holder["w"].reset()
        info = store.put_snapshot(st, REF, step=7, timeout=60)
        res["root"] = info.root
        res["blocks_new"], res["blocks_total"] = info.blocks_new, info.blocks_total
        res["puts"] = list(holder["w"].puts)
        res["exists"] = list(holder["w"].exists_calls)
        dist.barrier()
        got = store.checkout(REF, timeout=30)
        res["rank_view"] = got["rank"]
        torch.save({"emb": got["emb"], "head": got["head"]}, os.path.join(out, f"rep_rank{rank}.pt"))


def ddp_state(version: int) -> dict:
    """What every DDP rank holds (the same replicated model, plain tensors): two Linear
    layers and a bigger tensor. The weights are cut into blocks; the biases (at most
    INLINE bytes) are inlined in the manifest node. Versions differ in "1.bias" only."""
    g = torch.Generator().manual_seed(5)
    state = {"0.weight": torch.randn(64, 64, generator=g), "0.bias": torch.randn(64, generator=g),
             "1.weight": torch.randn(8, 64, generator=g), "1.bias": torch.randn(8, generator=g),
             "big": torch.randn(20 * BLOCK // 4, generator=g)}
    state["1.bias"] += version
    return state


def ddp_new(rank, world, out, res, _arg):
    """Every rank puts the same plain state (DDP), three times: a first snapshot, the same
    again, then one whose only change is an inlined tensor. Records each SnapshotInfo."""
    import torch.distributed as dist
    with _open(out) as store:
        res["infos"] = []
        for step, version in ((1, 0), (2, 0), (3, 1)):
            info = store.put_snapshot(ddp_state(version), REF, step=step, timeout=60)
            res["infos"].append(info.to_json())
            dist.barrier()


def same_bytes_state(rank: int, world: int, version: int) -> dict:
    """A state whose ranks hold some of the same bytes: "zeros", a sharded piece equal on
    every rank (its global tensor is one value); "mine", a sharded piece of its own; "emb",
    a Replicated tensor; "w", a plain tensor equal on every rank (DDP's weights); and the
    rank. Each piece is one block (BLOCK bytes), "emb" four, "w" two; every value changes
    with `version`."""
    import tensorstore_ck as tsck
    g = torch.Generator().manual_seed(1000 * version + rank)
    same = torch.Generator().manual_seed(1000 * version + 999)
    rows, cols = 4, BLOCK // 16
    return {"zeros": tsck.Sharded(torch.full((rows, cols), float(version)), (rows * world, cols), (rows * rank, 0)),
            "mine": tsck.Sharded(torch.randn(rows, cols, generator=g), (rows * world, cols), (rows * rank, 0)),
            "emb": tsck.Replicated(torch.randn(4 * rows, cols, generator=same)),
            "w": torch.randn(2 * rows, cols, generator=same), "rank": rank}


def same_bytes(rank, world, out, res, _arg):
    """Every rank puts same_bytes_state: version 0, version 1 (every value changed), version
    1 again. Records each SnapshotInfo and (rank 0, once every rank returned) the block
    files in the store with their sizes."""
    import torch.distributed as dist
    blocks = os.path.join(out, "store", "blocks")
    with _open(out) as store:
        res["infos"], res["blocks"] = [], []
        for step, version in ((1, 0), (2, 1), (3, 1)):
            info = store.put_snapshot(same_bytes_state(rank, world, version), REF, step=step, timeout=60)
            res["infos"].append(info.to_json())
            dist.barrier()
            if rank == 0:
                res["blocks"].append({f: os.path.getsize(os.path.join(blocks, d, f))
                                      for d in os.listdir(blocks) for f in os.listdir(os.path.join(blocks, d))})
            dist.barrier()


PACK = 64 * 1024  # pack_size of the packrestart scenario: each rank's small pieces in one pack


def pack_state(rank: int, world: int, edited: bool) -> dict:
    """16 small sharded pieces per rank (512 B each: all packed), piece 0 of each rank
    edited in the second state."""
    import tensorstore_ck as tsck
    out = {}
    for i in range(16):
        g = torch.Generator().manual_seed(100 * i + rank + (10_000 if edited and i == 0 else 0))
        out[f"p{i}"] = tsck.Sharded(torch.randn(1, 128, generator=g), (world, 128), (rank, 0))
    return out


def pack_put(rank, world, out, res, edited):
    """One collective put of pack_state (a launch of its own: a restarted job's first put
    is its second); its SnapshotInfo recorded."""
    with _open(out, pack_size=PACK) as store:
        res["info"] = store.put_snapshot(pack_state(rank, world, bool(edited)), REF, step=1 + edited,
                                         timeout=60).to_json()


def _failure_common(rank, world, out, res, victim, stall, aborting_put):
    """First snapshot (step 1) succeeds; then a second one (step 2) during which `victim`
    is trapped in its block writes for `stall` seconds (killed there by the launcher
    when stall is long)."""
    import torch.distributed as dist
    import tensorstore_ck as tsck
    Trap = trap_store_class()
    holder = {}
    wrap = (lambda s: holder.setdefault("t", Trap(s, os.path.join(out, f"trap_rank{rank}"), stall))) \
        if rank == victim else None
    store = _open(out, wrap_storage=wrap)
    res["root1"] = store.put_snapshot(sharded_state(rank, world, 0), REF, step=1, timeout=60).root
    dist.barrier()
    if rank == victim:
        holder["t"].armed = True
    res["t_start"] = time.time()
    t0 = time.monotonic()
    try:
        aborting_put(store, rank)
        res["second"] = "returned"
    except tsck.SnapshotAborted as e:
        res["second"] = "aborted"
        res["message"] = str(e)
    except Exception as e:  # noqa: BLE001
        res["second"] = f"{type(e).__name__}: {e}"
    res["elapsed"] = time.monotonic() - t0
    res["t_end"] = time.time()
    return store


def kill_case(rank, world, out, res, victim):
    import torch.distributed as dist
    T = 4.0
    res["timeout"] = T

    def put2(store, r):
        store.put_snapshot(sharded_state(r, world, 1), REF, step=2, timeout=T)

    store = _failure_common(rank, world, out, res, victim, 120.0, put2)
    survivors = [r for r in range(world) if r != victim]
    t0 = time.monotonic()
    g2 = dist.new_group(ranks=survivors, use_local_synchronization=True, timeout=datetime.timedelta(seconds=15))
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x, group=g2)
    res["allreduce"] = x.item()
    res["regroup_elapsed"] = time.monotonic() - t0
    # The store is still usable collectively by the survivors (another ref).
    info = store.put_snapshot({"x": torch.full((5000,), float(rank)), "rank": rank}, "j/after", step=3,
                              group=g2, timeout=30)
    res["root3"] = info.root
    store.close()


def stall_case(rank, world, out, res, victim):
    import torch.distributed as dist
    T = 3.0
    stall = T + 3.0
    res["timeout"], res["stall"] = T, stall

    def put2(store, r):
        store.put_snapshot(sharded_state(r, world, 1), REF, step=2, timeout=T)

    store = _failure_common(rank, world, out, res, victim, stall, put2)
    t0 = time.monotonic()
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)  # the whole group, the late rank included
    res["allreduce"] = x.item()
    res["allreduce_elapsed"] = time.monotonic() - t0
    info = store.put_snapshot(sharded_state(rank, world, 2), REF, step=3, timeout=30)
    res["root3"] = info.root
    store.close()


def mismatch_case(rank, world, out, res, odd):
    import torch.distributed as dist

    def put2(store, r):
        store.put_snapshot(sharded_state(r, world, 1), REF, step=6 if r == odd else 5, timeout=30)

    store = _failure_common(rank, world, out, res, -1, 0.0, put2)
    t0 = time.monotonic()
    # The same put on every rank again: the call names realign (the odd rank's step-6 call,
    # which nobody else made, ends as rank 0 goes past it).
    res["root3"] = store.put_snapshot(sharded_state(rank, world, 2), REF, step=7, timeout=30).root
    res["third_elapsed"] = time.monotonic() - t0
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    res["allreduce"] = x.item()
    store.close()


def skip_case(rank, world, out, res, odd):
    """Rank `odd` skips the put of step 2 (and makes no call in its place), asynchronous
    or blocking: the others' step 2 fails as OutOfStep, at once; step 3 is published with
    every rank's own step-3 state; later calls and a checkout are aligned."""
    import torch.distributed as dist
    import tensorstore_ck as tsck
    blocking = os.environ.get("TSCK_SKIP_MODE", "blocking") == "blocking"
    with _open(out) as store:
        try:  # no step: nothing names the call, so it is refused on every rank, before anything
            store.put_snapshot(small_state(rank, world, 0), REF, timeout=30, blocking=blocking)
            res["no_step"] = "returned"
        except tsck.TsckError as e:
            res["no_step"] = f"{type(e).__name__}: {e}"
        outcomes = {}
        for v in (1, 2, 3, 4):
            if v == 2 and rank == odd:
                continue
            t0 = time.monotonic()
            try:
                got = store.put_snapshot(small_state(rank, world, v), REF, step=v, timeout=30, blocking=blocking)
                info = got if blocking else got.result()
                outcomes[v] = ["ok", info.root, time.monotonic() - t0]
            except tsck.SnapshotAborted as e:
                outcomes[v] = [type(e).__name__, str(e), time.monotonic() - t0]
        res["outcomes"] = outcomes
        res["checkout_v"] = store.checkout(REF)["v"]  # (collective: each rank its own view of step 4)
        dist.barrier()


def swap_case(rank, world, out, res, odd):
    """Rank `odd` makes a checkout where the others make the put of step 2: both calls end
    (as OutOfStep, at their timeout); then the put of step 3 and a checkout, which every
    rank makes alike, succeed (with calls named by a count, each later call of either
    kind failed)."""
    import tensorstore_ck as tsck
    T = 4.0
    with _open(out) as store:
        res["put1"] = store.put_snapshot(small_state(rank, world, 1), REF, step=1, timeout=30).root
        try:
            if rank == odd:
                store.checkout(REF, timeout=T)
            else:
                store.put_snapshot(small_state(rank, world, 2), REF, step=2, timeout=T)
            res["second"] = "returned"
        except tsck.SnapshotAborted as e:
            res["second"] = f"{type(e).__name__}: {e}"
        res["put3"] = store.put_snapshot(small_state(rank, world, 3), REF, step=3, timeout=30).root
        res["checkout_v"] = store.checkout(REF, timeout=30)["v"]


def desync_case(rank, world, out, res, odd):
    """Rank `odd` makes a put that fails its own argument checks; then every rank makes
    the same valid put, which must succeed."""
    import torch.distributed as dist
    with _open(out) as store:
        st = {"x": torch.full((3000,), float(rank)), "rank": rank}
        res["root1"] = store.put_snapshot(st, REF, step=1, timeout=30).root
        try:
            store.put_snapshot(st, REF, step=2, metrics={"loss": "nan" if rank == odd else 1.0}, timeout=2)
            res["second"] = "returned"
        except Exception as e:  # noqa: BLE001
            res["second"] = type(e).__name__
        dist.barrier()
        t0 = time.monotonic()
        try:
            res["root3"] = store.put_snapshot(st, REF, step=3, timeout=2).root
            res["third"] = "returned"
        except Exception as e:  # noqa: BLE001
            res["third"] = f"{type(e).__name__}: {e}"
        res["third_elapsed"] = time.monotonic() - t0


def notfound_case(rank, world, out, res, _arg):
    """A collective checkout of a ref that does not exist (a fresh job's resume)."""
    import tensorstore_ck as tsck
    with _open(out) as store:
        try:
            store.checkout("no/such", timeout=10)
            res["checkout"] = "returned"
        except tsck.RefNotFound:
            res["checkout"] = "RefNotFound"
        except Exception as e:  # noqa: BLE001
            res["checkout"] = f"{type(e).__name__}: {e}"


def exit_put(rank, world, out, res, step):
    """put_snapshot as the last thing of a training script (then destroy + exit; the
    store is not even closed, as a script that just ends does not close it)."""
    store = _open(out)
    st = sharded_state(rank, world, step)
    # Rank 0 has the most to write (as the rank holding extra state often does), so the
    # others have been waiting a while, polling at their slowest, when it publishes.
    st["local"]["extra"] = torch.randn((4 << 20) if rank == 0 else 1, generator=_gen(rank))
    info = store.put_snapshot(st, REF, step=step, timeout=30)
    res["root"] = info.root


def exit_checkout(rank, world, out, res, _arg):
    """checkout as the last collective of a script (then destroy + exit), of the small
    snapshot exit_setup took: rank 0 has little to read and is gone fast."""
    store = _open(out)
    got = store.checkout("j/small", timeout=30)
    res["step"] = got["step"]
    res["local_rank"] = got["local"]["rank"]


def exit_setup(rank, world, out, res, _arg):
    with _open(out) as store:
        res["root"] = store.put_snapshot(sharded_state(rank, world), "j/small", step=100, timeout=30).root


def _try_put(store, res, key, st, step):
    import tensorstore_ck as tsck
    try:
        res[key] = "returned"
        res[key + "_root"] = store.put_snapshot(st, REF, step=step, timeout=30).root
    except tsck.TsckError as e:
        res[key], res[key + "_message"] = type(e).__name__, str(e)


def diverged_case(rank, world, out, res, odd):
    """Rank `odd`'s replica of "emb" differs in one element (a non-deterministic kernel,
    silent DDP divergence); then the ranks agree again."""
    import tensorstore_ck as tsck
    with _open(out) as store:
        reps = replicated_tensors()
        emb = reps["emb"].clone()
        if rank == odd:
            emb[321, 5] += 1.0  # block 20 of 32: owned by some rank, not necessarily `odd`
        st = {"emb": tsck.Replicated(emb), "head": tsck.Replicated(reps["head"]), "rank": rank}
        _try_put(store, res, "first", st, 7)
        st["emb"] = tsck.Replicated(reps["emb"])
        _try_put(store, res, "second", st, 8)


TILE_ROWS, TILE_COLS = 4096, 8


def tile_global() -> torch.Tensor:
    return torch.randn(TILE_ROWS, TILE_COLS, generator=_gen(11))


def tiling_case(rank, world, out, res, _arg):
    """2 ranks: rows [0, 3072) on rank 0 and rows [0, 1024) on rank 1, whose offset should
    have been 3072 (the sizes add up to the global tensor); then the right offsets."""
    import tensorstore_ck as tsck
    g = tile_global()
    a, b = (0, 3072) if rank == 0 else (3072, 4096)
    with _open(out) as store:
        bad = tsck.Sharded(g[a:b].clone(), (TILE_ROWS, TILE_COLS), (0 if rank == 1 else a, 0))
        _try_put(store, res, "first", {"w": bad, "rank": rank}, 1)
        good = tsck.Sharded(g[a:b].clone(), (TILE_ROWS, TILE_COLS), (a, 0))
        _try_put(store, res, "second", {"w": good, "rank": rank}, 2)


# -- the collective protocol's outcomes: naming, liveness, late ranks, members, targets -----

def small_global(version: int) -> torch.Tensor:
    return torch.randn(64, 32, generator=_gen(500 + version))


def small_state(rank: int, world: int, version: int) -> dict:
    """Rank `rank`'s rows of a small row-sharded tensor (contents differ per version)."""
    import tensorstore_ck as tsck
    a, b = row_split(64, world, rank)
    return {"w": tsck.Sharded(small_global(version)[a:b].clone(), (64, 32), (a, 0)), "rank": rank, "v": version}


def _outcome(res, key, fn):
    """Run fn (a put: -> SnapshotInfo, or anything else): record "returned" and the root, or the error."""
    t0 = time.monotonic()
    try:
        got = fn()
        res[key] = "returned"
        if hasattr(got, "root"):
            res[key + "_root"] = got.root
    except Exception as e:  # noqa: BLE001 - recorded for the test
        res[key], res[key + "_message"] = type(e).__name__, str(e)
    res[key + "_elapsed"] = time.monotonic() - t0


def newstore_case(rank, world, out, res, rounds):
    """Collective puts through Store objects opened per call, and through two stores held
    open side by side (a fast one and a durable one): every call is one snapshot."""
    import torch.distributed as dist
    import tensorstore_ck as tsck
    kv = dist.distributed_c10d._get_default_store()
    two = [tsck.open_store(os.path.join(out, name), block_size=BLOCK, inline_threshold=INLINE)
           for name in ("fast", "durable")]
    for v in range(1, rounds + 1):
        with tsck.open_store(os.path.join(out, "percall"), block_size=BLOCK, inline_threshold=INLINE) as s:
            _outcome(res, f"percall{v}", lambda: s.put_snapshot(small_state(rank, world, v), REF, step=v, timeout=30))
        for name, s in zip(("fast", "durable"), two):
            _outcome(res, f"{name}{v}", lambda: s.put_snapshot(small_state(rank, world, v), REF, step=v, timeout=30))
        dist.barrier()
        res.setdefault("keys", []).append(kv.num_keys())  # the c10d Store must not grow with every call
    for s in two:
        s.close()


def slow_store_class():
    WrappedStore = _wrapped_base()

    class Slow(WrappedStore):
        """When armed, writing a commit object takes `delay` seconds (a slow object store);
        `then` (if set) runs first."""

        def __init__(self, inner, delay: float):
            super().__init__(inner)
            self.delay, self.armed, self.then = delay, False, None

        def put_if_absent(self, key, bufs):
            if self.armed and key.startswith("commits/"):
                self.armed = False
                if self.then is not None:
                    self.then()
                time.sleep(self.delay)
            return self.inner.put_if_absent(key, bufs)

    return Slow


def slowcommit_case(rank, world, out, res, _arg):
    """timeout=T; rank 0's commit object write takes 3T: it is slow, not dead, and
    publishes; every rank must say so. (T = 4 s, not less: rank 0 must claim the commit
    before rank 1's deadline, on a loaded machine too.)"""
    import torch.distributed as dist
    Slow = slow_store_class()
    holder = {}
    T = 4.0
    res["timeout"] = T
    wrap = (lambda s: holder.setdefault("w", Slow(s, 3 * T))) if rank == 0 else None
    with _open(out, wrap_storage=wrap) as store:
        _outcome(res, "first", lambda: store.put_snapshot(small_state(rank, world, 1), REF, step=1, timeout=30))
        dist.barrier()
        if rank == 0:
            holder["w"].armed = True
        _outcome(res, "second", lambda: store.put_snapshot(small_state(rank, world, 2), REF, step=2, timeout=T))


def stopped_case(rank, world, out, res, _arg):
    """Rank 1 is SIGSTOPped (by rank 0, as it writes the commit object of put 1, so rank 1
    has posted done) across put 1's publication and put 2 (aborted: rank 1 is missing);
    rank 0 resumes it once it has started put 3. Rank 1 must learn that put 1 was published,
    that put 2 was aborted, and then take part in put 3."""
    import torch.distributed as dist
    kv = dist.distributed_c10d._get_default_store()
    Slow = slow_store_class()
    holder = {}
    T = 5.0  # put 1 must reach rank 0's commit within it, on a loaded machine too
    kv.set(f"test/pid/{rank}", str(os.getpid()))
    wrap = (lambda s: holder.setdefault("w", Slow(s, 0.0))) if rank == 0 else None
    with _open(out, wrap_storage=wrap) as store:
        dist.barrier()
        if rank == 0:
            victim = int(kv.get("test/pid/1"))
            holder["w"].then = lambda: os.kill(victim, signal.SIGSTOP)
            holder["w"].armed = True
        _outcome(res, "put1", lambda: store.put_snapshot(small_state(rank, world, 1), REF, step=1, timeout=T))
        _outcome(res, "put2", lambda: store.put_snapshot(small_state(rank, world, 2), REF, step=2, timeout=T))
        resumer, calling = None, threading.Event()
        if rank == 0:
            def resume():
                # once put 3 has begun: rank 0's hello (after the call tidied the Store)
                # changes the key count
                try:
                    calling.wait()
                    base, deadline = kv.num_keys(), time.monotonic() + 10.0
                    while kv.num_keys() == base and time.monotonic() < deadline:
                        time.sleep(0.01)
                    time.sleep(0.5)
                except Exception as e:  # noqa: BLE001 - recorded; rank 1 is resumed anyway
                    res["resume_error"] = repr(e)
                os.kill(victim, signal.SIGCONT)
            resumer = threading.Thread(target=resume, daemon=True)
            resumer.start()
        try:
            calling.set()
            _outcome(res, "put3", lambda: store.put_snapshot(small_state(rank, world, 3), REF, step=3, timeout=60))
        finally:
            if resumer is not None:
                # rank 1 is resumed whatever put 3 did here: left stopped, it would hide
                # rank 0's outcome behind a launcher timeout
                resumer.join()
                os.kill(victim, signal.SIGCONT)


def deadcommit_case(rank, world, out, res, _arg):
    """Rank 0 dies (SIGKILL, by itself) as it writes the commit object of put 2, after its
    commit claim: its heartbeat stops, and rank 1 must give up (SnapshotAborted, the ref
    did not move), not wait for ever."""
    import torch.distributed as dist
    Slow = slow_store_class()
    holder = {}
    T = 3.0
    res["timeout"] = T
    wrap = (lambda s: holder.setdefault("w", Slow(s, 0.0))) if rank == 0 else None
    with _open(out, wrap_storage=wrap) as store:
        _outcome(res, "first", lambda: store.put_snapshot(small_state(rank, world, 1), REF, step=1, timeout=30))
        dist.barrier()
        if rank == 0:
            holder["w"].then = lambda: os.kill(os.getpid(), signal.SIGKILL)
            holder["w"].armed = True
        _outcome(res, "second", lambda: store.put_snapshot(small_state(rank, world, 2), REF, step=2, timeout=T))


def nonmember_case(rank, world, out, res, _arg):
    """group= holds ranks 0 and 1; rank 2 passes it too."""
    import torch.distributed as dist
    g = dist.new_group([0, 1])
    with _open(out) as store:
        st = {"x": torch.full((3000,), float(rank)), "rank": rank}
        _outcome(res, "put", lambda: store.put_snapshot(st, REF, step=1, group=g, timeout=30))
        _outcome(res, "checkout", lambda: store.checkout(REF, group=g, timeout=30))
        if "checkout" in res and res["checkout"] == "returned":
            res["checkout_rank"] = store.checkout(REF, group=False)["rank"]


def cotarget_case(rank, world, out, res, _arg):
    """Two snapshots; then collective checkouts: rank 1 asks for step 1's root while rank 0
    asks for the head (refused on every rank); then the head spelled two ways (the ref, its
    root) is one snapshot; then the same target on every rank."""
    with _open(out) as store:
        roots = [store.put_snapshot(small_state(rank, world, v), REF, step=v, timeout=30).root for v in (1, 2)]
        res["roots"] = roots

        def co(target):
            got = store.checkout(target, timeout=30)
            res.setdefault("got_v", []).append(got["v"])
        _outcome(res, "differ", lambda: co(REF if rank == 0 else roots[0]))
        _outcome(res, "spelled", lambda: co(REF if rank == 0 else roots[1]))
        _outcome(res, "same", lambda: co(roots[0]))


# -- a gc or prune deletion phase overlapping a collective put; a move whose answer is lost ---

GC_CODE = """
import json, sys
import tensorstore_ck as tsck
with tsck.open_store(sys.argv[1]) as s:
    r = s.gc(grace=0) if sys.argv[2] == "gc" else s.prune(sys.argv[2])
print(json.dumps({"deleted": r.deleted_by_kind, "expired": len(r.expired)}))
"""


def _deletion_phase(out, what: str) -> dict:
    """A whole gc (grace 0: every object no snapshot references yet goes) or prune of job
    `what`, in another process, to its end -> what it deleted and expired."""
    import subprocess
    p = subprocess.run([sys.executable, "-c", GC_CODE, os.path.join(out, "store"), what], capture_output=True,
                       text=True, timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed: {p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def _create_first(rank, out) -> None:
    """Rank 0 creates the store before the others open it: ranks that create a new store
    all at once can leave its ref table marked as found empty (then gc refuses to run)."""
    import torch.distributed as dist
    if rank == 0:
        _open(out).close()
    dist.barrier()


def gcphase_case(rank, world, out, res, _arg):
    """Put 1 (version 0); put 2 (version 1), during which a gc with grace 0 runs in another
    process as rank 0 writes the commit object (after every rank posted done): it deletes
    every block and node of put 2, and its deletion phase fences the ref move. Then with
    keep_last=1 on the job, put 3 (version 0 again: it reuses put 1's blocks and nodes),
    during which a prune of the job expires put 1 and deletes those. Both puts must
    publish on every rank, re-uploading what was deleted."""
    import torch.distributed as dist
    import tensorstore_ck as tsck
    Slow = slow_store_class()
    holder = {}
    wrap = (lambda s: holder.setdefault("w", Slow(s, 0.0))) if rank == 0 else None
    _create_first(rank, out)
    with _open(out, wrap_storage=wrap) as store:
        _outcome(res, "put1", lambda: store.put_snapshot(sharded_state(rank, world, 0), REF, step=1, timeout=60))
        for key, step, version, what in (("put2", 2, 1, "gc"), ("put3", 3, 0, "j")):
            dist.barrier()
            if rank == 0:
                if what != "gc":
                    store.set_retention("j", tsck.Retention(keep_last=1))
                holder["w"].then = lambda what=what, key=key: res.update({key + "_phase": _deletion_phase(out, what)})
                holder["w"].armed = True
            _outcome(res, key, lambda: store.put_snapshot(sharded_state(rank, world, version), REF, step=step,
                                                          timeout=60))


def gcfail_case(rank, world, out, res, _arg):
    """As put 2 of gcphase (a gc deleting every block and node of the put before the ref
    moves), but rank 1's storage refuses block writes from then on (a file `fail` marks
    it): rank 1 cannot re-upload its part, so the snapshot must abort on every rank and
    the ref stay where it was. Then, storage healthy again, put 3 publishes."""
    import torch.distributed as dist
    import tensorstore_ck as tsck
    WrappedStore = _wrapped_base()
    flag = os.path.join(out, "fail")

    class Failing(WrappedStore):
        def put_if_absent(self, key, bufs):
            if key.startswith("blocks/") and os.path.exists(flag):
                raise tsck.StorageError(f"{key}: no space left on device")
            return self.inner.put_if_absent(key, bufs)

    def after_gc():
        res["put2_phase"] = _deletion_phase(out, "gc")
        open(flag, "w").close()

    Slow = slow_store_class()
    holder = {}
    wrap = {0: lambda s: holder.setdefault("w", Slow(s, 0.0)), 1: Failing}.get(rank)
    _create_first(rank, out)
    with _open(out, wrap_storage=wrap) as store:
        _outcome(res, "put1", lambda: store.put_snapshot(sharded_state(rank, world, 0), REF, step=1, timeout=60))
        dist.barrier()
        if rank == 0:
            holder["w"].then = after_gc
            holder["w"].armed = True
        _outcome(res, "put2", lambda: store.put_snapshot(sharded_state(rank, world, 1), REF, step=2, timeout=60))
        dist.barrier()
        if rank == 0:
            os.unlink(flag)
        dist.barrier()
        _outcome(res, "put3", lambda: store.put_snapshot(sharded_state(rank, world, 2), REF, step=3, timeout=60))


class _LostAnswer:
    """Rank 0's ref table as seen across a network that failed at the ref move: the move
    (its COMMIT) went out and no answer came back (OutcomeUnknown), and the table cannot
    be asked afterwards. Every other call goes to the real table."""

    def __init__(self, inner):
        self.inner, self.armed, self.lost = inner, False, False

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def compare_and_swap(self, *a, **kw):
        if self.armed:
            import tensorstore_ck as tsck
            self.lost = True
            raise tsck.OutcomeUnknown("the ref table's answer to the COMMIT was lost")
        return self.inner.compare_and_swap(*a, **kw)

    def get_or_none(self, ref):
        if self.lost:
            import tensorstore_ck as tsck
            raise tsck.StorageError("the ref table is unreachable")
        return self.inner.get_or_none(ref)


def _put2_outcome(store, rank, world, res, *, timeout: float) -> None:
    """Put 2 of the outcome cases: record "returned", or OutcomeUnknown with the root and
    the ref it names, or another error."""
    import tensorstore_ck as tsck
    try:
        store.put_snapshot(small_state(rank, world, 2), REF, step=2, timeout=timeout)
        res["put2"] = "returned"
    except tsck.OutcomeUnknown as e:
        res["put2"], res["put2_message"] = "OutcomeUnknown", str(e)
        res["put2_root"], res["put2_ref"] = e.root.hex() if e.root else None, e.ref
    except Exception as e:  # noqa: BLE001 - recorded for the test
        res["put2"], res["put2_message"] = type(e).__name__, str(e)


def unknown_case(rank, world, out, res, _arg):
    """Put 1 publishes; put 2's ref move on rank 0 ends in OutcomeUnknown: every rank must
    say so (with the root and the ref), not that nothing was published."""
    import torch.distributed as dist
    with _open(out) as store:
        _outcome(res, "put1", lambda: store.put_snapshot(small_state(rank, world, 1), REF, step=1, timeout=30))
        if rank == 0:
            store.publisher.reftable = _LostAnswer(store.publisher.reftable)
            store.publisher.reftable.armed = True
        dist.barrier()
        _put2_outcome(store, rank, world, res, timeout=30)


def pgunknown_case(rank, world, out, res, _arg):
    """The ref table is a real PostgreSQL server; rank 0 reaches it through a TCP proxy
    (tests/sim/netproxy.py) that holds back the COMMIT of put 2's ref move, kills the
    connection and black-holes the server past the client's connect timeout: rank 0's
    move ends in OutcomeUnknown. Then rank 0 lets the held COMMIT through: it lands, the
    snapshot is published after all. Rank 1 must have said OutcomeUnknown, not aborted."""
    import logging
    import torch.distributed as dist
    from psycopg.conninfo import conninfo_to_dict
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.sim.netproxy import NetProxy
    dsn, timeout = os.environ["TSCK_DIST_PG_DSN"], 3
    proxy = None
    if rank == 0:
        d = conninfo_to_dict(dsn)
        proxy = NetProxy(int(d.get("port", 5432)), d.get("host", "127.0.0.1"))
        d.update(host="127.0.0.1", port=str(proxy.port), connect_timeout=str(timeout))
        dsn = " ".join(f"{k}={v}" for k, v in d.items())

        class Restorer(logging.Handler):  # ends the blackout once the write has given up
            def emit(self, record):
                if "commit unanswered" in record.getMessage():
                    threading.Timer(timeout + 0.3, proxy.restore).start()
        logging.getLogger("tensorstore_ck").addHandler(Restorer(logging.WARNING))
    # A short retry budget: rank 0's write gives up when its connect timeout ends, before
    # the blackout does (the default budget would ride the blackout out).
    store = _open(out, refs=dsn, retry_budget=1.5)
    try:
        _outcome(res, "put1", lambda: store.put_snapshot(small_state(rank, world, 1), REF, step=1, timeout=60))
        dist.barrier()
        if rank == 0:
            proxy.arm_hold()
            proxy.blackout_after_fault = float("inf")
        _put2_outcome(store, rank, world, res, timeout=60)
        if rank == 0:
            res["held"] = proxy.holds
            proxy.restore()
            res["released"] = proxy.release()  # the COMMIT lands now
        dist.barrier()
    finally:
        if proxy is not None:
            proxy.restore()
            proxy.release()
        store.close()
        if proxy is not None:
            proxy.close()


def scenarios(scenario: str, out: str, argv: list) -> list | None:
    """SCENARIO -> the launch infos of its runs (tests/_util.launcher_main runs this)."""
    arg = int(argv[3]) if len(argv) > 3 else None
    # one launch: scenario -> (phase, ranks, body, its argument when none is given, limit s)
    one = {"replicated": ("rep", 4, replicated, None, 60.0), "stall": ("stall", 4, stall_case, 1, 60.0),
           "swap": ("swap", 2, swap_case, 1, 120.0), "skip": ("skip", 3, skip_case, 1, 120.0),
           "mismatch": ("mismatch", 4, mismatch_case, 2, 60.0), "desync": ("desync", 4, desync_case, 2, 60.0),
           "diverged": ("diverged", 4, diverged_case, 2, 60.0), "tiling": ("tiling", 2, tiling_case, None, 60.0),
           "newstore": ("newstore", 2, newstore_case, 3, 120.0),
           "slowcommit": ("slowcommit", 2, slowcommit_case, None, 90.0),
           "stopped": ("stopped", 2, stopped_case, None, 120.0),
           "deadcommit": ("deadcommit", 2, deadcommit_case, None, 90.0),
           "nonmember": ("nonmember", 3, nonmember_case, None, 60.0),
           "cotarget": ("cotarget", 2, cotarget_case, None, 60.0),
           "gcfail": ("gcfail", 3, gcfail_case, None, 240.0),
           "pgunknown": ("pgunknown", 2, pgunknown_case, None, 120.0),
           "unknown": ("unknown", 2, unknown_case, None, 60.0), "ddpnew": ("ddpnew", 2, ddp_new, None, 60.0),
           "samebytes": ("samebytes", 4, same_bytes, None, 90.0),
           "notfound": ("notfound", 4, notfound_case, None, 60.0)}
    if scenario in one:
        phase, world, body, default, limit = one[scenario]
        return [launch(phase, world, body, out, default if arg is None else arg, limit=limit)]
    if scenario == "packrestart":  # two jobs, one after the other: the second restarts the first
        return [launch("pack0", 2, pack_put, out, 0), launch("pack1", 2, pack_put, out, 1)]
    if scenario == "sharded":
        infos = [launch("save", 4, sharded_save, out)]
        for w in (4, 2, 8):
            infos.append(launch(f"load{w}", w, sharded_load, out))
    elif scenario == "index":  # save at W = arg ranks, checkout at W ranks counting node reads
        infos = [launch("save", arg, sharded_save, out, limit=240.0),
                 launch("indexed", arg, index_load, out, limit=240.0)]
    elif scenario == "kill":
        infos = [launch("kill", 4, kill_case, out, arg, kill_rank=arg)]
    elif scenario == "exit":
        infos = [launch("exitsetup", 4, exit_setup, out)]
        for i in range(6 if arg is None else arg):
            infos.append(launch_env(f"exitput{i}", 4, exit_put, out, i))
            infos.append(launch_env(f"exitco{i}", 4, exit_checkout, out))
    elif scenario == "gcphase":
        infos = [launch("gcphase", arg or 2, gcphase_case, out, limit=240.0)]
    else:
        return None
    return infos


if __name__ == "__main__":
    launcher_main(scenarios)
