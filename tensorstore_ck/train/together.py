"""A CheckpointManager's collective restores: every rank reads its own part of one snapshot,
and the ranks then agree on how the read went (one all-reduce), so that every rank resumes
at the same step or raises the same error. A collective checkout's outcome round covers
the root the ranks read, not each rank's own read of its part afterwards: one rank's
damaged block would otherwise leave that rank raising while the others train on.

restore_latest(): the ref's kept snapshots, newest first as rank 0 lists them, are tried in
turn; one that some rank cannot read whole (IntegrityError, FormatError: a damaged or
missing object) is passed over on every rank, with a warning, for the next older one. Any
other failure (a storage outage, a state that does not fit) ends the restore at once: every
rank raises the same error (the lowest failing rank's type and words). restore(step): that
one snapshot, read by every rank or by none; then rank 0 records the rollback in the store
(restoring.py) and the ranks agree on that too."""

from __future__ import annotations

import logging
import warnings

import torch

from .. import errors
from ..errors import FormatError, IntegrityError, RefNotFound, SnapshotWarning, TsckError
from .outcomes import caller_level

__all__: list[str] = []  # a part of CheckpointManager (manager.py), nothing public of its own

log = logging.getLogger(__package__)

# What a rank's attempt came to: read whole; its part damaged (an older snapshot may read
# whole); any other failure (every rank stops there).
OK, DAMAGED, FAILED = 0, 1, 2


def _code(e: BaseException | None) -> int:
    if e is None:
        return OK
    return DAMAGED if isinstance(e, (IntegrityError, FormatError)) else FAILED


