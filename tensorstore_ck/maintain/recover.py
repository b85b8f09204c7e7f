"""recover: rebuild the ref table's catalog, refs, reflog and tags from storage.

The ref table is an index over what storage already says: every commit names
its job and ref, and every tag is also written to storage as ``tags/<hex of
name>`` (JSON {name, root, time}). After the LMDB file is lost, each ref is
restored at its newest commit with a reflog that lists its commits oldest
first, so ``log`` and ``REF@STEP`` work again. "Newest" follows the ref's
history: a commit comes after its parent (when that is still stored) whatever
the writers' clocks said (a clock stepped back must not put a ref on an old
snapshot); otherwise times and steps order them (gc removes expired commits, so
chains have gaps; forks; a commit whose ref move lost a race). The refs' moves
interleave by time and step, so the reflog's numbers follow a job's history
across its refs; retention ranks recover's moves within a ref only (see
retention.newest_first_order).
Refs and tags that still exist are left as they are, except a ref a killed
recover left on an intermediate commit: it is moved on, so running recover
again always ends where one uninterrupted run ends. A commit whose tree is not
all present (gc swept it, a crash cut it short) is never adopted, nor is the
earlier encoding of a put that lost a race (_one_per_put); the report says which
and why. Neither is a snapshot a user forgot nor a ref a user deleted
(their reflog records say so) while gc has not reclaimed them yet. Retention
rules and pins live only in the ref table and must be set again.

While it runs, and after it was stopped until a run finishes, the table carries a
rebuild mark (RefTable.rebuild_begin, set in recover's first transaction, before
anything is adopted): every gc and prune refuses (RebuildUnfinished), since a table
that lacks snapshots storage holds would have them deleted. recover does not start
while a gc holds the store (GcBusy; `wait` seconds for it to end).
"""

from __future__ import annotations

import heapq
import logging
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field

import msgpack

from ..core.core import Core
from ..core.roles import Rebuild
from ..core.walk import walk_commit
from ..errors import FormatError, GcBusy, IntegrityError, InvalidArgument, RefConflict, RefNotFound, UnreadableObject
from ..format.manifest import decode_commit
from ..format.names import validate_name
from ..refs.history import RECOVERED
from ..write.publish import TIMING_STATS

__all__ = ["RecoverReport", "REMOVED_BY_USER", "EARLIER_ENCODING", "run_recover", "incomplete", "commit_row"]

log = logging.getLogger(__name__)


# Why a commit a user removed (forget, delete-ref) is not adopted: RecoverReport.skipped.
REMOVED_BY_USER = "removed by a user (forget or delete-ref): not brought back"
# Why an unpublished commit of a put that lost a race is not adopted (_one_per_put).
EARLIER_ENCODING = ("an earlier encoding of the put that published {} (its move lost a race to another "
                    "writer's): not a snapshot of its own")


@dataclass
class RecoverReport:
    commits_found: int = 0
    catalog_rows_added: int = 0
    refs_restored: dict = field(default_factory=dict)   # name -> root hex
    tags_restored: dict = field(default_factory=dict)
    unreadable: list = field(default_factory=list)      # keys of commits/tags that did not verify
    skipped: dict = field(default_factory=dict)         # root hex -> why it was not adopted (incomplete)

    def to_json(self) -> dict:
        return asdict(self)




def _moved_by_recover(rt: Rebuild, ref: str, cur: bytes) -> bool:
    log = rt.reflog(ref)
    return bool(log) and log[-1].new == cur and log[-1].message == RECOVERED


def incomplete(core: Core, root: bytes, present: set) -> str | None:
    """Why the snapshot `root` cannot be adopted (a node unreadable, a block missing), or
    None: every node verified, every block present (recover, and a tag of a removed
    snapshot by its root: lifecycle.tag). present: blocks known to exist (filled in)."""
    try:
        for obj in walk_commit(core.assets, root, verify=True):
            if obj.kind == "block" and obj.digest not in present:
                if not core.assets.block_exists(obj.digest):
                    return f"block {obj.digest.hex()[:16]} of {obj.path or 'its tree'} is missing"
                present.add(obj.digest)
    except (IntegrityError, FormatError, UnreadableObject) as e:
        return f"its tree is incomplete: {e}"
    return None


