"""Deterministic states of the golden stores (tests/data/golden/).

Imported by make_golden.py (which writes them) and tests/format/test_golden.py (which
rebuilds them and compares every checkout bit for bit). Pure torch/numpy and
the standard library; no tensorstore_ck import except `Sharded`/`Replicated`
leaves, passed in by the caller. Every byte comes from SHAKE-256 of a seed
string, never from torch's or numpy's RNG, so the states stay the same under
any later torch/numpy.

Never change what an existing builder returns: the committed stores hold
exactly these states. Add new builders (and a new golden folder) instead.
"""
from __future__ import annotations

import collections
import hashlib
import math
import struct

import numpy as np
import torch

__all__ = ["BUILDERS", "build", "rbytes", "rtensor", "rarray", "checkout_form", "DCP_BUILDERS",
           "DIST_SHARDED", "dist_global", "dist_rows"]


# ---------------------------------------------------------------- deterministic bytes
def rbytes(seed: str, n: int) -> bytes:
    return hashlib.shake_256(seed.encode()).digest(n) if n else b""


def rtensor(seed: str, dtype: torch.dtype, shape) -> torch.Tensor:
    """A dense CPU tensor of `dtype` whose bytes are SHAKE-256(seed) (NaN payloads and all)."""
    shape = tuple(shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = math.prod(shape) * itemsize
    raw = torch.tensor(list(rbytes(seed, n)), dtype=torch.uint8)
    if dtype == torch.bool:
        raw = raw & 1  # canonical bools only
    return raw.view(dtype).reshape(shape)


def rarray(seed: str, dtype, shape) -> np.ndarray:
    dt = np.dtype(dtype)
    n = math.prod(shape) * dt.itemsize
    raw = np.frombuffer(rbytes(seed, n), dtype=np.uint8).copy()
    if dt == np.bool_:
        raw &= 1
    return raw.view(dt).reshape(shape)


def _f64(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", bits))[0]


def _quant_values(seed: str, shape, lo: int, hi: int) -> torch.Tensor:
    """Integers in [lo, hi] as float32 (exact): the int_repr of a quantized tensor."""
    raw = rtensor(seed, torch.int32, shape).to(torch.int64)
    return (raw % (hi - lo + 1) + lo).to(torch.float32)


# Every dense torch dtype put_snapshot stores (the quantized ones are below).
TORCH_DTYPE_NAMES = [
    "float32", "float16", "float64", "bfloat16",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "complex32", "complex64", "complex128",
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2",
]


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name)
    assert isinstance(dt, torch.dtype), name
    return dt


# ---------------------------------------------------------------- the zoo: every supported value
def zoo(sharded_cls, replicated_cls) -> dict:
    """Every type put_snapshot supports without pickle, inline and in blocks."""
    tensors = {name: rtensor(f"dt-{name}", _dtype(name), (3, 5)) for name in TORCH_DTYPE_NAMES}
    base = rtensor("noncontig", torch.float64, (20, 30))
    x = _quant_values("q", (30, 70), 0, 255)
    xi = _quant_values("qi", (10, 70), -120, 120)
    x32 = _quant_values("q32", (10, 70), -30000, 30000)
    pc_scales = torch.tensor([2.0 ** -(i % 5) for i in range(70)], dtype=torch.float64)
    pc_zps = torch.tensor([i % 7 for i in range(70)], dtype=torch.int64)
    quant = {
        # scales are powers of two and values integers: quantization is exact
        "pt_quint8": torch.quantize_per_tensor((x - 3) * 0.125, 0.125, 3, torch.quint8),
        "pt_qint8": torch.quantize_per_tensor((xi + 2) * 0.5, 0.5, -2, torch.qint8),
        "pt_qint32": torch.quantize_per_tensor(x32 * 0.25, 0.25, 0, torch.qint32),
        "pc_quint8": torch.quantize_per_channel((x - pc_zps.to(torch.float32)) * pc_scales.to(torch.float32),
                                                pc_scales, pc_zps, 1, torch.quint8),
        "pc_qint8_small": torch.quantize_per_channel(xi[:2, :3] * 0.5, torch.tensor([0.5, 0.5, 0.5],
                                                     dtype=torch.float64), torch.zeros(3, dtype=torch.int64),
                                                     1, torch.qint8),
    }
    structured = np.zeros(5, dtype=[("a", "<i4"), ("b", "<f8"), ("c", "S3"), ("d", "<f4", (2,))])
    structured["a"] = [1, -2, 3, 2**31 - 1, -(2**31)]
    structured["b"] = [-0.0, np.nan, np.inf, 1.5, -np.inf]
    structured["c"] = [b"x", b"yz", b"", b"abc", b"\x00\x01"]
    structured["d"] = [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]
    nan_payload = np.frombuffer(bytes.fromhex("0100000000f8ff7f"), dtype="<f8")[0]
    return {
        "dtypes": tensors,
        "tensors": {
            "zero_d": rtensor("zero_d", torch.float32, ()),
            "zero_d_i64": torch.tensor(-(2**63), dtype=torch.int64),
            "empty": torch.empty(0, dtype=torch.float32),
            "empty_2d": torch.empty(3, 0, dtype=torch.int16),
            "multi_block_f32": rtensor("mb-f32", torch.float32, (40, 64)),  # 10 KiB: 3 blocks
            "multi_block_bf16": rtensor("mb-bf16", torch.bfloat16, (50, 100)),  # 3 blocks of 20 rows
            "wide_row": rtensor("wide", torch.float16, (2, 3000)),  # a row > a block: element boundaries
            "noncontig_view": base.t(),  # not contiguous; 2 blocks
            "strided_slice": base[::3, 1::4],
            "param": torch.nn.Parameter(rtensor("param", torch.float32, (24, 64))),  # requires_grad
            "param_frozen": torch.nn.Parameter(rtensor("param-frozen", torch.bfloat16, (4, 8)),
                                               requires_grad=False),
            "requires_grad": rtensor("rg", torch.float32, (5,)).requires_grad_(True),
            "complex_blocks": rtensor("cplx", torch.complex128, (300,)),  # 4800 B: 2 blocks
            "bool_blocks": rtensor("boolb", torch.bool, (5000,)),
            "zeros": torch.zeros(64, 64),  # compressible: lz4 codec
            "quantized": quant,
        },
        "numpy": {
            "fortran": np.asfortranarray(rarray("fortran", "<f8", (30, 40))),  # 3 blocks
            "fortran_small": np.asfortranarray(rarray("fortran-s", "<i2", (3, 4))),
            "structured": structured,
            "big_endian": rarray("be", ">f4", (7,)),
            "unicode": np.array(["", "abc", "ü✓😀xy", "hello"], dtype="<U5"),
            "bytes": np.array([b"", b"\x00a", b"abcd"], dtype="S4"),
            "datetime": np.array([0, 1, -5, 2**40], dtype="M8[ms]"),
            "timedelta": np.array([7, -3], dtype="m8[us]"),
            "float16": rarray("np-f16", "<f2", (9,)),
            "bool": rarray("np-bool", "?", (11,)),
            "zero_d": np.array(2.5, dtype="<f8"),
            "empty": np.zeros((0, 4), dtype="<u4"),
            "blocks_u8": rarray("np-u8", "u1", (80, 100)),  # 8000 B: 2 blocks
        },
        "np_scalars": {
            "f32": np.float32(1.5), "f16": np.float16(-0.0), "f64_nan_payload": nan_payload,
            "i8": np.int8(-128), "i64": np.int64(-(2**63)), "u64": np.uint64(2**64 - 1),
            "bool": np.bool_(True), "c64": np.complex64(1 - 2j), "c128": np.complex128(complex(-0.0, np.inf)),
            "str": np.str_("ünï😀"), "bytes": np.bytes_(b"a\x00b"),
            "datetime": np.datetime64("2024-02-29T12:00", "m"), "timedelta": np.timedelta64(5, "s"),
        },
        "python": {
            "ints": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 2**200, -(2**100) + 7],
            "floats": [0.0, -0.0, float("nan"), float("inf"), float("-inf"), 5e-324, 1.7976931348623157e308,
                       _f64(0x7FF0000000000001), _f64(0xFFF8000000000123)],
            "str": ["", "plain", "ünïcödé ✓ 😀", "a\x00b"],
            "bytes": [b"", b"\x00\xff" * 3, bytes(range(256))],
            "none": None, "true": True, "false": False,
        },
        "containers": {
            "int_keys": {0: "zero", -1: "minus one", 2**70: "big", 7: [1, 2]},
            "ordered": collections.OrderedDict([("z", 1), (3, "three"), ("a", (1, "x")), (-(2**80), None)]),
            "nested": {"list": [1, [2, (3, {"four": [5.0, (6,)]})]], "tuple": ((), [], {}, (None,))},
            "empties": {"dict": {}, "list": [], "tuple": (), "ordered": collections.OrderedDict()},
            "tuple_vs_list": ([1, 2], (1, 2)),
            "unsorted": {"b": 1, "a": 2, "c": 3},
            # > 4 KiB encoded: a manifest node of its own
            "big": {f"tok_{i:04d}": (i * 7919) % 10007 for i in range(600)},
            "big_list": [rtensor(f"small-{i}", torch.int16, (3,)) for i in range(300)],
        },
        "sharded": sharded_cls(rtensor("shard", torch.float32, (16, 64)), (48, 64), (16, 0)),
        "replicated": replicated_cls(rtensor("repl", torch.float32, (4, 4))),
    }


