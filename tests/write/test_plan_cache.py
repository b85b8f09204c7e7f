"""The plan of an unchanged layout, kept across snapshots (plancache.py).

The one promise: a put planned from a kept layout writes exactly the manifest a full plan
writes, and refuses exactly what a full plan refuses. Each test compares a store whose
puts keep layouts with a reference store whose every put is planned whole, on the same
states: the snapshot's tree address (a Merkle root over every node and block) must be the
same, and so must a refusal's type and message. A seeded walk changes the state one way
at a time, through every kind of layout change (each must be planned whole: a miss) and
every kind of value-only change (each must be planned from the kept layout: a hit).
"""

from __future__ import annotations

import collections
import copy
import random

import pytest
import torch

from _util import assert_same

import tensorstore_ck as tsck
from tensorstore_ck.format.manifest import commit_tree
from tensorstore_ck.format.tree import MAX_BIGINT_BYTES

BS = 64 * 1024  # block size; INLINE: tensors of at most this many bytes live in their node
INLINE = 1024


def _base():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 5, dtype=torch.complex64, generator=g)
    return {
        "model": collections.OrderedDict(
            (f"layer.{i}.w", torch.nn.Parameter(torch.randn(64, 48 + i, generator=g))) for i in range(4)),
        "optim": {"state": {i: {"exp_avg": torch.randn(64, 48 + i, generator=g),
                                "exp_avg_sq": torch.rand(64, 48 + i, generator=g)} for i in range(4)},
                  "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1, 2, 3], "fused": None}]},
        "small": [torch.arange(7), torch.ones(3, dtype=torch.bool), torch.zeros(2, 2, dtype=torch.bfloat16)],
        "big": torch.randn(300, 300, generator=g),           # several blocks
        "strided": torch.randn(40, 30, generator=g).t(),   # non-contiguous, staged through a copy
        "conj": z.conj(),                                   # a conjugate view, resolved when staged
        "grad": torch.randn(10, generator=g).requires_grad_(),
        "step": 1, "name": "run-a", "blob": b"\x00\x01", "lr": 0.5, "flag": True, "none": None,
        "empty": {}, "nested": {"a": {"b": {"c": (torch.randn(300, generator=g), 3)}}},
    }


# Each change: (name, fn(state) -> None, whether the kept layout still applies).
def _values(s, r):
    for path in (("big",), ("model", "layer.0.w"), ("small", 0), ("nested", "a", "b", "c", 0)):
        t = _get(s, path)
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
            with torch.no_grad():
                t.add_(r.randint(1, 9))


def _get(s, path):
    try:
        for k in path:
            s = s[k]
        return s
    except (KeyError, IndexError, TypeError):
        return None


def _set(path, value):
    """fn(state, rng): state[path] = value(old) (a callable) or value; nothing where an
    earlier change took the path away."""
    def fn(s, r):
        d = _get(s, path[:-1])
        if d is None or type(d) is tuple or (isinstance(d, dict) and path[-1] not in d and callable(value)):
            return
        d[path[-1]] = value(d[path[-1]]) if callable(value) else value
    return fn


HITS = [
    ("tensor values", _values),
    ("step +1", _set(("step",), lambda v: v + 1 if v < 100 else v)),
    ("a str of the same length", _set(("name",), lambda v: v[:-1] + ("b" if v[-1] != "b" else "a"))),
    ("a float", _set(("lr",), lambda v: v / 2)),
    ("a nan", _set(("lr",), float("nan"))),
    ("bytes of the same length", _set(("blob",), lambda v: bytes(reversed(v)))),
    ("a bool", _set(("flag",), lambda v: (not v) if type(v) is bool else v)),
    ("a tuple's plain item", _set(("nested", "a", "b", "c"), lambda v: (v[0], v[1] + 1 if v[1] < 100 else 3))),
    ("a new tensor object of the same kind", _set(("big",), lambda v: v.clone() + 1)),
]

MISSES = [
    ("a shape", _set(("small", 0), lambda v: torch.arange(v.numel() + 1))),
    ("a dtype", _set(("big",), lambda v: v.to(torch.float64 if v.dtype == torch.float32 else torch.float32))),
    ("a Parameter becomes a tensor", _set(("model", "layer.1.w"), lambda v: v.detach().clone()
                                          if type(v) is torch.nn.Parameter else torch.nn.Parameter(v))),
    ("requires_grad", _set(("grad",), lambda v: v.detach().clone().requires_grad_(not v.requires_grad))),
    ("a key added", _set(("optim", "extra"), 7)),
    ("a key removed", lambda s, r: s.pop("none", None) if "none" in s else s.__setitem__("none", None)),
    ("a key renamed", lambda s, r: s.__setitem__("name2" if "name" in s else "name", s.pop("name", None) or s.pop("name2"))),
    ("keys reordered", lambda s, r: s.__setitem__("model", collections.OrderedDict(reversed(s["model"].items())))),
    ("a dict becomes an OrderedDict", _set(("empty",), lambda v: collections.OrderedDict() if type(v) is dict else {})),
    ("a list becomes a tuple", _set(("small",), lambda v: tuple(v) if type(v) is list else list(v))),
    ("a list grows", _set(("optim", "param_groups", 0, "params"), lambda v: v + [len(v)])),
    ("an int key becomes a str", lambda s, r: s["optim"].__setitem__("state", {
        (str(k) if type(k) is int else int(k)): v for k, v in s["optim"]["state"].items()})),
    ("an int plain becomes a float", _set(("optim", "param_groups", 0, "fused"), lambda v: 1.0 if v is None else None)),
    ("True becomes 1", _set(("flag",), lambda v: 1 if type(v) is bool else True)),
    ("an int crosses an encoding size", _set(("step",), lambda v: 1000 if v < 1000 else 1)),
    ("a str grows", _set(("name",), lambda v: v + "x" * 40)),
    ("a big int", _set(("step",), 2 ** 70)),
    ("a tensor becomes a plain value", _set(("grad",), lambda v: 0.0 if isinstance(v, torch.Tensor) else
                                         torch.randn(10).requires_grad_())),
    ("a sub-tree moves deeper", lambda s, r: s.__setitem__("nested", {"x": s["nested"]})),
    ("a tensor goes inline", _set(("big",), lambda v: torch.randn(8) if v.numel() > 8 else torch.randn(300, 300))),
]

REFUSED = [  # a state that matches a kept layout but must be refused as a full plan refuses it
    ("a str with a lone surrogate", _set(("name",), "run\ud800")),
    ("a bool key", lambda s, r: s.__setitem__(True, 1)),
    ("an int beyond the stored limit", _set(("step",), 2 ** (8 * MAX_BIGINT_BYTES + 8))),
    ("a sparse tensor of the same shape", _set(("big",), lambda v: v.to_sparse())),
    ("a meta tensor", _set(("big",), lambda v: torch.empty(v.shape, device="meta"))),
]


def _tree(store, root: str) -> bytes:
    return commit_tree(store.core.assets.get_commit(bytes.fromhex(root)))


def _outcome(store, state, ref, blocking, fresh=False):
    if fresh:
        store._plan_cache = None  # this put is planned whole
    try:
        r = store.put_snapshot(state, ref=ref, blocking=blocking)
        info = r if blocking else r.result(timeout=60)
        return "ok", _tree(store, info.root)
    except tsck.TsckError as e:
        return type(e).__name__, str(e)


@pytest.fixture(params=[0, 40_000], ids=["unpacked", "packed"])
def stores(tmp_path, request):
    """pack_size 40,000: the 12-13 KB tensors packed three to a pack, so a kept layout must
    stage each pack whole and name the same packs as a whole plan does."""
    kept = tsck.open_store(str(tmp_path / "kept"), block_size=BS, inline_threshold=INLINE, pack_size=request.param)
    whole = tsck.open_store(str(tmp_path / "whole"), block_size=BS, inline_threshold=INLINE, pack_size=request.param)
    yield kept, whole
    kept.close()
    whole.close()


def _put_both(kept, whole, state, n, blocking):
    """Put `state` into both stores -> 1 if the kept store planned it from a kept layout, else 0."""
    cache = kept._plan_cache
    hits, asked = (cache.hits, cache.hits + cache.misses) if cache else (0, 0)
    got = _outcome(kept, state, "cache/kept", blocking)
    want = _outcome(whole, state, "cache/whole", True, fresh=True)
    assert got == want, n
    cache = kept._plan_cache
    assert cache.hits + cache.misses == asked + 1, n  # every put asks once
    return cache.hits - hits


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_kept_layout_writes_what_a_whole_plan_writes_through_every_change(stores, seed):
    kept, whole = stores
    r = random.Random(seed)
    state = _base()
    _put_both(kept, whole, state, "first", True)
    changes = [(n, fn, True) for n, fn in HITS] + [(n, fn, False) for n, fn in MISSES]
    seen = set()
    for i in range(60):
        name, fn, hit = r.choice(changes)
        fn(state, r)
        blocking = r.random() < 0.5
        hits = _put_both(kept, whole, state, f"{i}: {name}", blocking)
        # After a layout change the next put is planned whole and the new layout kept; a
        # value-only change is planned from it (a change back to an older layout may hit:
        # a few layouts are kept).
        if hit:
            assert hits == 1, f"{i}: {name} was planned whole"
        seen.add((name, hit))
        hits = _put_both(kept, whole, state, f"{i}: {name}, again", not blocking)
        assert hits == 1, f"{i}: {name}: the same state again was planned whole"
        if r.random() < 0.1:
            assert_same(state, kept.checkout("cache/kept"))
    assert_same(state, kept.checkout("cache/kept"))
    assert len(seen) >= 20


@pytest.mark.parametrize("name,fn", MISSES, ids=[n for n, _ in MISSES])
def test_every_layout_change_is_planned_whole(stores, name, fn):
    kept, whole = stores
    state = _base()
    _put_both(kept, whole, state, "first", True)
    assert _put_both(kept, whole, state, "again", False) == 1
    fn(state, random.Random(0))
    assert _put_both(kept, whole, state, name, False) == 0, f"{name}: planned from the old layout"
    assert_same(state, kept.checkout("cache/kept"))


@pytest.mark.parametrize("name,fn", REFUSED, ids=[n for n, _ in REFUSED])
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_refused_change_is_refused_as_a_whole_plan_refuses_it(stores, name, fn, blocking):
    kept, whole = stores
    state = _base()
    _put_both(kept, whole, state, "first", True)
    assert _put_both(kept, whole, state, "again", blocking) == 1
    before = kept.resolve("cache/kept")
    bad = copy.copy(state)
    bad["small"] = list(state["small"])
    fn(bad, random.Random(0))
    got = _outcome(kept, bad, "cache/kept", blocking)
    assert got == _outcome(whole, bad, "cache/whole", True, fresh=True)
    assert got[0] != "ok", name
    assert kept.resolve("cache/kept") == before  # the store as it was
    # and the layout kept before still serves the good state
    assert _put_both(kept, whole, state, "good again", blocking) == 1


def test_an_async_put_from_a_kept_layout_holds_the_values_it_was_given(tmp_path):
    """The staging copy of a kept layout goes into views kept with each buffer: a
    snapshot holds its state as it was when the put returned, whichever buffer it took,
    also when the layout changes between puts and the buffers' views are made again."""
    with tsck.open_store(str(tmp_path / "s"), block_size=BS, inline_threshold=INLINE, max_inflight=2) as store:
        state = _base()
        expect, futs = [], []
        for i in range(12):
            if i == 6:
                state["big"] = torch.randn(310, 300)  # a new layout mid-way
            for t in (state["big"], state["small"][0], state["strided"]):
                with torch.no_grad():
                    t.fill_(i)
            state["step"] = i
            futs.append(store.put_snapshot(state, ref="cache/async", step=i, blocking=False))
            expect.append(copy.deepcopy(state))
            for t in (state["big"], state["small"][0], state["strided"]):  # changed once the put returned
                with torch.no_grad():
                    t.fill_(-1)
        roots = [f.result(timeout=60).root for f in futs]
        for root, want in zip(roots, expect):
            assert_same(want, store.checkout(root))
        assert store._plan_cache.hits >= 9


@pytest.mark.parametrize("state", [None, 3, "s", torch.arange(3.0), [], {}], ids=repr)
def test_a_state_that_is_one_value_is_kept_too(stores, state):
    kept, whole = stores
    assert [_put_both(kept, whole, state, i, i == 1) for i in range(3)] == [0, 1, 1]


def test_what_a_layout_cannot_hold_is_planned_whole_every_time(stores):
    """A quantized tensor's parameters change from snapshot to snapshot, and torch has no
    copy into a staging buffer for the sub-byte dtypes: a state holding one is never
    planned from a kept layout."""
    kept, whole = stores
    odd = [lambda i: torch.quantize_per_tensor(torch.rand(40), 0.1 * (i + 1), i, torch.qint8)]
    if hasattr(torch, "uint4"):
        odd.append(lambda i: torch.full((4,), i, dtype=torch.uint8).view(torch.uint4))
    for make in odd:
        for i in range(3):
            state = {"odd": make(i), "w": torch.full((300,), float(i)), "step": i}
            assert _put_both(kept, whole, state, i, i % 2 == 0) == 0
            assert_same(state, kept.checkout("cache/kept"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
def test_device_tensors_from_a_kept_layout(stores):  # pragma: no cover - runs on a GPU machine
    """Device tensors beside host ones: staged through pinned views of the buffer on a side
    stream, the same tree as a whole plan, and a value changed once the put returned is not
    in the snapshot."""
    kept, whole = stores
    state = {"w": torch.randn(300, 300, device="cuda"), "ids": torch.arange(5, device="cuda"),
             "h": torch.randn(400), "many": [torch.randn(700 + i, device="cuda") for i in range(600)], "step": 0}
    for i in range(4):
        with torch.no_grad():
            state["w"].add_(1)
            state["h"].add_(1)
        state["step"] = i
        assert _put_both(kept, whole, state, i, i % 2 == 1) == (1 if i else 0)
        assert_same(state, kept.checkout("cache/kept"))
    want = copy.deepcopy(state)
    fut = kept.put_snapshot(state, ref="cache/kept", blocking=False)
    for t in [state["w"], state["h"]] + state["many"]:
        t.fill_(-1)
    assert_same(want, kept.checkout(fut.result(timeout=60).root))


def test_the_first_put_from_a_kept_layout_reuses_the_whole_plans_buffer(tmp_path):
    """A plan from a kept layout stages the inline tensors too, so it needs more bytes than
    the whole plan that kept it; the whole plan's buffer is sized for it, so the next put
    copies into memory already mapped (a fresh buffer, pinned on a GPU host, costs more
    than the copy)."""
    with tsck.open_store(str(tmp_path / "s"), block_size=BS, inline_threshold=INLINE) as store:
        state = {"big": torch.randn(100_000), "small": [torch.randn(200) for _ in range(200)]}  # 160 KB inline
        ptrs = []
        for i in range(3):
            store.put_snapshot(state, ref="cache/buf", step=i, blocking=False).result(timeout=60)
            ptrs.append(sorted(b.data_ptr() for b in store._puts.staging._free))
        assert store._plan_cache.hits == 2
        assert ptrs[0] == ptrs[1] == ptrs[2] and len(ptrs[0]) == 1, ptrs


def test_the_views_a_kept_layout_stages_into_are_made_in_the_background(tmp_path):
    """The whole plan that kept a layout has its background publisher make that layout's
    typed views of the staging buffer, so the first put from the layout makes none on the
    caller's thread; each view is where the layout stages its tensor, whatever its dtype
    or shape (0-d, an empty dimension, a packed member)."""
    state = {"w": torch.randn(40, 30), "e": torch.empty(3, 0), "z": torch.tensor(2.5, dtype=torch.float64),
             "b": torch.ones(5, dtype=torch.bool), "h": torch.randn(7, 9, dtype=torch.bfloat16),
             "c": torch.randn(4, dtype=torch.complex64), "i": torch.arange(300), "step": 0}
    with tsck.open_store(str(tmp_path / "s"), block_size=BS, inline_threshold=64, pack_size=BS) as store:
        store.put_snapshot(state, ref="cache/views", step=0, blocking=False).result(timeout=60)
        (buf,) = store._puts.staging._free
        lay, views = buf._tsck_views
        assert lay is store._plan_cache._layouts[0]
        for (name, t), v, off in zip(((k, v) for k, v in state.items() if k != "step"), views, lay.offsets):
            assert (v.dtype, v.shape, v.is_contiguous()) == (t.dtype, t.shape, True), name
            assert v.numel() == 0 or v.data_ptr() == buf.data_ptr() + off, name  # (empty: no address)
        for i in range(1, 3):
            with torch.no_grad():
                state["w"].add_(1)
            state["step"] = i
            store.put_snapshot(state, ref="cache/views", step=i, blocking=False).result(timeout=60)
            assert buf._tsck_views[1] is views  # staged into the views made in the background
            assert_same(state, store.checkout("cache/views"))
        assert store._plan_cache.hits == 2
