"""Preemption: the signal a scheduler sends before it takes the machine back (SIGTERM by
default: Kubernetes, GKE, spot instances; a user's own, e.g. SIGUSR1 for Slurm's requeue),
caught for a CheckpointManager so that the run loses one snapshot's time, not the steps
since its last interval.

The handler only notes the signal (a flag read by the next step(), which saves; see
CheckpointManager) and calls the handler the program had installed before, so a program's
own SIGTERM logic still runs. Should no step() come within the grace (a loop stuck, or the
signal arriving during a long evaluation) where the signal's action was the default one, a
watchdog ends the process then, with the status a process the signal ended reports to a
shell (128 + its number), as it would have ended without the manager.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import warnings

from ..errors import InvalidArgument, SnapshotWarning

__all__ = ["Preempted", "PreemptSignals", "DEFAULT_GRACE", "any_rank_preempted"]

log = logging.getLogger(__package__)

# Seconds a preemption's final snapshot may take, by default: below the shortest notice the
# common platforms give (GKE's pods about 15 s when asked, Kubernetes' default
# terminationGracePeriodSeconds 30 s, GCP Spot 30 s, AWS Spot 120 s), less a margin for the
# process to exit.
DEFAULT_GRACE = 20.0
PAST_GRACE = 5.0  # seconds a final snapshot may still write after the grace before the process ends (its abort, delayed requests)


class Preempted(SystemExit):
    """Raised by CheckpointManager.step() after a preemption's final snapshot: left to end
    the process, it exits with status 128 + the signal's number (143 for SIGTERM), as a
    process the signal ended would, which torchrun, Slurm and Kubernetes count as a failure
    to restart or requeue. A SystemExit, so a loop's `except Exception` does not swallow it.

    step: the step saved (None: none could be); durable: the snapshot reached the store's
    most durable place within the grace (the remote behind a local tier; always for a store
    without one); signal: the signal's number; why: what went wrong, when something did.
    close_by: when the grace ends (time.monotonic()): a Store's `with` block the exception
    leaves closes by then (its uploads still queued stay in the local tier for the next
    start), so the process ends with this status before the platform's SIGKILL."""

    def __init__(self, step: int | None, *, signum: int, durable: bool, why: str = "",
                 close_by: float | None = None):
        self.step, self.signal, self.durable, self.why = step, signum, durable, why
        self.close_by = close_by
        super().__init__(128 + signum)

    def __str__(self) -> str:
        name = signal.Signals(self.signal).name
        if self.step is None:
            return f"preempted ({name}): no snapshot was saved ({self.why}); a restart resumes from the newest kept one"
        where = "durable" if self.durable else "in the local tier, its upload to finish at the next start"
        return f"preempted ({name}): the snapshot of step {self.step} is saved ({where}){': ' + self.why if self.why else ''}"


def preempt_options(signals, grace) -> tuple[tuple, float]:
    """The preempt_signals= and preempt_grace= of a manager, a callback or a plugin, checked
    (InvalidArgument) -> (the signals, the grace in seconds)."""
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not grace > 0:
        raise InvalidArgument(f"preempt_grace must be a number of seconds > 0, got {grace!r}")
    try:
        signals = tuple(signal.Signals(s) for s in (signals or ()))
    except (TypeError, ValueError):
        raise InvalidArgument(f"preempt_signals must be signals (e.g. (signal.SIGTERM, signal.SIGUSR1)), "
                              f"got {signals!r}") from None
    return signals, float(grace)


