"""Hugging Face: a Trainer's checkpoints as snapshots, resumed exactly; model folders in and out.

    from tensorstore_ck import open_store, hf
    store = open_store("ckpts")
    trainer = Trainer(model, args, train_dataset=ds, callbacks=[hf.TsckCallback(store, job="run1")])
    trainer.train()                      # every save: a snapshot at ref "run1/main"
    ...                                  # killed; later, in a fresh process:
    path = hf.resume_checkpoint(store, "run1/main", args.output_dir)
    trainer.train(resume_from_checkpoint=path)     # continues bit-identically

    hf.export_pretrained(store, "run1/main", "out/")   # a folder from_pretrained loads
    hf.import_pretrained(store, "out/", ref="base/main")

A Trainer snapshot holds {"model": state_dict, "optimizer", "scheduler"[, "scaler"],
"rng": {python, numpy, torch, cuda} (train.capture_rng), "trainer_state": the text of
trainer_state.json[, "files": the other files of the folder, the tokenizer's and processor's,
as bytes]}; its meta["hf"] says where the weights are and carries config.json
(hf_folder.HF_META), meta["hf_trainer"] the layout and the transformers version.
resume_checkpoint writes them back as the checkpoint-N folder this transformers
version's Trainer reads (model.safetensors, optimizer.pt, scheduler.pt, scaler.pt,
rng_state.pth, trainer_state.json, config.json, the tokenizer's files), so the Trainer's own resume path
(data skipping included) does the rest. This module imports transformers; the rest
of the package does not.

Under torchrun (DDP, world_size W > 1) every rank's callback takes part in ONE
collective snapshot per save: the model's parameters and the optimizer's state are
the same on every rank, so they are stored as tsck.Replicated (each block written
once, by one rank); "rng" is each rank's own, and "rng_ranks" holds all W ranks'
streams (gathered at the save: a few KB per rank), so any single process can write
every rng_state_{r}.pth the Trainer reads. resume_checkpoint is then collective too:
every rank calls it, one writes the folder, every rank returns its path.

    trainer = Trainer(..., callbacks=[hf.TsckCallback(store, job="run1", keep_local=False)])
    trainer.train(resume_from_checkpoint=True)   # "latest": the store's newest snapshot
"""

from __future__ import annotations

import dataclasses
import json
import logging
import numbers
import os
import re
import shutil
import signal

import torch
import transformers
from transformers import TrainerCallback

from .errors import InvalidArgument, RefNotFound
from .interchange.hf_folder import (FILE_NAME, HF_META, MAX_CONFIG_BYTES, MAX_FILE_BYTES, MAX_FILES, SHARD_BYTES,
                                    config_text, trainer_file, check_kept_files, export_folder, write_kept_files, write_pretrained)
from .interchange.importing import import_files
from .maintain.retention import Retention
from .train import capture_rng
from .train.preempt import DEFAULT_GRACE, Preempted, PreemptSignals, preempt_options, any_rank_preempted
from .train.pruner import Pruner
from .util.localfile import NotRegularFile, open_regular, write_dir
from .write.shard import Replicated

__all__ = ["TsckCallback", "resume_checkpoint", "export_pretrained", "import_pretrained", "trainer_state",
           "LAYOUT"]

log = logging.getLogger(__name__)

LAYOUT = 1  # of a Trainer snapshot (meta["hf_trainer"]["layout"]); resume_checkpoint refuses others
_SCALER = "scaler.pt"  # transformers.trainer.SCALER_NAME
MAX_RANKS = 1 << 16  # rng_ranks of a stored snapshot: one rng_state_{r}.pth is written per entry
_CHECKPOINT = re.compile(r"^checkpoint-([0-9]+)$")  # transformers.trainer_utils' PREFIX_CHECKPOINT_DIR


