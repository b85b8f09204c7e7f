"""A local tier's byte budget (open_store(local_budget=), docs/design/tiers.md, "Budget:
the tier's bytes"): what the tier holds, and the eviction of durable snapshots' local
copies until it fits (the local gc's machinery: gc.evict_snapshots)."""

from __future__ import annotations

import logging

from ..core.core import Core
from ..core.roles import CatalogReader
from ..core.walk import walk_commit
from ..errors import TsckError

__all__ = ["tier_bytes", "fit_budget"]

log = logging.getLogger(__name__)


def tier_bytes(local: Core) -> int:
    """The tier's stored bytes, as the budget counts them: every object (blocks, nodes,
    commits) as stored, found by listing them (no walk)."""
    return sum(b for _, b in local.assets.object_stats().values())


def fit_budget(local: Core[CatalogReader], budget: int, *, warn: bool = True, listed=None) -> list[bytes]:
    """Evict local copies until the tier's stored objects fit in `budget` bytes -> the
    roots evicted. Never what a queued upload or a local-only snapshot needs: only
    snapshots marked durable (and, with `listed`, -> the roots the remote catalog lists
    of those given, still listed there) are candidates, the older first, each ref's newest durable
    tip (and a tag's or pin's target) after every other, so they stay while the budget
    allows. The bytes an eviction frees are the objects no remaining snapshot reaches
    (counted by walking every snapshot of the tier; a put in flight's objects are not
    counted and not deleted). The deletion is a local gc (gc.evict_snapshots: the gc
    lock, its lease and fence), not files removed by hand: a put that reused an evicted
    object is fenced and writes it again. When what must stay exceeds the budget: a
    warning (warn=False: the caller, a put's make_room, says more), and nothing more is
    evicted; the next put waits for uploads or fails (Uploader.make_room)."""
    from ..maintain.gc import evict_snapshots
    total = tier_bytes(local)
    if total <= budget:
        return []
    refs = local.refs
    sizes = {kind: {o.digest: o.size for o in local.assets.list_objects(kind)} for kind in ("commits", "nodes", "blocks")}
    evicted, parts = refs.tier_rows.evicted(), refs.tier_rows.parts()
    rows = {root: row for root, row in refs.catalog_iter(bad=[])}
    held = {r for _, r in refs.list()} | {r for _, r in refs.tags()} | refs.pins()
    roots = (set(rows) | held) - evicted
    queued = {e["root"] for _, e in refs.tier_rows.upload_pending()}
    durable = refs.tier_rows.durable(roots) - queued
    if listed is not None and durable:
        # Only what the remote catalog still lists: a durable snapshot its retention has
        # expired there since has no copy but this one (the tier's prune expires it too).
        durable = set(listed(durable))
    # What each snapshot reaches here, and how many snapshots reach each object.
    reach: dict[bytes, set] = {}
    count: dict[tuple, int] = {}
    for root in roots:
        objs = set()
        try:
            for o in walk_commit(local.assets, root, verify=False, part=parts.get(root)):
                objs.add((o.kind + "s", o.digest))
        except (TsckError, OSError):
            durable.discard(root)  # not whole here: left to fsck, and kept
        reach[root] = objs
        for k in objs:
            count[k] = count.get(k, 0) + 1
    tips = {r for _, r in refs.list()} | {r for _, r in refs.tags()} | refs.pins()

    def order(root: bytes):
        row = rows.get(root) or {}
        return (root in tips, float(row.get("time", 0.0)), root)

    now, chosen = total, []  # objects no snapshot reaches (a put in flight's) count: they take the space
    for root in sorted(durable, key=order):
        if now <= budget:
            break
        for k in reach[root]:
            count[k] -= 1
            if count[k] == 0:
                now -= sizes[k[0]].get(k[1], 0)
        chosen.append(root)
    if now > budget and warn:
        log.warning("local tier: its budget of %d bytes cannot hold what must stay local (%d bytes: snapshots not "
                    "yet uploaded, or local-only); nothing more is evicted", budget, now)
    if not chosen:
        return []
    rep = evict_snapshots(local, chosen)
    gone = [bytes.fromhex(r) for r in rep.expired]
    log.debug("local tier: evicted the local copies of %d durable snapshots (%d bytes) to fit the budget of %d "
              "bytes; their reads go to the remote store", len(gone), rep.deleted_bytes, budget)
    return gone
