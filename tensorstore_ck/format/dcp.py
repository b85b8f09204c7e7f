"""The top of a snapshot written through dcp.save (TsckWriter): its constants, how it is
recognized and its planner_data read, with neither torch nor I/O, so that `tsck ls`
(listing.py) and checkout (dcpstate.py) agree on what a DCP snapshot is.

    {"format": "dcp", "version": 1,
     "tensors":  {fqn: G leaf}, "bytes": {fqn: bytes | 1-D uint8 T leaf},
     "metadata": {..., "planner_data": {fqn: path}, ...}}
"""

from __future__ import annotations

from ..errors import FormatError
from . import tree

__all__ = ["DCP_FORMAT", "DCP_LAYOUT_VERSION", "MIN_LAYOUT_VERSION", "MAX_LAYOUT_VERSION", "TOP_KEYS",
           "is_dcp_top", "check_version", "fqn_paths"]

DCP_FORMAT = "dcp"
DCP_LAYOUT_VERSION = 1          # the "version" field of the tree; readers accept 1..1
MIN_LAYOUT_VERSION = MAX_LAYOUT_VERSION = 1
TOP_KEYS = ("format", "version", "tensors", "bytes", "metadata")


def is_dcp_top(v) -> bool:
    """A decoded top value laid out by TsckWriter: exactly its five keys, format "dcp" and
    its sections in nodes of their own (a put_snapshot state cannot look like it by chance)."""
    if type(v) is not tree.Container or v.kind != "d" or tuple(k for k, _ in v.items) != TOP_KEYS:
        return False
    d = dict(v.items)
    return d["format"] == DCP_FORMAT and type(d["tensors"]) is tree.Ref and type(d["metadata"]) is tree.Ref


def check_version(v) -> None:
    if type(v) is not int or not MIN_LAYOUT_VERSION <= v <= MAX_LAYOUT_VERSION:
        raise FormatError(f"DCP snapshot layout version {v!r} not readable (this build reads "
                          f"{MIN_LAYOUT_VERSION}..{MAX_LAYOUT_VERSION})")


def fqn_paths(md, snap: str) -> dict:
    """{fqn: the path (keys from the top) DCP flattened it from} of a DCP snapshot's
    metadata as plain values; {} when it has no planner_data (each fqn is its own path)."""
    pd = md.get("planner_data") if isinstance(md, dict) else None
    if pd is None:
        return {}
    if not isinstance(pd, dict):
        raise FormatError(f"DCP snapshot {snap[:16]}: planner_data is not a map")
    out = {}
    for fqn, p in pd.items():
        if type(fqn) is not str or not isinstance(p, (tuple, list)) or not p or not all(
                type(k) is str or (type(k) is int and 0 <= k < 1 << 31) for k in p):
            raise FormatError(f"DCP snapshot {snap[:16]}: planner_data entry {fqn!r:.80} is not a path")
        out[fqn] = tuple(p)
    return out
