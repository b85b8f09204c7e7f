"""Collective snapshots through local tiers: each rank's tier, the remote store behind.

Under torch.distributed with `open_store(remote, local=NODE_DIR)` on every rank:

    every rank   writes its own blocks and sub-tree to its own local tier (the collective
                 protocol of collective/, unchanged; each rank under its own tier's gc fence)
    rank 0       writes the top nodes and the commit to its tier and moves its local ref
                 (the local publication), then hands the commit and the top node to the
                 others (one c10d key), and each group of 16 ranks its path down the rank
                 tree (one key a group: collective.put.rank_paths): every rank's tier can then
                 read its own region of the snapshot, and says what the snapshot is,
                 without the remote
    every rank   queues its upload: rank 0 the snapshot, the others their part

    the uploader of a rank other than 0 (upload_part): its sub-tree's blocks, then its
                 nodes, skipping what the remote has: then the snapshot is durable for
                 that rank (its part is remote)
    the uploader of rank 0 (upload_world): reads the remote gc fence, then walks the
                 snapshot: what its tier holds (its sub-tree, the top, the commit) is sent
                 as by a single-process upload; every object it lacks (the other ranks'
                 sub-trees) must be found in the remote after that fence read (a node is
                 read from there, checked against its address; a block is asked with a
                 HEAD); what is not there yet is waited for with backoff, bounded, while
                 the other ranks upload; then the fenced move of the remote ref to the
                 same root (Publisher.move_to), whose re-validation asks for every
                 object again under the new fence

The remote ref therefore never names an object missing remotely: every object was
either sent and synced by rank 0 or seen present in the remote by rank 0 itself after
it read the fence its move is conditional on (docs/design/tiers.md, "Collective puts").
"""

from __future__ import annotations

import dataclasses
import logging
import time

import msgpack

from ..core.walk import by_kind, walk_commit, walk_tree
from ..errors import IntegrityError, TsckError, UnreadableObject
from .memory import TIER_ONLY, drop_superseded, tier_only
from .reads import Here, ReadChain, Remote, missing_only

__all__ = ["CollectiveTier", "upload_part", "upload_world", "PART_WAIT", "KEEP_PREFIX"]

log = logging.getLogger(__name__)

# How long rank 0's uploader waits, without progress, for the other ranks' parts of a
# collective snapshot, seconds.
PART_WAIT = 900.0
_PAUSE = (0.1, 5.0)  # first and longest pause between two looks, seconds
# The bytes of a root rank 0 sends for each snapshot its tier keeps (top_blob): 8 B a
# snapshot through the c10d Store, and a root is dropped only if no kept one starts alike.
KEEP_PREFIX = 8


