"""Collective snapshots under torch.distributed.

put_snapshot and checkout are collective when torch.distributed is initialised
(or a group= is given). No tensor data crosses ranks, ever:

    every rank   plans (validates) its own state -> hello (step, ref, job, its pieces
                 of sharded tensors)
    rank 0       checks that all ranks agree and that the pieces tile each sharded
                 tensor exactly, reads the gc fence -> go
    every rank   hashes and writes its own blocks (a Replicated tensor's blocks
                 are spread over the ranks: each is written by exactly one),
                 writes its own manifest sub-tree, syncs -> done (32-byte root + stats +
                 a digest of its Replicated tensors' block addresses)
    rank 0       checks that the replicas agree (else abort: nobody wrote the blocks of
                 a diverged replica), composes one commit {"W": [root of rank 0, ..., root of rank W-1]},
                 claims the outcome ("decided" = commit), moves the ref once -> result
    every rank   acks once it holds the outcome (result or abort); rank 0, which
                 usually hosts the Store, returns only when every rank has acked

Coordination goes through the process group's c10d Store (set/add/check with
our own deadlines), never through collectives, so a dead or stalled rank cannot
poison the process group: when the deadline passes, rank 0 (or any rank that
fails) claims the outcome "abort" and writes an abort key, every live rank
raises SnapshotAborted, nothing is published, and the group stays usable for
training. The claim (one compare_set) makes abort and commit exclusive: once
rank 0 has claimed "commit", a rank whose deadline passes waits for the
result instead of declaring an abort, so a published snapshot is never
reported aborted while the Store is reachable. The argument is in
docs/ARCHITECTURE.md ("Distributed snapshots").
"""

from __future__ import annotations

import hashlib
import math
import threading
import time
import warnings

import msgpack

from .errors import AmbiguousTarget, InvalidArgument, InvalidName, RefNotFound, SnapshotAborted, TsckError
from .ids import Digest
from .shard import find_overlap
from .validate import UNSET

__all__ = ["collective_put", "collective_checkout", "is_collective", "CollectiveContext"]

AUTO = object()

# How long rank 0 waits, past the deadline if need be, for every rank to confirm that
# it read the outcome, before it returns (a published snapshot: with a warning).
ACK_GRACE = 10.0
# Clock skew tolerated when a rank looks up in the ref table whether a silent rank 0 published.
CLOCK_SKEW = 120.0


