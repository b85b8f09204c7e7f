"""torch.distributed.checkpoint (DCP) storage for tensorstore_ck.

    import torch.distributed.checkpoint as dcp
    from tensorstore_ck.dcp import TsckWriter, TsckReader

    dcp.save(sd, storage_writer=TsckWriter(store, ref="jobA/main", step=100))
    dcp.load(sd, storage_reader=TsckReader(store, "jobA/main"))
    dcp.async_save(sd, storage_writer=TsckWriter(store, ref="jobA/main", step=200)).result()

DCP keeps doing the planning (flattening, deduplication of replicated items,
resharding on load); this module only stores what DCP asks it to store, as
one ordinary snapshot:

* every rank writes the blocks of its own chunks (hashed, deduplicated,
  written in parallel on the store's pool); only digests travel to the
  coordinator, inside ``WriteResult.storage_data``;
* the coordinator's ``finish`` composes one manifest tree and publishes it with
  ``store.commit_tree`` (one commit, one ref move, fenced against gc; if a gc
  deletion phase overlaps, it waits it out and checks that every block still
  exists, else raises ``SnapshotAborted`` and publishes nothing).

The tree is a plain state tree, so ``store.checkout(ref)`` works on it too::

    {"format": "dcp", "version": 1,
     "tensors":  {fqn: G leaf (global dtype and shape, every chunk of every rank)},
     "bytes":    {fqn: bytes  (DCP's torch.save'd non-tensor values; values over
                        1 MiB are stored as blocks: a 1-D uint8 tensor leaf)},
     "metadata": {"version", "state_dict_metadata", "planner_data", "storage_data",
                  "storage_meta"}}

``metadata`` is DCP's ``Metadata`` encoded field by field (dtypes, layouts and
memory formats by name, sizes as lists, tuples kept as tuples), never pickled;
``TsckReader.read_metadata`` rebuilds it exactly. Large containers are split
into child nodes (``{"r": digest}``), so an unchanged tensor's entry is shared
between snapshots, and a rank reading a few tensors reads only their nodes.

Loading reads, for each ``ReadItem``, only the blocks of the stored chunk that
intersect the requested rows, verifies them against their addresses, and
copies the requested box into ``planner.resolve_tensor(item)``.

Known limits: ``use_collectives=False`` under a process group of more than one
rank is refused (every rank would publish its own snapshot); quantized and
non-strided tensors are refused (``UnsupportedType``); a writer is picklable
(for ``AsyncCheckpointerType.PROCESS``) only when its store is a local folder
with its ref table beside it, and it then reopens the store in the other process.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import threading
import uuid
import weakref
from concurrent.futures import FIRST_EXCEPTION, wait
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   StorageMeta, TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem, SavePlan,
                                                  SavePlanner, WriteItem, WriteItemType)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import chunker
from .assets import block_key
from .errors import CheckoutMismatch, FormatError, InvalidName, SnapshotAborted, UnsupportedType
from .format.manifest import MAX_DEPTH, MAX_NODE_BYTES, decode_commit, decode_node, encode_node
from .refs.names import parse_target, validate_component, validate_name
from .state import NODE_SPLIT, TORCH_DTYPES
from .store import Store, _check_plain

__all__ = ["TsckWriter", "TsckReader", "TsckStorageData", "DCP_FORMAT", "DCP_LAYOUT_VERSION",
           "encode_metadata", "decode_metadata"]

DCP_FORMAT = "dcp"
DCP_LAYOUT_VERSION = 1          # the "version" field of the tree above; readers accept 1..1
MIN_LAYOUT_VERSION = MAX_LAYOUT_VERSION = 1
DCP_METADATA_VERSION = "1.0.0"  # what FileSystemWriter writes into Metadata.version
BYTES_INLINE_MAX = 1 << 20      # bytes items up to this size are stored inline (msgpack bin)
WRITE_COPY_BUDGET = 512 << 20   # host copies (device / non-contiguous tensors) in flight per rank
READ_TMP_BUDGET = 256 << 20     # staging buffers for partially read chunks, per batch

_LAYOUTS = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.layout)}
_MEMORY_FORMATS = {str(v).removeprefix("torch."): v for v in vars(torch).values()
                   if isinstance(v, torch.memory_format)}
_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}


def _name(table: dict, value, what: str) -> str:
    for k, v in table.items():
        if v == value:
            return k
    raise UnsupportedType(f"DCP metadata: {what} {value!r} has no stored name")


def _dtype_name(dt: torch.dtype) -> str:
    name = str(dt).removeprefix("torch.")
    if TORCH_DTYPES.get(name) is not dt:
        raise UnsupportedType(f"tensors of dtype {dt} are not supported")
    return name


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# -- the tree: python values -> manifest values, split into nodes --------------------------

@dataclass(frozen=True)
class _Value:
    """An already encoded manifest value (a G or T leaf)."""
    value: Any


@dataclass(frozen=True)
class _OwnNode:
    """Encode `obj` and always give it a node of its own."""
    obj: Any


class _NodeWriter:
    def __init__(self, assets):
        self.assets = assets
        self.payloads: list[bytes] = []  # kept so a fenced commit can write them again

    def put(self, value) -> bytes:
        payload = encode_node(value)
        if len(payload) > MAX_NODE_BYTES:
            raise UnsupportedType(f"a DCP manifest node of {len(payload)} bytes exceeds {MAX_NODE_BYTES}")
        self.payloads.append(payload)
        return self.assets.put_node(payload).digest

    def _split(self, v, size: int, depth: int):
        if depth > 0 and size > NODE_SPLIT:
            return {"r": self.put(v)}, 40
        return v, size

    def encode(self, obj, path=(), depth=0):
        """-> (manifest value, approximate encoded size)."""
        if depth > MAX_DEPTH:
            raise UnsupportedType(f"DCP metadata nested deeper than {MAX_DEPTH} levels", _fmt_path(path))
        t = type(obj)
        if t is _OwnNode:
            v, _ = self.encode(obj.obj, path, depth)
            if isinstance(v, dict) and len(v) == 1 and "r" in v:
                return v, 40  # already split off
            return {"r": self.put(v)}, 40
        if t is _Value:
            return self._split(obj.value, len(msgpack.packb(obj.value, use_bin_type=True)), depth)
        if obj is None or t is bool or t is float:
            return obj, 9
        if t is int:
            if -(2**63) <= obj < 2**64:
                return obj, 9
            return {"i": obj.to_bytes((obj.bit_length() + 8) // 8, "big", signed=True)}, 40
        if t is str:
            try:
                n = len(obj.encode("utf-8"))
            except UnicodeEncodeError:
                raise UnsupportedType("string is not valid UTF-8", _fmt_path(path)) from None
            return obj, n + 5
        if t is bytes:
            return self._split(obj, len(obj) + 5, depth)
        if t is dict:
            out, size = [], 8
            for k, x in obj.items():
                if type(k) is str:
                    kv, ks = self.encode(k, path, depth)
                elif type(k) is int and -(2**63) <= k < 2**64:
                    kv, ks = k, 9
                else:
                    raise UnsupportedType(f"dict key of type {type(k).__name__} (only str and 64-bit int)",
                                          _fmt_path(path))
                xv, xs = self.encode(x, path + (k,), depth + 1)
                out.append([kv, xv])
                size += ks + xs
            return self._split({"d": out}, size, depth)
        if t is list or t is tuple:
            out, size = [], 8
            for i, x in enumerate(obj):
                xv, xs = self.encode(x, path + (i,), depth + 1)
                out.append(xv)
                size += xs
            return self._split({"l" if t is list else "t": out}, size, depth)
        raise UnsupportedType(f"DCP metadata holds a {t.__module__}.{t.__qualname__}, which tensorstore_ck "
                              "stores only as None/bool/int/float/str/bytes/list/tuple/dict (no pickle)",
                              _fmt_path(path))


def _fmt_path(path) -> str:
    return "".join(f"[{p!r}]" for p in path)


# -- Metadata <-> plain values ----------------------------------------------------------

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
                "dtype": _dtype_name(p.dtype),
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
    _need(isinstance(x, list) and len(x) <= 64 and all(_is_int(v) and 0 <= v < 1 << 48 for v in x)
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
        _need(isinstance(chunks, list) and len(chunks) <= 1 << 20, f"chunks of {fqn!r}")
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


# -- writing ------------------------------------------------------------------------------

@dataclass(frozen=True)
class TsckStorageData:
    """WriteResult.storage_data: what a rank wrote for one item (addresses, not data).

    kind "tensor": value is the chunk dict {dt, sh, off, n, x | bs, b} of a G leaf.
    kind "bytes":  value is the bytes, or a {"T": uint8 leaf} whose blocks hold them."""
    kind: str
    value: Any
    blocks_new: int = 0
    bytes_new: int = 0


def _flat_bytes(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    """A tensor's C-contiguous bytes as a flat uint8 numpy array; True if that took a copy."""
    t = t.detach()
    src = t
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    copied = t.data_ptr() != src.data_ptr() or t.device != src.device
    return t.reshape(-1).view(torch.uint8).numpy(), copied


