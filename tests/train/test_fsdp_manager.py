"""CheckpointManager under FSDP2 and hybrid sharding: the README's manager code on real gloo
ranks (tests/helpers/fsdp_manager.py forks them), a snapshot at every step with retention,
then restore_latest() into fresh models and optimizers at the same and at another world size
(and from an HSDP mesh into FSDP2), judged against an uninterrupted run bit for bit.
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
WORKER = HERE / "helpers" / "fsdp_manager.py"
REF = "fsdp/main"
FIRST, LAST = 6, 10
WORLD = {"first": 2, "same": 2, "grow": 3, "one": 1, "straight": 2, "hfirst": 4, "hsame": 4, "hshrink": 2, "hstraight": 4}

def ranks(out: Path, phase: str) -> list[dict]:
    return rank_results(out, phase, WORLD[phase])


def dumped(out: Path, phase: str, rank: int) -> dict:
    return torch.load(out / f"{phase}_rank{rank}.pt", weights_only=False)


def kept_steps(store_path: Path) -> list[int]:
    with tsck.open_store(store_path, create=False) as s:
        return sorted(e.step for e in s.log(REF))


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> Path:
    """One run of the fsdp scenario (four phases on 2-3 ranks) for the tests below."""
    return run_worker_scenario(WORKER, tmp_path_factory.mktemp("fsdp"), "fsdp", limit=600.0)


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory) -> Path:
    return run_worker_scenario(WORKER, tmp_path_factory.mktemp("hsdp"), "hsdp", limit=600.0)


def check_snapshots_and_prune(out: Path, first: str, straight: str) -> None:
    for phase, store, last in ((first, "store", FIRST), (straight, "straight", LAST)):
        got = ranks(out, phase)
        for d in got:  # a snapshot at every step, none failed, nothing raised out of step()
            assert d["failed"] == 0 and d["errors"] == [], (phase, d["errors"])
            assert d["prune_errors"] == [], (phase, d["prune_errors"])
            assert sorted(map(int, d["losses"])) == list(range(1, last + 1))
        assert got[0]["prune_runs"] >= 1, phase  # the prune ran, on rank 0 only
        assert all(d["prune_runs"] == 0 for d in got[1:]), phase
        assert kept_steps(out / store) == [last - 1, last], phase  # keep_last=2, once close() returned


def check_resumed(out: Path, first: str, straight: str, phase: str) -> None:
    ref = ranks(out, straight)[0]["losses"]
    saved = dumped(out, first, 0)["final"]  # every tensor whole, as the first run left it at its last snapshot
    want = dumped(out, straight, 0)["final"]
    for r, d in enumerate(ranks(out, phase)):
        assert d["start"] == FIRST, (phase, r, d["start"])
        assert d["failed"] == 0 and d["errors"] == [], (phase, r, d["errors"])
        got = dumped(out, phase, r)
        assert sorted(got["restored"]) == sorted(saved)
        for k in saved:
            assert same_bits(saved[k], got["restored"][k]), f"{phase} rank {r}: restored {k} differs"
        assert d["losses"] == {str(s): ref[str(s)] for s in range(FIRST + 1, LAST + 1)}, (phase, r)
        for k in want:
            assert same_bits(want[k], got["final"][k]), f"{phase} rank {r}: final {k} differs"
    assert kept_steps(out / f"store_{phase}") == [LAST - 1, LAST]


def test_fsdp2_manager_snapshots_at_every_step_and_prunes_once_on_rank_0(fsdp):
    check_snapshots_and_prune(fsdp, "first", "straight")
    # the snapshots hold the optimizer's DTensor state sharded over the two ranks' pieces
    with tsck.open_store(fsdp / "store", create=False) as s:
        whole = s.checkout(REF, group=False)
    full = dumped(fsdp, "first", 0)["final"]
    assert same_bits(full["model.0.weight"], whole["model"]["0.weight"])
    assert same_bits(full["optim.0.weight.exp_avg"], whole["optimizer"]["state"][0]["exp_avg"])


@pytest.mark.parametrize("phase", ["same", "grow", "one"])
def test_fsdp2_restore_latest_into_a_fresh_model_resumes_bit_identical(fsdp, phase):
    """same: 2 ranks, as saved; grow: 3 ranks (23 rows split 8, 8, 7); one: FSDP2 on a 1-rank
    mesh (torchrun --nproc_per_node 1: the manager is not collective there). Every rank resumes
    at step 6 with the whole state the first run had there, then its losses of steps 7-10 and
    its final parameters and Adam state equal an uninterrupted run's bit for bit."""
    check_resumed(fsdp, "first", "straight", phase)
    if phase == "grow":
        assert [d["local_shapes"]["0.weight"] for d in ranks(fsdp, "grow")] == [[8, 16], [8, 16], [7, 16]]


def test_hsdp_manager_snapshots_at_every_step_and_prunes_once_on_rank_0(hsdp):
    check_snapshots_and_prune(hsdp, "hfirst", "hstraight")


@pytest.mark.parametrize("phase", ["hsame", "hshrink"])
def test_hsdp_restore_latest_resumes_bit_identical_on_hsdp_and_on_fsdp2_at_2(hsdp, phase):
    """hsame: HSDP on 4 ranks (replicate 2 x shard 2), as saved; hshrink: FSDP2 on 2 ranks."""
    check_resumed(hsdp, "hfirst", "hstraight", phase)


def test_the_training_rule_makes_fsdp2_and_hsdp_runs_the_same_bits(fsdp, hsdp):
    """What the resume tests rely on to compare across world sizes: an uninterrupted run's
    losses do not depend on the mesh (global batch on every rank, float64 reduction)."""
    assert ranks(fsdp, "straight")[0]["losses"] == ranks(hsdp, "hstraight")[0]["losses"]


def test_example_fsdp2_resume_on_more_ranks_after_a_rank_is_killed_is_bit_identical(tmp_path):
    """examples/fsdp2_resume.py under torchrun: an FSDP2 job on 2 ranks, rank 1 SIGKILLed at
    step 17 (torchrun takes the job down); the same script on 3 ranks resumes every rank at
    the newest snapshot (every 5 steps: 15 when the manager snapshots in the foreground, an
    earlier one when step 15's was still in the background at the kill), and its losses and
    final parameters equal an uninterrupted 2-rank run's bit for bit."""
    env = dict(os.environ, **{zygote.SUBPROCESS: "1"})  # torchrun's agent and ranks: forks of the zygote
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = zygote.run([sys.executable, str(REPO / "examples" / "fsdp2_resume.py"), "--out", str(tmp_path)],
                      cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    said = re.findall(r"rank (\d) of 3: resumed at step (\d+); losses identical to the uninterrupted 2-rank "
                      r"run's; final parameters identical", proc.stdout)
    assert sorted(int(r) for r, _s in said) == [0, 1, 2], proc.stdout
    assert len({s for _r, s in said}) == 1 and int(said[0][1]) in (5, 10, 15), proc.stdout
    with tsck.open_store(tmp_path / "store", create=False) as s:  # (retention keeps the newest few)
        steps = sorted(e.step for e in s.log("fsdp2/main"))
    assert steps and set(steps) <= {5, 10, 15, 20}, steps
