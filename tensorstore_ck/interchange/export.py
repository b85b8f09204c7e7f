"""A snapshot out as one standalone file other tools read: `tsck checkout STORE TARGET FILE`.

export_file writes the snapshot (or the part at a dotted path) as safetensors (tensors
by dotted name, plain values as metadata strings; hf_folder.py's safetensors view) or
torch.save (the state as checkout returns it), to a temporary file beside DEST renamed
into place: never half a file. A DEST that names a folder is a Hugging Face model
folder (hf_folder.export_folder). "lightning" is torch.save of a snapshot TsckCheckpointIO
took (a dict with a "state_dict"): the .ckpt file torch.load and `Net.load_from_checkpoint`
read; its TARGET may be the pointer file Lightning left at the checkpoint's path.

Paths are dotted, as safetensors names and state_dict keys are: the keys from the top
joined by "." ("model.layers.0.weight"), list and tuple items by their index. A key that
holds dots (a flat state_dict's) is kept whole, so a flat state_dict and the same tree
stored nested name their values alike, and a PATH "model.layers.0" selects in either.

export_weights (`tsck export-weights STORE TARGET FILE`) is the file a training run ends
with: the model's weights alone, as one .safetensors file that
`model.load_state_dict(safetensors.torch.load_file(FILE))` takes. It takes the model's
sub-tree (where TrainState, the Hugging Face callback and Lightning keep it), names each
tensor as the model's own state_dict does (without the sub-tree's path, and without the
wrapper prefixes DDP, torch.compile and FSDP1 put on every name, nor torch.compile's
inside a name: blocks compiled one by one, as get_model_state_dict names them), leaves out what is not a
tensor (named in its summary), and casts floating tensors to `dtype` when one is given.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..ckpt_pointer import read_local_pointer
from ..errors import InvalidArgument, RefNotFound, TsckError, UnsupportedType, storage_error
from ..format.dtypes import QUANT_NAMES, TORCH_DTYPES
from ..read.listing import list_tree
from ..util.localfile import write_atomic
from .hf_folder import (HF_META, check_for_safetensors, check_st_names, nbytes, safetensors_items, select,
                        st_refusal, export_folder, is_folder_dest)

__all__ = ["export_file", "export_weights", "format_for", "FORMATS", "WEIGHT_DTYPES", "WRAPPER_PREFIXES"]

FORMATS = ("safetensors", "torch", "lightning")


def format_for(dest: str, fmt: str | None = None) -> str:
    """The format to write: `fmt`, else by DEST's suffix."""
    if fmt is not None:
        if fmt not in FORMATS:
            raise InvalidArgument(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        return fmt
    low = str(dest).lower()
    if low.endswith(".safetensors"):
        return "safetensors"
    if low.endswith((".pt", ".pth", ".bin")):
        return "torch"
    if low.endswith(".ckpt"):
        return "lightning"
    raise InvalidArgument(f"cannot tell the format from the name {os.path.basename(str(dest))!r} (.safetensors, "
                          ".pt, .pth, .bin, .ckpt): pass --format safetensors|torch|lightning")


def _pointer_target(store, target: str) -> str:
    """TARGET, or the root a Lightning pointer file at TARGET names (a file wins over a ref
    of the same name: it is what Lightning calls that checkpoint)."""
    if not os.path.isfile(target):
        return target
    try:
        ptr, why = read_local_pointer(target)
    except OSError:
        return target
    if ptr is None:
        if target.endswith(".ckpt"):
            raise InvalidArgument(f"{target} is not a tensorstore_ck pointer file ({why}): give a ref, tag or "
                                  "snapshot root")
        return target
    url = ptr.get("store")
    try:
        return store.resolve(ptr["root"])
    except RefNotFound:
        raise RefNotFound(f"{target} names snapshot {ptr['root'][:16]} (ref {ptr['ref']}, step {ptr.get('step')}) "
                          f"of the store {url}, which {store.url} does not hold (forgotten, or another store)") \
            from None


def export_file(store, target: str, dest, *, fmt: str | None = None, path: str | None = None,
                force: bool = False, progress: bool = False) -> dict:
    """Write the snapshot `target` (or the part at `path`) to `dest` as one standalone file:
    "safetensors" (tensors by dotted name; plain values, as strings, in its metadata, with
    "format": "pt" unless the tree has its own) or "torch" (torch.save of the state as
    checkout returns it). DEST is replaced only with force=True; it is written under a
    temporary name and renamed, so it is never half a file. A DEST that is a directory,
    or ends with a path separator, is a Hugging Face model folder: export_folder.
    -> a summary dict."""
    if is_folder_dest(dest):
        if fmt not in (None, "safetensors"):
            raise InvalidArgument(f"{dest} names a folder, which is written as safetensors (a Hugging Face "
                                  f"model folder), not as {fmt}: give a file name for --format {fmt}")
        return export_folder(store, target, dest, path=path, force=force, progress=progress)
    dest = os.path.abspath(os.fspath(dest))
    fmt = format_for(dest, fmt)
    _check_dest(dest, force)
    if fmt == "lightning" and path is not None:
        raise InvalidArgument("--format lightning writes a whole Lightning checkpoint: drop --path (or use "
                              "--format torch for the part at a path)")
    # once: the ref may move while we read
    root = store.resolve(_pointer_target(store, os.fspath(target)))
    where = f"snapshot {root[:16]} ({target}) of {store.url}"
    # Refuses a path that holds nothing, or a value safetensors cannot hold, before a block is read.
    entries = list_tree(store.read_core, root, path)[1] if fmt == "safetensors" or path is not None else None
    if fmt == "safetensors":
        try:
            check_for_safetensors(entries, where)
        except UnsupportedType as e:
            raise UnsupportedType(f"{e}{_parts_hint(entries, path, lambda es: check_for_safetensors(es, where))}") \
                from None
    # Reads only the blocks under PATH; select then finds the value in the pruned tree.
    try:
        state = store.checkout(root, paths=None if path is None else [path], progress=progress)
    except UnsupportedType as e:
        try:
            if entries is None:
                entries = list_tree(store.read_core, root, path)[1]
        except TsckError:
            raise e from None  # the refusal itself is what to report
        if not any(x.kind == "pickled" for x in entries):
            raise
        # A value only a full unpickle loads (a DCP bytes item): the CLI never unpickles.
        raise UnsupportedType(f"{e}; that is Store.checkout in Python: `tsck checkout` loads nothing beyond "
                              f"torch's weights_only loader{_parts_hint(entries, path, _no_pickled)}") from None
    value, prefix = (state, "") if path is None else select(state, path)
    if fmt == "lightning" and not (isinstance(value, dict) and isinstance(value.get("state_dict"), dict)):
        raise InvalidArgument(f"{where} is not a Lightning checkpoint (a dict with a 'state_dict', as "
                              "TsckCheckpointIO stores them): write it with --format torch")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file
            tensors, meta = safetensors_items(value, prefix, where)
            check_st_names(tensors, where)
            meta.setdefault("format", "pt")  # what transformers checks before it loads a file
            write_atomic(dest, lambda tmp: save_file(tensors, tmp, metadata=meta), force=force,
                         needed=nbytes(tensors))
            summary = {"tensors": len(tensors), "metadata": len(meta)}
        else:
            write_atomic(dest, lambda tmp: _torch_save(value, tmp), force=force, needed=nbytes(value))
            summary = {}
    except TsckError:
        raise
    except OSError as e:
        raise storage_error(e, f"writing {dest}") from e
    return {"root": root, "target": target, "dest": dest, "format": fmt, "path": path,
            "bytes": os.path.getsize(dest), **summary}


def _check_dest(dest: str, force: bool) -> None:
    parent = os.path.dirname(dest)
    if not os.path.isdir(parent):
        raise InvalidArgument(f"cannot write {dest}: no directory {parent}")
    if os.path.isdir(dest):
        raise InvalidArgument(f"cannot write {dest}: it is a directory")
    if os.path.lexists(dest) and not force:
        raise InvalidArgument(f"{dest} exists (pass --force to replace it)")


def _no_pickled(entries) -> None:
    for e in entries:
        if e.kind == "pickled":
            raise UnsupportedType(e.path)


def _parts_hint(entries, path: str | None, check) -> str:
    """"; the parts that can be: --path A, --path B": the values one key below `path` (the
    top's keys without one) whose entries all pass `check`, so that a refusal of one
    value (a pickled optimizer hyper-parameter) says how to take out the rest."""
    groups: dict = {}
    cut = 0 if path is None else len(path) + 1
    for e in entries:
        if len(e.path) <= cut:
            return ""  # the value at PATH itself: no part below it
        head = e.path[:cut] + e.path[cut:].split(".", 1)[0]
        groups.setdefault(head, []).append(e)
    ok = []
    for head, es in groups.items():
        try:
            check(es)
        except UnsupportedType:
            continue
        ok.append(head)
    if not ok:
        return ""
    more = f" (and {len(ok) - 8} more)" if len(ok) > 8 else ""
    return "; the parts that can be: " + ", ".join(f"--path {h}" for h in ok[:8]) + more


class _RecordingFile:
    """A file torch.save writes through that keeps the OSError of a failed write: torch
    turns it into a RuntimeError that says only "unexpected pos"."""

    def __init__(self, f):
        self._f = f
        self.error: OSError | None = None

    def write(self, b):
        try:
            return self._f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self._f.flush()


def _torch_save(value, path: str) -> None:
    with open(path, "wb") as f:
        sink = _RecordingFile(f)
        try:
            torch.save(value, sink)
        except Exception:
            if sink.error is not None:
                raise sink.error from None
            raise


# -- the model's weights alone ----------------------------------------------------------
# dtype= of export_weights: a floating dtype safetensors holds, by torch's name or a short one.
WEIGHT_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "half": "float16", "fp32": "float32",
                 "f32": "float32", "float": "float32", "fp64": "float64", "f64": "float64", "double": "float64",
                 **{n: n for n in ("bfloat16", "float16", "float32", "float64", "float8_e4m3fn", "float8_e5m2",
                                   "float8_e4m3fnuz", "float8_e5m2fnuz")}}
