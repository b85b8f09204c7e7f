"""What an operator watches of a CheckpointManager: the on_commit hook's CommitEvent, the
store's size measured off the training thread, on_durable, the log lines of commits."""

from __future__ import annotations

import logging
import numbers
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from ..errors import InvalidArgument, InvalidName, TsckError, UnsupportedType

__all__ = ["CommitEvent"]

# The records keep the one name of the training helpers, whichever part logs.
log = logging.getLogger(__package__)


@dataclass(frozen=True)
class CommitEvent:
    """What CheckpointManager(on_commit=) hands its hook once a snapshot of the job is
    committed: the numbers an operator watches (export them to a metrics system, a
    dashboard, an alert on `since_last` or `failures`)."""
    ref: str
    step: int | None
    root: str
    since_last: float | None  # seconds since the job's previous committed snapshot (commit times); None: the first
    seconds: float | None     # the put's duration, call to commit (SnapshotInfo.seconds)
    stall: float | None       # of which the training step was blocked (SnapshotInfo.stall)
    bytes_total: int
    bytes_new: int            # what this snapshot added to the store (uncompressed)
    failures: int             # snapshots of this manager that failed so far
    skipped: int              # asynchronous snapshots the store skipped so far (when_busy="skip")
    prune_backlog: int        # the job's earlier prunes not done yet (Pruner.backlog; not this commit's own)
    # The store's physical size in bytes (`tsck du`'s "physical": every stored commit, node
    # and block) as last measured off the training thread (CheckpointManager(store_size_every=));
    # None until first measured. With a local tier: the remote store's (the one at the URL).
    store_size: int | None
    store_size_at: float | None  # when that listing began (time.time()): what committed before it is counted
    local_size: int | None    # with a local tier, the tier's physical size measured alongside; None without one
    info: object              # the SnapshotInfo


def _as_hooks(on_commit) -> tuple:
    """CheckpointManager(on_commit=): None, a callable, or a list or tuple of callables
    (each called in turn, each failure its own) -> the callables."""
    hooks = tuple(on_commit) if isinstance(on_commit, (list, tuple)) else () if on_commit is None else (on_commit,)
    for h in hooks:
        if not callable(h):
            raise InvalidArgument(f"on_commit must be a callable taking a CommitEvent, or a list of them, got "
                                  f"{type(h).__name__}")
    return hooks


class _StoreSize:
    """The store's physical size (what `tsck du` prints as physical), measured by listing
    its commits, nodes and blocks on a thread of its own, at most once every `every`
    seconds (0: after every request), when asked (after a commit): a listing (on S3, one
    LIST request per 1000 objects) never runs on the training thread nor on the store's
    publisher, so neither a snapshot nor the on_commit hook ever waits for one. known()
    is the last measurement; a failed listing is logged and keeps the one before."""

    def __init__(self, store, every: float):
        self.store, self.every = store, every
        self._cv = threading.Condition()
        self._busy = self._again = self._closed = False
        self._started: float | None = None  # time.monotonic() of the last listing's start
        self._known: tuple[int | None, float | None, int | None] = (None, None, None)

    def known(self) -> tuple[int | None, float | None, int | None]:
        """(store_size, store_size_at, local_size) of the last listing that ended."""
        with self._cv:
            return self._known

    def request(self) -> None:
        with self._cv:
            if self._closed:
                return
            if self._busy:  # a commit during the listing: one more after it, if due by then
                self._again = True
                return
            if self._started is not None and time.monotonic() - self._started < self.every:
                return
            self._busy = True
            self._started = time.monotonic()
        threading.Thread(target=self._run, name="tsck-store-size", daemon=True).start()

    def _measure(self) -> tuple[int, float, int | None]:
        at = time.time()
        remote = self.store.remote_core
        if remote is None:
            return _physical(self.store.core), at, None
        return _physical(remote), at, _physical(self.store.core)

    def _run(self) -> None:
        while True:
            try:
                got = self._measure()
            except Exception as e:  # noqa: BLE001 - a size for a dashboard must never stop training
                log.warning("the store's size could not be measured: %s: %s (the last known one is kept)",
                            type(e).__name__, e)
                got = None
            with self._cv:
                if got is not None:
                    self._known = got
                if self._again and not self._closed and time.monotonic() - self._started >= self.every:
                    self._again = False
                    self._started = time.monotonic()
                    continue
                self._busy = self._again = False
                self._cv.notify_all()
                return

    def wait(self) -> None:
        """Until no listing runs."""
        with self._cv:
            self._cv.wait_for(lambda: not self._busy)

    def close(self) -> None:
        with self._cv:
            self._closed = True
        self.wait()


def _physical(core) -> int:
    """Bytes of every stored commit, node and block (one listing of each kind)."""
    return sum(b for _n, b in core.assets.object_stats().values())


