"""Collective snapshots under torch.distributed.

put_snapshot and checkout are collective when torch.distributed is initialised
(or a group= is given). No tensor data crosses ranks, ever:

    every rank   plans (validates) its own state -> hello (step, ref, job, a 16-byte
                 digest of its pieces of sharded tensors: its layout)
    rank 0       checks that all ranks agree; asks the ranks whose layout it does not
                 hold (from the job's previous snapshot) for their pieces -> need; checks
                 that the pieces tile each sharded tensor exactly (once per layout of the
                 whole job), reads the gc fence -> go
    every rank   hashes and writes its own blocks (a Replicated tensor's blocks
                 are spread over the ranks: each is written by exactly one),
                 writes its own manifest sub-tree, syncs -> done (32-byte root + stats +
                 a digest of its Replicated tensors' block addresses)
    rank 0       checks that the replicas agree (else abort: nobody wrote the blocks of
                 a diverged replica), composes one commit whose top names every rank's
                 tree through a rank tree and a chunk index cut by offset range
                 (format/world.py; the index built once per layout it checks),
                 claims the outcome ("decided" = commit), moves the ref once -> result
                 (if a gc deletion phase fenced the move: a re-validation round, in
                 which every rank re-uploads what the phase deleted of its own part,
                 then the move again)
    every rank   acks once it holds the outcome (result or abort); rank 0, which
                 usually hosts the Store, returns only when every rank has acked

Coordination goes through the process group's c10d Store (set/add/wait with
our own deadlines), never through collectives, so a dead or stalled rank cannot
poison the process group: when the deadline passes, rank 0 (or any rank that
fails) claims the outcome "abort" and writes an abort key, every live rank
raises SnapshotAborted, nothing is published, and the group stays usable for
training. The claim (one compare_set) makes abort and commit exclusive: once
rank 0 has claimed "commit", a rank whose deadline passes waits for the
result instead of declaring an abort, so a published snapshot is never
reported aborted while the Store is reachable; and rank 0 beats a counter while it
publishes, so the others wait for a slow rank 0 and give up only on a silent one.
A call's keys are named by what the call is, never by how many calls a process has
made: a put by its ref, its step (which a collective put must be given) and how many
puts of that ref and step this process made before; a checkout by the put named last
and how many checkouts followed it. A rank that skips a call, or makes another in its
place, costs that one call (OutOfStep, named as such: each rank posts which call it is
in, and a rank waiting for another reads it), never every later one: the next call has
the same name on every rank again. A call's outcome stays in the Store until every rank
has acked it. Nobody polls: a rank blocks on the keys it needs (c10d
`wait`, in a few slices of its timeout), an abort writes those keys to wake it, and a
counter's last arrival posts the one key rank 0 blocks on, so a rank's requests per
call are a constant however long it waits. The argument is in
docs/design/collective.md.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Sequence

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import msgpack

from .errors import (AmbiguousTarget, InvalidArgument, InvalidName, OutcomeUnknown, OutOfStep, RefNotFound,
                     SnapshotAborted, TsckError)
from .ids import Digest
from .shard import find_overlap
from .validate import UNSET

if TYPE_CHECKING:  # annotations only: publish.py and plan.py are the Store's to load
    from .core import Core
    from .plan import Plan
    from .publish import Publisher
    from .validate import SnapshotArgs

__all__ = ["collective_put", "begin_put", "run_put", "collective_checkout", "is_collective", "CollectiveContext",
           "CollectiveJob", "CALLS", "StoreGroup"]

AUTO = object()

# How long rank 0 waits, past the deadline if need be, for every rank to confirm that
# it read the outcome, before it returns (a published snapshot: with a warning).
ACK_GRACE = 10.0
# Clock skew tolerated when a rank looks up in the ref table whether a silent rank 0 published.
CLOCK_SKEW = 120.0
# Rank 0 keeps the outcome of a call in the Store until every rank has acked it (a rank
# stopped across later calls reads it when it resumes), but of at most this many calls per
# (group, op): beyond, the oldest go (a rank that never comes back must not grow the Store).
KEEP_UNACKED = 256
# The keys of a call that every rank reads (rank 0 deletes them); the rest are per rank.
_SHARED_KEYS = ("hello_n", "hello_all", "need", "pieces_n", "pieces_all", "go", "done_n", "done_all", "result",
                "abort", "root", "decided", "acked", "ack_all", "beat", "tsum", "reval", "rdone_n", "rfail", "tier")
# A rank blocks on the keys it needs (c10d `wait`: the Store answers when they exist, no
# polling) in at most this many slices of its timeout, so that its requests per call are a
# constant however long it waits; between slices it looks at what a wait cannot see (rank
# 0's heartbeat). An abort wakes every waiter by writing the keys they block on (WOKEN).
WAIT_SLICES = 4
# The value an aborting rank writes into every key the others may be blocked on: whoever
# reads it reads the abort record. (No real value starts with a zero byte: see its writers.)
WOKEN = b"\x00aborted"
# Rank 0 keeps, per group, the validated layout of every rank (its pieces of sharded
# tensors, by digest) from the job's previous snapshot; of at most this many groups, and
# this many validated whole-job layouts (with their chunk index) per group.
LAYOUT_GROUPS = 4
LAYOUT_JOBS = 2


# The names of calls (a put's ref and step) whose count a process keeps (CollectiveContext).
OCCURRENCES = 4096
# What a look at a key that may not exist reads when it does not (_Channel.peek).
_ABSENT = b"\x00absent"


def _describe(op: str, ref, step) -> str:
    """A collective call, as a message names it."""
    if op == "put" and ref is not None:
        return f"put_snapshot of {ref!r} at step {step}"
    return "a checkout" if op == "checkout" else f"a {op} call"


def _short(v) -> str:
    """A piece of a call's name: an int as itself, anything else as a short hash."""
    return str(v) if type(v) is int else hashlib.blake2b(repr(v).encode(), digest_size=6).hexdigest()


class _CommitUnderWay(Exception):
    """This rank's deadline passed, but rank 0 had already claimed the outcome "commit"."""


class _RevalFailed(Exception):
    """This rank could not re-validate its part after a gc deletion phase (args[0]: the
    error it raises; rank 0 has been told through "rfail" and aborts)."""