def _folder_files(folder: str) -> dict:
    """{name: bytes} of the files in a Trainer's checkpoint folder that the snapshot keeps as
    files: every regular file at its top that is not the Trainer's own. Subfolders, links and
    odd names are left out with a warning: resume_checkpoint could not write them back."""
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    out = {}
    for name in names:
        if trainer_file(name):
            continue
        path = os.path.join(folder, name)
        if not FILE_NAME.match(name) or os.path.islink(path) or not os.path.isfile(path) or len(out) >= MAX_FILES:
            log.warning("%s: not kept in the snapshot (only up to %d regular files with plain names are)", path,
                        MAX_FILES)
            continue
        try:
            fd = open_regular(path)
        except (FileNotFoundError, NotRegularFile):
            continue
        with open(fd, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            log.warning("%s is larger than %d bytes: not kept in the snapshot", path, MAX_FILE_BYTES)
            continue
        out[name] = data
    return out


def _file_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


def _dist_world() -> int:
    """The default process group's size; 1 when torch.distributed is not initialised."""
    import torch.distributed as dist
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _replicated(sd: dict, same: set) -> dict:
    """state_dict with the tensors whose storage is in `same` (data_ptrs) as Replicated."""
    return {k: Replicated(v) if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in same else v
            for k, v in sd.items()}


def _optimizer_replicated(osd: dict) -> dict:
    """An optimizer's state_dict with every tensor of its per-parameter state Replicated
    (under DDP each rank steps the same parameters with the same all-reduced gradients)."""
    state = osd.get("state")
    if not isinstance(state, dict):
        return osd
    return {**osd, "state": {i: {k: Replicated(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                             if isinstance(st, dict) else st for i, st in state.items()}}


def _tied(sd: dict) -> dict:
    """{name: the name it shares memory with} in a state_dict: the keys save_pretrained
    leaves out (GPT-2's lm_head.weight is transformer.wte.weight)."""
    first: dict = {}
    out = {}
    for k, t in sd.items():
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        key = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), t.dtype, tuple(t.shape), t.stride())
        if key in first:
            out[k] = first[key]
        else:
            first[key] = k
    return out


def _small(text: str | None, what: str) -> str | None:
    if text is not None and len(text.encode("utf-8")) > MAX_CONFIG_BYTES:
        log.warning("%s is larger than %d bytes: not kept in the snapshot's meta (export_pretrained then "
                    "needs config=)", what, MAX_CONFIG_BYTES)
        return None
    return text


def _metrics(log_history) -> dict:
    """The newest value of each number the Trainer logged (loss, learning_rate, eval_*)."""
    out = {}
    for entry in log_history or ():
        for k, v in entry.items():
            if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool) and v == v:
                out[k] = v
    return out


def trainer_state(model, optimizer, lr_scheduler, state, *, scaler: dict | None = None,
                  rng_ranks: list | None = None, files: dict | None = None) -> tuple[dict, dict]:
    """(snapshot state, meta) of a Trainer at a save: what TsckCallback puts. files:
    {name: bytes} kept as they are (the tokenizer's and processor's files). rng_ranks
    (a run of W > 1 processes: every rank's capture_rng(), in rank order) makes the
    snapshot one rank's part of a collective one: the parameters and the optimizer's
    state are then Replicated (DDP keeps them equal on every rank; buffers stay each
    rank's own, as a rank's forward may update them)."""
    sd = model.state_dict()
    opt = optimizer.state_dict()
    stored = sd
    if rng_ranks is not None:
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        stored, opt = _replicated(sd, params), _optimizer_replicated(opt)
    snap = {
        "model": stored,
        "optimizer": opt,
        "scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "rng": capture_rng(),
        # what Trainer._save_checkpoint wrote to trainer_state.json, to the byte
        "trainer_state": json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n",
    }
    if rng_ranks is not None:
        snap["rng_ranks"] = list(rng_ranks)
    if scaler is not None:
        snap["scaler"] = scaler
    if files:  # each rank's part holds the same bytes: written once
        wrap = Replicated if rng_ranks is not None else (lambda t: t)
        snap["files"] = {k: wrap(_file_tensor(v)) for k, v in files.items()}
    hf = {"weights": "model", "tied": _tied(sd)}
    if files:
        hf["files"] = "files"  # where export_folder finds them
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        hf["config"] = _small(config.to_json_string(), "config.json")
    gen = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if gen is not None and callable(can_generate) and can_generate():
        hf["generation_config"] = _small(gen.to_json_string(), "generation_config.json")
    hf = {k: v for k, v in hf.items() if v is not None}
    meta = {HF_META: hf, "hf_trainer": {"layout": LAYOUT, "transformers": transformers.__version__}}
    return snap, meta


