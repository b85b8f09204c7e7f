"""Training helpers: exact resume of a training run, and when to snapshot it.

    loader = ResumableDataLoader(dataset, batch_size=32, shuffle=True, num_workers=2, seed=0)
    ts = TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    mgr = CheckpointManager(store, job="run1", state=ts, every_steps=100,
                            retention=Retention(keep_last=3))
    step = mgr.restore_latest() or 0
    while step < total_steps:
        for x, y in loader:               # a resumed epoch yields exactly the remaining batches
            step += 1
            ...train...
            mgr.step(step, metrics={"loss": loss.item()})
    mgr.close()

Resume is bit-identical when everything random flows from state TrainState
captures: model, optimizer, scheduler and grad-scaler state, every RNG stream
(python, numpy's global state and the numpy Generators handed to it, torch CPU
and each CUDA device) and the data-loader position. ResumableDataLoader makes
the data side exact: epoch e's order is a permutation drawn from (seed, e), and
the dataset's own randomness (python random, numpy and torch global RNGs used
inside __getitem__) is reseeded per batch from (seed, e, batch index) in
whichever process fetches it. A batch is therefore the same whether it comes
from worker 0, worker 1 or the main process, and whether the epoch was resumed
in the middle or not.
"""

from __future__ import annotations

import logging
import numbers
import random
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .dist import is_collective
from .errors import (InvalidArgument, InvalidName, OutcomeUnknown, RefNotFound, SnapshotsFailed, SnapshotWarning,
                     TsckError, UnsupportedType)
from .pruner import Pruner
from .retention import Retention

__all__ = ["TrainState", "CheckpointManager", "CommitEvent", "capture_rng", "restore_rng"]

log = logging.getLogger(__name__)


def capture_rng(numpy_generators: dict | None = None) -> dict:
    """Every RNG stream a training step may draw from: python, numpy's global state
    and the given numpy Generators, torch CPU and each CUDA device."""
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "numpy_generators": {k: g.bit_generator.state for k, g in (numpy_generators or {}).items()},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng(rng: dict, numpy_generators: dict | None = None) -> None:
    """Put back what capture_rng() took (CUDA devices: as many as both sides have)."""
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    for k, g in (numpy_generators or {}).items():
        g.bit_generator.state = rng["numpy_generators"][k]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        states = rng["cuda"]
        for i in range(min(len(states), torch.cuda.device_count())):
            torch.cuda.set_rng_state(states[i], i)


def _has_state(obj) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


_COMPONENTS = ("model", "optimizer", "scheduler", "scaler", "dataloader")


def _not_stateful(name: str, obj, *, tensors: bool) -> InvalidArgument:
    what = "must have state_dict() and load_state_dict()" + (", or be a tensor" if tensors else "")
    hint = ""
    if isinstance(obj, torch.utils.data.DataLoader):
        hint = ("; a torch DataLoader cannot say where it stands: use tsck.ResumableDataLoader or "
                "torchdata's StatefulDataLoader")
    elif isinstance(obj, dict):
        hint = "; pass the object itself (the model, not model.state_dict()), so a restore loads into it"
    return InvalidArgument(f"TrainState {name}= {what} (got {type(obj).__name__}){hint}")