class CollectiveTier:
    """What a collective put through local tiers does besides the protocol of collective/,
    built by the Store for one call (collective/put.py calls it, and knows nothing of tiers)."""

    own_tables = True  # each rank publishes in a table of its own (its tier's)

    def __init__(self, core, uploader, peers=None, schedule=None):  # peers: replicas.Peers; schedule: memory.Schedule
        self.core, self.uploader, self.peers, self.schedule = core, uploader, peers, schedule

    @staticmethod
    def write_fence(rank: int, fence: int, publisher) -> int:
        """The gc fence a rank writes its part under: rank 0's (its tier is the one the
        snapshot is published in), or for another rank its own tier's, another table's
        number."""
        return fence if rank == 0 else publisher.fence()

    @staticmethod
    def part0(tree: bytes) -> bytes:
        """Rank 0's own part, marked in its tier with the ref's move."""
        return tree

    def commit_meta(self, ref: str) -> dict:
        """Rank 0: what the commit's meta records for the tiers: with peer replicas, each
        rank's node (Peers.commit_meta: whom a restore asks for its copies); tier-only
        when the schedule keeps the snapshot out of the remote (every rank learns it
        from the commit it adopts)."""
        meta = {} if self.peers is None else self.peers.commit_meta()
        if self.schedule is not None and not self.schedule.durable(ref):
            meta[TIER_ONLY] = True
        return meta

    def post_top(self, ch, root: bytes, payloads: list, world: int) -> None:
        """Rank 0, published locally: the commit, the top node and the kept roots for all
        (*tier*), and each 16 ranks' path down the rank tree (*tierpath/{g}*, deleted by
        rank 0 once every rank acked), before the result."""
        from ..collective.put import rank_paths
        shared = self.top_blob(root, payloads[-1:])
        paths = {f"tierpath/{g}": path for g, path in rank_paths(payloads, world).items()}
        ch.posted += list(paths)
        ch.set_many(paths)
        ch.set("tier", shared)

    def adopt_posted(self, ch, root: bytes, part: bytes) -> None:
        """A rank other than 0, told the root: what rank 0 posted for it (one request), adopted."""
        from ..format.world import FAN
        self.adopt(root, *ch.get_many(["tier", f"tierpath/{ch.rank // FAN}"]), part)

    def make_room(self) -> None:
        """Before this rank writes its part: room under its tier's budget, as before a put
        (Uploader.make_room: it may wait for uploads, or raise TierFull with nothing
        written, which aborts the snapshot on every rank)."""
        self.uploader.make_room()

    def top_blob(self, root: bytes, top_payloads: list) -> bytes:
        """Rank 0, after its local publication: the commit and the top node, for the
        others (each reads its own path down the rank tree beside it: collective.put.rank_paths),
        and the snapshots of the job that rank 0's tier keeps, which the others' tiers
        follow: its catalog rows less what the job's retention drops now (ref tips, tags,
        pins and the upload in flight stay), the same set whether or not rank 0's own
        prune has run yet (it runs in the background, and may lag more than a snapshot on
        a loaded host). They are sent as KEEP_PREFIX-byte prefixes: the word only keeps,
        so two roots alike that far keep both (a prefix never stands for a root to drop)."""
        from ..maintain.gc import plan_expiry
        refs = self.core.refs
        job = (refs.catalog_get(root, checked=False) or {}).get("job")
        rules = {j: r for j, r in refs.retention_all().items() if j == job}
        try:  # (without rules too: a tier-only snapshot the new one superseded is dropped)
            doomed = set(plan_expiry(self.core, refs.wall_now(), rules))
        except TsckError as e:  # a stored rule that does not decode: the rows as listed (the prune reports it)
            log.debug("local tier: job %s's retention not applied to the word for the other ranks: %s", job, e)
            doomed = set()
        kept = b"".join(r[:KEEP_PREFIX] for r, row in refs.catalog_iter(bad=[])
                        if row.get("job") == job and r not in doomed)
        return msgpack.packb([self.core.assets.get_commit(root), list(top_payloads), kept])

    def intend(self, part: bytes, args) -> None:
        """A rank other than 0, its part written and synced, before it says "done": the
        intent to upload `part` (TierTable.intent_put), kept until the snapshot's row
        (adopt) or its abort (abandon) is here. A rank killed between the two leaves it,
        and its next open uploads the part: rank 0 may have published the snapshot."""
        self.core.refs.tier_rows.intent_put(part, {"ref": args.ref, "step": args.step, "job": args.job})

    def abandon(self, part: bytes) -> None:
        """The snapshot was aborted: its part is nobody's to upload (a gc of the tier
        reclaims what nothing else holds)."""
        try:
            self.core.refs.tier_rows.intent_drop(part)
        except Exception as e:  # noqa: BLE001 - the abort is the outcome to raise; a part left queued is harmless
            log.warning("local tier: the intent to upload part %s of an aborted snapshot was not dropped (%s: %s); "
                        "the next open uploads it", part.hex()[:16], type(e).__name__, e)

    def adopt(self, root: bytes, blob: bytes, path: bytes, part: bytes) -> None:
        """A rank other than 0: store rank 0's commit, top node and this rank's path down
        the rank tree (`path`) in this rank's tier. Each is stored under the address of
        its own bytes, and the commit must be `root`: nothing rank 0 sends can stand for
        another object. Then the tier follows rank 0's: the snapshots of the job rank 0 no
        longer keeps are dropped here, in the background (Uploader.follow), once their
        parts are uploaded."""
        body, payloads, kept = msgpack.unpackb(blob)
        assets = self.core.assets
        for p in list(payloads) + list(msgpack.unpackb(path)):
            assets.put_node(p)
        got = assets.put_commit(body).digest
        if got != root:
            raise IntegrityError(f"rank 0 sent a commit object that is not snapshot {root.hex()[:16]} "
                                 f"(its bytes hash to {got.hex()[:16]})", reason="corrupt")
        assets.sync()
        # A catalog row (no ref) with this rank's part: this tier keeps the snapshot. gc,
        # fsck and the budget walk it through the part and what else is here (the other
        # ranks' sub-trees are in their tiers: walk.walk_commit(part=)).
        from ..format.manifest import decode_commit
        c = decode_commit(body)
        self.core.refs.tier_rows.catalog_put_part(root, {k: c.get(k) for k in (
            "job", "ref", "step", "time", "metrics", "meta", "parent", "tree")} | dict(c.get("stats") or {}), part)
        if isinstance(kept, bytes) and len(kept) % KEEP_PREFIX == 0:
            self.uploader.follow(c.get("job"), {kept[i:i + KEEP_PREFIX] for i in range(0, len(kept), KEEP_PREFIX)}
                                 | {root[:KEEP_PREFIX]})

    def agrees_after(self, info) -> bool:
        """Rank 0: whether this snapshot's publication ends in the copies' agreement
        (published(ch=)), which the others join once they hold the result: rank 0 posts
        the result first."""
        return self.peers is not None and tier_only(info.meta)

    def published(self, info, tree: bytes, rank0: bool, ch=None):
        """Every rank once the snapshot is published locally: queue its upload (rank 0: the
        snapshot; another rank: its part, the sub-tree `tree`); with replicas, send the
        part to the peers in the background. A tier-only snapshot with replicas is not
        queued: its part's copies are sent now, and the ranks agree through `ch` (the
        call's channel) whether every part has its copies; where one lacks them, every
        rank queues its part after all (the remote is then the copy the lost one was)."""
        root = bytes.fromhex(info.root)  # (rank 0's part is marked with its move, the others' by adopt)
        only = tier_only(info.meta)
        if not only:
            self.uploader.enqueue(root, info.ref, info.step, part=None if rank0 else tree)
        if self.peers is not None:
            sent = self.peers.replicate(root, tree)
            if only:
                if self.copies_agreed(ch, _sent_whole(sent), f"snapshot {info.root[:16]} of ref {info.ref}"):
                    self.core.refs.tier_rows.committed.add(root)  # (it stands in for the older ones now)
                else:
                    self.uploader.enqueue(root, info.ref, info.step, part=None if rank0 else tree)
        if self.schedule is not None and rank0:  # (the other ranks follow rank 0's tier: top_blob)
            drop_superseded(self.core, info.job)
        if root in self.core.refs.tier_rows.committed:
            self.uploader.lean_due()  # (after the prune: a budget's check then sees what stays)
        return dataclasses.replace(info, durable=False)

    @staticmethod
    def copies_agreed(ch, mine: bool, what: str) -> bool:
        """Every rank says whether its part's copies reached all its holders (`mine`); ->
        whether every rank's did. O(1) requests a rank: a counter of the ranks that said
        and one of those that failed; the rank that makes the first W posts the second's
        value, which every rank waits for (up to the call's timeout: a rank that never says
        counts as a failure). Without a channel (no other rank to ask), this rank's own."""
        if ch is None:
            return mine
        ch.extra += [k for k in _AGREE_KEYS if k not in ch.extra]  # (deleted with the call's keys)
        try:
            if not mine:
                ch.add("copies_bad", 1)
            if ch.add("copies_n", 1) == ch.world:
                ch.set("copies_all", str(ch.add("copies_bad", 0)).encode())
            until = time.monotonic() + ch.timeout
            while not ch.block(["copies_all"], until):
                if time.monotonic() >= until:
                    raise TsckError(f"not every rank said within {ch.timeout:g}s")
            bad = int(ch.get("copies_all"))
        except Exception as e:  # noqa: BLE001 - unknown is a failure: the snapshot goes to the remote
            log.warning("%s (tier-only): the ranks' agreement on their copies failed (%s: %s); this rank's part "
                        "is queued for upload", what, type(e).__name__, e)
            return False
        if bad:
            log.warning("%s (tier-only): %d rank(s)' part(s) lack a copy on a peer; every rank queues its part "
                        "for upload: the remote store keeps the snapshot in their place", what, bad)
        return bad == 0