class Together:
    """CheckpointManager's collective restores (mixed into it, manager.py)."""

    def _pg(self):
        import torch.distributed as dist
        g = self._group()
        backend = str(dist.get_backend(g))
        dev = (torch.device("cuda", torch.cuda.current_device())
               if "nccl" in backend and "gloo" not in backend else torch.device("cpu"))
        return dist, g, dev

    def _agree(self, value: int, op: str = "max") -> int:
        """The largest (or smallest) of every rank's value: one all-reduce over the group."""
        dist, g, dev = self._pg()
        t = torch.tensor([value], dtype=torch.int64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.MIN, group=g)
        return int(t.item())

    def _from_rank(self, src: int, obj):
        """`obj` as group rank `src` has it, on every rank (one broadcast of a small object)."""
        dist, g, _dev = self._pg()
        box = [obj]
        dist.broadcast_object_list(box, src=src if g is None else dist.get_global_rank(g, src), group=g)
        return box[0]

    def _rank0_says(self, fn):
        """fn() on rank 0, its value (or its error, raised alike) on every rank."""
        out = None
        if self._rank() == 0:
            try:
                out = ("ok", fn())
            except Exception as e:  # noqa: BLE001 - handed to every rank, raised there
                out = ("err", type(e).__name__, str(e))
        out = self._from_rank(0, out)
        if out[0] == "err":
            raise _rebuilt(out[1], out[2])
        return out[1]

    def _same_error(self, own: BaseException | None, lead: str = "") -> TsckError:
        """The error every rank raises: the lowest failing rank's, its type and words (with
        `lead` before them), the same on every rank."""
        world = self._world()
        src = self._agree(self._rank() if own is not None else world, "min")
        said = self._from_rank(src, (type(own).__name__, str(own)) if self._rank() == src else None)
        return _rebuilt(said[0], f"{lead}rank {src}: {said[1]}")

    def _world(self) -> int:
        import torch.distributed as dist
        return dist.get_world_size(self._group())

    def _read_agreed(self, state, targets: list[str], progress: bool, what: str, elsewhere: bool = False):
        """Check out targets[0], or the next one when some rank cannot read it whole, on every
        rank alike -> (index of the target read, the tree checkout returned). Raises the same
        error on every rank when none reads whole, or on any other failure. elsewhere: when
        targets[0] (the ref) does not read whole, the older snapshots the other ranks' tiers
        posted to a rank 0 whose tier lost the ref are tried next (Store.held_elsewhere,
        one broadcast on that path only)."""
        targets = list(targets)
        last_err = None
        i = -1
        while i + 1 < len(targets):
            i += 1
            target = targets[i]
            own = sd = None
            try:
                sd = self.store.checkout(target, into=state.checkout_targets(), group=self.group, progress=progress)
            except Exception as e:  # noqa: BLE001 - told to every rank below, then raised
                own = e
            worst = self._agree(_code(own))
            if worst == OK:
                return i, sd
            if elsewhere and i == 0 and worst == DAMAGED:
                targets[1:1] = self._rank0_says(lambda: [r for r in self.store.held_elsewhere(self.ref)
                                                         if r not in targets])
            if worst == FAILED or i == len(targets) - 1:
                lead = "" if worst == FAILED else (
                    f"{what}: no snapshot of ref {self.ref!r} reads whole on every rank ({i + 1} tried); the oldest: ")
                err = self._same_error(own if _code(own) == worst else None, lead)
                raise err from (own or last_err)
            last_err = own
            bad = self._same_error(own if _code(own) == DAMAGED else None)
            msg = (f"CheckpointManager {self.job}: {what}: the snapshot {target[:16]} of ref {self.ref!r} cannot be "
                   f"read whole on every rank ({bad}); every rank falls back to the next older kept snapshot")
            log.warning("%s", msg)
            warnings.warn(msg, SnapshotWarning, stacklevel=caller_level())
        raise AssertionError("unreachable: no targets")  # (callers pass at least one)

    def _restore_latest_together(self, state, must_exist: bool, progress: bool) -> int | None:
        """restore_latest() under torch.distributed (see the module)."""
        history = self._history()
        targets = self._rank0_says(lambda: self._targets(history))
        if not targets:
            if must_exist:
                raise self._nothing_to_resume()
            return None
        try:
            _i, sd = self._read_agreed(state, targets, progress, "restore_latest", elsewhere=bool(self.store.replicas))
        except RefNotFound:
            if must_exist:
                raise self._nothing_to_resume() from None
            return None
        state.load_checked_out(sd)
        self._restored(state, self._history())
        return state.step

    def _targets(self, history: list) -> list:
        """Rank 0: what restore_latest tries, in order: the ref itself (what a checkout of it
        reads: with a local tier, the newer tier's tip), then its older kept snapshots by
        root. With peer copies and the ref unknown to rank 0's own tier (its node lost), a
        checkout of the ref may name a newer snapshot the other ranks' tiers hold (their
        tips), so the newest of `history` (the remote's) is a target of its own after it,
        and the ref is tried even with no history (the remote held none of it yet)."""
        elsewhere = bool(self.store.replicas) and self.store.core.refs.get_or_none(self.ref) is None
        if not history:
            return [self.ref] if elsewhere else []
        return [self.ref] + [h.root for h in (history if elsewhere else history[1:])]

    def _restore_step_together(self, state, step: int, progress: bool) -> int:
        """restore(step) under torch.distributed: REF@STEP read by every rank, then rank 0
        records the rollback and every rank learns how that went."""
        target = f"{self.ref}@{step}"
        try:
            _i, sd = self._read_agreed(state, [target], progress, f"restore({step})")
        except RefNotFound:
            raise self._no_step(step, self._history()) from None
        state.load_checked_out(sd)
        history = self._history()
        own = None
        if self._rank() == 0:
            try:
                self._record_rollback(history, state.step)
            except Exception as e:  # noqa: BLE001 - every rank raises it alike
                own = e
        if self._agree(0 if own is None else 1):
            raise self._same_error(own, f"restore({step}) read the snapshot, but could not record the rollback: ")
        self._restored(state, history)
        return state.step


def _rebuilt(name: str, message: str) -> TsckError:
    """An error of tsck.errors named `name` (a TsckError with the type's name in front of
    the message when that type cannot be made from a message alone, or is not ours)."""
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, TsckError):
        try:
            return cls(message)
        except TypeError:
            pass
    return TsckError(f"{name}: {message}")
