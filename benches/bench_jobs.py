#!/usr/bin/env python
"""Dozens of training jobs on one store: does every job keep what its retention says,
does any snapshot fail, and what do the others' prunes cost a job's puts?

Each job is a process of its own (tests/helpers/jobs_worker.py): an asynchronous
CheckpointManager with Retention(keep_last=K) that snapshots every `--interval`
seconds (a frozen tensor every job shares, plus `--mb` MB of per-job weights that
change every step) and prunes as it trains. First one job runs alone for
`--lone-seconds` (the peer: the same put with nobody else on the store), then
`--jobs` jobs run together for `--seconds`, in the same run, on a fresh store each.
While they run the bytes stored (blocks, nodes, commits, as storage lists them) are
sampled; once every job has closed its manager the bench reports:

- failed / skipped snapshots (target 0) and prunes reported as deferred;
- snapshots kept per job against keep_last (target: every job exactly K);
- bytes stored at the end against what retention keeps (the bytes of the objects
  the kept snapshots reach, i.e. stored less what a dry-run gc would delete), and
  the largest sample of the second half of the run against that (flat: bounded by
  the snapshots in flight, not growing with time);
- put latency (step() to commit) p50 / p99 of every job against the lone job's.

    .venv/bin/python benches/bench_jobs.py | tee benches/results/jobs.txt
    .venv/bin/python benches/bench_jobs.py --jobs 4 --seconds 20 --lone-seconds 10   # smoke run

--store URL / --refs DSN run it on another backend (e.g. s3://bucket/prefix with a
PostgreSQL ref table; the environment gives S3 credentials, as for open_store).
tests/train/test_jobs.py runs a small configuration in CI and checks the counts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = REPO / "tests" / "helpers" / "jobs_worker.py"
if str(REPO) not in sys.path:  # as installed, or else from this checkout
    sys.path.insert(1, str(REPO))

import tensorstore_ck as tsck  # noqa: E402


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def stored_bytes(store) -> int:
    return sum(o.size for kind in ("blocks", "nodes", "commits") for o in store.storage.list(kind + "/"))


def open_(url: str, refs: str | None):
    return tsck.open_store(url, **({"refs": refs} if refs else {}))


def run(url: str, *, jobs: int, seconds: float, interval: float, keep: int, mb: float, refs: str | None = None,
        workdir: str, sample_every: float = 2.0, log=print) -> dict:
    """`jobs` job processes on the store at `url` for `seconds`; what they and the store show."""
    open_(url, refs).close()
    bar = Path(workdir) / f"barrier-{uuid.uuid4().hex[:6]}"
    bar.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    steps = max(1, int(seconds / interval))
    names = [f"job{i:02d}" for i in range(jobs)]
    procs = []
    samples: list[tuple[float, int]] = []
    stop = threading.Event()
    try:
        for name in names:
            err = open(bar / f"{name}.err", "wb")
            cmd = [sys.executable, str(WORKER), url, name, str(steps), str(bar), "--keep", str(keep),
                   "--interval", str(interval), "--mb", str(mb)] + (["--refs", refs] if refs else [])
            procs.append((subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, cwd=REPO, env=env), err))
        while not all((bar / f"{n}.ready").exists() for n in names):
            if any(p.poll() is not None for p, _e in procs):
                raise RuntimeError("a job died before the start: " + next(
                    (bar / f"{n}.err").read_text(errors="replace")[-2000:] for n, (p, _e) in zip(names, procs)
                    if p.poll() is not None))
            time.sleep(0.05)
        t0 = time.monotonic()
        (bar / "go").touch()

        def sampler():
            with open_(url, refs) as s:
                while not stop.wait(sample_every):
                    samples.append((time.monotonic() - t0, stored_bytes(s)))

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        reports = []
        for name, (p, err) in zip(names, procs):
            out, _ = p.communicate()
            err.close()
            if p.returncode != 0:
                raise RuntimeError(f"{name} rc={p.returncode}: " +
                                   (bar / f"{name}.err").read_text(errors="replace")[-2000:])
            reports.append(json.loads(out.decode().strip().splitlines()[-1]))
        wall = time.monotonic() - t0
        stop.set()
        th.join()
    finally:
        stop.set()
        for p, err in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            err.close()
    with open_(url, refs) as store:
        kept = Counter(str(row.get("job")) for _r, row in store.reftable.catalog_iter())
        final = stored_bytes(store)
        garbage = store.gc(dry_run=True).deleted_bytes
        queued = getattr(store.reftable, "prune_requests", dict)()  # (a tree without the queue: none)
    lat = [x for r in reports for x in r["put_seconds"]]
    half = [b for t, b in samples if t >= wall / 2]
    return {
        "jobs": jobs, "steps": steps, "interval": interval, "keep": keep, "mb": mb, "wall": wall,
        "snapshots": sum(r["steps"] for r in reports),
        "failed": sum(r["failed"] for r in reports), "skipped": sum(r["skipped"] for r in reports),
        "errors": [e for r in reports for e in r["errors"]][:5],
        "prune_errors": [e for r in reports for e in r["prune_errors"]][:5],
        "prune_runs": sum(r["prune_runs"] for r in reports),
        "kept": {n: kept.get(n, 0) for n in names}, "queued_after": sorted(queued),
        "final_bytes": final, "garbage_bytes": garbage, "kept_bytes": final - garbage,
        "max_second_half_bytes": max(half) if half else final, "samples": samples,
        "p50": pct(lat, 0.5), "p99": pct(lat, 0.99), "puts": len(lat),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=24)
    ap.add_argument("--seconds", type=float, default=180.0)
    ap.add_argument("--lone-seconds", type=float, default=60.0)
    ap.add_argument("--interval", type=float, default=2.0)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--mb", type=float, default=4.0, help="per-job weights that change every step (MB)")
    ap.add_argument("--store", default=None, help="store URL (default: a fresh local directory per run)")
    ap.add_argument("--refs", default=None, help="ref table (e.g. a PostgreSQL DSN)")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--json-out", default=None)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="tsck-bench-jobs-", dir=a.dir)
    print(f"# bench_jobs: {a.jobs} jobs x {a.seconds:g}s, a snapshot every {a.interval:g}s, keep_last={a.keep}, "
          f"{a.mb:g} MB changing per job; tensorstore_ck {getattr(tsck, '__version__', '?')}; "
          f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} CPUs", flush=True)
    try:
        out = {}
        for name, n, secs in (("lone", 1, a.lone_seconds), ("many", a.jobs, a.seconds)):
            url = a.store.rstrip("/") + f"/{name}-{uuid.uuid4().hex[:6]}" if a.store else os.path.join(work, name)
            out[name] = run(url, jobs=n, seconds=secs, interval=a.interval, keep=a.keep, mb=a.mb, refs=a.refs,
                            workdir=work)
            r = out[name]
            print(f"# {name}: {r['snapshots']} snapshots in {r['wall']:.0f}s, load average "
                  f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        lone, many = out["lone"], out["many"]
        ok_kept = sum(1 for v in many["kept"].values() if v == a.keep)
        print()
        print("| | lone job | %d jobs |" % a.jobs)
        print("|---|---|---|")
        print(f"| snapshots taken | {lone['snapshots']} | {many['snapshots']} |")
        print(f"| failed / skipped | {lone['failed']} / {lone['skipped']} | {many['failed']} / {many['skipped']} |")
        print(f"| prunes reported deferred | {len(lone['prune_errors'])} | {len(many['prune_errors'])} |")
        print(f"| jobs keeping exactly keep_last={a.keep} | {sum(1 for v in lone['kept'].values() if v == a.keep)}/1 "
              f"| {ok_kept}/{a.jobs} |")
        print(f"| stored at the end / what retention keeps | {lone['final_bytes'] / 1e6:.1f} / "
              f"{lone['kept_bytes'] / 1e6:.1f} MB | {many['final_bytes'] / 1e6:.1f} / {many['kept_bytes'] / 1e6:.1f} MB |")
        print(f"| largest sample, 2nd half / what retention keeps | "
              f"{lone['max_second_half_bytes'] / max(1, lone['kept_bytes']):.2f}x | "
              f"{many['max_second_half_bytes'] / max(1, many['kept_bytes']):.2f}x |")
        print(f"| put latency p50 (step() to commit) | {lone['p50'] * 1e3:.0f} ms | {many['p50'] * 1e3:.0f} ms "
              f"({many['p50'] / lone['p50']:.2f}x) |")
        print(f"| put latency p99 | {lone['p99'] * 1e3:.0f} ms | {many['p99'] * 1e3:.0f} ms "
              f"({many['p99'] / lone['p99']:.2f}x) |")
        print()
        print("stored bytes over time (s, MB): " + ", ".join(f"{t:.0f}:{b / 1e6:.1f}" for t, b in many["samples"]))
        if many["errors"] or many["prune_errors"]:
            print("errors:", many["errors"], many["prune_errors"])
        print(f"# load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        if a.json_out:
            with open(a.json_out, "w") as f:
                json.dump(out, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
