"""TsckWriter: a torch.distributed.checkpoint StorageWriter publishing one snapshot per dcp.save.

Every rank writes the blocks of its own chunks through the store's Publisher;
only addresses travel to the coordinator (WriteResult.storage_data), which
composes the tree (layout.py) and publishes it with one fenced ref move.
"""

from __future__ import annotations

import io
import time
import uuid
from concurrent.futures import FIRST_EXCEPTION, wait
from concurrent.futures import Future as FutureOf
from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..core.validate import SnapshotArgs, check_snapshot_args
from ..errors import FormatError, InvalidArgument, SnapshotAborted, UnsupportedType
from ..format import chunker
from ..format.names import parse_target, validate_name
from ..read.dcpstate import load_bytes_item
from ..store import Store
from ..write import packparts
from ..write.plan import contiguous
from ..write.publish import Timing
from .handle import StoreHandle
from .layout import BYTES_INLINE_MAX, DCP_FORMAT, compose
from .metadata import QUANTIZED, dtype_name, encode_metadata

__all__ = ["TsckWriter", "TsckStorageData"]

DCP_METADATA_VERSION = "1.0.0"  # what FileSystemWriter writes into Metadata.version
WRITE_COPY_BUDGET = 512 << 20   # host copies (device / non-contiguous tensors) in flight per rank


@dataclass(frozen=True)
class TsckStorageData:
    """WriteResult.storage_data: what a rank wrote for one item (addresses, not data).

    kind "tensor": value is the chunk dict {dt, sh, off, n, x | bs, b} of a G leaf.
    kind "bytes":  value is the bytes, or a {"T": uint8 leaf} whose blocks hold them."""
    kind: str
    value: Any
    blocks_new: int = 0
    bytes_new: int = 0
    stored_new: int = 0  # bytes the new blocks take in storage