# ---------------------------------------------------------------- training-like states (dedup)
def train(step: int) -> dict:
    """A job's state at `step`: a frozen layer (same every step), an embedding
    with one new row per step, a head and moments that change every step."""
    emb = rtensor("emb", torch.float32, (64, 32)).clone()
    row = (step // 100) % 64
    emb[row] = rtensor(f"emb-row-{step}", torch.float32, (32,))
    return {
        "model": {
            "frozen.weight": rtensor("frozen", torch.float32, (64, 64)),  # 4 blocks, shared by all
            "embed.weight": emb,  # 2 blocks: one changes per step
            "head.weight": rtensor(f"head-{step}", torch.bfloat16, (32, 64)),
            "head.bias": rtensor(f"head-bias-{step}", torch.float32, (32,)),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(float(step)),
                          "exp_avg": rtensor(f"m-{step}", torch.float32, (32, 64)),
                          "exp_avg_sq": torch.zeros(32, 64)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0, "params": [0]}],
        },
        "rng": rtensor(f"rng-{step}", torch.uint8, (5056,)),
        "step": step,
        "loader": {"epoch": step // 150, "position": step * 32},
    }


def finetune(step: int) -> dict:
    """Another job sharing train()'s frozen layer (dedup across jobs)."""
    return {
        "base": {"frozen.weight": rtensor("frozen", torch.float32, (64, 64))},
        "lora": {"A": rtensor(f"lora-A-{step}", torch.float32, (16, 64)),
                 "B": rtensor(f"lora-B-{step}", torch.float32, (8, 4)),
                 # smooth values: compressible after a byte shuffle (codec 2 in a shuffle store)
                 "table": torch.arange(1024, dtype=torch.float32) + step},
        "step": step,
    }


