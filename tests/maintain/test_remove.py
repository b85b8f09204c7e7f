"""Removal by name: delete_ref, untag, forget, from Python and `tsck`.

Each removal is one ref-table transaction recorded in the reflog; gc then reclaims
what only the removed snapshots held; recover over the live table does not bring
any of it back (tests/sim's "remove" flavor races them with writers, gc and prune).
"""
from __future__ import annotations

import json
import os

import pytest
import torch

import tensorstore_ck as tsck

from _util import assert_same, object_listing, rand_tensor, run_cli


BS = 64 * 1024


def _state(seed: int, shared: torch.Tensor) -> dict:
    return {"own": rand_tensor(torch.float32, (64, 1024), seed=seed), "shared": shared, "step": seed}


def _open(backend_or_path, **kw):
    if hasattr(backend_or_path, "open"):
        return backend_or_path.open(**kw)
    return tsck.open_store(backend_or_path, block_size=BS, **kw)


@pytest.fixture
def two_jobs(backend):
    """Job a: 3 snapshots of its own content; job b: one. Both share one tensor."""
    shared = rand_tensor(torch.float32, (64, 1024), seed=999)
    with backend.open(create=True, block_size=BS) as s:
        a = [s.put_snapshot(_state(i, shared), ref="a/main", step=i) for i in range(3)]
        b = s.put_snapshot(_state(100, shared), ref="b/main", step=0)
    return backend, a, b, shared


def _block_bytes(backend) -> int:
    return sum(n for k, n in object_listing(backend).items() if k.startswith("blocks/"))


def test_delete_ref_lets_gc_reclaim_what_only_its_history_held(two_jobs, tmp_path):
    backend, a, b, shared = two_jobs
    before = _block_bytes(backend)
    with backend.open() as s:
        d = s.delete_ref("a/main")
        assert d == {"ref": "a/main", "root": a[-1].root, "snapshots_dropped": 3}
        assert "a/main" not in s.refs()
        with pytest.raises(tsck.RefNotFound):
            s.log("a/main")
        with pytest.raises(tsck.RefNotFound):
            s.checkout("a/main@1")
        assert [e.op for e in s.reftable.reflog("a/main")] == ["move"] * 3 + ["delete"]  # the record stays
        rep = s.gc()
        assert rep.deleted_objects > 0
        assert s.fsck(full=True).ok
        assert_same(s.checkout("b/main"), _state(100, shared))
    # What is left is exactly what b alone needs: the same content in a fresh store.
    after = _block_bytes(backend)
    assert after < before
    alone = tmp_path / "alone"
    with tsck.open_store(alone, block_size=BS) as fresh:
        fresh.put_snapshot(_state(100, shared), ref="b/main", step=0)
    assert after == _block_bytes(alone)


def test_delete_ref_expected_and_errors_change_nothing(two_jobs):
    backend, a, b, _ = two_jobs
    with backend.open() as s:
        table = dict(s.refs())
        with pytest.raises(tsck.RefConflict):
            s.delete_ref("a/main", expected=a[0].root)  # it moved on since
        with pytest.raises(tsck.RefConflict):
            s.delete_ref("a/main", expected=a[0].root[:8])
        for bad in ("zz", "abc", 42, a[-1].root.upper()):
            with pytest.raises(tsck.InvalidArgument):
                s.delete_ref("a/main", expected=bad)
        with pytest.raises(tsck.RefNotFound):
            s.delete_ref("a/nope")
        with pytest.raises(tsck.InvalidName):
            s.delete_ref("../x")
        assert dict(s.refs()) == table and s.du()["snapshots"] == 4
        assert [e.op for e in s.reftable.reflog("a/main")] == ["move"] * 3
        assert s.delete_ref("a/main", expected=a[-1].root[:10])["root"] == a[-1].root


def test_a_deleted_ref_name_starts_a_new_history(two_jobs):
    backend, a, _b, shared = two_jobs
    with backend.open() as s:
        s.delete_ref("a/main")
        new = s.put_snapshot(_state(7, shared), ref="a/main", step=1)
        assert [i.root for i in s.log("a/main")] == [new.root]
        assert s.resolve("a/main@1") == new.root  # not the deleted history's step 1
        with pytest.raises(tsck.RefNotFound):
            s.resolve("a/main@2")


def test_delete_ref_keeps_what_others_still_hold(two_jobs):
    backend, a, b, shared = two_jobs
    with backend.open() as s:
        s.tag("keep", "a/main@1")
        s.pin("a/main@0")
        assert s.delete_ref("a/main")["snapshots_dropped"] == 1  # only the tip went
        s.gc()
        assert_same(s.checkout("keep"), _state(1, shared))
        assert_same(s.checkout(a[0].root), _state(0, shared))
        assert s.fsck(full=True).ok


