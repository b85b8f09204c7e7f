"""A state larger than the host-memory bound, staged in waves (open_store(host_memory=)).

An asynchronous put copies its state into a staging buffer so that the caller may change
it at once (staging.py). A state larger than the bound cannot be copied whole: it goes in
waves through one buffer of the bound's size. Each wave copies as many of the plan's
block jobs as the buffer holds (a block, or a pack gathered from its members), has them
hashed, coded and written (threads or the saver process: the store's executor), and the
next wave reuses the buffer. Every wave runs before put_snapshot returns: the caller's
tensors are read only while the put holds them, so the snapshot is one state, never
parts of two training steps. The stall grows with the state (it holds every wave's
writes but the snapshot's nodes and commit, which go to the background publisher as for
any asynchronous put); the memory does not.

A buffer holds the bound, or one block where a block is larger (then at most the bound
plus one block). After the waves the plan holds every block's address and no reference
to the caller's bytes: its blocks cannot be written again from it. So a waved snapshot
names no parts of stored packs (its packs are written as planned), and when a gc
deletion phase overlaps it, its re-validation checks that its blocks exist and aborts
it (SnapshotAborted) where the gc removed one (Publisher.revalidate_written).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..format.chunker import job_order
from .plan import Pack, Plan

__all__ = ["wave_limit", "waves_of", "stage_in_waves"]

_ALIGN = 64  # each job's bytes start on a multiple of this in the buffer (the codecs read items)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def wave_limit(plan: Plan, bound: int) -> int:
    """The buffer a waved plan needs: the bound, or its largest block job where that is larger."""
    largest = max((b - a for leaf in plan.leaves for a, b in leaf.ranges), default=0)
    return max(bound, _aligned(largest))


def waves_of(plan: Plan, limit: int) -> list[list[tuple]]:
    """The plan's block jobs, in the order they start (chunker.job_order), cut into waves
    of at most `limit` bytes (aligned) -> [[(leaf, block index, offset in the buffer)]]."""
    waves, cur, off = [], [], 0
    for leaf in job_order(plan.leaves):
        if leaf.known is not None:
            continue  # unchanged: nothing to copy (stage_in_waves looks for its blocks)
        for i, (a, b) in enumerate(leaf.ranges):
            if cur and off + (b - a) > limit:
                waves.append(cur)
                cur, off = [], 0
            cur.append((leaf, i, off))
            off += _aligned(b - a)
    if cur:
        waves.append(cur)
    return waves


def _fill(leaf, a: int, b: int, dst: torch.Tensor) -> None:
    """Bytes [a, b) of a leaf's data (a pack: its members', back to back) into `dst`."""
    if type(leaf) is Pack:
        for m in leaf.members:
            _fill(m, 0, m.nbytes, dst[m.pack_off:m.pack_off + m.nbytes])
    elif leaf.raw is not None:
        dst.copy_(torch.from_numpy(leaf.raw[a:b]))
    else:  # a device tensor (defer_device): copied as the current stream has it
        dst.copy_(leaf.device_src[a:b])


class _Job:
    """One block job of a wave, as an executor takes a leaf: its bytes in the buffer."""
    replicated = False
    private = True  # the buffer is the put's alone until the wave is written
    known = None

    def __init__(self, raw, itemsize: int):
        self.raw, self.itemsize = raw, itemsize
        self.ranges = [(0, raw.nbytes)]
        self.results: list = []


class _Wave:
    """A wave as an executor takes a plan: its jobs, and the shared buffer they lie in."""

    def __init__(self, jobs: list, shared):
        self.leaves, self.shared = jobs, shared


def stage_in_waves(plan: Plan, buf: torch.Tensor, shared, write: Callable, limit: int) -> int:
    """Write every block of `plan` through `buf` (uint8, at least `limit` bytes; `shared`:
    its staging.SharedBuffer, or None): per wave, its jobs copied in, then write(wave)
    (an executor's write_blocks). Each leaf's results are filled in order. Then the plan
    lets go of the caller's bytes. -> the number of waves."""
    waves = waves_of(plan, limit)
    with torch.no_grad():
        for wave in waves:
            jobs = []
            for leaf, i, off in wave:
                a, b = leaf.ranges[i]
                dst = buf[off:off + b - a]
                _fill(leaf, a, b, dst)
                jobs.append(_Job(dst.numpy(), leaf.itemsize))
            write(_Wave(jobs, shared))
            for (leaf, _i, _off), job in zip(wave, jobs):
                leaf.results.extend(job.results)
    known = [leaf for leaf in plan.leaves if leaf.known is not None]
    if known:  # blocks of unchanged tensors: looked for in storage (written from the tensor where lost)
        write(_Wave(known, shared))
    for leaf in plan.leaves:
        for m in (leaf.members if type(leaf) is Pack else (leaf,)):
            m.raw = m.device_src = None  # not the caller's bytes, nor the buffer's: written
    return len(waves)
