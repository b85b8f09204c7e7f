"""checkout(paths=), checkout(into=subset), map_location and DCP Stateful objects.

Reads are counted on the store's own Assets (the real storage below answers them):
a partial checkout must read only the nodes on the way to what it names and the
blocks of what it names.
"""

from __future__ import annotations

import collections

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.format.manifest import encode_node

from _util import assert_same


def _counting(store) -> collections.Counter:
    """Count the node and block reads of `store` (each still goes to the storage)."""
    cnt: collections.Counter = collections.Counter()
    a = store.assets
    get_node, read_block_into = a.get_node, a.read_block_into

    def counted_node(d, *args, **kw):
        cnt["node"] += 1
        return get_node(d, *args, **kw)

    def counted_block(d, *args, **kw):
        cnt["block"] += 1
        cnt["block_bytes"] += args[0].nbytes if args else kw["out"].nbytes
        return read_block_into(d, *args, **kw)

    a.get_node, a.read_block_into = counted_node, counted_block
    return cnt


@pytest.fixture
def big_state():
    g = torch.Generator().manual_seed(0)
    # 200 tensors of 256 KiB: each is blocks of its own (above the inline threshold).
    model = {f"layers.{i}.weight": torch.randn(256, 256, generator=g) for i in range(200)}
    optim = {"state": {i: {"exp_avg": torch.randn(256, 256, generator=g), "step": torch.tensor(float(i))}
                       for i in range(4)},
             "param_groups": [{"lr": 1e-3, "params": [0, 1, 2, 3]}]}
    return {"model": model, "optim": optim, "step": 10, "rng": [7, torch.arange(5), (1, "x")]}


def test_one_tensor_of_200_reads_its_blocks_and_the_nodes_on_its_path(store, big_state):
    store.put_snapshot(big_state, ref="j/main", step=10)
    cnt = _counting(store)
    full = store.checkout("j/main")
    full_nodes, full_blocks = cnt["node"], cnt["block"]
    assert full_blocks >= 204
    cnt.clear()
    out = store.checkout("j/main", paths=["model.layers.7.weight"])
    assert list(out) == ["model"] and list(out["model"]) == ["layers.7.weight"]
    assert torch.equal(out["model"]["layers.7.weight"], big_state["model"]["layers.7.weight"])
    # Its own blocks (256 KiB of them) and the nodes on its path only.
    assert cnt["block_bytes"] == 256 * 256 * 4
    assert cnt["node"] <= 4, cnt
    assert cnt["node"] <= full_nodes and 100 * cnt["block"] < full_blocks
    assert_same(full, big_state)


def test_paths_select_sub_trees_dotted_like_tsck_ls(store, big_state):
    store.put_snapshot(big_state, ref="j/main", step=10)
    out = store.checkout("j/main", paths=["optim.state.3", "step", "rng.1", "model.layers.19"])
    assert set(out) == {"optim", "step", "rng", "model"}
    assert list(out["optim"]) == ["state"] and list(out["optim"]["state"]) == [3]
    assert_same(out["optim"]["state"][3], big_state["optim"]["state"][3])
    assert out["step"] == 10
    # A list of which only some items are asked for: {index: item}, no index shifts.
    assert list(out["rng"]) == [1] and torch.equal(out["rng"][1], torch.arange(5))
    # A prefix of a flat state_dict's dotted keys selects the keys under it, not layers.190.
    assert list(out["model"]) == ["layers.19.weight"]
    # The whole of a sequence, asked for by its own path, is the sequence itself.
    assert_same(store.checkout("j/main", paths=["rng"])["rng"], big_state["rng"])


@pytest.mark.parametrize("paths, why", [
    (["model.nope"], "holds nothing at 'model.nope'"),
    (["step.x"], "holds nothing at 'step.x'"),          # below a leaf
    (["model", "zzz"], "holds nothing at 'zzz'"),
])
def test_a_path_that_names_nothing_is_refused_before_any_block_is_read(store, big_state, paths, why):
    store.put_snapshot(big_state, ref="j/main", step=10)
    cnt = _counting(store)
    with pytest.raises(tsck.InvalidArgument, match=why):
        store.checkout("j/main", paths=paths)
    assert cnt["block"] == 0


