"""Rank 0's check of a put's layout: where each rank's pieces of sharded tensors lie.
A rank sends a 16-byte digest of its pieces (layout_digest), its pieces themselves only
when rank 0 does not hold them (Layouts: the last validated layout of each rank, per
group); rank 0 checks that the pieces tile each sharded tensor exactly (tiling) once per
whole-job layout (job_digest), and keeps the chunk index it wrote for it."""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence

import msgpack

from ..write.shard import find_overlap
from .naming import ranks_named

# Validated whole-job layouts (with their chunk index) rank 0 keeps per group (naming.LAYOUT_GROUPS: how many groups).
LAYOUT_JOBS = 2


def layout_digest(packed: bytes) -> bytes:
    """16 bytes over a rank's layout, `packed`: the msgpack of its pieces of sharded
    tensors, each [path, dtype, global shape, offsets, shape] (plain str and int lists),
    in its plan's order; the very bytes it sends when rank 0 asks. Equal digests mean
    equal layouts (blake2b-128), nothing less: rank 0 re-computes it over the bytes it is
    sent and refuses a mismatch."""
    return hashlib.blake2b(packed, digest_size=16, person=b"tsck-layout-v1").digest()


class Pieces(Sequence):
    """Every rank's pieces (rank r's: self[r]), held as the msgpack each rank sent (~36 B
    a piece, where the decoded lists take ~470 B: rank 0 keeps W x N of them between
    snapshots) and decoded when read (the tiling check and the chunk index: once per
    whole-job layout)."""

    def __init__(self, packed: list):
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [msgpack.unpackb(b) for b in self.packed[i]]
        return msgpack.unpackb(self.packed[i])


def job_digest(digests: list) -> bytes:
    """16 bytes over every rank's layout digest, in rank order (the whole job's layout)."""
    return hashlib.blake2b(b"".join(digests), digest_size=16, person=b"tsck-job-v1").digest()


class Layouts:
    """Rank 0, per group: each rank's layout (digest, pieces) as of the last layout of the
    whole job that passed the tiling check, and the whole-job layouts that passed it (by
    job_digest, the last LAYOUT_JOBS, each with the chunk index compose() wrote for it).
    So a snapshot whose layout repeats costs each rank a 16-byte digest in its hello and
    rank 0 O(W) work: a rank sends its pieces only when its digest is not the one held
    here, and the tiling is checked again whenever the whole job's digest is new (one
    piece moved anywhere). Per process (CALLS): a new rank 0 process asks every rank."""

    def __init__(self, world: int):
        self.digests: list = [None] * world
        self.pieces: list = [None] * world  # rank r's pieces, packed (Pieces)
        self.jobs: OrderedDict = OrderedDict()  # job digest -> (index node, its payloads) or None
        self.lock = threading.Lock()

    def view(self) -> tuple[list, list]:
        with self.lock:
            return list(self.digests), list(self.pieces)

    def validated(self, job: bytes) -> bool:
        with self.lock:
            return job in self.jobs

    def remember(self, job: bytes, digests: list, packed: list) -> None:
        """A whole-job layout that passed the tiling check (packed: each rank's pieces)."""
        with self.lock:
            self.digests[:], self.pieces[:] = digests, packed
            self.jobs[job] = self.jobs.pop(job, None)
            while len(self.jobs) > LAYOUT_JOBS:
                self.jobs.popitem(last=False)

    def index(self, job: bytes):
        with self.lock:
            return self.jobs.get(job)

    def set_index(self, job: bytes, index) -> None:
        with self.lock:
            if job in self.jobs:
                self.jobs[job] = index


def tiling(pieces_by_rank: list) -> str | None:
    """Rank 0, from every rank's hello: the pieces of each sharded tensor (by path) must
    agree on dtype and global shape and tile it exactly: no overlap, no gap (identical
    pieces on several ranks are replicas of one piece, as in hybrid sharding)."""
    by_path: dict = {}
    for r, pieces in enumerate(pieces_by_rank):
        for path, dt, gs, off, sh in pieces:
            by_path.setdefault(path, []).append((r, dt, tuple(gs), tuple(off), tuple(sh)))
    rule = "the pieces of a sharded tensor must tile it exactly (no overlap, no gap)"
    for path, entries in by_path.items():
        r0, dt0, gs0 = entries[0][:3]
        for r, dt, gs, _o, _s in entries:
            if (dt, gs) != (dt0, gs0):
                return (f"ranks disagree on the sharded tensor at {path}: rank {r0} has {dt0} {list(gs0)}, "
                        f"rank {r} has {dt} {list(gs)}")
        holders: dict = {}
        for r, _dt, _gs, off, sh in entries:
            holders.setdefault((off, sh), []).append(r)
        boxes = list(holders)
        hit = find_overlap(boxes)
        if hit is not None:
            (oa, sa), (ob, sb) = boxes[hit[0]], boxes[hit[1]]
            return (f"sharded tensor at {path}: the piece of {ranks_named(holders[boxes[hit[0]]])} at offsets "
                    f"{list(oa)} (shape {list(sa)}) overlaps the piece of {ranks_named(holders[boxes[hit[1]]])} at "
                    f"{list(ob)} (shape {list(sb)}); {rule}")
        covered, total = sum(math.prod(sh) for _o, sh in boxes), math.prod(gs0)
        if covered != total:
            return (f"sharded tensor at {path}: the pieces of {ranks_named({e[0] for e in entries})} cover {covered} "
                    f"of its {total} elements {list(gs0)}; {rule}")
    return None
