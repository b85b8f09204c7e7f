"""The one publisher: blocks -> manifest nodes -> commit object -> storage sync ->
fenced compare-and-swap of the ref -> (if a gc deletion phase overlapped)
re-validate and retry.

Store.put_snapshot, the collective put (dist.py) and the DCP writer (dcp/) all
publish through a Publisher; none of them moves a ref itself. The argument for
why the fence makes reuse of existing blocks safe while gc runs is in
docs/ARCHITECTURE.md ("GC and concurrent writers").
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor

from .assets import Assets, PutResult
from .errors import Fenced, FormatError, RefConflict, SnapshotAborted, StorageError
from .format.manifest import decode_commit, encode_commit
from .format.tree import NodeWriter
from .info import SnapshotInfo, row_to_info
from .plan import Plan, plan_stats, run_block_jobs
from .validate import UNSET, SnapshotArgs

__all__ = ["Publisher", "COMMIT_ATTEMPTS"]

log = logging.getLogger(__name__)

COMMIT_ATTEMPTS = 1000  # ref moves tried before a put gives up (each lost one is a real race)


class Publisher:
    """Writes and publishes snapshots into one store (thread-safe).

    Call order for one snapshot: fence() before looking at storage ->
    write_blocks() / submit_block() -> write_nodes() -> commit(). publish()
    does all of it for a Plan."""

    def __init__(self, assets: Assets, reftable, pool: ThreadPoolExecutor):
        self.assets = assets
        self.reftable = reftable
        self.pool = pool

    # -- the steps -----------------------------------------------------------------
    def fence(self) -> int:
        """The gc deletion epoch. Read it before any object is found present: if a
        deletion phase starts or runs before the ref moves, the move is refused
        (Fenced) and everything the snapshot references is re-validated."""
        return self.reftable.gc_state()["epoch"]

    def write_blocks(self, plan: Plan, owns=None, progress=None) -> None:
        run_block_jobs(plan, self.assets, self.pool, owns=owns, progress=progress)

    def submit_block(self, raw, itemsize: int = 1, *, private: bool = False) -> "Future[PutResult]":
        """private: nobody else writes `raw` until the block is written (Assets.put_block)."""
        return self.pool.submit(self.assets.put_block, raw, itemsize, private=private)

    def write_nodes(self, value) -> tuple[bytes, list[bytes]]:
        """Lay `value` out in nodes and write them -> (top node address, payloads)."""
        w = NodeWriter()
        top = w.write(value, lambda payload: self.assets.put_node(payload).digest)
        return top, w.payloads

    def sync(self) -> None:
        self.assets.sync()

    def info(self, root: bytes) -> SnapshotInfo:
        """What the catalog (or, for a snapshot it does not list, the commit) says of a root."""
        try:
            row = self.reftable.catalog_get(root)
        except FormatError:
            row = None  # a malformed row: the commit object says the same, checked
        if row is None:
            try:
                c = decode_commit(self.assets.get_commit(root))
            except FormatError as e:
                raise FormatError(f"snapshot {root.hex()[:16]}: {e}") from None
            row = {**c, **c["stats"]}
        return row_to_info(root, row)

    def find_published(self, ref: str, tree: bytes, since: float) -> SnapshotInfo | None:
        """The snapshot of manifest tree `tree` that `ref` moved to after `since` (wall
        clock), if any: how a rank of a collective put whose publisher went silent learns
        whether the ref moved after all."""
        for e in reversed(self.reftable.reflog(ref)):
            if e.time < since:
                break
            row = self.reftable.catalog_get(e.new)
            if row is not None and row.get("tree") == tree:
                return row_to_info(e.new, row)
        return None

    def publish(self, plan: Plan, args: SnapshotArgs, progress=None) -> SnapshotInfo:
        """The whole pipeline for one planned snapshot."""
        fence = self.fence()
        self.write_blocks(plan, progress=progress)
        top, payloads = self.write_nodes(plan.value)
        return self.commit(top, args, stats=plan_stats(plan).as_dict(), fence=fence,
                           revalidate=lambda body: self.revalidate_plan(plan, payloads, body))

    def commit(self, tree: bytes, args: SnapshotArgs, *, stats: dict, fence: int, revalidate=None,
               meta_extra: dict | None = None) -> SnapshotInfo:
        """Publish a manifest tree whose objects are all written: commit object,
        storage sync, then the fenced compare-and-swap of the ref. `revalidate(body)`
        must make every object the snapshot references exist again and return a
        new fence; without it a fenced move raises SnapshotAborted.

        Without expected=, a writer that loses the race re-encodes only its small
        commit object with the new parent and tries again, so two writers on one ref
        both land in its history."""
        ref, exp = args.ref, args.expected
        meta = {**args.meta, **(meta_extra or {})}
        races = fenced = 0
        body = last_parent = None
        for _attempt in range(COMMIT_ATTEMPTS):
            parent = self.reftable.get_or_none(ref) if exp is UNSET else exp
            if body is None or parent != last_parent:
                # After a fenced move with the same parent the same commit object is
                # published: a new one each time would leave the old as garbage for every
                # snapshot that overlaps a gc's (or a prune's) deletion phase.
                now = self.reftable.wall_now()  # one clock for every writer's commit times
                body = encode_commit(job=args.job, ref=ref, step=args.step, time=now, metrics=args.metrics,
                                     meta=meta, parent=parent, tree=tree, stats=stats)
                last_parent = parent
            root = self.assets.put_commit(body).digest
            self.assets.sync()  # everything the commit references is durable before the ref moves
            row = {"job": args.job, "ref": ref, "step": args.step, "time": now, "metrics": args.metrics,
                   "meta": meta, "parent": parent, "tree": tree, **stats}
            try:
                self.reftable.compare_and_swap(ref, parent, root, message=f"snapshot step {args.step}",
                                               catalog_row=row, fence=fence)
            except Fenced:
                if revalidate is None:
                    raise SnapshotAborted("a gc deletion phase overlapped this snapshot; nothing was "
                                          "published, take it again") from None
                fenced += 1
                log.info("ref %s: a gc deletion phase overlapped this snapshot; re-validating its objects", ref)
                fence = revalidate(body)
                continue
            except StorageError:
                self._drop_unpublished(ref, root)
                raise
            except RefConflict as e:
                if exp is not UNSET or e.what != "ref":  # conditional, or the name is a tag's
                    raise
                # Another writer moved the ref: chain onto its snapshot and retry, after a
                # short jittered pause so that writers hammering one ref do not livelock.
                races += 1
                time.sleep(random.uniform(0, min(0.05, 0.0005 * 2 ** min(races, 10))))
                continue
            return row_to_info(root, row)
        raise SnapshotAborted(f"gave up publishing to {ref!r} after {COMMIT_ATTEMPTS} attempts: {races} lost "
                              f"races with other writers moving it, {fenced} overlapping gc deletion phases; "
                              "nothing was published, take the snapshot again")

    def _drop_unpublished(self, ref: str, root: bytes) -> None:
        """The ref table failed the move (its disk full, its server away): if it confirms
        that `root` is not published, remove the commit object, so that `recover` cannot
        adopt a snapshot whose put failed. Blocks and nodes are left to gc. When the
        table cannot tell (a commit whose answer was lost may have landed), keep it."""
        try:
            if self.reftable.get_or_none(ref) == root or self.reftable.catalog_has(root):
                return
            self.assets.delete_objects("commits", [root])
            self.assets.sync()
        except Exception as e:  # noqa: BLE001 - unsure or failing: leave it, gc sees to it
            log.info("commit %s of a failed put left in storage (%s)", root.hex()[:16], e)

    # -- after a fenced move ---------------------------------------------------------
    def wait_gc_idle(self) -> int:
        """Wait until no gc deletion phase is running (closing a dead gc's phase once
        its lease ran out on the ref table's clock: the gc's own declaration, never this
        process's opinion); the even epoch, as a new fence."""
        t0, told = time.monotonic(), False
        self.reftable.release_abandoned_gc()  # a gc of ours that could not record its end
        while True:
            st = self.reftable.gc_state()
            if st["epoch"] % 2 == 0:
                if told:
                    log.info("gc deletion phase over after %.2fs; going on", time.monotonic() - t0)
                return st["epoch"]
            if not told:  # once per wait, not per poll
                told = True
                log.info("waiting for gc %s's deletion phase (epoch %d) to end; its lease runs %.1fs more",
                         st.get("owner"), st["epoch"], st["lease_left"] or 0.0)
            if not st["lease_left"]:
                log.warning("closing the deletion phase of gc %s: its lease ran out on the ref table's clock",
                            st.get("owner"))
                self.reftable.gc_abort_stale()
            else:
                time.sleep(min(0.05, st["lease_left"]))

    def _rewrite(self, payloads: list, commit_body: bytes) -> None:
        for payload in payloads:
            self.assets.put_node(payload)
        self.assets.put_commit(commit_body)
        self.assets.sync()

    def revalidate_plan(self, plan: Plan, payloads: list, commit_body: bytes) -> int:
        """Wait out a gc deletion phase, then make sure every object this snapshot
        references exists (writing again, from the data still held, what gc removed).
        Returns the new fence."""
        fence = self.wait_gc_idle()
        # A leaf that is not private is copied again and checked against its address (put_block).
        futs = [self.pool.submit(self.assets.put_block, leaf.raw[a:b], leaf.itemsize, r.digest, private=leaf.private)
                for leaf in plan.leaves for (a, b), r in zip(leaf.ranges, leaf.results)]
        for f in futs:
            f.result()
        self._rewrite(payloads, commit_body)
        return fence

    def revalidate_addresses(self, digests: list, payloads: list, commit_body: bytes, *, what: str) -> int:
        """The same for a writer that holds only addresses, not the data (the DCP
        coordinator): a block gc removed aborts the snapshot. Returns the new fence."""
        fence = self.wait_gc_idle()
        present = list(self.pool.map(self.assets.block_exists, digests))
        missing = sum(1 for ok in present if not ok)
        if missing:
            raise SnapshotAborted(f"gc removed {missing} block(s) {what} references; nothing was published, "
                                  "save again")
        self._rewrite(payloads, commit_body)
        return fence
