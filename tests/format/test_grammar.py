"""One manifest grammar: checkout, fsck and gc accept and refuse exactly the same
trees, and put_snapshot refuses (before writing anything) what they would refuse.

Before format/tree.py, fsck and gc walked manifests with their own lenient copy
of the grammar: every hostile tree below passed fsck as clean and was marked by
gc, while checkout refused it.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.format import tree
from tensorstore_ck.format.manifest import decode_node, encode_node

STATS = {"bytes_total": 0, "bytes_new": 0, "blocks_total": 0, "blocks_new": 0}
D = b"\x01" * 32  # an address that is never stored


def _leaf(**kw):
    body = {"dt": "float32", "sh": [2], "n": 8, "x": b"\0" * 8}
    body.update(kw)
    return {"T": {k: v for k, v in body.items() if v is not None}}


def _descr(depth):
    d = "<f4"
    for i in range(depth):
        d = [[f"f{i}", d]]
    return d


def _nest(depth):
    v = 1
    for _ in range(depth):
        v = {"l": [v]}
    return v


HOSTILE = {
    "inline bytes shorter than the shape": _leaf(x=b"\0" * 4),
    "size that does not match the shape": _leaf(n=12, x=b"\0" * 12),
    "unknown torch dtype": _leaf(dt="float99"),
    "65 dims": _leaf(sh=[1] * 65, n=4, x=b"\0" * 4),
    "dim of 2^48 beside a 0 dim": _leaf(sh=[0, 1 << 48], n=0, x=b""),
    "block size not a multiple of the item": _leaf(x=None, n=8, bs=3, b=[D, D, D]),
    "unknown tag": {"d": [["a", {"Z": 1}]]},
    "dict entry that is not a pair": {"d": [["a"]]},
    "dict key that is a float": {"d": [[1.5, 1]]},
    "multi-rank node below the top": {"d": [["w", {"W": {"world": 1, "ranks": [D]}}]]},
    "big int over 64 KiB": {"d": [["i", {"i": b"\x01" * (70 << 10)}]]},
    "numpy scalar of a bad dtype": {"d": [["s", {"S": ["<q99", b"\0" * 8]}]]},
    "numpy dtype nested deeper than 8": {"A": {"dt": _descr(10), "sh": [0], "n": 0, "x": b""}},
    "sharded chunk outside its tensor": {"G": {"dt": "float32", "sh": [2], "chunks": [
        {"dt": "float32", "off": [1], "sh": [2], "n": 8, "x": b"\0" * 8}]}},
    "quantized tensor without parameters": {"T": {"dt": "qint8", "sh": [1], "n": 1, "x": b"\0"}},
    "nested deeper than 200": _nest(205),
}


def _plant(store, value, ref):
    top = store.assets.put_node(encode_node(value)).digest
    store.assets.sync()
    return store.commit_tree(top, ref=ref, job=ref.split("/")[0], step=1, metrics={}, meta={}, stats=dict(STATS))


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_checkout_fsck_and_gc_refuse_the_same_hostile_tree(tmp_path, name):
    store = tsck.open_store(tmp_path / "s")
    try:
        store.put_snapshot({"w": torch.arange(10.0)}, ref="good/main", step=1)
        info = _plant(store, HOSTILE[name], "evil/x")
        with pytest.raises((tsck.FormatError, tsck.IntegrityError)):
            store.checkout("evil/x")
        rep = store.fsck()
        bad = [f for f in rep.findings if f.snapshot == info.root]
        assert bad, f"fsck passed a tree checkout refuses ({name})"
        before = sorted(o.key for o in store.storage.list(""))
        with pytest.raises(tsck.TsckError, match="gc stopped before deleting anything"):
            store.gc()
        assert sorted(o.key for o in store.storage.list("")) == before
        assert torch.equal(store.checkout("good/main")["w"], torch.arange(10.0))
    finally:
        store.close()


def test_odd_but_valid_trees_pass_all_three(tmp_path):
    """The other direction: what the grammar accepts, all three accept."""
    store = tsck.open_store(tmp_path / "s")
    try:
        value = {"d": [
            [1, {"t": [None, True, -1, 2.5, "s", b"b"]}],
            [{"i": (2**70).to_bytes(9, "big", signed=True)}, {"o": [["k", {"l": []}]]}],
            ["e", _leaf(sh=[0, 3], n=0, x=b"")],
            ["g", {"G": {"dt": "float32", "sh": [2], "chunks": [
                {"dt": "float32", "off": [0], "sh": [2], "n": 8, "x": b"\0" * 8}]}}],
            ["deep", _nest(190)],
        ]}
        info = _plant(store, value, "odd/x")
        state = store.checkout("odd/x")
        assert state[1] == (None, True, -1, 2.5, "s", b"b") and 2**70 in state
        assert state["e"].shape == (0, 3) and state["g"].tolist() == [0.0, 0.0]
        assert store.fsck().ok
        rep = store.gc()
        assert store.checkout(info.root)[1] == state[1] and rep.deleted_objects == 0
    finally:
        store.close()


# -- the writer refuses what the readers refuse, before writing anything -------------------
def _deep_dtype(depth):
    dt = np.dtype("<f4")
    for i in range(depth):
        dt = np.dtype([(f"f{i}", dt)])
    return dt


UNSTORABLE = {
    "int over 64 KiB": lambda: 1 << (8 * (70 << 10)),
    "dict key int over 64 KiB": lambda: {1 << (8 * (70 << 10)): 1},
    "tensor with a 0 dim and a dim of 2^48": lambda: torch.empty((0, 1 << 48)),
    "array with a 0 dim and a dim of 2^48": lambda: np.empty((0, 1 << 48), dtype=np.float32),
    "numpy structured dtype nested deeper than 8": lambda: np.zeros(2, dtype=_deep_dtype(10)),
    "numpy structured dtype with 1025 fields": lambda: np.zeros(2, dtype=np.dtype([(f"f{i}", "u1")
                                                                                    for i in range(1025)])),
    "numpy subarray dim of 2^20": lambda: np.zeros(0, dtype=np.dtype([("a", "u1", (1 << 20,))])),
    "numpy structured dtype with no fields": lambda: np.zeros(3, dtype=np.dtype([])),
    "one bytes value of 257 MiB": lambda: b"\0" * (257 << 20),
}


@pytest.mark.parametrize("name", sorted(UNSTORABLE))
def test_put_refuses_what_checkout_would_refuse_before_writing(tmp_path, name):
    store = tsck.open_store(tmp_path / "s")
    try:
        store.put_snapshot({"w": torch.arange(4.0)}, ref="a/b", step=1)
        before = sorted(o.key for o in store.storage.list("") if not o.key.startswith("tmp/"))
        with pytest.raises(tsck.UnsupportedType) as ei:
            store.put_snapshot({"x": {"y": UNSTORABLE[name]()}}, ref="a/b", step=2)
        assert "['x']" in str(ei.value), ei.value  # names the path inside the state
        after = sorted(o.key for o in store.storage.list("") if not o.key.startswith("tmp/"))
        assert after == before and [i.step for i in store.log("a/b")] == [1]
    finally:
        store.close()


def test_writer_output_decodes_node_by_node():
    """NodeWriter's sizes are exact and every node it writes decodes with the grammar."""
    nodes = {}

    def put(payload):
        d = bytes([len(nodes) % 256]) * 32
        nodes[d] = payload
        return d

    rows = [[f"k{i}", {"l": [b"x" * 100, "y" * 50, i, {"T": {"dt": "int8", "sh": [3], "n": 3, "x": b"abc"}}]}]
            for i in range(200)]
    value = {"d": [["rows", {"d": rows}], ["big", b"z" * 10_000], ["own", tree.OwnNode({"d": [["a", 1]]})]]}
    top = tree.NodeWriter().write(value, put)
    stack = [top]
    seen = 0
    while stack:
        v = tree.decode_node_value(decode_node(nodes[stack.pop()]), world=True)
        seen += 1
        stack += [it.digest for _p, _d, it in tree.visit(v) if isinstance(it, tree.Ref)]
    assert seen == len(nodes) > 3  # split into several nodes, all reachable and valid


def test_documented_normalisations(tmp_path):
    """docs/FORMAT.md: memory formats and numpy's aligned flag are normalised, values exact.
    If either starts to round-trip, update the doc (and this test)."""
    dt = np.dtype([("a", "u1"), ("b", "<i4")], align=True)
    a = np.zeros(3, dtype=dt)
    a["b"] = 7
    x = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    with tsck.open_store(tmp_path / "s") as s:
        s.put_snapshot({"a": a, "x": x}, ref="a/b")
        got = s.checkout("a/b")
        assert got["a"].dtype == dt and got["a"].tobytes() == a.tobytes() and not got["a"].dtype.isalignedstruct
        assert torch.equal(got["x"], x) and got["x"].is_contiguous()
        into = {"a": np.zeros(3, dtype=dt), "x": torch.zeros_like(x)}
        s.checkout("a/b", into=into)
        assert into["x"].is_contiguous(memory_format=torch.channels_last) and torch.equal(into["x"], x)
