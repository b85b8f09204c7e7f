"""Pruning while training: a CheckpointManager with retention
expires what its rules drop and deletes what only those snapshots held, after each
committed snapshot, in a thread of its own, with gc's protocol.

Real LMDB stores in tmp_path; what is on disk is measured by walking the store's
directories, not by asking the store.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import tensorstore_ck as tsck
from _util import pruning_manager
from tensorstore_ck.maintain.lease import holding_gc_lock


def object_bytes(root: str) -> tuple[int, int]:
    """(files, bytes) of every stored object (blocks, nodes, commits)."""
    n = size = 0
    for kind in ("blocks", "nodes", "commits"):
        for dirpath, _dirs, files in os.walk(os.path.join(root, kind)):
            for f in files:
                n += 1
                size += os.path.getsize(os.path.join(dirpath, f))
    return n, size


class Model(torch.nn.Module):
    """A frozen embedding (dedups across steps) and a head that changes every step."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.frozen = torch.nn.Parameter(torch.randn(64, 256), requires_grad=False)
        self.head = torch.nn.Linear(256, 64)


def train(store, mgr, model, steps, every=None):
    sizes = []
    for step in range(1, steps + 1):
        with torch.no_grad():
            model.head.weight.add_(torch.randn_like(model.head.weight) * 1e-3)
        mgr.step(step, metrics={"loss": 1.0 / step})
        if every and step % every == 0:
            mgr.wait()
            sizes.append(object_bytes(store.url.removeprefix("file://")))
    return sizes


@pytest.mark.slow
@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_storage_stays_flat_over_200_snapshots_with_keep_last_3(tmp_path, async_):
    path = str(tmp_path / "s")
    with tsck.open_store(path) as store:
        model = Model()
        mgr = pruning_manager(store, model, 3, async_=async_)
        sizes = train(store, mgr, model, 200, every=10)
        mgr.close()
        assert [e.step for e in store.log("run/main")] == [200, 199, 198]
        assert mgr.prune_errors == []
        # The newest prune may have found nothing left to expire (an earlier one, run after
        # the last commit, took it); that prunes ran is what matters, and the flat sizes
        # below say they deleted.
        assert mgr.last_prune is not None and mgr.last_prune.jobs == ["run"]
        # Flat: from the 20th snapshot on, the objects on disk are those of 3 snapshots.
        files = {n for n, _b in sizes[1:]}
        assert len(files) == 1, sizes
        assert max(b for _n, b in sizes[1:]) <= 1.01 * min(b for _n, b in sizes[1:]), sizes
        rep = store.fsck()
        assert rep.ok, rep
        assert store.gc().deleted_objects == 0  # nothing left behind for an offline gc
        sd = store.checkout("run/main")
        assert torch.equal(sd["model"]["head.weight"], model.head.weight.detach())


def test_without_pruning_storage_grows(tmp_path):
    """The measure above can fail: the same run with prune=False grows with every snapshot."""
    path = str(tmp_path / "s")
    with tsck.open_store(path) as store:
        model = Model()
        mgr = tsck.CheckpointManager(store, job="run", state=tsck.TrainState(model=model), every_steps=1,
                                     retention=tsck.Retention(keep_last=3), async_=False, prune=False)
        sizes = train(store, mgr, model, 30, every=10)
        mgr.close()
        assert sizes[0][0] < sizes[1][0] < sizes[2][0]
        assert mgr.last_prune is None


def test_prune_keeps_what_other_jobs_tags_and_pins_hold(tmp_path):
    """Blocks shared with another job, a tagged and a pinned snapshot of the pruned job,
    and the ref tip all survive; everything else of the job's expired snapshots goes."""
    path = str(tmp_path / "s")
    with tsck.open_store(path) as store:
        model = Model()
        other = {"frozen": model.frozen.detach().clone(), "own": torch.randn(1000)}
        store.put_snapshot(other, ref="other/main", job="other", step=1)
        mgr = pruning_manager(store, model, 2)
        train(store, mgr, model, 3)
        store.tag("keep-3", "run/main@3")
        train_from = 4
        for step in range(train_from, 8):
            with torch.no_grad():
                model.head.weight.add_(1e-3)
            mgr.step(step)
            if step == 5:
                store.pin("run/main@5")
        mgr.close()
        kept = {e.step for e in store.log("run/main")}
        assert {7, 6} <= kept
        for target in ("keep-3", "run/main@5", "run/main", "other/main"):
            store.checkout(target)  # verifies every block it reads
        assert torch.equal(store.checkout("other/main")["frozen"], model.frozen)
        with pytest.raises(tsck.RefNotFound):
            store.checkout("run/main@4")
        assert store.fsck().ok


