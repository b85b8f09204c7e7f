"""A deleted ref comes back as a ref: `tsck undelete STORE REF` (Store.undelete) moves it
back, from its reflog, to the root it had (or to --to ROOT), checked whole first, and
refuses while the ref exists again; delete-ref and forget print the command that undoes
them. Refs and tags share one namespace: a tag never takes a ref's name (live or
deleted), a ref never a tag's. And the CLI's words: the space form of a global option
with $TSCK_STORE, `tsck log` of a tag or a mistyped ref, `tsck init` where the API would
say create=True. CLI checks go through the real entry point (`python -m tensorstore_ck`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import tensorstore_ck as tsck

import _zygote as zygote

from _util import child_env

REPO = Path(__file__).resolve().parents[2]


def _tsck(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return zygote.run([sys.executable, "-m", "tensorstore_ck", *map(str, args)], capture_output=True,
                      text=True, timeout=120, cwd=str(REPO),
                      env=child_env(drop=("TSCK_",), cli=True, **(env or {})))


def _runs(*argvs):
    with ThreadPoolExecutor(4) as ex:
        return list(ex.map(lambda a: _tsck(*a), argvs))


def _w(step: int) -> np.ndarray:
    return np.full(40000, float(step), dtype=np.float32)  # 160 KB: several blocks, none shared


def _fill(path) -> tsck.Store:
    s = tsck.open_store(path, block_size=64 * 1024)
    for step in (1, 2, 3):
        s.put_snapshot({"w": _w(step)}, ref="mine/main", step=step)
    s.put_snapshot({"w": _w(9)}, ref="other/main", step=9)
    s.tag("golden", "other/main")
    return s


def _table(s: tsck.Store) -> dict:
    rt = s.reftable
    return {"refs": sorted(rt.list()), "tags": sorted(rt.tags()), "catalog": sorted(rt.catalog_roots()),
            "reflog": [(e.old, e.new, e.op) for e in rt.reflog("mine/main")]}


# -- the API ------------------------------------------------------------------------------

def test_undelete_brings_the_ref_back_and_the_job_goes_on(tmp_path):
    with _fill(tmp_path / "s") as s:
        tip = s.resolve("mine/main")
        s.delete_ref("mine/main")
        info = s.undelete("mine/main")
        assert info.root == tip and info.step == 3
        assert s.resolve("mine/main") == tip and [i.root for i in s.log("mine/main")] == [tip]
        np.testing.assert_array_equal(s.checkout("mine/main")["w"], _w(3))
        # The job's next snapshot moves the ref as before (no tag in its way).
        nxt = s.put_snapshot({"w": _w(4)}, ref="mine/main", step=4, expected=tip)
        assert s.resolve("mine/main") == nxt.root
        assert s.gc().kept_snapshots >= 2 and s.fsck().ok


def test_undelete_to_an_older_snapshot_of_its_history(tmp_path):
    with _fill(tmp_path / "s") as s:
        first = s.resolve("mine/main@1")
        s.delete_ref("mine/main")
        assert s.undelete("mine/main", to=first).step == 1  # its full root: nothing keeps it any more
        np.testing.assert_array_equal(s.checkout("mine/main")["w"], _w(1))
        assert s.fsck().ok


def test_undelete_refuses_and_changes_nothing(tmp_path):
    with _fill(tmp_path / "s") as s:
        with pytest.raises(tsck.RefNotFound, match="no deleted ref named 'never/made'"):
            s.undelete("never/made")
        with pytest.raises(tsck.RefConflict, match="exists again"):
            s.undelete("mine/main")  # alive: never deleted
        tip = s.resolve("mine/main")
        s.delete_ref("mine/main")
        # Made again by a put: undelete must not move it back.
        again = s.put_snapshot({"w": _w(7)}, ref="mine/main", step=7).root
        with pytest.raises(tsck.RefConflict, match="exists again"):
            s.undelete("mine/main")
        assert s.resolve("mine/main") == again
        s.delete_ref("mine/main")
        # A block of the snapshot swept (a gc under way): checked whole first, refused.
        from tensorstore_ck.core.walk import walk_commit
        block = next(o.digest for o in walk_commit(s.core.assets, bytes.fromhex(again)) if o.kind == "block")
        s.core.storage.delete(s.core.assets.object_key("blocks", block))
        before = _table(s)
        with pytest.raises(tsck.IntegrityError, match="cannot be brought back.*is missing"):
            s.undelete("mine/main")
        assert _table(s) == before
        # After a gc reclaimed it: no commit left.
        s.gc()
        before = _table(s)
        with pytest.raises(tsck.RefNotFound, match="storage holds no commit"):
            s.undelete("mine/main", to=tip)
        assert _table(s) == before


def test_a_tag_never_takes_a_deleted_refs_name(tmp_path):
    with _fill(tmp_path / "s") as s:
        tip = s.resolve("mine/main")
        s.delete_ref("mine/main")
        before = _table(s)
        # A tag there would make the job's next put to the ref fail (RefConflict).
        with pytest.raises(tsck.RefConflict, match="a deleted ref has this name.*tsck undelete STORE mine/main"):
            s.tag("mine/main", tip)  # by its full root, as delete-ref printed it
        assert _table(s) == before and s.core.assets.tag_object("mine/main") is None
        s.put_snapshot({"w": _w(4)}, ref="mine/main", step=4)  # the job goes on


def test_refs_and_tags_refuse_each_others_names_saying_what_to_do(tmp_path):
    with _fill(tmp_path / "s") as s:
        with pytest.raises(tsck.RefConflict, match="a ref has this name.*choose another tag name"):
            s.tag("mine/main", "golden")
        with pytest.raises(tsck.RefConflict, match="a tag has this name.*tsck untag STORE golden"):
            s.put_snapshot({"w": _w(5)}, ref="golden", step=5)
        assert "golden" not in dict(s.reftable.list()) and "mine/main" not in dict(s.reftable.tags())


def test_a_tag_in_the_refs_place_is_named_by_undelete(tmp_path):
    """A table where a tag took a deleted ref's name (as the old advice made): undelete
    says to remove the tag first, and does once it is gone."""
    with _fill(tmp_path / "s") as s:
        tip = s.resolve("mine/main")
        s.delete_ref("mine/main")
        s.reftable._write(lambda t: t.put("tags", b"mine/main", bytes.fromhex(tip)))
        with pytest.raises(tsck.RefConflict, match="a tag has this name.*untag"):
            s.undelete("mine/main")
        s.reftable.tag_delete("mine/main")
        assert s.undelete("mine/main").root == tip


def _rand(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(40000).astype(np.float32)  # 160 KB, 3 blocks


def test_a_jobs_prune_keeps_what_undelete_brings_back(tmp_path):
    """The deleted ref's snapshot shares its base with a snapshot the job's prune expires:
    the prune deletes what only the expired one held, never what undelete brings back."""
    with tsck.open_store(tmp_path / "s", block_size=64 * 1024) as s:
        s.set_retention("run", tsck.Retention(keep_last=1))
        base = _rand(1)
        old = s.put_snapshot({"base": base, "head": _rand(10)}, ref="run/main", step=1).root
        tip = s.put_snapshot({"base": base, "head": _w(100)}, ref="run/exp", step=1).root
        s.delete_ref("run/exp")
        s.put_snapshot({"base": _rand(2), "head": _rand(11)}, ref="run/main", step=2)
        rep = s.prune("run")
        assert rep.expired == [old] and rep.deleted_objects >= 4  # its commit, node, own head blocks
        assert s.undelete("run/exp").root == tip
        back = s.checkout("run/exp")
        assert back["base"].tobytes() == base.tobytes() and back["head"].tobytes() == _w(100).tobytes()
        assert s.fsck().ok
        # The promise ends at the next gc: a deleted ref's snapshot is garbage to it.
        s.delete_ref("run/exp")
        assert s.gc().deleted_objects > 0
        with pytest.raises(tsck.RefNotFound, match="gone"):
            s.undelete("run/exp")


def test_a_prune_that_expires_the_deleted_refs_own_snapshot_keeps_it(tmp_path):
    """The deleted ref's snapshot stayed in the catalog (a tag held it at the deletion) and
    its job's retention expires it later: the prune leaves it whole for undelete."""
    with tsck.open_store(tmp_path / "s", block_size=64 * 1024) as s:
        s.set_retention("run", tsck.Retention(keep_last=1))
        tip = s.put_snapshot({"w": _rand(3)}, ref="run/exp", step=1).root
        s.tag("hold", "run/exp")
        s.delete_ref("run/exp")
        s.untag("hold")
        s.put_snapshot({"w": _rand(4)}, ref="run/main", step=2)
        assert s.prune("run").expired == [tip]
        assert s.undelete("run/exp").root == tip
        assert s.checkout("run/exp")["w"].tobytes() == _rand(3).tobytes()
        assert s.fsck().ok


