"""The state tree <-> manifest values: planning (validate the whole tree and
cut tensors into block jobs before anything is written) and reading back.

No storage keys here; block and node I/O goes through assets.Assets.
"""

from __future__ import annotations

import math
import os
import pickle
from collections import OrderedDict
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch

from . import chunker
from .assets import Assets
from .errors import CheckoutMismatch, FormatError, IntegrityError, UnsupportedType
from .format.manifest import MAX_DEPTH, decode_node, encode_node
from .shard import Replicated, Sharded

__all__ = ["Planner", "Plan", "Reader", "format_path", "TORCH_DTYPES"]

# Every dense dtype this torch build knows, by name. Decoding looks names up
# here and nowhere else: a stored string never reaches getattr(torch, ...).
TORCH_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)
}
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
# Containers whose encoding grows past this become nodes of their own, so an
# unchanged subtree is stored once and shared by later snapshots.
NODE_SPLIT = 4096
MAX_DIMS = 64
# A fresh tensor bigger than this is allocated only once all its blocks are known
# to exist (one HEAD / stat per distinct block; smaller ones are not worth it).
PRESENCE_CHECK_ABOVE = 64 << 20


def _code_units(raw: bytes, dtype: np.dtype) -> list[int]:
    """The UTF-32 code units of a numpy '<U'/'>U' value, in its byte order."""
    return np.frombuffer(raw, dtype=np.dtype("u4").newbyteorder(dtype.byteorder)).tolist()


