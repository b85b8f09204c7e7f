"""Exact round trip of every value type in docs/FORMAT.md's manifest node table.

Every test puts a state, checks it out again and compares with `assert_same`:
same Python types (tuple stays tuple, Parameter stays Parameter, numpy scalar
stays that numpy scalar type), same dict key order, same dtypes and shapes, and
bitwise-equal data (NaN payloads, -0.0, random bit patterns).
"""
from __future__ import annotations

import math
import struct
import uuid
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tensorstore_ck as tsck

from _util import all_torch_dtypes, assert_same, rand_tensor, tensor_bytes

BLOCK = 64 * 1024
SMALL_INLINE = 256


# ---------------------------------------------------------------- fixtures
# small_store, plain_store and hyp_store run on every backend (file, s3, pg: see
# tests/_backends.py); the memory:// fixtures are the separate in-memory backend.
@pytest.fixture
def small_store(backend):
    """Store with small blocks and a small inline threshold (forces multi-block)."""
    s = backend.open(block_size=BLOCK, inline_threshold=SMALL_INLINE)
    yield s
    s.close()


@pytest.fixture
def plain_store(backend):
    s = backend.open()
    yield s
    s.close()


# The dtype-parametrised tests (80-odd per backend) share one store per backend and
# module: a fresh store per case costs several server round trips on s3/pg.
@pytest.fixture(scope="module")
def shared_small_store(module_backend, tmp_path_factory):
    b = module_backend.sibling(tmp_path_factory.mktemp("small"), "small")
    s = b.open(block_size=BLOCK, inline_threshold=SMALL_INLINE)
    yield s
    s.close()
    b.remove()  # a sibling: the backend fixture only removes its own location


@pytest.fixture(scope="module")
def shared_plain_store(module_backend, tmp_path_factory):
    b = module_backend.sibling(tmp_path_factory.mktemp("plain"), "plain")
    s = b.open()
    yield s
    s.close()
    b.remove()  # a sibling: the backend fixture only removes its own location


@pytest.fixture
def mem_store():
    s = tsck.open_store(f"memory://tsck-test-{uuid.uuid4().hex}")
    yield s
    s.close()


@pytest.fixture(scope="module")
def hyp_store(module_backend):
    """One store per backend shared by the hypothesis tests (many puts, one location)."""
    s = module_backend.open(block_size=BLOCK, inline_threshold=128)
    yield s
    s.close()


@pytest.fixture(scope="module")
def hyp_mem_store():
    s = tsck.open_store(f"memory://tsck-hyp-{uuid.uuid4().hex}")
    yield s
    s.close()


def roundtrip(store, state, ref="rt/main", **kw):
    info = store.put_snapshot(state, ref=ref, **kw)
    assert isinstance(info.root, str) and len(info.root) == 64
    int(info.root, 16)
    out = store.checkout(ref)
    assert_same(state, out)
    return info, out


# ---------------------------------------------------------------- strategies
NP_DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
             "uint64", "float16", "float32", "float64", "complex64", "complex128",
             ">i4", ">f8", "datetime64[ns]", "timedelta64[s]"]
TORCH_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.uint16, torch.uint32, torch.uint64, torch.float16, torch.bfloat16,
                torch.float32, torch.float64, torch.complex32, torch.complex64,
                torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2]

shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def np_arrays(draw):
    dt = np.dtype(draw(st.sampled_from(NP_DTYPES)))
    shape = draw(shapes)
    raw = draw(st.binary(min_size=math.prod(shape) * dt.itemsize,
                         max_size=math.prod(shape) * dt.itemsize))
    arr = np.frombuffer(raw, dtype=np.uint8).copy()
    if dt == np.bool_:
        arr %= 2
    arr = arr.view(dt).reshape(shape)
    if draw(st.booleans()) and arr.ndim >= 2:
        arr = arr.T  # non-contiguous
    return arr


@st.composite
def np_scalars(draw):
    dt = np.dtype(draw(st.sampled_from(NP_DTYPES)))
    raw = bytearray(draw(st.binary(min_size=dt.itemsize, max_size=dt.itemsize)))
    if dt == np.bool_:
        raw[0] %= 2
    return np.frombuffer(bytes(raw), dtype=dt).reshape(())[()]