def test_a_damaged_deleted_snapshot_does_not_stop_the_prune(tmp_path):
    """A deleted ref whose snapshot lost its tree node cannot come back; the job's prune
    still runs (and undelete says what is missing)."""
    path = tmp_path / "s"
    with tsck.open_store(path, block_size=64 * 1024) as s:
        s.set_retention("run", tsck.Retention(keep_last=1))
        s.put_snapshot({"w": _rand(5)}, ref="run/exp", step=1)
        nodes = [p for p in (path / "nodes").rglob("*") if p.is_file()]
        assert len(nodes) == 1
        nodes[0].unlink()
        s.delete_ref("run/exp")
        old = s.put_snapshot({"w": _rand(6)}, ref="run/main", step=1).root
        s.put_snapshot({"w": _rand(7)}, ref="run/main", step=2)
        rep = s.prune("run")
        assert rep.expired == [old] and rep.deleted_objects > 0
        with pytest.raises(tsck.IntegrityError):
            s.undelete("run/exp")


# -- the command line ---------------------------------------------------------------------

def _removal_advice(tmp_path, command: str, name: str) -> tuple:
    """`tsck COMMAND` of NAME in a _fill()ed store succeeds, and the undo it prints is not
    `tsck tag`: (the store's path, the root NAME resolved to, what it printed)."""
    path = tmp_path / "s"
    with _fill(path) as s:
        root = s.resolve(name)
    r = _tsck(command, path, name)
    assert r.returncode == 0, r.stderr
    assert "tsck tag" not in r.stdout, r.stdout
    return path, root, r.stdout


