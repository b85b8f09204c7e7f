"""The top of a multi-rank snapshot, version 2: a rank tree and a range-cut chunk index.
Pure; no I/O (nodes are read and written through callbacks).

A collective checkout must cost each rank O(its own region), whatever the number of
ranks W. Version 1 of the "W" node listed every rank's tree (33 B x W) and pointed at one
chunk index listing every piece of every rank: every rank read both whole, O(W) and
O(W x N) bytes. Version 2 (docs/FORMAT.md) cuts both:

- the rank tree: the W rank-tree addresses in a fan tree (FAN per node), so finding one
  rank's tree reads ceil(log_FAN W) nodes of at most FAN x 34 B;
- the range index: every piece of a sharded tensor filed in buckets by where it lies
  in its tensor, as a fraction of the tensor's elements in row-major order (its first and
  last element), bucket b covering [b/B, (b+1)/B): for a row split (FSDP) rank r's pieces
  of every tensor fall in the same one or two buckets. The B bucket addresses are a fan
  tree as well. A region needs the buckets its own first..last element range meets:
  every piece that meets the region meets that range (a common element lies in both).

Nodes depend only on what they hold, so a repeated layout writes the same index nodes
(stored once). A fan tree over n items: a node of height 0 lists up to FAN items, one of
height h up to FAN nodes of height h-1; the root's height is the least h with
FAN^(h+1) >= n, and every node but the last of each level is full, so the shape is fixed
by n and FAN and is checked on read."""

from __future__ import annotations

import math
from typing import Callable

import msgpack

from ..errors import FormatError
from .tree import DIGEST_SIZE, MAX_RANKS, NODE_SPLIT, Container, World

__all__ = ["FAN", "fan_height", "fan_children", "fan_lookup", "fan_all", "build_fan",
           "span", "bucket_range", "bucket_count", "buckets", "write_index", "write_world", "bucket_entries", "rank_top", "rank_tops", "rank_path"]

FAN = 16  # items per fan-tree node: 16 x 34 B = 0.55 KB; a level per 16x ranks (or buckets)


def fan_height(n: int, fan: int) -> int:
    h, cap = 0, fan
    while cap < n:
        cap *= fan
        h += 1
    return h


def fan_children(value, count: int, what: str) -> list:
    """The items of one decoded fan-tree node, which must be exactly `count` addresses."""
    if type(value) is not Container or value.kind != "l" or len(value.items) != count \
            or not all(type(x) is bytes and len(x) == DIGEST_SIZE for x in value.items):
        raise FormatError(f"malformed {what} node of a multi-rank snapshot")
    return value.items