# Prefixes a wrapper puts on every name of the model it wraps: DDP's and DataParallel's
# "module.", torch.compile's "_orig_mod.". Stripped by default when every name has one.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# Wrapper modules that appear at any depth of a name: FSDP1's, activation checkpointing's.
_WRAPPER_PARTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")
_COMPILED = "_orig_mod"  # torch.compile's OptimizedModule keeps the module it wraps by this name
_WEIGHTS_SUBTREES = ("model", "state_dict")  # TrainState's and Hugging Face's; Lightning's


def weights_dtype(dtype) -> torch.dtype | None:
    """A torch dtype, or a name of WEIGHT_DTYPES ("bf16", "bfloat16", "torch.float16") ->
    the torch dtype; None -> None. InvalidArgument for anything else."""
    if dtype is None:
        return None
    ok = sorted({getattr(torch, n) for n in WEIGHT_DTYPES.values() if hasattr(torch, n)}, key=str)
    if isinstance(dtype, torch.dtype):
        if dtype not in ok:
            raise InvalidArgument(f"dtype {dtype} is not a floating dtype safetensors holds "
                                  f"({', '.join(str(d).removeprefix('torch.') for d in ok)})")
        return dtype
    name = dtype.lower().removeprefix("torch.") if isinstance(dtype, str) else None
    if name not in WEIGHT_DTYPES or not hasattr(torch, WEIGHT_DTYPES[name]):
        raise InvalidArgument(f"dtype {dtype!r} is not one: give a floating dtype safetensors holds: "
                              f"{', '.join(k for k in WEIGHT_DTYPES if hasattr(torch, WEIGHT_DTYPES[k]))}")
    return getattr(torch, WEIGHT_DTYPES[name])


