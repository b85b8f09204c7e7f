"""Bit-identical resume of a real training run after kill -9.

Each case runs tests/helpers/train_run.py (MLP with dropout, AdamW, warmup+cosine
LambdaLR, tsck.ResumableDataLoader(shuffle=True) over a dataset drawing noise from
numpy's global RNG, python random and torch's RNG, a registered numpy Generator
used in the loop, CheckpointManager(every_steps=K)) three times in subprocesses:

1. reference: N steps uninterrupted;
2. victim: the same run, SIGKILLed at a step between two snapshots, in the
   middle of an epoch (13 batches per epoch, K=5, so epochs and snapshots do not
   line up);
3. resumed: restore_latest() from the victim's store, then on to N.

Every loss the resumed run logs must equal the reference's bit for bit (repr of
a python float round-trips exactly), and the final model, optimizer, scheduler,
data-loader position and RNG states must be identical (torch.equal per tensor).

The victim is told to stop (sleep) after step S (--hold-at) so the kill lands
at a known step however loaded the machine is; the kill itself is a real
SIGKILL of the training process (its DataLoader workers are killed after it, as
cleanup: they would otherwise linger until their parent-death watchdog fires).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import _zygote as zygote
from _util import assert_same, child_env

import tensorstore_ck as tsck

HERE = Path(__file__).resolve().parents[1]
REPO = HERE.parent
HELPER = HERE / "helpers" / "train_run.py"
N = 40          # steps
K = 5           # every_steps
EPOCH = 13      # batches per epoch (97 items, batch 8): not a multiple of K
JOB = "train"
REF = f"{JOB}/main"
TIMEOUT = 120

pytestmark = pytest.mark.slow


class Run:
    """A train_run.py subprocess whose stdout lines are collected by a thread."""

    def __init__(self, store: Path, tmp: Path, name: str, *args: str):
        self.errpath = tmp / f"{name}.stderr"
        self._err = open(self.errpath, "wb")
        self.proc = zygote.Popen([sys.executable, str(HELPER), str(store), "--job", JOB, *args],
                                 stdout=subprocess.PIPE, stderr=self._err, cwd=REPO, env=child_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")))
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self):
        for raw in self.proc.stdout:
            if raw.endswith(b"\n"):
                self._q.put(raw.decode().strip())
        self._q.put(None)

    def wait_line(self, pred, timeout=TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out waiting for a line; got {self.lines[-5:]}\n{self.stderr()}")
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"process ended (rc={self.proc.wait()}) before the expected line; "
                                     f"last lines {self.lines[-5:]}\n{self.stderr()}")
            self.lines.append(line)
            if pred(line):
                return line

    def finish(self, timeout=TIMEOUT) -> list[str]:
        self.wait_line(lambda l: l == "final", timeout)
        rc = self.proc.wait(timeout=timeout)
        self._t.join(timeout=10)
        self._err.close()
        assert rc == 0, self.stderr()
        return self.lines

    def _children(self) -> list[int]:
        out = []
        try:
            for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
                with open(f"/proc/{self.proc.pid}/task/{tid}/children") as f:
                    out += [int(p) for p in f.read().split()]
        except OSError:
            pass
        return out

    def sigkill(self) -> int:
        kids = self._children()
        os.kill(self.proc.pid, signal.SIGKILL)
        rc = self.proc.wait(timeout=30)
        for pid in kids:  # DataLoader workers of the dead process (cleanup only)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._t.join(timeout=30)
        self._err.close()
        return rc

    def cleanup(self):
        if self.proc.poll() is None:
            self.sigkill()

    def stderr(self) -> str:
        try:
            return self.errpath.read_text(errors="replace")[-3000:]
        except OSError:
            return ""


@pytest.fixture
def runs():
    live: list[Run] = []
    yield live
    for r in live:
        r.cleanup()


def losses(lines) -> dict[int, str]:
    out = {}
    for line in lines:
        w = line.split()
        if w and w[0] == "step":
            n = int(w[1])
            assert n not in out, f"step {n} logged twice"
            out[n] = w[2]
    return out


def load_final(p: Path) -> dict:
    return torch.load(p, weights_only=False)


def count_tensors(x) -> int:
    if isinstance(x, torch.Tensor):
        return 1
    if isinstance(x, dict):
        return sum(count_tensors(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return sum(count_tensors(v) for v in x)
    return 0


_REFERENCE: dict[int, tuple[dict, Path]] = {}


def reference(workers: int, tmp_path_factory) -> tuple[dict, Path]:
    """Losses and final-state file of an uninterrupted run (one per worker count per session)."""
    if workers not in _REFERENCE:
        d = tmp_path_factory.mktemp(f"ref{workers}")
        r = Run(d / "store", d, "ref", "--steps", str(N), "--every", str(K), "--workers", str(workers),
                "--async", "--out", str(d / "final.pt"))
        try:
            lines = r.finish()
        finally:
            r.cleanup()
        ls = losses(lines)
        assert sorted(ls) == list(range(1, N + 1))
        _REFERENCE[workers] = (ls, d / "final.pt")
    return _REFERENCE[workers]


def check_resume(tmp_path, tmp_path_factory, runs, *, workers: int, async_: bool, kill_at: int,
                 expect_resume: int, slow: bool):
    ref_losses, ref_final = reference(workers, tmp_path_factory)
    store = tmp_path / "store"
    common = ["--steps", str(N), "--every", str(K), "--workers", str(workers)] + (["--async"] if async_ else [])

    # 2. the victim: killed at kill_at
    extra = ["--hold-at", str(kill_at)]
    extra += ["--slow-from", str(kill_at), "--delay", "2.0"] if slow else ["--settle"]
    victim = Run(store, tmp_path, "victim", *common, *extra)
    runs.append(victim)
    victim.wait_line(lambda l: l == f"hold {kill_at}")
    rc = victim.sigkill()
    assert rc == -signal.SIGKILL
    v_losses = losses(victim.lines)
    assert sorted(v_losses) == list(range(1, kill_at + 1))
    assert all(v_losses[n] == ref_losses[n] for n in v_losses), "runs are not deterministic before the kill"
    if slow:
        assert f"snap {kill_at} inflight" in victim.lines, victim.lines[-4:]

    # what survived the kill: the newest COMMITTED snapshot
    with tsck.open_store(store) as s:
        log = s.log(REF)
        steps = [e.step for e in log]
        assert steps[0] == expect_resume, f"newest committed snapshot is step {steps[0]}, log {steps}"
        assert steps == list(range(expect_resume, 0, -K)), steps
        assert kill_at not in steps
        sd = s.checkout(REF)
        assert sd["step"] == expect_resume
        dl = sd["dataloader"]
        assert 0 < dl["batches_consumed"] < EPOCH, f"snapshot not mid-epoch: {dl}"
        assert (dl["epoch"], dl["batches_consumed"]) == divmod(expect_resume, EPOCH), dl
        assert s.fsck(full=False).ok

    # 3. resume to the end
    resumed = Run(store, tmp_path, "resumed", *common, "--resume", "--out", str(tmp_path / "final.pt"))
    runs.append(resumed)
    lines = resumed.finish()
    assert f"resumed {expect_resume}" in lines, lines[:3]
    r_losses = losses(lines)
    assert sorted(r_losses) == list(range(expect_resume + 1, N + 1))
    diffs = [(n, ref_losses[n], r_losses[n]) for n in r_losses if r_losses[n] != ref_losses[n]]
    assert not diffs, f"losses after resume differ from the reference (step, ref, resumed): {diffs[:5]}"

    want, got = load_final(ref_final), load_final(tmp_path / "final.pt")
    assert count_tensors(want["model"]) == 6 and count_tensors(want["optimizer"]) >= 12
    assert want["loader"] == {"epoch": (N - 1) // EPOCH, "batches_consumed": N - EPOCH * ((N - 1) // EPOCH),
                              "seed": 11, "batch_size": 8, "shuffle": True}
    assert_same(want, got)


@pytest.mark.parametrize("workers,async_,kill_at", [(0, False, 23), (2, True, 33)],
                         ids=["workers0-sync", "workers2-async"])
def test_kill9_between_snapshots_resumes_bit_identical(tmp_path, tmp_path_factory, runs, workers, async_, kill_at):
    assert kill_at % K != 0 and kill_at // EPOCH == (kill_at // K * K) // EPOCH  # mid-epoch, between snapshots
    check_resume(tmp_path, tmp_path_factory, runs, workers=workers, async_=async_, kill_at=kill_at,
                 expect_resume=kill_at // K * K, slow=False)


@pytest.mark.parametrize("workers", [0, 2])
def test_kill9_with_async_snapshot_in_flight_resumes_from_last_committed(tmp_path, tmp_path_factory, runs,
                                                                         workers):
    # Snapshot 35 is triggered on a store slowed down from step 35 on and the process is
    # killed right after step 35: 35 never commits, the resume starts from 30.
    check_resume(tmp_path, tmp_path_factory, runs, workers=workers, async_=True, kill_at=35,
                 expect_resume=30, slow=True)
