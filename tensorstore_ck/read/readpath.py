"""The read path's front door: every checkout of a snapshot's state enters here.

Store.checkout hands read_state a Reader (read.py: verified objects, selections,
placement, into=) and the top of the snapshot's tree. A snapshot written through
dcp.save (TsckWriter; format/dcp.py recognizes its top) comes back as the state that
was saved (dcpstate.read_dcp); any other as the tree put_snapshot wrote
(Reader.materialize). The DCP adapters (dcp/) read regions through the Reader itself.
"""

from __future__ import annotations

from ..format.dcp import is_dcp_top
from .dcpstate import read_dcp
from .read import MISSING, Reader

__all__ = ["read_state"]


def read_state(reader: Reader, top: bytes, into=MISSING, *, allow_pickle: bool = False):
    """The state a snapshot's top (its commit's tree) holds: what dcp.save wrote through
    TsckWriter (read_dcp), else the tree put_snapshot wrote (Store.checkout reads it so)."""
    v = reader.top(top)
    if is_dcp_top(v):
        return read_dcp(reader, v, into, allow_pickle=allow_pickle)
    return reader.materialize(v, (), into)