class _CommitUnderWay(Exception):
    """This rank's deadline passed, but rank 0 had already claimed the outcome "commit"."""


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
        self.t_start = time.time()
        self.late: list[int] = []  # ranks known not to be waiting for the outcome (dead or stalled)
        self.aborted = False       # this rank has written an abort record

    def set(self, k: str, v: bytes) -> None:
        self.kv.set(self.pfx + k, v)

    def get(self, k: str) -> bytes:
        return self.kv.get(self.pfx + k)

    def add(self, k: str, n: int = 1) -> int:
        return self.kv.add(self.pfx + k, n)

    def claim(self, outcome: bytes) -> bytes:
        """The outcome of this call: the first claim wins (an atomic compare_set), and
        this returns the winner's."""
        return self.kv.compare_set(self.pfx + "decided", b"", outcome)

    def abort(self, why: str, kind: str = "snapshot_aborted", *, late=(), shared: bool = False,
              force: bool = False) -> bool:
        """Abort this call on every rank. False, and nothing written, when rank 0 has
        already claimed the outcome "commit" (it may be moving the ref right now):
        then nobody may say aborted, except rank 0 itself if its commit fails (force).
        shared: every rank raises the error of `kind`, not SnapshotAborted."""
        self.late = sorted(set(self.late) | set(late))
        try:
            if not force and self.claim(b"abort") != b"abort":
                return False
            self.aborted = True
            self.kv.set(self.pfx + "abort", msgpack.packb([kind, why[:4000], self.late, shared]))
        except Exception:  # noqa: BLE001 - the store itself is gone: nothing more we can tell anyone
            pass
        return True

    def _check_abort(self) -> None:
        if self.kv.check([self.pfx + "abort"]):
            kind, why, late, shared = "snapshot_aborted", "unreadable abort record", [], False
            try:
                rec = msgpack.unpackb(self.kv.get(self.pfx + "abort"))
                kind, why = rec[:2]
                late, shared = (rec[2], rec[3]) if len(rec) >= 4 else ([], False)
                self.late = sorted(set(self.late) | {int(r) for r in late})
            except Exception:  # noqa: BLE001
                pass
            cls = _REraise.get(kind) if self.op == "checkout" or shared else None
            if cls is not None:  # the user's mistake, told to every rank as what it is
                raise cls(why)
            raise SnapshotAborted(f"snapshot aborted: {why}")

    def ack(self) -> None:
        """This rank holds the outcome (it returns or raises next)."""
        try:
            self.kv.set(self.pfx + f"ack/{self.rank}", b"1")
        except Exception:  # noqa: BLE001 - the store is gone: nobody is waiting for us any more
            pass

    def wait_acks(self) -> list[int]:
        """Rank 0 (usually the host of the Store): wait until every rank that is still
        waiting for the outcome has read it, so that leaving (and taking the Store down)
        cannot turn their outcome into a connection error. Ranks known to be dead or
        stalled are not waited for. -> the ranks that did not ack in time."""
        expect = [r for r in range(self.world) if r not in self.late]
        keys = [self.pfx + f"ack/{r}" for r in expect]
        deadline = max(self.deadline, time.monotonic() + min(self.timeout, ACK_GRACE))
        delay = 0.001
        try:
            while not self.kv.check(keys):
                if time.monotonic() > deadline:
                    return [r for r, k in zip(expect, keys) if not self.kv.check([k])]
                time.sleep(delay)
                delay = min(0.05, delay * 2)
        except Exception:  # noqa: BLE001 - the store is gone: nobody can read anything from it now
            return []
        return []

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
        keys = [f"hello/{self.rank}", f"done/{self.rank}", f"ack/{self.rank}", f"rep/{self.rank}"]
        if self.rank == 0:
            keys += ["hello_n", "done_n", "go", "result", "abort", "root", "decided"]
        for k in keys:
            try:
                self.kv.delete_key(old + k)
            except Exception:  # noqa: BLE001 - best effort
                pass

    def _poll(self, ready, what: str, per_rank: str | None = None, of_ranks: bool = False):
        delay = 0.001
        while True:
            self._check_abort()
            out = ready()
            if out is not None:
                return out
            if time.monotonic() > self.deadline:
                late = self.missing(per_rank) if per_rank is not None else []
                if of_ranks:  # `what` is what the late ranks did not do
                    why = f"rank {self.rank}: ranks {late} did not {what} within {self.timeout:g}s"
                else:
                    why = f"rank {self.rank}: timed out after {self.timeout:g}s waiting for {what}"
                    if late:
                        why += f" (ranks {late} are behind)"
                if not self.abort(why, late=late):
                    raise _CommitUnderWay()
                raise SnapshotAborted(f"snapshot aborted: {why}")
            time.sleep(delay)
            delay = min(0.05, delay * 2)

    def wait_key(self, k: str, what: str, per_rank: str | None = None) -> bytes:
        """per_rank: the key every rank posts before this one can come; on a timeout the
        ranks that have not posted it are named (and not waited for in the outcome round)."""
        return self._poll(lambda: self.get(k) if self.kv.check([self.pfx + k]) else None, what, per_rank)

    def wait_count(self, k: str, n: int, what: str, per_rank: str | None = None) -> int:
        return self._poll(lambda: (lambda c: c if c >= n else None)(self.add(k, 0)), what, per_rank,
                          of_ranks=per_rank is not None)


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
    except (SnapshotAborted, _CommitUnderWay):
        raise
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        kind = getattr(e, "kind", "error") if isinstance(e, TsckError) else "error"
        if not ch.aborted:  # (else this rank has told the others already, in its own words)
            ch.abort(str(e) if kind in _REraise else f"rank {ch.rank}: {type(e).__name__}: {e}", kind)
        if isinstance(e, TsckError):
            raise
        raise SnapshotAborted(f"snapshot aborted: rank {ch.rank}: {type(e).__name__}: {e}") from e


