#!/usr/bin/env python
"""gc at scale: offline gc's memory per object and its mark, list and sweep rates on
stores of millions of objects, and the projection to 180 M objects.

Builds one local store through the project's own put path (``put_snapshot``; every
object is a valid stored object: framed, lz4, BLAKE3-addressed), with tiny blocks so
that millions of objects cost little disk: each block is 4 KiB of raw bytes, all zero
but a unique 8-byte stamp, so lz4 stores it in ~40 bytes (one filesystem block).
Tensors hold 64 blocks each (one leaf of 64 addresses; ~2 tensors per manifest node,
about one node per 100 blocks, the ratio of a real training state's tree). Three
jobs:

* ``archive`` (no retention rules: keeps everything): each of its snapshots adds
  2 x --per-put new blocks;
* ``run0`` and ``run1`` (``keep_last=1``): each snapshot adds --per-put new blocks, so
  all but each job's latest become garbage at the next gc;
* every snapshot also holds one base of 32 tensors shared by all of them (the same
  subtree in every tree: the mark walks it once and skips it after).

The store grows in stages: at each stage it is filled (rounds of archive, run0,
run1) until it holds --sizes[i] objects, then ``tsck gc`` runs in a child process
(run_gc, as the CLI runs it; no lease or phase settings changed). The child reports
its GCReport with the seconds of its mark, list and sweep, and its memory: the
kernel's high-water mark (VmHWM, reset after import and open_store through
/proc/self/clear_refs) minus the RSS of the idle open store, i.e. what gc added at
its peak; and ``ru_maxrss`` (lifetime peak, import included) for context. Memory
per object is that peak over the reachable objects, and over the listed objects
(reachable + candidates). The growth is fitted as peak = a + b x reachable + c x
garbage ... simplified to a line in the listed objects over the stages, and
projected to 180 M objects.

The builder writes without fsync (a throwaway store; ``os.sync()`` before each gc):
building is what takes time here, not gc. Typical use (about an hour at 5 M on 2
busy cores; ~25 GB of disk and ~6 M inodes under --dir; the store is deleted at the
end unless --keep-store):

    .venv/bin/python benches/bench_gc_scale.py --dir /work/tmp-gcmem | tee benches/results/gc_scale.txt
    .venv/bin/python benches/bench_gc_scale.py --sizes 100000 250000 --per-put 10000   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
try:
    import tensorstore_ck as tsck
except ImportError:  # run from a checkout without an install
    sys.path.insert(0, REPO)
    import tensorstore_ck as tsck

BLOCK = 4096
ROWS = 64          # blocks per tensor
BASE_TENSORS = 32  # the base every snapshot shares


def _tensors(first: int, n_blocks: int, prefix: str) -> dict:
    """Tensors of ROWS blocks holding n_blocks new blocks, stamped first, first+1, ...
    (a stamp is unique in the store, so every block is a new object)."""
    n_blocks -= n_blocks % ROWS
    a = np.zeros((n_blocks, BLOCK // 4), dtype=np.float32)
    a.view(np.uint64)[:, 0] = np.arange(first, first + n_blocks, dtype=np.uint64) + (1 << 40)
    return {f"{prefix}{i:07d}": a[i * ROWS:(i + 1) * ROWS] for i in range(n_blocks // ROWS)}


def count_objects(root: str) -> dict:
    out = {}
    for kind in ("blocks", "nodes", "commits"):
        n = 0
        for _r, _d, names in os.walk(os.path.join(root, kind)):
            n += len(names)
        out[kind] = n
    return out


class Builder:
    """Fills the store in rounds (archive, run0, run1) through put_snapshot."""

    def __init__(self, path: str, per_put: int, workers: int):
        self.path, self.per_put, self.workers = path, per_put, workers
        self.stamp = 0
        self.puts = 0
        self.seconds = 0.0
        store = tsck.open_store(path, block_size=BLOCK, inline_threshold=0, workers=workers)
        for j in ("run0", "run1"):
            store.set_retention(j, tsck.Retention(keep_last=1))
        store.close()
        self.base = _tensors(0, BASE_TENSORS * ROWS, "b")
        self.stamp = BASE_TENSORS * ROWS

    def fill(self, target: int) -> None:
        """Put snapshots until the store holds at least `target` objects."""
        store = tsck.open_store(self.path, workers=self.workers)
        # A throwaway store: no fsync per object (os.sync() below makes it all durable
        # before gc reads it); the writes and links are the project's own.
        store.storage._fsync = False
        held = sum(count_objects(self.path).values())
        t0 = time.perf_counter()
        try:
            while held < target:
                for job, mult in (("archive", 2), ("run0", 1), ("run1", 1)):
                    n = mult * self.per_put
                    own = _tensors(self.stamp, n, "t")
                    self.stamp += n
                    st = store.put_snapshot({"base": self.base, "own": own, "step": self.puts},
                                            ref=f"{job}/main", step=self.puts, job=job)
                    self.puts += 1
                    held += st.blocks_new + st.blocks_new // 100 + 2  # nodes: counted exactly after the fill
                    print(f"\r  {held:,} objects, {self.puts} snapshots, "
                          f"{held / max(1e-9, time.perf_counter() - t0):,.0f} objects/s   ",
                          end="", file=sys.stderr, flush=True)
                    if held >= target:
                        break
        finally:
            store.close()
            print(file=sys.stderr)
        os.sync()
        self.seconds += time.perf_counter() - t0


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def child_gc(path: str) -> int:
    """In a child process: one offline gc (run_gc, as `tsck gc` runs it) and its memory."""
    store = tsck.open_store(path)
    store.reftable.gc_state()  # the idle open store, its ref table read: the baseline
    base_kib = _status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        hwm_reset = True
    except OSError:
        hwm_reset = False
    t = time.perf_counter()
    rep = store.gc()
    wall = time.perf_counter() - t
    hwm_kib = _status_kib("VmHWM") if hwm_reset else None
    maxrss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    store.close()
    d = rep.to_json()
    for k in ("would_delete", "expired", "snapshots"):
        d.pop(k, None)
    d.update(wall=wall, base_kib=base_kib, hwm_kib=hwm_kib, maxrss_kib=maxrss_kib, expired_n=len(rep.expired))
    print(json.dumps(d))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where to build the store (default: a temp dir under /work or /tmp)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 2_500_000, 5_000_000],
                    help="objects in the store at each gc")
    ap.add_argument("--per-put", type=int, default=50_000, help="new blocks per run snapshot (archive: twice)")
    ap.add_argument("--workers", type=int, default=8, help="store I/O threads for the build")
    ap.add_argument("--project", type=float, default=180e6, help="objects to project to")
    ap.add_argument("--keep-store", action="store_true")
    ap.add_argument("--child-gc", metavar="STORE", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child_gc:
        return child_gc(a.child_gc)

    parent = a.dir or ("/work" if os.access("/work", os.W_OK) else None)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="tsck-bench-gc-scale-", dir=parent)
    path = os.path.join(tmp, "store")
    rows = []
    try:
        print(f"# bench_gc_scale: tensorstore_ck {tsck.__version__}, python {platform.python_version()}, "
              f"{os.cpu_count()} cpus, store under {tmp}; load average at start {os.getloadavg()}", flush=True)
        b = Builder(path, a.per_put, a.workers)
        for target in a.sizes:
            b.fill(target)
            objs = count_objects(path)
            print(f"built {sum(objs.values()):,} objects {objs} in {b.seconds:.0f}s so far; load {os.getloadavg()}",
                  flush=True)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-gc", path],
                                 capture_output=True, text=True)
            if out.returncode:
                print(out.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"gc child failed ({out.returncode})")
            g = json.loads(out.stdout.strip().splitlines()[-1])
            g["load"] = os.getloadavg()
            g["objects"] = sum(objs.values())
            rows.append(g)
            print(json.dumps(g), flush=True)
    finally:
        if a.keep_store:
            print(f"(store kept at {path})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