def test_forget_one_snapshot(two_jobs):
    backend, a, b, shared = two_jobs
    with backend.open() as s:
        before = _block_bytes(backend)
        got = s.forget("a/main@1")
        assert got.root == a[1].root and got.step == 1
        assert [i.step for i in s.log("a/main")] == [2, 0]
        with pytest.raises(tsck.RefNotFound):
            s.resolve("a/main@1")
        with pytest.raises(tsck.RefNotFound):
            s.forget(a[1].root)  # once
        assert s.reftable.reflog("a/main")[-1].op == "forget"
        s.gc()
        assert before - _block_bytes(backend) >= 256 * 1024  # its own tensor's blocks went
        for i in (0, 2):
            assert_same(s.checkout(f"a/main@{i}"), _state(i, shared))


def test_forget_refuses_a_tip_a_tag_and_a_pin(two_jobs):
    backend, a, b, _ = two_jobs
    with backend.open() as s:
        s.tag("t", "a/main@1")
        s.pin("a/main@0")
        for target, why in (("a/main", "tip of ref 'a/main'"), ("a/main@1", "target of tag 't'"),
                            ("a/main@0", "pinned")):
            with pytest.raises(tsck.InvalidArgument, match=why):
                s.forget(target)
        assert s.du()["snapshots"] == 4
        with pytest.raises(tsck.RefNotFound):
            s.forget("a/main@77")


def test_untag(two_jobs):
    backend, a = two_jobs[:2]  # (job a's snapshots are all it tags)
    with backend.open() as s:
        s.tag("best", "a/main@1")
        key = "tags/" + "best".encode().hex()
        assert s.storage.exists(key)
        assert s.untag("best") == a[1].root
        assert "best" not in s.tags()
        with pytest.raises(tsck.RefNotFound):
            s.untag("best")
        assert not s.storage.exists(key)  # its storage object went too: recover cannot revive it
        s.tag("best", "a/main@2")  # the name is free again
        assert s.show("best").root == a[2].root


def test_recover_over_the_live_table_brings_nothing_removed_back(two_jobs):
    backend, a, b, shared = two_jobs
    with backend.open() as s:
        s.tag("t", "b/main")
        s.forget("a/main@0")
        s.delete_ref("a/main")
        s.untag("t")
        before = (dict(s.refs()), dict(s.tags()), s.du()["snapshots"])
        rep = s.recover()  # storage still holds all of it: no gc ran
        assert rep.refs_restored == {} and rep.tags_restored == {} and rep.catalog_rows_added == 0
        assert sum("removed by a user" in why for why in rep.skipped.values()) == 3
        assert (dict(s.refs()), dict(s.tags()), s.du()["snapshots"]) == before


def test_recover_after_losing_the_ref_table_restores_what_storage_holds(two_jobs, tmp_path):
    """The removal records live in the ref table: lost with it, what gc did not reclaim
    yet comes back (documented); what gc reclaimed does not."""
    backend, a, b, shared = two_jobs
    if backend.kind != "file":
        pytest.skip("the file backend's ref table is a local LMDB that the test can delete")
    with backend.open() as s:
        s.delete_ref("a/main")
        s.gc()
    import shutil
    shutil.rmtree(os.path.join(backend.url, "refs.lmdb"))
    with tsck.open_store(backend.url, create=False, create_refs=True) as s:
        rep = s.recover()
        assert set(rep.refs_restored) == {"b/main"}


# -- the command line ----------------------------------------------------------------------
def test_cli_delete_ref_untag_forget(tmp_path):
    shared = rand_tensor(torch.float32, (64, 1024), seed=999)
    path = tmp_path / "s"
    with tsck.open_store(path, block_size=BS) as s:
        a = [s.put_snapshot(_state(i, shared), ref="a/main", step=i) for i in range(3)]
        s.put_snapshot(_state(100, shared), ref="b/main", step=0)
        s.tag("t", "a/main@1")
    r = run_cli("forget", path, "a/main@1")
    assert r.returncode == 2 and r.stderr.startswith("tsck: error:") and "target of tag 't'" in r.stderr \
        and len(r.stderr.strip().splitlines()) == 1
    r = run_cli("untag", path, "t", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"untag": "t", "root": a[1].root}
    r = run_cli("forget", path, "a/main@1")
    assert r.returncode == 0 and a[1].root in r.stdout, r.stderr
    r = run_cli("delete-ref", path, "a/main", "--expected", a[0].root[:8])
    assert r.returncode == 2 and "moved: expected it on" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("delete-ref", path, "a/main", "--expected", a[2].root[:8], "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"ref": "a/main", "root": a[2].root, "snapshots_dropped": 2}
    r = run_cli("refs", path, "--json")
    assert list(json.loads(r.stdout)["refs"]) == ["b/main"]
    r = run_cli("gc", path)
    assert r.returncode == 0, r.stderr
    r = run_cli("fsck", path)
    assert r.returncode == 0, r.stdout + r.stderr
    for args in (("delete-ref", path, "a/main"), ("untag", path, "t"), ("forget", path, "a/main@0")):
        r = run_cli(*args)
        assert r.returncode == 2 and r.stderr.startswith("tsck: error:") and "Traceback" not in r.stderr
    r = run_cli("--help")
    for verb in ("delete-ref", "untag", "forget"):
        assert verb in r.stdout
