"""CheckpointManager under torch.distributed: DDP-style training loops on real gloo ranks,
for tests/train/test_dist_manager.py.

    python ddp_manager.py SCENARIO OUTDIR [ARG]

SCENARIO is one of:
  loop ARG      the README's manager code (ARG "async": async_ left at its default; "sync":
                async_=False), every_steps=2, on_metric on each rank's own loss, retention
  prune         a snapshot at every step beside rank 0's prune (async_=False)
  clock         every_seconds with clocks that disagree between ranks
  fail          rank 1's block writes fail during one snapshot
  fenced        another party's gc deletion phase is open while one snapshot starts
  resume        train 9 steps, then new processes restore_latest and train on to 12; also
                an uninterrupted 12-step run in another store (losses to compare)
  preempt ARG   every_steps=100; SIGTERM to rank 1 alone at step 5 (ARG "one"), or to rank 0
                at step 4 and rank 1 at step 6 ("both"); each rank saves what it holds at
                each step (OUTDIR/preempt_rank<r>_step<s>.pt); then new processes restore
The ranks are forked by dist_worker.launch (the c10d TCPStore hosted by the launcher).
Each rank writes OUTDIR/<phase>_rank<r>.json: what step() returned at each step (root or
None), the manager's counters, losses; for resume, OUTDIR/<phase>_rank<r>_step<s>.pt
(the state it snapshotted at step s) and <phase>_rank<r>_restored.pt. The test judges.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


import torch  # noqa: E402

import dist_worker as dw  # noqa: E402
from dist_worker import launcher_main  # noqa: E402

JOB = "llm"
REF = f"{JOB}/main"


def _model_and_opt():
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts them)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt


def _batch(rank: int, step: int):
    g = torch.Generator()
    g.manual_seed(1000 * rank + step)
    x = torch.randn(8, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True) * 0.1


def _train_step(model, opt, rank: int, step: int) -> float:
    x, y = _batch(rank, step)
    x = x + 0.01 * torch.randn_like(x)  # the global RNG too: a resume must restore it per rank
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def _root(res):
    """The root of what step() returned: a SnapshotInfo (blocking), a future (asynchronous:
    waited for here; one that failed was reported by the manager: None), or None."""
    if res is None:
        return None
    if hasattr(res, "add_done_callback"):
        res.exception()  # waits (the manager reports a failure; it is not raised)
        return None if res.failure() is not None else res.result().root
    return res.root


def _roots(steps: dict) -> dict:
    """step -> what step() returned, turned into roots once the manager has closed."""
    return {s: _root(r) for s, r in steps.items()}


def _counters(mgr) -> dict:
    p = mgr._pruner
    return {"failed": mgr.failed_snapshots, "errors": [f"{type(e).__name__}: {e}" for e in mgr.snapshot_errors],
            "prune_runs": None if p is None else p.runs,
            "prune_errors": [f"{type(e).__name__}: {e}" for e in mgr.prune_errors]}


def loop_case(rank, world, out, res, mode):
    """The README's quick start, as each rank of a DDP job runs it (the loss each rank
    passes is its own: ranks see different batches)."""
    import tensorstore_ck as tsck
    model, opt = _model_and_opt()
    torch.manual_seed(100 + rank)
    store = tsck.open_store(os.path.join(out, "store"))
    extra = {} if mode == "async" else {"async_": False}
    mgr = tsck.CheckpointManager(store, job=JOB, state=tsck.TrainState(model=model, optimizer=opt),
                                 every_steps=2, on_metric=("val_loss", "min"),
                                 retention=tsck.Retention(keep_last=2, keep_best=1, metric="val_loss"), **extra,
                                 on_commit=lambda e: res["commits"].append([e.step, e.root, e.seconds]))
    res["commits"] = []  # what the on_commit hook heard, on each rank
    start = mgr.restore_latest() or 0
    res["start"] = start
    res["steps"], res["vals"] = {}, {}
    for step in range(start + 1, 17):
        val = res["vals"][step] = _train_step(model, opt, rank, step)
        res["steps"][step] = mgr.step(step, metrics={"val_loss": val})
    mgr.close()
    res["steps"] = _roots(res["steps"])
    res.update(_counters(mgr))
    store.close()


class _Clock:
    def __init__(self, per_tick: float):
        self.t, self.per_tick = 0.0, per_tick

    def __call__(self):
        return self.t


def clock_case(rank, world, out, res, _arg):
    """every_seconds=10: rank 0's clock moves 1 s per step, rank 1's 100 s (its own clock
    would fire at every step)."""
    import tensorstore_ck as tsck
    model, opt = _model_and_opt()
    clock = _Clock(1.0 if rank == 0 else 100.0)
    with tsck.open_store(os.path.join(out, "store")) as store:
        mgr = _manager(store, model, opt, every_seconds=10, clock=clock)
        res["steps"] = {}
        for step in range(1, 26):
            clock.t += clock.per_tick
            _train_step(model, opt, rank, step)
            res["steps"][step] = mgr.step(step)
        mgr.close()
        res["steps"] = _roots(res["steps"])
        res.update(_counters(mgr))


def prune_case(rank, world, out, res, mode):
    """A snapshot at every step, retention keep_last=2 (mode "sync": async_=False; "async":
    the default): rank 0's prune of one snapshot runs while the next is taken, unless the
    manager keeps them apart."""
    import tensorstore_ck as tsck
    model, opt = _model_and_opt()
    extra = {} if mode == "async" else {"async_": False}
    import logging

    class Fences(logging.Handler):  # the publisher logs each ref move a deletion phase fenced (DEBUG)
        n = 0

        def emit(self, record):
            Fences.n += "deletion phase overlapped" in record.getMessage()

    lg = logging.getLogger("tensorstore_ck.write.publish")
    lg.setLevel(logging.DEBUG)
    lg.addHandler(Fences())
    with tsck.open_store(os.path.join(out, "store")) as store:
        mgr = _manager(store, model, opt, every_steps=1, retention=tsck.Retention(keep_last=2), **extra)
        res["steps"] = {}
        for step in range(1, 25):
            _train_step(model, opt, rank, step)
            res["steps"][step] = mgr.step(step)
        mgr.close()
        res["fenced"] = Fences.n
        res["steps"] = _roots(res["steps"])
        res.update(_counters(mgr))


def _failing_store_class():
    from tensorstore_ck.storage.wrappers import WrappedStore

    class Failing(WrappedStore):
        """When armed, every object write fails (a full or broken disk on this rank)."""

        def __init__(self, inner):
            super().__init__(inner)
            self.armed = False

        def put_if_absent(self, key, bufs):
            if self.armed:
                raise OSError(28, "No space left on device (injected)")
            return self.inner.put_if_absent(key, bufs)

    return Failing


def _manager(store, model, opt, **kw):
    """The job's manager of the model and its optimizer; KW: its triggers and the rest."""
    import tensorstore_ck as tsck
    return tsck.CheckpointManager(store, job=JOB, state=tsck.TrainState(model=model, optimizer=opt), **kw)


