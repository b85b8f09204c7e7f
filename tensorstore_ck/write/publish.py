"""The write path: a plan's blocks -> manifest nodes -> commit object -> storage
sync -> fenced compare-and-swap of the ref -> (if a gc deletion phase overlapped)
re-validate and retry; and the stats of what was written.

plan.py turns a state into a Plan (validated, cut into block jobs) and writes
nothing; everything that writes is here. Store.put_snapshot, the collective put
(collective/) and the DCP writer (dcp/) all publish through a Publisher; none of
them moves a ref itself. The argument for why the fence makes reuse of existing
blocks safe while gc runs is in docs/design/gc.md ("GC and concurrent writers").
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import random
import socket
import threading
import time
import uuid
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.assets import Assets, PutResult
from ..core.roles import Executor, RefPublisher
from ..core.core import POOL_PREFIX
from ..core.validate import UNSET, SnapshotArgs
from ..errors import (Fenced, FormatError, OutcomeUnknown, RefConflict, SnapshotAborted, StepReusedWarning,
                      StorageError, TsckError)
from ..format.manifest import decode_commit, encode_commit
from ..format.tree import NodeWriter, Pending
from ..info import SnapshotInfo, row_to_info
from ..refs.gcstate import HOLD_SECONDS
from ..util.units import human_bytes
from . import packparts
from .executor import Threads, cancelled_on_failure, wait_all

if TYPE_CHECKING:
    from .plan import Plan

__all__ = ["Publisher", "COMMIT_ATTEMPTS", "BuildStats", "Timing", "TIMING_STATS", "plan_stats", "replica_digests",
           "NewObjects", "inline_bytes"]

log = logging.getLogger(__name__)

COMMIT_ATTEMPTS = 1000  # ref moves tried before a put gives up (each lost one is a real race)
_PARTS_TRIES = 4  # a put's tries when gc removes packs it named parts of (Publisher.publish)
LEARN_REFS = 16  # refs whose tips a put on a new ref learns stored packs' parts from


# -- the blocks of a plan and what they add up to -----------------------------------
def replica_digests(plan: Plan) -> list[tuple[str, bytes]]:
    """(path, 16-byte digest of dtype, shape and block addresses or inline bytes) of every
    Replicated tensor, once its blocks are hashed: equal on every rank iff the replicas
    are (a collective put compares them before it publishes)."""
    out = []
    for where, chunk in plan.replicas:
        h = hashlib.blake2b(digest_size=16)
        meta = chunk.meta if isinstance(chunk, Pending) else chunk  # a block leaf, or inline chunk meta
        h.update(repr((meta["dt"], list(meta["sh"]))).encode())
        if isinstance(chunk, Pending):
            for r in chunk.results:
                h.update(r.digest)
        else:
            h.update(b"x" + meta["x"])
        out.append((where, h.digest()))
    return out


def _resumed_past(args: SnapshotArgs) -> bool:
    """The writer resumed from an earlier snapshot of the ref and this step lies past it:
    a kept snapshot of the ref at this step belongs to the run it abandoned (a rollback,
    CheckpointManager.restore(step)), not to a re-run, so it is not a step reused."""
    return args.resumed_from is not None and args.step is not None and args.step > args.resumed_from


def _warn_step_reused(ref: str, step, earlier: bytes, root: bytes) -> None:
    msg = (f"ref {ref!r} already had a snapshot at step {step} ({earlier.hex()[:16]}); {root.hex()[:16]} was "
           f"published after it at the same step and both are kept ({ref}@{step} now names the newer). A script "
           "re-run from its start? Resume from the ref (restore_latest, TsckReader) or give the new run a ref "
           "of its own")
    log.warning("%s", msg)
    warnings.warn(msg, StepReusedWarning, stacklevel=4)


@dataclass
class BuildStats:
    """What a snapshot's blocks add up to: the stats its commit object and catalog row carry.

    bytes_total: the logical bytes the snapshot holds (its tensors' bytes, in blocks or
    inlined in its manifest nodes). bytes_new: the logical bytes of what it added to the
    store, each object once: the raw bytes of the blocks it wrote new, and the tensor bytes
    inlined in the manifest nodes it wrote new (a new node stores its inlined tensors
    again). stored_new: what its new blocks take in storage (framed, compressed)."""
    bytes_total: int = 0
    blocks_total: int = 0
    bytes_new: int = 0
    blocks_new: int = 0
    stored_new: int = 0  # bytes the new blocks take in storage (framed, compressed)

    def as_dict(self) -> dict:
        return {"bytes_total": self.bytes_total, "bytes_new": self.bytes_new,
                "blocks_total": self.blocks_total, "blocks_new": self.blocks_new, "stored_new": self.stored_new}


def inline_bytes(payload: bytes) -> int:
    """The tensor bytes inlined in one manifest node (a payload this process encoded)."""
    from ..format import tree
    from ..format.manifest import decode_node
    n = 0
    for _p, _d, item in tree.visit(tree.decode_node_value(decode_node(payload))):
        for leaf in item.chunks if type(item) is tree.Global else (item,):
            if getattr(leaf, "inline", None) is not None:
                n += len(leaf.inline)
    return n


@dataclass
class NewObjects:
    """The objects one writer (one process, or one rank of a collective put) stored new, by
    address, so that an object it stored twice counts once: block address -> (raw bytes,
    stored bytes); node address -> tensor bytes inlined in it. A rank of a collective put
    sends only the sums (into()): an object is new for the one writer that named it in the
    store (forget_lost drops those another writer named first), so the ranks' sums count
    it once, whichever ranks wrote it."""
    blocks: dict = field(default_factory=dict)
    nodes: dict = field(default_factory=dict)

    def add_plan(self, plan: Plan) -> "NewObjects":
        for leaf in plan.leaves:
            for r in leaf.results:
                if r.counted and r.new:
                    self.blocks[r.digest] = (r.raw_len, r.stored)
        return self

    def add_nodes(self, new_nodes: list) -> "NewObjects":
        for digest, payload in new_nodes:
            self.nodes[digest] = inline_bytes(payload)
        return self

    def forget_lost(self, assets: Assets) -> "NewObjects":
        """Drop what another writer named in the store before this one (two ranks writing
        the same bytes at once: DDP ranks' same weights, identical nodes); call after the
        sync that names this writer's objects (Assets.lost_to_others)."""
        if self.blocks or self.nodes:
            blocks, nodes = assets.lost_to_others(self.blocks, self.nodes)
            self.blocks = {d: v for d, v in self.blocks.items() if d not in blocks}
            self.nodes = {d: v for d, v in self.nodes.items() if d not in nodes}
        return self

    def into(self, st: BuildStats) -> BuildStats:
        """Set `st`'s new counts from these objects (its totals stay)."""
        st.blocks_new = len(self.blocks)
        st.bytes_new = sum(raw for raw, _s in self.blocks.values()) + sum(self.nodes.values())
        st.stored_new = sum(s for _r, s in self.blocks.values())
        return st


# The commit stats Timing writes: they differ between the encodings of one put (recover).
TIMING_STATS = ("put_us", "stall_us")


@dataclass(frozen=True)
class Timing:
    """When a put began (time.monotonic()) and how long its caller was blocked (None: all
    along, a blocking put). The commit records both as durations in its stats
    (`put_us`: from the call to the commit object; `stall_us`), so `tsck log` and
    SnapshotInfo show them for as long as the snapshot is kept."""
    started: float
    stall: float | None = None

    def stats(self) -> dict:
        us = max(0, int((time.monotonic() - self.started) * 1e6))
        stall = us if self.stall is None else max(0, int(self.stall * 1e6))
        return {"put_us": us, "stall_us": min(stall, us)}


def plan_stats(plan: Plan, new_nodes: list | None = None, assets: Assets | None = None) -> BuildStats:
    """What the written blocks add up to (a replicated block counts on its owner rank
    only), new_nodes (Publisher.write_nodes(new=)) adding the tensor bytes inlined in
    the nodes written new to bytes_new (BuildStats). assets: where they were written
    and synced, for a writer beside others (NewObjects.forget_lost)."""
    st = BuildStats(bytes_total=plan.inline_bytes)
    for leaf in plan.leaves:
        for r in leaf.results:
            if r.counted:
                st.blocks_total += 1
                st.bytes_total += r.raw_len
    for m in plan.reused:  # parts of stored packs it names: its bytes, nothing new
        st.bytes_total += m.nbytes
    st.blocks_total += len(packparts.reused_packs(plan))
    new = NewObjects().add_plan(plan).add_nodes(new_nodes or [])
    return (new if assets is None else new.forget_lost(assets)).into(st)


def snapshot_fields(info: SnapshotInfo) -> dict:
    """What a log line (and a JSON log line: the record's `tsck` attribute) says of a snapshot."""
    return {"event": "committed", "ref": info.ref, "job": info.job, "step": info.step, "root": info.root,
            "bytes": info.bytes_total, "bytes_new": info.bytes_new, "seconds": info.seconds, "stall": info.stall}


def log_committed(info: SnapshotInfo) -> SnapshotInfo:
    """One INFO line per committed snapshot: the line an operator looks for in a training log."""
    if log.isEnabledFor(logging.INFO):
        took = "" if info.seconds is None else f" in {info.seconds:.2f}s"
        took += "" if info.stall is None else f" (stall {info.stall:.2f}s)"
        log.info("snapshot committed: ref %s step %s, %s (%s new)%s, root %s", info.ref,
                 "-" if info.step is None else info.step, human_bytes(info.bytes_total), human_bytes(info.bytes_new), took,
                 info.root[:16], extra={"tsck": snapshot_fields(info)})
    return info


@dataclass(frozen=True)
class _Move:
    """One try of a fenced ref move (Publisher._move_ref): the ref from `parent` to
    `root`, with the catalog row; part0 as in RefTable.compare_and_swap."""
    parent: bytes | None
    root: bytes
    row: dict
    part0: bytes | None = None
    superseded: tuple = ()  # the put's earlier encodings (RefTable.compare_and_swap)


class Publisher:
    """Writes and publishes snapshots into one store (thread-safe).

    Call order for one snapshot: fence() before looking at storage ->
    write_blocks() / submit_block() -> write_nodes() -> commit(). publish()
    does all of it for a Plan."""

    def __init__(self, assets: Assets, reftable: RefPublisher, pool: ThreadPoolExecutor,
                 executor: Executor | None = None):
        self.assets = assets
        self.reftable = reftable
        self.pool = pool
        # Where the blocks are written (roles.Executor): threads of `pool` (Threads), or a
        # saver process (saver.SaverExecutor, a store opened with saver="process").
        self.executor = executor or Threads(self)

    # -- the steps -----------------------------------------------------------------
    def fence(self) -> int:
        """The gc deletion epoch. Read it before any object is found present: if a
        deletion phase starts or runs before the ref moves, the move is refused
        (Fenced) and everything the snapshot references is re-validated. Passed to the
        writes below, it lets them reuse what this Store saw present under that same
        epoch without asking storage (assets.Presence)."""
        return self.reftable.gc_state()["epoch"]

    def write_blocks(self, plan: Plan, owns=None, progress=None, fence: int | None = None) -> None:
        """The plan's blocks written; a packed tensor a stored pack holds names its part
        instead (packparts.reuse_parts), and the index learns the packs written."""
        packparts.reuse_parts(plan, self.assets, self.pool, fence)
        self.executor.write_blocks(plan, self.assets, owns=owns, progress=progress, fence=fence)
        packparts.learn_written(plan, self.assets.parts)

    def submit_block(self, raw, itemsize: int = 1, *, private: bool = False) -> "Future[PutResult]":
        """private: nobody else writes `raw` until the block is written (Assets.put_block)."""
        return self.pool.submit(self.assets.put_block, raw, itemsize, private=private)

    def write_nodes(self, value, fence: int | None = None, new: list | None = None) -> tuple[bytes, list[bytes]]:
        """Lay `value` out in nodes and write them -> (top node address, payloads).
        new: gets (address, payload) of each node this call stored new."""
        w = NodeWriter()
        if self.assets.storage.local or threading.current_thread().name.startswith(POOL_PREFIX):
            # A local disk writes a node in microseconds; a pool worker must not wait on its own pool.
            def put(payload):
                r = self.assets.put_node(payload, fence)
                if new is not None and r.new:
                    new.append((r.digest, payload))
                return r.digest
            return w.write(value, put), w.payloads
        # An object store answers each request in milliseconds (a HEAD and a PUT per node on a
        # cold store): the nodes go out in parallel, as the blocks do. A node's address is its
        # payload's hash, so the parent is laid out before its children are stored; all are
        # stored before this returns (the commit comes after them).
        futs: list[Future] = []
        sent: list[bytes] = []

        def put_async(payload):
            d = self.assets.node_address(payload)
            futs.append(self.pool.submit(self.assets.put_node, payload, fence, d))
            sent.append(payload)
            return d
        with cancelled_on_failure(futs):
            top = w.write(value, put_async)
            wait_all(futs)
        if new is not None:
            new.extend((f.result().digest, p) for f, p in zip(futs, sent) if f.result().new)
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

    def publish(self, plan: Plan, args: SnapshotArgs, progress=None, timing: Timing | None = None) -> SnapshotInfo:
        """The whole pipeline for one planned snapshot. Parts of stored packs it names
        that a gc deletion phase removed meanwhile (PartsGone, at the fenced move's
        re-validation) are written anew, and the snapshot published again."""
        if plan.written is not None:
            return self._publish_written(plan, args, timing)
        if plan.pack_size:
            self.learn_parts(args.ref)
        for _try in range(_PARTS_TRIES):
            fence = self.fence()
            self.write_blocks(plan, progress=progress, fence=fence)
            new: list = []
            top, payloads = self.write_nodes(plan.value, fence, new)
            try:
                info = self.commit(top, args, stats=plan_stats(plan, new).as_dict(), fence=fence, timing=timing,
                                   revalidate=lambda body, fence: self.revalidate_plan(plan, payloads, body, fence))
                self.assets.parts.wrote(bytes.fromhex(info.root))  # the next put on the ref reads no nodes
                return info
            except packparts.PartsGone as e:
                log.debug("ref %s: %s", args.ref, e)
                self.assets.parts.forget(e.packs)
                packparts.unwrite(plan)
        raise SnapshotAborted(f"gc deletion phases removed packs this snapshot named, {_PARTS_TRIES} times; "
                              "nothing was published, take it again")

    def _publish_written(self, plan: Plan, args: SnapshotArgs, timing: Timing | None) -> SnapshotInfo:
        """publish() of a plan whose blocks were written already, under the fence
        plan.written (a state staged in waves: waves.py): its nodes and commit. Its bytes
        are not held any more, so a fenced move re-validates its blocks by address."""
        packparts.learn_written(plan, self.assets.parts)
        fence = plan.written
        new: list = []
        top, payloads = self.write_nodes(plan.value, fence, new)
        digests = [r.digest for leaf in plan.leaves for r in leaf.results if r.counted]
        return self.commit(top, args, stats=plan_stats(plan, new).as_dict(), fence=fence, timing=timing,
                           revalidate=lambda body, fence: self.revalidate_written(digests, payloads, body, fence))

    def revalidate_written(self, digests: list, payloads: list, commit_body: bytes, fence: int) -> None:
        """After a fenced move, for a snapshot whose bytes are no longer held (staged in
        waves): every block it names must still exist (SnapshotAborted where the deletion
        phase removed one: nothing is published); its nodes and commit are written again."""
        self.revalidate_addresses(digests, payloads, commit_body, fence,
                                  what="this snapshot (staged in waves: its bytes are no longer held to write them "
                                       "again)")

    def learn_parts(self, ref: str, rank: int | None = None) -> None:
        """The parts of packs named by the snapshot `ref` is on, else (a new ref: a fork of
        another job's base) by the tips of up to LEARN_REFS other refs, into the index
        (once per snapshot, its nodes only): what a new process names instead of writing.
        rank: a rank of a collective put, which learns its own tree of a collective snapshot."""
        try:
            tip = self.reftable.get_or_none(ref)
            tips = [tip] if tip is not None else [r for _n, r in list(self.reftable.list())[:LEARN_REFS]]
        except TsckError:
            return
        for root in tips:
            packparts.learn(self.assets.parts, self.assets, root, rank)

    def commit(self, tree: bytes, args: SnapshotArgs, *, stats: dict, fence: int, revalidate=None,
               meta_extra: dict | None = None, timing: Timing | None = None,
               part0: bytes | None = None) -> SnapshotInfo:
        """Publish a manifest tree whose objects are all written: commit object,
        storage sync, then the fenced compare-and-swap of the ref. After a fenced move
        the commit waits out the deletion phase, takes a gc hold (no new phase opens
        until the move) and calls `revalidate(body, fence)`, which must make every object the
        snapshot references exist again (`fence`: the new one); without it a fenced move
        raises SnapshotAborted.

        Without expected=, a writer that loses the race re-encodes only its small
        commit object with the new parent and tries again, so two writers on one ref
        both land in its history.

        part0: rank 0's sub-tree, marked with the move (RefTable.compare_and_swap), when
        this is rank 0's tier.

        timing: the put's durations go into the commit's stats (see Timing). Each
        commit that lands is logged at INFO (logger tensorstore_ck.write.publish), the line
        a training log wants: ref, step, bytes, new bytes, seconds, stall."""
        ref, exp = args.ref, args.expected
        meta = {**args.meta, **(meta_extra or {})}
        made: dict = {}  # the commit object last encoded: body, parent, time, stats, root
        # Commit objects this put wrote and the table did not publish: each one it re-encoded
        # after a lost race, and the last one if the put fails. Removed once the put ends
        # (_drop_unpublished), or `recover` after a lost table would adopt each as a
        # snapshot of its own (one put, two snapshots).
        unpublished: list[bytes] = []

        def attempt() -> _Move | None:
            parent = self.reftable.get_or_none(ref) if exp is UNSET else exp
            if made.get("root") is not None and (parent == made["root"] or self.reftable.catalog_has(made["root"])):
                # A recover beside this put adopted the commit it wrote (recover adopts every
                # complete commit): that is this put's snapshot, whose move is done (the ref
                # on it, or was: moved back to it, the ref would go back past a later
                # snapshot) or is made now as it is. Re-encoded, the put would be two snapshots.
                if parent == made["root"] or any(e.new == made["root"] for e in self.reftable.reflog(ref)):
                    return None
            elif not made or parent != made["parent"]:
                if made.get("root") is not None:
                    unpublished.append(made["root"])
                # After a fenced move with the same parent the same commit object is
                # published: a new one each time would leave the old as garbage for every
                # snapshot that overlaps a gc's (or a prune's) deletion phase.
                now = self.reftable.wall_now()  # one clock for every writer's commit times
                st = made.get("stats", stats)
                if timing is not None:
                    st = {**st, **timing.stats()}
                made.update(body=encode_commit(job=args.job, ref=ref, step=args.step, time=now, metrics=args.metrics,
                                               meta=meta, parent=parent, tree=tree, stats=st),
                            parent=parent, time=now, stats=st)
            root = made["root"] = self.assets.put_commit(made["body"]).digest
            self.assets.sync()  # everything the commit references is durable before the ref moves
            return _Move(parent, root, {"job": args.job, "ref": ref, "step": args.step, "time": made["time"],
                                        "metrics": args.metrics, "meta": meta, "parent": made["parent"], "tree": tree,
                                        **made["stats"]}, part0, tuple(r for r in unpublished if r != root))

        def unknown(e: OutcomeUnknown, root: bytes) -> OutcomeUnknown:
            # Never delete here: a COMMIT still in flight may yet publish `root`,
            # and no read can order itself after it (gc reclaims it if it never lands).
            return OutcomeUnknown(f"{e}; snapshot {root.hex()} may or may not be published on ref {ref!r}: check "
                                  "`tsck log` of the ref (or store.resolve/store.log) before taking it again, or a "
                                  "retry may publish it twice", root=root, ref=ref)

        try:
            moved = self._move_ref(
                ref, attempt, fence=fence, what="snapshot", conditional=exp is not UNSET,
                revalidate=None if revalidate is None else (lambda new_fence: revalidate(made["body"], new_fence)),
                unknown=unknown,
                gave_up=lambda races, fenced: (
                    f"gave up publishing to {ref!r} after {COMMIT_ATTEMPTS} attempts: {races} lost races with other "
                    f"writers moving it, {fenced} overlapping gc deletion phases; nothing was published, take the "
                    "snapshot again"))
        except OutcomeUnknown:
            raise  # never delete the last one: a COMMIT still in flight may yet publish it
        except (RefConflict, SnapshotAborted, StorageError):
            # A definite failure (expected= not met, attempts spent, a fenced move that could
            # not be re-validated, the table's disk full or server away): the last one was
            # not published either.
            unpublished.append(made.get("root"))
            raise
        finally:
            self._drop_unpublished(ref, [r for r in dict.fromkeys(unpublished) if r is not None])
        if moved is None:
            log.warning("ref %s: a recover moved it to this put's commit %s while the put's move waited; that is "
                        "this put's snapshot", ref, made["root"].hex()[:16])
            return log_committed(self.info(made["root"]))
        move, lost = moved
        if lost:
            log.warning("ref %s: the answer to its move to %s was lost; the table shows it landed",
                        ref, move.root.hex()[:16])
        else:
            # After the move, not before: the commit's own round trips are the ones a
            # fault (a held or lost COMMIT) meets, and a warning costs no read to a put
            # that fails.
            had = None if _resumed_past(args) else self._step_taken(ref, args.step, move.root)
            if had is not None:
                _warn_step_reused(ref, args.step, had, move.root)
        return log_committed(row_to_info(move.root, move.row))

    def _step_taken(self, ref: str, step, root: bytes) -> bytes | None:
        """A kept snapshot of `ref`'s history at `step` other than `root`, if any (the
        steps index: a few reads). Only for a warning: a table that cannot answer says None."""
        if step is None:
            return None
        try:
            return self.reftable.step_root(ref, step, besides=root)
        except (TsckError, OSError) as e:
            log.debug("ref %s: could not look for an earlier snapshot at step %s: %s", ref, step, e)
            return None

    def move_to(self, root: bytes, row: dict, *, fence: int, revalidate) -> SnapshotInfo:
        """Publish a commit object that is already stored, with every object it references
        (a local tier's upload): the fenced compare-and-swap of row["ref"] to `root` itself,
        never a new commit (the same root in every tier; its parent is a weak link and this
        store's reflog records the moves as they happen here). The lost races, fenced moves
        and lost answers are handled as in commit() (_move_ref); revalidate(fence) must make
        every object of the snapshot exist again under the new fence."""
        ref = row["ref"]

        def attempt() -> _Move | None:
            if self.reftable.catalog_has(root):
                return None  # published here already (an upload resumed after the move)
            return _Move(self.reftable.get_or_none(ref), root, row)

        got = self._move_ref(ref, attempt, fence=fence, what="upload", revalidate=revalidate, backoff=False,
                             gave_up=lambda _races, _fenced: (f"gave up moving {ref!r} to {root.hex()[:16]} after "
                                                              f"{COMMIT_ATTEMPTS} attempts"))
        return self.info(root) if got is None else row_to_info(root, row)

    def _move_ref(self, ref: str, attempt, *, fence: int, revalidate, what: str, gave_up, conditional: bool = False,
                  backoff: bool = True, unknown=None) -> tuple[_Move, bool] | None:
        """The fenced compare-and-swap of `ref`, tried until it lands (commit and move_to).
        attempt() -> the _Move to try (its objects durable), or None: nothing to move.
        -> (the move that landed, whether its answer was lost and the table showed it
        landed), or None as attempt() said.

        Fenced (a gc deletion phase began since `fence`): wait it out holding a gc hold,
        so that no new phase opens until the move, call revalidate(new fence) under the
        hold (renewed meanwhile) and try again; without revalidate, SnapshotAborted.
        OutcomeUnknown (the answer was lost): landed if the table shows it, else raised
        (as unknown(e, root) when given). RefConflict on the ref (another writer moved it): a short jittered pause (growing
        with the lost races with backoff, else up to 50 ms), then again, unless the move
        is conditional (expected=). The hold goes in every case."""
        races = fenced = 0
        holder = None  # the gc hold taken after a fenced move, until the move releases it
        try:
            for _attempt in range(COMMIT_ATTEMPTS):
                move = attempt()
                if move is None:
                    return None
                try:
                    self.reftable.compare_and_swap(ref, move.parent, move.root,
                                                   message=f"snapshot step {move.row.get('step')}",
                                                   catalog_row=move.row, fence=fence, hold=holder, part0=move.part0,
                                                   superseded=move.superseded)
                except Fenced:
                    if revalidate is None:
                        raise SnapshotAborted("a gc deletion phase overlapped this snapshot; nothing was "
                                              "published, take it again") from None
                    fenced += 1
                    log.debug("ref %s: a gc deletion phase overlapped this %s; re-validating its objects", ref, what)
                    holder = holder or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
                    # With the hold taken no deletion phase opens until the move (or its expiry).
                    fence = self.wait_gc_idle(hold=holder)
                    with self._renewing(holder):
                        revalidate(fence)
                    continue
                except OutcomeUnknown as e:
                    if not self._landed(ref, move.root):
                        if unknown is None:
                            raise
                        raise unknown(e, move.root) from None
                    holder = None  # the move released it
                    self.assets.presence.settle(fence)
                    return move, True
                except RefConflict as e:
                    if conditional or e.what != "ref":  # conditional, or the name is a tag's
                        raise
                    # Another writer moved the ref: chain onto its snapshot and retry, after a
                    # short jittered pause so that writers hammering one ref do not livelock.
                    races += 1
                    log.debug("ref %s: this %s lost the race to move it (%d so far)", ref, what, races)
                    time.sleep(random.uniform(0, min(0.05, 0.0005 * 2 ** min(races, 10)) if backoff else 0.05))
                    continue
                holder = None  # the move released it
                self.assets.presence.settle(fence)
                return move, False
            raise SnapshotAborted(gave_up(races, fenced))
        finally:
            if holder is not None:
                try:
                    self.reftable.gc_unhold(holder)
                except Exception as e:  # noqa: BLE001 - it expires on its own
                    log.debug("gc hold %s not released (%s); it expires in %gs", holder, e, HOLD_SECONDS)

    def _landed(self, ref: str, root: bytes) -> bool:
        """After a move whose answer was lost: does the table show `root` published (the
        ref at it, or its catalog row, written in the same transaction as the move)?
        False when it shows neither or cannot be asked: the move may still land."""
        try:
            return self.reftable.get_or_none(ref) == root or self.reftable.catalog_has(root)
        except Exception as e:  # noqa: BLE001 - cannot tell: the caller says so
            log.debug("ref %s: cannot tell whether the move to %s landed (%s)", ref, root.hex()[:16], e)
            return False

    def _drop_unpublished(self, ref: str, roots: list[bytes]) -> None:
        """Remove commit objects of `ref` this put wrote that the table did not publish
        (refused: a lost race, a fenced move, expected= not met; or a move that failed
        definitely: the table's disk full, its server away), so that `recover` cannot adopt
        them. Only after a definite answer: after a COMMIT whose answer was lost the table
        raises OutcomeUnknown and nothing is deleted (commit() above). One the table shows
        published (the ref on it, or its catalog row: a recover running meanwhile adopted
        it) stays, and so does every one when the table cannot tell or the delete fails:
        gc reclaims them. Blocks and nodes are left to gc."""
        if not roots:
            return
        try:
            tip = self.reftable.get_or_none(ref)
            kept = [r for r in roots if r == tip or self.reftable.catalog_has(r)]
            if kept:
                log.debug("%d unpublished commit object(s) left in storage: the table shows them published "
                          "(a recover adopted them meanwhile)", len(kept))
            gone = [r for r in roots if r not in kept]
            if gone:
                self.assets.delete_objects("commits", gone)
                self.assets.sync()
        except Exception as e:  # noqa: BLE001 - unsure or failing: leave them, gc sees to them
            log.debug("%d unpublished commit object(s) of a put left in storage (%s)", len(roots), e)

    # -- after a fenced move ---------------------------------------------------------
    def wait_gc_idle(self, hold: str | None = None) -> int:
        """Wait until no gc deletion phase is running (closing a dead gc's phase once
        its lease ran out on the ref table's clock: the gc's own declaration, never this
        process's opinion); the even epoch, as a new fence. With `hold`, take that gc
        hold at once (so the gc's next deletion phase waits for this writer) and return
        the epoch read in the transaction that renews it and finds it even."""
        t0, told = time.monotonic(), False
        held_at = None  # when the hold was last taken or renewed (monotonic)
        self.reftable.release_abandoned_gc()  # a gc of ours that could not record its end
        while True:
            # The hold is taken at once, even while a phase runs (the gc's next phase then
            # waits for this writer), and renewed while waiting; the epoch is polled by reads.
            if hold is not None and (held_at is None or time.monotonic() - held_at >= HOLD_SECONDS / 4):
                held_at = time.monotonic()
                epoch = self.reftable.gc_hold(hold)
                if epoch is not None:
                    if told:
                        log.debug("gc deletion phase over after %.2fs; going on", time.monotonic() - t0)
                    return epoch
            st = self.reftable.gc_state()
            if st["epoch"] % 2 == 0:
                if hold is not None:
                    held_at = None
                    continue  # it ended: take the hold (it is ours already; this reads the new fence)
                if told:
                    log.debug("gc deletion phase over after %.2fs; going on", time.monotonic() - t0)
                return st["epoch"]
            if not told:  # once per wait, not per poll
                told = True
                # (the phase usually ends long before its lease: the lease only bounds the wait)
                log.debug("waiting for gc %s's deletion phase (epoch %d) to end, at most its lease's %.1fs more",
                          st.get("owner"), st["epoch"], st["lease_left"] or 0.0)
            if not st["lease_left"]:
                log.warning("closing the deletion phase of gc %s: its lease ran out on the ref table's clock",
                            st.get("owner"))
                self.reftable.gc_abort_stale()
            else:
                time.sleep(min(0.05, st["lease_left"]))

    @contextlib.contextmanager
    def _renewing(self, holder: str):
        """Renew `holder`'s gc hold from a thread while the body runs (a re-validation
        may take longer than one hold); once a deletion phase runs anyway, stop."""
        done = threading.Event()

        def run():
            while not done.wait(HOLD_SECONDS / 4):
                try:
                    if self.reftable.gc_hold(holder) is None:
                        return  # the hold ran out and a gc froze: the move will be fenced again
                except Exception as e:  # noqa: BLE001 - the move's own transaction tells
                    log.debug("gc hold %s: renewal failed (%s)", holder, e)
                    return
        t = threading.Thread(target=run, name="tsck-gc-hold", daemon=True)
        t.start()
        try:
            yield
        finally:
            done.set()
            t.join()

    def rewrite(self, payloads: list, commit_body: bytes | None) -> None:
        """Write again, after a fenced move, the nodes and the commit object of a snapshot
        (what a deletion phase may have removed; the re-validations end with it)."""
        for payload in payloads:
            self.assets.put_node(payload)
        if commit_body is not None:
            self.assets.put_commit(commit_body)
        self.assets.sync()

    def revalidate_plan(self, plan: Plan, payloads: list, commit_body: bytes | None, fence: int,
                        owns=None) -> None:
        """After a fenced move (no deletion phase runs: commit() waited it out and holds
        the store), make sure every object this snapshot references exists, writing
        again, from the data still held, what gc removed. A rank of a collective put
        passes its own part (no commit body) and its `owns` (run_block_jobs): each
        replicated block is checked by the one rank that wrote it."""
        # A leaf that is not private is copied again and checked against its address (put_block).
        # Under the new fence: what this Store saw before the phase is of an older epoch and
        # is asked of storage again like any block (assets.Presence); only what was seen
        # after this fence was read may be reused.
        futs = [self.pool.submit(self.assets.put_block, leaf.raw[a:b], leaf.itemsize, r.digest, private=leaf.private,
                                 fence=fence)
                for leaf in plan.leaves for i, ((a, b), r) in enumerate(zip(leaf.ranges, leaf.results))
                if owns is None or not leaf.replicated or owns(leaf, i)]
        named = packparts.reused_packs(plan)  # parts of stored packs: only there or gone
        there = list(self.pool.map(lambda d: self.assets.has_block(d, named[d], fence), named))
        for f in futs:
            f.result()
        gone = [d for d, ok in zip(named, there) if not ok]
        if gone:
            raise packparts.PartsGone(gone)
        self.rewrite(payloads, commit_body)

    def revalidate_addresses(self, digests: list, payloads: list, commit_body: bytes, fence: int, *,
                             what: str) -> None:
        """The same for a writer that holds only addresses, not the data (the DCP
        coordinator): a block gc removed aborts the snapshot."""
        present = list(self.pool.map(self.assets.block_exists, digests))
        missing = sum(1 for ok in present if not ok)
        if missing:
            raise SnapshotAborted(f"gc removed {missing} block(s) {what} references; nothing was published, "
                                  "save again")
        self.rewrite(payloads, commit_body)