def _read_scaler(path: str) -> dict | None:
    """The grad scaler's state the Trainer saved at `path`; None when there is none (or
    something other than a regular file is there: never waited on, as a FIFO would be)."""
    try:
        fd = open_regular(path)
    except (FileNotFoundError, NotRegularFile):
        return None
    with open(fd, "rb") as f:
        return torch.load(f, map_location="cpu", weights_only=True)


class TsckCallback(TrainerCallback):
    """Snapshots the run into `store` at every save of the Trainer (on_save, after it
    wrote its checkpoint-N folder): the model's state_dict, optimizer, LR scheduler,
    grad scaler (read from the scaler.pt the Trainer just wrote: a callback is not
    handed the accelerator), every RNG stream and the TrainerState, at ref
    `ref` (default f"{job}/main"), step = global_step, metrics = the newest logged
    numbers. resume_checkpoint() turns a snapshot back into a folder to resume from.

    keep_local=False deletes the checkpoint-N folder once its snapshot is committed, so
    the store holds the only copy (refused with load_best_model_at_end or push_to_hub,
    which read those folders later). async_=True (the default, as for CheckpointManager)
    snapshots in the background: the state is staged (copied) first, so training goes on
    at once and cannot change what is stored; a failure is raised at the next save or at
    on_train_end, which waits for every snapshot in flight. A process killed while a put
    is in flight resumes from the save before (with keep_local=False that save's folder
    is still there: folders go only once committed). async_=False: each save returns
    once its snapshot is committed.

    latest=True: when the Trainer is built (on_init_end, before train() resolves
    resume_from_checkpoint=True to output_dir's newest checkpoint-N), the ref's newest
    snapshot is written to output_dir as its checkpoint-N folder if output_dir holds no
    checkpoint of that step or a later one; so train(resume_from_checkpoint=True) resumes
    from the store when it holds the only copy (keep_local=False, a fresh output_dir).
    Pass the callback in Trainer(callbacks=[...]) for that: add_callback() comes after
    on_init_end. With keep_local=False that folder goes again at the next save.

    Files the Trainer writes beside the model (the processing class's: tokenizer.json,
    tokenizer_config.json, vocab.json, merges.txt, chat_template.jinja, preprocessor_config.json,
    ...) are kept in the snapshot as bytes and written back by resume_checkpoint.

    retention=: the job's rules, set in the store; without it, the Trainer's
    save_total_limit N sets Retention(keep_last=N) for the job, and with
    load_best_model_at_end also keep_best=1 by metric_for_best_model (the Trainer keeps
    the best folder past the limit: the store keeps the N newest and the best). Rules the callback sets
    it also applies (prune=None means: when it sets rules): after each committed
    snapshot the world's process zero prunes the job on a thread (store.prune), as the
    Trainer deletes its older folders; prune=False leaves that to `tsck gc`.

    Many processes (torchrun, DDP: world_size > 1): every rank carries the callback, and
    each save is ONE collective snapshot of every rank's state (the parameters and the
    optimizer's state Replicated: written once; each rank's RNG streams; see the module
    docstring). The folders are written and deleted by the processes that write the
    Trainer's own (args.should_save). Sharded training (FSDP, DeepSpeed) is refused
    with InvalidArgument: its ranks hold different pieces of the parameters and
    optimizer state, which the Trainer saves through accelerate, not in on_save's
    arguments.

    Preemption, as CheckpointManager's (train/preempt.py): SIGTERM (and the signals in
    preempt_signals=; () catches none) is noted, chained to the handler installed before;
    at the next step's end (every rank agreeing: one rank's signal is enough) the Trainer
    is told to save and stop; that save is blocking, its upload awaited for what is left
    of preempt_grace= seconds, and on_save raises tsck.Preempted (exit status 143 left
    alone; `preempted` keeps it). No step ending within the grace: the process ends then,
    as the signal would have ended it. Make the callback in the main thread."""

    def __init__(self, store, *, job: str, ref: str | None = None, keep_local: bool = True, async_: bool = True,
                 retention=None, prune: bool | None = None, latest: bool = True,
                 preempt_signals=(signal.SIGTERM,), preempt_grace: float = DEFAULT_GRACE):
        preempt_signals, preempt_grace = preempt_options(preempt_signals, preempt_grace)
        self.store = store
        self.job = job
        self.ref = ref or f"{job}/main"
        self.keep_local = keep_local
        self.async_ = async_
        self.latest = latest
        self.last = None  # SnapshotInfo (or Future) of the newest snapshot
        self._pending: list = []  # (put result, the Trainer's folder it replaces)
        self._restored: list = []  # folders written from the store at init (keep_local=False: removed at a save)
        self._retention = retention
        self._prune = prune
        self._pruner = None
        self._set_up = False
        if retention is not None:
            store.set_retention(job, retention)
        self.preempted: Preempted | None = None  # set by a preemption's save (on_save raises it)
        self._stopping = False  # a preemption agreed: the Trainer's next save is the final one
        self._preempt = PreemptSignals(preempt_signals, preempt_grace)  # last: a handler is process state

    def on_step_end(self, args, state, control, **kwargs):
        seen = self._preempt.seen
        if args.world_size > 1:  # every rank, every step: one rank's signal is everyone's, at one step
            seen = any_rank_preempted(seen)
        if seen:
            self._preempt.saving = True  # (the watchdog lets the save end)
            self._stopping = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def _save_preempted(self, put, step: int) -> None:
        """The final save of a preemption: after the snapshots in flight, blocking, its
        upload awaited for the grace left; then Preempted, raised."""
        pre = self._preempt
        why, durable, res = "", False, None
        try:
            self.store.wait()
        except Exception:  # noqa: BLE001 - an earlier snapshot's failure: the final one still goes
            pass
        try:
            res = put()
            self.last = res
            durable = bool(self.store.wait_durable(timeout=pre.remaining()))
            if not durable:
                why = f"its upload did not end within the grace ({pre.grace:g} s); the local tier keeps it"
        except Exception as e:  # noqa: BLE001 - said in the exception the process ends with
            why = f"the final snapshot failed: {type(e).__name__}: {e}"
        pre.done()
        signum = pre.signum if pre.signum is not None else signal.SIGTERM  # (another rank's signal)
        self.preempted = Preempted(step if res is not None else None, signum=int(signum), durable=durable,
                                   why=why, close_by=pre.ends_at())
        pre.close()
        raise self.preempted

    def _setup(self, args) -> None:
        """The job's retention from save_total_limit, and the pruner; once (on_init_end,
        or on_train_begin when the callback was added after the Trainer was built)."""
        if self._set_up:
            return
        self._set_up = True
        rules = self._retention
        if rules is None and args.save_total_limit:
            rules = _limit_rules(args)
            if args.process_index == 0:
                self.store.set_retention(self.job, rules)
        if rules is not None and self._prune is not False and args.process_index == 0:
            self._pruner = Pruner(self.store, self.job)

    def on_init_end(self, args, state, control, **kwargs):
        self._setup(args)
        if self.latest:
            path = _write_latest(self.store, self.ref, args)
            if path is not None and not self.keep_local and args.should_save:
                self._restored.append(path)

    def on_train_begin(self, args, state, control, **kwargs):
        self._setup(args)
        if args.world_size > 1:
            if _dist_world() != args.world_size:
                raise InvalidArgument(f"TsckCallback: the Trainer runs {args.world_size} processes but "
                                      "torch.distributed is not initialised with as many (launch with torchrun)")
            sharded = _sharded_by(kwargs.get("model"))
            if sharded:
                raise InvalidArgument(
                    f"TsckCallback snapshots DDP runs (every rank holds the whole model and optimizer); this one "
                    f"runs {sharded}, whose ranks hold pieces of them that the Trainer saves through accelerate. "
                    "Use DDP (no fsdp=/deepspeed=), or put the sharded state yourself as one collective snapshot "
                    "on every rank: tsck.CheckpointManager, or store.put_snapshot of "
                    "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer) (DTensors)")
        if not self.keep_local and (args.load_best_model_at_end or args.push_to_hub):
            raise InvalidArgument("TsckCallback(keep_local=False) deletes the Trainer's checkpoint folders, which "
                                  "load_best_model_at_end and push_to_hub read later: keep them (keep_local=True)")

    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        collective = args.world_size > 1
        if not collective and not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        scaler = _read_scaler(os.path.join(folder, _SCALER))
        rng_ranks = None
        files = _folder_files(folder) if state.is_world_process_zero else None
        if collective:  # every rank's streams in every rank's part: one process can write all rng_state_{r}.pth
            import torch.distributed as dist
            rng_ranks = [None] * args.world_size
            dist.all_gather_object(rng_ranks, capture_rng())
            sent = [files]  # process zero's folder: every rank's part holds the same files (Replicated)
            dist.broadcast_object_list(sent, src=0)
            files = sent[0]
            if self._pruner is not None:
                self._pruner.wait()  # the job's own deletion phase never meets its next snapshot
        snap, meta = trainer_state(model, optimizer, lr_scheduler, state, scaler=scaler, rng_ranks=rng_ranks,
                                   files=files)
        put = lambda blocking: self.store.put_snapshot(  # noqa: E731
            snap, ref=self.ref, job=self.job, step=state.global_step, metrics=_metrics(state.log_history),
            meta={**meta, "triggers": ["preempted"]} if self._stopping else meta, blocking=blocking)
        if self._stopping:
            self._save_preempted(lambda: put(True), state.global_step)
        res = put(not self.async_)
        self.last = res
        if self._pruner is not None:
            if collective and hasattr(res, "add_done_callback"):
                # Asynchronous and collective: behind the snapshot on the background publisher,
                # before the next one (as CheckpointManager does): never beside its own snapshots.
                self.store.after_in_flight(lambda: self._pruner.run_after(res))
            elif hasattr(res, "add_done_callback"):
                res.add_done_callback(self._pruner.after)
            else:
                self._pruner.request()
        if not self.keep_local and args.should_save:
            self._pending.append((res, folder))
        self._remove_committed()

    def on_train_end(self, args, state, control, **kwargs):
        self._preempt.close()
        self.store.wait()
        self._remove_committed()
        if self._pruner is not None:
            self._pruner.wait()
        self.store.raise_pending_error()

    @property
    def prune_errors(self) -> list:
        """The errors of the background prunes that failed (logged; the next save tries again)."""
        return [] if self._pruner is None else list(self._pruner.errors)

    def _remove_committed(self) -> None:
        """Delete the Trainer's folders whose snapshots are committed (keep_local=False);
        a failed snapshot keeps its folder. Here, on the training thread: not in a
        future's callback, which may run after on_train_end returned. A folder written
        from the store at init goes too: the store holds it, and the Trainer has read it
        before its first step."""
        for folder in self._restored:
            shutil.rmtree(folder, ignore_errors=True)
        self._restored = []
        left = []
        for res, folder in self._pending:
            if not hasattr(res, "done"):  # a blocking put: committed when it returned
                shutil.rmtree(folder, ignore_errors=True)
            elif not res.done():
                left.append((res, folder))
            elif not res.cancelled() and res.failure() is None:  # looking is not the caller retrieving it
                shutil.rmtree(folder, ignore_errors=True)
        self._pending = left


