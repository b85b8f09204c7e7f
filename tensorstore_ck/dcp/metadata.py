"""DCP Metadata <-> plain values (no pickle): dtypes, layouts and memory formats by
name, sizes as lists; every field checked on the way back."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)

from ..errors import FormatError, UnsupportedType
from ..format.dtypes import TORCH_DTYPES, torch_dtype_name
from ..format.tree import MAX_CHUNKS, MAX_DIM, MAX_DIMS

__all__ = ["encode_metadata", "decode_metadata", "dtype_name", "QUANTIZED"]

_LAYOUTS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_MEMORY_FORMATS = {str(v).removeprefix("torch."): v for v in vars(torch).values()
                   if isinstance(v, torch.memory_format)}
QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def _name(table: dict, value, what: str) -> str:
    for k, v in table.items():
        if v == value:
            return k
    raise UnsupportedType(f"DCP metadata: {what} {value!r} has no stored name")


def dtype_name(dt: torch.dtype) -> str:
    name = torch_dtype_name(dt)
    if TORCH_DTYPES.get(name) is not dt:
        raise UnsupportedType(f"tensors of dtype {dt} are not supported")
    return name


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)



def encode_metadata(md: Metadata) -> dict:
    """DCP Metadata -> plain values (no pickle): dtypes/layouts/memory formats by name."""
    sdm = {}
    for fqn, m in md.state_dict_metadata.items():
        if type(fqn) is not str:
            raise UnsupportedType(f"DCP fqn {fqn!r} is not a str")
        if isinstance(m, TensorStorageMetadata):
            p = m.properties
            sdm[fqn] = {
                "type": "tensor",
                "dtype": dtype_name(p.dtype),
                "layout": _name(_LAYOUTS, p.layout, "layout"),
                "requires_grad": bool(p.requires_grad),
                "memory_format": _name(_MEMORY_FORMATS, p.memory_format, "memory format"),
                "pin_memory": bool(p.pin_memory),
                "size": [int(x) for x in m.size],
                "chunks": [[[int(x) for x in c.offsets], [int(x) for x in c.sizes]] for c in m.chunks],
            }
        elif isinstance(m, BytesStorageMetadata):
            sdm[fqn] = {"type": "bytes"}
        else:
            raise UnsupportedType(f"DCP storage metadata of type {type(m).__name__} for {fqn!r}")
    sm = md.storage_meta
    smd = None
    if sm is not None:
        cid = sm.checkpoint_id
        smd = {"checkpoint_id": None if cid is None else str(cid), "save_id": sm.save_id, "load_id": sm.load_id,
               "modules": list(sm.modules)}
    return {"version": md.version, "state_dict_metadata": sdm, "planner_data": md.planner_data,
            "storage_data": md.storage_data, "storage_meta": smd}


def _need(cond, what):
    if not cond:
        raise FormatError(f"DCP metadata: bad {what}")


def _ints(x, what, n=None):
    _need(isinstance(x, list) and len(x) <= MAX_DIMS and all(_is_int(v) and 0 <= v < MAX_DIM for v in x)
          and (n is None or len(x) == n), what)
    return torch.Size(x)


def decode_metadata(d) -> Metadata:
    """Plain values (as encode_metadata made them) -> DCP Metadata; every field is checked."""
    _need(isinstance(d, dict), "top value")
    sdm_in = d.get("state_dict_metadata")
    _need(isinstance(sdm_in, dict), "state_dict_metadata")
    sdm: dict = {}
    for fqn, m in sdm_in.items():
        _need(isinstance(fqn, str) and isinstance(m, dict), "entry")
        if m.get("type") == "bytes":
            sdm[fqn] = BytesStorageMetadata()
            continue
        _need(m.get("type") == "tensor", f"entry type of {fqn!r}")
        dt, lay, mf = m.get("dtype"), m.get("layout"), m.get("memory_format")
        _need(isinstance(dt, str) and dt in TORCH_DTYPES, f"dtype of {fqn!r}")
        _need(isinstance(lay, str) and lay in _LAYOUTS, f"layout of {fqn!r}")
        _need(isinstance(mf, str) and mf in _MEMORY_FORMATS, f"memory format of {fqn!r}")
        _need(isinstance(m.get("requires_grad"), bool) and isinstance(m.get("pin_memory"), bool), f"flags of {fqn!r}")
        size = _ints(m.get("size"), f"size of {fqn!r}")
        chunks = m.get("chunks")
        _need(isinstance(chunks, list) and len(chunks) <= MAX_CHUNKS, f"chunks of {fqn!r}")
        cl = []
        for c in chunks:
            _need(isinstance(c, list) and len(c) == 2, f"chunk of {fqn!r}")
            off = _ints(c[0], f"chunk offsets of {fqn!r}", len(size))
            sz = _ints(c[1], f"chunk sizes of {fqn!r}", len(size))
            _need(all(o + s <= g for o, s, g in zip(off, sz, size)), f"chunk bounds of {fqn!r}")
            cl.append(ChunkStorageMetadata(offsets=off, sizes=sz))
        props = TensorProperties(dtype=TORCH_DTYPES[dt], layout=_LAYOUTS[lay], requires_grad=m["requires_grad"],
                                 memory_format=_MEMORY_FORMATS[mf], pin_memory=m["pin_memory"])
        sdm[fqn] = TensorStorageMetadata(properties=props, size=size, chunks=cl)
    sm_in = d.get("storage_meta")
    sm = None
    if sm_in is not None:
        _need(isinstance(sm_in, dict), "storage_meta")
        for k in ("checkpoint_id", "save_id", "load_id"):
            _need(sm_in.get(k) is None or isinstance(sm_in.get(k), str), f"storage_meta.{k}")
        mods = sm_in.get("modules")
        _need(isinstance(mods, list) and all(isinstance(x, str) for x in mods), "storage_meta.modules")
        sm = StorageMeta(checkpoint_id=sm_in.get("checkpoint_id"), save_id=sm_in.get("save_id"),
                         load_id=sm_in.get("load_id"), modules=list(mods))
    ver = d.get("version")
    _need(ver is None or isinstance(ver, str), "version")
    return Metadata(state_dict_metadata=sdm, planner_data=d.get("planner_data"),
                    storage_data=d.get("storage_data"), storage_meta=sm, version=ver)


