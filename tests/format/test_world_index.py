"""The top of a multi-rank snapshot (version 2): the rank tree and the chunk index cut by
offset range (tensorstore_ck/format/world.py, docs/FORMAT.md).

Snapshots are made by the project's own collective put: W ranks as threads of this
process, each with its own Store and its own client of one real c10d TCPStore
(collective.StoreGroup), as benches/bench_scale.py runs them. Version-1 tops (the rank list,
with or without the single-node chunk index) are written here as the writer of that
version laid them out, from the same rank trees."""

from __future__ import annotations

import datetime
import threading

import msgpack
import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.core.assets import node_key
from tensorstore_ck.collective import CollectiveContext, StoreGroup
from tensorstore_ck.errors import FormatError, IntegrityError
from tensorstore_ck.format import tree
from tensorstore_ck.format import world as wf
from tensorstore_ck.format.manifest import decode_commit, decode_node, encode_node
from tensorstore_ck.core.validate import check_snapshot_args

REF = "wx/main"
W = 4
ROWS = 3      # rows of "rows" per rank (a row split, as FSDP makes)
COLS = 5


def _state(rank: int, step: int) -> dict:
    g = _global("rows", step)
    u = _global("uneven", step)
    c = _global("cols", step)
    ua, ub = _uneven(rank)
    return {"model": {"rows": tsck.Sharded(g[rank * ROWS:(rank + 1) * ROWS].clone(), g.shape, (rank * ROWS, 0)),
                      "uneven": tsck.Sharded(u[ua:ub].clone(), u.shape, (ua, 0)),
                      "cols": tsck.Sharded(c[:, rank * 2:(rank + 1) * 2].clone(), c.shape, (0, rank * 2)),
                      "rep": tsck.Replicated(torch.arange(6, dtype=torch.float32) + step)},
            "local": torch.full((2,), float(rank)), "step": step}


def _uneven(rank: int) -> tuple[int, int]:
    """Rows [a, b) of a 10-row tensor over 4 ranks (3, 3, 3, 1): not a bucket's multiple."""
    return min(10, rank * 3), min(10, rank * 3 + 3)


def _global(name: str, step: int) -> torch.Tensor:
    shape = {"rows": (W * ROWS, COLS), "uneven": (10, 7), "cols": (3, W * 2)}[name]
    n = shape[0] * shape[1]
    return (torch.arange(n, dtype=torch.float32) * (7 + len(name)) + step).reshape(shape)


