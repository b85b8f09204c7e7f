"""Preemption under real torchrun (`python -m torch.distributed.run --standalone`, 2 to 4
gloo ranks on CPU) running tests/helpers/preempt_torchrun.py, a DDP loop with a
CheckpointManager, and tests/helpers/preempt_frameworks.py, the HF Trainer's and
Lightning's DDP runs with their preemption callbacks. The test sends real signals, as the
platforms do: SIGTERM to every worker at once (Kubernetes), to one worker, to the torchrun
agent; a second SIGTERM during the final save; SIGKILL while it is half written (the end of
the grace); with a local tier whose S3 remote is cut off, the final snapshot kept in the
tier and uploaded by the next start; with S3 slowed down, a grace too short for the final
snapshot. It waits for the files the workers write and for process exits only.

What torchrun reports: each preempted worker exits 143 (128 + SIGTERM); the agent, seeing a
worker fail, takes the others down and exits 1 (ChildFailedError), or, when it got the
SIGTERM itself, forwards it to its workers, waits for them (up to 30 s, then SIGKILL) and
exits 1 too (its SignalException). docs/guide/torchrun.md says how to requeue on each."""

from __future__ import annotations

import json
import os
import random
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
from tests.sim.netproxy import Chaos

pytestmark = pytest.mark.slow  # torchrun's agent and its ranks, twice per test

SCRIPT = REPO / "tests" / "helpers" / "preempt_torchrun.py"
FRAMEWORKS = REPO / "tests" / "helpers" / "preempt_frameworks.py"  # the HF Trainer's and Lightning's runs
DEADLINE = float(os.environ.get("DBG_DEADLINE", 240))  # for each wait: generous, the machine is shared
REF = "run/main"


class Run:
    """One torchrun of the helper: start(), then wait for its workers' files and exit."""

    def __init__(self, out: Path, phase: str, world: int, script: Path = SCRIPT, **cfg):
        self.out, self.phase, self.world = out, phase, world
        out.mkdir(exist_ok=True)
        conf = out / f"{phase}.json"
        conf.write_text(json.dumps({"phase": phase, **cfg}))
        env = child_env(TORCH_CPP_LOG_LEVEL="ERROR", **{zygote.SUBPROCESS: "1"})  # the agent's ranks: forks too
        for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)
        self.err = open(out / f"{phase}_agent.err", "w")
        self.agent = zygote.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                   f"--nproc-per-node={world}", str(script), str(out), str(conf)],
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

    def sigterm(self, ranks=None) -> None:
        """SIGTERM to the workers of `ranks` (every one by default); once each has run its
        handler, go."""
        ranks = list(range(self.world) if ranks is None else ranks)
        pids = self.pids()
        for r in ranks:
            _kill(pids[r], signal.SIGTERM)
        self.until(f"the handlers of ranks {ranks} ran", lambda: all(self.heard(r) for r in ranks))
        self.go()

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
    first.sigterm()
    assert first.wait() == 1, first.log()
    _preempted(first, 4)
    assert "exitcode  : 143" in first.log() or "exitcode: 143" in first.log(), first.log()
    assert _same(torch.load(first.file(1, "step4.pt")), torch.load(first.file(0, "step4.pt"))) is None
    with tsck.open_store(out / "store", create=False) as s:
        assert [i.step for i in s.log(REF)] == [4] and s.log(REF)[0].meta["triggers"] == ["preempted"]
    _resume(runs, out, 3, first, 4)


def test_sigterm_to_one_worker_saves_the_same_step_on_every_rank_and_resumes_on_as_many(tmp_path, runs):
    """SIGTERM to rank 1 of 3 only: the per-step agreement makes it every rank's, at the
    same step; every rank exits 143 (the ranks that got no signal say SIGTERM too); the
    job resumes on 3 ranks, bit for bit."""
    out = tmp_path / "run"
    first = runs(out, "first", 3, hold=3, end=50)
    first.until_all("ready")
    first.sigterm([1])
    assert first.wait() == 1, first.log()
    _preempted(first, 4)
    # Only rank 1 had heard a signal when step() raised (the others may hear the agent's
    # SIGTERM later, as it takes down the workers still alive once one has exited).
    assert [e["seconds"] is not None for e in first.ends()] == [False, True, False]
    _resume(runs, out, 3, first, 4)


