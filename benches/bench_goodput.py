#!/usr/bin/env python
"""Expected goodput of a run from measured quantities (the model of tensorstore_ck/goodput.py,
docs/guide/goodput.md): this machine's figures, and the projected 1,024-rank ones.

Measured here, in this run: a CheckpointManager's asynchronous snapshots of --mb MB of fp32
(every_steps=1 over a loop of --snapshots steps that each train for --step-s seconds of
sleep, so each snapshot has a step to overlap): the stall (SnapshotInfo.stall) and the call
to commit (SnapshotInfo.seconds, the time to durable on a store without a tier), medians.
Given: the restart time (benches/bench_restart.py: --restart here, --restart-1024 its
projection) and the MTBF (--mtbf, default 7.9 h: the MTTF reported at 1,024 GPUs).
The 1,024-rank row scales the stall and the time to durable with each rank's bytes
(--gb-1024 GB per rank, each rank staging and writing its own part at the rates measured here).

    .venv/bin/python benches/bench_goodput.py --restart 12.7 --restart-1024 42.9 | tee benches/results/goodput.txt
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=256.0)
    ap.add_argument("--snapshots", type=int, default=8)
    ap.add_argument("--step-s", type=float, default=0.5)
    ap.add_argument("--restart", type=float, required=True, help="seconds, this machine (bench_restart.py)")
    ap.add_argument("--restart-1024", type=float, required=True, help="seconds, projected at 1,024 ranks")
    ap.add_argument("--gb-1024", type=float, default=5.0)
    ap.add_argument("--mtbf", default="7.9h")
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    import torch
    import tensorstore_ck as tsck
    from tensorstore_ck.goodput import goodput, parse_seconds
    mtbf = parse_seconds(a.mtbf, "--mtbf")
    n = int(a.mb * 1e6 / 4 / 8)
    params = [torch.randn(n) for _ in range(8)]
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        with tsck.open_store(os.path.join(d, "store")) as store:
            mgr = tsck.CheckpointManager(store, job="bench", state={f"p{i}": p for i, p in enumerate(params)},
                                         every_steps=1)
            for step in range(1, a.snapshots + 1):
                for p in params:
                    p.add_(1.0)  # every block changes: a full write each time
                mgr.step(step)
                time.sleep(a.step_s)
            mgr.close()
            infos = store.log("bench/main")
    stall = statistics.median(i.stall for i in infos)
    secs = statistics.median(i.seconds for i in infos)
    gbps = a.mb * 1e6 / secs / 1e9
    print(f"# {os.cpu_count()} cores, torch {torch.__version__}; {a.mb:g} MB fp32, {len(infos)} asynchronous "
          f"snapshots, {a.step_s:g} s steps; MTBF {mtbf / 3600:.2f} h")
    print(f"# measured: stall {stall:.3f} s, call to commit {secs:.2f} s ({gbps:.2f} GB/s) (medians)")
    scale = a.gb_1024 * 1e9 / (a.mb * 1e6)  # each rank's bytes, there over here
    stall_1024 = stall * scale  # (the staging copy: its bytes)
    durable_1024 = max(stall_1024, secs * scale)
    print("\n| run | stall s | durable s | restart s | interval | goodput | best interval | best goodput |")
    print("|---|---|---|---|---|---|---|---|")
    for name, st, du, rs in (("this machine", stall, secs, a.restart),
                             (f"1,024 ranks x {a.gb_1024:g} GB (projected)", stall_1024, durable_1024, a.restart_1024)):
        for interval in (600.0, 1800.0):
            g = goodput(stall=st, durable=du, restart=rs, mtbf=mtbf, interval=max(interval, du))
            best = "continuous" if g.best_is_continuous else "Young/Daly"
            print(f"| {name} | {st:.3f} | {du:.1f} | {rs:.1f} | {interval / 60:.0f} min | {100 * g.goodput:.2f}% | "
                  f"{g.best_interval:.0f} s ({best}) | {100 * g.best_goodput:.2f}% |")
    print("\n(goodput = (c - stall)/c x (1 - (restart + c/2 + durable)/MTBF) for a cycle c; best interval "
          "max(sqrt(2 stall (MTBF - restart - durable)), durable))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
