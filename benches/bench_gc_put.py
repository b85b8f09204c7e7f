#!/usr/bin/env python
"""put_snapshot latency beside a looping gc: what the gc protocol costs writers.

One writer commits a training-like state (a frozen base shared by every
snapshot, plus dense weights and Adam moments that change every step) to one
ref with retention keep_last=2, first alone, then while another process runs
``store.gc()`` in a loop (every run expires the snapshot before last, so every
run has a deletion phase that overlaps the writer's commits), and once more with
the gc's grace period (``gc(grace=)``: objects younger than that are left for a
later gc, so the writer's snapshot in flight keeps its new objects). The peer is
``torch.save`` of the same state to a local file, timed in the same run.

Run it against two trees to compare protocols (the same script, PYTHONPATH set):

    .venv/bin/python benches/bench_gc_put.py | tee benches/results/gc_put.txt
    PYTHONPATH=/tmp/old .venv/bin/python benches/bench_gc_put.py     # e.g. git worktree add /tmp/old <commit>
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

GC_LOOP = r"""
import os, sys, time
import tensorstore_ck as tsck
store = tsck.open_store(sys.argv[1])
stop, grace = sys.argv[2], float(sys.argv[3])
n = 0
print("ready", flush=True)
while not os.path.exists(stop):
    r = store.gc(grace=grace) if grace else store.gc()
    n += 1
    time.sleep(0.01)
print(f"runs {n}", flush=True)
store.close()
"""


def make_state(step: int, base_mb: int, live_mb: int) -> dict:
    g = torch.Generator().manual_seed(0)
    base = {f"frozen.{i}": torch.randn(base_mb * 2**20 // 4 // 8, generator=g) for i in range(8)}
    g.manual_seed(1000 + step)
    n = live_mb * 2**20 // 4 // 3 // 8
    live = {f"w.{i}": torch.randn(n, generator=g) for i in range(8)}
    optim = {f"exp_avg.{i}": torch.randn(n, generator=g) for i in range(8)}
    optim.update({f"exp_avg_sq.{i}": torch.rand(n, generator=g) for i in range(8)})
    return {"model": {**base, **live}, "optim": optim, "step": step}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round((len(xs) - 1) * q / 100)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--puts", type=int, default=12, help="puts per phase")
    ap.add_argument("--base-mb", type=int, default=32)
    ap.add_argument("--live-mb", type=int, default=48)
    ap.add_argument("--grace", type=float, nargs="+", default=[0.0, 60.0],
                    help="one gc-loop phase per value of gc(grace=) (0 works on trees without it)")
    args = ap.parse_args()
    import tensorstore_ck as tsck

    root = tempfile.mkdtemp(prefix="tsck-bench-gcput-", dir=args.dir)
    try:
        path = os.path.join(root, "store")
        store = tsck.open_store(path)
        store.set_retention("job", tsck.Retention(keep_last=2))
        states = [make_state(s, args.base_mb, args.live_mb) for s in range((1 + len(args.grace)) * args.puts + 1)]
        nbytes = sum(t.numel() * t.element_size() for d in (states[0]["model"], states[0]["optim"])
                     for t in d.values())
        store.put_snapshot(states[0], ref="job/main", step=0)  # the base is stored once

        def puts(first: int) -> list[float]:
            out = []
            for s in range(first, first + args.puts):
                t = time.perf_counter()
                store.put_snapshot(states[s], ref="job/main", step=s)
                out.append(time.perf_counter() - t)
            return out

        alone = puts(1)
        beside, runs = {}, {}
        for k, grace in enumerate(args.grace):
            stop = os.path.join(root, f"stop{k}")
            gc = subprocess.Popen([sys.executable, "-c", GC_LOOP, path, stop, str(grace)], stdout=subprocess.PIPE,
                                  text=True)
            assert gc.stdout.readline().strip() == "ready"
            time.sleep(0.5)
            beside[grace] = puts(1 + (k + 1) * args.puts)
            open(stop, "w").close()
            runs[grace] = gc.stdout.read().strip()
            gc.wait(120)
        saves = []
        for s in range(args.puts):
            t = time.perf_counter()
            torch.save(states[s], os.path.join(root, "peer.pt"))
            os.sync()
            saves.append(time.perf_counter() - t)
        ok = store.fsck(full=False).ok
        store.close()

        tsave = statistics.median(saves)
        print(f"# put_snapshot beside a looping gc ({tsck.__file__})")
        print(f"state {nbytes / 1e6:.0f} MB ({args.base_mb} MB frozen base, the rest changes every step); "
              f"{args.puts} puts per phase; gc loops: {runs}; fsck after: {'clean' if ok else 'PROBLEMS'}\n")
        print("| phase | p50 s | p90 s | max s | p50 / torch.save p50 |")
        print("|---|---|---|---|---|")
        rows = [("put alone", alone)] + [(f"put beside a gc loop, grace {g:g} s", xs) for g, xs in beside.items()]
        for name, xs in rows + [("torch.save + sync", saves)]:
            print(f"| {name} | {pct(xs, 50):.3f} | {pct(xs, 90):.3f} | {max(xs):.3f} | "
                  f"{pct(xs, 50) / tsave:.2f}x |")
        for g, xs in beside.items():
            print(f"\nbeside a gc loop (grace {g:g} s) / alone, p50: {pct(xs, 50) / pct(alone, 50):.2f}x; "
                  f"p90: {pct(xs, 90) / pct(alone, 90):.2f}x")
        return 0 if ok else 1
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
