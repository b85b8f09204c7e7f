"""Hugging Face accelerate: what Accelerator.save_state writes, snapshotted into a store instead.

    import tensorstore_ck as tsck
    from tensorstore_ck import accelerate as tsck_accelerate
    accelerator = Accelerator(project_config=ProjectConfiguration(total_limit=3),
                              dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                                        use_seedable_sampler=True))
    model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
    store = tsck.open_store("ckpts")
    mgr = tsck_accelerate.checkpoint_manager(accelerator, store, "run1", every_steps=100)
    step = mgr.restore_latest() or 0     # model, optimizer, ..., the loader's position and epoch
    ...                                  # train; mgr.step(step) after each step
    mgr.close()

    tsck_accelerate.save_state(accelerator, store, "run1")   # as accelerator.save_state()
    tsck_accelerate.load_state(accelerator, store, "run1")   # as accelerator.load_state()

A snapshot holds what save_state writes, read from the Accelerator when it is taken: the
prepared models (unwrapped: the same names on 1 or W processes), optimizers, schedulers,
the grad scaler, every prepared data loader's state (a stateful loader's position) and
epoch, what register_for_checkpointing registered, the accelerator's step and checkpoint
counter (project_configuration.iteration, which counts saves), and every RNG stream
(train.TrainState). A restore puts all of them back, the loaders' epochs and the counter
included (accelerate's load_state restores neither: a resumed epoch replays epoch 0's
order, and a counter back at 0 makes total_limit's rotation delete the newest folders).
ProjectConfiguration(total_limit=N) is the job's Retention(keep_last=N), pruned as the job
trains (CheckpointManager's pruner), unless retention= is given.

Under DDP (world size W > 1; torchrun or `accelerate launch`) every rank calls the same
functions and each snapshot is one collective snapshot: the parameters and the optimizer's
state are the same on every rank, so they are stored as tsck.Replicated (each block written
once, by one rank); the RNG streams and loader positions are each rank's own. FSDP,
DeepSpeed and Megatron-LM shard the model and optimizer inside accelerate's own files and
are refused (InvalidArgument) until supported. This module imports accelerate; the rest of
the package does not.
"""

from __future__ import annotations

import weakref

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from .errors import InvalidArgument
from .maintain.retention import Retention
from .train import CheckpointManager, TrainState
from .write.shard import Replicated, is_dtensor

__all__ = ["checkpoint_manager", "save_state", "load_state", "AcceleratorStateful"]

_SHARDED = (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM)


def _check(accelerator) -> None:
    if not isinstance(accelerator, Accelerator):
        raise InvalidArgument(f"tensorstore_ck.accelerate takes an accelerate.Accelerator, got "
                              f"{type(accelerator).__name__}")
    kind = accelerator.distributed_type
    sharded = kind in _SHARDED or any(is_dtensor(p) for m in accelerator._models for p in m.parameters())
    if sharded:
        name = kind.value if kind in _SHARDED else "a model of DTensors"
        raise InvalidArgument(f"tensorstore_ck.accelerate does not snapshot {name} training yet: its ranks hold "
                              "different pieces of the model and optimizer, which accelerate saves in files of "
                              "its own (use accelerator.save_state, or tensorstore_ck.dcp's TsckWriter with "
                              "dcp.save)")


