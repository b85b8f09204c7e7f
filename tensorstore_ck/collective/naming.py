"""The names of collective calls: which call a process is in, per (group, op), named
alike on every rank that makes it (CollectiveContext; CALLS, the process's), and how
messages name calls and ranks. Rank 0's per-process memory of a group (its validated
layouts, the calls whose outcome some rank has not read yet) is kept here too."""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

# Rank 0 keeps the outcome of a call in the Store until every rank has acked it (a rank
# stopped across later calls reads it when it resumes), but of at most this many calls per
# (group, op): beyond, the oldest go (a rank that never comes back must not grow the Store).
KEEP_UNACKED = 256
# The keys of a call that every rank reads (rank 0 deletes them); the rest are per rank.
SHARED_KEYS = ("hello_n", "hello_all", "need", "pieces_n", "pieces_all", "go", "done_n", "done_all", "result",
               "abort", "root", "decided", "acked", "ack_all", "beat", "tsum", "reval", "rdone_n", "rfail", "tier")
# Rank 0 keeps, per group, the validated layout of every rank (its pieces of sharded
# tensors, by digest) from the job's previous snapshot; of at most this many groups, and
# this many validated whole-job layouts (with their chunk index) per group.
LAYOUT_GROUPS = 4
# The names of calls (a put's ref and step) whose count a process keeps (CollectiveContext).
OCCURRENCES = 4096


def describe(op: str, ref, step) -> str:
    """A collective call, as a message names it."""
    if op == "put" and ref is not None:
        return f"put_snapshot of {ref!r} at step {step}"
    return "a checkout" if op == "checkout" else f"a {op} call"


def ranks_named(rs) -> str:
    """Ranks, as a message names them ("rank 3", "ranks [1, 4]")."""
    rs = sorted(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else f"ranks {rs}"


def _short(v) -> str:
    """A piece of a call's name: an int as itself, anything else as a short hash."""
    return str(v) if type(v) is int else hashlib.blake2b(repr(v).encode(), digest_size=6).hexdigest()


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
        self._made: dict = {}    # group -> {"<ref>.<step>": puts of them named} (OutOfStep tells calls apart)
        self._waiting: dict = {}  # group -> {name: step}: rank 0 saw a rank wait in that later put
        self._kept: dict = {}  # (group, op) -> [seq, ...], oldest first
        self._shared: dict = {}  # ((group, op), seq) -> the shared keys of that call (rank 0 deletes them)
        self._own: dict = {}   # (group, op) -> [(seq, [own key, ...]), ...]: calls ended here, keys still there
        self._layouts: OrderedDict = OrderedDict()  # (group, world) -> Layouts (rank 0)
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
                what = f"{_short(ident[0])}.{_short(ident[1])}"
                k = self._count((gid, op) + tuple(map(repr, ident)))
                name = f"{what}.{k}"
                self._epoch[gid] = name
                made = self._made.setdefault(gid, OrderedDict())
                made.pop(what, None)
                made[what] = k  # (the most recently used last: the oldest go first)
                while len(made) > OCCURRENCES:
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
        """Whether this process named a put `name` (it made, or is making, that call): the
        k-th put of a ref and step is made once this process named k puts of them. Kept
        by (ref, step), not as a list of recent names, so a call this process made long
        ago (a run rolled back past thousands of steps, or a rank's `latest` record rank 0
        has not replaced since) is still known as made: taken for a call never made, it
        would fail every put below its step as OutOfStep."""
        what, _, k = name.rpartition(".")
        with self._lock:
            got = self._made.get(gid, {}).get(what)
        return got is not None and k.isdigit() and got >= int(k)

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

    def finished(self, key, seq: int, shared, posted=()) -> None:
        """Rank 0 ended call seq, whose shared keys are `shared` (and `posted`: keys it
        posted for groups of ranks, which it deletes itself)."""
        with self._lock:
            self._kept.setdefault(key, []).append(seq)
            self._shared[(key, seq)] = (list(shared), list(posted))

    def shared(self, key, seq: int) -> tuple:
        """-> (the shared keys, the posted keys) of call seq (forgotten here)."""
        with self._lock:
            return self._shared.pop((key, seq), (list(SHARED_KEYS), []))

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

    def layouts(self, key, world: int, new):
        """Rank 0: the validated layouts of group `key` (layout.Layouts; new(world), empty,
        for a new group or world size; the least recently used group beyond LAYOUT_GROUPS
        goes). Held here, per process, so that they outlive the Store a call goes through."""
        with self._lock:
            k = (key, world)
            got = self._layouts.pop(k, None) or new(world)
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
