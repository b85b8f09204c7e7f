"""Sharded tensors and multi-rank snapshots, read: the half of a checkout that
gathers a tensor's pieces.

A sharded tensor (tree.Global) is stored as chunks, each with its offsets in the
whole; `read_box` schedules the block reads of one chunk's region (checkout here,
the DCP reader in dcp/), and a checkout fills a tensor or a rank's region from the
chunks that meet it, refusing overlapping pieces (an overlap must not hide a gap).

A collective snapshot holds one tree per rank (format/world.py). A rank's view of it
is merged here: its own rank-local values, with each sharded tensor's chunks gathered
from the ranks that hold them, and what an into= target names that its own tree lacks
merged from the ranks that hold it. One process's view (Reader(rank=None): no process
group) is every rank's tree merged (world_view.py). With a chunk index (version 1's index node, version
2's range-bucketed index) only this rank's tree and the index are read up front, and
other ranks' pieces when the region being filled needs them, so a checkout in the
layout it was saved with costs one rank's nodes, not the world's.

WorldReading is the Reader's (read.py) multi-rank and sharded part: Reader inherits it,
and it uses the Reader's node cache (_node, _deref), its read queue and its checks.
"""

from __future__ import annotations

import logging
import math

import torch

from ..errors import CheckoutMismatch, FormatError, IntegrityError
from ..format import tree
from ..format import world as worldfmt
from ..format.tree import format_path
from ..util.paths import FULL, SKIP
from ..write.shard import Sharded, find_overlap
from .readjobs import part_job
from .world_view import VALUE_COST, Union

__all__ = ["Gathered", "WorldReading", "read_box"]

logger = logging.getLogger("tensorstore_ck")

_ABSENT = object()  # a path a rank's tree does not have (None is a value)


class Gathered:
    """A sharded tensor of a multi-rank snapshot with a chunk index: this rank's own leaf
    and where every rank's pieces lie. Other ranks' chunks are read (WorldReading._gather) only
    for the region a checkout fills."""
    __slots__ = ("own", "me", "pieces", "ranks", "dt", "dtype", "shape", "replicated")

    def __init__(self, own: tree.Global, me: int, pieces, ranks):
        self.own, self.me, self.pieces, self.ranks = own, me, pieces, ranks
        self.dt, self.dtype, self.shape, self.replicated = own.dt, own.dtype, own.shape, False


def read_box(leaf: tree.Leaf, dtype: torch.dtype, box: tuple, target: torch.Tensor, jobs: list, path: str,
             *, caller: bool = True):
    """Schedule the reads that fill `target` (shaped like leaf[box]) with leaf[box],
    reading only the blocks that hold the box's rows (blocks are row-aligned).
    Appends (digest, destination, path, bounce) to `jobs`; returns (after, staged_bytes):
    a function to run once the reads are done (None when the blocks land in the
    target directly) and the bytes of the staging buffer it holds.
    caller: `target` is the caller's memory (blocks read into it directly bounce)."""
    sh = leaf.shape
    nd = len(sh)
    if target.numel() == 0 or leaf.nbytes == 0:
        return None, 0
    if leaf.inline is not None:
        src = torch.frombuffer(bytearray(leaf.inline), dtype=torch.uint8).view(dtype).reshape(sh)
        return (lambda: target.copy_(src[box])), 0
    row = dtype.itemsize * math.prod(sh[1:]) if nd else dtype.itemsize
    r0, r1 = (box[0].start, box[0].stop) if nd else (0, 1)
    if leaf.part is not None:  # a small leaf in a pack: its rows out of the pack's part
        tmp = torch.empty(leaf.nbytes, dtype=torch.uint8)
        jobs.append((leaf.blocks[0], part_job(leaf, tmp.numpy()), path, False))
        rows = tmp[r0 * row:r1 * row].view(dtype)
        rows = rows.reshape((r1 - r0,) + tuple(sh[1:])) if nd else rows.reshape(())
        src = rows[(slice(None),) + tuple(box[1:])] if nd else rows
        return (lambda: target.copy_(src)), tmp.numel()
    b_lo, b_hi = r0 * row, r1 * row
    bs, n = leaf.block_size, leaf.nbytes
    i0, i1 = b_lo // bs, -(-b_hi // bs)
    inner_full = all(box[d].start == 0 and box[d].stop == sh[d] for d in range(1, nd))
    if inner_full and target.device.type == "cpu" and target.is_contiguous() and target.dtype == dtype \
            and b_lo % bs == 0 and (b_hi % bs == 0 or b_hi == n):
        # The requested rows are whole blocks: read them straight into the target.
        dst = target.reshape(-1).view(torch.uint8).numpy()
        for i in range(i0, i1):
            a, b = i * bs, min(n, (i + 1) * bs)
            jobs.append((leaf.blocks[i], dst[a - b_lo:b - b_lo], path, caller))
        return None, 0
    base = i0 * bs
    tmp = torch.empty(min(n, i1 * bs) - base, dtype=torch.uint8)
    flat = tmp.numpy()
    for i in range(i0, i1):
        a, b = i * bs, min(n, (i + 1) * bs)
        jobs.append((leaf.blocks[i], flat[a - base:b - base], path, False))
    rows = tmp[b_lo - base:b_hi - base].view(dtype)
    rows = rows.reshape((r1 - r0,) + tuple(sh[1:])) if nd else rows.reshape(())
    src = rows[(slice(None),) + tuple(box[1:])] if nd else rows
    return (lambda: target.copy_(src)), tmp.numel()