class TrainState:
    """Everything a run needs to continue exactly: captured by state_dict(), put back by load_state_dict().

    model, optimizer, scheduler, scaler, dataloader and the other keyword objects are
    anything with state_dict() and load_state_dict() (torch's protocol, what DCP calls
    Stateful). The data loader's position is captured the same way: tsck's
    ResumableDataLoader, torchdata's StatefulDataLoader (what Lightning and accelerate
    resume with) or any loader of your own with that pair; a plain torch DataLoader has
    no position to capture and is refused. A keyword object may also be a tensor (a
    counter, an EMA buffer): stored as is, copied back into the same tensor on restore.
    Every RNG stream is captured besides (capture_rng)."""

    def __init__(self, model=None, optimizer=None, scheduler=None, scaler=None, dataloader=None, *,
                 numpy_generators: dict | None = None, step: int = 0, **objects):
        self.components = {k: v for k, v in zip(_COMPONENTS, (model, optimizer, scheduler, scaler, dataloader))
                           if v is not None}
        for name, obj in self.components.items():
            if not _has_state(obj):
                raise _not_stateful(name, obj, tensors=False)
        for name, obj in objects.items():
            if not (_has_state(obj) or isinstance(obj, torch.Tensor)):
                raise _not_stateful(name, obj, tensors=True)
        self.objects = objects
        self.numpy_generators = dict(numpy_generators or {})
        for name, g in self.numpy_generators.items():
            if not isinstance(g, np.random.Generator):
                raise InvalidArgument(f"numpy_generators[{name!r}] is not a numpy Generator")
        self.step = step

    @classmethod
    def from_dict(cls, state: dict, *, numpy_generators: dict | None = None) -> "TrainState":
        """A TrainState of a dict {name: Stateful object or tensor} (what DCP's save and
        load take): model, optimizer, scheduler, scaler and dataloader by those names, the
        rest as keyword objects. Anything else (a plain number, a state_dict() instead of
        its object) is refused here, naming the key: nothing could be restored into it."""
        if not isinstance(state, dict):
            raise InvalidArgument(f"TrainState.from_dict takes a dict, got {type(state).__name__}")
        parts, objects = {}, {}
        for k, v in state.items():
            if not isinstance(k, str) or not k:
                raise InvalidArgument(f"state= keys must be non-empty str, got {k!r}")
            if not (_has_state(v) or isinstance(v, torch.Tensor)):
                raise _not_stateful(k, v, tensors=True)
            if k in _COMPONENTS and not isinstance(v, torch.Tensor):
                parts[k] = v
            else:
                objects[k] = v
        ts = cls(**parts, numpy_generators=numpy_generators)
        ts.objects = objects  # not as keywords: a key such as "step" is an object here
        return ts

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            **{k: v.state_dict() for k, v in self.components.items()},
            "objects": {k: v if isinstance(v, torch.Tensor) else v.state_dict() for k, v in self.objects.items()},
            "rng": capture_rng(self.numpy_generators),
        }

    def checkout_targets(self) -> dict:
        """The into= tree that checks this state out into its live objects: modules and
        optimizers as themselves (tensors filled in place, a DTensor's local shard from the
        blocks it needs only; then their load_state_dict(); a fresh optimizer over DTensor
        parameters gets DTensor state), the rest read as stored. FSDP2 needs it: a sharded
        model refuses whole plain tensors in load_state_dict. load_checked_out() finishes."""
        def live(obj):
            return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer))
        return {"step": None, **{k: v if live(v) else None for k, v in self.components.items()},
                "objects": {k: v if live(v) or isinstance(v, torch.Tensor) else None for k, v in self.objects.items()},
                "rng": None}

    def load_checked_out(self, sd: dict) -> None:
        """The tree checkout(into=checkout_targets()) returned: what it did not load already."""
        for k, v in self.components.items():
            if k not in sd:
                raise InvalidArgument(f"snapshot has no {k!r} to restore")
            if sd[k] is not v:
                v.load_state_dict(sd[k])
        for k, v in self.objects.items():
            if sd["objects"][k] is not v:
                _load_object(v, sd["objects"][k])
        restore_rng(sd["rng"], self.numpy_generators)
        self.step = sd["step"]

    def load_state_dict(self, sd: dict) -> None:
        for k, v in self.components.items():
            if k not in sd:
                raise InvalidArgument(f"snapshot has no {k!r} to restore")
            v.load_state_dict(sd[k])
        for k, v in self.objects.items():
            _load_object(v, sd["objects"][k])
        restore_rng(sd["rng"], self.numpy_generators)
        self.step = sd["step"]


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


def _caller_level() -> int:
    """warnings.warn's stacklevel naming the first frame outside this package (the training
    script's step() or close() line; on a background thread, the thread's own start)."""
    import os
    import sys
    pkg = os.path.dirname(os.path.abspath(__file__))
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

    @property
    def ok(self) -> bool:
        return self.attempted == 0 or self.newest_committed


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


