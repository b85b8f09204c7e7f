"""A DDP restore from S3: each rank reading its own tree, against shared reads (a block
several ranks read is read once, by its owner rank, and sent to the others).

W forked gloo ranks (tests/helpers/shared_reads.py) each hold the same --mb MB model (and
a tensor of their own); one collective snapshot is put, then checked out by W new ranks
without and with shared reads, and by one rank alone (the objects of one rank's state).
A real S3 server: radosgw started here (.ci/start-rgw.sh), or --endpoint; every request
goes through tests/sim/s3proxy.py's ThrottleProxy (a real HTTP proxy, no throttling),
which counts the GETs the server saw. Time: the slowest rank's checkout (its process and
the store already open, the ranks released together by a barrier).

Targets (docs/PERFORMANCE.md, "Restore"): GETs of the W-rank restore <= 1.1x those of one
rank's; the W-rank restore >= 2x faster than without shared reads.

    .venv/bin/python benches/bench_restore.py | tee benches/results/restore.txt
    .venv/bin/python benches/bench_restore.py --ranks 2 --mb 32 --repeats 1    # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import uuid

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benches"))
sys.path.insert(0, os.path.join(REPO, "tests"))

from tests.sim.s3proxy import ThrottleProxy  # noqa: E402

WORKER = os.path.join(REPO, "tests", "helpers", "shared_reads.py")


def run(scenario: str, out: str, spec: dict) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": REPO, "TORCH_CPP_LOG_LEVEL": "ERROR"}
    r = subprocess.run([sys.executable, WORKER, scenario, out, json.dumps(spec)], env=env, capture_output=True,
                       text=True, timeout=900)
    if r.returncode != 0:
        sys.exit(f"{scenario} failed:\n{r.stderr[-4000:]}")
    res = []
    for rank in range(spec["world"]):
        with open(os.path.join(out, f"{scenario}_rank{rank}.json")) as f:
            d = json.load(f)
        if not d.get("ok"):
            sys.exit(f"{scenario}: rank {rank} failed:\n{d.get('error')}")
        res.append(d)
    return res


def main() -> int:
    import bench_s3
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--mb", type=float, default=256.0, help="the model's MB on every rank (default 256)")
    ap.add_argument("--block", type=int, default=4 << 20, help="block size in bytes (default 4 MiB)")
    ap.add_argument("--repeats", type=int, default=3)
    bench_s3.add_server_args(ap, "tsck-bench")
    a = ap.parse_args()
    rgw_dir, opts, _fs = bench_s3.connect(a)
    proxy = ThrottleProxy(a.endpoint)
    popts = {**opts, "endpoint_url": proxy.url}
    try:
        with tempfile.TemporaryDirectory(prefix="tsck-bench-restore-") as d:
            spec = {"url": f"s3://{a.bucket}/restore-{uuid.uuid4().hex}", "opts": popts,
                    "refs": os.path.join(d, "refs.lmdb"), "world": a.ranks, "mb": a.mb, "block": a.block,
                    "shared": False, "liar": None}
            run("put", os.path.join(d, "put"), spec)
            print(f"# {platform.node()} {os.cpu_count()} cores; S3 at {a.endpoint}"
                  f"{' (radosgw started here)' if rgw_dir else ''}, through a counting proxy")
            print(f"# {a.ranks} gloo ranks, the same {a.mb:g} MB model on each ({a.block >> 20} MiB blocks) "
                  f"+ 256 KB of each rank's own; median of {a.repeats}\n")
            rows = {}
            cases = [("one rank alone", 1, False), (f"{a.ranks} ranks, each its own reads", a.ranks, False),
                     (f"{a.ranks} ranks, shared reads", a.ranks, True)]
            for name, world, shared in cases:
                secs, gets = [], []
                for i in range(a.repeats):
                    proxy.reset_counts()
                    res = run("read", os.path.join(d, f"read-{world}-{shared}-{i}"),
                              {**spec, "world": world, "shared": shared})
                    gets.append(proxy.forwarded_by["GET"])
                    secs.append(max(r["seconds"] for r in res))
                rows[name] = (statistics.median(secs), statistics.median(gets))
                print(f"{name:32s} {rows[name][0]:7.2f} s  {rows[name][0] and a.mb * world / rows[name][0]:8.0f} "
                      f"MB/s restored  {rows[name][1]:6.0f} GETs", flush=True)
            one, plain, shared = (rows[n] for n, _w, _s in cases)
            print(f"\nGETs, {a.ranks} ranks shared / one rank: {shared[1] / one[1]:.2f}x (target <= 1.1x); "
                  f"each its own / one rank: {plain[1] / one[1]:.2f}x")
            print(f"restore time, {a.ranks} ranks each its own / shared: {plain[0] / shared[0]:.2f}x faster "
                  "(target >= 2x)")
    finally:
        proxy.close()
        bench_s3.stop_rgw(rgw_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
