#!/usr/bin/env python
"""What a ref's history costs once retention has run (issue 12, failure 12).

One ref takes N snapshots with retention keep_last=2; then gc runs. Timed before and
after that gc: ``log(ref)`` (what ``CheckpointManager.restore_latest()`` calls at every
resume), ``resolve("REF@STEP")`` of a kept step, and the gc itself. The reflog's length
is printed too.

The history is built cheaply: one real snapshot, then N ref moves through
``RefTable.compare_and_swap`` (the writers' own transaction: reflog, catalog row, and
on newer code the steps index) with made-up roots whose catalog rows name the real
snapshot's tree, so nothing but the ref table is written. The store lives on /dev/shm
when there is one (an fsync there is free; the ref table's work is what is timed).

Run it against two trees to compare (the same script, PYTHONPATH set):

    .venv/bin/python benches/bench_history.py | tee benches/results/history.txt
    PYTHONPATH=/tmp/old .venv/bin/python benches/bench_history.py    # e.g. git worktree add /tmp/old <commit>
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

try:
    import tensorstore_ck as tsck
except ImportError:  # not installed: this checkout's
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import tensorstore_ck as tsck


def _timed(fn, repeats: int) -> tuple[float, object]:
    out, times = None, []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100_000, help="snapshots taken on the ref (default 100000)")
    ap.add_argument("--repeats", type=int, default=5, help="timings per figure, median reported")
    ap.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="tsck-bench-history-", dir=args.dir)
    try:
        store = tsck.open_store(os.path.join(base, "s"))
        real = store.put_snapshot({"w": torch.arange(16.0)}, ref="j/main", step=0)
        rt = store.reftable
        tree = rt.catalog_get(bytes.fromhex(real.root))["tree"]
        store.set_retention("j", tsck.Retention(keep_last=2))
        prev = bytes.fromhex(real.root)
        t0 = time.perf_counter()
        now = time.time()
        for step in range(1, args.n + 1):
            root = hashlib.blake2b(step.to_bytes(8, "big"), digest_size=32).digest()
            row = {"job": "j", "ref": "j/main", "step": step, "time": now + step * 1e-3, "metrics": {},
                   "meta": {}, "parent": prev, "tree": tree, "bytes_total": 64, "bytes_new": 0,
                   "blocks_total": 0, "blocks_new": 0}
            rt.compare_and_swap("j/main", prev, root, message=f"snapshot step {step}", catalog_row=row)
            prev = root
        build = time.perf_counter() - t0
        kept_step = f"j/main@{args.n - 1}"
        print(f"tensorstore_ck from {os.path.dirname(tsck.__file__)}")
        print(f"history: {args.n} snapshots on one ref, keep_last=2 (built in {build:.1f} s); "
              f"median of {args.repeats}")
        print()
        print("| when | reflog entries | log() | REF@STEP | gc |")
        print("|---|---:|---:|---:|---:|")

        def row(when: str, gc_s: float | None) -> None:
            n_log = len(rt.reflog("j/main"))
            log_s, infos = _timed(lambda: store.log("j/main"), args.repeats)
            step_s, _root = _timed(lambda: store.resolve(kept_step), args.repeats)
            gc_txt = "" if gc_s is None else f"{gc_s:.2f} s"
            print(f"| {when} | {n_log} | {log_s * 1e3:.2f} ms ({len(infos)} snapshots) | {step_s * 1e3:.2f} ms | "
                  f"{gc_txt} |", flush=True)

        row("before gc", None)
        gc_s, _ = _timed(store.gc, 1)
        row("after gc", gc_s)
        gc2_s, _ = _timed(store.gc, 1)
        row("after a second gc", gc2_s)
        store.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