@pytest.mark.parametrize("paths", ["model", [], [""], [".a"], ["a."], [3], 5])
def test_bad_paths_arguments(store, paths):
    store.put_snapshot({"a": 1}, ref="j/main", step=1)
    assert store.checkout("j/main", paths=None) == {"a": 1}
    with pytest.raises(tsck.InvalidArgument, match="path"):
        store.checkout("j/main", paths=paths)


def test_into_a_subset_reads_only_it_and_adds_nothing(store, big_state):
    store.put_snapshot(big_state, ref="j/main", step=10)
    mine = {"model": {"layers.3.weight": torch.zeros(256, 256)}, "step": 0}
    t = mine["model"]["layers.3.weight"]
    cnt = _counting(store)
    out = store.checkout("j/main", into=mine)
    assert out is mine and mine["model"]["layers.3.weight"] is t
    assert torch.equal(t, big_state["model"]["layers.3.weight"]) and mine["step"] == 10
    assert list(mine) == ["model", "step"] and list(mine["model"]) == ["layers.3.weight"]
    assert cnt["block_bytes"] == 256 * 256 * 4 and cnt["node"] <= 4, cnt


def test_into_with_a_key_the_snapshot_lacks_changes_nothing(store, big_state):
    store.put_snapshot(big_state, ref="j/main", step=10)
    mine = {"model": {"layers.3.weight": torch.zeros(256, 256), "layers.999.weight": torch.zeros(1)}, "step": 0}
    cnt = _counting(store)
    with pytest.raises(tsck.CheckoutMismatch, match="layers.999.weight"):
        store.checkout("j/main", into=mine)
    assert cnt["block"] == 0 and mine["step"] == 0 and not mine["model"]["layers.3.weight"].any()


def test_into_and_paths_together(store, big_state):
    store.put_snapshot(big_state, ref="j/main", step=10)
    mine = {"model": {"layers.3.weight": torch.zeros(256, 256)}, "step": 0}
    store.checkout("j/main", into=mine, paths=["step"])
    assert mine["step"] == 10 and not mine["model"]["layers.3.weight"].any()


# ---------------------------------------------------------------- map_location
def _planted(store, dev: str, ref="dev/x"):
    """A snapshot whose tensor says it was saved on `dev` (this machine may lack it)."""
    node = store.assets.put_node(encode_node({"d": [["w", {"T": {"dt": "float32", "sh": [2], "n": 8,
                                                                    "x": b"\0\0\x80?\0\0\0@", "dev": dev}}]]}))
    store.assets.sync()
    stats = {"bytes_total": 8, "bytes_new": 0, "blocks_total": 0, "blocks_new": 0}
    return store.commit_tree(node.digest, ref=ref, job="dev", step=1, metrics={}, meta={}, stats=stats)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA (the device must be missing)")
def test_saved_on_a_missing_device_is_refused_unless_mapped(store):
    _planted(store, "cuda:0")
    cnt = _counting(store)
    with pytest.raises(tsck.DeviceUnavailable, match="saved on 'cuda:0'.*map_location"):
        store.checkout("dev/x")
    assert cnt["block"] == 0
    for ml in ("cpu", torch.device("cpu"), {"cuda:0": "cpu"}):
        out = store.checkout("dev/x", map_location=ml)
        assert out["w"].device.type == "cpu" and out["w"].tolist() == [1.0, 2.0]
    seen = []

    def fn(t, loc):
        seen.append((t.device.type, loc))
        return t.clone()

    assert store.checkout("dev/x", map_location=fn)["w"].tolist() == [1.0, 2.0] and seen == [("cpu", "cuda:0")]
    with pytest.raises(tsck.DeviceUnavailable):  # a callable returning None: torch.load's default
        store.checkout("dev/x", map_location=lambda t, loc: None)
    with pytest.raises(tsck.DeviceUnavailable, match="mapped to 'cuda:1'"):
        store.checkout("dev/x", map_location={"cuda:0": "cuda:1"})
    # into= tensors keep their own device: nothing to map.
    mine = {"w": torch.zeros(2)}
    store.checkout("dev/x", into=mine)
    assert mine["w"].tolist() == [1.0, 2.0]


