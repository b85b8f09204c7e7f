"""A removed snapshot (its ref deleted, it forgotten) is brought back before gc reclaims
it: `tsck tag STORE NAME ROOT` (Store.tag) adopts it by its full root when its commit is
still stored and every node and block of it is present (as recover checks), and refuses
with a clear error otherwise; beside a gc it is fenced on the deletion epoch, so it never
tags a partial snapshot. `tsck delete-ref` and `tsck forget` take --dry-run."""
from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from _util import cli_here, in_thread

import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import WrappedStore
from tensorstore_ck.core.walk import walk_commit


def _w(step: int) -> torch.Tensor:
    return torch.full((40000,), float(step))  # 160 KB: several blocks, none shared with another step


def _fill(path, wrap=None) -> tsck.Store:
    s = tsck.open_store(path, block_size=64 * 1024, wrap_storage=wrap)
    for step in (1, 2):
        s.put_snapshot({"w": _w(step), "step": step}, ref="a/main", step=step)
    s.put_snapshot({"w": _w(9)}, ref="b/main", step=9)
    return s


def _state(s: tsck.Store) -> dict:
    """What the ref table keeps, and every stored object: a dry run changes none of it."""
    rt, top = s.reftable, s.url.removeprefix("file://")
    objects = sorted(os.path.relpath(os.path.join(d, f), top) for d, _, fs in os.walk(top) for f in fs
                     if not d.startswith(os.path.join(top, "refs")))
    try:
        log = [i.root for i in s.log("a/main")]
    except tsck.RefNotFound:
        log = None
    return {"refs": sorted(rt.list()), "tags": sorted(rt.tags()), "pins": sorted(rt.pins()),
            "catalog": sorted(rt.catalog_roots()), "reflog": [(e.old, e.new, e.message) for e in rt.reflog("a/main")],
            "log": log, "objects": objects}


def test_tag_by_root_brings_back_a_deleted_ref_before_gc(tmp_path, capsys):
    path = tmp_path / "s"
    with _fill(path):
        pass
    rc, out, _ = cli_here(capsys, "delete-ref", path, "a/main", "--json")
    assert rc == 0
    root = json.loads(out)["root"]
    rc, out, err = cli_here(capsys, "tag", path, "rescued", root)
    assert rc == 0, err
    assert f"tag rescued -> {root}" in out
    rc, out, _ = cli_here(capsys, "show", path, "rescued", "--json")
    assert rc == 0 and json.loads(out)["step"] == 2 and json.loads(out)["ref"] == "a/main"
    assert cli_here(capsys, "gc", path)[0] == 0
    assert cli_here(capsys, "fsck", path)[0] == 0
    with tsck.open_store(path) as s:
        assert torch.equal(s.checkout("rescued")["w"], _w(2))
        assert s.reftable.catalog_has(bytes.fromhex(root))  # its row is back: du and retention see it
        with pytest.raises(tsck.RefNotFound):
            s.resolve("a/main@1")  # step 1, not rescued, went with the gc


def test_a_forgotten_snapshot_comes_back_by_its_root(tmp_path, capsys):
    path = tmp_path / "s"
    with _fill(path) as s:
        root = s.resolve("a/main@1")
    assert cli_here(capsys, "forget", path, "a/main@1")[0] == 0
    rc, _, err = cli_here(capsys, "tag", path, "step1", root)
    assert rc == 0, err
    assert cli_here(capsys, "gc", path)[0] == 0
    with tsck.open_store(path) as s:
        assert torch.equal(s.checkout("step1")["w"], _w(1)) and s.fsck().ok


def test_tag_by_root_says_why_not(tmp_path, capsys):
    path = tmp_path / "s"
    with _fill(path) as s:
        root1, root2 = s.resolve("a/main@1"), s.resolve("a/main")
    assert cli_here(capsys, "delete-ref", path, "a/main")[0] == 0
    # A prefix names kept snapshots only: the error says to give the full root.
    rc, _, err = cli_here(capsys, "tag", path, "x", root2[:16])
    assert rc == 2 and "full root, 64 hex digits" in err
    # A block of step 2 lost (what a sweep under way leaves): refused, nothing created.
    with tsck.open_store(path) as s:
        block = next(o.digest for o in walk_commit(s.core.assets, bytes.fromhex(root2)) if o.kind == "block")
        s.core.storage.delete(s.core.assets.object_key("blocks", block))
        before = _state(s)
    rc, _, err = cli_here(capsys, "tag", path, "x", root2)
    assert rc == 2 and f"snapshot {root2[:16]} cannot be tagged" in err and "is missing" in err, err
    with tsck.open_store(path) as s:
        assert _state(s) == before and s.reftable.tags() == []
    # After gc reclaimed it: no commit left.
    assert cli_here(capsys, "gc", path)[0] == 0
    rc, _, err = cli_here(capsys, "tag", path, "x", root1)
    assert rc == 2 and "storage holds no commit" in err, err


