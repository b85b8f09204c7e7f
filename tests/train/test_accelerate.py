"""tensorstore_ck.accelerate against the released accelerate: a real Accelerator's training
loop (tests/helpers/accel_train.py) on 1 process and on 2 DDP ranks (real torchrun, gloo on
CPU), SIGKILLed once its snapshot of step 10 is committed and resumed from the store,
blocking and asynchronous, through checkpoint_manager and through save_state/load_state:
every rank's run from step 11 on is bit-identical to an uninterrupted one (batches, losses,
parameters, optimizer, scheduler, RNG streams, the loader's position and epoch,
accelerator.step, the checkpoint counter, a registered object), and
ProjectConfiguration(total_limit=2) bounds the store after the resume. FSDP and DeepSpeed
are refused. The test waits for the files the runs write and for their exits only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("accelerate", reason="the hf extra (accelerate) is not installed")

import _zygote as zygote  # noqa: E402
from _util import REPO, child_env  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402

SCRIPT = REPO / "tests" / "helpers" / "accel_train.py"
DEADLINE = float(os.environ.get("DBG_DEADLINE", 180))  # for each wait: generous, the machine is shared
COMPARED = ("params", "optimizer", "scheduler", "rng", "epoch", "loader", "accelerator_step", "iteration", "counter")


class Run:
    """One launch of the helper: one process (world 1) or torchrun's agent and its ranks."""

    def __init__(self, out: Path, phase: str, world: int, **cfg):
        self.out, self.phase, self.world = out, phase, world
        conf = out / f"{phase}.json"
        conf.write_text(json.dumps({"out": str(out), "store": str(out / "store"), "phase": phase, "steps": 16,
                                    "every": 5, "total_limit": 2, **cfg}))
        env = child_env(TORCH_CPP_LOG_LEVEL="ERROR", PYTHONWARNINGS="ignore", **{zygote.SUBPROCESS: "1"})
        for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        argv = [str(SCRIPT), str(conf)]
        if world > 1:
            argv = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] + argv
        self.err = open(out / f"{phase}.err", "w")
        self.proc = zygote.Popen([sys.executable, *argv], cwd=REPO, env=env, stdout=self.err,
                                 stderr=subprocess.STDOUT, start_new_session=True)

    def file(self, rank: int, name: str) -> Path:
        return self.out / f"{self.phase}_rank{rank}_{name}"

    def log(self) -> str:
        return (self.out / f"{self.phase}.err").read_text()[-4000:]

    def until(self, name: str) -> None:
        deadline = time.monotonic() + DEADLINE
        while not all(self.file(r, name).exists() for r in range(self.world)):
            if self.proc.poll() is not None and not all(self.file(r, name).exists() for r in range(self.world)):
                raise AssertionError(f"{self.phase} exited {self.proc.returncode} before {name}:\n{self.log()}")
            assert time.monotonic() < deadline, f"{self.phase}: timed out waiting for {name}:\n{self.log()}"
            time.sleep(0.02)

    def results(self) -> list[dict]:
        try:
            rc = self.proc.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            self._dump_ranks()
            os.killpg(self.proc.pid, signal.SIGKILL)
            raise AssertionError(f"{self.phase} ran past {DEADLINE}s:\n{self.log()}") from None
        finally:
            self.err.close()
        assert rc == 0, f"{self.phase} exited {rc}:\n{self.log()}"
        return [json.loads(self.file(r, "result.json").read_text()) for r in range(self.world)]

    def _dump_ranks(self) -> None:
        """Every rank's Python stacks into the log (faulthandler on SIGUSR1): a run past its
        deadline says where it waits."""
        for r in range(self.world):
            try:
                os.kill(int(self.file(r, "started").read_text()), signal.SIGUSR1)
            except (OSError, ValueError):
                pass
        self.err.flush()
        time.sleep(1.0)  # (the dumps are written by the ranks' own C handler; a failure's report only)

    def sigkill_ranks(self) -> None:
        """SIGKILL every rank (as a node lost); torchrun's agent then ends on its own."""
        for r in range(self.world):
            os.kill(int(self.file(r, "started").read_text()), signal.SIGKILL)
        try:
            rc = self.proc.wait(timeout=DEADLINE)
        finally:
            self.err.close()
        assert rc != 0