def test_cli_delete_ref_prints_undelete_and_it_works(tmp_path):
    path, tip, out = _removal_advice(tmp_path, "delete-ref", "mine/main")
    assert f"`tsck undelete {path} mine/main`" in out
    tag = _tsck("tag", path, "mine/main", tip)  # the old advice: refused, naming the right command
    assert tag.returncode == 2 and f"`tsck undelete {path} mine/main`" in tag.stderr, tag.stderr
    back = _tsck("undelete", path, "mine/main", "--json")
    assert back.returncode == 0, back.stderr
    assert json.loads(back.stdout)["root"] == tip
    again = _tsck("undelete", path, "mine/main")
    assert again.returncode == 2 and "exists again" in again.stderr and len(again.stderr.splitlines()) == 1
    with tsck.open_store(path) as s:
        assert s.resolve("mine/main") == tip and "mine/main" not in dict(s.reftable.tags())
        s.put_snapshot({"w": _w(4)}, ref="mine/main", step=4)


def test_cli_undelete_after_the_managers_prunes(tmp_path):
    """`tsck delete-ref`'s words hold while the job trains on: its CheckpointManager prunes
    after every snapshot, expiring the snapshots whose blocks the deleted ref shares, and
    `tsck undelete` still brings the ref back bit-identical."""
    import torch
    path = tmp_path / "s"
    state = {"base": torch.randn(64, 1024, generator=torch.Generator().manual_seed(0)), "head": torch.zeros(256)}
    with tsck.open_store(path, block_size=64 * 1024) as s:
        mgr = tsck.CheckpointManager(s, job="run", state=state, every_steps=1, retention=tsck.Retention(keep_last=1),
                                     async_=False)
        mgr.step(1)
        exp = {"base": state["base"].clone(), "head": torch.ones(256)}
        tip = s.put_snapshot(exp, ref="run/exp", step=1).root
        r = _tsck("delete-ref", path, "run/exp")
        assert r.returncode == 0, r.stderr
        assert f"`tsck undelete {path} run/exp`" in r.stdout and "the next gc" in r.stdout
        for step in (2, 3):  # every value changes: the expired snapshots' blocks are the deleted ref's
            state["base"].add_(1.0)
            state["head"].add_(1.0)
            mgr.step(step)
        mgr.close()
        assert mgr.prune_errors == [] and mgr.last_prune is not None
        assert [i.step for i in s.log("run/main")] == [3]
    back = _tsck("undelete", path, "run/exp", "--json")
    assert back.returncode == 0, back.stderr
    assert json.loads(back.stdout)["root"] == tip
    with tsck.open_store(path) as s:
        got = s.checkout("run/exp")
        assert torch.equal(got["base"], exp["base"]) and torch.equal(got["head"], exp["head"])
        assert s.fsck().ok


