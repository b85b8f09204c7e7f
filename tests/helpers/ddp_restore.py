"""CheckpointManager under torch.distributed, where one rank differs: its part of a snapshot
damaged, its state_dict() failing, a rollback, for tests/train/test_dist_restore.py.

    python ddp_restore.py SCENARIO OUTDIR [ARG]

SCENARIO is one of:
  train STORE      steps 1-6 of the README's loop (every_steps=2), each rank with a part of
                   its own (`part`: values only that rank holds, so only it reads its blocks)
  restore STORE    new processes: restore_latest(), then what each rank got (step or error)
  stagefail        rank 1's data loader cannot report its position at step 10 (once);
                   asynchronous snapshots every 5 steps, put timeout left at its default
  rollback STORE   steps 1-30 (every_steps=10), restore(10), then the processes end with
                   no further snapshot (a crash); new processes restore_latest() and train
                   on to 20
  farback          snapshots at every step from 20 to 100, in an order the ranks are made
                   to take (rank 1 enters the put of step 30 first, rank 0 every other),
                   then restore(20) and snapshots at 21-29
The ranks are forked by dist_worker.launch (the c10d TCPStore hosted by the launcher).
Each rank writes OUTDIR/<phase>_rank<r>.json; the test judges.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import dist_worker as dw  # noqa: E402
from dist_worker import launcher_main  # noqa: E402

JOB = "llm"
REF = f"{JOB}/main"
PART = 16384  # floats: one block of 64 KiB (above the inline threshold), written and read by its rank alone


def part_values(rank: int, step: int) -> torch.Tensor:
    """Rank `rank`'s own part after training step `step` (the test computes its block's address)."""
    g = torch.Generator()
    g.manual_seed(7919 * (rank + 1) + step)
    return torch.rand(PART, generator=g)


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train(model, opt, part, rank: int, step: int) -> None:
    g = torch.Generator()
    g.manual_seed(100 * rank + step)
    opt.zero_grad()
    model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    opt.step()
    part.copy_(part_values(rank, step))


def side_store(seconds: float):
    """A client of its own of the job's c10d Store (the keys the collectives use): a wait
    on the training thread must not hold the client the store's background publisher
    talks through."""
    import datetime
    import torch.distributed as dist
    kv = dist.distributed_c10d._get_default_store().clone()
    kv.set_timeout(datetime.timedelta(seconds=seconds))
    return kv


def _root(res):
    if res is None:
        return None
    if hasattr(res, "add_done_callback"):
        res.exception()
        return None if res.failure() is not None else res.result().root
    return res.root


def _model_and_opt_and_part():
    model, opt = _model_and_opt()
    return model, opt, torch.zeros(PART)


def _manager(store, model, opt, part, every: int = 2):
    """The job's manager: a snapshot every EVERY steps of the model, its optimizer and
    this rank's part."""
    import tensorstore_ck as tsck
    return tsck.CheckpointManager(store, job=JOB, state=tsck.TrainState(model=model, optimizer=opt, part=part),
                                  every_steps=every)


def train_case(rank, world, out, res, store_dir):
    import tensorstore_ck as tsck
    model, opt, part = _model_and_opt_and_part()
    with tsck.open_store(store_dir) as store:
        mgr = _manager(store, model, opt, part)
        steps = {}
        for step in range(1, 7):
            _train(model, opt, part, rank, step)
            steps[step] = mgr.step(step)
            if step % 2 == 0:
                torch.save(model.state_dict(), os.path.join(out, f"model_rank{rank}_step{step}.pt"))
        mgr.close()
        res["steps"] = {s: _root(r) for s, r in steps.items()}


def restore_case(rank, world, out, res, store_dir):
    import tensorstore_ck as tsck
    model, opt, part = _model_and_opt_and_part()
    with tsck.open_store(store_dir) as store:
        mgr = _manager(store, model, opt, part)
        try:
            res["restored"] = mgr.restore_latest()
            res["part_ok"] = bool(torch.equal(part, part_values(rank, res["restored"])))
            torch.save(model.state_dict(), os.path.join(out, f"restored_rank{rank}.pt"))
        except tsck.TsckError as e:
            res["error"] = [type(e).__name__, str(e)]
        mgr.close()


HEAR_WITHIN = 60.0  # seconds: far above an abort's time, far below the put's 300 s deadline


class Loader:
    """A data loader's position, which rank 1 cannot read once, at step `fail_at`."""

    def __init__(self, rank: int, fail_at: int):
        self.rank, self.fail_at, self.pos = rank, fail_at, 0

    def state_dict(self):
        if self.rank == 1 and self.pos == self.fail_at:
            raise RuntimeError(f"rank 1's loader cannot report its position at step {self.pos}")
        return {"pos": self.pos}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


def stagefail_case(rank, world, out, res, _arg):
    """Rank 1 waits after its failed step 10 until rank 0's future of step 10 has ended (or
    HEAR_WITHIN passed): only an abort that rank 1's failed staging sends can end it, since
    rank 1 makes no later put meanwhile (which would end it as OutOfStep)."""
    from concurrent import futures
    import tensorstore_ck as tsck
    kv = side_store(3 * HEAR_WITHIN)
    model, opt = _model_and_opt()
    part = torch.zeros(PART)
    loader = Loader(rank, 10)
    with tsck.open_store(os.path.join(out, "store")) as store:
        mgr = tsck.CheckpointManager(store, job=JOB, every_steps=5,
                                     state=tsck.TrainState(model=model, optimizer=opt, dataloader=loader, part=part))
        steps, took = {}, {}
        t_start = time.monotonic()
        for step in range(1, 21):
            _train(model, opt, part, rank, step)
            loader.pos = step
            t0 = time.monotonic()
            steps[step] = mgr.step(step)
            took[step] = time.monotonic() - t0
            if step == 10:  # rank 1 goes on only once rank 0 heard how its snapshot of step 10 ended
                if rank == 0:
                    done, _ = futures.wait([steps[10]], timeout=HEAR_WITHIN)
                    res["heard"], res["heard_in"] = bool(done), time.monotonic() - t0
                    kv.set("test/heard", b"1")
                else:
                    kv.wait(["test/heard"])
        t0 = time.monotonic()
        try:
            mgr.close()
            res["closed"] = "ok"
        except tsck.SnapshotsFailed as e:
            res["closed"] = f"SnapshotsFailed: {e}"
        took["close"] = time.monotonic() - t0
        res["total"] = time.monotonic() - t_start
        res["took"] = took
        res["steps"] = {s: _root(r) for s, r in steps.items()}
        res["failed"] = mgr.failed_snapshots
        res["errors"] = [f"{type(e).__name__}: {e}" for e in mgr.snapshot_errors]


