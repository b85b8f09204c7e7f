"""The gc state machine of a ref table: the gc lock and its lease, the deletion phases
(freeze / thaw, the epoch writers fence on), writers' holds, the queue of prunes, and
the mark of a rebuild (recover) in progress, as the part of RefTable (refs/base.py)
that reads and writes them.

One record (gc: b"state" -> {epoch, phase, owner, lease, clock, expires, holds, ...})
moves idle -> marking -> deleting -> marking ... -> idle. The epoch is odd exactly
while a deletion phase may be running; a writer that decided which objects exist
under an even epoch moves a ref only while the epoch is still that one (check_fence,
in the move's own transaction). A gc declares its lease (seconds; gc.py's Lease
renews it) and the lock is judged on the table's clock only (Txn.clock), so no
party's own clock or setting can declare a live gc dead. The one exception is a
holder known dead: the lock records its process (`proc`: host, pid, start time), and
a party on the same host that finds that process gone takes the lock over at once
(holder_gone; docs/design/gc.md, "A holder known dead").
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ..errors import Fenced, FormatError, GcBusy, RebuildUnfinished, RefNotFound, TsckError
from ..format.records import decode_gc_state, decode_record, encode_record
from .txn import Txn

log = logging.getLogger(__name__)

__all__ = ["GcStateMachine", "HOLD_SECONDS", "UNDECLARED_LEASE", "rebuild_message", "process_identity",
           "holder_gone",
           # the rows and checks RefTable's own transactions share (refs/base.py)
           "REBUILD_KEY", "PRUNE_KEY", "note_dropped", "check_fence", "check_kept", "drop_hold"]

REBUILD_KEY = b"rebuild"  # meta: a recover began and none has finished since ({owner, started})
PRUNE_KEY = b"prune:"  # gc: a queued prune request of job <name> ({at, id})
# gc: what each of the last RECLAIMED_KEPT gcs and prunes that deleted anything deleted
# ({"runs": [[at, block bytes, all bytes], ...]}, oldest first): `tsck du --plot` draws the
# store's size over time from it and the commits' stored_new.
_RECLAIMED = b"reclaimed"
RECLAIMED_KEPT = 1000
# gc: per commit whose catalog row was dropped (a prune, gc's retention, delete-ref,
# forget), what it had added to storage and when: b"dropped:" + root -> {at, bytes,
# est} (bytes: its stored_new; its bytes_new, est true, for an older commit without
# one). `tsck du --plot` draws those writes at their time, as it draws the kept
# commits' (usage.physical_over_time). A gc keeps the newest DROPPED_KEPT.
_DROPPED = b"dropped:"
DROPPED_KEPT = 100_000
# A gc state with no declared lease (no `expires`): the lock is judged by its heartbeat's
# age on the wall clock, and runs out this many seconds after it.
UNDECLARED_LEASE = 120.0
HOLD_SECONDS = 30.0  # a writer's hold, renewed every HOLD_SECONDS / 4 while it re-validates
_LOCK_FIELDS = ("clock", "expires", "proc")  # what a released lock leaves out of the gc state


class GcStateMachine:
    """The gc lock, lease, phases, holds, fences, prune queue and rebuild mark of RefTable
    (a mixin over its _read/_write)."""

    # The queue of prunes that found the store busy (docs/design/gc.md, "Many jobs
    # on one store"). A job whose prune cannot take the gc lock queues a request; the
    # prune or gc that holds the lock applies the rules of every queued job along with
    # its own and removes the requests it served in its expiry transaction. A request
    # read before the catalog is read covers every snapshot committed before it was
    # queued, which is what the job asked for.
    def note_reclaimed(self, *, block_bytes: int, total_bytes: int) -> None:
        """Record that a gc or prune just deleted these bytes (at the table's wall clock)."""
        def txn(t):
            runs = _reclaimed_runs(t.get("gc", _RECLAIMED))
            runs.append([t.wall(), int(block_bytes), int(total_bytes)])
            t.put("gc", _RECLAIMED, encode_record({"runs": runs[-RECLAIMED_KEPT:]}))
            keys = [k for k, _v in t.items("gc", _DROPPED)]
            if len(keys) > DROPPED_KEPT:  # the oldest go (their writes join the picture's start)
                have = _dropped_entries(t)
                for k in sorted(keys, key=lambda k: have.get(k[len(_DROPPED):], (0.0,))[0])[:-DROPPED_KEPT]:
                    t.delete("gc", k)
        self._write(txn)

    def dropped(self) -> dict[bytes, tuple[float, int, bool]]:
        """root -> (commit time, bytes it added to storage, estimated) of the commits whose
        catalog rows were dropped (note_dropped); an entry that does not decode is left out."""
        return self._read(lambda t: _dropped_entries(t))

    def reclaimed(self) -> list[list]:
        """[[at, block bytes, all bytes], ...] of the recorded gcs and prunes, oldest first
        (note_reclaimed); a record that does not decode reads as none."""
        return self._read(lambda t: _reclaimed_runs(t.get("gc", _RECLAIMED)))

    def prune_request(self, job: str) -> bytes:
        """Queue a prune of `job` (replacing one already queued) -> its token, for prune_pending."""
        token = os.urandom(8)

        def txn(t):
            t.put("gc", PRUNE_KEY + job.encode(), encode_record({"at": t.wall(), "id": token}))
        self._write(txn)
        return token

    def prune_requests(self) -> dict[str, bytes]:
        """The queued prune requests: job -> the stored request (compared, never trusted, by
        catalog_expire). A key that is not UTF-8 is no job: left alone."""
        def txn(t):
            out = {}
            for k, v in t.items("gc", PRUNE_KEY):
                try:
                    out[k[len(PRUNE_KEY):].decode("utf-8")] = v
                except UnicodeDecodeError:
                    continue
            return out
        return self._read(txn)

    def prune_pending(self, job: str, token: bytes) -> bool:
        """Is the request `token` of `job` still queued (not yet served by a prune or gc)?"""
        def txn(t):
            raw = t.get("gc", PRUNE_KEY + job.encode())
            if raw is None:
                return False
            try:
                rec = decode_record(raw, "prune request")
            except FormatError:
                return True  # unreadable: not known to be served
            return rec.get("id") == token if isinstance(rec, dict) else True
        return self._read(txn)

    def gc_state(self) -> dict:
        """The gc state, with `lease_left`: seconds the current gc's lease still runs on
        the table's clock (0.0 once it ran out, or once its holder is known dead; None
        when no gc holds the store), and `holder_gone`: its holder's process is known
        to be gone (holder_gone)."""
        def txn(t):
            st = _gc_state(t)
            locked = not (st["phase"] == "idle" and st["epoch"] % 2 == 0)
            st["lease_left"] = _lease_left(t, st, None) if locked else None
            st["holder_gone"] = locked and holder_gone(st.get("proc"))
            return st
        return self._read(txn)

    # gc state machine: idle -> marking -> deleting -> idle. The epoch is odd exactly while
    # a deletion phase may be running (docs/design/gc.md, "GC and concurrent writers").
    # A gc holds the store under a lease it declares (seconds) and renews; whether it ran
    # out is judged on the table's clock only, so no party's own clock or setting can
    # declare a live gc dead. `now` (a reading of the table's clock) is for tests.
    def gc_abandoned(self, owner: str) -> None:
        """A gc of this process that stopped and could not record its end (the table's
        disk was full, its server away): released at this handle's next chance
        (release_abandoned_gc) instead of holding the store until its lease runs out."""
        self.__dict__.setdefault("_abandoned_gcs", set()).add(owner)

    def release_abandoned_gc(self) -> None:
        """End the gcs of this process that gc_abandoned() recorded, if the table takes
        writes again; one that another party closed or took over is forgotten."""
        owners = self.__dict__.get("_abandoned_gcs")
        for owner in list(owners or ()):
            try:
                self.gc_finish(owner)
            except GcBusy:
                pass  # no longer ours: closed as stale, or another gc holds the store
            except TsckError:
                continue  # still failing: try again next time
            owners.discard(owner)

    def gc_begin(self, owner: str, *, lease: float, now: float | None = None, rebuilding_ok: bool = False,
                 what: str = "gc") -> dict:
        """Take the gc lock. RebuildUnfinished while a recover has not finished (the
        table may not list every snapshot: nothing may be deleted by reachability),
        unless rebuilding_ok (fsck --repair, which deletes nothing a snapshot reaches)."""
        if not (isinstance(lease, (int, float)) and 0 < lease < 1e7):
            raise ValueError(f"gc lease must be a positive number of seconds, got {lease!r}")
        self.release_abandoned_gc()

        def txn(t):
            if not rebuilding_ok:
                _refuse_if_rebuilding(t, what)
            st = _gc_state(t)
            took = None
            if st["phase"] != "idle" or st["epoch"] % 2:
                left = _lease_left(t, st, now)
                if left > 0:
                    raise GcBusy(f"another gc ({st.get('owner')}) is {st['phase']}; its lease runs "
                                 f"{left:.1f}s more (its process is alive, or on another host)")
                took = st.get("owner"), holder_gone(st.get("proc"))
                if st["epoch"] % 2:  # a dead gc's deletion phase is over: close it
                    st["epoch"] += 1
            clock, tnow = _clock(t, now)
            st.update(phase="marking", owner=owner, lease=float(lease), clock=clock, expires=tnow + lease,
                      heartbeat=t.wall(), started=t.wall())
            _set_proc(st)
            t.put("gc", b"state", encode_record(st))
            return st, took
        st, took = self._write(txn)
        if took is not None and took[1]:
            log.warning("gc lock of %s taken over by %s at once: its process on this host is gone", took[0], owner)
        elif took is not None:
            log.warning("gc lock of %s taken over by %s: its lease ran out", took[0], owner)
        return st

    # A rebuild in progress (docs/design/recover.md, "recover under gc"). recover's first
    # transaction sets the mark, its last one clears it; while it is set no gc lock is
    # given for deleting, and the mark is set only while no live gc holds the lock (a
    # dead one's lock is closed, so it can never renew and go on). Both checks run
    # inside the transaction that acts, so a gc and a recover cannot overlap.
    def rebuild_begin(self, owner: str, *, now: float | None = None) -> dict | None:
        """Mark the table as being rebuilt by `owner` (recover), before anything is
        adopted. GcBusy while a gc (or prune, or fsck --repair) holds a live lease.
        -> the mark an earlier recover left unfinished, or None."""
        def txn(t):
            st = _gc_state(t)
            if st["phase"] != "idle" or st["epoch"] % 2:
                left = _lease_left(t, st, now)
                if left > 0:
                    raise GcBusy(f"a gc ({st.get('owner')}) is {st['phase']}; its lease runs {left:.1f}s more")
                # Its lease ran out: it deletes no more (it never deletes past its lease);
                # closing the lock makes its next renewal fail, so it cannot go on.
                if st["epoch"] % 2:
                    st["epoch"] += 1
                st.update(phase="idle", owner=None, aborted=t.wall())
                for k in _LOCK_FIELDS:
                    st.pop(k, None)
                t.put("gc", b"state", encode_record(st))
            prev = _rebuild_mark(t)
            t.put("meta", REBUILD_KEY, encode_record({"owner": owner, "started": t.wall()}))
            return prev
        return self._write(txn)

    def rebuild_finish(self) -> None:
        """A recover finished: every complete commit in storage has its catalog row, so
        the table is complete again and gc may delete by it."""
        self._write(lambda t: t.delete("meta", REBUILD_KEY))

    def rebuild_unfinished(self) -> dict | None:
        """The mark of a recover that began and has not finished ({owner, started}), or
        None (a table without the mark is complete)."""
        return self._read(_rebuild_mark)

    def _gc_owned(self, owner, now, phases, fn):
        def txn(t):
            st = _gc_state(t)
            if st.get("owner") != owner or st["phase"] not in phases:
                raise GcBusy(f"this gc lost the store's gc lock (state {st['phase']} held by {st.get('owner')})")
            # Renewing after the lease ran out is safe: nobody closed it (the owner and
            # phase are unchanged, and closing one is a write this transaction would see).
            clock, tnow = _clock(t, now)
            st.update(clock=clock, expires=tnow + float(st.get("lease", UNDECLARED_LEASE)), heartbeat=t.wall())
            fn(st, clock, tnow)
            t.put("gc", b"state", encode_record(st))
            return st
        return self._write(txn)

    def gc_heartbeat(self, owner, *, now: float | None = None):
        """Renew the lease of `owner` (GcBusy if it lost the lock)."""
        return self._gc_owned(owner, now, ("marking", "deleting"), lambda st, clock, tnow: None)

    def gc_freeze(self, owner, *, now: float | None = None):
        """Open the deletion phase (epoch odd), unless a writer holds the store while it
        re-validates (gc_hold): then nothing changes but the lease's renewal, and the
        returned state says for how long at most (`held`, seconds) the gc should wait."""
        held = 0.0

        def fn(st, clock, tnow):
            nonlocal held
            held = 0.0  # a transaction the table retries runs fn again
            live = _live_holds(st, clock, tnow)
            if live:
                st["holds"] = live  # the expired ones go
                held = max(e for _c, e in live.values()) - tnow
                return
            st.pop("holds", None)
            st["phase"] = "deleting"
            st["epoch"] += 1  # odd: writers that commit from now on re-validate first
        st = dict(self._gc_owned(owner, now, ("marking",), fn))
        st["held"] = held
        return st

    # Liveness for writers (docs/design/gc.md, "Writers are not starved"). A writer
    # whose move was fenced takes a hold in the transaction that finds the epoch even;
    # while a hold lives no deletion phase opens, so its re-validation and move go
    # through. Holds expire on the table's clock; the safety of the fence never depends
    # on them.
    def gc_hold(self, holder: str, *, seconds: float | None = None, now: float | None = None) -> int | None:
        """Take or renew `holder`'s hold for `seconds` (default HOLD_SECONDS) -> the epoch,
        the writer's new fence, if it is even; None while a deletion phase runs. The hold
        is recorded either way: one taken during a phase keeps the gc's next phase (a gc
        deletes in several) from opening until the writer has moved, so a writer that
        polls the epoch cannot miss the short gap between two phases."""
        seconds = HOLD_SECONDS if seconds is None else float(seconds)

        def txn(t):
            st = _gc_state(t)
            clock, tnow = _clock(t, now)
            live = _live_holds(st, clock, tnow)
            live[holder] = [clock, tnow + seconds]
            st["holds"] = live
            t.put("gc", b"state", encode_record(st))
            return None if st["epoch"] % 2 else st["epoch"]
        return self._write(txn)

    def gc_unhold(self, holder: str) -> None:
        """Release `holder`'s hold (a move with hold= releases it too)."""
        def txn(t):
            drop_hold(t, holder)
        self._write(txn)

    def gc_thaw(self, owner, *, now: float | None = None):
        """Close `owner`'s deletion phase (epoch even) and keep the lock (phase "marking"):
        a gc deletes in several short phases, so a writer it fences waits for one
        phase, never for the whole sweep. The next gc_freeze opens the next phase."""
        def fn(st, _clock, _tnow):
            if st["epoch"] % 2:
                st["epoch"] += 1
            st["phase"] = "marking"
        return self._gc_owned(owner, now, ("deleting",), fn)

    def gc_finish(self, owner, *, now: float | None = None, **fields):
        def fn(st, _clock, _tnow):
            if st["epoch"] % 2:
                st["epoch"] += 1
            st.update(fields, phase="idle", owner=None)
            for k in _LOCK_FIELDS:
                st.pop(k, None)
        return self._gc_owned(owner, now, ("marking", "deleting"), fn)

    def gc_abort_stale(self, *, now: float | None = None):
        """Close a deletion phase whose gc's lease ran out (on the table's clock), or whose
        gc's process is known to be gone: a gc never deletes past its lease, and a dead
        one deletes nothing more, so its epoch can be closed."""
        def txn(t):
            st = _gc_state(t)
            # Any odd epoch whose lease ran out is closed, whatever its phase says.
            if st["epoch"] % 2 and _lease_left(t, st, now) <= 0:
                st["epoch"] += 1
                st.update(phase="idle", owner=None, aborted=t.wall())
                for k in _LOCK_FIELDS:
                    st.pop(k, None)
                t.put("gc", b"state", encode_record(st))
            st["lease_left"] = None if st["epoch"] % 2 == 0 else _lease_left(t, st, now)
            return st
        return self._write(txn)


def note_dropped(t: Txn, root: bytes, row: dict) -> None:
    """Record what the commit of a catalog row being dropped had added to storage, and when
    (_DROPPED): a picture of the store's past draws it (usage.physical_over_time)."""
    n, est = row.get("stored_new"), False
    if n is None:
        n, est = row.get("bytes_new", 0), True
    at = row.get("time", 0.0)
    if type(n) is int and 0 <= n < 1 << 62 and type(at) in (int, float) and abs(at) < 1e18:
        t.put("gc", _DROPPED + root, encode_record({"at": float(at), "bytes": n, "est": est}))


def _dropped_entries(t: Txn) -> dict[bytes, tuple[float, int, bool]]:
    """The stored entries of _DROPPED (untrusted: one that does not decode is left out)."""
    out = {}
    for k, raw in t.items("gc", _DROPPED):
        try:
            e = decode_record(raw, "dropped commit")
        except FormatError:
            continue
        at, n = e.get("at"), e.get("bytes")
        if type(at) in (int, float) and abs(at) < 1e18 and type(n) is int and 0 <= n < 1 << 62:
            out[k[len(_DROPPED):]] = (float(at), n, e.get("est") is True)
    return out


def _reclaimed_runs(raw: bytes | None) -> list[list]:
    """The stored runs, each [at, block bytes, all bytes] of finite numbers; stored bytes
    are untrusted: an undecodable record or entry is left out (it only feeds a picture)."""
    if raw is None:
        return []
    try:
        runs = decode_record(raw, "gc reclaimed").get("runs")
    except FormatError:
        return []
    ok = []
    for r in runs if isinstance(runs, list) else []:
        if isinstance(r, list) and len(r) == 3 and all(type(x) in (int, float) for x in r) \
                and all(abs(x) < 1e18 for x in r) and r[1] >= 0 and r[2] >= 0:
            ok.append(r)
    return ok[-RECLAIMED_KEPT:]


def _clock(t: Txn, now: float | None) -> tuple[str, float]:
    clock, tnow = t.clock()
    return clock, (tnow if now is None else now)


def _lease_left(t: Txn, st: dict, now: float | None) -> float:
    if holder_gone(st.get("proc")):
        return 0.0  # a dead process deletes nothing more (docs/design/gc.md, "A holder known dead")
    if "expires" not in st:  # no declared lease: its heartbeat's age on the wall clock
        return max(0.0, float(st.get("heartbeat", 0.0)) + UNDECLARED_LEASE - (t.wall() if now is None else now))
    clock, tnow = _clock(t, now)
    if st.get("clock") != clock:
        return 0.0  # another boot of the table's host: that gc is gone
    return max(0.0, float(st["expires"]) - tnow)


def _live_holds(st: dict, clock: str, tnow: float) -> dict:
    """The writers' holds that have not run out on the table's clock (one of another boot has)."""
    return {h: [c, e] for h, (c, e) in (st.get("holds") or {}).items() if c == clock and e > tnow}


def drop_hold(t: Txn, holder: str) -> None:
    st = _gc_state(t)
    holds = st.get("holds") or {}
    if holder in holds:
        del holds[holder]
        t.put("gc", b"state", encode_record(st))


def check_fence(t: Txn, fence: int | None) -> None:
    if fence is not None:
        epoch = _gc_state(t).get("epoch", 0)
        if epoch != fence or epoch % 2:
            raise Fenced(f"gc deletion epoch moved from {fence} to {epoch}")


def check_kept(t: Txn, root: bytes, fence: int | None) -> None:
    """A fenced tag or pin names a snapshot that is kept now: it has a catalog row or is a
    ref's tip. Checked in the transaction that inserts the row, so a gc's expiry either
    saw the tag or pin (and kept the snapshot) or happened before it (and this refuses)."""
    if fence is None or t.get("catalog", root) is not None:
        return
    if any(v == root for _k, v in t.items("refs")):
        return
    raise RefNotFound(f"snapshot {root.hex()[:16]} is no longer kept (retention dropped it meanwhile)")


def _rebuild_mark(t: Txn) -> dict | None:
    raw = t.get("meta", REBUILD_KEY)
    if raw is None:
        return None
    try:
        mark = decode_record(raw, "rebuild mark")
    except FormatError:
        return {"owner": "?", "started": None}  # unreadable: still a rebuild nobody finished
    owner = mark.get("owner")
    return {"owner": None if owner is None else str(owner), "started": mark.get("started")}


def rebuild_message(mark: dict, what: str = "gc") -> str:
    started = mark.get("started")
    when = (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
            if isinstance(started, (int, float)) and not isinstance(started, bool) and 0 <= started < 1e11 else "?")
    if mark.get("owner") is None:
        return (f"{what} refused: this ref table was found empty ({when}) for a store made before it (a lost or "
                f"emptied table, or the wrong --refs / $TSCK_REFS?) and no `tsck recover` has finished on it "
                f"since; it may not list every snapshot. Run `tsck recover` first, then {what}; nothing was "
                f"deleted")
    return (f"{what} refused: the ref table is being rebuilt from storage by `tsck recover` (begun {when} by "
            f"{mark.get('owner', '?')}), or that recover stopped before it finished; until a recover finishes, "
            f"the table may not list every snapshot, so nothing may be deleted by it. Run `tsck recover` "
            f"again (or let the running one finish), then {what}; nothing was deleted")


def _refuse_if_rebuilding(t: Txn, what: str = "gc") -> None:
    mark = _rebuild_mark(t)
    if mark is not None:
        raise RebuildUnfinished(rebuild_message(mark, what))


def _gc_state(t: Txn) -> dict:
    return decode_gc_state(t.get("gc", b"state"))


# A holder known dead (docs/design/gc.md, "A holder known dead"). The lock records the
# process that took it; a party that shares its host (the same boot, pid namespace and
# time namespace: pids and start times mean the same there) and finds that pid gone,
# or held by a process that started at another time, or a zombie, knows the holder
# deletes nothing more. Anything else (another host, a record it cannot read, a
# /proc that is not its own) is no proof of death: the lease decides.
_IDENTITY: tuple[int, dict | None] | None = None


def _read_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, start time in clock ticks since boot, threads) of `pid` from /proc, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        fields = raw[raw.rindex(b")") + 2:].split()  # the name may hold spaces and parentheses
        return fields[0].decode(), int(fields[19]), int(fields[17])
    except (OSError, ValueError, IndexError):
        return None