class _Pending:
    """Block writes of one item in flight."""
    __slots__ = ("item", "kind", "meta", "wrap", "futs", "keep", "copied")

    def __init__(self, item, kind, meta, wrap, futs, keep, copied):
        self.item, self.kind, self.meta, self.wrap = item, kind, meta, wrap
        self.futs, self.keep, self.copied = futs, keep, copied


class TsckWriter(StorageWriter):
    """A DCP StorageWriter that publishes one tensorstore_ck snapshot per dcp.save.

    store: a tensorstore_ck Store (each rank opens its own on the same location).
    ref, step, job, metrics, meta: as for store.put_snapshot. dcp.save's
    checkpoint_id, when given, is the ref ("REF" or "REF@STEP").
    After a save, `writer.info` (on the coordinator) is the SnapshotInfo."""

    def __init__(self, store: Store, ref: str, step: int | None = None, *, job: str | None = None,
                 metrics: dict | None = None, meta: dict | None = None):
        super().__init__()
        if not isinstance(store, Store):
            raise InvalidName(f"store must be a tensorstore_ck Store, got {type(store).__name__}")
        self.store = store
        self._job_given = job
        self._set_ref(ref, step)
        metrics = dict(metrics or {})
        for k, v in metrics.items():
            if type(k) is not str or type(v) not in (int, float):
                raise InvalidName(f"metrics must map str to int/float, got {k!r}: {v!r}")
        _check_plain(metrics, "metrics")
        meta = dict(meta or {})
        _check_plain(meta, "meta")
        self.metrics, self.meta = metrics, meta
        self.info = None
        self.is_coordinator = True
        self.rank = None
        self._fence: int | None = None
        self.save_id = uuid.uuid4().hex

    def _set_ref(self, ref, step):
        validate_name(ref)
        if step is not None and (type(step) is not int or not -(2**63) <= step < 2**63):
            raise InvalidName(f"step must be an int, got {step!r}")
        self.ref, self.step = ref, step
        self.job = validate_component(self._job_given if self._job_given is not None else ref.split("/", 1)[0],
                                      "job name")

    @property
    def checkpoint_id(self) -> str:
        return self.ref

    # -- StorageWriter ------------------------------------------------------------------
    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            cid = str(checkpoint_id)
            if "@" in cid:
                kind, ref, step = parse_target(cid)
                self._set_ref(ref, step)
            else:
                self._set_ref(cid, self.step)
        self.save_id = uuid.uuid4().hex
        self._fence = None
        self.info = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        try:
            s = str(checkpoint_id)
            if "@" in s:
                parse_target(s)
            else:
                validate_name(s)
            return True
        except Exception:
            return False

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.ref, save_id=self.save_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        if not kwargs.get("use_collectives", True):
            import torch.distributed as dist
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise InvalidName("TsckWriter needs use_collectives=True under a process group of more than "
                                  "one rank: one snapshot covers all ranks")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Refuse what cannot be stored before any rank writes anything.
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                continue
            p = item.tensor_data.properties
            if p.dtype in _QUANTIZED:
                raise UnsupportedType(f"quantized tensor {item.index.fqn!r} ({p.dtype}) is not supported by "
                                      "TsckWriter")
            _dtype_name(p.dtype)
            if p.layout != torch.strided:
                raise UnsupportedType(f"{p.layout} tensor {item.index.fqn!r} is not supported (only dense)")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # On the coordinator, after every rank planned and before any rank writes a
        # block: the gc fence the commit will be checked against.
        self._fence = self.store.gc_fence()
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        pending: list[_Pending] = []
        results: list[WriteResult] = []
        copied_inflight = 0
        try:
            for item in plan.items:
                p = self._submit(item, planner)
                if isinstance(p, WriteResult):
                    results.append(p)
                    continue
                pending.append(p)
                copied_inflight += p.copied
                while copied_inflight > WRITE_COPY_BUDGET and pending:
                    done = pending.pop(0)
                    results.append(self._finish_item(done))
                    copied_inflight -= done.copied
            while pending:
                results.append(self._finish_item(pending.pop(0)))
        except BaseException:
            for p in pending:
                for f in p.futs:
                    f.cancel()
            wait([f for p in pending for f in p.futs])
            raise
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _blocks(self, flat: np.ndarray, itemsize: int, shape: tuple, meta: dict):
        """Plan the blocks of `flat` into `meta`; -> futures of their PutResults."""
        store = self.store
        n = flat.nbytes
        meta["n"] = n
        layout = chunker.plan_blocks(n, itemsize, shape, store.block_size, store.inline_threshold)
        if layout.block_size == 0:
            meta["x"] = flat.tobytes()
            return []
        meta["bs"] = layout.block_size
        return [store._pool.submit(store.assets.put_block, flat[a:b], itemsize)
                for _i, a, b in chunker.block_ranges(layout)]

    def _submit(self, item: WriteItem, planner: SavePlanner):
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            data = planner.resolve_data(item)
            if isinstance(data, io.BytesIO):
                raw = bytes(data.getbuffer())
            elif isinstance(data, (bytes, bytearray, memoryview)):
                raw = bytes(data)
            else:
                raise UnsupportedType(f"DCP gave a {type(data).__name__} for the bytes item {fqn!r}")
            if len(raw) <= BYTES_INLINE_MAX:
                return WriteResult(index=item.index, size_in_bytes=len(raw),
                                   storage_data=TsckStorageData("bytes", raw))
            flat = np.frombuffer(raw, dtype=np.uint8)
            meta = {"dt": "uint8", "sh": [len(raw)]}
            futs = self._blocks(flat, 1, (len(raw),), meta)
            return _Pending(item, "bytes", meta, "T", futs, flat, 0)
        td = item.tensor_data
        if td is None or td.chunk is None:
            raise FormatError(f"DCP write item {fqn!r} has no tensor data")
        data = planner.resolve_data(item)
        if not isinstance(data, torch.Tensor):
            raise UnsupportedType(f"DCP gave a {type(data).__name__} for the tensor item {fqn!r}")
        if data.dtype != td.properties.dtype:
            raise UnsupportedType(f"tensor {fqn!r}: data is {data.dtype}, DCP's metadata says "
                                  f"{td.properties.dtype}")
        if data.dtype in _QUANTIZED or data.layout != torch.strided:
            raise UnsupportedType(f"tensor {fqn!r} of {data.dtype}/{data.layout} is not supported")
        shape = tuple(int(x) for x in td.chunk.sizes)
        if tuple(data.shape) != shape:
            raise FormatError(f"tensor {fqn!r}: data has shape {tuple(data.shape)}, its chunk {list(shape)}")
        flat, copied = _flat_bytes(data)
        meta = {"dt": _dtype_name(data.dtype), "sh": list(shape), "off": [int(x) for x in td.chunk.offsets]}
        futs = self._blocks(flat, data.element_size(), shape, meta)
        return _Pending(item, "tensor", meta, None, futs, flat, flat.nbytes if copied else 0)

    def _finish_item(self, p: _Pending) -> WriteResult:
        wait(p.futs, return_when=FIRST_EXCEPTION)
        for f in p.futs:
            if f.done() and not f.cancelled() and f.exception() is not None:
                for g in p.futs:
                    g.cancel()
                wait(p.futs)
                raise f.exception()
        res = [f.result() for f in p.futs]
        meta = dict(p.meta)
        if res:
            meta["b"] = [r.digest for r in res]
        bn = sum(1 for r in res if r.new)
        byn = sum(r.raw_len for r in res if r.new)
        value = {"T": meta} if p.wrap == "T" else meta
        p.keep = None
        return WriteResult(index=p.item.index, size_in_bytes=meta["n"],
                           storage_data=TsckStorageData(p.kind, value, bn, byn))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        store = self.store
        if metadata.version is None:
            metadata.version = DCP_METADATA_VERSION
        metadata.storage_meta = self.storage_meta()
        got: dict = {}
        st = {"bytes_total": 0, "bytes_new": 0, "blocks_total": 0, "blocks_new": 0}
        for wr_list in results:
            for wr in wr_list:
                sd = wr.storage_data
                if not isinstance(sd, TsckStorageData):
                    raise FormatError(f"write result for {wr.index.fqn!r} was not made by TsckWriter")
                off = None if wr.index.offset is None else tuple(int(x) for x in wr.index.offset)
                key = (wr.index.fqn, off if sd.kind == "tensor" else None)
                if key in got:
                    continue  # the same piece from two ranks: keep one
                got[key] = sd
                st["bytes_total"] += int(wr.size_in_bytes)
                st["bytes_new"] += sd.bytes_new
                st["blocks_new"] += sd.blocks_new
                leaf = sd.value.get("T") if sd.kind == "bytes" and isinstance(sd.value, dict) else sd.value
                if isinstance(leaf, dict):
                    st["blocks_total"] += len(leaf.get("b", ()))
        tensors, byts, digests = {}, {}, []
        for fqn, m in metadata.state_dict_metadata.items():
            if isinstance(m, TensorStorageMetadata):
                dt = _dtype_name(m.properties.dtype)
                chunks = []
                for c in m.chunks:
                    sd = got.pop((fqn, tuple(int(x) for x in c.offsets)), None)
                    if sd is None or sd.kind != "tensor":
                        raise SnapshotAborted(f"no rank wrote the chunk of {fqn!r} at {list(c.offsets)}; "
                                              "nothing was published")
                    if sd.value["sh"] != [int(x) for x in c.sizes] or sd.value["dt"] != dt:
                        raise FormatError(f"the chunk of {fqn!r} at {list(c.offsets)} does not match DCP's "
                                          "metadata")
                    chunks.append(sd.value)
                    digests.extend(sd.value.get("b", ()))
                tensors[fqn] = _Value({"G": {"dt": dt, "sh": [int(x) for x in m.size], "chunks": chunks}})
            else:
                sd = got.pop((fqn, None), None)
                if sd is None or sd.kind != "bytes":
                    raise SnapshotAborted(f"no rank wrote the bytes item {fqn!r}; nothing was published")
                if isinstance(sd.value, dict):
                    byts[fqn] = _Value(sd.value)
                    digests.extend(sd.value["T"].get("b", ()))
                else:
                    byts[fqn] = sd.value
        if got:
            extra = sorted(str(k) for k in got)[:5]
            raise FormatError(f"write results not described by DCP's metadata: {extra}")
        nodes = _NodeWriter(store.assets)
        top, _ = nodes.encode({"format": DCP_FORMAT, "version": DCP_LAYOUT_VERSION,
                               "tensors": _OwnNode(tensors), "bytes": byts,
                               "metadata": _OwnNode(encode_metadata(metadata))})
        tree = nodes.put(top)
        fence = self._fence if self._fence is not None else store.gc_fence()
        self.info = store.commit_tree(
            tree, ref=self.ref, job=self.job, step=self.step, metrics=self.metrics,
            meta={**self.meta, "format": DCP_FORMAT}, stats=st, fence=fence,
            revalidate=lambda body: self._revalidate(digests, nodes.payloads, body))

    def _revalidate(self, digests: list, payloads: list, commit_body: bytes) -> int:
        """A gc deletion phase overlapped: wait it out, then make sure every block
        still exists (the coordinator holds addresses only, not the data of other
        ranks: a removed block aborts the snapshot). Returns the new fence."""
        store = self.store
        fence = store.wait_gc_idle()
        exists = store.assets.storage.exists
        present = list(store._pool.map(lambda d: exists(block_key(d)), digests))
        missing = sum(1 for ok in present if not ok)
        if missing:
            raise SnapshotAborted(f"gc removed {missing} block(s) this DCP snapshot of {self.ref!r} references; "
                                  "nothing was published, save again")
        for payload in payloads:
            store.assets.put_node(payload)
        store.assets.put_commit(commit_body)
        store.assets.sync()
        return fence

    # -- pickling (AsyncCheckpointerType.PROCESS sends the writer to another process) -----
    def __getstate__(self):
        st = self.__dict__.copy()
        st["store"] = _StoreHandle.of(self.store)
        st["info"] = None
        return st

    def __setstate__(self, st):
        st["store"] = st["store"].open()
        self.__dict__.update(st)


