"""Golden stores: every version of tensorstore_ck reads the stores older versions wrote.

tests/data/golden/<version>/ is a small store written by an older release
(v1 and v1-collective: written by commit 34bdd15) plus expected.json (what was written: refs, steps, roots, builders,
tags, pins, retention rules). v1-collective holds 2-rank collective snapshots
(a "W" top node), read here without a process group. The states are rebuilt
from tests/data/golden_states.py and every snapshot must check out bit for
bit, keep its root hash and pass fsck; a fresh put of a single-process state
must still dedup completely against the stored blocks.

Never regenerate a committed golden store to make this test pass
(tests/data/README.md).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch

import tensorstore_ck as tsck

from _util import assert_same

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = DATA / "golden"
sys.path.insert(0, str(DATA))
import golden_states as gs  # noqa: E402

import _zygote as zygote

VERSIONS = sorted(d.name for d in GOLDEN.iterdir() if (d / "expected.json").is_file())

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                         "ignore::DeprecationWarning")]


def _having(kind: str) -> list:
    """The golden stores that hold snapshots of `kind` (each test runs where it applies)."""
    return [v for v in VERSIONS
            if any(s["kind"] == kind for s in json.loads((GOLDEN / v / "expected.json").read_text())["snapshots"])]


def _copy(version: str, dest: Path) -> Path:
    """A private copy: the committed store is never opened for writing."""
    path = dest / version
    shutil.copytree(GOLDEN / version, path)
    return path


def _expected(version: str) -> dict:
    return json.loads((GOLDEN / version / "expected.json").read_text())


def _want(snap: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = gs.build(snap["builder"], snap["args"], sharded_cls=tsck.Sharded, replicated_cls=tsck.Replicated)
    return gs.checkout_form(state, tsck.Replicated)


def _targets(snap: dict) -> list[str]:
    out = [snap["root"]]
    if snap["step"] is not None:
        out.append(f"{snap['ref']}@{snap['step']}")
    return out


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """version -> (open store on a private copy, expected.json); shared by the read-only tests."""
    opened = {}
    base = tmp_path_factory.mktemp("golden")
    yield lambda v: opened.get(v) or opened.setdefault(
        v, (tsck.open_store(_copy(v, base), create=False), _expected(v)))
    for s, _ in opened.values():
        s.close()


@pytest.mark.parametrize("version", VERSIONS)
def test_every_snapshot_checks_out_bit_exact(golden, version):
    store, exp = golden(version)
    assert exp["snapshots"]
    for snap in exp["snapshots"]:
        if snap["kind"] not in ("tree", "collective"):  # collective: the merged, whole-tensor view
            continue
        want = _want(snap)
        for target in _targets(snap):
            assert store.resolve(target) == snap["root"], target
            assert_same(want, store.checkout(target), f"{snap['ref']}@{snap['step']}")


@pytest.mark.parametrize("version", VERSIONS)
def test_commits_keep_their_fields(golden, version):
    store, exp = golden(version)
    for snap in exp["snapshots"]:
        info = store.show(snap["root"])
        assert info.root == snap["root"]
        assert (info.ref, info.step) == (snap["ref"], snap["step"])
        assert info.metrics == snap["metrics"] and info.meta == snap["meta"]
        assert (info.blocks_total, info.blocks_new) == (snap["blocks_total"], snap["blocks_new"])


@pytest.mark.parametrize("version", VERSIONS)
def test_log_refs_tags_pins_retention(golden, version):
    store, exp = golden(version)
    by_ref: dict[str, list] = {}
    for snap in exp["snapshots"]:
        by_ref.setdefault(snap["ref"], []).append(snap)
    for ref, snaps in by_ref.items():
        log = store.log(ref)
        assert [i.step for i in log] == [s["step"] for s in reversed(snaps)], ref
        assert [i.root for i in log] == [s["root"] for s in reversed(snaps)], ref
    assert {name: info.root for name, info in store.refs().items()} == {
        ref: snaps[-1]["root"] for ref, snaps in by_ref.items()}
    assert {name: info.root for name, info in store.tags().items()} == exp["tags"]
    for name, root in exp["tags"].items():
        assert store.resolve(name) == root
    assert sorted(bytes(r).hex() for r in store.reftable.pins()) == exp["pins"]
    assert {job: {k: v for k, v in vars(r).items()} for job, r in store.retention().items()} == exp["retention"]
    assert (store.block_size, store.inline_threshold) == (exp["store"]["block_size"],
                                                          exp["store"]["inline_threshold"])


@pytest.mark.parametrize("version", VERSIONS)
def test_fsck_clean(golden, version):
    store, exp = golden(version)
    report = store.fsck()
    assert report.ok, report.findings
    assert report.snapshots_checked >= len(exp["snapshots"])
    assert report.orphans == 0


@pytest.mark.parametrize("version", _having("dcp"))
def test_dcp_snapshots_load_bit_exact(golden, version):
    import torch.distributed.checkpoint as dcp

    from tensorstore_ck.dcp import TsckReader
    store, exp = golden(version)
    snaps = [s for s in exp["snapshots"] if s["kind"] == "dcp"]
    assert snaps
    for snap in snaps:
        want = _want(snap)
        for target in _targets(snap):
            got = gs.dcp_blank(want)
            dcp.load(got, storage_reader=TsckReader(store, target))
            assert_same(want, got, target)
        # a plain checkout gives the state that was saved: every tensor whole, at its path
        plain = store.checkout(snap["root"])

        def flat(x, prefix="", out=None):
            out = {} if out is None else out
            for k, v in x.items():
                if isinstance(v, dict):
                    flat(v, f"{prefix}{k}.", out)
                elif isinstance(v, torch.Tensor):
                    out[f"{prefix}{k}"] = v
            return out
        want_flat, got_flat = flat(want), flat(plain)
        assert sorted(got_flat) == sorted(want_flat)
        for k, t in want_flat.items():
            assert_same(t, got_flat[k], k)


@pytest.mark.parametrize("version", _having("collective"))
def test_collective_snapshots_read_by_region(golden, version):
    """Each rank's chunks merge path by path: regions of a 3-way split (crossing the
    2 writers' row boundaries) read into Sharded targets; other values come from rank 0."""
    store, exp = golden(version)
    snaps = [s for s in exp["snapshots"] if s["kind"] == "collective"]
    assert snaps
    for snap in snaps:
        want = _want(snap)
        step = snap["args"]["step"]
        for r in range(3):
            into: dict = {}
            for path, (rows, cols, dt) in gs.DIST_SHARDED.items():
                a, b = gs.dist_rows(rows, 3, r)
                d = into
                for k in path[:-1]:
                    d = d.setdefault(k, {})
                d[path[-1]] = tsck.Sharded(torch.zeros(b - a, cols, dtype=getattr(torch, dt)), (rows, cols), (a, 0))
            got = store.checkout(snap["root"], into=into)
            assert got is into
            for path, (rows, cols, _dt) in gs.DIST_SHARDED.items():
                a, b = gs.dist_rows(rows, 3, r)
                d = got
                for k in path:
                    d = d[k]
                assert type(d) is tsck.Sharded and d.offsets == (a, 0), path
                assert_same(gs.dist_global(path, step)[a:b], d.local, f"{path} rows {a}:{b}")
            # into= names what is read: the rest is not added; paths= reads it.
            assert "norm" not in got["model"] and "local" not in got and "step" not in got
            rest = store.checkout(snap["root"], paths=["model.norm", "local", "step"])
            assert_same(want["model"]["norm"], rest["model"]["norm"], "norm")
            assert_same(want["local"], rest["local"], "local")
            assert_same(want["step"], rest["step"], "step")


