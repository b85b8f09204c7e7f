"""The tree of a DCP snapshot: composed by the writer's coordinator, read back by the
reader, both through the manifest grammar (format/tree.py).

    {"format": "dcp", "version": 1,
     "tensors":  {fqn: G leaf (global dtype and shape, every chunk of every rank)},   own node
     "bytes":    {fqn: bytes | 1-D uint8 T leaf (values over BYTES_INLINE_MAX)},
     "metadata": DCP's Metadata as plain values (metadata.py)}                         own node
"""

from __future__ import annotations

import threading

from ..core.roles import WalkReader
from ..core.walk import read_node
from ..errors import FormatError, UnsupportedType
from ..format import tree
from ..format.dcp import DCP_FORMAT, DCP_LAYOUT_VERSION, MAX_LAYOUT_VERSION, MIN_LAYOUT_VERSION
from ..format.manifest import decode_commit
from ..read.read import Reader
from ..write.plan import Planner
from ..write.shard import find_overlap

__all__ = ["DCP_FORMAT", "DCP_LAYOUT_VERSION", "BYTES_INLINE_MAX", "compose", "DcpTree"]

BYTES_INLINE_MAX = 1 << 20      # bytes items up to this size are stored inline (msgpack bin)


def _plain(obj, planner: Planner, what: str):
    """Plain python values (DCP's metadata) -> a manifest value, by the put_snapshot planner."""
    plan = planner.plan(obj)
    if plan.leaves:
        raise UnsupportedType(f"DCP {what} holds tensors, which tensorstore_ck does not store there")
    return plan.value


def compose(tensors: dict, byts: dict, metadata_plain: dict, planner: Planner):
    """The tree's manifest value, ready for NodeWriter. tensors: fqn -> raw {"G": ...};
    byts: fqn -> bytes or raw {"T": ...}. Every leaf is checked by the grammar first:
    they come from other ranks."""
    for fqn, v in tensors.items():
        tree.check_leaf(v, ("tensors", fqn))
    for fqn, v in byts.items():
        if not isinstance(v, bytes):
            tree.check_leaf(v, ("bytes", fqn))
    return {"d": [
        ["format", DCP_FORMAT], ["version", DCP_LAYOUT_VERSION],
        ["tensors", tree.OwnNode({"d": [[k, v] for k, v in tensors.items()]})],
        ["bytes", {"d": [[k, v] for k, v in byts.items()]}],
        ["metadata", tree.OwnNode(_plain(metadata_plain, planner, "metadata"))],
    ]}


class DcpTree:
    """The DCP tree of one snapshot, decoded through the grammar; tensor entries on first use."""

    def __init__(self, assets: WalkReader, pool, root_hex: str, verify: bool):
        self.assets, self.pool, self.root, self.verify = assets, pool, root_hex, verify
        c = decode_commit(assets.get_commit(bytes.fromhex(root_hex), verify=verify))
        top = self._dict(self._node(c["tree"], ()), "top")
        if top.get("format") != DCP_FORMAT:
            raise FormatError(f"snapshot {root_hex[:16]} is not a DCP snapshot (no format 'dcp' at its top; "
                              "use store.checkout for snapshots taken with put_snapshot)")
        v = top.get("version")
        if type(v) is not int or not MIN_LAYOUT_VERSION <= v <= MAX_LAYOUT_VERSION:
            raise FormatError(f"DCP snapshot layout version {v!r} not readable (this build reads "
                              f"{MIN_LAYOUT_VERSION}..{MAX_LAYOUT_VERSION})")
        md = top.get("metadata")
        self.md_digest = md.digest if type(md) is tree.Ref else None
        self.metadata_plain = Reader(assets, pool, snapshot=root_hex, verify=verify).materialize(md, ("metadata",))
        self.tensors = self._dict(self._deref(top.get("tensors"), ("tensors",)), "tensors")
        self.bytes = self._dict(self._deref(top.get("bytes"), ("bytes",)), "bytes")
        self._chunks: dict = {}
        self._lock = threading.Lock()

    def fmt(self, msg, where) -> FormatError:
        return FormatError(f"{msg} at {where} of DCP snapshot {self.root[:16]}")

    def _node(self, d, path):
        try:
            return read_node(self.assets, d, path, len(path), snapshot=self.root, verify=self.verify)
        except FormatError as e:
            raise FormatError(f"{e} of DCP snapshot {self.root[:16]}") from None

    def _deref(self, v, path):
        return self._node(v.digest, path) if type(v) is tree.Ref else v

    def _dict(self, v, where) -> dict:
        if type(v) is not tree.Container or v.kind != "d" or not all(type(k) is str for k, _ in v.items):
            raise self.fmt("expected a dict of str keys", where)
        return dict(v.items)

    def chunks(self, fqn: str):
        """-> (dtype, global shape, {offsets: tree.Chunk}) for one tensor, read on first use."""
        with self._lock:
            hit = self._chunks.get(fqn)
        if hit is not None:
            return hit
        if fqn not in self.tensors:
            raise self.fmt("no such tensor", repr(fqn))
        g = self._deref(self.tensors[fqn], ("tensors", fqn))
        if type(g) is not tree.Global:
            raise self.fmt("not a sharded-tensor leaf", repr(fqn))
        out: dict = {}
        for c in g.chunks:
            out.setdefault(c.offsets, c)
        boxes = list(dict.fromkeys((c.offsets, c.shape) for c in g.chunks))
        hit = find_overlap(boxes)
        if hit is not None:  # stored bytes are untrusted: which chunk would a read get?
            (oa, sa), (ob, sb) = boxes[hit[0]], boxes[hit[1]]
            raise self.fmt(f"chunks at {list(oa)} (shape {list(sa)}) and {list(ob)} (shape {list(sb)}) overlap",
                           repr(fqn))
        res = (g.dtype, g.shape, out)
        with self._lock:
            self._chunks[fqn] = res
        return res

    def bytes_item(self, fqn: str) -> tuple[bytes | None, tree.Leaf | None]:
        if fqn not in self.bytes:
            raise self.fmt("no such bytes item", repr(fqn))
        v = self._deref(self.bytes[fqn], ("bytes", fqn))
        if isinstance(v, bytes):
            return v, None
        if type(v) is tree.Tensor and v.dt == "uint8" and v.quant is None:
            if len(v.shape) != 1:
                raise self.fmt("bytes leaf is not 1-D", repr(fqn))
            return None, v
        raise self.fmt("bad bytes item", repr(fqn))
