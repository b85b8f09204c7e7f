"""Walk a snapshot's Merkle DAG without loading tensor data (gc mark, fsck, diff).

Yields the objects under a commit with the state path that reaches them.
Nodes are read (and verified) because they hold the addresses; blocks are
only named, with the byte length the manifest expects of them. Every node is
decoded by the manifest grammar (format/tree.py), the same decoder checkout
uses, so gc and fsck accept exactly the trees checkout accepts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from ..errors import FormatError, IntegrityError
from ..format import tree
from ..format.dtypes import DTYPE_ITEMSIZES
from ..format.manifest import decode_commit, decode_node
from ..format.tree import format_path
from ..format.world import bucket_entries, fan_children, fan_height, rank_tops
from .roles import WalkReader

__all__ = ["Obj", "by_kind", "walk_commit", "walk_parted", "walk_tree", "iter_leaves", "read_node", "MAX_LEAF_PATHS",
           "PackedPart", "packed_parts"]


@dataclass(frozen=True, slots=True)
class Obj:
    kind: str            # "commit" | "node" | "block"
    digest: bytes
    path: str            # where in the state it sits ("" for the commit and top node)
    nbytes: int | None = None  # blocks: the length the manifest expects
    elsewhere: bool = False    # outside the part this store holds whole (walk_commit(part=)): may be absent
    itemsize: int = 0          # blocks: the element size of the tensor naming it (what the put coded it by)
    part: tuple | None = None  # a pack named by a leaf with a content hash: (offset, length, LEAF h) (fsck)


def read_node(assets: WalkReader, d: bytes, path: tuple, depth: int, *, snapshot: str, verify: bool = True,
              world: bool = False):
    """Fetch, verify and decode one node through the grammar. An undecodable node is
    an IntegrityError naming it; a malformed value is a FormatError naming the path."""
    data = assets.get_node(d, verify=verify, snapshot=snapshot, path=format_path(path))
    try:
        raw = decode_node(data)
    except FormatError as e:
        raise assets.node_error(d, f"undecodable manifest node: {e}", snapshot=snapshot,
                                path=format_path(path)) from None
    return tree.decode_node_value(raw, path, depth, world=world)


def _itemsize(leaf) -> int:
    """The element size of a leaf's dtype: the put coded its blocks by it (a pack holds
    tensors of one element size), and a copy to another store codes them again by it."""
    if type(leaf) is tree.Array:
        return leaf.dtype.itemsize if leaf.dtype is not None else 0
    return DTYPE_ITEMSIZES.get(leaf.dt, 0)


def _leaf_blocks(leaf) -> Iterator[tuple[bytes, int, tuple | None]]:
    chunks = leaf.chunks if isinstance(leaf, tree.Global) else (leaf,)
    for c in chunks:
        part = (c.part[0], c.nbytes, c.content) if c.part is not None and c.content is not None else None
        for d, n in c.stored_blocks():
            yield d, n, part


def _fan_roots(w: tree.World, path, depth) -> list:
    """The children of a version-2 multi-rank top: the roots of its two fan trees (rank
    tree: its items are the rank trees, walked at the top's path and depth; range index:
    its items are the bucket nodes, plain trees)."""
    return [(root, path, depth, ("fan", what, fan_height(n, w.fan), 0, n, w.fan, path, depth, w.world))
            for root, what, n in ((w.rank_tree, "rank tree", w.world), (w.range_index, "chunk index", w.nbuckets))]


def _nodes(assets: WalkReader, top: bytes, *, snapshot: str, verify: bool, skip_nodes: set | None = None):
    """Depth first over the nodes under `top`: (digest, path, read) per node, where
    read() fetches and decodes the node and returns its leaves, [(path, Tensor | Array
    | Global)]; its children are visited next. The digest comes before the read, so a
    caller can account for a node that then fails to read. Nodes in `skip_nodes` are
    neither yielded nor descended; new nodes are added to it.

    Each node is yielded once, with the first path (in state order) that reaches it:
    a DAG may name one node at many paths (40 nodes can name 2^40). A node met again
    deeper than before is decoded and descended again at that depth without being
    yielded, so the depth cap refuses exactly what checkout refuses (at most
    MAX_DEPTH + 1 times per node). With `skip_nodes` a node met again is skipped
    whatever its depth, so no depths are kept: memory stays that of skip_nodes (gc's
    compact NodeSet), not a dict entry per node of the walk."""
    deepest: dict[bytes, int] = {}
    stack = [(top, (), 0, True)]
    while stack:
        d, path, depth, world = stack.pop()
        if skip_nodes is not None:
            if d in skip_nodes:
                continue
            skip_nodes.add(d)
            again = False
        else:
            again = d in deepest
            if again and depth <= deepest[d]:
                continue
            deepest[d] = depth
        children: list = []

        def read(d=d, path=path, depth=depth, world=world, children=children):
            if type(world) is tuple and world[0] == "fan":  # a fan-tree node: its item count fixes its shape
                _f, what, h, lo, n, fan, wpath, wdepth, wn = world
                value = read_node(assets, d, path, depth, snapshot=snapshot, verify=verify)
                kids = fan_children(value, min(fan, -(-(n - lo) // fan ** h)), what)
                if h:
                    children.extend((k, path, depth, ("fan", what, h - 1, lo + j * fan ** h, n, fan, wpath, wdepth,
                                                      wn)) for j, k in enumerate(kids))
                elif what == "chunk index":  # the buckets: checked as checkout reads them
                    children.extend((k, wpath, wdepth, ("bucket", wn)) for k in kids)
                else:
                    children.extend((k, wpath, wdepth, False) for k in kids)
                return []
            value = read_node(assets, d, path, depth, snapshot=snapshot, verify=verify, world=world is True)
            if type(world) is tuple:
                def deref(v, dp):
                    while type(v) is tree.Ref:
                        v = read_node(assets, v.digest, path, depth + dp, snapshot=snapshot, verify=verify)
                    return v
                bucket_entries(value, world[1], deref)
            leaves = []
            for p, dp, item in tree.visit(value, path, depth):
                if type(item) is tree.Ref:
                    children.append((item.digest, p, dp, False))
                elif type(item) is tree.World and item.ranks is None:
                    children.extend(_fan_roots(item, p, dp))
                elif type(item) is tree.World:
                    children.extend((r, p, dp, False) for r in item.ranks)
                    if item.index is not None:
                        children.append((item.index, p, dp, False))
                else:
                    leaves.append((p, item))
            return leaves

        if again:
            read()  # only for the depth check and the children's depths
        else:
            yield d, path, read
        stack.extend(reversed(children))


def _inlined(items) -> int:
    """The tensor bytes inlined in one node's leaves."""
    n = 0
    for _p, item in items:
        for leaf in item.chunks if type(item) is tree.Global else (item,):
            if leaf.inline is not None:
                n += len(leaf.inline)
    return n


