"""A CheckpointManager's restores: the newest snapshot or one step of its ref, the steps it
keeps, and the rollback a restore of an older step starts."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..errors import InvalidArgument, RefNotFound
from .state import TrainState, as_state

__all__: list[str] = []  # a part of CheckpointManager (manager.py), nothing public of its own


def _is_step(step) -> bool:
    return isinstance(step, int) and not isinstance(step, bool)


@dataclass(frozen=True)
class Resumed:
    """The snapshot a manager restored, when the ref kept snapshots at later steps (a
    rollback): its step and root, and the newest step of the abandoned run."""
    step: int
    root: str | None
    until: int


class Restoring:
    """CheckpointManager's restores and what the ref keeps (mixed into it, manager.py:
    the attributes are its own, set by its __init__)."""

    def restore_latest(self, state: TrainState | None = None, *, must_exist: bool = False,
                       progress: bool = False) -> int | None:
        """Load the newest committed snapshot of this job's ref into the state; its step,
        or None when there is none (a first run). must_exist=True is for resume scripts:
        no snapshot to resume from is then RefNotFound naming the store, the ref and the
        refs the store does hold, so a mistyped path or job fails loudly instead of
        starting training over from step 0. progress=True: the bytes read as a bar on
        stderr (a long restore shows it is moving). The newest is the ref's head: after a
        rollback (restore(step)), the restored snapshot or the new run's newest since, even
        where the abandoned run's later steps are still kept. Under torch.distributed every
        rank gets the same outcome (together.py): the same step, read whole on every rank
        (one that some rank cannot read whole is passed over for the next older one, with
        a SnapshotWarning), or the same error."""
        state = self.state if state is None else as_state(state)
        if state is None:
            raise InvalidArgument("restore_latest needs a TrainState")
        if self._collective():
            self.store.wait()  # (snapshots of this process still in flight come first, in call order)
            return self._restore_latest_together(state, must_exist, progress)
        try:
            history = self.store.log(self.ref)
        except RefNotFound:
            history = []
        if not history:
            if must_exist:
                raise self._nothing_to_resume()
            return None
        # With a local tier the ref is read, not the root log() named: checkout takes the
        # newest snapshot of either tier that reads whole, an older one if that one does not.
        target = self.ref if self.store.remote_core is not None else history[0].root
        sd = self.store.checkout(target, into=state.checkout_targets(), progress=progress, **self._local())
        state.load_checked_out(sd)
        self._restored(state, history)
        return state.step

    def _nothing_to_resume(self) -> RefNotFound:
        names = sorted(self.store.refs())
        held = (f"it holds {len(names)} ref(s): {', '.join(names[:10])}{', ...' if len(names) > 10 else ''}"
                if names else "it holds no snapshot at all (a new store: is the path right?)")
        return RefNotFound(f"nothing to resume: no snapshot of ref {self.ref!r} (job {self.job!r}) in the store "
                           f"at {self.store.url}; {held}")

    def _record_rollback(self, history: list, step: int) -> None:
        """restore(step) of a snapshot that is not the ref's head: the ref moves back to it
        (a compare-and-swap, recorded in the reflog like any move; the abandoned run's
        snapshots stay in the ref's history, each kept by retention as before), so that the
        run's branch is in the store: a crash before the new run's first snapshot resumes
        here (restore_latest, an elastic restart), not at the abandoned run's newest.
        Fenced against gc as undelete is: the fence is read before the snapshot is found
        kept, and a deletion phase since makes the move wait it out and look again. With
        a local tier the remote's ref moves too when the remote holds the snapshot (the
        newer tier's tip is what a checkout reads)."""
        root = next((h.root for h in history if h.step == step and _is_step(h.step)), None)
        if root is None or self.store.read_only:
            return  # (nothing to move back to; a read-only store records nothing: a restore still reads)
        want = bytes.fromhex(root)
        why = f"rolled back to step {step} (CheckpointManager.restore): the run goes on from here"
        _move_back(self.store.core, self.ref, want, why, self.store.gc_fence, self.store.publisher.wait_gc_idle)
        remote = self.store.remote_core
        if remote is not None and remote.refs.catalog_has(want):
            _move_back(remote, self.ref, want, why, lambda: remote.refs.gc_state()["epoch"], None)

    def _restored(self, state: TrainState, history: list) -> None:
        self.last_step = state.step
        self.last_time = self.clock()
        later = [h.step for h in history if _is_step(h.step) and _is_step(state.step) and h.step > state.step]
        if later:
            root = next((h.root for h in history if h.step == state.step), None)
            self._resumed = Resumed(step=state.step, root=root, until=max(later))
        else:
            self._resumed = None
        if self.on_metric is not None:
            vals = [h.metrics[self.on_metric[0]] for h in history if self.on_metric[0] in h.metrics]
            vals = [v for v in vals if v == v]
            if vals:
                self.best = min(vals) if self.on_metric[1] == "min" else max(vals)

    def _resuming(self, step: int) -> "Resumed | None":
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
        kept, step(11), step(12), ... go on as usual. restore() records the rollback in the
        store: the ref moves back to the restored snapshot (a compare-and-swap, a move in its
        reflog; nothing is deleted), so its log lists it first, and restore_latest() and
        latest_step() return it until the new run's first snapshot, after a crash too (an
        elastic restart resumes at 10, not at the abandoned 30). The new run's snapshots
        publish on the ref and take the abandoned run's steps again without a
        StepReusedWarning (put_snapshot(resumed_from=10); each such commit's meta records
        "resumed_from"). The abandoned snapshots stay kept for as long as the job's
        retention rules keep them, each by its own rank in publication order (keep_last:
        published before the move back, they are the first to go as the new run
        publishes), step (keep_every_steps), metric (keep_best) and age (max_age_days);
        without retention rules every one of them is kept. A read-only store records
        nothing (the restore still reads)."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise InvalidArgument(f"restore(step=) takes the int step of a snapshot, got {step!r}")
        step = int(step)
        state = self.state if state is None else as_state(state)
        if state is None:
            raise InvalidArgument("restore needs a TrainState")
        self.store.wait()  # (this process's snapshots still in flight come first, in call order)
        target = f"{self.ref}@{step}"
        if self._collective():
            return self._restore_step_together(state, step, progress)
        history = self._history()
        at = [h for h in history if h.step == step and _is_step(h.step)]
        if not at:
            raise self._no_step(step, history)
        # With a local tier the target is read by name: checkout takes the tier that reads it whole.
        sd = self.store.checkout(target if self.store.remote_core is not None else at[0].root,
                                 into=state.checkout_targets(), progress=progress, **self._local())
        state.load_checked_out(sd)
        self._record_rollback(history, state.step)
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


def _move_back(core, ref: str, want: bytes, why: str, fence, wait_gc_idle, tries: int = 16) -> None:
    """Point `ref` of `core`'s table at `want`, a snapshot its catalog keeps, from wherever
    it points now (Restoring._record_rollback)."""
    from ..errors import Fenced, RefConflict
    refs = core.refs
    for _ in range(tries):
        head = refs.get_or_none(ref)
        if head == want:
            return
        f = fence()  # (before the snapshot is found kept)
        row = refs.catalog_get(want)
        if row is None:
            raise RefNotFound(f"snapshot {want.hex()[:16]} of ref {ref!r} is no longer kept (retention dropped it "
                              "meanwhile): the rollback to it was not recorded")
        try:
            refs.compare_and_swap(ref, head, want, message=why, catalog_row=row, fence=f)
            return
        except RefConflict:
            continue  # another writer moved it: look again
        except Fenced:
            if wait_gc_idle is None:
                raise
            wait_gc_idle()
    now = refs.get_or_none(ref)
    raise RefConflict(ref, want.hex(), None if now is None else now.hex(),
                      hint="other writers kept moving it: the rollback to that snapshot was not recorded")
