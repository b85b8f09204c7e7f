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
"""

from __future__ import annotations

import os

import torch

from .ckpt_pointer import read_local_pointer
from .errors import InvalidArgument, RefNotFound, TsckError, UnsupportedType, storage_error
from .hf_folder import (_check_for_safetensors, _check_st_names, _nbytes, _safetensors_items, _select, export_folder,
                        is_folder_dest)
from .listing import list_tree
from .localfile import write_atomic

__all__ = ["export_file", "format_for", "FORMATS"]

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
    parent = os.path.dirname(dest)
    if not os.path.isdir(parent):
        raise InvalidArgument(f"cannot write {dest}: no directory {parent}")
    if os.path.isdir(dest):
        raise InvalidArgument(f"cannot write {dest}: it is a directory")
    if os.path.lexists(dest) and not force:
        raise InvalidArgument(f"{dest} exists (pass --force to replace it)")
    if fmt == "lightning" and path is not None:
        raise InvalidArgument("--format lightning writes a whole Lightning checkpoint: drop --path (or use "
                              "--format torch for the part at a path)")
    # once: the ref may move while we read
    root = store.resolve(_pointer_target(store, os.fspath(target)))
    where = f"snapshot {root[:16]} ({target}) of {store.url}"
    # Refuses a path that holds nothing, or a value safetensors cannot hold, before a block is read.
    entries = list_tree(store.core, root, path)[1] if fmt == "safetensors" or path is not None else None
    if fmt == "safetensors":
        try:
            _check_for_safetensors(entries, where)
        except UnsupportedType as e:
            raise UnsupportedType(f"{e}{_parts_hint(entries, path, lambda es: _check_for_safetensors(es, where))}") \
                from None
    # Reads only the blocks under PATH; _select then finds the value in the pruned tree.
    try:
        state = store.checkout(root, paths=None if path is None else [path], progress=progress)
    except UnsupportedType as e:
        try:
            if entries is None:
                entries = list_tree(store.core, root, path)[1]
        except TsckError:
            raise e from None  # the refusal itself is what to report
        if not any(x.kind == "pickled" for x in entries):
            raise
        # A value only a full unpickle loads (a DCP bytes item): the CLI never unpickles.
        raise UnsupportedType(f"{e}; that is Store.checkout in Python: `tsck checkout` loads nothing beyond "
                              f"torch's weights_only loader{_parts_hint(entries, path, _no_pickled)}") from None
    value, prefix = (state, "") if path is None else _select(state, path)
    if fmt == "lightning" and not (isinstance(value, dict) and isinstance(value.get("state_dict"), dict)):
        raise InvalidArgument(f"{where} is not a Lightning checkpoint (a dict with a 'state_dict', as "
                              "TsckCheckpointIO stores them): write it with --format torch")
    try:
        if fmt == "safetensors":
            from safetensors.torch import save_file
            tensors, meta = _safetensors_items(value, prefix, where)
            _check_st_names(tensors, where)
            meta.setdefault("format", "pt")  # what transformers checks before it loads a file
            write_atomic(dest, lambda tmp: save_file(tensors, tmp, metadata=meta), force=force,
                         needed=_nbytes(tensors))
            summary = {"tensors": len(tensors), "metadata": len(meta)}
        else:
            write_atomic(dest, lambda tmp: _torch_save(value, tmp), force=force, needed=_nbytes(value))
            summary = {}
    except TsckError:
        raise
    except OSError as e:
        raise storage_error(e, f"writing {dest}") from e
    return {"root": root, "target": target, "dest": dest, "format": fmt, "path": path,
            "bytes": os.path.getsize(dest), **summary}


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