def test_delete_ref_and_forget_dry_run_change_nothing(tmp_path, capsys):
    path = tmp_path / "s"
    with _fill(path) as s:
        root1, root2 = s.resolve("a/main@1"), s.resolve("a/main")
        before = _state(s)
    rc, out, err = cli_here(capsys, "delete-ref", path, "a/main", "--dry-run")
    assert rc == 0, err
    assert "would delete ref a/main" in out and root1 in out and root2 in out and "nothing was changed" in out
    rc, out, _ = cli_here(capsys, "delete-ref", path, "a/main", "--dry-run", "--json")
    d = json.loads(out)
    assert d["dry_run"] is True and d["snapshots_dropped"] == 2 and sorted(d["dropped"]) == sorted([root1, root2])
    rc, out, err = cli_here(capsys, "forget", path, "a/main@1", "--dry-run")
    assert rc == 0 and f"would forget {root1}" in out and "nothing was changed" in out, err
    # What the real command refuses, the dry run refuses too.
    rc, _, err = cli_here(capsys, "forget", path, "a/main", "--dry-run")
    assert rc == 2 and "is the tip of ref 'a/main'" in err
    rc, _, err = cli_here(capsys, "delete-ref", path, "a/main", "--dry-run", "--expected", root1[:12])
    assert rc == 2
    with tsck.open_store(path) as s:
        assert _state(s) == before
    # The answer of the dry run is the answer of the run.
    assert json.loads(cli_here(capsys, "delete-ref", path, "a/main", "--json")[1])["snapshots_dropped"] == 2


class Gate(WrappedStore):
    """Holds the first call of `op` on a key starting with `prefix` until released."""

    def __init__(self, inner, op: str, prefix: str):
        super().__init__(inner)
        self.op, self.prefix = op, prefix
        self.reached, self.release = threading.Event(), threading.Event()
        self.armed = False

    def _hold(self, op, key):
        if self.armed and op == self.op and key.startswith(self.prefix) and not self.reached.is_set():
            self.reached.set()
            assert self.release.wait(60)

    def put_if_absent(self, key, bufs):
        self._hold("put_if_absent", key)
        return super().put_if_absent(key, bufs)

    def list(self, prefix):
        self._hold("list", prefix)
        return super().list(prefix)


def _gated(path, op, prefix):
    gate = {}

    def wrap(inner):
        gate["g"] = Gate(inner, op, prefix)
        return gate["g"]
    s = _fill(path, wrap)
    s.delete_ref("a/main")
    gate["g"].armed = True
    return s, gate["g"]


def test_a_gc_deletion_phase_between_the_check_and_the_tag_refuses_it(tmp_path):
    """tag() found the removed snapshot complete, then a gc swept it before the row went
    in: the row is fenced on the epoch read before the check, so tag() looks again,
    finds it partial and refuses; no tag in the table or in storage."""
    s, gate = _gated(tmp_path / "s", "put_if_absent", "tags/")
    with s:
        root = s.log("b/main")[0].root  # any kept one, to read the removed one's root below
        removed = [r for r in s.reftable.reflog("a/main") if r.message == "deleted"][0].new.hex()
        t, out = in_thread(lambda: s.tag("rescued", removed))
        assert gate.reached.wait(60)     # checked complete; writing tags/<hex>
        rep = s.gc()                     # deletes the removed snapshot's objects
        assert rep.deleted_objects > 0
        gate.release.set()
        t.join(60)
        assert isinstance(out.get("error"), tsck.IntegrityError), out
        assert "cannot be tagged" in str(out["error"])
        assert s.tags() == {} and list(s.core.assets.tags()) == []
        assert s.fsck().ok and s.resolve("b/main") == root


def test_a_tag_that_lands_after_gc_marked_is_kept_by_its_deletion_phase(tmp_path):
    """gc marked without the removed snapshot and listed it as a candidate; the tag went
    in before the deletion phase froze writers: the phase's re-mark (what tags and the
    catalog keep now) rescues it, so the tagged snapshot stays whole."""
    s, gate = _gated(tmp_path / "s", "list", "blocks/")
    with s:
        removed = [r for r in s.reftable.reflog("a/main") if r.message == "deleted"][0].new.hex()
        t, out = in_thread(lambda: s.gc())
        assert gate.reached.wait(60)     # gc marked, and lists blocks for its candidates
        s.tag("rescued", removed)
        gate.release.set()
        t.join(60)
        assert "error" not in out, out
        assert out["value"].rescued > 0  # candidates of the rescued snapshot, kept
        assert torch.equal(s.checkout("rescued")["w"], _w(2)) and s.fsck().ok


def test_rescue_and_dry_runs_on_each_backend(backend):
    """The same through the API on every ref table and storage: a dry run changes no
    row, and a deleted ref's tip comes back by its root and survives a gc."""
    with backend.open(create=True, block_size=64 * 1024) as s:
        for step in (1, 2):
            s.put_snapshot({"w": _w(step)}, ref="a/main", step=step)
        roots = [i.root for i in s.log("a/main")]
        rows = (sorted(s.reftable.list()), sorted(s.reftable.catalog_roots()), len(s.reftable.reflog("a/main")))
        d = s.delete_ref("a/main", dry_run=True)
        assert d["dry_run"] and sorted(d["dropped"]) == sorted(roots)
        assert s.forget("a/main@1", dry_run=True).root == roots[1]
        assert (sorted(s.reftable.list()), sorted(s.reftable.catalog_roots()), len(s.reftable.reflog("a/main"))) == rows
        s.delete_ref("a/main")
        assert s.tag("rescued", roots[0]).root == roots[0]
        s.gc()
        assert torch.equal(s.checkout("rescued")["w"], _w(2)) and s.fsck().ok
