"""One training job of many on one store (tests/train/test_jobs.py, benches/bench_jobs.py).

    python jobs_worker.py STORE JOB STEPS BARRIER [--interval S] [--keep N] [--sync] [--mb M] [--refs URL]

An asynchronous CheckpointManager (job JOB, ref JOB/main) snapshotting every step
with Retention(keep_last=N) and pruning as it trains; STEPS steps, one every S
seconds (0: back to back). The state is a small model: a frozen tensor that every
job shares (dedup across jobs) and a head that changes every step. The worker
writes BARRIER/JOB.ready and starts only once BARRIER/go exists, so the jobs
really overlap. --mb M adds M MB of per-job weights that change every step (the
bench's state size); --refs: the ref table (open_store's refs=, e.g. a PostgreSQL DSN).

stdout, one JSON line at the end: {job, steps, failed, skipped, errors, prune_errors,
prune_runs, put_seconds: [...]} (put_seconds: how long each step()'s put took to
commit, measured from the step() call to the future's completion).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import tensorstore_ck as tsck


class Model(torch.nn.Module):
    def __init__(self, job_seed: int, mb: float = 0.0):
        super().__init__()
        torch.manual_seed(0)
        self.frozen = torch.nn.Parameter(torch.randn(64, 256), requires_grad=False)  # shared by every job
        torch.manual_seed(job_seed)
        self.head = torch.nn.Linear(256, 64)
        self.extra = torch.nn.Parameter(torch.randn(int(mb * 2**18)), requires_grad=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("job")
    ap.add_argument("steps", type=int)
    ap.add_argument("barrier")
    ap.add_argument("--interval", type=float, default=0.0)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--mb", type=float, default=0.0)
    ap.add_argument("--refs", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    with open(os.path.join(a.barrier, a.job + ".ready"), "w"):
        pass
    while not os.path.exists(os.path.join(a.barrier, "go")):
        time.sleep(0.02)
    out = {"job": a.job, "steps": 0, "failed": 0, "skipped": 0, "errors": [], "prune_errors": [],
           "prune_runs": 0, "put_seconds": []}
    store = tsck.open_store(a.store, **({"refs": a.refs} if a.refs else {}))
    model = Model(sum(a.job.encode()), a.mb)
    mgr = tsck.CheckpointManager(store, job=a.job, state=tsck.TrainState(model=model), every_steps=1,
                                 retention=tsck.Retention(keep_last=a.keep), async_=not a.sync)
    t_next = time.monotonic()
    for step in range(1, a.steps + 1):
        with torch.no_grad():
            model.head.weight.add_(torch.randn_like(model.head.weight) * 1e-3)
            model.extra.add_(1e-3)
        t0 = time.monotonic()
        try:
            res = mgr.step(step)
        except tsck.TsckError as e:  # a failed background snapshot, raised by the next step()
            out["failed"] += 1
            out["errors"].append(f"{type(e).__name__}: {e}")
            continue
        if res is None:
            out["skipped"] += 1
        elif hasattr(res, "add_done_callback"):
            res.add_done_callback(lambda f, t0=t0: out["put_seconds"].append(time.monotonic() - t0))
        else:
            out["put_seconds"].append(time.monotonic() - t0)
        out["steps"] += 1
        if a.interval:
            t_next += a.interval
            time.sleep(max(0.0, t_next - time.monotonic()))
    try:
        mgr.close()
    except tsck.TsckError as e:
        out["failed"] += 1
        out["errors"].append(f"{type(e).__name__}: {e}")
    out["skipped"] += store.skipped
    out["prune_errors"] = [f"{type(e).__name__}: {e}" for e in mgr.prune_errors]
    out["prune_runs"] = mgr._pruner.runs if mgr._pruner is not None else 0
    store.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
