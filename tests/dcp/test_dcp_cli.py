"""`tsck ls` and `tsck checkout` of a snapshot written through dcp.save agree with the
Python API: the state as it was saved (model.0.weight, optim.param_groups.0.lr), not
the stored DCP layout (tensors.*, bytes.*, DCP's metadata), which `ls --raw` shows."""
from __future__ import annotations

import fractions
import json
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open

import tensorstore_ck as tsck
from tensorstore_ck.dcp import TsckWriter

import _zygote as zygote

from _util import NO_TORCH_CLI as _NO_TORCH, cli_here, mlp_and_adamw

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The same model + optimizer state saved by dcp.save (job/dcp) and put_snapshot
    (job/native); a dcp.save with a value only a full unpickle loads (job/odd)."""
    path = str(tmp_path_factory.mktemp("dcpcli") / "s")
    model, opt = mlp_and_adamw(4, 8)
    with tsck.open_store(path) as s:
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                 storage_writer=TsckWriter(s, ref="job/dcp", step=1))
        s.put_snapshot({"model": model.state_dict(), "optim": opt.state_dict()}, ref="job/native", step=1)
        dcp.save({"model": model.state_dict(), "extra": {"frac": fractions.Fraction(1, 3), "lr": 0.1}},
                 storage_writer=TsckWriter(s, ref="job/odd", step=1, allow_pickle=True))
    return path


def _ls(capsys, store, target, *more) -> list[dict]:
    rc, out, err = cli_here(capsys, "ls", store, target, *more, "--json")
    assert rc == 0, err
    return json.loads(out)["entries"]


def test_ls_shows_the_state_as_saved_like_the_same_state_put_natively(store, capsys):
    got = _ls(capsys, store, "job/dcp")
    want = _ls(capsys, store, "job/native")
    assert [(e["path"], e["kind"], e["dtype"], e["shape"], e.get("value")) for e in got] == \
        [(e["path"], e["kind"], e["dtype"], e["shape"], e.get("value")) for e in want]
    paths = [e["path"] for e in got]
    assert "model.0.weight" in paths and "optim.state.0.exp_avg" in paths
    assert {e["path"]: e.get("value") for e in got}["optim.param_groups.0.lr"] == 0.001
    assert not any(p.startswith(("tensors.", "bytes.", "metadata", "format", "version")) for p in paths)
    rc, text, _ = cli_here(capsys, "ls", store, "job/dcp")
    assert rc == 0 and len(text.splitlines()) == len(got) + 1 and "tensors." not in text

    # A PATH selects in the saved state, as checkout(paths=) does.
    assert [e["path"] for e in _ls(capsys, store, "job/dcp", "model")] == \
        ["model.0.weight", "model.0.bias", "model.2.weight", "model.2.bias"]
    assert [e["path"] for e in _ls(capsys, store, "job/dcp", "model.2.bias")] == ["model.2.bias"]
    rc, _, err = cli_here(capsys, "ls", store, "job/dcp", "tensors.model")
    assert rc == 2 and "holds nothing at 'tensors.model'" in err


def test_ls_raw_shows_the_stored_dcp_layout(store, capsys):
    paths = [e["path"] for e in _ls(capsys, store, "job/dcp", "--raw")]
    assert "tensors.model.0.weight" in paths and "bytes.optim.param_groups.0.lr" in paths
    assert any(p.startswith("metadata.") for p in paths)


def test_ls_of_a_dcp_snapshot_starts_without_torch(store):
    """Its bytes items (torch.save'd plain values) are read without torch."""
    p = zygote.run([sys.executable, "-c", _NO_TORCH, "ls", store, "job/dcp", "optim.param_groups"],
                   capture_output=True, text=True, timeout=120, fresh=True)
    assert p.returncode == 0, p.stderr
    assert "optim.param_groups.0.lr" in p.stdout and "0.001" in p.stdout


@pytest.mark.parametrize("path", ["model", "model.0.weight", "optim.state", None])
def test_checkout_path_writes_what_the_api_checks_out(store, capsys, tmp_path, path):
    dest = tmp_path / "x.safetensors"
    rc, _, err = cli_here(capsys, "checkout", store, "job/dcp", dest, *(["--path", path] if path else []))
    assert rc == 0, err
    with tsck.open_store(store) as s:
        api = s.checkout("job/dcp", paths=None if path is None else [path])

    def flat(v, p=""):
        if isinstance(v, dict):
            for k, x in v.items():
                yield from flat(x, f"{p}.{k}" if p else str(k))
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                yield from flat(x, f"{p}.{i}" if p else str(i))
        elif isinstance(v, torch.Tensor):
            yield p, v

    want = dict(flat(api))
    with safe_open(str(dest), "pt") as f:
        assert sorted(f.keys()) == sorted(want)
        for k in want:
            assert torch.equal(f.get_tensor(k), want[k]), k


def test_checkout_of_the_whole_dcp_snapshot_equals_the_native_ones(store, capsys, tmp_path):
    """Optimizer hyper-parameters are plain values once loaded: the file is the one the
    same state put through put_snapshot exports (tensors, and the plain values as metadata)."""
    a, b = tmp_path / "dcp.safetensors", tmp_path / "native.safetensors"
    assert cli_here(capsys, "checkout", store, "job/dcp", a)[0] == 0
    assert cli_here(capsys, "checkout", store, "job/native", b)[0] == 0
    with safe_open(str(a), "pt") as fa, safe_open(str(b), "pt") as fb:
        assert fa.metadata() == fb.metadata() and fa.metadata()["optim.param_groups.0.lr"] == "0.001"
        assert sorted(fa.keys()) == sorted(fb.keys())
        assert all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in fa.keys())


