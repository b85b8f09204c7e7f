"""The c10d channel of one collective call: its keys under one prefix in the process
group's c10d Store (or a StoreGroup's), set, added and waited on (c10d `wait`, in
WAIT_SLICES slices of the timeout) with the call's own deadline; the abort record and the
wake-up of every waiter; the outcome claim; the acks and the cleanup of a call's keys;
the out-of-step checks (which call each rank is in); rank 0's heartbeat while it
publishes. guard() and outcome_round() are how a call's body uses it: any failure on a
rank aborts the call on every rank, and rank 0 returns only once the others hold the
outcome. What a put or a checkout says through it is put.py's and checkout.py's."""

from __future__ import annotations

import datetime
import threading
import time
import warnings

import msgpack

from ..errors import (AmbiguousTarget, InvalidArgument, InvalidName, OutcomeUnknown, OutOfStep, RefNotFound,
                      SnapshotAborted, TsckError)
from .naming import KEEP_UNACKED, SHARED_KEYS, CollectiveContext, describe

AUTO = object()  # group= left out: the default process group, if torch.distributed is initialised

# How long rank 0 waits, past the deadline if need be, for every rank to confirm that
# it read the outcome, before it returns (a published snapshot: with a warning).
ACK_GRACE = 10.0
# A rank blocks on the keys it needs (c10d `wait`: the Store answers when they exist, no
# polling) in at most this many slices of its timeout, so that its requests per call are a
# constant however long it waits; between slices it looks at what a wait cannot see (rank
# 0's heartbeat). An abort wakes every waiter by writing the keys they block on (WOKEN).
WAIT_SLICES = 4
# The value an aborting rank writes into every key the others may be blocked on: whoever
# reads it reads the abort record. (No real value starts with a zero byte: see its writers.)
WOKEN = b"\x00aborted"
# What a look at a key that may not exist reads when it does not (Channel.peek).
_ABSENT = b"\x00absent"


class CommitUnderWay(Exception):
    """This rank's deadline passed, but rank 0 had already claimed the outcome "commit"."""


class RevalFailed(Exception):
    """This rank could not re-validate its part after a gc deletion phase (args[0]: the
    error it raises; rank 0 has been told through "rfail" and aborts)."""


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


class Channel:
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
        self.round = 0             # re-validation rounds asked for or done (the outcome's key: result_key)
        self.mine: list[str] = []  # the keys of this rank's own that it wrote (it deletes them later)
        self.extra: list[str] = []  # shared keys beyond SHARED_KEYS (those of re-validation rounds)
        # Rank 0: keys it posted for some ranks (one per 16: the paths through tiers), which
        # it deletes itself once every rank acked (the last rank to ack would make O(W) deletes).
        self.posted: list[str] = []
        # Once the call succeeded: its shared keys (the last rank to ack deletes these);
        # None: any of SHARED_KEYS (an abort writes WOKEN into several).
        self.used: list[str] | None = None
        self.acked = False  # ack() was called
        # One blocking wait lasts at most this long: WAIT_SLICES of them span the timeout.
        self.slice = max(0.01, timeout / WAIT_SLICES)

    def shared_keys(self) -> list[str]:
        return (list(SHARED_KEYS) if self.used is None else self.used) + self.extra

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
            self.check_abort()  # (unless it ended already: its own outcome, as recorded, first)
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
        return describe(self.op, *(self.ident if self.ident is not None else (None, None)))

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
                what = describe(op, ref, step)
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

    def set_many(self, kv: dict) -> None:
        """One request (multi_set) for keys of this call."""
        if not kv:
            return
        ms = getattr(self.kv, "multi_set", None)
        if ms is None:
            for k, v in kv.items():
                self.set(k, v)
        else:
            ms([self.pfx + k for k in kv], list(kv.values()))

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
            for k in _WAKE[self.op] + ((result_key(self.round),) if self.op == "put" else ()):
                self.kv.set(self.pfx + k, WOKEN)
        except Exception:  # noqa: BLE001 - the store itself is gone: nothing more we can tell anyone
            pass
        return True

    def check_abort(self) -> None:
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
            # Whatever this raises is the abort's own error: guard must not abort again (a
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
            while not self.block(keys, deadline):
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
        ("ack_all": the last rank to ack deleted the others), and the keys it posted for
        groups of ranks (Channel.posted). The outcome of a call some
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
            shared, posted = self.ctx.shared(self.key, seq)
            delete(old + k for k in (["ack_all", "acked"] if acked else shared) + posted)
            self.ctx.forget(self.key, seq)

    def block(self, keys, until: float) -> bool:
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
        while not self.block(keys, self.deadline):
            if time.monotonic() >= self.deadline:
                self._timed_out(what, per_rank, among, of_ranks)
            if per_rank is not None:  # one slice passed: a rank that skipped this call never comes
                self._skipped(per_rank, among)
        vals = self.get_many(keys)
        if WOKEN in vals:
            self.check_abort()
            raise SnapshotAborted("snapshot aborted by another rank")  # (the record is written first)
        return vals + (self.get_many(also) if also else [])

    def _skipped(self, per_rank: str, among) -> None:
        """Between two slices of a wait: abort this call as OutOfStep if a rank it waits
        for is already in a later put of the same ref (it skipped this one)."""
        if per_rank != "hello":  # (a skip shows at a call's start; later waits are for slow ranks)
            return
        self.check_abort()
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
        self.check_abort()
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
            why += "; " + "; ".join(f"rank {r} is still in an earlier call ({describe(w[0], w[2], w[3])}, for "
                                    f"{max(0.0, time.time() - w[4]):.0f}s)" for r, w in where.items())
        if not self.abort(why, "out_of_step" if step else "snapshot_aborted", late=late):
            raise CommitUnderWay()
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


