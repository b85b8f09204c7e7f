"""Native and DCP snapshots readable both ways: dcp.load through
TsckReader loads a put_snapshot snapshot, and store.checkout gives the state a
dcp.save through TsckWriter saved, so switching API never strands a checkpoint."""

from __future__ import annotations

import collections
import copy
import fractions
import pathlib

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tensorstore_ck as tsck
from tensorstore_ck.dcp import TsckReader, TsckWriter

from _util import assert_same, blank_like

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture
def store(small_store):
    """conftest's small_store: 16 KiB blocks."""
    return small_store


def _parts(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def _train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        loss = model(torch.randn(16, 32, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def _counting(store):
    cnt = collections.Counter()
    a = store.assets
    rb = a.read_block_into

    def counted(d, out, *args, **kw):
        cnt["blocks"] += 1
        cnt["bytes"] += out.nbytes
        return rb(d, out, *args, **kw)

    a.read_block_into = counted
    return cnt


def _extra(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"step": 7, "name": "run", "lrs": [0.1, 0.2], "pair": (1, "two"),
            "big": torch.randn(64, 300, generator=g), "bf16": torch.randn(10, 30, generator=g).bfloat16(),
            "mixed": [3, torch.arange(4)], "np": np.arange(6, dtype=np.int16)}


def _blank(x):
    """X with its tensors and numpy arrays zeroed, its other values kept."""
    return blank_like(x, lambda v: np.zeros_like(v) if isinstance(v, np.ndarray) else v)


# ---------------------------------------------------------------- native -> dcp.load
def test_dcp_load_reads_a_put_snapshot_snapshot_bit_identically(store):
    model, opt = _parts(0)
    _train(model, opt, 3, seed=1)
    extra = _extra()
    store.put_snapshot({"model": model, "optim": opt, "extra": extra}, ref="n/main", step=3)
    after = _train(model, opt, 4, seed=2)

    m2, o2 = _parts(99)
    _train(m2, o2, 1, seed=5)  # DCP loads into an optimizer that has its state
    sd = {"model": m2.state_dict(), "optim": o2.state_dict(), "extra": _blank(extra)}
    dcp.load(sd, storage_reader=TsckReader(store, "n/main"))
    m2.load_state_dict(sd["model"])
    o2.load_state_dict(sd["optim"])
    assert _train(m2, o2, 4, seed=2) == after
    for a, b in zip(model.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    assert_same(sd["extra"], extra)


def test_dcp_load_of_a_part_reads_only_its_blocks(store):
    extra = _extra()
    store.put_snapshot({"a": torch.randn(256, 256), "b": torch.randn(128, 64), "extra": extra}, ref="n/p", step=1)
    cnt = _counting(store)
    sd = {"b": torch.zeros(128, 64)}
    dcp.load(sd, storage_reader=TsckReader(store, "n/p"))
    assert torch.equal(sd["b"], store.checkout("n/p", paths=["b"])["b"])
    assert cnt["bytes"] == 2 * 128 * 64 * 4  # b's blocks, once for dcp.load and once for the check


def test_dcp_metadata_of_a_native_snapshot(store):
    store.put_snapshot({"m": {"w": torch.ones(3, 2)}, "lst": [1, 2], "opt": {"state": {0: {"x": torch.ones(1)}}}},
                       ref="n/m", step=1)
    md = TsckReader(store, "n/m").read_metadata()
    sdm = md.state_dict_metadata
    assert set(sdm) == {"m.w", "lst", "opt.state.0.x"}
    assert sdm["m.w"].size == torch.Size([3, 2]) and sdm["m.w"].properties.dtype == torch.float32
    assert type(sdm["lst"]).__name__ == "BytesStorageMetadata"
    assert md.planner_data["opt.state.0.x"] == ("opt", "state", "0", "x")


def test_a_native_tree_dcp_cannot_name_is_refused(store):
    store.put_snapshot({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, ref="n/clash", step=1)
    with pytest.raises(tsck.FormatError, match="two values flatten to the DCP key 'a.b'"):
        TsckReader(store, "n/clash").read_metadata()


# ---------------------------------------------------------------- dcp.save -> checkout
def _dcp_save(store, state, ref="d/main", step=5):
    dcp.save(state, storage_writer=TsckWriter(store, ref=ref, step=step))


def test_checkout_of_a_dcp_snapshot_gives_the_saved_state(store):
    model, opt = _parts(0)
    _train(model, opt, 3, seed=1)
    extra = _extra()
    extra.pop("np")  # DCP torch.saves it; weights_only loads refuse numpy arrays
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": extra}
    want = copy.deepcopy(state)
    _dcp_save(store, state)
    got = store.checkout("d/main")
    assert_same(got["model"], want["model"], loose_types=True)  # DCP does not keep OrderedDict
    assert_same(got["extra"], want["extra"])
    # DCP flattens dict keys to str: optimizer state comes back keyed "0", "1", ...
    assert_same(got["optim"]["state"]["0"], want["optim"]["state"][0])
    assert got["optim"]["param_groups"][0]["params"] == want["optim"]["param_groups"][0]["params"]


def test_checkout_into_stateful_objects_from_a_dcp_snapshot_resumes_bit_identically(store):
    model, opt = _parts(0)
    _train(model, opt, 3, seed=1)
    _dcp_save(store, {"model": model.state_dict(), "optim": opt.state_dict(), "step": 3})
    after = _train(model, opt, 4, seed=2)

    m2, o2 = _parts(42)
    _train(m2, o2, 1, seed=9)  # as with dcp.load, the optimizer has its state already
    mine = {"model": m2, "optim": o2, "step": 0}
    store.checkout("d/main", into=mine)
    assert mine["step"] == 3
    assert _train(m2, o2, 4, seed=2) == after

    fresh_m, fresh_o = _parts(7)  # no per-parameter state: refused, never half-restored
    with pytest.raises(tsck.CheckoutMismatch, match="does not name.*take a step first"):
        store.checkout("d/main", into={"model": fresh_m, "optim": fresh_o})


def test_checkout_paths_of_a_dcp_snapshot_reads_only_those_blocks(store):
    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(256, 256, generator=g), "b": {"c": torch.randn(128, 64, generator=g)}, "n": 4}
    want = copy.deepcopy(state)
    _dcp_save(store, state)
    cnt = _counting(store)
    got = store.checkout("d/main", paths=["b.c", "n"])
    assert set(got) == {"b", "n"} and got["n"] == 4 and torch.equal(got["b"]["c"], want["b"]["c"])
    assert cnt["bytes"] == 128 * 64 * 4
    with pytest.raises(tsck.InvalidArgument, match="holds nothing at 'zz'"):
        store.checkout("d/main", paths=["zz"])
    # into= a part: only it is read, nothing is added; a key the snapshot lacks is refused first.
    cnt.clear()
    mine = {"b": {"c": torch.zeros(128, 64)}}
    store.checkout("d/main", into=mine)
    assert list(mine) == ["b"] and torch.equal(mine["b"]["c"], want["b"]["c"]) and cnt["bytes"] == 128 * 64 * 4
    with pytest.raises(tsck.CheckoutMismatch, match="'b.x'"):
        store.checkout("d/main", into={"b": {"c": torch.zeros(128, 64), "x": 1}})


def test_dcp_bytes_that_need_pickle_need_the_opt_in(store):
    state = {"w": torch.ones(2), "s": fractions.Fraction(1, 3)}  # not in weights_only's allowlist
    dcp.save(state, storage_writer=TsckWriter(store, ref="d/main", step=5, allow_pickle=True))
    with pytest.raises(tsck.UnsupportedType, match="allow_pickle"):
        store.checkout("d/main")
    assert store.checkout("d/main", paths=["w"])["w"].tolist() == [1.0, 1.0]
    assert store.checkout("d/main", allow_pickle=True)["s"] == fractions.Fraction(1, 3)
    got = {"w": torch.zeros(2), "s": None}
    with pytest.raises(CheckpointException) as ei:  # the reader keeps checkout's rule
        dcp.load(got, storage_reader=TsckReader(store, "d/main"))
    assert _failure(ei.value, tsck.UnsupportedType, "fractions.Fraction")
    dcp.load(got, storage_reader=TsckReader(store, "d/main", allow_pickle=True))
    assert got["s"] == fractions.Fraction(1, 3) and got["w"].tolist() == [1.0, 1.0]


def _failure(exc: BaseException, kind, *words) -> bool:
    """Whether DCP's CheckpointException carries a `kind` error naming every word."""
    for f in exc.failures.values():
        e = f[0] if isinstance(f, tuple) else f
        if isinstance(e, kind) and all(w in str(e) for w in words):
            return True
    raise AssertionError(f"no {kind.__name__} naming {words} in {exc.failures}")


class _Touches:
    """Unpickling this creates a file (pathlib's touch: no shell, no os.system)."""

    def __init__(self, path):
        self.path = pathlib.Path(path)

    def __reduce__(self):
        return (pathlib.Path.touch, (self.path,))


@pytest.mark.parametrize("size", ["inline", "blocks"])
def test_dcp_load_never_runs_a_stored_pickle_without_the_opt_in(store, tmp_path, size):
    """A bytes item holding a live pickle (stored with the writer's opt-in, as anyone with
    write access to a shared store could): dcp.load through TsckReader refuses it before
    DCP's planner, which unpickles with weights_only=False, sees it."""
    marker = tmp_path / "pwned"
    pad = "x" * ((2 << 20) if size == "blocks" else 10)  # past BYTES_INLINE_MAX: stored in blocks
    dcp.save({"w": torch.ones(2), "e": [_Touches(marker), pad]},
             storage_writer=TsckWriter(store, ref="evil/main", allow_pickle=True))
    assert not marker.exists()
    got = {"w": torch.zeros(2), "e": None}
    with pytest.raises(CheckpointException) as ei:
        dcp.load(got, storage_reader=TsckReader(store, "evil/main"))
    assert _failure(ei.value, tsck.UnsupportedType, "'e'", "getattr", "allow_pickle=True to TsckReader")
    assert not marker.exists(), "dcp.load through TsckReader ran a pickle from the store"
    with pytest.raises(tsck.UnsupportedType):  # the same rule as checkout's
        store.checkout("evil/main")
    assert not marker.exists()
    # The payload is live: with the opt-in it runs, so the refusal above is not vacuous.
    dcp.load(got, storage_reader=TsckReader(store, "evil/main", allow_pickle=True))
    assert marker.exists() and got["e"][1] == pad


def test_tsck_writer_stores_a_value_that_needs_pickle_only_with_the_opt_in(store):
    store.put_snapshot({"w": torch.ones(2)}, "d/main", step=1)
    before, refs = sorted(o.key for o in store.storage.list("")), store.refs()
    state = {"w": torch.randn(64, 300), "s": fractions.Fraction(1, 3)}
    with pytest.raises(CheckpointException) as ei:
        dcp.save(state, storage_writer=TsckWriter(store, ref="d/main", step=2))
    assert _failure(ei.value, tsck.UnsupportedType, "'s'", "fractions.Fraction", "allow_pickle=True to TsckWriter")
    assert store.refs() == refs and sorted(o.key for o in store.storage.list("")) == before  # nothing written
    w = TsckWriter(store, ref="d/main", step=2, allow_pickle=True)
    dcp.save(state, storage_writer=w)
    assert store.resolve("d/main") == w.info.root


def test_model_and_optimizer_state_load_through_dcp_without_the_opt_in(store):
    """DCP stores the optimizer's non-tensor values (param groups: floats, tuples,
    bools, None) as bytes items: torch's weights_only loader takes them all."""
    model, opt = _parts(0)
    _train(model, opt, 2, seed=1)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 2, "tag": "run"}
    dcp.save(state, storage_writer=TsckWriter(store, ref="d/main", step=2))
    model2, opt2 = _parts(1)
    _train(model2, opt2, 1, seed=2)
    got = {"model": model2.state_dict(), "optim": opt2.state_dict(), "step": 0, "tag": ""}
    dcp.load(got, storage_reader=TsckReader(store, "d/main"))
    assert_same(got, state)


def test_a_pickled_value_of_a_native_snapshot_loads_through_dcp_only_with_the_opt_in(store):
    store.put_snapshot({"w": torch.ones(2), "s": {1, 2}}, "n/main", allow_pickle=True)
    got = {"w": torch.zeros(2), "s": None}
    with pytest.raises(CheckpointException) as ei:
        dcp.load(got, storage_reader=TsckReader(store, "n/main"))
    assert _failure(ei.value, tsck.UnsupportedType, "allow_pickle")
    dcp.load(got, storage_reader=TsckReader(store, "n/main", allow_pickle=True))
    assert got["s"] == {1, 2}


def test_a_native_state_that_looks_like_the_dcp_layout_is_not_taken_for_one(store):
    state = {"format": "dcp", "version": 1, "tensors": {}, "bytes": {}, "metadata": {}}
    store.put_snapshot(state, ref="n/fake", step=1)
    assert store.checkout("n/fake") == state


def test_example_dcp_swap_runs(tmp_path):
    """examples/dcp_swap.py: one argument changed in a dcp.save/load script; each of its three
    resumes must be bit-identical (it exits 1 otherwise)."""
    import _zygote as zygote
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[2] / "examples" / "dcp_swap.py"
    r = zygote.run([sys.executable, str(script), "--store", str(tmp_path / "s")], capture_output=True,
                   text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("bit-identical") == 3, r.stdout
