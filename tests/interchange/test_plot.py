"""`tsck du --plot`: the numbers behind the picture, checked against a count made here
from the tensors' own bytes and the files on disk, and the picture made by the real CLI."""
from __future__ import annotations

import json
import os
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

import blake3
import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck import cli
from tensorstore_ck.errors import InvalidArgument
from tensorstore_ck.maintain.usage import usage

from _util import DU_BS as BS, DU_N as N, block_sizes_on_disk, expected_numbers, fill, run_cli, vec


def test_usage_numbers(tmp_path):
    path = tmp_path / "s"
    states = fill(path)
    want, sizes = expected_numbers(path, states)
    with tsck.open_store(path, create=False) as s:
        u = usage(s.core)
        logs = {job: list(reversed(s.log(f"{job}/main"))) for job in states}
    assert set(u["jobs"]) == set(states)
    for job, (held, only) in want.items():
        j = u["jobs"][job]
        assert (j["held_bytes"], j["only_bytes"]) == (held, only), job
        assert j["snapshots"] == len(states[job]) and j["estimated"] == 0
        # over time: running sums of each commit's logical bytes and of what it stored
        infos = logs[job]
        assert j["logical"] == [sum(i.bytes_total for i in infos[:k + 1]) for k in range(len(infos))]
        assert j["written"] == [sum(i.stored_new for i in infos[:k + 1]) for k in range(len(infos))]
        assert j["times"] == [i.time for i in infos]
    assert want["solo"][0] == want["solo"][1] > 0  # shares nothing
    assert 0 < want["ft-b"][1] < want["ft-b"][0]   # its heads and zeros only: the base is shared
    assert u["block_bytes"] == sum(sizes.values())
    # every stored block was written by exactly one commit (one writer, no gc)
    assert sum(j["written"][-1] for j in u["jobs"].values()) == sum(sizes.values())


def test_stored_new_is_recorded(tmp_path):
    """Each commit records what its new blocks take in storage (framed, compressed): the
    bytes on disk it added. A compressible tensor stores less than its raw bytes. The
    catalog keeps it, and recover brings it back from the commit object."""
    path = tmp_path / "s"
    with tsck.open_store(path, block_size=BS, inline_threshold=1024) as s:
        i1 = s.put_snapshot({"w": vec(1, 4), "z": torch.zeros(N * 8)}, ref="a/main", step=1)
        on_disk = sum(block_sizes_on_disk(path).values())
        assert i1.stored_new == on_disk
        assert i1.stored_new < i1.bytes_new  # the zeros compress
        i2 = s.put_snapshot({"w": vec(1, 4), "z": torch.zeros(N * 8), "x": vec(2, 1)}, ref="a/main", step=2)
        assert i2.stored_new == sum(block_sizes_on_disk(path).values()) - on_disk
        assert [i.stored_new for i in s.log("a/main")] == [i2.stored_new, i1.stored_new]
        assert s.show("a/main").to_json()["stored_new"] == i2.stored_new
    shutil.rmtree(path / "refs.lmdb")
    with tsck.open_store(path, create=False, create_refs=True) as s:
        s.recover()
        assert [i.stored_new for i in s.log("a/main")] == [i2.stored_new, i1.stored_new]


def test_du_plot_cli(tmp_path):
    """The real `tsck du --plot`: a PNG from a real store, and the numbers it prints are
    the ones checked above."""
    path = tmp_path / "s"
    states = fill(path)
    want, _ = expected_numbers(path, states)
    png = tmp_path / "usage.png"
    with ThreadPoolExecutor(2) as ex:
        f1 = ex.submit(run_cli, "du", path, "--plot", png, "--json")
        f2 = ex.submit(run_cli, "du", path, "--plot", tmp_path / "usage.txt")
    r = f1.result()
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    doc = json.loads(r.stdout)
    assert doc["plot"]["file"] == str(png)
    for job, (held, only) in want.items():
        assert doc["plot"]["jobs"][job]["held_bytes"] == held
        assert doc["plot"]["jobs"][job]["only_bytes"] == only
    bad = f2.result()
    assert bad.returncode == 2 and bad.stderr.startswith("tsck: error: ") and len(bad.stderr.splitlines()) == 1
    assert ".png" in bad.stderr and not (tmp_path / "usage.txt").exists()
    assert [p for p in os.listdir(tmp_path) if p.endswith(".partial")] == []


def test_plot_without_matplotlib(tmp_path, monkeypatch, capsys):
    """Without the [plot] extra: one line saying how to install it, exit 2, nothing written."""
    path = tmp_path / "s"
    with tsck.open_store(path) as s:
        s.put_snapshot({"w": torch.ones(10)}, ref="a/main")
    for m in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert cli.main(["du", str(path), "--plot", str(tmp_path / "u.png")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tsck: error: ") and "tensorstore_ck[plot]" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "u.png").exists()
    from tensorstore_ck.interchange.plot import plot_usage
    with pytest.raises(InvalidArgument, match="matplotlib"):
        plot_usage({"jobs": {}}, tmp_path / "u.png")