class PreemptSignals:
    """The preemption signals of one manager: installed in the main thread (a handler can
    be installed nowhere else; a manager made in another thread catches none and says so),
    chained to the handlers they replace, put back by close()."""

    def __init__(self, signals, grace: float):
        self.grace = grace
        self.signum: int | None = None  # the first preemption signal seen
        self.at: float | None = None    # when (time.monotonic())
        self.count = 0                  # signals seen (a second one changes nothing)
        self.saving = False             # the final snapshot has begun: the watchdog lets it end ...
        self._saved = threading.Event()  # ... until done(), or PAST_GRACE after the grace
        self._prev: dict[int, object] = {}
        self._before: dict[int, object] = {}
        self._watch: threading.Thread | None = None
        self._closed = threading.Event()
        if not signals:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning("CheckpointManager made outside the main thread: preemption signals (%s) are not caught; "
                        "make it in the main thread, or pass preempt_signals=()",
                        ", ".join(signal.Signals(s).name for s in signals))
            return
        for s in signals:
            self._prev[s] = signal.signal(s, self._on_signal)
        self._before = dict(self._prev)  # (what a signal does once closed, should another put this back)

    @property
    def seen(self) -> bool:
        return self.signum is not None

    def ends_at(self) -> float:
        """When the grace ends (time.monotonic())."""
        return (time.monotonic() if self.at is None else self.at) + self.grace

    def remaining(self) -> float:
        """Seconds left of the grace since the first signal (the whole grace before one)."""
        return self.grace if self.at is None else max(0.0, self.grace - (time.monotonic() - self.at))

    def _on_signal(self, signum, frame) -> None:
        if self._closed.is_set():  # put back after close() by a framework that had chained to it
            prev = self._before.get(signum)
            if callable(prev):
                prev(signum, frame)
            elif prev in (signal.SIG_DFL, None):
                signal.signal(signum, signal.SIG_DFL)  # the default action, now
                os.kill(os.getpid(), signum)
            return
        self.count += 1
        if self.signum is None:
            self.signum, self.at = signum, time.monotonic()
            self._watch = threading.Thread(target=self._watchdog, name="tsck-preempt", daemon=True)
            self._watch.start()
        prev = self._prev.get(signum)
        if callable(prev):  # the program's own handler (SIG_DFL and SIG_IGN are not callable)
            prev(signum, frame)

    def done(self) -> None:
        """The final snapshot's save has ended (saved or not): the watchdog has no more to do."""
        self._saved.set()

    def _watchdog(self) -> None:
        if self._closed.wait(self.grace):
            return
        name = signal.Signals(self.signum).name
        if self.saving:
            # The final snapshot is still being written as the grace ends. Its own deadline
            # ends it, whole or absent; but a write below the store that never returns (its
            # storage unreachable, a socket with no timeout) would hold the process until the
            # platform's SIGKILL, which ends it mid-write all the same. So it ends here,
            # PAST_GRACE later, with the same outcome in the store: nothing half-published.
            if self._saved.wait(PAST_GRACE) or self._closed.is_set():
                return
            text = (f"preempted ({name}) and the final snapshot was still being written {PAST_GRACE:g} s after "
                    f"the grace ({self.grace:g} s) ended (a write that does not return: its storage unreachable?): "
                    f"nothing of it is published; the process ends as the signal asks")
        else:
            # No step() came within the grace: end as the signal's default action would have,
            # now (the process would have ended at the signal without the manager).
            text = (f"preempted ({name}) and no CheckpointManager.step() came within {self.grace:g} s: nothing "
                    f"was saved; the process ends as the signal asks")
        if not self.saving and self._prev.get(self.signum) not in (signal.SIG_DFL, None):
            # The program's own handler (or SIG_IGN) decides what the signal does. (Not once
            # the final save has begun: the program is in step(), waiting on a write that
            # will not return, and ran its handler already.)
            return
        log.warning("%s", text)
        warnings.warn(text, SnapshotWarning, stacklevel=1)  # (shown with no logging set up)
        logging.shutdown()
        sys.stderr.flush()
        os._exit(128 + self.signum)

    def take_over(self) -> None:
        """Install this handler again over one a framework installed since (Lightning's, at
        fit()): the signal is then this one's alone, still chained to the handler from
        before this was made. The framework puts its predecessor (this one) back itself."""
        if threading.current_thread() is not threading.main_thread() or self._closed.is_set():
            return
        for s in self._prev:
            if signal.getsignal(s) != self._on_signal:
                signal.signal(s, self._on_signal)

    def close(self) -> None:
        """Put back the handlers this replaced (where its own is still the one installed)."""
        self._closed.set()
        if threading.current_thread() is not threading.main_thread():
            return  # (only the main thread may; the manager's close runs there)
        for s, prev in self._prev.items():
            if signal.getsignal(s) == self._on_signal:
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._prev = {}


def any_rank_preempted(seen: bool) -> bool:
    """Whether any rank of the default process group saw a preemption signal: one
    all-reduce (MAX) of one int64, every rank at the same point of its loop (the
    integrations' per-step agreement; the manager's rides on its own, collective.py)."""
    import torch
    import torch.distributed as dist
    backend = str(dist.get_backend())
    dev = (torch.device("cuda", torch.cuda.current_device())
           if "nccl" in backend and "gloo" not in backend else torch.device("cpu"))
    t = torch.tensor([int(seen)], dtype=torch.int64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