def _failing_on_rank_1(rank: int):
    """On rank 1, a storage wrapper that fails the writes while armed: (a dict that will
    hold it as "w", the wrap_storage to open the store with); elsewhere nothing wraps."""
    Failing = _failing_store_class()
    holder: dict = {}
    return holder, (lambda s: holder.setdefault("w", Failing(s))) if rank == 1 else None


def fail_case(rank, world, out, res, _arg):
    """Rank 1 cannot write blocks while step 4 is snapshotted: that snapshot fails on
    every rank; training goes on and step 6 takes one."""
    import tensorstore_ck as tsck
    holder, wrap = _failing_on_rank_1(rank)
    model, opt = _model_and_opt()
    with tsck.open_store(os.path.join(out, "store"), wrap_storage=wrap) as store:
        mgr = _manager(store, model, opt, every_steps=2, retention=tsck.Retention(keep_last=2))
        res["steps"] = {}
        for step in range(1, 11):
            _train_step(model, opt, rank, step)
            if rank == 1:  # (the weights changed since step 2: the snapshot must write blocks)
                store.wait()  # (asynchronous: the snapshot before ended; only step 4's meets the failing disk)
                holder["w"].armed = step == 4
            res["steps"][step] = mgr.step(step, metrics={"loss": float(step)})
            if rank == 1 and step == 4:
                store.wait()  # (an asynchronous snapshot writes after step() returned: armed until it ended)
        mgr.close()
        res["steps"] = _roots(res["steps"])
        res.update(_counters(mgr))


