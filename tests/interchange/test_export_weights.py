"""The model's weights out of a training snapshot: `tsck.export_weights` and `tsck export-weights`.

A user's run: a module (plain, or wrapped as DDP and torch.compile wrap it) snapshotted
through TrainState and CheckpointManager beside its optimizer, RNG streams and step. The
file written is loaded into a FRESH module with load_state_dict(strict=True), the way
the weights are used once training ends; bad arguments are refused with the project's
errors and leave the store and the destination as they were.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import tensorstore_ck as tsck
from tensorstore_ck.cli import main as cli_main

from _util import assert_same, object_listing, refs_snapshot


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 11, bias=False)


class Wrapper(torch.nn.Module):
    """What a wrapper's state_dict looks like: DDP and DataParallel keep the model as
    `module`, torch.compile's OptimizedModule as `_orig_mod`."""

    def __init__(self, inner, attr: str):
        super().__init__()
        setattr(self, attr, inner)


def _net(seed: int) -> Net:
    torch.manual_seed(seed)
    net = Net()
    net.body[1].running_mean.uniform_()  # buffers too, and num_batches_tracked (int64)
    net.body[1].num_batches_tracked += 7
    return net


def _snapshot(store, model, job: str, step: int = 10) -> None:
    """A training snapshot as a user takes it: model, optimizer (with state), RNG, step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # the optimizer holds state: the snapshot is a training state, not a state_dict
    mgr = tsck.CheckpointManager(store, job=job, state=tsck.TrainState(model=model, optimizer=opt), every_steps=1)
    mgr.step(step, metrics={"loss": 1.5})
    mgr.close()


@pytest.fixture()
def store(tmp_path):
    with tsck.open_store(tmp_path / "store") as s:
        yield s


def test_the_model_of_a_training_snapshot_loads_into_a_fresh_module(store, tmp_path):
    net = _net(0)
    _snapshot(store, net, "run")
    r = tsck.export_weights(store, "run/main", tmp_path / "model.safetensors")
    assert r["subtree"] == "model" and r["tensors"] == len(net.state_dict()) and r["skipped"] == []
    fresh = Net()
    fresh.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)
    assert_same(fresh.state_dict(), net.state_dict())
    with safe_open(tmp_path / "model.safetensors", "pt") as f:  # the weights alone: no step, RNG, optimizer
        assert f.metadata() == {"format": "pt"} and set(f.keys()) == set(net.state_dict())


@pytest.mark.parametrize("attrs", [("module",), ("_orig_mod",), ("module", "_orig_mod")])
def test_wrapper_prefixes_are_stripped(store, tmp_path, attrs):
    def wrap(m):
        for a in reversed(attrs):
            m = Wrapper(m, a)
        return m

    net = _net(1)
    wrapped = wrap(net)
    assert all(k.startswith(attrs[0] + ".") for k in wrapped.state_dict())
    _snapshot(store, wrapped, "ddp")
    r = tsck.export_weights(store, "ddp/main", tmp_path / "w.safetensors")
    assert r["stripped"] == [a + "." for a in attrs]
    fresh = Net()
    fresh.load_state_dict(load_file(tmp_path / "w.safetensors"), strict=True)
    assert_same(fresh.state_dict(), net.state_dict())
    # strip_prefix="" keeps the names as the wrapper has them
    tsck.export_weights(store, "ddp/main", tmp_path / "kept.safetensors", strip_prefix="")
    wrap(Net()).load_state_dict(load_file(tmp_path / "kept.safetensors"), strict=True)


class Stack(torch.nn.Module):
    """An LLM trainer's layout: an embedding, a list of blocks, a head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.layers = torch.nn.ModuleList(
            [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.LayerNorm(6)) for _ in range(3)])
        self.head = torch.nn.Linear(6, 11, bias=False)


@pytest.mark.parametrize("whole", [False, True], ids=["blocks", "blocks-and-model"])
def test_blocks_compiled_one_by_one_lose_orig_mod_inside_names(store, tmp_path, whole):
    """model.layers[i] = torch.compile(layer) puts `_orig_mod.` inside names (compile is
    lazy: the wrapper exists without running it); the file loads strict=True into a fresh,
    uncompiled model, as get_model_state_dict names it."""
    torch.manual_seed(3)
    net = Stack()
    for i, layer in enumerate(net.layers):
        net.layers[i] = torch.compile(layer)
    model = torch.compile(net) if whole else net
    keys = list(model.state_dict())
    assert "layers.0._orig_mod.0.weight" in [k.removeprefix("_orig_mod.") for k in keys]
    _snapshot(store, model, "llm")
    r = tsck.export_weights(store, "llm/main", tmp_path / "w.safetensors")
    assert r["stripped"] == ["_orig_mod."] and r["tensors"] == len(keys)
    fresh = Stack()
    fresh.load_state_dict(load_file(tmp_path / "w.safetensors"), strict=True)
    got = fresh.state_dict()
    assert list(got) == [k.replace("_orig_mod.", "") for k in keys]
    assert all(torch.equal(got[k.replace("_orig_mod.", "")], v) for k, v in model.state_dict().items())
    # strip_prefix="" keeps the names as the compiled model has them
    tsck.export_weights(store, "llm/main", tmp_path / "kept.safetensors", strip_prefix="")
    assert set(load_file(tmp_path / "kept.safetensors")) == set(keys)


