"""Asynchronous collective puts: put_snapshot(..., blocking=False) under torch.distributed.

Real gloo ranks (tests/helpers/async_worker.py, forked by dist_worker.launch); the ranks
record what they saw and this file judges against the data computed here and the store.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from _util import load_helper, rank_results, run_worker_scenario, same_bits

import tensorstore_ck as tsck

HERE = Path(__file__).resolve().parents[1]
WORKER = HERE / "helpers" / "async_worker.py"

pytestmark = pytest.mark.slow


dw = load_helper(HERE / "helpers" / "dist_worker.py", name="tsck_test_async_dist_worker", sibling_imports=True)


def results(out: Path, phase: str, world: int, ok: bool = True) -> list[dict]:
    return rank_results(out, phase, world, ok=ok, missing_ok=True)


def _store(out: Path, name: str = "store"):
    return tsck.open_store(out / name, block_size=dw.BLOCK, inline_threshold=dw.INLINE)


def _assert_version(store, target: str, world: int, version: int):
    got = store.checkout(target)
    assert same_bits(got["w"], dw.small_global(version)), f"{target}: not version {version}'s rows"
    assert got.get("v", version) == version


@pytest.mark.parametrize("world,scenario", [(2, "inflight"), (3, "inflight"), (2, "inflight_saver")])
def test_async_collective_puts_in_flight_publish_each_state_as_staged_in_call_order(tmp_path, world, scenario):
    """inflight_saver: the same with each rank's blocks written by its saver process."""
    out = run_worker_scenario(WORKER, tmp_path, scenario, world, limit=240)
    res = results(out, "inflight", world)
    for key in ("put1", "put2", "put3", "put4", "put5", "percall7", "percall8"):
        assert [r[key] for r in res] == ["returned"] * world, [(r[key], r.get(key + "_message")) for r in res]
        assert len({r[key + "_root"] for r in res}) == 1, f"{key}: ranks got different roots"
    assert all(r["type1"] == "SnapshotFuture" for r in res)
    assert [r["savers"] for r in res] == [1 if scenario == "inflight_saver" else 0] * world
    assert all(r["cancel_refused"] for r in res)
    assert all(r["put5_done_before_6"] for r in res), "a blocking put must wait for the asynchronous ones"
    assert len({r["put6_root"] for r in res}) == 1
    with _store(out) as s:
        log = s.log(dw.REF)
        # Committed in call order: the ref's history is steps 6, 5, 4, 3, 2, 1.
        assert [i.step for i in log] == [6, 5, 4, 3, 2, 1]
        assert [i.root for i in log[2:]] == [res[0][f"put{v}_root"] for v in (4, 3, 2, 1)]
        assert all(i.meta.get("world") == world for i in log)
        for v in range(1, 7):
            # Each holds the state at its call, not what the ranks wrote into the tensors afterwards.
            _assert_version(s, log[6 - v].root, world, v)
    with _store(out, "percall") as s:
        assert [i.step for i in s.log(dw.REF)] == [8, 7]
        _assert_version(s, dw.REF, world, 8)


def test_a_rank_whose_state_cannot_be_staged_raises_and_the_others_futures_abort_at_once(tmp_path):
    out = run_worker_scenario(WORKER, tmp_path, "localerr", limit=90)  # the put's deadline is 120 s
    res = results(out, "localerr", 3)
    assert [r["put1"] for r in res] == ["returned"] * 3
    assert res[1]["put2"] == "UnsupportedType" and res[1].get("put2_raised"), res[1]
    assert [res[r]["put2"] for r in (0, 2)] == ["SnapshotAborted"] * 2, [r.get("put2_message") for r in res]
    assert all("rank 1" in res[r]["put2_message"] for r in (0, 2)), [r.get("put2_message") for r in res]
    # ... and why: rank 1's own error, not one raised while passing it on
    assert all("UnsupportedType" in res[r]["put2_message"] and "NameError" not in res[r]["put2_message"]
               for r in (0, 2)), [r.get("put2_message") for r in res]
    assert [r["put3"] for r in res] == ["returned"] * 3
    with _store(out) as s:
        assert [i.step for i in s.log(dw.REF)] == [3, 1]
        _assert_version(s, dw.REF, 3, 3)


def test_a_rank_killed_with_a_snapshot_staged_never_hangs_the_others(tmp_path):
    timeout = 3
    out = run_worker_scenario(WORKER, tmp_path, "dies", timeout, limit=150)
    launcher = json.loads((out / "dies_launcher.json").read_text())
    assert launcher["exitcodes"][1] == -9
    res = results(out, "dies", 3, ok=False)
    for r in (0, 2):
        assert res[r]["ok"], res[r].get("error")
        assert res[r]["put1"] == "returned"
        # Rank 1 never made put 3: it aborts on every live rank, within the deadline rules.
        assert res[r]["put3"] == "SnapshotAborted", res[r].get("put3_message")
        assert res[r]["put2"] in ("returned", "SnapshotAborted"), res[r].get("put2_message")
    assert res[0]["put2"] == res[2]["put2"], "the live ranks must learn the same outcome"
    with _store(out) as s:
        steps = [i.step for i in s.log(dw.REF)]
    assert steps == ([2, 1] if res[0]["put2"] == "returned" else [1])


def test_async_collective_puts_beside_gcs_publish_on_every_rank(tmp_path):
    out = run_worker_scenario(WORKER, tmp_path, "gcphase", limit=300)
    res = results(out, "gcphase", 2)
    assert res[0]["gcs"] >= 1
    for v in range(1, 9):
        assert [r[f"put{v}"] for r in res] == ["returned"] * 2, [r.get(f"put{v}_message") for r in res]
        assert res[0][f"put{v}_root"] == res[1][f"put{v}_root"]
    with _store(out) as s:
        assert [i.step for i in s.log(dw.REF)] == list(range(8, 0, -1))
        for i in s.log(dw.REF):
            _assert_version(s, i.root, 2, i.step)
        assert s.fsck().ok
