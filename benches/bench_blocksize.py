#!/usr/bin/env python
"""Block-size benchmark: what the default ``block_size`` of tensorstore_ck trades off.

For each block size (1, 2, 4, 8, 16 MiB by default), on a GPT-style fp32 state with AdamW
moments (~0.75 GB by default):

* ``put_snapshot`` GB/s into a fresh store (timed through ``os.sync()``);
* ``checkout`` GB/s with the page cache evicted (new tensors);
* dedup granularity: ``bytes_new`` / ``blocks_new`` of a second ``put_snapshot`` (same store,
  same ref) after one row changed in each of ~10% of the tensors stored as blocks (those above
  the 16 KiB inline threshold; a 1-D tensor: one element). With row-aligned blocks the ideal is
  one block per changed tensor (the whole tensor when it is smaller than a block).

Block sizes are tried in a rotated order on each repeat so drift in disk speed is spread;
medians (min–max) over repeats. 1 GB = 1e9 bytes. See benches/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_core import (  # noqa: E402
    GB, MiB, REF, build_state, evict, fmt_s, import_tsck, iter_tensors, pick_tensors, rm,
    state_nbytes, summ, timed, trim_memory,
)


def change_one_row(t: torch.Tensor, bump: float) -> int:
    """Change one row (the middle one along dim 0) of t in place; returns the bytes changed."""
    with torch.no_grad():
        if t.dim() == 0:
            t.add_(bump if t.dtype.is_floating_point else 1)
            return t.element_size()
        row = t[t.shape[0] // 2]
        row.add_(bump if t.dtype.is_floating_point else 1)
        return row.numel() * t.element_size()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1,2,4,8,16", help="block sizes in MiB, comma separated")
    ap.add_argument("--scale", type=float, default=0.75, help="target state size in GB (default 0.75)")
    ap.add_argument("--small", action="store_true", help="~0.2 GB smoke run")
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=8192,
                    help="vocabulary (default 8192, so the embeddings do not crowd out the blocks)")
    ap.add_argument("--inline-threshold", type=int, default=16 * 1024,
                    help="tensors up to this size are inlined (not blocks) and never picked for the row edits")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--changed", type=float, default=0.10, help="fraction of tensors with one changed row")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /work)")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    tsck = import_tsck()

    def log(*a):
        print(*a, flush=True)

    sizes = [int(x) for x in args.sizes.split(",")]
    if args.small:
        state, _, _ = build_state(0.2 * GB, 256, vocab=8192, log=log)
    else:
        state, _, _ = build_state(args.scale * GB, args.d_model, vocab=args.vocab, log=log)
    nbytes = state_nbytes(state)
    tensors = [t for _, t in iter_tensors(state)]
    changed = pick_tensors(state, args.changed, seed=2, min_bytes=args.inline_threshold)
    n_blocky = sum(1 for t in tensors if t.nbytes > args.inline_threshold)
    log(f"# state: {nbytes/GB:.3f} GB in {len(tensors)} tensors, {n_blocky} above the inline threshold; "
        f"one row changes in {len(changed)} of those (their sizes, MiB: "
        f"{sorted(round(t.nbytes / MiB, 2) for t in changed)})")

    base = args.dir or tempfile.mkdtemp(prefix="tsck-bsbench-", dir="/work")
    os.makedirs(base, exist_ok=True)
    p_store = os.path.join(base, "store")
    log(f"# scratch dir: {base}")

    R = {bs: {"put": [], "checkout": [], "incr": [], "bytes_new": [], "blocks_new": [], "blocks_total": [],
              "row_bytes": [], "disk": []} for bs in sizes}
    problems = []
    bump = 1e-3
    try:
        for rep in range(args.repeats):
            k = rep % len(sizes)
            for bs in sizes[k:] + sizes[:k]:
                rm(p_store)
                opts = {"block_size": bs * MiB}
                if args.workers:
                    opts["workers"] = args.workers
                s = tsck.open_store(p_store, **opts)
                try:
                    tm = timed(lambda: s.put_snapshot(state, ref=REF, step=1))
                finally:
                    s.close()
                R[bs]["put"].append(nbytes / GB / tm.seconds)
                R[bs]["blocks_total"].append(tm.result.blocks_total)
                R[bs]["disk"].append(sum(os.path.getsize(os.path.join(r, n))
                                         for r, _, ns in os.walk(p_store) for n in ns))
                trim_memory()

                s = tsck.open_store(p_store, create=False, **opts)
                try:
                    evict(p_store)
                    tc = timed(lambda: s.checkout(REF), sync=False)
                finally:
                    s.close()
                R[bs]["checkout"].append(nbytes / GB / tc.seconds)
                tc = None
                trim_memory()

                row_bytes = sum(change_one_row(t, bump) for t in changed)
                s = tsck.open_store(p_store, create=False, **opts)
                try:
                    ti = timed(lambda: s.put_snapshot(state, ref=REF, step=2))
                finally:
                    s.close()
                R[bs]["incr"].append(ti.seconds)
                R[bs]["bytes_new"].append(ti.result.bytes_new)
                R[bs]["blocks_new"].append(ti.result.blocks_new)
                R[bs]["row_bytes"].append(row_bytes)
                if ti.result.blocks_new > len(changed) * 2:
                    problems.append(f"block_size {bs} MiB: blocks_new {ti.result.blocks_new} > 2 x changed tensors")
                log(f"  rep {rep+1} bs {bs:>2} MiB: put {R[bs]['put'][-1]:.3f} GB/s, "
                    f"checkout {R[bs]['checkout'][-1]:.3f} GB/s, blocks {tm.result.blocks_total}; "
                    f"after row edits: {ti.seconds:.2f}s bytes_new {ti.result.bytes_new/1e6:.1f} MB "
                    f"blocks_new {ti.result.blocks_new}")
                tm = ti = None
                trim_memory()
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
        else:
            rm(p_store)

    # put GB/s ratio to the 4 MiB default, per repeat (repeats pair up the same disk period)
    ref_bs = 4 if 4 in sizes else sizes[0]
    lines = [f"State: {nbytes/GB:.2f} GB (GPT-style fp32 + AdamW moments, {len(tensors)} tensors); "
             f"{args.repeats} repeat(s); one row changed in each of {len(changed)} of the {n_blocky} tensors above "
             f"the inline threshold before the second put. "
             f"tensorstore_ck {getattr(tsck, '__version__', '?')}. Cells: median (min–max); "
             f"ratios are to {ref_bs} MiB in the same repeat.", "",
             f"| block size | put GB/s | put ÷ {ref_bs} MiB | checkout GB/s | checkout ÷ {ref_bs} MiB | blocks | "
             "2nd put bytes_new (MB) | 2nd put blocks_new | 2nd put time (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    out = {}
    for bs in sizes:
        r = R[bs]
        pr = [a / b for a, b in zip(r["put"], R[ref_bs]["put"])]
        cr = [a / b for a, b in zip(r["checkout"], R[ref_bs]["checkout"])]
        row = {"put_gbps": summ(r["put"]), "put_vs_ref": summ(pr), "checkout_gbps": summ(r["checkout"]),
               "checkout_vs_ref": summ(cr), "blocks_total": summ(r["blocks_total"]),
               "bytes_new_mb": summ([b / 1e6 for b in r["bytes_new"]]), "blocks_new": summ(r["blocks_new"]),
               "incr_s": summ(r["incr"]), "disk_gb": summ([b / GB for b in r["disk"]]), "raw": r}
        out[bs] = row
        lines.append(f"| {bs} MiB | {fmt_s(row['put_gbps'])} | {fmt_s(row['put_vs_ref'], unit='x')} | "
                     f"{fmt_s(row['checkout_gbps'])} | {fmt_s(row['checkout_vs_ref'], unit='x')} | "
                     f"{row['blocks_total']['median']:.0f} | {fmt_s(row['bytes_new_mb'], '{:.1f}')} | "
                     f"{row['blocks_new']['median']:.0f} | {fmt_s(row['incr_s'])} |")
    rb = R[sizes[0]]["row_bytes"][0] if R[sizes[0]]["row_bytes"] else 0
    lines += ["", f"Bytes actually changed by the row edits: {rb/1e6:.2f} MB; state {nbytes/1e6:.0f} MB."]
    table = "\n".join(lines)
    log("\n" + table + "\n")
    if problems:
        log("PROBLEMS:\n  " + "\n  ".join(problems))
    if args.json_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump({"bench": "bench_blocksize", "time": time.time(), "argv": sys.argv, "state_bytes": nbytes,
                       "tensors": len(tensors), "changed_tensors": len(changed), "row_bytes": rb,
                       "results": {str(k): v for k, v in out.items()}, "markdown": table, "problems": problems},
                      f, indent=1)
        log(f"# wrote {args.json_out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
