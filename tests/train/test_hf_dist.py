"""Hugging Face Trainer under DDP on real gloo ranks (2 processes, CPU): hf.TsckCallback
takes one collective snapshot of every rank's state per save, resume_checkpoint writes the
folder the Trainer reads on every rank (rng_state_{r}.pth per rank), and
examples/hf_ddp_resume.py (torchrun, a rank SIGKILLed, resume_from_checkpoint=True) is
bit-identical to an uninterrupted run."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers", reason="the hf extra (transformers, accelerate) is not installed")
pytest.importorskip("accelerate", reason="the hf extra (transformers, accelerate) is not installed")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

import _zygote as zygote
from _util import assert_same, run_worker_scenario  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402
from tensorstore_ck import hf  # noqa: E402

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "helpers" / "hf_ddp.py"


def _ranks(out: Path, scenario: str) -> list[dict]:
    ranks = [json.loads((out / f"{scenario}_rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["ok"], r.get("error")
    return ranks


def _same_folder(got: Path, trainer_wrote: Path) -> None:
    """The folder resume_checkpoint wrote holds what the Trainer itself wrote at that save
    (all but training_args.bin, which is the next run's own)."""
    names = sorted(n for n in os.listdir(trainer_wrote) if n != "training_args.bin")
    assert sorted(os.listdir(got)) == names
    for n in names:
        if n.endswith((".pt", ".pth")):
            assert_same(torch.load(trainer_wrote / n, weights_only=False), torch.load(got / n, weights_only=False),
                        f"{got.name}/{n}")
        elif n == "model.safetensors":
            assert_same(load_file(trainer_wrote / n), load_file(got / n), n)
        else:
            assert (got / n).read_bytes() == (trainer_wrote / n).read_bytes(), n


@pytest.mark.parametrize("mode", ["keep", "async"])
def test_ddp_saves_one_collective_snapshot_and_resume_writes_every_ranks_folder(tmp_path, mode):
    """2 ranks, saves at steps 5 and 10: one snapshot per save holding both ranks (meta
    world 2), and resume_checkpoint, collective on both ranks or from one process later,
    writes the folder the Trainer wrote at step 10: each rank's own rng_state_{r}.pth (the
    ranks' streams differ), the optimizer and scheduler, the weights and trainer_state.json.
    A snapshot that is not a Trainer's, or a missing ref: the same error on every rank,
    nothing written, nobody left waiting. async: TsckCallback(async_=True), each save's
    collective snapshot taken in the background on every rank."""
    out = run_worker_scenario(WORKER, tmp_path, mode, limit=400)
    ranks = _ranks(out, mode)
    trainer_wrote = out / "output" / "checkpoint-10"
    with tsck.open_store(out / "store", create=False) as s:
        log = s.log("j/main")
        assert [i.step for i in log] == [10, 5] and all(i.meta["world"] == 2 for i in log)
        single = Path(hf.resume_checkpoint(s, "j/main", tmp_path / "single"))
    rng0, rng1 = (torch.load(trainer_wrote / f"rng_state_{r}.pth", weights_only=False) for r in (0, 1))
    assert not torch.equal(rng0["cpu"], rng1["cpu"])  # each rank's own stream, and each comes back as its own
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(trainer_wrote))  # kept through the store:
    _same_folder(single, trainer_wrote)
    _same_folder(out / "again" / "checkpoint-10", trainer_wrote)
    for r in ranks:
        assert r["again"] == str(out / "again" / "checkpoint-10")
        assert r["again_files"] == sorted(os.listdir(single))
        assert r["not_trainer"][0] == "InvalidArgument" and "not a Trainer snapshot" in r["not_trainer"][1]
        assert r["missing"][0] == "RefNotFound"
        assert not r["bad_exists"]


def test_fsdp_on_cpu_trains_ddp_and_is_snapshotted_as_ddp(tmp_path):
    """accelerate turns FSDP on for accelerator devices only: fsdp="full_shard" with
    use_cpu=True trains plain DDP (every rank holds the whole model), so the callback
    asks accelerate what runs rather than refusing on args.fsdp."""
    out = run_worker_scenario(WORKER, tmp_path, "fsdp", limit=400)
    _ranks(out, "fsdp")
    with tsck.open_store(out / "store", create=False) as s:
        assert [(i.step, i.meta["world"]) for i in s.log("j/main")] == [(10, 2), (5, 2)]


def test_example_hf_ddp_resume_after_a_rank_is_killed_is_bit_identical(tmp_path):
    """examples/hf_ddp_resume.py under torchrun: keep_local=False (the store holds the only
    copy), rank 1 SIGKILLed at step 12, the same script resumes with
    resume_from_checkpoint=True at step 10 on both ranks, and every rank's losses and final
    parameters equal an uninterrupted run's; save_total_limit=2 kept the 2 newest snapshots."""
    env = dict(os.environ, **{zygote.SUBPROCESS: "1"})  # torchrun's agent and ranks: forks of the zygote
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    proc = zygote.run([sys.executable, str(REPO / "examples" / "hf_ddp_resume.py"), "--out", str(tmp_path)],
                      cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert "committed snapshots (steps): [5, 10]" in proc.stdout
    assert proc.stdout.count("resumed at step 10; losses identical to the uninterrupted run's; final parameters "
                             "identical; checkpoint folders left: []") == 2, proc.stdout
    with tsck.open_store(tmp_path / "store", create=False) as s:
        assert [i.step for i in s.log("hf-ddp/main")] == [20, 15]
        assert s.retention()["hf-ddp"] == tsck.Retention(keep_last=2)