def commit_row(c: dict) -> dict:
    """The catalog row of a snapshot, from its decoded commit."""
    st = c.get("stats") or {}
    return {"job": c["job"], "ref": c["ref"], "step": c["step"], "time": c["time"],
            "metrics": c["metrics"], "meta": c.get("meta") or {}, "parent": c.get("parent"),
            "tree": c["tree"], **{k: int(st.get(k, 0)) for k in
                                  ("bytes_total", "bytes_new", "blocks_total", "blocks_new")},
            **{k: int(st[k]) for k in ("stored_new", "put_us", "stall_us") if k in st}}


def _put_identity(c: dict) -> bytes:
    """What every encoding of one put shares. A put whose move lost the race re-encodes
    its commit with the winner as parent (publish.Publisher.commit): only the parent, the
    time and the timing stats change."""
    st = sorted((k, v) for k, v in (c.get("stats") or {}).items() if k not in TIMING_STATS)
    return msgpack.packb([c["job"], c["ref"], c["step"], c["tree"], c["metrics"], c.get("meta") or {}, st],
                         use_bin_type=True)


def _one_per_put(rt: Rebuild, found: list, forgotten: set, tagged: set, skipped: dict) -> list:
    """`found` ((root, commit) pairs) less the earlier encodings of a put: a put that lost
    races wrote one commit per try and publishes its last, and removes the others once
    its move is answered; a writer killed then, or a table or storage away then, leaves
    them (gc reclaims them). Adopted too, they would make one put several snapshots, and
    keep_last would count it as many and expire a snapshot it keeps. Of commits alike in
    everything but parent, time and timing (the same put, or puts of the same state at the
    same step, which are kept the more safely as one), the one the table has a row for or
    a tag names stays (every such one), else the newest; a put a user forgot stays
    forgotten whichever encoding the user named."""
    groups: dict = {}
    for root, c in found:
        groups.setdefault(_put_identity(c), []).append((root, c))
    out = []
    for same in groups.values():
        if len(same) == 1:
            out += same
            continue
        keep = [(root, c) for root, c in same if root in tagged or rt.catalog_has(root)]
        keep = keep or [max(same, key=lambda rc: (float(rc[1]["time"]), rc[0]))]
        kept = {root for root, _c in keep}
        user_removed = any(root in forgotten for root, _c in same)
        for root, _c in same:
            if root in kept:
                continue
            if user_removed:
                forgotten.add(root)
                skipped[root.hex()] = REMOVED_BY_USER
            else:
                skipped[root.hex()] = EARLIER_ENCODING.format(keep[-1][0].hex())
        out += keep
    return out


def _superseded_meanwhile(core: Core, rt: Rebuild, adopted: dict, listed: set, rep: RecoverReport) -> None:
    """What a put did while this run went on can undo an adoption. A put whose move lost a
    race writes its next encoding, publishes it and deletes the refused one: this run may
    have listed the refused one before the next existed and adopted it after (one put, two
    snapshots), even after its commit object was deleted (a row naming a missing commit).
    So the commits are listed again before the rebuild mark goes: an adopted one that is
    gone, or whose put published a later encoding since, loses its row (a forget record in
    its ref's reflog) unless a ref, tag or pin keeps it."""
    if not adopted:
        return
    now = {o.digest for o in core.assets.list_objects("commits", [])}
    ids = {_put_identity(c): root for root, c in adopted.items()}
    drop = {root: "its commit was deleted while recover ran" for root in adopted if root not in now}
    for root in now - listed:
        try:
            c = decode_commit(core.assets.get_commit(root, verify=True))
        except (ValueError, IntegrityError, FormatError, UnreadableObject):
            continue
        mine = ids.get(_put_identity(c))
        if mine is not None and mine != root and rt.catalog_has(root):
            drop.setdefault(mine, EARLIER_ENCODING.format(root.hex()))
    for root, why in drop.items():
        try:
            rt.forget(root, adopted[root]["ref"], message=f"recover: {why}")
        except (InvalidArgument, RefNotFound) as e:  # kept by a ref, a tag or a pin; or gone already
            log.warning("recover: adopted commit %s kept (%s): %s", root.hex()[:16], why, e)
            continue
        rep.catalog_rows_added -= 1
        rep.skipped[root.hex()] = why
        log.debug("recover: adopted commit %s dropped again: %s", root.hex()[:16], why)