def walk_tree(assets: WalkReader, top: bytes, *, snapshot: str, verify: bool = True,
              skip_nodes: set | None = None, absent_ok: bool = False, elsewhere: bool = False,
              inline: dict | None = None) -> Iterator[Obj]:
    """Every node and block under `top`, depth first. Nodes in `skip_nodes`
    (already walked elsewhere) are neither yielded nor descended; new nodes are
    added to it. absent_ok: a node that is missing here is passed over with what is
    under it (not yielded); a damaged one still raises. Blocks are yielded `elsewhere` with
    absent_ok or elsewhere (they may be in another store). inline: gets, per node read,
    the tensor bytes inlined in it (address -> bytes)."""
    for d, path, leaves in _nodes(assets, top, snapshot=snapshot, verify=verify, skip_nodes=skip_nodes):
        if absent_ok:
            try:
                items = leaves()
            except IntegrityError as e:
                if e.reason != "missing":
                    raise
                continue
            yield Obj("node", d, format_path(path))
        else:
            yield Obj("node", d, format_path(path))
            items = leaves()
        if inline is not None:
            inline[d] = _inlined(items)
        for p, item in items:
            fp, isz = format_path(p), _itemsize(item)
            for bd, nb, part in _leaf_blocks(item):
                yield Obj("block", bd, fp, nb, absent_ok or elsewhere, isz, part)


