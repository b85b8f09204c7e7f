"""recover: after the ref table (refs.lmdb) is lost, rebuild refs, history and tags from storage.

A pristine store is built once: two jobs, four refs with histories (one nested
ref with a job override and a snapshot without a step), tags (one with '/' in
its name). Each test works on a copy.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

import tensorstore_ck as tsck

from _util import assert_same, object_listing, rand_tensor, refs_snapshot, run_clis, tags_snapshot
from _lifecycle_util import StoreWalker

BLOCK = 4096
INLINE = 256
SHARED = rand_tensor(torch.float32, (8, 256), seed=3)
REFS = ("jobA/main", "jobA/exp", "jobB/main", "jobB/sweep/lr-1e-3")


def make_state(seed: int, step) -> dict:
    return {"model": {"shared": SHARED, "w": rand_tensor(torch.bfloat16, (8, 256), seed=seed)},
            "opt": {"state": {0: {"exp_avg": rand_tensor(torch.float32, (2, 300), seed=seed + 7)}}},
            "step": step, "rng": (seed, b"\x00\x01" * 8)}


class Pristine:
    pass


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Pristine:
    p = Pristine()
    p.path = tmp_path_factory.mktemp("recover") / "store"
    p.states = {}    # root -> state
    p.snaps = []     # (ref, step, root)
    seed = 0

    def put(s, ref, step, **kw):
        nonlocal seed
        seed += 1
        st = make_state(seed, step)
        info = s.put_snapshot(st, ref=ref, step=step, metrics={"loss": 1.0 / seed, "tokens": 1000 * seed},
                              meta={"note": f"snap {seed}", "cfg": {"lr": 1e-3, "tags": ["a", "b"]}}, **kw)
        p.states[info.root] = st
        p.snaps.append((ref, step, info.root))
        return info

    with tsck.open_store(p.path, block_size=BLOCK, inline_threshold=INLINE) as s:
        for k in range(5):
            put(s, "jobA/main", 100 * k)
            if k == 2:
                for e in range(3):
                    put(s, "jobA/exp", 200 + 10 * (e + 1))
            if k in (1, 3):
                put(s, "jobB/main", 50 * k)
        put(s, "jobB/main", 500)
        put(s, "jobB/main", 600)
        put(s, "jobB/sweep/lr-1e-3", None, job="sweeps")
        put(s, "jobB/sweep/lr-1e-3", 7, job="sweeps")
        s.tag("golden", "jobA/main@200")
        s.tag("release/v1", "jobB/main")
        s.tag("jobB-best", "jobB/main@150")
        s.tag("exp-first", "jobA/exp@210")
        p.refs = refs_snapshot(s)
        p.tags = tags_snapshot(s)
        p.logs = {ref: [i.to_json() for i in s.log(ref)] for ref in REFS}
        assert s.fsck().ok
    assert set(p.refs) == set(REFS)
    assert [len(p.logs[r]) for r in REFS] == [5, 3, 4, 2]
    assert len(p.snaps) == 14
    assert p.logs["jobB/sweep/lr-1e-3"][0]["job"] == "sweeps"
    return p


def copy(p: Pristine, tmp_path, name="store"):
    dst = tmp_path / name
    shutil.copytree(p.path, dst)
    return dst


def lose_ref_table(path):
    shutil.rmtree(path / "refs.lmdb")
    assert not (path / "refs.lmdb").exists()


def check_restored(store, path, p: Pristine):
    assert refs_snapshot(store) == p.refs
    assert tags_snapshot(store) == p.tags
    for ref in REFS:
        got = [i.to_json() for i in store.log(ref)]
        assert [i["step"] for i in got] == [i["step"] for i in p.logs[ref]], ref
        assert got == p.logs[ref], ref  # roots, times, metrics, meta, parents, stats, job
    # every snapshot again, bit-exact, by root and by REF@STEP
    for ref, step, root in p.snaps:
        assert_same(p.states[root], store.checkout(root))
        if step is not None:
            assert store.resolve(f"{ref}@{step}") == root
    for ref in REFS:
        assert_same(p.states[p.refs[ref]], store.checkout(ref))
    for tag, root in p.tags.items():
        assert_same(p.states[root], store.checkout(tag))
    assert_same(p.states[p.tags["golden"]], store.checkout("jobA/main@200"))
    rep = store.fsck(full=True)
    assert rep.ok, [str(f) for f in rep.findings]
    assert rep.orphans == 0
    assert rep.snapshots_checked == len(p.snaps)


def test_recover_after_ref_table_loss(pristine, tmp_path):
    p = pristine
    path = copy(p, tmp_path)
    listing = object_listing(path)
    lose_ref_table(path)
    with pytest.raises(tsck.NotAStore, match="tsck recover"):
        tsck.open_store(path, create=False)  # a lost table is never silently re-created
    with tsck.open_store(path, create=False, create_refs=True) as s:
        # the loss is real: nothing is named any more
        assert s.refs() == {} and s.tags() == {}
        with pytest.raises(tsck.RefNotFound):
            s.checkout("jobA/main")
        with pytest.raises(tsck.RefNotFound):
            s.checkout("golden")

        rep = s.recover()
        assert rep.commits_found == len(p.snaps)
        assert rep.catalog_rows_added == len(p.snaps)
        assert rep.refs_restored == p.refs
        assert rep.tags_restored == p.tags
        assert rep.unreadable == []
        check_restored(s, path, p)

        # recovering again is a no-op
        rep2 = s.recover()
        assert rep2.commits_found == len(p.snaps)
        assert rep2.catalog_rows_added == 0 and rep2.refs_restored == {} and rep2.tags_restored == {}
        assert {ref: [i.to_json() for i in s.log(ref)] for ref in REFS} == p.logs

        # writing goes on from the restored tip
        info = s.put_snapshot(make_state(99, 500), ref="jobA/main", step=500)
        assert info.parent == p.refs["jobA/main"]
        assert [i.step for i in s.log("jobA/main")] == [500, 400, 300, 200, 100, 0]
        with pytest.raises(tsck.RefConflict):
            s.tag("golden", "jobA/main")  # restored tags are tags again: immutable
    # recover never touches stored objects
    assert set(listing) <= set(object_listing(path))
    assert {k: v for k, v in object_listing(path).items() if k in listing} == listing


def test_recover_on_intact_store_changes_nothing(pristine, tmp_path):
    p = pristine
    path = copy(p, tmp_path)
    listing = object_listing(path)
    tag_files = sorted(x.name for x in (path / "tags").iterdir())
    with tsck.open_store(path, create=False) as s:
        rep = s.recover()
        assert rep.commits_found == len(p.snaps)
        assert rep.catalog_rows_added == 0
        assert rep.refs_restored == {} and rep.tags_restored == {} and rep.unreadable == []
        assert refs_snapshot(s) == p.refs
        assert tags_snapshot(s) == p.tags
        assert {ref: [i.to_json() for i in s.log(ref)] for ref in REFS} == p.logs
    assert object_listing(path) == listing
    assert sorted(x.name for x in (path / "tags").iterdir()) == tag_files


def test_cli_recover(pristine, tmp_path):
    p = pristine
    a, b = copy(p, tmp_path, "a"), copy(p, tmp_path, "b")
    lose_ref_table(a)
    lose_ref_table(b)
    text, js = run_clis(("recover", a), ("recover", b, "--json"))
    assert text.returncode == 0, text.stderr
    for ref, root in p.refs.items():
        assert f"ref {ref} -> {root}" in text.stdout
    for tag, root in p.tags.items():
        assert f"tag {tag} -> {root}" in text.stdout
    assert js.returncode == 0, js.stderr
    j = json.loads(js.stdout)
    assert j["refs_restored"] == p.refs
    assert j["tags_restored"] == p.tags
    assert j["commits_found"] == len(p.snaps) and j["catalog_rows_added"] == len(p.snaps)
    assert j["unreadable"] == []
    for path in (a, b):
        with tsck.open_store(path, create=False) as s:
            check_restored(s, path, p)


def test_recover_after_gc_keeps_only_what_gc_kept(pristine, tmp_path):
    p = pristine
    path = copy(p, tmp_path)
    with tsck.open_store(path, create=False) as s:
        s.set_retention("jobA", tsck.Retention(keep_last=2))
        rep = s.gc()
        assert rep.expired  # something went
        logs = {ref: [i.to_json() for i in s.log(ref)] for ref in REFS}
        refs, tags = refs_snapshot(s), tags_snapshot(s)
        kept = {i["root"] for lg in logs.values() for i in lg} | set(tags.values())
    lose_ref_table(path)
    with tsck.open_store(path, create=False, create_refs=True) as s:
        r = s.recover()
        assert r.refs_restored == refs and r.tags_restored == tags
        assert r.commits_found == len(kept)
        assert {ref: [i.to_json() for i in s.log(ref)] for ref in REFS} == logs
        for root in set(p.states) - kept:
            with pytest.raises(tsck.RefNotFound):
                s.checkout(root)
        for root in kept:
            assert_same(p.states[root], s.checkout(root))
        f = s.fsck()
        assert f.ok and f.orphans == 0
    # and storage holds exactly what the kept snapshots reach
    assert set(object_listing(path)) == StoreWalker(path).reachable(sorted(kept))