def empty(step=None) -> dict:
    return {}


# ---------------------------------------------------------------- DCP (torch.distributed.checkpoint)
def dcp_state(step: int) -> dict:
    """What dcp.save wrote: nested dicts of tensors and a few plain values
    (DCP stores plain values as its own torch.save bytes)."""
    return {
        "model": {
            "w": rtensor(f"dcp-w-{step}", torch.float32, (40, 64)),
            "b": rtensor(f"dcp-b-{step}", torch.float32, (64,)),
            "emb": rtensor(f"dcp-emb-{step}", torch.bfloat16, (30, 100)),
            "mask": rtensor(f"dcp-mask-{step}", torch.bool, (77,)),
            "scalar": torch.tensor(3.25, dtype=torch.float64),
        },
        "optim": {"state": {"w": {"exp_avg": rtensor(f"dcp-m-{step}", torch.float32, (40, 64)),
                                  "step": torch.tensor(float(step))}}},
        "extra": {"step": step, "name": f"dcp-{step}", "lrs": [0.1, 0.01]},
    }


def dcp_blank(sd):
    """The same structure with zeroed tensors and other plain values: a dcp.load target."""
    if isinstance(sd, torch.Tensor):
        return torch.zeros_like(sd)
    if isinstance(sd, dict):
        return {k: dcp_blank(v) for k, v in sd.items()}
    if isinstance(sd, list):
        return [dcp_blank(v) for v in sd]
    if isinstance(sd, str):
        return sd + "?"
    if isinstance(sd, (int, float)):
        return sd + 1
    return sd


