"""The Hugging Face model folder, and the safetensors view of a state it is made of.

A folder save_pretrained would write, from a snapshot (export_folder; `tsck checkout
STORE TARGET DIR/`): model.safetensors, or past max_shard_bytes the shards
model-0000i-of-0000n.safetensors and model.safetensors.index.json; config.json and
generation_config.json when the snapshot carries them. A snapshot that holds a model
says so in its meta (HF_META, below): where its state_dict lies in the tree, its
config texts, the names save_pretrained leaves out as tied. importing.py reads such
folders back; hf.py's callback writes the meta.

The safetensors view (also export.py's, for one .safetensors file): a state's tensors
by dotted name, its plain values as metadata strings; what the format cannot hold is
refused by name before a block is read.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import torch

from ..errors import InvalidArgument, TsckError, UnsupportedType, storage_error
from ..format.dtypes import QUANT_NAMES, TORCH_DTYPES
from ..read.listing import list_tree
from ..util.localfile import write_dir
from ..util.paths import key_str as _key_str, toward as _toward, under as _under
from ..write.shard import Sharded

__all__ = ["export_folder", "write_pretrained", "is_folder_dest", "SAFETENSORS_DTYPES", "HF_META", "SHARD_BYTES",
           "MAX_CONFIG_BYTES", "MAX_INDEX_BYTES"]

MAX_INDEX_BYTES = 64 << 20  # a Hugging Face index json (a few hundred KB for the largest models)
MAX_CONFIG_BYTES = 1 << 20  # a config.json carried in a snapshot's meta (a few KB; the catalog keeps it)
SHARD_BYTES = 50 * 10**9  # save_pretrained's default max_shard_size ("50GB") in transformers 5
# A snapshot that holds a Hugging Face model says so in its meta: meta[HF_META] = {"weights": the
# dotted path of its state_dict in the tree ("" for the top), "config": config.json's text,
# "generation_config": generation_config.json's text, "tied": {name: name it is tied to}, "files":
# the dotted path of the files kept beside the model (a Trainer snapshot's tokenizer)}; every
# key is optional. `tsck import FOLDER` and hf.TsckCallback write it; export_folder reads it.
HF_META = "hf"
CONFIG_FILES = (("config", "config.json"), ("generation_config", "generation_config.json"))

# Files of a checkpoint folder kept as they are (snapshot key "files"): what the Trainer writes
# beside the model that the rest of the snapshot does not hold, the processing class's above
# all (tokenizer.json, tokenizer_config.json, special_tokens_map.json, vocab.json, merges.txt,
# chat_template.jinja, spiece.model, preprocessor_config.json, processor_config.json, ...).
# A name is a plain file name; one that resume_checkpoint writes itself is the Trainer's.
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]{0,199}$")
_TRAINER_FILES = {"optimizer.pt", "scheduler.pt", "scaler.pt", "trainer_state.json", "training_args.bin", "config.json",
                  "generation_config.json"}
_TRAINER_FILE = re.compile(r"^(rng_state(_[0-9]+)?\.pth|.*\.safetensors|.*\.safetensors\.index\.json|"
                           r"pytorch_model.*\.bin|pytorch_model.*\.bin\.index\.json)$")
MAX_FILE_BYTES = 1 << 30  # one kept file; a bigger one is left in the folder (a warning says so)
MAX_FILES = 1024


def trainer_file(name: str) -> bool:
    """A file of a checkpoint folder the snapshot holds otherwise (weights, optimizer, RNG, state)."""
    return name in _TRAINER_FILES or _TRAINER_FILE.match(name) is not None


def check_kept_files(files, refuse) -> None:
    """Stored kept files are untrusted: a dict of plain file names (none the Trainer's or a
    model folder's own) -> 1-D uint8 tensors; else raise refuse(why)."""
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        raise refuse(f"its 'files' is not a dict of at most {MAX_FILES} files")
    for name, t in files.items():
        if type(name) is not str or not FILE_NAME.match(name) or trainer_file(name):
            raise refuse(f"its 'files' has the name {name!r:.80}, not a plain file name the Trainer's own "
                         "files leave free")
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
            raise refuse(f"its 'files'[{name!r}] is not the bytes of a file (a 1-D uint8 tensor)")


def write_kept_files(folder: str, files: dict) -> list[str]:
    """Write checked kept files (check_kept_files) into `folder`, byte for byte. -> their names."""
    for name, t in files.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(t.contiguous().numpy().tobytes())
    return list(files)


# What the safetensors format holds (dtype codes F64 ... U64, F8_*); this installed
# safetensors reads each of them back. Anything else is refused by name before a block is read.
SAFETENSORS_DTYPES = frozenset(
    getattr(torch, n) for n in (
        "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
        "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n))
_ST_PLAIN = ("None", "bool", "int", "float", "str", "numpy")  # values that go to the metadata, as strings


# -- a state as safetensors -------------------------------------------------------------
def st_refusal(kind: str, dtype) -> str | None:
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


def check_st_names(names, where: str) -> None:
    if ST_RESERVED in names:
        raise _reserved_name(where, ST_RESERVED)


def _refuse(where: str, what: str, path: str) -> UnsupportedType:
    return UnsupportedType(f"{where} cannot be written as safetensors: it holds {what} at {path or 'its top'} "
                           "(use --format torch, or --path to take out the tensors only)")


def check_for_safetensors(entries, where: str, strip: str | None = None) -> None:
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
        why = st_refusal(e.kind, dtype)
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


def safetensors_items(value, prefix: str, where: str) -> tuple[dict, dict]:
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
            why = st_refusal("tensor", v.dtype)
            if why:
                raise _refuse(where, why, p)
            t = v.detach().cpu().contiguous()
        elif isinstance(v, np.ndarray):
            why = st_refusal("array", v.dtype)
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
            raise _refuse(where, st_refusal(type(v).__name__, None) or type(v).__name__, p)
        if not p:
            raise UnsupportedType(f"{where} is a single tensor without a name: give --path NAME, or use "
                                  "--format torch")
        if p in tensors:
            raise _refuse(where, "two tensors named alike (a key with dots beside a nested one)", p)
        tensors[p] = t
    return tensors, meta


def select(state, path: str):
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


def nbytes(value) -> int:
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


def first_line(e: BaseException, limit: int = 300) -> str:
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text if len(text) <= limit else text[:limit] + "..."


# -- checkout to a Hugging Face model folder ---------------------------------------------
def is_folder_dest(dest) -> bool:
    """DEST names a folder: an existing directory, or a name that ends with a separator."""
    d = os.fspath(dest)
    return os.path.isdir(d) or d.endswith(os.sep) or (os.altsep is not None and d.endswith(os.altsep))


def _is_weights_file(name: str) -> bool:
    """The files save_pretrained writes the weights to (what an earlier export into the folder may have left)."""
    return name in ("model.safetensors", "model.safetensors.index.json") or \
        re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", name) is not None


def config_text(v, what: str) -> str | None:
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
        raise InvalidArgument(f"{what} is not a JSON object: {first_line(e)}") from None
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
    check_st_names(tensors, "a model folder")
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
    there already are replaced only with force=True (and an earlier export's weight files
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
    config = config_text(config if config is not None else hf.get("config"), f"the config of {where}")
    generation_config = config_text(generation_config if generation_config is not None
                                     else hf.get("generation_config"), f"the generation config of {where}")
    _, entries = list_tree(store.read_core, root, path)
    check_for_safetensors(entries, where, strip=path)
    state = store.checkout(root, paths=None if path is None else [path], progress=progress)  # only PATH's blocks
    value, prefix = (state, "") if path is None else select(state, path)
    tensors, plain = safetensors_items(value, prefix, where)
    if plain:
        raise _refuse(where, "a value that is not a tensor (a model folder holds tensors only)", next(iter(plain)))
    kept = {}
    fpath = hf.get("files") if path == wpath and isinstance(hf.get("files"), str) and hf.get("files") else None
    if fpath is not None:  # the tokenizer's and processor's files the Trainer wrote beside the model
        kept, _ = select(store.checkout(root, paths=[fpath]), fpath)
        check_kept_files(kept, lambda why: InvalidArgument(f"{where} cannot be written as a model folder: {why}"))
    if path:  # the names the state_dict has, not its place in the snapshot
        tensors = {k[len(path) + 1:] if k.startswith(path + ".") else k: v for k, v in tensors.items()}
    if isinstance(tied, dict):
        for alias, to in tied.items():
            if alias in tensors and to in tensors:
                del tensors[alias]
    try:
        names = write_dir(dest, lambda tmp: write_pretrained(tmp, tensors, config=config,
                                                             generation_config=generation_config,
                                                             max_shard_bytes=max_shard_bytes)
                          + write_kept_files(tmp, kept),
                          force=force, stale=_is_weights_file, needed=nbytes(tensors))
    except TsckError:
        raise
    except OSError as e:
        raise storage_error(e, f"writing {dest}") from e
    return {"root": root, "target": target, "dest": dest, "format": "hf-folder", "path": path, "files": names,
            "tensors": len(tensors), "config": config is not None,
            "bytes": sum(os.path.getsize(os.path.join(dest, n)) for n in names)}
