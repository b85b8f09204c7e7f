"""The asynchronous snapshots of one Store: put_snapshot(blocking=False).

A snapshot is staged on the caller's thread (copied into a reused host buffer, so the
caller may mutate its state at once), then published on one background thread, so
snapshots commit in the order they were taken. At most `max_inflight` are staged or
publishing (a slot each): when_busy="wait" blocks for a free slot, "skip" drops the
snapshot and counts it. A failure goes to its future, to the next put
(raise_pending_error) and, if nobody retrieved it, to Store.close() (unheard).

The staging buffers of all of them together stay within the host-memory bound
(open_store(host_memory=), staging.StagingPool): a put whose buffer would pass it waits for
earlier ones to give theirs back (or, with "skip", is skipped), and a state larger than the
bound is staged in waves (stage_waves, write/waves.py).

A collective snapshot (under torch.distributed) is named on the caller's thread
(collective.begin_put: the calls keep their order on every rank) and made on the background
thread (collective.run_put); its outcome goes to its future only, never to the next put: the
ranks learn it at different moments.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as _wait_all
from typing import Callable

from .collective import CollectiveJob, begin_put, run_put
from .core.roles import Executor
from .errors import SnapshotAborted
from .write.staging import StagingPool, StagingUse

__all__ = ["SnapshotFuture", "AsyncPuts", "note"]


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


def quietly(fn, *args) -> None:
    """Run fn for its effect on others; its error is known to the caller already."""
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001
        pass


def note(err: BaseException, text: str) -> None:
    if hasattr(err, "add_note"):  # Python >= 3.11
        err.add_note(text)


class AsyncPuts:
    """The background publisher, the slots and the staging buffers of one Store."""

    def __init__(self, max_inflight: int, when_busy: str, executor: Executor, host_memory: int | None = None):
        self.max_inflight = max_inflight
        self.when_busy = when_busy
        self.host_memory = host_memory  # the bytes the staging buffers may hold (None: no bound)
        self.executor = executor  # the publisher's: staging buffers in shared memory where it reads them
        self.skipped = 0  # asynchronous snapshots dropped by when_busy="skip"
        self.reset()

    def reset(self) -> None:
        """A fresh queue (at creation, and in the child of os.fork(): the parent's thread,
        and any lock or slot it held, are not there)."""
        self.bg = ThreadPoolExecutor(1, thread_name_prefix="tsck-bg")
        self.slots = threading.BoundedSemaphore(self.max_inflight)
        self.staging = StagingPool(self.max_inflight, shared=self.executor.shares_memory,
                                   on_drop=self.executor.forget if self.executor.shares_memory else None,
                                   bound=self.host_memory)
        self.inflight: list[Future] = []
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.failed: list[SnapshotFuture] = []  # failures no put or raise_pending_error() raised yet

    def stage(self, plan, *, wait: bool):
        """Take one of the max_inflight slots (wait for one, or None when none is free and
        not wait) and copy the plan's bytes into a staging buffer -> the buffer. The slot and
        buffer go back when the background publisher is done with the snapshot."""
        if not self.slots.acquire(blocking=wait):
            return None
        buf = None
        try:
            need = max(plan.staged_bytes, plan.reserve)  # (the reserve: what the next put from its layout stages)
            if self.host_memory is not None and need > self.host_memory:
                need = plan.staged_bytes
            buf = self.staging.take(need, wait=wait)
            if buf is None:  # the bound is held by the snapshots in flight, and not wait
                self.slots.release()
                return None
            plan.stage(buf)
            plan.shared = self.staging.shared_of(buf)  # the saver process writes its blocks from there
        except BaseException:
            if buf is not None:
                self.staging.give(buf)
            self.slots.release()
            raise
        return buf

    def too_big(self, plan) -> bool:
        """Whether the plan's state is larger than the host-memory bound (stage_waves)."""
        return self.host_memory is not None and plan.staged_bytes > self.host_memory

    def stage_waves(self, plan, write: Callable, *, wait: bool) -> bool:
        """A plan too_big to stage whole: take a slot (as stage()) and one buffer of the
        bound (waves.wave_limit: the bound, or the largest block where that is larger),
        waiting until the snapshots in flight give theirs back, and write the plan's
        blocks through it in waves (waves.stage_in_waves; write(wave): an executor's
        write_blocks) -> True; False where a slot or the memory is busy and not wait.
        The buffer goes back before this returns; the slot when the background publisher
        is done with the snapshot (submit it with buf None)."""
        from .write.waves import stage_in_waves, wave_limit  # (torch: imported where tensors are)
        if not self.slots.acquire(blocking=wait):
            return False
        try:
            limit = wave_limit(plan, self.host_memory)
            buf = self.staging.take(limit, wait=wait)
            if buf is None:
                self.slots.release()
                return False
            try:
                n = stage_in_waves(plan, buf, self.staging.shared_of(buf), write, limit)
            finally:
                self.staging.give(buf)
            self.staging.counted_waves(n)
        except BaseException:
            self.slots.release()
            raise
        return True

    def use(self) -> StagingUse:
        return self.staging.use()

    def submit(self, ref: str, buf, publish: Callable, kept=None) -> SnapshotFuture:
        """Publish a staged snapshot in the background: publish() -> SnapshotInfo. kept:
        the layout its whole plan kept (Plan.kept), whose views of `buf` are made after."""
        fut = SnapshotFuture(ref)
        with self.lock:
            self.bg.submit(self._run, fut, buf, publish, False, kept)
            self.inflight.append(fut)
        return fut

    def submit_collective(self, job: CollectiveJob, stage: Callable) -> SnapshotFuture:
        """blocking=False under torch.distributed: stage() -> (args, plan, buf) stages this
        rank's state on the caller's thread, then the collective put (hello, writes, rank 0's
        commit, the outcome round) runs on the background publisher, behind the snapshots
        already in flight, so the calls run in the same order on every rank. Every rank's
        future gets the same outcome. A failure of stage() (bad arguments, a state that
        cannot be snapshotted) is raised to this caller at once, and the call still runs in
        the background, only to abort it on every rank."""
        ch = begin_put(job)  # names the call: in call order, on every rank
        try:
            args, plan, buf = stage()
        except BaseException as e:
            def refuse(e=e):  # (an interrupt, too, must reach the others as an abort; e bound now: the
                # name is unbound once the except clause ends, and refuse runs later)
                raise e if isinstance(e, Exception) else SnapshotAborted(f"snapshot aborted: {type(e).__name__}")
            self.after_in_flight(lambda: run_put(ch, dataclasses.replace(job, prepare=refuse, plan=refuse)))
            raise
        fut = SnapshotFuture(args.ref)
        fut.set_running_or_notify_cancel()  # cancel() refuses: the other ranks expect this one
        job = dataclasses.replace(job, prepare=lambda: args, plan=lambda: plan)
        with self.lock:
            self.bg.submit(self._run, fut, buf, lambda: run_put(ch, job), True, plan.kept)
            self.inflight.append(fut)
        return fut

    def after_in_flight(self, fn) -> None:
        """Run fn() on the background publisher once the snapshots queued so far have
        ended (in their order; the CheckpointManager's prune between its collective
        snapshots). Its errors are fn's to handle."""
        with self.lock:
            self.inflight.append(self.bg.submit(quietly, fn))

    def _run(self, fut: SnapshotFuture, buf, publish, collective: bool, kept=None) -> None:
        """collective: a collective put's failure goes to its future and close(), not to
        the next put: the ranks learn it at different moments, and one rank raising it
        from its next put would abort that snapshot on every rank. kept: see submit()."""
        info = err = None
        started = False
        try:
            # False: cancelled while queued, nothing written. (A collective put's future runs
            # from the start: it cannot be cancelled, the other ranks expect this rank.)
            started = collective or fut.set_running_or_notify_cancel()
            if started:
                try:
                    info = publish()
                except BaseException as e:  # noqa: BLE001 - handed to the future, the next put and close()
                    err = e
                    with self.lock:
                        if not collective:
                            self.error = e
                        self.failed.append(fut)
                if kept is not None and err is None:
                    # The next put from this layout stages into views of this buffer: made here,
                    # not on the training thread (a failure: that put makes them).
                    try:
                        kept.views(buf)
                    except Exception:  # noqa: BLE001 - published already; the views are an optimisation
                        pass
        finally:
            try:
                # The slot and buffer are free before the future completes: a caller that
                # saw the outcome may put again at once.
                self.staging.give(buf)
                self.slots.release()
            finally:  # whatever happened above, the future completes (wait() and close() wait on it)
                if started:
                    if err is not None:
                        fut.set_exception(err)
                    else:
                        fut.set_result(info)

    def raise_pending_error(self) -> None:
        """Raise (once) the failure of an asynchronous snapshot, if one failed. The
        failures so far count as heard: close() does not raise them again."""
        with self.lock:
            err, self.error = self.error, None
            if err is not None:
                self.failed = []
        if err is not None:
            raise err

    def wait(self) -> None:
        """Block until every asynchronous snapshot in flight has committed or failed.
        Failures are not raised here (they are on their futures, the next put and close())."""
        with self.lock:
            futs, self.inflight = self.inflight, []
        _wait_all(futs)  # not a retrieval of their outcome

    def shutdown(self) -> None:
        """Finish every snapshot in flight and free the staging buffers."""
        self.bg.shutdown(wait=True)
        self.staging.clear()

    def unheard(self) -> BaseException | None:
        """The failure of an asynchronous snapshot whose outcome nobody retrieved (its
        future's result() or exception() was not called, and no put raised it), with a
        note counting any later ones; None if there is none. Cleared: asked once."""
        with self.lock:
            unheard, self.failed, self.error = [f for f in self.failed if not f.retrieved], [], None
        if not unheard:
            return None
        err = unheard[0].failure()
        note(err, f"raised by Store.close(): the asynchronous snapshot of ref {unheard[0].ref!r} failed "
                  "and its future's outcome was never retrieved"
                  + (f"; {len(unheard) - 1} later asynchronous snapshot(s) failed too" if len(unheard) > 1
                     else ""))
        return err
