"""Sharded tensors: a rank's piece of a larger (global) tensor.

    tsck.Sharded(local, global_shape, offsets)   this rank holds global[offsets : offsets + local.shape]
    tsck.Replicated(tensor)                      the same tensor on every rank (written once per snapshot)

A snapshot stores a sharded tensor as its global dtype and shape plus the
list of chunks (offsets, shape, blocks) that ranks wrote. Checkout assembles
the global tensor, or fills exactly the region a `Sharded` target asks for,
reading only the blocks that intersect it: another world size or another
sharding reads what it needs and no more. torch DTensors are converted with
`from_dtensor`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import InvalidArgument

__all__ = ["Sharded", "Replicated", "from_dtensor"]


@dataclass(frozen=True)
class Sharded:
    local: torch.Tensor
    global_shape: tuple
    offsets: tuple

    def __post_init__(self):
        if not isinstance(self.local, torch.Tensor):
            raise InvalidArgument("Sharded.local must be a torch.Tensor")
        gs, off = tuple(int(x) for x in self.global_shape), tuple(int(x) for x in self.offsets)
        object.__setattr__(self, "global_shape", gs)
        object.__setattr__(self, "offsets", off)
        if not (len(gs) == len(off) == self.local.dim()):
            raise InvalidArgument(f"Sharded: local has {self.local.dim()} dims, global_shape {len(gs)}, "
                              f"offsets {len(off)}")
        for d, (o, n, g) in enumerate(zip(off, self.local.shape, gs)):
            if o < 0 or o + n > g:
                raise InvalidArgument(f"Sharded: dim {d}: offset {o} + size {n} is outside global size {g}")

    @property
    def box(self) -> tuple:
        return self.offsets, tuple(self.local.shape)


@dataclass(frozen=True)
class Replicated:
    """A tensor every rank holds whole; a collective snapshot writes it once,
    spreading its blocks over the ranks."""
    tensor: torch.Tensor


def from_dtensor(t) -> "Sharded":
    """A DTensor's local shard, with its global shape and offsets."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return Sharded(t.to_local(), tuple(t.shape), tuple(offsets))