def walk_commit(assets: WalkReader, root: bytes, *, verify: bool = True, skip_nodes: set | None = None,
                part: bytes | None = None, inline: dict | None = None) -> Iterator[Obj]:
    """The commit object itself, then everything under its tree. part: the sub-tree of
    a collective snapshot whose nodes this store holds (a rank's own part, in its local
    tier: TierTable.parts), walked first, a missing node of it an error; of the rest,
    only the nodes present here are walked (the commit and top nodes, the replicas a rank
    keeps). Every block is yielded `elsewhere`: the other ranks'
    are in their own tiers, and a rank's part names the blocks of its Replicated tensors
    that the other ranks wrote (each writes those it owns). inline: as walk_tree's."""
    yield Obj("commit", root, "")
    c = decode_commit(assets.get_commit(root, verify=verify))
    yield from walk_parted(assets, c["tree"], part, snapshot=root.hex(), verify=verify, skip_nodes=skip_nodes,
                           inline=inline)


def walk_parted(assets: WalkReader, top: bytes, part: bytes | None, *, snapshot: str, verify: bool = True,
                skip_nodes: set | None = None, inline: dict | None = None) -> Iterator[Obj]:
    """walk_tree of `top`; with `part`, as walk_commit(part=) says."""
    if part is None:
        yield from walk_tree(assets, top, snapshot=snapshot, verify=verify, skip_nodes=skip_nodes, inline=inline)
        return
    seen = skip_nodes if skip_nodes is not None else set()
    yield from walk_tree(assets, part, snapshot=snapshot, verify=verify, skip_nodes=seen, elsewhere=True,
                         inline=inline)
    yield from walk_tree(assets, top, snapshot=snapshot, verify=verify, skip_nodes=seen, absent_ok=True,
                         inline=inline)


def _describe(item) -> str:
    if type(item) is tree.Global:
        return f"{item.dt} {list(item.shape)} sharded"
    if type(item) is tree.Array:
        return f"{item.dtype.str if item.dtype.fields is None else item.dtype} {list(item.shape)}"
    return f"{item.dt} {list(item.shape)}"


MAX_LEAF_PATHS = 1 << 22  # tensor paths iter_leaves (diff) lists for one snapshot


def _leaf_paths(assets: WalkReader, top: bytes, *, snapshot: str, verify: bool, limit: int) -> Iterator:
    """(path, leaf) for every tensor/array path of the tree, shared nodes at each of
    their paths. Each (node, depth) is read once and the paths are counted first: a
    tree naming more than `limit` is a FormatError before any is listed."""
    info: dict = {}     # (digest, depth) -> (leaves [(relative path, item)], children [(rel, depth, digest)])
    total: dict = {}    # (digest, depth) -> leaf paths under it
    stack = [(top, (), 0, True, False)]
    while stack:
        d, path, depth, world, done = stack.pop()
        key = (d, depth)
        if done:
            leaves, kids = info[key]
            total[key] = len(leaves) + sum(total[(r, dp)] for _p, dp, r in kids)
            continue
        if key in info:
            continue  # a DAG has no cycles: a node met again is complete
        value = read_node(assets, d, path, depth, snapshot=snapshot, verify=verify, world=world)
        leaves, kids = [], []
        for p, dp, item in tree.visit(value, (), depth):
            if type(item) is tree.Ref:
                kids.append((p, dp, item.digest))
            elif type(item) is tree.World:
                kids.extend((p, dp, r) for r in rank_tops(item, lambda x: read_node(
                    assets, x, path + p, dp, snapshot=snapshot, verify=verify)))
            else:
                leaves.append((p, item))
        info[key] = (leaves, kids)
        stack.append((d, path, depth, world, True))
        stack.extend((r, path + p, dp, False, False) for p, dp, r in reversed(kids))
    n = total[(top, 0)]
    if n > limit:
        raise FormatError(f"snapshot {snapshot[:16]} names {n} tensor paths, more than {limit} "
                          "(nodes shared at many paths)")
    # Only the children that hold a path are listed (each at most `limit` times): a tree
    # of 2^40 paths to no tensor at all is counted 0 above, and must not be walked here.
    live: dict = {}
    todo = [(top, 0, ())] if n else []
    while todo:
        d, depth, prefix = todo.pop()
        leaves, kids = info[(d, depth)]
        for p, item in leaves:
            yield prefix + p, item
        keep = live.get((d, depth))
        if keep is None:
            keep = live[(d, depth)] = [(p, dp, r) for p, dp, r in reversed(kids) if total[(r, dp)]]
        todo.extend((r, dp, prefix + p) for p, dp, r in keep)