def grow_case(rank, world, out, res, _arg):
    """The README's loop with a snapshot before the optimizer's first step: the state grows
    (Adam's moments appear), so the asynchronous snapshots stage states of two sizes and
    the store keeps two staging buffers of different sizes (max_inflight=2, the default)."""
    import tensorstore_ck as tsck
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)  # (weights big enough to be staged, not inlined in the manifest)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with tsck.open_store(os.path.join(out, "store")) as store:
        mgr = _manager(store, model, opt, every_steps=1)
        res["steps"] = {0: mgr.step(0)}  # before any optimizer step: no moments yet
        for step in range(1, 7):
            _train_step(model, opt, rank, step)
            res["steps"][step] = mgr.step(step)
        res["close"] = repr(mgr.close())
        res["steps"] = _roots(res["steps"])
        res.update(_counters(mgr))
        res["buffers"] = sorted(b.numel() for b in store._puts.staging._free)


def failend_case(rank, world, out, res, _arg):
    """Rank 1's disk fails for good from step 6 on: the last snapshots of the run fail.
    Nothing configures logging here, as in a user's script: what is shown is recorded
    through warnings.showwarning (called only for a warning the filters show)."""
    import warnings
    import tensorstore_ck as tsck
    shown = res["shown"] = []
    warnings.showwarning = lambda m, c, *a, **k: shown.append(f"{c.__name__}: {m}")
    holder, wrap = _failing_on_rank_1(rank)
    model, opt = _model_and_opt()
    with tsck.open_store(os.path.join(out, "store"), wrap_storage=wrap) as store:
        mgr = _manager(store, model, opt, every_steps=2)
        res["steps"] = {}
        for step in range(1, 11):
            _train_step(model, opt, rank, step)
            if rank == 1 and step == 6:
                store.wait()
                holder["w"].armed = True
            res["steps"][step] = mgr.step(step)
        try:
            mgr.close()
            res["closed"] = "returned"
        except tsck.SnapshotsFailed as e:
            res["closed"] = f"SnapshotsFailed: {e}"
            rep = e.report
            res["report"] = [rep.attempted, rep.committed, rep.failed, rep.last_attempted_step,
                             rep.last_committed_step]
        res["steps"] = _roots(res["steps"])
        res.update(_counters(mgr))


def force_case(rank, world, out, res, _arg):
    """force=True on one rank alone: rank 1's at step 3 (rank 0 does not force: no snapshot
    on either rank), rank 0's at step 5 (a snapshot on both). Every other snapshot is the
    policy's (every_steps=2), and none fails."""
    import tensorstore_ck as tsck
    model, opt = _model_and_opt()
    with tsck.open_store(os.path.join(out, "store")) as store:
        mgr = _manager(store, model, opt, every_steps=2, timeout=20)
        res["steps"] = {}
        for step in range(1, 9):
            _train_step(model, opt, rank, step)
            force = (rank == 1 and step == 3) or (rank == 0 and step == 5)
            res["steps"][step] = mgr.step(step, force=force)
        mgr.close()
        res["steps"] = _roots(res["steps"])
        res.update(_counters(mgr))


def fenced_case(rank, world, out, res, _arg):
    """Another party's gc opens its deletion phase before step 4 and ends it 3 s into step
    4's snapshot: the collective put waits the phase out and re-validates (every rank
    re-uploads what the phase could have deleted), so step 4 is published on every rank
    and nothing fails."""
    import threading
    import time

    import tensorstore_ck as tsck
    model, opt = _model_and_opt()
    with tsck.open_store(os.path.join(out, "store")) as store:
        mgr = _manager(store, model, opt, every_steps=2)
        res["steps"] = {}
        for step in range(1, 9):
            _train_step(model, opt, rank, step)
            if rank == 0 and step == 3:
                store.reftable.gc_begin("other-gc", lease=300.0)
                store.reftable.gc_freeze("other-gc")
            timer = None
            if rank == 0 and step == 4:
                def finish():
                    store.reftable.gc_finish("other-gc")
                    res["gc_end"] = time.monotonic()
                timer = threading.Timer(3.0, finish)
                timer.start()
            res["steps"][step] = mgr.step(step)
            if timer is not None:
                store.wait()  # (asynchronous: the snapshot ends after step() returned)
                res["step4_end"] = time.monotonic()
                timer.join()
        mgr.close()
        res["steps"] = _roots(res["steps"])
        res.update(_counters(mgr))


