"""Habits users bring from git, restic and torch to `tsck`: `log -n`, `diff --exit-code`,
$TSCK_STORE, dotted paths in diff and fsck, restic's `forget --keep-last`, `--keep-best`
without `--metric`, and a snapshot at a step its ref already has. Each through the real
entry point, tensorstore_ck.cli.main (one subprocess for $TSCK_STORE)."""
from __future__ import annotations

import json
import os
import sys
import warnings

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck import cli
from tensorstore_ck.errors import StepReusedWarning

import _zygote as zygote
from _util import child_env


def _state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"model": {"layers": [{"w": torch.randn(64, 64, generator=g)}], "b": torch.ones(4)},
            "opt": {"lr": 0.1}}


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.delenv("TSCK_STORE", raising=False)
    path = tmp_path / "store"
    with tsck.open_store(path, block_size=4096) as s:
        for step in (1, 2, 3):
            s.put_snapshot(_state(step), ref="a/main", step=step)
        s.put_snapshot({**_state(3), "extra": torch.zeros(2)}, ref="b/main", step=3)
    return str(path)


def tsck_cli(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_log_n(store, capsys):
    rc, out, err = tsck_cli(capsys, "log", store, "a/main", "-n", "2")
    assert rc == 0, err
    assert [ln.split()[2] for ln in out.splitlines()] == ["3", "2"]
    rc, out, _ = tsck_cli(capsys, "log", store, "a/main", "--max-count=1", "--json")
    assert rc == 0 and [d["step"] for d in json.loads(out)] == [3]
    rc, _, err = tsck_cli(capsys, "log", store, "a/main", "-n", "0")
    assert rc == 2 and err.startswith("tsck: error: ") and "begins with '-'" not in err


def test_diff_exit_code_and_dotted_paths(store, capsys):
    rc, out, err = tsck_cli(capsys, "diff", store, "a/main@1", "a/main@2", "--exit-code")
    assert rc == 1, err
    assert "~ model.layers.0.w: " in out and "['model']" not in out
    rc, out, _ = tsck_cli(capsys, "diff", store, "a/main@2", "a/main@2", "--exit-code")
    assert rc == 0 and "0 changed, 0 added, 0 removed" in out
    rc, out, _ = tsck_cli(capsys, "diff", store, "a/main@1", "a/main@2")  # without it: 0, as git diff
    assert rc == 0
    rc, out, _ = tsck_cli(capsys, "diff", store, "a/main", "b/main", "--json")
    d = json.loads(out)
    assert rc == 0 and d["added"] == ["extra"] and d["changed"] == [] and d["unchanged"] == 2
    # a dotted PATH, as ls takes it: only what is under it
    rc, out, _ = tsck_cli(capsys, "diff", store, "a/main@1", "b/main", "model.layers", "--json", "--exit-code")
    d = json.loads(out)
    assert rc == 1 and d["added"] == [] and [c["path"] for c in d["changed"]] == ["model.layers.0.w"]
    rc, out, _ = tsck_cli(capsys, "diff", store, "a/main@1", "b/main", "model.b", "--exit-code")
    assert rc == 0 and "0 changed, 0 added, 0 removed under model.b" in out


def test_fsck_names_dotted_paths(store, capsys):
    with tsck.open_store(store, create=False) as s:
        w = s.checkout("a/main@2")["model"]["layers"][0]["w"]
    # the last block of model.layers.0.w at step 2: truncate it on disk
    import blake3
    raw = w.contiguous().view(torch.uint8).numpy().tobytes()
    digest = blake3.blake3(raw[-4096:]).hexdigest()
    hits = [os.path.join(r, f) for r, _d, fs in os.walk(os.path.join(store, "blocks")) for f in fs if f == digest]
    assert len(hits) == 1
    with open(hits[0], "r+b") as f:
        f.truncate(10)
    rc, out, err = tsck_cli(capsys, "fsck", store)
    assert rc == 1, err
    assert "at model.layers.0.w" in out and "['model']" not in out
    rc, out, _ = tsck_cli(capsys, "fsck", store, "--json", "--quick")
    assert rc == 1 and {f["path"] for f in json.loads(out)["findings"]} == {"model.layers.0.w"}


def test_tsck_store_default(store, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TSCK_STORE", store)
    monkeypatch.chdir(tmp_path)  # "store" (a directory here) would name the store itself
    rc, out, err = tsck_cli(capsys, "log", "a/main", "-n", "1")
    assert rc == 0 and out.split()[2] == "3", err
    for argv in (["refs"], ["du", "--json"], ["show", "a/main@2"], ["ls", "a/main", "model.layers"],
                 ["diff", "a/main@1", "a/main"], ["fsck", "--quick"], ["gc", "--dry-run"], ["retention"],
                 ["tag", "t1", "a/main@1"], ["checkout", "a/main", tmp_path / "x.safetensors", "--path", "model"]):
        rc, out, err = tsck_cli(capsys, *argv)
        assert rc == 0, (argv, err)
    assert (tmp_path / "x.safetensors").stat().st_size > 64 * 64 * 4
    rc, out, _ = tsck_cli(capsys, "ls", "a/main", "model.layers")
    assert out.startswith("model.layers.0.w ")
    # a first positional that is a URL or an existing path is the store, as without $TSCK_STORE
    other = tmp_path / "other"
    with tsck.open_store(other) as s:
        s.put_snapshot({"v": torch.ones(2)}, ref="o/main", step=9)
    rc, out, err = tsck_cli(capsys, "log", other, "o/main")
    assert rc == 0 and out.split()[2] == "9", err
    rc, out, err = tsck_cli(capsys, "log", "file://" + str(other), "o/main", "--json")
    assert rc == 0 and json.loads(out)[0]["step"] == 9, err
    rc, out, err = tsck_cli(capsys, "log", "--", "o/main")  # after --: a positional, not the store
    assert rc == 2 and "o/main" in err
    rc, out, err = tsck_cli(capsys, "refs", tmp_path / "typo")  # a store path that does not exist
    assert rc == 2 and "the store is $TSCK_STORE" in err and len(err.splitlines()) == 1
    # the real command, as a shell runs it
    r = zygote.run([sys.executable, "-m", "tensorstore_ck", "log", "a/main", "--json"], capture_output=True,
                   text=True, timeout=120, env=child_env(cli=True, TSCK_STORE=store), cwd=str(tmp_path))
    assert r.returncode == 0 and [d["step"] for d in json.loads(r.stdout)] == [3, 2, 1], r.stderr
    monkeypatch.delenv("TSCK_STORE")
    rc, _, err = tsck_cli(capsys, "log", "a/main")
    assert rc == 2 and err.startswith("tsck: error: ")


def test_forget_keep_last_points_at_retention(store, capsys):
    for argv in (["forget", store, "--keep-last", "3"], ["forget", store, "a/main@1", "--keep-last=3"]):
        rc, out, err = tsck_cli(capsys, *argv)
        assert rc == 2 and len(err.splitlines()) == 1, err
        assert "tsck retention STORE JOB --keep-last 3" in err and "tsck gc STORE" in err
    rc, _, err = tsck_cli(capsys, "forget", store, "--keep-daily", "7")
    assert rc == 2 and "tsck retention STORE JOB --keep-last N" in err
    with tsck.open_store(store, create=False) as s:
        assert len(s.log("a/main")) == 3  # nothing was forgotten


def test_keep_best_without_metric(store, capsys):
    rc, _, err = tsck_cli(capsys, "retention", store, "a", "--keep-best", "2")
    assert rc == 2 and "--keep-best 2 needs --metric" in err and "Retention." not in err, err
    rc, _, err = tsck_cli(capsys, "retention", store, "a", "--metric", "val_loss")
    assert rc == 2 and "--keep-best" in err and "Retention" not in err, err
    rc, out, err = tsck_cli(capsys, "retention", store, "a", "--keep-best", "2", "--metric", "val_loss")
    assert rc == 0 and "keep best 2 by val_loss" in out, err


def test_same_step_again_warns(tmp_path, caplog):
    with tsck.open_store(tmp_path / "s") as s:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            s.put_snapshot({"w": torch.ones(3)}, ref="a/main", step=1)
            s.put_snapshot({"w": torch.ones(3)}, ref="a/main", step=2)
            s.put_snapshot({"w": torch.ones(3)}, ref="b/main", step=2)  # another ref: its own steps
            assert [x for x in w if x.category is StepReusedWarning] == []
            with caplog.at_level("WARNING", logger="tensorstore_ck"):
                i = s.put_snapshot({"w": torch.zeros(3)}, ref="a/main", step=1)
        got = [x for x in w if x.category is StepReusedWarning]
        assert len(got) == 1 and "step 1" in str(got[0].message), [str(x.message) for x in w]
        assert any("already had a snapshot at step 1" in r.getMessage() for r in caplog.records)
        assert s.resolve("a/main@1") == i.root and len(s.log("a/main")) == 3  # kept, not refused


def test_dcp_save_again_at_the_same_step_warns(tmp_path):
    import torch.distributed.checkpoint as dcp
    from tensorstore_ck.dcp import TsckWriter
    with tsck.open_store(tmp_path / "s") as s:
        sd = {"w": torch.arange(10.0)}
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            dcp.save(sd, storage_writer=TsckWriter(s, ref="run/main", step=100))
            assert [x for x in w if x.category is StepReusedWarning] == []
            dcp.save({"w": torch.arange(10.0) + 1}, storage_writer=TsckWriter(s, ref="run/main", step=100))
        assert len([x for x in w if x.category is StepReusedWarning]) == 1