def _replicated(sd: dict, module) -> dict:
    """A model's state_dict with its parameters Replicated (DDP keeps them equal on every
    rank; buffers stay each rank's own, as a rank's forward may update them)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    return {k: Replicated(v) if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in params else v
            for k, v in sd.items()}


def _optimizer_replicated(osd: dict) -> dict:
    state = osd.get("state")
    if not isinstance(state, dict):
        return osd
    return {**osd, "state": {i: {k: Replicated(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                             if isinstance(st, dict) else st for i, st in state.items()}}


class AcceleratorStateful:
    """What Accelerator.save_state writes, as one Stateful object (state_dict() /
    load_state_dict()), read from the accelerator at each call: so objects prepared or
    registered after it was made are in the next snapshot. state_dict() counts a save
    (project_configuration.iteration + 1), as save_state does."""

    def __init__(self, accelerator):
        _check(accelerator)
        self.accelerator = accelerator

    def state_dict(self) -> dict:
        acc = self.accelerator
        _check(acc)
        many = acc.num_processes > 1
        models = []
        for m in acc._models:
            inner = acc.unwrap_model(m)
            sd = inner.state_dict()
            models.append(_replicated(sd, inner) if many else sd)
        opts = [o.state_dict() for o in acc._optimizers]
        loaders = [{"epoch": getattr(dl, "iteration", None),
                    "state": dl.state_dict() if getattr(dl, "use_stateful_dataloader", False) else None}
                   for dl in acc._dataloaders]
        acc.project_configuration.iteration += 1  # this snapshot is a save: the counter counts it
        return {
            "models": models,
            "optimizers": [_optimizer_replicated(o) for o in opts] if many else opts,
            "schedulers": [s.state_dict() for s in acc._schedulers],
            "dataloaders": loaders,
            "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
            "custom": [o.state_dict() for o in acc._custom_objects],
            "step": acc.step,
            "iteration": acc.project_configuration.iteration,
        }

    def load_state_dict(self, sd: dict) -> None:
        acc = self.accelerator
        _check(acc)
        for key, have in (("models", acc._models), ("optimizers", acc._optimizers), ("schedulers", acc._schedulers),
                          ("dataloaders", acc._dataloaders), ("custom", acc._custom_objects)):
            if len(sd[key]) != len(have):
                raise InvalidArgument(f"the snapshot holds {len(sd[key])} {key}, the accelerator {len(have)}: "
                                      "prepare (and register_for_checkpointing) the same objects as the run that "
                                      "took it")
        for m, st in zip(acc._models, sd["models"]):
            acc.unwrap_model(m).load_state_dict(st)
        if acc.scaler is not None and sd["scaler"] is not None:
            acc.scaler.load_state_dict(sd["scaler"])
        for o, st in zip(acc._optimizers, sd["optimizers"]):
            o.load_state_dict(st)
        for s, st in zip(acc._schedulers, sd["schedulers"]):
            s.load_state_dict(st)
        for dl, st in zip(acc._dataloaders, sd["dataloaders"]):
            if st["state"] is not None:
                dl.load_state_dict(st["state"])
                dl.dl_state_dict = st["state"]  # what state_dict() answers until the next batch
            if st["epoch"] is not None:
                dl.set_epoch(st["epoch"])
        for o, st in zip(acc._custom_objects, sd["custom"]):
            o.load_state_dict(st)
        acc.step = sd["step"]
        acc.project_configuration.iteration = sd["iteration"]


def checkpoint_manager(accelerator, store, job: str, *, retention: Retention | None = None,
                       **manager_kw) -> CheckpointManager:
    """A CheckpointManager (train/manager.py: its triggers, asynchronous snapshots,
    preemption, restore_latest) of everything accelerator.save_state writes, at ref
    f"{job}/main" unless ref= says otherwise. retention: the job's rules; without it,
    ProjectConfiguration(total_limit=N) sets Retention(keep_last=N). Other keywords go to
    CheckpointManager. InvalidArgument for FSDP, DeepSpeed or Megatron-LM training."""
    state = TrainState(accelerator=AcceleratorStateful(accelerator))
    limit = accelerator.project_configuration.total_limit
    if retention is None and limit is not None:
        retention = Retention(keep_last=int(limit))
    return CheckpointManager(store, job=job, state=state, retention=retention, **manager_kw)


# accelerator -> {(store, ref): the manager save_state and load_state use}
_MANAGERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _manager(accelerator, store, job: str, ref: str | None) -> CheckpointManager:
    mine = _MANAGERS.setdefault(accelerator, {})
    key = (id(store), ref or f"{job}/main")
    if key not in mine or mine[key].store is not store:
        mine[key] = checkpoint_manager(accelerator, store, job, ref=ref, preempt_signals=(), store_size_every=None)
    return mine[key]


def save_state(accelerator, store, job: str, *, step: int | None = None, ref: str | None = None,
               metrics: dict | None = None, blocking: bool = True):
    """accelerator.save_state() into the store: one snapshot at step `step` (default: the
    checkpoint counter, as save_state names its folder checkpoint_<iteration>), pruned by
    ProjectConfiguration(total_limit=). -> SnapshotInfo once it is committed and the
    job pruned, as save_state returns once its folder is written and the oldest deleted;
    blocking=False: a Future (store.wait() or store.close() waits for it), its prune run
    in the background after it commits (one the process's end cuts short is done by the
    job's next prune, or by `tsck gc`: the rules are kept in the store). Under DDP every
    rank calls it."""
    mgr = _manager(accelerator, store, job, ref)
    mgr.async_ = not blocking
    n = accelerator.project_configuration.iteration if step is None else step
    res = mgr.step(n, metrics, force=True)
    if blocking:
        mgr.wait()
    return res


def load_state(accelerator, store, job: str, *, step: int | None = None, ref: str | None = None,
               must_exist: bool = False) -> int | None:
    """accelerator.load_state() from the store: the newest snapshot of the job's ref (or
    the one at `step`) put back into the accelerator's objects, epochs and counters
    included. -> its step; None when there is none (must_exist=True: RefNotFound naming
    the store and the refs it holds). Under DDP every rank calls it."""
    mgr = _manager(accelerator, store, job, ref)
    if step is not None:
        return mgr.restore(step)
    return mgr.restore_latest(must_exist=must_exist)
