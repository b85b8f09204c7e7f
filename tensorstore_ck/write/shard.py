"""Sharded tensors: a rank's piece of a larger (global) tensor.

    tsck.Sharded(local, global_shape, offsets)   this rank holds global[offsets : offsets + local.shape]
    tsck.Replicated(tensor)                      the same tensor on every rank (written once per snapshot)

A snapshot stores a sharded tensor as its global dtype and shape plus the
list of chunks (offsets, shape, blocks) that ranks wrote. Checkout assembles
the global tensor, or fills exactly the region a `Sharded` target asks for,
reading only the blocks that intersect it: another world size or another
sharding reads what it needs and no more. torch DTensors are converted with
`from_dtensor`.

In a collective snapshot the pieces of one global tensor must tile it exactly
(no overlap, no gap; identical pieces count once): `tiling_problem` and
`find_overlap` are the box algebra the collective put and checkout share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import InvalidArgument, UnsupportedType

if TYPE_CHECKING:
    import torch

__all__ = ["Sharded", "Replicated", "from_dtensor", "is_dtensor", "find_overlap", "tiling_problem"]


@dataclass(frozen=True)
class Sharded:
    local: torch.Tensor
    global_shape: tuple
    offsets: tuple

    def __post_init__(self):
        import torch  # here, not at import: `tsck` commands that never touch tensors skip it
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


def is_dtensor(t) -> bool:
    """A torch.distributed DTensor (without importing torch.distributed when it is not one)."""
    return type(t).__name__ == "DTensor" and type(t).__module__.startswith("torch.distributed")


def from_dtensor(t, path: str = "") -> "Sharded":
    """A DTensor's local shard, with its global shape and offsets: a view of its memory
    (detached, so a checkout may fill it in place, parameters included).

    Only Shard(d) and Replicate placements make the local shard one box of the global
    tensor, on any mesh (2-D: each mesh dim splits the box further). A Partial
    placement holds addends of the values, not the values, and a strided shard
    (FSDP2 over tensor parallelism) holds interleaved rows: neither is a box, so both
    are refused (UnsupportedType; `full_tensor()` or `redistribute` first)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    for i, p in enumerate(t.placements):
        if type(p) is not Shard and type(p) is not Replicate:
            raise UnsupportedType(f"DTensor with placement {p} on mesh dim {i}: only Shard(dim) and Replicate "
                                  "name a box of the global tensor (redistribute it, or use full_tensor())", path)
    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    with torch.no_grad():
        local = t.to_local().detach()
    if tuple(local.shape) != tuple(shape):
        raise UnsupportedType(f"DTensor's local shard is {list(local.shape)}, its placements "
                              f"{list(t.placements)} give {list(shape)}", path)
    return Sharded(local, tuple(t.shape), tuple(offsets))


# -- tiling: the pieces of a global tensor, exactly ------------------------------------

def find_overlap(boxes: list) -> tuple[int, int] | None:
    """Indices (i, j) of two boxes (offsets, shape) that share an element, or None.
    Identical boxes must have been merged first (they are one piece held twice);
    empty boxes share nothing. Exact: a sweep along the dimension where the boxes'
    offsets vary most (rows for row sharding, columns for column sharding), so
    the usual layouts cost O(n log n), not O(n^2)."""
    live = [i for i, (_o, sh) in enumerate(boxes) if math.prod(sh) > 0]
    if len(live) < 2:
        return None
    nd = len(boxes[live[0]][0])
    if nd == 0:
        return live[0], live[1]  # two 0-d pieces: both are the one element
    d = max(range(nd), key=lambda k: len({boxes[i][0][k] for i in live}))
    live.sort(key=lambda i: boxes[i][0][d])
    active: list[int] = []
    for j in live:
        oj, sj = boxes[j]
        active = [i for i in active if boxes[i][0][d] + boxes[i][1][d] > oj[d]]
        for i in active:
            oi, si = boxes[i]
            if all(max(a, b) < min(a + x, b + y) for a, x, b, y in zip(oi, si, oj, sj)):
                return i, j
        active.append(j)
    return None


def tiling_problem(global_shape: tuple, boxes: list) -> str | None:
    """None if the boxes (offsets, shape) tile the global tensor exactly: each inside
    it, no two overlapping, together all of it (identical boxes count once: replicas
    of one piece). Else what is wrong, in words. Exact box algebra: a gap cannot be
    made up for by an overlap."""
    gs = tuple(global_shape)
    distinct = list(dict.fromkeys((tuple(o), tuple(sh)) for o, sh in boxes))
    for o, sh in distinct:
        if len(o) != len(gs) or len(sh) != len(gs) or any(a < 0 or a + n > g for a, n, g in zip(o, sh, gs)):
            return f"the piece at offsets {list(o)} of shape {list(sh)} is outside the global shape {list(gs)}"
    hit = find_overlap(distinct)
    if hit is not None:
        (oi, si), (oj, sj) = distinct[hit[0]], distinct[hit[1]]
        return (f"the pieces at offsets {list(oi)} (shape {list(si)}) and {list(oj)} (shape {list(sj)}) "
                f"overlap")
    covered, total = sum(math.prod(sh) for _o, sh in distinct), math.prod(gs)
    if covered != total:
        return f"the pieces cover {covered} of its {total} elements"
    return None