@st.composite
def torch_tensors(draw):
    dt = draw(st.sampled_from(TORCH_DTYPES))
    shape = draw(shapes)
    itemsize = torch.empty(0, dtype=dt).element_size()
    n = math.prod(shape) * itemsize
    raw = draw(st.binary(min_size=n, max_size=n))
    u8 = torch.tensor(list(raw), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    if dt == torch.bool:
        u8 = u8 % 2
    t = u8.view(dt).reshape(shape)
    if draw(st.booleans()) and t.dim() >= 2:
        t = t.transpose(0, 1)
    if draw(st.integers(0, 9)) == 0 and dt.is_floating_point:
        t = torch.nn.Parameter(t.clone(), requires_grad=draw(st.booleans()))
    return t


@st.composite
def big_tensors(draw):
    """Tensors large enough to span several 64 KiB blocks (kept rare: cost)."""
    dt = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.complex128]))
    seed = draw(st.integers(0, 2**31))
    itemsize = torch.empty(0, dtype=dt).element_size()
    cols = draw(st.sampled_from([1, 37, 1000]))
    rows = (3 * BLOCK) // (cols * itemsize) + draw(st.integers(0, 5))
    return rand_tensor(dt, (rows, cols), seed=seed)


def _f64(b):
    return struct.unpack("<d", b)[0]


floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.binary(min_size=8, max_size=8).map(_f64),  # arbitrary bit patterns, NaN payloads
    st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 5e-324, -5e-324]),
)
ints = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**300), max_value=2**300),
    st.sampled_from([0, -1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64,
                     -(2**64), 2**128 + 7, -(2**1000)]),
)
leaves = st.one_of(
    st.none(), st.booleans(), ints, floats,
    st.text(max_size=20), st.binary(max_size=40),
    np_arrays(), np_scalars(), torch_tensors(),
)
keys = st.one_of(st.text(max_size=8), st.integers(min_value=-(2**63), max_value=2**63 - 1))
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(keys, children, max_size=5),
    ),
    max_leaves=25,
)

HYP = settings(max_examples=75, deadline=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture,
                                      HealthCheck.too_slow, HealthCheck.data_too_large])


def hyp_for(backend, file_examples: int, remote_examples: int) -> settings:
    """HYP with fewer examples on s3/pg, where each put costs server round trips."""
    return settings(HYP, max_examples=file_examples if backend.kind == "file" else remote_examples)


# ---------------------------------------------------------------- hypothesis round trips
def test_hypothesis_tree_roundtrip(module_backend, hyp_store):
    @hyp_for(module_backend, 75, 25)
    @given(state=trees)
    def check(state):
        roundtrip(hyp_store, state, ref="hyp/tree")

    check()


@settings(HYP, max_examples=50)
@given(state=trees)
def test_hypothesis_tree_roundtrip_memory(hyp_mem_store, state):
    roundtrip(hyp_mem_store, state, ref="hyp/mem")


def test_hypothesis_tree_with_big_tensors(module_backend, hyp_store):
    @hyp_for(module_backend, 15, 6)
    @given(state=st.dictionaries(keys, st.one_of(big_tensors(), trees), min_size=1, max_size=3))
    def check(state):
        roundtrip(hyp_store, state, ref="hyp/big")

    check()


@settings(HYP, max_examples=100)
@given(key_list=st.lists(keys, unique=True, max_size=12))
def test_dict_key_order_kept(hyp_mem_store, key_list):
    state = {k: i for i, k in enumerate(key_list)}
    out = roundtrip(hyp_mem_store, state, ref="hyp/keys")[1]
    assert [(type(k), k) for k in out] == [(type(k), k) for k in key_list]


