"""A DDP job whose rank 0 dies in its prune, then resumes: for tests/maintain/test_lease_dead_holder.py.

    python dead_prune.py run OUTDIR

Phase "first": 2 gloo ranks run the README's manager (asynchronous, a snapshot every
step, keep_last=2). From step 25 on, rank 0's storage hangs on the first request of its
next prune (the storage clock's probe, once the prune holds the gc lock: the prune runs
on the store's background publisher) and writes OUTDIR/trap_rank0; this launcher then
SIGKILLs rank 0, and rank 1 with it (as torchrun takes a job down). Phase "second": new ranks restore_latest, train 5 more
steps with the same manager and close it. OUTDIR/<phase>_rank<r>.json: what each rank
saw; OUTDIR/<phase>_launcher.json: the launch (first: kill_time; second: ended, both
on this host's wall clock).
"""

from __future__ import annotations

import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_worker as dw  # noqa: E402
from ddp_manager import JOB, REF, _model_and_opt, _train_step  # noqa: E402
from dist_worker import launcher_main  # noqa: E402

ARM_AT = 25
RESUMED_STEPS = 5


def _trap_class(out: str):
    from tensorstore_ck.storage.wrappers import WrappedStore

    class HangingClock(WrappedStore):
        """Once armed, the storage clock's probe (a prune's first request) never returns,
        and says so in the trap file."""
        armed = False

        def clock_now(self):
            if not self.armed:
                return self.inner.clock_now()
            with open(os.path.join(out, "trap_rank0"), "w") as f:
                f.write(str(os.getpid()))
            threading.Event().wait()

    return HangingClock


def _manager(store, model, opt):
    import tensorstore_ck as tsck
    return tsck.CheckpointManager(store, job=JOB, state=tsck.TrainState(model=model, optimizer=opt),
                                  every_steps=1, retention=tsck.Retention(keep_last=2))


def first_case(rank, world, out, res, _arg):
    import tensorstore_ck as tsck
    trap = {}
    wrap = (lambda inner: trap.setdefault("w", _trap_class(out)(inner))) if rank == 0 else None
    model, opt = _model_and_opt()
    store = tsck.open_store(os.path.join(out, "store"), wrap_storage=wrap)
    mgr = _manager(store, model, opt)
    for step in range(1, 2 * ARM_AT):
        _train_step(model, opt, rank, step)
        if rank == 0 and step == ARM_AT:
            trap["w"].armed = True
        mgr.step(step)
    res["not_killed"] = True  # the trap never fired: the test fails on the launcher's record
    mgr.close()
    store.close()


def second_case(rank, world, out, res, _arg):
    import tensorstore_ck as tsck
    model, opt = _model_and_opt()
    with tsck.open_store(os.path.join(out, "store")) as store:
        mgr = _manager(store, model, opt)
        start = res["start"] = mgr.restore_latest()
        for step in range(start + 1, start + 1 + RESUMED_STEPS):
            _train_step(model, opt, rank, step)
            mgr.step(step)
        mgr.close()
        res["prune_errors"] = [f"{type(e).__name__}: {e}" for e in mgr.prune_errors]
        res["prune_runs"] = mgr._pruner.runs
        res["kept"] = sorted(e.step for e in store.log(REF))


def _first(out: str, limit: float) -> dict:
    """dist_worker.launch, but the kill takes the whole job down: rank 0, then rank 1."""
    return dw.launch("first", 2, first_case, out, kill_rank=0, kill_job=True, limit=limit)


def scenarios(scenario: str, out: str, argv: list) -> list | None:
    if scenario != "run":
        return None
    first = _first(out, 180.0)
    second = dw.launch("second", 2, second_case, out, limit=180.0)
    second["ended"] = time.time()
    dw._dump(os.path.join(out, "second_launcher.json"), second)
    return [first, second]


if __name__ == "__main__":
    launcher_main(scenarios)
