"""TsckReader: a torch.distributed.checkpoint StorageReader over one snapshot.

Loading reads, for each ReadItem, only the blocks of the stored chunk that
intersect the requested rows (read.read_box, the same region reader checkout
uses), verifies them against their addresses, and copies the requested box
into planner.resolve_tensor(item).

Bytes items follow checkout's rule (dcpstate.load_bytes_item): DCP's planner
unpickles them with weights_only=False, so a stored item reaches it only after
torch's weights_only loader accepted it, and then re-serialized from the value
that loader built (the planner never parses the stored bytes themselves), unless
TsckReader(allow_pickle=True).
"""

from __future__ import annotations

import dataclasses
import io
import uuid
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..collective import AUTO
from ..errors import CheckoutMismatch, FormatError, InvalidArgument
from ..format.dcp import is_dcp_top
from ..format.manifest import decode_commit
from ..format.names import parse_target
from ..read.dcpstate import load_bytes_item
from ..read.read import PRESENCE_CHECK_ABOVE, Reader, default_max_bytes
from ..read.read_world import read_box
from ..read.readjobs import PackCache, part_job, run_reads
from ..store import Store
from .layout import DcpTree
from .metadata import decode_metadata
from .native import NativeTree

__all__ = ["TsckReader"]

READ_TMP_BUDGET = 256 << 20     # staging buffers for partially read chunks, per batch


