"""Preemption under real torchrun (`python -m torch.distributed.run --standalone`, 2 to 3
gloo ranks on CPU) running tests/helpers/preempt_torchrun.py, a DDP loop with a
CheckpointManager. The test sends real signals, as the platforms do: SIGTERM to every
worker at once (Kubernetes), to one worker, to the torchrun agent; a second SIGTERM during
the final save; SIGKILL while it is half written (the end of the grace); and, with a local
tier whose S3 remote is cut off, the final snapshot kept in the tier and uploaded by the
next start. It waits for the files the workers write and for process exits only.

What torchrun reports: each preempted worker exits 143 (128 + SIGTERM); the agent, seeing a
worker fail, takes the others down and exits 1 (ChildFailedError), or, when it got the
SIGTERM itself, forwards it to its workers, waits for them (up to 30 s, then SIGKILL) and
exits 1 too (its SignalException). docs/guide/preemption.md says how to requeue on each."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import _zygote as zygote
import tensorstore_ck as tsck
from _util import REPO, child_env, same_bits

pytestmark = pytest.mark.slow  # torchrun's agent and its ranks, twice per test

SCRIPT = REPO / "tests" / "helpers" / "preempt_torchrun.py"
DEADLINE = float(os.environ.get("DBG_DEADLINE", 240))  # for each wait: generous, the machine is shared
REF = "run/main"


class Run:
    """One torchrun of the helper: start(), then wait for its workers' files and exit."""

    def __init__(self, out: Path, phase: str, world: int, **cfg):
        self.out, self.phase, self.world = out, phase, world
        out.mkdir(exist_ok=True)
        conf = out / f"{phase}.json"
        conf.write_text(json.dumps({"phase": phase, **cfg}))
        env = child_env(TORCH_CPP_LOG_LEVEL="ERROR", **{zygote.SUBPROCESS: "1"})  # the agent's ranks: forks too
        for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        self.err = open(out / f"{phase}_agent.err", "w")
        self.agent = zygote.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc-per-node={world}", str(SCRIPT), str(out), str(conf)],
                                  cwd=REPO, env=env, stdout=self.err, stderr=subprocess.STDOUT)

    def file(self, rank: int, name: str) -> Path:
        return self.out / f"{self.phase}_rank{rank}_{name}"

    def until(self, what: str, cond) -> None:
        deadline = time.monotonic() + DEADLINE
        while not cond():
            if self.agent.poll() is not None and not cond():
                raise AssertionError(f"{self.phase}: torchrun exited {self.agent.returncode} before {what}:\n"
                                     f"{self.log()}")
            assert time.monotonic() < deadline, f"{self.phase}: timed out waiting for {what}:\n{self.log()}"
            time.sleep(0.02)

    def until_all(self, name: str, ranks=None) -> None:
        ranks = range(self.world) if ranks is None else ranks
        self.until(f"{name} of ranks {list(ranks)}", lambda: all(self.file(r, name).exists() for r in ranks))

    def pids(self) -> list[int]:
        self.until_all("start.json")
        return [json.loads(self.file(r, "start.json").read_text())["pid"] for r in range(self.world)]

    def heard(self, rank: int) -> int:
        f = self.file(rank, "heard")
        return len(f.read_text().split()) if f.exists() else 0

    def go(self, name: str = "go") -> None:
        (self.out / name).touch()

    def wait(self) -> int:
        try:
            return self.agent.wait(timeout=DEADLINE)
        except subprocess.TimeoutExpired:
            text = self.log()
            self.kill()
            raise AssertionError(f"{self.phase}: torchrun did not end:\n{text}") from None

    def kill(self) -> None:
        for pid in self._live_pids():
            _kill(pid, signal.SIGKILL)
        if self.agent.poll() is None:
            self.agent.kill()
            self.agent.wait()
        self.err.close()

    def _live_pids(self) -> list[int]:
        return [json.loads(self.file(r, "start.json").read_text())["pid"] for r in range(self.world)
                if self.file(r, "start.json").exists()]

    def ends(self) -> list[dict]:
        return [json.loads(self.file(r, "end.json").read_text()) for r in range(self.world)]

    def log(self) -> str:
        return (self.out / f"{self.phase}_agent.err").read_text()[-6000:]


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


@pytest.fixture
def runs():
    started: list[Run] = []
    yield lambda *a, **kw: started.append(Run(*a, **kw)) or started[-1]
    for r in started:
        r.kill()


def _resume(runs, out: Path, world: int, first: Run, at: int, **cfg) -> Run:
    """A new torchrun on `world` ranks resumes: every rank at step `at`, each holding bit
    for bit what rank 0 of the first run held after that step (DDP: the same on every rank)."""
    r = runs(out, "resume", world, end=at + 2, **cfg)
    assert r.wait() == 0, r.log()
    want = torch.load(first.file(0, f"step{at}.pt"))
    for rank in range(world):
        assert json.loads(r.file(rank, "start.json").read_text())["start"] == at
        got = torch.load(r.file(rank, "restored.pt"))
        _same(got, want)
    return r


def _same(got, want) -> None:
    if isinstance(want, dict):
        assert set(got) == set(want), (set(got), set(want))
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, torch.Tensor):
        assert same_bits(got, want)
    else:
        assert got == want


def _preempted(run: Run, step: int, durable: bool = True) -> None:
    for rank, e in enumerate(run.ends()):
        assert (e["step"], e["at"], e["code"], e["durable"]) == (step, step, 143, durable), (rank, e)


def test_sigterm_to_every_worker_at_once_saves_one_step_and_resumes_on_more_ranks(tmp_path, runs):
    """As Kubernetes stops a pod: SIGTERM to every worker at once. Every rank saves the next
    step (no interval snapshot was due), exits 143; torchrun exits 1. The job resumes
    from that step on 3 ranks (rank 2, beyond the saved world, reads rank 0's tree)."""
    out = tmp_path / "run"
    first = runs(out, "first", 2, hold=3, end=50)
    first.until_all("ready")
    for pid in first.pids():
        _kill(pid, signal.SIGTERM)
    first.until("every rank's handler ran", lambda: all(first.heard(r) for r in range(2)))
    first.go()
    assert first.wait() == 1, first.log()
    _preempted(first, 4)
    assert "exitcode  : 143" in first.log() or "exitcode: 143" in first.log(), first.log()
    assert _same(torch.load(first.file(1, "step4.pt")), torch.load(first.file(0, "step4.pt"))) is None
    with tsck.open_store(out / "store", create=False) as s:
        assert [i.step for i in s.log(REF)] == [4] and s.log(REF)[0].meta["triggers"] == ["preempted"]
    _resume(runs, out, 3, first, 4)
