"""Exact tiling of sharded tensors.

The pieces of a global tensor must tile it: no overlap, no gap. A collective put
refuses pieces that do not (tests/collective/test_dist.py, real processes); here: the box
algebra against a brute-force oracle, and checkout of stored manifests whose pieces
overlap (hand-made, or composed as a collective put without the tiling check would), which must raise FormatError
instead of returning a "complete" tensor with torch.empty() rows in it.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tensorstore_ck as tsck
from tensorstore_ck.format import tree
from tensorstore_ck.write.shard import find_overlap, tiling_problem
from tensorstore_ck.core.validate import check_snapshot_args

# -- the box algebra against brute force ---------------------------------------------------


def _cells(box):
    off, sh = box
    return set(itertools.product(*[range(o, o + n) for o, n in zip(off, sh)]))


@st.composite
def _layouts(draw):
    nd = draw(st.integers(0, 3))
    gs = tuple(draw(st.lists(st.integers(0, 5), min_size=nd, max_size=nd)))
    boxes = []
    for _ in range(draw(st.integers(0, 6))):
        off, sh = [], []
        for g in gs:
            o = draw(st.integers(0, g))
            off.append(o)
            sh.append(draw(st.integers(0, g - o)))
        boxes.append((tuple(off), tuple(sh)))
    return gs, boxes


@settings(max_examples=400, deadline=None)
@given(_layouts())
def test_tiling_matches_brute_force(layout):
    gs, boxes = layout
    distinct = list(dict.fromkeys(boxes))
    cells = [_cells(b) for b in distinct]
    overlap = any(a & b for a, b in itertools.combinations(cells, 2))
    hit = find_overlap(distinct)
    assert (hit is not None) == overlap
    if hit is not None:
        assert cells[hit[0]] & cells[hit[1]]
    union = set().union(*cells) if cells else set()
    tiles = not overlap and len(union) == math.prod(gs)
    assert (tiling_problem(gs, boxes) is None) == tiles


def test_overlap_does_not_make_up_for_a_gap():
    # The case: rows [0, 3072) from rank 0 and [0, 1024) from rank 1: 4096 rows "covered".
    problem = tiling_problem((4096, 8), [((0, 0), (3072, 8)), ((0, 0), (1024, 8))])
    assert problem is not None and "overlap" in problem
    assert tiling_problem((4096, 8), [((0, 0), (3072, 8)), ((3072, 0), (1024, 8))]) is None
    # column sharding (every piece spans all rows) and a 2x2 grid
    cols = [((0, c), (64, 1)) for c in range(256)]
    assert tiling_problem((64, 256), cols) is None
    assert "overlap" in tiling_problem((64, 256), cols + [((0, 10), (64, 2))])
    grid = [((r, c), (2, 3)) for r in (0, 2) for c in (0, 3)]
    assert tiling_problem((4, 6), grid) is None
    assert "cover 18 of its 24" in tiling_problem((4, 6), grid[:3])


# -- checkout of a stored manifest whose pieces overlap and leave a gap -----------------------

ROWS, COLS = 4096, 8


def _hostile_world_snapshot(store, ref="j/bad") -> torch.Tensor:
    """What a collective put without the tiling check commits for rank 0 = rows [0, 3072) and rank 1 =
    rows [0, 1024) (its offset should have been 3072): two rank trees, merged at checkout.
    Written with the store's own planner and publisher, exactly as collective/put.py composes them."""
    g = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
    planner = store.planner()
    trees = []
    for piece in (tsck.Sharded(g[:3072].clone(), (ROWS, COLS), (0, 0)),
                  tsck.Sharded(g[:1024].clone(), (ROWS, COLS), (0, 0))):
        plan = planner.plan({"w": piece, "step": 1})
        store.publisher.write_blocks(plan)
        trees.append(store.publisher.write_nodes(plan.value)[0])
    top, _ = store.publisher.write_nodes({"W": {"world": 2, "ranks": trees}})
    args = check_snapshot_args(ref, job=None, step=1, metrics=None, meta=None, expected=None)
    store.publisher.commit(top, args, stats={"bytes_total": 0, "bytes_new": 0, "blocks_total": 0,
                                             "blocks_new": 0}, fence=store.publisher.fence())
    return g