# The keys of the copies' agreement (CollectiveTier.copies_agreed), in the call's channel.
_AGREE_KEYS = ("copies_n", "copies_bad", "copies_all")


def _sent_whole(sent) -> bool:
    """Whether Peers.replicate's future says every holder took the part; its failure
    (this rank's part unreadable in its own tier) is a copy missing, never the put's
    error: the snapshot is published."""
    try:
        return bool(sent.result())
    except Exception as e:  # noqa: BLE001 - told by copies_agreed's warning
        log.warning("this rank's part could not be sent to its holders: %s: %s", type(e).__name__, e)
        return False


class _Pending(TsckError):
    """Objects of the snapshot that the remote does not hold yet (another rank uploads them)."""


def _pause(up, pause: float) -> None:
    if not up.pause(pause):
        raise TsckError("the uploader was stopped while it waited for the other ranks")


def _part_objects(up, tree: bytes, snapshot: str) -> dict:
    """This rank's objects under its sub-tree `tree`, by kind, each once. A Replicated
    tensor's blocks are split among the ranks (each writes those it owns) and every
    rank's nodes name them all: the blocks this tier lacks are the others' to send. Rank
    0 moves the ref only once it saw each one in the remote."""
    local = up.local.assets
    objs = by_kind(walk_tree(local, tree, snapshot=snapshot, verify=True))
    here = list(up.remote.pool.map(local.block_exists, objs["block"]))
    objs["block"] = [d for d, h in zip(objs["block"], here) if h]
    return objs


