#!/usr/bin/env python
"""GC / fsck benchmark: tensorstore_ck's lifecycle work on a store of >100,000 objects.

Builds a local store of small blocks (block_size 4 KiB, so the object count is
high and the bytes modest): 4 jobs x 6 snapshots; every snapshot holds a base
shared by all jobs (40 tensors x 100 blocks) and 49 tensors x 100 blocks of its
own; retention keep_last=3 per job, so about half of the blocks become garbage.
Then, in this order:

* ``fsck --quick`` (presence, header, size) and ``fsck`` (full: read + re-hash),
  both with the page cache of the store's files evicted first (posix_fadvise
  DONTNEED per file; no system-wide drop_caches) and once more warm;
* ``gc(dry_run=True)``: expire plan, mark, list (deletes nothing);
* the mark phase alone (``tensorstore_ck.maintain.reach.mark`` over every kept snapshot,
  an internal function, timed here to give the marking throughput);
* ``gc()`` in a child process, which reports its GCReport, its ru_maxrss
  (lifetime peak, torch import included) and, with the kernel's high-water
  mark reset after import+open, the memory gc itself added at its peak, to
  show that it stays bounded (8 bytes per reachable object, candidates
  spooled to a temporary file);
* ``fsck --quick`` again: no orphans may be left.

On a local disk the deletion rate is bounded by unlink: on ext4 mounted with
``discard`` a single thread unlinks only ~1,000 such files/s.

Prints a markdown table. 1 GB = 1e9 bytes. Typical use (a few minutes, ~0.6 GB
of disk under --dir):

    .venv/bin/python benches/bench_gc.py | tee benches/results/gc.txt
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
ROWS = 100  # rows of 4 KiB per tensor: 100 blocks each


def _arr(seed) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(seed).bytes(ROWS * BLOCK), dtype=np.float32).reshape(ROWS, 1024)


def evict(root: str) -> int:
    """Drop the page cache of every file under root (ours only); returns the file count."""
    n = 0
    for r, _, names in os.walk(root):
        for name in names:
            try:
                fd = os.open(os.path.join(r, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            n += 1
    return n


def count_objects(root: str) -> dict:
    out = {}
    for kind in ("blocks", "nodes", "commits"):
        n = b = 0
        for r, _, names in os.walk(os.path.join(root, kind)):
            for name in names:
                n += 1
                b += os.path.getsize(os.path.join(r, name))
        out[kind] = (n, b)
    return out


def build(path: str, jobs: int, snaps: int, base_tensors: int, own_tensors: int, keep: int, workers: int):
    store = tsck.open_store(path, block_size=BLOCK, inline_threshold=0, workers=workers)
    base = {f"layer{i}": _arr([1, i]) for i in range(base_tensors)}
    t0 = time.perf_counter()
    puts = 0
    for s in range(snaps):
        for j in range(jobs):
            own = {f"t{i}": _arr([2, j, s, i]) for i in range(own_tensors)}
            store.put_snapshot({"base": base, "own": own, "step": s}, ref=f"job{j}/main", step=s)
            puts += 1
            print(f"\r  built {puts}/{jobs * snaps} snapshots", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    for j in range(jobs):
        store.set_retention(f"job{j}", tsck.Retention(keep_last=keep))
    store.close()
    os.sync()
    return time.perf_counter() - t0


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
    """Run in a child process: one real gc; report it and its memory.

    ru_maxrss is the process's lifetime peak (import of torch included); the
    kernel's high-water mark VmHWM is reset after import+open (clear_refs 5), so
    VmHWM - VmRSS(before) is what gc itself added at its peak."""
    store = tsck.open_store(path)
    store.reftable.gc_state()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cur0 = _status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    t = time.perf_counter()
    rep = store.gc()
    wall = time.perf_counter() - t
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    hwm = _status_kib("VmHWM") if hwm_reset else None
    store.close()
    d = rep.to_json()
    d.pop("would_delete", None)
    d.pop("expired", None)
    d.update(wall=wall, rss_before_kib=rss0, rss_peak_kib=rss1, vmrss_before_kib=cur0, vmhwm_gc_kib=hwm,
             expired_n=len(rep.expired))
    print(json.dumps(d))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where to build the store (default: a temp dir under /work or /tmp)")
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--snapshots", type=int, default=6, help="per job")
    ap.add_argument("--base-tensors", type=int, default=40, help="shared by every snapshot (100 blocks each)")
    ap.add_argument("--own-tensors", type=int, default=49, help="unique to each snapshot (100 blocks each)")
    ap.add_argument("--keep", type=int, default=3, help="retention keep_last per job")
    ap.add_argument("--workers", type=int, default=16, help="store I/O threads for the build")
    ap.add_argument("--keep-store", action="store_true")
    ap.add_argument("--child-gc", metavar="STORE", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child_gc:
        return child_gc(a.child_gc)

    parent = a.dir or ("/work" if os.access("/work", os.W_OK) else None)
    tmp = tempfile.mkdtemp(prefix="tsck-bench-gc-", dir=parent)
    path = os.path.join(tmp, "store")
    rows = []
    try:
        print(f"# bench_gc: tensorstore_ck {tsck.__version__}, python {platform.python_version()}, "
              f"{os.cpu_count()} cpus, store under {tmp}")
        print(f"building: {a.jobs} jobs x {a.snapshots} snapshots, each {a.base_tensors} shared + "
              f"{a.own_tensors} own tensors of {ROWS} x 4 KiB blocks, keep_last={a.keep}", flush=True)
        t_build = build(path, a.jobs, a.snapshots, a.base_tensors, a.own_tensors, a.keep, a.workers)
        objs = count_objects(path)
        n_obj = sum(n for n, _ in objs.values())
        n_blocks, block_bytes = objs["blocks"]
        print(f"built in {t_build:.1f}s: {n_blocks} blocks ({block_bytes / 1e9:.3f} GB on disk), "
              f"{objs['nodes'][0]} nodes, {objs['commits'][0]} commits", flush=True)

        store = tsck.open_store(path)
        results = {}
        for label, full, cold in (("fsck --quick (cold cache)", False, True), ("fsck --quick (warm)", False, False),
                                  ("fsck full (cold cache)", True, True), ("fsck full (warm)", True, False)):
            if cold:
                evict(path)
            r = store.fsck(full=full)
            assert r.ok, [str(f) for f in r.findings[:5]]
            results[label] = r
            print(f"{label}: {r.seconds:.2f}s, {r.objects_checked} objects, {r.bytes_checked / 1e9:.3f} GB, "
                  f"orphans {r.orphans}", flush=True)
            gbps = f"{r.bytes_checked / 1e9 / r.seconds:.3f} GB/s" if full else ""
            rows.append((label, f"{r.seconds:.2f}", f"{r.objects_checked / r.seconds:,.0f} objects/s", gbps,
                         f"{r.objects_checked} objects checked"))

        evict(path)
        t = time.perf_counter()
        dry = store.gc(dry_run=True)
        t_dry = time.perf_counter() - t
        print(f"gc --dry-run: {t_dry:.2f}s, would expire {len(dry.expired)} snapshots and delete "
              f"{dry.deleted_objects} objects ({dry.deleted_bytes / 1e9:.3f} GB); reachable {dry.reachable_objects}",
              flush=True)
        rows.append(("gc --dry-run (expire plan + mark + list)", f"{t_dry:.2f}",
                     f"{(dry.reachable_objects + dry.candidates) / t_dry:,.0f} objects/s", "",
                     f"{dry.candidates} would go, {dry.reachable_objects} reachable"))

        from tensorstore_ck.maintain.reach import Marked, kept_roots, mark  # the mark phase alone
        roots = kept_roots(store.core, exclude={bytes.fromhex(r) for r in dry.expired})
        evict(path)
        t = time.perf_counter()
        marked = Marked()
        n_marked = mark(store.core, roots, marked, set())
        marked.freeze()
        t_mark = time.perf_counter() - t
        print(f"mark only: {t_mark:.2f}s for {n_marked} reachable objects of {len(roots)} kept snapshots",
              flush=True)
        rows.append(("gc mark phase alone (cold cache)", f"{t_mark:.2f}", f"{n_marked / t_mark:,.0f} objects/s", "",
                     f"{n_marked} objects, {len(roots)} kept snapshots"))
        store.close()

        evict(path)
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-gc", path],
                             capture_output=True, text=True, check=True)
        g = json.loads(out.stdout.strip().splitlines()[-1])
        added = None if g["vmhwm_gc_kib"] is None else (g["vmhwm_gc_kib"] - g["vmrss_before_kib"]) * 1024
        print(f"gc (child process): {g['seconds']:.2f}s, expired {g['expired_n']}, deleted {g['deleted_objects']} "
              f"objects ({g['deleted_bytes'] / 1e9:.3f} GB) {g['deleted_by_kind']}, rescued {g['rescued']}; "
              f"ru_maxrss {g['rss_before_kib'] / 1024:.0f} MiB after import+open -> "
              f"{g['rss_peak_kib'] / 1024:.0f} MiB after gc; RSS before gc {g['vmrss_before_kib'] / 1024:.0f} MiB, "
              f"peak during gc (VmHWM) {(g['vmhwm_gc_kib'] or 0) / 1024:.0f} MiB", flush=True)
        sweep = max(1e-9, g["seconds"] - t_dry)
        rows.append(("gc (full run, child process, cold cache)", f"{g['seconds']:.2f}",
                     f"{g['deleted_objects'] / g['seconds']:,.0f} deleted/s overall", "",
                     f"{g['deleted_objects']} deleted, {g['reachable_objects']} kept"))
        rows.append(("gc deletion (full run minus dry run)", f"{sweep:.2f}",
                     f"{g['deleted_objects'] / sweep:,.0f} deleted/s", "",
                     "deletes on the store's I/O threads, then directory fsyncs"))
        listed = g["reachable_objects"] + g["candidates"]
        rows.append(("gc peak RSS (ru_maxrss of the child)", "", f"{g['rss_peak_kib'] / 1024:.0f} MiB", "",
                     f"{g['rss_before_kib'] / 1024:.0f} MiB after import (torch) + open, before gc"))
        if added is not None:
            rows.append(("gc's own memory at its peak (VmHWM - VmRSS before)", "", f"{added / 2**20:.1f} MiB", "",
                         f"{added / max(1, listed):.0f} B per object in the store ({listed:,})"))

        store = tsck.open_store(path)
        after = store.fsck(full=False)
        store.close()
        assert after.ok and after.orphans == 0, (after.orphans, [str(f) for f in after.findings[:5]])
        left = count_objects(path)
        print(f"after gc: fsck --quick ok, {after.orphans} orphans; {left['blocks'][0]} blocks, "
              f"{left['nodes'][0]} nodes, {left['commits'][0]} commits on disk", flush=True)

        print()
        print(f"Store: {n_obj:,} objects ({n_blocks:,} blocks of 4 KiB, {block_bytes / 1e9:.2f} GB), "
              f"{a.jobs * a.snapshots} snapshots, keep_last={a.keep} -> {g['deleted_objects']:,} objects deleted "
              f"by gc. Build {t_build:.0f}s. {os.cpu_count()} cpus; cold = page cache of the store's files "
              f"evicted (fadvise).")
        print()
        print("| operation | seconds | throughput | GB/s | notes |")
        print("|---|---:|---:|---:|---|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
    finally:
        if a.keep_store:
            print(f"(store kept at {path})")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
