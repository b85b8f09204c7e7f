"""Fuzz target: the state encoder (plan.py Planner, through put_snapshot) and
the round trip through checkout, on a memory:// store.

Input: a small program in a byte language (ByteStream ops below) that builds
an arbitrary state tree: None, bool, ints of every size, floats with any bit
pattern, str (also with lone surrogates), bytes, dict / OrderedDict with
str, int and other keys, list, tuple, numpy arrays and scalars of many dtypes
(structured, big-endian, datetime, object, zero-size), torch tensors of every
dtype this torch knows (views, transposes, conj/neg bits, Parameters,
requires_grad, quantized, expanded, meta, sparse), Sharded / Replicated
pieces, shared references, nesting past the depth limit, and objects only
pickle can store. Seeds (fuzz/corpus/state_encoder/) are the real snapshots'
states written in this language by make_corpus.py (encode_tree).

Contract: put_snapshot(tree) either raises UnsupportedType / InvalidName, or
succeeds and checkout returns the same tree (types, key order, dtypes, shapes,
bits, quantization, requires_grad, Fortran order). A tree that needs pickle
is refused without allow_pickle; stored with allow_pickle=True it is refused
by checkout without allow_pickle (UnsupportedType) and comes back with it.
"""

from __future__ import annotations

import os
import struct
import sys
import uuid
import warnings
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
from _common import ByteStream, ContractViolation  # noqa: E402

with _common.instrument(__name__ == "__main__"):
    import datetime
    import decimal
    import fractions

    import numpy as np
    import torch

    import tensorstore_ck as tsck
    from tensorstore_ck.errors import InvalidName, StepReusedWarning, TsckError, UnsupportedType
    from tensorstore_ck.write.shard import Replicated, Sharded
    from tensorstore_ck.format.dtypes import TORCH_DTYPES

DEADLINE = 10.0
MAX_OPS = 400          # values built per input
RECYCLE_EVERY = 300    # a fresh memory store now and then keeps memory flat

# ---------------------------------------------------------------------------- tables
NP_DTYPES = [
    np.dtype("<f2"), np.dtype("<f4"), np.dtype("<f8"), np.dtype("<c8"), np.dtype("<c16"), np.dtype("?"),
    np.dtype("i1"), np.dtype("<i2"), np.dtype("<i4"), np.dtype("<i8"), np.dtype("u1"), np.dtype("<u2"),
    np.dtype("<u4"), np.dtype("<u8"), np.dtype(">f4"), np.dtype(">i8"), np.dtype("<M8[ns]"), np.dtype("<m8[s]"),
    np.dtype("<M8[D]"), np.dtype("<U3"), np.dtype("S4"), np.dtype("V4"), np.dtype("<U1"), np.dtype("S1"),
    np.dtype([("a", "<f4"), ("b", "u1")]),
    np.dtype([("id", "<i4"), ("w", "<f4", (2,)), ("tag", "S3")]),
    np.dtype([("a", "<f4"), ("b", "u1")], align=True),
    np.dtype([("outer", [("x", "<i2"), ("y", ">f8")]), ("z", "?")]),
    np.dtype({"names": ["a"], "formats": ["<f4"], "offsets": [4], "itemsize": 12}),
    np.dtype([(("title", "named"), "<i4")]),
    np.dtype(object),
    np.dtype([("a", "<i4"), ("o", object)]),
    np.dtype("<f16") if hasattr(np, "float128") else np.dtype("<f8"),
    np.dtype("V0"),
]
TORCH_NAMES = sorted(TORCH_DTYPES)
QUANT = [torch.qint8, torch.quint8, torch.qint32]
BIG_INTS = [2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64, -(2**64), 2**1000, -(2**4000)]
SPECIAL_FLOATS = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 5e-324, 1.7976931348623157e308]


class _IntSub(int):
    pass


class _DictSub(dict):
    pass


class _StrSub(str):
    pass


def _unsupported(bs: ByteStream):
    k = bs.u8() % 14
    return [
        lambda: {1, 2, bs.u8()},
        lambda: frozenset({"a"}),
        lambda: complex(bs.f64(), bs.f64()),
        lambda: fractions.Fraction(bs.u8() + 1, 3),
        lambda: decimal.Decimal("1.10"),
        lambda: bytearray(bs.blob(8)),
        lambda: range(bs.u8()),
        lambda: _IntSub(bs.u8()),
        lambda: _DictSub(a=1),
        lambda: _StrSub("s"),
        lambda: datetime.date(2024, 1, 1 + bs.u8() % 28),
        lambda: (lambda: 1),  # not even pickle stores it
        lambda: object(),
        lambda: Ellipsis,
    ][k]()


