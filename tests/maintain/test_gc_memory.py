"""gc's mark structures: memory per object, counted in bytes, and their safety.

The mark keeps reachable objects as 8-byte address prefixes (reach.Marked) and the
nodes it walked as exact addresses (reach.NodeSet). What is checked here is what
those structures hold, in bytes (tracemalloc's count of what reach.py allocated,
and the structures' own sizes), never a time: memory must grow with the distinct
objects reached, not with the references to them, and a prefix may only keep an
object, never lose one. Real LMDB stores in tmp_path; the scale figures are
benches/bench_gc_scale.py's.
"""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

import tensorstore_ck as tsck
from tensorstore_ck.maintain import reach
from tensorstore_ck.maintain.reach import Marked, NodeSet, kept_roots, mark


def _stored(root: str, kind: str) -> set[bytes]:
    out = set()
    for _dirpath, _dirs, files in os.walk(os.path.join(root, kind)):
        out.update(bytes.fromhex(f) for f in files)
    return out


def _reach_bytes(snap) -> int:
    """Bytes still allocated by reach.py's own lines (the mark structures)."""
    flt = [tracemalloc.Filter(True, reach.__file__)]
    return sum(s.size for s in snap.filter_traces(flt).statistics("filename"))


@pytest.mark.slow  # 1,200 blocks written with an fsync each: tens of seconds on a busy disk
def test_mark_memory_grows_with_objects_not_with_references(tmp_path, monkeypatch):
    """A training job's snapshots: 1,200 tensors of one block in one dict (one node),
    one tensor changed per snapshot, 12 snapshots kept. Every snapshot's node names
    every block again: the walk meets 14,400 references to ~1,200 blocks. What the
    mark holds afterwards is ~8 bytes per distinct object, not per reference."""
    monkeypatch.setattr(Marked, "MERGE_MIN", 1024)  # merges at this small size, as at 1 Mi on a big store
    path = str(tmp_path / "s")
    n_tensors, snaps = 1200, 12
    state = {f"t{i}": np.full(8, i, dtype=np.float32) for i in range(n_tensors)}
    with tsck.open_store(path, inline_threshold=0, pack_size=0) as store:  # (one block a tensor)
        for s in range(snaps):
            state[f"t{s}"] = np.full(8, -1 - s, dtype=np.float32)
            store.put_snapshot({"w": state}, ref="main", step=s)
        roots = kept_roots(store.core)
        assert len(roots) == snaps
        blocks = _stored(path, "blocks")
        assert n_tensors < len(blocks) <= n_tensors + snaps

        tracemalloc.start()
        try:
            marked, visited = Marked(), NodeSet()
            refs = mark(store.core, roots, marked, visited)
            held = _reach_bytes(tracemalloc.take_snapshot())
        finally:
            tracemalloc.stop()
        marked.freeze()
    assert refs >= snaps * n_tensors  # every snapshot named every block again
    distinct = len(blocks) + len(_stored(path, "nodes")) + snaps
    # 8 bytes per distinct object with room to grow, plus a buffer of at most half
    # the set or MERGE_MIN: far below 8 bytes per reference (115 KB here)
    assert held <= 8 * (2 * distinct + 2 * 1024) + 16384, (held, distinct, refs)
    assert marked.nbytes <= 8 * distinct + 1024, (marked.nbytes, distinct)
    assert len(marked) == distinct
    # and nothing reached is lost
    assert marked.contains("blocks", sorted(blocks)).all()


def test_marked_prefix_collision_only_keeps():
    """Two addresses with the same first 8 bytes: marking one reports the other as
    reachable too (an unreachable object kept), never the converse."""
    marked = Marked()
    a = b"\x11" * 8 + os.urandom(24)
    b = b"\x11" * 8 + os.urandom(24)
    other = b"\x22" * 8 + os.urandom(24)
    marked.add("blocks", a)
    marked.freeze()
    assert marked.contains("blocks", [a, b, other]).tolist() == [True, True, False]
    assert not marked.contains("nodes", [a]).any()  # kinds apart


