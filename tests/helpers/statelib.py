"""Deterministic training-like states for the subprocess tests.

Imported both by the helper scripts (run as subprocesses, where this directory
is sys.path[0]) and by the tests (loaded by file path), so the test process can
regenerate exactly what a child wrote for a given step and compare bit for bit.
Plain numpy (plus the suite's comparer from tests/_util.py).
"""

from __future__ import annotations

import os
import sys

import hashlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _util import same_bits  # noqa: E402,F401 - the suite's one bit-exact comparer

__all__ = ["crash_state", "conc_state", "digest_arrays", "same_bits"]

# ~20 MiB per crash-test snapshot, every array different at every step.
CRASH_SHAPES = {
    "w1": ((1024, 1024), np.float32),  # 4 MiB
    "w2": ((512, 2048), np.float64),  # 8 MiB
    "emb": ((4096, 512), np.uint16),  # 4 MiB
    "m": ((1024, 1024), np.int32),  # 4 MiB
}


def _arr(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(rng.bytes(n), dtype=dtype).reshape(shape).copy()


def digest_arrays(arrays: dict) -> str:
    h = hashlib.sha256()
    for k in sorted(arrays):
        a = np.ascontiguousarray(arrays[k])
        h.update(k.encode())
        h.update(str(a.dtype).encode())
        h.update(repr(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def crash_state(step: int, seed: int = 1234) -> dict:
    """The state the crash writer snapshots at `step`."""
    rng = np.random.default_rng([seed, step])
    model = {k: _arr(rng, shape, dt) for k, (shape, dt) in CRASH_SHAPES.items()}
    small = np.arange(16, dtype=np.int64) + step  # inlined
    # never changes: every step after the first reuses its blocks
    frozen = _arr(np.random.default_rng([seed, 10**9]), (512, 1024), np.float32)  # 2 MiB
    return {
        "step": step,
        "model": model,
        "frozen": frozen,
        "small": small,
        "digest": digest_arrays(model),
    }


SHARED_BASE_SEED = 99


def conc_state(worker: int, i: int) -> dict:
    """State written by concurrency worker `worker` at iteration `i`.

    "base" is identical for every worker and iteration (shared weights, written
    concurrently by everyone); "own" is unique to (worker, i).
    """
    base_rng = np.random.default_rng(SHARED_BASE_SEED)
    own_rng = np.random.default_rng([worker + 1000, i])
    base = {f"layer{j}": _arr(base_rng, (256, 256), np.float32) for j in range(4)}  # 4 x 256 KiB
    own = {"head": _arr(own_rng, (128, 512), np.float32), "bias": _arr(own_rng, (64,), np.float32)}
    return {"worker": worker, "i": i, "base": base, "own": own}