def _history_order(items) -> list:
    """The ref's commits oldest first: every commit after its parent (when the parent is
    among them), otherwise by (time, step). A topological order, not a depth: gc deletes
    the commits of expired snapshots, so chains have gaps, and a commit whose parent is
    gone still follows older ones by time."""
    by_root = {root: it for it in items for root in [it[2]]}
    children: dict = {}
    waiting: dict = {}
    for t, st, root, row in items:
        parent = row.get("parent")
        if parent in by_root and parent != root:
            children.setdefault(parent, []).append(root)
            waiting[root] = 1
    ready = [(t, st, root) for t, st, root, _row in items if root not in waiting]
    heapq.heapify(ready)
    out = []
    while ready:
        _t, _st, root = heapq.heappop(ready)
        out.append(by_root[root])
        for c in children.get(root, []):
            waiting.pop(c, None)
            heapq.heappush(ready, (by_root[c][0], by_root[c][1], c))
    # A cycle cannot be built from addresses, but stored bytes are untrusted: what is
    # left (never ready) goes last, by time.
    done = {it[2] for it in out}
    out += sorted((it for it in items if it[2] not in done), key=lambda x: (x[0], x[1]))
    return out


def _begin(rt: Rebuild, owner: str, wait: float) -> None:
    """Set the rebuild mark; while a gc holds the store, wait up to `wait` seconds for
    it to end (a gc that marked before a commit was adopted would delete it)."""
    until = time.monotonic() + wait
    while True:
        try:
            prev = rt.rebuild_begin(owner)
            break
        except GcBusy as e:
            if time.monotonic() >= until:
                raise GcBusy(f"recover refused: {e}; run `tsck recover` again once it has ended "
                             "(nothing was changed)") from None
            time.sleep(min(1.0, max(0.05, until - time.monotonic())))
    if prev is not None:
        log.debug("recover: finishing the rebuild begun by %s", prev.get("owner"))


