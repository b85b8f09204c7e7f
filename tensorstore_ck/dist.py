"""Collective snapshots under torch.distributed.

put_snapshot and checkout are collective when torch.distributed is initialised
(or a group= is given). No tensor data crosses ranks, ever:

    every rank   plans (validates) its own state -> hello (step, ref, job)
    rank 0       checks that all ranks agree, reads the gc fence -> go
    every rank   hashes and writes its own blocks (a Replicated tensor's blocks
                 are spread over the ranks: each is written by exactly one),
                 writes its own manifest sub-tree, syncs -> done (32-byte root + stats)
    rank 0       composes one commit {"W": [root of rank 0, ..., root of rank W-1]},
                 moves the ref once -> result

Coordination goes through the process group's c10d Store (set/add/check with
our own deadlines), never through collectives, so a dead or stalled rank cannot
poison the process group: when the deadline passes, rank 0 (or any rank that
fails) writes an abort key, every live rank raises SnapshotAborted, nothing is
published, and the group stays usable for training.
"""

from __future__ import annotations

import hashlib
import time

import msgpack

import threading

from .errors import AmbiguousTarget, InvalidArgument, InvalidName, RefNotFound, SnapshotAborted, TsckError
from .ids import Digest
from .plan import plan_stats
from .validate import UNSET

__all__ = ["collective_put", "collective_checkout", "is_collective", "CollectiveContext"]

AUTO = object()


class CollectiveContext:
    """Per store: how many collectives of each (group, op) this process has entered.
    Every rank makes the same calls in the same order, so the count names the call
    (the key prefix in the c10d Store) identically on every rank."""

    def __init__(self):
        self._seq: dict = {}
        self._lock = threading.Lock()

    def next(self, key) -> int:
        with self._lock:
            self._seq[key] = self._seq.get(key, 0) + 1
            return self._seq[key]


def _dist():
    import torch.distributed as dist
    return dist


def is_collective(group) -> bool:
    if group is False:
        return False
    if group is not AUTO and group is not None:
        return True
    dist = _dist()
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _Channel:
    """Keys under one prefix in the c10d Store, waited on with a deadline."""

    def __init__(self, ctx: CollectiveContext, group, op: str, timeout: float, kv=None):
        dist = _dist()
        g = None if group in (AUTO, None, True) else group
        self.world = dist.get_world_size(g)
        self.rank = dist.get_rank(g)
        self.kv = kv if kv is not None else dist.distributed_c10d._get_default_store()
        gid = "world" if g is None else "g" + "-".join(map(str, dist.get_process_group_ranks(g)))
        key = (gid, op)
        seq = ctx.next(key)
        self.pfx = f"tsck/{gid}/{op}/{seq}/"
        self.op = op
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout

    def set(self, k: str, v: bytes) -> None:
        self.kv.set(self.pfx + k, v)

    def get(self, k: str) -> bytes:
        return self.kv.get(self.pfx + k)

    def add(self, k: str, n: int = 1) -> int:
        return self.kv.add(self.pfx + k, n)

    def abort(self, why: str, kind: str = "snapshot_aborted") -> None:
        try:
            self.kv.set(self.pfx + "abort", msgpack.packb([kind, why[:4000]]))
        except Exception:  # the store itself is gone: nothing more we can tell anyone
            pass

    def _check_abort(self) -> None:
        if self.kv.check([self.pfx + "abort"]):
            try:
                kind, why = msgpack.unpackb(self.kv.get(self.pfx + "abort"))
            except Exception:  # noqa: BLE001
                kind, why = "snapshot_aborted", "unreadable abort record"
            cls = _REraise.get(kind) if self.op == "checkout" else None
            if cls is not None:  # the user's mistake, told to every rank as what it is
                raise cls(why)
            raise SnapshotAborted(f"snapshot aborted: {why}")

    def missing(self, k: str) -> list[int]:
        """Ranks that have not posted key k/{rank}."""
        return [r for r in range(self.world) if not self.kv.check([self.pfx + f"{k}/{r}"])]

    def cleanup_old(self) -> None:
        """Delete this rank's keys of two calls ago (every rank has passed them), and
        on rank 0 the shared ones, so the Store does not grow with every snapshot."""
        seq = int(self.pfx.rstrip("/").rsplit("/", 1)[1]) - 2
        if seq < 1:
            return
        old = self.pfx.rsplit("/", 2)[0] + f"/{seq}/"
        keys = [f"hello/{self.rank}", f"done/{self.rank}"]
        if self.rank == 0:
            keys += ["hello_n", "done_n", "go", "result", "abort", "root"]
        for k in keys:
            try:
                self.kv.delete_key(old + k)
            except Exception:  # noqa: BLE001 - best effort
                pass

    def _poll(self, ready, what: str):
        delay = 0.001
        while True:
            self._check_abort()
            out = ready()
            if out is not None:
                return out
            if time.monotonic() > self.deadline:
                why = f"rank {self.rank}: timed out after {self.timeout:g}s waiting for {what}"
                self.abort(why)
                raise SnapshotAborted(f"snapshot aborted: {why}")
            time.sleep(delay)
            delay = min(0.05, delay * 2)

    def wait_key(self, k: str, what: str) -> bytes:
        return self._poll(lambda: self.get(k) if self.kv.check([self.pfx + k]) else None, what)

    def wait_count(self, k: str, n: int, what: str, per_rank: str | None = None) -> int:
        try:
            return self._poll(lambda: (lambda c: c if c >= n else None)(self.add(k, 0)), what)
        except SnapshotAborted as e:
            if per_rank is None or "timed out" not in str(e):
                raise
            late = self.missing(per_rank)
            why = f"rank {self.rank}: ranks {late} did not {what} within {self.timeout:g}s"
            self.abort(why)
            raise SnapshotAborted(f"snapshot aborted: {why}") from None


