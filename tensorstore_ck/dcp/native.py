"""A put_snapshot snapshot seen by dcp.load through TsckReader, so switching from the
native API to DCP never strands a checkpoint (dcpstate.py does the other direction).

The tree is flattened as DCP flattens a state_dict (torch.distributed.checkpoint's
traverse_state_dict): dict keys as str joined by ".", lists that hold a tensor or a
dict walked by index, every other value (tuples, lists of plain values, numpy arrays,
quantized tensors, scalars, strings) one bytes item that is torch.save'd on request.
Tensors are one chunk at offset 0 (a sharded tensor: its stored pieces), read by
region like a DCP snapshot's. Only nodes are read to build the metadata; blocks are
read when DCP asks for a tensor or a bytes item.
"""

from __future__ import annotations

import io

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   TensorProperties, TensorStorageMetadata)

from ..core.roles import ObjectReader
from ..errors import FormatError
from ..format import tree
from ..format.manifest import decode_commit
from ..read.read import Reader
from ..write.shard import find_overlap

__all__ = ["NativeTree", "MAX_ITEMS"]

MAX_ITEMS = 1 << 22  # DCP items one snapshot may name (a DAG of 40 nodes can name 2^40 paths)


class NativeTree:
    """The DCP view of a native snapshot: metadata from its nodes, data on request."""

    md_digest = None  # ranks that resolved different roots of a moved ref are refused

    def __init__(self, assets: ObjectReader, pool, root_hex: str, verify: bool, *, rank: int = 0, allow_pickle: bool = False):
        self.assets, self.pool, self.root, self.verify = assets, pool, root_hex, verify
        # allow_pickle: whether a pickled value (put_snapshot(allow_pickle=True)) loads, as for checkout
        self.reader = Reader(assets, pool, snapshot=root_hex, verify=verify, rank=rank, allow_pickle=allow_pickle)
        c = decode_commit(assets.get_commit(bytes.fromhex(root_hex), verify=verify))
        v = self.reader.top(c["tree"])
        if type(v) is tree.World:
            v = self.reader.merged_world(v)  # every chunk: DCP's metadata lists them
        self.tensors: dict = {}  # fqn -> (dtype, shape, {offsets: leaf})
        self.bytes: dict = {}    # fqn -> (decoded value, state path): torch.save'd on request
        self.paths: dict = {}    # fqn -> DCP's object path (planner_data)
        # Per decoded container (nodes are decoded once per depth, and shared sub-trees merge
        # to one object): whether it is one DCP item, how many it flattens to. A DAG of 40
        # nodes names 2^40 paths: it is counted over its nodes and refused before the walk.
        self._terminals: dict = {}
        self._counts: dict = {}
        n = self._count(v, ())
        if n > MAX_ITEMS:
            raise self.fmt(f"{n} DCP items (nodes shared at many paths), more than {MAX_ITEMS}", "top")
        self._walk(v, (), ())
        self.metadata = self._metadata()

    def fmt(self, msg, where) -> FormatError:
        return FormatError(f"{msg} at {where} of snapshot {self.root[:16]}")

    def _d(self, v, path):
        return self.reader.deref(v, path)

    def _is_tensor(self, v) -> bool:
        return (type(v) is tree.Tensor and v.quant is None) or type(v) is tree.Global

    def _terminal(self, v, path) -> bool:
        v = self._d(v, path)
        if type(v) is tree.World:
            return False
        if type(v) is not tree.Container or v.kind in ("t",):
            return True  # a leaf or a tuple: one item
        if v.kind in ("d", "o"):
            return False
        hit = self._terminals.get(id(v))
        if hit is not None:
            return hit[1]
        out = True
        for i, x in enumerate(v.items):
            x = self._d(x, path + (i,))
            if self._is_tensor(x) or (type(x) is tree.Container and x.kind != "t"
                                      and not self._terminal(x, path + (i,))):
                out = False
                break
        self._terminals[id(v)] = (v, out)  # v kept: its id stays its own
        return out

    def _count(self, v, path) -> int:
        """The DCP items `v` flattens to (as _walk adds them), each container counted once."""
        v = self._d(v, path)
        if type(v) is not tree.Container:
            return 1
        hit = self._counts.get(id(v))
        if hit is not None:
            return hit[1]
        if v.kind in ("d", "o"):
            n = sum(self._count(x, path + (k,)) for k, x in v.items)
        elif v.kind == "l" and not self._terminal(v, path):
            n = sum(self._count(x, path + (i,)) for i, x in enumerate(v.items))
        else:
            n = 1
        self._counts[id(v)] = (v, n)
        return n

    def _add(self, fqn, obj_path):
        if fqn in self.paths:
            raise self.fmt(f"two values flatten to the DCP key {fqn!r:.80} (a key with dots beside a nested one)",
                           repr(fqn))
        if len(self.paths) >= MAX_ITEMS:
            raise self.fmt(f"more than {MAX_ITEMS} DCP items", "top")
        self.paths[fqn] = obj_path

    def _walk(self, v, state_path, obj_path):
        v = self._d(v, state_path)
        fqn = ".".join(map(str, obj_path))
        if type(v) is tree.Container and v.kind in ("d", "o"):
            for k, x in v.items:
                if self._count(x, state_path + (k,)):  # a sub-tree of no item (2^40 empty dicts) is not walked
                    self._walk(x, state_path + (k,), obj_path + (str(k),))
            return
        if type(v) is tree.Container and v.kind == "l" and not self._terminal(v, state_path):
            for i, x in enumerate(v.items):
                if self._count(x, state_path + (i,)):
                    self._walk(x, state_path + (i,), obj_path + (i,))
            return
        if not obj_path:
            raise self.fmt("the snapshot's top is not a dict: DCP loads state_dicts", "top")
        self._add(fqn, obj_path)
        if type(v) is tree.Tensor and v.quant is None:
            self.tensors[fqn] = (v.dtype, tuple(v.shape), {(0,) * len(v.shape): v})
        elif type(v) is tree.Global:
            chunks: dict = {}
            for c in v.chunks:
                chunks.setdefault(c.offsets, c)
            boxes = list(dict.fromkeys((c.offsets, c.shape) for c in v.chunks))
            if find_overlap(boxes) is not None:
                raise self.fmt("sharded tensor's pieces overlap", repr(fqn))
            self.tensors[fqn] = (v.dtype, tuple(v.shape), chunks)
        else:
            self.bytes[fqn] = (v, state_path)

    def _metadata(self) -> Metadata:
        sdm: dict = {}
        for fqn in self.paths:
            if fqn in self.tensors:
                dtype, shape, chunks = self.tensors[fqn]
                sdm[fqn] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=dtype), size=torch.Size(shape),
                    chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(c.shape))
                            for o, c in chunks.items()])
            else:
                sdm[fqn] = BytesStorageMetadata()
        return Metadata(state_dict_metadata=sdm, planner_data=dict(self.paths))

    def chunks(self, fqn: str):
        if fqn not in self.tensors:
            raise self.fmt("no such tensor", repr(fqn))
        return self.tensors[fqn]

    def bytes_item(self, fqn: str):
        """(torch.save'd value, None): DCP loads bytes items with torch.load."""
        if fqn not in self.bytes:
            raise self.fmt("no such bytes item", repr(fqn))
        v, state_path = self.bytes[fqn]
        value = self.reader.plain().materialize(v, state_path)
        buf = io.BytesIO()
        torch.save(value, buf)
        return buf.getvalue(), None