def _limit_rules(args) -> Retention:
    """The job's rules for the Trainer's save_total_limit N: the N newest snapshots, and
    with load_best_model_at_end also the best by metric_for_best_model (the Trainer keeps
    that folder past the limit: its rotation never deletes state.best_model_checkpoint).
    The store then keeps what the Trainer keeps, or one more: the Trainer counts the best
    among its N folders, the store keeps the N newest and the best."""
    n = int(args.save_total_limit)
    if not (args.load_best_model_at_end and args.metric_for_best_model):
        return Retention(keep_last=n)
    metric = args.metric_for_best_model  # as Trainer._determine_best_metric names it in the logs
    if not metric.startswith("eval_"):
        metric = f"eval_{metric}"
    return Retention(keep_last=n, keep_best=1, metric=metric, mode="max" if args.greater_is_better else "min")


def _sharded_by(model) -> str | None:
    """What shards this run's model and optimizer over the ranks (accelerate's FSDP or
    DeepSpeed, a model of DTensors), or None. Asked of accelerate, not of args.fsdp:
    accelerate turns FSDP on for accelerator devices only, so fsdp= with use_cpu=True
    trains plain DDP."""
    try:
        from accelerate.state import AcceleratorState
        if getattr(AcceleratorState, "_shared_state", None):  # the Trainer's Accelerator's state, not a new one
            kind = str(AcceleratorState().distributed_type).rsplit(".", 1)[-1]
            if kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
                return kind
    except ImportError:  # pragma: no cover - transformers' Trainer needs accelerate
        pass
    if model is not None:
        from .write.shard import is_dtensor
        if type(model).__name__ == "FullyShardedDataParallel" or any(is_dtensor(p) for p in model.parameters()):
            return "FSDP"
    return None


