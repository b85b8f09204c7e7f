"""Bad input is refused with the documented error and leaves the store untouched."""
from __future__ import annotations

import dataclasses
import datetime
import fractions
import os

import numpy as np
import pytest
import torch

import tensorstore_ck as tsck

from _util import assert_same, object_listing, rand_tensor, refs_snapshot, tags_snapshot


@pytest.fixture
def sp(tmp_path):
    """(store, path): a local store that already holds one snapshot on ref base/main."""
    path = tmp_path / "store"
    s = tsck.open_store(path, inline_threshold=64)
    s.put_snapshot({"w": rand_tensor(torch.float32, (64, 64), seed=0), "n": 1},
                   ref="base/main", step=1)
    yield s, path
    s.close()


def fresh_payload(seed=123):
    """State with content the store has never seen (so a careless writer would add blocks)."""
    return {"big": rand_tensor(torch.float32, (256, 256), seed=seed),
            "arr": np.arange(10_000, dtype=np.float64) + seed,
            "n": seed}


def state_of(store, path):
    return (refs_snapshot(store), tags_snapshot(store), object_listing(path))


# ---------------------------------------------------------------- names
BAD_NAMES = ["", "a//b", "/a", "a/", "..", "a/../b", ".", "a/./b", "./a", "a/..", "a b",
             "a@b", "a~b", "a\\b", "a\x00b", "a\nb", "a:b", "a*b", "x" * 256,
             "a/" + "b" * 254, "é" * 128]
BAD_NON_STR = [5, b"abc", ["a"], 1.5]


@pytest.mark.parametrize("name", BAD_NAMES + BAD_NON_STR, ids=repr)
def test_invalid_ref_name_put(sp, name):
    store, path = sp
    before = state_of(store, path)
    with pytest.raises(tsck.InvalidName) as ei:
        store.put_snapshot(fresh_payload(), ref=name, step=2)
    assert isinstance(ei.value, tsck.TsckError) and isinstance(ei.value, ValueError)
    assert state_of(store, path) == before


@pytest.mark.parametrize("name", BAD_NAMES + BAD_NON_STR, ids=repr)
def test_invalid_tag_name(sp, name):
    store, path = sp
    before = state_of(store, path)
    with pytest.raises(tsck.InvalidName):
        store.tag(name, "base/main")
    assert state_of(store, path) == before


@pytest.mark.parametrize("name", ["../../etc/passwd", "a//b", "/abs", "a b", "", "..", "a/"],
                         ids=repr)
def test_invalid_target_refused(sp, name):
    store, path = sp
    before = state_of(store, path)
    with pytest.raises((tsck.InvalidName, tsck.RefNotFound)):
        store.checkout(name)
    with pytest.raises((tsck.InvalidName, tsck.RefNotFound)):
        store.resolve(name)
    assert state_of(store, path) == before


@pytest.mark.parametrize("name", ["a", "jobA/main", "x.y_z-1/2/3", "A-1.b_c", ".hidden",
                                  "..a/b..", "a.", "x" * 255, "a/" * 127 + "b", "0123"],
                         ids=lambda n: n if len(n) < 20 else f"len{len(n)}")
def test_valid_ref_names_accepted(sp, name):
    store, _ = sp
    assert len(name.encode()) <= 255
    info = store.put_snapshot({"v": 1}, ref=name)
    assert store.refs()[name].root == info.root
    assert store.checkout(name) == {"v": 1}


# ---------------------------------------------------------------- unknown targets
def test_unknown_targets_raise_refnotfound(sp):
    store, path = sp
    root = store.resolve("base/main")
    other = ("0" if root[0] != "0" else "1") * 64
    before = state_of(store, path)
    for target in ["nope", "nope/main", "base/other", "base/main@999", "base/main@0",
                   "no-such-tag", other, other[:8], other[:20]]:
        with pytest.raises(tsck.RefNotFound) as ei:
            store.checkout(target)
        assert isinstance(ei.value, tsck.TsckError) and isinstance(ei.value, KeyError)
        with pytest.raises(tsck.RefNotFound):
            store.resolve(target)
        with pytest.raises(tsck.RefNotFound):
            store.show(target)
    with pytest.raises(tsck.RefNotFound):
        store.log("nope/main")
    with pytest.raises(tsck.RefNotFound):
        store.tag("t1", "nope/main")
    with pytest.raises(tsck.RefNotFound):
        store.tag("t2", other)
    assert state_of(store, path) == before


