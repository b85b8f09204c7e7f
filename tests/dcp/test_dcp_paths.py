"""`tsck diff` and `tsck fsck` name the values of a dcp.save snapshot at the paths `tsck ls`
shows (the state as saved: model.0.weight), not at the stored layout's
(tensors.model.0.weight), which `--raw` gives, as `ls --raw` does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tensorstore_ck as tsck
from tensorstore_ck.core.assets import block_key
from tensorstore_ck.dcp import TsckWriter
from tensorstore_ck.util.ids import Digest
from tensorstore_ck.core.walk import iter_leaves

from _util import cli_here, mlp_and_adamw

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.fixture
def saved(tmp_path):
    """Two dcp.save snapshots of a model and its optimizer (job/main@1, @2): between
    them, only model.0.weight changed."""
    path = tmp_path / "s"
    model, opt = mlp_and_adamw(64, 64)
    with tsck.open_store(path, block_size=4096) as s:
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                 storage_writer=TsckWriter(s, ref="job/main", step=1))
        with torch.no_grad():
            model[0].weight.add_(1.0)
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
                 storage_writer=TsckWriter(s, ref="job/main", step=2))
    return path


def _ls_paths(capsys, path, target, *more) -> set:
    rc, out, err = cli_here(capsys, "ls", path, target, *more, "--json")
    assert rc == 0, err
    return {e["path"] for e in json.loads(out)["entries"]}


def test_diff_of_two_dcp_saves_names_the_paths_ls_shows(saved, capsys):
    rc, out, err = cli_here(capsys, "diff", saved, "job/main@1", "job/main@2")
    assert rc == 0, err
    assert out.splitlines()[1:] == ["~ model.0.weight: 4/4 blocks differ",
                                    "1 changed, 0 added, 0 removed, 15 unchanged"]
    rc, out, _ = cli_here(capsys, "diff", saved, "job/main@1", "job/main@2", "--json")
    d = json.loads(out)
    assert rc == 0 and [c["path"] for c in d["changed"]] == ["model.0.weight"]
    assert "model.0.weight" in _ls_paths(capsys, saved, "job/main@2")
    # a path selects as in ls; --exit-code as git's
    rc, out, _ = cli_here(capsys, "diff", saved, "job/main@1", "job/main@2", "model.0", "--exit-code")
    assert rc == 1 and "~ model.0.weight:" in out
    rc, out, _ = cli_here(capsys, "diff", saved, "job/main@1", "job/main@2", "optim", "--exit-code")
    assert rc == 0 and "0 changed" in out
    # --raw: the stored layout, as ls --raw
    rc, out, _ = cli_here(capsys, "diff", saved, "job/main@1", "job/main@2", "--raw")
    assert rc == 0 and "~ tensors.model.0.weight: 4/4 blocks differ" in out.splitlines()
    assert "tensors.model.0.weight" in _ls_paths(capsys, saved, "job/main@2", "--raw")


def test_fsck_finding_in_a_dcp_snapshot_names_the_path_ls_shows(saved, capsys):
    with tsck.open_store(saved) as s:
        root = s.resolve("job/main@1")
        leaves = iter_leaves(s.core.assets, Digest.parse(root))
    # a block only snapshot 1's model.0.weight holds (snapshot 2 changed that tensor)
    _summary, blocks = leaves["['tensors']['model.0.weight']"]
    victim = Path(saved) / block_key(blocks[0])
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    os.chmod(victim, 0o644)
    victim.write_bytes(bytes(data))
    rc, out, err = cli_here(capsys, "fsck", saved)
    assert rc == 1, (out, err)
    bad = [ln for ln in out.splitlines() if ln.startswith("corrupt:")]
    assert len(bad) == 1 and f"snapshot {root[:16]}" in bad[0] and "at model.0.weight;" in bad[0], out
    rc, out, _ = cli_here(capsys, "fsck", saved, "--json")
    (f,) = json.loads(out)["findings"]
    assert rc == 1 and f["path"] == "model.0.weight" and f["snapshot"] == root
    rc, out, _ = cli_here(capsys, "fsck", saved, "--raw")
    assert rc == 1 and "at tensors.model.0.weight;" in out