def test_what_cannot_be_exported_is_named_with_the_paths_that_can(store, capsys, tmp_path):
    rc, _, err = cli_here(capsys, "checkout", store, "job/odd", tmp_path / "x.safetensors")
    assert rc == 2 and "a pickled object at extra.frac" in err and "--path model" in err, err
    rc, _, err = cli_here(capsys, "checkout", store, "job/odd", tmp_path / "x.pt")
    assert rc == 2 and "'extra.frac'" in err and "fractions.Fraction" in err and "--path model" in err, err
    assert "Traceback" not in err and not (tmp_path / "x.pt").exists()
    assert cli_here(capsys, "checkout", store, "job/odd", tmp_path / "m.safetensors", "--path", "model")[0] == 0
    rc, out, _ = cli_here(capsys, "ls", store, "job/odd", "extra")
    assert rc == 0 and "extra.frac" in out and "pickled" in out and "extra.lr" in out


class _Touch:
    """A value whose unpickling runs code: touches `path`."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        import pathlib
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def test_ls_and_checkout_never_run_a_stored_pickle(tmp_path, capsys):
    """ls reads a bytes item through an unpickler that refuses every global; checkout
    through torch's weights_only loader: a hostile item is listed, never run."""
    marker = tmp_path / "ran"
    path = str(tmp_path / "s")
    with tsck.open_store(path) as s:
        dcp.save({"w": torch.ones(3), "boom": _Touch(str(marker))},
                 storage_writer=TsckWriter(s, ref="j/main", step=1, allow_pickle=True))
    rc, out, _ = cli_here(capsys, "ls", path, "j/main")
    assert rc == 0 and "boom" in out and "pickled" in out
    rc, _, err = cli_here(capsys, "checkout", path, "j/main", tmp_path / "x.pt")
    assert rc == 2 and "'boom'" in err and "--path w" in err, err
    rc, _, err = cli_here(capsys, "checkout", path, "j/main", tmp_path / "x.safetensors")
    assert rc == 2 and "a pickled object at boom" in err, err
    assert not marker.exists()
