"""Packs that keep dedup (docs/design/scaling.md, "Packs").

A pack holds many small tensors in one block (plan.pack_leaves). Written whole, it would
be written again whenever one of its tensors changed, and a frozen tensor packed beside a
trained one would be stored again every snapshot. So, when a plan's blocks are written
(Publisher.write_blocks):

- each packed tensor's bytes are hashed (BLAKE3); one whose bytes a stored pack already
  holds (PartIndex: content hash -> that part, learned from the packs this store wrote
  and from the snapshots it was told of) names that part, `[old pack, offset, its
  length]`, and is not written. A part learned from a stored manifest is only what a
  writer claimed (LEAF `h` is untrusted input): it is named only once this process has
  read its pack (verified) and found the part's bytes hash to `h` (once per pack);
- new packs form from the rest only, in state order (a planned pack none of whose
  tensors is found stays as planned: staged, it is written from the staging buffer);
- a pack of which this snapshot would name less than LIVE_SHARE of the bytes is not
  named: those tensors go into new packs. So every pack a snapshot names is at least
  LIVE_SHARE its own; an old pack dies with the snapshots that name it, and gc deletes it.

Each part a writer names carries its content hash (LEAF `h`), so that a later writer
learns a snapshot's parts from its manifest without reading its packs.
"""

from __future__ import annotations

import blake3
import numpy as np

from ..core.partindex import PartIndex
from ..errors import IntegrityError, SnapshotAborted

__all__ = ["LIVE_SHARE", "find_parts", "reuse_parts", "learn", "learn_written", "gathered", "unwrite", "reused_packs",
           "PartsGone"]

# A snapshot names a stored pack's parts only if they are at least this share of its bytes.
# Bounds: the packs one snapshot names hold at most 1/LIVE_SHARE its packed bytes, and the
# bytes rewritten out of abandoned packs are at most LIVE_SHARE / (1 - LIVE_SHARE) of the
# bytes that changed (scaling.md, "Packs").
LIVE_SHARE = 0.5


class PartsGone(SnapshotAborted):
    """A gc deletion phase removed a pack whose parts this snapshot names (found when the
    fenced move re-validates): the put writes those tensors into new packs and tries again."""

    def __init__(self, packs):
        super().__init__(f"a gc deletion phase removed {len(packs)} pack(s) this snapshot named parts of; "
                         "nothing was published, take it again")
        self.packs = list(packs)


def learn(index: PartIndex, assets, root: bytes, rank: int | None = None) -> None:
    """Add the parts a stored snapshot names to `index` (its nodes are read, not its packs;
    of a collective snapshot, rank `rank`'s tree: walk.packed_parts), once per snapshot. A
    snapshot that cannot be read adds nothing: it is only a hint."""
    if not index.learning(root):
        return
    from ..errors import TsckError
    from ..core.walk import packed_parts
    try:
        for h, pack, off, glen, n in packed_parts(assets, root, rank):
            index.add(h, pack, off, glen, n, checked=False)
    except (TsckError, OSError):
        pass


def _packs(plan) -> list:
    from .plan import Pack
    return [leaf for leaf in plan.leaves if type(leaf) is Pack]


def _hash_members(pack) -> None:
    """The pack's bytes ours (copied together unless staged), and each member's hash of
    exactly those bytes: what lands in the pack is what its `h` says."""
    if pack.raw is None:
        pack.gather()
    for m in pack.members:
        m.content = blake3.blake3(memoryview(pack.raw[m.pack_off:m.pack_off + m.nbytes])).digest()


def _dense(hits) -> bool:
    """Whether the parts found of one pack are at least LIVE_SHARE of it (each part once)."""
    return bool(hits) and sum({hit[1]: hit[3] for _m, hit in hits}.values()) >= LIVE_SHARE * hits[0][1][2]


def _there(assets, index: PartIndex, d: bytes, hits: list, fence: int | None) -> bool:
    """Whether pack `d` is there to be named. Parts of it learned only from a stored
    manifest are checked first: the pack is read (verified against its address) and each
    such part's bytes against its content hash (PartIndex.check_pack), once per pack and
    process; a missing or damaged pack is not named."""
    glen = hits[0][1][2]
    # There in these assets themselves: a read may be served from elsewhere (a tier's
    # reads fall through to the remote), which a snapshot published here cannot name.
    if not assets.has_block(d, glen, fence):
        return False
    if all(hit[4] for _m, hit in hits):
        return True
    data = np.empty(glen, dtype=np.uint8)
    try:
        assets.read_block_into(d, data, verify=True, fence=fence)
    except IntegrityError:
        return False
    index.check_pack(d, data)
    return True