def _expect(n: int, fan: int, h: int, lo: int) -> int:
    """Items (h = 0) or children of the height-h node whose first item is `lo`."""
    return min(fan, -(-(n - lo) // fan ** h))


def fan_lookup(root: bytes, n: int, fan: int, i: int, read: Callable, what: str) -> bytes:
    """Item i of the fan tree over n items at `root`; read(digest) -> its decoded value.
    Reads one node per level."""
    if not 0 <= i < n:
        raise FormatError(f"{what}: no item {i} of {n}")
    d, lo = root, 0
    for h in range(fan_height(n, fan), -1, -1):
        kids = fan_children(read(d), _expect(n, fan, h, lo), what)
        j = (i - lo) // fan ** h
        d, lo = kids[j], lo + j * fan ** h
    return d


def fan_all(root: bytes, n: int, fan: int, read: Callable, what: str) -> list:
    """Every item of the fan tree, in order (reads every node of it)."""
    level, h = [(root, 0)], fan_height(n, fan)
    while True:
        nxt = []
        for d, lo in level:
            kids = fan_children(read(d), _expect(n, fan, h, lo), what)
            nxt += [(k, lo + j * fan ** h) for j, k in enumerate(kids)]
        if h == 0:
            return [d for d, _lo in nxt]
        level, h = nxt, h - 1


def build_fan(items: list, fan: int, put: Callable) -> bytes:
    """Write the fan tree over `items` (addresses) bottom-up through put(raw value) ->
    digest; -> the root's address."""
    level = list(items)
    while True:
        level = [put({"l": level[i:i + fan]}) for i in range(0, len(level), fan)]
        if len(level) == 1:
            return level[0]


# -- where a piece lies ------------------------------------------------------------------
def span(off, sh, gshape) -> tuple[int, int] | None:
    """(first, last) row-major element index of the box (off, sh) of a tensor of shape
    gshape; None for an empty box."""
    if any(s == 0 for s in sh):
        return None
    first = last = 0
    for o, s, g in zip(off, sh, gshape):
        first, last = first * g + o, last * g + o + s - 1
    return first, last


def bucket_range(first: int, last: int, numel: int, nb: int) -> range:
    """The buckets (of nb) an element range of a tensor of numel elements meets."""
    return range(first * nb // numel, last * nb // numel + 1)


def _empty_bucket(off, gshape, nb: int) -> int:
    """Where an empty piece is filed (it meets no region; it is listed so that the index
    names every piece): the bucket of its offsets, clamped."""
    numel = math.prod(gshape)
    if not numel:
        return 0
    first = 0
    for o, g in zip(off, gshape):
        first = first * g + min(o, g - 1)
    return min(first * nb // numel, nb - 1)


def bucket_count(pieces_by_rank: list, world: int) -> int:
    """B: about as many buckets as a tensor has pieces, so that a bucket holds one or two
    pieces of each tensor (W for a row split over W ranks). Each piece is filed in every
    bucket it meets: a piece spanning a fraction f of its tensor is filed ~f x B times, so
    B is bounded by pieces / (the fractions summed) to keep the index within ~2x the
    pieces (a tensor held whole by one rank must not be filed W times)."""
    pieces, frac = 0, 0.0
    for rank_pieces in pieces_by_rank:
        for _p, _dt, gs, off, sh in rank_pieces:
            pieces += 1
            sp = span(off, sh, gs)
            if sp is not None:
                frac += (sp[1] - sp[0] + 1) / math.prod(gs)
    if not pieces:
        return 1
    return max(1, min(world, MAX_RANKS, int(pieces / max(frac, 1.0))))


def buckets(pieces_by_rank: list, nb: int) -> list:
    """The nb buckets: [{format_path: [entry, ...]}], entry = [rank, offsets, shape] (raw),
    pieces in rank order."""
    out: list = [{} for _ in range(nb)]
    for r, rank_pieces in enumerate(pieces_by_rank):
        for p, _dt, gs, off, sh in rank_pieces:
            entry = {"l": [r, {"l": list(off)}, {"l": list(sh)}]}
            sp = span(off, sh, gs)
            if sp is None:
                out[_empty_bucket(off, gs, nb)].setdefault(p, []).append(entry)
                continue
            numel = math.prod(gs)
            for b in range(sp[0] * nb // numel, sp[1] * nb // numel + 1):
                out[b].setdefault(p, []).append(entry)
    return out


def _bucket_node(bk: dict, put: Callable) -> dict:
    """A bucket's raw node value, laid out as the node writer lays values out: a tensor's
    list of pieces whose encoding passes NODE_SPLIT is a node of its own (a row split has
    one or two per bucket: never)."""
    items = []
    for p, es in bk.items():
        v = {"l": es}
        if len(es) > 8 and len(msgpack.packb(v, use_bin_type=True)) > NODE_SPLIT:
            v = {"r": put(v)}
        items.append([p, v])
    return {"d": items}


def write_index(pieces_by_rank: list, put: Callable, fan: int | None = None) -> tuple[int, bytes]:
    """Write the chunk index of a multi-rank snapshot through put(raw value) -> digest,
    which writes the value as one node (its layout is made here: every value is small),
    bottom-up -> (nb, ri): its bucket count and the root of its bucket fan. It depends on
    the layout alone, so a repeated layout writes the same nodes."""
    nb, fan = bucket_count(pieces_by_rank, len(pieces_by_rank)), fan or FAN
    return nb, build_fan([put(_bucket_node(b, put)) for b in buckets(pieces_by_rank, nb)], fan, put)


def write_world(rank_tops: list, index: tuple[int, bytes], put: Callable, fan: int | None = None) -> dict:
    """Write the rank tree through put (as write_index) -> the raw "W" value of the top
    node (version 2), with index = write_index(...) of the same world. fan: FAN unless
    given (read when called: tests set FAN to make small worlds of several leaves)."""
    nb, ri = index
    fan = fan or FAN
    rt = build_fan(rank_tops, fan, put)
    return {"W": {"v": 2, "world": len(rank_tops), "fan": fan, "rt": rt, "nb": nb, "ri": ri}}


# -- reading -----------------------------------------------------------------------------
def bucket_entries(value, world: int, deref: Callable) -> dict:
    """One decoded bucket node -> {format_path: [(rank, offsets, shape)]}, every field
    checked (FormatError). deref(value, depth) follows a node reference (a long list of
    one tensor's pieces may be a node of its own)."""
    def bad():
        return FormatError("malformed chunk index of a multi-rank snapshot")

    if type(value) is not Container or value.kind not in ("d", "o"):
        raise bad()
    out: dict = {}
    for p, pieces in value.items:
        pieces = deref(pieces, 1)
        if type(p) is not str or type(pieces) is not Container or pieces.kind != "l":
            raise bad()
        got = out.setdefault(p, [])
        for e in pieces.items:
            e = deref(e, 2)
            if not (type(e) is Container and e.kind == "l" and len(e.items) == 3):
                raise bad()
            r, off, sh = (deref(x, 3) for x in e.items)
            if not (type(r) is int and 0 <= r < world and type(off) is Container and off.kind == "l"
                    and type(sh) is Container and sh.kind == "l" and len(off.items) == len(sh.items)
                    and all(type(x) is int and x >= 0 for x in off.items + sh.items)):
                raise bad()
            got.append((r, tuple(off.items), tuple(sh.items)))
    return out


def rank_top(w: World, i: int, read: Callable) -> bytes:
    """The address of rank i's tree (version 2: one rank-tree node per level read)."""
    if w.ranks is not None:
        return w.ranks[i]
    return fan_lookup(w.rank_tree, w.world, w.fan, i, read, "rank tree")


def rank_tops(w: World, read: Callable) -> list:
    """Every rank's tree address (O(W))."""
    if w.ranks is not None:
        return list(w.ranks)
    return fan_all(w.rank_tree, w.world, w.fan, read, "rank tree")


def rank_path(w: World, i: int, read: Callable) -> list:
    """The addresses of the rank-tree nodes rank_top(w, i) reads, root first: what a
    rank's own region of the snapshot needs above its tree (ceil(log_FAN W) nodes; a
    checkout in the layout it was saved with reads no chunk index)."""
    got: list = []

    def noted(d):
        got.append(d)
        return read(d)
    rank_top(w, i, noted)
    return got