@pytest.mark.parametrize("dev", ["../../x", "cuda:99", "meta", "cpu; rm -rf /", "mps", "x" * 64])
def test_hostile_device_names_are_refused_or_mapped(store, dev):
    _planted(store, dev)
    if torch.cuda.is_available() and dev == "cuda:99" and torch.cuda.device_count() > 99:  # pragma: no cover
        pytest.skip("this machine has 100 GPUs")
    with pytest.raises(tsck.DeviceUnavailable):
        store.checkout("dev/x")
    assert store.checkout("dev/x", map_location="cpu")["w"].tolist() == [1.0, 2.0]


@pytest.mark.parametrize("ml", [3, "nodevice", {"cpu": 5}, {1.5: "cpu"}])
def test_bad_map_location(store, ml):
    store.put_snapshot({"a": torch.ones(2)}, ref="j/m", step=1)
    with pytest.raises(tsck.InvalidArgument, match="map_location"):
        store.checkout("j/m", map_location=ml)


def test_map_location_callable_that_breaks_its_contract(store):
    store.put_snapshot({"a": torch.ones(2)}, ref="j/m", step=1)
    with pytest.raises(tsck.CheckoutMismatch, match="must return the tensor"):
        store.checkout("j/m", map_location=lambda t, loc: "nope")
    with pytest.raises(tsck.CheckoutMismatch, match="ZeroDivisionError"):
        store.checkout("j/m", map_location=lambda t, loc: 1 / 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
def test_cuda_round_trip_and_mapping():  # pragma: no cover - runs on a GPU machine
    import tempfile
    with tsck.open_store(tempfile.mkdtemp()) as store:
        store.put_snapshot({"w": torch.arange(4.0, device="cuda:0")}, ref="g/x", step=1)
        assert store.checkout("g/x")["w"].device == torch.device("cuda:0")
        assert store.checkout("g/x", map_location="cpu")["w"].device.type == "cpu"
        mine = {"w": torch.zeros(4)}
        store.checkout("g/x", into=mine)
        assert mine["w"].device.type == "cpu" and mine["w"].tolist() == [0, 1, 2, 3]
        t = torch.zeros(4, device="cuda:0")
        store.checkout("g/x", into={"w": t})
        assert t.tolist() == [0, 1, 2, 3]


# ---------------------------------------------------------------- Stateful objects
class AppState:
    """An application object following DCP's Stateful protocol."""

    def __init__(self):
        self.epoch, self.seen = 0, torch.zeros(3)

    def state_dict(self):
        return {"epoch": self.epoch, "seen": self.seen}

    def load_state_dict(self, sd):
        self.epoch, self.seen = sd["epoch"], sd["seen"]


def _train(model, opt, sched, steps, seed):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def _parts(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3, 0.5)
    return model, opt, sched


@pytest.mark.parametrize("blocking", [True, False])
def test_stateful_objects_go_in_and_come_back_bit_identical(store, blocking):
    model, opt, sched = _parts(0)
    app = AppState()
    _train(model, opt, sched, 5, seed=1)
    app.epoch, app.seen = 2, torch.arange(3.0)
    res = store.put_snapshot({"model": model, "optim": opt, "sched": sched, "app": app}, ref="sf/main", step=5,
                             blocking=blocking)
    if not blocking:
        res.result()
    after = _train(model, opt, sched, 4, seed=2)

    # A fresh model, a fresh optimizer with no state yet: load_state_dict gets the snapshot's.
    m2, o2, s2 = _parts(123)
    app2 = AppState()
    state = {"model": m2, "optim": o2, "sched": s2, "app": app2}
    out = store.checkout("sf/main", into=state)
    assert out is state and out["model"] is m2
    assert app2.epoch == 2 and torch.equal(app2.seen, torch.arange(3.0))
    assert _train(m2, o2, s2, 4, seed=2) == after  # bit-identical continuation
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    # The snapshot is a plain state tree too.
    plain = store.checkout("sf/main")
    assert set(plain) == {"model", "optim", "sched", "app"} and "0.weight" in plain["model"]
    assert set(plain["optim"]) == {"state", "param_groups"}


def test_stateful_refusing_the_snapshot_is_a_checkout_mismatch(store):
    model, opt, sched = _parts(0)
    store.put_snapshot({"model": model}, ref="sf/m", step=1)
    other = torch.nn.Linear(6, 16)  # its keys are not the snapshot's: nothing is read
    with pytest.raises(tsck.CheckoutMismatch):
        store.checkout("sf/m", into={"model": other})

    bigger = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2),
                                 torch.nn.Linear(2, 2))
    smaller = torch.nn.Sequential(torch.nn.Linear(6, 16))  # a prefix of the snapshot's keys
    before = smaller[0].weight.detach().clone()
    with pytest.raises(tsck.CheckoutMismatch, match="'2.weight'.*does not have"):
        store.checkout("sf/m", into={"model": smaller})
    assert torch.equal(smaller[0].weight, before)  # refused before anything was written
    with pytest.raises(tsck.CheckoutMismatch, match="'3.weight'"):
        store.checkout("sf/m", into={"model": bigger})

    class Broken(AppState):
        def load_state_dict(self, sd):
            raise RuntimeError("no thanks")

    store.put_snapshot({"app": AppState()}, ref="sf/a", step=1)
    with pytest.raises(tsck.CheckoutMismatch, match="Broken.load_state_dict.*no thanks"):
        store.checkout("sf/a", into={"app": Broken()})