def find_parts(assets, pool, fence: int | None, wanted: list) -> list:
    """For each (content hash, length) in `wanted`, the stored part to name instead of
    writing those bytes, (pack, offset, the pack's length), or None: only parts of packs
    this snapshot names a large share of (each part once, _dense), that are there, and
    that this process hashed itself (_there checks the others)."""
    index = assets.parts
    found: dict = {}  # pack address -> [(position in wanted, its part)]
    for i, (h, n) in enumerate(wanted):
        hit = index.get(h)
        if hit is not None and hit[3] == n:
            found.setdefault(hit[0], []).append((i, hit))
    dense = [d for d, ms in found.items() if _dense(ms)]
    there = list(pool.map(lambda d: _there(assets, index, d, found[d], fence), dense))
    index.forget([d for d, ok in zip(dense, there) if not ok])
    out: list = [None] * len(wanted)
    for d, ok in zip(dense, there):
        if not ok:
            continue
        ms = [(i, hit) for i, hit in found[d] if hit[4] or index.get(wanted[i][0]) == hit[:4] + (True,)]
        if _dense(ms):
            for i, hit in ms:
                out[i] = hit[:3]
    return out


def reuse_parts(plan, assets, pool, fence: int | None) -> None:
    """Before a plan's blocks are written: each packed tensor whose bytes a stored pack
    holds names that part (Leaf.reused), the packs form anew from the rest, and
    plan.leaves becomes what is to be written. Undone by unwrite()."""
    from .plan import Pack, pack_leaves
    packs = _packs(plan)
    if not packs or getattr(plan, "planned", None) is not None:
        return
    plan.planned = [(leaf, [(m, m.pack_off, m.raw, m.private) for m in leaf.members] if type(leaf) is Pack else None)
                    for leaf in plan.leaves]
    list(pool.map(_hash_members, packs))
    members = [m for p in packs for m in p.members]
    named = find_parts(assets, pool, fence, [(m.content, m.nbytes) for m in members])
    reused = []
    for m, hit in zip(members, named):
        if hit is not None:
            m.reused = hit
            reused.append(m)
    plan.reused = reused
    if not reused:
        return
    leaves, rest = [], []
    for leaf in plan.leaves:
        if type(leaf) is not Pack:
            leaves.append(leaf)
            continue
        keep = [m for m in leaf.members if m.reused is None]
        if len(keep) == len(leaf.members):
            leaves.append(leaf)  # as planned (a staged one: its span of the staging buffer)
            continue
        for m in keep:
            m.raw, m.private, m.pack = leaf.raw[m.pack_off:m.pack_off + m.nbytes], True, None
        rest.extend(keep)
    fresh = pack_leaves(rest, plan.pack_size or max(p.nbytes for p in packs))
    for leaf in fresh:
        if type(leaf) is Pack:
            leaf.gather()
    plan.gathered = [leaf for leaf in fresh if type(leaf) is Pack]
    plan.leaves = leaves + fresh


def gathered(plan) -> list:
    """The packs reuse_parts made of the leftovers of partly reused ones: their bytes are
    in a buffer of their own, not in a plan's staging buffer."""
    return getattr(plan, "gathered", None) or []


def reused_packs(plan) -> dict:
    """pack address -> its length, of the stored packs the plan names parts of."""
    return {m.reused[0]: m.reused[2] for m in getattr(plan, "reused", None) or ()}


def learn_written(plan, index: PartIndex) -> None:
    """After a plan's blocks are written: its packs' parts into the index (the parts it
    named again stay most recently used)."""
    from .plan import Pack
    for leaf in plan.leaves:
        if type(leaf) is Pack and leaf.results:
            d = leaf.results[0].digest
            for m in leaf.members:
                if m.content is not None:
                    index.add(m.content, d, m.pack_off, leaf.nbytes, m.nbytes)
    for m in getattr(plan, "reused", None) or ():
        index.get(m.content)


def unwrite(plan) -> None:
    """The plan as planned again, nothing written (before it is written anew)."""
    planned = getattr(plan, "planned", None)
    if planned is None:
        for leaf in plan.leaves:
            leaf.results = []
        return
    leaves = []
    for leaf, members in planned:
        leaf.results = []
        if members is not None:
            for m, off, raw, private in members:
                m.pack, m.pack_off, m.raw, m.private, m.reused, m.results = leaf, off, raw, private, None, []
        leaves.append(leaf)
    plan.leaves, plan.planned, plan.reused, plan.gathered = leaves, None, [], []