class CollectiveContext:
    """Per process (CALLS, shared by every Store of the process): how many collectives
    of each (group, op) it has entered. Every rank makes the same collective calls in
    the same order, whichever Store object it makes them through, so the count names the
    call (the key prefix in the c10d Store) identically on every rank and never repeats
    within the process: a Store opened per snapshot, or two Stores used in turn, cannot
    meet an earlier call's keys. Rank 0 also lists here the calls whose shared keys are
    still in the c10d Store (until every rank has acked them)."""

    def __init__(self):
        self._seq: dict = {}
        self._names: dict = {}   # (group, op) -> {seq: the call's name (its keys' prefix)}
        self._occur: OrderedDict = OrderedDict()  # (group, "put", ref, step) | (group, "checkout", epoch) -> calls
        self._epoch: dict = {}   # group -> the name of the last put named in it
        self._made: dict = {}    # group -> the names of this process's recent puts (OutOfStep tells them apart)
        self._waiting: dict = {}  # group -> {name: step}: rank 0 saw a rank wait in that later put
        self._kept: dict = {}  # (group, op) -> [seq, ...], oldest first
        self._shared: dict = {}  # ((group, op), seq) -> the shared keys of that call (rank 0 deletes them)
        self._own: dict = {}   # (group, op) -> [(seq, [own key, ...]), ...]: calls ended here, keys still there
        self._layouts: OrderedDict = OrderedDict()  # (group, world) -> _Layouts (rank 0)
        self._lock = threading.Lock()

    def next(self, key, ident=None) -> tuple[int, str]:
        """-> (seq, name) of this process's next call of key = (group, op): seq orders its
        own calls (the cleanup of their keys), name is the call's on every rank that makes
        the same call: ident = (ref, step) names a put; a checkout is named after the last
        put named in the group. (Without ident: by the count, as a group with no steps.)"""
        gid, op = key
        with self._lock:
            seq = self._seq[key] = self._seq.get(key, 0) + 1
            if op == "put" and ident is not None:
                name = f"{_short(ident[0])}.{_short(ident[1])}.{self._count((gid, op) + tuple(map(repr, ident)))}"
                self._epoch[gid] = name
                made = self._made.setdefault(gid, OrderedDict())
                made[name] = True
                while len(made) > 64:
                    made.popitem(last=False)
            elif op == "checkout":
                epoch = self._epoch.get(gid, "0")
                name = f"{epoch}~{self._count((gid, op, epoch))}"
            else:
                name = f"n{seq}"
            names = self._names.setdefault(key, {})
            names[seq] = name
            while len(names) > 4 * KEEP_UNACKED:  # (the oldest: their keys are gone or given up)
                names.pop(next(iter(names)))
            return seq, name

    def made(self, gid, name: str) -> bool:
        """Whether this process named a put `name` lately (it made, or is making, that call)."""
        with self._lock:
            return name in self._made.get(gid, ())

    def remember_waiting(self, gid, name: str, step: int) -> None:
        """Rank 0: a rank waits in the later put `name` (it skipped rank 0's call)."""
        with self._lock:
            w = self._waiting.setdefault(gid, {})
            w[name] = step
            while len(w) > 16:
                w.pop(next(iter(w)))

    def passed_by(self, gid, name: str, step: int) -> list:
        """Rank 0, starting the put `name` at `step`: the remembered puts of other ranks it
        goes past without making (a lower or equal step, another name) -> [(name, step)];
        the one it makes is forgotten too (it joins it)."""
        with self._lock:
            w = self._waiting.get(gid, {})
            out = [(n, st) for n, st in w.items() if n != name and st <= step]
            for n in [n for n, st in w.items() if n == name or st <= step]:
                w.pop(n)
            return out

    def _count(self, o) -> int:
        """How many calls named `o` this process made, this one included (the last
        OCCURRENCES kept: a name older than those is not made again in practice)."""
        n = self._occur[o] = self._occur.pop(o, 0) + 1
        while len(self._occur) > OCCURRENCES:
            self._occur.popitem(last=False)
        return n

    def name(self, key, seq: int) -> str:
        with self._lock:
            return self._names.get(key, {}).get(seq, f"n{seq}")

    def finished(self, key, seq: int, shared) -> None:
        """Rank 0 ended call seq, whose shared keys are `shared`."""
        with self._lock:
            self._kept.setdefault(key, []).append(seq)
            self._shared[(key, seq)] = list(shared)

    def shared(self, key, seq: int) -> list:
        with self._lock:
            return self._shared.pop((key, seq), list(_SHARED_KEYS))

    def ended(self, key, seq: int, own=()) -> None:
        """This rank is done with call seq (asynchronous calls of several Stores may end
        out of order): its own keys (`own`, the ones it wrote) may go once two later calls
        have started."""
        with self._lock:
            self._own.setdefault(key, []).append((seq, list(own)))

    def own_to_delete(self, key, below: int) -> list:
        """-> [(seq, [own key, ...]), ...] of the calls ended here up to `below`."""
        with self._lock:
            own = self._own.get(key, [])
            out = [e for e in own if e[0] <= below]
            self._own[key] = [e for e in own if e[0] > below]
            return out

    def layouts(self, key, world: int) -> "_Layouts":
        """Rank 0: the validated layouts of group `key` (a new one, empty, for a new group
        or world size; the least recently used group beyond LAYOUT_GROUPS goes)."""
        with self._lock:
            k = (key, world)
            got = self._layouts.pop(k, None) or _Layouts(world)
            self._layouts[k] = got
            while len(self._layouts) > LAYOUT_GROUPS:
                self._layouts.popitem(last=False)
            return got

    def kept(self, key) -> list[int]:
        with self._lock:
            return list(self._kept.get(key, ()))

    def forget(self, key, seq: int) -> None:
        with self._lock:  # (two threads of one process may clean up at once)
            if seq in self._kept.get(key, ()):
                self._kept[key].remove(seq)


CALLS = CollectiveContext()


def _layout_digest(packed: bytes) -> bytes:
    """16 bytes over a rank's layout, `packed`: the msgpack of its pieces of sharded
    tensors, each [path, dtype, global shape, offsets, shape] (plain str and int lists),
    in its plan's order; the very bytes it sends when rank 0 asks. Equal digests mean
    equal layouts (blake2b-128), nothing less: rank 0 re-computes it over the bytes it is
    sent and refuses a mismatch."""
    return hashlib.blake2b(packed, digest_size=16, person=b"tsck-layout-v1").digest()


class _Pieces(Sequence):
    """Every rank's pieces (rank r's: self[r]), held as the msgpack each rank sent (~36 B
    a piece, where the decoded lists take ~470 B: rank 0 keeps W x N of them between
    snapshots) and decoded when read (the tiling check and the chunk index: once per
    whole-job layout)."""

    def __init__(self, packed: list):
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [msgpack.unpackb(b) for b in self.packed[i]]
        return msgpack.unpackb(self.packed[i])


def _job_digest(digests: list) -> bytes:
    """16 bytes over every rank's layout digest, in rank order (the whole job's layout)."""
    return hashlib.blake2b(b"".join(digests), digest_size=16, person=b"tsck-job-v1").digest()


class _Layouts:
    """Rank 0, per group: each rank's layout (digest, pieces) as of the last layout of the
    whole job that passed the tiling check, and the whole-job layouts that passed it (by
    _job_digest, the last LAYOUT_JOBS, each with the chunk index compose() wrote for it).
    So a snapshot whose layout repeats costs each rank a 16-byte digest in its hello and
    rank 0 O(W) work: a rank sends its pieces only when its digest is not the one held
    here, and the tiling is checked again whenever the whole job's digest is new (one
    piece moved anywhere). Per process (CALLS): a new rank 0 process asks every rank."""

    def __init__(self, world: int):
        self.digests: list = [None] * world
        self.pieces: list = [None] * world  # rank r's pieces, packed (_Pieces)
        self.jobs: OrderedDict = OrderedDict()  # job digest -> (index node, its payloads) or None
        self.lock = threading.Lock()

    def view(self) -> tuple[list, list]:
        with self.lock:
            return list(self.digests), list(self.pieces)

    def validated(self, job: bytes) -> bool:
        with self.lock:
            return job in self.jobs

    def remember(self, job: bytes, digests: list, packed: list) -> None:
        """A whole-job layout that passed the tiling check (packed: each rank's pieces)."""
        with self.lock:
            self.digests[:], self.pieces[:] = digests, packed
            self.jobs[job] = self.jobs.pop(job, None)
            while len(self.jobs) > LAYOUT_JOBS:
                self.jobs.popitem(last=False)

    def index(self, job: bytes):
        with self.lock:
            return self.jobs.get(job)

    def set_index(self, job: bytes, index) -> None:
        with self.lock:
            if job in self.jobs:
                self.jobs[job] = index


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


class StoreGroup:
    """A collective group given as (a c10d Store client, this member's rank, the world
    size), for group= of put_snapshot and checkout, instead of a torch.distributed process
    group: the protocol only ever talks through the Store, so members that share one
    (a torch.distributed.TCPStore, each with its own client) can make collective calls
    without a process group. This is how benches/bench_scale.py runs thousands of ranks
    as threads of one process (a process group cannot be initialised per thread). Each
    member must also count its calls in a CollectiveContext of its own (a Store's
    `_collective`): CALLS is per process, and the simulated ranks share one process.
    name: the key prefix of the group's calls in the Store. kv: any c10d Store client
    (set, get, add, check, compare_set, delete_key, wait(keys, timedelta); multi_get if
    it has one)."""

    def __init__(self, kv, rank: int, world: int, name: str = "kv"):
        if not (type(world) is int and world >= 1 and type(rank) is int and 0 <= rank < world):  # (not a bool)
            raise InvalidArgument(f"StoreGroup: rank must be in [0, world) and world >= 1, got rank={rank!r}, "
                                  f"world={world!r}")
        if not isinstance(name, str) or not name or "/" in name:
            raise InvalidArgument(f"StoreGroup: name must be a non-empty string without '/', got {name!r}")
        self.kv, self.rank, self.world, self.name = kv, rank, world, name