def _strip_arg(strip_prefix) -> tuple | None:
    """None (the wrappers' prefixes, where every name has one), or the prefixes to strip."""
    if strip_prefix is None:
        return None
    items = (strip_prefix,) if isinstance(strip_prefix, str) else strip_prefix
    try:
        items = tuple(items)
    except TypeError:
        raise InvalidArgument(f"strip_prefix must be a str or a list of str, got {type(strip_prefix).__name__}") \
            from None
    out = []
    for p in items:
        if type(p) is not str:
            raise InvalidArgument(f"strip_prefix must be a str or a list of str, got an item {p!r:.40}")
        if p:  # "" strips nothing
            out.append(p if p.endswith(".") else p + ".")
    return tuple(out)


def _top_keys(store, root: str) -> list[str]:
    try:
        entries = list_tree(store.read_core, root)[1]
    except TsckError:
        return []
    return list(dict.fromkeys(e.path.split(".", 1)[0] for e in entries if e.path))


def _weights_entries(store, root: str, subtree: str | None, where: str) -> tuple[str, list]:
    """(the sub-tree's dotted path, "" for the top; its entries). None: the snapshot's
    meta["hf"] weights, else "model" (TrainState, the Hugging Face callback), else
    "state_dict" (a Lightning checkpoint)."""
    if subtree is not None:
        if type(subtree) is not str:
            raise InvalidArgument(f"subtree must be a dotted path (str), got {type(subtree).__name__}")
        try:
            return subtree, list_tree(store.read_core, root, subtree or None)[1]
        except InvalidArgument:
            keys = _top_keys(store, root)
            raise InvalidArgument(f"{where} has nothing at {subtree!r}; its top holds: "
                                  f"{', '.join(keys[:12]) or 'nothing'}") from None
    hf = store.show(root).meta.get(HF_META)
    tries = list(_WEIGHTS_SUBTREES)
    if isinstance(hf, dict) and isinstance(hf.get("weights"), str):
        tries.insert(0, hf["weights"])
    for t in tries:
        try:
            return t, list_tree(store.read_core, root, t or None)[1]
        except InvalidArgument:
            continue
    keys = _top_keys(store, root)
    raise InvalidArgument(f"{where} has no model sub-tree ('model' as TrainState and the Hugging Face callback "
                          f"store it, or a Lightning checkpoint's 'state_dict'); its top holds: "
                          f"{', '.join(keys[:12]) or 'nothing'}: pass --path NAME (subtree=), or --path '' for "
                          "the whole snapshot")