def test_stateful_whose_state_dict_fails_is_refused_before_any_write(store):
    class Bad:
        def state_dict(self):
            raise ValueError("boom")

        def load_state_dict(self, sd):
            pass

    before = sorted(o.key for o in store.storage.list(""))
    with pytest.raises(tsck.UnsupportedType, match="boom") as ei:
        store.put_snapshot({"x": {"y": Bad()}}, ref="sf/b", step=1)
    assert "['x']['y']" in str(ei.value)
    assert sorted(o.key for o in store.storage.list("")) == before


def test_tsck_checkout_path_reads_only_that_part(store, big_state, tmp_path):
    """`tsck checkout STORE TARGET DEST --path P` is export.export_file(path=P)."""
    from safetensors.torch import load_file

    from tensorstore_ck.interchange.export import export_file
    store.put_snapshot(big_state, ref="j/main", step=10)
    cnt = _counting(store)
    export_file(store, "j/main", tmp_path / "l7.safetensors", path="model.layers.7")
    assert cnt["block_bytes"] == 256 * 256 * 4, cnt
    got = load_file(tmp_path / "l7.safetensors")
    assert list(got) == ["model.layers.7.weight"]
    assert torch.equal(got["model.layers.7.weight"], big_state["model"]["layers.7.weight"])


# ---------------------------------------------------------------- cost of paths=
def _lines_of_selected_checkout(store, n: int) -> int:
    """Python lines run in paths.py and read.py (this thread) by a checkout of n keys,
    every key named: a count of the work, the same on a loaded machine and a quiet one."""
    import sys

    from tensorstore_ck.util import paths as paths_mod
    from tensorstore_ck.read import read as read_mod

    state = {f"layers.{i}.weight": torch.full((2,), float(i)) for i in range(n)}  # inline: no block reads
    ref = f"n/k{n}"
    store.put_snapshot(state, ref=ref, step=1)
    files = {paths_mod.__file__, read_mod.__file__}
    count = 0

    def line(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return line

    def call(frame, event, arg):
        return line if frame.f_code.co_filename in files else None

    sys.settrace(call)
    try:
        out = store.checkout(ref, paths=list(state))
    finally:
        sys.settrace(None)
    assert len(out) == n and out["layers.7.weight"].equal(torch.full((2,), 7.0))
    return count


def test_paths_cost_is_linear_in_keys_and_paths(store):
    """Naming every key of a state must cost keys + paths, not keys x paths (14,000 keys
    all named took 100x a full checkout): doubling both doubles the work."""
    small, large = _lines_of_selected_checkout(store, 300), _lines_of_selected_checkout(store, 600)
    assert large <= 2.3 * small, (small, large)  # keys x paths: 4x
    assert small <= 300 * 200, small  # a few dozen lines per key, not one per key and path
