"""Files other tools wrote, in as one snapshot: `tsck import`.

load_files reads torch.save files (weights_only: nothing from the file is executed),
safetensors files and Hugging Face model folders (hf_folder.py's format: the sharded
safetensors or pytorch_model.bin weights, config.json carried into the meta); several
inputs merge into one dict. import_files puts the result as one snapshot. Inputs are
untrusted: only regular files are opened (a FIFO is never waited on), a file is sniffed
by its bytes, not its name, and small inputs (an index, a config) are sized before
they are read.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from collections import OrderedDict

import torch

from ..core.validate import check_snapshot_args
from ..errors import InvalidArgument, TsckError, UnsupportedType
from ..info import SnapshotInfo
from ..util.localfile import NotRegularFile, open_regular, reopen_path
from .hf_folder import CONFIG_FILES, HF_META, MAX_CONFIG_BYTES, MAX_INDEX_BYTES, config_text, first_line

__all__ = ["load_files", "import_files"]


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
                              f"{first_line(e).replace(src, path)}") from None


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
                              f"{first_line(e).replace(src, path)}") from None
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError, EOFError, ... on a bad file
        raise InvalidArgument(f"{path} is not a readable torch.save file: "
                              f"{first_line(e).replace(src, path)}") from None


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
        raise InvalidArgument(f"{index} is not valid JSON: {first_line(e)}") from None
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
    for key, fname in CONFIG_FILES:
        p = os.path.join(folder, fname)
        if not os.path.lexists(p):
            continue
        raw = _read_small(p, MAX_CONFIG_BYTES, "too large to keep in the snapshot's meta")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidArgument(f"{p} is not UTF-8 text") from None
        out[key] = config_text(text, p)
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