def test_sigterm_to_the_torchrun_agent_reaches_every_worker_which_saves_and_exits_143(tmp_path, runs):
    """SIGTERM to the agent (what a scheduler that signals only the main process sends):
    torchrun forwards it to every worker (and SIGKILLs those alive 30 s later); each
    saves the step and exits 143; the agent exits 1. Measured here: the seconds from the
    agent's signal to its exit, well inside the default grace (20 s) on this machine."""
    out = tmp_path / "run"
    first = runs(out, "first", 2, hold=3, end=50)
    first.until_all("ready")
    t0 = time.monotonic()
    first.agent.send_signal(signal.SIGTERM)
    first.until("every rank heard the forwarded signal", lambda: all(first.heard(r) for r in range(2)))
    first.go()
    assert first.wait() == 1, first.log()
    took = time.monotonic() - t0
    _preempted(first, 4)
    assert "Received Signals.SIGTERM death signal" in first.log() or "SIGTERM" in first.log(), first.log()
    print(f"agent SIGTERM -> agent exit: {took:.2f} s")
    with tsck.open_store(out / "store", create=False) as s:
        assert [i.step for i in s.log(REF)] == [4]


def test_a_second_sigterm_during_the_final_save_changes_nothing(tmp_path, runs):
    """The platform repeats its notice while the final snapshot is being written (rank 0's
    first write held until the second SIGTERM was heard): the program's own handler hears
    both, the save goes on to the end (no second save, no hang, no early exit), every rank
    exits 143 with the snapshot durable and whole."""
    out = tmp_path / "run"
    first = runs(out, "first", 2, hold=3, end=50, hold_save=True)
    first.until_all("ready")
    pids = first.pids()
    first.sigterm()
    first.until_all("saving", ranks=[0])
    for pid in pids:
        _kill(pid, signal.SIGTERM)
    first.until("rank 0 heard the second signal", lambda: first.heard(0) == 2)
    first.go("release")
    assert first.wait() == 1, first.log()
    _preempted(first, 4)
    with tsck.open_store(out / "store", create=False) as s:
        assert [i.step for i in s.log(REF)] == [4]
        assert s.fsck().ok
        _same(s.checkout(REF)["model"], torch.load(first.file(0, "step4.pt"))["model"])


def test_sigkill_while_the_final_snapshot_is_half_written_leaves_the_store_whole(tmp_path, runs):
    """The grace runs out while the final snapshot is being written (rank 0's first write
    held): the kubelet SIGKILLs every process. The store is whole (fsck clean: the
    half-written snapshot's objects are orphans at most), its ref still at the interval
    snapshot of step 2, and the job resumes there, bit for bit."""
    out = tmp_path / "run"
    first = runs(out, "first", 2, hold=3, end=50, every=2, hold_save=True)
    first.until_all("ready")
    pids = first.pids()
    first.sigterm()
    first.until_all("saving", ranks=[0])
    for pid in pids:
        _kill(pid, signal.SIGKILL)
    first.agent.send_signal(signal.SIGKILL)
    assert first.wait() == -signal.SIGKILL
    assert not any(first.file(r, "end.json").exists() for r in range(2))
    with tsck.open_store(out / "store", create=False) as s:
        assert s.fsck().ok
        assert [i.step for i in s.log(REF)] == [2]
    _resume(runs, out, 2, first, 2)


def _sigterm_with_the_network_cut(first: Run, proxy) -> float:
    """Once every rank is ready: the network to S3 black-holed, SIGTERM to every worker, and
    (every handler having run) go -> seconds from go to torchrun's exit (status 1)."""
    first.until_all("ready")
    proxy.blackout()
    first.sigterm()
    t0 = time.monotonic()
    assert first.wait() == 1, first.log()
    return time.monotonic() - t0


def test_with_the_remote_down_the_final_snapshot_lands_in_the_tier_and_the_next_start_uploads_it(
        tmp_path, runs, s3_url, s3_proxy, s3_server):
    """Each rank has a local tier in front of S3; the network to S3 is cut before the notice.
    The final snapshot is in the tiers within the grace (5 s), Preempted says not durable,
    every worker exits 143. With S3 back, the next start resumes from the tiers at that
    step and uploads it: the remote's ref then holds step 4."""
    proxy, opts = s3_proxy
    out = tmp_path / "run"
    store = {"url": s3_url, "refs": str(tmp_path / "refs.lmdb"), "opts": opts, "tier": str(tmp_path / "tiers")}
    first = runs(out, "first", 2, hold=3, end=50, every=2, grace=5, store=store)
    took = _sigterm_with_the_network_cut(first, proxy)
    print(f"go -> torchrun exit, remote down: {took:.2f} s")
    # The store's close (its `with` block) waits for uploads no longer than the grace: the
    # workers end with 143 before a platform's SIGKILL (without that bound: ~40 s here).
    assert took < 5 + 10, first.log()
    _preempted(first, 4, durable=False)
    for e in first.ends():
        assert e["committed"] < 5 and "local tier" in e["text"], e  # in the tier within the grace
        assert e["seconds"] < 5 + 2, e  # and step() raised when the grace was over (the upload waited for)
    with tsck.open_store(s3_url, refs=store["refs"], storage_options=s3_server, create=False) as s:
        assert [i.step for i in s.log(REF)] == [2]  # the remote: only what was uploaded before the cut
    proxy.restore()
    _resume(runs, out, 2, first, 4, store=store)
    with tsck.open_store(s3_url, refs=store["refs"], storage_options=s3_server, create=False) as s:
        assert max(i.step for i in s.log(REF)) >= 4
        assert s.fsck().ok