class Watching:
    """CheckpointManager's on_commit and on_durable hooks and the puts of one process
    watched to their commit (mixed into CheckpointManager, manager.py: the attributes are
    its own, set by its __init__)."""

    def _init_watch(self, on_commit, store_size_every) -> None:
        hooks = _as_hooks(on_commit)
        if store_size_every is not None and (isinstance(store_size_every, bool)
                                             or not isinstance(store_size_every, numbers.Real)
                                             or not store_size_every >= 0):
            raise InvalidArgument(f"store_size_every must be a number of seconds >= 0 or None, "
                                  f"got {store_size_every!r}")
        # Only a hook reads the size; under torch.distributed only rank 0 lists the store.
        self._size = (_StoreSize(self.store, float(store_size_every))
                      if hooks and store_size_every is not None
                      and (not self._collective() or self._rank() == 0) else None)
        if self._size is not None:
            self._size.request()
        self.on_commit = on_commit
        self._hooks = hooks
        self._init_durable(hooks)
        self._local_failures = 0   # this process's own failed snapshots (a collective one: failed_snapshots)
        self._last_commit: float | None = None  # commit time of the job's newest committed snapshot
        self._last_seconds: float | None = None  # how long that snapshot took, asked for to committed
        self._watch_lock = threading.Condition()
        self._callbacks = 0  # done-callbacks of asynchronous snapshots not run yet (wait() waits for them)

    def _track(self, fut, callback) -> None:
        """fut.add_done_callback(callback), counted until it ran: a future's waiters wake
        before its callbacks run, so wait() and close() wait for these too (the hook has
        seen every snapshot they waited for)."""
        with self._watch_lock:
            self._callbacks += 1

        def run(f):
            try:
                callback(f)
            finally:
                with self._watch_lock:
                    self._callbacks -= 1
                    self._watch_lock.notify_all()
        fut.add_done_callback(run)

    def _wait_callbacks(self) -> None:
        with self._watch_lock:
            self._watch_lock.wait_for(lambda: self._callbacks == 0)

    def _watched(self, put, step):
        """A put of this process alone: its commit (now, or when its future completes) goes
        to _committed; a failure is counted and warned, and raised when it is a TsckError
        or an OSError (the store's failures, as documented). Any other exception is a bug
        in a snapshot, never a reason to stop training: reported, and step() returns None."""
        try:
            res = put()
        except (InvalidArgument, UnsupportedType, InvalidName):
            raise
        except Exception as e:
            with self._watch_lock:
                self._local_failures += 1
            self._failure(e, step)
            if isinstance(e, (TsckError, OSError)):
                raise
            log.error("CheckpointManager %s: the snapshot of step %s failed unexpectedly", self.job, step,
                      exc_info=e)
            return None
        if res is None:
            pass  # skipped (when_busy="skip"): the store logged it
        elif hasattr(res, "add_done_callback"):
            self._track(res, lambda fut: self._async_done(fut, step))
        else:
            self._committed(res)
        return res

    def _async_done(self, fut, step) -> None:
        if fut.cancelled():
            return
        if fut.failure() is not None:  # (the store logged it; it is raised by the next step())
            with self._watch_lock:
                self._local_failures += 1
            self._failure(fut.failure(), step)
            return
        self._committed(Future.result(fut, 0))  # (not a retrieval: close() still reports failures)

    def _committed(self, info) -> None:
        """One committed snapshot: the hook, if any, gets its CommitEvent."""
        if info is None:
            return
        self._outcome_ok(info.step)
        with self._watch_lock:
            last, self._last_commit = self._last_commit, max(info.time, self._last_commit or info.time)
            # Asked for to committed, the wait for earlier snapshots included: what a
            # preemption's save compares with the grace left.
            began = self._began.pop(info.step, None)
            if began is not None:
                self._last_seconds = time.monotonic() - began
        if not self._hooks:
            return
        try:
            if last is None and info.parent is not None:
                try:  # the first of this manager: since the ref's previous snapshot (one catalog read)
                    last = self.store.show(info.parent).time
                except TsckError:
                    last = None
            ev = CommitEvent(ref=info.ref, step=info.step, root=info.root,
                             since_last=None if last is None else max(0.0, info.time - last),
                             seconds=info.seconds, stall=info.stall, bytes_total=info.bytes_total,
                             bytes_new=info.bytes_new, failures=self.failed_snapshots + self._local_failures,
                             skipped=self.store.skipped,
                             prune_backlog=0 if self._pruner is None else self._pruner.backlog(),
                             **self._sizes(), info=info)
        except Exception:  # noqa: BLE001 - an operator's hook must never stop training
            log.warning("CheckpointManager %s: the commit event of step %s could not be made", self.job, info.step,
                        exc_info=True)
            return
        for hook in self._hooks:
            try:
                hook(ev)
            except Exception:  # noqa: BLE001 - an operator's hook must never stop training
                log.warning("CheckpointManager %s: on_commit hook failed for step %s", self.job, info.step,
                            exc_info=True)

    def _init_durable(self, hooks) -> None:
        """With a local tier, each hook's on_durable(DurableEvent), if it has one, for the
        manager's snapshots once durable (Store.on_durable, on the uploader's thread). The
        listener stays until the store closes: the store's close() uploads what is still
        queued, after the manager's close()."""
        durable = [h.on_durable for h in hooks if callable(getattr(h, "on_durable", None))]
        if not durable or getattr(self.store, "remote_core", None) is None:
            return
        ref, job = self.ref, self.job

        def heard(ev) -> None:
            if ev.ref != ref:
                return
            for fn in durable:
                try:
                    fn(ev)
                except Exception:  # noqa: BLE001 - an operator's hook must never stop the uploads
                    log.warning("CheckpointManager %s: on_durable hook failed for step %s", job, ev.step,
                                exc_info=True)
        self.store.on_durable(heard)

    def _sizes(self) -> dict:
        """The event's store_size fields: the last measurement (a new one is asked for, to
        run off this thread; the hook never waits for it)."""
        if self._size is None:
            return {"store_size": None, "store_size_at": None, "local_size": None}
        size, at, local = self._size.known()
        self._size.request()
        return {"store_size": size, "store_size_at": at, "local_size": local}
