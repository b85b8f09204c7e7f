"""Shared helpers for the round-trip / bad-input / CLI tests.

Nothing here touches tensorstore_ck internals: only the public API and the
on-disk directory names documented in docs/FORMAT.md (blocks/ nodes/ commits/).
assert_same / same_bits are the suite's one bit-exact comparison of state trees.
"""
from __future__ import annotations

import dataclasses
import math
import os
import struct

import numpy as np
import torch

OBJECT_DIRS = ("blocks", "nodes", "commits")


# ---------------------------------------------------------------- comparison
def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor's logical content (row-major), bit-exact."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same(a, b, path: str = "", *, loose_types: bool = False) -> None:
    """Strict structural + bitwise equality (a: expected, b: actual). loose_types: a dict
    subclass may stand for a dict and a Tensor subclass for a tensor (what dcp.load
    gives back), everything else still bit-exact."""
    where = path or "<root>"
    if loose_types and isinstance(a, dict) and isinstance(b, dict):
        pass
    elif loose_types and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        a, b = a.detach().as_subclass(torch.Tensor), b.detach().as_subclass(torch.Tensor)
    else:
        assert type(a) is type(b), f"{where}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype} != {b.dtype}"
        assert tuple(a.shape) == tuple(b.shape), f"{where}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.requires_grad == b.requires_grad, f"{where}: requires_grad differs"
        if a.is_quantized:
            assert b.is_quantized and a.qscheme() == b.qscheme(), f"{where}: qscheme differs"
            if a.qscheme() == torch.per_tensor_affine:
                assert struct.pack("<d", a.q_scale()) == struct.pack("<d", b.q_scale()), f"{where}: q_scale"
                assert a.q_zero_point() == b.q_zero_point(), f"{where}: q_zero_point"
            else:
                assert a.q_per_channel_axis() == b.q_per_channel_axis(), f"{where}: q_per_channel_axis"
                assert_same(a.q_per_channel_scales(), b.q_per_channel_scales(), f"{path}.q_per_channel_scales")
                assert_same(a.q_per_channel_zero_points(), b.q_per_channel_zero_points(),
                            f"{path}.q_per_channel_zero_points")
            a, b = a.int_repr(), b.int_repr()
        assert tensor_bytes(a) == tensor_bytes(b), f"{where}: tensor bytes differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype!r} != {b.dtype!r}"
        assert a.shape == b.shape, f"{where}: shape {a.shape} != {b.shape}"
        if a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous:  # stored in Fortran order
            assert b.flags.f_contiguous, f"{where}: Fortran order lost"
        assert a.tobytes() == b.tobytes(), f"{where}: array bytes differ"
    elif dataclasses.is_dataclass(a) and not isinstance(a, type):  # tsck.Sharded, tsck.Replicated
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype, f"{where}: dtype {a.dtype!r} != {b.dtype!r}"
        assert a.tobytes() == b.tobytes(), f"{where}: scalar bytes differ"
    elif isinstance(a, dict):
        ka, kb = list(a.keys()), list(b.keys())
        assert [(type(k), k) for k in ka] == [(type(k), k) for k in kb], (
            f"{where}: keys/order differ: {ka!r} != {kb!r}")
        for k in ka:
            assert_same(a[k], b[k], f"{path}[{k!r}]", loose_types=loose_types)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: len {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]", loose_types=loose_types)
    elif isinstance(a, float):
        assert struct.pack("<d", a) == struct.pack("<d", b), f"{where}: float bits {a!r} != {b!r}"
    else:  # None, bool, int, str, bytes, picklable objects
        assert a == b, f"{where}: {a!r} != {b!r}"


def same_bits(a, b) -> bool:
    """assert_same as a predicate."""
    try:
        assert_same(a, b)
    except AssertionError:
        return False
    return True


# ---------------------------------------------------------------- tensors
def rand_tensor(dtype: torch.dtype, shape, seed: int = 0) -> torch.Tensor:
    """A dense CPU tensor of `dtype` filled with random bytes (NaN payloads etc.)."""
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    n = math.prod(shape) * itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw = raw % 2  # keep bools canonical
    return raw.view(dtype).reshape(tuple(shape))


def all_torch_dtypes():
    return sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)


# ---------------------------------------------------------------- store listing
def object_listing(store_path) -> dict:
    """{relative path: size} for every file under blocks/ nodes/ commits/
    (`store_path` may be a tests/_backends.Backend: then on any backend)."""
    if hasattr(store_path, "objects"):
        return store_path.objects()
    out = {}
    for d in OBJECT_DIRS:
        base = os.path.join(str(store_path), d)
        for root, _dirs, files in os.walk(base):
            for f in files:
                full = os.path.join(root, f)
                out[os.path.relpath(full, str(store_path))] = os.path.getsize(full)
    return out


def refs_snapshot(store) -> dict:
    return {name: info.root for name, info in store.refs().items()}


def tags_snapshot(store) -> dict:
    return {name: info.root for name, info in store.tags().items()}


def run_worker_scenario(worker, tmp_path, scenario: str, *args, limit: float) -> "os.PathLike":
    """Run `python WORKER SCENARIO OUT ARGS...` (a launcher that forks real gloo ranks) with
    the repository on PYTHONPATH; -> OUT. Past `limit` seconds the launcher and every rank
    it forked are killed and the test fails with the launcher's stderr."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import pytest
    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / scenario
    env = dict(os.environ)
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    proc = subprocess.Popen([sys.executable, str(worker), scenario, str(out), *map(str, args)], cwd=repo, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        _o, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it forked
        _o, err = proc.communicate()
        pytest.fail(f"scenario {scenario} {args} ran past {limit}s:\n{err.decode(errors='replace')[-4000:]}")
    assert proc.returncode == 0, err.decode(errors="replace")[-4000:]
    return out