@pytest.mark.parametrize("version", VERSIONS)
def test_cli_fsck_exits_0(tmp_path, version):
    path = _copy(version, tmp_path)
    env = dict(os.environ)
    pkg_root = str(Path(tsck.__file__).resolve().parent.parent)  # the code under test, old or new
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("PYTHONWARNINGS", None)
    r = zygote.run([sys.executable, "-m", "tensorstore_ck", "fsck", str(path), "--json"],
                   capture_output=True, text=True, timeout=120, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(r.stdout)["ok"] is True


@pytest.mark.parametrize("version", VERSIONS)
def test_put_of_a_recorded_state_writes_no_new_block(tmp_path, version):
    """Blocks are format-stable: today's writer cuts and addresses the old states the same way
    (unpacked, as they were written: packs would be new blocks by design)."""
    exp = _expected(version)
    with tsck.open_store(_copy(version, tmp_path), create=False, pack_size=0) as store:
        for i, snap in enumerate(exp["snapshots"]):
            if snap["kind"] != "tree":
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                state = gs.build(snap["builder"], snap["args"], sharded_cls=tsck.Sharded,
                                 replicated_cls=tsck.Replicated)
            info = store.put_snapshot(state, ref=f"redo/s{i}", step=snap["step"])
            assert info.blocks_new == 0 and info.bytes_new == 0, (snap["ref"], snap["step"], info)
            assert info.blocks_total == snap["blocks_total"], (snap["ref"], snap["step"], info)
            assert_same(_want(snap), store.checkout(info.root))
        assert store.fsck().ok
