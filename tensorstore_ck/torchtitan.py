"""torchtitan: its own CheckpointManager, saving to and resuming from a store.

    from tensorstore_ck.torchtitan import TsckCheckpointManager

    config.checkpoint = TsckCheckpointManager.Config(
        enable=True, store="/data/ckpt", job="llama3-8b", interval=500, keep_latest_k=5)

or on the command line of a config whose checkpoint is this Config:

    --checkpoint.store s3://bucket/ckpt --checkpoint.job llama3-8b

torchtitan's Trainer builds whichever class owns `config.checkpoint`, so this one line
is the whole change: every rank opens the store, every save is ONE collective snapshot
of every rank's state (dcp.save through tensorstore_ck.dcp.TsckWriter, at ref
"JOB/main", step N: deduplicated, verified, published atomically), and a restart finds
the newest snapshot in the store instead of the newest `step-N/.metadata` folder.

What torchtitan's manager does keeps its meaning:

- `interval`, `enable_first_step_checkpoint`, `load_only`, `last_save_model_only`,
  `export_dtype`, `create_seed_checkpoint`: unchanged (torchtitan's own code decides
  when and what to save).
- `async_mode`: "disabled" (dcp.save), "async" (dcp.async_save in a thread: the step
  waits only for the copy to host memory), "async_with_pinned_mem" (DCP's process
  checkpointer with pinned staging buffers; it needs an accelerator, and the writer is
  sent to another process, which only a store on a local folder with its ref table
  beside it allows).
- `load_step` (load(step=N)): the snapshot of step N (`JOB/main@N`); a step the store
  does not keep is tsck.RefNotFound.
- `exclude_from_loading`: those states keep their values; a name that is not one of the
  manager's states is tsck.InvalidArgument when the manager is built.
- `initial_load_path` (and its `_model_only`, `_in_hf` options): when the store holds no
  snapshot of the job, the run starts from that folder, read as torchtitan reads it; once
  the job has a snapshot, a restart resumes from the store and the folder is not read.
- `keep_latest_k` = K > 0: the job's retention in the store is Retention(keep_last=K)
  (set by rank 0 when the manager is built), applied after each committed snapshot by
  a prune on rank 0's thread (store.prune: what only the expired snapshots hold is
  deleted; blocks shared with kept ones stay), and once more at close() (torchtitan's
  final save does not purge). 0 leaves the job's rules as they are.
- `last_save_in_hf`: refused (tsck.InvalidArgument): a store holds snapshots, not
  safetensors folders; export the final snapshot instead, e.g.
  `tsck export-weights STORE JOB/main out.safetensors`.
- `folder` is not used: nothing is written there.

Fields of its own: `store` (a URL or path for tsck.open_store), `job` (the job name:
its ref is JOB/main, its retention the job's), `refs` (a PostgreSQL DSN when the ranks
run on several hosts and share one ref table; None: the table beside the data).

This module imports torchtitan (the `[torchtitan]` extra); the rest of the package
does not.
"""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.utils import GarbageCollection

from .dcp import TsckReader, TsckWriter
from .errors import InvalidArgument, RefNotFound
from .format.names import parse_target, validate_component
from .maintain.retention import Retention
from .opener import open_store
from .train.pruner import Pruner

__all__ = ["TsckCheckpointManager"]

log = logging.getLogger(__name__)