def _newest_local(output_dir: str) -> int | None:
    """The step of output_dir's newest checkpoint-N folder (what get_last_checkpoint picks)."""
    try:
        names = os.listdir(output_dir)
    except (FileNotFoundError, NotADirectoryError):
        return None
    steps = [int(m.group(1)) for n in names if (m := _CHECKPOINT.match(n))
             and os.path.isdir(os.path.join(output_dir, n))]
    return max(steps, default=None)


def _write_latest(store, ref: str, args) -> str | None:
    """TsckCallback(latest=True) at the Trainer's init: the ref's newest snapshot as
    output_dir/checkpoint-N unless output_dir already has a checkpoint of step >= N.
    Under many processes the world's process zero decides (so every rank resumes from
    the same snapshot) and the processes that write the Trainer's folders write it.
    -> its path, or None when nothing was written."""
    out = os.path.abspath(os.fspath(args.output_dir))

    def decide():
        try:
            info = store.show(ref)
        except RefNotFound:
            return None
        have = _newest_local(out)
        return None if have is not None and info.step is not None and have >= info.step else (info.root, info.step)

    if args.world_size <= 1:
        got = decide()
        if got is None:
            return None
        path = _WRITTEN[(out, got[0])] = resume_checkpoint(store, got[0], out, group=False)
        return path
    import torch.distributed as dist
    msg = [None]
    if dist.get_rank() == 0:
        try:
            msg = [("ok", decide())]
        except Exception as e:  # noqa: BLE001 - told to every rank, raised on every rank
            msg = [(type(e).__name__, str(e))]
    dist.broadcast_object_list(msg, src=0)
    if msg[0][0] != "ok":
        raise _told(*msg[0])
    got = msg[0][1]
    if got is None:
        return None
    root, step = got
    writes = args.should_save and not os.path.isdir(os.path.join(out, f"checkpoint-{step}"))
    path = _WRITTEN[(out, root)] = resume_checkpoint(store, root, out, writer=writes)
    return path


