#!/usr/bin/env python
"""gc at scale: offline gc's memory per object and its mark, list and sweep rates on
stores of millions of objects, and the projection to 180 M objects.

Builds one local store through the project's own put path (``put_snapshot``; every
object is a valid stored object: framed, lz4, BLAKE3-addressed), with tiny blocks so
that millions of objects cost little disk: each block is 4 KiB of raw bytes, all zero
but a unique 8-byte stamp, so lz4 stores it in ~120 bytes (one filesystem block).
Tensors hold 64 blocks each. Two jobs:

* ``archive`` (no retention rules: keeps everything): each snapshot adds 2 x
  --per-put new blocks (an append-only history: most of the store is reachable);
* ``run0`` (``keep_last=2``): a training job's state of 2 x --per-put blocks in one
  dict (one manifest node), half of whose tensors change at every snapshot, so a
  kept snapshot names again every block it shares with the previous one (the mark
  meets those blocks once per snapshot) and each expired one leaves --per-put
  blocks of garbage;
* every snapshot also holds one base of 32 tensors shared by all of them (the same
  subtree in every tree: the mark walks it once and skips it after).

The store grows in stages: at each stage it is filled (rounds of archive, run0)
until it holds --sizes[i] objects, then, each in a child process: ``gc
--dry-run`` with this checkout and, with --peer SRC, with another checkout of the
project (the same store, the same plan: expire, mark, list; the A/B of the mark's
memory), then ``gc`` itself (run_gc, as ``tsck gc`` runs it; default lease and
phases). A child reports its GCReport with the seconds of its mark, list and
sweep, and its memory: the kernel's high-water mark (VmHWM, reset after import
and open_store through /proc/self/clear_refs) minus the RSS of the idle open
store, i.e. what gc added at its peak. Memory per object is that peak over the
reachable objects and over the listed objects (reachable + candidates). The
stages are fitted with a line, peak = a + b x listed objects (least squares), and
projected to --project objects (180 M) with the same share of reachable objects.

The builder writes without fsync (a throwaway store; ``os.sync()`` before each gc):
building is what takes time here, not gc (~1,600 objects/s on 2 busy cores: 5 M
take ~50 minutes). Each object is a small file: on a filesystem with 4 KiB blocks 5 M
of them take ~20 GB, and removing them one by one takes as long again, so give the
store a filesystem of its own, with 1 KiB blocks, and drop it with one umount
(~6 GB and ~5 M inodes at 5 M objects). Typical use:

    truncate -s 12G /work/tmp-gcmem/img && mkfs.ext4 -q -b 1024 -I 128 -i 1600 /work/tmp-gcmem/img
    mkdir -p /work/tmp-gcmem/mnt && mount -o loop,noatime /work/tmp-gcmem/img /work/tmp-gcmem/mnt
    git archive BASE tensorstore_ck | tar -x -C /work/tmp-gcmem/peer   # the checkout to compare with
    .venv/bin/python benches/bench_gc_scale.py --dir /work/tmp-gcmem/mnt --peer /work/tmp-gcmem/peer \
        | tee benches/results/gc_scale.txt
    umount /work/tmp-gcmem/mnt && rm /work/tmp-gcmem/img
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
    """Fills the store in rounds (archive, run0) through put_snapshot."""

    def __init__(self, path: str, per_put: int, workers: int, stamp: int = 0):
        """stamp: where new blocks' stamps start (a store built before, grown further:
        past every stamp it holds, so new blocks are new objects)."""
        self.path, self.per_put, self.workers = path, per_put, workers
        self.puts = 0
        self.seconds = 0.0
        store = tsck.open_store(path, block_size=BLOCK, inline_threshold=0, workers=workers)
        store.set_retention("run0", tsck.Retention(keep_last=2))
        store.close()
        self.base = _tensors(0, BASE_TENSORS * ROWS, "b")
        self.stamp = max(stamp, BASE_TENSORS * ROWS)
        self.run = _tensors(self.stamp, 2 * per_put, "w")  # run0's state; half changes per snapshot
        self.stamp += 2 * per_put

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
                for job in ("archive", "run0"):
                    if job == "archive":
                        state = _tensors(self.stamp, 2 * self.per_put, "t")
                        self.stamp += 2 * self.per_put
                    else:
                        names = sorted(self.run)
                        fresh = _tensors(self.stamp, self.per_put, "x")
                        self.stamp += self.per_put
                        for name, t in zip(names[self.puts % 2::2], fresh.values()):
                            self.run[name] = t
                        state = self.run
                    st = store.put_snapshot({"base": self.base, "own": state, "step": self.puts},
                                            ref=f"{job}/main", step=self.puts, job=job)
                    self.puts += 1
                    held += st.blocks_new + 2  # + its commit and node (counted exactly after the fill)
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


def child_gc(path: str, dry_run: bool) -> int:
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
    rep = store.gc(dry_run=dry_run)
    wall = time.perf_counter() - t
    hwm_kib = _status_kib("VmHWM") if hwm_reset else None
    maxrss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    store.close()
    d = rep.to_json()
    for k in ("would_delete", "expired", "snapshots"):
        d.pop(k, None)
    d.update(wall=wall, base_kib=base_kib, hwm_kib=hwm_kib, maxrss_kib=maxrss_kib, expired_n=len(rep.expired),
             code=os.path.dirname(os.path.dirname(os.path.abspath(tsck.__file__))))
    print(json.dumps(d))
    return 0


def _child(path: str, dry_run: bool, code: str) -> dict:
    env = dict(os.environ, PYTHONPATH=code)
    cmd = [sys.executable, os.path.abspath(__file__), "--child-gc", path] + (["--dry-run"] if dry_run else [])
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode:
        print(out.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"gc child failed ({out.returncode}): {' '.join(cmd)}")
    g = json.loads(out.stdout.strip().splitlines()[-1])
    g["added"] = None if g["hwm_kib"] is None else (g["hwm_kib"] - g["base_kib"]) * 1024
    g["listed"] = g["reachable_objects"] + g["candidates"]
    g["load"] = os.getloadavg()
    return g


def _fit(xs, ys):
    """Least squares line y = a + b x -> (a, b)."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(x) < 2:
        return 0.0, float(y[0] / x[0])
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def report(stages: list, peer: bool, project: float) -> None:
    """The table, the fit and the projection."""
    mib = 2 ** 20
    print()
    print(f"Local store, 4 KiB blocks (~120 B each stored, after lz4), tensors of {ROWS} blocks; "
          f"{os.cpu_count()} cpus shared; 1-minute load average when each gc ended: "
          f"{', '.join(format(st['gc']['load'][0], '.1f') for st in stages)}.")
    print()
    print("| objects (blocks / nodes / commits) | reachable | garbage deleted | mark | list | sweep | gc wall "
          "| gc peak added | B / reachable | B / listed |" + (" peer dry-run peak | peer B / listed |" if peer else ""))
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if peer else ""))
    for st in stages:
        g, k = st["gc"], st["by_kind"]
        # the gc's own mark and list; the dry run's memory beside the peer's on the same store
        row = [f"{st['objects']:,} ({k['blocks']:,} / {k['nodes']:,} / {k['commits']:,})",
               f"{g['reachable_objects']:,}", f"{g['deleted_objects']:,}",
               f"{g.get('mark_seconds', 0):.1f} s ({g['reachable_objects'] / max(1e-9, g.get('mark_seconds', 0)):,.0f}/s)",
               f"{g.get('list_seconds', 0):.1f} s ({g['listed'] / max(1e-9, g.get('list_seconds', 0)):,.0f}/s)",
               f"{g.get('sweep_seconds', 0):.1f} s ({g['deleted_objects'] / max(1e-9, g.get('sweep_seconds', 0)):,.0f}/s)",
               f"{g['wall']:.1f} s", f"{g['added'] / mib:.1f} MiB",
               f"{g['added'] / max(1, g['reachable_objects']):.1f}", f"{g['added'] / max(1, g['listed']):.1f}"]
        if peer and "peer" not in st:
            row += ["", ""]
        elif peer:
            p = st["peer"]
            row += [f"{p['added'] / mib:.1f} MiB (this: {st['dry']['added'] / mib:.1f})",
                    f"{p['added'] / max(1, p['listed']):.1f} (this: {st['dry']['added'] / max(1, st['dry']['listed']):.1f})"]
        print("| " + " | ".join(row) + " |")
    print()
    xs = [st["gc"]["listed"] for st in stages]
    ys = [st["gc"]["added"] for st in stages]
    ia, ib = _fit(xs, ys)
    share = sum(st["gc"]["reachable_objects"] for st in stages) / max(1, sum(xs))
    n = project
    print(f"Fit over {len(stages)} stages: gc peak added = {ia / mib:.1f} MiB + {ib:.1f} B x listed objects "
          f"(reachable share {share:.0%}).")
    last = stages[-1]["gc"]
    mark_rate = last["reachable_objects"] / max(1e-9, last.get("mark_seconds", 0))
    list_rate = last["listed"] / max(1e-9, last.get("list_seconds", 0))
    sweep_rate = last["deleted_objects"] / max(1e-9, last.get("sweep_seconds", 0))
    print(f"Projection to {n / 1e6:.0f} M objects: {ia / mib:.0f} MiB + {ib:.1f} B x {n / 1e6:.0f} M = "
          f"{(ia + ib * n) / 2**30:.2f} GiB. At the last stage's rates (mark {mark_rate:,.0f} reachable/s, "
          f"list {list_rate:,.0f}/s, sweep {sweep_rate:,.0f} deleted/s): mark {n * share / mark_rate / 60:.0f} min, "
          f"list {n / list_rate / 60:.0f} min, sweep {n * (1 - share) / sweep_rate / 60:.0f} min "
          f"({1 - share:.0%} garbage).")
    ab = [st for st in stages if "peer" in st and "dry" in st]
    if ab:
        pa, pb = _fit([st["peer"]["listed"] for st in ab], [st["peer"]["added"] for st in ab])
        da, db = _fit([st["dry"]["listed"] for st in ab], [st["dry"]["added"] for st in ab])
        print(f"gc --dry-run, same stores: peer {pa / mib:.1f} MiB + {pb:.1f} B x listed -> "
              f"{(pa + pb * n) / 2**30:.2f} GiB at {n / 1e6:.0f} M; this checkout {da / mib:.1f} MiB + {db:.1f} B x "
              f"listed -> {(da + db * n) / 2**30:.2f} GiB (peer / this at the last stage: "
              f"{ab[-1]['peer']['added'] / max(1, ab[-1]['dry']['added']):.2f}x; {len(ab)} stages).")


