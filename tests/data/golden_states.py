"""The states of the golden store (tests/data/golden/v1): deterministic, seeded, pure
torch/numpy, so a later version of the package rebuilds exactly what was written."""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np
import torch

TORCH_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.complex128,
                torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32,
                torch.uint64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2]


def _bytes_tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def model(step: int) -> dict:
    """A small 'training job': frozen embedding (dedups across steps), weights that move."""
    g = torch.Generator().manual_seed(1000)
    emb = torch.randn(64, 96, generator=g)                       # 24 KiB: blocks, shared by every step
    g = torch.Generator().manual_seed(step)
    w = torch.randn(48, 80, generator=g)
    p = torch.nn.Parameter(torch.randn(16, 16, generator=g), requires_grad=True)
    return {"model": {"emb.weight": emb, "fc.weight": w, "fc.param": p, "fc.bias": torch.zeros(80)},
            "optim": {"state": {i: {"exp_avg": w * i, "step": torch.tensor(float(step))} for i in range(3)},
                      "param_groups": [{"lr": 1e-3 / (step + 1), "betas": (0.9, 0.999), "params": [0, 1, 2]}]},
            "step": step, "rng": np.random.default_rng(step).bit_generator.state}


def every_kind() -> dict:
    """Every kind of value a snapshot holds."""
    base = torch.arange(120, dtype=torch.float32).reshape(10, 12)
    q = torch.quantize_per_tensor(torch.linspace(-1, 1, 40), 0.01, 3, torch.qint8)
    qc = torch.quantize_per_channel(torch.linspace(-1, 1, 24).reshape(4, 6), torch.tensor([0.1, 0.2, 0.3, 0.4],
                                    dtype=torch.float64), torch.tensor([0, 1, 2, 3]), 0, torch.quint8)
    structured = np.zeros(5, dtype=[("a", "<i4"), ("b", "<f8"), ("c", "S3")])
    structured["a"] = np.arange(5)
    structured["b"] = np.linspace(0, 1, 5)
    return {
        "dtypes": {str(dt): _bytes_tensor(dt, (7, 9), i) for i, dt in enumerate(TORCH_DTYPES)},
        "big_blocks": _bytes_tensor(torch.float32, (40, 300), 99),  # 47 KiB: several blocks
        "zero_dim": torch.tensor(3.5), "empty": torch.empty(0, 4), "view": base.t()[2:7],
        "quant": q, "quant_channel": qc,
        "np": {"c": np.arange(30, dtype=np.float64).reshape(5, 6),
               "f": np.asfortranarray(np.arange(12, dtype=np.int16).reshape(3, 4)),
               "structured": structured,
               "scalars": [np.float32(1.5), np.int64(-7), np.str_("ab\x00"), np.bytes_(b"x\x00\x00")]},
        "py": {"big": 2 ** 100 + 7, "neg_big": -(2 ** 90), "floats": (math.nan, math.inf, -0.0, 1e-310),
               "s": "snowman \u2603", "b": b"\x00\xff", "none": None, "t": True, 5: "int key",
               "od": OrderedDict([("z", 1), ("a", 2)]), "nested": [[1, (2, [3])], {"k": {}}]},
        "wide": {f"k{i:03d}": float(i) for i in range(400)},              # > 4 KiB: a node of its own
    }


def sharded() -> dict:
    from tensorstore_ck import Sharded
    full = torch.arange(60, dtype=torch.float32).reshape(10, 6)
    return {"w": Sharded(full[4:10].clone(), (10, 6), (4, 0)), "note": "one rank's piece"}


def dcp_state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {"model": {"a.weight": torch.randn(32, 40, generator=g), "a.bias": torch.randn(40, generator=g)},
            "extra": {"count": 3, "name": "dcp"}}


BUILDERS = {"model": model, "every_kind": every_kind, "sharded": sharded, "dcp_state": dcp_state}


def build(name: str, arg=None):
    fn = BUILDERS[name]
    return fn(arg) if arg is not None else fn()
