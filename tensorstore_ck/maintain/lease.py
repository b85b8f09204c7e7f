"""The store's gc lock held under a lease: gc, prune and fsck --repair take it
(holding_gc_lock); the Lease renews it from a thread of its own and keeps every delete
request within it, judged on the ref table's clock (docs/design/gc.md, "The gc lease and the one clock")."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid

from ..core.core import DEFAULT_LEASE, Core
from ..core.roles import GcTable
from ..errors import GcBusy, InvalidArgument, TsckError
from ..storage.base import DeadlinePassed

__all__ = ["Lease", "holding_gc_lock", "REMOVED_KEPT"]

log = logging.getLogger(__name__)

REMOVED_KEPT = 1 << 20  # deletions noted for the presence record (Lease.note_removed); past it, none


@contextlib.contextmanager
def holding_gc_lock(core: Core[GcTable], *, lease: float = DEFAULT_LEASE, role: str = "", renew_every: float | None = None,
                    rebuilding_ok: bool = False):
    """The store's gc lock under a lease (gc itself, and work other than gc that removes
    objects from their addresses: fsck --repair moves damaged ones aside): yields the
    Lease (freeze() opens the deletion phase, run() keeps each removal within the
    lease); the phase is finished on exit, whatever happened (with the Lease's
    finish_fields recorded in the gc state when all went well). RebuildUnfinished while
    a recover has not finished, unless rebuilding_ok (work that deletes nothing a
    snapshot reaches)."""
    refs = core.refs
    owner = f"{role}{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    hold = Lease(refs, owner, lease, request_timeout=core.storage.request_timeout, renew_every=renew_every,
                 rebuilding_ok=rebuilding_ok, what=role.rstrip(":") or "gc")
    try:
        yield hold
    except BaseException as e:
        log.warning("gc lock %s: stopped: %s: %s", owner, type(e).__name__, e)
        hold.stop()
        try:
            refs.gc_finish(owner)
        except GcBusy:
            pass  # the lock is no longer ours
        except TsckError as e2:  # e.g. the table's disk is full: end it at the next chance
            log.warning("gc lock %s: could not release it (%s); released once the ref table takes writes",
                        owner, e2)
            refs.gc_abandoned(owner)
        raise
    hold.stop()
    try:
        st = refs.gc_finish(owner, **hold.finish_fields)
    except GcBusy:
        raise
    except TsckError:
        refs.gc_abandoned(owner)
        raise
    if hold.froze_from is not None and hold.removed is not None:
        # This process ran the only deletion phase since froze_from and knows all it deleted.
        core.assets.presence.carry(hold.froze_from, st["epoch"], hold.removed)


class Lease:
    """A gc's hold on the store, renewed from a thread of its own.

    The ref table records expires = (its clock during the renewal) + seconds, and
    others judge the gc dead only once their reading of that clock passes it. A
    renewal's transaction runs after `m0`, this host's monotonic time taken just
    before it, so here the lease surely lasts until m0 + seconds. No delete request
    starts unless it ends (at the storage's request timeout) a margin before that:
    a gc never deletes after the moment another party may consider it dead."""

    def __init__(self, refs: GcTable, owner: str, seconds: float, *, request_timeout: float,
                 renew_every: float | None = None, rebuilding_ok: bool = False, what: str = "gc"):
        if not (isinstance(seconds, (int, float)) and 0 < seconds < 1e7):
            raise InvalidArgument(f"gc lease must be a positive number of seconds, got {seconds!r}")
        self.refs, self.owner, self.seconds = refs, owner, float(seconds)
        self.finish_fields: dict = {}  # recorded in the gc state when the holder finishes
        self.margin = max(0.05, 0.05 * self.seconds)  # clock rates differ a little; renewals take time
        self.request_timeout = float(request_timeout)
        self.every = renew_every or max(0.02, min(5.0, self.seconds / 4))
        # Between two renewals a delete may start only while it ends a margin before the
        # lease could run out: the lease must outlast one request plus two renewal periods.
        if self.request_timeout + self.margin + 2 * self.every >= self.seconds:
            raise InvalidArgument(f"gc lease of {self.seconds:g}s is too short: this storage's requests may take "
                                  f"{self.request_timeout:g}s (its timeouts), and a delete must end well within the "
                                  "lease; use a longer lease or shorter storage timeouts")
        self.error: BaseException | None = None
        self.froze_from: int | None = None    # freeze(): the even epoch its phase closed
        self.removed: dict | None = None      # kind -> digests deleted, when all are noted
        self._lock = threading.Lock()
        m0 = time.monotonic()
        refs.gc_begin(owner, lease=self.seconds, rebuilding_ok=rebuilding_ok, what=what)
        self.until = m0 + self.seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tsck-gc-lease", daemon=True)
        self._thread.start()

    def renew(self) -> None:
        m0 = time.monotonic()
        self.refs.gc_heartbeat(self.owner)
        with self._lock:
            self.until = max(self.until, m0 + self.seconds)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.renew()
            except BaseException as e:  # noqa: BLE001 - handed to the gc thread by check()
                log.warning("gc %s: lease renewal failed: %s: %s", self.owner, type(e).__name__, e)
                self.error = e
                return

    def freeze(self) -> None:
        """Open the deletion phase; first wait out the holds of writers that are
        re-validating a fenced snapshot (each expires on the table's clock), so that a gc
        looping back to back cannot fence the same writer forever."""
        t0, told = time.monotonic(), False
        while True:
            self.check()
            m0 = time.monotonic()
            st = self.refs.gc_freeze(self.owner)
            with self._lock:
                self.until = max(self.until, m0 + self.seconds)
            if not st["held"]:
                self.froze_from = st["epoch"] - 1  # the even epoch this phase closed
                break
            if not told:
                told = True
                log.debug("gc %s: %d writer(s) re-validating a fenced snapshot; deletion waits for them",
                          self.owner, len(st.get("holds") or ()))
            time.sleep(min(0.05, st["held"]))
        if told:
            log.debug("gc %s: writers' holds gone after %.2fs", self.owner, time.monotonic() - t0)

    def thaw(self):
        """Close the deletion phase freeze() opened (epoch even) and keep the lock. ->
        (the even epoch the phase closed, the even epoch now, the objects it deleted or
        None when not all were noted), or None if no phase was open."""
        if self.froze_from is None:
            return None
        self.check()
        m0 = time.monotonic()
        st = self.refs.gc_thaw(self.owner)
        with self._lock:
            self.until = max(self.until, m0 + self.seconds)
        out = (self.froze_from, st["epoch"], self.removed)
        self.froze_from, self.removed = None, None
        return out

    def note_removed(self, kind: str, digests) -> None:
        """Objects this phase deleted (gc's sweep): with all of them known at the finish,
        the Store's presence record survives the phase less these (Presence.carry)."""
        if self.removed is None:
            return
        got = self.removed.setdefault(kind, set())
        got.update(digests)
        if sum(len(v) for v in self.removed.values()) > REMOVED_KEPT:
            self.removed = None  # too many to carry: the record starts afresh instead

    def check(self) -> None:
        """Raise if the lock was lost (another gc took over a lease that ran out)."""
        if self.error is not None:
            raise self.error

    def deadline(self) -> float:
        """The monotonic time after which no delete request may start."""
        with self._lock:
            return self.until - self.margin - self.request_timeout

    def run(self, fn, *args):
        """fn(*args, deadline=...) with the lease's deadline; if the deadline comes first,
        renew (GcBusy if the lock was lost meanwhile) and go on. fn must be idempotent."""
        for _ in range(1000):
            self.check()
            try:
                return fn(*args, deadline=self.deadline)
            except DeadlinePassed:
                log.debug("gc %s: a delete would end past the lease's margin; renewing first", self.owner)
                self.renew()
                if time.monotonic() >= self.deadline():  # a renewal slower than the lease itself
                    raise GcBusy("gc stopped deleting: it could not renew its lease in time") from None
        raise GcBusy("gc stopped deleting: its lease kept running out")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