def stages_from_log(path: str) -> list:
    """The stages a run printed (its "built" and child lines): the table again without
    re-running, e.g. from a run whose store removal was cut short."""
    stages, st = [], None
    with open(path) as f:
        for line in f:
            if line.startswith("built "):
                n = int(line.split()[1].replace(",", ""))
                kinds = json.loads(line[line.index("{"):line.index("}") + 1].replace("'", '"'))
                st = {"objects": n, "by_kind": kinds}
                stages.append(st)
            elif st is not None and line.startswith("  gc"):
                key = "dry" if "(this checkout)" in line else "peer" if "(peer)" in line else "gc"
                st[key] = json.loads(line[line.index("{"):])
    return [st for st in stages if "gc" in st]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where to build the store (default: a temp dir under /work or /tmp)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 2_500_000, 5_000_000],
                    help="objects in the store at each gc")
    ap.add_argument("--per-put", type=int, default=50_000, help="run0's new blocks per snapshot (archive: twice)")
    ap.add_argument("--workers", type=int, default=8, help="store I/O threads for the build")
    ap.add_argument("--peer", default=None, help="another checkout of the project: its gc --dry-run, same store")
    ap.add_argument("--project", type=float, default=180e6, help="objects to project to")
    ap.add_argument("--keep-store", action="store_true")
    ap.add_argument("--from-log", metavar="LOG", help="print the table of an earlier run's output and exit")
    ap.add_argument("--resume", metavar="STORE", help="grow a store an earlier run kept (--keep-store) instead")
    ap.add_argument("--gc-only", action="store_true", help="no dry runs (this checkout's or the peer's)")
    ap.add_argument("--child-gc", metavar="STORE", help=argparse.SUPPRESS)
    ap.add_argument("--dry-run", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child_gc:
        return child_gc(a.child_gc, a.dry_run)
    if a.from_log:
        stages = stages_from_log(a.from_log)
        report(stages, any("peer" in st for st in stages), a.project)
        return 0

    parent = a.dir or ("/work" if os.access("/work", os.W_OK) else None)
    if parent:
        os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="tsck-bench-gc-scale-", dir=parent)
    path = os.path.join(tmp, "store")
    if a.resume:  # grown in place; removed with tmp unless --keep-store
        os.rename(a.resume, path)
    here = os.path.dirname(os.path.dirname(os.path.abspath(tsck.__file__)))
    stages = []
    try:
        print(f"# bench_gc_scale: tensorstore_ck {tsck.__version__} from {here}, python {platform.python_version()}, "
              f"numpy {np.__version__}, {os.cpu_count()} cpus, store under {tmp}; "
              f"load average at start {os.getloadavg()}", flush=True)
        b = Builder(path, a.per_put, a.workers, stamp=(1 << 48) + (int(time.time()) << 20) if a.resume else 0)
        for target in a.sizes:
            b.fill(target)
            objs = count_objects(path)
            st = {"objects": sum(objs.values()), "by_kind": objs, "build_s": b.seconds, "snapshots": b.puts}
            print(f"built {st['objects']:,} objects {objs} ({b.puts} snapshots) in {b.seconds:.0f}s so far; "
                  f"load {os.getloadavg()}", flush=True)
            if not a.gc_only:
                st["dry"] = _child(path, True, here)
                print("  gc --dry-run (this checkout):", json.dumps(st["dry"]), flush=True)
            if a.peer and not a.gc_only:
                st["peer"] = _child(path, True, os.path.abspath(a.peer))
                print("  gc --dry-run (peer):", json.dumps(st["peer"]), flush=True)
            st["gc"] = _child(path, False, here)
            print("  gc:", json.dumps(st["gc"]), flush=True)
            stages.append(st)
    finally:
        if a.keep_store:
            print(f"(store kept at {path})")
        else:
            t = time.perf_counter()
            shutil.rmtree(tmp, ignore_errors=True)
            print(f"(store removed in {time.perf_counter() - t:.0f}s)", flush=True)

    report(stages, bool(a.peer), a.project)
    return 0


if __name__ == "__main__":
    sys.exit(main())