def _hf_rng(rng: dict, *, distributed: bool = False) -> dict:
    """train.capture_rng's streams in the layout of the Trainer's rng_state.pth (one
    process: the current CUDA device's state under "cuda"; one of many: every device's,
    as the Trainer saves rng_state_{r}.pth under DDP)."""
    out = {"python": rng["python"], "numpy": rng["numpy"], "cpu": rng["torch"]}
    cuda = rng.get("cuda")
    if cuda and torch.cuda.is_available():
        out["cuda"] = list(cuda) if distributed else cuda[min(torch.cuda.current_device(), len(cuda) - 1)]
    return out


def _is_rng(rng) -> bool:
    return isinstance(rng, dict) and all(k in rng for k in ("python", "numpy", "torch")) \
        and isinstance(rng.get("cuda", [None]), (list, tuple)) and bool(rng.get("cuda", [None]))


MAX_STEP = 2**63 - 1  # a step as the store keeps one (int64)


def _trainer_snapshot(store, target: str, root: str | None = None) -> tuple[dict, dict, str, int]:
    """(state, meta["hf"], trainer_state text, global_step) of a snapshot TsckCallback
    took, every stored value resume_checkpoint uses checked first: stored values are
    untrusted, and global_step names the folder written (checkpoint-N), so it must be
    an int >= 0, never text such as "../../x". InvalidArgument naming the snapshot."""
    root = store.resolve(target) if root is None else root
    where = f"snapshot {root[:16]} ({target}) of {store.url}"

    def refuse(why: str) -> InvalidArgument:
        return InvalidArgument(f"{where} is not a Trainer snapshot TsckCallback took: {why}")

    info = store.show(root)
    tr = info.meta.get("hf_trainer")
    if not isinstance(tr, dict) or tr.get("layout") != LAYOUT:
        raise InvalidArgument(f"{where} is not a Trainer snapshot of layout {LAYOUT} (TsckCallback takes them); "
                              f"its meta has hf_trainer={tr!r:.200}")
    hf = info.meta.get(HF_META)
    hf = {} if hf is None else hf
    if not isinstance(hf, dict):
        raise refuse(f"its meta[{HF_META!r}] is a {type(hf).__name__}, not a dict")
    tied = hf.get("tied")
    if tied is not None and not (isinstance(tied, dict)
                                 and all(type(k) is str and type(v) is str for k, v in tied.items())):
        raise refuse(f"its meta[{HF_META!r}]['tied'] is not a dict of names")
    hf = dict(hf)
    for k in ("config", "generation_config"):  # as export_pretrained takes them: JSON objects, as text
        hf[k] = config_text(hf.get(k), f"the {k.replace('_', ' ')} of {where}")
    state = store.checkout(root, group=False)  # this process alone: one rank writes the folder
    if not isinstance(state, dict):
        raise refuse(f"it holds a {type(state).__name__}, not a dict")
    missing = [k for k in ("model", "optimizer", "rng", "trainer_state") if k not in state]
    if missing:
        raise refuse(f"it has no {', '.join(map(repr, missing))}")
    model = state["model"]
    if not isinstance(model, dict) or not all(type(k) is str and isinstance(v, torch.Tensor)
                                              for k, v in model.items()):
        raise refuse("its 'model' is not a state_dict (names -> tensors)")
    if not _is_rng(state["rng"]):
        raise refuse("its 'rng' is not what train.capture_rng takes")
    ranks = state.get("rng_ranks")
    if ranks is not None and not (isinstance(ranks, (list, tuple)) and 1 <= len(ranks) <= MAX_RANKS
                                  and all(map(_is_rng, ranks))):
        raise refuse(f"its 'rng_ranks' is not a list of 1 to {MAX_RANKS} ranks' train.capture_rng streams")
    if state.get("files") is not None:
        check_kept_files(state["files"], refuse)
    ts = state["trainer_state"]
    if type(ts) is not str:
        raise refuse(f"its 'trainer_state' is a {type(ts).__name__}, not the text of trainer_state.json")
    try:
        parsed = json.loads(ts)
    except (ValueError, RecursionError) as e:
        raise refuse(f"its 'trainer_state' is not JSON ({str(e)[:100]})") from None
    step = parsed.get("global_step") if isinstance(parsed, dict) else None
    if type(step) is not int or not 0 <= step <= MAX_STEP:  # type(): bool is no step
        raise refuse(f"its trainer_state's global_step is {step!r:.80}, not an int >= 0")
    return state, hf, ts, step