def test_short_prefix_not_accepted(sp):
    store, _ = sp
    root = store.resolve("base/main")
    for n in range(1, 8):
        with pytest.raises(tsck.TsckError):
            store.checkout(root[:n])
        with pytest.raises(tsck.TsckError):
            store.resolve(root[:n])
    assert store.resolve(root[:8]) == root
    assert store.resolve(root) == root


def test_ambiguous_prefix_is_error(sp):
    """Two snapshots whose roots share >= 10 hex digits: a prefix of them is ambiguous.

    A natural 8-hex-digit collision needs ~2**16 commits, so the second root is planted
    in the ref table (catalog row + ref) through the RefTable interface; only public
    resolution behaviour is checked."""
    store, _ = sp
    root = store.resolve("base/main")
    rt = store.reftable
    twin = root[:10] + ("0" if root[10] != "0" else "1") + root[11:]
    rt.compare_and_swap("zz/twin", None, bytes.fromhex(twin), message="test: colliding root",
                        catalog_row=rt.catalog_get(bytes.fromhex(root)))
    for prefix in (root[:8], root[:10]):
        with pytest.raises(tsck.TsckError) as ei:
            store.resolve(prefix)
        assert not isinstance(ei.value, tsck.RefNotFound), "ambiguous is not 'not found'"
        with pytest.raises(tsck.TsckError):
            store.checkout(prefix)
    assert store.resolve(root[:11]) == root
    assert store.resolve(root) == root


# ---------------------------------------------------------------- not a store
def test_non_empty_dir_without_marker_is_not_a_store(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "important.txt").write_text("user data")
    (d / "sub").mkdir()
    with pytest.raises(tsck.NotAStore) as ei:
        tsck.open_store(d)
    assert isinstance(ei.value, tsck.TsckError)
    assert sorted(os.listdir(d)) == ["important.txt", "sub"]  # nothing created
    assert (d / "important.txt").read_text() == "user data"
    with pytest.raises(tsck.NotAStore):
        tsck.open_store(f"file://{d}")


def test_regular_file_is_not_a_store(tmp_path):
    f = tmp_path / "file.bin"
    f.write_bytes(b"not a store")
    with pytest.raises(tsck.NotAStore):
        tsck.open_store(f)
    with pytest.raises(tsck.NotAStore):
        tsck.open_store(str(f))
    assert f.read_bytes() == b"not a store"


def test_empty_dir_becomes_store(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    with tsck.open_store(d) as s:
        s.put_snapshot({"a": 1}, ref="e/main")
    assert (d / "tsck.json").is_file()
    with tsck.open_store(d) as s:
        assert s.checkout("e/main") == {"a": 1}


# ---------------------------------------------------------------- unsupported types
class Custom:
    pass


def _sparse():
    return torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0]),
                                   (2, 2))


UNSUPPORTED = {
    "lambda": lambda: (lambda x: x),
    "object": lambda: object(),
    "custom": lambda: Custom(),
    "set": lambda: {1, 2},
    "frozenset": lambda: frozenset({1}),
    "tuple_key": lambda: {(1, 2): 3},
    "float_key": lambda: {1.5: 3},
    "none_key": lambda: {None: 3},
    "object_array": lambda: np.array([1, "a", None], dtype=object),
    "sparse": _sparse,
    "sparse_csr": lambda: _sparse().to_sparse_csr(),
    "half_stateful": lambda: type("OnlySaves", (), {"state_dict": lambda self: {}})(),  # no load_state_dict
    "generator": lambda: (i for i in range(3)),
    "type": lambda: int,
    "numpy_int_key": lambda: {np.int64(3): 1},  # only str and int keys
    "cycle": lambda: (lambda lst: (lst.append(lst), lst)[1])([]),
    "bytearray": lambda: bytearray(b"abc"),  # only bytes is a listed type
    "complex": lambda: complex(1, 2),  # python complex is not a listed type
}