def default_max_bytes() -> int:
    """The host's RAM + swap: the most a checkout into fresh memory can hold."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("SwapTotal:"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total


def format_path(parts) -> str:
    return "".join(f"[{p!r}]" for p in parts)


# Quantized dtypes stored as their integer representation plus affine parameters.
_QUANT_REPR = {torch.qint8: torch.int8, torch.quint8: torch.uint8, torch.qint32: torch.int32}
_QUANT_BY_NAME = {str(k).removeprefix("torch."): (k, v) for k, v in _QUANT_REPR.items()}
_QUANT_NAMES = {"qint8", "quint8", "qint32", "quint4x2", "quint2x4"}


def _quant_params(t: torch.Tensor):
    if t.dtype not in _QUANT_REPR:
        return None
    scheme = t.qscheme()
    name = str(t.dtype).removeprefix("torch.")
    if scheme == torch.per_tensor_affine:
        return name, {"s": "pt", "scale": float(t.q_scale()), "zp": int(t.q_zero_point())}
    if scheme == torch.per_channel_affine:
        return name, {"s": "pc", "scales": t.q_per_channel_scales().tolist(),
                      "zps": t.q_per_channel_zero_points().tolist(), "axis": int(t.q_per_channel_axis())}
    return None


def _dtype_out(d: np.dtype):
    """numpy dtype -> a msgpack-able description (dtype.str, or the structured descr)."""
    return d.str if d.fields is None else np.lib.format.dtype_to_descr(d)


def _descr_in(x, depth=0):
    """The msgpack form of a numpy descr (lists for tuples) back to what numpy expects."""
    if depth > 8:
        raise ValueError("dtype description nested too deeply")
    if isinstance(x, str):
        if len(x) > 64:
            raise ValueError("dtype string too long")
        return x
    if not isinstance(x, list) or not 0 < len(x) <= 1024:
        raise ValueError("bad dtype description")
    fields = []
    for f in x:
        if not isinstance(f, list) or len(f) not in (2, 3):
            raise ValueError("bad structured dtype field")
        name = f[0] if isinstance(f[0], str) else tuple(f[0]) if isinstance(f[0], list) else None
        if name is None or (isinstance(name, tuple) and not all(isinstance(n, str) for n in name)):
            raise ValueError("bad structured dtype field name")
        entry = (name, _descr_in(f[1], depth + 1))
        if len(f) == 3:
            if not isinstance(f[2], list) or not all(isinstance(n, int) and 0 <= n < 1 << 20 for n in f[2]):
                raise ValueError("bad subarray shape")
            entry += (tuple(f[2]),)
        fields.append(entry)
    return fields


def _np_dtype(desc) -> np.dtype:
    d = np.lib.format.descr_to_dtype(_descr_in(desc))
    if d.hasobject:
        raise ValueError(f"numpy dtype {d} holds Python objects")
    return d


def _check_utf8(s: str, path) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnsupportedType(f"string is not valid UTF-8 ({e.reason} at index {e.start})",
                              format_path(path)) from None


def _int_to_bytes(x: int) -> bytes:
    return x.to_bytes((x.bit_length() + 8) // 8, "big", signed=True)


# -- planning (write side) ---------------------------------------------------------

@dataclass
class _Leaf:
    """A tensor/array whose blocks are still to be written."""
    tag: str                 # "T" or "A"
    meta: dict               # dt, sh, n, bs, and tensor extras
    raw: object              # flat uint8 numpy view of the bytes (keeps them alive); None until
                             # staged for a device tensor
    itemsize: int
    ranges: list             # [(start, stop)]
    results: list = field(default_factory=list)  # PutResult per block, filled by run()
    device_src: object = None  # flat uint8 view of a contiguous device tensor (async staging)
    replicated: bool = False   # the same bytes on every rank (a collective put spreads its blocks)
    path: str = ""             # where in the state (spreads replicated blocks over ranks)

    @property
    def nbytes(self) -> int:
        return self.ranges[-1][1] if self.ranges else 0


@dataclass
class Plan:
    value: object            # the manifest value with _Leaf placeholders
    leaves: list
    inline_bytes: int = 0

    @property
    def staged_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves)

    def stage(self, buf: torch.Tensor) -> None:
        """Copy every leaf's bytes into `buf` (a reused uint8 host buffer of at
        least staged_bytes), so the caller may change its tensors as soon as
        this returns while the blocks are written in the background. Device
        tensors go through non_blocking copies on a side stream (into pinned
        memory when the pool pinned it), synchronised before returning."""
        stream = None
        if any(leaf.device_src is not None for leaf in self.leaves):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())  # see the tensors' final values
        off = 0
        for leaf in self.leaves:
            n = leaf.nbytes
            dst = buf[off:off + n]
            if leaf.device_src is not None:
                with torch.cuda.stream(stream):
                    dst.copy_(leaf.device_src, non_blocking=True)
                leaf.device_src = None
            else:
                dst.copy_(torch.from_numpy(leaf.raw))  # torch's copy runs on several threads
            leaf.raw = dst.numpy()
            off += n
        if stream is not None:
            stream.synchronize()


class Planner:
    def __init__(self, *, block_size: int, inline_threshold: int, allow_pickle: bool = False,
                 defer_device: bool = False):
        self.block_size = block_size
        self.inline_threshold = inline_threshold
        self.allow_pickle = allow_pickle
        self.defer_device = defer_device  # leave device tensors for Plan.stage() to copy

    def plan(self, state) -> Plan:
        self._leaves: list[_Leaf] = []
        self._inline = 0
        value = self._plan(state, (), 0)
        return Plan(value, self._leaves, self._inline)

    def _unsupported(self, obj, path, why=None):
        if self.allow_pickle and why is None:
            try:
                return {"P": pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)}
            except Exception as e:
                raise UnsupportedType(f"cannot pickle {type(obj).__name__}: {e}", format_path(path)) from None
        raise UnsupportedType(why or f"unsupported type {type(obj).__module__}.{type(obj).__qualname__}",
                              format_path(path))

    def _plan(self, obj, path, depth):
        self._path = path
        if depth > MAX_DEPTH:
            raise UnsupportedType(f"state nested deeper than {MAX_DEPTH} levels", format_path(path))
        t = type(obj)
        if t is str:
            _check_utf8(obj, path)
            return obj
        if obj is None or t is bool or t is bytes or t is float:
            return obj
        if t is int:
            return obj if _INT64_MIN <= obj <= _UINT64_MAX else {"i": _int_to_bytes(obj)}
        if t is dict or t is OrderedDict:
            items = []
            for k, v in obj.items():
                if type(k) is str:
                    _check_utf8(k, path + (k,))
                    ek = k
                elif type(k) is int:
                    ek = k if _INT64_MIN <= k <= _UINT64_MAX else {"i": _int_to_bytes(k)}
                else:
                    raise UnsupportedType(f"dict key of type {type(k).__name__} (only str and int keys)",
                                          format_path(path))
                items.append([ek, self._plan(v, path + (k,), depth + 1)])
            return {"d" if t is dict else "o": items}
        if t is list or t is tuple:
            return {"l" if t is list else "t": [self._plan(v, path + (i,), depth + 1) for i, v in enumerate(obj)]}
        if t is torch.Tensor or t is torch.nn.Parameter:
            return self._plan_tensor(obj, path)
        if t is Sharded:
            return self._plan_global(obj.local, obj.global_shape, obj.offsets, path)
        if t is Replicated:
            tt = obj.tensor
            return self._plan_global(tt, tuple(tt.shape), (0,) * tt.dim(), path, replicated=True)
        if getattr(t, "__name__", "") == "DTensor":
            from .shard import from_dtensor
            sh = from_dtensor(obj)
            return self._plan_global(sh.local, sh.global_shape, sh.offsets, path)
        if t is np.ndarray:
            return self._plan_array(obj, path)
        if isinstance(obj, np.generic):
            if obj.dtype.hasobject:
                return self._unsupported(obj, path)
            if obj.dtype.itemsize == 0:
                return self._unsupported(obj, path, f"numpy scalar of empty dtype {obj.dtype}")
            raw = obj.tobytes()
            if obj.dtype.kind == "U" and max(_code_units(raw, obj.dtype)) > 0x10FFFF:
                # numpy lets such a scalar exist, but it is no valid string and cannot be rebuilt
                return self._unsupported(obj, path, "numpy str_ scalar with code points beyond U+10FFFF")
            return {"S": [_dtype_out(obj.dtype), raw]}
        return self._unsupported(obj, path)

    def _leaf(self, tag, meta, raw, itemsize, shape, device_src=None):
        n = raw.nbytes if raw is not None else device_src.numel()
        meta["n"] = n
        layout = chunker.plan_blocks(n, itemsize, shape, self.block_size, self.inline_threshold)
        if layout.block_size == 0:
            meta["x"] = raw.tobytes() if raw is not None else device_src.cpu().numpy().tobytes()
            self._inline += n
            return {tag: meta}
        meta["bs"] = layout.block_size
        leaf = _Leaf(tag, meta, raw, itemsize, [(a, b) for _, a, b in chunker.block_ranges(layout)],
                     device_src=device_src, path=format_path(self._path))
        self._leaves.append(leaf)
        return leaf

    def _plan_global(self, local, global_shape, offsets, path, replicated: bool = False):
        """A piece of a global tensor: stored as {"G": {dt, sh, chunks: [chunk]}}; ranks'
        chunks of one tensor are merged by path at checkout."""
        if type(local) not in (torch.Tensor, torch.nn.Parameter) or local.is_quantized:
            raise UnsupportedType("a sharded tensor's local piece must be a dense tensor", format_path(path))
        leaf = self._plan_tensor(local, path)
        if isinstance(leaf, _Leaf):
            leaf.tag = None  # finished as a bare chunk, not a {"T": ...} value
            chunk = leaf
        else:
            chunk = leaf["T"]
        meta = chunk.meta if isinstance(chunk, _Leaf) else chunk
        meta["off"] = list(offsets)
        g = {"dt": meta["dt"], "sh": list(global_shape), "chunks": [chunk]}
        if replicated:
            g["rep"] = True
            if isinstance(chunk, _Leaf):
                chunk.replicated = True
        return {"G": g}

    def _plan_tensor(self, obj: torch.Tensor, path):
        if obj.layout != torch.strided:
            return self._unsupported(obj, path, f"{obj.layout} tensors are not supported (only dense)")
        quant = None
        if obj.is_quantized:
            quant = _quant_params(obj)
            if quant is None:
                return self._unsupported(obj, path, f"quantized tensors of {obj.dtype} / {obj.qscheme()} "
                                                    "are not supported")
            obj = obj.int_repr()  # the stored bytes; "q" says how to re-quantize
        if obj.device.type == "meta":
            return self._unsupported(obj, path, "meta tensors have no data")
        t = obj.detach()
        on_device = t.device.type != "cpu"
        if on_device and not self.defer_device:
            t = t.cpu()
            on_device = False
        if str(t.dtype).removeprefix("torch.") in _QUANT_NAMES and not t.is_quantized:
            return self._unsupported(obj, path, f"a {t.dtype} view of a plain tensor is not a quantized tensor")
        try:
            if t.is_conj():
                t = t.resolve_conj()
            if t.is_neg():
                t = t.resolve_neg()
            if not t.is_contiguous():
                t = t.contiguous()
        except Exception as e:  # torch has no copy kernel for some dtypes (uint1..7, int1..7)
            return self._unsupported(obj, path, f"a non-contiguous {t.dtype} tensor cannot be copied: "
                                                f"{type(e).__name__}; make it contiguous first")
        try:
            flat = t.reshape(-1).view(torch.uint8)
            raw, device_src = (None, flat) if on_device else (flat.numpy(), None)
        except Exception as e:
            return self._unsupported(obj, path, f"tensor of dtype {t.dtype} cannot be viewed as bytes: {e}")
        meta = {"dt": str(t.dtype).removeprefix("torch."), "sh": list(t.shape)}
        if quant is not None:
            meta["dt"], meta["q"] = quant
        if type(obj) is torch.nn.Parameter:
            meta["p"] = True
        if obj.requires_grad:
            meta["rg"] = True
        if obj.device.type != "cpu":
            meta["dev"] = str(obj.device)
        return self._leaf("T", meta, raw, t.element_size(), tuple(t.shape), device_src)

    def _plan_array(self, a: np.ndarray, path):
        if a.dtype.hasobject:
            return self._unsupported(a, path, f"numpy arrays of dtype {a.dtype} are not supported")
        meta = {"dt": _dtype_out(a.dtype), "sh": list(a.shape)}
        if a.flags.f_contiguous and not a.flags.c_contiguous:
            meta["fo"] = True
            body = a.T  # C-contiguous view of the same memory
        else:
            body = np.ascontiguousarray(a)
        raw = body.reshape(-1).view(np.uint8)
        return self._leaf("A", meta, raw, a.dtype.itemsize, tuple(body.shape))


def run_block_jobs(plan: Plan, assets: Assets, pool: ThreadPoolExecutor, owns=None) -> None:
    """Hash, compress and write every block of the plan in parallel.

    owns(leaf, i) -> bool, for replicated leaves of a collective snapshot: a
    block another rank owns is only hashed here (its address goes into this
    rank's manifest), so each replicated block is written exactly once."""
    futs: list[tuple[_Leaf, Future]] = []
    try:
        for leaf in plan.leaves:
            for i, (a, b) in enumerate(leaf.ranges):
                if owns is not None and leaf.replicated and not owns(leaf, i):
                    futs.append((leaf, pool.submit(assets.hash_block, leaf.raw[a:b])))
                else:
                    futs.append((leaf, pool.submit(assets.put_block, leaf.raw[a:b], leaf.itemsize)))
        wait([f for _, f in futs], return_when=FIRST_EXCEPTION)
        for _, f in futs:
            if f.done() and f.exception() is not None:
                raise f.exception()
    except BaseException:
        for _, f in futs:
            f.cancel()
        raise
    for leaf, f in futs:
        leaf.results.append(f.result())


@dataclass
class BuildStats:
    bytes_total: int = 0
    blocks_total: int = 0
    bytes_new: int = 0
    blocks_new: int = 0


def build_tree(plan: Plan, assets: Assets) -> tuple[bytes, BuildStats, list]:
    """Replace leaves by their block ids, split big containers into nodes,
    write the nodes bottom-up and return the top node's address, the stats and
    the encoded nodes (kept so a fenced writer can re-validate them)."""
    stats = BuildStats(bytes_total=plan.inline_bytes)
    nodes: list[bytes] = []

    def put_node(payload: bytes) -> bytes:
        nodes.append(payload)
        return assets.put_node(payload).digest

    def fin(v, depth):
        if isinstance(v, _Leaf):
            meta = dict(v.meta)
            meta["b"] = [r.digest for r in v.results]
            for r in v.results:
                if not r.counted:  # a replicated block its owner rank counts
                    continue
                stats.blocks_total += 1
                stats.bytes_total += r.raw_len
                if r.new:
                    stats.blocks_new += 1
                    stats.bytes_new += r.raw_len
            if v.tag is None:  # a chunk of a global tensor
                return meta, 64 + 34 * len(v.results)
            return {v.tag: meta}, 64 + 34 * len(v.results)
        if isinstance(v, dict) and len(v) == 1:
            (tag, body), = v.items()
            if tag == "G":
                chunks, size = [], 64
                for c in body["chunks"]:
                    fc, sz = fin(c, depth + 1) if isinstance(c, _Leaf) else (c, len(msgpack.packb(c)))
                    chunks.append(fc)
                    size += sz
                return {"G": {**body, "chunks": chunks}}, size
            if tag in ("d", "o"):
                out, size = [], 8
                for k, x in body:
                    fx, s = fin(x, depth + 1)
                    out.append([k, fx])
                    size += s + (len(k) + 4 if isinstance(k, str) else 10)
                return split({tag: out}, size, depth)
            if tag in ("l", "t"):
                out, size = [], 8
                for x in body:
                    fx, s = fin(x, depth + 1)
                    out.append(fx)
                    size += s
                return split({tag: out}, size, depth)
            return v, len(msgpack.packb(v))  # inline tensor, scalar, big int, pickle: small
        if isinstance(v, (str, bytes)):
            return v, len(v) + 5
        return v, 9

    def split(v, size, depth):
        if depth > 0 and size > NODE_SPLIT:
            return {"r": put_node(encode_node(v))}, 40
        return v, size

    top, _ = fin(plan.value, 0)
    return put_node(encode_node(top)), stats, nodes


# -- reading -----------------------------------------------------------------------

_MISSING = object()


class Reader:
    """Decode a manifest tree back into a state, reading blocks in parallel.

    Stored bytes are untrusted: every field is type- and size-checked before
    use, and nothing from a manifest is executed (pickle only if allowed)."""

    def __init__(self, assets: Assets, pool: ThreadPoolExecutor, *, snapshot: str, verify: bool = True,
                 allow_pickle: bool = False, max_bytes: int | None = None, rank: int = 0):
        self.rank = rank  # whose rank-local values a multi-rank snapshot yields
        self.assets = assets
        self.pool = pool
        self.snapshot = snapshot
        self.verify = verify
        self.allow_pickle = allow_pickle
        # What a manifest may make us allocate: by default the host's memory (RAM +
        # swap), since a checkout into fresh CPU memory cannot hold more anyway.
        self.max_bytes = default_max_bytes() if max_bytes is None else int(max_bytes)
        self._allocated = 0
        self._jobs: list[tuple[bytes, object, str]] = []
        self._after: list = []

    def read(self, tree: bytes, into=_MISSING):
        value = self._node(tree, (), 0)
        out = self._value(value, (), 0, into)
        self._run_jobs()
        for fn in self._after:
            fn()
        return out

    def _fmt(self, msg, path):
        return FormatError(f"{msg} at {format_path(path) or 'top'} of snapshot {self.snapshot[:16]}")

    def _node(self, d, path, depth):
        data = self.assets.get_node(d, verify=self.verify, snapshot=self.snapshot, path=format_path(path))
        try:
            return decode_node(data)
        except FormatError as e:
            raise self._fmt(str(e), path) from None

    def _run_jobs(self):
        if not self._jobs:
            return
        futs = [self.pool.submit(self.assets.read_block_into, d, out, verify=self.verify,
                                 snapshot=self.snapshot, path=p) for d, out, p in self._jobs]
        wait(futs, return_when=FIRST_EXCEPTION)
        for f in futs:
            if f.done() and f.exception() is not None:
                for g in futs:
                    g.cancel()
                wait(futs)
                raise f.exception()
        for f in futs:
            f.result()

    def _value(self, v, path, depth, into=_MISSING):
        if depth > MAX_DEPTH:
            raise self._fmt(f"manifest nested deeper than {MAX_DEPTH}", path)
        if v is None or isinstance(v, (bool, int, float, str, bytes)):
            return v
        if not isinstance(v, dict) or len(v) != 1:
            raise self._fmt(f"unexpected manifest value of type {type(v).__name__}", path)
        (tag, body), = v.items()
        if tag == "r":
            if not isinstance(body, bytes) or len(body) != 32:
                raise self._fmt("bad node reference", path)
            child = self._node(body, path, depth)
            if isinstance(child, dict) and "r" in child:
                raise self._fmt("a node that only points at another node", path)
            # A node stands in for a container at the same level of the state tree.
            return self._value(child, path, depth, into)
        if tag == "W":
            return self._value(self._merge_world(body, path, depth), path, depth, into)
        if tag in ("d", "o"):
            return self._dict(tag, body, path, depth, into)
        if tag in ("l", "t"):
            if not isinstance(body, list):
                raise self._fmt("sequence body is not an array", path)
            if tag == "l" and type(into) is list:
                if len(into) != len(body):
                    raise CheckoutMismatch(f"list at {format_path(path)} has {len(into)} items, "
                                           f"snapshot has {len(body)}")
                for i, x in enumerate(body):
                    into[i] = self._value(x, path + (i,), depth + 1, into[i])
                return into
            sub = into if type(into) is tuple and len(into) == len(body) else None
            items = [self._value(x, path + (i,), depth + 1, sub[i] if sub else _MISSING)
                     for i, x in enumerate(body)]
            return items if tag == "l" else tuple(items)
        if tag == "i":
            if not isinstance(body, bytes) or len(body) > 1 << 16:
                raise self._fmt("bad big int", path)
            return int.from_bytes(body, "big", signed=True)
        if tag == "T":
            return self._tensor(body, path, into)
        if tag == "G":
            return self._global(body, path, into)
        if tag == "A":
            return self._array(body, path, into)
        if tag == "S":
            return self._scalar(body, path)
        if tag == "P":
            if not self.allow_pickle:
                raise UnsupportedType("snapshot holds a pickled object; pass allow_pickle=True to "
                                      "checkout to load it (only for snapshots you trust)", format_path(path))
            if not isinstance(body, bytes):
                raise self._fmt("bad pickle body", path)
            try:
                return pickle.loads(body)
            except Exception as e:
                raise self._fmt(f"pickled object does not load: {e}", path) from None
        raise self._fmt(f"unknown manifest tag {tag!r}", path)

    def _dict(self, tag, body, path, depth, into):
        if not isinstance(body, list):
            raise self._fmt("dict body is not an array", path)
        target = into if isinstance(into, dict) else (dict() if tag == "d" else OrderedDict())
        for pair in body:
            if not isinstance(pair, list) or len(pair) != 2:
                raise self._fmt("dict entry is not a pair", path)
            k, x = pair
            if isinstance(k, dict) and len(k) == 1 and isinstance(k.get("i"), bytes):
                k = int.from_bytes(k["i"], "big", signed=True)
            elif not isinstance(k, (str, int)) or isinstance(k, bool):
                raise self._fmt("dict key is not a str or int", path)
            target[k] = self._value(x, path + (k,), depth + 1, target.get(k, _MISSING) if into is not _MISSING
                                    and isinstance(into, dict) else _MISSING)
        return target

    def _leaf_common(self, body, path, itemsize_of):
        if not isinstance(body, dict):
            raise self._fmt("tensor leaf is not a map", path)
        sh = body.get("sh")
        if not isinstance(sh, list) or len(sh) > MAX_DIMS or not all(
                isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 48 for s in sh):
            raise self._fmt("bad tensor shape", path)
        n = body.get("n")
        itemsize = itemsize_of(body.get("dt"))
        if not isinstance(n, int) or n != math.prod(sh) * itemsize:
            raise self._fmt(f"tensor size {n!r} does not match shape {sh} of {body.get('dt')}", path)
        if n > self.max_bytes:
            raise self._fmt(f"tensor of {n} bytes exceeds max_bytes={self.max_bytes} "
                            "(checkout(..., max_bytes=N) raises the cap)", path)
        if "x" in body:
            if not isinstance(body["x"], bytes) or len(body["x"]) != n:
                raise self._fmt("inline tensor bytes do not match its size", path)
            return sh, n, None
        bs, blocks = body.get("bs"), body.get("b")
        if not isinstance(bs, int) or not 1 <= bs <= chunker.MAX_BLOCK_SIZE or not isinstance(blocks, list):
            raise self._fmt("bad block layout", path)
        if len(blocks) != math.ceil(n / bs) or not all(isinstance(b, bytes) and len(b) == 32 for b in blocks):
            raise self._fmt("block list does not match the tensor size", path)
        return sh, n, (bs, blocks)

    def _reserve(self, n, layout, path):
        """Called before allocating n fresh bytes: the checkout's total stays under
        max_bytes, and a big tensor's blocks must exist before its memory is taken
        (a few hundred hostile manifest bytes must not cost gigabytes)."""
        self._allocated += n
        if self._allocated > self.max_bytes:
            raise self._fmt(f"the snapshot's tensors need more than max_bytes={self.max_bytes} "
                            "(checkout(..., max_bytes=N) raises the cap)", path)
        if layout is None or n <= PRESENCE_CHECK_ABOVE:
            return
        exists = self.assets.block_exists
        distinct = list(dict.fromkeys(layout[1]))
        for d, ok in zip(distinct, self.pool.map(exists, distinct)):
            if not ok:
                raise IntegrityError("missing object", key=f"blocks/{d.hex()[:2]}/{d.hex()}", reason="missing",
                                     snapshot=self.snapshot, path=format_path(path))

    def _fill(self, flat_u8, n, layout, inline, path):
        """Schedule the reads that fill `flat_u8` (a writable uint8 buffer of n bytes)."""
        if layout is None:
            flat_u8[:] = np.frombuffer(inline, dtype=np.uint8)
            return
        bs, blocks = layout
        p = format_path(path)
        for i, d in enumerate(blocks):
            self._jobs.append((d, flat_u8[i * bs:min(n, (i + 1) * bs)], p))

    # -- multi-rank snapshots ----------------------------------------------------
    def _merge_world(self, body, path, depth):
        """A collective snapshot holds one tree per rank. Merge them into this rank's
        view: its own rank-local values (rank 0's for a rank the snapshot did not
        have), with every sharded tensor's chunks gathered from all ranks."""
        if path or not isinstance(body, dict) or not isinstance(body.get("ranks"), list) \
                or not 0 < len(body["ranks"]) <= 1 << 20 or body.get("world") != len(body["ranks"]) \
                or not all(isinstance(d, bytes) and len(d) == 32 for d in body["ranks"]):
            raise self._fmt("bad multi-rank snapshot", path)
        vals = [self._node(d, path, depth) for d in body["ranks"]]
        sel = self.rank if self.rank < len(vals) else 0
        return self._merge(vals, sel, path, depth)

    def _deref(self, v, path, depth):
        while isinstance(v, dict) and len(v) == 1 and "r" in v:
            if not isinstance(v["r"], bytes) or len(v["r"]) != 32:
                raise self._fmt("bad node reference", path)
            v = self._node(v["r"], path, depth)
        return v

    def _merge(self, vals, sel, path, depth):
        if depth > MAX_DEPTH:
            raise self._fmt(f"manifest nested deeper than {MAX_DEPTH}", path)
        vals = [self._deref(v, path, depth) for v in vals]
        v0 = vals[sel]
        if not isinstance(v0, dict) or len(v0) != 1:
            return v0
        (tag, body), = v0.items()
        if tag == "G" and isinstance(body, dict):
            chunks = []
            for v in vals:
                g = v.get("G") if isinstance(v, dict) else None
                if isinstance(g, dict) and g.get("dt") == body.get("dt") and g.get("sh") == body.get("sh") \
                        and isinstance(g.get("chunks"), list):
                    chunks.extend(g["chunks"])
            return {"G": {**body, "chunks": chunks}}
        same = [v for v in vals if isinstance(v, dict) and len(v) == 1 and tag in v]
        if len(same) != len(vals):
            return v0  # the ranks' trees differ here: this rank's own view
        bodies = [v[tag] for v in same]
        if tag in ("d", "o") and all(isinstance(b, list) and all(isinstance(p, list) and len(p) == 2 for p in b)
                                     for b in bodies):
            keys = [[p[0] if isinstance(p, list) and len(p) == 2 else None for p in b] for b in bodies]
            if all(k == keys[sel] for k in keys):
                return {tag: [[k, self._merge([b[i][1] for b in bodies], sel, path + (k,), depth + 1)]
                              for i, k in enumerate(keys[sel])]}
        if tag in ("l", "t") and all(isinstance(b, list) and len(b) == len(body) for b in bodies):
            return {tag: [self._merge([b[i] for b in bodies], sel, path + (i,), depth + 1)
                          for i in range(len(body))]}
        return v0

    # -- global (sharded) tensors ------------------------------------------------
    def _chunks(self, body, path):
        """Validate a G leaf -> (dtype, global shape, [(offsets, shape, n, layout, inline)])."""
        if not isinstance(body, dict) or not isinstance(body.get("chunks"), list) \
                or len(body["chunks"]) > 1 << 20:
            raise self._fmt("bad sharded tensor", path)
        dt = body.get("dt")
        if not isinstance(dt, str) or dt not in TORCH_DTYPES or dt in _QUANT_BY_NAME \
                or TORCH_DTYPES[dt] in (torch.quint4x2, torch.quint2x4):
            raise self._fmt(f"unknown or unsupported torch dtype {dt!r} for a sharded tensor", path)
        gs = body.get("sh")
        if not isinstance(gs, list) or len(gs) > MAX_DIMS or not all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 48 for x in gs):
            raise self._fmt("bad global shape", path)
        if math.prod(gs) * TORCH_DTYPES[dt].itemsize > self.max_bytes:
            raise self._fmt(f"sharded tensor of shape {gs} exceeds max_bytes={self.max_bytes}", path)
        out, seen = [], set()
        for c in body["chunks"]:
            if not isinstance(c, dict) or c.get("dt") != dt:
                raise self._fmt("bad chunk", path)
            off = c.get("off")
            if not isinstance(off, list) or len(off) != len(gs) or not all(
                    isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in off):
                raise self._fmt("bad chunk offsets", path)
            sh, n, layout = self._leaf_common(c, path, lambda d: TORCH_DTYPES[d].itemsize)
            if len(sh) != len(gs) or any(o + k > g for o, k, g in zip(off, sh, gs)):
                raise self._fmt("chunk outside its tensor", path)
            key = (tuple(off), tuple(sh))
            if key in seen:  # the same piece from several ranks (replicated): read it once
                continue
            seen.add(key)
            out.append((tuple(off), tuple(sh), n, layout, c.get("x")))
        return TORCH_DTYPES[dt], tuple(gs), out

    def _global(self, body, path, into):
        dtype, gs, chunks = self._chunks(body, path)
        if isinstance(into, Sharded):
            tgt, roff = into.local, into.offsets
            if tgt.dtype != dtype or len(into.global_shape) != len(gs) or tuple(into.global_shape) != gs:
                raise CheckoutMismatch(f"sharded tensor at {format_path(path)} is {dtype} {list(gs)}, "
                                       f"target is {tgt.dtype} {list(into.global_shape)}")
            self._fill_region(chunks, dtype, tgt, roff, path, require_full=True)
            return into
        if isinstance(into, torch.Tensor):
            if into.dtype != dtype or tuple(into.shape) != gs:
                raise CheckoutMismatch(f"tensor at {format_path(path)} is {into.dtype} {list(into.shape)}, "
                                       f"snapshot has {dtype} {list(gs)}")
            self._fill_region(chunks, dtype, into, (0,) * len(gs), path, require_full=True)
            return into
        covered = sum(math.prod(c[1]) for c in chunks)
        if len(chunks) == 1 and covered < math.prod(gs):
            off, sh, *_ = chunks[0]  # one rank's piece saved on its own: give the piece back
            local = torch.empty(sh, dtype=dtype)
            self._fill_region(chunks, dtype, local, off, path, require_full=True)
            return Sharded(local, gs, off)
        try:
            t = torch.empty(gs, dtype=dtype)
        except Exception as e:
            raise self._fmt(f"cannot allocate tensor of {dtype} {list(gs)}: {type(e).__name__}", path) from None
        self._fill_region(chunks, dtype, t, (0,) * len(gs), path, require_full=True)
        return t

    def _fill_region(self, chunks, dtype, dst: torch.Tensor, roff, path, require_full: bool):
        """Fill dst (the region of the global tensor at offsets roff) from the chunks
        that intersect it, scheduling reads of only the blocks that overlap it."""
        rshape = tuple(dst.shape)
        itemsize = dtype.itemsize
        filled = 0
        for coff, cshape, n, layout, inline in chunks:
            lo = [max(a, b) for a, b in zip(coff, roff)]
            hi = [min(a + x, b + y) for a, x, b, y in zip(coff, cshape, roff, rshape)]
            if any(a >= b for a, b in zip(lo, hi)) and len(cshape):
                continue
            filled += math.prod(b - a for a, b in zip(lo, hi))
            src_box = tuple(slice(a - c, b - c) for a, b, c in zip(lo, hi, coff))
            dst_box = tuple(slice(a - r, b - r) for a, b, r in zip(lo, hi, roff))
            if not n:
                continue
            if inline is not None:
                src = torch.frombuffer(bytearray(inline), dtype=torch.uint8).view(dtype).reshape(cshape)
                dst[dst_box].copy_(src[src_box])
                continue
            bs, blocks = layout
            row = itemsize * math.prod(cshape[1:]) if len(cshape) else itemsize
            r0, r1 = (lo[0] - coff[0], hi[0] - coff[0]) if len(cshape) else (0, 1)
            b_lo, b_hi = r0 * row, r1 * row
            i0, i1 = b_lo // bs, -(-b_hi // bs)
            whole = all(s.start == 0 and s.stop == k for s, k in zip(src_box, cshape))
            target = dst[dst_box]
            if whole and target.is_contiguous() and dst.device.type == "cpu":
                # The chunk lands whole in contiguous memory: read its blocks straight in.
                self._fill(target.reshape(-1).view(torch.uint8).numpy(), n, layout, None, path)
                continue
            base = i0 * bs
            tmp = torch.empty(min(n, i1 * bs) - base, dtype=torch.uint8)
            flat = tmp.numpy()
            p = format_path(path)
            for i in range(i0, i1):
                a, b = i * bs, min(n, (i + 1) * bs)
                self._jobs.append((blocks[i], flat[a - base:b - base], p))
            rows = tmp[b_lo - base:b_hi - base].view(dtype).reshape((r1 - r0,) + tuple(cshape[1:])) \
                if len(cshape) else tmp.view(dtype).reshape(())
            sub = rows[(slice(None),) + src_box[1:]] if len(cshape) else rows
            self._after.append(lambda t=target, s=sub: t.copy_(s))
        if require_full and filled < math.prod(rshape):
            raise CheckoutMismatch(f"the snapshot does not hold all of the requested region of the tensor "
                                   f"at {format_path(path)} ({filled} of {math.prod(rshape)} elements)")

    def _fill_now(self, flat_u8, n, layout, inline, path):
        pending, self._jobs = self._jobs, []
        try:
            self._fill(flat_u8, n, layout, inline, path)
            self._run_jobs()
        finally:
            self._jobs = pending

    def _tensor(self, body, path, into):
        def itemsize_of(dt):
            if not isinstance(dt, str) or dt not in TORCH_DTYPES:
                raise self._fmt(f"unknown torch dtype {dt!r}", path)
            return TORCH_DTYPES[dt].itemsize
        sh, n, layout = self._leaf_common(body, path, itemsize_of)
        dtype = TORCH_DTYPES[body["dt"]]
        if "q" in body or body["dt"] in _QUANT_BY_NAME or dtype in (torch.quint4x2, torch.quint2x4):
            return self._quantized(body, sh, n, layout, path, into)
        inline = body.get("x")
        rg = body.get("rg") is True
        if isinstance(into, torch.Tensor):
            if into.dtype != dtype or list(into.shape) != sh:
                raise CheckoutMismatch(f"tensor at {format_path(path)} is {into.dtype} {list(into.shape)}, "
                                       f"snapshot has {dtype} {sh}")
            if into.device.type == "cpu" and into.is_contiguous() and not into.is_conj() and not into.is_neg():
                dst = into.detach()
            else:
                dst = torch.empty(sh, dtype=dtype)
                self._after.append(lambda: _copy_into(into, dst))
            if n:
                self._fill(dst.reshape(-1).view(torch.uint8).numpy(), n, layout, inline, path)
            return into
        self._reserve(n, layout, path)
        try:
            t = torch.empty(sh, dtype=dtype)
            flat = t.reshape(-1).view(torch.uint8).numpy() if n else None
        except Exception as e:
            raise self._fmt(f"cannot allocate tensor of {body['dt']} {sh}: {e}", path) from None
        dev = body.get("dev")
        on_cuda = isinstance(dev, str) and dev.startswith("cuda") and torch.cuda.is_available()
        if n:
            # A CUDA tensor is filled now, so it can be moved before it is placed in the tree.
            (self._fill_now if on_cuda else self._fill)(flat, n, layout, inline, path)
        if on_cuda:
            try:
                t = t.to(dev)
            except Exception:  # e.g. fewer devices than when written: stay on the CPU
                pass
        rg = rg and (t.dtype.is_floating_point or t.dtype.is_complex)  # only those can require grad
        if body.get("p") is True:
            return torch.nn.Parameter(t, requires_grad=rg)
        if rg:
            t.requires_grad_(True)
        return t

    def _quantized(self, body, sh, n, layout, path, into):
        qt, repr_dtype = _QUANT_BY_NAME.get(body["dt"], (None, None))
        q = body.get("q")
        if qt is None or not isinstance(q, dict):
            raise self._fmt(f"quantized tensor of {body['dt']} without valid parameters", path)
        if into is not _MISSING and isinstance(into, torch.Tensor):
            raise CheckoutMismatch(f"checkout(into=) cannot fill the quantized tensor at {format_path(path)}")
        try:
            rep = torch.empty(sh, dtype=repr_dtype)
        except Exception as e:
            raise self._fmt(f"cannot allocate quantized tensor {sh}: {type(e).__name__}", path) from None
        if q.get("s") == "pt" and isinstance(q.get("scale"), float) and isinstance(q.get("zp"), int):
            make = lambda: torch._make_per_tensor_quantized_tensor(rep, q["scale"], q["zp"])  # noqa: E731
        elif q.get("s") == "pc" and isinstance(q.get("axis"), int) and 0 <= q["axis"] < max(1, len(sh)) \
                and isinstance(q.get("scales"), list) and isinstance(q.get("zps"), list) \
                and len(q["scales"]) == len(q["zps"]) == (sh[q["axis"]] if sh else 1) \
                and all(isinstance(x, float) for x in q["scales"]) \
                and all(isinstance(x, int) and not isinstance(x, bool) for x in q["zps"]):
            make = lambda: torch._make_per_channel_quantized_tensor(  # noqa: E731
                rep, torch.tensor(q["scales"], dtype=torch.float64), torch.tensor(q["zps"], dtype=torch.int64),
                q["axis"])
        else:
            raise self._fmt("bad quantization parameters", path)
        if n:
            self._fill_now(rep.reshape(-1).view(torch.uint8).numpy(), n, layout, body.get("x"), path)
        try:
            return make()
        except Exception as e:
            raise self._fmt(f"cannot rebuild quantized tensor: {e}", path) from None

    def _array(self, body, path, into):
        dtype = self._np_dtype(body.get("dt") if isinstance(body, dict) else None, path)
        sh, n, layout = self._leaf_common(body, path, lambda _dt: dtype.itemsize)
        fo = body.get("fo") is True
        if isinstance(into, np.ndarray) and into.dtype == dtype and list(into.shape) == sh \
                and into.flags.writeable:
            dst = np.empty(sh, dtype=dtype, order="F" if fo else "C")
            if n:
                body_view = dst.T if fo else dst
                self._fill(body_view.reshape(-1).view(np.uint8), n, layout, body.get("x"), path)
            self._after.append(lambda: np.copyto(into, dst))
            return into
        if isinstance(into, np.ndarray):
            raise CheckoutMismatch(f"array at {format_path(path)} is {into.dtype} {list(into.shape)}, "
                                   f"snapshot has {dtype} {sh}")
        self._reserve(n, layout, path)
        try:
            a = np.empty(sh, dtype=dtype, order="F" if fo else "C")
        except Exception as e:
            raise self._fmt(f"cannot allocate array of {dtype} {sh}: {type(e).__name__}", path) from None
        if n:
            body_view = a.T if fo else a
            self._fill(body_view.reshape(-1).view(np.uint8), n, layout, body.get("x"), path)
        return a

    def _np_dtype(self, desc, path) -> np.dtype:
        try:
            return _np_dtype(desc)
        except Exception as e:
            raise self._fmt(f"bad numpy dtype {str(desc)[:80]!r}: {e}", path) from None

    def _scalar(self, body, path):
        if not isinstance(body, list) or len(body) != 2 or not isinstance(body[1], bytes):
            raise self._fmt("bad numpy scalar", path)
        d = self._np_dtype(body[0], path)
        if d.itemsize == 0 or len(body[1]) != d.itemsize:
            raise self._fmt("numpy scalar bytes do not match its dtype", path)
        try:
            if d.kind == "S":  # frombuffer's scalar would drop trailing NULs (and shrink the dtype)
                return np.bytes_(body[1])
            if d.kind == "U":  # the same for str_: decode the UTF-32 code units ourselves
                # chr, unlike the utf-32 codec, takes surrogates
                return np.str_("".join(map(chr, _code_units(body[1], d))))
            return np.frombuffer(body[1], dtype=d)[0]
        except Exception as e:  # e.g. an invalid code point in a <U scalar
            raise self._fmt(f"numpy scalar does not decode: {type(e).__name__}", path) from None


def _copy_into(into: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        into.copy_(src)
