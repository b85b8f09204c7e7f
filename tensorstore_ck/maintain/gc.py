"""Garbage collection: expire what retention drops, mark, sweep. Safe while writers write.

The protocol (docs/design/gc.md, "GC and concurrent writers", has the argument):

1. begin    take the store's gc lock in the ref table (phase "marking") under a lease
            the gc declares and renews (judged on the ref table's clock only);
            refused while a recover has not finished (the rebuild mark: the
            table may lack snapshots; docs/design/recover.md, "recover under gc").
2. expire   drop the catalog rows retention no longer keeps (never a ref tip, tag or pin;
            re-checked inside the ref-table transaction), then compact the reflog to the
            moves of kept snapshots plus each ref's latest few (RefTable.compact_history).
3. mark     walk every kept commit's Merkle DAG; remember every reachable object.
4. list     list storage; anything unreachable (and written `grace` seconds before gc
            began, or earlier) is a candidate.
5. freeze   bump the deletion epoch to odd (phase "deleting"): from here on a writer's
            ref move fenced on an older epoch is refused; it re-validates the objects
            it references (re-uploading any that are gone) and retries.
6. re-mark  walk the commits published since step 3 (or the last re-mark): they may
            reuse candidates.
7. sweep    delete candidates not re-marked: commits, then nodes, then blocks; no
            delete request starts unless it ends, at the storage's request timeout,
            a margin before the lease could have run out. After PHASE_OBJECTS
            deletions or PHASE_SECONDS of them, thaw (epoch even, lock kept) and
            go back to 5: a writer a phase fences waits for that phase only.
8. finish   bump the epoch to even (phase "idle").

plan_gc does 2-4 (a dry run stops there), execute_gc 5-8; run_gc composes them
under the lock and its lease. prune_job is the same protocol for one job's rules
(what a CheckpointManager runs after each snapshot): its candidates are the
objects of the snapshots it expired that no kept snapshot reaches, found by
walking those snapshots instead of listing storage; it also applies the rules
of every job whose prune found the lock taken and queued itself in the ref
table (RefTable.prune_request), so no job's retention waits on winning the
lock. Reachability (mark, the packed set of reached
addresses, the streaming of unreachable objects) is in reach.py; every key is
assets.py's. Candidates are spooled to a temporary file, not held in memory. A
stored name that is not a well-formed key (a stray) is reported, never deleted.
Every entry point takes the store's Core (core.py: storage, assets, ref table, pool,
settings), so a gc is built and tested without a Store.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..core.core import DEFAULT_LEASE, Core
from ..core.roles import GcTable
from ..core.validate import tier_only
from ..core.walk import walk_commit
from ..errors import (FormatError, GcBusy, IntegrityError, InvalidArgument, RebuildUnfinished, TsckError,
                      UnreadableObject)
from ..refs.gcstate import rebuild_message
from ..util.progress import progress_bar
from ..util.units import human_bytes
from .lease import Lease, holding_gc_lock
from .reach import KINDS, Marked, NodeSet, holders, iter_unreachable, kept_roots, mark, undeletable
from .retention import Retention, SnapRow, explain_kept

log = logging.getLogger(__name__)

__all__ = ["GCReport", "GCPlan", "plan_gc", "execute_gc", "run_gc", "prune_job", "plan_expiry", "retention_plan",
           "DEFAULT_LEASE"]

SWEEP_BATCH = 512            # deletes between two checks of the lock
# A deletion phase ends after this many deletions or this many seconds of deleting,
# whichever comes first, and the next one opens after it (re-marking first): a writer
# that a phase fences waits for that one phase, not for the whole sweep.
PHASE_OBJECTS = 8192
PHASE_SECONDS = 1.0


@dataclass
class GCReport:
    dry_run: bool
    expired: list = field(default_factory=list)      # root hex of snapshots retention dropped
    kept_snapshots: int = 0
    reachable_objects: int = 0
    candidates: int = 0
    rescued: int = 0                                  # candidates re-marked (reused meanwhile)
    deleted_objects: int = 0
    deleted_bytes: int = 0
    deleted_block_bytes: int = 0                      # of deleted_bytes, those of blocks
    deleted_by_kind: dict = field(default_factory=dict)
    temp_files_removed: int = 0
    temp_files: dict = field(default_factory=dict)    # dry run: tmp/'s temp files, which this gc would sweep
    #                                                   and when the rest become due (Assets.temp_report)
    would_delete: list = field(default_factory=list)  # dry run: keys (capped at 10000)
    strays: list = field(default_factory=list)        # stored names that are no object key (kept)
    malformed_rows: list = field(default_factory=list)  # root hex of catalog rows that do not decode (kept)
    reflog_compacted: int = 0                         # history records of snapshots no longer kept, removed
    phases: int = 0                                   # deletion phases opened (writers fenced in each)
    jobs: list = field(default_factory=list)          # prune: the jobs whose rules it applied (its own and
                                                      # those queued because they found the store busy)
    snapshots: list = field(default_factory=list)     # dry run: per snapshot {root, ref, job, step, time,
                                                      # metrics, keep, why}: what retention decides and why
    seconds: float = 0.0
    mark_seconds: float = 0.0                         # walking the kept snapshots
    list_seconds: float = 0.0                         # listing storage against the mark
    sweep_seconds: float = 0.0                        # the deletion phases (re-marks included)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class GCPlan:
    """What a mark found: the kept snapshots, what they reach, and the spooled candidates
    (lines "kind hexdigest size", in deletion order: commits, nodes, blocks)."""
    began: float                  # objects written after this are a writer's, in flight
    kept: set
    marked: Marked
    visited: NodeSet              # the nodes the mark walked (exact addresses)
    spool: object
    report: GCReport

    def close(self) -> None:
        """Close the spool (a temporary file: unclosed, each plan left an open file
        descriptor and a ResourceWarning behind until the collector found it)."""
        self.spool.close()


def retention_plan(core: Core, now: float, records: dict | None = None, bad: list | None = None, *,
                   durable: set | None = None) -> list[dict]:
    """Every kept snapshot with what retention (`records`, default: the stored rules)
    decides for it and why: {root, ref, job, step, time, metrics, keep, why}. A ref
    tip, tag target or pin is kept whatever the rules say; a job without rules keeps
    everything. In a tier's table, a tier-only snapshot (its commit kept out of the remote
    by open_store(durable_every=): tier/memory.py) that is none of those and has a newer
    snapshot of its ref here that is safe (_safe_times) is not kept, whatever the rules
    say: it was superseded, and the rules keep durable snapshots. A catalog row that does
    not decode is never expired (its snapshot stays kept; fsck reports it); it goes to
    `bad` as (root, error). durable: the snapshots that count as durable (_safe_times;
    default: the tier's durable marks)."""
    records = core.refs.retention_all() if records is None else records
    rules = {job: Retention.from_dict(r) for job, r in records.items()}
    order = core.refs.publication_record()
    by_job: dict[str, list] = {}
    for root, row in core.refs.catalog_iter(bad=[] if bad is None else bad):
        seq, recovered = order.get(root, (None, False))
        by_job.setdefault(str(row.get("job", "")), []).append((SnapRow(
            root, row.get("step"), float(row.get("time", 0.0)), dict(row.get("metrics") or {}), seq,
            str(row.get("ref", "")), recovered), row))
    words = {"ref": "tip of {}", "tag": "tag {}", "pin": "pinned", "upload": "being uploaded"}
    protected = {root: [words[kind].format(name) for kind, name in hs] for root, hs in holders(core).items()}
    tier = is_tier_table(core)
    out = []
    for job, rows in by_job.items():
        why = explain_kept([sr for sr, _row in rows], rules.get(job), now)
        safe = _safe_times(core, rows, durable) if tier else {}
        for sr, row in rows:
            superseded = (tier and tier_only(row.get("meta")) and sr.root not in protected
                          and safe.get(sr.ref, sr.time) > sr.time)
            reasons = protected.get(sr.root, []) + ([] if superseded else why.get(sr.root, []))
            out.append({"root": sr.root, "ref": row.get("ref"), "job": job, "step": sr.step, "time": sr.time,
                        "metrics": sr.metrics, "keep": bool(reasons),
                        "why": reasons or ["tier-only, superseded" if superseded else "no rule keeps it"]})
    out.sort(key=lambda d: (d["job"], str(d["ref"]), d["time"]))
    return out


def _safe_times(core: Core, rows: list, durable: set | None = None) -> dict:
    """ref -> the commit time of its newest snapshot in this tier that stands in for an
    older tier-only one: durable (uploaded), or tier-only with a newer snapshot after it
    (its put returned, so its parts' copies were agreed: tier/collective.py), or one this
    process saw committed (TierTable.committed). Not the newest tier-only snapshot while
    its copies may be in flight, nor one queued for upload and not there yet: a node lost
    then would leave the older one the newest whole snapshot. durable: the rows' durable
    marks, where the caller read them already."""
    if durable is None:
        durable = core.refs.tier_rows.durable([sr.root for sr, _row in rows])
    committed = core.refs.tier_rows.committed
    by_ref: dict = {}
    for sr, row in rows:
        by_ref.setdefault(sr.ref, []).append((sr.time, sr.root, tier_only(row.get("meta"))))
    out = {}
    for ref, snaps in by_ref.items():
        snaps.sort(key=lambda t: t[0], reverse=True)
        for i, (when, root, only) in enumerate(snaps):
            if root in durable or (only and (i > 0 or root in committed)):
                out[ref] = when
                break
    return out


def superseded_copies(core: Core, durable: set | None = None) -> list[bytes]:
    """In a tier's table, the durable snapshots a newer snapshot of their ref stands in for
    (_safe_times), none a ref tip, tag or pin target nor already evicted: what a memory
    tier drops its copy of (the remote holds them; tier.uploader.Uploader.lean).
    durable: the snapshots that count as durable (default: the tier's durable marks)."""
    refs = core.refs
    rows = [(SnapRow(root, row.get("step"), float(row.get("time", 0.0)), {}, None, str(row.get("ref", "")), False),
             row) for root, row in refs.catalog_iter(bad=[])]
    held = {r for _, r in refs.list()} | {r for _, r in refs.tags()} | refs.pins() | refs.tier_rows.evicted()
    if durable is None:
        durable = refs.tier_rows.durable([sr.root for sr, _row in rows])
    safe = _safe_times(core, rows, durable)
    return [sr.root for sr, _row in rows
            if sr.root in durable and sr.root not in held and safe.get(sr.ref, sr.time) > sr.time]


def is_tier_table(core: Core) -> bool:
    """Whether `core`'s table is a local tier's (it has queued uploads): where tier-only
    snapshots are expired once superseded."""
    return core.refs.tier_rows.upload_last_seq() > 0


def superseded_tier_only(core: Core, job: str) -> bool:
    """Whether `job` has a tier-only snapshot in this tier's catalog that retention_plan
    would expire (a prune of the job has something to do even without rules)."""
    return is_tier_table(core) and any(not d["keep"] and d["why"] == ["tier-only, superseded"]
                                       for d in retention_plan(core, core.refs.wall_now()) if d["job"] == job)


def plan_expiry(core: Core, now: float, records: dict | None = None, bad: list | None = None) -> list[bytes]:
    """Roots that retention no longer keeps (see retention_plan)."""
    return [d["root"] for d in retention_plan(core, now, records, bad) if not d["keep"]]


def plan_gc(core: Core[GcTable], *, dry_run: bool, began: float, progress: bool = False, beat=None) -> GCPlan:
    """Steps 2-4: expire (a dry run only computes what would expire), mark, list."""
    rep = GCReport(dry_run=dry_run)
    refs = core.refs
    rules = refs.retention_all()
    queued = {} if dry_run else refs.prune_requests()  # every job's rules apply: read before the catalog
    bad: list = []
    decisions = retention_plan(core, refs.wall_now(), rules, bad)  # ages on the table's clock, like commits
    doomed = [d["root"] for d in decisions if not d["keep"]]
    if dry_run:  # what was decided for each snapshot and why (tsck gc --dry-run prints it)
        rep.snapshots = [{**d, "root": d["root"].hex()} for d in decisions]
    rep.malformed_rows = [r.hex() for r, _e in bad]
    expired = doomed if dry_run else refs.catalog_expire(doomed, rules=rules, served=queued)
    rep.expired = [r.hex() for r in expired]
    if not dry_run:
        # The history follows what is kept: log(), REF@STEP and restore_latest() then
        # cost what retention keeps, not every snapshot ever taken.
        rep.reflog_compacted = refs.compact_history()
    k0 = kept_roots(core, exclude=set(expired) if dry_run else None)
    rep.kept_snapshots = len(k0)
    marked, visited = Marked(), NodeSet()
    bar = progress_bar(progress, "gc: mark")
    t0 = time.monotonic()
    rep.reachable_objects = mark(core, k0, marked, visited, bar)
    if bar is not None:
        bar.close()
    marked.freeze()
    rep.mark_seconds = time.monotonic() - t0
    t0 = time.monotonic()
    spool = tempfile.TemporaryFile(mode="w+", prefix="tsck-gc-")
    try:
        bar = progress_bar(progress, "gc: list")
        for kind in KINDS:
            for o in iter_unreachable(core, marked, kind, before=began, bar=bar, strays=rep.strays):
                spool.write(f"{kind} {o.digest.hex()} {o.size}\n")
                rep.candidates += 1
            if beat is not None:
                beat.check()
        if bar is not None:
            bar.close()
    except BaseException:
        spool.close()
        raise
    rep.list_seconds = time.monotonic() - t0
    spool.seek(0)
    return GCPlan(began, k0, marked, visited, spool, rep)


def _count(rep: GCReport, kind: str, size: int) -> None:
    rep.deleted_objects += 1
    rep.deleted_bytes += size
    if kind == "blocks":
        rep.deleted_block_bytes += size
    rep.deleted_by_kind[kind] = rep.deleted_by_kind.get(kind, 0) + 1


def _dry_report(core: Core, plan: GCPlan) -> GCReport:
    try:
        return _count_plan(core, plan)
    finally:
        plan.close()


def _count_plan(core: Core, plan: GCPlan) -> GCReport:
    rep = plan.report
    for line in plan.spool:
        kind, hexd, size = line.split()
        _count(rep, kind, int(size))
        if len(rep.would_delete) < 10000:
            rep.would_delete.append(core.assets.object_key(kind, bytes.fromhex(hexd)))
    return rep


def execute_gc(core: Core, plan: GCPlan, *, lease: "Lease", progress: bool = False,
               phase_objects: int | None = None, phase_seconds: float | None = None) -> GCReport:
    """Steps 5-8, in deletion phases of at most `phase_objects` deletions or
    `phase_seconds` of deleting: each phase freezes (epoch odd), re-marks what was
    published since the plan's mark or the last re-mark, deletes a share of the
    candidates that nothing reaches, each request within the lease, and thaws
    (epoch even) keeping the lock. Writers a phase fences wait for that phase only.
    The plan is closed on return (its spool is read once)."""
    try:
        return _execute(core, plan, lease=lease, progress=progress, phase_objects=phase_objects,
                        phase_seconds=phase_seconds)
    finally:
        plan.close()


def _execute(core: Core, plan: GCPlan, *, lease: "Lease", progress: bool, phase_objects: int | None,
             phase_seconds: float | None) -> GCReport:
    rep = plan.report
    # None: the module's limits as they are at the call (the harness shrinks them to make
    # many phases out of a small store).
    phase_objects = PHASE_OBJECTS if phase_objects is None else phase_objects
    phase_seconds = PHASE_SECONDS if phase_seconds is None else phase_seconds
    if rep.candidates == 0:
        # Nothing to delete: no deletion phase, so writers are not fenced. (A gc loop
        # that froze on every run kept a writer re-validating; benches/bench_gc_put.py.)
        rep.temp_files_removed = core.assets.sweep_temp(plan.began - lease.seconds)
        return rep
    t_sweep = time.monotonic()
    bar = progress_bar(progress, "gc: sweep", total=rep.candidates)
    # the plan's walked nodes stay as they are; the re-marks' go to an overlay
    walked, visited = set(plan.kept), NodeSet(base=plan.visited)
    remarks: list[Marked] = []  # one per phase: what the commits published meanwhile reach
    phase = {"open": False, "deleted": 0, "t0": 0.0}

    def open_phase() -> None:
        lease.removed = {}  # every deletion is noted (a phase that moves objects aside notes none: None)
        lease.freeze()
        rep.phases += 1
        log.debug("gc %s: deletion phase %d began (writers are fenced): %d candidates left", lease.owner,
                  rep.phases, rep.candidates - rep.deleted_objects - rep.rescued)
        # Every commit kept now and not yet walked (published since the plan's mark, or since
        # the last phase's re-mark): what it reaches is kept. Walks of earlier phases still
        # count: their marks only keep more.
        new = kept_roots(core) - walked
        extra = Marked()
        mark(core, new, extra, visited)
        extra.freeze()
        walked.update(new)
        remarks.append(extra)
        if rep.phases == 1:
            rep.temp_files_removed = core.assets.sweep_temp(plan.began - lease.seconds)
        phase.update(open=True, deleted=0, t0=time.monotonic())

    def close_phase() -> None:
        st = lease.thaw()
        phase["open"] = False
        if st is not None:
            before, after, removed = st
            if removed is not None:
                # This process ran the only deletion phase between the two even epochs and
                # knows all it deleted: the presence record survives it less those.
                core.assets.presence.carry(before, after, removed)

    def sweep(kind: str, batch: list) -> None:
        if not phase["open"]:
            open_phase()
        digests = [bytes.fromhex(h) for h, _s in batch]
        live = np.zeros(len(digests), dtype=bool)
        for extra in remarks:
            live |= extra.contains(kind, digests)
        todo = []
        for d, (_h, size), is_live in zip(digests, batch, live):
            if is_live:
                rep.rescued += 1
            else:
                todo.append((d, int(size)))
        # Parallel slices (one batched request each on object stores); the spool is in
        # commits -> nodes -> blocks order and a batch never mixes kinds, so a kind is
        # gone before the next starts.
        ds = [d for d, _s in todo]
        n = max(1, min(len(ds), core.settings.workers))
        for f in [core.pool.submit(lease.run, core.assets.delete_objects, kind, ds[i::n]) for i in range(n)]:
            f.result()
        lease.note_removed(kind, ds)
        for _d, size in todo:
            _count(rep, kind, size)
        phase["deleted"] += len(ds)
        if bar is not None:
            bar.update(len(batch))
            bar.set_postfix_str(f"{human_bytes(rep.deleted_bytes)} freed", refresh=False)
        if phase["deleted"] >= phase_objects or time.monotonic() - phase["t0"] >= phase_seconds:
            core.storage.sync()  # what this phase deleted is gone before writers may look again
            close_phase()

    limit = max(1, min(SWEEP_BATCH, phase_objects))
    kind, batch = None, []
    for line in plan.spool:
        k, hexd, size = line.split()
        if batch and (len(batch) >= limit or k != kind):
            sweep(kind, batch)
            batch = []
            lease.check()  # raises if another gc took the lock over: stop deleting
        kind = k
        batch.append((hexd, size))
    if batch:
        sweep(kind, batch)
    if bar is not None:
        bar.close()
    core.storage.sync()
    if phase["open"]:
        close_phase()
    rep.sweep_seconds = time.monotonic() - t_sweep
    return rep


def _refuse_if_rebuilding(core: Core, what: str) -> None:
    """A recover that began and has not finished: the table may lack snapshots that
    storage holds, and a gc by it would delete them. Checked here for a clear refusal
    before any work; the gc lock's own transaction checks it again (gc_begin), which is
    what makes a gc and a recover unable to overlap."""
    mark = core.refs.rebuild_unfinished()
    if mark is not None:
        raise RebuildUnfinished(rebuild_message(mark, what))


def _refuse_if_the_ref_table_knows_nothing(core: Core[GcTable]) -> None:
    """An empty ref table over a store that holds commits is a lost or wrong table, not a
    store with nothing to keep: gc would delete every snapshot (and recover would then
    find nothing). Deleting needs the table rebuilt first."""
    rt = core.refs
    if rt.born_with_store() or rt.catalog_roots() or rt.list() or rt.tags() \
            or rt.pins():
        return  # a table made with its store: empty means a fresh store (commits in flight)
    found = next(core.assets.list_objects("commits"), None)
    if found is not None:
        raise TsckError("gc refused: storage holds snapshots but the ref table knows none of them (a lost "
                        "or wrong ref table?); run `tsck recover` first, then gc; nothing was deleted")


def run_gc(core: Core[GcTable], *, dry_run: bool = False, progress: bool = False, lease: float = DEFAULT_LEASE,
           renew_every: float | None = None, grace: float = 0.0, phase_objects: int | None = None,
           phase_seconds: float | None = None) -> GCReport:
    """1-8: take the lock under a lease (not for a dry run), plan, execute, release.
    grace: objects younger than this (seconds) are left alone, so a writer whose
    snapshot is in flight keeps its new, not yet referenced objects (the fence keeps
    it safe either way; without a grace it re-uploads what gc removed)."""
    if not (isinstance(grace, (int, float)) and 0 <= grace < 1e9):
        raise InvalidArgument(f"gc grace must be a number of seconds >= 0, got {grace!r}")
    t_start = time.time()
    refs = core.refs
    _refuse_if_rebuilding(core, "gc --dry-run" if dry_run else "gc")
    if dry_run:
        now = core.storage.clock_now()
        rep = _dry_report(core, plan_gc(core, dry_run=True, began=now - grace, progress=progress))
        rep.temp_files = core.assets.temp_report(lease=lease, grace=grace, now=now)
        rep.seconds = time.time() - t_start
        return rep
    _refuse_if_the_ref_table_knows_nothing(core)
    with holding_gc_lock(core, lease=lease, renew_every=renew_every) as hold:
        owner = hold.owner
        log.debug("gc %s on %s: began (lease %gs, grace %gs)", owner, core.url, lease, grace)
        # began is compared with stored objects' mtimes, so it is read on the storage's
        # clock (a gc host's clock that is off would only cost writers re-uploads or
        # keep garbage longer: the fence, not the time, keeps data safe).
        plan = plan_gc(core, dry_run=False, began=core.storage.clock_now() - grace, progress=progress,
                       beat=hold)
        log.debug("gc %s: marked; %d snapshots expired, %d kept, %d candidates", owner, len(plan.report.expired),
                  plan.report.kept_snapshots, plan.report.candidates)
        rep = execute_gc(core, plan, lease=hold, progress=progress, phase_objects=phase_objects,
                         phase_seconds=phase_seconds)
        rep.seconds = time.time() - t_start
        hold.finish_fields = {"last_gc": {"at": refs.wall_now(), "deleted": rep.deleted_objects}}
    log.debug("gc %s: finished in %.1fs: deleted %d objects (%d bytes), %d reused by writers and kept",
              owner, rep.seconds, rep.deleted_objects, rep.deleted_bytes, rep.rescued)
    _note_reclaimed(core, rep)
    return rep


def _note_reclaimed(core: Core, rep: GCReport) -> None:
    """Record what was deleted, for `tsck du --plot`'s size over time: a picture's data,
    so a failure to record is logged, never raised."""
    if not rep.deleted_bytes:
        return
    try:
        core.refs.note_reclaimed(block_bytes=rep.deleted_block_bytes, total_bytes=rep.deleted_bytes)
    except Exception as e:  # noqa: BLE001 - the deletion itself is done and reported
        log.debug("not recorded for du --plot: %d bytes reclaimed (%s)", rep.deleted_bytes, e)


def prune_job(core: Core[GcTable], job: str, *, lease: float = DEFAULT_LEASE, renew_every: float | None = None,
              phase_objects: int | None = None, phase_seconds: float | None = None) -> GCReport:
    """Expire what `job`'s retention drops, and what the rules of every job whose
    prune is queued (RefTable.prune_request: it found the store busy) drop, and delete
    the objects only those snapshots held, under the gc lock and with gc's protocol
    (short deletion phases, each re-marking what was published meanwhile, fenced
    writers), so it is safe beside writers and an offline gc (GcBusy while one holds
    the lock). Storage is not listed: the candidates are the expired snapshots' own
    objects that the mark of every kept snapshot does not reach. What a killed prune
    leaves (expired rows whose objects were not yet deleted) is garbage the next
    `tsck gc` reclaims."""
    t_start = time.time()
    refs = core.refs
    rep = GCReport(dry_run=False)
    _refuse_if_rebuilding(core, "prune")
    rules = refs.retention_all()
    if job not in rules and not superseded_tier_only(core, job):
        return rep
    with holding_gc_lock(core, lease=lease, role="prune:", renew_every=renew_every) as hold:
        began = core.storage.clock_now()
        # The jobs whose prunes found the store busy are served here too, read before the
        # catalog is (their requests cover the snapshots committed before them).
        queued = refs.prune_requests()
        jobs = sorted({job} | (set(queued) & set(rules)))
        rep.jobs = jobs
        bad: list = []
        doomed = plan_expiry(core, refs.wall_now(), {j: rules[j] for j in jobs if j in rules}, bad)
        if job not in rules:  # (a job without rules prunes its superseded tier-only snapshots alone)
            doomed = [r for r in doomed if (refs.catalog_get(r, checked=False) or {}).get("job") == job]
        # A local tier's evicted snapshots have no objects here left to walk or delete
        # (read before the expiry, which drops their marks with their rows).
        evicted = refs.tier_rows.evicted()
        parts = refs.tier_rows.parts()
        expired = refs.catalog_expire(doomed, rules=rules, served=queued) if doomed or queued else []
        rep.expired = [r.hex() for r in expired]
        if not expired:
            hold.finish_fields = {"last_prune": {"at": refs.wall_now(), "job": job, "deleted": 0}}
            return rep
        rep.reflog_compacted = refs.compact_history()
        rep = _delete_only_theirs(core, [r for r in expired if r not in evicted], hold, began, rep, f"prune {job}",
                                  parts=parts, phase_objects=phase_objects, phase_seconds=phase_seconds,
                                  keep_undeletable=True)
        rep.seconds = time.time() - t_start
        hold.finish_fields = {"last_prune": {"at": refs.wall_now(), "job": job, "deleted": rep.deleted_objects}}
    log.debug("prune %s: expired %d snapshots, deleted %d objects (%d bytes) in %.2fs", job, len(rep.expired),
              rep.deleted_objects, rep.deleted_bytes, rep.seconds)
    _note_reclaimed(core, rep)
    return rep


def _delete_only_theirs(core: Core, gone: list, hold: "Lease", began: float, rep: GCReport, what: str, *,
                        parts: dict | None = None, phase_objects: int | None = None,
                        phase_seconds: float | None = None, keep_undeletable: bool = False) -> GCReport:
    """Delete the objects of the snapshots `gone` (no longer kept: expired, or evicted)
    that no kept snapshot reaches, with gc's deletion phases: storage is not listed, the
    candidates are found by walking those snapshots. parts: TierTable.parts() as read
    before their rows were dropped (a rank's tier walks a collective snapshot through its
    own part); None: read now. keep_undeletable: what deleted refs' tips reach counts as kept
    too (a prune: undelete works until the next gc)."""
    if parts is None:
        parts = core.refs.tier_rows.parts()
    k0 = kept_roots(core)
    rep.kept_snapshots = len(k0)
    marked, visited = Marked(), NodeSet()
    rep.reachable_objects = mark(core, k0, marked, visited)
    if keep_undeletable:  # read after k0: a ref deleted meanwhile was a tip in it
        k0 |= _mark_undeletable(core, k0, marked, visited, rep)
    marked.freeze()
    hold.check()
    # Nodes a kept snapshot reaches are in `visited`: walking with it skips them and
    # everything under them; blocks are checked against the mark one by one.
    found: dict[str, dict[bytes, int]] = {k: {} for k in KINDS}
    skip = NodeSet(base=visited)  # the gone snapshots' nodes must not count as kept ones
    for root in gone:
        try:
            for o in walk_commit(core.assets, root, verify=True, skip_nodes=skip, part=parts.get(root)):
                found[o.kind + "s"].setdefault(o.digest, o.nbytes or 0)
        except (IntegrityError, FormatError, UnreadableObject) as e:  # left for an offline gc
            log.warning("%s: snapshot %s not walked (%s); `tsck gc` reclaims it", what, root.hex()[:16], e)
    spool = tempfile.TemporaryFile(mode="w+", prefix="tsck-prune-")
    try:
        for kind in KINDS:  # commits, nodes, blocks: the order gc deletes in
            ds = list(found[kind])
            for d, live in zip(ds, marked.contains(kind, ds) if ds else []):
                if not live:
                    spool.write(f"{kind} {d.hex()} {found[kind][d]}\n")
                    rep.candidates += 1
        spool.seek(0)
    except BaseException:
        spool.close()
        raise
    return execute_gc(core, GCPlan(began, k0, marked, visited, spool, rep), lease=hold,
                      phase_objects=phase_objects, phase_seconds=phase_seconds)


def _mark_undeletable(core: Core, kept: set, marked: Marked, visited: NodeSet, rep: GCReport) -> set:
    """Mark what deleted refs' tips reach (reach.undeletable) -> those roots. One that is
    damaged could not be undeleted anyway: skipped, logged; an unreadable one stops the
    prune (it may be readable at the next)."""
    roots = undeletable(core) - kept
    for root in sorted(roots):
        try:
            rep.reachable_objects += mark(core, [root], marked, visited)
        except UnreadableObject:
            raise
        except TsckError as e:
            log.warning("deleted ref's snapshot %s is damaged (%s): undelete cannot bring it back", root.hex()[:16], e)
    return roots


def evict_snapshots(core: Core, roots: list, *, lease: float = DEFAULT_LEASE) -> GCReport:
    """A local tier's budget (tier.budget.fit_budget): drop the local copies of `roots`,
    snapshots the remote store holds, keeping their catalog rows, refs and history.
    Under the gc lock: mark them evicted in the tier's table (TierTable.evict_mark takes
    only roots marked durable and not queued), then delete what only they reach, with
    gc's protocol (a writer that reused one of those objects is fenced and writes it
    again). Reads of an evicted snapshot fall through to the remote (tier/reads.py's read_through)."""
    t_start = time.time()
    rep = GCReport(dry_run=False)
    _refuse_if_rebuilding(core, "eviction")
    with holding_gc_lock(core, lease=lease, role="evict:") as hold:
        began = core.storage.clock_now()
        gone = core.refs.tier_rows.evict_mark(roots)
        rep.expired = [r.hex() for r in gone]  # evicted here, not expired: their rows stay
        if gone:
            rep = _delete_only_theirs(core, gone, hold, began, rep, "local tier eviction")
        rep.seconds = time.time() - t_start
    return rep


def drop_parts(core: Core, roots: list, *, lease: float = DEFAULT_LEASE) -> GCReport:
    """The local tier of a rank other than 0: drop the catalog rows of `roots`, collective
    snapshots rank 0's tier no longer keeps (tier.collective.CollectiveTier.adopt), then delete what
    only they reached here (this rank's part, the replicas it held), with gc's protocol.
    TierTable.parts_expire drops only parts not queued for upload, in its transaction."""
    t_start = time.time()
    rep = GCReport(dry_run=False)
    _refuse_if_rebuilding(core, "the cleanup of a rank's tier")
    with holding_gc_lock(core, lease=lease, role="parts:") as hold:
        began = core.storage.clock_now()
        parts = core.refs.tier_rows.parts()
        evicted = core.refs.tier_rows.evicted()
        gone = core.refs.tier_rows.parts_expire(roots)
        rep.expired = [r.hex() for r in gone]
        if gone:
            rep = _delete_only_theirs(core, [r for r in gone if r not in evicted], hold, began, rep,
                                      "a rank's tier cleanup", parts=parts)
        rep.seconds = time.time() - t_start
    _note_reclaimed(core, rep)
    return rep