class WorldReading:
    """The Reader's sharded tensors and multi-rank merge (a mixin: read.Reader's state)."""

    def _chunks(self, g: tree.Global, path):
        if math.prod(g.shape) * g.dtype.itemsize > self.max_bytes:
            raise self._fmt(f"sharded tensor of shape {list(g.shape)} exceeds max_bytes={self.max_bytes}", path)
        out, seen = [], set()
        for c in g.chunks:
            self._cap(c.nbytes, path)
            key = (c.offsets, c.shape)
            if key in seen:  # the same piece from several ranks (replicated): read it once
                continue
            seen.add(key)
            out.append(c)
        # A stored manifest is untrusted: its pieces must not overlap, so that the
        # elements _fill_region counts are the elements it fills (an overlap must not
        # make up for a gap, leaving torch.empty() memory in a "complete" tensor).
        hit = find_overlap([(c.offsets, c.shape) for c in out])
        if hit is not None:
            a, b = out[hit[0]], out[hit[1]]
            raise self._fmt(f"sharded tensor's pieces at offsets {list(a.offsets)} (shape {list(a.shape)}) and "
                            f"{list(b.offsets)} (shape {list(b.shape)}) overlap", path)
        return out

    def _global(self, g: tree.Global, path, into):
        if type(g) is Gathered:  # only the pieces the region needs are read
            box = (tuple(into.offsets), tuple(into.local.shape)) if isinstance(into, Sharded) else None
            g = self._gather(g, box, path)
        elif self._world is not None and not g.replicated and id(g) not in self._whole:
            box = (tuple(into.offsets), tuple(into.local.shape)) if isinstance(into, Sharded) else None
            g = self._ranged(g, box, path)
        dtype, gs = g.dtype, g.shape
        chunks = self._chunks(g, path)
        if isinstance(into, Sharded):
            tgt, roff = into.local, into.offsets
            if tgt.dtype != dtype or tuple(into.global_shape) != gs:
                raise CheckoutMismatch(f"sharded tensor at {format_path(path)} is {dtype} {list(gs)}, "
                                       f"target is {tgt.dtype} {list(into.global_shape)}")
            self._fill_region(chunks, dtype, tgt, roff, path, caller=True)
            return into
        if isinstance(into, torch.Tensor):
            if into.dtype != dtype or tuple(into.shape) != gs:
                raise CheckoutMismatch(f"tensor at {format_path(path)} is {into.dtype} {list(into.shape)}, "
                                       f"snapshot has {dtype} {list(gs)}")
            self._fill_region(chunks, dtype, into, (0,) * len(gs), path, caller=True)
            return into
        covered = sum(math.prod(c.shape) for c in chunks)
        if len(chunks) == 1 and covered < math.prod(gs):
            c = chunks[0]  # one rank's piece saved on its own: give the piece back
            local = torch.empty(c.shape, dtype=dtype)
            self._fill_region(chunks, dtype, local, c.offsets, path)
            return Sharded(local, gs, c.offsets)
        try:
            t = torch.empty(gs, dtype=dtype)
        except Exception as e:
            raise self._fmt(f"cannot allocate tensor of {dtype} {list(gs)}: {type(e).__name__}", path) from None
        self._fill_region(chunks, dtype, t, (0,) * len(gs), path)
        return t

    def _fill_region(self, chunks, dtype, dst: torch.Tensor, roff, path, caller: bool = False):
        """Fill dst (the region of the global tensor at offsets roff) from the chunks
        that intersect it, reading only the blocks that overlap it. caller: dst is
        the caller's memory."""
        rshape = tuple(dst.shape)
        filled = 0
        p = format_path(path)
        for c in chunks:
            lo = [max(a, b) for a, b in zip(c.offsets, roff)]
            hi = [min(a + x, b + y) for a, x, b, y in zip(c.offsets, c.shape, roff, rshape)]
            if any(a >= b for a, b in zip(lo, hi)) and len(c.shape):
                continue
            filled += math.prod(b - a for a, b in zip(lo, hi))
            src_box = tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, c.offsets))
            dst_box = tuple(slice(a - r, b - r) for a, b, r in zip(lo, hi, roff))
            after, _ = read_box(c, dtype, src_box, dst[dst_box], self._jobs, p, caller=caller)
            if after is not None:
                self._after.append(after)
                if caller:
                    self._staged.add(p)
        if filled < math.prod(rshape):
            raise CheckoutMismatch(f"the snapshot does not hold all of the requested region of the tensor "
                                   f"at {format_path(path)} ({filled} of {math.prod(rshape)} elements)")

    # -- multi-rank snapshots ----------------------------------------------------
    def merged_world(self, w: tree.World):
        """Every rank's tree of collective snapshot `w` merged into one view, each sharded
        tensor with all its chunks (what DCP's metadata lists: dcp/native.py)."""
        return self._merge_world(w, (), 0, lazy=False)

    def _merge_world(self, w: tree.World, path, depth, sel=FULL, *, lazy: bool = True):
        """A collective snapshot holds one tree per rank. Merge them into this rank's
        view: its own rank-local values (rank 0's for a rank the snapshot did not
        have), with every sharded tensor's chunks gathered from all ranks. Only what
        the selection keeps is merged (and read). lazy=False (one process's view without
        into=; DCP's metadata, which lists every chunk): every rank's tree merged into
        one (world_view.py), O(W) rank trees.

        Version 2 (format/world.py): only this rank's tree is read here, found through the
        rank tree; the index buckets and other ranks' pieces a sharded tensor's region
        needs are read when it is filled (_ranged).
        Version 1 with a chunk index: only this rank's tree and the index are read here;
        another rank's chunks of a sharded tensor are read when the region
        being filled needs them. Without one, or if the
        index node cannot be read (a gc that did not keep it), every rank's
        tree is merged (O(W) node reads per rank)."""
        me = self.rank if self.rank < w.world else 0
        self._multi = w
        if not lazy:
            return self._view(w, me, path, depth, sel, extend=True)
        if w.ranks is None:  # version 2: this rank's tree; _global reads the index for its regions
            self._world = w
            return self._node(self._rank_top(w, me, path, depth), path, depth)
        ix = self._chunk_index(w, path, depth) if w.index is not None else None
        if ix is not None:
            return self._indexed(self._node(w.ranks[me], path, depth), me, w.ranks, ix, path, depth, sel, True)
        return self._view(w, me, path, depth, sel, extend=False)

    def _union(self, extend: bool) -> Union:
        u = self._unions.get(extend)
        if u is None:
            step = None if self.select is None else self.select.step
            budget = min(tree.MAX_VALUES, self.max_bytes // VALUE_COST)  # the values a checkout may hold
            u = self._unions[extend] = Union(self._deref, step, snapshot=self.snapshot, extend=extend,
                                             whole=self._whole, budget=budget)
        return u

    def _order(self, w: tree.World, me: int) -> list:
        """The ranks in the order their rank-local values are preferred: `me`, then the rest."""
        return [me] + [r for r in range(w.world) if r != me]

    def _view(self, w: tree.World, me: int, path, depth, sel, *, extend: bool):
        """Every rank's tree merged, `me`'s values preferred (extend: with what only the others hold)."""
        key = (me, extend, None if sel is FULL else id(sel))
        hit = self._views.get(key)
        if hit is None:
            vals = [(r, tree.Ref(self._rank_top(w, r, path, depth))) for r in self._order(w, me)]
            hit = self._views[key] = self._union(extend).merge(vals, path, depth, sel)
        return hit

    def _borrow(self, v: tree.Container, path, depth, keys, sel) -> tree.Container:
        """This rank's dict `v` at `path` with `keys` (which it lacks) added from the ranks
        whose trees hold them, each merged over those ranks (sharded tensors whole), read
        along `path` only: O(W) rank trees, only when an into= target needs it."""
        w = self._multi
        me = self.rank if self.rank < w.world else 0
        extra = []
        for k in keys:
            vals = []
            for r in self._order(w, me):
                x = self._rank_leaf(self._rank_top(w, r, path, 0), path + (k,), missing=_ABSENT)
                if x is not _ABSENT:
                    vals.append((r, x))
            if vals:
                csel = FULL if sel is FULL else self.select.step(sel, k)
                extra.append((k, self._union(True).merge(vals, path + (k,), depth + 1, csel)))
        return tree.Container(v.kind, list(v.items) + extra) if extra else v

    def _chunk_index(self, w: tree.World, path, depth) -> dict | None:
        """{format_path of a sharded tensor: [(rank, offsets, shape)]} from the index node."""
        try:
            raw = type(self)(self.assets, self.pool, snapshot=self.snapshot, verify=self.verify).materialize(
                self._node(w.index, path, depth), path)
        except IntegrityError as e:
            logger.warning("snapshot %s: its chunk index cannot be read (%s); merging every rank's tree instead",
                           self.snapshot[:16], e)
            return None
        out: dict = {}
        ok = isinstance(raw, dict)
        for p, pieces in (raw.items() if ok else ()):
            if type(p) is not str or type(pieces) is not list:
                ok = False
                break
            got = []
            for e in pieces:
                if not (type(e) is list and len(e) == 3 and type(e[0]) is int and 0 <= e[0] < len(w.ranks)
                        and type(e[1]) is list and type(e[2]) is list and len(e[1]) == len(e[2])
                        and all(type(x) is int and x >= 0 for x in e[1] + e[2])):
                    ok = False
                    break
                got.append((e[0], tuple(e[1]), tuple(e[2])))
            out[p] = got
        if not ok:
            raise self._fmt("malformed chunk index of a multi-rank snapshot", path)
        return out

    def _indexed(self, v, me, ranks, ix, path, depth, sel, lazy):
        """This rank's tree with each sharded tensor made a Gathered (or, not lazy, a
        Global of every rank's chunks). A sub-tree above no tensor of the index is
        itself (nodes shared at many paths are not expanded)."""
        if type(v) is tree.Ref and path and format_path(path) not in self._prefixes(ix):
            return v
        v = self._deref(v, path, depth)
        t = type(v)
        if t is tree.Global:
            pieces = None if v.replicated else ix.get(format_path(path))
            if pieces is None:
                return v  # replicated (whole on every rank) or not in the index: its own view
            g = Gathered(v, me, pieces, ranks)
            return g if lazy else self._gather(g, None, path)
        if t is not tree.Container:
            return v

        def child(k, x):
            csel = FULL if sel is FULL else self.select.step(sel, k)
            if csel is SKIP:
                return x  # left out: not read
            return self._indexed(x, me, ranks, ix, path + (k,), depth + 1, csel, lazy)

        if v.kind in ("d", "o"):
            return tree.Container(v.kind, [(k, child(k, x)) for k, x in v.items])
        return tree.Container(v.kind, [child(i, x) for i, x in enumerate(v.items)])

    def _prefixes(self, ix: dict) -> set:
        hit = self._ix_prefixes.get(id(ix))
        if hit is None:
            out = set()
            for p in ix:  # "['a'][0]['w']" -> "['a']", "['a'][0]", "['a'][0]['w']"
                out.update(p[:i] for i in range(1, len(p) + 1) if p[i - 1] == "]")
            hit = self._ix_prefixes[id(ix)] = (ix, out)
        return hit[1]

    def _gather(self, g: "Gathered", box, path) -> tree.Global:
        """The chunks of `g` that intersect `box` ((offsets, shape); None: all of it), read
        from the trees of the ranks that hold them."""
        def meets(off, sh):
            return box is None or all(a < r + rs and r < a + s for a, s, r, rs in zip(off, sh, *box))

        need: dict = {}
        for r, off, sh in g.pieces:
            if meets(off, sh):
                need.setdefault(r, set()).add(off)
        return self._pieces_of(need, g.own, g.me, lambda r: self._rank_leaf(g.ranks[r], path), path)

    def _pieces_of(self, need: dict, own: tree.Global, me: int, leaf_of, path) -> tree.Global:
        """The chunks the index names ({rank: {offsets}}), each read from its rank's leaf
        (leaf_of(rank); this rank's own: `own`), checked against what the index said."""
        chunks: list = []
        for r in sorted(need):
            leaf = own if r == me else leaf_of(r)
            if type(leaf) is not tree.Global or leaf.dt != own.dt or leaf.shape != own.shape:
                raise self._fmt(f"the chunk index names a piece of rank {r}, whose tree has no such sharded "
                                "tensor there", path)
            found = [c for c in leaf.chunks if c.offsets in need[r]]
            if len({c.offsets for c in found}) != len(need[r]):
                raise self._fmt(f"the chunk index names a piece rank {r} does not hold", path)
            chunks += found
        return tree.Global(own.dt, own.shape, chunks, False)

    def _world_error(self, e: FormatError, path) -> FormatError:
        # a node that does not decode already names the snapshot; a bad fan tree or bucket does not
        return e if f"of snapshot {self.snapshot[:16]}" in str(e) else self._fmt(str(e), path)

    def _rank_top(self, w: tree.World, r: int, path, depth) -> bytes:
        """Rank r's tree address (version 2: one rank-tree node per level, read once)."""
        hit = self._rank_tops.get(r)
        if hit is None:
            try:
                hit = self._rank_tops[r] = worldfmt.rank_top(w, r, lambda d: self._node(d, path, depth))
            except FormatError as e:
                raise self._world_error(e, path) from None
        return hit

    def _bucket(self, b: int, path) -> dict:
        """Bucket b of the range index -> {format_path: [(rank, offsets, shape)]} (read once)."""
        hit = self._buckets.get(b)
        if hit is not None:
            return hit
        w = self._world
        node = lambda d: self._node(d, (), 0)  # noqa: E731 - the index hangs off the top
        try:
            d = worldfmt.fan_lookup(w.range_index, w.nbuckets, w.fan, b, node, "chunk index")
        except FormatError as e:
            raise self._world_error(e, path) from None
        try:
            out = worldfmt.bucket_entries(node(d), w.world, lambda v, depth: self._deref(v, (), depth))
        except FormatError as e:
            raise self._world_error(e, path) from None
        self._buckets[b] = out
        return out

    def _ranged(self, own: tree.Global, box, path) -> tree.Global:
        """A sharded tensor of a version-2 multi-rank snapshot: the chunks that meet `box`
        ((offsets, shape); None: all of it). This rank's own chunks serve when they cover the
        region (a checkout in the layout it was saved with reads no index); else the index
        buckets the region's element range meets name the other ranks' pieces, which are
        read from their trees along this tensor's path only."""
        w = self._world
        me = self.rank if self.rank < w.world else 0
        if box is not None:
            want = math.prod(box[1])
            got = 0
            for c in own.chunks:
                got += math.prod(max(0, min(a + s, r + rs) - max(a, r))
                                 for a, s, r, rs in zip(c.offsets, c.shape, *box))
            if got >= want:
                return own
            sp = worldfmt.span(box[0], box[1], own.shape)
            if sp is None:
                return own
            which = worldfmt.bucket_range(sp[0], sp[1], math.prod(own.shape), w.nbuckets)
        else:
            which = range(w.nbuckets)  # the whole tensor: every rank's pieces of it

        def meets(off, sh):
            return box is None or all(a < r + rs and r < a + s for a, s, r, rs in zip(off, sh, *box))

        need: dict = {}
        p = format_path(path)
        for b in which:
            if not 0 <= b < w.nbuckets:
                raise self._fmt("a sharded tensor's region lies outside its shape", path)  # pragma: no cover
            for r, off, sh in self._bucket(b, path).get(p, ()):
                if meets(off, sh):
                    need.setdefault(r, set()).add(off)
        need.setdefault(me, set()).update(c.offsets for c in own.chunks if meets(c.offsets, c.shape))
        return self._pieces_of(need, own, me, lambda r: self._rank_leaf(self._rank_top(w, r, path, 0), path), path)

    def _rank_leaf(self, top: bytes, path, missing=None):
        """The value at `path` in the rank tree `top` (nodes read along the path only);
        `missing` where it has none."""
        v = self._node(top, (), 0)
        for i, k in enumerate(path):
            v = self._deref(v, path[:i], i)
            if type(v) is not tree.Container:
                return missing
            if v.kind in ("d", "o"):
                m = self._keymaps.get(id(v))
                if m is None:
                    m = self._keymaps[id(v)] = (v, dict(v.items))  # v kept: its id stays its own
                v = m[1].get(k, _ABSENT)
            else:
                v = v.items[k] if type(k) is int and 0 <= k < len(v.items) else _ABSENT
            if v is _ABSENT or (v is None and missing is None):
                return missing
        return self._deref(v, path, len(path))