def upload_part(up, seq: int, entry: dict) -> None:
    """A rank other than 0: send this rank's part of a collective snapshot (blocks, then
    nodes, skipping what the remote has); then it is durable *for this rank*. It does not
    wait for rank 0's remote move: rank 0 may never make it (its retention expired the
    snapshot before its upload, or it took a newer one first), and this rank's later
    parts, queued behind, are what rank 0 waits for then."""
    root, tree, local, remote = entry["root"], entry["part"], up.local, up.remote
    if entry.get("orphan"):
        return _upload_orphan(up, seq, entry)
    if not remote.refs.catalog_has(root):
        fence = up.read_fence()  # before the remote is asked about any object
        try:
            objs = _part_objects(up, tree, root.hex())
        except IntegrityError:
            # As for a whole snapshot: a gc of this tier may have expired the row (its
            # retention) and deleted the part meanwhile; otherwise the tier is damaged.
            if local.refs.catalog_get(root, checked=False) is None:
                up.expired(seq, root)
                return
            raise
        up.send(objs, fence)
    local.refs.tier_rows.upload_done(seq, root)
    up.notify()
    log.debug("local tier: this rank's part of snapshot %s of ref %s is in %s", root.hex()[:16],
              entry.get("ref"), remote.url)


def _upload_orphan(up, seq: int, entry: dict) -> None:
    """A part this rank wrote and said "done" for, and then died before the snapshot's
    row reached its tier (TierTable.intents_queue): the snapshot's root is unknown here,
    but rank 0 may have published it and waits for this part in the remote. Send what
    the remote lacks of it (conditional writes, as any part); nothing is marked durable
    here (this tier keeps no row of the snapshot). Its objects gone from the tier (a gc
    took them after the grace period) or damaged: nothing to send, the entry goes."""
    tree = entry["part"]
    fence = up.read_fence()
    try:
        objs = _part_objects(up, tree, f"(part {tree.hex()[:16]})")
    except (IntegrityError, UnreadableObject) as e:
        log.warning("local tier: this rank's part %s of a collective snapshot (ref %s, step %s), written before a "
                    "restart, is not whole here (%s): not uploaded", tree.hex()[:16], entry.get("ref"),
                    entry.get("step"), e)
        up.local.refs.tier_rows.upload_drop(seq)
        return
    up.send(objs, fence)
    up.local.refs.tier_rows.upload_drop(seq)
    up.orphans += 1
    up.notify()
    log.debug("local tier: this rank's part %s of a collective snapshot (ref %s, step %s), written before a restart, "
              "is in %s", tree.hex()[:16], entry.get("ref"), entry.get("step"), up.remote.url)


def _nearest(up) -> ReadChain:
    """The local tier's objects for rank 0's walk of a collective snapshot: a node the
    tier lacks (another rank's) is read from the remote store, checked there, and
    recorded (its tally); missing there too, the walk stops with _Pending. A node the
    tier holds damaged is the tier's fault, as in a single-process upload (IntegrityError)."""
    def pending(kind, d, path, err):
        return _Pending(f"{kind} {d.hex()[:16]} at {path or '(top)'}")
    return ReadChain([Here(up.local.assets), Remote(up.remote)], falls=missing_only,
                     exhausted=pending, lacks_by_design=True).tallied(record="remote")


