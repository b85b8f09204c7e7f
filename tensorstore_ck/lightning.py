"""PyTorch Lightning: checkpoints go into a tensorstore_ck store (pip install 'tensorstore_ck[lightning]').

    store = tsck.open_store("ckpts.tsck")
    trainer = Trainer(plugins=[TsckCheckpointIO(store, job="run1")],
                      callbacks=[ModelCheckpoint(dirpath="ckpt", save_top_k=2, monitor="val_loss", save_last=True)])
    trainer.fit(model)                     # later, in a new process:
    trainer.fit(model, ckpt_path="last")   # bit-identical when the run's randomness is in the checkpoint

Lightning names a checkpoint by a file path; the plugin maps it:

- the snapshot goes to ref ``<job>/<name>``: the file name without ``.ckpt``, each character
  outside ``[A-Za-z0-9._-]`` replaced by ``_`` (``epoch=0-step=10.ckpt`` -> ``run1/epoch_0-step_10``,
  ``last.ckpt`` -> ``run1/last``), with step = the checkpoint's ``global_step``, and the score
  ModelCheckpoint monitors as a metric;
- at the path itself a small pointer file (store, ref, root, step; ckpt_pointer.py) is written
  after the snapshot is committed, so everything Lightning does with files (``exists``, the version
  counter, ``ckpt_path="last"`` by modification time, ``save_last="link"`` symlinks) works
  unchanged; load_checkpoint reads the snapshot the pointer names (its root, not the ref's tip);
- saving over a path forgets the snapshot its old pointer named, and remove_checkpoint
  (ModelCheckpoint's top-k) deletes the pointer, then forgets its snapshot, and drops the ref
  once no pointer file names anything in its history. A snapshot another pointer file in the
  same directory names (a copy, a name that maps to the same ref, a link) is never forgotten,
  nor one saved from another directory.

Outside the Trainer a pointer is not a torch file (torch.load and Net.load_from_checkpoint of it
fail, with an error naming the way out):

    ckpt = tensorstore_ck.lightning.load_checkpoint("ckpt/last.ckpt")          # the checkpoint dict
    net = Net.load_from_checkpoint(tensorstore_ck.lightning.open_checkpoint("ckpt/last.ckpt"))
    $ tsck checkout STORE ckpt/last.ckpt out.ckpt     # a real .ckpt, for torch.load and every tool
    $ tsck export-weights STORE ckpt/last.ckpt model.safetensors   # the weights, for load_state_dict

Give each checkpoint directory its own job: two directories with the same file names under
one job share refs (each pointer file still names its own snapshot, and neither directory's
removals forget the other's, but a ref's tip may then outlive its file).

The checkpoint dict is stored natively (tensors, dicts, lists, tuples, str, numbers, None);
Lightning's AttributeDict is stored as the dict it is. A value that would need pickle is
refused (UnsupportedType naming where it is) unless TsckCheckpointIO(allow_pickle=True).

Strategies: single device and DDP (Lightning saves on global rank 0, every rank loads).
The sharded strategies (FSDPStrategy, ModelParallelStrategy, DeepSpeedStrategy, in
Lightning and in Fabric) are refused with InvalidArgument: they load their checkpoints
themselves (torch.load of the file, or torch.distributed.checkpoint of a folder), never
through a CheckpointIO, and their sharded saves bypass it too, so a snapshot taken through
the plugin could never be resumed and a sharded save would silently not reach the store.
Take sharded state as one collective snapshot instead (every rank: tensorstore_ck.dcp's
TsckWriter with torch.distributed.checkpoint.save, or store.put_snapshot of
get_model_state_dict / get_optimizer_state_dict, whose DTensors are stored as their shards).
Lightning hands a CheckpointIO no reference to its strategy, so the plugin finds the
strategy calling it on the call stack: at a save (the gathered, rank-0 saves), or at
ModelCheckpoint's removal of an older checkpoint (the first call a run whose saves all
bypass the plugin makes; a run that removes none never calls it).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import re
import signal
import sys
from collections import OrderedDict

import torch

try:
    from lightning.fabric.plugins import CheckpointIO
    from lightning.fabric.utilities.data import AttributeDict
    from lightning.pytorch.callbacks import Callback
except ImportError as e:  # pragma: no cover - the extra is not installed
    raise ImportError("tensorstore_ck.lightning needs PyTorch Lightning: pip install 'tensorstore_ck[lightning]'") \
        from e

from .ckpt_pointer import MAX_POINTER_BYTES, POINTER_FORMAT, parse_pointer, pointer_bytes, read_local_pointer
from .errors import FormatError, InvalidArgument, RefConflict, RefNotFound, UnsupportedType
from .format.names import MAX_NAME_BYTES, validate_component
from .train.preempt import DEFAULT_GRACE, Preempted, PreemptSignals, preempt_options, any_rank_preempted
from .util.localfile import sync_dir, write_atomic

__all__ = ["TsckCheckpointIO", "TsckPreemption", "ref_for_path", "POINTER_FORMAT", "read_pointer", "load_checkpoint", "open_checkpoint"]

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def ref_for_path(job: str, path) -> str:
    """The ref a checkpoint path is saved to: ``<job>/<file name without .ckpt>``, characters
    outside [A-Za-z0-9._-] as ``_``; a name too long for a ref is cut and ends in a hash of it."""
    name = os.path.basename(os.fspath(path).rstrip("/"))
    stem = name[:-len(".ckpt")] if name.endswith(".ckpt") and len(name) > len(".ckpt") else name
    comp = _UNSAFE.sub("_", stem)
    if comp in ("", ".", ".."):
        comp = "_" + comp
    room = MAX_NAME_BYTES - len(job.encode()) - 1
    if len(comp) > room:
        tail = "-" + hashlib.blake2b(stem.encode("utf-8", "surrogatepass"), digest_size=4).hexdigest()
        comp = comp[:room - len(tail)] + tail
    return f"{job}/{comp}"


def _sharded_strategy_classes() -> tuple:
    out = []
    for mod in ("lightning.pytorch.strategies", "lightning.fabric.strategies"):
        try:
            m = __import__(mod, fromlist=["FSDPStrategy"])
        except ImportError:  # pragma: no cover - lightning without one of its halves
            continue
        out += [getattr(m, n) for n in ("FSDPStrategy", "ModelParallelStrategy", "DeepSpeedStrategy") if hasattr(m, n)]
    return tuple(out)


def _calling_sharded_strategy():
    """The sharded Lightning strategy among this call's callers, or None. A CheckpointIO
    is handed no reference to its strategy; the strategy's own method (save_checkpoint,
    remove_checkpoint, teardown) is on the stack when it calls the plugin."""
    classes = _sharded_strategy_classes()
    f = sys._getframe(1)
    while f is not None:
        s = f.f_locals.get("self")
        if s is not None and isinstance(s, classes):
            return s
        f = f.f_back
    return None


def _refuse_sharded(strategy, doing: str) -> InvalidArgument:
    name = type(strategy).__name__
    return InvalidArgument(
        f"TsckCheckpointIO cannot take {name}'s checkpoints ({doing}): {name} loads its checkpoints itself "
        "(torch.load of the file, or torch.distributed.checkpoint of a folder), never through a CheckpointIO, and its "
        "sharded saves bypass the CheckpointIO, so they would not be resumable from the store or not reach it. Use "
        "strategy='ddp' with TsckCheckpointIO, or take the sharded state as one collective snapshot on every rank: "
        "torch.distributed.checkpoint.save with tensorstore_ck.dcp's TsckWriter, or store.put_snapshot of "
        "get_model_state_dict(model) and get_optimizer_state_dict(model, optimizer) (DTensors are stored as "
        "their shards)")


def _native(obj):
    """The checkpoint with Lightning's AttributeDict (hparams) as plain dicts; all else as it is."""
    t = type(obj)
    if isinstance(obj, AttributeDict):
        return {k: _native(v) for k, v in obj.items()}
    if t is dict or t is OrderedDict:
        return t((k, _native(v)) for k, v in obj.items())
    if t is list or t is tuple:
        return t(_native(v) for v in obj)
    return obj


