"""Many training jobs on one store: each job's retention is applied, and no job's
prune makes another job's snapshot fail, abort or be skipped.

Real processes (tests/helpers/jobs_worker.py), each an asynchronous
CheckpointManager pruning as it trains, all on one local store (LMDB ref table).
What is kept is counted from the ref table after every process has exited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

import tensorstore_ck as tsck

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "helpers" / "jobs_worker.py"


def run_jobs(tmp_path: Path, store: str, jobs: int, steps: int, *, keep: int = 2, interval: float = 0.0,
             deadline: float = 600.0) -> list[dict]:
    """Start `jobs` worker processes, release them together, wait for all; their reports."""
    tsck.open_store(store).close()
    bar = tmp_path / "barrier"
    bar.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    names = [f"job{i:02d}" for i in range(jobs)]
    procs = []
    try:
        for name in names:
            err = open(tmp_path / f"{name}.err", "wb")
            procs.append((subprocess.Popen([sys.executable, str(WORKER), store, name, str(steps), str(bar),
                                            "--keep", str(keep), "--interval", str(interval)],
                                           stdout=subprocess.PIPE, stderr=err, cwd=REPO, env=env), err))
        t_end = time.monotonic() + deadline
        while not all((bar / f"{n}.ready").exists() for n in names):
            assert all(p.poll() is None for p, _e in procs), "a worker died before the start"
            assert time.monotonic() < t_end, "workers did not start"
            time.sleep(0.05)
        (bar / "go").touch()
        reports = []
        for name, (p, err) in zip(names, procs):
            out, _ = p.communicate(timeout=max(1.0, t_end - time.monotonic()))
            err.close()
            msg = (tmp_path / f"{name}.err").read_text(errors="replace")[-4000:]
            assert p.returncode == 0, f"{name} rc={p.returncode}: {msg}"
            reports.append(json.loads(out.decode().strip().splitlines()[-1]))
        return reports
    finally:
        for p, err in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            err.close()


def kept_per_job(store) -> Counter:
    return Counter(str(row.get("job")) for _root, row in store.reftable.catalog_iter())


@pytest.mark.slow
def test_twelve_jobs_each_keep_what_their_retention_says(tmp_path):
    """12 processes, each snapshotting every step with keep_last=2 and pruning: once
    every job has closed its manager, every job holds exactly 2 snapshots, and no
    snapshot failed or was skipped."""
    path = str(tmp_path / "s")
    reports = run_jobs(tmp_path, path, jobs=12, steps=30, keep=2)
    for r in reports:
        assert (r["failed"], r["skipped"], r["errors"]) == (0, 0, []), r
        assert r["steps"] == 30, r
    with tsck.open_store(path) as store:
        kept = kept_per_job(store)
        assert kept == Counter({r["job"]: 2 for r in reports}), (kept, [r["prune_errors"] for r in reports])
        for r in reports:
            assert [e.step for e in store.log(r["job"] + "/main")] == [30, 29]
        assert store.fsck().ok