def _is_step(step) -> bool:
    return isinstance(step, int) and not isinstance(step, bool)


@dataclass(frozen=True)
class _Resumed:
    """The snapshot a manager restored, when the ref kept snapshots at later steps (a
    rollback): its step and root, and the newest step of the abandoned run."""
    step: int
    root: str | None
    until: int


def _physical(core) -> int:
    """Bytes of every stored commit, node and block (one listing of each kind)."""
    return sum(b for _n, b in core.assets.object_stats().values())


def _load_object(obj, stored) -> None:
    if isinstance(obj, torch.Tensor):
        with torch.no_grad():  # a parameter or buffer is updated in place, as into= does
            obj.copy_(stored)
    else:
        obj.load_state_dict(stored)


def _as_state(state) -> TrainState | None:
    """state= as the manager takes it: a TrainState, or a dict of Stateful objects and
    tensors (TrainState.from_dict); anything else is refused when the manager is made,
    not at the first snapshot."""
    if state is None or isinstance(state, TrainState):
        return state
    if callable(getattr(state, "state_dict", None)) and hasattr(state, "step"):
        return state  # TrainState's own protocol (state_dict(), step): a class of the user's that speaks it
    if isinstance(state, dict):
        return TrainState.from_dict(state)
    raise InvalidArgument(f"CheckpointManager state= takes a TrainState or a dict of objects with "
                          f"state_dict()/load_state_dict() and tensors, got {type(state).__name__}"
                          + (" (wrap it: TrainState(model=...) or state={'model': ...})" if _has_state(state) else ""))


