"""Manifest nodes and commit objects: msgpack, versioned, validated on decode.

A node is ``{"v": 1, "x": VALUE}``. VALUE is a msgpack primitive (nil, bool,
int within 64 bits, float64, str, bin) or a one-key map whose key says what it is:

    {"d": [[key, VALUE], ...]}   dict, order kept; key is str or int (big ints as {"i"})
    {"l": [VALUE, ...]}          list
    {"t": [VALUE, ...]}          tuple
    {"i": bin}                   int beyond 64 bits, signed big-endian two's complement
    {"T": LEAF}                  torch tensor
    {"A": LEAF}                  numpy array
    {"S": [dtype str, bin]}      numpy scalar
    {"P": bin}                   pickled object (only with allow_pickle on both sides)
    {"r": bin32}                 a child node, by address

    LEAF = {"dt": dtype name, "sh": [int...], "n": nbytes,
            "x": bin (inline)  |  "bs": block size, "b": [bin32, ...],
            optional "p": true (nn.Parameter), "rg": requires_grad, "dev": device}

A commit is ``{"v": 1, "k": "commit", "job", "ref", "step", "time", "metrics",
"meta", "parent": bin32|nil, "tree": bin32, "stats": {...}}``; its address,
the snapshot's root hash, is the BLAKE3 of exactly these bytes.
"""

from __future__ import annotations

import math

import msgpack

from ..errors import FormatError

__all__ = [
    "MANIFEST_VERSION", "encode_node", "decode_node", "encode_commit", "decode_commit",
    "MAX_DEPTH", "MAX_NODE_BYTES", "commit_tree",
]

MANIFEST_VERSION = 1
MIN_MANIFEST_VERSION = 1
MAX_MANIFEST_VERSION = 1
MAX_DEPTH = 200            # nesting of the state tree, across nodes
MAX_NODE_BYTES = 256 << 20  # one node or commit object
MAX_META_DEPTH = 33        # a commit's meta map and what it holds (writers check 32 below the map)


def _unpack(data, what: str):
    if len(data) > MAX_NODE_BYTES:
        raise FormatError(f"{what} of {len(data)} bytes exceeds the cap {MAX_NODE_BYTES}")
    try:
        return msgpack.unpackb(bytes(data), raw=False, strict_map_key=False, use_list=True)
    except Exception as e:  # ExtraData, FormatError, StackError, ValueError, UnicodeDecodeError...
        raise FormatError(f"undecodable {what}: {type(e).__name__}: {e}") from None


def _check_version(obj, what: str) -> None:
    if not isinstance(obj, dict):
        raise FormatError(f"{what} is not a map")
    v = obj.get("v")
    if not isinstance(v, int) or isinstance(v, bool) or not MIN_MANIFEST_VERSION <= v <= MAX_MANIFEST_VERSION:
        raise FormatError(
            f"{what} format version {v!r} not readable (this build reads "
            f"{MIN_MANIFEST_VERSION}..{MAX_MANIFEST_VERSION})")


def encode_node(value) -> bytes:
    return msgpack.packb({"v": MANIFEST_VERSION, "x": value}, use_bin_type=True)


def decode_node(data):
    obj = _unpack(data, "manifest node")
    _check_version(obj, "manifest node")
    if "x" not in obj or len(obj) != 2:
        raise FormatError("manifest node has unexpected fields")
    return obj["x"]


_COMMIT_FIELDS = {"v", "k", "job", "ref", "step", "time", "metrics", "meta", "parent", "tree", "stats"}


def encode_commit(*, job: str, ref: str, step, time: float, metrics: dict, meta, parent: bytes | None,
                  tree: bytes, stats: dict) -> bytes:
    return msgpack.packb({
        "v": MANIFEST_VERSION, "k": "commit", "job": job, "ref": ref, "step": step, "time": time,
        "metrics": metrics, "meta": meta, "parent": parent, "tree": tree, "stats": stats,
    }, use_bin_type=True)


def _nesting(v) -> int:
    """How deep lists and maps nest in `v` (0 for a scalar); iterative, stops early."""
    deepest, stack = 0, [(v, 0)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, dict):
            x = list(x.values())
        if isinstance(x, list):
            d += 1
            deepest = max(deepest, d)
            if d > MAX_META_DEPTH:
                break
            stack.extend((y, d) for y in x)
    return deepest


def _is_digest(x) -> bool:
    return isinstance(x, bytes) and len(x) == 32


def decode_commit(data) -> dict:
    c = _unpack(data, "commit")
    _check_version(c, "commit")
    if c.get("k") != "commit" or not set(c) <= _COMMIT_FIELDS:
        raise FormatError("object is not a commit")
    if not isinstance(c.get("job"), str) or not isinstance(c.get("ref"), str):
        raise FormatError("commit has no job/ref")
    if "step" not in c:
        raise FormatError("commit has no step")
    step = c.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise FormatError("commit step is not an int")
    t = c.get("time")
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t):
        # NaN or inf would pass into the catalog and break every reader of it (retention
        # ages, log order, the CLI's dates): one odd commit must stay one finding.
        raise FormatError(f"commit time {t!r} is not a finite number")
    m = c.get("metrics")
    if not isinstance(m, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                          and not isinstance(v, bool) for k, v in m.items()):
        raise FormatError("commit metrics is not a map of names to numbers")
    if not isinstance(c.get("meta", {}), dict):
        raise FormatError("commit meta is not a map")
    if _nesting(c.get("meta", {})) > MAX_META_DEPTH:
        # Writers allow 32 levels (validate.check_plain); a deeper value would fail
        # msgpack's packer when recover copies it into the catalog.
        raise FormatError(f"commit meta is nested deeper than {MAX_META_DEPTH}")
    if c.get("parent") is not None and not _is_digest(c["parent"]):
        raise FormatError("commit parent is not a digest")
    if not _is_digest(c.get("tree")):
        raise FormatError("commit tree is not a digest")
    st = c.get("stats")
    if not isinstance(st, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63
                                           for v in st.values()):
        raise FormatError("commit stats is not a map of counts")
    return c


def commit_tree(data) -> bytes:
    """The tree address a commit names, even where decode_commit refuses the commit for
    another field (a NaN time): gc keeps what it names, and keeping more is always safe.
    FormatError only if there is no tree address to be found."""
    try:
        return decode_commit(data)["tree"]
    except FormatError:
        c = _unpack(data, "commit")
        if isinstance(c, dict) and c.get("k") == "commit" and _is_digest(c.get("tree")):
            return c["tree"]
        raise
