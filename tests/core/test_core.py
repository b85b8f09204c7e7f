"""The layers below the Store facade are given a Core, not a Store: built here from a
real local block store and a real LMDB ref table alone, resolve, listing, usage, fsck
and gc run on it, and a Store opened afterwards sees exactly what they did."""
from __future__ import annotations

import os

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.core.core import Core, Settings
from tensorstore_ck.maintain.fsck import run_fsck
from tensorstore_ck.maintain.gc import run_gc
from tensorstore_ck.read.listing import list_tree
from tensorstore_ck.refs.lmdb import LmdbRefTable
from tensorstore_ck.storage.local import LocalBlockStore
from tensorstore_ck.maintain.usage import usage


def _core(url: str) -> Core:
    return Core.build(LocalBlockStore(url), LmdbRefTable(os.path.join(url, "refs.lmdb"), create=False),
                      settings=Settings(workers=2))


def test_gc_fsck_listing_and_usage_run_from_a_core_without_a_store(tmp_path):
    url = str(tmp_path / "store")
    with tsck.open_store(url) as store:
        store.set_retention("j", tsck.Retention(keep_last=1))
        for step in range(3):
            store.put_snapshot({"w": torch.full((4096,), float(step)), "step": step}, ref="j/main", step=step,
                               job="j")
        newest = store.resolve("j/main")
        before = store.du()

    core = _core(url)
    try:
        assert core.resolve("j/main").hex() == newest
        assert core.resolve("j/main@2").hex() == newest
        with pytest.raises(tsck.RefNotFound):
            core.resolve("j/other")
        _, entries = list_tree(core, newest)
        assert sorted(e.path for e in entries) == ["step", "w"]
        assert usage(core)["jobs"].keys() >= {"j"}

        report = run_fsck(core)
        assert report.ok and report.snapshots_checked == 3

        gc = run_gc(core)
        assert gc.kept_snapshots == 1 and gc.deleted_objects > 0
        after_gc = run_fsck(core)
        assert after_gc.ok and after_gc.snapshots_checked == 1
    finally:
        core.pool.shutdown(wait=True)
        core.refs.close()
        core.storage.close()

    with tsck.open_store(url) as store:
        assert [i.step for i in store.log("j/main")] == [2]
        state = store.checkout("j/main")
        assert torch.equal(state["w"], torch.full((4096,), 2.0)) and state["step"] == 2
        du = store.du()
        assert du["snapshots"] == 1 and before["snapshots"] == 3 and du["physical_bytes"] < before["physical_bytes"]