def resume_checkpoint(store, target: str, output_dir, *, force: bool = False, writer: bool | None = None,
                      group=None) -> str:
    """Write the Trainer snapshot `target` (a ref: its newest snapshot; a root, a tag)
    as output_dir/checkpoint-N (N its global step), the folder
    trainer.train(resume_from_checkpoint=...) reads; -> its path. The folder appears
    whole; an existing one is written into only with force=True. InvalidArgument
    naming the snapshot when it is not one TsckCallback took (another layout, values
    missing or of the wrong kind, a global_step that is not an int >= 0), before
    anything is written.

    A snapshot of W > 1 processes gets every rank's rng_state_{r}.pth, as the Trainer
    writes them under DDP (a single one: rng_state.pth). Under torch.distributed
    (world > 1; group=False: this process alone) the call is collective: every rank
    calls it, rank 0 resolves `target` (so all write and read the same snapshot),
    the processes with writer=True (default: rank 0 only; under save_on_each_node,
    args.should_save) write the folder, and every rank returns its path once it is
    written, or raises the writer's error."""
    if group is not False and _dist_world() > 1:
        return _resume_collective(store, target, output_dir, force=force, writer=writer)
    return _write_checkpoint(store, target, output_dir, force=force)


def _told(kind: str, msg: str) -> Exception:
    """An error another rank raised, rebuilt on this one: the project's class of that name."""
    from . import errors
    cls = getattr(errors, kind, None)
    return cls(msg) if isinstance(cls, type) and issubclass(cls, errors.TsckError) else InvalidArgument(msg)


