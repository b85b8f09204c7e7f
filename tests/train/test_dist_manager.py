"""CheckpointManager under torch.distributed: the README's manager code in a DDP loop on
real gloo ranks (tests/helpers/ddp_manager.py forks them), judged here from what each rank
observed (what step() returned, the manager's counters, the states it saved and restored)
and from the store as this process sees it afterwards.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

import _zygote as zygote
from _util import rank_results, run_worker_scenario, same_bits

import tensorstore_ck as tsck

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parents[1]
REPO = HERE.parent
WORKER = HERE / "helpers" / "ddp_manager.py"
REF = "llm/main"


def run_scenario(tmp_path: Path, scenario: str, *args, limit: float = 300.0) -> Path:
    return run_worker_scenario(WORKER, tmp_path, scenario, *args, limit=limit)


def ranks(out: Path, phase: str, world: int = 2) -> list[dict]:
    return rank_results(out, phase, world)


def taken(d: dict) -> dict[int, str]:
    """step -> root of the snapshots step() returned on one rank."""
    return {int(s): root for s, root in d["steps"].items() if root is not None}


def kept_roots(store_path: Path) -> dict[int, str]:
    with tsck.open_store(store_path, create=False) as s:
        return {e.step: e.root for e in s.log(REF)}


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_readme_manager_under_ddp_snapshots_prunes_and_never_raises(tmp_path, mode):
    """The README's manager (every_steps, on_metric with each rank's own loss, retention)
    in a 16-step DDP loop, asynchronous (the default: snapshots in the background on
    every rank) and with async_=False; rank 0's prune never overlaps the next snapshot
    and nothing escapes step()."""
    out = run_scenario(tmp_path, "loop", mode)
    r0, r1 = ranks(out, "loop")
    assert r0["steps"] == r1["steps"]  # every rank: the same snapshots, the same roots
    snaps = taken(r0)
    assert {2, 4, 6, 8, 10, 12, 14, 16} <= set(snaps)  # every_steps=2
    assert len(set(snaps.values())) == len(snaps)
    # on_metric fires on rank 0's loss: a step where only rank 1's loss improved took none
    best, expect_metric = None, set()
    for s in range(1, 17):
        v = r0["vals"][str(s)]
        if best is None or v < best:
            best = v
            expect_metric.add(s)
    assert set(snaps) == {s for s in range(2, 17, 2)} | expect_metric
    for d in (r0, r1):
        assert d["failed"] == 0 and d["errors"] == [], d["errors"]
        assert d["prune_errors"] == []
    assert r0["prune_runs"] >= 1 and r1["prune_runs"] == 0  # prune: rank 0 only
    # The store holds what retention keeps (keep_last=2, keep_best=1 on val_loss, rank 0's
    # value, as recorded), once close() waited for the last prune.
    last2 = sorted(snaps)[-2:]
    best_step = min(snaps, key=lambda s: r0["vals"][str(s)])
    assert kept_roots(out / "store") == {s: snaps[s] for s in {*last2, best_step}}


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_managers_own_prune_never_overlaps_its_collective_snapshots(tmp_path, mode):
    """A snapshot at every one of 24 steps, keep_last=2, asynchronous (the default: rank 0
    queues each prune behind its snapshot on the store's background publisher) or not
    (rank 0 waits for the prune before the next): the job's prune never overlaps its next
    snapshot (whose ref move its deletion phase would fence: none was), nor lets an
    error out of step()."""
    out = run_scenario(tmp_path, "prune", mode)
    r0, r1 = ranks(out, "prune")
    assert r0["steps"] == r1["steps"]
    snaps = taken(r0)
    assert sorted(snaps) == list(range(1, 25))
    assert r0["failed"] == r1["failed"] == 0, (r0["errors"], r1["errors"])
    assert r0["prune_runs"] >= 1 and r0["prune_errors"] == []
    assert r0["fenced"] == 0
    assert kept_roots(out / "store") == {23: snaps[23], 24: snaps[24]}


def test_a_time_trigger_is_rank_0s_decision_on_every_rank(tmp_path):
    """every_seconds=10; rank 0's clock moves 1 s per step, rank 1's 100 s: rank 1 alone
    would snapshot at every step and wait for a rank 0 that never joins."""
    out = run_scenario(tmp_path, "clock")
    r0, r1 = ranks(out, "clock")
    assert r0["steps"] == r1["steps"]
    assert sorted(taken(r0)) == [10, 20]
    assert r0["failed"] == r1["failed"] == 0
    assert kept_roots(out / "store") == taken(r0)


def test_a_snapshot_that_fails_is_reported_and_training_goes_on(tmp_path):
    """Rank 1's object writes fail (ENOSPC) while step 4 is snapshotted: step() returns
    None on both ranks, both count it, and step 6 takes the next snapshot."""
    out = run_scenario(tmp_path, "fail")
    r0, r1 = ranks(out, "fail")
    assert r0["steps"] == r1["steps"]
    assert sorted(taken(r0)) == [2, 6, 8, 10]
    assert r0["failed"] == r1["failed"] == 1
    assert "No space left on device" in r1["errors"][0]
    assert r0["errors"][0].startswith("SnapshotAborted")
    assert kept_roots(out / "store") == {s: taken(r0)[s] for s in (8, 10)}


def test_a_snapshot_met_by_a_gc_deletion_phase_is_revalidated_and_training_goes_on(tmp_path):
    """Another party's gc holds its deletion phase open when step 4's snapshot starts and
    ends it 3 s later: the collective put waits it out and re-validates instead of
    aborting, so step 4 is published on every rank, after the phase ended, and nothing
    is reported failed."""
    out = run_scenario(tmp_path, "fenced")
    r0, r1 = ranks(out, "fenced")
    assert r0["steps"] == r1["steps"]
    assert sorted(taken(r0)) == [2, 4, 6, 8]
    assert r0["failed"] == r1["failed"] == 0
    assert r0["step4_end"] >= r0["gc_end"]  # it did meet the phase: it returned only after it ended
    assert kept_roots(out / "store") == taken(r0)


def test_restore_latest_is_collective_and_resumes_bit_exact_on_every_rank(tmp_path):
    """Train 9 steps (snapshots every 3), exit; new processes restore_latest(): every rank
    resumes at 9 with exactly the state it snapshotted there (its own RNG streams), and
    its losses of steps 10-12 are bit-identical to an uninterrupted run's."""
    out = run_scenario(tmp_path, "resume")
    first = ranks(out, "first")
    second = ranks(out, "second")
    straight = ranks(out, "straight")
    assert [d["start"] for d in first] == [None, None]  # a first run: nothing to restore on any rank
    assert [d["start"] for d in second] == [9, 9]
    restored = []
    for r in range(2):
        saved = torch.load(out / f"first_rank{r}_step9.pt", weights_only=False)
        got = torch.load(out / f"second_rank{r}_restored.pt", weights_only=False)
        assert same_bits(got, saved), f"rank {r}: the restored state differs from the one it snapshotted"
        restored.append(got)
        for s in ("10", "11", "12"):
            assert second[r]["losses"][s] == straight[r]["losses"][s], (r, s)
    # each rank got its own part of the one snapshot, not rank 0's
    assert not torch.equal(restored[0]["rng"]["torch"], restored[1]["rng"]["torch"])
    assert second[0]["steps"] == second[1]["steps"] and taken(second[0]).keys() == {12}


def test_example_ddp_resume_after_a_rank_is_killed_is_bit_identical(tmp_path):
    """examples/ddp_resume.py under torchrun: rank 1 SIGKILLed at step 17 (torchrun takes the
    job down), the same script resumes every rank at the newest committed snapshot (every
    5 steps, asynchronous), and every rank's losses equal an uninterrupted run's bit for bit."""
    env = dict(os.environ, **{zygote.SUBPROCESS: "1"})  # torchrun's agent and ranks: forks of the zygote
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = zygote.run([sys.executable, str(REPO / "examples" / "ddp_resume.py"), "--out", str(tmp_path)],
                      cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    # Asynchronous snapshots: the newest one committed before the kill (step 5, 10 or 15:
    # 10 and 15 may still have been in the background), the same on every rank.
    starts = re.findall(r"resumed at step (\d+); losses identical", proc.stdout)
    assert len(starts) == 2 and len(set(starts)) == 1 and int(starts[0]) in (5, 10, 15), proc.stdout
    with tsck.open_store(tmp_path / "store", create=False) as s:  # (retention keeps the newest few)
        steps = sorted(e.step for e in s.log("ddp/main"))
    assert steps == [15, 20], steps  # keep_last=2 of the resumed run's snapshots


def test_a_state_that_grows_between_asynchronous_snapshots_never_stops_training(tmp_path):
    """A snapshot before the optimizer's first step, then one per step: the staged states
    have two sizes, so each rank's store holds two staging buffers of different sizes.
    Every snapshot commits; nothing escapes step() (a value comparison of the buffers
    raised RuntimeError out of step() on both ranks at the third)."""
    out = run_scenario(tmp_path, "grow")
    r0, r1 = ranks(out, "grow")
    assert r0["steps"] == r1["steps"]
    assert sorted(taken(r0)) == list(range(0, 7))
    assert r0["failed"] == r1["failed"] == 0, (r0["errors"], r1["errors"])
    assert len(r0["buffers"]) == 2 and r0["buffers"][0] < r0["buffers"][1], r0["buffers"]  # the case is met
    assert kept_roots(out / "store") == taken(r0)


def test_the_last_snapshots_failing_are_shown_and_close_raises(tmp_path):
    """Rank 1's disk fails from step 6 on: steps 6, 8 and 10 fail on both ranks. With no
    logging configured, each rank is shown one SnapshotWarning (the first of its kind,
    the rest counted) and close() raises SnapshotsFailed naming the newest committed
    step (4): the run cannot end quietly on a failed snapshot."""
    out = run_scenario(tmp_path, "failend")
    r0, r1 = ranks(out, "failend")
    for r in (r0, r1):
        assert r["failed"] == 3, r["errors"]
        assert r["closed"].startswith("SnapshotsFailed"), r["closed"]
        assert "step 10" in r["closed"] and "step 4" in r["closed"], r["closed"]
        assert r["report"] == [5, 2, 3, 10, 4]
        warned = [w for w in r["shown"] if w.startswith("SnapshotWarning")]
        assert len(warned) == 1 and "step 6" in warned[0], r["shown"]  # one of its kind; the rest counted
    assert sorted(kept_roots(out / "store")) == [2, 4]


def test_force_is_rank_0s_decision_on_every_rank(tmp_path):
    """force=True passed by one rank alone made it enter a collective call the others never
    made: that snapshot and, with calls named by count, every later one failed. Rank 0's
    force decides on every rank, as its clock and metric do."""
    out = run_scenario(tmp_path, "force")
    r0, r1 = ranks(out, "force")
    assert r0["steps"] == r1["steps"]
    assert sorted(taken(r0)) == [2, 4, 5, 6, 8]
    assert r0["failed"] == r1["failed"] == 0, (r0["errors"], r1["errors"])
    assert kept_roots(out / "store") == taken(r0)


@pytest.mark.parametrize("who", ["one", "both"])
def test_a_preemption_signal_to_one_rank_saves_one_step_on_every_rank(tmp_path, who):
    """SIGTERM to rank 1 alone (at step 5), or to rank 0 at step 4 and rank 1 at step 6, in
    a run whose interval took no snapshot: every rank agrees at its next step() on one step,
    saves it blocking and raises Preempted (exit status 143); new processes resume there,
    each rank bit-identical to what it held at that step."""
    out = run_scenario(tmp_path, "preempt", who)
    r0, r1 = ranks(out, "preempt")
    want = {"one": 5, "both": 4}[who]
    for r in (r0, r1):
        assert (r["saved"], r["at"], r["code"], r["durable"]) == (want, want, 143, True), r
    assert sorted(kept_roots(out / "store")) == [want]
    for rank, r in enumerate(ranks(out, "restored")):
        assert r["start"] == want
        got = torch.load(out / f"restored_rank{rank}.pt")
        saved = torch.load(out / f"preempt_rank{rank}_step{want}.pt")
        assert all(same_bits(got["model"][k], saved["model"][k]) for k in saved["model"])
