"""CheckpointManager(continuous=True) on 2 real gloo ranks, for tests/train/test_continuous.py.

    python continuous_ranks.py continuous OUTDIR

Each rank trains a small model for 10 steps with continuous=True, min_interval=10. Rank 0's
clock reads 4 s per step, rank 1's 100 s (its own clock alone would fire at every step):
rank 0 decides. Rank 0's object writes are held from step 3 until the loop opens them
before step 7, so the snapshot of step 3 stays in flight (not durable) through steps 4-6.
Each rank writes OUTDIR/continuous_rank<r>.json: what step() returned at each step (root
or None), the manager's counters. The ranks are forked by dist_worker.launch.
"""

from __future__ import annotations

import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import dist_worker as dw  # noqa: E402
from dist_worker import launcher_main  # noqa: E402

JOB = "llm"
HOLD_FOR = 120.0  # a gate nobody opens lets the writes go by itself (the test then fails on the steps)
DEADLINE = 120.0  # a snapshot that should end and does not: TimeoutError, the rank's failure (said in its result)


def _held_class():
    from tensorstore_ck.storage.wrappers import WrappedStore

    class Held(WrappedStore):
        """Holds every object write while `gate` is clear."""

        def __init__(self, inner):
            super().__init__(inner)
            self.gate = threading.Event()
            self.gate.set()

        def put_if_absent(self, key, bufs):
            self.gate.wait(HOLD_FOR)
            return self.inner.put_if_absent(key, bufs)

        def put_addressed(self, key, bufs):
            self.gate.wait(HOLD_FOR)
            return self.inner.put_addressed(key, bufs)
    return Held


def continuous_case(rank, world, out, res, _arg):
    import tensorstore_ck as tsck
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    Held = _held_class()
    held: dict = {}
    wrap = (lambda s: held.setdefault("w", Held(s))) if rank == 0 else None
    now = {"t": 0.0}
    per_step = 4.0 if rank == 0 else 100.0
    with tsck.open_store(os.path.join(out, "store"), block_size=4096, inline_threshold=256,
                         wrap_storage=wrap) as store:
        mgr = tsck.CheckpointManager(store, job=JOB, state=tsck.TrainState(model=model, optimizer=opt),
                                     continuous=True, min_interval=10, clock=lambda: now["t"])
        got, first, early = {}, None, None
        try:
            for step in range(1, 11):
                now["t"] = per_step * step
                if rank == 0 and step == 3:
                    held["w"].gate.clear()
                if step == 7:
                    if rank == 0:
                        held["w"].gate.set()
                    first.exception(timeout=DEADLINE)  # the snapshot of step 3 ends (on every rank: it is collective)
                with torch.no_grad():
                    model.weight.add_(0.01)
                r = got[step] = mgr.step(step)
                if step == 3:
                    first = r
                elif r is not None and 4 <= step <= 6:
                    # The durability check failed: said at once (the snapshot's writes are held
                    # too; waiting for it would only wait out the gate). Rank 0 decides for both.
                    early = f"step {step} took a snapshot while step 3's was held in flight (not durable yet)"
                    break
                elif r is not None:
                    r.exception(timeout=DEADLINE)  # durable before the next step: min_interval alone holds the next
        finally:
            if rank == 0:
                held["w"].gate.set()  # a failed check leaves no write held for close()
        mgr.close()
    res["early"] = early
    res["steps"] = {s: (None if r is None else r.result().root) for s, r in got.items()}
    res["failed"] = mgr.failed_snapshots
    res["errors"] = [f"{type(e).__name__}: {e}" for e in mgr.snapshot_errors]


def scenarios(scenario: str, out: str, argv: list) -> list | None:
    """SCENARIO -> the launch infos of its runs (tests/_util.launcher_main runs this)."""
    if scenario == "continuous":
        return [dw.launch("continuous", 2, continuous_case, out, None, limit=240.0)]
    return None


if __name__ == "__main__":
    launcher_main(scenarios)