def rollback_case(rank, world, out, res, arg):
    import warnings
    import tensorstore_ck as tsck
    store_dir, phase = arg
    model, opt, part = _model_and_opt_and_part()
    with tsck.open_store(store_dir) as store:
        mgr = _manager(store, model, opt, part, every=10)
        if phase == "first":
            for step in range(1, 31):
                _train(model, opt, part, rank, step)
                mgr.step(step)
            mgr.wait()
            res["restored"] = mgr.restore(10)
            res["part_ok"] = bool(torch.equal(part, part_values(rank, 10)))
            # a crash before the new run's first snapshot: the process ends here
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            start = res["restored"] = mgr.restore_latest()
            res["part_ok"] = bool(torch.equal(part, part_values(rank, start)))
            steps = {}
            for step in range(start + 1, 21):
                _train(model, opt, part, rank, step)
                steps[step] = mgr.step(step)
            mgr.close()
        res["steps"] = {s: _root(r) for s, r in steps.items()}
        res["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
        res["failed"] = mgr.failed_snapshots


class Gate:
    """Holds this rank's next put back until the other rank is in it (its hello is in the
    c10d Store): which rank enters each put first is then the test's choice, not chance.
    Rank 1 enters the put of step `first1` first, rank 0 every other one."""

    def __init__(self, rank: int, first1: int):
        from tensorstore_ck.collective.naming import _short
        self.rank, self.first1, self.step = rank, first1, None
        self.kv = side_store(120.0)
        self.ref = _short(REF)
        self.made: dict = {}  # step -> puts of it named so far (the call's name counts them)

    def state_dict(self):
        step = self.step
        k = self.made[step] = self.made.get(step, 0) + 1
        waits_for = 1 if step == self.first1 else 0
        if self.rank != waits_for:
            # The other rank is in the put once it posted its hello there, or once the call
            # ended before that (it could not enter it: OutOfStep claims "decided").
            pfx = f"tsck/world/put/{self.ref}.{step}.{k}/"
            deadline = time.monotonic() + 120.0
            while not (self.kv.check([pfx + f"hello/{waits_for}"]) or self.kv.check([pfx + "decided"])):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {waits_for} never entered the put of step {step}")
                time.sleep(0.005)
        return {}

    def load_state_dict(self, sd):
        pass


def farback_case(rank, world, out, res, _arg):
    import tensorstore_ck as tsck
    model, opt = _model_and_opt()
    part = torch.zeros(PART)
    gate = Gate(rank, 30)
    with tsck.open_store(os.path.join(out, "store")) as store:
        mgr = tsck.CheckpointManager(store, job=JOB, every_steps=1, timeout=60,
                                     state=tsck.TrainState(model=model, optimizer=opt, gate=gate, part=part))
        for step in range(20, 101):
            _train(model, opt, part, rank, step)
            gate.step = step
            mgr.step(step)
        mgr.wait()
        res["first_failed"] = mgr.failed_snapshots
        # The last put a rank entered before rank 0 (the group's `latest` record): step 30's,
        # 70 puts ago, above every step the rollback below takes again.
        import msgpack
        res["latest"] = msgpack.unpackb(gate.kv.get("tsck/world/latest"))[1:]
        res["restored"] = mgr.restore(20)
        steps = {}
        t0 = time.monotonic()
        for step in range(21, 30):
            _train(model, opt, part, rank, step)
            gate.step = step
            steps[step] = mgr.step(step)
        try:
            mgr.close()
        except tsck.SnapshotsFailed:
            pass  # (the test reads the failures below)
        res["took"] = time.monotonic() - t0
        res["steps"] = {s: _root(r) for s, r in steps.items()}
        res["failed"] = mgr.failed_snapshots
        res["errors"] = [f"{type(e).__name__}: {e}" for e in mgr.snapshot_errors]


def scenarios(scenario: str, out: str, argv: list) -> list | None:
    """SCENARIO -> the launch infos of its runs (tests/_util.launcher_main runs this)."""
    arg = argv[3] if len(argv) > 3 else None
    if scenario == "train":
        return [dw.launch("train", 2, train_case, out, arg, limit=240.0)]
    if scenario == "restore":
        return [dw.launch("restore", 2, restore_case, out, arg, limit=240.0)]
    if scenario == "stagefail":
        return [dw.launch("stagefail", 2, stagefail_case, out, None, limit=240.0)]
    if scenario == "rollback":
        return [dw.launch("first", 2, rollback_case, out, (arg, "first"), limit=240.0),
                dw.launch("second", 2, rollback_case, out, (arg, "second"), limit=240.0)]
    if scenario == "farback":
        return [dw.launch("farback", 2, farback_case, out, None, limit=400.0)]
    return None


if __name__ == "__main__":
    launcher_main(scenarios)