class CheckpointManager:
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
    StepReusedWarning. restore() writes and deletes nothing; the abandoned run's
    snapshots stay for as long as the job's retention rules keep them, each by its own
    publication order, step, metric and age (keep_last counts publication order, so they
    are the first to go as the new run publishes). See restore().

    Triggers (any one fires a snapshot):
      every_steps=N      when step % N == 0
      every_seconds=T    when clock() - time of the last snapshot (or of the start) >= T
      on_metric=(name, "min"|"max")  when metrics[name] improves on the best seen (the first value counts)
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
      metric value rank 0 passes, its force=) is broadcast to the group once per
      step() (one 8-byte broadcast, the only collective the policy adds), so a
      rank-local clock, a rank-local loss or a force=True on one rank alone cannot make
      ranks disagree. timeout= is each collective snapshot's deadline (put_snapshot's).
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
      rank reads its own part of that one snapshot and resumes at the same step.
    - close() (and wait()) waits on every rank for the snapshots in flight and, on
      rank 0, for the prune.
    For one process, a failed background snapshot is raised by the next step() (or
    close()) when it is the store's (a TsckError or OSError); any other exception of a
    snapshot is reported, never raised into training.
    Every failed snapshot is also a SnapshotWarning (shown by default, with no logging
    set up), the first of each kind; close() returns a CloseReport, and raises
    SnapshotsFailed when the newest snapshot attempted was not committed.

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
                 store_size_every: float | None = 300.0, timeout: float | None = None):
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
        self.timeout = timeout  # a collective snapshot's deadline (None: put_snapshot's default)
        self.store = store
        self.job = job
        self.ref = ref or f"{job}/main"
        self.state = _as_state(state)
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.on_metric = on_metric
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
        self._resumed: _Resumed | None = None
        self.group = group  # None: the default process group when torch.distributed is initialised
        self.failed_snapshots = 0  # collective snapshots that could not be taken (reported, not raised)
        self.snapshot_errors: list = []  # their errors, the newest 16
        self._failures_lock = threading.Lock()  # asynchronous failures are counted from the background
        # How the run's snapshots ended (close() reports them). Outcomes arrive in the order
        # the snapshots were taken (the store's publisher runs them in order), so the last
        # outcome heard, once nothing is in flight, is the newest attempt's.
        self._attempted = 0
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
        why = self.reasons(step, metrics)
        best_before = self.best
        if self.on_metric is not None and metrics and self.on_metric[0] in metrics:
            v = metrics[self.on_metric[0]]
            if v == v and (self.best is None or (v < self.best if self.on_metric[1] == "min" else v > self.best)):
                self.best = v
        if collective:  # (force too: one rank's force alone would enter a call the others never make)
            why, force = self._rank0_decides(why, force)
        if not why and not force:
            return None
        if self.state is None:
            raise InvalidArgument("CheckpointManager has no state= to snapshot")
        self.state.step = step
        metrics = {k: float(v.item()) if isinstance(v, torch.Tensor) and v.numel() == 1 else v
                   for k, v in (metrics or {}).items()}
        metrics = {k: v for k, v in metrics.items()
                   if isinstance(v, numbers.Real) and not isinstance(v, bool)}
        kw = dict(ref=self.ref, job=self.job, step=step, metrics=metrics, meta={"triggers": why or ["forced"]})
        resumed = self._resuming(step)
        if resumed is not None:  # a step of the run a rollback abandoned, taken again on purpose
            kw["resumed_from"] = resumed.step
            kw["meta"]["resumed_from"] = {"step": resumed.step, "root": resumed.root}
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

    # -- what an operator watches: the on_commit hook, the log lines ---------------
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

    # -- under torch.distributed -------------------------------------------------
    def _collective(self) -> bool:
        return self.group is not False and is_collective(self.group)

    def _local(self) -> dict:
        """group=False: this process alone, even under torch.distributed."""
        return {"group": False} if self.group is False else {}

    def _group(self):
        return None if self.group in (None, True) else self.group

    def _rank(self) -> int:
        import torch.distributed as dist
        return dist.get_rank(self._group())

    _BITS = {"steps": 1, "seconds": 2, "metric": 4}
    _FORCE = 8

    def _rank0_decides(self, why: list[str], force: bool) -> tuple[list[str], bool]:
        """Rank 0's triggers, on every rank: one broadcast of an int64 from the group's
        rank 0. A clock or a metric of each rank's own would otherwise let one rank
        enter a collective snapshot that another never joins."""
        import torch.distributed as dist
        g = self._group()
        mask = sum(b for k, b in self._BITS.items() if k in why) | (self._FORCE if force else 0)
        backend = str(dist.get_backend(g))
        dev = (torch.device("cuda", torch.cuda.current_device())
               if "nccl" in backend and "gloo" not in backend else torch.device("cpu"))
        t = torch.tensor([mask], dtype=torch.int64, device=dev)
        dist.broadcast(t, src=0 if g is None else dist.get_global_rank(g, 0), group=g)
        mask = int(t.item())
        return [k for k, b in self._BITS.items() if mask & b], bool(mask & self._FORCE)

    def _collective_snapshot(self, kw: dict, best_before):
        """One collective snapshot. async_ (the default): the state is staged and the
        put runs on the store's background publisher; rank 0 queues the prune behind
        it there, so the job's own deletion phase never overlaps its next snapshot and
        training never waits for either. Blocking: rank 0 first waits for the prune.
        -> the Future or SnapshotInfo, or None when it could not be taken (reported,
        not raised; an asynchronous failure is reported when its future completes)."""
        rank0_prunes = self._pruner is not None and self._rank() == 0
        if rank0_prunes and not self.async_:
            self._pruner.wait()
        try:
            res = self.store.put_snapshot(self.state.state_dict(), **kw, blocking=not self.async_, group=self.group,
                                          when_busy="wait",
                                          **({} if self.timeout is None else {"timeout": self.timeout}))
        except (InvalidArgument, UnsupportedType, InvalidName):
            raise  # the caller's own mistake: every snapshot would fail alike
        except Exception as e:  # noqa: BLE001 - a snapshot's failure, even a bug's, never stops training
            if not isinstance(e, (TsckError, OSError)):
                log.error("CheckpointManager %s: the snapshot of step %s failed unexpectedly", self.job,
                          kw["step"], exc_info=e)
            return self._snapshot_failed(e, kw["step"], best_before)
        if self.async_:
            self._track(res, lambda fut: self._collective_done(fut, kw["step"], best_before))
            if rank0_prunes:
                self.store.after_in_flight(lambda: self._pruner.run_after(res))
        else:
            self._committed(res)
            if rank0_prunes:
                self._pruner.request()
        return res

    def _collective_done(self, fut, step: int, best_before) -> None:
        """An asynchronous collective snapshot ended (on the background publisher, or here
        if it had already): a failure is reported as for a blocking one, never raised."""
        err = fut.failure()
        if err is None:
            self._committed(Future.result(fut, 0))
            return
        fut.retrieved = True  # heard: reported here, so close() does not raise it again
        if isinstance(err, (TsckError, OSError)):
            self._snapshot_failed(err, step, best_before)
        else:  # a bug: still never out of step(), but loudly
            log.error("CheckpointManager %s: the snapshot of step %s failed unexpectedly", self.job, step,
                      exc_info=err)
            self._count_failure(err, step)

    def _snapshot_failed(self, e: BaseException, step, best_before):
        if isinstance(e, OutcomeUnknown) and e.root is not None and self._published(e.root, e.ref):
            log.warning("snapshot %s of ref %s: the answer to its ref move was lost, but the ref table shows "
                        "it published; going on", e.root.hex()[:16], e.ref)
            self._outcome_ok(step)
            return self.store.show(e.root.hex())
        self._count_failure(e, step)
        if self.best is not None and best_before != self.best:
            self.best = best_before  # the next improvement on what is stored takes one
        log.warning("CheckpointManager %s: the snapshot of step %s could not be taken: %s: %s (training goes "
                    "on; the next policy point takes one; %d failed so far)", self.job, step,
                    type(e).__name__, e, self.failed_snapshots, extra=self._failed_fields(e, step))
        return None

    def _failed_fields(self, e: BaseException, step) -> dict:
        """The fields of a failed snapshot's log record (`tsck --log-format json`, a log shipper)."""
        return {"tsck": {"event": "failed", "ref": self.ref, "job": self.job, "step": step,
                         "why": f"{type(e).__name__}: {e}", "failures": self.failed_snapshots}}

    def _count_failure(self, e: BaseException, step) -> None:
        with self._failures_lock:
            self.failed_snapshots += 1
            self.snapshot_errors = (self.snapshot_errors + [e])[-Pruner.KEEP_ERRORS:]
        self._failure(e, step)

    # -- how the run's snapshots ended: warned as they fail, reported by close() ------
    def _attempt(self, step) -> int:
        with self._failures_lock:
            self._attempted += 1
            self._prev_attempted_step, self._last_attempted_step = self._last_attempted_step, step
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
                          "close() reports them)", SnapshotWarning, stacklevel=_caller_level())

    def report(self) -> CloseReport:
        """How the manager's snapshots ended so far (close() returns it once nothing is in flight)."""
        with self._failures_lock:
            return CloseReport(attempted=self._attempted, committed=self._committed_n,
                               failed=sum(self._warned.values()), last_attempted_step=self._last_attempted_step,
                               last_committed_step=self._last_committed_step, newest_committed=self._newest_ok,
                               errors=tuple(self._errors))

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

    def restore_latest(self, state: TrainState | None = None, *, must_exist: bool = False,
                       progress: bool = False) -> int | None:
        """Load the newest committed snapshot of this job's ref into the state; its step,
        or None when there is none (a first run). must_exist=True is for resume scripts:
        no snapshot to resume from is then RefNotFound naming the store, the ref and the
        refs the store does hold, so a mistyped path or job fails loudly instead of
        starting training over from step 0. progress=True: the bytes read as a bar on
        stderr (a long restore shows it is moving). The newest is the ref's head: after a
        rollback (restore(step)) and a snapshot since, the new run's newest, even where
        the abandoned run's later steps are still kept."""
        state = self.state if state is None else _as_state(state)
        if state is None:
            raise InvalidArgument("restore_latest needs a TrainState")
        if self._collective():
            self.store.wait()  # (snapshots of this process still in flight come first, in call order)
            return self._restore_collective(state, must_exist, progress)
        try:
            history = self.store.log(self.ref)
        except RefNotFound:
            history = []
        if not history:
            if must_exist:
                names = sorted(self.store.refs())
                held = (f"it holds {len(names)} ref(s): {', '.join(names[:10])}{', ...' if len(names) > 10 else ''}"
                        if names else "it holds no snapshot at all (a new store: is the path right?)")
                raise RefNotFound(f"nothing to resume: no snapshot of ref {self.ref!r} (job {self.job!r}) in the "
                                  f"store at {self.store.url}; {held}")
            return None
        # With a local tier the ref is read, not the root log() named: checkout takes the
        # newest snapshot of either tier that reads whole, an older one if that one does not.
        target = self.ref if self.store.remote_core is not None else history[0].root
        sd = self.store.checkout(target, into=state.checkout_targets(), progress=progress, **self._local())
        state.load_checked_out(sd)
        self._restored(state, history)
        return state.step

    def _restored(self, state: TrainState, history: list) -> None:
        self.last_step = state.step
        self.last_time = self.clock()
        later = [h.step for h in history if _is_step(h.step) and _is_step(state.step) and h.step > state.step]
        if later:
            root = next((h.root for h in history if h.step == state.step), None)
            self._resumed = _Resumed(step=state.step, root=root, until=max(later))
        else:
            self._resumed = None
        if self.on_metric is not None:
            vals = [h.metrics[self.on_metric[0]] for h in history if self.on_metric[0] in h.metrics]
            vals = [v for v in vals if v == v]
            if vals:
                self.best = min(vals) if self.on_metric[1] == "min" else max(vals)

    def _resuming(self, step: int) -> "_Resumed | None":
        """The restore a snapshot at `step` resumes from, when it takes a step of the run that
        restore abandoned (put_snapshot(resumed_from=), and a record in the commit's meta):
        steps moving on from the restored one, up to the abandoned run's newest. A step at
        or below one this manager already took is not covered (a loop that went back)."""
        r = self._resumed
        if r is None or not _is_step(step):
            return None
        if step > r.until:
            self._resumed = None  # past the abandoned run: no step of it is taken again
            return None
        if step <= r.step or (_is_step(self.last_step) and step <= self.last_step):
            return None
        return r

    def _history(self) -> list:
        """The kept snapshots of the ref, newest first (store.log); [] when it has none."""
        try:
            return self.store.log(self.ref)
        except RefNotFound:
            return []

    def all_steps(self) -> list[int]:
        """The steps of the ref's committed snapshots that are still kept, ascending, each
        once: read from the store's catalog (store.log), not from this manager's memory, so
        a manager made in a new process sees what another one wrote, and a snapshot that
        retention pruned is not listed. A snapshot still in flight is not (wait() first).
        After a rollback (restore(step)) the abandoned run's snapshots that retention
        still keeps are listed too: restore(step) can go back to any step listed here."""
        return sorted({h.step for h in self._history() if _is_step(h.step)})

    def latest_step(self) -> int | None:
        """The step restore_latest() would resume at: that of the ref's newest committed
        snapshot (after a rollback, the new run's newest, even where the abandoned run's
        later steps are still kept), or None when the ref has none. Reads the store's
        catalog; restores nothing and leaves the state as it is."""
        return next((h.step for h in self._history() if _is_step(h.step)), None)

    def restore(self, step: int, state: TrainState | None = None, *, progress: bool = False) -> int:
        """Load the ref's kept snapshot at `step` into the state, as restore_latest() loads
        the newest (the same objects, RNG streams and data-loader position; bit-identical);
        returns its step. A step the ref does not hold (never taken, or pruned by retention)
        is RefNotFound naming the kept steps nearest to it; the state is left as it was.
        Where the ref holds two snapshots at `step` (a rollback took it again), the newer.

        Rolling back is a supported path: after restore(10) with snapshots up to step 30
        kept, step(11), step(12), ... go on as usual. Their snapshots are published on the
        ref (its log lists them first, restore_latest() and latest_step() return the newest
        of them) and take the abandoned run's steps again without a StepReusedWarning
        (put_snapshot(resumed_from=10); each such commit's meta records "resumed_from").
        restore() itself writes and deletes nothing: until the first snapshot after it
        commits, the ref still ends at the abandoned run's newest. The abandoned snapshots
        stay kept for as long as the job's retention rules keep them, each by its own rank
        in publication order (keep_last: published before the new run's, they are the
        first to go as it publishes), step (keep_every_steps), metric (keep_best) and age
        (max_age_days); without retention rules every one of them is kept."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise InvalidArgument(f"restore(step=) takes the int step of a snapshot, got {step!r}")
        step = int(step)
        state = self.state if state is None else _as_state(state)
        if state is None:
            raise InvalidArgument("restore needs a TrainState")
        self.store.wait()  # (this process's snapshots still in flight come first, in call order)
        target = f"{self.ref}@{step}"
        if self._collective():
            try:
                sd = self.store.checkout(target, into=state.checkout_targets(), group=self.group, progress=progress)
            except RefNotFound:
                raise self._no_step(step, self._history()) from None
            state.load_checked_out(sd)
            self._restored(state, self._history())
            return state.step
        history = self._history()
        at = [h for h in history if h.step == step and _is_step(h.step)]
        if not at:
            raise self._no_step(step, history)
        # With a local tier the target is read by name: checkout takes the tier that reads it whole.
        sd = self.store.checkout(target if self.store.remote_core is not None else at[0].root,
                                 into=state.checkout_targets(), progress=progress, **self._local())
        state.load_checked_out(sd)
        self._restored(state, history)
        return state.step

    def _no_step(self, step: int, history: list) -> RefNotFound:
        steps = sorted({h.step for h in history if _is_step(h.step)})
        where = f"ref {self.ref!r} (job {self.job!r}) in the store at {self.store.url}"
        if not steps:
            return RefNotFound(f"no snapshot at step {step}: {where} has no snapshot")
        below = [s for s in steps if s < step]
        above = [s for s in steps if s > step]
        near = " and ".join(x for x in (f"{below[-1]} below" if below else "", f"{above[0]} above" if above else "")
                            if x)
        return RefNotFound(f"no snapshot at step {step} of {where} (never taken, or pruned by retention); the "
                           f"nearest kept steps are {near}; {len(steps)} kept, from {steps[0]} to {steps[-1]} "
                           "(all_steps() lists them)")

    def _restore_collective(self, state: TrainState, must_exist: bool, progress: bool = False) -> int | None:
        """A collective checkout of the ref: rank 0 resolves its head and hands every rank
        that root through the c10d Store, so every rank reads the same snapshot (its own
        part of it) even if the ref moves meanwhile, and resumes at the same step. No
        snapshot: RefNotFound on every rank alike, so every rank returns None alike."""
        try:
            sd = self.store.checkout(self.ref, into=state.checkout_targets(), group=self.group, progress=progress)
        except RefNotFound:
            if must_exist:
                names = sorted(self.store.refs())
                held = (f"it holds {len(names)} ref(s): {', '.join(names[:10])}{', ...' if len(names) > 10 else ''}"
                        if names else "it holds no snapshot at all (a new store: is the path right?)")
                raise RefNotFound(f"nothing to resume: no snapshot of ref {self.ref!r} (job {self.job!r}) in the "
                                  f"store at {self.store.url}; {held}") from None
            return None
        state.load_checked_out(sd)
        # The best so far (rank 0's decides; the others' are kept alike) and the later steps
        # a rollback left behind (they only spare a warning, so each rank reads its own).
        self._restored(state, self._history())
        return state.step

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
                              SnapshotWarning, stacklevel=_caller_level())
        if not rep.ok:
            last = (f"the newest committed by this run is of step {rep.last_committed_step}"
                    if rep.last_committed_step is not None else "none of its snapshots was committed")
            err = rep.errors[-1] if rep.errors else None
            raise SnapshotsFailed(
                f"CheckpointManager {self.job}: the newest snapshot attempted (step {rep.last_attempted_step}) was not "
                f"committed: {type(err).__name__ if err else 'failed'}: {err}; {rep.failed} of {rep.attempted} "
                f"snapshot(s) failed ({kinds}); {last}, so a resume starts there", rep) from err
        return rep
