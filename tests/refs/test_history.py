"""History costs what retention keeps, not every snapshot ever taken: without
compaction, keep_last=2 and 100,000 snapshots leave 100,001 reflog entries after gc
(log() 0.6 s, REF@STEP 0.5 s, paid again by every restore_latest()). gc compacts each ref's history to the moves
of kept snapshots plus its latest REFLOG_TAIL moves, and REF@STEP reads an index.
benches/bench_history.py measures the figures."""
from __future__ import annotations

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.refs.history import REFLOG_TAIL


def test_gc_compacts_the_history_to_what_it_keeps(tmp_path):
    with tsck.open_store(tmp_path / "s") as s:
        s.set_retention("j", tsck.Retention(keep_last=2))
        for step in range(1, 31):
            s.put_snapshot({"w": torch.full((10,), float(step))}, ref="j/main", step=step)
        s.tag("mid", "j/main@5")
        assert len(s.reftable.reflog("j/main")) == 30
        s.gc()
        # the tagged snapshot's move, then the latest REFLOG_TAIL moves (their rows may be gone)
        assert len(s.reftable.reflog("j/main")) == 1 + REFLOG_TAIL
        assert [i.step for i in s.log("j/main")] == [30, 29, 5]
        assert s.resolve("j/main@5") == s.resolve("mid")
        assert s.checkout("j/main@29")["w"][0] == 29.0
        with pytest.raises(tsck.RefNotFound):
            s.resolve("j/main@10")
        # keep_last still follows publication order after the compaction
        for step in (31, 32):
            s.put_snapshot({"w": torch.full((10,), float(step))}, ref="j/main", step=step)
        s.gc()
        assert [i.step for i in s.log("j/main")] == [32, 31, 5]
        assert len(s.reftable.reflog("j/main")) == 1 + REFLOG_TAIL
        # recover still recognises the refs as placed by writers: nothing moves
        tip = s.resolve("j/main")
        rep = s.recover()
        assert rep.refs_restored == {} and s.resolve("j/main") == tip
        assert s.fsck().ok


def test_a_dry_run_compacts_nothing(tmp_path):
    with tsck.open_store(tmp_path / "s") as s:
        s.set_retention("j", tsck.Retention(keep_last=1))
        for step in range(1, 15):
            s.put_snapshot({"w": torch.zeros(3)}, ref="j/main", step=step)
        assert s.gc(dry_run=True).reflog_compacted == 0
        assert len(s.reftable.reflog("j/main")) == 14
        assert s.gc().reflog_compacted >= 14 - REFLOG_TAIL