def test_checkout_refuses_overlapping_pieces_that_hide_a_gap(store):
    _hostile_world_snapshot(store)
    with pytest.raises(tsck.FormatError, match="overlap"):
        store.checkout("j/bad", group=False)
    # into= a whole tensor or a region: refused too, and the caller's memory is left as it was
    into = torch.full((ROWS, COLS), -1.0)
    with pytest.raises(tsck.FormatError, match="overlap"):
        store.checkout("j/bad", into={"w": into, "step": 0}, group=False)
    assert bool((into == -1.0).all())
    region = tsck.Sharded(torch.full((1024, COLS), -1.0), (ROWS, COLS), (3072, 0))
    with pytest.raises(tsck.FormatError, match="overlap"):
        store.checkout("j/bad", into={"w": region, "step": 0}, group=False)
    assert bool((region.local == -1.0).all())


def test_checkout_refuses_overlapping_chunks_in_one_node(store):
    """A hand-made G leaf (one node, as a DCP tree holds them) with two overlapping chunks."""
    g = torch.arange(64 * 4, dtype=torch.int32).reshape(64, 4)

    def chunk(a, b, off):
        raw = g[a:b].contiguous().view(torch.uint8).reshape(-1).numpy()
        d = store.assets.put_block(raw, 4).digest
        return {"dt": "int32", "sh": [b - a, 4], "off": [off, 0], "n": raw.nbytes, "bs": raw.nbytes, "b": [d]}

    value = {"d": [["w", {"G": {"dt": "int32", "sh": [64, 4],
                                "chunks": [chunk(0, 48, 0), chunk(0, 16, 8)]}}]]}
    top = tree.NodeWriter().write(value, lambda payload: store.assets.put_node(payload).digest)
    args = check_snapshot_args("j/one", job=None, step=1, metrics=None, meta=None, expected=None)
    store.publisher.commit(top, args, stats={"bytes_total": 0, "bytes_new": 0, "blocks_total": 0,
                                             "blocks_new": 0}, fence=store.publisher.fence())
    with pytest.raises(tsck.FormatError, match=r"offsets \[0, 0\] \(shape \[48, 4\]\) and \[8, 0\]"):
        store.checkout("j/one", group=False)


def test_well_tiled_and_single_pieces_still_read(store):
    """The check refuses only overlaps: a tiling reads back whole, one piece alone comes
    back as that piece, identical pieces (replicas) are read once."""
    g = torch.randn(100, 6)
    planner = store.planner()
    trees = []
    for a, b in ((0, 40), (40, 100), (0, 40)):
        plan = planner.plan({"w": tsck.Sharded(g[a:b].clone(), (100, 6), (a, 0))})
        store.publisher.write_blocks(plan)
        trees.append(store.publisher.write_nodes(plan.value)[0])
    top, _ = store.publisher.write_nodes({"W": {"world": 3, "ranks": trees}})
    args = check_snapshot_args("j/ok", job=None, step=1, metrics=None, meta=None, expected=None)
    store.publisher.commit(top, args, stats={"bytes_total": 0, "bytes_new": 0, "blocks_total": 0,
                                             "blocks_new": 0}, fence=store.publisher.fence())
    assert torch.equal(store.checkout("j/ok", group=False)["w"], g)
    store.put_snapshot({"w": tsck.Sharded(g[10:20].clone(), (100, 6), (10, 0))}, "j/piece", group=False)
    got = store.checkout("j/piece", group=False)["w"]
    assert type(got) is tsck.Sharded and got.offsets == (10, 0) and torch.equal(got.local, g[10:20])