def test_bf16(store, tmp_path):
    net = _net(2)
    _snapshot(store, net, "run")
    r = tsck.export_weights(store, "run/main@10", tmp_path / "bf16.safetensors", dtype="bf16")
    sd = net.state_dict()
    n_float = sum(t.is_floating_point() for t in sd.values())
    assert r["dtype"] == "bfloat16" and r["cast"] == n_float
    got = load_file(tmp_path / "bf16.safetensors")
    for k, t in sd.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t  # integer buffers as they are
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k
    fresh = Net().to(torch.bfloat16)
    fresh.load_state_dict(got, strict=True)
    assert fresh.head.weight.dtype == torch.bfloat16
    # a torch dtype, and torch's own name, mean the same
    tsck.export_weights(store, "run/main", tmp_path / "h.safetensors", dtype=torch.float16)
    tsck.export_weights(store, "run/main", tmp_path / "h2.safetensors", dtype="torch.float16")
    assert_same(load_file(tmp_path / "h.safetensors"), load_file(tmp_path / "h2.safetensors"))


def test_tied_weights_and_values_that_are_not_tensors(store, tmp_path):
    net = _net(3)
    net.head.weight = net.emb.weight  # tied, as a language model's output layer often is
    state = {"model": {**net.state_dict(), "config": "tiny", "version": 2}, "step": 5}
    store.put_snapshot(state, "hand/main", step=5)
    r = tsck.export_weights(store, "hand/main", tmp_path / "t.safetensors")
    assert r["skipped"] == ["model.config", "model.version"]
    fresh = Net()
    fresh.head.weight = fresh.emb.weight
    fresh.load_state_dict(load_file(tmp_path / "t.safetensors"), strict=True)
    assert_same(fresh.state_dict(), net.state_dict())


def test_bad_input_is_refused_and_changes_nothing(store, tmp_path):
    _snapshot(store, _net(4), "run")
    before = (refs_snapshot(store), object_listing(tmp_path / "store"))
    dest = tmp_path / "w.safetensors"
    cases = [
        (dict(subtree="modle"), tsck.InvalidArgument, "nothing at 'modle'.*model"),
        (dict(dtype="bf17"), tsck.InvalidArgument, "dtype 'bf17' is not one.*bf16"),
        (dict(dtype="int8"), tsck.InvalidArgument, "dtype 'int8'"),
        (dict(dtype=torch.int8), tsck.InvalidArgument, "not a floating dtype"),
        (dict(strip_prefix="module."), tsck.InvalidArgument, "no tensor name starts with 'module.'"),
        (dict(strip_prefix=3), tsck.InvalidArgument, "strip_prefix"),
        (dict(subtree="step"), tsck.InvalidArgument, "no tensor at step"),
    ]
    for kw, err, match in cases:
        with pytest.raises(err, match=match):
            tsck.export_weights(store, "run/main", dest, **kw)
    with pytest.raises(tsck.RefNotFound):
        tsck.export_weights(store, "nope/main", dest)
    with pytest.raises(tsck.InvalidArgument, match="writes safetensors"):
        tsck.export_weights(store, "run/main", tmp_path / "w.pt")
    with pytest.raises(tsck.InvalidArgument, match="no directory"):
        tsck.export_weights(store, "run/main", tmp_path / "nodir" / "w.safetensors")
    assert not dest.exists() and not (tmp_path / "w.pt").exists()
    dest.write_bytes(b"mine")
    with pytest.raises(tsck.InvalidArgument, match="exists"):
        tsck.export_weights(store, "run/main", dest)
    assert dest.read_bytes() == b"mine"
    assert (refs_snapshot(store), object_listing(tmp_path / "store")) == before
    # a snapshot with no model sub-tree says what it holds
    store.put_snapshot({"w": torch.zeros(2), "opt": {"lr": 0.1}}, "flat/main")
    with pytest.raises(tsck.InvalidArgument, match="no model sub-tree.*w, opt"):
        tsck.export_weights(store, "flat/main", tmp_path / "f.safetensors")
    tsck.export_weights(store, "flat/main", tmp_path / "f.safetensors", subtree="")  # the whole snapshot
    assert set(load_file(tmp_path / "f.safetensors")) == {"w"}
    assert [p for p in tmp_path.iterdir() if p.name.endswith(".partial")] == []


def test_cli(tmp_path, capsys):
    net = _net(5)
    with tsck.open_store(tmp_path / "store") as store:
        _snapshot(store, Wrapper(net, "module"), "run")
    s, out = str(tmp_path / "store"), tmp_path / "model.safetensors"
    assert cli_main(["export-weights", s, "run/main", str(out), "--dtype", "bf16"]) == 0
    text = capsys.readouterr().out
    assert "cast to bfloat16" in text and "'model.', 'module.'" in text
    fresh = Net().to(torch.bfloat16)
    fresh.load_state_dict(load_file(out), strict=True)
    # --strip-prefix '' keeps the wrapper's names; --path takes another sub-tree
    assert cli_main(["export-weights", s, "run/main", str(tmp_path / "k.safetensors"), "--strip-prefix", ""]) == 0
    assert all(k.startswith("module.") for k in load_file(tmp_path / "k.safetensors"))
    capsys.readouterr()
    for argv, match in [(["--dtype", "bf17"], "dtype 'bf17' is not one"), (["--path", "modle"], "nothing at 'modle'"),
                        (["--strip-prefix", "encoder."], "no tensor name starts with 'encoder.'")]:
        assert cli_main(["export-weights", s, "run/main", str(tmp_path / "bad.safetensors"), *argv]) == 2
        assert match in capsys.readouterr().err
        assert not (tmp_path / "bad.safetensors").exists()
    # the whole-state form says where the weights alone are
    assert cli_main(["checkout", s, "run/main", str(tmp_path / "all.safetensors")]) == 0
    assert f"tsck export-weights {s} run/main" in capsys.readouterr().out