def test_four_ranks_sigterm_to_one_then_to_every_worker_and_resume_on_two(tmp_path, runs):
    """4 ranks. SIGTERM to rank 2 alone at step 4: every rank saves step 4 and exits 143.
    4 new ranks resume there bit for bit; SIGTERM to every worker at once at step 7: every
    rank saves step 7 and exits 143. The job then resumes on 2 ranks at step 7, bit for bit."""
    out = tmp_path / "run"
    first = runs(out, "first", 4, hold=3, end=50)
    first.until_all("ready")
    first.sigterm([2])
    assert first.wait() == 1, first.log()
    _preempted(first, 4)
    (out / "go").unlink()  # (the next run's hold waits for a go of its own)
    second = runs(out, "second", 4, hold=6, end=50)
    second.until_all("ready")
    want = torch.load(first.file(0, "step4.pt"))
    for rank in range(4):
        assert json.loads(second.file(rank, "start.json").read_text())["start"] == 4
        _same(torch.load(second.file(rank, "restored.pt")), want)
    second.sigterm()
    assert second.wait() == 1, second.log()
    _preempted(second, 7)
    with tsck.open_store(out / "store", create=False) as s:
        assert [(i.step, i.meta["world"]) for i in s.log(REF)] == [(7, 4), (4, 4)]
    _resume(runs, out, 2, second, 7)


class _Slowest(random.Random):
    """Chaos's draws, every one the slowest: each request it delays waits delay_s exactly."""

    def uniform(self, a, b):
        return b


def test_a_grace_too_short_for_the_final_collective_snapshot_publishes_nothing_and_says_so(
        tmp_path, runs, s3_url, s3_proxy, s3_server):
    """The final snapshot cannot be written within the grace (1 s): from the notice on, the
    network to S3 forwards each request 1.5 s late, so no rank's part of the collective save
    is written when its deadline (the grace) ends. Each rank's Preempted, and its warning,
    say the grace could not hold the snapshot and that nothing of it was published; every
    worker exits 143. The store is whole: fsck is clean and the ref still gives the interval
    snapshot of step 2, bit for bit; the job resumes there, bit for bit."""
    proxy, opts = s3_proxy
    out = tmp_path / "run"
    store = {"url": s3_url, "refs": str(tmp_path / "refs.lmdb"), "opts": opts}
    first = runs(out, "first", 2, hold=3, end=50, every=2, grace=1, store=store)
    first.until_all("ready")
    slow = Chaos(0, delay=1.0, delay_s=1.5, drop=0, drop_commit=0, hold_commit=0, blackout=0, dark_after=0)
    slow.rng = _Slowest(0)
    proxy.chaos = slow
    first.sigterm()
    assert first.wait() == 1, first.log()
    assert proxy.delays > 0  # (the final save did reach the slowed network)
    proxy.chaos = None
    said = "the grace (1 s) could not hold the final snapshot of step 4: nothing of it was published"
    for rank, e in enumerate(first.ends()):
        assert (e["step"], e["at"], e["code"], e["durable"]) == (None, 4, 143, False), (rank, e)
        assert said in e["why"] and said in e["text"], (rank, e)
        assert any(w.startswith("SnapshotWarning") and said in w for w in e["warnings"]), (rank, e)
    with tsck.open_store(s3_url, refs=store["refs"], storage_options=s3_server, create=False) as s:
        assert s.fsck().ok
        assert [i.step for i in s.log(REF)] == [2]
        _same(s.checkout(REF)["model"], torch.load(first.file(0, "step2.pt"))["model"])
    _resume(runs, out, 2, first, 2, store=store)