def _ns(name: str) -> str:
    try:
        return os.readlink(f"/proc/self/ns/{name}")
    except OSError:
        return ""


def process_identity() -> dict | None:
    """This process as the gc lock records it: {host, pid, start}, or None where it
    cannot be told apart reliably (no /proc, or a /proc of another pid namespace)."""
    global _IDENTITY
    pid = os.getpid()
    if _IDENTITY is not None and _IDENTITY[0] == pid:  # computed again in a forked child
        return _IDENTITY[1]
    ident = None
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        with open("/proc/self/stat", "rb") as f:
            own = int(f.read().split(b" ", 1)[0])
    except (OSError, ValueError):
        boot, own = "", -1
    stat = _read_stat(pid)
    pidns = _ns("pid")
    if boot and own == pid and stat is not None and pidns:
        ident = {"host": f"{boot}/{pidns}/{_ns('time')}", "pid": pid, "start": stat[1]}
    _IDENTITY = (pid, ident)
    return ident


def _set_proc(st: dict) -> None:
    ident = process_identity()
    if ident is None:
        st.pop("proc", None)
    else:
        st["proc"] = dict(ident)


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 < x < 2**63


def holder_gone(proc: Any) -> bool:
    """Is the process a gc lock records (`proc`, untrusted stored data) known to be gone?
    Only where this process shares its host and pid namespace; never for its own."""
    me = process_identity()
    if me is None or not isinstance(proc, dict) or proc.get("host") != me["host"]:
        return False
    pid, start = proc.get("pid"), proc.get("start")
    if not (_int(pid) and isinstance(start, int) and not isinstance(start, bool)):
        return False
    if pid == me["pid"]:
        return start != me["start"]  # this pid was the holder's, in another process's life
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # it exists (another user's)
    except OSError:
        return False
    stat = _read_stat(pid)
    if stat is None:  # hidden from us (hidepid), or gone this instant: not proven
        return False
    state, started, threads = stat
    if started != start:
        return True  # the pid was reused after the holder ended
    return state in ("Z", "X") and threads <= 1  # exited; only its exit status is left
