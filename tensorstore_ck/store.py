"""The Store facade: what users hold.

    Store ──> Planner (plan.py) ──> Publisher (publish.py) ──> Assets (assets.py) ──> BlockStore (storage/)
      ├────> Reader (read.py)                                    └─> RefTable (refs/)
      └────> gc, fsck, recover, diff (gc.py, fsck.py, recover.py, walk.py)

Publication order, always: blocks -> manifest nodes -> commit object ->
storage sync -> compare-and-swap of the ref (with reflog and catalog row in
the same ref-table transaction), all in publish.Publisher. A crash anywhere
before the CAS leaves only unreferenced objects behind. open_store() is in
opener.py.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as _wait_all
from typing import TYPE_CHECKING

from . import chunker
from .core import DEFAULT_WORKERS, Core, Settings
from .dist import AUTO as _AUTO_GROUP
from .dist import CALLS, begin_put, collective_checkout, collective_put, is_collective, run_put
from .errors import (AmbiguousTarget, Fenced, FormatError, IntegrityError, InvalidArgument, InvalidName,
                     OutcomeUnknown, ReadOnlyStore, RefConflict, RefNotFound, StorageError, StoreClosed, TsckError,
                     storage_error)
from .format.manifest import decode_commit
from .ids import MIN_PREFIX, Digest, is_hex_prefix
from .info import SnapshotInfo, row_to_info
from .publish import Publisher
from .refs import RefTable
from .format.names import parse_target, validate_component, validate_name, validate_new_name
from .retention import Retention
from .staging import StagingPool
from .storage import BlockStore
from .validate import UNSET, SnapshotArgs, check_snapshot_args

if TYPE_CHECKING:  # plan.py and read.py import torch: loaded where tensors are
    from .plan import Planner

__all__ = ["Store", "SnapshotInfo"]

MAX_TAG_BYTES = 120
_UNSET = UNSET


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
def _bytes_bar(desc: str, total):
    """A bytes progress bar on stderr for one put or checkout, closed however it ends."""
    from .progress import progress_bar
    total = total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else None
    bar = progress_bar(True, desc, total=total, unit="B")
    if bar is None:  # pragma: no cover - tqdm is a dependency
        yield type("NoBar", (), {"update": staticmethod(lambda n: None)})
        return
    try:
        yield bar
    finally:
        bar.close()


class SnapshotFuture(Future):
    """The Future of an asynchronous put_snapshot. It remembers whether the caller has
    retrieved its outcome (result() or exception() returned or raised it), so that
    Store.close() can raise a failure nobody retrieved."""

    def __init__(self, ref: str):
        super().__init__()
        self.ref = ref
        self.retrieved = False

    def result(self, timeout=None):
        try:
            return super().result(timeout)
        finally:
            if self.done():  # a timeout retrieved nothing
                self.retrieved = True

    def exception(self, timeout=None):
        err = super().exception(timeout)
        self.retrieved = True
        return err

    def failure(self) -> BaseException | None:
        """The error of a finished, failed snapshot, else None; not a retrieval (the
        package's own callbacks look with this, leaving the caller's duty intact)."""
        return Future.exception(self, 0) if self.done() and not self.cancelled() else None


_STORES: "weakref.WeakSet[Store]" = weakref.WeakSet()


def _quietly(fn, *args) -> None:
    """Run fn for its effect on others; its error is known to the caller already."""
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001
        pass


def _note(err: BaseException, text: str) -> None:
    if hasattr(err, "add_note"):  # Python >= 3.11
        err.add_note(text)


def _stores_after_fork() -> None:
    for store in list(_STORES):
        store._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_stores_after_fork)


def _utf8(s: str, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what}: string {s!r} is not valid UTF-8") from None


def layout(block_size, inline_threshold, config: dict | None = None, *, where: str = "") -> tuple[int, int]:
    """The block size and inline threshold a Store writes with: the arguments, else the
    store marker's, else the defaults (the inline threshold is never above the block
    size unless asked for). open_store calls it before writing anything, so a bad
    argument never leaves a half-made store; a marker whose values do not fit (written
    by hand, or by an older build) is a FormatError that says how to go on."""
    for name, v in (("block_size", block_size), ("inline_threshold", inline_threshold)):
        if v is not None and (type(v) is not int or v < 0):
            raise InvalidArgument(f"{name} must be a non-negative int, got {v!r}")
    cfg = config or {}
    bs = block_size if block_size is not None else cfg.get("block_size", chunker.DEFAULT_BLOCK_SIZE)
    if inline_threshold is not None:
        it = inline_threshold
    else:
        it = cfg.get("inline_threshold", min(chunker.DEFAULT_INLINE_THRESHOLD, bs))
    problem = None
    if not chunker.MIN_BLOCK_SIZE <= bs <= chunker.MAX_BLOCK_SIZE:
        problem = f"block_size must be within {chunker.MIN_BLOCK_SIZE}..{chunker.MAX_BLOCK_SIZE}, got {bs}"
    elif not 0 <= it <= bs:
        problem = f"inline_threshold must be within 0..block_size ({bs}), got {it}"
    if problem is None:
        return int(bs), int(it)
    if (block_size is None and "block_size" in cfg) or (inline_threshold is None and "inline_threshold" in cfg):
        raise FormatError(f"{where or 'the store marker'} holds a layout this build cannot write with: {problem}; "
                          "open the store with block_size=/inline_threshold= arguments that fit, or correct those "
                          "fields of the marker (they only decide how new snapshots are cut; stored ones read "
                          "either way)")
    raise InvalidArgument(problem)


COMPRESSION = ("auto", "float", "lz4", "none")


def codecs_for(compression: str, storage: BlockStore, *, compress: bool = True, shuffle: bool = False) -> str:
    """The codecs a writer uses (Assets(codecs=)) for open_store(compression=...).

    "auto" is the measured best for the backend (docs/ARCHITECTURE.md, "Compression"):
    the float codec where the bytes cross a network (object stores: fewer bytes is
    time and money saved), lz4 where they do not (a local disk, memory://), where
    coding floats costs more CPU time than the disk saves. The older flags map in:
    compress=False is "none", shuffle=True the byte-shuffle codec (deprecated).
    The options are checked first (check_options)."""
    if not compress:
        return "none"
    if shuffle:
        return "shuffle"
    if compression == "auto":
        return "lz4" if storage.local or storage.url.startswith("memory://") else "float"
    return compression


def check_options(*, workers=None, gc_lease=None, max_inflight=2, when_busy="wait", compression="auto",
                  compress=True, shuffle=False) -> None:
    """A Store's other options, checked before open_store writes anything."""
    if compression not in COMPRESSION:
        raise InvalidArgument(f"compression must be one of {', '.join(map(repr, COMPRESSION))}, got {compression!r}")
    if not compress and compression not in ("auto", "none"):
        raise InvalidArgument(f"compress=False contradicts compression={compression!r}")
    if shuffle and compression not in ("auto", "lz4"):
        raise InvalidArgument(f"shuffle=True contradicts compression={compression!r}")
    if workers is not None and (type(workers) is not int or not 1 <= workers <= 1024):
        raise InvalidArgument(f"workers must be an int within 1..1024, got {workers!r}")
    if gc_lease is not None and not (isinstance(gc_lease, (int, float)) and not isinstance(gc_lease, bool)
                                     and 0 < gc_lease < 1e7):
        raise InvalidArgument(f"gc_lease must be a positive number of seconds, got {gc_lease!r}")
    if type(max_inflight) is not int or max_inflight < 1:
        raise InvalidArgument(f"max_inflight must be an int >= 1, got {max_inflight!r}")
    if when_busy not in ("wait", "skip"):
        raise InvalidArgument(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")


class Store:
    """A content-addressed snapshot store. Thread-safe; use one per process."""

    def __init__(self, storage: BlockStore, refs: RefTable, *, config: dict, workers: int | None = None,
                 verify: bool = True, compress: bool = True, shuffle: bool = False,
                 compression: str = "auto", block_size: int | None = None, inline_threshold: int | None = None,
                 gc_lease: float | None = None, max_inflight: int = 2, when_busy: str = "wait",
                 read_only: str | None = None):
        """read_only: why the store is opened read-only (open_store decides), or None."""
        from .gc import DEFAULT_LEASE
        check_options(workers=workers, gc_lease=gc_lease, max_inflight=max_inflight, when_busy=when_busy,
                      compression=compression, compress=compress, shuffle=shuffle)
        # The lease of the gcs this Store runs (store.gc()). Other parties judge it on the ref
        # table's clock from what the gc declared; no Store's setting judges another's gc.
        self.gc_lease = float(gc_lease if gc_lease is not None else DEFAULT_LEASE)
        self.storage = storage
        self.reftable = refs
        self.config = config
        self.verify = verify
        self.block_size, self.inline_threshold = layout(block_size, inline_threshold, config,
                                                        where=f"{storage.url}/tsck.json")
        # What blocks are written with ("none", "lz4", "shuffle", "float"); any store reads every codec.
        self.codecs = codecs_for(compression, storage, compress=compress, shuffle=shuffle)
        self.workers = workers or DEFAULT_WORKERS
        # What the layers below the facade are given (gc, fsck, recover, dist, ...).
        self.core = Core.build(storage, refs, codecs=self.codecs, settings=Settings(
            verify=verify, workers=self.workers, gc_lease=self.gc_lease, block_size=self.block_size,
            inline_threshold=self.inline_threshold, read_only=read_only))
        self.assets = self.core.assets
        self._pool = self.core.pool
        # The one way anything is published into this store (put, collective put, DCP writer).
        self.publisher = Publisher(self.assets, refs, self._pool)
        # One background publisher: asynchronous snapshots commit in the order they were taken.
        self._bg = ThreadPoolExecutor(1, thread_name_prefix="tsck-bg")
        self.max_inflight = max_inflight
        self.when_busy = when_busy
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._staging = StagingPool(max_inflight)
        self._inflight: list[Future] = []
        self._bg_lock = threading.Lock()
        self._bg_error: BaseException | None = None
        self._failed: list[SnapshotFuture] = []  # failures no put or raise_pending_error() raised yet
        self.skipped = 0  # asynchronous snapshots dropped by when_busy="skip"
        self._collective = CALLS  # the process's call counters of collectives (shared by its Stores)
        self._read_only = read_only
        self._closed = False
        _STORES.add(self)

    def _after_fork(self) -> None:
        """In the child of os.fork(): only the forking thread exists there, so the I/O
        pool's workers, the background publisher and the snapshots it had in flight (and
        any lock or slot they held) are the parent's. Rebuild them; the ref table and the
        storage reopen their own handles (refs/base.py track_for_fork, _after_fork below)."""
        if self._closed:
            return
        self._pool = self.core.pool = ThreadPoolExecutor(self.workers, thread_name_prefix="tsck-io")
        self.publisher.pool = self._pool
        self._bg = ThreadPoolExecutor(1, thread_name_prefix="tsck-bg")
        self._slots = threading.BoundedSemaphore(self.max_inflight)
        self._staging = StagingPool(self.max_inflight)
        self._inflight = []
        self._bg_lock = threading.Lock()
        self._bg_error = None
        self._failed = []
        self.assets.presence.after_fork()
        # torch's intra-op pool (OpenMP here) does not survive a fork either: the child's
        # first parallel op (staging's copy_, a checkout's) waits for workers that are not
        # there. One thread, as torch's own DataLoader workers do.
        torch = sys.modules.get("torch")  # not imported: no pool to lose
        if torch is not None and torch.get_num_threads() > 1:
            torch.set_num_threads(1)
        s = self.storage
        while s is not None:  # wrappers (throttle, faults) and backends with their own locks or clients
            hook = getattr(s, "_after_fork", None)
            if hook is not None:
                hook()
            s = getattr(s, "inner", None)

    # -- lifecycle -------------------------------------------------------------
    def close(self) -> None:
        """Finish every asynchronous snapshot in flight, release everything (pools,
        staging buffers, the ref table, storage), then raise the failure of an
        asynchronous snapshot whose outcome the caller never learnt: one whose future's
        result() or exception() was not called and that no later put_snapshot,
        raise_pending_error() or CheckpointManager call raised. A script that ends with
        close() thus hears that its last snapshot failed. Raised once: a second close()
        returns quietly. Several such failures: the first is raised, a note counts the
        others (their futures hold them). As a context manager, an exception already
        leaving the `with` block is not replaced: it gets the failure as a note."""
        if self._closed:
            return
        self._closed = True
        self._bg.shutdown(wait=True)
        self._staging.clear()
        self._pool.shutdown(wait=True)
        self.reftable.release_abandoned_gc()  # a gc of ours that could not record its end
        self.reftable.close()
        self.storage.close()
        with self._bg_lock:
            unheard, self._failed, self._bg_error = [f for f in self._failed if not f.retrieved], [], None
        if unheard:
            err = unheard[0].failure()
            _note(err, f"raised by Store.close(): the asynchronous snapshot of ref {unheard[0].ref!r} failed "
                       "and its future's outcome was never retrieved"
                       + (f"; {len(unheard) - 1} later asynchronous snapshot(s) failed too" if len(unheard) > 1
                          else ""))
            raise err

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None:
            self.close()
            return
        try:
            self.close()
        except Exception as err:  # noqa: BLE001 - the exception already on its way out wins
            if err is not exc:
                _note(exc, f"while closing the store at {self.url}: {type(err).__name__}: {err}")

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
        return self._pool

    # -- writing ---------------------------------------------------------------
    @_public
    def put_snapshot(self, state, ref: str, *, step: int | None = None, metrics: dict | None = None,
                     meta: dict | None = None, job: str | None = None, expected=_UNSET,
                     blocking: bool = True, allow_pickle: bool = False, when_busy: str | None = None,
                     group=_AUTO_GROUP, timeout: float = 300.0, progress: bool = False):
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
        calls it alike and one snapshot holds every rank's state. blocking=False there
        stages this rank's state, returns its future, and makes the collective call
        on the background publisher, in call order on every rank (the same outcome on
        every rank's future, never re-raised by the next put; when_busy must be
        "wait"; the future cannot be cancelled: the other ranks expect this one). A
        rank whose state cannot be staged raises at once, and the call aborts on
        every rank. timeout counts from when the call starts in the background.

        A blocking put first waits for the asynchronous ones in flight, so the
        ref never moves back to an older snapshot. progress=True: a blocking put
        shows the bytes it hashes and writes as a bar on stderr (`tsck import`)."""
        self._writable("put_snapshot")
        def prepare() -> SnapshotArgs:
            self.raise_pending_error()
            if when_busy is not None and when_busy not in ("wait", "skip"):
                raise InvalidArgument(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
            return check_snapshot_args(ref, job=job, step=step, metrics=metrics, meta=meta, expected=expected)

        if is_collective(group):
            if not blocking:
                return self._put_collective_async(state, prepare, allow_pickle, when_busy, group, timeout)

            self.wait()  # the asynchronous ones first (named already): the calls run in call order
            # Every rank enters the collective before checking its arguments, so a bad
            # argument on one rank aborts this snapshot everywhere instead of leaving
            # that rank one collective behind the others.
            return collective_put(self.publisher, self._collective, state, planner=self.planner(allow_pickle),
                                  prepare=prepare, group=group, timeout=timeout)
        args = prepare()
        plan = self.planner(allow_pickle, defer_device=not blocking).plan(state)  # validates it all first
        if blocking:
            self.wait()
            if not progress:
                return self._publish(plan, args)
            with _bytes_bar("put", sum(b - a for leaf in plan.leaves for a, b in leaf.ranges)) as bar:
                return self._publish(plan, args, progress=bar.update)
        buf = self._stage(plan, wait=(when_busy or self.when_busy) == "wait")
        if buf is None:
            self.skipped += 1
            return None
        fut = SnapshotFuture(args.ref)
        with self._bg_lock:
            self._bg.submit(self._publish_staged, fut, buf, plan, args)
            self._inflight.append(fut)
        return fut

    def _stage(self, plan, *, wait: bool):
        """Take one of the max_inflight slots (wait for one, or None when none is free and
        not wait) and copy the plan's bytes into a staging buffer -> the buffer. The slot and
        buffer go back when the background publisher is done with the snapshot."""
        if not self._slots.acquire(blocking=wait):
            return None
        try:
            buf = self._staging.take(plan.staged_bytes)
            plan.stage(buf)
        except BaseException:
            self._slots.release()
            raise
        return buf

    def _put_collective_async(self, state, prepare, allow_pickle, when_busy, group, timeout):
        """blocking=False under torch.distributed: stage this rank's state on the caller's
        thread, then make the collective put (hello, writes, rank 0's commit, the outcome
        round) on the background publisher, behind the snapshots already in flight, so the
        calls run in the same order on every rank. Every rank's future gets the same
        outcome. A failure here, before anything is staged (bad arguments, a state that
        cannot be snapshotted), is raised to this caller at once, and the call still
        runs in the background, only to abort it on every rank."""
        ch = begin_put(self._collective, group, timeout)  # names the call: in call order, on every rank
        try:
            args = prepare()
            if (when_busy or self.when_busy) != "wait":
                raise InvalidArgument(
                    "when_busy='skip' cannot apply to a collective snapshot: the ranks would skip different ones; "
                    "pass when_busy='wait' (an asynchronous collective put waits for a free slot)")
            plan = self.planner(allow_pickle, defer_device=True).plan(state)
            buf = self._stage(plan, wait=True)
        except BaseException as e:
            def refuse():  # (an interrupt, too, must reach the others as an abort)
                raise e if isinstance(e, Exception) else SnapshotAborted(f"snapshot aborted: {type(e).__name__}")
            with self._bg_lock:
                self._inflight.append(self._bg.submit(_quietly, run_put, ch, self.publisher, refuse, refuse))
            raise
        fut = SnapshotFuture(args.ref)
        fut.set_running_or_notify_cancel()  # cancel() refuses: the other ranks expect this one
        with self._bg_lock:
            self._bg.submit(self._publish_staged, fut, buf, plan, args,
                            lambda: run_put(ch, self.publisher, lambda: args, lambda: plan))
            self._inflight.append(fut)
        return fut

    def _after_in_flight(self, fn) -> None:
        """Run fn() on the background publisher once the snapshots queued so far have
        ended (in their order; the CheckpointManager's prune between its collective
        snapshots). Its errors are fn's to handle."""
        with self._bg_lock:
            self._inflight.append(self._bg.submit(_quietly, fn))

    def planner(self, allow_pickle: bool = False, defer_device: bool = False) -> Planner:
        """A planner with this store's block layout (validates a state before any write)."""
        from .plan import Planner  # torch, imported where tensors are (not by `tsck refs`)
        return Planner(block_size=self.block_size, inline_threshold=self.inline_threshold,
                       allow_pickle=allow_pickle, defer_device=defer_device)

    def _publish_staged(self, fut: SnapshotFuture, buf, plan, args, collective=None) -> None:
        """collective: the collective put to make (run_put), instead of publishing alone.
        Its failure goes to its future and close(), not to the next put: the ranks learn
        it at different moments, and one rank raising it from its next put would abort
        that snapshot on every rank."""
        info = err = None
        started = False
        try:
            # False: cancelled while queued, nothing written. (A collective put's future runs
            # from the start: it cannot be cancelled, the other ranks expect this rank.)
            started = collective is not None or fut.set_running_or_notify_cancel()
            if started:
                try:
                    info = self._publish(plan, args) if collective is None else collective()
                except BaseException as e:  # noqa: BLE001 - handed to the future, the next put and close()
                    err = e
                    with self._bg_lock:
                        if collective is None:
                            self._bg_error = e
                        self._failed.append(fut)
        finally:
            try:
                # The slot and buffer are free before the future completes: a caller that
                # saw the outcome may put again at once.
                self._staging.give(buf)
                self._slots.release()
            finally:  # whatever happened above, the future completes (wait() and close() wait on it)
                if started:
                    if err is not None:
                        fut.set_exception(err)
                    else:
                        fut.set_result(info)

    def raise_pending_error(self) -> None:
        """Raise (once) the failure of an asynchronous snapshot, if one failed. The
        failures so far count as heard: close() does not raise them again."""
        with self._bg_lock:
            err, self._bg_error = self._bg_error, None
            if err is not None:
                self._failed = []
        if err is not None:
            raise err

    def wait(self) -> None:
        """Block until every asynchronous snapshot in flight has committed or failed.
        Failures are not raised here (they are on their futures, the next put and close())."""
        with self._bg_lock:
            futs, self._inflight = self._inflight, []
        _wait_all(futs)  # not a retrieval of their outcome

    @_storage_errors
    def _publish(self, plan, args: SnapshotArgs, progress=None) -> SnapshotInfo:
        return self.publisher.publish(plan, args, progress=progress)

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
        table so an offline `tsck gc` applies each job's own rules."""
        self._writable("set_retention")
        validate_component(job, "job name")
        if retention is not None and not isinstance(retention, Retention):
            raise InvalidArgument(f"retention must be a tsck.Retention, got {type(retention).__name__}")
        self.reftable.retention_set(job, None if retention is None else retention.to_dict())

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
        from .gc import run_gc
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
        from .gc import prune_job
        validate_component(job, "job name")
        self._writable("prune")
        return prune_job(self.core, job, lease=self.gc_lease if lease is None else lease)

    @_public
    def fsck(self, *, full: bool = True, progress: bool = False, repair: bool = False):
        """Check every kept snapshot and every ref/tag/pin; full=True re-hashes every byte.
        repair=True also moves every damaged object aside (quarantine/, never deleted),
        so the next put of its content stores it again and heals the snapshots using it;
        it takes the store's gc lock (GcBusy while a gc runs)."""
        from .fsck import run_fsck
        if repair:
            self._writable("fsck --repair")
        return run_fsck(self.core, full=full, progress=progress, repair=repair, lease=self.gc_lease)

    # -- reading ---------------------------------------------------------------
    @_public
    def resolve(self, target: str) -> str:
        """A target (ref, tag, REF@STEP, root hex or unique prefix >= 8) -> root hex."""
        return self._root(target).hex()

    def _root(self, target: str) -> Digest:
        kind, text, step = parse_target(target)
        if kind == "step":
            found = self.reftable.step_root(text, step)  # an index: cost independent of the history
            if found is not None:
                return Digest(found)
            if self.reftable.history(text) is None:
                raise RefNotFound(f"no ref named {text!r}")
            raise RefNotFound(f"ref {text!r} has no kept snapshot at step {step}")
        r = self.reftable.get_or_none(text)
        if r is None:
            r = self.reftable.tag_get(text)
        if r is not None:
            return Digest(r)
        if is_hex_prefix(text):
            even = text[: len(text) // 2 * 2]
            found = [x for x in self.reftable.catalog_prefix(bytes.fromhex(even)) if x.hex().startswith(text)]
            if len(found) == 1:
                return Digest(found[0])
            if len(found) > 1:
                raise AmbiguousTarget(f"root prefix {text!r} matches {len(found)} snapshots; give more digits")
        if text and len(text) < MIN_PREFIX and all(c in "0123456789abcdef" for c in text):
            raise RefNotFound(f"no ref or tag named {target!r}, and a root prefix needs at least {MIN_PREFIX} hex "
                              "digits (see `tsck log` for roots)")
        raise RefNotFound(f"no ref, tag or snapshot named {target!r}")

    def _info(self, root: bytes) -> SnapshotInfo:
        return self.publisher.info(root)

    @_public
    def show(self, target: str) -> SnapshotInfo:
        return self._info(self._root(target))

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
        from .dcpview import is_dcp_top, read_dcp
        from .read import MISSING, Reader
        Reader(self.assets, self._pool, snapshot="", **opts)  # checks paths and map_location first

        def read_with(reader: Reader, top: bytes):
            v = reader.top(top)
            if is_dcp_top(v):  # written by dcp.save through TsckWriter: the state it saved
                return read_dcp(reader, v, MISSING if into is None else into, allow_pickle=allow_pickle)
            return reader.materialize(v, (), MISSING if into is None else into)

        def read(root: Digest, rank: int = 0):
            # Read before any object is: what this checkout reads is then known present under
            # it, for later puts and checkouts of this Store (assets.Presence).
            fence = self.assets.fence_now()
            c = decode_commit(self.assets.get_commit(root, verify=verify))
            if not progress:
                return read_with(Reader(self.assets, self._pool, snapshot=root.hex(), rank=rank, fence=fence,
                                        **opts), c["tree"])
            st = c.get("stats") or {}
            with _bytes_bar("checkout", st.get("bytes_total") if isinstance(st, dict) else None) as bar:
                return read_with(Reader(self.assets, self._pool, snapshot=root.hex(), rank=rank, fence=fence,
                                        progress=bar.update, **opts), c["tree"])

        if is_collective(group):
            return collective_checkout(self._collective, target, resolve=self._root, read=read, group=group,
                                       timeout=timeout)
        return read(self._root(target))

    @_public
    def log(self, ref: str, *, errors: dict | None = None) -> list[SnapshotInfo]:
        """Snapshots `ref` has pointed at that still exist, newest first. gc compacts the
        history to what it keeps, so this costs what retention keeps. A snapshot whose
        catalog row does not decode raises FormatError, or with errors={} goes there
        (root hex -> error) and the others are listed."""
        validate_name(ref)
        hist = self.reftable.history(ref)
        if hist is None:
            raise RefNotFound(f"no ref named {ref!r}")
        out = []
        for root, row in hist:
            if isinstance(row, FormatError):
                if errors is None:
                    raise row
                errors[root.hex()] = row
                continue
            out.append(row_to_info(root, row))
        return out

    def _infos(self, named, errors: dict | None) -> dict[str, SnapshotInfo]:
        out = {}
        for name, root in named:
            try:
                out[name] = self._info(root)
            except (FormatError, IntegrityError) as e:
                if errors is None:
                    if isinstance(e, FormatError):
                        raise FormatError(f"{name!r}: {e}") from None
                    raise
                errors[name] = e  # one odd snapshot: the others are still listed
        return out

    @_public
    def refs(self, prefix: str = "", *, errors: dict | None = None) -> dict[str, SnapshotInfo]:
        """name -> SnapshotInfo of every ref (under `prefix`). A ref whose snapshot cannot
        be described (catalog row and commit both unreadable) raises FormatError (or
        IntegrityError), or with
        errors={} goes there (name -> error) and the others are listed."""
        if not isinstance(prefix, str):
            raise InvalidArgument(f"prefix must be a str, got {type(prefix).__name__}")
        _utf8(prefix, "ref prefix")
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
        single source of truth across hosts."""
        validate_new_name(name, "tag name")
        self._writable("tag")
        if len(name.encode()) > MAX_TAG_BYTES:  # stored as tags/<hex>: one file name of 2x the bytes
            raise InvalidName(f"tag name is longer than {MAX_TAG_BYTES} bytes")
        fence = self.publisher.fence()  # before the target is looked at (see _fenced)
        root = self._root(target)
        if self.reftable.get_or_none(name) is not None:
            raise RefConflict(name, None, self.reftable.get_or_none(name).hex(), what="tag (a ref has this name)")
        cur = self.reftable.tag_get(name)
        if cur is not None:
            raise RefConflict(name, None, cur.hex(), what="tag")
        stored = self.assets.put_tag(name, root, time.time())
        if stored is not None and stored != root:  # another tag by this name exists in storage
            raise RefConflict(name, None, stored.hex() if stored else None, what="tag")
        self.assets.sync()
        try:
            self._fenced(root, target, fence, lambda f: self.reftable.tag_create(name, root, fence=f))
        except OutcomeUnknown as e:
            # Its answer was lost: the row may be in or still landing, so the stored tag
            # stays (deleting it could leave a table tag that recover cannot rebuild).
            if self._landed(lambda: self.reftable.tag_get(name) == root):
                return self._info(root)
            raise OutcomeUnknown(f"{e}; tag {name!r} of {root.hex()[:16]} may or may not have been created: check "
                                 "`tsck tags` before creating it again", root=root, ref=name) from None
        except BaseException:
            # Ours, and the table refused it (gone snapshot, full disk): the name stays free,
            # and recover cannot bring back a tag the caller was told failed.
            if stored is None and not self._tag_in_table(name, root):
                self.assets.delete_tag(name)
            raise
        try:
            return self._info(root)
        except StorageError:
            # The tag is made; the table went away after: describe the snapshot from its
            # commit object rather than report a failure for a tag that exists.
            c = decode_commit(self.assets.get_commit(root))
            return row_to_info(root, {**c, **c["stats"]})

    @staticmethod
    def _landed(check) -> bool:
        """After a write whose answer was lost: does the table now show it? False when
        it does not or cannot be asked."""
        try:
            return bool(check())
        except TsckError:
            return False

    def _tag_in_table(self, name: str, root: bytes) -> bool:
        """Whether the table holds the tag after a failed create (a lost acknowledgement
        may hide a commit); when it cannot tell, say yes: the stored tag is kept."""
        try:
            return self.reftable.tag_get(name) == root
        except Exception:  # noqa: BLE001 - the table is failing: keep what is stored
            return True

    def _fenced(self, root: bytes, target: str, fence: int, make) -> None:
        """Make a tag or pin of `root`, fenced against gc like a ref move: the row goes in
        only while the deletion epoch is still the one read before `root` was resolved.
        If a deletion phase overlapped, wait it out and go on only if the snapshot is
        still kept (catalog row, commit object); else it is gone: RefNotFound."""
        while True:
            try:
                return make(fence)
            except Fenced:
                fence = self.publisher.wait_gc_idle()
                kept = self.reftable.catalog_has(root) or root in {r for _, r in self.reftable.list()}
                if not kept or not self.assets.has_commit(root):
                    raise RefNotFound(f"snapshot {root.hex()[:16]} ({target!r}) was removed by a gc that ran "
                                      "meanwhile; nothing was created") from None

    @_public
    def recover(self, *, progress: bool = False, wait: float = 0.0):
        """Rebuild catalog, refs (at their newest commits), reflog and tags from storage.
        Until a recover finishes, gc and prune refuse (RebuildUnfinished). GcBusy if a gc
        holds the store for more than `wait` seconds."""
        from .recover import run_recover
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < 1e7:
            raise InvalidArgument(f"recover wait must be a number of seconds >= 0, got {wait!r}")
        self._writable("recover")
        return run_recover(self.core, progress=progress, wait=wait)

    @_public
    def diff(self, a: str, b: str) -> dict:
        """Which tensors differ between two targets, and in how many blocks."""
        from .walk import iter_leaves
        ra, rb = self._root(a), self._root(b)
        la = iter_leaves(self.assets, ra, verify=self.verify)
        lb = iter_leaves(self.assets, rb, verify=self.verify)
        out = {"a": ra.hex(), "b": rb.hex(), "added": [], "removed": [], "changed": [], "unchanged": 0}
        for p in la.keys() - lb.keys():
            out["removed"].append(p)
        for p in lb.keys() - la.keys():
            out["added"].append(p)
        for p in la.keys() & lb.keys():
            (da, ba), (db, bb) = la[p], lb[p]
            if da == db and ba == bb:
                out["unchanged"] += 1
                continue
            differ = sum(1 for x, y in zip(ba, bb) if x != y) + abs(len(ba) - len(bb))
            out["changed"].append({"path": p, "a": da, "b": db, "blocks_differ": differ,
                                   "blocks": max(len(ba), len(bb))})
        for k in ("added", "removed"):
            out[k].sort()
        out["changed"].sort(key=lambda x: x["path"])
        return out

    @_public
    def pin(self, target: str) -> str:
        self._writable("pin")
        fence = self.publisher.fence()
        root = self._root(target)
        try:
            self._fenced(root, target, fence, lambda f: self.reftable.pin(root, fence=f))
        except OutcomeUnknown as e:
            if not self._landed(lambda: root in self.reftable.pins()):
                raise OutcomeUnknown(f"{e}; the pin of {root.hex()[:16]} may or may not have been made",
                                     root=root) from None
        return root.hex()

    @_public
    def unpin(self, target: str) -> str:
        self._writable("unpin")
        root = self._root(target)
        self.reftable.unpin(root)
        return root.hex()

    @_public
    def delete_ref(self, ref: str, *, expected: str | None = None) -> dict:
        """Remove ref `ref` (RefConflict if `expected`, a root's hex or prefix, no longer
        names what it points at; RefNotFound if there is no such ref). Its reflog keeps a
        record of the removal; the snapshots of its history that nothing else keeps (another
        ref, a tag, a pin) leave the catalog in the same transaction, so the next gc or
        prune reclaims their objects. The name may be used again by a later put.
        -> {"ref", "root", "snapshots_dropped"}."""
        validate_name(ref)
        self._writable("delete_ref")
        want = None
        if expected is not None:
            if not is_hex_prefix(expected):
                raise InvalidArgument(f"expected must be a root: {MIN_PREFIX} to 64 lowercase hex digits, "
                                      f"got {expected!r}")
            actual = self.reftable.get(ref)
            if not actual.hex().startswith(expected):
                raise RefConflict(ref, expected, actual.hex())
            want = actual  # the transaction deletes only if the ref still points exactly here
        root, dropped = self.reftable.delete_ref(ref, want)
        return {"ref": ref, "root": root.hex(), "snapshots_dropped": dropped}

    @_public
    def untag(self, name: str) -> str:
        """Remove tag `name` (RefNotFound if there is none); -> the root it named. Its
        storage object goes first, so recover cannot bring it back after a crash here."""
        validate_name(name, "tag name")
        self._writable("untag")
        root = self.reftable.tag_get(name)
        if root is None:
            raise RefNotFound(f"no tag named {name!r}")
        saved = self.assets.tag_object(name)
        self.assets.delete_tag(name)
        self.assets.sync()
        try:
            self.reftable.tag_delete(name)
        except BaseException:
            # The table kept the tag (its disk full, its server away): put its object back,
            # so the tag is whole again and recover still knows it.
            if saved is not None and self._tag_in_table(name, root):
                self.assets.restore_tag(name, saved)
                self.assets.sync()
            raise
        return root.hex()

    @_public
    def forget(self, target: str) -> SnapshotInfo:
        """Drop one snapshot (REF@STEP, or a root) from the catalog so gc reclaims what
        only it holds; recorded in its ref's reflog. Refused (InvalidArgument) while it is
        a ref's tip, a tag's target or pinned. -> what it was."""
        self._writable("forget")
        root = self._root(target)
        info = self._info(root)
        self.reftable.forget(root, info.ref)
        return info

    @_public
    def du(self) -> dict:
        """Logical bytes (what the kept snapshots hold) vs physical (what storage holds)."""
        jobs: dict[str, dict] = {}
        logical = 0
        bad: list = []
        for root, row in self.reftable.catalog_iter(bad=bad):
            info = row_to_info(root, row)
            j = jobs.setdefault(info.job, {"snapshots": 0, "logical_bytes": 0, "new_bytes": 0,
                                           "latest_step": None, "latest_time": 0.0})
            j["snapshots"] += 1
            j["logical_bytes"] += info.bytes_total
            j["new_bytes"] += info.bytes_new
            if info.time >= j["latest_time"]:
                j["latest_time"], j["latest_step"] = info.time, info.step
            logical += info.bytes_total
        phys = self.assets.object_stats()
        physical = sum(v[1] for v in phys.values())
        return {
            "store": self.url, "snapshots": sum(j["snapshots"] for j in jobs.values()),
            "logical_bytes": logical, "physical_bytes": physical,
            "block_bytes": phys["blocks"][1], "blocks": phys["blocks"][0],
            "nodes": phys["nodes"][0], "commits": phys["commits"][0],
            "malformed_rows": [r.hex() for r, _e in bad],  # catalog rows left out (tsck fsck names them)
            "dedup_ratio": (logical / phys["blocks"][1]) if phys["blocks"][1] else None,
            "jobs": jobs,
        }


