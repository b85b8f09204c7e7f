#!/usr/bin/env python
"""What packs cost in space over a job's life (docs/design/scaling.md, "Packs").

A state of many small tensors (all of them packed: each is under the pack size) takes
N snapshots on one ref; before each, a random 10% of the tensors (by count) get new
values. Retention keeps the last K snapshots, and gc runs after every snapshot (it
applies retention, then sweeps). Measured from outside: the bytes under the store's
object prefixes (blocks/, nodes/, commits/) on disk, divided by the state's bytes, at the
end and at worst over the run; and the bytes the snapshots wrote (sum of bytes_new).
Each configuration runs on the same sequence of states: packs of 64 MiB (what an object
store or a local tier uses by default) against pack_size=0 (one block per tensor).
Every snapshot's checkout is compared bit for bit with its state.

    .venv/bin/python benches/bench_packs.py | tee benches/results/packs.txt
    .venv/bin/python benches/bench_packs.py --snapshots 20       # a quick run
    .venv/bin/python benches/bench_packs.py --share 0.5 0.75     # packparts.LIVE_SHARE values to compare
    PYTHONPATH=/tmp/old .venv/bin/python benches/bench_packs.py  # another tree (git worktree add /tmp/old <commit>)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

try:
    import tensorstore_ck as tsck
except ImportError:  # not installed: this checkout's
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import tensorstore_ck as tsck
try:
    from tensorstore_ck.write import packparts
except ImportError:  # a tree from before packs named stored parts (to compare with)
    packparts = type("packparts", (), {"LIVE_SHARE": None})

PREFIXES = ("blocks", "nodes", "commits")


def stored(root: str) -> int:
    n = 0
    for p in PREFIXES:
        for d, _dirs, files in os.walk(os.path.join(root, p)):
            n += sum(os.path.getsize(os.path.join(d, f)) for f in files)
    return n


def states(args):
    """The sequence of states: the same for every configuration (seeded)."""
    g = torch.Generator().manual_seed(args.seed)
    pick = torch.Generator().manual_seed(args.seed + 1)
    st = {f"t{i:04d}": torch.randn(args.elems, generator=g) for i in range(args.tensors)}
    k = max(1, round(args.tensors * args.changed))
    for step in range(1, args.snapshots + 1):
        if step > 1:
            for i in torch.randperm(args.tensors, generator=pick)[:k].tolist():
                st[f"t{i:04d}"] = torch.randn(args.elems, generator=g)
        yield step, st


def run(args, pack_size: int, share: float) -> dict:
    packparts.LIVE_SHARE = share
    root = tempfile.mkdtemp(prefix="bench_packs_", dir=args.dir)
    try:
        size = args.tensors * args.elems * 4
        worst, written, t0 = 0.0, 0, time.perf_counter()
        with tsck.open_store(root, pack_size=pack_size, compression="none") as s:
            s.set_retention("j", tsck.Retention(keep_last=args.keep))
            for step, st in states(args):
                info = s.put_snapshot(st, ref="j/main", step=step)
                written += info.bytes_new
                s.gc()
                got = s.checkout("j/main")
                assert all(torch.equal(got[k], v) for k, v in st.items()), f"step {step}: not bit-identical"
                worst = max(worst, stored(root) / size)
        return {"pack_size": pack_size, "share": share, "final": stored(root) / size, "worst": worst,
                "written": written / size, "seconds": time.perf_counter() - t0}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--snapshots", type=int, default=120)
    ap.add_argument("--tensors", type=int, default=400)
    ap.add_argument("--elems", type=int, default=4096, help="float32 elements a tensor (16 KiB)")
    ap.add_argument("--changed", type=float, default=0.10, help="share of the tensors changed per snapshot")
    ap.add_argument("--keep", type=int, default=3, help="retention: keep_last")
    ap.add_argument("--share", type=float, nargs="+", default=[packparts.LIVE_SHARE])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    size = args.tensors * args.elems * 4
    print(f"{args.snapshots} snapshots of {args.tensors} tensors x {args.elems * 4} B ({size / 1e6:.1f} MB), "
          f"{args.changed:.0%} changed each, keep_last={args.keep}, gc after each; store bytes / state bytes\n")
    print("| pack_size | live share | store at the end | store at worst | written (sum of bytes_new) | seconds |")
    print("|---|---|---|---|---|---|")
    rows = [run(args, 0, packparts.LIVE_SHARE)] + [run(args, 64 << 20, sh) for sh in args.share]
    for r in rows:
        print(f"| {r['pack_size'] >> 20} MiB | {r['share'] if r['pack_size'] else '-'} | {r['final']:.2f}x | "
              f"{r['worst']:.2f}x | {r['written']:.2f}x | {r['seconds']:.1f} |")


if __name__ == "__main__":
    main()