class _Channel:
    """Keys under one prefix in the c10d Store, waited on with a deadline."""

    def __init__(self, ctx: CollectiveContext, group, op: str, timeout: float, kv=None, ident=None):
        if isinstance(group, StoreGroup):  # no torch.distributed at all: the group says it all
            self.rank, self.world = group.rank, group.world
            self.kv = kv if kv is not None else group.kv
            gid = group.name
        else:
            dist = _dist()
            g = None if group in (AUTO, None, True) else group
            self.rank = dist.get_rank(g)
            if self.rank < 0:  # (torch's answer for a process outside the group) before it counts a call
                raise InvalidArgument(
                    f"this process (global rank {dist.get_rank()}) is not a member of the process group passed as "
                    "group=: a collective put_snapshot or checkout is made by the group's members only "
                    "(group=False for this process alone); nothing was written")
            self.world = dist.get_world_size(g)
            self.kv = kv if kv is not None else dist.distributed_c10d._get_default_store()
            gid = "world" if g is None else "g" + "-".join(map(str, dist.get_process_group_ranks(g)))
        self.ctx, self.key = ctx, (gid, op)
        self.seq, self.name = ctx.next(self.key, ident)
        self.ident = ident
        self.base = f"tsck/{gid}/{op}/"
        self.pfx = f"{self.base}{self.name}/"
        self.at = f"tsck/{gid}/at/"  # at/{rank}: the call each rank is in (OutOfStep names it)
        self.op = op
        self.timeout = timeout
        self.restart()
        self.late: list[int] = []  # ranks known not to be waiting for the outcome (dead or stalled)
        self.aborted = False       # this rank has written (or read) the abort record: it aborts nothing more
        self.abort_kind: str | None = None
        self.round = 0             # re-validation rounds asked for or done (the outcome's key: _result_key)
        self.mine: list[str] = []  # the keys of this rank's own that it wrote (it deletes them later)
        self.extra: list[str] = []  # shared keys beyond _SHARED_KEYS (those of re-validation rounds)
        # Once the call succeeded: its shared keys (the last rank to ack deletes these);
        # None: any of _SHARED_KEYS (an abort writes WOKEN into several).
        self.used: list[str] | None = None
        self.acked = False  # ack() was called
        # One blocking wait lasts at most this long: WAIT_SLICES of them span the timeout.
        self.slice = max(0.01, timeout / WAIT_SLICES)

    def shared_keys(self) -> list[str]:
        return (list(_SHARED_KEYS) if self.used is None else self.used) + self.extra

    def restart(self) -> None:
        """The call's deadline counts from now (when it starts talking to the others)."""
        self.deadline = time.monotonic() + self.timeout
        self.t_start = time.time()

    def post_at(self) -> None:
        """at/{rank}: the call this rank is in now (one set per call): a rank that waits for
        this one in another call reads it, to tell a skipped call from a slow rank."""
        ref, step = self.ident if self.ident is not None else (None, None)
        try:
            self.kv.set(self.at + str(self.rank), msgpack.packb([self.op, self.name, ref, step, self.t_start]))
        except Exception:  # noqa: BLE001 - the call itself will meet the store's failure
            pass

    def abort_call(self, name: str, step, why: str) -> None:
        """Abort another put of this group by name: one this rank will never make (it skipped
        it, or went past it), in which other ranks wait. Its ranks raise OutOfStep."""
        pfx = f"{self.base}{name}/"
        try:
            if self.kv.compare_set(pfx + "decided", b"", b"abort") != b"abort":
                return  # (decided already: committed, or aborted by another)
            why = f"the ranks are out of step: {why}"
            self.kv.set(pfx + "abort", msgpack.packb(["out_of_step", why[:4000], [self.rank], False,
                                                      {"name": self.name, "step": self.ident[1]}]))
            for k in _WAKE["put"] + ("result",):
                self.kv.set(pfx + k, WOKEN)
        except Exception:  # noqa: BLE001 - the store is gone: the call itself will say so
            pass

    def peek(self, key: str) -> bytes | None:
        """The value of a key that may not exist, in one request (a get would block on a
        missing key, a check then a get is two): a compare_set whose expected value no key
        holds answers the value, or that expected value when there is none."""
        v = self.kv.compare_set(key, _ABSENT, _ABSENT)
        return None if v == _ABSENT else v

    def check_entry(self) -> None:
        """At the start of a put: is a rank already in a call this one can never meet?
        Rank 0 reads the last put a rank entered before it (`latest`); any other rank reads
        rank 0's at/0, and posts itself as `latest` when rank 0 is not in this call yet (one
        or two requests). A call that rank 0 waits in and this rank skipped is aborted at
        once (its ranks raise OutOfStep, and rank 0 then comes to this one); this call, if
        rank 0 or another rank is already past it, raises OutOfStep at once."""
        if self.op != "put" or self.ident is None or type(self.ident[1]) is not int:
            return
        ref, step = self.ident
        gid = self.key[0]
        latest = f"tsck/{gid}/latest"
        try:
            if self.rank == 0:
                for name, st in self.ctx.passed_by(gid, self.name, step):
                    self.abort_call(name, st, f"rank 0 went on to {self.describe()} without making the put of "
                                              f"{ref!r} at step {st}, in which other ranks wait")
                got = self.peek(latest)
                rec = msgpack.unpackb(got) if got else None
                src = "a rank"
            else:
                got = self.peek(self.at + "0")
                rec = msgpack.unpackb(got)[1:4] if got else None
                src = "rank 0"
                if not (isinstance(rec, list) and rec[:1] == [self.name]):  # rank 0 is not in this call yet
                    self.kv.set(latest, msgpack.packb([self.name, ref, step]))
        except Exception:  # noqa: BLE001 - only the early word is lost: the waits still tell
            return
        if not (isinstance(rec, list) and len(rec) == 3):
            return
        name, r_ref, r_step = rec
        if name == self.name or r_ref != ref or type(r_step) is not int or self.ctx.made(gid, name):
            return
        if r_step > step:  # someone is past this call: it can never complete
            self._check_abort()  # (unless it ended already: its own outcome, as recorded, first)
            if self.rank == 0:
                self.ctx.remember_waiting(gid, name, r_step)
            why = (f"rank {self.rank}: the ranks are out of step: this rank is in {self.describe()}, but {src} is "
                   f"already in the put at step {r_step}, without this one (a rank skipped a call or passed another "
                   "step). Nothing was published; the next call the ranks make alike goes ahead")
            if self.abort(why, "out_of_step", extra={"name": name, "step": r_step}):
                raise OutOfStep(f"snapshot aborted: {why}")
        elif self.rank != 0 and r_step < step:  # rank 0 waits in a put this rank skipped
            self.abort_call(name, r_step, f"rank {self.rank} skipped this call: it is in {self.describe()}. "
                                          "Nothing was published; the next call the ranks make alike goes ahead")

    def where(self, ranks) -> dict:
        """-> {rank: (op, name, ref, step, since)} for those of `ranks` that posted at/."""
        out = {}
        for r in ranks:
            try:
                got = self.peek(self.at + str(r))
                rec = msgpack.unpackb(got) if got else None
                if isinstance(rec, list) and len(rec) == 5 and rec[1] != self.name:
                    out[r] = tuple(rec)
            except Exception:  # noqa: BLE001 - only a better message is lost
                pass
        return out

    def describe(self) -> str:
        return _describe(self.op, *(self.ident if self.ident is not None else (None, None)))

    def skipped_by(self, where: dict) -> list[int]:
        """The ranks of `where` that are in a put of this call's ref at a later step: they
        made that one without this one (skipped it), so this call can never complete."""
        if self.op != "put" or self.ident is None:
            return []
        ref, step = self.ident
        return [r for r, (op, _n, r_ref, r_step, _t) in where.items()
                if op == "put" and r_ref == ref and type(r_step) is int and type(step) is int and r_step > step]

    def out_of_step(self, where: dict, late: list[int]) -> str:
        """Why `late` ranks are not in this call, from where they are."""
        parts = []
        for r in late:
            if r in where:
                op, _name, ref, step, since = where[r]
                what = _describe(op, ref, step)
                parts.append(f"rank {r} is in {what} (for {max(0.0, time.time() - since):.0f}s)")
        if not parts:
            return ""
        return (f"the ranks are out of step: this rank is in {self.describe()}, but " + "; ".join(parts)
                + ": a rank skipped a call or made another in its place (every rank must make the same "
                "collective calls, in the same order, with the same step). Nothing was published; the next "
                "call the ranks make alike goes ahead")

    def set(self, k: str, v: bytes) -> None:
        self.kv.set(self.pfx + k, v)

    def get(self, k: str) -> bytes:
        return self.kv.get(self.pfx + k)

    def add(self, k: str, n: int = 1) -> int:
        return self.kv.add(self.pfx + k, n)

    def set_mine(self, k: str, v: bytes) -> None:
        """Set a key of this rank's own (k/{rank}), noted for its later deletion."""
        key = f"{k}/{self.rank}"
        self.set(key, v)
        self.mine.append(key)

    def get_many(self, ks) -> list[bytes]:
        """One request (multi_get) for keys that exist."""
        keys = [self.pfx + k for k in ks]
        mg = getattr(self.kv, "multi_get", None)
        return list(mg(keys)) if mg is not None else [self.kv.get(k) for k in keys]

    def arrive(self, k: str, value: bytes, expect: int) -> None:
        """Post k/{rank} and count it in k_n; the rank whose count reaches `expect` posts
        k_all, the one key rank 0 blocks on (O(1) requests per rank, and one for rank 0
        whatever W). A set, never a compare_set: the TCPStore wakes no waiter on a
        compare_set. (If it overwrites an abort's WOKEN, rank 0 goes on to its claim,
        which the abort holds: it raises there.)"""
        self.set_mine(k, value)
        if self.add(f"{k}_n") == expect:
            self.set(f"{k}_all", b"1")

    def claim(self, outcome: bytes) -> bytes:
        """The outcome of this call: the first claim wins (an atomic compare_set), and
        this returns the winner's."""
        return self.kv.compare_set(self.pfx + "decided", b"", outcome)

    def abort(self, why: str, kind: str = "snapshot_aborted", *, late=(), shared: bool = False,
              force: bool = False, extra: dict | None = None) -> bool:
        """Abort this call on every rank. False, and nothing written, when rank 0 has
        already claimed the outcome "commit" (it may be moving the ref right now):
        then nobody may say aborted, except rank 0 itself if its commit fails (force).
        shared: every rank raises the error of `kind`, not SnapshotAborted (extra: its
        fields, as OutcomeUnknown's root and ref)."""
        self.late = sorted(set(self.late) | set(late))
        try:
            if not force and self.claim(b"abort") != b"abort":
                return False
            self.aborted = True
            self.abort_kind = kind
            self.kv.set(self.pfx + "abort", msgpack.packb([kind, why[:4000], self.late, shared, extra or {}]))
            # Wake whoever is blocked on a key of this call (after the record: a woken rank reads it).
            for k in _WAKE[self.op] + ((_result_key(self.round),) if self.op == "put" else ()):
                self.kv.set(self.pfx + k, WOKEN)
        except Exception:  # noqa: BLE001 - the store itself is gone: nothing more we can tell anyone
            pass
        return True

    def _check_abort(self) -> None:
        if self.kv.check([self.pfx + "abort"]):
            kind, why, late, shared, extra = "snapshot_aborted", "unreadable abort record", [], False, {}
            try:
                rec = msgpack.unpackb(self.kv.get(self.pfx + "abort"))
                kind, why = rec[:2]
                late, shared = (rec[2], rec[3]) if len(rec) >= 4 else ([], False)
                extra = rec[4] if len(rec) >= 5 and isinstance(rec[4], dict) else {}
                self.late = sorted(set(self.late) | {int(r) for r in late})
            except Exception:  # noqa: BLE001
                pass
            # Whatever this raises is the abort's own error: _guard must not abort again (a
            # second claim of "abort" reads "abort", and its record, not shared, would
            # replace the first: the ranks reading it after would raise another error).
            self.aborted = True
            if kind == "outcome_unknown" and shared:
                # Rank 0's ref move went unanswered: the snapshot may be published. Every rank
                # says so (never "nothing published"), with the root and ref to look up.
                root = extra.get("root")
                raise OutcomeUnknown(why, root=bytes.fromhex(root) if isinstance(root, str) else None,
                                     ref=extra.get("ref"))
            if kind == "out_of_step":
                self.abort_kind = kind
                if self.rank == 0 and isinstance(extra.get("name"), str) and type(extra.get("step")) is int:
                    self.ctx.remember_waiting(self.key[0], extra["name"], extra["step"])
                raise OutOfStep(f"snapshot aborted: {why}")
            cls = _REraise.get(kind) if self.op == "checkout" or shared else None
            if cls is not None:  # the user's mistake, told to every rank as what it is
                raise cls(why)
            raise SnapshotAborted(f"snapshot aborted: {why}")

    def ack(self) -> None:
        """(Once per call: rank 0 acks before it posts a result, so that the last rank to ack,
        which deletes the call's shared keys, is another one when it can be.) This rank holds the outcome (it returns or raises next). ack/{rank} tells rank 0
        who is still reading (rank 0 itself needs none); the counter "acked" tells when the
        outcome may go: the rank that makes it W posts "ack_all", on which rank 0 blocks,
        and deletes the call's other shared keys (every rank holds the outcome: nobody reads
        them again), so rank 0 does not make a dozen deletes per call."""
        if self.acked:
            return
        self.acked = True
        try:
            if self.rank != 0:
                self.set_mine("ack", b"1")
            if self.kv.add(self.pfx + "acked", 1) == self.world:
                for k in self.shared_keys():
                    if k not in ("acked", "ack_all"):  # (rank 0 blocks on ack_all, and later deletes both)
                        self.kv.delete_key(self.pfx + k)
                # Last: rank 0, which may take the Store down when it returns, waits for the deletes too.
                self.kv.set(self.pfx + "ack_all", b"1")
        except Exception:  # noqa: BLE001 - the store is gone: nobody is waiting for us any more
            pass

    def wait_acks(self) -> list[int]:
        """Rank 0 (usually the host of the Store): wait until every rank that is still
        waiting for the outcome has read it, so that leaving (and taking the Store down)
        cannot turn their outcome into a connection error. Ranks known to be dead or
        stalled are not waited for. -> the ranks that did not ack in time."""
        expect = [r for r in range(1, self.world) if r not in self.late]  # (rank 0 posts no ack key)
        if self.abort_kind == "out_of_step":  # a rank in another call never acks this one
            try:
                expect = [r for r in expect if r not in self.missing("hello", expect)]
            except Exception:  # noqa: BLE001 - the store is gone: nobody can read anything from it now
                return []
        # Every rank: "ack_all" (a rank gone on to later calls may have deleted its ack key
        # already); else the ack keys of those still expected.
        keys = ["ack_all"] if len(expect) == self.world - 1 else [f"ack/{r}" for r in expect]
        if not keys:
            return []
        deadline = max(self.deadline, time.monotonic() + min(self.timeout, ACK_GRACE))
        try:
            while not self._block(keys, deadline):
                if time.monotonic() >= deadline:
                    if self.kv.add(self.pfx + "acked", 0) >= self.world:
                        return []
                    return [r for r in expect if not self.kv.check([self.pfx + f"ack/{r}"])]
        except Exception:  # noqa: BLE001 - the store is gone: nobody can read anything from it now
            return []
        return []

    def missing(self, k: str, among=None) -> list[int]:
        """Ranks (of `among`, default all) that have not posted key k/{rank}."""
        return [r for r in (range(self.world) if among is None else among)
                if not self.kv.check([self.pfx + f"{k}/{r}"])]

    def cleanup_old(self) -> None:
        """So the Store does not grow with every snapshot: delete this rank's own keys of
        the calls it has ended, two calls or more ago (nobody reads them after that), and on
        rank 0 the last two shared keys of each earlier call once every rank has acked it
        ("ack_all": the last rank to ack deleted the others). The outcome of a call some
        rank has not acked (a stopped rank) stays, so that rank reads the truth when it
        resumes, however many calls later; of at most KEEP_UNACKED calls (a rank that never
        comes back: then all its shared keys go)."""
        def delete(keys):
            for k in keys:
                try:
                    self.kv.delete_key(k)
                except Exception:  # noqa: BLE001 - best effort
                    pass
        for seq, own in self.ctx.own_to_delete(self.key, self.seq - 2):
            delete(f"{self.base}{self.ctx.name(self.key, seq)}/{k}" for k in own)
        if self.rank != 0:
            return
        kept = self.ctx.kept(self.key)
        for i, seq in enumerate(kept):  # oldest first; a rank acks calls in order
            old = f"{self.base}{self.ctx.name(self.key, seq)}/"
            try:
                acked = self.kv.check([old + "ack_all"])
            except Exception:  # noqa: BLE001 - the store is unreachable: the call itself will say so
                return
            if not acked and len(kept) - i <= KEEP_UNACKED:
                break
            shared = self.ctx.shared(self.key, seq)
            delete(old + k for k in (("ack_all", "acked") if acked else shared))
            self.ctx.forget(self.key, seq)

    def _block(self, keys, until: float) -> bool:
        """Block until every key of this call in `keys` exists (c10d `wait`: the Store
        answers when they do; one request), for at most one slice and not past `until`.
        -> whether they exist."""
        left = until - time.monotonic()
        if left <= 0:
            return False
        try:
            self.kv.wait([self.pfx + k for k in keys], datetime.timedelta(seconds=min(left, self.slice)))
            return True
        except Exception as e:  # noqa: BLE001 - told apart below
            if _wait_timed_out(e):
                return False
            raise

    def wait_for(self, keys, what: str, per_rank: str | None = None, among=None, of_ranks: bool = False,
                 also=()) -> list:
        """Block until every key in `keys` exists (at most WAIT_SLICES + 1 requests however
        long it takes), then read them in one request. A woken wait (WOKEN: the call was
        aborted) raises the abort; the deadline aborts the call. per_rank: the key every
        rank (of `among`) posts before these can come: on a timeout the ranks that have not
        posted it are named (and not waited for in the outcome round). also: keys that exist
        once these do (unless woken), read after them in one request (their values follow:
        not with them, as a get of a key that does not exist blocks)."""
        while not self._block(keys, self.deadline):
            if time.monotonic() >= self.deadline:
                self._timed_out(what, per_rank, among, of_ranks)
            if per_rank is not None:  # one slice passed: a rank that skipped this call never comes
                self._skipped(per_rank, among)
        vals = self.get_many(keys)
        if WOKEN in vals:
            self._check_abort()
            raise SnapshotAborted("snapshot aborted by another rank")  # (the record is written first)
        return vals + (self.get_many(also) if also else [])

    def _skipped(self, per_rank: str, among) -> None:
        """Between two slices of a wait: abort this call as OutOfStep if a rank it waits
        for is already in a later put of the same ref (it skipped this one)."""
        if per_rank != "hello":  # (a skip shows at a call's start; later waits are for slow ranks)
            return
        self._check_abort()
        # Rank 0 looks at the late ranks (while some are late), the others at rank 0 alone
        # (O(1) requests each per slice, whatever W).
        late = self.missing(per_rank, among if self.rank == 0 else [0])[:16]
        if not late:
            return
        where = {r: w for r, w in self.where(late).items() if not self.ctx.made(self.key[0], w[1])}
        gone = self.skipped_by(where)
        if gone:
            if self.rank == 0:
                for r in gone:
                    self.ctx.remember_waiting(self.key[0], where[r][1], where[r][3])
            why = f"rank {self.rank}: {self.out_of_step(where, gone)}"
            if self.abort(why, "out_of_step", late=gone):
                raise OutOfStep(f"snapshot aborted: {why}")

    def _timed_out(self, what: str, per_rank, among, of_ranks: bool):
        self._check_abort()
        late = self.missing(per_rank, among) if per_rank is not None else []
        if of_ranks:  # `what` is what the late ranks did not do
            why = f"rank {self.rank}: ranks {late} did not {what} within {self.timeout:g}s"
        else:
            why = f"rank {self.rank}: timed out after {self.timeout:g}s waiting for {what}"
            if late:
                why += f" (ranks {late} are behind)"
        where = self.where(late[:16]) if late else {}
        odd = self.skipped_by(where) + [r for r, w in where.items() if w[0] != self.op]
        step = self.out_of_step(where, sorted(set(odd)))
        if step:
            why += f"; {step}"
        elif where:  # behind, in an earlier call: slow or stopped, not out of step
            why += "; " + "; ".join(f"rank {r} is still in an earlier call ({_describe(w[0], w[2], w[3])}, for "
                                    f"{max(0.0, time.time() - w[4]):.0f}s)" for r, w in where.items())
        if not self.abort(why, "out_of_step" if step else "snapshot_aborted", late=late):
            raise _CommitUnderWay()
        raise (OutOfStep if step else SnapshotAborted)(f"snapshot aborted: {why}")

    def wait_key(self, k: str, what: str, per_rank: str | None = None, among=None) -> bytes:
        return self.wait_for([k], what, per_rank, among)[0]

    def wait_all(self, k: str, what: str, among=None) -> list[bytes]:
        """Rank 0: until every rank (of `among`, default all) has arrived at k (arrive())
        -> what each posted (k/{rank})."""
        ranks = range(self.world) if among is None else among
        return self.wait_for([f"{k}_all"], what, k, among, of_ranks=True, also=[f"{k}/{r}" for r in ranks])[1:]