def _weights_refusal(e, cast, where: str) -> UnsupportedType | None:
    """Why the tensor of entry `e` cannot be a weight in the file (None: it can)."""
    if e.kind in ("tensor", "sharded"):
        if e.dtype in QUANT_NAMES:
            why = f"a quantized tensor of {e.dtype}"
        else:
            dt = TORCH_DTYPES.get(e.dtype)
            why = st_refusal(e.kind, cast if cast is not None and dt is not None and dt.is_floating_point else dt)
    else:
        try:
            why = st_refusal("array", np.dtype(e.dtype))
        except TypeError:
            why = f"a numpy array of {e.dtype}"
    if why is None:
        return None
    return UnsupportedType(f"{where} cannot be exported as safetensors weights: it holds {why} at {e.path}")


def _strip_names(names: list[str], strip: tuple | None) -> tuple[list[str], list[str]]:
    """(the names without the prefixes, the prefixes stripped)."""
    done: list[str] = []
    if strip is None:
        if any(p in n.split(".") for n in names for p in _WRAPPER_PARTS):
            names = [".".join(x for x in n.split(".") if x not in _WRAPPER_PARTS) for n in names]
            done += [p + "." for p in _WRAPPER_PARTS]
        while names:
            p = next((p for p in WRAPPER_PREFIXES if all(n.startswith(p) and len(n) > len(p) for n in names)), None)
            if p is None:
                break
            names = [n[len(p):] for n in names]
            done.append(p)
        # Blocks compiled one by one (model.layers[i] = torch.compile(layer)) hold it inside
        # names; torch's get_model_state_dict drops it at any depth too.
        inner = [n.split(".") for n in names]
        if any(_COMPILED in parts[:-1] for parts in inner):
            names = [".".join(x for i, x in enumerate(parts) if x != _COMPILED or i == len(parts) - 1)
                     for parts in inner]
            if _COMPILED + "." not in done:
                done.append(_COMPILED + ".")
        return names, done
    for p in strip:
        if not any(n.startswith(p) and len(n) > len(p) for n in names):
            raise InvalidArgument(f"no tensor name starts with {p!r} (names are the sub-tree's own; they begin: "
                                  f"{', '.join(names[:4])})")
        names = [n[len(p):] if n.startswith(p) and len(n) > len(p) else n for n in names]
        done.append(p)
    return names, done