def resume_case(rank, world, out, res, arg):
    """arg = (store name, first step, last step, dump snapshots?): a training script that
    restores the newest snapshot, then trains to the last step."""
    import tensorstore_ck as tsck
    name, last = arg
    model, opt = _model_and_opt()
    torch.manual_seed(100 + rank)
    ts = tsck.TrainState(model=model, optimizer=opt)
    with tsck.open_store(os.path.join(out, name)) as store:
        mgr = tsck.CheckpointManager(store, job=JOB, state=ts, every_steps=3,
                                     retention=tsck.Retention(keep_last=2))
        start = mgr.restore_latest()
        res["start"] = start
        phase = res["phase"]
        if start is not None:
            torch.save(ts.state_dict(), os.path.join(out, f"{phase}_rank{rank}_restored.pt"))
        res["losses"], res["steps"] = {}, {}
        for step in range((start or 0) + 1, last + 1):
            res["losses"][step] = _train_step(model, opt, rank, step)
            got = mgr.step(step)
            res["steps"][step] = got
            if got is not None:
                torch.save(ts.state_dict(), os.path.join(out, f"{phase}_rank{rank}_step{step}.pt"))
        mgr.close()
        res["steps"] = _roots(res["steps"])
        res.update(_counters(mgr))


def preempt_case(rank, world, out, res, arg):
    """A preemption notice to one rank, or to each at another step, in a run whose interval
    (every_steps=100) takes no snapshot: every rank saves the same step, blocking, and
    step() raises Preempted there (caught here to record it)."""
    import signal

    import tensorstore_ck as tsck
    model, opt = _model_and_opt()
    torch.manual_seed(100 + rank)
    store = tsck.open_store(os.path.join(out, "store"))
    mgr = _manager(store, model, opt, every_steps=100)
    at = {"one": {1: 5}, "both": {0: 4, 1: 6}}[arg].get(rank)
    res["saved"] = res["at"] = None
    for step in range(1, 30):
        _train_step(model, opt, rank, step)
        if step == at:
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler's notice, to this rank only
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                   os.path.join(out, f"preempt_rank{rank}_step{step}.pt"))
        try:
            mgr.step(step)
        except tsck.Preempted as e:
            res.update(saved=e.step, durable=e.durable, code=e.code, at=step, text=str(e))
            break
    store.close()


def preempted_resume_case(rank, world, out, res, _arg):
    """New processes after the preemption: each rank restores the newest snapshot."""
    import tensorstore_ck as tsck
    model, opt = _model_and_opt()
    store = tsck.open_store(os.path.join(out, "store"))
    mgr = _manager(store, model, opt, every_steps=100)
    res["start"] = mgr.restore_latest()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
               os.path.join(out, f"restored_rank{rank}.pt"))
    mgr.close()
    store.close()


def scenarios(scenario: str, out: str, argv: list) -> list | None:
    """SCENARIO -> the launch infos of its runs (tests/_util.launcher_main runs this)."""
    arg = argv[3] if len(argv) > 3 else None
    one = {"loop": (loop_case, arg or "async"), "clock": (clock_case, None), "fail": (fail_case, None),
           "prune": (prune_case, arg or "sync"), "force": (force_case, None), "grow": (grow_case, None),
           "failend": (failend_case, None), "fenced": (fenced_case, None)}
    if scenario in one:
        body, a = one[scenario]
        return [dw.launch(scenario, 2, body, out, a, limit=240.0)]
    if scenario == "preempt":
        return [dw.launch("preempt", 2, preempt_case, out, arg, limit=240.0),
                dw.launch("restored", 2, preempted_resume_case, out, None, limit=240.0)]
    if scenario == "resume":
        return [dw.launch("first", 2, resume_case, out, ("store", 9), limit=240.0),
                dw.launch("second", 2, resume_case, out, ("store", 12), limit=240.0),
                dw.launch("straight", 2, resume_case, out, ("straight", 12), limit=240.0)]
    return None


if __name__ == "__main__":
    launcher_main(scenarios)