def test_a_final_snapshot_whose_storage_stops_answering_ends_the_workers_soon_after_the_grace(
        tmp_path, runs, s3_url, s3_proxy, s3_server):
    """No local tier, and the network to S3 black-holes every connection from the notice
    on: the final snapshot's writes never return, and no deadline of the store's can end
    a rank inside one. Each worker still ends with 143 PAST_GRACE (5 s) after its grace (2 s),
    before a platform's SIGKILL, saying why; without that the workers sat in their writes
    past 60 s. With the network back the store is whole: fsck is clean, the ref still gives
    the interval snapshot of step 2, and the job resumes there bit for bit."""
    from tensorstore_ck.train.preempt import PAST_GRACE
    proxy, opts = s3_proxy
    out = tmp_path / "run"
    store = {"url": s3_url, "refs": str(tmp_path / "refs.lmdb"), "opts": opts}
    first = runs(out, "first", 2, hold=3, end=50, every=2, grace=2, store=store)
    took = _sigterm_with_the_network_cut(first, proxy)
    print(f"go -> torchrun exit, storage black-holed: {took:.2f} s")
    assert took < 2 + PAST_GRACE + 20, first.log()  # (a platform's notice is 15-120 s; the writes alone hang > 60 s)
    assert first.log().count("exitcode  : 143") == 2, first.log()
    for rank in range(2):
        assert not first.file(rank, "end.json").exists()  # (ended in the write, not by a Preempted raised)
        said = first.file(rank, "log").read_text()
        assert "the final snapshot was still being written" in said, (rank, said)
    proxy.restore()
    with tsck.open_store(s3_url, refs=store["refs"], storage_options=s3_server, create=False) as s:
        assert s.fsck().ok
        assert [i.step for i in s.log(REF)] == [2]
        _same(s.checkout(REF)["model"], torch.load(first.file(0, "step2.pt"))["model"])
    _resume(runs, out, 2, first, 2, store=store)


def _framework_run(runs, out: Path, kind: str) -> None:
    """DDP on 2 ranks, SIGTERM to rank 1 only at step 4's end: every rank saves step 4 and
    exits 143; a new torchrun resumes from the store to step 8, each step's parameters bit
    for bit those of an uninterrupted run (trained next in the same processes, into a store
    of its own)."""
    first = runs(out, "first", 2, FRAMEWORKS, kind=kind, hold=4, end=8)
    first.until_all("ready")
    first.sigterm([1])
    assert first.wait() == 1, first.log()
    assert "exitcode  : 143" in first.log() or "exitcode: 143" in first.log(), first.log()
    ends = first.ends()
    for rank, e in enumerate(ends):
        assert (e["step"], e["code"], e["durable"], e["why"]) == (4, 143, True, ""), (rank, e)
        assert sorted(map(int, e["digests"])) == [1, 2, 3, 4], (rank, e)
    resumed = runs(out, "resume", 2, FRAMEWORKS, kind=kind, end=8, resume=True, reference=True)
    assert resumed.wait() == 0, resumed.log()
    want = resumed.ends()[0]["reference"]
    assert sorted(map(int, want)) == list(range(1, 9))
    for rank in range(2):
        assert resumed.ends()[rank]["reference"] == want, rank  # (DDP: every rank's parameters alike)
        assert ends[rank]["digests"] == {k: want[k] for k in ("1", "2", "3", "4")}, rank
        got = resumed.ends()[rank]["digests"]
        assert got == {str(k): want[str(k)] for k in range(5, 9)}, (rank, got, want)
    return first


def test_hf_trainer_under_ddp_sigterm_to_one_rank_saves_that_step_everywhere_and_resumes_bit_for_bit(tmp_path, runs):
    """hf.TsckCallback on 2 torchrun ranks, SIGTERM to rank 1 only at step 4's end: the
    per-step agreement has every rank's Trainer save step 4 (one collective snapshot, the
    Trainer's own rng_state_{r}.pth of each rank in it), each worker exits 143, torchrun 1.
    resume_from_checkpoint=True on 2 new ranks finds step 4 in the store and steps 5-8 are
    an uninterrupted run's bit for bit (dropout draws from each rank's own stream)."""
    pytest.importorskip("transformers", reason="the hf extra (transformers, accelerate) is not installed")
    out = tmp_path / "run"
    _framework_run(runs, out, "hf")
    with tsck.open_store(out / "store", create=False) as s:
        # (step 8: the Trainer's save at the resumed run's end)
        assert [(i.step, i.meta["world"], i.meta.get("triggers")) for i in s.log("hf/main")] == [
            (8, 2, None), (4, 2, ["preempted"])]
        assert s.fsck().ok


def test_lightning_under_ddp_sigterm_to_one_rank_saves_that_step_everywhere_and_resumes_bit_for_bit(
        tmp_path, runs):
    """TsckPreemption + TsckCheckpointIO in a DDP Trainer on 2 torchrun ranks, SIGTERM to
    rank 1 only at step 4's end (Lightning's own SIGTERM handler there too): every rank
    agrees on step 4, rank 0 saves ck/preempted.ckpt into the store, every worker exits 143.
    fit(ckpt_path=that pointer) on 2 new ranks resumes at step 4; steps 5-8 are an
    uninterrupted run's bit for bit."""
    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install -e '.[lightning]')")
    from tensorstore_ck.lightning import read_pointer
    out = tmp_path / "run"
    _framework_run(runs, out, "lightning")
    assert read_pointer(out / "ck" / "preempted.ckpt")["step"] == 4
    with tsck.open_store(out / "store", create=False) as s:
        assert [i.step for i in s.log("lt/preempted")] == [4]
        assert s.fsck().ok