def _wait_timed_out(e: Exception) -> bool:
    """A c10d wait that ran out its time (DistStoreError "wait timeout ..."), not a Store
    that went away (DistNetworkError)."""
    return (isinstance(e, RuntimeError) and type(e).__name__ != "DistNetworkError"
            and "timeout" in str(e).lower())


def _result_key(n: int) -> str:
    """The key the ranks other than 0 block on for the outcome after n re-validation
    rounds: rank 0 writes REVAL into the previous one to start a round (a wait cannot
    see two keys at once, and a key, once written, wakes every later wait on it)."""
    return "result" if n == 0 else f"result.{n}"


# The keys a rank may be blocked on, by op (an abort writes WOKEN into them).
_WAKE = {"put": ("hello_all", "need", "pieces_all", "go", "done_all"), "checkout": ("hello_all", "root")}
REVAL = b"\x00reval"
# The shared keys of a checkout whose root was posted (no abort).
_CHECKOUT_KEYS = ["hello_n", "hello_all", "tsum", "root", "acked", "ack_all"]


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
    except (SnapshotAborted, _CommitUnderWay, _RevalFailed):
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


def _open_channel(ctx, group, op, timeout, kv, ident=None) -> _Channel:
    try:
        return _Channel(ctx, group, op, timeout, kv, ident)
    except InvalidArgument:
        raise
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
        ch.ctx.ended(ch.key, ch.seq, ch.mine)
        if ch.rank == 0:
            ch.wait_acks()
            ch.ctx.finished(ch.key, ch.seq, ch.shared_keys())
        raise
    ch.ack()
    ch.ctx.ended(ch.key, ch.seq, ch.mine)
    if ch.rank == 0:
        silent = ch.wait_acks()
        ch.ctx.finished(ch.key, ch.seq, ch.shared_keys())
        if silent:
            warnings.warn(f"{what} succeeded, but ranks {silent} did not confirm within the deadline that they "
                          "read the outcome (dead or stalled?): they may report an error for it", RuntimeWarning,
                          stacklevel=4)
    return out


