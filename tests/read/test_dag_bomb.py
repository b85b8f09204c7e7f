"""A manifest DAG bomb. Nodes whose lists name the same child twice, 40 levels deep
(under the depth cap, every address valid), name 2^40 paths: a walker that visited
every path would never end, and a checkout that did not measure first would allocate
without bound. Every walker visits a node once (diff counts paths over distinct nodes first), and
checkout measures the tree over distinct nodes before it allocates anything.

A node named at two paths is also what legitimate dedup produces (two identical
sub-trees are one node): checkout and diff still give both paths.
"""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import _zygote as zygote
from _util import child_env

import tensorstore_ck as tsck
from tensorstore_ck.format.manifest import decode_node, encode_node
from tensorstore_ck.core.walk import iter_leaves

REPO = Path(__file__).resolve().parents[2]
STATS = {"bytes_total": 0, "bytes_new": 0, "blocks_total": 0, "blocks_new": 0}
LEVELS = 40
TIMEOUT = 90  # seconds; each run imports torch. A walk of every path never finishes.


def _run(args):
    """One command in a subprocess, killed at TIMEOUT: a hang is a failure, not a stuck suite."""
    try:
        return zygote.run([sys.executable, *args], capture_output=True, text=True, timeout=TIMEOUT,
                          env=child_env(), cwd=str(REPO))
    except subprocess.TimeoutExpired:
        return None


def _bomb(path) -> tuple[str, str]:
    """A good snapshot and, over its tree, LEVELS nodes each naming the one below twice."""
    with tsck.open_store(path) as s:
        good = s.put_snapshot({"w": torch.arange(4096.0), "n": 1}, ref="good/main", step=1)
        d = s.reftable.catalog_get(bytes.fromhex(good.root))["tree"]
        for _ in range(LEVELS):
            d = s.assets.put_node(encode_node({"l": [{"r": d}, {"r": d}]})).digest
        s.assets.sync()
        bomb = s.commit_tree(d, ref="bomb/x", job="bomb", step=1, metrics={}, meta={}, stats=dict(STATS))
    return good.root, bomb.root


CHECKOUT = """
import sys, tensorstore_ck as tsck
with tsck.open_store(sys.argv[1]) as s:
    try:
        s.checkout("bomb/x")
    except tsck.FormatError as e:
        print("refused:", e)
        sys.exit(3)
    sys.exit(4)
"""


@pytest.mark.slow
def test_dag_bomb_ends_in_every_walker(tmp_path):
    path = tmp_path / "s"
    good, bomb = _bomb(path)
    cmds = [["-m", "tensorstore_ck", "fsck", str(path)],
            ["-m", "tensorstore_ck", "fsck", str(path), "--quick"],
            ["-m", "tensorstore_ck", "diff", str(path), "good/main", "bomb/x"],
            ["-c", CHECKOUT, str(path)]]
    with ThreadPoolExecutor(3) as ex:
        fsck, quick, diff, checkout = ex.map(_run, cmds)
    # recover and gc one after the other: recover refuses to run beside a gc that holds
    # the store (it would rebuild the table under a sweep), so together they race.
    recover = _run(["-m", "tensorstore_ck", "recover", str(path)])
    gc = _run(["-m", "tensorstore_ck", "gc", str(path)])
    assert fsck is not None and quick is not None, "fsck did not finish"
    # The bomb is a well-formed tree: fsck checks its 40 nodes once each and finds it clean.
    assert fsck.returncode == 0 and quick.returncode == 0, (fsck.stdout, fsck.stderr)
    assert diff is not None, "diff did not finish"
    assert diff.returncode == 2 and "1099511627776 tensor paths" in diff.stderr, diff.stderr
    assert checkout is not None, "checkout did not finish"
    assert checkout.returncode == 3 and "max_bytes" in checkout.stdout, (checkout.stdout, checkout.stderr)
    assert recover is not None and recover.returncode == 0, recover
    assert gc is not None and gc.returncode == 0, gc
    with tsck.open_store(path) as s:  # still readable, still one store
        assert s.checkout("good/main")["w"].equal(torch.arange(4096.0))
        assert s.resolve("bomb/x") == bomb