def _dist():
    """torch.distributed (imported when the manager is made: the package's modules outside
    dcp/ do not import it at their own import)."""
    import torch.distributed as dist
    return dist


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class TsckCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager with a tensorstore_ck store in place of its folder
    (the module docstring says what each setting means here)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        store: str = ""
        """The store: a path or URL for tsck.open_store (file, s3://, any fsspec URL)."""

        job: str = ""
        """The job's name: snapshots go to ref JOB/main; keep_latest_k is the job's retention."""

        refs: str | None = None
        """The ref table (a postgresql:// DSN for ranks on several hosts); None: beside the data."""

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.enable:
                if not isinstance(self.store, str) or not self.store.strip():
                    raise InvalidArgument("checkpoint.store: give the store's path or URL "
                                          "(--checkpoint.store URL)")
                validate_component(self.job, "checkpoint.job")
                if self.last_save_in_hf:
                    raise InvalidArgument(
                        "checkpoint.last_save_in_hf writes a Hugging Face safetensors folder, which a store does "
                        "not hold: leave it False and export the final snapshot, e.g. `tsck export-weights "
                        f"{self.store} {self.job}/main@STEP model.safetensors`")

    def __init__(self, config: Config, **kwargs: Any) -> None:
        # torchtitan's purge thread removes folders; retention in the store takes its place.
        super().__init__(dataclasses.replace(config, keep_latest_k=0), **kwargs)
        if not self.enable:
            return
        self.keep_latest_k = config.keep_latest_k
        self.job = config.job
        self.ref = f"{config.job}/main"
        for name in self.exclude_from_loading:
            if name not in self.states:
                raise InvalidArgument(f"checkpoint.exclude_from_loading names {name!r}, which is not one of the "
                                      f"states this manager saves: {sorted(self.states)}")
        dist = _dist()
        collective = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # Rank 0 creates a new store before the others open it (ranks racing to create one
        # could each find its ref table half made).
        if _rank() == 0:
            self.store = open_store(config.store, refs=config.refs)
        if collective:
            dist.barrier()
        if _rank() != 0:
            self.store = open_store(config.store, refs=config.refs, create=False)
        self._pruner: Pruner | None = None
        if self.keep_latest_k > 0 and _rank() == 0:
            self.store.set_retention(self.job, Retention(keep_last=self.keep_latest_k))
            self._pruner = Pruner(self.store, self.job)
        log.info("checkpoints of job %s go to %s (ref %s)", self.job, config.store, self.ref)

    # -- where a step lives ---------------------------------------------------------------
    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        return f"{self.ref}@{step}"

    def _find_load_step(self, folder: str = "") -> int:
        """The step of the job's newest snapshot in the store; -1 if it has none."""
        try:
            kept = self.store.log(self.ref)
        except RefNotFound:
            return -1
        return kept[0].step if kept else -1

    # -- saving ---------------------------------------------------------------------------
    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False):
        if to_hf:  # (the Config refuses last_save_in_hf; a direct call is refused alike)
            raise InvalidArgument("TsckCheckpointManager does not save Hugging Face safetensors folders")
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
        _kind, ref, step = parse_target(checkpoint_id)
        if self._pruner is not None:
            self._pruner.wait()  # the job's own deletion phase never meets its next snapshot
        writer = TsckWriter(self.store, ref=ref, step=step, job=self.job)
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg,
                                 async_checkpointer_type=AsyncCheckpointerType.PROCESS, async_stager=self.stager)
        else:
            ret = dcp.save(state_dict, storage_writer=writer)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def _purge_stale_checkpoints(self) -> None:
        """Retention instead of rmtree: rank 0 prunes the job once its snapshot is committed."""
        if self._pruner is None:
            return
        fut = self.save_future
        if isinstance(fut, Future) and not fut.done():
            pruner = self._pruner
            fut.add_done_callback(lambda f: pruner.request() if not f.cancelled() and f.exception() is None
                                  else None)
        else:
            self._pruner.request()

    # -- loading --------------------------------------------------------------------------
    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """Load a snapshot of the store (checkpoint_id: a target, "JOB/main@STEP")."""
        import torch.distributed.checkpoint as dcp
        dcp.load(state_dict, storage_reader=TsckReader(self.store, checkpoint_id))
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        if step != -1:
            load_step = step
            target = self._create_checkpoint_id(step)
            self.store.resolve(target)  # RefNotFound: the store keeps no snapshot of that step
        else:
            load_step = self._find_load_step()
        if load_step == -1:
            return self._initial_load()
        target = self._create_checkpoint_id(load_step)
        log.info("loading the checkpoint %s from %s", target, self.store.url)
        self.dcp_load(self._states_to_load(load_step == 0), target, from_hf=False, from_quantized=False)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        return True

    def _initial_load(self) -> bool:
        """No snapshot of the job yet: torchtitan's own first load (initial_load_path, or the
        model's Hugging Face assets), read from files as torchtitan's manager reads them."""
        from_hf, from_quantized = self.initial_load_in_hf, self.initial_load_in_hf_quantized
        if self.initial_load_path:
            path, what = self.initial_load_path, "checkpoint.initial_load_path"
        elif from_hf:
            path, what = getattr(self.sd_adapter, "hf_assets_path", None), "model.hf_assets_path"
        else:
            log.info("no snapshot of job %s in %s: a fresh start", self.job, self.store.url)
            return False
        if not path or not filesystem.isdir(path):
            raise InvalidArgument(f"{what} is not a folder: {path!r} (the store holds no snapshot of job "
                                  f"{self.job} to resume from)")
        log.info("no snapshot of job %s in %s: loading %s", self.job, self.store.url, path)
        CheckpointManager.dcp_load(self, self._states_to_load(self.initial_load_model_only), checkpoint_id=path,
                                   from_hf=from_hf, from_quantized=from_quantized)
        GarbageCollection.collect("GC collection for checkpoint loading.")
        return True

    def _close(self) -> None:
        try:
            if getattr(self, "save_future", None) is not None:
                fut, self.save_future = self.save_future, None
                fut.result()  # the store stays open until the last snapshot has ended
            pruner = getattr(self, "_pruner", None)
            if pruner is not None:  # once more: torchtitan's final save (last_step) does not purge
                pruner.request()
                pruner.wait()
                pruner.close()
        finally:
            super()._close()
            store = getattr(self, "store", None)
            if store is not None:
                store.close()