@dataclass(frozen=True)
class CollectiveJob:
    """What one collective put or checkout needs, built by the Store that makes it; nothing
    here calls back into the Store. A put fills prepare and plan, a checkout read."""
    core: "Core"                     # the store's core: rank 0 resolves the target with it
    publisher: "Publisher"           # rank 0 publishes the snapshot through it
    calls: CollectiveContext         # the process's call names: they name the call's keys
    group: Any                       # the process group (AUTO: the default one)
    timeout: float                   # seconds every rank waits for the others
    prepare: "Callable[[], SnapshotArgs] | None" = None  # put: the arguments, checked inside the call
    plan: "Callable[[], Plan] | None" = None             # put: this rank's plan (validates its state)
    read: "Callable[[Digest, int], Any] | None" = None   # checkout: the state of a root, as a rank reads it
    kv: Any = None                   # the c10d store (None: the group's default one)
    # Through local tiers (tier.collective.CollectiveTier: each rank's store is its own tier): each
    # rank writes under its own tier's fence, rank 0 hands its commit and top nodes to the
    # others, and every rank queues its upload once the snapshot is published locally.
    tier: Any = None
    resolve: "Callable[[str], Digest] | None" = None     # checkout: rank 0 resolves with it (default core.resolve)
    timing: "Callable[[], Any] | None" = None  # put: -> publish.Timing of this rank's call (rank 0's is recorded)
    ident: Any = None  # put: (ref, step) as the caller gave them: they name the call (CollectiveContext.next)


def collective_put(job: CollectiveJob):
    """One snapshot of every rank's state (job.plan), published once by rank 0 through
    job.publisher. job.prepare() -> SnapshotArgs checks the arguments (on every rank,
    inside the collective)."""
    return run_put(begin_put(job), job)


