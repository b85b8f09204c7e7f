"""recover adopts only whole snapshots, and a recover
killed half-way and run again ends exactly where one uninterrupted run ends."""
from __future__ import annotations

import shutil
import time

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.format.manifest import encode_commit

STATS = {"bytes_total": 0, "bytes_new": 0, "blocks_total": 0, "blocks_new": 0}


def _store(path, n=6):
    s = tsck.open_store(path)
    for step in range(1, n + 1):
        s.put_snapshot({"w": torch.full((5000,), float(step)), "step": step}, ref="a/main", step=step)
    return s


def _orphan_commit(s, *, tree: bytes, step: int) -> str:
    """A commit object written just after a gc began (so gc kept it) whose tree gc swept:
    its writer's fenced move failed and it re-uploaded under another commit."""
    body = encode_commit(job="a", ref="a/main", step=step, time=time.time() + 60, metrics={}, meta={},
                         parent=None, tree=tree, stats=dict(STATS))
    root = s.assets.put_commit(body).digest
    s.assets.sync()
    return root.hex()


def test_recover_skips_a_commit_whose_tree_is_gone(tmp_path):
    path = tmp_path / "s"
    with _store(path) as s:
        tip = s.resolve("a/main")
        orphan = _orphan_commit(s, tree=b"\x07" * 32, step=99)   # newest by time, tree absent
        # With the ref table intact: no catalog row for it (gc would refuse forever after).
        rep = s.recover()
        assert orphan in rep.skipped and "incomplete" in rep.skipped[orphan]
        assert s.reftable.catalog_get(bytes.fromhex(orphan)) is None
        assert s.gc().deleted_by_kind.get("commits") == 1       # gc runs on, and removes the orphan
        orphan = _orphan_commit(s, tree=b"\x07" * 32, step=99)
    shutil.rmtree(path / "refs.lmdb")
    with tsck.open_store(path, create_refs=True) as s:
        rep = s.recover()
        assert orphan in rep.skipped
        assert s.resolve("a/main") == tip                        # not the orphan, the newest whole one
        assert s.checkout("a/main")["step"] == 6 and s.fsck().ok


def test_recover_skips_a_commit_missing_a_block(tmp_path):
    path = tmp_path / "s"
    with _store(path, n=2) as s:
        info = s.put_snapshot({"w": torch.full((5000,), 42.0), "step": 3}, ref="b/x", step=3)
        shared = {d for r in ("a/main@1", "a/main@2") for d in _blocks(s, r)}
        only3 = [d for d in _blocks(s, "b/x") if d not in shared]
        s.assets.delete_objects("blocks", only3[:1])
    shutil.rmtree(path / "refs.lmdb")
    with tsck.open_store(path, create_refs=True) as s:
        rep = s.recover()
        assert "missing" in rep.skipped[info.root] and "b/x" not in s.refs()
        assert s.checkout("a/main")["step"] == 2


def _blocks(s, target):
    from tensorstore_ck.core.walk import walk_commit
    return [o.digest for o in walk_commit(s.assets, bytes.fromhex(s.resolve(target))) if o.kind == "block"]


class _Killed(BaseException):
    pass


@pytest.mark.parametrize("kill_after", [1, 3, 5])
def test_recover_killed_half_way_then_run_again_ends_where_one_run_ends(tmp_path, kill_after):
    path = tmp_path / "s"
    _store(path, n=8).close()
    shutil.rmtree(path / "refs.lmdb")
    ref_copy = tmp_path / "ref"
    shutil.copytree(path, ref_copy)
    with tsck.open_store(ref_copy, create_refs=True) as s:
        s.recover()
        want_tip, want_log = s.resolve("a/main"), [(i.root, i.step) for i in s.log("a/main")]
    with tsck.open_store(path, create_refs=True) as s:
        real, calls = s.reftable.compare_and_swap, [0]

        def cas(*a, **k):  # each move is one atomic transaction: a kill lands between two
            if calls[0] == kill_after:
                raise _Killed()
            calls[0] += 1
            return real(*a, **k)
        s.reftable.compare_and_swap = cas
        with pytest.raises(_Killed):
            s.recover()
        s.reftable.compare_and_swap = real
        assert s.resolve("a/main") != want_tip                   # left on an intermediate commit
    with tsck.open_store(path, create=False) as s:
        s.recover()
        assert s.resolve("a/main") == want_tip and s.resolve("a/main@8") == want_tip
        assert [(i.root, i.step) for i in s.log("a/main")] == want_log
        again = s.recover()                                      # a third run changes nothing
        assert again.refs_restored == {} and s.resolve("a/main") == want_tip


def test_recover_leaves_a_ref_a_user_moved_back(tmp_path):
    with _store(tmp_path / "s") as s:
        r3, r6 = s.resolve("a/main@3"), s.resolve("a/main")
        s.reftable.compare_and_swap("a/main", bytes.fromhex(r6), bytes.fromhex(r3), message="roll back")
        s.recover()
        assert s.resolve("a/main") == r3


def test_recover_follows_the_refs_history_not_the_clock(tmp_path, monkeypatch):
    """After the host's clock stepped back an hour (NTP, a restored VM), the newest
    commits carry the oldest times. recover must still put the ref on the last one
    published (its parent chain), not on the one whose clock read latest (by the clock, the ref would land at step 3
    of 6, and restore_latest would resume from there)."""
    path = tmp_path / "s"
    with _store(path, n=3) as s:
        real = time.time
        monkeypatch.setattr(time, "time", lambda: real() - 3600)  # this host's clock, stepped back
        for step in (4, 5, 6):
            s.put_snapshot({"w": torch.full((5000,), float(step)), "step": step}, ref="a/main", step=step)
        monkeypatch.setattr(time, "time", real)
        tip = s.resolve("a/main")
        log = [i.step for i in s.log("a/main")]
    shutil.rmtree(path / "refs.lmdb")
    with tsck.open_store(path, create_refs=True) as s:
        s.recover()
        assert s.resolve("a/main") == tip
        assert s.checkout("a/main")["step"] == 6
        assert [i.step for i in s.log("a/main")] == log == [6, 5, 4, 3, 2, 1]
        assert s.checkout("a/main@2")["step"] == 2
        assert s.recover().refs_restored == {}  # a second recover changes nothing


def test_recover_orders_a_history_with_gaps_that_gc_made(tmp_path):
    """gc deletes the commits of expired snapshots, so a ref's chain has gaps: pinned
    steps 1 -> 2 are linked, step 6's parent (5) is gone. recover must still end on
    step 6 (found by the interleaving harness, seed 9 --focus recover: a depth count
    along present parents put the ref back on step 2)."""
    path = tmp_path / "s"
    with _store(path, n=6) as s:
        s.pin("a/main@1")
        s.pin("a/main@2")
        s.set_retention("a", tsck.Retention(keep_last=1))
        s.gc()
        assert [i.step for i in s.log("a/main")] == [6, 2, 1]
        tip = s.resolve("a/main")
    shutil.rmtree(path / "refs.lmdb")
    with tsck.open_store(path, create_refs=True) as s:
        s.recover()
        assert s.resolve("a/main") == tip
        assert s.checkout("a/main")["step"] == 6
