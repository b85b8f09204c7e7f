"""Collective snapshots through local tiers: each rank's tier, the remote store behind.

Under torch.distributed with `open_store(remote, local=NODE_DIR)` on every rank:

    every rank   writes its own blocks and sub-tree to its own local tier (the collective
                 protocol of dist.py, unchanged; each rank under its own tier's gc fence)
    rank 0       writes the top nodes and the commit to its tier and moves its local ref
                 (the local publication), then hands the commit and the top nodes to the
                 others (one c10d key): every rank's tier can then read its own region of
                 the snapshot, and says what the snapshot is, without the remote
    every rank   queues its upload: rank 0 the snapshot, the others their part

    the uploader of a rank other than 0 (upload_part): its sub-tree's blocks, then its
                 nodes, skipping what the remote has; then it waits (bounded, with
                 backoff) for the remote catalog to list the snapshot, re-sending under
                 the new fence if a gc deletion phase ran meanwhile: then the snapshot is
                 durable for that rank
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

from .errors import IntegrityError, TsckError, UnreadableObject
from .walk import walk_commit, walk_tree

__all__ = ["CollectiveTier", "upload_part", "upload_world", "PART_WAIT"]

log = logging.getLogger(__name__)

# How long an uploader waits, without progress, for the other ranks' part of a
# collective snapshot (rank 0) or for rank 0's remote move (the others), seconds.
PART_WAIT = 900.0
_PAUSE = (0.1, 5.0)  # first and longest pause between two looks, seconds


class CollectiveTier:
    """What a collective put through local tiers does besides the protocol of dist.py,
    built by the Store for one call (dist.py calls it, and knows nothing of tiers)."""

    def __init__(self, core, uploader):
        self.core, self.uploader = core, uploader

    def top_blob(self, root: bytes, top_payloads: list) -> bytes:
        """Rank 0, after its local publication: the commit and the top nodes, for the others."""
        return msgpack.packb([self.core.assets.get_commit(root), list(top_payloads)])

    def adopt(self, root: bytes, blob: bytes) -> None:
        """A rank other than 0: store rank 0's commit and top nodes in this rank's tier.
        Each is stored under the address of its own bytes, and the commit must be `root`:
        nothing rank 0 sends can stand for another object."""
        body, payloads = msgpack.unpackb(blob)
        assets = self.core.assets
        for p in payloads:
            assets.put_node(p)
        got = assets.put_commit(body).digest
        if got != root:
            raise IntegrityError(f"rank 0 sent a commit object that is not snapshot {root.hex()[:16]} "
                                 f"(its bytes hash to {got.hex()[:16]})", reason="corrupt")
        assets.sync()

    def published(self, info, tree: bytes | None):
        """Every rank once the snapshot is published locally: queue its upload (rank 0,
        tree None: the snapshot; another rank: its part, the sub-tree `tree`)."""
        root = bytes.fromhex(info.root)
        self.uploader.enqueue(root, info.ref, info.step, part=tree)
        return dataclasses.replace(info, durable=False)


class _Pending(TsckError):
    """Objects of the snapshot that the remote does not hold yet (another rank uploads them)."""


def _pause(up, pause: float) -> None:
    with up._cond:
        if not up._stop:
            up._cond.wait(pause)
    if up._stop:
        raise TsckError("the uploader was stopped while it waited for the other ranks")


def upload_part(up, seq: int, entry: dict) -> None:
    """A rank other than 0: send this rank's part of a collective snapshot (blocks, then
    nodes), then wait for rank 0's remote move; the snapshot is durable for this rank then."""
    root, tree, local, remote = entry["root"], entry["part"], up.local, up.remote
    since, pause = time.monotonic(), _PAUSE[0]
    while not remote.refs.catalog_has(root):
        fence = up.publisher.fence()  # before the remote is asked about any object
        objs: dict = {"block": [], "node": [], "commit": []}
        seen: set[bytes] = set()
        for o in walk_tree(local.assets, tree, snapshot=root.hex(), verify=True):
            if o.digest not in seen:
                seen.add(o.digest)
                objs[o.kind].append(o.digest)
        up._send(objs, fence)
        # Rank 0 moves the remote ref once every part is there; a gc deletion phase that
        # ran meanwhile (the fence moved) may have removed this part: send it again.
        while not remote.refs.catalog_has(root) and up.publisher.fence() == fence:
            if time.monotonic() - since > PART_WAIT:
                raise TsckError(f"part of snapshot {root.hex()[:16]} uploaded, but rank 0 did not publish it in "
                                f"the remote store within {PART_WAIT:g}s")
            _pause(up, pause)
            pause = min(_PAUSE[1], pause * 2)
    local.refs.upload_done(seq, root)
    with up._cond:
        up._cond.notify_all()
    log.info("local tier: this rank's part of snapshot %s of ref %s is durable at %s", root.hex()[:16],
             entry.get("ref"), remote.url)


