"""Read jobs: (digest, destination, path, bounce) run in parallel on a Store's pool, and the
parts of packs (one read of a pack for all the parts a batch of jobs wants). No torch: the
commands that read manifests without tensors (`tsck diff`, `ls`, `fsck`) use it too."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import numpy as np

from ..core.assets import Assets
from ..core.partindex import part_matches
from ..core.roles import ObjectReader
from ..errors import IntegrityError
from ..format import tree

__all__ = ["PackPart", "PackCache", "part_job", "part_mismatch", "run_reads"]


class PackPart:
    """A read job's destination that is a part of a pack (a block many small tensors share):
    bytes [off, off + dst.nbytes) of the pack, whose raw length is glen. h: the BLAKE3 the
    leaf gives of those bytes (LEAF `h`), checked before they are copied out, or None."""
    __slots__ = ("dst", "off", "glen", "h")

    def __init__(self, dst, off: int, glen: int, h: bytes | None = None):
        self.dst, self.off, self.glen, self.h = dst, off, glen, h

    @property
    def nbytes(self) -> int:
        return self.dst.nbytes


def part_job(leaf: tree.Leaf, dst) -> PackPart:
    """The destination of a packed leaf's read: its part of its pack into `dst` (all of
    it: its content hash is checked)."""
    return PackPart(dst, leaf.part[0], leaf.part[1], leaf.content)


class PackCache:
    """The packs read last, verified (a few: reads of one leaf at a time, a tensor bound for
    a device, would otherwise read its whole pack once per tensor)."""

    def __init__(self, size: int = 2):
        self.size, self._packs = size, OrderedDict()
        self._lock = threading.Lock()  # (the pool's threads read packs at once)

    def get(self, key):
        with self._lock:
            return self._packs.get(key)

    def put(self, key, buf) -> None:
        with self._lock:
            self._packs[key] = buf
            while len(self._packs) > self.size:
                self._packs.popitem(last=False)


def _read_pack(assets: ObjectReader, d: bytes, glen: int, parts: list, cache: PackCache | None, *,
               verify: bool, snapshot: str, fence: int | None) -> None:
    """Read the pack `d` once, verified, into a buffer of ours, check each part against its
    leaf's content hash, and only then copy the parts out (the caller's memory gets only
    verified bytes, as with a bounce read). The pack's address covers the pack, not what a
    leaf claims of its part: a leaf whose `h` its part does not match (a writer's bug, or
    hostile stored bytes) is an IntegrityError naming it, never its part's bytes."""
    buf = cache.get((d, glen)) if cache is not None else None
    if buf is None:
        buf = np.empty(glen, dtype=np.uint8)
        assets.read_block_into(d, buf, path=parts[0][1], bounce=False, verify=verify, snapshot=snapshot,
                               fence=fence)
        if cache is not None:
            cache.put((d, glen), buf)
    if verify:
        for part, p, _b in parts:
            if part.h is not None and not part_matches(buf, part.off, part.dst.nbytes, part.h):
                raise part_mismatch(d, snapshot, p)
    for part, _p, _b in parts:
        np.copyto(part.dst, buf[part.off:part.off + part.dst.nbytes])


def part_mismatch(d: bytes, snapshot: str | None, path: str | None) -> IntegrityError:
    return IntegrityError("a packed tensor's bytes do not match its content hash (LEAF h): "
                          "its leaf names a part of a pack that holds other bytes",
                          snapshot=snapshot, path=path, key=Assets.object_key("blocks", d))


def run_reads(assets: ObjectReader, pool: ThreadPoolExecutor, jobs: list, *, snapshot: str, verify: bool,
              written: dict | None = None, progress=None, fence: int | None = None,
              packs: PackCache | None = None) -> None:
    """Read (digest, destination, path, bounce) jobs in parallel; the first failure
    cancels the rest. bounce: the destination is the caller's memory, which gets
    only verified bytes (Assets.read_block_into). A destination that is a PackPart is a
    part of a pack: the parts of one pack are read with one read of it (through `packs`,
    the cache of the packs read last, if given); the packs' reads start first. `written`,
    on failure: filled with path -> (blocks copied into the caller's memory, blocks it was
    to get), for the paths that had bounce jobs, once no job is running any more."""
    if not jobs:
        return
    tasks: list = []  # (future, [(path, bounce, bytes)])
    grouped: dict = {}
    blocks: list = []
    filled = getattr(assets, "filled_job", None)  # (a plan that filled packs' parts already: tier/peerreads.py)
    for job in jobs:
        if type(job[1]) is PackPart and filled is not None and filled(job[0], job[1]):
            continue
        if type(job[1]) is PackPart:
            grouped.setdefault((job[0], job[1].glen), []).append(job[1:])
        else:
            blocks.append(job)
    # The packs first: a pack (up to pack_size) is the longest read, and one started last
    # is the checkout's tail (as for a put's jobs: chunker.job_order).
    for (d, glen), parts in grouped.items():
        tasks.append((pool.submit(_read_pack, assets, d, glen, parts, packs, verify=verify, snapshot=snapshot,
                                  fence=fence), [(p, b, out.nbytes) for out, p, b in parts]))
    for d, out, p, b in blocks:
        tasks.append((pool.submit(assets.read_block_into, d, out, verify=verify, snapshot=snapshot, path=p,
                                  bounce=b, fence=fence), [(p, b, out.nbytes)]))
    futs = [f for f, _ in tasks]
    if progress is not None:  # progress(bytes) as each block (or pack's parts) is read and verified
        for f, what in tasks:
            f.add_done_callback(lambda f, n=sum(k for _p, _b, k in what):
                                None if f.cancelled() or f.exception() is not None else progress(n))
    wait(futs, return_when=FIRST_EXCEPTION)
    for f in futs:
        if f.done() and not f.cancelled() and f.exception() is not None:
            for g in futs:
                g.cancel()
            wait(futs)
            if written is not None:
                for g, what in tasks:
                    ok = not g.cancelled() and g.exception() is None
                    for p, b, _n in what:
                        if b:
                            done, total = written.get(p, (0, 0))
                            written[p] = (done + ok, total + 1)
            raise f.exception()