def _monitored(checkpoint: dict) -> dict:
    """{monitor: score} of the ModelCheckpoint states in the checkpoint (catalog metrics)."""
    out = {}
    callbacks = checkpoint.get("callbacks")
    for state in (callbacks.values() if isinstance(callbacks, dict) else ()):
        if not isinstance(state, dict):
            continue
        name, score = state.get("monitor"), state.get("current_score")
        if isinstance(score, torch.Tensor) and score.numel() == 1:
            score = score.item()
        if isinstance(name, str) and isinstance(score, (int, float)) and not isinstance(score, bool):
            out[name] = float(score)
    return out


# -- files at Lightning's paths (local, or any fsspec URL Lightning itself accepts) ----------
def _fs(path):
    from fsspec.core import url_to_fs
    return url_to_fs(os.fspath(path))


def _is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _read_pointer(path, *, strict: bool = True) -> dict | None:
    """The pointer at `path`; None if there is no file (or, with strict=False, if it is not
    a pointer). FormatError naming the path for a file that is not one."""
    fs, p = _fs(path)
    try:
        if _is_local(fs):  # a regular file only: open() of a FIFO would wait for a writer forever
            ptr, why = read_local_pointer(p)
        else:
            with fs.open(p, "rb") as f:
                ptr, why = parse_pointer(f.read(MAX_POINTER_BYTES + 1))
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    if why is None:
        return ptr
    if not strict:
        return None
    raise FormatError(f"{os.fspath(path)} is not a checkpoint saved by TsckCheckpointIO: {why}")


