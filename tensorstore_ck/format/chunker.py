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
import os
from dataclasses import dataclass

from ..errors import InvalidArgument
from . import tree

__all__ = ["DEFAULT_BLOCK_SIZE", "DEFAULT_INLINE_THRESHOLD", "DEFAULT_PACK_SIZE", "Layout", "job_order", "plan_blocks",
           "block_ranges", "default_pack_size", "packable", "pack_full"]

# 4 MiB: measured in benches/bench_blocksize.py (docs/PERFORMANCE.md): smaller blocks cost
# per-object overhead (a file, an fsync, a request on S3) for no gain in
# throughput; larger ones make a one-row change rewrite more bytes.
DEFAULT_BLOCK_SIZE = 4 * 1024 * 1024
DEFAULT_INLINE_THRESHOLD = 16 * 1024
MIN_BLOCK_SIZE = 4096
MAX_BLOCK_SIZE = tree.MAX_BLOCK_SIZE  # the readers' limit (format/tree.py)
# 64 MiB packs of small tensors on object stores: a rank of a 1,024-rank job of a
# 405B-parameter model holds ~3,400 tensors of 5 GB, nearly all under 4 MiB; packed, a
# 5 TB snapshot is ~75 k objects instead of ~2.7 M (docs/design/scaling.md, "Packs").
DEFAULT_PACK_SIZE = 64 * 1024 * 1024


def packable(nblocks: int, nbytes: int, pack_size: int) -> bool:
    """Whether a tensor of `nbytes` cut into `nblocks` goes into a pack (pack_size > 0):
    one block, and less than a pack. (The writers also leave replicated tensors alone.)"""
    return nblocks == 1 and 0 < nbytes < pack_size


def pack_full(size: int, itemsize: int, n: int, its_itemsize: int, pack_size: int) -> bool:
    """Whether an open pack of `size` bytes of `itemsize` cannot take a tensor of n bytes of
    its_itemsize: the codec codes a block by one item size, and a pack stays ≤ pack_size."""
    return its_itemsize != itemsize or size + n > pack_size


def job_order(leaves: list) -> list:
    """A plan's leaves in the order their block jobs start: the packs first (plan.Pack,
    the leaves with `members`: the longest jobs, up to pack_size where a block is
    block_size; one started last makes the put's tail), then the others as planned. The
    results of each leaf's jobs stay in its ranges' order."""
    packs = [x for x in leaves if getattr(x, "members", None) is not None]
    return packs + [x for x in leaves if getattr(x, "members", None) is None] if packs else list(leaves)


def default_pack_size(object_store: bool) -> int:
    """open_store(pack_size=None): DEFAULT_PACK_SIZE where an object costs a request (an
    object store, a tier in front of one), else 0; $TSCK_PACK_SIZE (bytes) overrides it."""
    env = os.environ.get("TSCK_PACK_SIZE")
    if env is not None:
        try:
            v = int(env)
        except ValueError:
            v = -1
        if not 0 <= v <= MAX_BLOCK_SIZE:
            raise InvalidArgument(f"$TSCK_PACK_SIZE must be an int within 0..{MAX_BLOCK_SIZE}, got {env!r}")
        return v
    return DEFAULT_PACK_SIZE if object_store else 0


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
