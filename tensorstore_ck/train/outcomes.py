"""How a CheckpointManager's snapshots ended: each failure warned once per kind and
counted, an answer lost on a ref move told apart from a failure, and the CloseReport."""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass

from ..errors import InvalidArgument, InvalidName, OutcomeUnknown, SnapshotWarning, TsckError, UnsupportedType
from .pruner import Pruner

__all__ = ["CloseReport"]

# The records keep the one name of the training helpers, whichever part logs.
log = logging.getLogger(__package__)


def caller_level() -> int:
    """warnings.warn's stacklevel naming the first frame outside the tensorstore_ck package
    (the training script's step() or close() line; on a background thread, the thread's
    own start)."""
    import os
    import sys
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (this file is in its train/)
    f, level = sys._getframe(1), 1
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(pkg + os.sep):
        f, level = f.f_back, level + 1
    return level


@dataclass(frozen=True)
class CloseReport:
    """What CheckpointManager.close() returns, and SnapshotsFailed carries: how the run's
    snapshots ended. ok: the newest snapshot the manager attempted is committed (or none
    was attempted), so a resume loses no step since it."""
    attempted: int                    # snapshots the manager started (a skipped one is not counted)
    committed: int
    failed: int
    last_attempted_step: int | None
    last_committed_step: int | None   # the newest this manager committed (None: none)
    newest_committed: bool            # the newest attempted snapshot ended committed
    errors: tuple                     # the newest failures' errors (at most 16), oldest first
    durability: object = None         # with a local tier: how far the remote is behind (tier.outage.Lag)

    @property
    def ok(self) -> bool:
        return self.attempted == 0 or self.newest_committed


class Outcomes:
    """CheckpointManager's record of how its snapshots ended (mixed into it,
    manager.py: the attributes are its own, set by its __init__)."""

    def _attempt(self, step) -> int:
        with self._failures_lock:
            self._attempted += 1
            self._prev_attempted_step, self._last_attempted_step = self._last_attempted_step, step
            self._began[step] = time.monotonic()  # (its commit measures the snapshot's wall time from here)
            if len(self._began) > 64:  # failed ones never commit: the oldest goes
                self._began.pop(next(iter(self._began)))
            return self._attempted

    def _unattempt(self, n: int) -> None:
        with self._failures_lock:
            if n == self._attempted:
                self._attempted -= 1
                self._last_attempted_step = self._prev_attempted_step

    def _outcome_ok(self, step) -> None:
        with self._failures_lock:
            self._newest_ok = True
            self._committed_n += 1
            self._last_committed_step = step

    def _failure(self, e: BaseException, step) -> None:
        """A snapshot that could not be taken: a SnapshotWarning (shown by default, without
        any logging set up) for the first of each kind, the rest counted."""
        kind = type(e).__name__
        with self._failures_lock:
            self._newest_ok = False
            n = self._warned[kind] = self._warned.get(kind, 0) + 1
            self._errors = (self._errors + [e])[-Pruner.KEEP_ERRORS:]
        if n == 1:
            warnings.warn(f"CheckpointManager {self.job}: the snapshot of step {step} could not be taken: {kind}: "
                          f"{e} (training goes on; later failures of this kind are counted, not shown: "
                          "close() reports them)", SnapshotWarning, stacklevel=caller_level())

    def _count_failure(self, e: BaseException, step) -> None:
        with self._failures_lock:
            self.failed_snapshots += 1
            self.snapshot_errors = (self.snapshot_errors + [e])[-Pruner.KEEP_ERRORS:]
        self._failure(e, step)

    def report(self) -> CloseReport:
        """How the manager's snapshots ended so far (close() returns it once nothing is in flight)."""
        try:
            lag = self.store.durability_lag()
        except (TsckError, AttributeError):  # (a table that refused; a store-like object without tiers)
            lag = None
        with self._failures_lock:
            return CloseReport(attempted=self._attempted, committed=self._committed_n,
                               failed=sum(self._warned.values()), last_attempted_step=self._last_attempted_step,
                               last_committed_step=self._last_committed_step, newest_committed=self._newest_ok,
                               errors=tuple(self._errors), durability=lag)

    def _raise_pending(self) -> None:
        """The store's pending background failure, except an OutcomeUnknown whose
        snapshot the ref table now shows published: training goes on over it (raising
        would stop a run whose snapshot is committed, and a retry would publish it twice)."""
        try:
            self.store.raise_pending_error()
        except (InvalidArgument, UnsupportedType, InvalidName):
            raise
        except Exception as e:  # noqa: BLE001 - told apart below
            if not isinstance(e, OutcomeUnknown):
                if isinstance(e, (TsckError, OSError)):
                    raise
                return  # a bug in a snapshot: reported when its future failed (_async_done), never raised
            if e.root is None or not self._published(e.root, e.ref):
                raise
            with self._failures_lock:  # it did commit: the newest outcome is not a failure after all
                self._newest_ok = True
            log.warning("snapshot %s of ref %s: the answer to its ref move was lost, but the ref table shows it "
                        "published; going on", e.root.hex()[:16], e.ref)

    def _published(self, root: bytes, ref: str | None) -> bool:
        try:
            if ref is not None and self.store.resolve(ref) == root.hex():
                return True
            return self.store.core.refs.catalog_has(root)
        except TsckError:  # still cannot tell: the caller raises the OutcomeUnknown
            return False
