"""The format-compatibility promise, made testable: a store written by an earlier
version (tests/data/golden/v1, written by the code before the November 2026
redesign; see tests/data/README.md) opens, every snapshot checks out bit-exact
with its recorded root, and fsck is clean."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

import tensorstore_ck as tsck
from _util import assert_same
from tensorstore_ck.dcp import TsckReader

DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(DATA))
import golden_states as gs  # noqa: E402

V1 = DATA / "golden" / "v1"
EXPECTED = json.loads((V1 / "expected.json").read_text())


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    path = tmp_path_factory.mktemp("golden") / "store"
    shutil.copytree(V1 / "store", path)  # never touch the committed copy
    with tsck.open_store(path, create=False) as s:
        yield s, path


def _want(snap):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's deprecation of quantize_per_*
        return gs.build(snap["builder"], snap["arg"])


@pytest.mark.parametrize("snap", EXPECTED["snapshots"], ids=lambda s: f"{s['ref']}@{s['step']}")
def test_every_snapshot_checks_out_bit_exact(golden, snap):
    s, _ = golden
    assert s.resolve(f"{snap['ref']}@{snap['step']}") == snap["root"]
    if snap.get("dcp"):
        target = gs.dcp_state()
        for v in target["model"].values():
            v.zero_()
        dcp.load(target, storage_reader=TsckReader(s, snap["root"]))
        assert_same(_want(snap), target, loose_types=True)
        return
    got = s.checkout(snap["root"])
    want = _want(snap)
    if snap["builder"] == "sharded":  # one rank's piece comes back as a Sharded
        assert_same(want["w"].local, got["w"].local)
        assert (got["w"].global_shape, got["w"].offsets) == ((10, 6), (4, 0))
        assert got["note"] == want["note"]
    else:
        assert_same(want, got)
        assert_same(want, s.checkout(f"{snap['ref']}@{snap['step']}"))


def test_refs_log_tags_pins_and_fsck(golden):
    s, path = golden
    by_ref: dict = {}
    for snap in EXPECTED["snapshots"]:
        by_ref.setdefault(snap["ref"], []).append(snap["step"])
    for ref, steps in by_ref.items():
        assert [i.step for i in s.log(ref)] == sorted(steps, reverse=True)
    for name, root in EXPECTED["tags"].items():
        assert s.resolve(name) == root
    assert {r.hex() for r in s.reftable.pins()} == set(EXPECTED["pins"])
    assert s.retention()["jobA"].keep_last == 5
    rep = s.fsck()
    assert rep.ok and rep.orphans == 0, [str(f) for f in rep.findings]
    r = subprocess.run([sys.executable, "-m", "tensorstore_ck", "fsck", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_blocks_are_format_stable(golden):
    """Today's writer cuts and addresses the same state exactly as the old one did."""
    s, _ = golden
    snap = next(x for x in EXPECTED["snapshots"] if x["builder"] == "every_kind")
    info = s.put_snapshot(_want(snap), ref="kinds/again", step=2)
    assert info.blocks_new == 0 and info.blocks_total > 0
    assert_same(_want(snap), s.checkout("kinds/again"))
