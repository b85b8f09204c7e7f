"""Snapshots in and out as files other tools read: `tsck ls`, `tsck checkout`, `tsck import`.

    list_tree(core, root, path)            the tree's values: path, kind, dtype, shape, bytes;
                                           manifest nodes only, no block is read
    export_file(store, target, dest, ...)  one standalone file, safetensors or torch.save, written
                                           to a temp file beside DEST and renamed: never half a file
    export_folder(store, target, dest)     a Hugging Face `save_pretrained` folder: model.safetensors
                                           (or shards + index), config.json when the snapshot carries it
    load_files(files) / import_files(...)  torch.save files (weights_only), safetensors files and
                                           Hugging Face model folders -> one snapshot

Paths are dotted, as safetensors names and state_dict keys are: the keys from the top
joined by "." ("model.layers.0.weight"), list and tuple items by their index. A key that
holds dots (a flat state_dict's) is kept whole, so a flat state_dict and the same tree
stored nested name their values alike, and a PATH "model.layers.0" selects in either.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections import OrderedDict

import numpy as np
import torch

from .errors import InvalidArgument, TsckError, UnsupportedType, storage_error
from .format.dtypes import QUANT_NAMES, TORCH_DTYPES
from .info import SnapshotInfo
from .listing import MAX_ENTRIES, Entry, list_tree
from .localfile import NotRegularFile, open_regular, reopen_path, write_atomic, write_dir
from .paths import dotted, key_str as _key_str, toward as _toward, under as _under
from .shard import Sharded
from .validate import check_snapshot_args

__all__ = ["Entry", "list_tree", "export_file", "export_folder", "write_pretrained", "format_for", "load_files",
           "import_files", "dotted", "is_folder_dest", "SAFETENSORS_DTYPES", "MAX_ENTRIES", "FORMATS", "HF_META",
           "SHARD_BYTES"]

FORMATS = ("safetensors", "torch")
MAX_INDEX_BYTES = 64 << 20  # a Hugging Face index json (a few hundred KB for the largest models)
MAX_CONFIG_BYTES = 1 << 20  # a config.json carried in a snapshot's meta (a few KB; the catalog keeps it)
SHARD_BYTES = 50 * 10**9  # save_pretrained's default max_shard_size ("50GB") in transformers 5
# A snapshot that holds a Hugging Face model says so in its meta: meta[HF_META] = {"weights": the
# dotted path of its state_dict in the tree ("" for the top), "config": config.json's text,
# "generation_config": generation_config.json's text, "tied": {name: name it is tied to}}; every
# key is optional. `tsck import FOLDER` and hf.TsckCallback write it; export_folder reads it.
HF_META = "hf"
_CONFIG_FILES = (("config", "config.json"), ("generation_config", "generation_config.json"))

# What the safetensors format holds (dtype codes F64 ... U64, F8_*); this installed
# safetensors reads each of them back. Anything else is refused by name before a block is read.
SAFETENSORS_DTYPES = frozenset(
    getattr(torch, n) for n in (
        "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
        "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n))
_ST_PLAIN = ("None", "bool", "int", "float", "str", "numpy")  # values that go to the metadata, as strings


# -- checkout to a file ---------------------------------------------------------------
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
    raise InvalidArgument(f"cannot tell the format from the name {os.path.basename(str(dest))!r} (.safetensors, "
                          ".pt, .pth, .bin): pass --format safetensors|torch")


def _st_refusal(kind: str, dtype) -> str | None:
    """Why safetensors cannot hold a value of this kind (None: it can). dtype: the
    torch or numpy dtype of a tensor or array."""
    if kind in ("tensor", "sharded", "array"):
        if isinstance(dtype, np.dtype):
            try:
                dtype = torch.from_numpy(np.empty(0, dtype=dtype.newbyteorder("="))).dtype
            except (TypeError, ValueError):
                return f"a numpy array of {dtype} (no torch dtype matches it)"
        if dtype not in SAFETENSORS_DTYPES:
            return f"a tensor of {str(dtype).removeprefix('torch.')} (safetensors has no such dtype)"
        return None
    if kind in _ST_PLAIN or kind in ("dict", "list", "tuple"):
        return None
    return {"bytes": "bytes (safetensors metadata holds strings only)",
            "pickled": "a pickled object"}.get(kind, f"a value of type {kind}")


# The key of a safetensors header that holds the file's metadata: a tensor of that name
# makes a header no reader opens (a duplicate key, or a tensor where strings belong).
ST_RESERVED = "__metadata__"


def _reserved_name(where: str, path: str) -> UnsupportedType:
    return UnsupportedType(f"{where} cannot be written as safetensors: the tensor at {path} would be named "
                           f"{ST_RESERVED!r}, which safetensors reserves for the file's metadata (no reader opens "
                           "such a file); use --format torch, or --path to write another part")


def _check_st_names(names, where: str) -> None:
    if ST_RESERVED in names:
        raise _reserved_name(where, ST_RESERVED)


def _refuse(where: str, what: str, path: str) -> UnsupportedType:
    return UnsupportedType(f"{where} cannot be written as safetensors: it holds {what} at {path or 'its top'} "
                           "(use --format torch, or --path to take out the tensors only)")


def _check_for_safetensors(entries, where: str, strip: str | None = None) -> None:
    """Refuse from the manifest alone, before a block is read. strip: the prefix the
    tensors' names lose (a model folder's weights at PATH)."""
    for e in entries:
        dtype = None
        if e.kind in ("tensor", "sharded", "array"):
            name = e.path[len(strip) + 1:] if strip and e.path.startswith(strip + ".") else e.path
            if name == ST_RESERVED:
                raise _reserved_name(where, e.path)
        if e.kind in ("tensor", "sharded"):
            if e.dtype in QUANT_NAMES:
                raise _refuse(where, f"a quantized tensor of {e.dtype}", e.path)
            dtype = TORCH_DTYPES.get(e.dtype)
        elif e.kind == "numpy" and e.value is None:
            raise _refuse(where, f"a numpy scalar of {e.dtype}", e.path)
        elif e.kind == "array":
            try:
                dtype = np.dtype(e.dtype)
            except TypeError:
                raise _refuse(where, f"a numpy array of {e.dtype}", e.path) from None
        why = _st_refusal(e.kind, dtype)
        if why is not None:
            raise _refuse(where, why, e.path)


def _meta_str(v) -> str:
    if type(v) is str:
        return v
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, complex):
        return str(v)
    return json.dumps(v)  # None -> null, True -> true, 0.1 -> 0.1, nan -> NaN


def _safetensors_items(value, prefix: str, where: str) -> tuple[dict, dict]:
    """A state (or the part of it at `prefix`) -> (name -> tensor, name -> str)."""
    tensors: dict[str, torch.Tensor] = {}
    meta: dict[str, str] = {}
    stack = [(value, prefix)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, dict):
            stack.extend((x, f"{p}.{_key_str(k)}" if p else _key_str(k)) for k, x in reversed(list(v.items())))
            continue
        if isinstance(v, (list, tuple)):
            stack.extend((x, f"{p}.{i}" if p else str(i)) for i, x in reversed(list(enumerate(v))))
            continue
        if isinstance(v, Sharded):
            raise _refuse(where, "one rank's piece of a sharded tensor", p)
        if isinstance(v, torch.Tensor):
            if v.is_quantized or v.layout != torch.strided:
                raise _refuse(where, "a quantized or sparse tensor", p)
            why = _st_refusal("tensor", v.dtype)
            if why:
                raise _refuse(where, why, p)
            t = v.detach().cpu().contiguous()
        elif isinstance(v, np.ndarray):
            why = _st_refusal("array", v.dtype)
            if why:
                raise _refuse(where, why, p)
            # safetensors is little-endian: a big-endian array's values go in native order
            t = torch.from_numpy(np.ascontiguousarray(v, dtype=v.dtype.newbyteorder("=")))
        elif v is None or type(v) in (bool, int, float, str) or (isinstance(v, np.generic)
                                                                  and v.dtype.kind in "biufc"):
            if p in meta:
                raise _refuse(where, "two values named alike", p)
            meta[p] = _meta_str(v)
            continue
        else:
            raise _refuse(where, _st_refusal(type(v).__name__, None) or type(v).__name__, p)
        if not p:
            raise UnsupportedType(f"{where} is a single tensor without a name: give --path NAME, or use "
                                  "--format torch")
        if p in tensors:
            raise _refuse(where, "two tensors named alike (a key with dots beside a nested one)", p)
        tensors[p] = t
    return tensors, meta


def _select(state, path: str):
    """(value, its dotted path) of the value at `path` in a checked-out state; when no one
    value is there (the keys of a flat state_dict under a prefix), a dict of the values
    under it by their full dotted names, and prefix ""."""
    v, rest, done = state, path, []
    while rest:
        if isinstance(v, dict):
            pairs = [(_key_str(k), k) for k in v]
        elif isinstance(v, (list, tuple)):
            pairs = [(str(i), i) for i in range(len(v))]
        else:
            break
        hits = [(s, k) for s, k in pairs if rest == s or rest.startswith(s + ".")]
        if not hits:
            break
        s, k = max(hits, key=lambda h: len(h[0]))  # a key with dots beats a shorter one
        v, rest = v[k], rest[len(s) + 1:]
        done.append(s)
    if not rest:
        return v, path
    # A prefix of keys that hold dots (a flat state_dict): gather the values under it.
    out: dict = {}
    stack = [(state, "")]
    while stack:
        x, p = stack.pop()
        if _under(p, path) and p:
            out[p] = x
        elif isinstance(x, dict) and _toward(p, path):
            stack.extend((y, f"{p}.{_key_str(k)}" if p else _key_str(k)) for k, y in reversed(list(x.items())))
        elif isinstance(x, (list, tuple)) and _toward(p, path):
            stack.extend((y, f"{p}.{i}" if p else str(i)) for i, y in reversed(list(enumerate(x))))
    return out, ""


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
    root = store.resolve(target)  # once: the ref may move while we read
    where = f"snapshot {root[:16]} ({target}) of {store.url}"
    if fmt == "safetensors":
        _, entries = list_tree(store.core, root, path)
        _check_for_safetensors(entries, where)
    elif path is not None:
        list_tree(store.core, root, path)  # refuses a path that holds nothing before a block is read
    # Reads only the blocks under PATH; _select then finds the value in the pruned tree.
    state = store.checkout(root, paths=None if path is None else [path], progress=progress)
    value, prefix = (state, "") if path is None else _select(state, path)
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


def _nbytes(value) -> int:
    """The bytes of the tensors and arrays in a state (about what a file of it takes)."""
    n, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, torch.Tensor):
            n += v.numel() * v.element_size()
        elif isinstance(v, np.ndarray):
            n += v.nbytes
    return n


def _torch_save(value, path: str) -> None:
    with open(path, "wb") as f:
        sink = _RecordingFile(f)
        try:
            torch.save(value, sink)
        except Exception:
            if sink.error is not None:
                raise sink.error from None
            raise


# -- checkout to a Hugging Face model folder ---------------------------------------------
def is_folder_dest(dest) -> bool:
    """DEST names a folder: an existing directory, or a name that ends with a separator."""
    d = os.fspath(dest)
    return os.path.isdir(d) or d.endswith(os.sep) or (os.altsep is not None and d.endswith(os.altsep))


def _is_weights_file(name: str) -> bool:
    """The files save_pretrained writes the weights to (what an older export may have left)."""
    return name in ("model.safetensors", "model.safetensors.index.json") or \
        re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name) is not None


def _config_text(v, what: str) -> str | None:
    if v is None:
        return None
    if isinstance(v, dict):
        v = json.dumps(v, indent=2, sort_keys=True) + "\n"
    if type(v) is not str:
        raise InvalidArgument(f"{what} must be a JSON text or a dict, got {type(v).__name__}")
    try:
        if not isinstance(json.loads(v), dict):
            raise ValueError("not a JSON object")
    except (ValueError, RecursionError) as e:
        raise InvalidArgument(f"{what} is not a JSON object: {_first_line(e)}") from None
    return v


def _check_shard_bytes(n) -> None:
    if type(n) is not int or n < 1:
        raise InvalidArgument(f"max_shard_bytes must be an int >= 1, got {n!r}")


def write_pretrained(folder: str, tensors: dict, *, config: str | None = None, generation_config: str | None = None,
                     max_shard_bytes: int = SHARD_BYTES) -> list[str]:
    """Write a state_dict (name -> CPU tensor, no two sharing memory) into the empty
    directory `folder` as save_pretrained lays it out: model.safetensors, or past
    max_shard_bytes shards model-0000i-of-0000n.safetensors (in the state_dict's order)
    and model.safetensors.index.json; config.json and generation_config.json when given.
    -> the file names written."""
    from safetensors.torch import save_file
    _check_shard_bytes(max_shard_bytes)
    _check_st_names(tensors, "a model folder")
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    shards: list[list[str]] = [[]]
    used = 0
    for k, n in sizes.items():
        if shards[-1] and used + n > max_shard_bytes:  # a tensor larger than a shard gets one of its own
            shards.append([])
            used = 0
        shards[-1].append(k)
        used += n
    names = []
    if len(shards) == 1:
        save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        names.append("model.safetensors")
    else:
        weight_map = {}
        for i, part in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({k: tensors[k] for k in part}, os.path.join(folder, fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, fname))
            names.append(fname)
        index = {"metadata": {"total_size": sum(sizes.values()),
                              "total_parameters": sum(t.numel() for t in tensors.values())},
                 "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
        names.append("model.safetensors.index.json")
    for text, fname in ((config, "config.json"), (generation_config, "generation_config.json")):
        if text is not None:
            with open(os.path.join(folder, fname), "w", encoding="utf-8") as f:
                f.write(text)
            names.append(fname)
    return names


def export_folder(store, target: str, dest, *, path: str | None = None, config=None, generation_config=None,
                  max_shard_bytes: int = SHARD_BYTES, force: bool = False, progress: bool = False) -> dict:
    """Write the model a snapshot holds as a folder that transformers' from_pretrained
    loads (see write_pretrained). The weights: the part at `path`, else where the
    snapshot's meta["hf"] puts them ("model" for a Trainer snapshot), else the whole
    tree; the names save_pretrained leaves out as tied (meta "tied") are left out too.
    config.json / generation_config.json: `config`/`generation_config` (JSON text or a
    dict), else the snapshot's own (meta "hf"); none is written when there is neither.
    A DEST that does not exist appears whole; into an existing directory, files that are
    there already are replaced only with force=True (and an older export's weight files
    are then removed). Values safetensors cannot hold are refused before a block is read.
    -> a summary dict."""
    _check_shard_bytes(max_shard_bytes)  # before the snapshot is read
    dest = os.path.abspath(os.fspath(dest))
    parent = os.path.dirname(dest)
    if not os.path.isdir(parent):
        raise InvalidArgument(f"cannot write {dest}: no directory {parent}")
    if os.path.lexists(dest) and not os.path.isdir(dest):
        raise InvalidArgument(f"cannot write the folder {dest}: it is a file")
    root = store.resolve(target)  # once: the ref may move while we read
    where = f"snapshot {root[:16]} ({target}) of {store.url}"
    hf = store.show(root).meta.get(HF_META)
    hf = hf if isinstance(hf, dict) else {}
    wpath = hf.get("weights") if isinstance(hf.get("weights"), str) and hf.get("weights") else None
    if path is None:
        path = wpath
    tied = hf.get("tied") if path == wpath else None
    config = _config_text(config if config is not None else hf.get("config"), f"the config of {where}")
    generation_config = _config_text(generation_config if generation_config is not None
                                     else hf.get("generation_config"), f"the generation config of {where}")
    _, entries = list_tree(store.core, root, path)
    _check_for_safetensors(entries, where, strip=path)
    state = store.checkout(root, paths=None if path is None else [path], progress=progress)  # only PATH's blocks
    value, prefix = (state, "") if path is None else _select(state, path)
    tensors, plain = _safetensors_items(value, prefix, where)
    if plain:
        raise _refuse(where, "a value that is not a tensor (a model folder holds tensors only)", next(iter(plain)))
    if path:  # the names the state_dict has, not its place in the snapshot
        tensors = {k[len(path) + 1:] if k.startswith(path + ".") else k: v for k, v in tensors.items()}
    if isinstance(tied, dict):
        for alias, to in tied.items():
            if alias in tensors and to in tensors:
                del tensors[alias]
    try:
        names = write_dir(dest, lambda tmp: write_pretrained(tmp, tensors, config=config,
                                                             generation_config=generation_config,
                                                             max_shard_bytes=max_shard_bytes),
                          force=force, stale=_is_weights_file, needed=_nbytes(tensors))
    except TsckError:
        raise
    except OSError as e:
        raise storage_error(e, f"writing {dest}") from e
    return {"root": root, "target": target, "dest": dest, "format": "hf-folder", "path": path, "files": names,
            "tensors": len(tensors), "config": config is not None,
            "bytes": sum(os.path.getsize(os.path.join(dest, n)) for n in names)}


# -- import ------------------------------------------------------------------------------
def _first_line(e: BaseException, limit: int = 300) -> str:
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text if len(text) <= limit else text[:limit] + "..."


def _open_input(path: str) -> int:
    """A descriptor of the input file `path`; InvalidArgument for anything but a regular
    file (a FIFO is never waited on: localfile.open_regular)."""
    try:
        return open_regular(path, "tsck import reads regular files only")
    except FileNotFoundError:
        raise InvalidArgument(f"{path}: no such file or directory") from None
    except NotRegularFile as e:
        raise InvalidArgument(e.strerror) from None


def _sniff(path: str, head: bytes, size: int) -> str:
    """"torch" or "safetensors" by the file's first bytes (not its name: HF's .bin are torch).
    safetensors first: its u64 header length may begin with the byte 0x80 that begins a
    pickle (a header of 384 bytes does), but its ninth byte opens the JSON header."""
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= size - 8:
        return "safetensors"
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":  # torch.save's zip, or a legacy pickle
        return "torch"
    raise InvalidArgument(f"{path} is neither a torch.save nor a safetensors file (nor a Hugging Face model "
                          "folder)")


def _load_safetensors(src: str, path: str) -> tuple[dict, dict]:
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(src, framework="pt") as f:
            meta = dict(f.metadata() or {})
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except SafetensorError as e:
        raise InvalidArgument(f"{path} is not a readable safetensors file: "
                              f"{_first_line(e).replace(src, path)}") from None


def _storage_sizes(pkl: bytes) -> dict | None:
    """{record key: bytes} of the storages a torch.save zip's data.pkl names, as torch.load's
    own weights-only unpickler reads them (tensors rebuilt on the meta device: no data is
    read). None when this torch cannot say (its private unpickler changed): the caller then
    loads without mmap, where torch checks every record itself. A global the unpickler
    refuses raises its UnpicklingError, as torch.load would."""
    import io
    try:
        from torch import _weights_only_unpickler as wou
        from torch._utils import _element_size
        from torch.storage import TypedStorage
    except ImportError:
        return None
    sizes: dict[str, int] = {}
    made: dict[str, object] = {}

    def persistent_load(pid):
        _, storage_type, key, _location, numel = pid
        key = key.decode("ascii") if isinstance(key, bytes) else str(key)
        if key not in made:  # torch.load too reads a key once and shares it
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            sizes[key] = int(numel) * _element_size(dtype)
            made[key] = TypedStorage(wrap_storage=torch.UntypedStorage(sizes[key], device="meta"), dtype=dtype,
                                     _internal=True)
        return made[key]

    try:
        u = wou.Unpickler(io.BytesIO(pkl), encoding="utf-8")
        u.persistent_load = persistent_load
        u.load()
    except pickle.UnpicklingError:
        raise
    except Exception:  # noqa: BLE001 - whatever it is, torch.load without mmap says it in its words
        return None
    return sizes


def _zip_records_checked(src: str, path: str) -> bool:
    """Whether torch.load(mmap=True) of this torch.save zip reads exactly what torch.load
    without mmap reads. The mmap path takes each tensor's bytes from where its record's
    data begins, as many as the tensor needs, and checks neither that the record is
    stored uncompressed nor that it holds that many bytes: a DEFLATE-compressed record
    would be read as its compressed bytes, a record cut short as the zip entries after
    it. Both are refused here (InvalidArgument naming the record). False when this
    cannot be told (the file is not one Python's zipfile reads, this torch's unpickler
    changed): then the file is loaded without mmap, and torch checks each record."""
    import struct
    import zipfile
    try:
        zf = zipfile.ZipFile(src)
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError):
        return False
    with zf:
        infos = zf.infolist()
        names = [i.filename for i in infos]
        if not infos or len(set(names)) != len(names):  # two records of one name: torch's own reader decides
            return False
        archive = names[0].split("/", 1)[0]  # torch reads the records under its first record's folder
        by_name = {i.filename: i for i in infos}
        pkl = by_name.get(f"{archive}/data.pkl")
        if pkl is None:
            return False
        try:
            data = zf.read(pkl)
        except (zipfile.BadZipFile, ValueError, EOFError, OSError, NotImplementedError, RuntimeError):
            return False
        sizes = _storage_sizes(data)
        if sizes is None:
            return False
        end = os.fstat(zf.fp.fileno()).st_size
        for key, nbytes in sizes.items():
            name = f"{archive}/data/{key}"
            info = by_name.get(name)
            if info is None:
                raise InvalidArgument(f"{path} is not a readable torch.save file: it names a tensor record {name} "
                                      "that it does not hold")
            if info.compress_type != zipfile.ZIP_STORED:
                raise InvalidArgument(
                    f"{path} holds the tensor record {name} compressed (zip method {info.compress_type}); torch.save "
                    "stores tensor data uncompressed, and tsck import reads records in place, so it refuses the "
                    "file: load it with torch.load and re-save it with torch.save")
            zf.fp.seek(info.header_offset)
            local = zf.fp.read(30)
            if len(local) != 30 or local[:4] != b"PK\x03\x04":
                return False  # torch's reader refuses it, in its words
            start = info.header_offset + 30 + sum(struct.unpack("<HH", local[26:30]))  # name, extra field
            if info.file_size != nbytes or info.compress_size != nbytes or start + nbytes > end:
                raise InvalidArgument(
                    f"{path} is not a readable torch.save file: its record {name} holds {info.file_size} bytes where "
                    f"its tensor needs {nbytes} (the file is cut short or damaged; torch.load refuses it too)")
    return True


def _blocked_global(message: str) -> str | None:
    """The global a weights-only load refused, from torch's message (its first line is
    generic: "Weights only load failed ...")."""
    for pattern in (r"GLOBAL (\S+) was not an allowed global", r"unsupported GLOBAL (\S+) whose module \S+ is blocked",
                    r"Trying to call reduce for unrecognized function (.+?)(?: which belongs to .*)?$",
                    r"classes allowlisted via `add_safe_globals` but got (.+)$"):
        m = re.search(pattern, message, re.MULTILINE)
        if m:
            return m.group(1).strip().rstrip(".")
    return None


def _load_torch(src: str, path: str, zipped: bool):
    try:
        mmap = zipped and _zip_records_checked(src, path)
        return torch.load(src, map_location="cpu", weights_only=True, mmap=mmap)
    except TsckError:
        raise
    except pickle.UnpicklingError as e:
        name = _blocked_global(str(e))
        if name is not None:
            raise UnsupportedType(f"{path} needs pickle to load (it holds {name}, which a weights-only load refuses); "
                                  "tsck import loads torch files with weights_only=True: load it in Python, only if "
                                  "you trust its source, and put_snapshot the state") from None
        raise InvalidArgument(f"{path} is not a readable torch.save file: "
                              f"{_first_line(e).replace(src, path)}") from None
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, EOFError, ... on a bad file
        raise InvalidArgument(f"{path} is not a readable torch.save file: "
                              f"{_first_line(e).replace(src, path)}") from None


def _load_file(path: str):
    fd = _open_input(path)
    with open(fd, "rb") as f:
        head = f.read(9)
        kind = _sniff(path, head, os.fstat(fd).st_size)
        # The libraries open by name: the name of this open file, so nothing swapped in
        # at `path` since (a FIFO) is opened.
        src = reopen_path(fd, path)
        if kind == "safetensors":
            return _load_safetensors(src, path) + ("safetensors",)
        return _load_torch(src, path, head[:4] == b"PK\x03\x04"), {}, "torch"


def _read_small(path: str, limit: int, what: str) -> bytes:
    """The bytes of a small input file (a model index, a config.json); InvalidArgument
    past `limit` (sized on the open file) or for anything but a regular file."""
    with open(_open_input(path), "rb") as f:
        if os.fstat(f.fileno()).st_size > limit:
            raise InvalidArgument(f"{path} is larger than {limit} bytes: {what}")
        data = f.read(limit + 1)
    if len(data) > limit:  # grew meanwhile
        raise InvalidArgument(f"{path} is larger than {limit} bytes: {what}")
    return data


def _shards(folder: str, index: str) -> tuple[list[tuple[str, list]], list[str]]:
    """([(shard file, [names the index puts there])], [every name, in the index's order])
    of a sharded model's index json."""
    data = _read_small(index, MAX_INDEX_BYTES, "not a model index")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise InvalidArgument(f"{index} is not valid JSON: {_first_line(e)}") from None
    wm = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise InvalidArgument(f"{index} has no weight_map of tensor names to shard files")
    out: dict[str, list] = {}
    for name, shard in wm.items():
        if shard in ("", ".", "..") or os.path.basename(shard) != shard or "\\" in shard:
            raise InvalidArgument(f"{index} names the shard {shard!r}: a shard is a file in the model's folder")
        out.setdefault(shard, []).append(name)
    return list(out.items()), list(wm)


_HF_FILES = (("model.safetensors.index.json", True), ("model.safetensors", False),
             ("pytorch_model.bin.index.json", True), ("pytorch_model.bin", False))


def _load_folder(folder: str) -> tuple[dict, dict, str]:
    """A Hugging Face model folder: its (sharded) safetensors weights, else its pytorch_model.bin."""
    for name, is_index in _HF_FILES:
        p = os.path.join(folder, name)
        if not os.path.lexists(p):
            continue
        if not is_index:
            state, meta, kind = _load_file(p)
            if not isinstance(state, dict):
                raise InvalidArgument(f"{p} holds a {type(state).__name__}, not a dict of tensors")
            return state, meta, f"hf:{kind}"
        loaded: dict = {}
        meta: dict = {}
        kind = "safetensors" if "safetensors" in name else "torch"
        shards, order = _shards(folder, p)
        for shard, names in shards:
            sp = os.path.join(folder, shard)
            if not os.path.lexists(sp):
                raise InvalidArgument(f"{p} names the shard {shard}, which is not in {folder}")
            part, m, _ = _load_file(sp)
            if not isinstance(part, dict):
                raise InvalidArgument(f"{sp} holds a {type(part).__name__}, not a dict of tensors")
            missing = [n for n in names if n not in part]
            if missing:
                raise InvalidArgument(f"{p} puts {missing[0]!r} in {shard}, which does not hold it "
                                      f"({len(missing)} name(s) missing)")
            for k, v in part.items():
                if k in loaded:
                    raise InvalidArgument(f"{k!r} is in two shards of {folder}")
                loaded[k] = v
            meta.update(m)
        # The index's order (not the shards'), so a model sharded otherwise is the same tree.
        state = {n: loaded.pop(n) for n in order}
        state.update(loaded)  # anything a shard holds beyond its index
        return state, meta, f"hf:{kind}"
    raise InvalidArgument(f"{folder} is a folder without model.safetensors(.index.json) or pytorch_model.bin"
                          "(.index.json): not a Hugging Face model folder")


def _folder_configs(folder: str) -> dict:
    """config.json / generation_config.json of a model folder, as texts (meta "hf")."""
    out = {}
    for key, fname in _CONFIG_FILES:
        p = os.path.join(folder, fname)
        if not os.path.lexists(p):
            continue
        raw = _read_small(p, MAX_CONFIG_BYTES, "too large to keep in the snapshot's meta")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(f"{p} is not UTF-8 text") from None
        out[key] = _config_text(text, p)
    return out


def load_files(files) -> tuple[object, dict]:
    """(state, meta) of torch.save files, safetensors files and Hugging Face model folders.
    One input gives its state as it is; several are merged into one dict (each must be a
    dict; a name in two of them is refused). meta: {"import": [{"source", "format"[, "metadata"]}]},
    and for one Hugging Face folder "hf": {"weights": "", "config": config.json's text, ...}."""
    if not files:
        raise InvalidArgument("no file to import")
    states, sources = [], []
    for f in map(os.fspath, files):
        if not os.path.exists(f):
            raise InvalidArgument(f"{f}: no such file or directory")
        try:
            if os.path.isdir(f):
                state, md, kind = _load_folder(f)
            else:
                state, md, kind = _load_file(f)
        except OSError as e:
            raise InvalidArgument(f"cannot read {f}: {type(e).__name__}: {e.strerror or e}") from None
        states.append((f, state))
        sources.append({"source": os.path.abspath(f), "format": kind, **({"metadata": md} if md else {})})
    hf = {}
    if len(states) == 1:
        state = states[0][1]
        if os.path.isdir(states[0][0]):
            hf = _folder_configs(states[0][0])
    else:
        state, origin = {}, {}
        for f, s in states:
            if not isinstance(s, dict):
                raise InvalidArgument(f"{f} holds a {type(s).__name__}: several inputs merge into one dict, "
                                      "so each must hold a dict")
            for k, v in s.items():
                if k in state:
                    raise InvalidArgument(f"{k!r} is in both {origin[k]} and {f}")
                state[k], origin[k] = v, f
        if all(type(s) is OrderedDict for _, s in states):
            state = OrderedDict(state)
    return state, {"import": sources, **({HF_META: {"weights": "", **hf}} if hf else {})}


def import_files(store, ref: str, files, *, step: int | None = None, job: str | None = None,
                 progress: bool = False) -> SnapshotInfo:
    """One snapshot of the files' tensors at `ref` (see load_files). The arguments are
    checked before any file is read; nothing is written unless every file loads."""
    check_snapshot_args(ref, job=job, step=step)
    state, meta = load_files(files)
    return store.put_snapshot(state, ref=ref, step=step, job=job, meta=meta, progress=progress)