def _contents(leaf: tree.Leaf) -> list:
    """What names a leaf's bytes: its inline bytes, its block addresses, or for a part of a
    pack a PackedPart (its pack may differ where its own bytes do not: diff reads them)."""
    if leaf.inline is not None:
        return [leaf.inline]
    if leaf.part is not None:
        return [PackedPart(leaf.blocks[0], leaf.part[0], leaf.part[1], leaf.nbytes, leaf.content)]
    return list(leaf.blocks)


@dataclass(frozen=True)
class PackedPart:
    """Bytes [off, off + n) of the pack `digest` of raw length glen."""
    digest: bytes
    off: int
    glen: int
    n: int
    h: bytes | None = field(default=None, compare=False)  # LEAF h: checked when diff reads the part


def iter_leaves(assets: WalkReader, root: bytes, *, verify: bool = True,
                limit: int = MAX_LEAF_PATHS) -> dict[str, tuple[str, list]]:
    """path -> (dtype/shape summary, [block digests or inline bytes]) for every tensor or
    array of a snapshot (diff). A sharded tensor's chunks from every rank are gathered
    under its path, in order of their offsets. A node shared at several paths is listed
    at each; each node is read once, and a tree naming more than `limit` tensor paths
    is a FormatError."""
    snap = root.hex()
    c = decode_commit(assets.get_commit(root, verify=verify))
    out: dict[str, tuple[str, list]] = {}
    sharded: dict[str, list] = {}
    for p, item in _leaf_paths(assets, c["tree"], snapshot=snap, verify=verify, limit=limit):
        key = format_path(p)
        if type(item) is tree.Global:
            if key not in out:
                out[key] = (_describe(item), [])
            sharded.setdefault(key, []).extend(item.chunks)
        else:
            out[key] = (_describe(item), _contents(item))
    for key, chunks in sharded.items():
        blocks = []
        for ch in sorted(chunks, key=lambda ch: ch.offsets):
            blocks += _contents(ch)
        out[key] = (out[key][0], blocks)
    return out


def packed_parts(assets: WalkReader, root: bytes, rank: int | None = None) -> Iterator[tuple[bytes, bytes, int, int, int]]:
    """(content hash, pack, offset, pack length, part length) of every part of a pack a
    snapshot names with its content hash (LEAF `h`): what a writer names again instead of
    writing (packparts.PartIndex). Its nodes are read, never its packs. Of a collective
    snapshot, rank `rank`'s tree alone (the parts that rank wrote: what the same rank
    writes again); nothing without a rank, or for a rank the snapshot's world lacks."""
    snap = root.hex()
    top = decode_commit(assets.get_commit(root))["tree"]
    v = read_node(assets, top, (), 0, snapshot=snap, world=True)
    if type(v) is tree.World:
        if rank is None or not 0 <= rank < v.world:
            return
        from ..format.world import rank_top
        top = rank_top(v, rank, lambda d: read_node(assets, d, (), 0, snapshot=snap))
    for _d, _path, read in _nodes(assets, top, snapshot=snap, verify=True):
        for _p, item in read():
            for leaf in item.chunks if type(item) is tree.Global else (item,):
                if leaf.part is not None and leaf.content is not None:
                    yield leaf.content, leaf.blocks[0], leaf.part[0], leaf.part[1], leaf.nbytes


def by_kind(objs) -> dict:
    """Walked objects (Obj) by kind, each once; "itemsize": each block's element
    size, by which the remote codes it again (Assets.framed_here)."""
    out: dict = {"block": [], "node": [], "commit": [], "itemsize": {}}
    seen: set[bytes] = set()
    for o in objs:
        if o.digest not in seen:
            seen.add(o.digest)
            out[o.kind].append(o.digest)
            if o.kind == "block":
                out["itemsize"][o.digest] = o.itemsize
    return out