def _owner(path: str, i: int, world: int) -> int:
    h = int.from_bytes(hashlib.blake2b(path.encode(), digest_size=8).digest(), "little")
    return (h + i) % world


_REraise = {"ref_not_found": RefNotFound, "invalid_name": InvalidName, "invalid_argument": InvalidArgument,
            "ambiguous_target": AmbiguousTarget}


def _guard(ch: _Channel, fn):
    """Run fn; any failure on this rank aborts the snapshot on every rank. This
    rank raises its own error (a TsckError as itself); the others SnapshotAborted,
    or for a checkout the same user error (RefNotFound, InvalidName, ...)."""
    try:
        return fn()
    except SnapshotAborted:
        raise
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        kind = getattr(e, "kind", "error") if isinstance(e, TsckError) else "error"
        ch.abort(str(e) if kind in _REraise else f"rank {ch.rank}: {type(e).__name__}: {e}", kind)
        if isinstance(e, TsckError):
            raise
        raise SnapshotAborted(f"snapshot aborted: rank {ch.rank}: {type(e).__name__}: {e}") from e


def collective_put(publisher, ctx: CollectiveContext, state, *, planner, prepare, group, timeout, kv=None):
    """One snapshot of every rank's `state`, published once by rank 0 through `publisher`.
    prepare() -> SnapshotArgs checks the arguments (on every rank, inside the collective)."""
    try:
        ch = _Channel(ctx, group, "put", timeout, kv)
    except Exception as e:  # noqa: BLE001
        raise SnapshotAborted(f"cannot reach the process group's store: {e}") from e
    W, rank = ch.world, ch.rank
    ch.cleanup_old()
    args = _guard(ch, prepare)
    plan_ = _guard(ch, lambda: planner.plan(state))
    expected = args.expected
    exp_hex = None if expected is UNSET else ("-" if expected is None else expected.hex())
    _guard(ch, lambda: (ch.set(f"hello/{rank}", msgpack.packb([args.step, args.ref, args.job, exp_hex])),
                        ch.add("hello_n")))
    if rank == 0:
        def agree():
            ch.wait_count("hello_n", W, "arrive", per_rank="hello")
            hellos = [msgpack.unpackb(ch.get(f"hello/{r}")) for r in range(W)]
            for r, h in enumerate(hellos):
                if h != hellos[0]:
                    raise SnapshotAborted(
                        f"ranks disagree: rank 0 has (step, ref, job) = {tuple(hellos[0][:3])}, rank {r} has "
                        f"{tuple(h[:3])}")
            fence = publisher.fence()  # read before any rank looks at storage
            ch.set("go", msgpack.packb(fence))
            return fence
        try:
            fence = _guard(ch, agree)
        except SnapshotAborted as e:
            ch.abort(str(e).removeprefix("snapshot aborted: "))
            raise
    else:
        _guard(ch, lambda: ch.wait_key("go", "rank 0 to start the snapshot"))

    def write():
        publisher.write_blocks(plan_, owns=lambda leaf, i: _owner(leaf.path, i, W) == rank)
        tree, _payloads = publisher.write_nodes(plan_.value)
        st = plan_stats(plan_)
        publisher.sync()  # this rank's objects are durable before rank 0 publishes
        ch.set(f"done/{rank}", msgpack.packb({"tree": tree, "stats": [st.bytes_total, st.bytes_new,
                                                                        st.blocks_total, st.blocks_new]}))
        ch.add("done_n")

    _guard(ch, write)
    if rank != 0:
        root = _guard(ch, lambda: ch.wait_key("result", "rank 0 to publish")).decode()
        return publisher.info(Digest.parse(root))

    def publish():
        ch.wait_count("done_n", W, "finish writing", per_rank="done")
        dones = [msgpack.unpackb(ch.get(f"done/{r}")) for r in range(W)]
        top, _payloads = publisher.write_nodes({"W": {"world": W, "ranks": [d["tree"] for d in dones]}})
        sums = [sum(d["stats"][i] for d in dones) for i in range(4)]
        stats = dict(zip(("bytes_total", "bytes_new", "blocks_total", "blocks_new"), sums))
        return publisher.commit(top, args, stats=stats, fence=fence, meta_extra={"world": W})

    info = _guard(ch, publish)
    ch.set("result", info.root.encode())
    return info


def collective_checkout(ctx: CollectiveContext, target, *, resolve, read, group, timeout, kv=None):
    """Rank 0 resolves `target` (so every rank reads the same snapshot even if the ref
    moves meanwhile); every rank then reads its own view with read(root, rank)."""
    try:
        ch = _Channel(ctx, group, "checkout", timeout, kv)
    except Exception as e:  # noqa: BLE001
        raise SnapshotAborted(f"cannot reach the process group's store: {e}") from e
    ch.cleanup_old()
    if ch.rank == 0:
        root = _guard(ch, lambda: resolve(target))
        ch.set("root", root.hex().encode())
    else:
        root = Digest.parse(_guard(ch, lambda: ch.wait_key("root", "rank 0 to resolve the target")).decode())
    return read(root, ch.rank)