def export_weights(store, target: str, dest, *, subtree: str | None = None, dtype=None, strip_prefix=None,
                   force: bool = False, progress: bool = False) -> dict:
    """Write the model weights of the snapshot `target` (a ref, tag, REF@STEP, root, or a
    Lightning pointer file) to `dest` as one .safetensors file that
    `model.load_state_dict(safetensors.torch.load_file(dest))` takes.

    subtree: the dotted path of the model's state_dict in the snapshot; None: the one
    the snapshot's Hugging Face meta names, else "model" (TrainState, CheckpointManager,
    the Hugging Face callback), else "state_dict" (a Lightning checkpoint); "": the whole
    snapshot. Names lose the sub-tree's path. strip_prefix: a prefix (or a list) every
    name that has it loses ("module." of DDP); None: the wrappers' (WRAPPER_PREFIXES:
    DDP's "module.", torch.compile's "_orig_mod.", each only when every name has it;
    torch.compile's "_orig_mod." inside names too (blocks compiled one by one), FSDP1's
    and activation checkpointing's wrapper modules, at any depth); "" or []:
    none. dtype: cast floating tensors to it ("bf16", "fp16", torch.bfloat16, ...;
    WEIGHT_DTYPES); integer and bool tensors stay as they are. Values that are not
    tensors are left out and named in the summary ("skipped"). DEST is replaced only
    with force=True, and is the whole file or untouched. Bad arguments are refused
    before anything is read. -> a summary dict."""
    cast = weights_dtype(dtype)
    strip = _strip_arg(strip_prefix)
    dest = os.path.abspath(os.fspath(dest))
    if is_folder_dest(dest):
        raise InvalidArgument(f"{dest} names a folder: export-weights writes one .safetensors file (a Hugging Face "
                              "model folder: tsck checkout STORE TARGET DIR/)")
    if dest.lower().endswith((".pt", ".pth", ".bin", ".ckpt")):
        raise InvalidArgument(f"{os.path.basename(dest)}: export-weights writes safetensors: name the file "
                              ".safetensors (a torch.save file of the model: tsck checkout STORE TARGET FILE "
                              "--path model --format torch)")
    _check_dest(dest, force)
    root = store.resolve(_pointer_target(store, os.fspath(target)))  # once: the ref may move while we read
    where = f"snapshot {root[:16]} ({target}) of {store.url}"
    subtree, entries = _weights_entries(store, root, subtree, where)
    weights = [e for e in entries if e.kind in ("tensor", "sharded", "array")]
    skipped = [e.path for e in entries if e.kind not in ("tensor", "sharded", "array", "dict", "list", "tuple")]
    if not weights:
        raise InvalidArgument(f"{where} holds no tensor at {subtree or 'its top'} (give the model's path: --path)")
    for e in weights:
        refusal = _weights_refusal(e, cast, where)
        if refusal is not None:
            raise refusal
    # Reads only the tensors' blocks (and never a value only pickle loads).
    paths = ([subtree] if subtree else None) if not skipped else [e.path for e in weights]
    state = store.checkout(root, paths=paths, progress=progress)
    value, prefix = (state, "") if not subtree else select(state, subtree)
    tensors, _ = safetensors_items(value, prefix, where)
    if subtree:
        tensors = {k[len(subtree) + 1:] if k.startswith(subtree + ".") else k: v for k, v in tensors.items()}
    names, stripped = _strip_names(list(tensors), strip)
    if len(set(names)) < len(names):
        seen: dict = {}
        for old, new in zip(tensors, names):
            if new in seen:
                raise InvalidArgument(f"{seen[new]} and {old} would both be named {new!r} once "
                                      f"{', '.join(stripped)} is stripped: pass strip_prefix= (--strip-prefix) "
                                      "to say which prefixes to strip")
            seen[new] = old
    out: dict[str, torch.Tensor] = {}
    ptrs: set = set()
    n_cast = 0
    for new, t in zip(names, tensors.values()):
        if cast is not None and t.is_floating_point() and t.dtype != cast:
            t = t.to(cast)
            n_cast += 1
        elif t.numel() and t.untyped_storage().data_ptr() in ptrs:
            t = t.clone()  # tied weights: safetensors refuses tensors that share memory
        if t.numel():
            ptrs.add(t.untyped_storage().data_ptr())
        out[new] = t
    check_st_names(out, where)
    from safetensors.torch import save_file
    try:
        write_atomic(dest, lambda tmp: save_file(out, tmp, metadata={"format": "pt"}), force=force,
                     needed=nbytes(out))
    except TsckError:
        raise
    except OSError as e:
        raise storage_error(e, f"writing {dest}") from e
    return {"root": root, "target": target, "dest": dest, "format": "safetensors", "subtree": subtree,
            "tensors": len(out), "dtype": None if cast is None else str(cast).removeprefix("torch."),
            "cast": n_cast, "stripped": stripped, "skipped": skipped, "bytes": os.path.getsize(dest)}