def run_recover(core: Core[Rebuild], *, progress: bool = False, wait: float = 0.0) -> RecoverReport:
    from ..util.progress import progress_bar
    rt = core.refs
    _begin(rt, f"recover:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}", wait)
    rep = RecoverReport()
    bar = progress_bar(progress, "recover: commits", unit="commit")
    by_ref: dict[str, list[tuple[float, int, bytes, dict]]] = {}
    strays: list = []
    present: set = set()  # blocks known to exist
    # What users removed (delete-ref, forget) stays removed while storage still holds it:
    # the reflog keeps those records. A lost ref table has none; then all comes back.
    deleted, forgotten = rt.removed()
    deleted_roots = {e.new for ref in deleted for e in rt.reflog(ref)}
    tags = list(core.assets.tags())
    tagged = {rec[1] for _key, rec in tags if not isinstance(rec, Exception)}
    found: list = []  # (root, commit) of every readable commit storage holds
    listed: set = set()  # every commit listed, readable or not
    adopted: dict = {}  # root -> commit: the rows this run added
    for o in core.assets.list_objects("commits", strays):
        if bar is not None:
            bar.update(1)
        root = o.digest
        listed.add(root)
        try:
            c = decode_commit(core.assets.get_commit(root, verify=True))
            validate_name(c["ref"])
        except (ValueError, IntegrityError, FormatError, UnreadableObject) as e:
            rep.unreadable.append(f"{core.assets.object_key('commits', root)}: {e}")
            log.warning("recover: commit %s is unreadable, left out: %s", root.hex()[:16], e)
            continue
        rep.commits_found += 1
        found.append((root, c))
    if bar is not None:
        bar.close()
    for root, c in _one_per_put(rt, found, forgotten, tagged, rep.skipped):
        if root in forgotten or (c["ref"] in deleted and (root in deleted_roots
                                                          or float(c["time"]) <= deleted[c["ref"]])):
            rep.skipped[root.hex()] = REMOVED_BY_USER
            continue
        why = incomplete(core, root, present)
        if why is not None:
            # A commit whose tree gc swept (written just after a gc began, its writer's
            # fenced move failed and it re-uploaded) or that a crash left half-written:
            # adopting it would name a snapshot that cannot be read.
            rep.skipped[root.hex()] = why
            log.debug("recover: commit %s not adopted: %s", root.hex()[:16], why)
            continue
        row = commit_row(c)
        if rt.catalog_put_if_absent(root, row):
            rep.catalog_rows_added += 1
            adopted[root] = c
        step = c["step"] if isinstance(c["step"], int) else -1
        by_ref.setdefault(c["ref"], []).append((float(c["time"]), step, root, row))
    moving: dict = {}  # ref -> [where it is, how many commits its history has, moved meanwhile]
    queues = []
    for ref, items in sorted(by_ref.items()):
        items = _history_order(items)
        roots = [root for _t, _s, root, _row in items]
        cur = rt.get_or_none(ref)
        if cur is not None and (cur not in roots[:-1] or not _moved_by_recover(rt, ref, cur)):
            log.debug("recover: ref %s left at %s (its newest commit, or set by a writer or a user)", ref,
                      cur.hex()[:16])
            continue  # at its newest commit, or placed there by a writer or a user: their view wins
        # A recover killed half-way left the ref on an intermediate commit: go on from
        # there, so a second run ends exactly where one uninterrupted run ends.
        start = 0 if cur is None else roots.index(cur) + 1
        moving[ref] = [cur, len(items), False]
        queues.append([(t, st, ref, root, row) for t, st, root, row in items[start:]])
    # Each ref moves along its own history; the refs' moves interleave by (time, step), so
    # the reflog's numbers follow the job's history across its refs too (what retention
    # counts as the order of a ref's recovered snapshots is the order of these moves).
    for _t, _s, ref, root, row in heapq.merge(*queues, key=lambda m: (m[0], m[1])):
        state = moving[ref]
        if state[2]:
            continue
        try:
            rt.compare_and_swap(ref, state[0], root, message=RECOVERED, catalog_row=row)
            state[0] = root
        except RefConflict:  # a writer moved it meanwhile: its view wins
            log.debug("recover: ref %s was moved by a writer meanwhile; left as it is", ref)
            state[2] = True
    for ref, (prev, n, conflict) in moving.items():
        if not conflict:
            rep.refs_restored[ref] = prev.hex()
            log.debug("recover: ref %s restored at %s (%d commits in its reflog)", ref, prev.hex()[:16], n)
    rep.unreadable += [f"{key}: not an object key" for key in strays]
    for key, rec in tags:
        if isinstance(rec, Exception):
            rep.unreadable.append(f"{key}: {rec}")
            continue
        name, root, _t = rec
        if rt.tag_get(name) is None and core.assets.has_commit(root):
            try:
                rt.tag_create(name, root)
                rep.tags_restored[name] = root.hex()
                log.debug("recover: tag %s restored at %s", name, root.hex()[:16])
            except RefConflict:
                pass
    _superseded_meanwhile(core, rt, adopted, listed, rep)
    # Every complete commit storage held when this run listed it now has its row (what
    # was written since came with its own ref move): gc may delete by the table again.
    rt.rebuild_finish()
    return rep