@pytest.mark.parametrize("kind", list(UNSUPPORTED))
def test_unsupported_type_deep_path(sp, kind):
    store, path = sp
    bad = UNSUPPORTED[kind]()
    # lots of new data BEFORE the bad leaf (in insertion order), so a streaming writer
    # that only validates as it goes would already have written blocks.
    state = {"first": fresh_payload(7),
             "a": {"x": fresh_payload(8), "b": [rand_tensor(torch.int64, (3000,), seed=9),
                                                  "ok", bad, 1.0]},
             "last": fresh_payload(10)}
    before = state_of(store, path)
    with pytest.raises(tsck.UnsupportedType) as ei:
        store.put_snapshot(state, ref="bad/main", step=5)
    e = ei.value
    assert isinstance(e, tsck.TsckError)
    assert isinstance(e.kind, str) and e.kind
    if kind == "cycle":  # reported where the cycle is detected, at or below its start
        assert e.path.startswith("['a']['b'][2]"), e.path
    else:
        assert e.path == "['a']['b'][2]", e.path
    assert "['a']['b'][2]" in str(e)
    assert state_of(store, path) == before
    assert "bad/main" not in store.refs()


def test_unsupported_int_key_and_tuple_path(sp):
    store, path = sp
    state = {"opt": {"state": {3: {"exp_avg": torch.zeros(2), "weird": (1, object())}}}}
    before = state_of(store, path)
    with pytest.raises(tsck.UnsupportedType) as ei:
        store.put_snapshot(state, ref="bad/int")
    assert ei.value.path == "['opt']['state'][3]['weird'][1]"
    assert state_of(store, path) == before


def test_unsupported_on_existing_ref_keeps_ref(sp):
    store, path = sp
    root = store.resolve("base/main")
    before = state_of(store, path)
    with pytest.raises(tsck.UnsupportedType):
        store.put_snapshot({"w": fresh_payload(3), "z": {1, 2}}, ref="base/main", step=2)
    assert store.resolve("base/main") == root
    assert [i.root for i in store.log("base/main")] == [root]
    assert state_of(store, path) == before


def test_unsupported_in_memory_store_leaves_no_ref():
    s = tsck.open_store(f"memory://tsck-unsup-{os.getpid()}-{id(object())}")
    try:
        with pytest.raises(tsck.UnsupportedType) as ei:
            s.put_snapshot([1, 2, {"k": object()}], ref="m/main")
        assert ei.value.path == "[2]['k']"
        assert s.refs() == {}
    finally:
        s.close()


def test_too_deep_refused_cleanly(sp):
    store, path = sp
    deep = 1
    for _ in range(5000):
        deep = [deep]
    before = state_of(store, path)
    with pytest.raises(tsck.UnsupportedType):
        store.put_snapshot({"w": fresh_payload(11), "deep": deep}, ref="bad/deep")
    assert state_of(store, path) == before


@pytest.mark.parametrize("where", ["value", "key"])
def test_unencodable_str_roundtrips_or_refused_cleanly(sp, where):
    """A str holding a lone surrogate cannot be UTF-8 encoded: it must round-trip exactly
    or be refused with UnsupportedType naming its path, writing nothing."""
    store, path = sp
    s = "ok\ud800x"
    state = {"w": fresh_payload(12), "s": s} if where == "value" else {"w": fresh_payload(12), s: 1}
    before = state_of(store, path)
    try:
        store.put_snapshot(state, ref="bad/surrogate")
    except tsck.UnsupportedType as e:
        if where == "value":
            assert e.path == "['s']"
        assert state_of(store, path) == before
    else:
        assert_same(state, store.checkout("bad/surrogate"))


def test_bool_key_exact_or_refused(sp):
    store, path = sp
    state = {True: "t", 2: "two"}
    try:
        store.put_snapshot(state, ref="bad/boolkey")
    except tsck.UnsupportedType:
        assert "bad/boolkey" not in store.refs()
    else:  # a bool key must not come back as int
        assert_same(state, store.checkout("bad/boolkey"))


# ---------------------------------------------------------------- pickle opt-in
@dataclasses.dataclass
class Picklable:
    name: str
    values: list


_UNPICKLED = []


def _make_canary(tag):
    _UNPICKLED.append(tag)
    return Canary(tag)


class Canary:
    def __init__(self, tag):
        self.tag = tag

    def __reduce__(self):
        return (_make_canary, (self.tag,))

    def __eq__(self, other):
        return type(other) is Canary and other.tag == self.tag


def test_allow_pickle_roundtrip(sp):
    store, _ = sp
    obj = Picklable("x", [1, 2.5, "three"])
    state = {"obj": obj, "frac": fractions.Fraction(1, 3), "set": {1, 2, 3},
             "when": datetime.datetime(2024, 1, 2, 3, 4, 5),
             "w": torch.arange(6.0), "nested": [Picklable("y", [])]}
    store.put_snapshot(state, ref="pk/main", allow_pickle=True)
    out = store.checkout("pk/main", allow_pickle=True)
    assert_same(state, out)
    assert type(out["obj"]) is Picklable and out["obj"] == obj