def begin_put(job: CollectiveJob) -> "_Channel":
    """Name the next collective put of this process (on the caller's thread: the names
    follow the order of the calls, the same on every rank) without talking to anyone
    yet; run_put(channel, job) makes it, later and on any thread. An asynchronous put
    stages its state between the two."""
    return _open_channel(job.calls, job.group, "put", job.timeout, job.kv, job.ident)


def run_put(ch: "_Channel", job: CollectiveJob):
    """The collective put named by ch: job.prepare() -> SnapshotArgs and job.plan() ->
    Plan run inside it (a failure of either aborts it on every rank). The deadline counts
    from here, not from begin_put: a staged put may wait behind earlier ones."""
    ch.restart()
    ch.post_at()
    ch.cleanup_old()
    def body():
        ch.check_entry()
        return _put(ch, job.publisher, job.plan, job.prepare, job.tier, job.timing)
    return _outcome_round(ch, body, f"collective put_snapshot (call {ch.pfx})")


def _put(ch: _Channel, publisher, plan, prepare, tier=None, timing=None):
    W, rank = ch.world, ch.rank
    args = _guard(ch, prepare)
    plan_ = _guard(ch, plan)
    expected = args.expected
    exp_hex = None if expected is UNSET else ("-" if expected is None else expected.hex())
    # Where this rank's pieces of sharded tensors lie: rank 0 checks that they tile. The
    # hello carries their digest; the pieces themselves go only if rank 0 asks ("need").
    pieces = msgpack.packb([[p, dt, list(gs), list(off), list(sh)]
                            for p, dt, gs, off, sh, rep in plan_.pieces if not rep])
    digest = _layout_digest(pieces)
    _guard(ch, lambda: ch.arrive("hello", msgpack.packb([args.step, args.ref, args.job, exp_hex, digest]), W))
    pieces_by_rank: Sequence = ()  # rank 0: every rank's pieces of sharded tensors (the chunk index)
    layout: dict = {}  # rank 0: the whole job's layout digest
    if rank == 0:
        layouts = ch.ctx.layouts(ch.key, W)

        def agree():
            nonlocal pieces_by_rank
            hellos = [msgpack.unpackb(h) for h in ch.wait_all("hello", "arrive")]
            for r, h in enumerate(hellos):
                if h[:4] != hellos[0][:4]:
                    raise SnapshotAborted(
                        f"ranks disagree: rank 0 has (step, ref, job) = {tuple(hellos[0][:3])}, rank {r} has "
                        f"{tuple(h[:3])}")
                if not (isinstance(h[4], bytes) and len(h[4]) == 16):
                    raise SnapshotAborted(f"rank {r}'s hello carries no layout digest (another version of "
                                          "tensorstore_ck?)")
            digests = [h[4] for h in hellos]
            held, held_pieces = layouts.view()
            need = [r for r in range(1, W) if digests[r] != held[r]]
            got = {0: pieces}
            if need:  # those ranks send their pieces; the others wait for "go"
                ch.set("need", msgpack.packb([need, None]))
                for r, v in zip(need, ch.wait_all("pieces", "send their layout", among=need)):
                    if _layout_digest(v) != digests[r]:  # never hold pieces under a digest not theirs
                        raise SnapshotAborted(f"rank {r} sent a layout that does not match its digest")
                    got[r] = v
            layout["need"] = need
            pieces_by_rank = _Pieces([got[r] if r in got else held_pieces[r] for r in range(W)])
            layout["job"] = job = _job_digest(digests)
            if not layouts.validated(job):  # a new layout anywhere: the whole check, as on a first snapshot
                problem = _tiling(pieces_by_rank)
                if problem is not None:  # no rank's own mistake: every rank raises it as what it is
                    ch.abort(problem, "invalid_argument", shared=True)
                    raise InvalidArgument(problem)
                layouts.remember(job, digests, pieces_by_rank.packed)
            fence = publisher.fence()  # read before any rank looks at storage
            if need:
                ch.set("go", msgpack.packb(fence))
            else:
                ch.set("need", msgpack.packb([[], fence]))
            return fence
        try:
            fence = _guard(ch, agree)
        except SnapshotAborted as e:
            if not ch.aborted:
                ch.abort(str(e).removeprefix("snapshot aborted: "))
            raise
    else:
        started: dict = {}

        def start():
            need, fence = msgpack.unpackb(ch.wait_key("need", "rank 0 to start the snapshot", per_rank="hello"))
            started["need"] = need
            if fence is None:  # rank 0 checks a layout it does not hold (all of it, or these ranks')
                if rank in need:
                    ch.arrive("pieces", pieces, len(need))  # (the bytes its digest is over)
                fence = msgpack.unpackb(ch.wait_key("go", "rank 0 to check the layout", per_rank="pieces",
                                                    among=need))
            return fence
        fence = _guard(ch, start)

    owns = lambda leaf, i: _owner(leaf.path, i, W) == rank  # noqa: E731
    part: dict = {}  # this rank's node payloads: re-written if a gc deletion phase fences the commit

    def write():
        # Every rank writes under rank 0's fence: what it saw present under that epoch
        # needs no request (assets.Presence); a deletion phase since fences the commit.
        # Through local tiers each rank writes to its own tier, another store with its own
        # gc epoch: under that one (rank 0's would be another table's number).
        wfence = part["fence"] = fence if tier is None or rank == 0 else publisher.fence()
        publisher.write_blocks(plan_, owns=owns, fence=wfence)
        new_nodes: list = []
        tree, part["payloads"] = publisher.write_nodes(plan_.value, wfence, new_nodes)
        part["tree"] = tree
        from .publish import NewObjects, plan_stats, replica_digests
        st = plan_stats(plan_)
        # What this rank wrote new, by address: rank 0 counts an object two ranks both
        # wrote new (the same replicated weights of DDP ranks) once.
        mine_new = NewObjects().add_plan(plan_).add_nodes(new_nodes)
        reps = replica_digests(plan_)
        rep = None
        if reps:  # the full list only for rank 0 to read if the replicas disagree; one digest in done
            ch.set_mine("rep", msgpack.packb(reps))
            rep = hashlib.blake2b(msgpack.packb(reps), digest_size=16).digest()
        publisher.sync()  # this rank's objects are durable before rank 0 publishes
        if tier is not None and rank != 0:
            # Rank 0's tier holds every rank's nodes (not their blocks): what its local gc
            # and prune walk to know what the snapshot keeps (tier/collective.py).
            ch.set_mine("tnodes", msgpack.packb(part["payloads"]))
            tier.intend(tree, args)  # (a rank killed from here until the outcome still uploads its part)
        ch.arrive("done", msgpack.packb({"tree": tree, "rep": rep,
                                         "stats": [st.bytes_total, st.blocks_total],
                                         "new": mine_new.packed()}), W)

    _guard(ch, write)

    def revalidate_mine(new_fence: int) -> None:
        # What this rank wrote or reused: it still holds the data (the plan) and its nodes.
        if tier is not None and rank != 0:
            new_fence = publisher.fence()  # its own tier's (see write)
        publisher.revalidate_plan(plan_, part["payloads"], None, new_fence, owns=owns)
        part["fence"] = new_fence

    if rank != 0:
        def info_of(root: Digest):
            if tier is not None:  # rank 0's commit and top nodes into this rank's tier first
                tier.adopt(bytes(root), ch.get("tier"), part["tree"])
            return publisher.info(root)
        try:
            info = _await_result(ch, publisher, args, revalidate_mine, info_of)
        except SnapshotAborted as e:
            if tier is not None and "tree" in part:
                if not ch.aborted:
                    # No abort was won or read here, only inferred (rank 0 silent after its
                    # commit claim, or the c10d Store gone, which often lives in rank 0's
                    # process). Rank 0 publishes in its own tier, which this rank cannot ask:
                    # it may have published, and its uploader would wait for this part.
                    raise OutcomeUnknown(
                        f"rank {rank}: rank 0 did not tell this rank the outcome of its put to {args.ref!r} ({e}); "
                        "through local tiers this rank cannot ask rank 0's tier whether it published. This "
                        "rank's part stays queued for upload (the next open of its tier sends it); look at rank "
                        f"0's tier (store.log({args.ref!r})) before taking the snapshot again", ref=args.ref) from e
                tier.abandon(part["tree"])
            raise
        publisher.assets.presence.settle(part.get("fence", fence))  # published: what this rank wrote is there
        _published(ch, started["need"], tier is not None)
        return info if tier is None else tier.published(info, part["tree"], False)

    def compose():
        dones = [msgpack.unpackb(d) for d in ch.wait_all("done", "finish writing")]
        if len({d.get("rep") for d in dones}) > 1:
            why = _replica_disagreement(ch)
            ch.abort(why)
            raise SnapshotAborted(f"snapshot aborted: {why}")
        if tier is not None and W > 1:  # every rank's nodes into this rank's tier (put: checked by address)
            for blob in ch.get_many([f"tnodes/{r}" for r in range(1, W)]):
                for payload in msgpack.unpackb(blob):
                    publisher.assets.put_node(payload, fence)
        # The rank tree and the range-cut chunk index (format/world.py): a rank's checkout
        # reads the few nodes its own region needs, whatever W (not O(W) or O(W x N)). The
        # index depends on the layout alone: built once per checked layout, then put again.
        from .format.manifest import encode_node
        from .format.world import write_index, write_world

        def putter(payloads: list):
            def put(value):  # one node, laid out by format/world.py (the node writer's walk costs ~15 us a piece)
                payloads.append(encode_node(value))
                return publisher.assets.put_node(payloads[-1], fence).digest
            return put

        def chunk_index():
            payloads: list = []
            return write_index(pieces_by_rank, putter(payloads)), payloads
        index, ix_payloads = _chunk_index(layouts, layout["job"], publisher, fence, chunk_index)
        payloads: list = []
        put = putter(payloads)
        top = put(write_world([d["tree"] for d in dones], index, put))
        part["top"] = ix_payloads + payloads
        # Totals: what each rank's part holds. New: each object written new once, whichever
        # ranks wrote it (and the nodes written here, which hold no tensor bytes).
        from .publish import BuildStats, NewObjects
        new = NewObjects()
        for d in dones:
            new.merge_packed(d.get("new"))
        st = BuildStats(bytes_total=sum(d["stats"][0] for d in dones),
                        blocks_total=sum(d["stats"][1] for d in dones))
        return top, new.into(st).as_dict()

    top, stats = _guard(ch, compose)
    # The point of no return: from here no other rank may declare this snapshot aborted
    # (their deadlines may pass while the ref moves); only this rank can, if the move fails.
    mine = b"commit:" + top.hex().encode()
    won = _guard(ch, lambda: ch.claim(mine))
    if won == b"abort":  # another rank gave up first: its abort record follows
        _guard(ch, lambda: ch.wait_key("abort", "the abort record of the rank that aborted"))
        raise SnapshotAborted("snapshot aborted by another rank")  # pragma: no cover - wait_key raised
    if won != mine:  # another call's claim under this call's keys: never take it for this one's
        why = (f"rank 0: the c10d Store already holds another call's commit claim under {ch.pfx} "
               "(a collective call named like an earlier one); nothing was published")
        ch.abort(why, force=True)
        raise SnapshotAborted(f"snapshot aborted: {why}")
    beat = _Heartbeat(ch)  # the others wait for the result as long as this rank shows it is alive
    rounds = [0]
    try:
        info = publisher.commit(
            top, args, stats=stats, fence=fence, meta_extra={"world": W}, timing=timing() if timing else None,
            part0=None if tier is None else part["tree"],  # (rank 0's own part, in its tier: with the move)
            revalidate=lambda body, new_fence: _revalidation_round(ch, publisher, rounds, revalidate_mine,
                                                                   part["top"], body, new_fence))
    except OutcomeUnknown as e:
        # The ref may have moved (or may yet): every rank must say so, never "nothing published".
        beat.stop()
        ch.abort(str(e), "outcome_unknown", force=True, shared=True,
                 extra={"root": e.root.hex() if e.root else None, "ref": e.ref})
        raise
    except Exception as e:
        beat.stop()
        why = str(e) if isinstance(e, SnapshotAborted) else f"rank 0: {type(e).__name__}: {e}"
        ch.abort(why.removeprefix("snapshot aborted: "), force=True)
        if isinstance(e, TsckError):
            raise
        raise SnapshotAborted(f"snapshot aborted: {why}") from e
    finally:
        beat.stop()  # (also on a KeyboardInterrupt: a beat that outlived the commit would keep the others waiting)
    _published(ch, layout["need"], tier is not None)
    if tier is not None:
        try:  # (before the result: the others read it once they hold the root)
            ch.set("tier", tier.top_blob(bytes.fromhex(info.root), part["top"]))
        except Exception as e:  # noqa: BLE001 - the ref moved: this rank's outcome is a success
            warnings.warn(f"snapshot {info.root[:16]} was published locally, but its top nodes could not be handed "
                          f"to the other ranks: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
        info = tier.published(info, part["tree"], True)
    ch.ack()  # (it holds the outcome and reads nothing of the call's after: the others' acks come after)
    try:
        ch.set(_result_key(ch.round), info.root.encode())
    except Exception as e:  # noqa: BLE001 - the ref moved: this rank's outcome is a success
        warnings.warn(f"snapshot {info.root[:16]} was published, but the other ranks could not be told: "
                      f"{type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
    return info


def _published(ch: _Channel, need: list, tier: bool = False) -> None:
    """Published, so nobody aborted (the claim): the call's shared keys are these (the last
    rank to ack deletes them)."""
    ch.used = ["hello_n", "hello_all", "need", "done_n", "done_all", "decided", "result", "beat", "acked",
               "ack_all"] + (["reval", "rdone_n"] if ch.round else []) + (["pieces_n", "pieces_all", "go"] if need
                                                                          else []) + (["tier"] if tier else [])


def _chunk_index(layouts: _Layouts, job: bytes, publisher, fence: int, build):
    """The chunk index of a whole-job layout: built (O(W x N)) once per layout, then the
    same nodes again, put under this snapshot's fence (a deletion phase may have removed
    them: put_node checks, as for any node)."""
    got = layouts.index(job)
    if got is None:
        got = build()
        layouts.set_index(job, got)
        return got
    for payload in got[1]:
        publisher.assets.put_node(payload, fence)
    return got


class _Heartbeat:
    """Rank 0, from its commit claim until the result is posted: adds 1 to the call's
    "beat" counter every `timeout`/6 s, from a thread, so that the other
    ranks, whose deadline may pass while a slow storage write goes on, can tell a slow
    rank 0 (the count moves: keep waiting) from a dead or stopped one (it does not move
    for `timeout`: ask the ref table)."""

    def __init__(self, ch: _Channel):
        self._stop = threading.Event()
        # (every timeout/6: the others look at it once a slice, timeout/4, so it always moves
        # between two looks; more often would only add requests)
        key, interval = ch.pfx + "beat", max(0.02, ch.timeout / 6)

        def beat() -> bool:
            try:
                ch.kv.add(key, 1)
                return True
            except Exception:  # noqa: BLE001 - the store is gone: nobody is listening
                return False

        def run():
            while not self._stop.wait(interval) and beat():
                pass
        # The first beat here, not in the thread: the call's keys are then the same whether
        # or not the thread ran before a fast commit stopped it.
        beat()
        self._thread = threading.Thread(target=run, name="tsck-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _revalidation_round(ch: _Channel, publisher, rounds: list, revalidate_mine, top_payloads: list, body: bytes,
                        fence: int) -> None:
    """Rank 0, called by Publisher.commit after its ref move was fenced by a gc deletion
    phase (the phase is over and rank 0 holds a gc hold, so no new one opens): every rank
    re-validates what it wrote or reused, re-uploading from the state it still holds
    whatever the phase deleted, under the new fence; then rank 0 re-writes the top
    nodes and the commit object, and commit() moves the ref. O(1) messages per rank:
    rank 0 posts "reval" = [round, fence] and wakes the others (REVAL in the key they
    block on for the outcome); each rank posts rdone/{rank}, adds to "rdone_n" and the
    last one posts "rdone_all.<round>" (or a rank writes "rfail" and wakes rank 0, which
    aborts)."""
    rounds[0] += 1
    n, others = rounds[0], ch.world - 1
    ch.round = n  # first: an abort from here on wakes the others on the next outcome key
    ch.extra += [_result_key(n), f"rdone_all.{n}"]
    ch.set("reval", msgpack.packb([n, fence]))
    ch.set(_result_key(n - 1), REVAL)
    revalidate_mine(fence)  # rank 0's own part, while the others do theirs
    until = time.monotonic() + ch.timeout
    while others and not ch._block([f"rdone_all.{n}"], until):
        if time.monotonic() >= until:
            late = [r for r in range(1, ch.world) if not ch.kv.check([ch.pfx + f"rdone/{r}"])
                    or msgpack.unpackb(ch.get(f"rdone/{r}")) < n]
            raise SnapshotAborted(f"snapshot aborted: a gc deletion phase overlapped this snapshot and ranks {late} "
                                  f"did not re-validate their part within {ch.timeout:g}s; nothing was published")
    if ch.kv.check([ch.pfx + "rfail"]):
        raise SnapshotAborted(f"snapshot aborted: a gc deletion phase overlapped this snapshot and "
                              f"{ch.get('rfail').decode(errors='replace')}; nothing was published")
    publisher._rewrite(top_payloads, body)


def _serve_revalidation(ch: _Channel, done: int, revalidate_mine) -> int:
    """A rank other than 0, woken by REVAL while waiting for the outcome: do the round
    rank 0 asked for and say so. -> the last round done. A failure is written to "rfail"
    (rank 0 then aborts, and cannot have moved the ref: it waits for every rank) and
    raised as _RevalFailed(the error this rank raises)."""
    n, fence = msgpack.unpackb(ch.get("reval"))
    if n <= done:
        return done
    try:
        revalidate_mine(fence)
    except Exception as e:  # noqa: BLE001 - every failure must reach rank 0
        why = f"rank {ch.rank} could not re-validate its part: {type(e).__name__}: {e}"
        try:
            ch.kv.compare_set(ch.pfx + "rfail", b"", why[:4000].encode())
            ch.kv.set(ch.pfx + f"rdone_all.{n}", b"rfail")  # wakes rank 0 (a compare_set would not)
        except Exception:  # noqa: BLE001 - the store is gone: rank 0 times out instead
            pass
        own = e if isinstance(e, TsckError) else SnapshotAborted(f"snapshot aborted: {why}")
        raise _RevalFailed(own) from e
    ch.set_mine("rdone", msgpack.packb(n))
    if ch.add("rdone_n") == n * (ch.world - 1):
        ch.set(f"rdone_all.{n}", b"1")
    return n


def _await_result(ch: _Channel, publisher, args, revalidate_mine, info_of=None):
    """A rank other than 0, its part written: block on the outcome, re-validating its
    part whenever rank 0 asks (a gc deletion phase fenced the move). Once rank 0 has
    claimed "commit", this rank's deadline no longer aborts: it waits for the result as
    long as rank 0's heartbeat moves; if it stops for `timeout` (rank 0 dead or stopped)
    or the Store goes away, it asks the ref table whether the ref moved to the snapshot
    (through tiers its own tier's, which cannot know: _put says OutcomeUnknown then)."""
    done = [0]  # re-validation rounds done: the outcome's key is _result_key(done[0])
    info_of = info_of or publisher.info

    def outcome(v: bytes):
        """-> the root posted, or None: a re-validation round served (then wait on the next key)."""
        if v == REVAL:
            n = _serve_revalidation(ch, done[0], revalidate_mine)
            if n > done[0]:
                done[0] = ch.round = n
                ch.extra += [_result_key(n), f"rdone_all.{n}"]
            return None
        return v

    try:
        try:
            while True:
                root = outcome(_guard(ch, lambda: ch.wait_key(_result_key(done[0]), "rank 0 to publish",
                                                              per_rank="done")))
                if root is not None:
                    return info_of(Digest.parse(root.decode()))
        except _CommitUnderWay:
            pass
        return _await_result_alive(ch, publisher, args, done, outcome, info_of)
    except _RevalFailed as e:
        raise e.args[0] from e.__cause__


def _await_result_alive(ch: _Channel, publisher, args, done: list, outcome, info_of):
    try:
        last, seen = None, time.monotonic()
        while True:
            # One slice of blocking, then one look at rank 0's heartbeat: two requests per slice.
            key = _result_key(done[0])
            if ch._block([key], time.monotonic() + ch.slice):
                v = ch.get(key)
                if v == WOKEN:  # rank 0's own commit failed: it wrote the abort record
                    ch._check_abort()
                root = outcome(v)
                if root is not None:
                    return info_of(Digest.parse(root.decode()))
                continue
            beat, now = ch.add("beat", 0), time.monotonic()
            if beat != last:
                last, seen = beat, now
            elif now - seen > ch.timeout:
                break
    except (SnapshotAborted, OutcomeUnknown, _RevalFailed):
        raise
    except Exception:  # noqa: BLE001 - the store went away
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
    raise SnapshotAborted(f"snapshot aborted: rank {ch.rank}: rank 0 began publishing, then showed no sign of "
                          f"life for {ch.timeout:g}s (dead or stopped), and {args.ref!r} has not moved to the "
                          "snapshot")


def _target_hash(spelled: str) -> int:
    """40 bits of the target as written: W of them summed fit in the Store's int64 counter."""
    return int.from_bytes(hashlib.blake2b(spelled.encode(), digest_size=5).digest(), "little")


def _target_disagreement(ch: _Channel, root: Digest, spelled: str, resolve) -> str | None:
    """Rank 0, when the ranks did not all write the target as it did: read what each asked
    for (only now: O(W)) and resolve each distinct one; the same snapshot written two ways
    (its ref, its root) is agreement. -> the refusal, or None."""
    asked: dict = {}
    for r in range(ch.world):
        t = ch.get(f"hello/{r}").decode(errors="replace") if ch.kv.check([ch.pfx + f"hello/{r}"]) else "?"
        asked.setdefault(t, []).append(r)
    roots = {spelled: root.hex()}
    for t in list(asked)[:8]:
        if t not in roots:
            try:
                roots[t] = resolve(t).hex()
            except TsckError as e:
                roots[t] = f"{type(e).__name__}: {e}"
    if len(asked) <= 8 and all(roots[t] == root.hex() for t in asked):
        return None
    parts = [f"{_ranks(rs)} {'asks' if len(rs) == 1 else 'ask'} for {t!r} ({roots.get(t, '?')[:16]})"
             for t, rs in sorted(asked.items(), key=lambda kv: kv[1][0])[:4]]
    return ("ranks disagree on the snapshot to check out: " + "; ".join(parts)
            + " (a collective checkout reads one snapshot on every rank; nothing was read)")


def collective_checkout(job: CollectiveJob, target):
    """Every rank says what it asks for (a hello); rank 0 checks that they all ask for
    the same snapshot and resolves `target` (job.core.resolve: so every rank reads the same
    snapshot even if the ref moves meanwhile); every rank then reads its own view with
    job.read(root, rank).
    The check costs each rank O(1) messages: each adds a 40-bit hash of its target to the
    counter "tsum", which equals W times rank 0's hash when all agree; rank 0 reads the
    hellos themselves only when it does not."""
    ch = _open_channel(job.calls, job.group, "checkout", job.timeout, job.kv)
    ch.post_at()
    ch.cleanup_old()
    resolve, read = job.resolve or job.core.resolve, job.read
    spelled = target if isinstance(target, str) else repr(target)

    def hello():
        ch.add("tsum", _target_hash(spelled))
        ch.arrive("hello", spelled.encode(), ch.world)  # (after tsum: rank 0 reads it once all arrived)

    if ch.rank != 0:
        # The outcome is the root (or the error); the rest is this rank's own reading.
        def wait_root():
            _guard(ch, hello)
            root = Digest.parse(_guard(ch, lambda: ch.wait_key("root", "rank 0 to resolve the target",
                                                               per_rank="hello")).decode())
            ch.used = _CHECKOUT_KEYS
            return root
        root = _outcome_round(ch, wait_root, "")
        return read(root, ch.rank)

    def agree():
        ch.wait_for(["hello_all"], "arrive", "hello", of_ranks=True)  # (the hellos are read only if they differ)
        root = resolve(target)
        if ch.add("tsum", 0) != ch.world * _target_hash(spelled):
            problem = _target_disagreement(ch, root, spelled, resolve)
            if problem is not None:  # every rank raises it as what it is
                ch.abort(problem, "invalid_argument", shared=True)
                raise InvalidArgument(problem)
        return root

    def body():
        _guard(ch, hello)
        root = _guard(ch, agree)
        _guard(ch, lambda: ch.set("root", root.hex().encode()))
        out = read(root, 0)  # while the others pick up the root
        ch.used = _CHECKOUT_KEYS  # (no abort: this rank read)
        return out

    return _outcome_round(ch, body, f"collective checkout of {target!r}")
