"""CheckpointManager under torch.distributed where one rank differs from the others: its
part of the newest snapshot damaged (restore_latest gives every rank the same outcome), its
state_dict() failing once (the snapshot aborts on every rank at once, nothing waits for the
deadline), and a rollback (restore(step) is recorded in the store, so a crash right after it
resumes there; a step that went back does not confuse the names of collective puts).
Real gloo ranks forked by tests/helpers/ddp_restore.py; judged here from what each rank
reported and from the store as this process sees it.
"""

from __future__ import annotations

import os
from pathlib import Path

import blake3
import pytest
import torch

from _util import rank_results, run_worker_scenario

import tensorstore_ck as tsck

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parents[1]
WORKER = HERE / "helpers" / "ddp_restore.py"
REF = "llm/main"


def run_scenario(tmp_path: Path, scenario: str, *args, limit: float = 400.0) -> Path:
    return run_worker_scenario(WORKER, tmp_path, scenario, *args, limit=limit)


def ranks(out: Path, phase: str) -> list[dict]:
    return rank_results(out, phase, 2)


def taken(d: dict) -> dict[int, str]:
    return {int(s): root for s, root in d["steps"].items() if root is not None}


# ---------------------------------------------------------------- one rank cannot stage

def test_a_rank_whose_state_cannot_be_read_aborts_that_snapshot_for_every_rank_at_once(tmp_path):
    """Rank 1's data loader cannot report its position at step 10. Its snapshot of step 10
    is lost on both ranks and nothing else: rank 0's future of step 10 ends at once (rank 1
    aborts the call it could not stage; rank 1 makes no other put meanwhile, so nothing
    else could end it before the 300 s deadline), and steps 5, 15 and 20 are committed
    alike on both ranks."""
    out = run_scenario(tmp_path, "stagefail")
    r0, r1 = ranks(out, "stagefail")
    assert r0["heard"], f"rank 0's snapshot of step 10 had not ended after {r0['heard_in']:.0f}s"
    assert r0["heard_in"] < 60
    assert taken(r0) == taken(r1) and sorted(taken(r0)) == [5, 15, 20]
    assert r0["failed"] == r1["failed"] == 1
    assert "rank 1" in r0["errors"][0] and "cannot report its position at step 10" in r0["errors"][0]
    assert r0["errors"][0].startswith("SnapshotAborted")  # not OutOfStep: rank 1 made the call, to abort it
    assert r1["errors"] == ["RuntimeError: rank 1's loader cannot report its position at step 10"]
    assert r0["closed"] == r1["closed"] == "ok"
    with tsck.open_store(out / "store", create=False) as s:
        assert [e.step for e in s.log(REF)] == [20, 15, 5]


# ---------------------------------------------------------------- a step that went back

def test_collective_snapshots_after_a_rollback_past_many_puts(tmp_path):
    """Snapshots at every step from 20 to 100, rank 1 entering the put of step 30 first and
    rank 0 every other one (so the group's record of the last put a rank entered before
    rank 0 stays step 30's, 70 puts back), then restore(20): each snapshot of the new run
    (steps 21-29, each taken for the second time in this process) is committed on both
    ranks, none fails as OutOfStep."""
    out = run_scenario(tmp_path, "farback")
    r0, r1 = ranks(out, "farback")
    assert r0["latest"] == [REF, 30]
    assert r0["first_failed"] == r1["first_failed"] == 0
    assert r0["restored"] == r1["restored"] == 20
    assert r0["errors"] == [] and r1["errors"] == [], r0["errors"][:1]
    assert taken(r0) == taken(r1) and sorted(taken(r0)) == list(range(21, 30))
    with tsck.open_store(out / "store", create=False) as s:
        assert s.log(REF)[0].step == 29 and s.log(REF)[0].root == taken(r0)[29]


# ---------------------------------------------------------------- one rank's part damaged

def _flip_part_block(store_dir: Path, rank: int, step: int) -> None:
    """Flip one bit of the block holding rank `rank`'s own part at `step` (its address is the
    BLAKE3 of its raw bytes; no other rank and no other step holds those bytes)."""
    from ddp_restore import part_values
    key = blake3.blake3(part_values(rank, step).numpy().tobytes()).hexdigest()
    path = store_dir / "blocks" / key[:2] / key
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_damaged_part_of_one_rank_gives_every_rank_the_same_restore(tmp_path):
    """Steps 2, 4 and 6 snapshotted by two ranks; one bit of rank 1's own part of step 6
    flipped. restore_latest() in new processes gives both ranks step 4, read whole on each
    (rank 1's part and the model as they were at step 4), with a warning naming the damaged
    snapshot; with rank 1's part of every snapshot damaged, both ranks raise the same
    IntegrityError and neither resumes."""
    import sys
    sys.path.insert(0, str(HERE / "helpers"))
    store_dir = tmp_path / "store"
    out = run_scenario(tmp_path, "train", store_dir)
    r0, r1 = ranks(out, "train")
    assert taken(r0) == taken(r1) and sorted(taken(r0)) == [2, 4, 6]
    _flip_part_block(store_dir, 1, 6)

    out = run_scenario(tmp_path, "restore", store_dir)
    r0, r1 = ranks(out, "restore")
    assert "error" not in r0 and "error" not in r1, (r0.get("error"), r1.get("error"))
    assert r0["restored"] == r1["restored"] == 4
    assert r0["part_ok"] and r1["part_ok"]
    for r in (0, 1):
        got = torch.load(out / f"restored_rank{r}.pt")
        want = torch.load(tmp_path / "train" / f"model_rank{r}_step4.pt")
        assert all(torch.equal(got[k], want[k]) for k in want)

    for step in (2, 4):
        _flip_part_block(store_dir, 1, step)
    out = run_scenario(tmp_path, "restore", store_dir)
    os.replace(out, tmp_path / "restore_all_damaged")
    r0, r1 = ranks(tmp_path / "restore_all_damaged", "restore")
    assert r0["error"][0] == r1["error"][0] == "IntegrityError"
    assert r0["error"] == r1["error"]
    assert "reads whole on every rank (3 tried)" in r0["error"][1] and "rank 1" in r0["error"][1]


# ---------------------------------------------------------------- a rollback, then a crash

def test_a_collective_rollback_is_recorded_before_a_crash(tmp_path):
    """Two ranks train to 30 (snapshots 10, 20, 30), restore(10), and the processes end with
    no snapshot since (a crash). New processes' restore_latest() gives both ranks step 10
    (rank 1's own part as it was at 10), and training on to 20 publishes without a
    StepReusedWarning."""
    store_dir = tmp_path / "store"
    out = run_scenario(tmp_path, "rollback", store_dir)
    first = ranks(out, "first")
    assert [d["restored"] for d in first] == [10, 10] and all(d["part_ok"] for d in first)
    second = ranks(out, "second")
    assert [d["restored"] for d in second] == [10, 10] and all(d["part_ok"] for d in second)
    assert taken(second[0]) == taken(second[1]) and sorted(taken(second[0])) == [20]
    for d in second:
        assert d["failed"] == 0 and not [w for w in d["warnings"] if "StepReused" in w], d["warnings"]
    with tsck.open_store(store_dir, create=False) as s:
        assert [e.step for e in s.log(REF)] == [20, 10, 30, 20]