class TsckReader(StorageReader):
    """A DCP StorageReader over one tensorstore_ck snapshot.

    target: a ref, tag, REF@STEP or root hash (prefix); it is resolved when DCP
    reads the metadata, as checkout resolves it (with a local tier: the newer of the
    tier's and the remote's snapshot), and read through the tier with the remote behind.
    Under torch.distributed (group: as checkout's; False for a load on one rank alone)
    rank 0 resolves it and hands every rank the root (a collective call of `timeout`
    seconds), so ranks whose tiers differ read one snapshot. dcp.load's checkpoint_id,
    when given, replaces the target. A snapshot
    taken with put_snapshot loads too (flattened as DCP flattens a state_dict).
    allow_pickle: as for checkout: a bytes item that torch's weights_only loader
    refuses (or a pickled value of a put_snapshot snapshot) is UnsupportedType unless
    True; only for snapshots you trust."""

    def __init__(self, store: Store, target: str, *, verify: bool | None = None, allow_pickle: bool = False,
                 group=AUTO, timeout: float = 300.0):
        super().__init__()
        if not isinstance(store, Store):
            raise InvalidArgument(f"store must be a tensorstore_ck Store, got {type(store).__name__}")
        self.store = store
        parse_target(target)
        store.resolve(target)  # RefNotFound now rather than from inside DCP
        self.target = target
        self.verify = store.core.settings.verify if verify is None else bool(verify)
        self.allow_pickle = bool(allow_pickle)
        self.group, self.timeout = group, timeout
        self._core = store.read_core  # the tier's objects with the remote behind (Store.read_core)
        self.load_id = uuid.uuid4().hex
        self.root: str | None = None
        self._m: DcpTree | None = None
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

    def _open(self, root: str):
        """The snapshot's DCP view: its own layout (TsckWriter), or a put_snapshot tree flattened
        as DCP flattens a state_dict (native.py)."""
        assets, pool = self._core.assets, self._core.pool
        top = Reader(assets, pool, snapshot=root, verify=self.verify).top(
            decode_commit(assets.get_commit(bytes.fromhex(root), verify=self.verify))["tree"])
        if is_dcp_top(top):
            return DcpTree(assets, pool, root, self.verify)
        return NativeTree(assets, pool, root, self.verify, rank=self.rank or 0,
                          allow_pickle=self.allow_pickle)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Every rank calls this (dcp.load's local step): resolved once, by rank 0.
        root = self.store.resolve(self.target, group=self.group, timeout=self.timeout)
        self._m = self._open(root)
        self.root = root
        md = self._m.metadata if isinstance(self._m, NativeTree) else decode_metadata(self._m.metadata_plain)
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

    def _pin_root(self, plan: LoadPlan) -> DcpTree:
        want = plan.storage_data.get("tsck_root") if isinstance(plan.storage_data, dict) else None
        if want is None or want == self.root:
            return self._m
        other = self._open(want)
        if other.md_digest is None or other.md_digest != self._m.md_digest:
            raise CheckoutMismatch(f"ranks resolved {self.target!r} to different snapshots ({want[:16]} and "
                                   f"{self.root[:16]}) whose layouts differ: the ref moved during the load; "
                                   "load a root hash or a tag")
        self._m, self.root = other, want
        return other

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        m = self._pin_root(plan)
        batch = _ReadBatch(self._core, m, self.verify)
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

    def _read_bytes(self, m: DcpTree, fqn: str) -> bytes:
        """What DCP's planner gets for a bytes item: a stored one only as checkout would load it."""
        raw = self._stored_bytes(m, fqn)
        if self.allow_pickle or isinstance(m, NativeTree):  # NativeTree: our own torch.save of decoded values
            return raw
        value = load_bytes_item(raw, fqn, allow_pickle=False, where=f"DCP snapshot {m.root[:16]}",
                                opt_in="TsckReader")
        buf = io.BytesIO()
        torch.save(value, buf)
        return buf.getvalue()

    def _stored_bytes(self, m: DcpTree, fqn: str) -> bytes:
        raw, leaf = m.bytes_item(fqn)
        if raw is not None:
            return raw
        if leaf.inline is not None:
            return leaf.inline
        # As checkout does (Reader._reserve): a few hostile manifest bytes must not cost
        # gigabytes, so the size is capped by the host's memory and a big item's blocks
        # must exist before its buffer is taken.
        if leaf.nbytes > default_max_bytes():
            raise m.fmt(f"bytes item of {leaf.nbytes} bytes exceeds this host's memory", repr(fqn))
        if leaf.nbytes > PRESENCE_CHECK_ABOVE:
            self._core.assets.require_blocks(dict.fromkeys(leaf.blocks), self._core.pool, snapshot=m.root,
                                             path=repr(fqn))
        buf = np.empty(leaf.nbytes, dtype=np.uint8)
        jobs = [(leaf.blocks[0], part_job(leaf, buf), repr(fqn), False)] if leaf.part is not None \
            else [(d, buf[a:b], repr(fqn), False) for _i, d, a, b in leaf.block_spans()]
        run_reads(self._core.assets, self._core.pool, jobs,  # a fresh buffer: read into directly
                  snapshot=m.root, verify=self.verify)
        return buf.tobytes()


class _ReadBatch:
    """Tensor read items whose block reads run together on the store's pool."""

    def __init__(self, core, m: DcpTree, verify: bool):
        self.core, self.m, self.verify = core, m, verify
        self.jobs: list = []
        self.after: list = []  # (req, target, function to run after the reads or None)
        self.tmp_bytes = 0
        self.planner = None
        self.packs = PackCache()  # a pack whose parts two batches read is read once

    def add(self, req: ReadItem, planner: LoadPlanner) -> None:
        self.planner = planner
        fqn = req.storage_index.fqn
        if req.storage_index.offset is None:
            raise FormatError(f"DCP read item for tensor {fqn!r} has no chunk offsets")
        dtype, _gs, chunks = self.m.chunks(fqn)
        ch = chunks.get(tuple(int(x) for x in req.storage_index.offset))
        if ch is None:
            raise self.m.fmt(f"no chunk at {list(req.storage_index.offset)}", repr(fqn))
        so, ln = tuple(int(x) for x in req.storage_offsets), tuple(int(x) for x in req.lengths)
        nd = len(ch.shape)
        if len(so) != nd or len(ln) != nd or any(o < 0 or k < 0 or o + k > s for o, k, s in zip(so, ln, ch.shape)):
            raise CheckoutMismatch(f"DCP asks for {list(ln)} at {list(so)} of a chunk of {fqn!r} shaped "
                                   f"{list(ch.shape)}")
        target = planner.resolve_tensor(req).detach()
        if tuple(target.shape) != ln:
            raise CheckoutMismatch(f"DCP's target for {fqn!r} is {list(target.shape)}, the read is {list(ln)}")
        box = tuple(slice(o, o + k) for o, k in zip(so, ln))
        # DCP's target is the caller's tensor: blocks read into it are verified first.
        after, staged = read_box(ch, dtype, box, target, self.jobs, repr(fqn), caller=True)
        self.tmp_bytes += staged
        self.after.append((req, target, after))

    def flush(self) -> None:
        jobs, after = self.jobs, self.after
        self.jobs, self.after, self.tmp_bytes = [], [], 0
        run_reads(self.core.assets, self.core.pool, jobs, snapshot=self.m.root, verify=self.verify,
                  packs=self.packs)
        for req, target, fn in after:
            if fn is not None:
                fn()
            self.planner.commit_tensor(req, target)
