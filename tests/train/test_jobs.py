"""Many training jobs on one store: each job's retention is applied, and no job's
prune makes another job's snapshot fail, abort or be skipped.

Real processes (tests/helpers/jobs_worker.py), each an asynchronous
CheckpointManager pruning as it trains, all on one local store (LMDB ref table).
What is kept is counted from the ref table after every process has exited.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import _zygote as zygote
from _util import kill_left, load_helper, pruning_manager

import tensorstore_ck as tsck
from tensorstore_ck.maintain.lease import holding_gc_lock
from tensorstore_ck.storage.base import check_deadline
from tensorstore_ck.storage.wrappers import WrappedStore
from tensorstore_ck.train.pruner import Pruner

HERE = Path(__file__).resolve().parents[1]
REPO = HERE.parent
WORKER = HERE / "helpers" / "jobs_worker.py"


def run_jobs(tmp_path: Path, store: str, jobs: int, steps: int, *, keep: int = 2, interval: float = 0.0,
             deadline: float = 1800.0) -> list[dict]:
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
            procs.append((zygote.Popen([sys.executable, str(WORKER), store, name, str(steps), str(bar),
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
        kill_left(procs)


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
        assert (r["failed"], r["skipped"], r["errors"], r["prune_errors"]) == (0, 0, [], []), r
        assert r["steps"] == 30, r
    with tsck.open_store(path) as store:
        kept = kept_per_job(store)
        assert kept == Counter({r["job"]: 2 for r in reports}), (kept, [r["prune_errors"] for r in reports])
        for r in reports:
            assert [e.step for e in store.log(r["job"] + "/main")] == [30, 29]
        assert store.fsck().ok


# -- the pieces, one process ------------------------------------------------------------

class Model(torch.nn.Module):
    def __init__(self, seed: int = 1):
        super().__init__()
        torch.manual_seed(seed)
        self.head = torch.nn.Linear(64, 64)


def train(mgr, model, steps):
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.head.weight.add_(1e-3)
        mgr.step(step)


def hold_lock(store, release: threading.Event, held: threading.Event):
    with holding_gc_lock(store.core, lease=60.0):
        held.set()
        release.wait(60)


@contextlib.contextmanager
def lock_held(store):
    """The store's gc lock held by another thread for the block's length."""
    release, held = threading.Event(), threading.Event()
    t = threading.Thread(target=hold_lock, args=(store, release, held))
    t.start()
    try:
        held.wait(30)
        yield
    finally:
        release.set()
        t.join()


def wait_for(cond, what: str, deadline: float = 60.0):
    t_end = time.monotonic() + deadline
    while not cond():
        assert time.monotonic() < t_end, what
        time.sleep(0.02)


def test_a_queued_prune_is_served_by_another_jobs_prune(tmp_path):
    """A job whose prune found the store busy is queued in the ref table; the next
    prune of any job applies its rules too and takes it off the queue."""
    with tsck.open_store(tmp_path / "s") as store:
        for job in ("a", "b"):
            store.set_retention(job, tsck.Retention(keep_last=1))
            for step in range(1, 4):
                store.put_snapshot({"x": torch.full((100,), float(step)), "job": job}, ref=f"{job}/main",
                                   job=job, step=step)
        store.reftable.prune_request("a")
        assert set(store.reftable.prune_requests()) == {"a"}
        rep = store.prune("b")
        assert rep.jobs == ["a", "b"]
        assert kept_per_job(store) == Counter({"a": 1, "b": 1})
        assert store.reftable.prune_requests() == {}
        assert store.gc().deleted_objects == 0  # the served job's objects went with its rows
        assert store.fsck().ok


def test_a_request_queued_again_after_it_was_read_stays_queued(tmp_path):
    """A request queued again after the serving prune read the queue covers snapshots
    that prune may not have seen: it is not taken off."""
    with tsck.open_store(tmp_path / "s") as store:
        store.set_retention("a", tsck.Retention(keep_last=1))
        store.put_snapshot({"x": torch.ones(10)}, ref="a/main", job="a", step=1)
        store.reftable.prune_request("a")
        read = store.reftable.prune_requests()
        token = store.reftable.prune_request("a")
        store.reftable.catalog_expire([], served=read)
        assert store.reftable.prune_pending("a", token)
        store.reftable.catalog_expire([], served=store.reftable.prune_requests())
        assert not store.reftable.prune_pending("a", token)


def test_a_gc_serves_queued_prunes(tmp_path):
    with tsck.open_store(tmp_path / "s") as store:
        store.set_retention("a", tsck.Retention(keep_last=1))
        store.put_snapshot({"x": torch.ones(10)}, ref="a/main", job="a", step=1)
        store.put_snapshot({"x": torch.zeros(10)}, ref="a/main", job="a", step=2)
        store.reftable.prune_request("a")
        store.gc()
        assert store.reftable.prune_requests() == {}
        assert kept_per_job(store) == Counter({"a": 1})


def test_a_prune_that_finds_the_store_busy_is_retried_until_it_runs(tmp_path, monkeypatch):
    """However many tries a busy store costs, the prune runs once the lock is free: it
    is never dropped (the tries are made quick here, so a budget of tries runs out)."""
    monkeypatch.setattr(Pruner, "BACKOFF", 0.01)
    with tsck.open_store(tmp_path / "s") as store:
        model = Model()
        mgr = pruning_manager(store, model, 1)
        with lock_held(store):
            train(mgr, model, 3)
            time.sleep(1.0)  # many tries, all finding the lock taken
        mgr.close()
        assert mgr.prune_errors == []
        assert [e.step for e in store.log("run/main")] == [3]
        assert store.reftable.prune_requests() == {}


def test_a_prune_that_cannot_run_is_reported_and_still_runs_later(tmp_path, monkeypatch, caplog):
    """Past PATIENCE of a busy store the prune is reported (a warning and a GcBusy in
    prune_errors) and wait() returns; it is still tried, and runs once the lock is free."""
    monkeypatch.setattr(Pruner, "PATIENCE", 0.5, raising=False)
    with tsck.open_store(tmp_path / "s") as store:
        model = Model()
        mgr = pruning_manager(store, model, 1)
        with lock_held(store):
            with caplog.at_level(logging.WARNING, logger="tensorstore_ck"):
                train(mgr, model, 3)
                mgr.wait()
            assert [type(e) for e in mgr.prune_errors] == [tsck.GcBusy]
            assert "stays queued" in str(mgr.prune_errors[0])
            assert any("could not take the store's gc lock" in r.getMessage() for r in caplog.records)
            assert len(store.log("run/main")) == 3
        wait_for(lambda: len(store.log("run/main")) == 1, "the deferred prune ran once the lock was free")
        mgr.close()
        assert store.fsck().ok


class SlowDeletes(WrappedStore):
    """Storage whose deletes take 20 ms each (a slow object store's DELETE)."""

    def delete_many(self, keys, *, deadline=None):
        for key in keys:
            check_deadline(deadline)
            time.sleep(0.02)
            self.inner.delete(key)


def test_a_long_gc_fences_a_writer_for_one_short_phase_not_the_whole_sweep(tmp_path):
    """A gc with ~1,000 objects to delete at 20 ms each (~5 s on 4 threads) deletes in
    phases of about a second; a writer fenced by one publishes while the gc still has most of the
    sweep ahead (a single phase made it wait for the last delete)."""
    path = tmp_path / "s"
    with tsck.open_store(path, wrap_storage=SlowDeletes, block_size=4096, inline_threshold=256) as store:
        store.put_snapshot({"junk": torch.randn(1024 * 1024)}, ref="old", job="old", step=1)  # ~1,024 blocks
        store.delete_ref("old")
        n0 = sum(1 for _ in store.storage.list("blocks/"))
        done = threading.Event()
        reps = []

        def gc():
            reps.append(store.gc())
            done.set()

        t = threading.Thread(target=gc)
        t.start()
        wait_for(lambda: store.reftable.gc_state()["epoch"] % 2 == 1, "the gc's first deletion phase")
        store.put_snapshot({"y": torch.randn(1000)}, ref="w", job="w", step=1)  # fenced, waits, publishes
        left = sum(1 for _ in store.storage.list("blocks/"))
        assert not done.is_set(), (reps, left, n0)
        t.join()
        assert left > n0 // 4, (left, n0)  # most of the sweep was still to come
        assert reps[0].phases > 1
        assert store.checkout("w")["y"].shape == (1000,)
        assert store.fsck().ok


@pytest.mark.slow
def test_bench_jobs_small_configuration_counts(tmp_path):
    """benches/bench_jobs.py's measurement, small: 4 jobs snapshotting every 0.5 s for
    ~10 s beside each other. Counts only: no failed or skipped snapshot, no prune
    reported deferred, every job keeps exactly keep_last, nothing left queued, and
    nothing stored beyond what retention keeps."""
    bench = load_helper(REPO / "benches" / "bench_jobs.py", name="tsck_bench_jobs")
    r = bench.run(str(tmp_path / "s"), jobs=4, seconds=10, interval=0.5, keep=2, mb=0.25, workdir=str(tmp_path),
                  log=lambda *a: None)
    assert (r["snapshots"], r["failed"], r["skipped"], r["errors"], r["prune_errors"]) == (80, 0, 0, [], []), r
    assert r["kept"] == {f"job{i:02d}": 2 for i in range(4)}, r
    assert r["queued_after"] == [], r
    assert r["garbage_bytes"] == 0, r