def test_cli_forget_prints_an_undo_that_works(tmp_path):
    path, old, out = _removal_advice(tmp_path, "forget", "mine/main@2")
    assert f"`tsck pin {path} {old}`" in out
    pin = _tsck("pin", path, old)
    assert pin.returncode == 0, pin.stderr
    with tsck.open_store(path) as s:
        assert old in [i.root for i in s.log("mine/main")]  # back in its ref's history


def test_cli_global_option_in_its_space_form_with_tsck_store(tmp_path):
    path = tmp_path / "s"
    with _fill(path):
        pass
    space = _tsck("--log-level", "info", "refs", env={"TSCK_STORE": str(path)})
    eq_form = _tsck("--log-level=info", "refs", env={"TSCK_STORE": str(path)})
    for r in (space, eq_form):
        assert r.returncode == 0 and "mine/main" in r.stdout and "golden" in r.stdout, r.stderr


def test_cli_log_of_a_tag_or_a_mistyped_ref_says_what_to_do(tmp_path):
    path = tmp_path / "s"
    with _fill(path):
        pass
    log_tag, log_typo = _runs(("log", path, "golden"), ("log", path, "mine/mian"))
    assert log_tag.returncode == 2 and "is a tag" in log_tag.stderr
    assert f"`tsck show {path} golden`" in log_tag.stderr
    assert log_typo.returncode == 2 and "did you mean mine/main?" in log_typo.stderr
    assert f"`tsck refs {path}` lists the refs" in log_typo.stderr
    for r in (log_tag, log_typo):
        assert len(r.stderr.splitlines()) == 1, r.stderr


def test_cli_init_and_the_words_for_a_missing_store(tmp_path):
    new, lmdb = tmp_path / "new", tmp_path / "elsewhere.lmdb"
    missing, missing_refs = _runs(("refs", new), ("refs", new, "--refs", lmdb))
    for r in (missing, missing_refs):
        assert r.returncode == 2 and "create=True" not in r.stderr and f"`tsck init {new}`" in r.stderr, r.stderr
    assert "(same --refs)" in missing_refs.stderr
    init = _tsck("init", new, "--refs", lmdb)
    assert init.returncode == 0, init.stderr
    refs, twice = _runs(("refs", new, "--refs", lmdb), ("init", new, "--refs", lmdb))
    assert refs.returncode == 0 and refs.stdout.strip() == "(no refs)", refs.stderr
    assert twice.returncode == 2 and "already" in twice.stderr
    assert os.path.isdir(lmdb)  # the table went where --refs said
    with tsck.open_store(new, refs=str(lmdb), create=False) as s:
        s.put_snapshot({"w": _w(1)}, ref="a/main", step=1)