def test_checkout_without_allow_pickle_refuses(sp):
    store, path = sp
    _UNPICKLED.clear()
    store.put_snapshot({"c": Canary("boom"), "w": torch.ones(3)}, ref="pk/canary",
                       allow_pickle=True)
    _UNPICKLED.clear()
    with pytest.raises(tsck.TsckError) as ei:
        store.checkout("pk/canary")
    assert isinstance(ei.value, (tsck.UnsupportedType, tsck.FormatError)), type(ei.value)
    assert _UNPICKLED == [], "checkout unpickled without allow_pickle=True"
    out = store.checkout("pk/canary", allow_pickle=True)
    assert out["c"] == Canary("boom") and _UNPICKLED == ["boom"]


def test_put_without_allow_pickle_refuses_picklable(sp):
    store, path = sp
    before = state_of(store, path)
    with pytest.raises(tsck.UnsupportedType) as ei:
        store.put_snapshot({"x": [fresh_payload(4), Picklable("a", [])]}, ref="pk/no")
    assert ei.value.path == "['x'][1]"
    assert state_of(store, path) == before


# ---------------------------------------------------------------- conflicts
def test_tag_existing_raises_refconflict(sp):
    store, path = sp
    info = store.tag("golden", "base/main")
    root = store.resolve("base/main")
    assert info.root == root and store.tags()["golden"].root == root
    store.put_snapshot({"n": 2}, ref="base/main", step=2)
    new_root = store.resolve("base/main")
    for target in ("base/main", root):  # different target and same target: both refused
        with pytest.raises(tsck.RefConflict) as ei:
            store.tag("golden", target)
        assert isinstance(ei.value, tsck.TsckError)
        assert store.tags()["golden"].root == root
    assert store.resolve("golden") == root and new_root != root


def test_expected_wrong_root_raises_and_keeps_ref(sp):
    store, path = sp
    cur = store.resolve("base/main")
    wrong = ("f" if cur[0] != "f" else "e") * 64
    before_refs = refs_snapshot(store)
    with pytest.raises(tsck.RefConflict) as ei:
        store.put_snapshot(fresh_payload(5), ref="base/main", step=2, expected=wrong)
    e = ei.value
    assert isinstance(e, tsck.TsckError)
    assert e.expected == wrong
    assert e.actual == cur
    assert refs_snapshot(store) == before_refs
    assert [i.root for i in store.log("base/main")] == [cur]


def test_expected_none_on_existing_ref(sp):
    store, _ = sp
    cur = store.resolve("base/main")
    with pytest.raises(tsck.RefConflict) as ei:
        store.put_snapshot({"n": 9}, ref="base/main", expected=None)
    assert ei.value.expected is None and ei.value.actual == cur
    assert store.resolve("base/main") == cur


def test_expected_root_on_missing_ref(sp):
    store, _ = sp
    cur = store.resolve("base/main")
    with pytest.raises(tsck.RefConflict) as ei:
        store.put_snapshot({"n": 9}, ref="fresh/main", expected=cur)
    assert ei.value.expected == cur and ei.value.actual is None
    assert "fresh/main" not in store.refs()


def test_expected_correct_succeeds(sp):
    store, _ = sp
    cur = store.resolve("base/main")
    info = store.put_snapshot({"n": 2}, ref="base/main", step=2, expected=cur)
    assert info.parent == cur and store.resolve("base/main") == info.root
    info2 = store.put_snapshot({"n": 1}, ref="new/main", expected=None)
    assert store.resolve("new/main") == info2.root


def test_error_hierarchy():
    for cls in (tsck.RefConflict, tsck.RefNotFound, tsck.IntegrityError, tsck.FormatError,
                tsck.UnsupportedType, tsck.SnapshotAborted, tsck.InvalidName, tsck.NotAStore,
                tsck.CheckoutMismatch):
        assert issubclass(cls, tsck.TsckError)
        assert cls is getattr(tsck.errors, cls.__name__)
    assert issubclass(tsck.RefNotFound, KeyError)
    assert issubclass(tsck.InvalidName, ValueError)
    assert issubclass(tsck.CheckoutMismatch, ValueError)
