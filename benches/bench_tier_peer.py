#!/usr/bin/env python
"""Restore of a collective snapshot through local tiers: from the rank's own tier, from a
peer's replica after the tier was lost, and from S3 with no replica left. One S3 server,
one run, real gloo ranks (each phase is a fresh job: the ranks are started again, as
after a failure).

The server: --endpoint (or $TEST_S3_ENDPOINT with $TEST_S3_KEY/$TEST_S3_SECRET); without
one the script starts Ceph's radosgw with .ci/start-rgw.sh and stops it at the end.
Each rank opens open_store(s3://..., local=<dir>/node<r>, replicas=1), one directory per
rank standing for one node's disk (here all on this machine's disk, --dir).

Per repeat:
  put      every rank holds its row range of a sharded fp32 tensor (--scale GB in all)
           and a collective put_snapshot writes it; wait_durable; replicas sent.
  local    a restart, tiers intact: a collective checkout into the ranks' regions;
  peer     rank 1's tier deleted: rank 1's region comes from rank 2's replica;
  remote   every tier deleted: every region comes from S3.
Before each restore the page cache is dropped (drop_caches). A phase's time is the
slowest rank's open_store + checkout (the checkout alone is reported too; the zeroed
tensors it restores into are made before it, as a job's model is, and timed apart); `peer`
also reports rank 1's own. Bit-identity of every
region is checked in every phase.

    .venv/bin/python benches/bench_tier_peer.py --repeats 3 | tee benches/results/tier_peer.txt
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

GB = 1e9
REF = "bench/main"
COLS = 4096


def _rows(scale: float) -> int:
    return max(64, int(scale * GB / (COLS * 4)))


def _region(rows: int, world: int, rank: int) -> tuple[int, int]:
    per = -(-rows // world)
    return min(rows, rank * per), min(rows, (rank + 1) * per)


def _part(rows: int, world: int, rank: int):
    import torch
    a, b = _region(rows, world, rank)
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(b - a, COLS, generator=g)


def _rank(rank: int, world: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist
    import tensorstore_ck as tsck
    os.environ.setdefault("TSCK_PEER_HOST", "127.0.0.1")
    dist.init_process_group("gloo", init_method=cfg["init"], rank=rank, world_size=world)
    rows, phase = cfg["rows"], cfg["phase"]
    a, b = _region(rows, world, rank)
    res = {"rank": rank}
    t0 = time.perf_counter()
    store = tsck.open_store(cfg["url"], refs=cfg["refs"], storage_options=cfg["opts"],
                            local=os.path.join(cfg["tiers"], f"node{rank}"), replicas=1)
    res["open_s"] = time.perf_counter() - t0
    try:
        if phase == "put":
            part = _part(rows, world, rank)
            t1 = time.perf_counter()  # (the state's making is not the put's)
            info = store.put_snapshot({"w": tsck.Sharded(part, (rows, COLS), (a, 0))}, REF, step=1)
            res["return_s"] = time.perf_counter() - t1
            assert store.wait_durable(timeout=1800), "the upload did not finish"
            res["durable"] = info.root
        else:
            # The tensors to restore into exist before the restore, as a job's model does
            # (made at its start, whatever it restores); making them is reported apart.
            ta = time.perf_counter()
            into = {"w": tsck.Sharded(torch.zeros(b - a, COLS), (rows, COLS), (a, 0))}
            res["alloc_s"] = time.perf_counter() - ta
            t1 = time.perf_counter()
            got = store.checkout(REF, into=into, timeout=600)
            res["checkout_s"] = time.perf_counter() - t1
            res["restore_s"] = res["open_s"] + res["checkout_s"]
            res["same"] = bool(torch.equal(got["w"].local, _part(rows, world, rank)))
            tier = store._tier  # (its counters: tier/local.py)
            res["fetched_from_peers"] = getattr(getattr(tier, "peers", None), "fetched", None)
            res["read_from_remote"] = getattr(getattr(tier, "reads", None), "missing", None)
        dist.barrier()
    finally:
        store.close()
        dist.destroy_process_group()
    with open(os.path.join(cfg["out"], f"{phase}-{rank}.json"), "w") as f:
        json.dump(res, f)


def _worker(rank: int, world: int, cfg: dict) -> None:
    _rank(rank, world, cfg)


def run_phase(world: int, cfg: dict) -> list[dict]:
    import torch.multiprocessing as mp
    cfg = dict(cfg, init=f"file://{tempfile.mktemp(prefix='tsck-bench-rdv-')}")
    mp.spawn(_worker, args=(world, cfg), nprocs=world, join=True)
    return [json.load(open(os.path.join(cfg["out"], f"{cfg['phase']}-{r}.json"))) for r in range(world)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.3, help="GB in all, over the ranks (default 0.3)")
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--phases", default="local,peer,remote",
                    help="restores to run, in this order (peer needs --world 2 or more)")
    import bench_s3
    bench_s3.add_server_args(ap, "tsck-bench-peer")
    ap.add_argument("--dir", default="/work", help="parent folder of the ranks' local tiers")
    a = ap.parse_args()
    phases = [p for p in a.phases.split(",") if p]
    if set(phases) - {"local", "peer", "remote"} or ("peer" in phases and a.world < 2):
        ap.error("--phases: local, peer, remote (peer with --world 2 or more)")

    import bench_core as core
    import torch
    tsck = core.import_tsck()
    rgw_dir, opts, fs = bench_s3.connect(a)
    rows = _rows(a.scale)
    print(f"# {platform.node()} {os.cpu_count()} cores, torch {torch.__version__}, S3 at {a.endpoint}"
          f"{' (radosgw started by this script)' if rgw_dir else ''}; tiers under {a.dir}")
    print(f"# state: {rows * COLS * 4 / GB:.3f} GB fp32 ({rows} x {COLS}) sharded by rows over {a.world} ranks; "
          f"replicas=1; repeats {a.repeats}")
    rows_out = collections.defaultdict(list)
    try:
        for rep in range(a.repeats):
            run = uuid.uuid4().hex[:8]
            scratch = tempfile.mkdtemp(prefix="tsck-bench-peer-", dir=a.dir)
            try:
                url = f"s3://{a.bucket}/{run}/store"
                cfg = {"url": url, "opts": opts, "refs": os.path.join(scratch, "refs.lmdb"), "rows": rows,
                       "tiers": os.path.join(scratch, "tiers"), "out": scratch}
                tsck.open_store(url, refs=cfg["refs"], storage_options=opts).close()
                put = run_phase(a.world, dict(cfg, phase="put"))
                rows_out["put returns (slowest rank), s"].append(max(r["return_s"] for r in put))
                res = {}
                for phase in phases:
                    if phase == "peer":
                        shutil.rmtree(os.path.join(cfg["tiers"], "node1"))
                    if phase == "remote":
                        shutil.rmtree(cfg["tiers"])
                    core.evict(scratch)
                    res[phase] = run_phase(a.world, dict(cfg, phase=phase))
                    assert all(r["same"] for r in res[phase]), f"{phase}: a region is not bit-identical"
                    rows_out[f"restore {phase} (slowest rank), s"].append(max(r["restore_s"] for r in res[phase]))
                    rows_out[f"  of which checkout, {phase} (slowest rank), s"].append(
                        max(r["checkout_s"] for r in res[phase]))
                    rows_out[f"  (apart: zeroed tensors made, {phase}, slowest rank), s"].append(
                        max(r["alloc_s"] for r in res[phase]))
                one = min(1, a.world - 1)  # rank 1, the rank whose tier the peer phase loses
                for phase in ("peer", "remote"):
                    if phase in res:
                        rows_out[f"restore {phase} (rank {one}), s"].append(res[phase][one]["restore_s"])
                r = {k: v[-1] for k, v in rows_out.items()}
                if "local" in res and "remote" in res:
                    rows_out["remote / local (speedup)"].append(
                        r["restore remote (slowest rank), s"] / r["restore local (slowest rank), s"])
                if "peer" in res and "remote" in res:
                    rows_out["remote / peer, rank 1 (speedup)"].append(
                        r["restore remote (rank 1), s"] / r["restore peer (rank 1), s"])
                said = [f"{p} {max(x['restore_s'] for x in res[p]):.2f} s (open {max(x['open_s'] for x in res[p]):.2f}, "
                        f"checkout {max(x['checkout_s'] for x in res[p]):.2f})" for p in phases]
                if "peer" in res:
                    said.append(f"peer fetched {res['peer'][1]['fetched_from_peers']}, remote reads "
                                f"{res['peer'][1]['read_from_remote']}")
                print(f"# repeat {rep + 1}: " + "; ".join(said), flush=True)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
                try:
                    fs.rm(f"{a.bucket}/{run}", recursive=True)
                except (FileNotFoundError, OSError):
                    pass
    finally:
        bench_s3.stop_rgw(rgw_dir)
    print()
    print(f"| measure ({a.repeats} repeats, {a.world} ranks) | median (min–max) |")
    print("|---|---|")
    for name, xs in rows_out.items():
        unit = " s" if name.endswith(", s") else "x"
        print(f"| {name.removesuffix(', s')} | {core.fmt_s(core.summ(xs), '{:.2f}', unit)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
