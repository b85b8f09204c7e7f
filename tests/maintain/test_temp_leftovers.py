"""Temp files a killed save leaves under tmp/ (.partial writes cut short, .pending objects
never named) are reported by `tsck fsck`, `tsck du` and `tsck gc --dry-run`: how many,
their bytes, and when a gc sweeps them given its lease; a gc then removes them.

The leftovers come from a real saving process killed -9 while a write is under way."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck import cli

import _zygote as zygote
from _util import child_env

SAVER = textwrap.dedent("""
    import sys, torch, tensorstore_ck as tsck
    with tsck.open_store(sys.argv[1], create=False) as s:
        g = torch.Generator().manual_seed(0)
        for step in range(10_000):
            # fresh random content: every block is new, so every put writes (and links) files
            s.put_snapshot({"w": torch.randn(4 << 20, generator=g)}, ref="run/main", step=step)
""")


def _leftovers(store) -> dict[str, int]:
    tmp = os.path.join(store, "tmp")
    out = {}
    for f in os.listdir(tmp) if os.path.isdir(tmp) else []:
        if f.endswith((".partial", ".pending")):
            try:
                out[f] = os.path.getsize(os.path.join(tmp, f))
            except FileNotFoundError:
                pass
    return out


def _kill_mid_write(store, tmp_path) -> dict[str, int]:
    """Start a saver, kill -9 it the moment a temp file is seen under tmp/; again until a
    kill leaves one behind (a write may finish between the look and the kill)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        p = zygote.Popen([sys.executable, "-c", SAVER, str(store)], env=child_env(),
                         stdout=subprocess.DEVNULL, stderr=open(tmp_path / "saver.err", "wb"))
        try:
            while p.poll() is None and time.monotonic() < deadline:
                if _leftovers(store):
                    os.kill(p.pid, signal.SIGKILL)
                    break
        finally:
            if p.poll() is None:
                p.kill()
            p.wait()
        assert p.returncode == -signal.SIGKILL, (tmp_path / "saver.err").read_text()
        left = _leftovers(store)
        if left:
            return left
    pytest.fail("no kill -9 of the saver left a temp file within 300 s")


def tsck_json(capsys, *argv):
    rc = cli.main([str(a) for a in argv] + ["--json"])
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def tsck_text(capsys, *argv):
    rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.slow
def test_killed_save_leftovers_reported_then_swept(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TSCK_STORE", raising=False)
    store = tmp_path / "store"
    with tsck.open_store(store, block_size=1 << 20) as s:
        s.put_snapshot({"w": torch.ones(100)}, ref="run/main", step=0)
    left = _kill_mid_write(store, tmp_path)
    n, nbytes = len(left), sum(left.values())
    mtimes = [os.stat(store / "tmp" / f).st_mtime for f in left]
    partial = sum(f.endswith(".partial") for f in left)

    rc, fsck, err = tsck_json(capsys, "fsck", store, "--quick")
    assert rc == 0, err  # leftovers are not damage: fsck stays clean
    t = fsck["temp_files"]
    assert (t["files"], t["bytes"], t["partial"], t["pending"]) == (n, nbytes, partial, n - partial)
    assert t["lease"] == 120.0 and t["sweepable"] == 0  # written just now: younger than the lease
    wait = [m + 120.0 + (600.0 if f.endswith(".pending") else 0.0) for f, m in zip(left, mtimes)]
    assert t["all_due"] == pytest.approx(max(wait)) and t["next_due"] == pytest.approx(min(wait))

    rc, du, err = tsck_json(capsys, "du", store)
    assert rc == 0 and (du["temp_files"]["files"], du["temp_files"]["bytes"]) == (n, nbytes), err
    rc, gc, err = tsck_json(capsys, "gc", store, "--dry-run", "--lease", "30")
    assert rc == 0 and (gc["temp_files"]["files"], gc["temp_files"]["bytes"]) == (n, nbytes), err
    assert gc["temp_files"]["lease"] == 30.0 and gc["temp_files"]["sweepable"] == 0
    assert gc["temp_files"]["all_due"] == pytest.approx(max(w - 90.0 for w in wait))

    for verb in (["fsck", store, "--quick"], ["du", store], ["gc", store, "--dry-run"]):
        rc, out, err = tsck_text(capsys, *verb)
        assert rc == 0, err
        assert f"tmp/: {n} temp file(s)" in out and "older than the gc's lease (120 s" in out, out
        assert ("this gc would remove 0" if verb[0] == "gc" else "0 (0 B) are old enough") in out, out

    # aged past the lease (and a .pending file's extra wait): the dry run says this gc
    # removes them all, and a gc does; nothing is left to report after it
    for f in left:
        old = time.time() - 3600
        os.utime(store / "tmp" / f, (old, old))
    rc, gc, err = tsck_json(capsys, "gc", store, "--dry-run")
    assert rc == 0 and gc["temp_files"]["sweepable"] == n and gc["temp_files"]["next_due"] is None, err
    assert _leftovers(store) == left  # a dry run removes nothing
    rc, out, err = tsck_text(capsys, "gc", store, "--dry-run")
    assert f"this gc would remove {n} (" in out, out
    rc, gc, err = tsck_json(capsys, "gc", store)
    assert rc == 0 and gc["temp_files_removed"] == n, err
    assert _leftovers(store) == {}
    rc, out, err = tsck_text(capsys, "fsck", store, "--quick")
    assert rc == 0 and "tmp/" not in out, err
    with tsck.open_store(store, create=False) as s:  # the kill lost nothing committed
        assert s.checkout("run/main")["w"].numel() >= 100


def test_placed_leftovers_as_a_killed_save_leaves_them(tmp_path, capsys, monkeypatch):
    """Files placed as a killed save leaves them (the fast twin of the test above): one
    .partial past the lease, one just written, one .pending past the lease only."""
    monkeypatch.delenv("TSCK_STORE", raising=False)
    store = tmp_path / "store"
    with tsck.open_store(store) as s:
        s.put_snapshot({"w": torch.ones(100)}, ref="run/main", step=0)
    tmp = store / "tmp"
    tmp.mkdir(exist_ok=True)
    now = time.time()
    for name, size, age in (("a" * 32 + ".partial", 5000, 3600), ("b" * 32 + ".partial", 300, 0),
                            ("c" * 32 + ".pending", 2000, 300)):
        (tmp / name).write_bytes(os.urandom(size))
        os.utime(tmp / name, (now - age, now - age))
    rc, gc, err = tsck_json(capsys, "gc", store, "--dry-run")
    t = gc["temp_files"]
    assert rc == 0, err
    assert (t["files"], t["bytes"], t["partial"], t["pending"]) == (3, 7300, 2, 1)
    assert (t["sweepable"], t["sweepable_bytes"]) == (1, 5000)
    assert t["next_due"] == pytest.approx(now + 120, abs=5) and t["all_due"] == pytest.approx(now + 420, abs=5)
    rc, out, _ = tsck_text(capsys, "du", store)
    assert "tmp/: 3 temp file(s), 7.30 kB (2 .partial" in out and "1 .pending" in out
    assert "1 (5.00 kB) are old enough for the next gc" in out
    assert "the other 2 become old enough at " in out and "(the last at " in out, out
    rc, fsck, _ = tsck_json(capsys, "fsck", store)
    assert rc == 0 and fsck["ok"] and fsck["temp_files"]["files"] == 3
    rc, gc, _ = tsck_json(capsys, "gc", store)
    assert rc == 0 and gc["temp_files_removed"] == 1
    assert sorted(os.listdir(tmp)) == ["b" * 32 + ".partial", "c" * 32 + ".pending"]