def _ranks(rs) -> str:
    rs = sorted(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"


def _tiling(pieces_by_rank: list) -> str | None:
    """Rank 0, from every rank's hello: the pieces of each sharded tensor (by path) must
    agree on dtype and global shape and tile it exactly: no overlap, no gap (identical
    pieces on several ranks are replicas of one piece, as in hybrid sharding)."""
    by_path: dict = {}
    for r, pieces in enumerate(pieces_by_rank):
        for path, dt, gs, off, sh in pieces:
            by_path.setdefault(path, []).append((r, dt, tuple(gs), tuple(off), tuple(sh)))
    rule = "the pieces of a sharded tensor must tile it exactly (no overlap, no gap)"
    for path, entries in by_path.items():
        r0, dt0, gs0 = entries[0][:3]
        for r, dt, gs, _o, _s in entries:
            if (dt, gs) != (dt0, gs0):
                return (f"ranks disagree on the sharded tensor at {path}: rank {r0} has {dt0} {list(gs0)}, "
                        f"rank {r} has {dt} {list(gs)}")
        holders: dict = {}
        for r, _dt, _gs, off, sh in entries:
            holders.setdefault((off, sh), []).append(r)
        boxes = list(holders)
        hit = find_overlap(boxes)
        if hit is not None:
            (oa, sa), (ob, sb) = boxes[hit[0]], boxes[hit[1]]
            return (f"sharded tensor at {path}: the piece of {_ranks(holders[boxes[hit[0]]])} at offsets "
                    f"{list(oa)} (shape {list(sa)}) overlaps the piece of {_ranks(holders[boxes[hit[1]]])} at "
                    f"{list(ob)} (shape {list(sb)}); {rule}")
        covered, total = sum(math.prod(sh) for _o, sh in boxes), math.prod(gs0)
        if covered != total:
            return (f"sharded tensor at {path}: the pieces of {_ranks({e[0] for e in entries})} cover {covered} "
                    f"of its {total} elements {list(gs0)}; {rule}")
    return None


def _replica_disagreement(ch: _Channel) -> str:
    """Rank 0, when the ranks' replica digests differ: which Replicated tensors differ
    between which ranks (each rank's manifest would name its own replica's blocks,
    but each block is written by one rank only: the snapshot would be broken)."""
    per_rank = []
    for r in range(ch.world):
        try:
            per_rank.append(dict(msgpack.unpackb(ch.get(f"rep/{r}"))) if ch.kv.check([ch.pfx + f"rep/{r}"]) else {})
        except Exception:  # noqa: BLE001
            per_rank.append({})
    paths = list(dict.fromkeys(p for d in per_rank for p in d))
    found = []
    for p in paths:
        groups: dict = {}
        for r, d in enumerate(per_rank):
            groups.setdefault(d.get(p), []).append(r)
        if len(groups) == 1:
            continue
        missing = groups.pop(None, [])
        ordered = sorted(groups.values(), key=lambda rs: (-len(rs), rs))
        parts = []
        if len(ordered) > 1:
            odd = [r for rs in ordered[1:] for r in rs]
            parts.append(f"{_ranks(odd)} {'disagrees' if len(odd) == 1 else 'disagree'} with {_ranks(ordered[0])}")
        if missing:
            parts.append(f"{_ranks(missing)} {'does' if len(missing) == 1 else 'do'} not hold it as Replicated")
        found.append(f"the Replicated tensor at {p} differs between ranks: {'; '.join(parts)}")
        if len(found) == 3:
            break
    if not found:
        found = ["the ranks' Replicated tensors differ"]
    return ("; ".join(found) + " (a Replicated tensor must be identical on every rank; nothing was published)")


def _open_channel(ctx, group, op, timeout, kv) -> _Channel:
    try:
        return _Channel(ctx, group, op, timeout, kv)
    except Exception as e:  # noqa: BLE001
        raise SnapshotAborted(f"cannot reach the process group's store: {e}") from e


def _outcome_round(ch: _Channel, body, what: str):
    """Run a collective's body, then the outcome round: every rank acks once it holds
    the outcome (a result or an error), and rank 0, which usually hosts the Store,
    returns or raises only once every rank still waiting has acked, so leaving cannot
    turn the others' outcome into a connection error. A success stays a success when
    some rank does not ack in time (it happened: the ref moved); rank 0 warns."""
    try:
        out = body()
    except Exception:
        ch.ack()
        if ch.rank == 0:
            ch.wait_acks()
        raise
    ch.ack()
    if ch.rank == 0:
        silent = ch.wait_acks()
        if silent:
            warnings.warn(f"{what} succeeded, but ranks {silent} did not confirm within the deadline that they "
                          "read the outcome (dead or stalled?): they may report an error for it", RuntimeWarning,
                          stacklevel=4)
    return out


def collective_put(publisher, ctx: CollectiveContext, state, *, planner, prepare, group, timeout, kv=None):
    """One snapshot of every rank's `state`, published once by rank 0 through `publisher`.
    prepare() -> SnapshotArgs checks the arguments (on every rank, inside the collective)."""
    ch = _open_channel(ctx, group, "put", timeout, kv)
    ch.cleanup_old()
    return _outcome_round(ch, lambda: _put(ch, publisher, state, planner, prepare),
                          f"collective put_snapshot (call {ch.pfx})")


def _put(ch: _Channel, publisher, state, planner, prepare):
    W, rank = ch.world, ch.rank
    args = _guard(ch, prepare)
    plan_ = _guard(ch, lambda: planner.plan(state))
    expected = args.expected
    exp_hex = None if expected is UNSET else ("-" if expected is None else expected.hex())
    # Where this rank's pieces of sharded tensors lie: rank 0 checks that they tile.
    pieces = [[p, dt, list(gs), list(off), list(sh)] for p, dt, gs, off, sh, rep in plan_.pieces if not rep]
    _guard(ch, lambda: (ch.set(f"hello/{rank}", msgpack.packb([args.step, args.ref, args.job, exp_hex, pieces])),
                        ch.add("hello_n")))
    pieces_by_rank: list = []  # rank 0: every rank's pieces of sharded tensors (the chunk index)
    if rank == 0:
        def agree():
            ch.wait_count("hello_n", W, "arrive", per_rank="hello")
            hellos = [msgpack.unpackb(ch.get(f"hello/{r}")) for r in range(W)]
            for r, h in enumerate(hellos):
                if h[:4] != hellos[0][:4]:
                    raise SnapshotAborted(
                        f"ranks disagree: rank 0 has (step, ref, job) = {tuple(hellos[0][:3])}, rank {r} has "
                        f"{tuple(h[:3])}")
            pieces_by_rank[:] = [h[4] for h in hellos]
            problem = _tiling([h[4] for h in hellos])
            if problem is not None:  # no rank's own mistake: every rank raises it as what it is
                ch.abort(problem, "invalid_argument", shared=True)
                raise InvalidArgument(problem)
            fence = publisher.fence()  # read before any rank looks at storage
            ch.set("go", msgpack.packb(fence))
            return fence
        try:
            fence = _guard(ch, agree)
        except SnapshotAborted as e:
            if not ch.aborted:
                ch.abort(str(e).removeprefix("snapshot aborted: "))
            raise
    else:
        fence = msgpack.unpackb(_guard(ch, lambda: ch.wait_key("go", "rank 0 to start the snapshot",
                                                                per_rank="hello")))

    def write():
        # Every rank writes under rank 0's fence: what it saw present under that epoch
        # needs no request (assets.Presence); a deletion phase since fences the commit.
        publisher.write_blocks(plan_, owns=lambda leaf, i: _owner(leaf.path, i, W) == rank, fence=fence)
        tree, _payloads = publisher.write_nodes(plan_.value, fence)
        from .plan import plan_stats, replica_digests  # torch: only where tensors are
        st = plan_stats(plan_)
        reps = replica_digests(plan_)
        rep = None
        if reps:  # the full list only for rank 0 to read if the replicas disagree; one digest in done
            ch.set(f"rep/{rank}", msgpack.packb(reps))
            rep = hashlib.blake2b(msgpack.packb(reps), digest_size=16).digest()
        publisher.sync()  # this rank's objects are durable before rank 0 publishes
        ch.set(f"done/{rank}", msgpack.packb({"tree": tree, "rep": rep,
                                              "stats": [st.bytes_total, st.bytes_new, st.blocks_total,
                                                        st.blocks_new, st.stored_new]}))
        ch.add("done_n")

    _guard(ch, write)
    if rank != 0:
        info = _await_result(ch, publisher, args)
        publisher.assets.presence.settle(fence)  # published: what this rank wrote is there
        return info

    def compose():
        ch.wait_count("done_n", W, "finish writing", per_rank="done")
        dones = [msgpack.unpackb(ch.get(f"done/{r}")) for r in range(W)]
        if len({d.get("rep") for d in dones}) > 1:
            why = _replica_disagreement(ch)
            ch.abort(why)
            raise SnapshotAborted(f"snapshot aborted: {why}")
        # The chunk index: by tensor path, which rank holds which piece, so a rank reads one
        # index plus the rank trees its region needs (O(W) node reads in all, not O(W^2)).
        ix: dict = {}
        for r, pieces in enumerate(pieces_by_rank):
            for p, _dt, _gs, off, sh in pieces:
                ix.setdefault(p, []).append({"l": [r, {"l": list(off)}, {"l": list(sh)}]})
        index, _ = publisher.write_nodes({"d": [[p, {"l": v}] for p, v in ix.items()]}, fence)
        top, _payloads = publisher.write_nodes({"W": {"world": W, "ranks": [d["tree"] for d in dones], "ix": index}},
                                               fence)
        sums = [sum(d["stats"][i] for d in dones) for i in range(5)]
        return top, dict(zip(("bytes_total", "bytes_new", "blocks_total", "blocks_new", "stored_new"), sums))

    top, stats = _guard(ch, compose)
    # The point of no return: from here no other rank may declare this snapshot aborted
    # (their deadlines may pass while the ref moves); only this rank can, if the move fails.
    won = _guard(ch, lambda: ch.claim(b"commit:" + top.hex().encode()))
    if not won.startswith(b"commit:"):  # another rank gave up first: its abort record follows
        _guard(ch, lambda: ch.wait_key("abort", "the abort record of the rank that aborted"))
        raise SnapshotAborted("snapshot aborted by another rank")  # pragma: no cover - wait_key raised
    try:
        info = publisher.commit(top, args, stats=stats, fence=fence, meta_extra={"world": W})
    except Exception as e:
        why = str(e) if isinstance(e, SnapshotAborted) else f"rank 0: {type(e).__name__}: {e}"
        ch.abort(why.removeprefix("snapshot aborted: "), force=True)
        if isinstance(e, TsckError):
            raise
        raise SnapshotAborted(f"snapshot aborted: {why}") from e
    try:
        ch.set("result", info.root.encode())
    except Exception as e:  # noqa: BLE001 - the ref moved: this rank's outcome is a success
        warnings.warn(f"snapshot {info.root[:16]} was published, but the other ranks could not be told: "
                      f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
    return info


def _await_result(ch: _Channel, publisher, args):
    """A rank other than 0, its part written: wait for the outcome. Once rank 0 has
    claimed "commit", this rank's deadline no longer aborts: it waits one more timeout
    for the result, then asks the ref table whether the ref moved to the snapshot."""
    try:
        root = _guard(ch, lambda: ch.wait_key("result", "rank 0 to publish", per_rank="done"))
        return publisher.info(Digest.parse(root.decode()))
    except _CommitUnderWay:
        pass
    ch.deadline = time.monotonic() + ch.timeout
    try:
        root = ch.wait_key("result", "rank 0 to finish publishing")
        return publisher.info(Digest.parse(root.decode()))
    except SnapshotAborted:
        raise
    except Exception:  # noqa: BLE001 - _CommitUnderWay again, or the store went away
        pass
    decided = b""
    try:
        decided = ch.kv.get(ch.pfx + "decided")
    except Exception:  # noqa: BLE001
        pass
    top = bytes.fromhex(decided.decode()[len("commit:"):]) if decided.startswith(b"commit:") else None
    info = None if top is None else publisher.find_published(args.ref, top, ch.t_start - CLOCK_SKEW)
    if info is not None:
        return info
    raise SnapshotAborted(f"snapshot aborted: rank {ch.rank}: rank 0 began publishing but reported no outcome "
                          f"within a further {ch.timeout:g}s, and {args.ref!r} has not moved to the snapshot")


def collective_checkout(ctx: CollectiveContext, target, *, resolve, read, group, timeout, kv=None):
    """Rank 0 resolves `target` (so every rank reads the same snapshot even if the ref
    moves meanwhile); every rank then reads its own view with read(root, rank)."""
    ch = _open_channel(ctx, group, "checkout", timeout, kv)
    ch.cleanup_old()
    if ch.rank != 0:
        # The outcome is the root (or the error); the rest is this rank's own reading.
        root = _outcome_round(ch, lambda: Digest.parse(
            _guard(ch, lambda: ch.wait_key("root", "rank 0 to resolve the target")).decode()), "")
        return read(root, ch.rank)

    def body():
        root = _guard(ch, lambda: resolve(target))
        _guard(ch, lambda: ch.set("root", root.hex().encode()))
        return read(root, 0)  # while the others pick up the root

    return _outcome_round(ch, body, f"collective checkout of {target!r}")