def _flat_bytes(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    """A tensor's C-contiguous bytes as a flat uint8 numpy array; True if that took a copy."""
    src = t.detach()
    t = contiguous(src if src.device.type == "cpu" else src.cpu())
    copied = t.data_ptr() != src.data_ptr() or t.device != src.device
    return t.reshape(-1).view(torch.uint8).numpy(), copied


def _addresses(leaf: dict) -> list:
    """The blocks a leaf names: its own, or the pack it is a part of (a stored one named
    again must still be there when the snapshot is published)."""
    return [leaf["g"][0]] if "g" in leaf else list(leaf.get("b", ()))


class _Pending:
    """Block writes of one item in flight."""
    __slots__ = ("item", "kind", "meta", "wrap", "futs", "keep", "copied")

    def __init__(self, item, kind, meta, wrap, futs, keep, copied):
        self.item, self.kind, self.meta, self.wrap = item, kind, meta, wrap
        self.futs, self.keep, self.copied = futs, keep, copied


class _OpenPack:
    """Small items of one item size gathered for one pack (Store.pack_size; plan.Pack for
    put_snapshot): each member's future is `fut`, resolved with the pack's PutResult once
    the pack, closed, is written."""
    __slots__ = ("itemsize", "chunks", "size", "fut", "closed")

    def __init__(self, itemsize: int):
        self.itemsize, self.chunks, self.size, self.closed = itemsize, [], 0, False
        self.fut = FutureOf()

    def add(self, flat: np.ndarray) -> int:
        off = self.size
        self.chunks.append(np.array(flat, copy=True))  # the caller's tensor may change after write_data
        self.size += flat.nbytes
        return off

    def close(self, publisher, sent: list) -> None:
        if self.closed:
            return
        self.closed = True
        buf, self.chunks = np.concatenate(self.chunks), []
        f = publisher.submit_block(buf, self.itemsize, private=True)
        sent.append(f)
        f.add_done_callback(self._settle)

    def _settle(self, f) -> None:
        if self.fut.done():  # (cancelled: the save failed meanwhile)
            return
        if f.cancelled():
            self.fut.cancel()
        elif f.exception() is not None:
            self.fut.set_exception(f.exception())
        else:
            self.fut.set_result(f.result())


class TsckWriter(StorageWriter):
    """A DCP StorageWriter that publishes one tensorstore_ck snapshot per dcp.save.

    store: a tensorstore_ck Store (each rank opens its own on the same location).
    ref, step, job, metrics, meta: as for store.put_snapshot. dcp.save's
    checkpoint_id, when given, is the ref ("REF" or "REF@STEP").
    allow_pickle: as for put_snapshot: a non-tensor value that only a full unpickle
    loads (DCP torch.saves non-tensor values; torch's weights_only loader is the test)
    is stored only with True, else UnsupportedType before this rank writes anything.
    After a save, `writer.info` (on the coordinator) is the SnapshotInfo.

    The commit records the save's durations as put_snapshot's do (SnapshotInfo.seconds
    and .stall, `tsck log --json`): seconds from the start of the save on the
    coordinator (dcp.save's set-up of this writer; dcp.async_save's staging) to its
    commit; the stall, what the caller was blocked: all of it for dcp.save, the staging
    for dcp.async_save (the writer is its AsyncStager: the state dict is copied to CPU
    memory, as async_save's default stager does, and the caller goes on). Given an
    async_stager= of the caller's own, async_save stages without the writer, which then
    cannot tell the caller's wait: it records the save from its set-up, as dcp.save's."""

    # dcp.async_save: stage() returns the staged copy itself, nothing to synchronize after
    _synchronize_after_execute = False

    def __init__(self, store: Store, ref: str, step: int | None = None, *, job: str | None = None,
                 metrics: dict | None = None, meta: dict | None = None, allow_pickle: bool = False):
        super().__init__()
        if not isinstance(store, Store):
            raise InvalidArgument(f"store must be a tensorstore_ck Store, got {type(store).__name__}")
        self.store = store
        self.allow_pickle = bool(allow_pickle)
        self._job_given = job
        # The same checks as put_snapshot's (one table: validate.py).
        self.args: SnapshotArgs = check_snapshot_args(ref, job=job, step=step, metrics=metrics, meta=meta)
        self._set_ref(ref, step)
        self.info = None
        self.is_coordinator = True
        self.rank = None
        self._fence: int | None = None
        self.save_id = uuid.uuid4().hex
        self._staged: tuple[float, float] | None = None  # async_save's staging: (began, seconds)
        self._timing: Timing | None = None

    def _set_ref(self, ref, step):
        a = self.args
        self.args = check_snapshot_args(ref, job=self._job_given, step=step, metrics=a.metrics, meta=a.meta)
        self.ref, self.step, self.job = self.args.ref, self.args.step, self.args.job

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
        # The save begins here (dcp.save calls this first on every rank), or at the
        # staging that dcp.async_save did before it on the caller's thread.
        began, stall = self._staged if self._staged is not None else (time.monotonic(), None)
        self._staged = None
        self._timing = Timing(began, stall)
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        import torch.distributed as dist
        ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if ranks > 1 and not kwargs.get("use_collectives", True):
            raise InvalidArgument("TsckWriter needs use_collectives=True under a process group of more than "
                                  "one rank: one snapshot covers all ranks")
        if ranks > 1 and self.store.remote_core is not None:
            # Each rank's blocks would land in its own node's tier, and the coordinator's
            # commit would name blocks its tier (and its uploader) does not have.
            raise InvalidArgument("TsckWriter does not take a store with a local tier (open_store(local=)) under "
                                  "a process group of more than one rank; open the remote store itself")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # Refuse what cannot be stored before any rank writes anything.
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                continue
            p = item.tensor_data.properties
            if p.dtype in QUANTIZED:
                raise UnsupportedType(f"quantized tensor {item.index.fqn!r} ({p.dtype}) is not supported by "
                                      "TsckWriter")
            dtype_name(p.dtype)
            if p.layout != torch.strided:
                raise UnsupportedType(f"{p.layout} tensor {item.index.fqn!r} is not supported (only dense)")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # On the coordinator, after every rank planned and before any rank writes a
        # block: the gc fence the commit will be checked against.
        self._fence = self.store.publisher.fence()
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.store.before_write()
        self._pack = None  # small items gathered for the next pack (_blocks)
        self._sent: list = []  # the packs' block writes
        pending: list[_Pending] = []
        results: list[WriteResult] = []
        copied_inflight = 0
        # Every bytes item is resolved and checked before any block is written: one that
        # needs pickle without the opt-in leaves nothing behind.
        raws = {i: self._bytes_of(item, planner) for i, item in enumerate(plan.items)
                if item.type == WriteItemType.BYTE_IO}
        parts = self._stored_parts(plan, planner, raws)
        try:
            for i, item in enumerate(plan.items):
                p = self._submit(item, planner, raws.get(i), parts.get(i))
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
            # This rank's blocks are durable and named before its results go to the
            # coordinator, which publishes a commit that references them.
            self.store.publisher.sync()
        except BaseException:
            for p in pending:
                for f in p.futs:
                    f.cancel()
            wait([f for p in pending for f in p.futs] + self._sent)
            raise
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def _packable(self, flat: np.ndarray, itemsize: int, shape: tuple) -> bool:
        st = self.store.core.settings
        layout = chunker.plan_blocks(flat.nbytes, itemsize, shape, st.block_size, st.inline_threshold)
        return layout.block_size != 0 and chunker.packable(layout.nblocks, flat.nbytes, self.store.pack_size)

    def _item_bytes(self, item: WriteItem, planner: SavePlanner, raw: bytes | None):
        """(flat bytes, item size, shape) of an item that is stored in blocks, as _submit
        lays it out; None for one it stores otherwise or refuses (_submit says why)."""
        if item.type == WriteItemType.BYTE_IO:
            return None if len(raw) <= BYTES_INLINE_MAX else (np.frombuffer(raw, dtype=np.uint8), 1, (len(raw),))
        data = planner.resolve_data(item) if item.tensor_data is not None else None
        if not isinstance(data, torch.Tensor) or data.dtype in QUANTIZED or data.layout != torch.strided:
            return None
        return _flat_bytes(data)[0], data.element_size(), tuple(data.shape)

    def _stored_parts(self, plan: SavePlan, planner: SavePlanner, raws: dict) -> dict:
        """Item position -> (its bytes' BLAKE3, the stored pack part that holds them or
        None), for every item that goes into a pack: one whose bytes a stored pack holds
        names that part instead of being written again (packparts.find_parts, the rules
        of put_snapshot's packs: docs/design/scaling.md, "Packs"). At the first save on the
        ref in this process, the parts of the snapshot it is on are learnt first (its nodes only)."""
        store = self.store
        if not store.pack_size:
            return {}
        hashed = {}
        for i, item in enumerate(plan.items):
            got = self._item_bytes(item, planner, raws.get(i))
            if got is not None and self._packable(*got):
                hashed[i] = (blake3.blake3(memoryview(got[0])).digest(), got[0].nbytes)
        if not hashed:
            return {}
        if store.assets.parts.first_look(self.ref):  # (later saves know the packs they wrote)
            store.publisher.learn_parts(self.ref)
        found = packparts.find_parts(store.assets, store.pool, None, list(hashed.values()))
        return {i: (h, hit) for (i, (h, _n)), hit in zip(hashed.items(), found)}

    def _blocks(self, flat: np.ndarray, itemsize: int, shape: tuple, meta: dict, private: bool, part=None):
        """Plan the blocks of `flat` into `meta`; -> futures of their PutResults.
        private: `flat` is a copy of our own (else each block is copied before hashing).
        part: (its BLAKE3, a stored part holding it or None) of an item that goes into a
        pack (_stored_parts): a stored part is named, nothing written."""
        store = self.store
        n = flat.nbytes
        meta["n"] = n
        st = store.core.settings
        layout = chunker.plan_blocks(n, itemsize, shape, st.block_size, st.inline_threshold)
        if layout.block_size == 0:
            meta["x"] = flat.tobytes()
            return []
        if chunker.packable(layout.nblocks, n, store.pack_size):  # a small item: into the open pack
            if part is not None and part[1] is not None:
                meta["h"], meta["g"] = part[0], list(part[1])  # (h: checked on every read)
                return []
            pk = self._pack
            if pk is not None and chunker.pack_full(pk.size, pk.itemsize, n, itemsize, store.pack_size):
                pk.close(store.publisher, self._sent)
                pk = None
            if pk is None:
                pk = self._pack = _OpenPack(itemsize)
            meta["_pack"] = (pk, pk.add(flat))  # ("g" once the pack is written: _finish_item)
            if part is not None:  # the hash of the bytes the pack holds (the tensor may have changed since)
                meta["h"] = blake3.blake3(memoryview(pk.chunks[-1])).digest()
            return [pk.fut]
        meta["bs"] = layout.block_size
        return [store.publisher.submit_block(flat[a:b], itemsize, private=private)
                for _i, a, b in chunker.block_ranges(layout)]

    def _bytes_of(self, item: WriteItem, planner: SavePlanner) -> bytes:
        """A bytes item's content (DCP's torch.save of the value), as readers will load it."""
        fqn = item.index.fqn
        data = planner.resolve_data(item)
        if isinstance(data, io.BytesIO):
            raw = bytes(data.getbuffer())
        elif isinstance(data, (bytes, bytearray, memoryview)):
            raw = bytes(data)
        else:
            raise UnsupportedType(f"DCP gave a {type(data).__name__} for the bytes item {fqn!r}")
        if not self.allow_pickle:  # the same test checkout and TsckReader apply when loading it
            load_bytes_item(raw, fqn, allow_pickle=False, where=f"TsckWriter of {self.ref!r}", opt_in="TsckWriter")
        return raw

    def _submit(self, item: WriteItem, planner: SavePlanner, raw: bytes | None = None, part=None):
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            if len(raw) <= BYTES_INLINE_MAX:
                return WriteResult(index=item.index, size_in_bytes=len(raw),
                                   storage_data=TsckStorageData("bytes", raw))
            flat = np.frombuffer(raw, dtype=np.uint8)
            meta = {"dt": "uint8", "sh": [len(raw)]}
            futs = self._blocks(flat, 1, (len(raw),), meta, private=True, part=part)  # our own bytes object
            return _Pending(item, "bytes", meta, "T", futs, flat, flat.nbytes if "_pack" in meta else 0)
        td = item.tensor_data
        if td is None or td.chunk is None:
            raise FormatError(f"DCP write item {fqn!r} has no tensor data")
        data = planner.resolve_data(item)
        if not isinstance(data, torch.Tensor):
            raise UnsupportedType(f"DCP gave a {type(data).__name__} for the tensor item {fqn!r}")
        if data.dtype != td.properties.dtype:
            raise UnsupportedType(f"tensor {fqn!r}: data is {data.dtype}, DCP's metadata says "
                                  f"{td.properties.dtype}")
        if data.dtype in QUANTIZED or data.layout != torch.strided:
            raise UnsupportedType(f"tensor {fqn!r} of {data.dtype}/{data.layout} is not supported")
        shape = tuple(int(x) for x in td.chunk.sizes)
        if tuple(data.shape) != shape:
            raise FormatError(f"tensor {fqn!r}: data has shape {tuple(data.shape)}, its chunk {list(shape)}")
        flat, copied = _flat_bytes(data)
        meta = {"dt": dtype_name(data.dtype), "sh": list(shape), "off": [int(x) for x in td.chunk.offsets]}
        futs = self._blocks(flat, data.element_size(), shape, meta, private=copied, part=part)
        return _Pending(item, "tensor", meta, None, futs, flat, flat.nbytes if copied or "_pack" in meta else 0)

    def _finish_item(self, p: _Pending) -> WriteResult:
        packed = p.meta.get("_pack")
        if packed is not None:
            packed[0].close(self.store.publisher, self._sent)  # (its future settles once it is sent)
        wait(p.futs, return_when=FIRST_EXCEPTION)
        for f in p.futs:
            if f.done() and not f.cancelled() and f.exception() is not None:
                for g in p.futs:
                    g.cancel()
                wait(p.futs)
                raise f.exception()
        res = [f.result() for f in p.futs]
        meta = dict(p.meta)
        if packed is not None:
            pk, off = meta.pop("_pack")
            meta["g"] = [res[0].digest, off, pk.size]
            if "h" in meta:  # the next save names it instead of writing it
                self.store.assets.parts.add(meta["h"], res[0].digest, off, pk.size, meta["n"])
            res = res if off == 0 else []  # the pack counts once, with its first member
        elif res:
            meta["b"] = [r.digest for r in res]
        bn = sum(1 for r in res if r.new)
        byn = sum(r.raw_len for r in res if r.new)
        stn = sum(r.stored for r in res if r.new)
        value = {"T": meta} if p.wrap == "T" else meta
        p.keep = None
        return WriteResult(index=p.item.index, size_in_bytes=meta["n"],
                           storage_data=TsckStorageData(p.kind, value, bn, byn, stn))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        store = self.store
        if metadata.version is None:
            metadata.version = DCP_METADATA_VERSION
        metadata.storage_meta = self.storage_meta()
        got: dict = {}
        st = {"bytes_total": 0, "bytes_new": 0, "blocks_total": 0, "blocks_new": 0, "stored_new": 0}
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
                st["stored_new"] += sd.stored_new
                leaf = sd.value.get("T") if sd.kind == "bytes" and isinstance(sd.value, dict) else sd.value
                if isinstance(leaf, dict):
                    st["blocks_total"] += len(leaf.get("b", ()))
        tensors, byts, digests = {}, {}, []
        for fqn, m in metadata.state_dict_metadata.items():
            if isinstance(m, TensorStorageMetadata):
                dt = dtype_name(m.properties.dtype)
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
                    digests.extend(_addresses(sd.value))
                tensors[fqn] = {"G": {"dt": dt, "sh": [int(x) for x in m.size], "chunks": chunks}}
            else:
                sd = got.pop((fqn, None), None)
                if sd is None or sd.kind != "bytes":
                    raise SnapshotAborted(f"no rank wrote the bytes item {fqn!r}; nothing was published")
                byts[fqn] = sd.value
                if isinstance(sd.value, dict):
                    digests.extend(_addresses(sd.value["T"]))
        if got:
            extra = sorted(str(k) for k in got)[:5]
            raise FormatError(f"write results not described by DCP's metadata: {extra}")
        planner = store.planner()
        value = compose(tensors, byts, encode_metadata(metadata), planner)
        pub = store.publisher
        new_nodes: list = []
        tree, payloads = pub.write_nodes(value, None, new_nodes)
        from ..write.publish import inline_bytes
        st["bytes_new"] += sum(inline_bytes(p) for _d, p in new_nodes)  # (BuildStats says what new is)
        fence = self._fence if self._fence is not None else pub.fence()
        timing, self._timing = self._timing, None
        self.info = store.after_publish(pub.commit(
            tree, self.args, stats=st, fence=fence, meta_extra={"format": DCP_FORMAT}, timing=timing,
            revalidate=lambda body, fence: pub.revalidate_addresses(digests, payloads, body, fence,
                                                             what=f"this DCP snapshot of {self.ref!r}")))

    # -- AsyncStager (dcp.async_save stages through the writer) ----------------------------
    def stage(self, state_dict):
        """A copy of state_dict in CPU memory that training cannot change: what async_save
        stages with when given no stager (DefaultStager, synchronous, no pinned memory),
        timed, so the commit records how long the caller was blocked."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        began = time.monotonic()
        stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                              use_async_staging=False, use_non_blocking_copy=False))
        try:
            staged = stager.stage(state_dict)
        finally:
            stager.close()
        self._staged = (began, time.monotonic() - began)
        return staged

    @property
    def should_synchronize_after_execute(self) -> bool:
        return self._synchronize_after_execute

    def synchronize_staging(self) -> None:
        pass  # stage() returned the copy whole

    def close(self) -> None:
        pass

    # -- pickling (AsyncCheckpointerType.PROCESS sends the writer to another process) -----
    def __getstate__(self):
        st = self.__dict__.copy()
        st["store"] = StoreHandle.of(self.store)
        st["info"] = None
        return st

    def __setstate__(self, st):
        st["store"] = st["store"].open()
        self.__dict__.update(st)