def _resume_collective(store, target: str, output_dir, *, force: bool, writer: bool | None) -> str:
    import torch.distributed as dist
    rank = dist.get_rank()
    msg = [None]
    if rank == 0:
        try:
            msg = [("ok", store.resolve(target))]
        except Exception as e:  # noqa: BLE001 - every rank raises it
            msg = [(type(e).__name__, str(e))]
    dist.broadcast_object_list(msg, src=0)
    if msg[0][0] != "ok":
        raise _told(*msg[0])
    root = msg[0][1]
    mine, err = None, None
    if rank == 0 if writer is None else writer:
        try:
            mine = _write_checkpoint(store, root, output_dir, force=force)
        except Exception as e:  # noqa: BLE001 - the others must not wait for a folder that never comes
            err = e
    told = [None] * dist.get_world_size()
    dist.all_gather_object(told, (os.path.basename(mine) if mine else None,
                                  None if err is None else (type(err).__name__, f"rank {rank}: {err}")))
    if err is not None:
        raise err
    for _name, e in told:
        if e is not None:
            raise _told(*e)
    names = {name for name, _e in told if name is not None}
    if len(names) != 1:  # no writer at all, or writers that read different steps: nothing to resume from
        raise InvalidArgument(f"resume_checkpoint of {target!r}: the ranks wrote {sorted(names) or 'no folder'} "
                              "(exactly one process per output_dir must write: writer=True)")
    return os.path.join(os.path.abspath(os.fspath(output_dir)), names.pop())


# (output_dir, root) -> the folder TsckCallback(latest=True) wrote there from that snapshot
# when the Trainer was built: a resume_checkpoint of the same snapshot afterwards (the
# recipe of the module docstring) gets that folder back instead of "exists".
_WRITTEN: dict = {}


def _write_checkpoint(store, target: str, output_dir, *, force: bool) -> str:
    output_dir = os.path.abspath(os.fspath(output_dir))
    root = store.resolve(target)
    done = _WRITTEN.get((output_dir, root))
    if done is not None and not force and os.path.isdir(done):
        return done
    state, hf, ts, step = _trainer_snapshot(store, target, root)
    os.makedirs(output_dir, exist_ok=True)
    dest = os.path.join(output_dir, f"checkpoint-{step}")
    tied = hf.get("tied") or {}
    model = {k: v for k, v in state["model"].items() if not (k in tied and tied[k] in state["model"])}
    ranks = state.get("rng_ranks")
    if ranks is None:
        rng_files = {"rng_state.pth": _hf_rng(state["rng"])}
    else:
        rng_files = {f"rng_state_{r}.pth": _hf_rng(x, distributed=True) for r, x in enumerate(ranks)}

    def fill(tmp: str) -> list:
        names = write_pretrained(tmp, model, config=hf.get("config"), generation_config=hf.get("generation_config"),
                                 max_shard_bytes=SHARD_BYTES)
        files = {"optimizer.pt": state["optimizer"], **rng_files}
        if state.get("scheduler") is not None:
            files["scheduler.pt"] = state["scheduler"]
        if state.get("scaler") is not None:
            files[_SCALER] = state["scaler"]
        for name, obj in files.items():
            torch.save(obj, os.path.join(tmp, name))
        with open(os.path.join(tmp, "trainer_state.json"), "w", encoding="utf-8") as f:
            f.write(ts)
        return names + list(files) + ["trainer_state.json"] + write_kept_files(tmp, state.get("files") or {})

    write_dir(dest, fill, force=force)
    return dest


def export_pretrained(store, target: str, folder, *, config=None, max_shard_bytes: int = SHARD_BYTES,
                      force: bool = False) -> dict:
    """The model of snapshot `target` as a folder from_pretrained loads (model.safetensors
    or shards + index, config.json): hf_folder.export_folder, which `tsck checkout
    TARGET DIR/` runs. config: a PretrainedConfig, dict or JSON text, when the snapshot
    carries none (or to replace its own)."""
    if config is not None and hasattr(config, "to_json_string"):
        config = config.to_json_string()
    return export_folder(store, target, folder, config=config, max_shard_bytes=max_shard_bytes, force=force)


def import_pretrained(store, folder, *, ref: str, step: int | None = None, job: str | None = None):
    """A save_pretrained folder (model.safetensors, shards + index, or pytorch_model.bin)
    as one snapshot at `ref`, its config.json carried in the meta: what `tsck import
    REF FOLDER` does. -> SnapshotInfo."""
    if not os.path.isdir(os.fspath(folder)):
        raise InvalidArgument(f"{folder} is not a folder (a Hugging Face model folder holds model.safetensors "
                              "and config.json)")
    return import_files(store, ref, [folder], step=step, job=job)
