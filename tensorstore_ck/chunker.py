"""Tensor and array bytes -> fixed-size, element-aligned blocks. Pure; no I/O.

A tensor's contiguous bytes are cut at multiples of one *row* (the bytes of
``shape[1:]``) when a row fits in a block, else at multiples of one element.
Aligning to rows means a change to one row of an embedding table touches one
block, and a block never starts in the middle of an element. The same tensor
always cuts the same way for a given block size, which is what makes
unchanged blocks deduplicate across snapshots and jobs.

Tensors of at most ``inline_threshold`` bytes are not cut at all: their bytes
go inline into the manifest node (a block of a few bytes would cost a whole
object and a request).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .format import tree

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_INLINE_THRESHOLD", "Layout", "plan_blocks", "block_ranges"]

# 4 MiB: measured in benches/bench_blocksize.py (docs/PERFORMANCE.md): smaller blocks cost
# per-object overhead (a file, an fsync, a request on S3) for no gain in
# throughput; larger ones make a one-row change rewrite more bytes.
DEFAULT_BLOCK_SIZE = 4 * 1024 * 1024
DEFAULT_INLINE_THRESHOLD = 16 * 1024
MIN_BLOCK_SIZE = 4096
MAX_BLOCK_SIZE = tree.MAX_BLOCK_SIZE  # the readers' limit (format/tree.py)


@dataclass(frozen=True, slots=True)
class Layout:
    nbytes: int
    block_size: int  # bytes per block (the last one may be shorter); 0 when inline

    @property
    def nblocks(self) -> int:
        return 0 if self.block_size == 0 else math.ceil(self.nbytes / self.block_size)


def plan_blocks(nbytes: int, itemsize: int, shape: tuple[int, ...], block_size: int,
                inline_threshold: int) -> Layout:
    """Choose how a tensor of `nbytes` bytes is cut."""
    if nbytes <= inline_threshold:
        return Layout(nbytes, 0)
    itemsize = max(1, itemsize)
    row = itemsize * math.prod(shape[1:]) if len(shape) > 1 else itemsize
    unit = row if 0 < row <= block_size else itemsize
    bs = max(unit, (block_size // unit) * unit)
    return Layout(nbytes, bs)


def block_ranges(layout: Layout):
    """Yield (index, start, stop) byte ranges of each block."""
    bs = layout.block_size
    for i in range(layout.nblocks):
        start = i * bs
        yield i, start, min(start + bs, layout.nbytes)
