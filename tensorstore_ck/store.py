"""The Store facade: what users hold. Each call checks its arguments and hands the work to
the module that does it, giving it the store's Core (core.py), never the Store:

    put_snapshot   Planner (plan.py) -> Publisher (publish.py) -> Assets -> BlockStore;
                   blocking=False through AsyncPuts (asyncput.py), collective through collective/
    checkout       Reader (read.py), through readpath.py (a DCP-written one: dcpstate.py)
    tag, pin, untag, forget, delete_ref, undelete  lifecycle.py (fenced against gc); with a
                   local tier in both tiers' tables (tier/holds.py)
    resolve, show, diff, ...  one resolution for all (_root: with a local tier, as checkout)
    gc, prune, fsck, recover, du, diff         gc.py, fsck.py, recover.py, usage.py, listing.py

Publication order, always: blocks -> manifest nodes -> commit object -> storage sync ->
compare-and-swap of the ref (with reflog and catalog row in the same ref-table
transaction), all in publish.Publisher. A crash anywhere before the CAS leaves only
unreferenced objects behind. open_store() (opener.py) checks and translates the options
and builds the Core and the Store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import sys
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from .asyncput import AsyncPuts, SnapshotFuture, note
from .collective import AUTO as _AUTO_GROUP
from .collective import CALLS, CollectiveJob, collective_checkout, collective_put, is_collective
from .core.core import Core
from .core.validate import UNSET, SnapshotArgs, check_utf8, check_snapshot_args
from .errors import IntegrityError, InvalidArgument, ReadOnlyStore, RefNotFound, StoreClosed, TsckError, storage_error
from .format.chunker import default_pack_size
from .format.manifest import decode_commit
from .format.names import validate_component, validate_name, validate_new_name
from .info import DurableEvent, SnapshotInfo
from .maintain.retention import Retention
from .tier.none import NoTier
from .util.ids import Digest
from .write.publish import Publisher, Timing
from .write.saver import CLOSE_WAIT, GIVE_UP_WAIT, Saver, executor_for

if TYPE_CHECKING:  # plan.py and read.py import torch: loaded where tensors are
    from .write.plan import Planner
    from .tier.local import LocalTier

__all__ = ["Store", "SnapshotInfo", "SnapshotFuture"]

_UNSET = UNSET
_log = logging.getLogger(__name__)

# How long close() waits by default for a local tier's queued uploads. Long enough for an
# upload that is making progress to finish (a few GB at the links jobs upload over: a
# snapshot left queued on a node the job gives back is lost with its disk), bounded so
# that a remote that answers nothing cannot hold a job's exit; a remote that fails ends
# the wait at once (Uploader.drain), so a down remote costs one retry budget, not this.
CLOSE_TIMEOUT = 300.0


def _caller_level() -> int:
    """warnings.warn's stacklevel naming the first frame outside this package."""
    pkg = os.path.dirname(os.path.abspath(__file__)) + os.sep
    f, level = sys._getframe(1), 1
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(pkg):
        f, level = f.f_back, level + 1
    return level