def test_marked_contains_needs_freeze():
    marked = Marked()
    marked.add("blocks", os.urandom(32))
    with pytest.raises(RuntimeError):
        marked.contains("blocks", [os.urandom(32)])


def test_marked_merges_keep_every_distinct_prefix(monkeypatch):
    """Many merges (small MERGE_MIN), duplicates across and within buffers: the set is
    exactly the distinct prefixes added, sorted."""
    monkeypatch.setattr(Marked, "MERGE_MIN", 64)
    rng = np.random.default_rng(5)
    pool = [rng.bytes(32) for _ in range(5000)]
    marked = Marked()
    want = set()
    for i in rng.integers(0, len(pool), 40000):
        marked.add("blocks", pool[i])
        want.add(pool[i][:8])
    assert marked.nbytes <= 8 * (2 * len(want) + 2 * 64 + 1024)
    marked.freeze()
    assert len(marked) == len(want)
    assert marked.contains("blocks", pool).tolist() == [d[:8] in want for d in pool]
    assert marked.nbytes == 8 * len(want)


def test_nodeset_is_exact(monkeypatch):
    """NodeSet holds whole addresses: one sharing 31 bytes with a walked node (or
    differing only in trailing NULs, which numpy's S32 items drop) is not walked."""
    monkeypatch.setattr(NodeSet, "MERGE_MIN", 8)  # most members in the packed array
    s = NodeSet()
    walked = [os.urandom(31) + b"\x00", b"\x00" * 32, b"\x07" * 30 + b"\x00\x01"] + [os.urandom(32) for _ in range(100)]
    for d in walked:
        s.add(d)
    near = [d[:31] + bytes([d[31] ^ 1]) for d in walked] + [b"\x00" * 31 + b"\x01", b"\x07" * 30 + b"\x00\x00"]
    assert all(d in s for d in walked)
    assert not any(d in s for d in near if d not in walked)
    assert len(s) == len(walked)
    assert s.nbytes < 32 * len(walked) + 8 * 1200  # packed, plus the few recent ones
    over = NodeSet(base=s)  # an overlay: what it adds stays out of the base
    over.add(near[0])
    assert near[0] in over and near[0] not in s and walked[0] in over


@pytest.mark.parametrize("how", ["gc", "prune"])
def test_gc_keeps_nodes_reached_only_through_shared_subtrees(tmp_path, monkeypatch, how):
    """A subtree of many nodes shared by three snapshots, two kept (the second walk
    skips the shared nodes: NodeSet says they were walked, mostly from its packed
    array) and one expired (prune walks it skipping what the kept ones reach): only
    what the expired one alone held goes, and the kept snapshots read back whole."""
    monkeypatch.setattr(NodeSet, "MERGE_MIN", 2)
    path = str(tmp_path / "s")
    # three dicts of 80 one-block tensors: each dict past 4 KiB is a node of its own
    rng = np.random.default_rng(7)
    shared = {f"g{g}": {f"t{i}": rng.random(8, dtype=np.float32) for i in range(80)} for g in range(3)}
    with tsck.open_store(path, block_size=4096, inline_threshold=0) as store:
        store.set_retention("job", tsck.Retention(keep_last=2))
        for step in (1, 2, 3):
            store.put_snapshot({"shared": shared, "own": rng.random(4096, dtype=np.float32)},
                               ref="job/a", job="job", step=step)
        before_blocks, before_nodes = _stored(path, "blocks"), _stored(path, "nodes")
        rep = store.gc() if how == "gc" else store.prune("job")
        assert len(rep.expired) == 1
        after_blocks, after_nodes = _stored(path, "blocks"), _stored(path, "nodes")
        assert len(after_nodes) == 3 + 2  # the shared dicts' nodes, the kept snapshots' tops
        assert len(before_nodes) - len(after_nodes) == 1  # the expired one's top node
        assert len(before_blocks) - len(after_blocks) == 4  # its own 16 KiB: 4 blocks
        got = store.checkout("job/a")
        for g in range(3):
            for i in range(80):
                np.testing.assert_array_equal(got["shared"][f"g{g}"][f"t{i}"], shared[f"g{g}"][f"t{i}"])
        assert store.fsck(full=True).ok  # every kept snapshot's objects there and whole