def _killed_and_resumed(out: Path, world: int, job: str, **cfg) -> list[dict]:
    """A run SIGKILLed once its snapshot of step 10 is committed on every rank (it waits at
    step 12), then a new run resumed from the store to step 16: its ranks' results."""
    killed = Run(out, f"{job}_killed", world, job=job, resume=False, hold_at=12, **cfg)
    killed.until("committed_10")
    killed.sigkill_ranks()
    return Run(out, f"{job}_resumed", world, job=job, resume=True, **cfg).results()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_killed_run_resumes_bit_identically_blocking_and_async(tmp_path, world):
    """World 1: blocking through save_state/load_state, asynchronous through
    checkpoint_manager; world 2 (torchrun, DDP): the other way round. The loader holds 8
    batches an epoch on one process and 4 per rank on two, so step 10 is inside epoch 1 or 2:
    a restore that left the epoch at 0 would replay epoch 0's order (accelerate's own
    load_state does)."""
    ref = Run(tmp_path, "ref", world, job="ref", resume=False, **{"async": True}).results()
    assert all(r["iteration"] == 3 for r in ref)  # saves at 5, 10, 15
    assert ref[0]["epoch"] == (1 if world == 1 else 3)
    for job, is_async, api in (("blocking", False, "functions" if world == 1 else "manager"),
                               ("async", True, "manager" if world == 1 else "functions")):
        got = _killed_and_resumed(tmp_path, world, job, api=api, **{"async": is_async})
        for rank, (a, b) in enumerate(zip(ref, got)):
            assert sorted(map(int, b["trace"])) == list(range(11, 17)), (job, rank)
            for step, seen in b["trace"].items():
                assert seen == a["trace"][step], f"{job} rank {rank}: step {step} differs"
            diff = [k for k in COMPARED if a[k] != b[k]]
            assert not diff, f"{job} rank {rank}: {diff} differ from the uninterrupted run"
        with tsck.open_store(tmp_path / "store") as store:
            # total_limit=2 after the resume: the counter went on from 2 (3 saves), and the
            # job's newest two snapshots are what the store keeps
            assert [s.step for s in store.log(f"{job}/main")] == [15, 10]
            newest = store.checkout(f"{job}/main", paths=["objects.accelerator.iteration"])
            assert newest["objects"]["accelerator"]["iteration"] == 3


@pytest.fixture
def accelerator():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield Accelerator(cpu=True)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize("kind", ["FSDP", "DEEPSPEED"])
def test_sharded_training_is_refused(accelerator, tmp_path, kind):
    """An Accelerator whose state says FSDP or DeepSpeed (what `accelerate launch
    --use_fsdp` / `--use_deepspeed` sets on accelerator devices; on CPU accelerate trains
    DDP, so the test sets the real state's distributed_type) is refused by every entry
    point with InvalidArgument naming it, before anything is stored."""
    import torch
    from accelerate.utils import DistributedType

    from tensorstore_ck import accelerate as tsck_accelerate
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    accelerator.state.distributed_type = getattr(DistributedType, kind)
    with tsck.open_store(tmp_path / "s") as store:
        for call in (lambda: tsck_accelerate.checkpoint_manager(accelerator, store, "j"),
                     lambda: tsck_accelerate.save_state(accelerator, store, "j"),
                     lambda: tsck_accelerate.load_state(accelerator, store, "j")):
            with pytest.raises(tsck.InvalidArgument, match=kind if kind == "FSDP" else "DEEPSPEED") as e:
                call()
            assert "does not snapshot" in str(e.value)
        assert store.refs() == {}
    assert model is not None


def test_save_and_load_state_in_process(accelerator, tmp_path):
    """save_state/load_state in one process without a loop: the step defaults to the
    checkpoint counter (as save_state names checkpoint_<iteration>), load_state puts back
    the model and the counter, and a snapshot with other prepared objects is refused."""
    import torch

    from tensorstore_ck import accelerate as tsck_accelerate
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with tsck.open_store(tmp_path / "s") as store:
        assert tsck_accelerate.load_state(accelerator, store, "j") is None
        assert tsck_accelerate.save_state(accelerator, store, "j").step == 0
        assert tsck_accelerate.save_state(accelerator, store, "j").step == 1
        assert accelerator.project_configuration.iteration == 2
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1)
        accelerator.project_configuration.iteration = 0
        assert tsck_accelerate.load_state(accelerator, store, "j") == 1
        assert accelerator.project_configuration.iteration == 2
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        accelerator.prepare(torch.nn.Linear(2, 2))  # a second model the snapshot does not hold
        with pytest.raises(tsck.InvalidArgument, match="1 models, the accelerator 2"):
            tsck_accelerate.load_state(accelerator, store, "j")


@pytest.mark.slow
def test_a_dataloader_without_a_generator_cannot_resume_exactly(tmp_path):
    """What docs/guide/accelerate.md tells users to set, shown needed: without a generator
    on the DataLoader, starting the resumed epoch's iterator draws its base seed from the
    global torch RNG, which the uninterrupted run drew at the epoch's start, before the
    snapshot: from step 11 on the RNG streams (dropout) differ, with everything the store
    holds restored."""
    kw = {"generator": False, "async": False, "api": "manager"}
    ref = Run(tmp_path, "ref", 1, job="ref", resume=False, **kw).results()[0]
    got = _killed_and_resumed(tmp_path, 1, "nogen", **kw)[0]
    assert got["epoch"] == ref["epoch"] and got["iteration"] == ref["iteration"]
    assert got["rng"] != ref["rng"] and got["trace"]["11"][1] != ref["trace"]["11"][1]