# ---------------------------------------------------------------- collective (multi-rank "W") snapshots
# path -> (rows, cols, dtype name): row-sharded tensors. "w": 256-byte rows, 16 per block;
# "emb": 37 rows, split unevenly; "proj": a 6000-byte row is wider than a block (element
# boundaries); "tiny": every rank's chunk is inline; "exp_avg" changes every step.
DIST_SHARDED = {
    ("model", "w"): (40, 64, "float32"),
    ("model", "emb"): (37, 100, "bfloat16"),
    ("model", "proj"): (2, 3000, "float16"),
    ("model", "tiny"): (3, 4, "int64"),
    ("optim", "w", "exp_avg"): (40, 64, "float32"),
}


def dist_global(path: tuple, step: int) -> torch.Tensor:
    """The whole tensor at `path` whose rows the ranks share out."""
    rows, cols, dt = DIST_SHARDED[path]
    seed = "dist-" + "/".join(path) + (f"-{step}" if path[0] == "optim" else "")
    return rtensor(seed, _dtype(dt), (rows, cols))


def dist_rows(n: int, world: int, r: int) -> tuple:
    """Rows [a, b) of rank r (torch.tensor_split's split)."""
    q, m = divmod(n, world)
    a = r * q + min(r, m)
    return a, a + q + (1 if r < m else 0)


def _dist_local(rank: int, step: int) -> dict:
    return {"rank": rank, "name": f"rank-{rank}", "big": 2**70 + rank,
            "rng": rtensor(f"dist-rng-{rank}-{step}", torch.uint8, (5000,))}


def dist_rank(rank: int, world: int, step: int, *, sharded_cls, replicated_cls) -> dict:
    """What rank `rank` of `world` passes to a collective put_snapshot at `step`."""
    st: dict = {"model": {}, "optim": {"w": {}}}
    for path, (rows, cols, _dt) in DIST_SHARDED.items():
        a, b = dist_rows(rows, world, rank)
        d = st
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = sharded_cls(dist_global(path, step)[a:b].clone(), (rows, cols), (a, 0))
    st["model"]["norm"] = replicated_cls(rtensor("dist-norm", torch.float32, (20, 64)))  # written once
    st["local"] = _dist_local(rank, step)
    st["step"] = step
    return st


def dist_view(world: int, step: int) -> dict:
    """What a plain (non-collective) checkout of that snapshot returns: every sharded and
    replicated tensor whole, every other value as rank 0 wrote it."""
    st: dict = {"model": {}, "optim": {"w": {}}}
    for path in DIST_SHARDED:
        d = st
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = dist_global(path, step)
    st["model"]["norm"] = rtensor("dist-norm", torch.float32, (20, 64))
    st["local"] = _dist_local(0, step)
    st["step"] = step
    return st


BUILDERS = {"zoo": zoo, "train": train, "finetune": finetune, "empty": empty, "dist_view": dist_view}
DCP_BUILDERS = {"dcp_state": dcp_state}


def build(name: str, args: dict, *, sharded_cls=None, replicated_cls=None):
    if name == "zoo":
        return zoo(sharded_cls, replicated_cls)
    if name == "dist_rank":
        return dist_rank(**args, sharded_cls=sharded_cls, replicated_cls=replicated_cls)
    if name in DCP_BUILDERS:
        return DCP_BUILDERS[name](**args)
    return BUILDERS[name](**args)


def checkout_form(state, replicated_cls):
    """What a plain checkout returns for `state`: a Replicated leaf comes back as its tensor."""
    if isinstance(state, replicated_cls):
        return state.tensor
    if type(state) in (dict, collections.OrderedDict):
        return type(state)((k, checkout_form(v, replicated_cls)) for k, v in state.items())
    if type(state) in (list, tuple):
        return type(state)(checkout_form(v, replicated_cls) for v in state)
    return state
