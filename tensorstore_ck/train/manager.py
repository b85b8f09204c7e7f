"""CheckpointManager: when to snapshot a TrainState, and its snapshots taken; its parts in
watch.py (hooks), outcomes.py (failures, CloseReport), collective.py (torch.distributed),
together.py (collective restores) and restoring.py (restores)."""

from __future__ import annotations

import numbers
import signal
import threading
import time
import warnings
from typing import Callable

import torch

from ..errors import InvalidArgument, SnapshotsFailed, SnapshotWarning
from ..maintain.retention import Retention
from .collective import Collective
from .continuous import DurableRoots
from .outcomes import CloseReport, caller_level, Outcomes
from .preempt import DEFAULT_GRACE, Preempted, PreemptSignals, preempt_options
from .pruner import Pruner
from .restoring import Resumed, Restoring
from .state import TrainState, as_state
from .together import Together
from .watch import Watching

__all__ = ["CheckpointManager"]


class CheckpointManager(Watching, Outcomes, Collective, Together, Restoring):
    """Decides when to snapshot a TrainState and snapshots it (asynchronously by default).

    state=: a TrainState, or a dict {name: object with state_dict()/load_state_dict(), or
    tensor} as DCP takes (TrainState.from_dict); anything else is refused here, with
    InvalidArgument naming the key. A snapshot taken by step(n) holds the state after
    training step n, so restore_latest() returns n and training resumes at n + 1.
    Asynchronous by default (async_=True, as hf.TsckCallback): the state is staged (copied)
    before step() returns, so the steps that follow cannot change what is stored, and the
    put runs on the store's publisher; a failure is raised at the next step() or close().

    What the ref holds is read from the store, never from the manager's memory (a manager
    made in a new process sees what another wrote): all_steps() lists the steps of its kept
    snapshots, latest_step() is the step restore_latest() would resume at, and
    restore(step) loads the snapshot at that step as restore_latest() loads the newest.
    Rolling back is supported: after restore(10) with steps up to 30 kept, step(11), ...
    publish on the ref as usual (the newest of them is what restore_latest() and
    latest_step() then return), taking the abandoned run's steps again without a
    StepReusedWarning. restore() moves the ref back to the restored snapshot (a move in
    its reflog) and deletes nothing, so a crash before the new run's first snapshot
    resumes there; the abandoned run's snapshots stay for as long as the job's retention
    rules keep them, each by its own publication order, step, metric and age (keep_last
    counts publication order, so they are the first to go as the new run publishes).
    See restore().

    Triggers (any one fires a snapshot):
      every_steps=N      when step % N == 0
      every_seconds=T    when clock() - time of the last snapshot (or of the start) >= T
      on_metric=(name, "min"|"max")  when metrics[name] improves on the best seen (the first value counts)
      continuous=True    as soon as the previous snapshot is durable (committed; with a
                         local tier, uploaded: its remote ref moved; one that failed
                         counts as ended) and min_interval= seconds (default 0) passed
                         since it started (or since the start): the smallest loss a
                         failure can cost on this store (docs/guide/goodput.md). It
                         is checked at step(), never waited for: step() does not block.
    The job's retention rules are set in the store when given, and applied as the
    job trains (prune=True, the default with retention): after each committed
    snapshot a thread of the manager's own expires what the rules drop and deletes
    what only those snapshots held (store.prune: gc's protocol for one job, safe
    beside other writers and `tsck gc`), so the job's storage stays bounded by its
    rules without stalling the training step. A prune that finds the store busy
    (another job's prune, an offline gc) is queued in the store and retried until it
    runs or another job's prune serves it (many jobs on one store each keep their
    rules); one that cannot run for Pruner.PATIENCE (pruner.py) seconds, or fails, is logged as
    a warning (logger tensorstore_ck) and kept in `prune_errors`. Jobs in one store
    keep independent policies (each manager has its own job and ref).

    Under torch.distributed (initialised, world size > 1, or a group= given; group=False:
    this process alone) every rank constructs the manager the same way and calls
    step() with the same step numbers; the snapshots are collective (one commit
    covers every rank's state):
    - They are asynchronous by default as for one process (async_=False: blocking):
      each rank's state is staged, the collective put runs on the store's background
      publisher, and step() returns its future.
    - Every rank decides alike: rank 0's decision (its step number, its clock, the
      metric value rank 0 passes, its force=) and whether any rank was preempted reach
      the group once per step() (one all-reduce of 16 bytes, the only collective the
      policy adds), so a rank-local clock, a rank-local loss, a force=True or a signal on
      one rank alone cannot make ranks disagree. timeout= is each collective snapshot's
      deadline (put_snapshot's).
    - Prune runs on rank 0 only, between snapshots: asynchronous, rank 0 queues it on
      the store's background publisher behind the snapshot (training waits for
      neither); blocking, rank 0's next snapshot waits for it. The job's prune never
      overlaps its own snapshots.
    - A snapshot that cannot be taken (SnapshotAborted: a rank died or stalled, or could not
      re-upload its part after a gc deletion phase; a storage error; any exception of a
      snapshot, a bug's included) is logged as a warning and counted in
      `failed_snapshots` (the error in `snapshot_errors`),
      never raised out of step() (an asynchronous one is reported when its future
      completes): training goes on, and the next policy point takes one (a failed
      metric snapshot leaves the best value where it was). Errors that are the
      caller's own (InvalidArgument, UnsupportedType) are raised.
    - restore_latest() is collective: rank 0 resolves the ref's newest snapshot, every
      rank reads its own part of that one snapshot, and the ranks agree on how their
      reads went (one all-reduce): every rank resumes at the same step, or raises the
      same error. A snapshot some rank cannot read whole (a damaged or missing object
      of its part) is passed over on every rank for the next older kept one, with a
      SnapshotWarning; restore(step) reads that step on every rank or on none.
    - A rank whose state_dict() raises still makes the collective put, only to abort it
      on every rank at once: that snapshot is lost (reported on every rank), and no
      rank waits for the deadline.
    - close() (and wait()) waits on every rank for the snapshots in flight and, on
      rank 0, for the prune.
    For one process, a failed background snapshot is raised by the next step() (or
    close()) when it is the store's (a TsckError or OSError); any other exception of a
    snapshot is reported, never raised into training.
    Every failed snapshot is also a SnapshotWarning (shown by default, with no logging
    set up), the first of each kind; close() returns a CloseReport, and raises
    SnapshotsFailed when the newest snapshot attempted was not committed.

    Preemption: the manager catches SIGTERM (and the signals in preempt_signals=, e.g.
    (signal.SIGTERM, signal.SIGUSR1) for Slurm's `--signal=USR1@60`; () catches none),
    calling the handler the program had installed too. The next step() (on every rank
    at once: one rank's signal is enough) saves that step, blocking, into the store (its
    local tier when it has one), waits for its upload for what is left of preempt_grace=
    seconds (default 20, below the shortest notice common platforms give), and raises
    Preempted: a SystemExit whose status is 128 + the signal's number (143), which
    torchrun, Slurm and Kubernetes count as a failure to restart or requeue. With
    on_preempt="return" step() returns the snapshot and sets `preempted` instead. A
    snapshot is whole or absent: one the grace cannot hold fails (a collective one by its
    deadline) and Preempted says so. No step() within the grace (where the signal's own
    action was to end the process): the process ends then, as the signal would have.

    on_commit=fn: fn(CommitEvent) after each committed snapshot of the manager (on the
    store's background thread for an asynchronous one; on every rank of a collective
    one; wait() and close() return once it ran). A list of callables calls each in turn
    (tsck.metrics' TensorBoardMetrics and PrometheusMetrics are such callables). An
    exception in fn is logged, never raised into training, and the next fn still runs;
    fn must not call the manager's wait() or close(). With a local tier a hook that has
    an on_durable(DurableEvent) method also hears when each of the manager's snapshots
    became durable (Store.on_durable: on the uploader's thread, until the store closes;
    rank 0's under torch.distributed). The event's
    store_size is the store's physical size (`tsck du`'s) as last measured, with
    store_size_at, when: a listing of the store on a thread of the manager's own, never the
    training thread or the hook's, asked for after a commit and run at most once every
    store_size_every seconds (default 300: a listing of a large S3 store is many LIST
    requests; 0: after every commit; None: never, store_size stays None); the first is
    asked for when the manager is made. With a local tier store_size is the remote
    store's and local_size the tier's. Under torch.distributed only rank 0 lists (the
    other ranks' events say None). Each commit is also
    logged at INFO (logger tensorstore_ck), each failed or skipped snapshot with why, and
    restore_latest as one INFO line (the ref, step and root it resumed from, and where it
    read them); its background prunes log at DEBUG. restore_latest(progress=True) shows
    the bytes read as a bar on stderr."""

    def __init__(self, store, *, job: str, state: TrainState | dict | None = None, ref: str | None = None,
                 every_steps: int | None = None, every_seconds: float | None = None,
                 on_metric: tuple | None = None, retention: Retention | None = None,
                 async_: bool = True, when_busy: str | None = None, clock: Callable[[], float] = time.monotonic,
                 prune: bool | None = None, group=None, on_commit: Callable | None = None,
                 store_size_every: float | None = 300.0, timeout: float | None = None,
                 preempt_signals=(signal.SIGTERM,), preempt_grace: float = DEFAULT_GRACE,
                 on_preempt: str = "raise", continuous: bool = False, min_interval: float = 0.0):
        if not isinstance(continuous, bool):
            raise InvalidArgument(f"continuous must be True or False (min_interval= bounds it), got {continuous!r}")
        if isinstance(min_interval, bool) or not isinstance(min_interval, numbers.Real) or not min_interval >= 0:
            raise InvalidArgument(f"min_interval must be a number of seconds >= 0, got {min_interval!r}")
        if min_interval and not continuous:
            raise InvalidArgument("min_interval= bounds the continuous trigger: give continuous=True with it "
                                  "(every_seconds= is the trigger by time alone)")
        if every_steps is not None and (type(every_steps) is not int or every_steps < 1):
            raise InvalidArgument(f"every_steps must be an int >= 1, got {every_steps!r}")
        if every_seconds is not None and not every_seconds > 0:
            raise InvalidArgument(f"every_seconds must be > 0, got {every_seconds!r}")
        if on_metric is not None and (not isinstance(on_metric, tuple) or len(on_metric) != 2
                                      or on_metric[1] not in ("min", "max")):
            raise InvalidArgument(f"on_metric must be (name, 'min'|'max'), got {on_metric!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)
                                    or not timeout > 0):
            raise InvalidArgument(f"timeout must be a number of seconds > 0 or None, got {timeout!r}")
        preempt_signals, preempt_grace = preempt_options(preempt_signals, preempt_grace)
        if on_preempt not in ("raise", "return"):
            raise InvalidArgument(f"on_preempt must be 'raise' or 'return', got {on_preempt!r}")
        self.timeout = timeout  # a collective snapshot's deadline (None: put_snapshot's default)
        self.on_preempt = on_preempt
        # Set once a preemption's final snapshot is done (on_preempt="return"; "raise" raises it).
        self.preempted: Preempted | None = None
        self.store = store
        self.job = job
        self.ref = ref or f"{job}/main"
        self.state = as_state(state)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.on_metric = on_metric
        self.continuous = continuous
        self.min_interval = float(min_interval)
        self.async_ = async_
        self.when_busy = when_busy
        self.clock = clock
        self.last_time = clock()
        self.last_step: int | None = None
        self.best: float | None = None
        self.last = None  # SnapshotInfo or Future of the last snapshot taken
        # After a restore: the run resumed from that snapshot, and the ref's kept snapshots
        # at later steps are a run it abandoned (a rollback); the snapshots that take their
        # steps again say so (put_snapshot(resumed_from=)). None: nothing abandoned.
        self._resumed: Resumed | None = None
        self.group = group  # None: the default process group when torch.distributed is initialised
        self.failed_snapshots = 0  # collective snapshots that could not be taken (reported, not raised)
        self.snapshot_errors: list = []  # their errors, the newest 16
        self._failures_lock = threading.Lock()  # asynchronous failures are counted from the background
        # How the run's snapshots ended (close() reports them). Outcomes arrive in the order
        # the snapshots were taken (the store's publisher runs them in order), so the last
        # outcome heard, once nothing is in flight, is the newest attempt's.
        self._attempted = 0
        self._began: dict = {}  # step -> when its snapshot was asked for (time.monotonic())
        self._committed_n = 0
        self._last_attempted_step: int | None = None
        self._last_committed_step: int | None = None
        self._prev_attempted_step: int | None = None
        self._newest_ok = True
        self._errors: list = []
        self._warned: dict[str, int] = {}  # failures by kind (the first of each is warned)
        if retention is not None:
            store.set_retention(job, retention)
        if prune is None:
            prune = retention is not None
        self._pruner = Pruner(store, job) if prune else None
        self._init_watch(on_commit, store_size_every)
        self._durable = DurableRoots(store, self.ref) if continuous else None
        # Last, once nothing above can refuse the arguments: a handler is process state.
        self._preempt = PreemptSignals(preempt_signals, preempt_grace)

    def reasons(self, step: int, metrics: dict | None = None) -> list[str]:
        """Which triggers fire at this step (does not change any state)."""
        out = []
        if step == self.last_step:
            return out
        if self.every_steps and step % self.every_steps == 0:
            out.append("steps")
        if self.every_seconds is not None and self.clock() - self.last_time >= self.every_seconds:
            out.append("seconds")
        if self.on_metric is not None and metrics and self.on_metric[0] in metrics:
            v = metrics[self.on_metric[0]]
            if v == v and (self.best is None or (v < self.best if self.on_metric[1] == "min" else v > self.best)):
                out.append("metric")
        if (self.continuous and self.clock() - self.last_time >= self.min_interval
                and self._durable.ended(self.last)):
            out.append("continuous")
        return out

    def step(self, step: int, metrics: dict | None = None, *, force: bool = False):
        """Call once per training step. Snapshots when a trigger fires (or force=True);
        returns the SnapshotInfo (blocking), a Future (async), or None. A failed
        background snapshot is raised here, at the next call (one whose ref move went
        unanswered is not, if the ref table now shows it published). Under
        torch.distributed a snapshot that cannot be taken is reported instead (a
        warning, `failed_snapshots`) and step() returns None (see the class)."""
        collective = self._collective()
        if not collective:
            self._raise_pending()
        preempted = self._preempt.seen
        why = self.reasons(step, metrics)
        best_before = self.best
        if self.on_metric is not None and metrics and self.on_metric[0] in metrics:
            v = metrics[self.on_metric[0]]
            if v == v and (self.best is None or (v < self.best if self.on_metric[1] == "min" else v > self.best)):
                self.best = v
        if collective:  # (force too: one rank's force alone would enter a call the others never make)
            why, force, preempted = self._rank0_decides(why, force, preempted)
        if preempted:
            return self._save_preempted(step, metrics, collective, best_before)
        if not why and not force:
            return None
        kw = self._put_args(step, metrics, why or ["forced"])
        attempt = self._attempt(step)
        if collective:
            res = self._collective_snapshot(kw, best_before)
        else:
            res = self._watched(lambda: self.store.put_snapshot(self.state.state_dict(), **kw,
                                                                blocking=not self.async_,
                                                                when_busy=self.when_busy, **self._local()), step)
            if res is None and attempt == self._attempted and self._newest_ok:
                self._unattempt(attempt)  # skipped (when_busy="skip"), not failed: no attempt
        if res is not None:
            self.last_time = self.clock()
            self.last_step = step
            self.last = res
            if self._pruner is not None and not collective:  # (a collective one: _collective_snapshot)
                if hasattr(res, "add_done_callback"):
                    res.add_done_callback(self._pruner.after)
                else:
                    self._pruner.request()
        return res

    def _put_args(self, step: int, metrics: dict | None, triggers: list[str]) -> dict:
        if self.state is None:
            raise InvalidArgument("CheckpointManager has no state= to snapshot")
        self.state.step = step
        metrics = {k: float(v.item()) if isinstance(v, torch.Tensor) and v.numel() == 1 else v
                   for k, v in (metrics or {}).items()}
        metrics = {k: v for k, v in metrics.items()
                   if isinstance(v, numbers.Real) and not isinstance(v, bool)}
        kw = dict(ref=self.ref, job=self.job, step=step, metrics=metrics, meta={"triggers": triggers})
        resumed = self._resuming(step)
        if resumed is not None:  # a step of the run a rollback abandoned, taken again on purpose
            kw["resumed_from"] = resumed.step
            kw["meta"]["resumed_from"] = {"step": resumed.step, "root": resumed.root}
        return kw

    def _save_preempted(self, step: int, metrics: dict | None, collective: bool, best_before):
        """A preemption signal came (to this rank, or to any under torch.distributed: every
        rank agreed on this step): the snapshots in flight end, this step's state is saved
        blocking into the store (its local tier, when it has one: the fastest durable place),
        its upload awaited for what is left of the grace, and Preempted raised (or kept in
        `preempted` and the snapshot returned, on_preempt="return"). A snapshot the grace
        cannot hold fails whole (a collective one by its deadline) and says so."""
        pre = self._preempt
        pre.saving = True
        signum = pre.signum if pre.signum is not None else signal.SIGTERM  # (another rank's signal)
        res, why = None, ""
        kw = self._put_args(step, metrics, ["preempted"])
        self._attempt(step)
        try:
            self.store.wait()  # the snapshots in flight end first, each as it ends
        except Exception:  # noqa: BLE001 - an earlier snapshot's failure (reported already): the final one still goes,
            pass           # on every rank alike (a rank that skipped it would leave the others to their deadline)
        took, left = self._last_seconds, pre.remaining()
        if took is not None and took > left:  # said before the save, which still goes: it may be faster (dedup)
            warnings.warn(f"CheckpointManager {self.job}: preempted; the last snapshot took {took:.1f} s and "
                          f"{left:.1f} s of the grace ({pre.grace:g} s) are left: the final snapshot of step {step} "
                          f"may not fit (it is tried; Preempted says whether it made it)",
                          SnapshotWarning, stacklevel=caller_level())
        try:
            if collective:
                res = self._collective_snapshot(kw, best_before, blocking=True, deadline=max(pre.remaining(), 1.0))
                if res is None:
                    why = f"the final snapshot failed: {self.snapshot_errors[-1] if self.snapshot_errors else '?'}"
            else:
                res = self._watched(lambda: self.store.put_snapshot(self.state.state_dict(), **kw, blocking=True,
                                                                    **self._local()), step)
        except Exception as e:  # noqa: BLE001 - said in the exception the process ends with
            why = f"the final snapshot failed: {type(e).__name__}: {e}"
        pre.done()
        if res is None and not why:
            why = "the final snapshot could not be taken (its warning above says why)"
        if res is None and pre.remaining() == 0:  # over by the time it gave up: whatever failed, the grace was short
            why = (f"the grace ({pre.grace:g} s) could not hold the final snapshot of step {step}: nothing of it "
                   f"was published ({why})")
        saved = res is not None and not why
        if saved:
            self.last, self.last_step, self.last_time = res, step, self.clock()
        durable = False
        if saved:
            try:
                durable = bool(self.store.wait_durable(timeout=pre.remaining()))
            except Exception as e:  # noqa: BLE001 - the tier keeps it; the next start uploads it
                why = f"its upload failed ({type(e).__name__}: {e}); the local tier keeps it"
            if not durable and not why:
                why = f"its upload did not end within the grace ({pre.grace:g} s); the local tier keeps it"
        exc = Preempted(step if saved else None, signum=int(signum), durable=durable, why=why, close_by=pre.ends_at())
        if not durable:
            warnings.warn(f"CheckpointManager {self.job}: {exc}", SnapshotWarning, stacklevel=caller_level())
        self.preempted = exc
        if self.on_preempt == "raise":
            self._preempt.close()
            raise exc
        return res

    @property
    def prune_errors(self) -> list:
        """Errors of background prunes (the newest 16), oldest first: a prune that failed,
        or a GcBusy for one that could not take the store's gc lock for PATIENCE seconds
        (it stays queued in the store and is still tried)."""
        return [] if self._pruner is None else list(self._pruner.errors)

    @property
    def last_prune(self):
        """The GCReport of the newest background prune that ran, or None."""
        return None if self._pruner is None else self._pruner.last

    def wait(self, *, prune: bool = True) -> None:
        """Wait for snapshots in flight (raise if one failed), then, with prune=True,
        for the background prune they asked for. Under torch.distributed a failed
        snapshot is not raised (the manager reported it when it ended)."""
        self.store.wait()
        self._wait_callbacks()
        if self._size is not None:
            self._size.wait()  # (the listing the last commit asked for: the next event reports it)
        if not self._collective():
            self._raise_pending()
        if prune and self._pruner is not None:
            self._pruner.wait()

    def close(self) -> CloseReport:
        """Wait for the snapshots in flight and the prune; raise a snapshot's failure not
        raised before (as wait() does), after stopping the prune thread. The store stays
        open (it is the caller's); a failure raised here is not raised by store.close().
        -> a CloseReport. A run must not end quietly on a failed snapshot: when the newest
        snapshot the manager attempted is not committed, close() raises SnapshotsFailed
        (its `report` the same CloseReport; on every rank alike under torch.distributed),
        so the script exits non-zero and the operator learns that a resume would start at
        the newest committed step. Earlier failures, each kind warned as it happened, are
        summed up in one more SnapshotWarning."""
        try:
            self.wait()
        finally:
            self._preempt.close()
            if self._durable is not None:
                self._durable.close()
            if self._size is not None:
                self._size.close()
            if self._pruner is not None:
                self._pruner.close()
        rep = self.report()
        with self._failures_lock:
            kinds = ", ".join(f"{k} x{n}" for k, n in self._warned.items())
        if rep.failed:
            if rep.ok:
                warnings.warn(f"CheckpointManager {self.job}: {rep.failed} of {rep.attempted} snapshot(s) failed in "
                              f"this run ({kinds}); the newest, of step {rep.last_attempted_step}, is committed",
                              SnapshotWarning, stacklevel=caller_level())
        if rep.durability is not None and rep.durability.lagging:
            warnings.warn(f"CheckpointManager {self.job}: durability lags: {rep.durability}", SnapshotWarning,
                          stacklevel=caller_level())
        if not rep.ok:
            last = (f"the newest committed by this run is of step {rep.last_committed_step}"
                    if rep.last_committed_step is not None else "none of its snapshots was committed")
            err = rep.errors[-1] if rep.errors else None
            raise SnapshotsFailed(
                f"CheckpointManager {self.job}: the newest snapshot attempted (step {rep.last_attempted_step}) was not "
                f"committed: {type(err).__name__ if err else 'failed'}: {err}; {rep.failed} of {rep.attempted} "
                f"snapshot(s) failed ({kinds}); {last}, so a resume starts there", rep) from err
        return rep