def _write_pointer(path, ptr: dict) -> None:
    data = pointer_bytes(ptr)
    fs, p = _fs(path)
    fs.makedirs(fs._parent(p), exist_ok=True)
    if _is_local(fs):
        def write(tmp):
            with open(tmp, "wb") as f:
                f.write(data)
        write_atomic(p, write, force=True)  # the old pointer or the new one, never half of one
    else:
        fs.pipe_file(p, data)  # object stores replace a whole object


def _where(path) -> str:
    """A path as recorded in a snapshot's meta: absolute when local, so directories compare."""
    p = os.fspath(path)
    return p if "://" in p else os.path.abspath(p)


def _named_in_dir(path) -> set[str]:
    """The roots the pointer files in `path`'s directory name (links to them included)."""
    fs, p = _fs(path)
    try:
        names = fs.ls(fs._parent(p), detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return set()
    out = set()
    for q in names:
        try:
            if fs.isdir(q) or fs.size(q) > MAX_POINTER_BYTES:
                continue
            ptr = _read_pointer(q if _is_local(fs) else fs.unstrip_protocol(q), strict=False)
        except OSError:
            continue
        if ptr is not None:
            out.add(ptr["root"])
    return out


class TsckPreemption(Callback):
    """Preemption for a Lightning run, as CheckpointManager's (train/preempt.py): SIGTERM
    (and the signals in preempt_signals=; () catches none) is noted, chained to the handler
    installed before. Lightning's own SIGTERM handler, installed at fit(), is set aside for
    the training (this one is put back over it at on_train_start): under DDP it broadcasts
    from rank 0 inside the handler, which on a rank the signal alone reached waits for a
    broadcast the other ranks never make, and its own path saves nothing. At
    the end of the next training batch (every rank agreeing: one rank's signal is enough)
    the trainer saves `<dirpath>/<filename>.ckpt` (dirpath: the ModelCheckpoint's, else the
    trainer's default_root_dir), through its CheckpointIO (TsckCheckpointIO: into the store,
    blocking), its upload awaited for what is left of preempt_grace= seconds, and
    tsck.Preempted is raised: left alone, exit status 143 (Lightning's own SIGTERM path
    would end with SIGTERMException, status 0, after saving nothing). `preempted` keeps it.
    No batch ending within the grace: the process ends then, as the signal would have
    ended it. Make it in the main thread, before fit()."""

    def __init__(self, *, dirpath=None, filename: str = "preempted", preempt_signals=(signal.SIGTERM,),
                 preempt_grace: float = DEFAULT_GRACE):
        preempt_signals, preempt_grace = preempt_options(preempt_signals, preempt_grace)
        self.dirpath, self.filename = dirpath, filename
        self.preempted: Preempted | None = None
        self._preempt = PreemptSignals(preempt_signals, preempt_grace)

    def on_train_start(self, _trainer, _pl_module) -> None:  # (after fit() installed Lightning's handlers)
        self._preempt.take_over()

    def on_train_batch_end(self, trainer, _pl_module, _outputs, _batch, _batch_idx) -> None:  # (Lightning's order)
        pre = self._preempt
        seen = pre.seen
        if trainer.world_size > 1:  # every rank, every batch: one rank's signal is everyone's, at one step
            seen = any_rank_preempted(seen)
        if not seen:
            return
        pre.saving = True  # (the watchdog lets the save end)
        ck = trainer.checkpoint_callback
        where = self.dirpath or (getattr(ck, "dirpath", None) if ck is not None else None) or trainer.default_root_dir
        path = os.path.join(os.fspath(where), f"{self.filename}.ckpt")
        step, why, durable = trainer.global_step, "", False
        try:
            trainer.save_checkpoint(path)
            io_ = trainer.strategy.checkpoint_io
            store = getattr(getattr(io_, "checkpoint_io", io_), "store", None)  # (through an AsyncCheckpointIO too)
            durable = True if store is None else bool(store.wait_durable(timeout=pre.remaining()))
            if not durable:
                why = f"its upload did not end within the grace ({pre.grace:g} s); the local tier keeps it"
        except Exception as e:  # noqa: BLE001 - said in the exception the process ends with
            step, why = None, f"the final checkpoint failed: {type(e).__name__}: {e}"
        pre.done()
        signum = pre.signum if pre.signum is not None else signal.SIGTERM  # (another rank's signal)
        self.preempted = Preempted(step, signum=int(signum), durable=durable, why=why, close_by=pre.ends_at())
        raise self.preempted

    def on_exception(self, _trainer, _pl_module, _exception) -> None:
        self._preempt.close()

    def teardown(self, *_args, **_kwargs) -> None:  # (Lightning passes stage= by name)
        self._preempt.close()


class TsckCheckpointIO(CheckpointIO):
    """Lightning's CheckpointIO over a Store: Trainer(plugins=[TsckCheckpointIO(store, job=...)]).

    job: the job of the snapshots, and the first component of their refs (see the module
    docstring for how a path maps to a ref). allow_pickle: store (and load) values that
    are not tensors, containers, str, numbers or None pickled; off by default, as for
    put_snapshot. The store stays the caller's (the plugin never closes it)."""

    def __init__(self, store, *, job: str, allow_pickle: bool = False):
        validate_component(job, "job name")
        if job.startswith("-"):
            raise InvalidArgument(f"job name {job!r} begins with '-'")
        self.store = store
        self.job = job
        self.allow_pickle = bool(allow_pickle)

    def ref_for(self, path) -> str:
        return ref_for_path(self.job, path)

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        """Snapshot `checkpoint` into the path's ref, then point the file at `path` to it;
        the snapshot the old file there named is forgotten."""
        if storage_options is not None:
            raise InvalidArgument(f"TsckCheckpointIO takes no storage_options (got {storage_options!r})")
        sharded = _calling_sharded_strategy()
        if sharded is not None:  # before anything is written: no snapshot, no pointer file
            raise _refuse_sharded(sharded, f"saving {os.fspath(path)}")
        ref = self.ref_for(path)
        # A link (save_last="link") names another path's snapshot: replacing it keeps that one.
        old = None if os.path.islink(os.fspath(path)) else _read_pointer(path, strict=False)
        step = checkpoint.get("global_step")
        try:
            info = self.store.put_snapshot(
                _native(checkpoint), ref, job=self.job, step=step if type(step) is int else None,
                metrics=_monitored(checkpoint), meta={"lightning_path": _where(path)},
                allow_pickle=self.allow_pickle, group=False)  # Lightning saves on global rank 0 only
        except UnsupportedType as e:
            raise UnsupportedType(
                f"Lightning checkpoint {os.fspath(path)} was not saved (make the value a tensor, dict, list, str "
                f"or number, or pass allow_pickle=True to TsckCheckpointIO to store it pickled): {e.message}",
                e.path) from None
        _write_pointer(path, {"format": POINTER_FORMAT, "store": self.store.url, "ref": ref, "root": info.root,
                              "step": info.step, "job": self.job})
        self._replaced(path, ref, info.root, old)

    def _replaced(self, path, ref: str, new: str, old: dict | None) -> None:
        """After a save over `path`: forget what the old pointer named (if this directory's),
        and the snapshots of the ref's history saved from this very path (a save killed
        between its commit and its pointer leaves one behind), unless a pointer names them."""
        where = _where(path)
        drop = set()
        if old is not None and old["root"] != new:
            try:
                saved_at = self.store.show(old["root"]).meta.get("lightning_path")
            except RefNotFound:
                saved_at = None
            if isinstance(saved_at, str) and os.path.dirname(saved_at) == os.path.dirname(where):
                drop.add(old["root"])
        try:
            hist = self.store.log(ref)
        except RefNotFound:
            hist = []
        drop |= {h.root for h in hist[1:] if h.meta.get("lightning_path") == where and h.root != new}
        if drop:
            for root in drop - _named_in_dir(path):
                self._forget(path, root)

    def _forget(self, path, root: str) -> None:
        try:
            self.store.forget(root)
        except RefNotFound:
            pass  # already gone
        except InvalidArgument as e:  # tagged, pinned or a ref's tip: kept on purpose
            log.debug("checkpoint %s: snapshot %s kept: %s", os.fspath(path), root[:16], e)

    def load_checkpoint(self, path, map_location=None, weights_only: bool | None = None) -> dict:
        """The checkpoint the pointer at `path` names. weights_only=True refuses pickled values
        even with allow_pickle. map_location as for torch.load; None loads onto the CPU, as
        Lightning's TorchCheckpointIO does (Lightning moves the states to the device)."""
        if map_location is None:
            map_location = "cpu"
        ptr = _read_pointer(path)
        if ptr is None:
            raise RefNotFound(f"no checkpoint at {os.fspath(path)} (no such file)")
        try:
            # Every rank loads, each for itself (as torch.load would), not as a collective.
            return self.store.checkout(ptr["root"], map_location=map_location,
                                       allow_pickle=self.allow_pickle and not weights_only, group=False)
        except RefNotFound as e:
            raise RefNotFound(f"checkpoint {os.fspath(path)} names snapshot {ptr['root'][:16]} (ref {ptr['ref']!r}, "
                              f"step {ptr.get('step')}, store {ptr.get('store')}), which the store at "
                              f"{self.store.url} does not hold (forgotten, or another store): {e}") from None

    def remove_checkpoint(self, path) -> None:
        """Delete the pointer file at `path`, then forget its snapshot (and drop its ref
        when that held only this snapshot), unless another pointer in the directory names it."""
        p = os.fspath(path)
        sharded = _calling_sharded_strategy()
        if sharded is not None:
            raise _refuse_sharded(sharded, f"removing {p}")
        link = os.path.islink(p)
        ptr = None if link else _read_pointer(path, strict=False)
        fs, fp = _fs(path)
        if not link and not fs.exists(fp):
            return
        # The file goes first (durably): a crash after it leaves an unnamed snapshot (`tsck
        # delete-ref` removes it), never a pointer naming a forgotten one.
        fs.rm(fp)
        if _is_local(fs):
            sync_dir(os.path.dirname(os.path.abspath(fp)))
        if ptr is not None:
            self._drop(path, ptr)

    def _drop(self, path, ptr: dict) -> None:
        """Forget the snapshot the pointer that was at `path` named, unless a pointer file in
        its directory still names it. Its ref goes when nothing in its history is still named
        there or was saved from another directory; a tip that cannot go yet (older snapshots of
        the ref are still named) stays until they do."""
        root, ref = ptr["root"], ptr["ref"]
        named = _named_in_dir(path)
        if root in named:
            return
        here = os.path.dirname(_where(path))
        try:
            hist = self.store.log(ref)
        except (RefNotFound, InvalidArgument):
            hist = []

        def needed(h) -> bool:  # still named here, or another directory's (never ours to drop)
            saved_at = h.meta.get("lightning_path")
            return h.root in named or not isinstance(saved_at, str) or os.path.dirname(saved_at) != here
        if hist and not any(needed(h) for h in hist):
            try:
                self.store.delete_ref(ref, expected=hist[0].root)
            except (RefNotFound, RefConflict):
                pass  # already gone, or the ref moved on meanwhile (another writer's now)
        elif not hist or hist[0].root != root:
            self._forget(path, root)
        else:
            log.debug("checkpoint %s: snapshot %s stays while it is the tip of ref %s, whose older "
                      "snapshots are still named", os.fspath(path), root[:16], ref)


# -- outside the Trainer: inference scripts, LightningCLI, model registries ----------------
def read_pointer(path) -> dict:
    """The pointer file at `path` (a local path or an fsspec URL) as a dict: format, store,
    ref, root, step, job. RefNotFound if there is no file, FormatError if it is not a pointer."""
    ptr = _read_pointer(path)
    if ptr is None:
        raise RefNotFound(f"no checkpoint at {os.fspath(path)} (no such file)")
    return ptr


def load_checkpoint(path, *, store=None, refs=None, storage_options: dict | None = None, map_location=None,
                    allow_pickle: bool = False) -> dict:
    """The checkpoint dict a pointer file names, read from its store: what torch.load of a
    .ckpt returns, where torch.load of a pointer file cannot work (it is not a torch file).

    store: an open Store to read from; default: the store the pointer names, opened
    read-only (refs= and storage_options= as for open_store, for a remote one) and closed
    again. map_location as for torch.load (default: the CPU). allow_pickle: read values the
    checkpoint was saved with pickled (TsckCheckpointIO(allow_pickle=True)); off by default.
    Give it to Lightning as a file: Net.load_from_checkpoint(open_checkpoint(path))."""
    ptr = read_pointer(path)
    if store is not None:
        return TsckCheckpointIO(store, job="lightning", allow_pickle=allow_pickle) \
            .load_checkpoint(path, map_location=map_location)
    url = ptr.get("store")
    if not isinstance(url, str) or not url:
        raise FormatError(f"{os.fspath(path)} names no store: pass store= (an open Store)")
    from .opener import open_store
    with open_store(url, refs=refs, storage_options=storage_options, create=False, read_only=True) as st:
        return TsckCheckpointIO(st, job="lightning", allow_pickle=allow_pickle) \
            .load_checkpoint(path, map_location=map_location)


def open_checkpoint(path, **kwargs) -> io.BytesIO:
    """The checkpoint a pointer file names as an in-memory torch.save file, for what takes
    a .ckpt file object: Net.load_from_checkpoint(open_checkpoint(path)), torch.load(...).
    Arguments as for load_checkpoint. Holds the whole checkpoint in memory (twice, while it
    is written); `tsck checkout STORE POINTER OUT.ckpt` writes one to disk instead."""
    buf = io.BytesIO()
    torch.save(load_checkpoint(path, **kwargs), buf)
    buf.seek(0)
    return buf
