"""The manifest grammar: every value a manifest node holds, in one place. Pure; no I/O.

One table of limits, one validating decoder, one visitor and one node writer.
Every reader of stored manifests (checkout, fsck, gc, diff, the DCP reader,
collective checkout) decodes through `decode_node_value`, so they accept and
refuse exactly the same trees; the writers (put_snapshot, the collective put,
the DCP writer) check each leaf with the same decoder before anything is
written (`check_leaf`) and lay nodes out with the one `NodeWriter`.

Raw values (what msgpack gives; the layout is in manifest.py and FORMAT.md)
decode to:

    None, bool, int, float, str, bytes   themselves ({"i": bin} decodes to int)
    Container(kind, items)               "d" dict / "o" OrderedDict: items [(key, value)];
                                         "l" list / "t" tuple: items [value]
    Ref(digest)                          a child node, not fetched here
    Tensor / Array / Global              tensor leaves (blocks or inline bytes)
    NpScalar, Pickled, World             numpy scalar, pickled object, one tree per rank

Child nodes are decoded by the caller (which fetches them) with the depth and
path of the Ref, so depth counts across nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import msgpack
import numpy as np

from ..errors import FormatError, UnsupportedType
from .dtypes import DTYPE_ITEMSIZES, PACKED_QUANT_NAMES, QUANT_NAMES, code_units, np_dtype_in, torch_dtype
from .manifest import MAX_DEPTH, MAX_NODE_BYTES, encode_node

__all__ = [
    "MAX_DEPTH", "MAX_NODE_BYTES", "MAX_DIMS", "MAX_DIM", "MAX_BIGINT_BYTES", "MAX_BLOCK_SIZE", "MAX_CHUNKS",
    "MAX_RANKS", "MAX_FAN", "MAX_VALUES", "NODE_SPLIT", "DIGEST_SIZE", "format_path",
    "Ref", "Container", "Leaf", "Tensor", "Array", "Chunk", "Global", "NpScalar", "Pickled", "World",
    "decode_value", "decode_node_value", "check_leaf", "visit", "Pending", "OwnNode", "NodeWriter",
    "INT_MIN", "INT_MAX", "int_value",
]

# -- the one table of limits (writer and readers) ----------------------------------------
MAX_DIMS = 64                 # dimensions of a tensor or array
MAX_DIM = 1 << 48             # every dimension is below this, even when another is 0
MAX_BIGINT_BYTES = 1 << 16    # an int beyond 64 bits, as signed big-endian bytes
MAX_BLOCK_SIZE = 256 << 20    # bytes per block (chunker cuts within this)
MAX_CHUNKS = 1 << 20          # chunks of one sharded tensor
MAX_RANKS = 1 << 20           # trees of one multi-rank snapshot
MAX_FAN = 1 << 12             # items per node of a multi-rank snapshot's fan trees (format/world.py)
MAX_VALUES = 1 << 28          # values of one tree (containers, leaves, plain values) over all its
                              # paths: a DAG of 40 nodes can name 2^40; a rank's tree of a multi-rank one
MAX_DEVICE_NAME = 64
NODE_SPLIT = 4096             # a value encoding past this at depth > 0 gets a node of its own
DIGEST_SIZE = 32
INT_MIN, INT_MAX = -(2**63), 2**64 - 1  # msgpack's native int range


def _part(p) -> str:
    if type(p) is int and p.bit_length() > 64:
        return f"[<int of {p.bit_length()} bits>]"  # repr of a huge int is slow or refused
    return f"[{p!r}]"


def format_path(parts) -> str:
    return "".join(map(_part, parts))


def _bad(msg: str, path) -> FormatError:
    return FormatError(f"{msg} at {format_path(path) or 'top'}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_digest(x) -> bool:
    return isinstance(x, bytes) and len(x) == DIGEST_SIZE


# -- typed values ----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Ref:
    digest: bytes


@dataclass(slots=True)
class Container:
    kind: str     # "d", "o", "l", "t"
    items: list   # [(key, value)] for "d"/"o", [value] for "l"/"t"


@dataclass(slots=True)
class Leaf:
    """Bytes of a tensor, array or chunk: inline, cut into blocks of block_size, or a part
    of a pack (a block shared by many small tensors: `part` = (offset, the pack's length),
    `blocks` = [the pack's address], block_size 0)."""
    shape: tuple
    nbytes: int
    inline: bytes | None
    block_size: int
    blocks: list
    part: tuple | None = None
    content: bytes | None = None  # a part of a pack: the BLAKE3 of its own bytes (`h`), if written

    def block_spans(self) -> Iterator[tuple[int, bytes, int, int]]:
        """(index, digest, start, stop) of every block; a packed leaf has none of its own
        (its readers read a part of its pack: `part`)."""
        if self.part is not None:
            raise ValueError("a packed leaf has no blocks of its own")  # pragma: no cover - a reader's bug
        bs = self.block_size
        for i, d in enumerate(self.blocks):
            yield i, d, i * bs, min(self.nbytes, (i + 1) * bs)

    def stored_blocks(self) -> Iterator[tuple[bytes, int]]:
        """(digest, raw length) of every block object it names: its blocks, or its pack."""
        if self.part is not None:
            yield self.blocks[0], self.part[1]
        else:
            for _i, d, a, b in self.block_spans():
                yield d, b - a


@dataclass(slots=True)
class Tensor(Leaf):
    dt: str = ""  # a name of DTYPE_ITEMSIZES (the grammar checked it)
    param: bool = False
    requires_grad: bool = False
    device: str | None = None
    quant: dict | None = None   # validated affine parameters of a quantized tensor

    @property
    def dtype(self):
        """The torch.dtype (imports torch: walking a tree never needs it)."""
        return torch_dtype(self.dt)


@dataclass(slots=True)
class Array(Leaf):
    dtype: np.dtype | None = None
    fortran: bool = False


@dataclass(slots=True)
class Chunk(Leaf):
    offsets: tuple = ()


@dataclass(slots=True)
class Global:
    dt: str
    shape: tuple
    chunks: list = field(default_factory=list)
    replicated: bool = False

    @property
    def dtype(self):
        return torch_dtype(self.dt)


@dataclass(frozen=True, slots=True)
class NpScalar:
    dtype: np.dtype
    raw: bytes


@dataclass(frozen=True, slots=True)
class Pickled:
    data: bytes


@dataclass(frozen=True, slots=True)
class World:
    ranks: list | None          # version 1: every rank's tree address (version 2: None, see rank_tree)
    index: bytes | None = None  # version 1: the chunk-index node: where each rank's pieces of each sharded tensor lie
    world: int = 0
    # version 2 (format/world.py): fan trees over the rank-tree addresses and over the
    # buckets of the range-cut chunk index
    fan: int = 0
    rank_tree: bytes | None = None
    nbuckets: int = 0
    range_index: bytes | None = None


# -- decoding ----------------------------------------------------------------------------
def int_value(body, path) -> int:
    if not isinstance(body, bytes) or len(body) > MAX_BIGINT_BYTES:
        raise _bad("bad big int", path)
    return int.from_bytes(body, "big", signed=True)


def _shape(sh, path, what="tensor shape") -> tuple:
    if not isinstance(sh, list) or len(sh) > MAX_DIMS or not all(_is_int(s) and 0 <= s < MAX_DIM for s in sh):
        raise _bad(f"bad {what}", path)
    return tuple(sh)


def _leaf_fields(body, path, itemsize: int):
    """-> (shape, nbytes, inline, block_size, blocks, part, content), everything consistent."""
    if not isinstance(body, dict):
        raise _bad("tensor leaf is not a map", path)
    sh = _shape(body.get("sh"), path)
    n = body.get("n")
    if not _is_int(n) or n != math.prod(sh) * itemsize:
        raise _bad(f"tensor size {n!r} does not match shape {list(sh)} of {body.get('dt')}", path)
    if "x" in body:
        if not isinstance(body["x"], bytes) or len(body["x"]) != n or "g" in body:
            raise _bad("inline tensor bytes do not match its size", path)
        return sh, n, body["x"], 0, [], None, None
    if "g" in body:  # a part of a pack: [address, offset, the pack's length]; `h`: its bytes' BLAKE3
        g = body["g"]
        if "bs" in body or "b" in body or not isinstance(g, list) or len(g) != 3 or not _is_digest(g[0]) \
                or not _is_int(g[1]) or not _is_int(g[2]) or not 0 < g[2] <= MAX_BLOCK_SIZE \
                or not 0 <= g[1] <= g[2] - n:
            raise _bad("bad pack reference", path)
        h = body.get("h")
        if h is not None and not _is_digest(h):
            raise _bad("bad content hash of a pack's part", path)
        return sh, n, None, 0, [g[0]], (g[1], g[2]), h
    bs, blocks = body.get("bs"), body.get("b")
    if not _is_int(bs) or not 1 <= bs <= MAX_BLOCK_SIZE or bs % max(1, itemsize) or not isinstance(blocks, list):
        raise _bad("bad block layout", path)
    if len(blocks) != -(-n // bs) or not all(_is_digest(b) for b in blocks):
        raise _bad("block list does not match the tensor size", path)
    return sh, n, None, bs, blocks, None, None


def _dtype_itemsize(dt, path, what="torch dtype") -> int:
    if not isinstance(dt, str) or dt not in DTYPE_ITEMSIZES:
        raise _bad(f"unknown {what} {dt!r}", path)
    return DTYPE_ITEMSIZES[dt]


def _quant(body, sh, path) -> dict:
    q = body.get("q")
    if body.get("dt") not in QUANT_NAMES - PACKED_QUANT_NAMES or not isinstance(q, dict):
        raise _bad(f"quantized tensor of {body.get('dt')} without valid parameters", path)
    if q.get("s") == "pt" and isinstance(q.get("scale"), float) and _is_int(q.get("zp")):
        return {"s": "pt", "scale": q["scale"], "zp": q["zp"]}
    axis = q.get("axis")
    if q.get("s") == "pc" and _is_int(axis) and 0 <= axis < max(1, len(sh)) \
            and isinstance(q.get("scales"), list) and isinstance(q.get("zps"), list) \
            and len(q["scales"]) == len(q["zps"]) == (sh[axis] if sh else 1) \
            and all(isinstance(x, float) for x in q["scales"]) and all(_is_int(x) for x in q["zps"]):
        return {"s": "pc", "scales": q["scales"], "zps": q["zps"], "axis": axis}
    raise _bad("bad quantization parameters", path)


def _tensor(body, path) -> Tensor:
    if not isinstance(body, dict):
        raise _bad("tensor leaf is not a map", path)
    itemsize = _dtype_itemsize(body.get("dt"), path)
    sh, n, inline, bs, blocks, part, h = _leaf_fields(body, path, itemsize)
    quant = None
    if "q" in body or body["dt"] in QUANT_NAMES:
        if body["dt"] in PACKED_QUANT_NAMES:
            raise _bad(f"quantized tensors of torch.{body['dt']} are not supported", path)
        quant = _quant(body, sh, path)
    dev = body.get("dev")
    if dev is not None and (not isinstance(dev, str) or len(dev) > MAX_DEVICE_NAME):
        raise _bad("bad device name", path)
    return Tensor(sh, n, inline, bs, blocks, part, h, dt=body["dt"], param=body.get("p") is True,
                  requires_grad=body.get("rg") is True, device=dev, quant=quant)


def _array(body, path) -> Array:
    if not isinstance(body, dict):
        raise _bad("array leaf is not a map", path)
    try:
        dtype = np_dtype_in(body.get("dt"))
    except FormatError as e:
        raise _bad(str(e), path) from None
    sh, n, inline, bs, blocks, part, h = _leaf_fields(body, path, dtype.itemsize)
    return Array(sh, n, inline, bs, blocks, part, h, dtype=dtype, fortran=body.get("fo") is True)


def _global(body, path) -> Global:
    if not isinstance(body, dict) or not isinstance(body.get("chunks"), list) or len(body["chunks"]) > MAX_CHUNKS:
        raise _bad("bad sharded tensor", path)
    dt = body.get("dt")
    itemsize = _dtype_itemsize(dt, path, "torch dtype for a sharded tensor")
    if dt in QUANT_NAMES:
        raise _bad(f"unknown or unsupported torch dtype {dt!r} for a sharded tensor", path)
    gs = _shape(body.get("sh"), path, "global shape")
    chunks = []
    for c in body["chunks"]:
        if not isinstance(c, dict) or c.get("dt") != dt:
            raise _bad("bad chunk", path)
        off = c.get("off")
        if not isinstance(off, list) or len(off) != len(gs) or not all(_is_int(x) and x >= 0 for x in off):
            raise _bad("bad chunk offsets", path)
        sh, n, inline, bs, blocks, part, h = _leaf_fields(c, path, itemsize)
        if len(sh) != len(gs) or any(o + k > g for o, k, g in zip(off, sh, gs)):
            raise _bad("chunk outside its tensor", path)
        chunks.append(Chunk(sh, n, inline, bs, blocks, part, h, offsets=tuple(off)))
    return Global(dt, gs, chunks, replicated=body.get("rep") is True)


def _scalar(body, path) -> NpScalar:
    if not isinstance(body, list) or len(body) != 2 or not isinstance(body[1], bytes):
        raise _bad("bad numpy scalar", path)
    try:
        d = np_dtype_in(body[0])
    except FormatError as e:
        raise _bad(str(e), path) from None
    if d.itemsize == 0 or len(body[1]) != d.itemsize:
        raise _bad("numpy scalar bytes do not match its dtype", path)
    if d.kind == "U" and max(code_units(body[1], d)) > 0x10FFFF:
        raise _bad("numpy str_ scalar with code points beyond U+10FFFF", path)
    return NpScalar(d, body[1])


def _key(k, path):
    if isinstance(k, dict) and len(k) == 1 and "i" in k:
        return int_value(k["i"], path)
    if isinstance(k, str) or _is_int(k):
        return k
    raise _bad("dict key is not a str or int", path)


def decode_value(v, path=(), depth: int = 0, *, world: bool = False):
    """One raw value -> its typed form, validated; child nodes stay Refs.
    world: a multi-rank {"W"} value is allowed here (only a snapshot's top)."""
    if depth > MAX_DEPTH:
        raise _bad(f"manifest nested deeper than {MAX_DEPTH}", path)
    if v is None or isinstance(v, (bool, int, float, str, bytes)):
        return v
    if not isinstance(v, dict) or len(v) != 1:
        raise _bad(f"unexpected manifest value of type {type(v).__name__}", path)
    (tag, body), = v.items()
    if tag in ("d", "o"):
        if not isinstance(body, list):
            raise _bad("dict body is not an array", path)
        items = []
        for pair in body:
            if not isinstance(pair, list) or len(pair) != 2:
                raise _bad("dict entry is not a pair", path)
            k = _key(pair[0], path)
            items.append((k, decode_value(pair[1], path + (k,), depth + 1)))
        return Container(tag, items)
    if tag in ("l", "t"):
        if not isinstance(body, list):
            raise _bad("sequence body is not an array", path)
        return Container(tag, [decode_value(x, path + (i,), depth + 1) for i, x in enumerate(body)])
    if tag == "r":
        if not _is_digest(body):
            raise _bad("bad node reference", path)
        return Ref(body)
    if tag == "T":
        return _tensor(body, path)
    if tag == "A":
        return _array(body, path)
    if tag == "G":
        return _global(body, path)
    if tag == "S":
        return _scalar(body, path)
    if tag == "i":
        return int_value(body, path)
    if tag == "P":
        if not isinstance(body, bytes):
            raise _bad("bad pickle body", path)
        return Pickled(body)
    if tag == "W" and world and isinstance(body, dict) and "v" in body:
        return _world_v2(body, path)
    if tag == "W":
        if not world or not isinstance(body, dict) or not isinstance(body.get("ranks"), list) \
                or not 0 < len(body["ranks"]) <= MAX_RANKS or body.get("world") != len(body["ranks"]) \
                or not all(_is_digest(d) for d in body["ranks"]):
            raise _bad("bad multi-rank snapshot", path)
        ix = body.get("ix")
        if ix is not None and not _is_digest(ix):
            raise _bad("bad chunk index of a multi-rank snapshot", path)
        return World(list(body["ranks"]), ix, len(body["ranks"]))
    raise _bad(f"unknown manifest tag {tag!r}", path)


def _world_v2(body: dict, path) -> World:
    """{"v": 2, "world": W, "fan": F, "rt": bin32, "nb": B, "ri": bin32} (FORMAT.md)."""
    if not (_is_int(body.get("v")) and body["v"] == 2):
        raise _bad(f"multi-rank snapshot of version {body.get('v')!r}; this reader reads 1 (no \"v\") and 2", path)
    w, fan, nb = body.get("world"), body.get("fan"), body.get("nb")
    if not (_is_int(w) and 0 < w <= MAX_RANKS and _is_int(fan) and 2 <= fan <= MAX_FAN
            and _is_int(nb) and 0 < nb <= MAX_RANKS and _is_digest(body.get("rt")) and _is_digest(body.get("ri"))):
        raise _bad("bad multi-rank snapshot", path)
    return World(None, None, w, fan, body["rt"], nb, body["ri"])


def decode_node_value(raw, path=(), depth: int = 0, *, world: bool = False):
    """The value of one decoded node (manifest.decode_node's result). A node that
    only points at another node is refused: a writer never makes one."""
    v = decode_value(raw, path, depth, world=world)
    if isinstance(v, Ref):
        raise _bad("a node that only points at another node", path)
    return v


def check_leaf(raw, path) -> None:
    """The writer's check of one planned leaf (block addresses may be placeholders):
    the readers' own decoder, so put refuses exactly what checkout would."""
    try:
        if not (isinstance(raw, dict) and ("T" in raw or "G" in raw)):
            # exactly what a reader will see: msgpack turns a numpy descr's tuples into lists
            raw = msgpack.unpackb(msgpack.packb(raw, use_bin_type=True), raw=False, strict_map_key=False)
        decode_value(raw, path, 0)
    except FormatError as e:
        raise UnsupportedType(f"not storable: {e}", format_path(path)) from None


# -- the one visitor ---------------------------------------------------------------------
def visit(value, path=(), depth: int = 0, *, plain: bool = False) -> Iterator[tuple[tuple, int, object]]:
    """(path, depth, item) for every Ref, World and leaf (Tensor, Array, Global) under
    a decoded value, in state order (dict keys and sequence items in order).
    plain: also every other value (None, bool, int, float, str, bytes, NpScalar,
    Pickled) and every empty Container, so that the items cover the whole tree."""
    stack = [(value, path, depth)]
    while stack:
        v, p, d = stack.pop()
        if isinstance(v, Container):
            if plain and not v.items:
                yield p, d, v
            elif v.kind in ("d", "o"):
                stack.extend((x, p + (k,), d + 1) for k, x in reversed(v.items))
            else:
                stack.extend((x, p + (i,), d + 1) for i, x in reversed(list(enumerate(v.items))))
        elif plain or isinstance(v, (Ref, World, Tensor, Array, Global)):
            yield p, d, v


# -- the one node writer -----------------------------------------------------------------
class Pending:
    """A leaf whose manifest value is final only after its blocks are written.
    manifest_value(final=False) gives a value of at least the final encoded size
    (placeholder addresses; a part of a pack may end up a part of an older pack, or a
    block of its own), so the node layout and the size caps are checked before any write."""
    packed_size: int | None = None  # its encoded size, once known

    def manifest_value(self, final: bool):  # pragma: no cover - interface
        raise NotImplementedError


@dataclass(frozen=True)
class OwnNode:
    """Give this value a node of its own whatever its size (a DCP snapshot's sections)."""
    value: object


_PLACEHOLDER = b"\0" * DIGEST_SIZE
_REF_SIZE = 37  # {"r": bin32}: map header, "r", bin8 header, 32 bytes


def _hdr(n: int) -> int:
    """Bytes of a msgpack array/map header for n entries."""
    return 1 if n < 16 else 3 if n < 1 << 16 else 5


class NodeWriter:
    """Lays a value tree out in nodes: a container or leaf whose encoding passes
    NODE_SPLIT bytes below the top gets a node of its own (so an unchanged sub-tree,
    a frozen module's state dict, is the same node in every snapshot).

    check(value) runs the layout without writing (UnsupportedType naming the path
    of a node that would pass MAX_NODE_BYTES); write(value, put) writes the nodes
    bottom-up through put(payload) -> digest and returns the top node's digest.
    The payloads written are kept in `payloads` (a fenced writer writes them again)."""

    def __init__(self, split: int = NODE_SPLIT):
        self.split = split
        self.payloads: list[bytes] = []
        self.values = 0  # values laid out, counted as readers count them (each path of the tree)

    def check(self, value) -> None:
        self.values = 0
        v, size = self._emit(value, (), 0, None)
        self._cap(size, ())

    def write(self, value, put: Callable[[bytes], bytes]) -> bytes:
        self.values = 0
        v, _ = self._emit(value, (), 0, put)
        return self._put(v, (), put)

    def _cap(self, size: int, path) -> None:
        if size + 8 > MAX_NODE_BYTES:
            raise UnsupportedType(f"a manifest node of about {size} bytes would pass the cap of {MAX_NODE_BYTES} "
                                  "bytes (split the value into smaller ones)", format_path(path))

    def _put(self, v, path, put) -> bytes:
        payload = encode_node(v)
        self._cap(len(payload), path)
        self.payloads.append(payload)
        return put(payload)

    def _own(self, v, size, path, put):
        self._cap(size, path)
        if put is None:
            return {"r": _PLACEHOLDER}, _REF_SIZE
        return {"r": self._put(v, path, put)}, _REF_SIZE

    def _maybe_split(self, v, size, path, depth, put):
        if depth > 0 and size > self.split:
            return self._own(v, size, path, put)
        return v, size

    def _emit(self, v, path, depth, put):
        """-> (raw value, exact encoded size)."""
        t = type(v)
        if t is not OwnNode:
            self.values += 1
            if self.values > MAX_VALUES:
                raise UnsupportedType(f"the state holds more than {MAX_VALUES} values (containers, tensors and "
                                      "plain values), more than a reader takes", format_path(path))
        if t is bytes:  # sizes of msgpack bin/str headers, without packing (values can be big)
            n = len(v)
            return self._maybe_split(v, n + (2 if n < 256 else 3 if n < 1 << 16 else 5), path, depth, put)
        if t is str:
            n = len(v.encode("utf-8", "surrogatepass"))
            return self._maybe_split(v, n + (1 if n < 32 else 2 if n < 256 else 3 if n < 1 << 16 else 5),
                                     path, depth, put)
        if isinstance(v, Pending):
            # Placeholder and final addresses have the same length: the size is computed once.
            raw = v.manifest_value(final=put is not None) if put is not None or v.packed_size is None else None
            if v.packed_size is None:
                v.packed_size = len(msgpack.packb(raw, use_bin_type=True))
            return self._maybe_split(raw, v.packed_size, path, depth, put)
        if t is OwnNode:
            raw, size = self._emit(v.value, path, depth, put)
            if isinstance(raw, dict) and len(raw) == 1 and "r" in raw:
                return raw, size  # split off already
            return self._own(raw, size, path, put)
        if t is dict and len(v) == 1:
            (tag, body), = v.items()
            if tag in ("d", "o") and isinstance(body, list):
                out, size = [], 0
                for k, x in body:
                    fx, s = self._emit(x, path + (k,), depth + 1, put)
                    out.append([k, fx])
                    size += 1 + len(msgpack.packb(k, use_bin_type=True)) + s
                return self._maybe_split({tag: out}, 3 + _hdr(len(out)) + size, path, depth, put)
            if tag in ("l", "t") and isinstance(body, list):
                out, size = [], 0
                for i, x in enumerate(body):
                    fx, s = self._emit(x, path + (i,), depth + 1, put)
                    out.append(fx)
                    size += s
                return self._maybe_split({tag: out}, 3 + _hdr(len(out)) + size, path, depth, put)
            if tag == "G" and isinstance(body, dict):
                chunks = [c.manifest_value(final=put is not None) if isinstance(c, Pending) else c
                          for c in body["chunks"]]
                raw = {"G": {**body, "chunks": chunks}}
                return self._maybe_split(raw, len(msgpack.packb(raw, use_bin_type=True)), path, depth, put)
        return self._maybe_split(v, len(msgpack.packb(v, use_bin_type=True)), path, depth, put)