# ---------------------------------------------------------------------------- builder
class Builder:
    def __init__(self, data: bytes):
        self.bs = ByteStream(data)
        self.ops = 0
        self.made: list = []

    def value(self, depth: int = 0):
        bs = self.bs
        self.ops += 1
        if self.ops > MAX_OPS or bs.left() == 0:
            return None
        op = bs.u8() % 20
        if depth > 8 and op in (8, 9, 10, 11, 16):
            op = 2
        v = self._make(op, depth)
        if op not in (0, 1, 2):
            self.made.append(v)
        return v

    def _text(self, cap: int = 32) -> str:
        b = self.bs.blob(cap)
        try:
            return b.decode("utf-8", "surrogatepass")
        except UnicodeDecodeError:
            return b.decode("utf-8", "surrogateescape")

    def _key(self):
        bs = self.bs
        k = bs.u8() % 9
        if k <= 3:
            return self._text(12)
        if k == 4:
            return bs.i64() >> (bs.u8() % 64)
        if k == 5:
            return bs.pick(BIG_INTS)
        return [True, 1.5, None, (1, 2), b"k"][bs.u8() % 5] if k == 8 else (bs.u8() - 128)

    def _make(self, op: int, depth: int):
        bs = self.bs
        if op == 0:
            return None
        if op == 1:
            return bool(bs.u8() & 1)
        if op == 2:
            return bs.u8() - 128
        if op == 3:
            return bs.i64()
        if op == 4:
            if bs.u8() & 1:
                return bs.pick(BIG_INTS)
            return int.from_bytes(bs.take(bs.u8() % 40 + 1), "big", signed=True)
        if op == 5:
            return bs.pick(SPECIAL_FLOATS) if bs.u8() & 1 else bs.f64()
        if op == 6:
            return self._text()
        if op == 7:
            return bs.blob(64)
        if op in (8, 9):
            items = [(self._key(), self.value(depth + 1)) for _ in range(bs.u8() % 6)]
            return dict(items) if op == 8 else OrderedDict(items)
        if op in (10, 11):
            items = [self.value(depth + 1) for _ in range(bs.u8() % 6)]
            return items if op == 10 else tuple(items)
        if op == 12:
            return self._array()
        if op == 13:
            return self._np_scalar()
        if op == 14:
            return self._tensor()
        if op == 15:
            return _unsupported(bs)
        if op == 16:
            v: object = bs.u8()
            for _ in range(150 + bs.u8()):  # 150..405 levels: the limit is 200
                v = [v]
            return v
        if op == 17:
            return self._sharded()
        if op == 18:
            return bs.pick(self.made) if self.made else None
        return self._array(special=True)

    def _shape(self, max_dims: int = 3, max_dim: int = 5):
        return tuple(self.bs.u8() % (max_dim + 1) for _ in range(self.bs.u8() % (max_dims + 1)))

    def _array(self, special: bool = False):
        bs = self.bs
        dt = bs.pick(NP_DTYPES)
        shape = self._shape()
        n = int(np.prod(shape)) if shape else 1
        if dt.hasobject:
            a = np.empty(shape, dtype=dt)
            return a
        raw = bs.take(n * dt.itemsize)
        a = np.frombuffer(bytearray(raw), dtype=dt, count=n).reshape(shape) if dt.itemsize else np.zeros(shape, dt)
        if not special:
            return a.copy()
        k = bs.u8() % 6
        if k == 0:
            return np.asfortranarray(a)
        if k == 1 and a.ndim:
            return a[::2]
        if k == 2:
            return a.T
        if k == 3:
            a = a.copy()
            a.flags.writeable = False
            return a
        if k == 4:
            return a.reshape(-1)[:1].reshape(()).copy() if a.size else a
        return a.astype(dt.newbyteorder(">")) if dt.kind in "fiuc" else a

    def _np_scalar(self):
        bs = self.bs
        k = bs.u8() % 8
        if k == 0:
            return np.str_(self._text(8))
        if k == 1:
            return np.bytes_(bs.blob(8))
        if k == 2:
            return np.void(bs.blob(8))
        dt = bs.pick(NP_DTYPES)
        if dt.hasobject or dt.itemsize == 0:
            return np.float64(bs.f64())
        try:
            return np.frombuffer(bytearray(bs.take(dt.itemsize)), dtype=dt)[0]
        except (SystemError, ValueError):  # e.g. '<U1' bytes past U+10FFFF: numpy cannot make the scalar
            return np.float64(0.5)

    def _tensor(self):
        bs = self.bs
        name = bs.pick(TORCH_NAMES)
        dtype = TORCH_DTYPES[name]
        shape = self._shape()
        n = int(np.prod(shape)) if shape else 1
        variant = bs.u8() % 12
        if dtype in QUANT or variant == 10:
            base = torch.frombuffer(bytearray(bs.take(4 * n)), dtype=torch.float32).reshape(shape) \
                if n else torch.empty(shape)
            base = torch.nan_to_num(base, nan=0.0, posinf=1.0, neginf=-1.0).clamp(-100, 100)
            qd = dtype if dtype in QUANT else bs.pick(QUANT)
            if variant == 10 and len(shape) >= 1 and shape[0] > 0:
                scales = torch.tensor([0.01 + bs.u8() / 100 for _ in range(shape[0])], dtype=torch.float64)
                zps = torch.tensor([bs.u8() % 10 for _ in range(shape[0])], dtype=torch.int64)
                return torch.quantize_per_channel(base, scales, zps, 0, qd)
            return torch.quantize_per_tensor(base, 0.01 + bs.u8() / 50, bs.u8() % 10, qd)
        try:
            itemsize = torch.empty(0, dtype=dtype).element_size()
            raw = torch.frombuffer(bytearray(bs.take(max(1, n * itemsize))), dtype=torch.uint8)[:n * itemsize]
            t = raw.view(dtype).reshape(shape)
        except Exception:  # a dtype without a byte view (sub-byte types): the planner decides
            try:
                t = torch.empty(shape, dtype=dtype)
            except Exception:
                t = torch.zeros(shape)
        fp = t.dtype.is_floating_point or t.dtype.is_complex
        if variant == 1 and t.dim() >= 2:
            t = t.transpose(0, 1)
        elif variant == 2 and t.dim() >= 1:
            t = t[::2]
        elif variant == 3:
            t = torch.nn.Parameter(t, requires_grad=fp and bool(bs.u8() & 1))
        elif variant == 4 and fp:
            t = t.clone().requires_grad_(True)
        elif variant == 5 and t.dtype.is_complex:
            t = t.conj()
        elif variant == 6 and t.dtype in (torch.float32, torch.float64, torch.int64, torch.int32):
            t = t._neg_view()
        elif variant == 7 and t.dim() >= 1:
            t = t.unsqueeze(0).expand(2, *t.shape)
        elif variant == 8:
            t = torch.empty(shape, dtype=torch.float32, device="meta")
        elif variant == 9 and t.dtype == torch.float32 and t.dim() == 2:
            t = t.to_sparse()
        return t

    def _sharded(self):
        bs = self.bs
        t = torch.frombuffer(bytearray(bs.take(4 * 6)), dtype=torch.float32).reshape(2, 3).clone()
        if bs.u8() & 1:
            return Replicated(t)
        gs = (2 + bs.u8() % 3, 3 + bs.u8() % 2)
        off = (bs.u8() % (gs[0] - 1), bs.u8() % (gs[1] - 2))
        return Sharded(t, gs, off)

    def build(self):
        bs = self.bs
        flags = bs.u8()
        tree = self.value(0)
        return tree, bool(flags & 1), (flags >> 1) % 4