def _survey(up, root: bytes, fence: int):
    """-> (this tier's objects of the snapshot, by kind; the others' objects, each seen in
    the remote after `fence` was read). _Pending when some are not there yet."""
    local, remote = up.local.assets, up.remote.assets
    nearest = _nearest(up)
    mine = by_kind(walk_commit(nearest, root, verify=True))
    blocks, nodes = mine["block"], mine["node"]
    theirs_read = nearest.tally.recorded
    remote_nodes = {d for _, d in theirs_read}  # (known once the walk is over: a node is named before it is read)
    mine["node"] = [d for d in nodes if d not in remote_nodes]
    here = list(up.remote.pool.map(local.block_exists, blocks))
    mine["block"] = [d for d, h in zip(blocks, here) if h]
    theirs = [d for d, h in zip(blocks, here) if not h]
    missing = [d for d, ok in zip(theirs, up.remote.pool.map(remote.block_exists, theirs)) if not ok]
    if missing:
        raise _Pending(f"{len(missing)} block(s), e.g. {missing[0].hex()[:16]}")
    return mine, theirs_read + [("block", d) for d in theirs]


def _confirm(up, theirs: list) -> None:
    """Every object of `theirs` is in the remote now (asked of storage: a HEAD each)."""
    remote = up.remote.assets

    def there(kd) -> bool:
        kind, d = kd
        return up.remote.storage.exists(remote.object_key(kind + "s", d))
    missing = [kd for kd, ok in zip(theirs, up.remote.pool.map(there, theirs)) if not ok]
    if missing:
        raise _Pending(f"{len(missing)} object(s) of the other ranks, e.g. {missing[0][0]} {missing[0][1].hex()[:16]}")


class _Skipped(Exception):
    """The snapshot waited for was dropped from the queue meanwhile (the backlog rule)."""


def _until_present(up, root: bytes, look, give_up=None):
    """look() until it stops raising _Pending (another rank's upload is still under way):
    with backoff, for up to PART_WAIT seconds without progress (the count of what is
    missing going down). give_up(seconds without progress) -> True between tries: stop
    waiting (_Skipped)."""
    since, pause, best = time.monotonic(), _PAUSE[0], None
    while True:
        try:
            return look()
        except _Pending as e:
            if str(e) != best:  # progress: what is missing changed
                best, since = str(e), time.monotonic()
            if give_up is not None and give_up(time.monotonic() - since):
                raise _Skipped() from None
            if time.monotonic() - since > PART_WAIT:
                raise TsckError(f"snapshot {root.hex()[:16]}: the other ranks' parts are not in the remote store "
                                f"after {PART_WAIT:g}s ({e} missing)") from None
            log.debug("snapshot %s: waiting for the other ranks' uploads (%s missing)", root.hex()[:16], e)
            _pause(up, pause)
            pause = min(_PAUSE[1], pause * 2)


def upload_world(up, seq: int, entry: dict, row: dict) -> None:
    """Rank 0: make a collective snapshot durable once every rank's part is in the remote."""
    root, local = entry["root"], up.local
    fence = up.read_fence()  # before the remote is asked about any object

    def look():
        if local.refs.catalog_get(root) is None:  # (a node of its own deleted looks like another rank's)
            raise IntegrityError(f"snapshot {root.hex()[:16]} left the local catalog", reason="missing")
        return _survey(up, root, fence)

    def superseded(stalled: float) -> bool:
        # A part that never comes (its rank was killed after the snapshot was published,
        # its tier lost) must not hold the queue for PART_WAIT: once a newer snapshot of
        # the ref is queued, the backlog rule drops this one, at once where retention
        # would expire it, else once the part has stalled (Uploader.skip_superseded).
        return up.skip_superseded(seq, entry, local.refs.tier_rows.upload_pending(), part_stalled=stalled)
    try:
        mine, theirs = _until_present(up, root, look, give_up=superseded)
        up.send(mine, fence)
    except _Skipped:
        return
    except IntegrityError:
        # Missing or damaged here: the snapshot may have left the tier on purpose
        # meanwhile; else the tier is damaged (Uploader._gone_meanwhile).
        if up.gone_meanwhile(seq, root):
            return
        raise

    def revalidate(new_fence: int) -> None:
        # A gc deletion phase ran: everything again, under the new fence (what it removed
        # of the others' parts is waited for, bounded: its owners sent it once).
        _until_present(up, root, lambda: _confirm(up, theirs))
        up.send(mine, new_fence)

    try:
        info = up.publisher.move_to(root, row, fence=fence, revalidate=revalidate)
    except IntegrityError:
        if up.gone_meanwhile(seq, root):
            return
        raise
    log.debug("local tier: collective snapshot %s of ref %s durable at %s", info.root[:16], info.ref,
              up.remote.url)
    up.after_durable(seq, root, row)
