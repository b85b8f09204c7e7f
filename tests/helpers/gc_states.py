"""Deterministic states for the gc race / gc crash tests (numpy only, cheap to import).

Imported by the helper scripts (tests/helpers is their sys.path[0]) and by the
tests (loaded by file path), so the test process regenerates exactly what a
child committed for (writer, step) or (job, step) and compares bit for bit.

Race states (block_size 64 KiB): snapshot k of writer w is

    variant  2 x 512 KiB, one of 3 per writer, chosen by k % 3    (16 blocks)
    base     4 x 256 KiB, identical for every writer and step   (16 blocks)
    unique   256 KiB, different for every (w, k)                  (4 blocks)
    small    inlined, different for every (w, k)

With keep_last=2, when writer w commits k its kept snapshots are k-1 and
k-2, so the variant blocks of k (shared only with k-3, k-6, ...) are exactly
what a concurrent gc condemns and deletes while k reuses them.

Crash states (block_size 4 KiB): snapshot s of job j is a base shared by all
jobs (32 blocks) plus 64 blocks unique to (j, s), one block per row.
"""

from __future__ import annotations

import os
import sys

import functools

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _util import same_bits  # noqa: E402,F401 - the suite's one bit-exact comparer

RACE_BLOCK = 64 * 1024
RACE_INLINE = 4096
RACE_VARIANTS = 3

CRASH_BLOCK = 4096
CRASH_INLINE = 1024
CRASH_OWN_ROWS = 64  # rows of 4 KiB: one block each


def _arr(seed, shape, dtype) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(np.random.default_rng(seed).bytes(n), dtype=dtype).reshape(shape).copy()


@functools.lru_cache(maxsize=None)
def _race_base():
    return {f"layer{i}": _arr([7, i], (256, 256), np.float32) for i in range(4)}


@functools.lru_cache(maxsize=None)
def _race_variant(writer: int, v: int):
    return {
        "proj": _arr([11, writer, v, 0], (512, 256), np.float32),  # 512 KiB
        "emb": _arr([11, writer, v, 1], (1024, 256), np.uint16),  # 512 KiB
    }


def race_state(writer: int, step: int) -> dict:
    """What race writer `writer` commits at `step`."""
    # The reused variant blocks come first, so the writer looks them up early and
    # spends the rest of the put writing the unique ones: a wide window for gc.
    return {
        "variant": _race_variant(writer, step % RACE_VARIANTS),
        "base": _race_base(),
        "unique": _arr([13, writer, step], (256, 256), np.float32),  # 256 KiB -> 4 blocks
        "small": np.arange(8, dtype=np.int64) * 1000 + writer * 10**6 + step,
        "writer": writer,
        "step": step,
    }


@functools.lru_cache(maxsize=None)
def _crash_base():
    return _arr([17], (32, 1024), np.float32)  # 32 rows of 4 KiB


def crash_own(job: str, step: int) -> np.ndarray:
    seed = [19, int.from_bytes(job.encode(), "little") % (2**32), step]
    return _arr(seed, (CRASH_OWN_ROWS, 1024), np.float32)


def crash_state(job: str, step: int) -> dict:
    """What the crash tests commit for `job` at `step`."""
    return {
        "job": job,
        "step": step,
        "base": _crash_base(),
        "own": crash_own(job, step),
        "small": np.arange(16, dtype=np.int32) + step,
    }