# ---------------------------------------------------------------- python values
def test_python_scalars_exact(plain_store):
    nan_payloads = [_f64(struct.pack("<Q", q)) for q in
                    (0x7FF0000000000001, 0x7FF8000000000000, 0xFFF8000000000000,
                     0x7FF8DEADBEEF0001, 0xFFF0000000000123)]
    state = {
        "none": None, "t": True, "f": False,
        "ints": [0, 1, -1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64 - 1, 2**64,
                 2**200 + 12345, -(2**200) - 12345, 10**80],
        "floats": [0.0, -0.0, 1.5, -2.25, math.inf, -math.inf, math.nan, 5e-324,
                   1.7976931348623157e308] + nan_payloads,
        "str": ["", "ascii", "ünïcødé ✓ 😀", "nul\x00inside", "x" * 10_000],
        "bytes": [b"", b"\x00\xff" * 3, bytes(range(256)), b"b" * 70_000],
        "tuple": (1, (2, (3, ())), [], {}),
        "empty": [{}, [], ()],
        "nested_tuple_of_lists": ([1], [2, (3,)]),
        "bool_vs_int": [True, 1, False, 0],
    }
    roundtrip(plain_store, state)


def test_dict_mixed_keys_order(plain_store):
    state = {"b": 1, 2: "two", "a": 3, 1: "one", "1": "str-one", -5: None, 0: 0,
             "": "empty", 2**62: "big", -(2**63): "min"}
    out = roundtrip(plain_store, state)[1]
    assert list(out.keys()) == list(state.keys())
    assert out[1] == "one" and out["1"] == "str-one"


@pytest.mark.parametrize("top", [
    None, 7, -(2**100), 1.5, "s", b"b", [1, 2], (1, "x"), (), [],
    "tensor", "array",
], ids=lambda v: type(v).__name__ if not isinstance(v, str) else v)
def test_top_level_values(mem_store, top):
    if top == "tensor":
        top = torch.arange(10, dtype=torch.float32)
    elif top == "array":
        top = np.arange(10, dtype=np.int16)
    roundtrip(mem_store, top)


def _nest(depth, kind):
    v = 1
    for _ in range(depth):
        v = [v] if kind == "list" else ({"k": v} if kind == "dict" else (v,))
    return {"top": v}


