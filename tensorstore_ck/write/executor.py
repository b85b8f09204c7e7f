"""Where a store's block jobs and object copies run: threads of this process (Threads,
here), or the saver process (saver.py's SaverExecutor). Both play one role
(core/roles.Executor), chosen once when the store is built: its Publisher writes a plan's
blocks through one, a local tier's uploader copies objects to the remote through one.

The jobs themselves are written once, here (run_jobs, run_copies), and run the same in
either place: the saver process runs these very functions over its own threads.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Callable, Iterable

from ..core.assets import Assets, PutResult
from ..format.chunker import job_order

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["Threads", "run_block_jobs", "run_jobs", "run_copies", "only_hashed", "wait_all",
           "cancelled_on_failure", "Known"]


def wait_all(futs: list[Future]) -> None:
    """Wait for every future; raise the first failure at once (the caller cancels the rest:
    cancelled_on_failure)."""
    wait(futs, return_when=FIRST_EXCEPTION)
    for f in futs:
        if f.done() and f.exception() is not None:
            raise f.exception()


@contextlib.contextmanager
def cancelled_on_failure(futs: list[Future]):
    """Around submitting `futs` and waiting for them: on any failure (one of them, a
    submission, an interrupt) the ones not started yet are cancelled, and the ones running
    are waited for, before it is raised. A job reads memory its caller lends (a staging
    buffer, a wave of one): one still running after the failure is raised would hash bytes
    the caller has since reused and store them under the address of the old ones."""
    try:
        yield
    except BaseException:
        for f in futs:
            f.cancel()
        wait(futs)
        raise


def only_hashed(leaf, i: int, owns) -> bool:
    """Block i of `leaf` is another rank's to write (a replicated block of a collective
    snapshot, owns(leaf, i) False): this rank only hashes it for its manifest."""
    return owns is not None and leaf.replicated and not owns(leaf, i)


class Gather:
    """A block job's bytes still to be copied together, in the job: a pack of a plan not
    staged (its members' bytes), so the copies run on the pool too."""

    def __init__(self, pack):
        self.pack = pack


class Known:
    """A block job whose address is known (a tensor proven unchanged, unchanged.py): only
    looked for in storage (Assets.put_known); its bytes are the tensor's own."""

    def __init__(self, digest: bytes, raw):
        self.digest, self.raw = digest, raw


# A block job: (bytes, or a Gather; its size; element size; only hashed; private: nobody
# else writes these bytes until the block is written, Assets.put_block).
Job = tuple[object, int, int, bool, bool]


def run_jobs(assets: Assets, pool: ThreadPoolExecutor, jobs: Iterable[Job], fence: int | None,
             progress: Callable[[int], None] | None = None) -> list[PutResult]:
    """Each job hashed, or hashed, coded and written (fence: the gc epoch read before,
    Assets.put_block), in parallel on `pool` -> the PutResults in job order. A job whose
    bytes are a pack not gathered yet copies its members' bytes together in the job.
    progress(bytes) as each job is done."""
    futs: list[Future] = []
    with cancelled_on_failure(futs):
        for raw, n, itemsize, hash_only, private in jobs:
            if isinstance(raw, Gather):
                f = pool.submit(_gather_and_put, assets, raw.pack, fence)
            elif isinstance(raw, Known):
                if hash_only:
                    f = Future()
                    f.set_result(PutResult(raw.digest, False, n, counted=False))
                else:
                    f = pool.submit(assets.put_known, raw.raw, itemsize, raw.digest, fence)
            elif hash_only:
                f = pool.submit(assets.hash_block, raw)
            else:
                f = pool.submit(assets.put_block, raw, itemsize, private=private, fence=fence)
            if progress is not None:
                f.add_done_callback(lambda f, n=n: None if f.cancelled() or f.exception() is not None
                                    else progress(n))
            futs.append(f)
        wait_all(futs)
    return [f.result() for f in futs]


def _gather_and_put(assets: Assets, pack, fence):
    pack.gather()
    return assets.put_block(pack.raw, pack.itemsize, private=True, fence=fence)


def run_block_jobs(plan: "Plan", assets: Assets, pool: ThreadPoolExecutor, owns=None, progress=None,
                   fence: int | None = None) -> None:
    """Every block of the plan through run_jobs, each leaf's results filled in order.

    owns(leaf, i) -> bool, for replicated leaves of a collective snapshot: a
    block another rank owns is only hashed here (its address goes into this
    rank's manifest), so each replicated block is written exactly once."""
    leaves, jobs = [], []
    for leaf in job_order(plan.leaves):
        known = getattr(leaf, "known", None)  # (a wave's job has none)
        if leaf.raw is None and known is None:  # a pack of a plan not staged: its members' bytes copied together in the job
            leaves.append(leaf)
            jobs.append((Gather(leaf), sum(b - a for a, b in leaf.ranges), leaf.itemsize, False, True))
            continue
        for i, (a, b) in enumerate(leaf.ranges):
            leaves.append(leaf)
            raw = leaf.raw[a:b] if leaf.raw is not None else None
            jobs.append((raw if known is None else Known(known[i], raw), b - a, leaf.itemsize,
                         only_hashed(leaf, i, owns), leaf.private))
    for leaf, r in zip(leaves, run_jobs(assets, pool, jobs, fence, progress)):
        leaf.results.append(r)


def run_copies(dst: Assets, src: Assets, pool: ThreadPoolExecutor, kind: str,
               rows: Iterable[tuple[bytes, tuple | None, int]], fence: int | None, sync: bool) -> list[bool]:
    """Objects of `kind` copied from `src` to `dst` in parallel (Assets.copy_from: each row
    is a digest, the (length, CRC32) this process recorded when it wrote it or None, and its
    element size or 0) -> whether each was written; with `sync`, `dst` synced after (an
    upload's last kind: every object durable before the remote ref moves)."""
    futs: list[Future] = []
    with cancelled_on_failure(futs):
        futs.extend(pool.submit(dst.copy_from, src, kind, d, fence, w, k) for d, w, k in rows)
        wait_all(futs)
    news = [f.result() for f in futs]
    if sync:
        dst.sync()
    return news


class Threads:
    """Block jobs and copies on threads of this process: the pool of `owner` (a Core, or a
    Publisher), read at each call, since a fork rebuilds it (Core.after_fork)."""

    shares_memory = False  # the staging buffers are plain memory: nobody else reads them

    def __init__(self, owner):
        self.owner = owner

    def write_blocks(self, plan: "Plan", assets: Assets, owns=None, progress=None, fence: int | None = None) -> None:
        run_block_jobs(plan, assets, self.owner.pool, owns=owns, progress=progress, fence=fence)

    def copy(self, dst: Assets, src: Assets, kind: str, digests: list, fence: int | None, written: list,
             sync: bool, itemsizes: list | None = None) -> list[bool]:
        return run_copies(dst, src, self.owner.pool, kind, zip(digests, written, itemsizes or [0] * len(digests)),
                          fence, sync)

    def forget(self, buf_id: int) -> None:
        pass