class Group:
    """W ranks, each a Store of its own on one local store and a client of one TCPStore."""

    def __init__(self, path, world: int = W):
        self.world = world
        self.server = torch.distributed.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False,
                                                 use_libuv=False, timeout=datetime.timedelta(seconds=120))
        self.first = tsck.open_store(path)
        self.stores = [tsck.open_store(path, refs=self.first.reftable) for _ in range(world)]
        self.groups = []
        for r, s in enumerate(self.stores):
            s._collective = CollectiveContext()  # per rank: CALLS is per process
            client = torch.distributed.TCPStore("127.0.0.1", self.server.port, None, False,
                                                timeout=datetime.timedelta(seconds=120))
            self.groups.append(StoreGroup(client, r, world, "g"))

    def run(self, fn, ranks=None) -> list:
        ranks = list(range(self.world)) if ranks is None else ranks
        out: list = [None] * len(ranks)
        errs: list = []

        def go(i, r):
            try:
                out[i] = fn(r)
            except BaseException as e:  # noqa: BLE001 - raised below
                errs.append(e)
        ts = [threading.Thread(target=go, args=(i, r)) for i, r in enumerate(ranks)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errs:
            raise errs[0]
        return out

    def put(self, step: int) -> str:
        roots = self.run(lambda r: self.stores[r].put_snapshot(_state(r, step), REF, step=step,
                                                                group=self.groups[r], timeout=120).root)
        assert len(set(roots)) == 1
        return roots[0]

    def close(self):
        for s in self.stores:
            s.close()
        self.first.close()


@pytest.fixture
def grp(tmp_path):
    g = Group(tmp_path / "store")
    yield g
    g.close()


def _top(store, root: str):
    c = decode_commit(store.assets.get_commit(bytes.fromhex(root)))
    return c["tree"], decode_node(store.assets.get_node(c["tree"]))


def _region_into(n: int, r: int) -> tuple[dict, dict]:
    """Rank r of n's targets: rows of "rows" and "uneven" split n ways, columns of "cols"."""
    into, want = {"model": {}}, {}
    for name in ("rows", "uneven"):
        g = _global(name, 0)
        rows = g.shape[0]
        a, b = rows * r // n, rows * (r + 1) // n
        into["model"][name] = tsck.Sharded(torch.zeros(b - a, g.shape[1]), g.shape, (a, 0))
        want[name] = (slice(a, b), slice(None))
    c = _global("cols", 0)
    a, b = c.shape[1] * r // n, c.shape[1] * (r + 1) // n
    into["model"]["cols"] = tsck.Sharded(torch.zeros(c.shape[0], b - a), c.shape, (0, a))
    want["cols"] = (slice(None), slice(a, b))
    return into, want


def _checkout_regions(grp: Group, n: int, step: int) -> None:
    """A collective checkout by n of the ranks (n != W: resharded), each its own region."""
    groups = [StoreGroup(grp.groups[r].kv, r, n, f"c{n}") for r in range(n)]

    def one(r):
        into, want = _region_into(n, r)
        got = grp.stores[r].checkout(REF, into=into, group=groups[r], timeout=120)
        for name, (rs, cs) in want.items():
            assert torch.equal(got["model"][name].local, _global(name, step)[rs, cs]), (n, r, name)
        return r
    grp.run(one, list(range(n)))


def test_collective_put_writes_a_version_2_top_that_reads_by_region(grp):
    root = grp.put(1)
    _d, top = _top(grp.first, root)
    w = top["W"]
    assert w["v"] == 2 and w["world"] == W and w["fan"] == wf.FAN and "ranks" not in w and "ix" not in w
    # a row split over 4 ranks: about one bucket per rank ("cols" spans every bucket, and
    # keeps the count from being W: pieces / summed span fractions)
    assert 1 <= w["nb"] <= W
    for n in (W, 3, 2, 1):  # the saved layout, then resharded (regions across the ranks' rows)
        _checkout_regions(grp, n, 1)
    s = grp.first
    full = s.checkout(REF, group=False)  # every rank's pieces: the whole tensors
    for name in ("rows", "uneven", "cols"):
        assert torch.equal(full["model"][name], _global(name, 1)), name
    assert torch.equal(full["local"], torch.zeros(2)) and full["step"] == 1
    assert s.fsck(full=True).ok
    from tensorstore_ck.read.listing import list_tree
    _root, entries = list_tree(s.core, s.resolve(REF))  # `tsck ls`: rank 0's tree, found through the rank tree
    assert any("rows" in e.path for e in entries), entries
    from tensorstore_ck.core.walk import iter_leaves  # `tsck diff`: every rank's tree
    leaves = iter_leaves(s.assets, bytes.fromhex(root))
    assert len(leaves["['model']['rows']"][1]) == W  # one inline piece per rank


def test_a_repeated_layout_writes_the_same_index_nodes(grp):
    """Nodes depend only on what they hold: the buckets and the index's fan tree of a
    second snapshot with the same layout are the first one's (stored once); the rank
    tree differs (its ranks' trees hold new values)."""
    tops = [_top(grp.first, grp.put(step))[1]["W"] for step in (1, 2)]
    assert tops[0]["ri"] == tops[1]["ri"] and tops[0]["nb"] == tops[1]["nb"]
    assert tops[0]["rt"] != tops[1]["rt"]


def _all_index_nodes(store, w: dict) -> list:
    read = lambda d: tree.decode_node_value(decode_node(store.assets.get_node(d)))  # noqa: E731
    out = []
    for root, n in ((w["rt"], w["world"]), (w["ri"], w["nb"])):
        level, h = [(root, 0)], wf.fan_height(n, w["fan"])
        while True:
            out += [d for d, _ in level]
            nxt = []
            for d, lo in level:
                kids = wf.fan_children(read(d), min(w["fan"], -(-(n - lo) // w["fan"] ** h)), "x")
                nxt += [(k, lo + j * w["fan"] ** h) for j, k in enumerate(kids)]
            if h == 0:
                if root == w["ri"]:
                    out += [d for d, _ in nxt]  # the buckets
                break
            level, h = nxt, h - 1
    return out


def _direct(store, world: int, state, ref: str) -> str:
    """A collective snapshot of `world` ranks written by one Store: each rank's tree as a
    collective put writes it and the top as rank 0 composes it (format.world.write_world),
    without the c10d round trips (130 threaded ranks would take half a minute here)."""
    pub = store.publisher
    fence = pub.fence()
    tops, pieces = [], []
    for r in range(world):
        plan = store.planner().plan(state(r))
        pub.write_blocks(plan, owns=lambda leaf, i: True, fence=fence)
        tops.append(pub.write_nodes(plan.value, fence)[0])
        pieces.append([[p, dt, list(gs), list(off), list(sh)] for p, dt, gs, off, sh, rep in plan.pieces if not rep])
    put = lambda v: store.assets.put_node(encode_node(v), fence).digest  # noqa: E731 - as compose() writes them
    top = put(wf.write_world(tops, wf.write_index(pieces, put), put))
    stats = dict.fromkeys(("bytes_total", "bytes_new", "blocks_total", "blocks_new", "stored_new"), 0)
    return pub.commit(top, check_snapshot_args(ref, step=1), stats=stats, fence=fence,
                      meta_extra={"world": world}).root


def test_gc_keeps_the_index_nodes_and_fsck_verifies_them(tmp_path):
    """gc marks through the rank tree and the index (walk.py) and keeps every node of
    both; fsck reads and checks each: a lost bucket is a finding, and the checkout of a
    region that needs it is an IntegrityError, never a wrong read."""
    n = 130  # fan trees of two levels (16 addresses per node)
    with tsck.open_store(tmp_path / "store") as s:
        root = _direct(s, n, lambda r: {"w": tsck.Sharded(torch.full((1, 2), float(r + 1)), (n, 2), (r, 0))}, REF)
        s.put_snapshot({"other": torch.ones(3)}, "wx/other")
        s.put_snapshot({"other": torch.zeros(3)}, "wx/other")  # the first is garbage once retention drops it
        _d, top = _top(s, root)
        w = top["W"]
        assert w["nb"] == n and wf.fan_height(n, w["fan"]) == 1
        nodes = _all_index_nodes(s, w)
        leaves = -(-n // wf.FAN)
        assert len(nodes) == (1 + leaves) + (1 + leaves + n)
        s.gc(grace=0)
        assert all(s.storage.exists(node_key(d)) for d in nodes), "gc dropped an index node"
        assert s.fsck(full=True).ok
        into = {"w": tsck.Sharded(torch.zeros(2, 2), (n, 2), (10, 0))}  # rows 10, 11: ranks 10 and 11
        got = s.checkout(REF, into=into)
        assert got["w"].local[:, 0].tolist() == [11.0, 12.0]
        lost = nodes[-n + 11]  # bucket 11
        s.storage.delete(node_key(lost))
        findings = [str(f) for f in s.fsck(full=True).findings]
        assert findings and any("missing" in f or lost.hex()[:16] in f for f in findings), findings
        with tsck.open_store(tmp_path / "store", refs=s.reftable) as fresh:
            with pytest.raises(IntegrityError):
                fresh.checkout(REF, into={"w": tsck.Sharded(torch.zeros(2, 2), (n, 2), (10, 0))})
            # a region its own rank's pieces fill reads no bucket: still there
            mine = fresh.checkout(REF, into={"w": tsck.Sharded(torch.zeros(1, 2), (n, 2), (0, 0))})
            assert mine["w"].local[0, 0] == 1.0


def _publish(store, top_value: dict, ref: str) -> str:
    pub = store.publisher
    fence = pub.fence()
    d = pub.write_nodes(top_value, fence)[0]
    stats = dict.fromkeys(("bytes_total", "bytes_new", "blocks_total", "blocks_new", "stored_new"), 0)
    return pub.commit(d, check_snapshot_args(ref, step=7), stats=stats, fence=fence,
                      meta_extra={"world": W}).root


def _v1_index(store, tops: list) -> dict:
    """The single-node chunk index, laid out as its writer did: {format_path: [[rank,
    offsets, shape], ...]}, from the ranks' own trees."""
    ix: dict = {}
    for r, d in enumerate(tops):
        leaves = {}
        stack = [((), d)]
        while stack:
            path, nd = stack.pop()
            v = tree.decode_node_value(decode_node(store.assets.get_node(nd)), path, len(path))
            for p, _dp, item in tree.visit(v, path, len(path)):
                if type(item) is tree.Ref:
                    stack.append((p, item.digest))
                elif type(item) is tree.Global and not item.replicated:
                    leaves[tree.format_path(p)] = item
        for p, g in leaves.items():
            for c in g.chunks:
                ix.setdefault(p, []).append({"l": [r, {"l": list(c.offsets)}, {"l": list(c.shape)}]})
    return {"d": [[p, {"l": v}] for p, v in ix.items()]}


@pytest.mark.parametrize("with_index", [True, False])
def test_version_1_tops_still_read(grp, with_index):
    """A top of version 1 (the rank list; with the single-node chunk index, or without:
    older still) reads by region as before, and fsck and gc walk it."""
    root2 = grp.put(1)
    s = grp.first
    _d, top = _top(s, root2)
    tops = wf.rank_tops(tree.decode_node_value(top, world=True),
                        lambda d: tree.decode_node_value(decode_node(s.assets.get_node(d))))
    body = {"world": W, "ranks": tops}
    if with_index:
        body["ix"] = s.publisher.write_nodes(_v1_index(s, tops), s.publisher.fence())[0]
    root1 = _publish(s, {"W": body}, "wx/v1")
    assert decode_node(s.assets.get_node(_top(s, root1)[0]))["W"].keys() == body.keys()
    s.gc(grace=0)
    assert s.fsck(full=True).ok
    for n in (W, 3):
        for r in range(n):
            into, want = _region_into(n, r)
            from tensorstore_ck.read.read import Reader
            c = decode_commit(s.assets.get_commit(bytes.fromhex(root1)))
            reader = Reader(s.assets, s._pool, snapshot=root1, rank=r)
            got = reader.materialize(reader.top(c["tree"]), (), into)
            for name, (rs, cs) in want.items():
                assert torch.equal(got["model"][name].local, _global(name, 1)[rs, cs]), (n, r, name)
    full = s.checkout("wx/v1", group=False)
    for name in ("rows", "uneven", "cols"):
        assert torch.equal(full["model"][name], _global(name, 1)), name


def _rewrite_top(store, root: str, edit) -> str:
    """A snapshot whose W node is `edit`ed (its other nodes the same), under ref wx/bad."""
    _d, top = _top(store, root)
    body = dict(top["W"])
    edit(store, body)
    return _publish(store, {"W": body}, "wx/bad")


def _put_node(store, raw) -> bytes:
    return store.assets.put_node(encode_node(raw)).digest


def _bad_bucket(entries):
    def edit(store, body):
        buckets = [_put_node(store, {"d": [["['model']['rows']", {"l": entries}]]})] * body["nb"]
        body["ri"] = wf.build_fan(buckets, body["fan"], lambda v: _put_node(store, v))
    return edit


MALFORMED = {
    "version 3": lambda s, b: b.update(v=3),
    "version 2.0 (a float)": lambda s, b: b.update(v=2.0),
    "fan 1": lambda s, b: b.update(fan=1),
    "no buckets": lambda s, b: b.update(nb=0),
    "world past the rank tree": lambda s, b: b.update(world=W + 1),
    "rank tree of too few ranks": lambda s, b: b.update(rt=_put_node(s, {"l": [b"\0" * 32] * (W - 1)})),
    "rank tree of ints": lambda s, b: b.update(rt=_put_node(s, {"l": [1] * W})),
    "index node of a map": lambda s, b: b.update(ri=_put_node(s, {"d": [["a", 1]]})),
    "bucket of a list": lambda s, b: b.update(ri=wf.build_fan([_put_node(s, {"l": [1]})] * b["nb"], b["fan"],
                                                                lambda v: _put_node(s, v))),
    "rank out of range": _bad_bucket([{"l": [W, {"l": [3, 0]}, {"l": [3, COLS]}]}]),
    "negative offset": _bad_bucket([{"l": [1, {"l": [-3, 0]}, {"l": [3, COLS]}]}]),
    "offsets and shape of different lengths": _bad_bucket([{"l": [1, {"l": [3]}, {"l": [3, COLS]}]}]),
    "entry of two fields": _bad_bucket([{"l": [1, {"l": [3, 0]}]}]),
    "a piece its rank does not hold": _bad_bucket([{"l": [1, {"l": [6, 0]}, {"l": [3, COLS]}]}]),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_top_or_index_is_a_format_error(grp, case):
    """Stored bytes are untrusted: a bad field of the top, a fan tree of the wrong shape
    or a malformed bucket is a FormatError naming the snapshot (never another exception,
    never a read outside the region), and the store is as it was."""
    root = grp.put(1)
    s = grp.first
    bad = _rewrite_top(s, root, MALFORMED[case])
    into, _want = _region_into(2, 1)  # rows 6..11: ranks 2 and 3 (the index is needed)
    from tensorstore_ck.read.read import Reader
    c = decode_commit(s.assets.get_commit(bytes.fromhex(bad)))
    reader = Reader(s.assets, s._pool, snapshot=bad, rank=1)
    with pytest.raises(FormatError) as e:
        reader.materialize(reader.top(c["tree"]), (), into)
    assert bad[:16] in str(e.value), str(e.value)
    assert not isinstance(e.value, IntegrityError)
    assert s.resolve(REF) == root
    rep = s.fsck(full=True)
    if case != "a piece its rank does not hold":  # (only a checkout meets that one: fsck walks nodes)
        assert not rep.ok and any(bad[:16] in str(f) for f in rep.findings), rep.findings
    # the good snapshot still reads
    _checkout_regions(grp, 2, 1)


def test_bucket_arithmetic():
    """Pieces are filed in every bucket their element range meets; a region's range meets
    the bucket of every piece it meets (here on all boxes of a small 2-D tensor)."""
    import itertools
    gs = (6, 4)
    numel = 24
    for nb in (1, 2, 3, 5, 24, 40):
        for a0, a1 in itertools.combinations(range(7), 2):
            for b0, b1 in itertools.combinations(range(5), 2):
                box = ((a0, b0), (a1 - a0, b1 - b0))
                sp = wf.span(*box, gs)
                mine = set(wf.bucket_range(*sp, numel, nb))
                assert all(0 <= b < nb for b in mine)
                for c0, c1 in itertools.combinations(range(7), 2):
                    for d0, d1 in itertools.combinations(range(5), 2):
                        piece = ((c0, d0), (c1 - c0, d1 - d0))
                        meets = a0 < c1 and c0 < a1 and b0 < d1 and d0 < b1
                        if meets:
                            assert mine & set(wf.bucket_range(*wf.span(*piece, gs), numel, nb)), (nb, box, piece)
    # FSDP: W ranks of rows, about one bucket each; a tensor held whole by one rank is not
    # filed W times
    rows = [[["['w']", "float32", [64, 8], [r, 0], [1, 8]]] for r in range(64)]
    assert wf.bucket_count(rows, 64) == 64
    assert [[len(es) for es in b.values()] for b in wf.buckets(rows, 64)] == [[1]] * 64
    whole = [[["['w%d']" % r, "float32", [64, 8], [0, 0], [64, 8]]] for r in range(64)]
    assert wf.bucket_count(whole, 64) == 1
    assert wf.span((0, 3), (2, 0), (4, 4)) is None


def test_msgpack_of_the_top_is_small_at_4096_ranks():
    """The top node does not grow with W: a few fields (a flat rank list is 33 B x W)."""
    assert len(msgpack.packb({"W": {"v": 2, "world": 4096, "fan": 64, "rt": b"\0" * 32, "nb": 4096,
                                    "ri": b"\0" * 32}})) < 120


def test_dcp_load_of_a_version_2_snapshot(grp):
    """dcp.load through TsckReader gathers every rank's pieces (its metadata lists them all:
    the DCP view merges every rank's tree through the rank tree)."""
    import torch.distributed.checkpoint as dcp

    from tensorstore_ck.dcp import TsckReader
    grp.put(3)
    sd = {"model": {name: torch.zeros(_global(name, 0).shape) for name in ("rows", "uneven", "cols")}}
    dcp.load(sd, storage_reader=TsckReader(grp.first, REF), no_dist=True)
    for name in ("rows", "uneven", "cols"):
        assert torch.equal(sd["model"][name], _global(name, 3)), name


def test_a_rank_beyond_the_saved_world_reads_its_region(grp):
    """Checked out at a larger world (rank >= W): rank 0's tree gives the structure, the
    index the pieces of its region."""
    from tensorstore_ck.read.read import Reader
    root = grp.put(1)
    s = grp.first
    c = decode_commit(s.assets.get_commit(bytes.fromhex(root)))
    for r in (4, 5, 7):
        into, want = _region_into(8, r)
        reader = Reader(s.assets, s._pool, snapshot=root, rank=r)
        got = reader.materialize(reader.top(c["tree"]), (), into)
        for name, (rs, cs) in want.items():
            assert torch.equal(got["model"][name].local, _global(name, 1)[rs, cs]), (r, name)


def test_a_column_split_over_many_ranks_still_reads(tmp_path):
    """A layout far from a row split: 300 ranks each holding one column of a (2, 300)
    tensor. Every piece spans half of the tensor's element range, so B shrinks (the index
    stays ~2x the pieces) and each bucket lists ~300 pieces of the tensor: a list past 4 KiB,
    a node of its own, which readers and fsck follow. Regions still read right."""
    from tensorstore_ck.read.read import Reader
    n = 300
    full = torch.arange(2 * n, dtype=torch.float32).reshape(2, n)
    with tsck.open_store(tmp_path / "store") as s:
        root = _direct(s, n, lambda r: {"c": tsck.Sharded(full[:, r:r + 1].clone(), (2, n), (0, r))}, REF)
        w = _top(s, root)[1]["W"]
        assert w["nb"] <= 4, w["nb"]
        b0 = decode_node(s.assets.get_node(_all_index_nodes(s, w)[-w["nb"]]))
        assert "r" in b0["d"][0][1], "the long list of pieces is a node of its own"
        assert s.fsck(full=True).ok
        c = decode_commit(s.assets.get_commit(bytes.fromhex(root)))
        for r, (a, b) in ((3, (0, 7)), (150, (140, 160)), (299, (290, 300))):
            reader = Reader(s.assets, s._pool, snapshot=root, rank=r)
            got = reader.materialize(reader.top(c["tree"]), (),
                                     {"c": tsck.Sharded(torch.zeros(2, b - a), (2, n), (0, a))})
            assert torch.equal(got["c"].local, full[:, a:b]), (r, a, b)
