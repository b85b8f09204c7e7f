"""The collective protocol at 64 to 4,096 ranks, on one machine.

W simulated ranks, each a thread of this process with its own Store object (open_store on
one shared local store; the LMDB ref table opened once and shared: LMDB forbids opening one
environment twice in a process), its own CollectiveContext (the call counter is per process
in production; here it must be per rank) and its own client connection to ONE real c10d
TCPStore (torch.distributed.TCPStore) that this script hosts. The ranks run the project's own
collective put_snapshot and checkout (dist.collective_put / collective_checkout through
Store.put_snapshot / Store.checkout) with group=collective.StoreGroup(client, rank, W): the
protocol only ever talks through the Store, so no process group is needed (one cannot be
initialised per thread).

Each rank holds N sharded tensors: a (1, 2) float32 row piece of each of N global (W, 2)
tensors (8 bytes of data; the pieces are what the protocol coordinates, so W x N pieces are
the load, not the bytes).

Counted, per snapshot (everything is counted, nothing is modelled):
  requests, bytes   through the Store, per rank and in all: every call of the rank's client
                    (set/get/multi_get/add/check/compare_set/delete_key/wait), bytes = the keys and values
                    it sends plus the values it gets back (the payload; the TCPStore wire
                    format adds ~9-17 bytes of framing per request)
  rank 0 CPU        time.thread_time() of rank 0's thread over its call (the coordination:
                    gathering and checking the hellos, composing the commit; its manifest
                    writes are on its Store's I/O pool, not counted)
  coord             wall time from the last rank's hello to rank 0 posting the result
                    (put) or the resolved root (checkout)
  reads             for a checkout, per rank: manifest nodes (and blocks) read from storage and
                    their bytes (a wrap_storage wrapper on each rank's Store)

Scenarios: "first" (a fresh store), "second" (the same layout, new values), "late" (the same
layout, rank W-1 calls put_snapshot 3 s after the others), then "checkout" (every rank
its own pieces) and "reshard" (W/2 ranks, each a Sharded target covering two ranks' rows).
Every checkout's values are checked against what was written.

The GIL: the ranks share this process's 2 cores, so rank 0's wall times include the other
ranks' work. Counts of bytes, nodes and requests do not depend on speed: a waiting rank
blocks on the keys it needs (c10d wait, counted under "waits"; a wait that runs out one of
its slices of the timeout is counted under "wait_timeouts"), it does not poll.

Usage:
    .venv/bin/python benches/bench_scale.py --worlds 64 256 --tensors 100 1000 --also 1024x100 \
        | tee benches/results/scale.txt              # docs/PERFORMANCE.md's figures (~1.5 h on 2 cores)
    .venv/bin/python benches/bench_scale.py --worlds 64 --tensors 100 --late 0.5     # smoke run
    .venv/bin/python benches/bench_scale.py --reads 64x100 256x100 1024x100 4096x100 \
        [--top-version 1]    # the checkout's reads alone (benches/results/scale_checkout.txt)

--reads: the checkout's reads alone, at sizes the threaded protocol cannot reach here. The
snapshot is written by one Store as a collective put writes it (write_direct: the same rank
trees and the same top, composed by format.world.write_world as rank 0 does at commit; no
c10d round trips), then a few ranks spread over the group read their region through the
Reader that Store.checkout runs once the ranks agree on the root (read_rank): same layout
(its own row of every tensor) and resharded (W/2 ranks, two rows each). --top-version 1
writes the top as the previous writer did (rank list, one chunk-index node), to compare.
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import argparse  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import tensorstore_ck as tsck  # noqa: E402
from tensorstore_ck.collective import CollectiveContext, CollectiveJob, StoreGroup, collective_checkout  # noqa: E402
from tensorstore_ck.storage.wrappers import WrappedStore  # noqa: E402

REF = "scale/main"
COLS = 2


class CountingKV:
    """One rank's client of the c10d Store: forwards every call and counts it (requests,
    payload bytes), and notes when this rank said hello and when it posted an outcome."""

    def __init__(self, inner):
        self.inner = inner
        self.reset()

    def reset(self) -> None:
        self.requests = self.bytes = 0
        self.polls = self.poll_bytes = 0  # of the requests, those that only look (check, add 0): it waited
        self.waits = 0  # of the requests, blocking waits (c10d wait: the Store answers when the keys exist)
        self.timeouts = 0  # of the waits, those that ran out their time (a slice) instead of being answered
        self.t_hello = self.t_out = None
        self.c_hello = self.c_out = None  # this thread's CPU time then (rank 0 makes both calls itself)

    def _count(self, n: int) -> None:
        self.requests += 1
        self.bytes += n

    def set(self, key, value):
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, value)
        self._count(len(key) + len(value))
        if key.endswith(("/result", "/root")):
            self.t_out, self.c_out = time.monotonic(), time.thread_time()

    def get(self, key):
        v = self.inner.get(key)
        self._count(len(key) + len(v))
        return v

    def add(self, key, n):
        v = self.inner.add(key, n)
        self._count(len(key) + 16)  # the increment out, the count back
        if n == 0:
            self.polls += 1
            self.poll_bytes += len(key) + 16
        if n and key.endswith("/hello_n"):
            self.t_hello, self.c_hello = time.monotonic(), time.thread_time()
        return v

    def check(self, keys):
        v = self.inner.check(keys)
        self._count(sum(len(k) for k in keys) + 1)
        self.polls += 1
        self.poll_bytes += sum(len(k) for k in keys) + 1
        return v

    def compare_set(self, key, expected, desired):
        v = self.inner.compare_set(key, expected, desired)
        self._count(len(key) + len(expected) + len(desired) + len(v))
        return v

    def delete_key(self, key):
        v = self.inner.delete_key(key)
        self._count(len(key) + 1)
        return v

    def wait(self, keys, *args):
        self._count(sum(len(k) for k in keys))
        self.waits += 1
        try:
            return self.inner.wait(keys, *args)
        except Exception:  # a wait that ran out its time (or the Store went away)
            self.timeouts += 1
            raise

    def multi_get(self, keys):
        v = self.inner.multi_get(keys)
        self._count(sum(len(k) for k in keys) + sum(len(x) for x in v))
        return v


class ReadCounting(WrappedStore):
    """One rank's storage: counts what it reads (manifest nodes, blocks, other objects) and
    their bytes."""

    def __init__(self, inner):
        super().__init__(inner)
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.n = {"nodes": 0, "blocks": 0, "other": 0}
        self.b = {"nodes": 0, "blocks": 0, "other": 0}

    def _count(self, key: str, size: int) -> None:
        kind = key.split("/", 1)[0]
        kind = kind if kind in self.n else "other"
        with self.lock:
            self.n[kind] += 1
            self.b[kind] += size

    def get(self, key, max_bytes=None):
        v = self.inner.get(key, max_bytes)
        self._count(key, len(v))
        return v

    def open_read(self, key, max_bytes=None):
        f = self.inner.open_read(key, max_bytes)
        try:
            size = os.fstat(f.fileno()).st_size  # a local store: the object is read whole
        except (AttributeError, OSError, ValueError):
            size = 0
        self._count(key, size)
        return f


class Rank:
    def __init__(self, h: "Harness", rank: int):
        self.rank = rank
        client = torch.distributed.TCPStore("127.0.0.1", h.port, None, False,
                                            timeout=datetime.timedelta(seconds=h.timeout))
        self.kv = CountingKV(client)
        self.storage: ReadCounting | None = None

        def wrap(s):
            self.storage = ReadCounting(s)
            return self.storage
        self.store = tsck.open_store(h.path, refs=h.refs, wrap_storage=wrap, workers=1)
        self.store._collective = CollectiveContext()  # per rank: CALLS is per process
        self.group = StoreGroup(self.kv, rank, h.world, "w")

    def reset(self) -> None:
        self.kv.reset()
        self.storage.reset()


def value(rank: int, i: int, step: int) -> float:
    return float((rank * 7919 + i * 31 + step) % 100003)


class Harness:
    """One c10d TCPStore server, one shared local store, W ranks."""

    def __init__(self, path: str, world: int, tensors: int, *, timeout: float = 600.0):
        self.path, self.world, self.tensors, self.timeout = path, world, tensors, timeout
        # The classic server: the libuv one accepts a few hundred connections per second at most.
        self.server = torch.distributed.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, use_libuv=False,
                                                 timeout=datetime.timedelta(seconds=timeout))
        self.port = self.server.port
        self._first = tsck.open_store(path)
        self.refs = self._first.reftable
        self.ranks = [Rank(self, r) for r in range(world)]

    def close(self) -> None:
        for rk in self.ranks:
            rk.store.close()
        self._first.close()
        self.ranks = []

    def state(self, rank: int, step: int) -> dict:
        W = self.world
        return {"t": {f"p{i:05d}": tsck.Sharded(torch.full((1, COLS), value(rank, i, step)), (W, COLS), (rank, 0))
                      for i in range(self.tensors)},
                "step": step}

    def _run(self, ranks, fn) -> list:
        """fn(rank) on a thread per rank -> results (an exception is raised here, the first)."""
        out: list = [None] * len(ranks)
        errs: list = []

        def go(i, rk):
            try:
                out[i] = fn(rk)
            except BaseException as e:  # noqa: BLE001 - reported below
                errs.append((rk.rank, e))
        for rk in ranks:
            rk.reset()
        ts = [threading.Thread(target=go, args=(i, rk), name=f"rank{rk.rank}") for i, rk in enumerate(ranks)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errs:
            r, e = min(errs, key=lambda x: x[0])
            raise RuntimeError(f"rank {r} failed ({len(errs)} ranks failed): {type(e).__name__}: {e}") from e
        return out

    def put(self, step: int, *, late: float = 0.0) -> dict:
        W = self.world

        def one(rk: Rank):
            st = self.state(rk.rank, step)
            if late and rk.rank == W - 1:
                time.sleep(late)
            c0 = time.thread_time()
            info = rk.store.put_snapshot(st, REF, step=step, group=rk.group, timeout=self.timeout)
            return info.root, time.thread_time() - c0
        t0 = time.monotonic()
        res = self._run(self.ranks, one)
        wall = time.monotonic() - t0
        roots = {r for r, _c in res}
        assert len(roots) == 1, f"ranks returned different roots: {len(roots)}"
        return self._row(self.ranks, res[0][1], wall)

    def checkout(self, step: int, *, reshard: bool = False, readers: int | None = None) -> dict:
        """One collective checkout: every rank its own pieces (reshard: the first W/2 ranks,
        each two ranks' rows); the values are checked. readers: only that many ranks, spread
        over the group, read their region through Store.checkout (and are counted); the
        others make the same collective call (dist.collective_checkout, what Store.checkout
        calls) with a read that does nothing: a rank's reads depend only on its region and
        the snapshot, and 1,024 ranks reading on 2 cores take long (--reads measures the
        reads alone, up to 4,096 ranks)."""
        W, N = self.world, self.tensors
        k = 2 if reshard else 1
        ranks = self.ranks[: W // k]
        n = len(ranks)
        groups = {rk.rank: StoreGroup(rk.kv, rk.rank, n, "half" if reshard else "w") for rk in ranks}
        chosen = set(range(n)) if readers is None or readers >= n else \
            {round(i * (n - 1) / (readers - 1)) for i in range(readers)} if readers > 1 else {0}

        def one(rk: Rank):
            if rk.rank not in chosen:
                collective_checkout(CollectiveJob(rk.store._collective, groups[rk.rank], self.timeout,
                                                  resolve=rk.store.core.resolve, read=lambda root, rank: None), REF)
                return None
            into = {"t": {f"p{i:05d}": tsck.Sharded(torch.zeros(k, COLS), (W, COLS), (k * rk.rank, 0))
                          for i in range(N)}}
            c0 = time.thread_time()
            got = rk.store.checkout(REF, into=into, group=groups[rk.rank], timeout=self.timeout)
            cpu = time.thread_time() - c0
            for i in range(N):
                t = got["t"][f"p{i:05d}"].local
                want = [value(k * rk.rank + j, i, step) for j in range(k)]
                if t[:, 0].tolist() != want or t[:, 1].tolist() != want:
                    raise AssertionError(f"rank {rk.rank}: p{i:05d} read {t.tolist()}, wrote {want}")
            return cpu
        t0 = time.monotonic()
        cpus = self._run(ranks, one)
        wall = time.monotonic() - t0
        row = self._row(ranks, cpus[0], wall)
        readers_ = [ranks[i] for i in sorted(chosen)]
        row["readers"] = [rk.rank for rk in readers_]
        row["reader_cpu"] = [cpus[i] for i in sorted(chosen)]
        row["nodes"] = [rk.storage.n["nodes"] for rk in readers_]
        row["read_bytes"] = [sum(rk.storage.b.values()) for rk in readers_]
        row["blocks"] = [rk.storage.n["blocks"] for rk in readers_]
        return row

    @staticmethod
    def _row(ranks, cpu0: float, wall: float) -> dict:
        hellos = [rk.kv.t_hello for rk in ranks]
        kv0 = ranks[0].kv
        coord = kv0.t_out - max(hellos) if kv0.t_out is not None and None not in hellos else None
        ccpu = kv0.c_out - kv0.c_hello if kv0.c_out is not None and kv0.c_hello is not None else None
        return {"world": len(ranks), "requests": [rk.kv.requests for rk in ranks],
                "polls": [rk.kv.polls for rk in ranks], "poll_bytes": [rk.kv.poll_bytes for rk in ranks],
                "waits": [rk.kv.waits for rk in ranks], "wait_timeouts": [rk.kv.timeouts for rk in ranks],
                "bytes": [rk.kv.bytes for rk in ranks], "cpu0": cpu0, "cpu0_coord": ccpu, "coord": coord,
                "wall": wall}


def write_direct(store, world: int, state, ref: str, step: int, *, top_version: int = 2) -> str:
    """A collective snapshot of `world` ranks written by one Store without the c10d
    protocol: each rank's tree as collective_put writes it (plan, blocks, nodes) and the top
    composed as rank 0 does at commit (format.world.write_world), then published. The
    stored objects are those of a collective put of the same states; only the coordination
    is skipped (its cost is what the put scenarios measure), so the checkout at 4,096
    ranks can be measured on this machine. state(rank) -> that rank's state.
    top_version=1: the top as the writer of version 1 composed it (every rank's tree
    address and one chunk-index node listing every piece), to compare. -> the root."""
    from tensorstore_ck.format.manifest import encode_node
    from tensorstore_ck.format.world import write_index, write_world
    from tensorstore_ck.core.validate import check_snapshot_args
    pub = store.publisher
    fence = pub.fence()
    tops, pieces_by_rank = [], []
    for r in range(world):
        plan = store.planner().plan(state(r))
        pub.write_blocks(plan, owns=lambda leaf, i: True, fence=fence)
        tops.append(pub.write_nodes(plan.value, fence)[0])
        pieces_by_rank.append([[p, dt, list(gs), list(off), list(sh)]
                               for p, dt, gs, off, sh, rep in plan.pieces if not rep])

    def put(value):  # one node, as rank 0 writes the index nodes (compose() in dist.py)
        return store.assets.put_node(encode_node(value), fence).digest
    if top_version == 1:
        ix: dict = {}
        for r, pieces in enumerate(pieces_by_rank):
            for p, _dt, _gs, off, sh in pieces:
                ix.setdefault(p, []).append({"l": [r, {"l": list(off)}, {"l": list(sh)}]})
        index = pub.write_nodes({"d": [[p, {"l": v}] for p, v in ix.items()]}, fence)[0]  # as it was written
        top = put({"W": {"world": world, "ranks": tops, "ix": index}})
    else:
        top = put(write_world(tops, write_index(pieces_by_rank, put), put))
    pub.sync()
    stats = dict.fromkeys(("bytes_total", "bytes_new", "blocks_total", "blocks_new", "stored_new"), 0)
    return pub.commit(top, check_snapshot_args(ref, step=step), stats=stats, fence=fence,
                      meta_extra={"world": world}).root


def read_rank(store, root: str, rank: int, into):
    """What Store.checkout's read does on `rank` of a collective checkout of `root` once
    the ranks agree on it (the coordination costs O(1) requests per rank: the checkout
    scenarios above count it): this rank's view, into `into`."""
    from tensorstore_ck.format.manifest import decode_commit
    from tensorstore_ck.read.read import Reader
    c = decode_commit(store.assets.get_commit(bytes.fromhex(root)))
    reader = Reader(store.assets, store._pool, snapshot=root, rank=rank, fence=store.assets.fence_now())
    return reader.materialize(reader.top(c["tree"]), (), into)


def run_reads(world: int, tensors: int, *, readers: int = 4, top_version: int = 2, log=print) -> dict:
    """The checkout of a snapshot of `world` ranks (written by write_direct), read by
    `readers` ranks spread over the group: "checkout" (each its own rows) and "reshard"
    (world/2 ranks, each two ranks' rows), counted as in the full run: nodes and bytes
    read per rank, CPU per rank. No c10d Store: -> {scenario: row}."""
    tmp = tempfile.mkdtemp(prefix="tsck-scale-", dir=os.environ.get("TSCK_BENCH_DIR"))
    rows: dict = {}
    try:
        path = os.path.join(tmp, "store")
        h = Harness.__new__(Harness)  # only its state(): the same states as the full run
        h.world, h.tensors = world, tensors
        t0 = time.monotonic()
        with tsck.open_store(path) as s:
            root = write_direct(s, world, lambda r: h.state(r, 1), REF, 1, top_version=top_version)
        log(f"# W={world} N={tensors}: snapshot (top version {top_version}) written directly in "
            f"{time.monotonic() - t0:.1f}s")
        for sc, k in (("checkout", 1), ("reshard", 2)):
            n = world // k
            chosen = sorted({round(i * (n - 1) / (readers - 1)) for i in range(readers)} if readers > 1 else {0})
            row = {"world": n, "readers": chosen, "nodes": [], "read_bytes": [], "blocks": [], "reader_cpu": []}
            for r in chosen:
                counted: list = []

                def wrap(st):
                    counted.append(ReadCounting(st))
                    return counted[0]
                with tsck.open_store(path, wrap_storage=wrap, workers=1) as s:
                    into = {"t": {f"p{i:05d}": tsck.Sharded(torch.zeros(k, COLS), (world, COLS), (k * r, 0))
                                  for i in range(tensors)}}
                    c0 = time.thread_time()
                    got = read_rank(s, root, r, into)
                    row["reader_cpu"].append(time.thread_time() - c0)
                for i in range(tensors):
                    t = got["t"][f"p{i:05d}"].local
                    want = [value(k * r + j, i, 1) for j in range(k)]
                    if t[:, 0].tolist() != want or t[:, 1].tolist() != want:
                        raise AssertionError(f"rank {r}: p{i:05d} read {t.tolist()}, wrote {want}")
                c = counted[0]
                row["nodes"].append(c.n["nodes"])
                row["read_bytes"].append(sum(c.b.values()))
                row["blocks"].append(c.n["blocks"])
            rows[sc] = row
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def reads_table(results: list) -> str:
    lines = ["| W (saved) | N/rank | scenario | ranks reading | nodes read/rank: mean (max) "
             "| bytes read/rank: mean (max) | checkout CPU s/rank: mean (max) | ranks read |",
             "|---|---|---|---|---|---|---|---|"]
    for (W, N), rows in results:
        for sc, r in rows.items():
            lines.append(f"| {W} | {N} | {sc} | {r['world']} | {_mean(r['nodes']):.1f} ({max(r['nodes'])}) | "
                         f"{_mean(r['read_bytes']) / 1e3:.1f} KB ({max(r['read_bytes']) / 1e3:.1f} KB) | "
                         f"{_mean(r['reader_cpu']):.3f} ({max(r['reader_cpu']):.3f}) | "
                         f"{', '.join(map(str, r['readers']))} |")
    return "\n".join(lines)


def run(world: int, tensors: int, *, late: float = 3.0, reshard: bool = True, timeout: float = 600.0,
        readers: int | None = None, log=print) -> dict:
    """The five scenarios at one size -> {scenario: row}."""
    tmp = tempfile.mkdtemp(prefix="tsck-scale-", dir=os.environ.get("TSCK_BENCH_DIR"))
    h = None
    rows: dict = {}
    try:
        t0 = time.monotonic()
        h = Harness(os.path.join(tmp, "store"), world, tensors, timeout=timeout)
        log(f"# W={world} N={tensors}: {world} clients and Stores opened in {time.monotonic() - t0:.1f}s")
        rows["first"] = h.put(1)
        rows["second"] = h.put(2)
        if late:
            rows["late"] = h.put(3, late=late)
        step = 3 if late else 2
        rows["checkout"] = h.checkout(step, readers=readers)
        if reshard and world >= 2:
            rows["reshard"] = h.checkout(step, reshard=True, readers=readers)
        gc.collect()
    finally:
        if h is not None:
            h.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _mean(xs) -> float:
    return sum(xs) / len(xs)


def table(results: list) -> str:
    lines = ["| W | N/rank | scenario | Store requests/rank: mean (max); polls, waits: mean "
             "| Store bytes/rank: mean (max) "
             "| Store bytes, all | rank 0 CPU s: call (hello→outcome) | last hello→outcome s | wall s "
             "| nodes read/rank: mean (max) | bytes read/rank: mean (max) | checkout CPU s/rank: mean (max) "
             "| ranks read |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (_W, N), rows in results:
        for sc, r in rows.items():
            reads = ("", "", "", "")
            if "nodes" in r:
                reads = (f"{_mean(r['nodes']):.1f} ({max(r['nodes'])})",
                         f"{_mean(r['read_bytes']) / 1e3:.1f} KB ({max(r['read_bytes']) / 1e3:.1f} KB)",
                         f"{_mean(r['reader_cpu']):.2f} ({max(r['reader_cpu']):.2f})",
                         "all" if len(r["readers"]) == r["world"] else ", ".join(map(str, r["readers"])))
            coord = "" if r["coord"] is None else f"{r['coord']:.2f}"
            ccpu = "" if r["cpu0_coord"] is None else f" ({r['cpu0_coord']:.2f})"
            lines.append(f"| {r['world']} | {N} | {sc} | {_mean(r['requests']):.1f} ({max(r['requests'])}); "
                         f"{_mean(r['polls']):.1f}, {_mean(r.get('waits', [0])):.1f} | "
                         f"{_mean(r['bytes']) / 1e3:.2f} KB ({max(r['bytes']) / 1e3:.1f} KB) | "
                         f"{sum(r['bytes']) / 1e6:.2f} MB | {r['cpu0']:.2f}{ccpu} | {coord} | {r['wall']:.1f} | "
                         f"{reads[0]} | {reads[1]} | {reads[2]} | {reads[3]} |")
    return "\n".join(lines)


def _lstsq(xs: list, ys: list) -> list:
    """Least squares for y = sum(c_j x_j)."""
    A = torch.tensor(xs, dtype=torch.float64)
    b = torch.tensor(ys, dtype=torch.float64).unsqueeze(1)
    return torch.linalg.lstsq(A, b).solution.squeeze(1).tolist()


def projection(results: list, *, world: int = 8192, tensors: int = 4600) -> str:
    """Fit, on the "second" snapshots (a repeated layout, nobody late: the steady state)
    and on the "first" ones (a layout rank 0 does not hold: a first snapshot, a new rank 0
    process, a changed layout), each:
        Store bytes per rank (mean) = a + b*N    (b: per piece, sent by a rank whose layout
                                                  rank 0 lacks and read back by rank 0)
        rank 0 CPU, hello->outcome  = c*W*N + d*W (c: per piece it decodes, tiles and indexes;
                                                   d: per rank it reads and checks)
    and project to `world` ranks of `tensors` sharded tensors each: 5 TB under FSDP, where
    every rank holds a piece of each of the model's ~4,600 tensors whatever W is. Assumes
    the costs stay linear (no cache or memory effects beyond the sizes measured) and one
    core of this machine for rank 0."""
    out = []
    for sc, what in (("second", "a repeated layout (every snapshot after the first)"),
                     ("first", "a layout rank 0 does not hold (the first snapshot of a rank 0 process, or a "
                               "changed layout)")):
        pts = [(W, N, r[sc]) for (W, N), r in results if sc in r]
        if len({N for _W, N, _r in pts}) < 2 or len({W for W, _N, _r in pts}) < 2:
            return "(the projection needs two values of W and of N)"
        a, b = _lstsq([[1.0, N] for _W, N, _r in pts], [_mean(r["bytes"]) for _W, N, r in pts])
        c, d = _lstsq([[W * N, W] for W, N, _r in pts], [r["cpu0_coord"] for W, N, r in pts])
        per_rank = a + b * tensors
        cpu = c * world * tensors + d * world
        out.append(
            f"{what}: fit on the '{sc}' rows: Store bytes/rank = {a:.0f} B + {b:.2f} B x N; rank 0 CPU from its "
            f"hello to the result = {c * 1e6:.3f} us x W x N + {d * 1e3:.3f} ms x W. Projected to W = {world:,} "
            f"ranks x N = {tensors:,} tensors per rank (5 TB under FSDP): {per_rank / 1e3:.1f} KB per rank and "
            f"{per_rank * world / 1e6:.1f} MB through the one Store, rank 0 CPU ~{cpu:.1f} s (one core of this "
            "machine).")
    reqs = [(W, N, sc, max(rows[sc]["requests"][1:]), rows[sc]["requests"][0], max(rows[sc]["wait_timeouts"]))
            for (W, N), rows in results for sc in ("first", "second", "late") if sc in rows and "waits" in rows[sc]]
    if reqs:
        out.append("Nobody polls: a waiting rank blocks on the keys it needs (c10d wait, in at most 4 slices of its "
                   "timeout). Requests per snapshot, most of any rank other than 0 / rank 0: " + ", ".join(
                       f"W={W} N={N} {sc} {m}/{r0}" for W, N, sc, m, r0, _t in reqs)
                   + f"; waits that ran out a slice: {max(t for *_x, t in reqs)} at most per rank.")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--tensors", type=int, nargs="+", default=[100, 1000])
    ap.add_argument("--also", nargs="*", default=["4096x100"], help="extra WxN sizes (default 4096x100)")
    ap.add_argument("--late", type=float, default=3.0, help="how late rank W-1 is in the 'late' scenario (0: skip)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--readers", type=int, default=4,
                    help="ranks that read their region in a checkout above --all-read ranks (the others coordinate)")
    ap.add_argument("--all-read", type=int, default=64, help="up to this many ranks, every rank reads its region")
    ap.add_argument("--json-out")
    ap.add_argument("--reads", nargs="*", metavar="WxN",
                    help="only the checkout's reads, of snapshots written without the c10d protocol "
                         "(write_direct), at these sizes: e.g. --reads 64x100 256x100 1024x100 4096x100")
    ap.add_argument("--top-version", type=int, default=2, choices=(1, 2),
                    help="with --reads: the multi-rank top to write (1: the rank list and one chunk-index node)")
    args = ap.parse_args()
    if args.reads:
        print(f"# bench_scale --reads (top version {args.top_version}): {platform.node()}, {os.cpu_count()} cores, "
              f"torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}, loadavg {os.getloadavg()[0]:.1f}",
              flush=True)
        results = []
        for s in args.reads:
            W, N = (int(x) for x in s.split("x"))
            rows = run_reads(W, N, readers=args.readers, top_version=args.top_version,
                             log=lambda m: print(m, flush=True))
            results.append(((W, N), rows))
            print(reads_table([((W, N), rows)]).split("\n", 2)[2], f"   (loadavg {os.getloadavg()[0]:.1f})",
                  flush=True)
        print()
        print(reads_table(results))
        return
    sizes = [(W, N) for W in args.worlds for N in args.tensors]
    sizes += [tuple(int(x) for x in s.split("x")) for s in args.also or ()]
    print(f"# bench_scale: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, loadavg {os.getloadavg()[0]:.1f}", flush=True)
    results = []
    for W, N in sizes:
        rows = run(W, N, late=args.late, timeout=args.timeout, readers=None if W <= args.all_read else args.readers,
                   log=lambda m: print(m, flush=True))
        results.append(((W, N), rows))
        print(table([((W, N), rows)]).split("\n", 2)[2], f"   (loadavg {os.getloadavg()[0]:.1f}, "
              f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.1f} GB)", flush=True)
    print()
    print(table(results))
    print()
    print(projection(results))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([{"world": W, "tensors": N, "rows": rows} for (W, N), rows in results], f)


if __name__ == "__main__":
    main()