# ---------------------------------------------------------------------------- expected
def expected(v):
    """What checkout gives back for `v`: the same tree, except that a Replicated
    tensor, and a Sharded piece that covers its whole tensor, come back as the
    plain tensor they describe."""
    if isinstance(v, Replicated):
        return v.tensor.detach()
    if isinstance(v, Sharded):
        local = v.local.detach()
        if local.numel() >= int(np.prod(v.global_shape)):
            return local
        return Sharded(local, v.global_shape, v.offsets)
    if type(v) in (dict, OrderedDict):
        return type(v)((k, expected(x)) for k, x in v.items())
    if type(v) is list:
        return [expected(x) for x in v]
    if type(v) is tuple:
        return tuple(expected(x) for x in v)
    return v


# ---------------------------------------------------------------------------- encode (seeds)
def encode_tree(v) -> bytes:
    """A program for Builder that rebuilds `v` (the supported types only):
    make_corpus.py turns the real snapshots' states into seeds with it."""
    out = bytearray([0])  # flags: no pickle, ref 0

    def text(s: str, cap: int):
        b = s.encode("utf-8", "surrogatepass")[:cap]
        out.append(len(b))
        out.extend(b)

    def key(k):
        if type(k) is str:
            out.append(0)
            text(k, 12)
        else:
            out.append(4)
            out.extend(struct.pack("<q", k))
            out.append(0)

    def enc(x):
        t = type(x)
        if x is None:
            out.append(0)
        elif t is bool:
            out.extend([1, int(x)])
        elif t is int and -(2**63) <= x < 2**63:
            out.append(3)
            out.extend(struct.pack("<q", x))
        elif t is int:
            b = x.to_bytes((x.bit_length() + 8) // 8, "big", signed=True)[-40:]
            out.extend([4, 0, len(b) - 1])
            out.extend(b)
        elif t is float:
            out.extend([5, 0])
            out.extend(struct.pack("<d", x))
        elif t is str:
            out.append(6)
            text(x, 32)
        elif t is bytes:
            out.append(7)
            out.append(min(len(x), 64))
            out.extend(x[:64])
        elif t in (dict, OrderedDict):
            items = list(x.items())[:5]
            out.extend([8 if t is dict else 9, len(items)])
            for k, y in items:
                key(k)
                enc(y)
        elif t in (list, tuple):
            items = list(x)[:5]
            out.extend([10 if t is list else 11, len(items)])
            for y in items:
                enc(y)
        elif t is np.ndarray and x.dtype in NP_DTYPES and not x.dtype.hasobject and x.ndim <= 3:
            a = x.reshape(-1)[:125]
            shape = (len(a),) if x.ndim else ()
            shape = tuple(min(s, 5) for s in shape)
            a = a[:int(np.prod(shape)) if shape else 1]
            out.extend([12, NP_DTYPES.index(x.dtype), len(shape), *shape])
            out.extend(np.ascontiguousarray(a).tobytes())
        elif isinstance(x, torch.Tensor) and not x.is_quantized and x.device.type == "cpu" and x.layout == torch.strided:
            name = str(x.dtype).removeprefix("torch.")
            flat = x.detach().contiguous().reshape(-1)[:5]
            shape = (flat.numel(),) if x.dim() else ()
            out.extend([14, TORCH_NAMES.index(name), len(shape), *shape, 0])
            out.extend(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"\0")
        else:
            out.append(0)

    enc(v)
    return bytes(out)


# ---------------------------------------------------------------------------- target
_STATE: dict = {"runs": 0}


def _store():
    if "store" not in _STATE or _STATE["runs"] % RECYCLE_EVERY == 0:
        if "store" in _STATE:
            _common.drop_memory_store(_STATE["store"])
        _STATE["store"] = tsck.open_store(f"memory://tsck-fuzz-enc-{uuid.uuid4().hex}",
                                          block_size=4096, inline_threshold=64)
    _STATE["runs"] += 1
    return _STATE["store"]


def TestOneInput(data: bytes) -> None:
    store = _store()
    b = Builder(bytes(data))
    tree, pickle_ok, ref_i = b.build()
    ref = ["fz/main", "fz/dev", "other/x", "fz/a.b-c_d"][ref_i]
    with _common.deadline(DEADLINE, "state encoder input"):
        try:
            with warnings.catch_warnings():  # every input is put at step 1 on purpose
                warnings.simplefilter("ignore", StepReusedWarning)
                store.put_snapshot(tree, ref=ref, step=1)
            needs_pickle = False
        except (UnsupportedType, InvalidName):
            if not pickle_ok:
                return
            needs_pickle = True
        except TsckError as e:
            raise ContractViolation(f"put_snapshot raised {type(e).__name__}: {e}") from None
        if needs_pickle:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", StepReusedWarning)
                    store.put_snapshot(tree, ref=ref, step=2, allow_pickle=True)
            except (UnsupportedType, InvalidName):
                return
            except TsckError as e:
                raise ContractViolation(f"put_snapshot(allow_pickle=True) raised {type(e).__name__}: {e}") from None
            try:
                store.checkout(ref)
            except UnsupportedType:
                pass
            except TsckError as e:
                raise ContractViolation(f"checkout of a snapshot just taken raised {type(e).__name__}: {e}") \
                    from None
            else:
                raise ContractViolation("checkout without allow_pickle returned a snapshot that holds a pickle")
        try:
            got = store.checkout(ref, allow_pickle=needs_pickle)
        except TsckError as e:
            raise ContractViolation(f"checkout of a snapshot just taken raised {type(e).__name__}: {e}") from None
        _common.same(expected(tree), got)


if __name__ == "__main__":
    _common.atheris_main(TestOneInput, ["-max_len=16384"])