def _storage_errors(fn):
    """A backend failure (full disk, network, permissions) reaches the caller as
    StorageError, one of our types, with the backend's error chained."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except TsckError:
            raise
        except OSError as e:
            raise storage_error(e, "storage failed") from e
        except RuntimeError as e:  # a pool shut down by a close() in another thread
            if self._closed:
                raise StoreClosed(f"the store at {self.url} was closed during this call") from e
            raise
    return wrapper


def _public(fn):
    """A public method: StoreClosed after close(), backend failures as StorageError."""
    inner = _storage_errors(fn)

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if self._closed:
            raise StoreClosed(f"the store at {self.url} is closed")
        return inner(self, *args, **kwargs)
    return wrapper


@contextlib.contextmanager
def _bytes_bar(show: bool, desc: str, total):
    """With show, a bytes progress bar on stderr for one put or checkout, closed however it
    ends: yields its update(n), else None (no progress callback)."""
    from .util.progress import progress_bar
    total = total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else None
    bar = progress_bar(show, desc, total=total, unit="B")
    if bar is None:  # not asked for (or tqdm missing, a dependency)
        yield None
        return
    try:
        yield bar.update
    finally:
        bar.close()


_STORES: "weakref.WeakSet[Store]" = weakref.WeakSet()


def _stores_after_fork() -> None:
    for store in list(_STORES):
        store._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_stores_after_fork)


def restored_fields(target: str, root: Digest, commit: dict, source: str, seconds: float, partial: bool) -> dict:
    """What a restore's log line (and a JSON log line: the record's `tsck` attribute) says."""
    st = commit.get("stats") or {}
    return {"event": "restored", "target": target, "ref": commit["ref"], "job": commit["job"], "step": commit["step"],
            "root": root.hex(), "bytes": st.get("bytes_total"), "source": source, "seconds": seconds,
            "partial": partial}


def _then(first, second):
    """Two read plans (Reader's plan) as one: `second` plans over what `first` gives; either
    may be None. (A collective checkout's shared reads must plan on every rank: asked first.)"""
    if first is None or second is None:
        return first or second
    return lambda jobs, base: second(jobs, first(jobs, base))


def _log_restored(target: str, root: Digest, commit: dict, source: tuple[str, str], seconds: float,
                  partial: bool) -> None:
    """One INFO line per checkout (restore_latest's, a manager's, `tsck checkout`'s): the
    snapshot it read (ref, step, root) and where from: the store, or with a local tier the
    tier, peer replicas or the remote store."""
    if not _log.isEnabledFor(logging.INFO):
        return
    fields = restored_fields(target, root, commit, source[0], seconds, partial)
    named = "" if target in (commit["ref"], root.hex()) else f" ({target})"
    _log.info("snapshot restored%s: ref %s step %s%s, root %s, from %s in %.2fs", named, commit["ref"],
              "-" if commit["step"] is None else commit["step"], " (some paths)" if partial else "",
              root.hex()[:16], source[1], seconds, extra={"tsck": fields})


class Store:
    """A content-addressed snapshot store. Thread-safe; use one per process.

    open_store() builds it over a Core (storage, assets, ref table, I/O pool, settings:
    the options translated once, in opener.py) and hands that Core, never the Store, to
    the layers below (gc, fsck, recover, usage, listing, lifecycle, dist)."""

    def __init__(self, core: Core, *, config: dict, max_inflight: int = 2, when_busy: str = "wait",
                 tier: "LocalTier | None" = None, saver: Saver | None = None, host_memory: int | None = None,
                 shared_reads: bool | None = None):
        self.core = core
        # With a local tier: `core` is the tier's store, and `tier` holds the rest (the
        # uploader and the remote store, the reads through to it, the peer replicas).
        self._tier = tier or NoTier(core)  # never None: a store without a tier answers through a NoTier
        self._queue_seen: bool | None = None  # see _is_tier
        st = core.settings
        self.storage, self.reftable, self.assets, self.config = core.storage, core.refs, core.assets, config
        self.verify, self.workers, self.gc_lease = st.verify, st.workers, st.gc_lease
        self.block_size, self.inline_threshold = st.block_size, st.inline_threshold
        # Small tensors packed into blocks of up to pack_size: by default where an object
        # costs a request (an object store, or a tier in front of one), not on a local disk.
        self.pack_size = st.pack_size if st.pack_size is not None else default_pack_size(
            self._tier.costs_requests or not (core.storage.local or core.storage.url.startswith("memory://")))
        self.codecs = core.assets.codecs  # what blocks are written with; any store reads every codec
        # saver="process": an asynchronous put's blocks are written by a saver process
        # (saver.py); with a local tier, the saver runs the uploads instead (the tier was
        # built with it) and the tier's puts write its disk on threads. This Store owns it.
        self._saver = saver
        # The one way anything is published into this store (put, collective put, DCP writer).
        self.publisher = Publisher(self.assets, self.reftable, core.pool,
                                   executor=executor_for(None if self._tier.uploads else saver, core))
        # blocking=False: in order, one thread; staged within host_memory bytes
        self._puts = AsyncPuts(max_inflight, when_busy, self.publisher.executor, host_memory)
        self._plan_cache = None  # the layouts put_snapshot planned last (plancache.py), made at the first put
        self.watch_writes = True  # open_store(watch_writes=): put_snapshot skips tensors proven unchanged
        self._collective = CALLS  # the process's collective call names (shared by its Stores)
        self._read_only = st.read_only
        # A collective checkout reads each block several ranks read once (collective/shared.py):
        # by default where a read is a request (an object store), not from a disk or a tier.
        self._shares = (not tier and not (core.storage.local or core.storage.url.startswith("memory://"))
                        if shared_reads is None else shared_reads)
        self._sharing = None  # its side channel, made at the first collective checkout
        self._closed = False
        _STORES.add(self)

    def _after_fork(self) -> None:
        """In the child of os.fork(): only the forking thread exists there, so the I/O
        pool's workers, the background publisher and the snapshots it had in flight (and
        any lock or slot they held) are the parent's. Rebuild them; the ref table and the
        storage reopen their own handles (refs/base.py track_for_fork, _after_fork below)."""
        if self._closed:
            return
        self.core.after_fork()
        self.publisher.pool = self.core.pool
        self._tier.after_fork()
        if self._saver is not None:
            self._saver.after_fork()
        self._puts.reset()
        # torch's intra-op pool (OpenMP here) does not survive a fork either: the child's
        # first parallel op (staging's copy_, a checkout's) waits for workers that are not
        # there. One thread, as torch's own DataLoader workers do.
        torch = sys.modules.get("torch")  # not imported: no pool to lose
        if torch is not None and torch.get_num_threads() > 1:
            torch.set_num_threads(1)

    # -- lifecycle -------------------------------------------------------------
    def close(self, timeout: float | None = CLOSE_TIMEOUT) -> None:
        """Finish every asynchronous snapshot in flight (and, with a local tier, every
        upload queued: Store.wait_durable), release everything (pools,
        staging buffers, the ref table, storage), then raise the failure of an
        asynchronous snapshot whose outcome the caller never learnt: one whose future's
        result() or exception() was not called and that no later put_snapshot,
        raise_pending_error() or CheckpointManager call raised. A script that ends with
        close() thus hears that its last snapshot failed. Raised once: a second close()
        returns quietly. Several such failures: the first is raised, a note counts the
        others (their futures hold them). As a context manager, an exception already
        leaving the `with` block is not replaced: it gets the failure as a note; one with
        a `close_by` time (train.Preempted: the end of the preemption's grace) bounds
        the wait for uploads by then.

        timeout: with a local tier, the seconds close() waits for the queued uploads
        (from its start; None: no bound; default CLOSE_TIMEOUT, 300). It waits while they
        make progress, and stops waiting once the timeout passed or as soon as an upload
        attempt fails (the remote away: after the storage's own retry budget,
        open_store(retry_budget=)); a remote request still being retried then gives up.
        What was not uploaded stays queued in the tier, safe on its disk, and the next
        open_store(..., local=PATH) uploads it: close() says so with a SnapshotWarning
        (how many, which tier), and does not raise for it. It still raises a failure
        that stopped the uploader (an IntegrityError, ...) instead, unless
        wait_durable() raised it. Without a local tier every put is in the store when
        it returns, and the timeout does nothing."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout < 0):
            raise InvalidArgument(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
        if self._closed:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        self._closed = True
        self._puts.shutdown()
        self._tier.close(deadline, getattr(self.storage, "root", self.core.url), stacklevel=_caller_level())
        if self._saver is not None:
            # After the uploads: the tier's close waited for them (past its deadline, a
            # copy still running in the saver is abandoned: the saver is killed).
            self._saver.close(GIVE_UP_WAIT if self._tier.uploads else CLOSE_WAIT)
        if self._sharing is not None:
            self._sharing.close()
        self.core.pool.shutdown(wait=True)
        self.reftable.release_abandoned_gc()  # a gc of ours that could not record its end
        self.reftable.close()
        self.storage.close()
        err = self._puts.unheard()
        if err is None:
            err = self._tier.unheard()
        if err is not None:
            raise err

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            self.close()
            return
        timeout = CLOSE_TIMEOUT
        by = getattr(exc, "close_by", None)  # an exit that must come by then (train.Preempted: the grace's end)
        if isinstance(by, (int, float)):
            timeout = max(0.0, by - time.monotonic())
        try:
            self.close(timeout)
        except Exception as err:  # noqa: BLE001 - the exception already on its way out wins
            if err is not exc:
                note(exc, f"while closing the store at {self.url}: {type(err).__name__}: {err}")

    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def read_only(self) -> bool:
        """Opened read-only (open_store(read_only=True), or its files are not writable):
        every write raises ReadOnlyStore before anything is written."""
        return self._read_only is not None

    def _writable(self, op: str) -> None:
        if self._read_only is not None:
            raise ReadOnlyStore(f"{op} on the store at {self.url}: it is opened read-only ({self._read_only}); "
                                "nothing was written")

    @property
    def pool(self) -> ThreadPoolExecutor:
        """The store's I/O workers (block reads and writes run here)."""
        return self.core.pool

    _pool = pool

    @property
    def max_inflight(self) -> int:
        return self._puts.max_inflight

    @property
    def when_busy(self) -> str:
        return self._puts.when_busy

    @property
    def skipped(self) -> int:
        """Asynchronous snapshots dropped by when_busy="skip"."""
        return self._puts.skipped

    @property
    def host_memory(self) -> int | None:
        """The bytes an asynchronous put's staging may hold in host memory, all snapshots in
        flight together (open_store(host_memory=); None: no bound)."""
        return self._puts.host_memory

    @property
    def staging(self):
        """What the asynchronous puts' staging holds now (write.staging.StagingUse: the
        bound, the bytes held, the most held at once, the puts staged in waves)."""
        return self._puts.use()

    # -- writing ---------------------------------------------------------------
    @_public
    def put_snapshot(self, state, ref: str, *, step: int | None = None, metrics: dict | None = None,
                     meta: dict | None = None, job: str | None = None, expected=_UNSET,
                     blocking: bool = True, allow_pickle: bool = False, when_busy: str | None = None,
                     group=_AUTO_GROUP, timeout: float = 300.0, progress: bool = False,
                     resumed_from: int | None = None):
        """Snapshot `state` and move `ref` to it.

        expected: unset moves the ref whatever it points at (retrying if another
        writer moves it meanwhile, so both snapshots stay in its history);
        a root hex makes the move conditional on the ref pointing there; None
        requires the ref not to exist. RefConflict otherwise.

        blocking=False returns a Future once the state is staged (copied into a
        reused host buffer), so the caller may mutate it at once; hashing,
        compression and IO run in the background, and snapshots commit in the
        order they were taken. At most `max_inflight` are staged or running:
        when_busy="wait" (default) blocks for a free slot, "skip" returns None
        and counts it in `store.skipped`. A background failure is raised by its
        future and again by the next put_snapshot call; close() raises one whose
        outcome nobody retrieved (see close()).

        Under torch.distributed (or with group=) the put is collective: every rank
        calls it alike, with the same step= (required: the ref and step name the call,
        docs/design/collective.md "Call identity"), and one snapshot holds every rank's
        state. A rank that skips a put, or makes another call in its place, makes that
        one call fail on every rank (OutOfStep), never a later one. blocking=False there
        stages this rank's state, returns its future, and makes the collective call
        on the background publisher, in call order on every rank (the same outcome on
        every rank's future, never re-raised by the next put; when_busy must be
        "wait"; the future cannot be cancelled: the other ranks expect this one). A
        rank whose state cannot be staged raises at once, and the call aborts on
        every rank. timeout counts from when the call starts in the background.

        A blocking put first waits for the asynchronous ones in flight, so the
        ref never moves back to an older snapshot. progress=True: a blocking put
        shows the bytes it hashes and writes as a bar on stderr (`tsck import`).

        A put at a step the ref's kept history already has is published (both are kept,
        REF@STEP names the newer) with a StepReusedWarning: a script re-run from its start?
        resumed_from=STEP says the state continues the ref's snapshot at STEP (a run rolled
        back to it, as CheckpointManager.restore(step) does): the kept snapshots at later
        steps are the abandoned run's, and taking a step above STEP again is not warned."""
        self._writable("put_snapshot")
        started = time.monotonic()

        def prepare() -> SnapshotArgs:
            self.raise_pending_error()
            if when_busy is not None and when_busy not in ("wait", "skip"):
                raise InvalidArgument(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
            return check_snapshot_args(ref, job=job, step=step, metrics=metrics, meta=meta, expected=expected,
                                       resumed_from=resumed_from)

        if is_collective(group):
            if step is None:  # (before the call is named: every rank that omits it raises alike)
                raise InvalidArgument(
                    f"a collective put_snapshot needs step= (put of {ref!r}): every rank passes the same step, "
                    "which names the call, so a rank that skipped a put can never join the others' next one with "
                    "another version of its state; nothing was written")
            stalled: list = []  # an asynchronous put's staging time, once staged
            call = CollectiveJob(self._collective, group, timeout, publisher=self.publisher, prepare=prepare,
                                 tier=self._collective_tier(), ident=(ref, step),
                                 timing=lambda: Timing(started, stall=stalled[0] if stalled else None))
            if not blocking:
                def stage():
                    args = prepare()
                    if (when_busy or self.when_busy) != "wait":
                        raise InvalidArgument(
                            "when_busy='skip' cannot apply to a collective snapshot: the ranks would skip different "
                            "ones; pass when_busy='wait' (an asynchronous collective put waits for a free slot)")
                    plan = self.planner(allow_pickle, defer_device=True, cached=True).plan(state)
                    if self._puts.too_big(plan):
                        # Waves write blocks before the call's protocol has said which rank writes
                        # each replicated one: refused, on every rank (the call aborts).
                        raise InvalidArgument(
                            f"this rank's state ({plan.staged_bytes} bytes to stage) is larger than the store's "
                            f"host_memory ({self.host_memory} bytes): an asynchronous collective put stages it "
                            "whole; open the store with a larger host_memory=, or put with blocking=True (it "
                            "stages nothing)")
                    buf = self._puts.stage(plan, wait=True)
                    stalled.append(time.monotonic() - started)
                    return args, plan, buf
                return self._puts.submit_collective(call, stage)

            self.wait()  # the asynchronous ones first (named already): the calls run in call order
            # Every rank enters the collective before checking its arguments, so a bad
            # argument on one rank aborts this snapshot everywhere instead of leaving
            # that rank one collective behind the others.
            planner = self.planner(allow_pickle, cached=True)
            return collective_put(dataclasses.replace(call, plan=lambda: planner.plan(state)))
        args = prepare()
        plan = self.planner(allow_pickle, defer_device=not blocking, cached=True).plan(state)  # validates it all first
        if blocking:
            self.wait()
            with _bytes_bar(progress, "put", sum(b - a for leaf in plan.leaves for a, b in leaf.ranges)) as bar:
                return self._publish(plan, args, progress=bar, timing=Timing(started))
        wait = (when_busy or self.when_busy) == "wait"
        if self._puts.too_big(plan):
            return self._put_in_waves(state, plan, args, allow_pickle, wait, started)
        buf = self._puts.stage(plan, wait=wait)
        if buf is None:
            self._skipped(args)
            return None
        timing = Timing(started, stall=time.monotonic() - started)
        return self._puts.submit(args.ref, buf, lambda: self._publish_async(plan, args, timing), kept=plan.kept)

    def _put_in_waves(self, state, plan, args: SnapshotArgs, allow_pickle: bool, wait: bool, started: float):
        """An asynchronous put of a state larger than host_memory: its blocks written in
        waves through one buffer of the bound before this returns (write/waves.py: the
        caller's tensors are read only here, so the snapshot is one state), its nodes and
        commit in the background as for any asynchronous put."""
        if getattr(plan, "from_cache", False):
            # A kept layout's plan stages into views of one buffer of the whole state (and its
            # inline tensors' bytes with them): planned whole instead.
            plan = self.planner(allow_pickle, defer_device=True).plan(state)
        fence: list = []

        def write(wave) -> None:
            if not fence:  # before the first block is looked for in storage
                self.before_write()
                fence.append(self.publisher.fence())
            self.publisher.executor.write_blocks(wave, self.assets, fence=fence[0])

        if not self._puts.stage_waves(plan, write, wait=wait):
            self._skipped(args)
            return None
        plan.written = fence[0]
        timing = Timing(started, stall=time.monotonic() - started)
        return self._puts.submit(args.ref, None, lambda: self._publish_async(plan, args, timing))

    def _skipped(self, args: SnapshotArgs) -> None:
        self._puts.skipped += 1
        _log.info("snapshot skipped: ref %s step %s: %d snapshot(s) still in flight (max_inflight, or the "
                  "host_memory they hold) and when_busy='skip'; %d skipped so far", args.ref,
                  "-" if args.step is None else args.step, self.max_inflight, self._puts.skipped,
                  extra={"tsck": {"event": "skipped", "ref": args.ref, "job": args.job, "step": args.step,
                                  "why": "busy", "skipped": self._puts.skipped}})

    def _publish_async(self, plan, args: SnapshotArgs, timing) -> SnapshotInfo:
        """An asynchronous put in the background: its failure is logged when it happens
        (a WARNING; it is raised by its future and the next put), so a training log shows it
        at the moment it failed."""
        try:
            return self._publish(plan, args, timing=timing)
        except BaseException as e:
            _log.warning("snapshot failed: ref %s step %s: %s: %s", args.ref, "-" if args.step is None else args.step,
                         type(e).__name__, e,
                         extra={"tsck": {"event": "failed", "ref": args.ref, "job": args.job, "step": args.step,
                                         "why": f"{type(e).__name__}: {e}"}})
            raise

    def _collective_tier(self):
        """With a local tier: what a collective put does besides the protocol (each rank
        publishes in its own tier and queues its own upload: tier/collective.py); else None."""
        return self._tier.collective()

    def after_in_flight(self, fn) -> None:
        """Run fn() on the background publisher once the snapshots queued so far have ended."""
        self._puts.after_in_flight(fn)

    def planner(self, allow_pickle: bool = False, defer_device: bool = False, cached: bool = False) -> Planner:
        """A planner with this store's block layout (validates a state before any write).
        cached: it plans a state of a layout put_snapshot planned lately from that plan."""
        from .write.plan import Planner  # torch, imported where tensors are (not by `tsck refs`)
        unchanged = None
        if cached:
            if self._plan_cache is None:
                from .write.plancache import PlanCache
                self._plan_cache = PlanCache()
            if self.watch_writes:
                from .write.unchanged import Unchanged
                unchanged = Unchanged.get()
        return Planner(block_size=self.block_size, inline_threshold=self.inline_threshold,
                       allow_pickle=allow_pickle, defer_device=defer_device, pack_size=self.pack_size,
                       cache=self._plan_cache if cached else None, unchanged=unchanged)

    def raise_pending_error(self) -> None:
        """Raise (once) the failure of an asynchronous snapshot, if one failed. The
        failures so far count as heard: close() does not raise them again."""
        self._puts.raise_pending_error()

    def wait(self) -> None:
        """Block until every asynchronous snapshot in flight has committed or failed.
        Failures are not raised here (they are on their futures, the next put and close())."""
        self._puts.wait()

    @_storage_errors
    def _publish(self, plan, args: SnapshotArgs, progress=None, timing=None) -> SnapshotInfo:
        if plan.written is None:  # (a waved plan's writes began before its blocks: _put_in_waves)
            self.before_write()
        args = self._tier.scheduled(args)  # (durable_every: a snapshot the remote does not get is marked)
        return self.after_publish(self.publisher.publish(plan, args, progress=progress, timing=timing))

    def before_write(self) -> None:
        """For the package's writers (put_snapshot, the DCP writer): call before writing blocks.
        Before a writer writes blocks: with a local tier, room
        under its budget (Uploader.make_room: it may wait for uploads, or raise TierFull
        with nothing written), then the remote fence its early uploads are recorded under."""
        self._tier.begin()

    def after_publish(self, info: SnapshotInfo) -> SnapshotInfo:
        """For the package's writers: call with what they published. After a writer
        published `info` in this store: with a local tier, queue it for
        upload (it is durable once the uploader has moved the remote ref)."""
        return self._tier.published(info)

    @_public
    def wait_durable(self, timeout: float | None = None) -> bool:
        """With a local tier (open_store(local=)): wait until every snapshot published
        before this call is durable (in the remote store, its remote ref moved) -> True,
        or False once `timeout` seconds passed. Raises the failure that stopped the
        uploader (the queue keeps the snapshot: the next open retries it). Without a
        tier every put is durable when it returns: True at once. Asynchronous puts in
        flight are waited for first."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or timeout < 0):
            raise InvalidArgument(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
        self.wait()
        return self._tier.wait_durable(timeout)

    @_public
    def on_durable(self, fn):
        """With a local tier (open_store(local=)): fn(DurableEvent) after each snapshot
        published here became durable (its remote ref moved), on the uploader's thread;
        fn must be quick, and a failure of fn is logged, never raised. -> a function that
        removes fn. Without a tier every put is durable when it commits and fn is never
        called. A metrics hook reads the durable lag from it (CheckpointManager(on_commit=)
        wires a hook's on_durable method here)."""
        if not callable(fn):
            raise InvalidArgument(f"on_durable takes a callable, got {type(fn).__name__}")
        def heard(root: bytes, row: dict, at: float) -> None:
            committed = float(row.get("time", at))
            step = row.get("step")
            fn(DurableEvent(root=root.hex(), ref=str(row.get("ref", "")), job=str(row.get("job", "")),
                            step=step if isinstance(step, int) and not isinstance(step, bool) else None,
                            committed=committed, time=at, lag=max(0.0, at - committed)))
        return self._tier.on_durable(heard)

    def durability_lag(self):
        """With a local tier: how far the remote store is behind it now (tier.outage.Lag:
        snapshots, steps and seconds not yet uploaded; how long uploads have failed, and
        why; `.lagging` while they fail). None without a tier, or once closed."""
        return None if self._closed else self._tier.lag()

    @property
    def remote_core(self) -> Core | None:
        """The remote store's Core behind a local tier (None without one)."""
        return self._tier.remote

    @property
    def replicas(self) -> int:
        """open_store(replicas=k): the copies of each rank's part of a collective snapshot
        held on other nodes' tiers (0: none)."""
        peers = getattr(self._tier, "peers", None)
        return 0 if peers is None else peers.k

    def held_elsewhere(self, ref: str) -> list[str]:
        """Rank 0 of a collective restore whose tier lost ref `ref` (its node lost) or names
        an older snapshot of it (the tier was another rank's since): the older snapshots of
        it the other ranks' tiers posted in the last collective checkout, newer than what
        the tiers name, the newest first, then the one the tiers name, as roots (hex): what
        restore_latest tries after the newest (LocalTier.held_elsewhere). [] otherwise."""
        held = getattr(self._tier, "held_elsewhere", None)
        return [] if held is None else [d.hex() for d in held(ref)]

    def _is_tier(self) -> bool:
        """Whether this store is a local tier (with its uploader, or opened by itself):
        asked of the table once per Store, not once per snapshot described."""
        if self._queue_seen is None:
            self._queue_seen = self._tier.uploads or self.reftable.tier_rows.upload_last_seq() > 0
        return self._queue_seen

    def _durable(self, infos: list) -> list:
        """`infos` with durable=False for the snapshots only the local tier has. A local
        tier opened as a store of its own (`tsck log /nvme/tsck REF`) says so too: its
        table has an upload queue."""
        if not infos or not self._is_tier():
            return infos
        done = self.reftable.tier_rows.durable(bytes.fromhex(i.root) for i in infos)
        return [i if bytes.fromhex(i.root) in done else dataclasses.replace(i, durable=False) for i in infos]

    @_public
    def gc_fence(self) -> int:
        """The gc deletion epoch; read it before looking at storage, pass it to commit_tree."""
        return self.publisher.fence()

    @_public
    def commit_tree(self, tree: bytes, *, ref: str, job: str, step, metrics: dict, meta: dict, stats: dict,
                    expected=UNSET, fence: int | None = None) -> SnapshotInfo:
        """Publish a manifest tree whose objects are all written (low level: tests and
        tools that plant trees). A gc deletion phase overlapping it aborts it."""
        self._writable("commit_tree")
        args = check_snapshot_args(ref, job=job, step=step, metrics=metrics, meta=meta)
        args = SnapshotArgs(args.ref, args.job, args.step, args.metrics, args.meta, expected)
        return self.publisher.commit(tree, args, stats=stats, fence=self.gc_fence() if fence is None else fence)

    @_public
    def wait_gc_idle(self) -> int:
        """Wait until no gc deletion phase is running; the even epoch, as a new fence."""
        return self.publisher.wait_gc_idle()

    # -- lifecycle: retention, gc, fsck ----------------------------------------
    @_public
    def set_retention(self, job: str, retention: "Retention | None") -> None:
        """Set (or with None, clear) the retention rules of `job`; kept in the ref
        table so an offline `tsck gc` applies each job's own rules. With a local tier, in
        both tiers' tables: the uploader applies them to the remote store after each
        upload."""
        self._writable("set_retention")
        validate_component(job, "job name")
        if retention is not None and not isinstance(retention, Retention):
            raise InvalidArgument(f"retention must be a tsck.Retention, got {type(retention).__name__}")
        self.reftable.retention_set(job, None if retention is None else retention.to_dict())
        self._tier.set_retention(job, None if retention is None else retention.to_dict())

    @_public
    def retention(self) -> dict[str, Retention]:
        return {job: Retention.from_dict(r) for job, r in self.reftable.retention_all().items()}

    @_public
    def gc(self, *, dry_run: bool = False, progress: bool = False, lease: float | None = None,
           grace: float = 0.0):
        """Apply retention, then mark and sweep. Safe while other processes write.
        lease: seconds this gc holds the store between renewals (default: the Store's
        gc_lease, 120 s); others judge it on the ref table's clock. grace: leave objects
        younger than this many seconds (in-flight snapshots' new objects) for a later gc."""
        from .maintain.gc import run_gc
        if not dry_run:
            self._writable("gc")
        return run_gc(self.core, dry_run=dry_run, progress=progress, lease=self.gc_lease if lease is None else lease,
                      grace=grace)

    @_public
    def prune(self, job: str, *, lease: float | None = None):
        """Expire what `job`'s retention drops and delete what only those snapshots
        held: gc for one job, without listing storage (a CheckpointManager with
        retention runs it after each snapshot). Safe beside writers and `tsck gc`;
        GcBusy while another gc holds the store. A GCReport."""
        from .maintain.gc import prune_job
        validate_component(job, "job name")
        self._writable("prune")
        return prune_job(self.core, job, lease=self.gc_lease if lease is None else lease)

    @_public
    def fsck(self, *, full: bool = True, progress: bool = False, repair: bool = False, raw: bool = False):
        """Check every kept snapshot and every ref/tag/pin; full=True re-hashes every byte.
        repair=True also moves every damaged object aside (quarantine/, never deleted),
        so the next put of its content stores it again and heals the snapshots using it;
        it takes the store's gc lock (GcBusy while a gc runs). A finding in a snapshot
        written through dcp.save names its path in the state as saved, as ls does
        (raw=True: the stored layout's, tensors.FQN)."""
        from .maintain.fsck import run_fsck
        from .read.listing import saved_findings
        if repair:
            self._writable("fsck --repair")
        r = run_fsck(self.core, full=full, progress=progress, repair=repair, lease=self.gc_lease)
        return r if raw else saved_findings(self.core, r)

    # -- reading ---------------------------------------------------------------
    @_public
    def resolve(self, target: str, *, group=None, timeout: float = 300.0) -> str:
        """A target (ref, tag, REF@STEP, root hex or unique prefix >= 8) -> root hex.
        group: a process group every rank of which calls this (collective.AUTO: the default one
        when initialized): resolved once, by rank 0, and its root handed to every rank (a
        collective checkout's resolution), so ranks whose tiers differ never name
        different snapshots (the DCP reader resolves so)."""
        if group is None or not is_collective(group):
            return self._root(target).hex()
        return collective_checkout(CollectiveJob(self._collective, group, timeout, resolve=self._root,
                                                 read=lambda root, _rank, _shared: root.hex()), target)

    def _root(self, target: str) -> Digest:
        """What `target` names, one answer for every call that names a snapshot (resolve,
        show, diff, tag, pin, forget, the DCP reader, export, checkout): with a local tier
        the newer of the tier's and the remote's (LocalTier.roots), what checkout reads."""
        return self._tier_roots(target)[0]

    def _tier_roots(self, target: str) -> list[Digest]:
        """The snapshots `target` names, the newest first: with a local tier, the tier's
        and the remote's where they differ (LocalTier.roots), else the one root."""
        return self._tier.roots(target)

    @property
    def read_core(self) -> Core:
        """The Core to read a snapshot _root named through: with a local tier, its objects
        read from the tier with the remote behind (tier/reads.py's read_through), so a snapshot
        only the remote holds reads as checkout reads it; else the store's own Core."""
        return self._tier.read_core()

    def _named(self, target: str) -> Digest | None:
        """_root(target), or None where nothing names it (a removed snapshot's full root:
        tag, pin and undelete adopt one whose objects a tier still holds)."""
        try:
            return self._root(target)
        except RefNotFound:
            return None

    def _info(self, root: bytes) -> SnapshotInfo:
        theirs = self._tier.remote_info(root)  # only the remote behind a tier lists it: its row
        if theirs is not None:
            return theirs
        return self._durable([self.publisher.info(root)])[0]

    @_public
    def show(self, target: str) -> SnapshotInfo:
        return self._info(self._root(target))

    def prefetch(self, ref: str):
        """Begin reading the blocks of `ref`'s newest snapshot that this store holds on a
        local disk (a local store, or a local tier: a rank's part of a collective snapshot),
        in the background, through the page cache: called first thing in a restarting job
        (before it builds its model, before init_process_group), the reads run at the disk's
        speed while the job does what does not touch the disk, and the restore that follows
        finds them in memory (read/prefetch.py). A hint: it reads into no tensor, checks
        nothing (the restore verifies every byte), never fails the job; a ref that does not
        exist, or an object store, reads nothing. -> a handle: wait(timeout) (True once it
        ended), files, bytes, error, seconds."""
        from .format.names import validate_name
        from .read.prefetch import Prefetch
        validate_name(ref)
        return Prefetch(self.core, ref)

    @_public
    def checkout(self, target: str, *, into=None, paths=None, map_location=None, verify: bool | None = None,
                 allow_pickle: bool = False, group=_AUTO_GROUP, timeout: float = 300.0,
                 max_bytes: int | None = None, progress: bool = False):
        """The state of a snapshot, verified against its root hash (unless verify=False).

        into=: an existing tree whose tensors/arrays/lists/dicts are updated in
        place (dtype and shape must match: CheckoutMismatch); it is returned. Only
        the keys its dicts have are read (each must be in the snapshot); a DCP
        Stateful in it (a module, an optimizer: state_dict()/load_state_dict())
        gets its whole sub-tree through load_state_dict once every read succeeded.
        into= tensors keep their own device.
        paths=["model", "optim.state.3"]: only those sub-trees (dotted paths, as
        `tsck ls` prints them), reading only their nodes and blocks; a list or
        tuple of which only some items are selected comes back as {index: item}.
        map_location: torch.load's meanings (a device, {saved: device}, or a
        callable(tensor, saved_location) -> tensor). Without it, a tensor saved on
        a device this process lacks raises DeviceUnavailable (nothing is read).
        max_bytes: the most fresh memory the snapshot's manifest may make this call
        allocate (default: the host's RAM + swap); beyond it, FormatError.
        progress=True: the bytes read as a bar on stderr (`tsck checkout`)."""
        verify = self.verify if verify is None else verify
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool)
                                      or max_bytes < 0):
            raise InvalidArgument(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        opts = dict(verify=verify, allow_pickle=allow_pickle, max_bytes=max_bytes, paths=paths,
                    map_location=map_location)
        from .read.readpath import read_state
        from .read.read import MISSING, Reader
        Reader(self.assets, self.pool, snapshot="", **opts)  # checks paths and map_location first

        def read_with(reader: Reader, top: bytes):
            return read_state(reader, top, MISSING if into is None else into, allow_pickle=allow_pickle)

        # With a local tier: the tier's copies first, the remote's where one is missing or
        # fails its check (and a collective checkout asks the peers holding replicas first).
        reads = self._tier.reads_for(is_collective(group))

        def read(root: Digest, rank: int | None = None, shared=None):
            # rank: this rank's tree of a collective snapshot (a collective checkout); None:
            # one process's view, every rank's tree merged (world_view.py). shared: the
            # checkout's SharedRead when its ranks read each shared block once.
            # Read before any object is: what this checkout reads is then known present under
            # it, for later puts and checkouts of this Store (assets.Presence).
            fence = self.assets.fence_now()
            t0 = time.monotonic()
            served = self._tier.served(reads)
            c = decode_commit(served.get_commit(root, verify=verify))
            plan = _then(shared and shared.plan, self._tier.read_plan(served, c))
            st = c.get("stats") or {}
            # A Store's own checkout (no tier): the packed parts it read and checked are ones a
            # later put may name without reading the snapshot's nodes again (packparts.py).
            seen = [] if self._tier.learns_parts and rank is None else None
            with _bytes_bar(progress, "checkout", st.get("bytes_total") if isinstance(st, dict) else None) as bar:
                try:
                    out = read_with(Reader(served, self.pool, snapshot=root.hex(), rank=rank, fence=fence,
                                           progress=bar, parts_seen=seen, plan=plan, **opts),
                                    c["tree"])
                except BaseException:
                    if shared is not None:
                        shared.abandon()  # the other ranks' reads go on without this rank's
                    raise
            if shared is not None:
                shared.finish()
            if seen is not None:
                self.assets.parts.read_back(root, seen, whole=paths is None)
            source = self._tier.source(served)
            _log_restored(target, root, c, source, time.monotonic() - t0, paths is not None)
            return out

        if is_collective(group):
            # Rank 0 resolves the target in both tiers (the newer snapshot, as for one
            # process); every rank reads its region through its own tier, the remote behind.
            # What its peers gave is kept in its tier once the checkout is done (reading).
            with self._tier.reading():
                return collective_checkout(CollectiveJob(self._collective, group, timeout, resolve=self._root,
                                                         read=read, share=self._share_for, shares=self._shares,
                                                         tip=self._tier.own_tip, newest=self._tier.newest_of), target)
        roots = self._tier_roots(target)
        for i, root in enumerate(roots):
            try:
                return read(root)
            except IntegrityError as e:
                if i + 1 == len(roots):
                    raise
                # Complete and verified in no tier (a local-only snapshot with a damaged
                # block): the other tier's snapshot of the target, older, is the newest
                # one that can be trusted.
                _log.warning("checkout %s: snapshot %s cannot be read whole from any tier (%s); reading the older "
                             "%s instead", target, root.hex()[:16], e, roots[i + 1].hex()[:16])
        raise AssertionError("unreachable")

    def _share_for(self, ch):
        """A collective checkout's shared reads over this Store's side channel."""
        from .collective.shared import SharedRead, Sharing
        if self._sharing is None:
            self._sharing = Sharing(self.storage)
        return SharedRead(self._sharing, ch)

    @_public
    def log(self, ref: str, *, errors: dict | None = None) -> list[SnapshotInfo]:
        """Snapshots `ref` has pointed at that still exist, newest first. gc compacts the
        history to what it keeps, so this costs what retention keeps. A snapshot whose
        catalog row does not decode raises FormatError, or with errors={} goes there
        (root hex -> error) and the others are listed."""
        from .read.listing import history
        validate_name(ref)
        core = self._tier.history_core(ref)
        if core is not self.core:
            # The remote tip is the newer (the local tier lost, or behind another node's
            # uploads): its history, all durable, is what checkout(ref) reads.
            return history(core, ref, errors)
        return self._durable(history(self.core, ref, errors))

    def _infos(self, named, errors: dict | None) -> dict[str, SnapshotInfo]:
        from .read.listing import describe
        return describe(named, self._info, errors)

    @_public
    def refs(self, prefix: str = "", *, errors: dict | None = None) -> dict[str, SnapshotInfo]:
        """name -> SnapshotInfo of every ref (under `prefix`). A ref whose snapshot cannot
        be described (catalog row and commit both unreadable) raises FormatError (or
        IntegrityError), or with
        errors={} goes there (name -> error) and the others are listed."""
        if not isinstance(prefix, str):
            raise InvalidArgument(f"prefix must be a str, got {type(prefix).__name__}")
        check_utf8(prefix, "ref prefix")
        return self._infos(self.reftable.list(prefix), errors)

    @_public
    def tags(self, *, errors: dict | None = None) -> dict[str, SnapshotInfo]:
        """As refs(), for tags."""
        return self._infos(self.reftable.tags(), errors)

    @_public
    def tag(self, name: str, target: str) -> SnapshotInfo:
        """Create an immutable tag; RefConflict if the name is taken.

        The tag is also written to storage (``tags/<hex>``), so `recover` can
        rebuild it; that object is created exclusively, so it is the tag's
        single source of truth across hosts (lifecycle.py).

        `target` may be the full root (64 hex digits) of a snapshot nothing keeps any
        more (its ref deleted, it forgotten) whose commit storage still holds: it is
        brought back (tagged, its catalog row restored) when every node and block of
        it is present, as recover checks, and IntegrityError names what is missing
        otherwise (a gc has begun reclaiming it). Safe beside a gc: fenced on its
        deletion epoch (lifecycle.tag)."""
        validate_new_name(name, "tag name")
        self._writable("tag")
        # One answer: the snapshot checkout reads; one catalog: through a tier the remote
        # keeps what the tier's tag keeps, and a snapshot only the remote lists is tagged there.
        info, here = self._tier.tag(self.publisher, name, target, self._named)
        return self._durable([info])[0] if here else info

    @_public
    def recover(self, *, progress: bool = False, wait: float = 0.0):
        """Rebuild catalog, refs (at their newest commits), reflog and tags from storage.
        Until a recover finishes, gc and prune refuse (RebuildUnfinished). GcBusy if a gc
        holds the store for more than `wait` seconds."""
        from .maintain.recover import run_recover
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < 1e7:
            raise InvalidArgument(f"recover wait must be a number of seconds >= 0, got {wait!r}")
        self._writable("recover")
        return run_recover(self.core, progress=progress, wait=wait)

    @_public
    def diff(self, a: str, b: str, *, raw: bool = False) -> dict:
        """Which tensors differ between two targets, and in how many blocks. A snapshot
        written through dcp.save names its tensors at their paths in the state as saved,
        as ls does (raw=True: the stored layout's, tensors.FQN)."""
        from .read.listing import diff
        return diff(self.read_core, self._root(a), self._root(b), raw=raw)

    @_public
    def pin(self, target: str) -> str:
        """Keep `target` whatever retention says, until unpin() -> its root hex. A full
        root that nothing keeps any more but whose objects storage still holds is brought
        back, as tag() brings one back. With a local tier the pin is the remote's too."""
        self._writable("pin")
        return self._tier.pin(self.publisher, target, self._named)

    @_public
    def pins(self, *, errors: dict | None = None) -> dict[str, SnapshotInfo]:
        """root hex -> SnapshotInfo of every pinned snapshot (pin() keeps one until
        unpin(), through retention and gc), oldest commit first. One that cannot be
        described raises FormatError (or IntegrityError), or with errors={} goes there
        (root hex -> error) and the others are listed, as for refs()."""
        infos = self._infos(((r.hex(), r) for r in self.reftable.pins()), errors)
        return dict(sorted(infos.items(), key=lambda kv: (kv[1].time, kv[0])))

    @_public
    def unpin(self, target: str) -> str:
        self._writable("unpin")
        root = self._root(target)
        self._tier.unpin(root)
        return root.hex()

    @_public
    def delete_ref(self, ref: str, *, expected: str | None = None, dry_run: bool = False) -> dict:
        """Remove ref `ref` (RefConflict if `expected`, a root's hex or prefix, no longer
        names what it points at; RefNotFound if there is no such ref). Its reflog keeps a
        record of the removal; the snapshots of its history that nothing else keeps (another
        ref, a tag, a pin) leave the catalog in the same transaction, so the next gc
        reclaims their objects (a prune keeps what the removed tip reaches). The name may be
        used again by a later put. Until a gc reclaims it, undelete(ref) brings the ref back
        on the snapshot it pointed at.
        dry_run: the same checks and answer, nothing changed (a read-only store answers too).
        -> {"ref", "root", "snapshots_dropped"}; a dry run adds "dropped" (the roots' hex of
        the snapshots that would no longer be kept) and "dry_run": True."""
        validate_name(ref)
        if not dry_run:
            self._writable("delete_ref")
        return self._tier.delete_ref(ref, expected, self._named, dry_run=dry_run)  # (through a tier: in both tables)

    @_public
    def undelete(self, ref: str, *, to: str | None = None) -> SnapshotInfo:
        """Bring back ref `ref`, removed by delete_ref, on the snapshot it pointed at then
        (from its reflog), or on `to` (a target, or the full root of a removed snapshot)
        -> what it points at. Refused while the ref exists again (RefConflict) or a tag
        has its name; RefNotFound if it was not deleted. A snapshot nothing else keeps is
        checked whole first (IntegrityError naming what a gc already reclaimed) and comes
        back with the ref; safe beside a gc (lifecycle.undelete). The older snapshots of
        its history that delete_ref dropped stay dropped (tag(name, root) keeps one)."""
        validate_name(ref)
        self._writable("undelete")
        info, here = self._tier.undelete(self.publisher, ref, to, self._named)
        return self._durable([info])[0] if here else info

    @_public
    def untag(self, name: str) -> str:
        """Remove tag `name` (RefNotFound if there is none); -> the root it named. Its
        storage object goes first, so recover cannot bring it back after a crash here."""
        validate_name(name, "tag name")
        self._writable("untag")
        return self._tier.untag(name)

    @_public
    def forget(self, target: str, *, dry_run: bool = False) -> SnapshotInfo:
        """Drop one snapshot (REF@STEP, or a root) from the catalog so gc reclaims what
        only it holds; recorded in its ref's reflog. Refused (InvalidArgument) while it is
        a ref's tip, a tag's target or pinned. Until a gc reclaims it, tag(name, root)
        brings it back. dry_run: the same checks and answer, nothing changed. -> what it was."""
        if not dry_run:
            self._writable("forget")
        return self._tier.forget(self.publisher, target, self._root, self._info, dry_run=dry_run)

    @_public
    def du(self) -> dict:
        """Logical bytes (what the kept snapshots hold) vs physical (what storage holds)."""
        from .maintain.usage import summary
        return summary(self.core, lease=self.gc_lease)
