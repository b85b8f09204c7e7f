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
trainer_state.json}; its meta["hf"] says where the weights are and carries config.json
(interchange.HF_META), meta["hf_trainer"] the layout and the transformers version.
resume_checkpoint writes them back as the checkpoint-N folder this transformers
version's Trainer reads (model.safetensors, optimizer.pt, scheduler.pt, scaler.pt,
rng_state.pth, trainer_state.json, config.json), so the Trainer's own resume path
(data skipping included) does the rest. This module imports transformers; the rest
of the package does not.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import numbers
import os
import shutil

import torch
import transformers
from transformers import TrainerCallback

from .errors import InvalidArgument
from .interchange import (HF_META, MAX_CONFIG_BYTES, SHARD_BYTES, _config_text, export_folder, import_files,
                          write_pretrained)
from .localfile import NotRegularFile, open_regular, write_dir
from .train import capture_rng

__all__ = ["TsckCallback", "resume_checkpoint", "export_pretrained", "import_pretrained", "trainer_state",
           "LAYOUT"]

log = logging.getLogger(__name__)

LAYOUT = 1  # of a Trainer snapshot (meta["hf_trainer"]["layout"]); resume_checkpoint refuses others
_SCALER = "scaler.pt"  # transformers.trainer.SCALER_NAME


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


def trainer_state(model, optimizer, lr_scheduler, state, *, scaler: dict | None = None) -> tuple[dict, dict]:
    """(snapshot state, meta) of a Trainer at a save: what TsckCallback puts."""
    sd = model.state_dict()
    snap = {
        "model": sd,
        "optimizer": optimizer.state_dict(),
        "scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
        "rng": capture_rng(),
        # what Trainer._save_checkpoint wrote to trainer_state.json, to the byte
        "trainer_state": json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n",
    }
    if scaler is not None:
        snap["scaler"] = scaler
    hf = {"weights": "model", "tied": _tied(sd)}
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
    which read those folders later). async_=True snapshots in the background (the
    state is staged first, so training goes on at once); on_train_end waits for them
    and raises a failure. retention=: the job's rules, set in the store (prune with
    store.prune(job) or `tsck gc`). Single process only (world_size 1): each rank's RNG
    differs and one ref holds one state."""

    def __init__(self, store, *, job: str, ref: str | None = None, keep_local: bool = True, async_: bool = False,
                 retention=None):
        self.store = store
        self.job = job
        self.ref = ref or f"{job}/main"
        self.keep_local = keep_local
        self.async_ = async_
        self.last = None  # SnapshotInfo (or Future) of the newest snapshot
        self._pending: list = []  # (put result, the Trainer's folder it replaces)
        if retention is not None:
            store.set_retention(job, retention)

    def on_train_begin(self, args, state, control, **kwargs):
        if args.world_size > 1:
            raise InvalidArgument(f"TsckCallback snapshots a single-process run; this one has world_size "
                                  f"{args.world_size} (use tensorstore_ck.dcp for a distributed run)")
        if not self.keep_local and (args.load_best_model_at_end or args.push_to_hub):
            raise InvalidArgument("TsckCallback(keep_local=False) deletes the Trainer's checkpoint folders, which "
                                  "load_best_model_at_end and push_to_hub read later: keep them (keep_local=True)")

    def on_save(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if not state.is_world_process_zero:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        scaler = _read_scaler(os.path.join(folder, _SCALER))
        snap, meta = trainer_state(model, optimizer, lr_scheduler, state, scaler=scaler)
        res = self.store.put_snapshot(snap, ref=self.ref, job=self.job, step=state.global_step,
                                      metrics=_metrics(state.log_history), meta=meta, blocking=not self.async_)
        self.last = res
        if not self.keep_local:
            self._pending.append((res, folder))
        self._remove_committed()

    def on_train_end(self, args, state, control, **kwargs):
        self.store.wait()
        self._remove_committed()
        self.store.raise_pending_error()

    def _remove_committed(self) -> None:
        """Delete the Trainer's folders whose snapshots are committed (keep_local=False);
        a failed snapshot keeps its folder. Here, on the training thread: not in a
        future's callback, which may run after on_train_end returned."""
        left = []
        for res, folder in self._pending:
            if not hasattr(res, "done"):  # a blocking put: committed when it returned
                shutil.rmtree(folder, ignore_errors=True)
            elif not res.done():
                left.append((res, folder))
            elif not res.cancelled() and res.failure() is None:  # looking is not the caller retrieving it
                shutil.rmtree(folder, ignore_errors=True)
        self._pending = left


