"""A training job's retention, applied while it trains: store.prune(job) on a thread
of its own (or on the store's background publisher, between a collective job's
snapshots), so the job's storage stays bounded by its rules without stalling the
training step, and a busy store delays the prune without losing it.

CheckpointManager (train.py) and the Hugging Face callback (hf.py) each run one.
"""

from __future__ import annotations

import logging
import random
import threading
import time

from ..errors import GcBusy, TsckError

__all__ = ["Pruner"]

log = logging.getLogger(__name__)


class Pruner:
    """store.prune(job) on a thread of its own. Requests that arrive while a prune runs
    fold into one more run. A prune that finds the gc lock taken (an offline gc,
    another job's prune) queues its job in the ref table (RefTable.prune_request: the
    prune or gc that holds the lock applies this job's rules too) and tries again,
    with a short backoff, until it runs or its request was served; never dropped. One
    that cannot run for PATIENCE seconds is reported (a warning, and a GcBusy in
    prune_errors) and still tried in the background while the manager is open;
    wait() and close() stop waiting for it then (its request stays queued in the
    store for the next prune or gc of any job)."""

    PATIENCE = 60.0                      # seconds of a busy store before a prune is reported
    BACKOFF, BACKOFF_MAX = 0.05, 2.0     # first pause between two tries, and the longest
    AFTER_PATIENCE = 1.0                 # a collective job's prune on the background publisher
    KEEP_ERRORS = 16

    def __init__(self, store, job: str):
        self.store, self.job = store, job
        self._cv = threading.Condition()
        self._wanted = self._busy = self._closed = self._closing = self._deferred = False
        self._owed = False  # a collective job's prune left queued in the store (run_after)
        self._thread: threading.Thread | None = None
        self.last = None
        self.runs = 0
        self.served = 0  # prunes another job's prune (or a gc) applied for this job
        self.errors: list = []

    def after(self, fut) -> None:  # done-callback of an async snapshot: only committed ones prune
        if not fut.cancelled() and fut.failure() is None:  # not a retrieval: close() still reports it
            self.request()

    def run_after(self, fut) -> None:
        """On the store's background publisher, once fut's snapshot has ended: prune here,
        now, if it was committed (between this job's collective snapshots, in their order).
        A busy store is waited for AFTER_PATIENCE at most (the job's next snapshot is
        queued behind this); then the prune stays queued in the store and close(), or
        the next snapshot's prune, sees to it."""
        if fut.cancelled() or fut.failure() is not None:
            return
        with self._cv:
            if self._closed:
                return
            self._busy = True
        try:
            self._owed = not self._prune_once(self.AFTER_PATIENCE, report=False)
        finally:
            with self._cv:
                self._busy = False
                self._cv.notify_all()

    def request(self) -> None:
        with self._cv:
            if self._closed:
                return
            self._wanted = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"tsck-prune-{self.job}", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._wanted and not self._closed:
                    self._cv.wait()
                if not self._wanted:
                    return
                self._wanted, self._busy, self._deferred = False, True, False
            try:
                self._prune_once(self.PATIENCE)
            finally:
                with self._cv:
                    self._busy = self._deferred = False
                    self._cv.notify_all()

    def _error(self, e: BaseException) -> None:
        self.errors = (self.errors + [e])[-self.KEEP_ERRORS:]

    def _prune_once(self, patience: float, report: bool = True) -> bool:
        """Prune until it ran or another's prune served this job's queued request ->
        True; False: gave up (an error; or the store stayed busy past `patience` without
        report=True, or the manager is closing after that was reported)."""
        token = None
        t0 = time.monotonic()
        delay = self.BACKOFF
        while True:
            try:
                self.last = self.store.prune(self.job)
                self.runs += 1
                return True
            except GcBusy as e:
                busy = e
            except TsckError as e:
                log.warning("prune %s failed: %s: %s (the next snapshot tries again; `tsck gc` reclaims "
                            "anything left)", self.job, type(e).__name__, e)
                self._error(e)
                return False
            except Exception as e:  # noqa: BLE001 - a bug must not kill training; it is logged and kept
                log.exception("prune %s failed unexpectedly", self.job)
                self._error(e)
                return False
            try:
                if token is None:  # whoever holds the lock now, or takes it next, serves this job too
                    token = self.store.core.refs.prune_request(self.job)
                elif not self.store.core.refs.prune_pending(self.job, token):
                    self.served += 1
                    log.debug("prune %s: applied by another job's prune or a gc", self.job)
                    return True
            except TsckError as e:
                log.warning("prune %s: could not queue it in the store: %s: %s (the next snapshot tries again)",
                            self.job, type(e).__name__, e)
                self._error(e)
                return False
            waited = time.monotonic() - t0
            if waited >= patience:
                if not report:
                    log.debug("prune %s: the store stayed busy for %.1fs (%s); it stays queued", self.job, waited,
                              busy)
                    return False
                with self._cv:
                    if not self._deferred:
                        self._deferred = True  # wait() and close() stop waiting for it
                        self._cv.notify_all()
                        log.warning("prune %s could not take the store's gc lock for %.0fs (%s); it stays queued "
                                    "in the store (the next prune of any job, or `tsck gc`, applies this job's "
                                    "retention) and is tried again while the manager is open", self.job, waited,
                                    busy)
                        self._error(GcBusy(f"prune of job {self.job!r} could not run for {waited:.0f}s: {busy}; "
                                           "it stays queued in the store"))
                    if self._closing:
                        return False
            log.debug("prune %s: the store's gc lock is taken (%s); trying again", self.job, busy)
            with self._cv:  # jittered, so jobs that lost together do not retry together
                self._cv.wait_for(lambda: self._closing and self._deferred, delay * random.uniform(0.5, 1.5))
            delay = min(self.BACKOFF_MAX, delay * 2)

    def backlog(self) -> int:
        """Prunes asked for and not done yet: one running, one asked for after it, one left
        queued in the store (deferred past PATIENCE, or a collective job's owed one)."""
        with self._cv:
            return int(self._busy) + int(self._wanted) + int((self._deferred or self._owed) and not self._busy)

    def wait(self) -> None:
        """Until no prune is asked for or running, or the one running was reported as
        deferred (the store stayed busy past PATIENCE)."""
        with self._cv:
            while (self._wanted or self._busy) and not self._deferred:
                self._cv.wait()

    def close(self) -> None:
        if self._owed:  # a collective job's last prune was left queued: see it through (or report it)
            self.request()
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self.wait()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            t = self._thread
        if t is not None:
            t.join()