class _Nearest:
    """The local tier's Assets for rank 0's walk of a collective snapshot: a node the
    tier lacks (another rank's) is read from the remote store, checked there, and
    recorded; missing there too, the walk stops with _Pending. A node the tier holds
    damaged is the tier's fault, as in a single-process upload (IntegrityError)."""

    def __init__(self, local, remote):
        self.local, self.remote = local, remote
        self.theirs: list[tuple[str, bytes]] = []

    def __getattr__(self, name):
        return getattr(self.local, name)

    def get_node(self, d: bytes, *, verify: bool = True, snapshot=None, path=None, fence=None) -> bytes:
        try:
            return self.local.get_node(d, verify=verify, snapshot=snapshot, path=path, fence=fence)
        except (IntegrityError, UnreadableObject) as e:
            if getattr(e, "reason", None) != "missing":
                raise
        try:
            data = self.remote.get_node(d, verify=verify, snapshot=snapshot, path=path)
        except (IntegrityError, UnreadableObject) as e:
            if getattr(e, "reason", None) != "missing":
                raise
            raise _Pending(f"node {d.hex()[:16]} at {path or '(top)'}") from None
        self.theirs.append(("node", d))
        return data


def _survey(up, root: bytes, fence: int):
    """-> (this tier's objects of the snapshot, by kind; the others' objects, each seen in
    the remote after `fence` was read). _Pending when some are not there yet."""
    local, remote = up.local.assets, up.remote.assets
    nearest = _Nearest(local, remote)
    mine: dict = {"block": [], "node": [], "commit": []}
    seen: set[bytes] = set()
    blocks, nodes = [], []
    for o in walk_commit(nearest, root, verify=True):
        if o.digest in seen:
            continue
        seen.add(o.digest)
        (blocks if o.kind == "block" else nodes if o.kind == "node" else mine[o.kind]).append(o.digest)
    remote_nodes = {d for _, d in nearest.theirs}  # (known once the walk is over: a node is named before it is read)
    mine["node"] = [d for d in nodes if d not in remote_nodes]
    here = list(up.remote.pool.map(local.block_exists, blocks))
    mine["block"] = [d for d, h in zip(blocks, here) if h]
    theirs = [d for d, h in zip(blocks, here) if not h]
    missing = [d for d, ok in zip(theirs, up.remote.pool.map(remote.block_exists, theirs)) if not ok]
    if missing:
        raise _Pending(f"{len(missing)} block(s), e.g. {missing[0].hex()[:16]}")
    return mine, nearest.theirs + [("block", d) for d in theirs]


def _confirm(up, theirs: list) -> None:
    """Every object of `theirs` is in the remote now (asked of storage: a HEAD each)."""
    remote = up.remote.assets

    def there(kd) -> bool:
        kind, d = kd
        return up.remote.storage.exists(remote.object_key(kind, d))
    missing = [kd for kd, ok in zip(theirs, up.remote.pool.map(there, theirs)) if not ok]
    if missing:
        raise _Pending(f"{len(missing)} object(s) of the other ranks, e.g. {missing[0][0]} {missing[0][1].hex()[:16]}")


def _until_present(up, root: bytes, look):
    """look() until it stops raising _Pending (another rank's upload is still under way):
    with backoff, for up to PART_WAIT seconds without progress (the count of what is
    missing going down)."""
    since, pause, best = time.monotonic(), _PAUSE[0], None
    while True:
        try:
            return look()
        except _Pending as e:
            if str(e) != best:  # progress: what is missing changed
                best, since = str(e), time.monotonic()
            if time.monotonic() - since > PART_WAIT:
                raise TsckError(f"snapshot {root.hex()[:16]}: the other ranks' parts are not in the remote store "
                                f"after {PART_WAIT:g}s ({e} missing)") from None
            log.debug("snapshot %s: waiting for the other ranks' uploads (%s missing)", root.hex()[:16], e)
            _pause(up, pause)
            pause = min(_PAUSE[1], pause * 2)


def upload_world(up, seq: int, entry: dict, row: dict) -> None:
    """Rank 0: make a collective snapshot durable once every rank's part is in the remote."""
    root, local = entry["root"], up.local
    fence = up.publisher.fence()  # before the remote is asked about any object
    try:
        mine, theirs = _until_present(up, root, lambda: _survey(up, root, fence))
    except IntegrityError:
        if local.refs.catalog_get(root) is None:  # expired locally meanwhile (as upload.py says)
            up._expired(seq, root)
            return
        raise
    up._send(mine, fence)

    def revalidate(new_fence: int) -> None:
        # A gc deletion phase ran: everything again, under the new fence (the owners of
        # what it removed send it again when they see the fence move: upload_part).
        _until_present(up, root, lambda: _confirm(up, theirs))
        up._send(mine, new_fence)

    info = up.publisher.move_to(root, row, fence=fence, revalidate=revalidate)
    local.refs.upload_done(seq, root)
    with up._cond:
        up._cond.notify_all()
    log.info("local tier: collective snapshot %s of ref %s durable at %s", info.root[:16], info.ref,
             up.remote.url)