def _hf_rng(rng: dict) -> dict:
    """train.capture_rng's streams in the layout of the Trainer's rng_state.pth (one
    process: the current CUDA device's state under "cuda")."""
    out = {"python": rng["python"], "numpy": rng["numpy"], "cpu": rng["torch"]}
    cuda = rng.get("cuda")
    if cuda and torch.cuda.is_available():
        out["cuda"] = cuda[min(torch.cuda.current_device(), len(cuda) - 1)]
    return out


MAX_STEP = 2**63 - 1  # a step as the store keeps one (int64)


def _trainer_snapshot(store, target: str) -> tuple[dict, dict, str, int]:
    """(state, meta["hf"], trainer_state text, global_step) of a snapshot TsckCallback
    took, every stored value resume_checkpoint uses checked first: stored values are
    untrusted, and global_step names the folder written (checkpoint-N), so it must be
    an int >= 0, never text such as "../../x". InvalidArgument naming the snapshot."""
    root = store.resolve(target)
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
        hf[k] = _config_text(hf.get(k), f"the {k.replace('_', ' ')} of {where}")
    state = store.checkout(root)
    if not isinstance(state, dict):
        raise refuse(f"it holds a {type(state).__name__}, not a dict")
    missing = [k for k in ("model", "optimizer", "rng", "trainer_state") if k not in state]
    if missing:
        raise refuse(f"it has no {', '.join(map(repr, missing))}")
    model = state["model"]
    if not isinstance(model, dict) or not all(type(k) is str and isinstance(v, torch.Tensor)
                                              for k, v in model.items()):
        raise refuse("its 'model' is not a state_dict (names -> tensors)")
    rng = state["rng"]
    if not isinstance(rng, dict) or any(k not in rng for k in ("python", "numpy", "torch")) \
            or not isinstance(rng.get("cuda", [None]), (list, tuple)) or not rng.get("cuda", [None]):
        raise refuse("its 'rng' is not what train.capture_rng takes")
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


def resume_checkpoint(store, target: str, output_dir, *, force: bool = False) -> str:
    """Write the Trainer snapshot `target` (a ref: its newest snapshot; a root, a tag)
    as output_dir/checkpoint-N (N its global step), the folder
    trainer.train(resume_from_checkpoint=...) reads; -> its path. The folder appears
    whole; an existing one is written into only with force=True. InvalidArgument
    naming the snapshot when it is not one TsckCallback took (another layout, values
    missing or of the wrong kind, a global_step that is not an int >= 0), before
    anything is written."""
    state, hf, ts, step = _trainer_snapshot(store, target)
    output_dir = os.path.abspath(os.fspath(output_dir))
    os.makedirs(output_dir, exist_ok=True)
    dest = os.path.join(output_dir, f"checkpoint-{step}")
    tied = hf.get("tied") or {}
    model = {k: v for k, v in state["model"].items() if not (k in tied and tied[k] in state["model"])}

    def fill(tmp: str) -> list:
        names = write_pretrained(tmp, model, config=hf.get("config"), generation_config=hf.get("generation_config"),
                                 max_shard_bytes=SHARD_BYTES)
        files = {"optimizer.pt": state["optimizer"], "rng_state.pth": _hf_rng(state["rng"])}
        if state.get("scheduler") is not None:
            files["scheduler.pt"] = state["scheduler"]
        if state.get("scaler") is not None:
            files[_SCALER] = state["scaler"]
        for name, obj in files.items():
            torch.save(obj, os.path.join(tmp, name))
        with open(os.path.join(tmp, "trainer_state.json"), "w", encoding="utf-8") as f:
            f.write(ts)
        return names + list(files) + ["trainer_state.json"]

    write_dir(dest, fill, force=force)
    return dest


def export_pretrained(store, target: str, folder, *, config=None, max_shard_bytes: int = SHARD_BYTES,
                      force: bool = False) -> dict:
    """The model of snapshot `target` as a folder from_pretrained loads (model.safetensors
    or shards + index, config.json): interchange.export_folder, which `tsck checkout
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