@pytest.mark.parametrize("kind", ["list", "dict", "tuple"])
def test_nesting_at_writer_limit_reads_back(mem_store, kind):
    """Whatever depth put_snapshot accepts must check out again (no write-ok/read-fail)."""
    lo, hi = 1, 5000  # find the deepest nesting the writer accepts
    assert mem_store.put_snapshot(_nest(lo, kind), ref="deep/probe")
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            mem_store.put_snapshot(_nest(mid, kind), ref="deep/probe")
            lo = mid
        except tsck.UnsupportedType:
            hi = mid - 1
    for depth in sorted({lo, lo - 1, lo - 2, max(1, lo // 2)}):
        roundtrip(mem_store, _nest(depth, kind), ref=f"deep/{kind}{depth}")


def test_deep_nesting(plain_store):
    state = "leaf"
    for i in range(20):
        state = [state] if i % 3 == 0 else ((state,) if i % 3 == 1 else {"k": state, i: i})
    roundtrip(plain_store, state)


# ---------------------------------------------------------------- torch dtypes
def _torch_dtype_ids(d):
    return str(d).replace("torch.", "")


def _check_quantized(store, dtype):
    """qint8/quint8/qint32 round-trip (per-tensor and per-channel affine): same int_repr
    and parameters. The packed sub-byte quint4x2/quint2x4 are refused with UnsupportedType."""
    x = torch.randn(300, 70, generator=torch.Generator().manual_seed(5)) * 4
    zp = 0 if dtype == torch.qint32 else 3
    if dtype in (torch.quint4x2, torch.quint2x4):
        q = torch.quantize_per_tensor(x, 0.25, zp, dtype)
        with pytest.raises(tsck.UnsupportedType) as ei:
            store.put_snapshot({"q": [q]}, ref="quant/refused")
        assert ei.value.path == "['q'][0]"
        return
    state = {
        "pt": torch.quantize_per_tensor(x, 0.125, zp, dtype),
        "pc": torch.quantize_per_channel(x, torch.rand(70, dtype=torch.float64) + 0.05,
                                         torch.full((70,), zp, dtype=torch.long), 1, dtype),
        "small": torch.quantize_per_tensor(x[:2, :3], 0.5, zp, dtype),
    }
    store.put_snapshot(state, ref="quant/ok")
    out = store.checkout("quant/ok")
    for k, q in state.items():
        o = out[k]
        assert o.dtype == dtype and o.qscheme() == q.qscheme() and o.shape == q.shape
        assert torch.equal(o.int_repr(), q.int_repr())
        if q.qscheme() == torch.per_tensor_affine:
            assert (o.q_scale(), o.q_zero_point()) == (q.q_scale(), q.q_zero_point())
        else:
            assert torch.equal(o.q_per_channel_scales(), q.q_per_channel_scales())
            assert torch.equal(o.q_per_channel_zero_points(), q.q_per_channel_zero_points())
            assert o.q_per_channel_axis() == q.q_per_channel_axis()


@pytest.mark.parametrize("dtype", all_torch_dtypes(), ids=_torch_dtype_ids)
def test_every_torch_dtype(shared_small_store, dtype):
    small_store = shared_small_store
    probe = torch.empty(1, dtype=dtype)
    if probe.is_quantized:
        _check_quantized(small_store, dtype)
        return
    try:
        rand_tensor(dtype, (4,)).clone()
        can_copy = True
    except RuntimeError:
        # int1..int7 / uint1..uint7: creatable (view of uint8) but torch has no copy kernel
        can_copy = False
    itemsize = probe.element_size()
    cols = 37
    rows = (3 * BLOCK) // (cols * itemsize) + 3  # > 3 blocks, rows not block aligned
    state = {
        "scalar": rand_tensor(dtype, (), seed=1),
        "empty1": rand_tensor(dtype, (0,), seed=2),
        "empty3": rand_tensor(dtype, (3, 0, 2), seed=3),
        "small": rand_tensor(dtype, (7,), seed=4),
        "mid": rand_tensor(dtype, (5, 13), seed=5),
        "big": rand_tensor(dtype, (rows, cols), seed=6),
    }
    if can_copy:
        state["transposed"] = rand_tensor(dtype, (6, 9), seed=7).t()
        state["stepped"] = rand_tensor(dtype, (40,), seed=8)[1::3]
    info = small_store.put_snapshot(state, ref="dt/main")
    assert info.blocks_total >= 3, info
    assert info.bytes_total >= rows * cols * itemsize, info
    out = small_store.checkout("dt/main")
    assert_same(state, out)
    for k, t in out.items():
        assert t.device.type == "cpu" and t.is_contiguous(), k


def test_float_bit_patterns_exact(small_store):
    def bits(vals, np_uint, tdtype):
        return torch.from_numpy(np.array(vals, dtype=np_uint).copy()).view(tdtype)

    f32 = bits([0x7F800001, 0x7FC00000, 0xFFC00000, 0x7FBFFFFF, 0xFF812345, 0x80000000,
                0x00000000, 0x7F800000, 0xFF800000, 0x00000001], np.uint32, torch.float32)
    f64 = bits([0x7FF0000000000001, 0x7FF8000000000000, 0xFFF8000000000000,
                0x7FF4000000000BAD, 0x8000000000000000, 1], np.uint64, torch.float64)
    f16 = bits([0x7C01, 0x7E00, 0xFE00, 0x8000, 0x7D55], np.uint16, torch.float16)
    bf16 = bits([0x7F81, 0x7FC0, 0xFFC1, 0x8000], np.uint16, torch.bfloat16)
    c64 = torch.complex(torch.tensor([-0.0, math.nan]), torch.tensor([math.inf, -0.0]))
    big_nan = rand_tensor(torch.float32, (70_000,), seed=11)  # multi-block, random payloads
    nan_arr = np.array([0x7FF0000000000001, 0xFFF8000000000001, 0x8000000000000000],
                       dtype=np.uint64).view(np.float64)
    state = {"f32": f32, "f64": f64, "f16": f16, "bf16": bf16, "c64": c64,
             "big": big_nan, "np": nan_arr, "np_f32_scalar": nan_arr.astype(np.float32)[0],
             "py": [-0.0, _f64(struct.pack("<Q", 0x7FF0000000000001))]}
    assert torch.isnan(f32[0])  # sanity: signalling NaN really is in there
    roundtrip(small_store, state)


# ---------------------------------------------------------------- views, params
def test_noncontiguous_views(small_store):
    base = rand_tensor(torch.float32, (64, 48), seed=3)
    big = rand_tensor(torch.float64, (300, 200), seed=4)  # 480 KB
    cplx = rand_tensor(torch.complex64, (5, 6), seed=5)
    state = {
        "t": base.t(),
        "step": base[::3, 1::2],
        "offset": base[5:9, 7:],
        "narrow": base.narrow(1, 3, 10),
        "expand": torch.arange(5, dtype=torch.int32).unsqueeze(1).expand(5, 1000),
        "expand_scalar": torch.tensor(2.5).expand(3, 4),
        "permute": rand_tensor(torch.int16, (3, 4, 5), seed=6).permute(2, 0, 1),
        "big_t": big.t(),
        "big_step": big[::2, ::3],
        "conj": cplx.conj(),
        "diag": base.diagonal(),
        "same_twice": [base[0], base[0]],
    }
    assert not state["t"].is_contiguous() and state["expand"].stride(1) == 0
    assert state["conj"].is_conj()
    _, out = roundtrip(small_store, state)
    for k in ("t", "step", "offset", "expand", "big_t", "conj"):
        assert out[k].is_contiguous(), k
    # assert_same resolved the conjugation on both sides: the stored bits are conj(cplx)


def test_parameters(plain_store):
    p1 = torch.nn.Parameter(rand_tensor(torch.float32, (4, 5), seed=1))
    p2 = torch.nn.Parameter(rand_tensor(torch.bfloat16, (3,), seed=2), requires_grad=False)
    p3 = torch.nn.Parameter(rand_tensor(torch.float32, (200, 100), seed=3))  # above inline
    leaf = torch.ones(3, requires_grad=True)
    nonleaf = leaf * 2
    state = {"model": {"w": p1, "frozen": p2, "big": p3}, "plain": leaf, "nonleaf": nonleaf}
    _, out = roundtrip(plain_store, state)
    assert type(out["model"]["w"]) is torch.nn.Parameter and out["model"]["w"].requires_grad
    assert type(out["model"]["frozen"]) is torch.nn.Parameter
    assert out["model"]["frozen"].requires_grad is False
    assert type(out["model"]["big"]) is torch.nn.Parameter and out["model"]["big"].requires_grad
    assert type(out["plain"]) is torch.Tensor and type(out["nonleaf"]) is torch.Tensor


def test_module_state_dict(plain_store):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                            torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m.train()
    m(torch.randn(4, 8)).sum().backward()
    opt.step()
    osd = opt.state_dict()
    # state_dict() is an OrderedDict (a dict subclass): use plain dicts
    state = {"model": dict(m.state_dict()),
             "opt": {"state": {k: dict(v) for k, v in osd["state"].items()},
                     "param_groups": [dict(g) for g in osd["param_groups"]]},
             "step": 1}
    roundtrip(plain_store, state)


# ---------------------------------------------------------------- numpy
@pytest.mark.parametrize("dtype", NP_DTYPES + ["<u2", ">c16", "datetime64[D]", "float16"])
def test_numpy_dtypes(shared_small_store, dtype):
    small_store = shared_small_store
    dt = np.dtype(dtype)
    rng = np.random.default_rng(zlib.crc32(dtype.encode()))

    def rand(shape):
        raw = rng.integers(0, 256, size=math.prod(shape) * dt.itemsize, dtype=np.uint8)
        if dt == np.bool_:
            raw %= 2
        return raw.view(dt).reshape(shape)

    big_rows = (3 * BLOCK) // (33 * dt.itemsize) + 2
    state = {
        "zero_d": rand(()),
        "empty": rand((0,)),
        "empty3": rand((3, 0, 2)),
        "small": rand((7,)),
        "mat": rand((6, 5)),
        "fortran": np.asfortranarray(rand((6, 5))),
        "transposed": rand((4, 9)).T,
        "stepped": rand((50,))[1::4],
        "neg_stride": rand((10,))[::-1],
        "big": rand((big_rows, 33)),
        "big_fortran": np.asfortranarray(rand((big_rows, 33))),
        "readonly": np.frombuffer(rand((12,)).tobytes(), dtype=dt),
    }
    assert state["fortran"].flags.f_contiguous and not state["fortran"].flags.c_contiguous
    info, out = roundtrip(small_store, state)
    assert info.blocks_total >= 6, info
    for k, v in out.items():
        assert type(v) is np.ndarray, k


@pytest.mark.parametrize("dtype", [
    "longdouble", "U5", "S4", "V6", [("a", "<i4"), ("b", "<f8"), ("c", "S3")],
    ">f4", "clongdouble", "M8[ms]", "m8[us]",
], ids=str)
def test_numpy_exotic_dtypes(shared_plain_store, dtype):
    plain_store = shared_plain_store
    dt = np.dtype(dtype)
    rng = np.random.default_rng(1)
    if dt.kind == "U":
        arr = np.array(["", "abc", "ü✓😀xy", "hello"], dtype=dt)
    elif dt.kind == "S":
        arr = np.array([b"", b"\x00a", b"abcd"], dtype=dt)
    elif dt.fields:
        arr = np.zeros(4, dtype=dt)
        arr["a"] = [1, -2, 3, 2**31 - 1]
        arr["b"] = [-0.0, np.nan, np.inf, 1.5]
        arr["c"] = [b"x", b"yz", b"", b"abc"]
    elif dt.kind in "fc" and dt.itemsize > 8:  # long double: padding bytes are undefined
        arr = np.array([1.5, -0.0, np.inf, 1 / 3], dtype=dt)
    else:
        arr = rng.integers(0, 256, size=5 * dt.itemsize, dtype=np.uint8).view(dt)
    state = {"a": arr, "two_d": np.stack([arr, arr])[:, ::-1]}
    if dt.kind not in "US":  # np.str_/np.bytes_ scalars are str/bytes subclasses: not asked
        state["scalar"] = arr[1]
    roundtrip(plain_store, state)


def test_numpy_scalars(plain_store):
    scalars = [
        np.float32(1.5), np.float32(-0.0),
        np.frombuffer(struct.pack("<I", 0x7F800001), dtype=np.float32)[0],  # sNaN payload
        np.float64(-0.0),  # float subclass: must stay np.float64
        np.float64(math.nan), np.float16(65504), np.longdouble(1) / 3,
        np.int64(-(2**63)), np.int8(-5), np.uint64(2**64 - 1), np.uint8(255), np.int32(7),
        np.bool_(True), np.bool_(False),
        np.complex64(1 - 2j), np.complex128(complex(-0.0, math.nan)),
        np.datetime64("2021-03-04T05:06:07.123456789", "ns"), np.datetime64("2020-01-01"),
        np.datetime64("NaT"), np.timedelta64(5, "s"), np.timedelta64(-3, "D"),
    ]
    state = {"list": scalars, "alone": np.float32(2.0), "tup": (np.int16(3), np.bool_(False))}
    _, out = roundtrip(plain_store, state)
    assert type(out["list"][3]) is np.float64
    assert type(out["list"][12]) is np.bool_


# ---------------------------------------------------------------- checkout(into=)
def test_checkout_into_inplace(small_store):
    src = {
        "model": {"w": torch.nn.Parameter(rand_tensor(torch.float32, (300, 100), seed=1)),
                  "b": rand_tensor(torch.bfloat16, (10,), seed=2)},
        "opt": [rand_tensor(torch.float64, (5, 5), seed=3), rand_tensor(torch.int64, (), seed=4)],
        "arr": np.arange(20_000, dtype=np.float32),
        "step": 5,
    }
    small_store.put_snapshot(src, ref="into/main", step=5)
    into = {
        "model": {"w": torch.nn.Parameter(torch.zeros(300, 100)),
                  "b": torch.zeros(10, dtype=torch.bfloat16)},
        "opt": [torch.zeros(5, 5, dtype=torch.float64), torch.zeros((), dtype=torch.int64)],
        "arr": np.zeros(20_000, dtype=np.float32),
        "step": 0,
    }
    opt_list, model_dict, arr = into["opt"], into["model"], into["arr"]
    ptrs = {"w": into["model"]["w"].data_ptr(), "b": into["model"]["b"].data_ptr(),
            "o0": into["opt"][0].data_ptr(), "o1": into["opt"][1].data_ptr()}
    w_obj = into["model"]["w"]
    res = small_store.checkout("into/main", into=into)
    assert res is into
    assert into["model"]["w"] is w_obj and type(w_obj) is torch.nn.Parameter
    assert into["model"]["w"].data_ptr() == ptrs["w"]
    assert into["model"]["b"].data_ptr() == ptrs["b"]
    assert into["opt"][0].data_ptr() == ptrs["o0"]
    assert into["opt"][1].data_ptr() == ptrs["o1"]
    assert into["opt"] is opt_list and into["model"] is model_dict  # containers in place
    assert into["arr"] is arr  # numpy arrays updated in place too
    assert_same(src, into)


def test_checkout_into_noncontiguous_target(plain_store):
    src = {"w": rand_tensor(torch.float32, (4, 6), seed=9)}
    plain_store.put_snapshot(src, ref="into/nc")
    backing = torch.zeros(6, 4)
    into = {"w": backing.t()}  # non-contiguous view of `backing`
    plain_store.checkout("into/nc", into=into)
    assert into["w"].data_ptr() == backing.data_ptr()
    assert tensor_bytes(backing.t()) == tensor_bytes(src["w"])


@pytest.mark.parametrize("bad", ["shape", "dtype", "ndim", "list_len", "array_dtype"])
def test_checkout_into_mismatch(shared_plain_store, bad):
    plain_store = shared_plain_store
    plain_store.put_snapshot({"w": torch.ones(4, 5), "n": 1, "l": [torch.ones(2), 3],
                              "a": np.ones(3)}, ref="into/mm")
    into = {"w": torch.zeros(4, 5), "n": 0, "l": [torch.zeros(2), 0], "a": np.zeros(3)}
    if bad == "shape":
        into["w"] = torch.zeros(5, 4)
    elif bad == "dtype":
        into["w"] = torch.zeros(4, 5, dtype=torch.float64)
    elif bad == "ndim":
        into["w"] = torch.zeros(20)
    elif bad == "list_len":
        into["l"] = [torch.zeros(2)]
    elif bad == "array_dtype":
        into["a"] = np.zeros(3, dtype=np.float32)
    with pytest.raises(tsck.CheckoutMismatch) as ei:
        plain_store.checkout("into/mm", into=into)
    assert isinstance(ei.value, tsck.TsckError) and isinstance(ei.value, ValueError)


# ---------------------------------------------------------------- store behaviour
def test_memory_store_roundtrip(mem_store):
    state = {"w": rand_tensor(torch.float32, (500, 300), seed=1), "s": "x", "n": 2**70,
             "a": np.arange(12.0).reshape(3, 4).T, "t": (None, -0.0)}
    info, _ = roundtrip(mem_store, state, ref="m/main", step=3)
    assert mem_store.resolve("m/main") == info.root
    assert_same(state, mem_store.checkout(info.root))


def test_memory_stores_are_separate():
    a = tsck.open_store(f"memory://tsck-a-{uuid.uuid4().hex}")
    b = tsck.open_store(f"memory://tsck-b-{uuid.uuid4().hex}")
    try:
        a.put_snapshot({"x": 1}, ref="only/in_a")
        assert "only/in_a" in a.refs()
        assert "only/in_a" not in b.refs()
    finally:
        a.close()
        b.close()


def test_reopen_store(backend):
    """A closed store opens again (without repeating its settings) with refs and data intact."""
    state = {"w": rand_tensor(torch.float16, (300, 257), seed=2), "meta": ("a", 1, 2.5)}
    with backend.open(block_size=BLOCK, inline_threshold=64) as s:
        info = s.put_snapshot(state, ref="re/main", step=1)
    with backend.open() as s2:
        assert s2.resolve("re/main") == info.root
        assert_same(state, s2.checkout("re/main"))
        assert_same(state, s2.checkout(info.root[:8]))


def test_targets_all_give_same_state(plain_store):
    s1 = {"v": torch.tensor([1.0, 2.0]), "step": 1}
    s2 = {"v": torch.tensor([3.0, -0.0]), "step": 2}
    i1 = plain_store.put_snapshot(s1, ref="tg/main", step=1)
    i2 = plain_store.put_snapshot(s2, ref="tg/main", step=2)
    assert i2.parent == i1.root
    plain_store.tag("tg-first", i1.root)
    assert plain_store.show("tg/main").step == 2 and plain_store.show("tg/main@1").root == i1.root
    assert_same(s2, plain_store.checkout("tg/main"))
    assert_same(s1, plain_store.checkout("tg/main@1"))
    assert_same(s2, plain_store.checkout("tg/main@2"))
    assert_same(s1, plain_store.checkout("tg-first"))
    assert_same(s1, plain_store.checkout(i1.root))
    assert_same(s1, plain_store.checkout(i1.root[:8]))
    assert_same(s2, plain_store.checkout(i2.root[:12]))


def test_snapshot_not_affected_by_later_mutation(plain_store):
    w = torch.zeros(100, 100)
    arr = np.zeros(50)
    lst = [1, 2]
    state = {"w": w, "a": arr, "l": lst}
    expect = {"w": w.clone(), "a": arr.copy(), "l": [1, 2]}
    plain_store.put_snapshot(state, ref="mut/main")
    w += 1
    arr += 1
    lst.append(3)
    assert_same(expect, plain_store.checkout("mut/main"))


def test_inline_and_block_counts(small_store):
    tiny = {"a": torch.arange(8, dtype=torch.int32), "b": np.arange(4.0)}  # far below 256 B
    info = small_store.put_snapshot(tiny, ref="cnt/tiny")
    assert info.blocks_total == 0 and info.blocks_new == 0
    assert_same(tiny, small_store.checkout("cnt/tiny"))
    big = {"x": rand_tensor(torch.float32, (4 * BLOCK // 4 + 1,), seed=5)}  # 4 blocks + 4 bytes
    info = small_store.put_snapshot(big, ref="cnt/big")
    assert info.blocks_total >= 5
    assert info.bytes_total == 4 * BLOCK + 4
    assert_same(big, small_store.checkout("cnt/big"))
    again = small_store.put_snapshot(big, ref="cnt/big2")
    assert again.blocks_new == 0 and again.bytes_new == 0 and again.blocks_total == info.blocks_total


def test_checked_out_data_is_writable_and_private(small_store):
    _check_checkout_private(small_store)


def test_checked_out_data_is_writable_and_private_memory(mem_store):
    _check_checkout_private(mem_store)


def _check_checkout_private(store):
    """Mutating what checkout returned must not change the store (or a later checkout)."""
    state = {"inline": torch.arange(4, dtype=torch.float32),          # below inline threshold
             "big": rand_tensor(torch.int32, (70_000,), seed=21),    # several blocks
             "arr_small": np.arange(3, dtype=np.int64),
             "arr_big": np.arange(50_000, dtype=np.float64)}
    expect = {k: v.clone() if isinstance(v, torch.Tensor) else v.copy() for k, v in state.items()}
    store.put_snapshot(state, ref="priv/main")
    first = store.checkout("priv/main")
    for k in ("inline", "big"):
        first[k].add_(1)  # must not raise nor warn about a non-writable buffer
    for k in ("arr_small", "arr_big"):
        assert first[k].flags.writeable, k
        first[k] += 1
    assert_same(expect, store.checkout("priv/main"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_cuda_tensors(plain_store):
    g = rand_tensor(torch.bfloat16, (300, 70), seed=3).cuda()
    state = {"g": g, "small": torch.arange(5, device="cuda"), "t": g.t(),
             "p": torch.nn.Parameter(g.float())}
    plain_store.put_snapshot(state, ref="cuda/main")
    out = plain_store.checkout("cuda/main")
    expect = {"g": g.cpu(), "small": torch.arange(5), "t": g.t().cpu(),
              "p": torch.nn.Parameter(g.float().cpu())}
    # As torch.load: back on the device each tensor was saved on, bit-exact.
    assert all(v.device == torch.device("cuda", 0) for v in out.values())
    assert_same(expect, _on_cpu(out))
    into = {"g": torch.zeros_like(g), "small": torch.zeros(5, dtype=torch.int64, device="cuda"),
            "t": torch.zeros(70, 300, dtype=torch.bfloat16, device="cuda"),
            "p": torch.nn.Parameter(torch.zeros(300, 70, device="cuda"))}
    ptr = into["g"].data_ptr()
    plain_store.checkout("cuda/main", into=into)
    assert into["g"].data_ptr() == ptr and into["g"].is_cuda
    assert_same(expect, _on_cpu(into))
    assert_same(expect, plain_store.checkout("cuda/main", map_location="cpu"))


def _on_cpu(state):
    return {k: (torch.nn.Parameter(v.detach().cpu()) if isinstance(v, torch.nn.Parameter) else v.cpu())
            for k, v in state.items()}