@contextlib.contextmanager
def _deadline(seconds: int):
    """Interrupt the test's own thread (SIGALRM) if the block runs past `seconds`."""
    def expire(*_):
        raise TimeoutError(f"did not finish within {seconds}s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def test_reader_measures_distinct_nodes_before_allocating(tmp_path):
    """In-process, for the quick suite: a 30-level bomb (2^30 paths) is refused without
    reading any node twice, and the refusal names the cap."""
    with tsck.open_store(tmp_path / "s") as s:
        good = s.put_snapshot({"w": torch.arange(16.0)}, ref="good/main", step=1)
        d = s.reftable.catalog_get(bytes.fromhex(good.root))["tree"]
        for _ in range(30):
            d = s.assets.put_node(encode_node({"l": [{"r": d}, {"r": d}]})).digest
        s.assets.sync()
        s.commit_tree(d, ref="bomb/x", job="bomb", step=1, metrics={}, meta={}, stats=dict(STATS))
        reads = []
        orig = s.assets.get_node

        def counting(digest, **kw):
            reads.append(digest)
            return orig(digest, **kw)

        s.assets.get_node = counting
        with _deadline(20), pytest.raises(tsck.FormatError, match="max_bytes"):
            s.checkout("bomb/x", max_bytes=1 << 20)
        assert len(reads) == len(set(reads)) == 31
        reads.clear()
        with _deadline(20), pytest.raises(tsck.FormatError, match="tensor paths"):
            iter_leaves(s.assets, bytes.fromhex(s.resolve("bomb/x")))
        assert len(reads) == len(set(reads)) == 31
        reads.clear()
        with _deadline(20):
            rep = s.fsck()
        assert rep.ok, rep.findings
        assert len([r for r in reads if r == d]) == 1  # the bomb's top node, checked once


def _shared_state(v: float):
    sub = {f"p{i}": torch.full((3,), float(i)) for i in range(200)}  # > 4 KiB: a node of its own
    return {"a": sub, "b": {k: t.clone() for k, t in sub.items()}, "c": torch.full((2,), v)}


def test_a_legitimately_shared_node_is_every_path(tmp_path):
    with tsck.open_store(tmp_path / "s") as s:
        s.put_snapshot(_shared_state(0.0), ref="r/x", step=1)
        top = decode_node(s.assets.get_node(s.reftable.catalog_get(bytes.fromhex(s.resolve("r/x")))["tree"]))
        refs = {k: v["r"] for k, v in top["d"] if isinstance(v, dict) and "r" in v}
        assert refs["a"] == refs["b"], "the two identical sub-dicts should be one node"
        out = s.checkout("r/x")
        assert set(out) == {"a", "b", "c"} and len(out["a"]) == len(out["b"]) == 200
        assert out["a"]["p7"].equal(torch.full((3,), 7.0)) and out["b"]["p7"].equal(torch.full((3,), 7.0))
        assert out["a"]["p7"].data_ptr() != out["b"]["p7"].data_ptr()  # two tensors, not one
        changed = _shared_state(1.0)
        changed["b"]["p3"] = torch.full((3,), -1.0)
        s.put_snapshot(changed, ref="r/x", step=2)
        d = s.diff("r/x@1", "r/x@2")
        assert [c["path"] for c in d["changed"]] == ["['b']['p3']", "['c']"]
        assert d["unchanged"] == 399 and not d["added"] and not d["removed"]
        assert s.fsck().ok


def test_a_node_met_again_deeper_is_held_to_the_depth_cap(tmp_path):
    """Visiting a node once must not let it pass the depth cap at a deeper path that
    checkout would refuse: fsck and checkout still agree (tests/format/test_grammar.py)."""
    v = 1
    for _ in range(195):  # 195 levels inside the node: fine at depth 1, not at depth 12
        v = {"l": [v]}
    with tsck.open_store(tmp_path / "s") as s:
        x = s.assets.put_node(encode_node(v)).digest
        deeper = {"r": x}
        for _ in range(10):
            deeper = {"l": [deeper]}
        top = s.assets.put_node(encode_node({"l": [{"r": x}, deeper]})).digest
        s.assets.sync()
        info = s.commit_tree(top, ref="deep/x", job="deep", step=1, metrics={}, meta={}, stats=dict(STATS))
        with pytest.raises(tsck.FormatError, match="deeper than"):
            s.checkout("deep/x")
        bad = [f for f in s.fsck().findings if f.snapshot == info.root]
        assert bad and "deeper than" in bad[0].message, bad


def _leafless_bomb(s, levels: int = LEVELS) -> str:
    """LEVELS nodes each naming the one below twice, over a node that holds no tensor:
    2^LEVELS paths, none to a tensor (diff counted 0 paths, then walked all 2^40)."""
    d = s.assets.put_node(encode_node({"l": [1]})).digest
    for _ in range(levels):
        d = s.assets.put_node(encode_node({"l": [{"r": d}, {"r": d}]})).digest
    s.assets.sync()
    return s.commit_tree(d, ref="bomb/x", job="bomb", step=1, metrics={}, meta={}, stats=dict(STATS)).root


def test_diff_of_a_bomb_without_tensors_ends(tmp_path):
    """2^40 paths to no tensor: diff lists nothing, after reading each node once."""
    with tsck.open_store(tmp_path / "s") as s:
        good = s.put_snapshot({"w": torch.arange(16.0)}, ref="good/main", step=1)
        _leafless_bomb(s)
        reads = []
        orig = s.assets.get_node
        s.assets.get_node = lambda digest, **kw: reads.append(digest) or orig(digest, **kw)
        with _deadline(60):  # a walk of all 2^40 paths never ends
            assert iter_leaves(s.assets, bytes.fromhex(s.resolve("bomb/x"))) == {}
            d = s.diff("good/main", "bomb/x")
        assert d["removed"] == ["['w']"] and not d["added"] and not d["changed"], d
        assert len(reads) == 2 * (LEVELS + 1) + 1, len(reads)  # each node once per snapshot walked
        assert good.root == s.resolve("good/main")


def test_ls_refuses_a_bomb_before_listing_anything(tmp_path, monkeypatch):
    """ls (and `tsck checkout` to safetensors, which lists first) counts the values it
    would visit over distinct nodes: a bomb is refused after a few hundred items
    visited, not after walking the cap's 4 Mi paths (40 s)."""
    from tensorstore_ck.read import listing
    from tensorstore_ck.format import tree

    visited = [0]
    visit = tree.visit

    def counting(*a, **kw):
        for x in visit(*a, **kw):
            visited[0] += 1
            yield x

    with tsck.open_store(tmp_path / "s") as s:
        good = s.put_snapshot({"w": torch.arange(16.0), "n": 1}, ref="good/main", step=1)
        d = s.reftable.catalog_get(bytes.fromhex(good.root))["tree"]
        for _ in range(LEVELS):
            d = s.assets.put_node(encode_node({"d": [["a", {"r": d}], ["b", {"r": d}]]})).digest
        s.assets.sync()
        s.commit_tree(d, ref="bomb/x", job="bomb", step=1, metrics={}, meta={}, stats=dict(STATS))
        monkeypatch.setattr(tree, "visit", counting)
        with pytest.raises(tsck.FormatError, match=f"more than {listing.MAX_ENTRIES} values"):
            listing.list_tree(s.core, s.resolve("bomb/x"))
        assert visited[0] <= 10 * LEVELS, visited[0]
        visited[0] = 0
        _, part = listing.list_tree(s.core, s.resolve("bomb/x"), "a.b." * (LEVELS // 2 - 1) + "a.b.w")
        assert [e.path for e in part] == ["a.b." * (LEVELS // 2) + "w"]
        assert visited[0] <= 20 * LEVELS, visited[0]
        with pytest.raises(tsck.InvalidArgument, match="holds nothing"):
            listing.list_tree(s.core, s.resolve("bomb/x"), "a.c")


@pytest.mark.slow
def test_cli_walkers_end_on_a_bomb_without_tensors(tmp_path):
    """`tsck diff`, `tsck ls`, `tsck checkout` to a file and `tsck du`, each in a subprocess killed at
    TIMEOUT (a diff over every path never finishes; ls and checkout to safetensors over
    every path take ~40 s)."""
    path = tmp_path / "s"
    with tsck.open_store(path) as s:
        s.put_snapshot({"w": torch.arange(16.0)}, ref="good/main", step=1)
        _leafless_bomb(s)
    out = tmp_path / "x.safetensors"
    cmds = [["-m", "tensorstore_ck", "diff", str(path), "good/main", "bomb/x"],
            ["-m", "tensorstore_ck", "ls", str(path), "bomb/x"],
            ["-m", "tensorstore_ck", "checkout", str(path), "bomb/x", str(out)],
            ["-m", "tensorstore_ck", "du", str(path)]]
    with ThreadPoolExecutor(3) as ex:
        diff, ls, checkout, du = ex.map(_run, cmds)
    assert du is not None and du.returncode == 0 and "job bomb" in du.stdout, du
    assert diff is not None and diff.returncode == 0 and "1 removed" in diff.stdout, diff
    assert ls is not None and ls.returncode == 2 and "values (nodes shared" in ls.stderr, ls
    assert checkout is not None and checkout.returncode == 2 and "values (nodes shared" in checkout.stderr, checkout
    assert "Traceback" not in ls.stderr + checkout.stderr + diff.stderr and not out.exists()


def test_checkout_under_a_raised_cap_is_held_to_the_format_limit(tmp_path):
    """max_bytes raised past what 2^40 values cost: the writers' shared limit on values
    (format/tree.MAX_VALUES) still refuses the bomb, counted over distinct nodes, before
    anything is materialised (2^40 values would never fit)."""
    with tsck.open_store(tmp_path / "s") as s:
        good = s.put_snapshot({"w": torch.arange(16.0)}, ref="good/main", step=1)
        d = s.reftable.catalog_get(bytes.fromhex(good.root))["tree"]
        for _ in range(LEVELS):
            d = s.assets.put_node(encode_node({"l": [{"r": d}, {"r": d}]})).digest
        s.assets.sync()
        s.commit_tree(d, ref="bomb/x", job="bomb", step=1, metrics={}, meta={}, stats=dict(STATS))
        with _deadline(60), pytest.raises(tsck.FormatError, match="more than the format's"):
            s.checkout("bomb/x", max_bytes=1 << 62)
        with _deadline(60), pytest.raises(tsck.FormatError, match="more than the format's"):
            s.checkout("bomb/x", max_bytes=1 << 62, paths=["0.1.0"])


def test_writers_and_readers_share_the_limit_on_values(tmp_path, monkeypatch):
    """What put_snapshot accepts, checkout takes: both count values alike (a container,
    a leaf, a plain value, each at every path) against one MAX_VALUES."""
    from tensorstore_ck.format import tree
    monkeypatch.setattr(tree, "MAX_VALUES", 1000)
    with tsck.open_store(tmp_path / "s") as s:
        ok = {"a": list(range(998))}                      # 1 + 1 + 998 values
        s.put_snapshot(ok, ref="v/ok", step=1)
        assert s.checkout("v/ok") == ok
        before = sorted(o.key for o in s.storage.list(""))
        with pytest.raises(tsck.UnsupportedType, match="more than 1000 values"):
            s.put_snapshot({"a": list(range(999))}, ref="v/big", step=1)
        assert sorted(o.key for o in s.storage.list("")) == before
        x = s.reftable.catalog_get(bytes.fromhex(s.resolve("v/ok")))["tree"]
        top = s.assets.put_node(encode_node({"d": [["x", {"r": x}], ["y", 1]]})).digest  # 1002 values
        s.assets.sync()
        s.commit_tree(top, ref="v/hand", job="v", step=1, metrics={}, meta={}, stats=dict(STATS))
        with pytest.raises(tsck.FormatError, match="more than the format's 1000"):
            s.checkout("v/hand", max_bytes=1 << 62)


def test_a_selection_through_a_bomb_measures_each_node_once_per_selection_state(tmp_path):
    """Keys "a" and "a.a" naming the same node: a dotted path of 40 a's is reached along
    Fibonacci(40) ~ 10^8 ways. The measure is memoised per (node, depth, selection
    state) and counts node decodes, not ways."""
    with tsck.open_store(tmp_path / "s") as s:
        good = s.put_snapshot({"w": torch.arange(16.0)}, ref="good/main", step=1)
        d = s.reftable.catalog_get(bytes.fromhex(good.root))["tree"]
        for _ in range(LEVELS):
            d = s.assets.put_node(encode_node({"d": [["a", {"r": d}], ["a.a", {"r": d}]]})).digest
        s.assets.sync()
        s.commit_tree(d, ref="bomb/y", job="bomb", step=1, metrics={}, meta={}, stats=dict(STATS))
        reads = []
        orig = s.assets.get_node
        s.assets.get_node = lambda digest, **kw: reads.append(digest) or orig(digest, **kw)
        with _deadline(60), pytest.raises(tsck.FormatError, match="values"):
            s.checkout("bomb/y", paths=["a." * (LEVELS - 1) + "a"])
        assert len(reads) <= 2 * (LEVELS + 1), len(reads)


@pytest.mark.parametrize("kind", ["dict", "no-items", "multi-rank", "indexed", "one-item"])
def test_the_dcp_view_of_a_bomb_counts_its_nodes(tmp_path, kind):
    """dcp.load of a native snapshot (TsckReader) flattens its tree to DCP items. Over a
    bomb it walked every path: 2^40 dicts to no item never ended, a dict bomb ended at
    the 4 Mi item cap (minutes), a multi-rank one expanded every rank's tree, and lists
    of lists asked "is this one item?" of each path again. Items are counted per node."""
    from tensorstore_ck.dcp.reader import TsckReader

    with tsck.open_store(tmp_path / "s") as s:
        good = s.put_snapshot({"w": torch.arange(16.0)}, ref="good/main", step=1)
        d = s.reftable.catalog_get(bytes.fromhex(good.root))["tree"]
        if kind == "no-items":
            d = s.assets.put_node(encode_node({"d": []})).digest
        if kind == "one-item":
            d = s.assets.put_node(encode_node({"l": [1, 2, 3]})).digest
        for _ in range(LEVELS):
            body = {"l": [{"r": d}, {"r": d}]} if kind == "one-item" else {"d": [["a", {"r": d}], ["b", {"r": d}]]}
            d = s.assets.put_node(encode_node(body)).digest
        d = s.assets.put_node(encode_node({"d": [["x", {"r": d}]]})).digest
        if kind in ("multi-rank", "one-item"):
            d = s.assets.put_node(encode_node({"W": {"ranks": [d], "world": 1}})).digest
        if kind == "indexed":  # with a chunk index (of no sharded tensor)
            ix = s.assets.put_node(encode_node({"d": []})).digest
            d = s.assets.put_node(encode_node({"W": {"ranks": [d], "world": 1, "ix": ix}})).digest
        s.assets.sync()
        s.commit_tree(d, ref="bomb/x", job="bomb", step=1, metrics={}, meta={}, stats=dict(STATS))
        reads = []
        orig = s.assets.get_node
        s.assets.get_node = lambda digest, **kw: reads.append(digest) or orig(digest, **kw)
        with _deadline(60):
            if kind in ("dict", "multi-rank", "indexed"):
                with pytest.raises(tsck.FormatError, match="1099511627776 DCP items"):
                    TsckReader(s, "bomb/x").read_metadata()
            else:
                md = TsckReader(s, "bomb/x").read_metadata()
                assert list(md.state_dict_metadata) == ([] if kind == "no-items" else ["x"])
        assert len(reads) <= 3 * (LEVELS + 3), len(reads)