@dataclass(frozen=True)
class _StoreHandle:
    """How to open the same store in another process (a store is opened once per
    process: in the process that pickled it, unpickling gives the same Store)."""
    url: str
    options: tuple

    @staticmethod
    def of(store: Store) -> "_StoreHandle":
        from .refs import LmdbRefTable
        url = store.url
        rt = store.reftable
        if not url.startswith("file://") or not isinstance(rt, LmdbRefTable) or \
                os.path.abspath(rt.path) != os.path.join(url[len("file://"):], "refs.lmdb"):
            raise TypeError("a TsckWriter can be pickled only with a store on a local folder whose ref table "
                            "is beside it; use the default (thread) async checkpointer")
        opts = (("block_size", store.block_size), ("inline_threshold", store.inline_threshold),
                ("verify", store.verify), ("compress", store.assets.compress), ("shuffle", store.assets.shuffle))
        h = _StoreHandle(url, opts)
        with _OPEN_LOCK:
            _REGISTERED.setdefault((os.getpid(), url), store)
        return h

    def open(self) -> Store:
        from .store import open_store
        key = (os.getpid(), self.url)  # a store inherited through fork is not usable: open a new one
        with _OPEN_LOCK:
            s = _REGISTERED.get(key) or _OPENED.get(key)
            if s is None or s._closed:
                s = _OPENED[key] = open_store(self.url[len("file://"):], create=False, **dict(self.options))
            return s


