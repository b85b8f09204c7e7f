"""A CheckpointManager under torch.distributed: rank 0's decision broadcast, the collective
snapshot and its failures reported (never raised); its restores are together.py's."""

from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

from ..collective import is_collective
from ..errors import InvalidArgument, InvalidName, OutcomeUnknown, TsckError, UnsupportedType

__all__: list[str] = []  # a part of CheckpointManager (manager.py), nothing public of its own

# The records keep the one name of the training helpers, whichever part logs.
log = logging.getLogger(__package__)


class Collective:
    """CheckpointManager's collective part (mixed into it, manager.py: the attributes
    are its own, set by its __init__)."""

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

    _BITS = {"steps": 1, "seconds": 2, "metric": 4, "continuous": 16}

    _FORCE = 8

    def _rank0_decides(self, why: list[str], force: bool, preempted: bool = False) -> tuple[list[str], bool, bool]:
        """Rank 0's triggers, on every rank, and whether any rank was preempted: one
        all-reduce (a sum) of two int64s, rank 0's triggers (the other ranks add 0) and
        each rank's preemption (1 where its signal came). A clock or a metric of each
        rank's own would otherwise let one rank enter a collective snapshot that another
        never joins; a signal to one rank alone (or to each at a different step) is then
        every rank's at the same step."""
        import torch.distributed as dist
        g = self._group()
        mask = sum(b for k, b in self._BITS.items() if k in why) | (self._FORCE if force else 0)
        backend = str(dist.get_backend(g))
        dev = (torch.device("cuda", torch.cuda.current_device())
               if "nccl" in backend and "gloo" not in backend else torch.device("cpu"))
        t = torch.tensor([mask if self._rank() == 0 else 0, int(preempted)], dtype=torch.int64, device=dev)
        dist.all_reduce(t, group=g)
        mask, preempted = int(t[0].item()), int(t[1].item()) > 0
        return [k for k, b in self._BITS.items() if mask & b], bool(mask & self._FORCE), preempted

    def _collective_snapshot(self, kw: dict, best_before, *, blocking: bool | None = None,
                             deadline: float | None = None):
        """One collective snapshot. async_ (the default): the state is staged and the
        put runs on the store's background publisher; rank 0 queues the prune behind
        it there, so the job's own deletion phase never overlaps its next snapshot and
        training never waits for either. Blocking: rank 0 first waits for the prune.
        -> the Future or SnapshotInfo, or None when it could not be taken (reported,
        not raised; an asynchronous failure is reported when its future completes)."""
        blocking = not self.async_ if blocking is None else blocking
        rank0_prunes = self._pruner is not None and self._rank() == 0
        if rank0_prunes and blocking:
            self._pruner.wait()
        try:
            state = self.state.state_dict()
            own = None
        except Exception as e:  # noqa: BLE001 - this rank cannot stage: the call is still made, to abort it
            state, own = _cannot_stage(self.state, e), e
        try:
            timeout = self.timeout if deadline is None else deadline
            res = self.store.put_snapshot(state, **kw, blocking=blocking, group=self.group,
                                          when_busy="wait", **({} if timeout is None else {"timeout": timeout}))
        except (InvalidArgument, UnsupportedType, InvalidName):
            if own is None:
                raise  # the caller's own mistake: every snapshot would fail alike
            return self._failed_to_stage(own, kw["step"], best_before)
        except Exception as e:  # noqa: BLE001 - a snapshot's failure, even a bug's, never stops training
            if own is not None:
                return self._failed_to_stage(own, kw["step"], best_before)
            if not isinstance(e, (TsckError, OSError)):
                log.error("CheckpointManager %s: the snapshot of step %s failed unexpectedly", self.job,
                          kw["step"], exc_info=e)
            return self._snapshot_failed(e, kw["step"], best_before)
        if not blocking:
            self._track(res, lambda fut: self._collective_done(fut, kw["step"], best_before))
            if rank0_prunes:
                self.store.after_in_flight(lambda: self._pruner.run_after(res))
        else:
            self._committed(res)
            if rank0_prunes:
                self._pruner.request()
        return res

    def _failed_to_stage(self, e: BaseException, step, best_before):
        """This rank's state_dict() raised: the put it made anyway aborted the call on every
        rank (the others' snapshot fails at once, not at the deadline); reported here."""
        if not isinstance(e, (TsckError, OSError)):
            log.error("CheckpointManager %s: the state of step %s could not be read on rank %s", self.job, step,
                      self._rank(), exc_info=e)
        return self._snapshot_failed(e, step, best_before)

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


class _CannotStage:
    """What a rank whose state_dict() raised hands to the collective put in place of its
    state: a Stateful whose state_dict() raises that error again, inside the put, where a
    rank that cannot stage still names the call and aborts it on every rank (store.py's
    put_snapshot: "a rank whose state cannot be staged"). Skipping the put instead would
    leave the other ranks waiting in it until the deadline, and one rank's next put
    waiting for theirs."""

    def __init__(self, error: BaseException):
        self.error = error

    def state_dict(self):
        raise self.error

    def load_state_dict(self, sd) -> None:  # (the Stateful protocol's other half: never called)
        raise NotImplementedError


def _cannot_stage(state, error: BaseException) -> _CannotStage:
    # Named as the state's class, so every rank's message says "TrainState.state_dict() failed".
    return type(type(state).__name__, (_CannotStage,), {})(error)