def test_prune_waits_out_a_held_gc_lock_and_then_runs(tmp_path, caplog):
    path = str(tmp_path / "s")
    with tsck.open_store(path) as store:
        model = Model()
        mgr = pruning_manager(store, model, 1)
        release = threading.Event()

        def hold():
            with holding_gc_lock(store.core, lease=30.0):
                release.wait(10)

        t = threading.Thread(target=hold)
        t.start()
        time.sleep(0.3)
        train(store, mgr, model, 3)  # each prune finds the lock taken and backs off
        time.sleep(0.5)
        assert mgr.last_prune is None
        release.set()
        t.join()
        mgr.wait()
        mgr.close()
        assert mgr.prune_errors == []
        assert [e.step for e in store.log("run/main")] == [3]
        assert store.gc().deleted_objects == 0
        assert store.fsck().ok


@pytest.mark.slow
def test_prune_beside_offline_gc_and_another_writer_loses_nothing(tmp_path):
    """A job pruning while an offline gc loops and another job writes snapshots that share
    the pruned job's frozen blocks: every kept snapshot of both checks out, fsck is clean."""
    path = str(tmp_path / "s")
    with tsck.open_store(path) as store:
        model = Model()
        stop = threading.Event()
        errors: list = []

        def gc_loop():
            while not stop.is_set():
                try:
                    store.gc()
                except tsck.GcBusy:
                    pass
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

        def other_writer():
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    store.put_snapshot({"frozen": model.frozen.detach().clone(), "x": torch.randn(512)},
                                       ref="other/main", job="other", step=i)
                except Exception as e:  # noqa: BLE001
                    errors.append(e)

        store.set_retention("other", tsck.Retention(keep_last=2))
        threads = [threading.Thread(target=gc_loop), threading.Thread(target=other_writer)]
        for t in threads:
            t.start()
        mgr = pruning_manager(store, model, 2, async_=True)
        train(store, mgr, model, 40)
        mgr.close()
        stop.set()
        for t in threads:
            t.join()
        assert errors == []
        assert mgr.prune_errors == []
        for ref in ("run/main", "other/main"):
            for e in store.log(ref):
                store.checkout(e.root)
        assert store.fsck().ok


def test_a_fenced_writer_publishes_the_commit_it_wrote_not_a_new_one(tmp_path):
    """A snapshot whose ref move is fenced by a gc deletion phase re-validates and
    publishes the same commit object: before, it wrote a new one (a new time) on every
    fenced attempt and left the first as garbage, once per snapshot that overlapped a
    prune, so a pruning job's storage grew by a commit per snapshot."""
    from tensorstore_ck.storage.wrappers import WrappedStore
    state = {"store": None, "fired": False}

    class GcOnFirstCommit(WrappedStore):
        def put_if_absent(self, key, bufs):
            out = self.inner.put_if_absent(key, bufs)
            if key.startswith("commits/") and not state["fired"]:
                state["fired"] = True  # a whole deletion phase between this write and the ref move
                with holding_gc_lock(state["store"].core, lease=30.0) as hold:
                    hold.freeze()
            return out

    path = str(tmp_path / "s")
    with tsck.open_store(path, wrap_storage=GcOnFirstCommit) as store:
        state["store"] = store
        epoch0 = store.reftable.gc_state()["epoch"]
        info = store.put_snapshot({"x": torch.arange(10.0)}, ref="r", job="j", step=1)
        assert state["fired"] and store.reftable.gc_state()["epoch"] == epoch0 + 2  # it was fenced
        commits = [f for _d, _s, fs in os.walk(os.path.join(path, "commits")) for f in fs]
        assert commits == [info.root]
