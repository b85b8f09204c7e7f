"""Records of the ref table and stored tag objects: bytes <-> values, checked. Pure; no I/O.

    reflog    {t, old, new, msg[, op]}                encode_reflog / decode_reflog
    catalog   {job, ref, step, time, metrics, ...}    encode_record / decode_catalog
    gc state  {epoch, phase, owner, lease, clock, expires, heartbeat, ...}   encode_record / decode_gc_state
    retention {keep_last, ...}                        encode_record / decode_record
    tags/<hex of name> (JSON {name, root, time})      encode_tag / decode_tag

Every record is untrusted input: a reader gets a value its callers can use, or
FormatError.
"""

from __future__ import annotations

import json
import time as _time

import msgpack

from ..errors import FormatError, InvalidName
from .names import validate_name

__all__ = ["encode_record", "decode_record", "decode_catalog", "encode_reflog", "decode_reflog",
           "decode_gc_state", "encode_tag", "decode_tag", "MAX_TAG_OBJECT"]

MAX_TAG_OBJECT = 4096
# stored_new, put_us and stall_us: optional
_COUNTS = ("bytes_total", "bytes_new", "blocks_total", "blocks_new", "stored_new", "put_us", "stall_us")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def _digest(v) -> bool:
    return isinstance(v, bytes) and len(v) == 32


def encode_record(value: dict) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def decode_record(data: bytes, what: str) -> dict:
    try:
        row = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several types on hostile bytes
        raise FormatError(f"undecodable {what} record: {e}") from None
    if not isinstance(row, dict):
        raise FormatError(f"{what} record is not a map")
    return row


def decode_catalog(data: bytes) -> dict:
    """Catalog rows are read back by log/refs/du/gc: refuse what they cannot use."""
    row = decode_record(data, "catalog")
    if not _number(row.get("time", 0.0)) or not isinstance(row.get("metrics", {}), dict) \
            or not isinstance(row.get("meta", {}), dict) \
            or not all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
                       for k, v in row.get("metrics", {}).items()) \
            or not all(isinstance(row.get(k, 0), int) and not isinstance(row.get(k, 0), bool)
                       and 0 <= row.get(k, 0) < 2**63 for k in _COUNTS) \
            or not isinstance(row.get("job", ""), str) or not isinstance(row.get("ref", ""), str) \
            or not (row.get("step") is None or (isinstance(row.get("step"), int)
                                                and not isinstance(row.get("step"), bool))):
        raise FormatError("malformed catalog record")
    return row


REFLOG_OPS = ("move", "delete", "forget")


def encode_reflog(old: bytes | None, new: bytes, message: str, t: float | None = None, op: str = "move") -> bytes:
    """A ref move (old -> new), or with op "delete" the ref's removal (old = new = the root
    it pointed at) or "forget" a snapshot of its history dropped (old = new = that root).
    "op" is absent for moves, so older readers read every record; they take a removal
    for a move that changed nothing."""
    rec = {"t": _time.time() if t is None else t, "old": old, "new": new, "msg": message}
    if op != "move":
        rec["op"] = op
    return encode_record(rec)


def decode_reflog(data: bytes, name: str) -> tuple[float, bytes | None, bytes, str, str]:
    """-> (time, old root or None, new root, message, op)."""
    e = decode_record(data, "reflog")
    new, old = e.get("new"), e.get("old")
    op = e.get("op", "move")
    if not _number(e.get("t", 0.0)) or not _digest(new) or not (old is None or _digest(old)) \
            or op not in REFLOG_OPS:
        raise FormatError(f"malformed reflog record of {name!r}")
    return float(e.get("t", 0.0)), old, new, str(e.get("msg", "")), op


def _holds_ok(holds) -> bool:
    """Writers' holds: {holder: [table clock name, expires on that clock]}."""
    return isinstance(holds, dict) and all(
        isinstance(h, str) and isinstance(v, (list, tuple)) and len(v) == 2 and isinstance(v[0], str)
        and _number(v[1]) for h, v in holds.items())


def decode_gc_state(data: bytes | None) -> dict:
    st = {"epoch": 0, "phase": "idle"}
    if data is not None:
        st.update(decode_record(data, "gc state"))
    e = st.get("epoch")
    if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e < 2**62 \
            or st.get("phase") not in ("idle", "marking", "deleting") \
            or not _number(st.get("heartbeat", 0.0)) \
            or not all(_number(st[k]) for k in ("lease", "expires") if k in st) \
            or not isinstance(st.get("clock", ""), str) \
            or not _holds_ok(st.get("holds", {})):
        raise FormatError("malformed gc state record")
    return st


def encode_tag(name: str, root: bytes, time: float) -> bytes:
    return json.dumps({"name": name, "root": root.hex(), "time": time}).encode()


def decode_tag(data: bytes) -> tuple[str, bytes, float]:
    """A stored tag object -> (name, root, time)."""
    if len(data) > MAX_TAG_OBJECT:
        raise FormatError(f"tag object of {len(data)} bytes is too large")
    try:
        obj = json.loads(data)
        name, root, t = obj["name"], bytes.fromhex(obj["root"]), float(obj.get("time", 0.0))
    except (ValueError, KeyError, TypeError, RecursionError, OverflowError) as e:
        raise FormatError(f"undecodable tag object: {type(e).__name__}") from None
    if len(root) != 32:
        raise FormatError("tag object root is not a digest")
    try:
        validate_name(name, "tag name")
    except InvalidName as e:
        raise FormatError(f"tag object names an invalid tag: {e}") from None
    return name, root, t