_REGISTERED: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()  # stores of this process
_OPENED: dict = {}  # stores opened by unpickling (kept open for the next request)
_OPEN_LOCK = threading.Lock()


# -- reading ------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Chunk:
    off: tuple
    sh: tuple
    n: int
    bs: int            # 0 when inline
    blocks: list
    inline: bytes | None


class _Manifest:
    """The DCP tree of one snapshot, decoded lazily and checked field by field."""

    def __init__(self, store: Store, root_hex: str, verify: bool):
        self.store, self.root, self.verify = store, root_hex, verify
        a = store.assets
        c = decode_commit(a.get_commit(bytes.fromhex(root_hex), verify=verify))
        top = self._node(c["tree"], "top")
        top = self._dict(top, "top")
        if top.get("format") != DCP_FORMAT:
            raise FormatError(f"snapshot {root_hex[:16]} is not a DCP snapshot (no format 'dcp' at its top; "
                              "use store.checkout for snapshots taken with put_snapshot)")
        v = top.get("version")
        if not _is_int(v) or not MIN_LAYOUT_VERSION <= v <= MAX_LAYOUT_VERSION:
            raise FormatError(f"DCP snapshot layout version {v!r} not readable (this build reads "
                              f"{MIN_LAYOUT_VERSION}..{MAX_LAYOUT_VERSION})")
        md_val = top.get("metadata")
        self.md_digest = md_val.get("r") if isinstance(md_val, dict) else None
        self.metadata_plain = self._plain(md_val, "metadata", 0)
        self.tensors = self._dict(self._deref(top.get("tensors"), "tensors"), "tensors")
        self.bytes = self._dict(self._deref(top.get("bytes"), "bytes"), "bytes")
        self._chunks: dict = {}
        self._lock = threading.Lock()

    def _fmt(self, msg, where):
        return FormatError(f"{msg} at {where} of DCP snapshot {self.root[:16]}")

    def _node(self, d, where):
        if not isinstance(d, bytes) or len(d) != 32:
            raise self._fmt("bad node reference", where)
        data = self.store.assets.get_node(d, verify=self.verify, snapshot=self.root, path=str(where))
        try:
            return decode_node(data)
        except FormatError as e:
            raise self._fmt(str(e), where) from None

    def _deref(self, v, where):
        hops = 0
        while isinstance(v, dict) and len(v) == 1 and "r" in v:
            hops += 1
            if hops > 1:
                raise self._fmt("a node that only points at another node", where)
            v = self._node(v["r"], where)
        return v

    def _dict(self, v, where) -> dict:
        if not isinstance(v, dict) or len(v) != 1 or "d" not in v or not isinstance(v["d"], list):
            raise self._fmt("expected a dict", where)
        out = {}
        for pair in v["d"]:
            if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str):
                raise self._fmt("bad dict entry", where)
            out[pair[0]] = pair[1]
        return out

    def _plain(self, v, where, depth):
        """A manifest value of plain python data (no tensors) -> python."""
        if depth > MAX_DEPTH:
            raise self._fmt(f"nested deeper than {MAX_DEPTH}", where)
        if v is None or isinstance(v, (bool, int, float, str, bytes)):
            return v
        if not isinstance(v, dict) or len(v) != 1:
            raise self._fmt(f"unexpected value of type {type(v).__name__}", where)
        (tag, body), = v.items()
        if tag == "r":
            return self._plain(self._deref(v, where), where, depth + 1)
        if tag in ("d", "o"):
            if not isinstance(body, list):
                raise self._fmt("bad dict", where)
            out = {}
            for pair in body:
                if not isinstance(pair, list) or len(pair) != 2:
                    raise self._fmt("bad dict entry", where)
                k = pair[0]
                if isinstance(k, dict) and len(k) == 1 and isinstance(k.get("i"), bytes):
                    k = int.from_bytes(k["i"], "big", signed=True)
                elif not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise self._fmt("bad dict key", where)
                out[k] = self._plain(pair[1], f"{where}[{k!r}]", depth + 1)
            return out
        if tag in ("l", "t"):
            if not isinstance(body, list):
                raise self._fmt("bad sequence", where)
            items = [self._plain(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(body)]
            return items if tag == "l" else tuple(items)
        if tag == "i":
            if not isinstance(body, bytes) or len(body) > 1 << 16:
                raise self._fmt("bad big int", where)
            return int.from_bytes(body, "big", signed=True)
        raise self._fmt(f"unexpected tag {tag!r}", where)

    @staticmethod
    def _leaf(c, itemsize, where, fmt):
        sh = c.get("sh")
        if not isinstance(sh, list) or len(sh) > 64 or not all(_is_int(s) and 0 <= s < 1 << 48 for s in sh):
            raise fmt("bad chunk shape", where)
        n = c.get("n")
        if not _is_int(n) or n != math.prod(sh) * itemsize:
            raise fmt(f"chunk size {n!r} does not match its shape {sh}", where)
        if "x" in c:
            if not isinstance(c["x"], bytes) or len(c["x"]) != n:
                raise fmt("inline chunk bytes do not match its size", where)
            return tuple(sh), n, 0, [], c["x"]
        bs, blocks = c.get("bs"), c.get("b")
        if not _is_int(bs) or not 1 <= bs <= chunker.MAX_BLOCK_SIZE or bs % itemsize or not isinstance(blocks, list) \
                or len(blocks) != math.ceil(n / bs) or not all(isinstance(b, bytes) and len(b) == 32 for b in blocks):
            raise fmt("bad block layout", where)
        return tuple(sh), n, bs, blocks, None

    def chunks(self, fqn: str):
        """-> (dtype, global shape, {offsets: _Chunk}) for one tensor, read on first use."""
        with self._lock:
            hit = self._chunks.get(fqn)
        if hit is not None:
            return hit
        if fqn not in self.tensors:
            raise self._fmt("no such tensor", repr(fqn))
        body = self._deref(self.tensors[fqn], repr(fqn))
        if not isinstance(body, dict) or len(body) != 1 or not isinstance(body.get("G"), dict):
            raise self._fmt("not a sharded-tensor leaf", repr(fqn))
        g = body["G"]
        dt, gs, cl = g.get("dt"), g.get("sh"), g.get("chunks")
        if not isinstance(dt, str) or dt not in TORCH_DTYPES or TORCH_DTYPES[dt] in _QUANTIZED:
            raise self._fmt(f"unknown dtype {dt!r}", repr(fqn))
        if not isinstance(gs, list) or len(gs) > 64 or not all(_is_int(x) and 0 <= x < 1 << 48 for x in gs):
            raise self._fmt("bad global shape", repr(fqn))
        if not isinstance(cl, list) or len(cl) > 1 << 20:
            raise self._fmt("bad chunk list", repr(fqn))
        dtype = TORCH_DTYPES[dt]
        out = {}
        for c in cl:
            if not isinstance(c, dict) or c.get("dt") != dt:
                raise self._fmt("bad chunk", repr(fqn))
            off = c.get("off")
            if not isinstance(off, list) or len(off) != len(gs) or not all(_is_int(x) and x >= 0 for x in off):
                raise self._fmt("bad chunk offsets", repr(fqn))
            sh, n, bs, blocks, inline = self._leaf(c, dtype.itemsize, repr(fqn), self._fmt)
            if len(sh) != len(gs) or any(o + k > s for o, k, s in zip(off, sh, gs)):
                raise self._fmt("chunk outside its tensor", repr(fqn))
            out.setdefault(tuple(off), _Chunk(tuple(off), sh, n, bs, blocks, inline))
        res = (dtype, tuple(gs), out)
        with self._lock:
            self._chunks[fqn] = res
        return res

    def bytes_item(self, fqn: str) -> tuple[bytes | None, _Chunk | None]:
        if fqn not in self.bytes:
            raise self._fmt("no such bytes item", repr(fqn))
        v = self._deref(self.bytes[fqn], repr(fqn))
        if isinstance(v, bytes):
            return v, None
        if isinstance(v, dict) and len(v) == 1 and isinstance(v.get("T"), dict) and v["T"].get("dt") == "uint8":
            sh, n, bs, blocks, inline = self._leaf(v["T"], 1, repr(fqn), self._fmt)
            if len(sh) != 1:
                raise self._fmt("bytes leaf is not 1-D", repr(fqn))
            return None, _Chunk((0,), sh, n, bs, blocks, inline)
        raise self._fmt("bad bytes item", repr(fqn))


class TsckReader(StorageReader):
    """A DCP StorageReader over one tensorstore_ck snapshot.

    target: a ref, tag, REF@STEP or root hash (prefix); it is resolved when DCP
    reads the metadata, and every rank then reads the snapshot the coordinator
    resolved. dcp.load's checkpoint_id, when given, replaces the target."""

    def __init__(self, store: Store, target: str, *, verify: bool | None = None):
        super().__init__()
        if not isinstance(store, Store):
            raise InvalidName(f"store must be a tensorstore_ck Store, got {type(store).__name__}")
        self.store = store
        parse_target(target)
        store.resolve(target)  # RefNotFound now rather than from inside DCP
        self.target = target
        self.verify = store.verify if verify is None else bool(verify)
        self.load_id = uuid.uuid4().hex
        self.root: str | None = None
        self._m: _Manifest | None = None
        self.rank = None
        self.is_coordinator = True

    @property
    def checkpoint_id(self) -> str:
        return self.target

    def reset(self, checkpoint_id=None) -> None:
        if checkpoint_id:
            parse_target(str(checkpoint_id))
            self.target = str(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self.root, self._m = None, None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        try:
            parse_target(str(checkpoint_id))
            return True
        except Exception:
            return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        root = self.store.resolve(self.target)
        self._m = _Manifest(self.store, root, self.verify)
        self.root = root
        md = decode_metadata(self._m.metadata_plain)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        if self._m is None:
            raise FormatError("TsckReader: read_metadata was not called before set_up_storage_reader")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        # Every rank reads the snapshot the coordinator resolved (a ref may move
        # between the ranks' read_metadata calls).
        return [dataclasses.replace(p, storage_data={"tsck_root": self.root}) for p in plans]

    def _pin_root(self, plan: LoadPlan) -> _Manifest:
        want = plan.storage_data.get("tsck_root") if isinstance(plan.storage_data, dict) else None
        if want is None or want == self.root:
            return self._m
        other = _Manifest(self.store, want, self.verify)
        if other.md_digest is None or other.md_digest != self._m.md_digest:
            raise CheckoutMismatch(f"ranks resolved {self.target!r} to different snapshots ({want[:16]} and "
                                   f"{self.root[:16]}) whose layouts differ: the ref moved during the load; "
                                   "load a root hash or a tag")
        self._m, self.root = other, want
        return other

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        m = self._pin_root(plan)
        batch = _ReadBatch(self.store, m, self.verify)
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(self._read_bytes(m, req.storage_index.fqn)))
                continue
            batch.add(req, planner)
            if batch.tmp_bytes >= READ_TMP_BUDGET:
                batch.flush()
        batch.flush()
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_bytes(self, m: _Manifest, fqn: str) -> bytes:
        raw, ch = m.bytes_item(fqn)
        if raw is not None:
            return raw
        if ch.inline is not None:
            return ch.inline
        buf = np.empty(ch.n, dtype=np.uint8)
        _run_reads(self.store, [(d, buf[i * ch.bs:min(ch.n, (i + 1) * ch.bs)], repr(fqn))
                                for i, d in enumerate(ch.blocks)], m.root, self.verify)
        return buf.tobytes()


def _run_reads(store: Store, jobs: list, root: str, verify: bool) -> None:
    if not jobs:
        return
    futs = [store._pool.submit(store.assets.read_block_into, d, out, verify=verify, snapshot=root, path=p)
            for d, out, p in jobs]
    wait(futs, return_when=FIRST_EXCEPTION)
    for f in futs:
        if f.done() and not f.cancelled() and f.exception() is not None:
            for g in futs:
                g.cancel()
            wait(futs)
            raise f.exception()


class _ReadBatch:
    """Tensor read items whose block reads run together on the store's pool."""

    def __init__(self, store: Store, m: _Manifest, verify: bool):
        self.store, self.m, self.verify = store, m, verify
        self.jobs: list = []
        self.after: list = []  # (req, target, src tensor or None)
        self.tmp_bytes = 0
        self.planner = None

    def add(self, req: ReadItem, planner: LoadPlanner) -> None:
        self.planner = planner
        fqn = req.storage_index.fqn
        if req.storage_index.offset is None:
            raise FormatError(f"DCP read item for tensor {fqn!r} has no chunk offsets")
        dtype, _gs, chunks = self.m.chunks(fqn)
        ch = chunks.get(tuple(int(x) for x in req.storage_index.offset))
        if ch is None:
            raise self.m._fmt(f"no chunk at {list(req.storage_index.offset)}", repr(fqn))
        so, ln = tuple(int(x) for x in req.storage_offsets), tuple(int(x) for x in req.lengths)
        nd = len(ch.sh)
        if len(so) != nd or len(ln) != nd or any(o < 0 or k < 0 or o + k > s for o, k, s in zip(so, ln, ch.sh)):
            raise CheckoutMismatch(f"DCP asks for {list(ln)} at {list(so)} of a chunk of {fqn!r} shaped "
                                   f"{list(ch.sh)}")
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != ln:
            raise CheckoutMismatch(f"DCP's target for {fqn!r} is {list(target.shape)}, the read is {list(ln)}")
        box = tuple(slice(o, o + k) for o, k in zip(so, ln))
        if math.prod(ln) == 0:
            self.after.append((req, target, None))
            return
        if ch.inline is not None:
            src = torch.frombuffer(bytearray(ch.inline), dtype=torch.uint8).view(dtype).reshape(ch.sh)
            self.after.append((req, target, src[box]))
            return
        itemsize = dtype.itemsize
        row = itemsize * math.prod(ch.sh[1:]) if nd else itemsize
        r0, r1 = (so[0], so[0] + ln[0]) if nd else (0, 1)
        b_lo, b_hi = r0 * row, r1 * row
        bs, n = ch.bs, ch.n
        i0, i1 = b_lo // bs, -(-b_hi // bs)
        path = repr(fqn)
        inner_full = all(so[d] == 0 and ln[d] == ch.sh[d] for d in range(1, nd))
        if inner_full and target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype \
                and b_lo % bs == 0 and (b_hi % bs == 0 or b_hi == n):
            # The requested rows are whole blocks: read them straight into the target.
            dst = target.reshape(-1).view(torch.uint8).numpy()
            for i in range(i0, i1):
                a, b = i * bs, min(n, (i + 1) * bs)
                self.jobs.append((ch.blocks[i], dst[a - b_lo:b - b_lo], path))
            self.after.append((req, target, None))
            return
        base = i0 * bs
        tmp = torch.empty(min(n, i1 * bs) - base, dtype=torch.uint8)
        flat = tmp.numpy()
        for i in range(i0, i1):
            a, b = i * bs, min(n, (i + 1) * bs)
            self.jobs.append((ch.blocks[i], flat[a - base:b - base], path))
        self.tmp_bytes += tmp.numel()
        rows = tmp[b_lo - base:b_hi - base].view(dtype).reshape((r1 - r0,) + tuple(ch.sh[1:])) if nd \
            else tmp[b_lo - base:b_hi - base].view(dtype).reshape(())
        src = rows[(slice(None),) + box[1:]] if nd else rows
        self.after.append((req, target, src))

    def flush(self) -> None:
        jobs, after = self.jobs, self.after
        self.jobs, self.after, self.tmp_bytes = [], [], 0
        _run_reads(self.store, jobs, self.m.root, self.verify)
        for req, target, src in after:
            if src is not None:
                target.copy_(src)
            self.planner.commit_tensor(req, target)
