"""A local tier's uploader: snapshots published in the local store, sent to the remote one.

open_store(remote, local=PATH) gives a Store whose Core is the local tier (a local disk
and an LMDB ref table under PATH) and an Uploader holding the remote Core. A put
publishes locally and queues its root in the local ref table (TierTable.upload_enqueue);
one background thread per Store then, for each queued snapshot, oldest first:

    read the remote gc fence -> walk the snapshot in the local tier (walk.py) ->
    blocks, then nodes, then the commit: skip what the remote's presence record or a
    HEAD says is there, copy the rest as stored (checked first, the same bytes under
    the same address) -> remote sync -> fenced compare-and-swap of the remote ref to
    the same root (Publisher.move_to; a fenced move re-validates every object) ->
    mark the root durable in the local table and drop it from the queue (one transaction).

The remote ref therefore never names an object the remote store lacks: every object
is there and synced before the move, and a gc deletion phase that overlaps the upload
fences the move, which then asks the remote for every object again
(docs/design/tiers.md). The queue lives in the local table, so a process killed at any
moment resumes at its next open: what the remote has is skipped, the move is made once
(a root the remote catalog lists is published already).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib

from ..core.assets import FRAME_KIND
from ..core.core import Core
from ..core.roles import UploadQueue
from ..refs import RefTable
from ..core.walk import by_kind, walk_commit
from ..errors import GcBusy, IntegrityError, NotAStore, StorageError, TierFull, TsckError
from ..format import frame
from ..write.publish import Publisher
from ..write.saver import Saver, executor_for
from .budget import fit_budget, tier_bytes
from .collective import KEEP_PREFIX
from .holds import held, publish_holds, upload_hold
from .memory import tier_only
from .outage import Outage, heals, said_after_stop

__all__ = ["Uploader", "RETRY_PAUSE", "BUDGET_WAIT", "TEE_BYTES", "early_default"]

log = logging.getLogger(__name__)

# Bytes of early-upload sends a tiered store holds in memory at once; past this a new
# block waits for the uploader, which reads it back from the local tier.
TEE_BYTES = 256 << 20

# The early upload is on by default on hosts with at least this many cores: its sends
# (request signing, the HTTP client) cost about as much CPU per byte as the put itself,
# which on a small host is taken from the put (docs/PERFORMANCE.md, "The local tier").
EARLY_UPLOAD_CORES = 8


# Objects this process's puts wrote new in the tier that the uploader remembers at once
# (Uploader.tee); past this the record starts afresh (an object it forgot is checked whole).
WRITTEN_MAX = 1 << 16


def early_default() -> bool:
    return (os.cpu_count() or 1) >= EARLY_UPLOAD_CORES

# First and longest pause between two tries of a failed upload, seconds: the pause doubles
# up to the longest, and the tries go on for as long as the process lives (tier/outage.py:
# only a failure no wait cures stops them). Read at each failure: a test shortens it.
RETRY_PAUSE = (0.5, 30.0)
TIDY_EVERY = 8  # uploads in a row after which a rank's due cleanup runs, even with more queued (Uploader.follow)
# Seconds a put into a tier over its budget waits for uploads to free room (Uploader.make_room)
# before it fails with TierFull: long enough for a large snapshot's upload over a slow
# link; past it the remote is as good as away, and a failed put says so where a put that
# waited on would stall the training without a word.
BUDGET_WAIT = 600.0
# Seconds rank 0 waits, without progress, for another rank's part of a collective
# snapshot that a newer queued snapshot of its ref supersedes, before it skips it
# (Uploader.skip_superseded): long enough for a slow rank's upload to show progress.
SUPERSEDED_PART_WAIT = 30.0
PRUNE_RETRY = 10.0  # seconds the uploader waits out a prune of the tier before it leaves its own to the next


class Uploader:
    """Sends a local tier's queued snapshots to the remote store, on one thread.

    Counters (tests, the harness): `sent` objects written remotely, `skipped` objects
    the remote had, `superseded` snapshots not sent (Uploader.skip_superseded)."""

    def __init__(self, local: Core[UploadQueue], remote: Core[RefTable], budget: int | None = None,
                 early: bool = True, stop: threading.Event | None = None, saver: Saver | None = None,
                 lean: bool = False, schedules: bool = False):
        """stop: the remote's retry policy's stop event (retry.Backoff.stoppable), set by
        close(): a request being retried gives up then instead of waiting out its budget.
        saver: a saver process (open_store(saver="process")): the uploads' copies run
        there, off this process's GIL, and there is no early upload (its sends would be
        this process's work again)."""
        self.local, self.remote = local, remote
        self._retry_stop = stop
        self.budget = budget  # the tier's byte budget (open_store(local_budget=)); None: none
        # A memory tier (lean): after each upload, the durable copies a newer snapshot of
        # their ref stands in for are dropped (gc.superseded_copies): host memory holds
        # what a restore needs first, the remote the rest.
        self.lean = lean
        self._lean_due = False  # (lean_due)
        self._listed: set = set()  # parts marked durable whose snapshot the remote catalog lists (_published)
        # durable_every=N: the tier holds tier-only snapshots, which an upload may let go
        # (_prune_here); without a schedule none is made, and no upload asks.
        self.schedules = schedules
        # An eviction to the budget is due or running (at open, after each upload):
        # wait_durable() returns once it is done, so the budget holds when it returns.
        self._fitting = budget is not None
        # The open's own work is still to come (the tier's tags and pins made again in the
        # remote table): wait_durable() and drain() wait for it, as for an upload queued.
        self._opening = True
        self._fit_lock = threading.Lock()  # one eviction at a time: this thread's, or a put's (make_room)
        self.publisher = Publisher(remote.assets, remote.refs, remote.pool)
        self._cond = threading.Condition()
        self._stop = False
        self.error: BaseException | None = None  # the failure that stopped the uploader
        self._heard = False  # wait_durable raised it (close() does not raise it again)
        # Upload attempts that failed, and the last failure: a close stops waiting at a
        # failure (drain), since the next try would come only after a backoff.
        self._failures, self._last_failure = 0, None
        self.outage = Outage()  # upload attempts failing since the last success (tier/outage.py)
        # ref -> the step of its snapshot made durable last (tier.outage.measure's steps behind)
        self.durable_steps: dict = {}
        self._closing = False  # drain() is waiting for the queue (Store.close)
        self._forked = False
        self.sent = self.skipped = 0
        self.orphans = 0  # parts sent whose snapshot's outcome never reached this tier (collective._upload_orphan)
        self.superseded = 0  # queued snapshots not sent: a newer one of their ref was queued (the backlog rule)
        # A rank other than 0 of collective snapshots: job -> what rank 0's tier keeps of
        # it, told at the last snapshot (follow); the rest of the job's parts go (_tidy).
        self._follow: dict = {}
        self._tidying = False  # a _tidy is running (wait_durable waits for it)
        self._since_tidy = 0
        self.tidied = 0  # part rows dropped by _tidy
        self.tidy_busy = 0  # _tidy attempts that found a gc holding the tier
        # The early upload (tee): each new block a put writes here is also sent to the
        # remote as it is written, from memory, so the upload overlaps the local write.
        self._tee_fence: int | None = None  # the remote fence the put's early sends are recorded under
        # The remote fence the uploader read last (read_fence): the early sends' fence. A put
        # never reads it from the remote table itself: with that table away, the tier's puts
        # go on (they would wait out the retry budget, then fail).
        self._known_fence: int | None = None
        self._tee_fence_failed = False  # this put's fence could not be read: no early sends
        self._fence_reading = False  # a send is reading it (_early_fence)
        self._fence_lock = threading.Condition()  # (notified as a send's fence read ends)
        self._tee_bytes = 0  # bytes held by sends in flight (bounded by TEE_BYTES)
        self.teed = self.tee_dropped = 0
        self.early = early and saver is None
        # Where the uploads' copies run (roles.Executor): the saver process, or threads of
        # the remote's pool.
        self.copies = executor_for(saver, remote)
        # (kind, digest) -> (length, CRC32) of each block and node this process's puts
        # wrote new here, as written (tee). The upload checks the tier's copy against them
        # (Assets.stored_frame) and sends it as the conditional PUT alone: new here, most
        # likely new there (Assets.copy_from). Forgotten once sent.
        self._written: dict[tuple[int, bytes], tuple[int, int | None]] = {}
        self.sent_written = 0  # objects copied with such a record (tests)
        # fn(root, row, at) after each snapshot became durable (after_durable), on this
        # thread: its catalog row and the local table's clock when it was marked durable.
        self.listeners: list = []
        local.assets.on_written(self.tee)
        self._requeue_unqueued()
        # Queued by an earlier process: its upload may have moved the remote ref already.
        self._resumed = {seq for seq, _ in local.refs.tier_rows.upload_pending()}
        self._thread = threading.Thread(target=self._run, name="tsck-upload", daemon=True)
        self._thread.start()

    # -- the queue -----------------------------------------------------------------
    def enqueue(self, root: bytes, ref: str, step, part: bytes | None = None) -> int:
        """part: this rank's sub-tree of a collective snapshot (tier/collective.py), not the snapshot."""
        seq = self.local.refs.tier_rows.upload_enqueue(root, ref, step, part=part)
        with self._cond:
            self._cond.notify_all()
        return seq

    def lean_due(self) -> None:
        """A memory tier, a tier-only snapshot committed: the durable copies it now stands
        in for go, on this thread once no upload is pending (wait_durable waits for it)."""
        if not self.lean or self._forked:  # (a forked child has no thread of its own: its parent's cleans up)
            return
        with self._cond:
            self._lean_due = self._fitting = True
            self._cond.notify_all()

    def follow(self, job, keep: set) -> None:
        """A rank other than 0 (tier.collective.CollectiveTier.adopt): `keep` is what rank 0's tier
        keeps of `job` (its retention's doing), as the roots' first KEEP_PREFIX bytes; this
        rank's parts of the job's other
        snapshots are dropped from its tier, with what only they reach, by the uploader
        thread when its queue is empty (or every TIDY_EVERY uploads), never a part still
        queued. The latest word per job wins: the rule is stateless, so one missed (the
        process ended first) is made good by the next."""
        with self._cond:
            self._follow[job] = set(keep)
            self._cond.notify_all()

    def _tidy(self) -> None:
        """Apply the latest words of follow(). A gc holding the tier is waited out, up to
        PRUNE_RETRY; past that the words are kept (unless a newer one came) and tried again
        at the next turn: rank 0 says nothing after its last snapshot, so a word dropped
        here would leave this rank's tier with parts its job no longer keeps."""
        with self._cond:
            follow, self._follow, self._tidying = self._follow, {}, True
        self._since_tidy = 0
        refs = self.local.refs
        busy = False
        again: set = set()  # jobs whose word waits for a queued part (applied once it is sent)
        try:
            parts = refs.tier_rows.parts(rank0=False)
            jobs = {r: (refs.catalog_get(r, checked=False) or {}).get("job") for r in parts}
            drop = [r for r, job in jobs.items() if job in follow and r[:KEEP_PREFIX] not in follow[job]]
            if drop:
                from ..maintain.gc import drop_parts

                def met_gc():
                    self.tidy_busy += 1
                rep = self._waiting_out_gc(lambda: drop_parts(self.local, drop, lease=self.local.settings.gc_lease),
                                           on_busy=met_gc)
                self.tidied += len(rep.expired)
                # A part still queued is not dropped (its upload comes first); rank 0 may say
                # nothing more, so the word is kept for the turn after that upload.
                queued = {e.get("root") for _, e in refs.tier_rows.upload_pending()}
                again = {jobs[r] for r in set(drop) - {bytes.fromhex(h) for h in rep.expired} if r in queued}
                log.debug("local tier: dropped this rank's part of %d collective snapshot(s) rank 0's tier no "
                          "longer keeps (%d objects, %d bytes)", len(rep.expired), rep.deleted_objects,
                          rep.deleted_bytes)
        except GcBusy:
            busy = True
            log.debug("local tier: a gc holds %s; this rank's old parts are dropped once it ends", self.local.url)
        except Exception as e:  # noqa: BLE001 - the uploads matter more than the cleanup
            log.warning("local tier: could not drop this rank's old parts (%s: %s); tried again after the next "
                        "snapshot", type(e).__name__, e)
        finally:
            with self._cond:
                for job, keep in follow.items():
                    if busy or job in again:
                        self._follow.setdefault(job, keep)  # a newer word wins
                self._tidying = False
                self._cond.notify_all()

    def _requeue_unqueued(self) -> None:
        """A put killed between its local ref move and its enqueue left a local tip that
        is neither durable nor queued: queue it (the ref's tip is what counts; an older
        snapshot of that ref superseded before the kill is not sent). The same for a
        rank's part of a collective snapshot (its row is written before the enqueue). A
        tier-only snapshot (durable_every) was never to be queued: it is left."""
        refs = self.local.refs
        for part in refs.tier_rows.intents_queue():
            log.debug("local tier: queueing this rank's part %s of a collective snapshot: it was written, and the "
                      "process ended before the snapshot's outcome reached this tier", part.hex()[:16])
        queued = {e["root"] for _, e in refs.tier_rows.upload_pending()}
        self._mark_listed(queued)
        parts = {r: t for r, t in refs.tier_rows.parts(rank0=False).items() if r not in queued}
        done = refs.tier_rows.durable(parts)
        for root, tree in parts.items():
            if root not in done:
                row = refs.catalog_get(root, checked=False) or {}
                if tier_only(row.get("meta")):
                    continue
                log.debug("local tier: queueing this rank's part of snapshot %s, published and never queued",
                          root.hex()[:16])
                refs.tier_rows.upload_enqueue(root, row.get("ref"), row.get("step"), part=tree)
        tips = [(name, root) for name, root in refs.list() if root not in queued]
        done = refs.tier_rows.durable(root for _, root in tips)
        for name, root in tips:
            if root not in done:
                row = refs.catalog_get(root) or {}
                if tier_only(row.get("meta")):
                    continue
                log.debug("local tier: queueing the tip of ref %s (%s), published locally and never queued",
                          name, root.hex()[:16])
                refs.tier_rows.upload_enqueue(root, name, row.get("step"))

    def _mark_listed(self, queued: set) -> None:
        """The tier's snapshots that are neither durable nor queued but that the remote
        catalog lists are marked durable: the remote holds them (a table rebuilt by
        `tsck recover` has lost its marks). So they are not queued or sent again, the
        budget may evict them, and `log` does not call them local-only. Only the remote
        ref table is asked (no request to the remote storage), and only about these
        roots: once marked they are not asked about again."""
        refs = self.local.refs
        roots = refs.catalog_roots() - queued
        roots -= refs.tier_rows.durable(roots)
        if not roots:
            return
        try:
            listed = self.remote.refs.catalog_which(roots)
        except Exception as e:  # noqa: BLE001 - unmarked, they are asked about at the next open
            log.warning("local tier: could not ask %s's ref table which snapshots it holds (%s: %s)",
                        self.remote.url, type(e).__name__, e)
            return
        marked = refs.tier_rows.durable_mark(listed) if listed else []
        if marked:
            log.debug("local tier: %d snapshot(s) of the tier that %s lists marked durable (not sent again)",
                      len(marked), self.remote.url)

    def wait_unsent(self, roots: set, timeout: float) -> bool:
        """Wait until no upload of `roots` is in flight (an entry is marked started before it
        sends, upload_begin, and dropped at its end) -> True; False past `timeout`, or once
        this uploader stopped or failed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.local.refs.tier_rows.uploading() & roots:
                left = deadline - time.monotonic()
                if left <= 0 or self.error is not None or self._stop:
                    return False
                self._cond.wait(min(0.5, left))
        return True

    def wait_durable(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot queued before this call is durable -> True, or False
        once `timeout` seconds passed. Raises the failure that stopped the uploader (one
        no wait cures: tier.outage.heals); an outage is waited out, up to `timeout`."""
        target = self.local.refs.tier_rows.upload_last_seq()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self.error is not None:
                    self._heard = True
                    raise self.error
                pending = [seq for seq, _ in self.local.refs.tier_rows.upload_pending() if seq <= target]
                if not pending and not self._fitting and not self._follow and not self._tidying \
                        and not self._opening:
                    return True
                if self._stop:
                    raise TsckError("the uploader stopped (the store was closed, or this is a forked child) before "
                                    "these uploads finished; they resume at the next open_store(..., local=) of "
                                    "this local tier")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.5 if left is None else min(0.5, left))

    def drain(self, timeout: float | None = None) -> str | None:
        """Wait while the queued uploads make progress -> None once the queue is empty,
        else why the wait ended with uploads left: the uploader stopped (its error is kept
        for unheard()), `timeout` seconds passed (None: no bound), or an upload attempt
        failed meanwhile (the remote away or failing: its next try would come only after
        a backoff, while the caller waits to exit). Store.close() finishes uploads as it
        finishes puts, within its timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            failures, self._closing = self._failures, True
            self._cond.notify_all()  # an uploader pausing after a failed try tries again now
            while self.local.refs.tier_rows.upload_pending() or self._follow or self._tidying or self._opening:
                if self.error is not None:
                    return f"the uploader stopped: {type(self.error).__name__}: {self.error}"
                if self._stop:
                    return "the uploader was stopped"
                if self._failures != failures:
                    e = self._last_failure
                    return f"an upload failed: {type(e).__name__}: {e}"
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return "close's timeout passed"
                self._cond.wait(0.5 if left is None else min(0.5, left))
        return None

    def close(self, timeout: float | None = None) -> bool:
        """Stop after the upload in progress; what is queued stays queued (the next open
        resumes). A remote request being retried gives up at once (the retry policy's
        stop), so the thread ends within about one request. -> whether it ended within
        `timeout` seconds (None: waited for). One that did not is left to end by itself:
        it can publish nothing wrongly, since the remote ref moves only after every
        object was sent and synced (and every request now fails), and the durable mark
        only after that move (a closed table refuses it; the next open sees the move)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._retry_stop is not None and not self._forked:
            self._retry_stop.set()
        if self._forked:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def queued(self) -> int:
        """Snapshots (or a rank's parts) still queued in the tier."""
        return len(self.local.refs.tier_rows.upload_pending())

    def unheard(self) -> BaseException | None:
        """The failure that stopped the uploader, if wait_durable() never raised it:
        Store.close() raises it, so a script that ends with close() hears it."""
        return None if self._heard else self.error

    def after_fork(self) -> None:
        """In a forked child: no uploader thread here (the parent's sends what the child
        queues); the remote core drops the parent's pool and locks."""
        self._forked, self._stop = True, True
        self._fitting = self._opening = False  # the parent's uploader keeps the budget and its holds
        self._cond = threading.Condition()
        self._fit_lock = threading.Lock()
        self._fence_lock = threading.Condition()
        self._fence_reading = False
        self.remote.after_fork()

    # -- the budget, before a put ------------------------------------------------------
    def make_room(self) -> None:
        """Before a put (or the DCP writer) writes its first block into a tier with a
        budget: return once the tier's stored bytes fit the budget, so that a put leaves
        the tier at most its own new bytes over it. Over the budget: evict the local
        copies of durable snapshots (fit_budget); still over with uploads queued, wait for
        them (each upload's eviction frees its snapshot's copy), with one warning, at most
        BUDGET_WAIT seconds. Then, or at once where waiting cannot help (nothing queued,
        the local-only snapshots alone over the budget, the uploader stopped, uploads
        failing since their last success: an outage, a forked child, whose parent keeps
        the budget), TierFull: nothing was written. Once uploads succeed again, puts wait
        for room again (back-pressure resumes as the backlog drains)."""
        budget = self.budget
        if budget is None:
            return
        held = tier_bytes(self.local)  # the cheap measure: a listing, no walk (the common case ends here)
        if held <= budget:
            return
        t0 = time.monotonic()
        deadline = t0 + BUDGET_WAIT  # read per put: a test shortens it
        evict, warned = not self._forked, False
        while True:
            if evict:
                evict = False
                try:
                    with self._fit_lock:
                        fit_budget(self.local, budget, warn=False, listed=self.remote.refs.catalog_which)
                except GcBusy:  # a gc of the tier (a prune) is running: it frees bytes too; evict after it
                    evict = True
                except TsckError as e:  # the uploader's evictions after each upload may still free room
                    log.warning("local tier: could not evict to the budget of %d bytes before a put (%s: %s)",
                                budget, type(e).__name__, e)
                held = tier_bytes(self.local)
                if held <= budget:
                    break
            stop = self._no_wait()
            if stop is None and not warned:
                from ..maintain.usage import tier_usage
                use = tier_usage(self.local)
                if use["local_only"]["bytes"] > budget:
                    stop = (f"its local-only snapshots alone take {use['local_only']['bytes']} bytes: uploads "
                            "cannot free enough",
                            "forget or prune the local-only snapshots (`tsck log` of the tier marks them) and gc "
                            "the tier, or raise local_budget=")
                else:
                    log.warning("local tier %s: it holds %d bytes, over its budget of %d bytes, and %d bytes of it "
                                "wait for upload to %s (%d snapshot(s)): the put waits for uploads to free room (at "
                                "most %gs, tier.uploader.BUDGET_WAIT)", self.local.url, held, budget,
                                use["pending"]["bytes"], self.remote.url, use["pending"]["snapshots"], BUDGET_WAIT)
                    warned = True
            if stop is not None:
                raise self._full(held, *stop)
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._full(held, f"the uploads did not free enough within {BUDGET_WAIT:g}s (tier.uploader.BUDGET_WAIT)",
                                 f"let the uploads to {self.remote.url} catch up (store.wait_durable()) before the "
                                 "next put, or raise local_budget= or the remote's write bandwidth")
            with self._cond:  # an upload's end, and the eviction after it, notify
                self._cond.wait(min(left, 0.5 if evict else 1.0))
            held = tier_bytes(self.local)
            if held <= budget:
                break
        log.debug("local tier %s: the put waited %.1fs for uploads to free room under the budget of %d bytes",
                  self.local.url, time.monotonic() - t0, budget)

    def _no_wait(self) -> tuple[str, str] | None:
        """Why waiting for the uploader cannot free the tier, and what to do; None: it can."""
        if self._forked:
            return ("this is a forked child: its parent's uploader sends what it queues and keeps the budget",
                    "put from the parent process, or raise local_budget=")
        if self.error is not None:
            return (f"the uploads to {self.remote.url} stopped ({type(self.error).__name__}: {self.error})",
                    "fix what stopped them (store.wait_durable() raises it) and reopen the store, or raise "
                    "local_budget=")
        if self._stop:
            return ("the store is closing: its uploader takes no more", "reopen the store")
        out = self.outage.failing()
        if out is not None:  # no upload can free room until the remote is back; then waiting helps again
            secs, n, e = out
            return (f"the uploads to {self.remote.url} have failed for {secs:.0f}s ({n} attempt(s); last: "
                    f"{type(e).__name__}: {e}): nothing frees room until they resume (they are retried for as long "
                    "as this process lives)",
                    "the puts wait for room again once the uploads resume (store.wait_durable() returns then); "
                    "or raise local_budget=")
        with self._cond:
            fitting = self._fitting  # an upload just ended: its eviction is still to come
        if not fitting and not self.local.refs.tier_rows.upload_pending():
            return ("no snapshot is queued for upload: waiting frees nothing",
                    "forget or prune the local-only snapshots and gc the tier (store.gc()), or raise local_budget=")
        return None

    def _full(self, held: int, why: str, fix: str) -> TierFull:
        import errno
        from ..maintain.usage import tier_usage
        try:
            use = tier_usage(self.local)
            parts = (f"{use['pending']['bytes']} bytes of {use['pending']['snapshots']} snapshot(s) waiting for "
                     f"upload, {use['local_only']['bytes']} of {use['local_only']['snapshots']} local-only "
                     f"snapshot(s), {use['durable']['bytes']} of durable copies, {use['unreferenced']['bytes']} "
                     "unreferenced")
        except (TsckError, OSError):
            use, parts = None, "what holds them could not be read"
        err = TierFull(errno.ENOSPC, f"local tier {self.local.url}: a put would exceed its budget of {self.budget} "
                                     f"bytes (local_budget=): it holds {held} bytes ({parts}); {why}; nothing was "
                                     f"written: {fix}")
        err.budget, err.held, err.usage = self.budget, held, use
        return err

    # -- the early upload ------------------------------------------------------------
    def read_fence(self) -> int:
        """The remote gc fence, read from the remote table (before an upload asks the
        remote about any object), and kept for the early sends (tee_begin)."""
        self._known_fence = fence = self.publisher.fence()
        return fence

    def tee_begin(self) -> None:
        """Before a put writes its blocks: the remote fence its early sends are recorded
        under, the one the uploader read last (none yet: the first early send reads it,
        _early_fence). Not read from the remote table here: a put through a tier must not
        wait on the remote. One older than the remote's is safe: what is recorded present
        under an older epoch is not trusted under a newer one (presence.py), and the
        upload reads the fence again before it asks the remote about anything."""
        with self._fence_lock:
            self._tee_fence, self._tee_fence_failed = self._known_fence, False

    def _early_fence(self) -> int | None:
        """The fence of this put's early sends where none was known as it began: read by
        the first send (a send thread, never the put's), outside the lock (the next put's
        tee_begin takes it, and must not wait on the remote); the sends behind it wait for
        that read on their own threads (each block of the put is sent early, however slow
        the read). None if the remote table did not answer, or once the uploader stops:
        the uploader sends those blocks."""
        with self._fence_lock:
            while self._fence_reading and self._tee_fence is None and not self._stop:
                self._fence_lock.wait(0.5)
            if self._tee_fence is not None or self._tee_fence_failed or self._stop:
                return self._tee_fence
            self._fence_reading = True
        fence = None
        try:
            fence = self.read_fence()
        except (StorageError, TsckError, OSError) as e:
            log.debug("local tier: no early upload for this put: the remote fence was not read (%s)", e)
        finally:
            with self._fence_lock:
                self._fence_reading = False
                self._fence_lock.notify_all()
                if fence is None:
                    self._tee_fence_failed = True
                elif self._tee_fence is None:
                    self._tee_fence = fence
        return fence

    def tee(self, kind: int, d: bytes, bufs, itemsize: int = 0) -> None:
        """A new block or node the local tier just wrote: its frame's length and CRC32 (a
        block kept raw: its length alone, its address checks it) recorded for its upload
        (see _written); with the early upload, a block's stored bytes also sent to the
        remote now, best effort. The uploader stays the authority:
        it walks the snapshot after publication and sends whatever this did not (a send dropped because
        TEE_BYTES were in flight, one that failed, one of a later gc phase's epoch), and
        the remote ref moves only after it. A block sent here and never named remotely
        (the put failed, the process died) is garbage to the remote gc, as any orphan."""
        try:
            n = sum(memoryview(b).nbytes for b in bufs)
            # A block kept raw is checked by its address (Assets.stored_frame): no CRC32 to take.
            crc = None if kind == frame.KIND_BLOCK and bufs and frame.is_raw_block(bufs[0]) else 0
            if crc is not None:
                for b in bufs:  # zlib releases the GIL over large buffers
                    crc = zlib.crc32(b, crc)
        except (TypeError, ValueError, BufferError):  # never the put's failure: no record, checked whole
            n = None
        if n is not None:
            with self._cond:
                if len(self._written) >= WRITTEN_MAX:
                    self._written.clear()
                self._written[(kind, d)] = (n, crc)
        fence = self._tee_fence  # (None: read by the send, _early_fence)
        if not self.early or kind != frame.KIND_BLOCK or self._tee_fence_failed or self._forked or self._stop:
            return
        data = b"".join(bufs)  # the put's buffers are reused once it returns
        with self._cond:
            if self._tee_bytes + len(data) > TEE_BYTES:
                self.tee_dropped += 1
                return
            self._tee_bytes += len(data)
        try:
            self.remote.pool.submit(self._tee_send, d, data, fence, itemsize)
        except RuntimeError:  # the pool is shut down (closing)
            self._tee_done(len(data))

    def _tee_send(self, d: bytes, data: bytes, fence: int | None, itemsize: int) -> None:
        try:
            if fence is None:
                fence = self._early_fence()
            if fence is not None and self.remote.assets.put_frame("block", d, data, fence, itemsize):
                with self._cond:
                    self.teed += 1
        except Exception as e:  # noqa: BLE001 - the uploader sends it (and hears the error)
            log.debug("local tier: early upload of block %s failed: %s", d.hex()[:16], e)
        finally:
            self._tee_done(len(data))

    def _tee_done(self, n: int) -> None:
        with self._cond:
            self._tee_bytes -= n
            self._cond.notify_all()

    def _tee_settle(self, limit: float = 10.0) -> None:
        """Wait for the early sends in flight, so the uploader asks about them once; at
        most `limit` seconds: the next puts' sends may keep some in flight for as long as
        puts keep coming, and a block both send is only sent twice, never lost."""
        deadline = time.monotonic() + limit
        with self._cond:
            while self._tee_bytes > 0 and time.monotonic() < deadline:
                self._cond.wait(0.5)

    # -- the thread ------------------------------------------------------------------
    def _republish_holds(self) -> None:
        """At open: the tier's tags and pins of durable snapshots made in the remote table
        again where it lacks them (a remote table rebuilt by `tsck recover` has its tags
        back from storage, not its pins; one made while the remote was away): one look
        at the remote table per tag or pin (holds.held)."""
        refs = self.local.refs
        try:
            roots = {r for _, r in refs.tags()} | refs.pins()
            for root in refs.tier_rows.durable(roots):
                held(self, root)
        except Exception as e:  # noqa: BLE001 - a failure here is retried at the next open
            log.warning("local tier: the tier's tags and pins could not be checked at %s (%s: %s)", self.remote.url,
                        type(e).__name__, e)

    def _run(self) -> None:
        tries = 0
        try:
            self._republish_holds()
        finally:
            with self._cond:
                self._opening = False
                self._cond.notify_all()
        self._fit()  # at open: a tier over its budget (a smaller budget than last time)
        while True:
            with self._cond:
                if self._stop:
                    return
            try:
                pending = self.local.refs.tier_rows.upload_pending()
            except Exception as e:  # noqa: BLE001 - the local table is gone (closed): stop
                self._fail(e)
                return
            if self._follow and (not pending or self._since_tidy >= TIDY_EVERY):
                self._tidy()
                continue
            if not pending and self._lean_due:
                with self._cond:
                    self._lean_due = False
                self._fit()
                continue
            if not pending:
                with self._cond:
                    if not self._stop and not self._follow:
                        self._cond.wait(1.0)
                continue
            seq, entry = pending[0]
            try:
                if self.skip_superseded(seq, entry, pending):
                    continue
                if not self.local.refs.tier_rows.upload_begin(seq):
                    continue  # another process sharing the tier finished or dropped it meanwhile
                self._upload(seq, entry)
                self._since_tidy += 1
                tries = 0
                ended = self.outage.succeeded()
                if ended is not None:
                    log.warning("local tier: uploads to %s resumed after %.0fs of failures (%d failed attempt(s))",
                                self.remote.url, *ended)
            except (StorageError, TsckError, OSError) as e:
                with self._cond:
                    stopped = self._stop
                if stopped and not said_after_stop(e):  # the close ended this try: nothing failed
                    return
                if not heals(e):  # a damaged local object, a remote of another store, a refused credential, ...
                    self._fail(e)
                    return
                tries += 1
                self.outage.failed(e)
                with self._cond:
                    self._failures, self._last_failure = self._failures + 1, e
                    closing = self._closing
                    self._cond.notify_all()
                    if self._stop:  # closed meanwhile: no retry, no message of one
                        return
                first, longest = RETRY_PAUSE
                pause = min(longest, first * 2 ** min(tries - 1, 64))
                log.warning("upload of %s to %s failed (%s: %s); try %d in %.1fs (an outage is waited out: tried "
                            "for as long as this process lives)", entry["root"].hex()[:16], self.remote.url,
                            type(e).__name__, e, tries + 1, pause)
                self._pause_after_failure(pause, closing)
            except BaseException as e:  # noqa: BLE001 - said by wait_durable and close
                self._fail(e)
                return

    def _pause_after_failure(self, pause: float, closing: bool) -> None:
        """Wait out `pause` seconds before the next try. Not cut short by enqueue() or any
        other notify (puts keep coming during an outage; a try per put would hammer a
        remote that is away): only a stop ends it, or a close that began after the failure
        (`closing` False then), which wants the next try now (drain); a close that saw the
        failure stops waiting at it, and then stops this thread."""
        end = time.monotonic() + pause
        with self._cond:
            while not self._stop and (closing or not self._closing):
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def skip_superseded(self, seq: int, entry: dict, pending: list, part_stalled: float | None = None) -> bool:
        """The backlog rule: a queued snapshot with a newer one of the same ref queued
        behind it is not sent (dropped from the queue, logged) when its job's retention
        would expire it anyway: the tier's catalog, its rules, tags, pins and ref tips
        decide (gc.retention_plan), as the next prune would. When uploads fall behind the
        snapshot cadence, a snapshot no rule keeps is not worth the bandwidth: the newest
        is what recovery wants, and what it shares with the older one is sent with it. A
        snapshot a rule keeps (keep_best's best, keep_every_steps' one per N steps, a tag
        or a pin) is sent, or it would never become durable; a job without rules keeps
        everything, so nothing of it is skipped. A skipped snapshot stays local-only and
        the local retention expires it. A rank's part of a collective snapshot is always
        sent: rank 0's tier decides by its own queue, and waits for the parts of the
        snapshot it sends; so is an entry queued for a tag or pin (hold).

        part_stalled: rank 0's collective snapshot waiting for another rank's part, for
        that many seconds without progress (tier/collective.py). A newer snapshot of the
        ref queued behind it and SUPERSEDED_PART_WAIT passed, it is skipped even if a
        rule keeps it: a part that has stopped coming (its rank killed with its tier)
        never will, and the newer snapshot is what can still become durable."""
        if entry.get("part") is not None or entry.get("hold"):
            return False
        root, ref = entry["root"], entry.get("ref")
        newer_seq = next((s for s, e in pending if s > seq and e.get("ref") == ref and e.get("root") != root), None)
        if newer_seq is None:
            return False
        refs = self.local.refs
        from ..maintain.gc import retention_plan
        plan = next((d for d in retention_plan(self.local, refs.wall_now()) if d["root"] == root), None)
        if plan is None:
            return False  # no catalog row: _upload drops it as expired
        stalled = part_stalled is not None and part_stalled >= SUPERSEDED_PART_WAIT
        if plan["keep"] and stalled:
            log.warning("local tier: skipping the upload of collective snapshot %s of ref %s (step %s), kept (%s): "
                        "another rank's part has not reached %s for %.0fs and a newer snapshot of the ref is queued "
                        "behind it; it stays local-only", root.hex()[:16], ref, entry.get("step"),
                        ", ".join(plan["why"]), self.remote.url, part_stalled)
            refs.tier_rows.upload_drop(seq)
            self.superseded += 1
            self.notify()
            return True
        if plan["keep"]:
            if part_stalled is not None:
                return False  # (asked again at each look while rank 0 waits for parts: said once, below)
            log.debug("local tier: snapshot %s of ref %s (step %s) is superseded in the queue but kept (%s): "
                      "uploading it", root.hex()[:16], ref, entry.get("step"), ", ".join(plan["why"]))
            return False
        log.warning("local tier: skipping the upload of snapshot %s of ref %s (step %s): a newer snapshot of the "
                    "ref is queued behind it (uploads fell behind the snapshot cadence) and its job's retention "
                    "keeps it no more; it stays local-only until a prune expires it", root.hex()[:16], ref,
                    entry.get("step"))
        refs.tier_rows.upload_drop(seq)
        self.superseded += 1
        with self._cond:
            self._cond.notify_all()
        return True

    def _waiting_out_gc(self, fn, on_busy=None):
        """fn(), tried again while a gc holds the tier, for up to PRUNE_RETRY -> its result;
        GcBusy past that, or once the uploader is stopped. on_busy() at each GcBusy."""
        deadline = time.monotonic() + PRUNE_RETRY
        while True:
            try:
                return fn()
            except GcBusy:
                if on_busy is not None:
                    on_busy()
                if time.monotonic() > deadline or not self.pause(0.2):
                    raise

    def pause(self, seconds: float) -> bool:
        """Wait up to `seconds` (woken early by a stop) -> False once the uploader is stopped."""
        with self._cond:
            if not self._stop:
                self._cond.wait(seconds)
            return not self._stop

    def notify(self) -> None:
        """The queue or a snapshot's state changed: wake whoever waits on the uploader."""
        with self._cond:
            self._cond.notify_all()

    def _fail(self, e: BaseException) -> None:
        if isinstance(e, OSError) and not isinstance(e, TsckError):
            # A backend's own error that no retry layer named (one not transient comes
            # as it came): wait_durable() and close() raise the store's type, errno kept.
            why = f"local tier: uploads to {self.remote.url} stopped: {type(e).__name__}: {e.strerror or e}"
            err = StorageError(e.errno, why) if e.errno is not None else StorageError(why)
            err.__cause__, e = e, err
        log.error("local tier: uploads to %s stopped: %s", self.remote.url, e)
        with self._cond:
            self.error = e
            self._cond.notify_all()

    def _upload(self, seq: int, entry: dict) -> None:
        root, local = entry["root"], self.local
        if entry.get("part") is not None:  # a rank's part of a collective snapshot (tier/collective.py)
            from .collective import upload_part
            return upload_part(self, seq, entry)
        row = local.refs.catalog_get(root)
        if row is None:
            self.expired(seq, root)
            return
        if entry.get("hold") or (isinstance(entry.get("ref"), str)
                                 and local.refs.deleted_ref_root(entry["ref"]) is not None):
            # (its ref deleted since, a tag or pin keeping the snapshot: sent for those, and no
            # remote ref moves, which would bring back the ref the removal took from both tiers)
            return upload_hold(self, seq, root, row)
        if seq in self._resumed and self._moved_before(seq, root, entry["ref"]):
            return
        world = (row.get("meta") or {}).get("world") if isinstance(row.get("meta"), dict) else None
        if isinstance(world, int) and world > 1:  # a collective snapshot: the other ranks send their parts
            from .collective import upload_world
            return upload_world(self, seq, entry, row)
        self._tee_settle()
        fence = self.read_fence()  # before the remote is asked about any object
        try:
            objs = self.walk(root)
            self.send(objs, fence)
            info = self.publisher.move_to(root, row, fence=fence, revalidate=lambda f: self.send(objs, f))
        except IntegrityError:
            # Missing or damaged here, in the first send or in a fenced move's re-send.
            if self.gone_meanwhile(seq, root):
                return
            raise
        self.after_durable(seq, root, row)
        log.debug("local tier: snapshot %s of ref %s durable at %s", info.root[:16], info.ref, self.remote.url)

    def after_durable(self, seq: int, root: bytes, row: dict) -> None:
        """`root`'s remote ref moved: its tags and pins made there, marked durable and
        dropped from the queue (one transaction), then the job's retention in both tiers
        and the budget; wait_durable() returns once they are done."""
        publish_holds(self, root)
        spared = any(s == seq and e.get("spared") for s, e in self.local.refs.tier_rows.upload_pending())
        with self._cond:
            self._fitting = True  # the retention and the budget follow: wait_durable waits for them
        try:
            at = self.local.refs.wall_now()
        except TsckError:
            at = time.time()
        self.local.refs.tier_rows.upload_done(seq, root, at)
        if isinstance(row.get("ref"), str):
            self.durable_steps[row["ref"]] = row.get("step")
        self.notify()
        self._tell_durable(root, row, at)
        try:
            self.remote_retention(row, root if spared else None)
        finally:
            self._fit()

    def _tell_durable(self, root: bytes, row: dict, at: float) -> None:
        """Each listener hears that `root` became durable at `at` (the time its mark
        records); one that fails is logged, never raised (a metrics hook must not stop
        the uploads)."""
        if not self.listeners:
            return
        for fn in list(self.listeners):
            try:
                fn(root, row, at)
            except Exception:  # noqa: BLE001 - a listener's failure is its own
                log.warning("local tier: a durable listener failed for snapshot %s", root.hex()[:16], exc_info=True)

    def remote_retention(self, row: dict, root: bytes | None = None) -> None:
        """After snapshot `root` became durable: its job's retention, where the remote
        table holds one (Store.set_retention sets it on both tables), applied to the
        remote store by a prune, as a CheckpointManager runs one after each snapshot, so
        the remote store does not grow without end; then to the tier where it is due
        (_prune_here). A gc holding a store (GcBusy) applies the rules itself; any other
        failure is logged, never fatal to the uploads."""
        job = row.get("job") if isinstance(row, dict) else None
        if not job:
            return
        from ..maintain.gc import prune_job
        try:
            expired: list = []
            if job in self.remote.refs.retention_all():
                rep = prune_job(self.remote, job, lease=self.remote.settings.gc_lease)
                expired = [bytes.fromhex(r) for r in rep.expired]
                if expired:
                    log.debug("local tier: the retention of job %s expired %d snapshot(s) at %s", job, len(expired),
                              self.remote.url)
            if self._prune_here(job, root, expired):
                # A prune of the tier running now (a CheckpointManager's, in the background)
                # may have read the catalog before this one's reason: wait it out, briefly.
                try:
                    self._waiting_out_gc(lambda: prune_job(self.local, job, lease=self.local.settings.gc_lease))
                except GcBusy:
                    self.local.refs.prune_request(job)  # the tier's next prune serves it
                    log.debug("local tier: a gc holds the tier; its next prune applies job %s's retention", job)
        except GcBusy:
            log.debug("local tier: a gc holds %s; it applies job %s's retention there", self.remote.url, job)
        except Exception as e:  # noqa: BLE001 - the uploads matter more than the remote prune
            log.warning("local tier: the retention of job %s could not be applied at %s (%s: %s); the next "
                        "upload tries again", job, self.remote.url, type(e).__name__, e)

    def _prune_here(self, job: str, root: bytes | None, expired: list) -> bool:
        """Whether the tier's prune of `job` is due after an upload (one decision for both
        tiers): the remote's retention expired snapshots the tier still lists (they would
        stay there as durable with no remote copy, and with no copy at all once the budget
        took the local one); or a prune spared the snapshot just uploaded (`root`: its
        queue entry said "spared", held while it was sent: TierTable.upload_begin) and the
        rules keep it no more, so what that prune would have done is done now."""
        refs = self.local.refs
        from ..maintain.gc import retention_plan, superseded_tier_only
        if self.schedules and superseded_tier_only(self.local, job):  # (this upload may let an older one go)
            return True
        if job not in refs.retention_all():
            return False
        if expired and refs.catalog_which(expired):
            return True
        if root is None:
            return False
        plan = next((d for d in retention_plan(self.local, refs.wall_now()) if d["root"] == root), None)
        return plan is not None and not plan["keep"]

    def _fit(self) -> None:
        """Keep the tier under its budget; a failure here is logged, never fatal (an
        eviction left undone is retried after the next upload)."""
        if self.budget is None and not self.lean:
            with self._cond:
                self._fitting = False
                self._cond.notify_all()
            return
        try:
            with self._fit_lock:
                if self.lean:
                    try:  # (a put's prune of the tier holds its gc lock for a moment: waited out)
                        self._waiting_out_gc(self._drop_superseded_copies)
                    except GcBusy:
                        with self._cond:
                            self._lean_due = True  # the next turn tries again
                        log.debug("memory tier: a gc holds the tier; its superseded copies go at the next turn")
                if self.budget is not None:
                    fit_budget(self.local, self.budget, listed=self.remote.refs.catalog_which)
        except Exception as e:  # noqa: BLE001 - the uploads matter more than the budget
            what = "drop superseded copies" if self.budget is None else f"evict to the budget of {self.budget} bytes"
            log.warning("local tier: could not %s (%s: %s); retried after the next upload", what, type(e).__name__, e)
        finally:
            with self._cond:
                self._fitting = self._lean_due  # (a memory tier's copies still to go: wait_durable waits)
                self._cond.notify_all()

    def _drop_superseded_copies(self) -> None:
        """A memory tier: drop this rank's superseded tier-only parts (a rank other than 0),
        then evict the local copies of the durable snapshots a newer snapshot of their ref
        stands in for (gc.superseded_copies), those the remote still lists (the local gc's
        eviction: their rows stay, their reads go to the remote)."""
        from ..maintain.gc import drop_parts, evict_snapshots, retention_plan, superseded_copies
        refs = self.local.refs
        durable = self._published()
        # A rank other than 0: its parts of tier-only snapshots a committed newer one stands
        # in for go now, the copies it held of them too, not at rank 0's next word, which
        # comes after this rank made room for that snapshot (the same rule as rank 0's).
        parts = refs.tier_rows.parts(rank0=False)
        if parts:
            gone = [d["root"] for d in retention_plan(self.local, refs.wall_now(), durable=durable)
                    if d["root"] in parts and d["why"] == ["tier-only, superseded"]]
            if gone:
                drop_parts(self.local, gone, lease=self.local.settings.gc_lease)
        queued = {e["root"] for _, e in refs.tier_rows.upload_pending()}
        doomed = [r for r in superseded_copies(self.local, durable) if r not in queued]
        if doomed:
            doomed = list(self.remote.refs.catalog_which(doomed))
        if doomed:
            rep = evict_snapshots(self.local, doomed)
            log.debug("memory tier: dropped the copies of %d superseded durable snapshot(s) (%d bytes)",
                      len(rep.expired), rep.deleted_bytes)

    def _published(self) -> set:
        """The tier's snapshots marked durable that stand for a snapshot in the remote. A
        rank other than 0 marks its part of a collective snapshot durable once the part is
        sent (collective.upload_part), before rank 0 moves the remote ref, which needs
        every rank's part: until the remote catalog lists it, such a snapshot stands in for
        no older tier-only one (whose copies are then the newest whole snapshot a lost
        node leaves). Asked once per snapshot; unanswered (the remote away), it does not count."""
        refs = self.local.refs
        marked = refs.tier_rows.durable(refs.catalog_roots())
        self._listed &= marked  # (rows gone since: forgotten)
        unsure = (marked & set(refs.tier_rows.parts(rank0=False))) - self._listed
        if unsure:
            try:
                self._listed |= set(self.remote.refs.catalog_which(unsure))
            except Exception as e:  # noqa: BLE001 - unknown: not counted, asked again at the next turn
                log.debug("memory tier: could not ask %s which snapshots it lists (%s: %s)", self.remote.url,
                          type(e).__name__, e)
            marked -= unsure - self._listed
        return marked

    def walk(self, root: bytes) -> dict:
        """The snapshot's objects in the tier (by_kind)."""
        return by_kind(walk_commit(self.local.assets, root, verify=True))

    def gone_meanwhile(self, seq: int, root: bytes) -> bool:
        """An object of `root` was missing or damaged here during its upload. Not damage
        when the snapshot left the tier on purpose meanwhile: its catalog row is gone (a
        prune or forget, then a gc) -> dropped from the queue; or another process sharing
        the tier made it durable and its budget evicted the local copy -> the entry goes
        (the other process's upload_done dropped it already). Otherwise the tier is
        damaged, and that stops the uploader (False)."""
        refs = self.local.refs
        if refs.catalog_get(root, checked=False) is None:
            self.expired(seq, root)
            return True
        if refs.tier_rows.durable([root]):
            log.debug("local tier: snapshot %s was made durable by another process sharing this tier while this "
                      "one uploaded it", root.hex()[:16])
            refs.tier_rows.upload_drop(seq)
            with self._cond:
                self._cond.notify_all()
            return True
        return False

    def _moved_before(self, seq: int, root: bytes, ref: str) -> bool:
        """A process killed after the remote move and before the durable mark left `root`
        queued. If the remote catalog still lists it, move_to sees that; if it has left
        the catalog since (the remote retention expired it, or a forget), only the remote
        reflog remembers the move, and moving the ref to it again would move the ref back
        past the snapshots published there since: mark it durable, move nothing."""
        remote = self.remote.refs
        if remote.catalog_has(root) or not any(e.op == "move" and e.new == root for e in remote.reflog(ref)):
            return False
        self.local.refs.tier_rows.upload_done(seq, root)
        with self._cond:
            self._cond.notify_all()
        log.warning("local tier: snapshot %s of ref %s was published at %s before a restart and has left its "
                    "catalog since (expired there); marked durable, the ref not moved back to it",
                    root.hex()[:16], ref, self.remote.url)
        return True

    def expired(self, seq: int, root: bytes) -> None:
        log.warning("local tier: queued snapshot %s left the local catalog (expired by retention) before it was "
                    "uploaded; dropped from the queue", root.hex()[:16])
        self.local.refs.tier_rows.upload_drop(seq)

    def send(self, objs: dict, fence: int) -> None:
        """Blocks, then nodes, then the commit: each kind complete before the next, so
        the remote never holds a node whose blocks are not there yet; the last one synced
        (self.copies: the saver process, or threads)."""
        kinds = [k for k in ("block", "node", "commit") if objs[k]]
        for i, kind in enumerate(kinds):
            ds = list(objs[kind])
            with self._cond:
                written = [self._written.get((FRAME_KIND[kind], d)) for d in ds]  # (commits are never recorded)
            sizes = [objs.get("itemsize", {}).get(d, 0) for d in ds]
            news = self.copies.copy(self.remote.assets, self.local.assets, kind, ds, fence, written,
                                    sync=i == len(kinds) - 1, itemsizes=sizes)
            with self._cond:
                for d, w, new in zip(ds, written, news):
                    if w is not None:
                        self._written.pop((FRAME_KIND[kind], d), None)
                        self.sent_written += 1
                    if new:
                        self.sent += 1
                    else:
                        self.skipped += 1