def result_key(n: int) -> str:
    """The key the ranks other than 0 block on for the outcome after n re-validation
    rounds: rank 0 writes REVAL into the previous one to start a round (a wait cannot
    see two keys at once, and a key, once written, wakes every later wait on it)."""
    return "result" if n == 0 else f"result.{n}"


# The keys a rank may be blocked on, by op (an abort writes WOKEN into them).
_WAKE = {"put": ("hello_all", "need", "pieces_all", "go", "done_all"), "checkout": ("hello_all", "root", "share_all", "shreg_all")}


_REraise = {"ref_not_found": RefNotFound, "invalid_name": InvalidName, "invalid_argument": InvalidArgument,
            "ambiguous_target": AmbiguousTarget}


def guard(ch: Channel, fn):
    """Run fn; any failure on this rank aborts the snapshot on every rank. This
    rank raises its own error (a TsckError as itself); the others SnapshotAborted,
    or for a checkout the same user error (RefNotFound, InvalidName, ...)."""
    try:
        return fn()
    except (SnapshotAborted, CommitUnderWay, RevalFailed):
        raise
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks
        kind = getattr(e, "kind", "error") if isinstance(e, TsckError) else "error"
        if not ch.aborted:  # (else this rank has told the others already, in its own words)
            ch.abort(str(e) if kind in _REraise else f"rank {ch.rank}: {type(e).__name__}: {e}", kind)
        if isinstance(e, TsckError):
            raise
        raise SnapshotAborted(f"snapshot aborted: rank {ch.rank}: {type(e).__name__}: {e}") from e


def open_channel(ctx, group, op, timeout, kv, ident=None) -> Channel:
    try:
        return Channel(ctx, group, op, timeout, kv, ident)
    except InvalidArgument:
        raise
    except Exception as e:  # noqa: BLE001
        raise SnapshotAborted(f"cannot reach the process group's store: {e}") from e


def outcome_round(ch: Channel, body, what: str):
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
            ch.ctx.finished(ch.key, ch.seq, ch.shared_keys(), ch.posted)
        raise
    ch.ack()
    ch.ctx.ended(ch.key, ch.seq, ch.mine)
    if ch.rank == 0:
        silent = ch.wait_acks()
        ch.ctx.finished(ch.key, ch.seq, ch.shared_keys(), ch.posted)
        if silent:
            warnings.warn(f"{what} succeeded, but ranks {silent} did not confirm within the deadline that they "
                          "read the outcome (dead or stalled?): they may report an error for it", RuntimeWarning,
                          stacklevel=4)
    return out


class Heartbeat:
    """Rank 0, from its commit claim until the result is posted: adds 1 to the call's
    "beat" counter every `timeout`/6 s, from a thread, so that the other
    ranks, whose deadline may pass while a slow storage write goes on, can tell a slow
    rank 0 (the count moves: keep waiting) from a dead or stopped one (it does not move
    for `timeout`: ask the ref table)."""

    def __init__(self, ch: Channel):
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
