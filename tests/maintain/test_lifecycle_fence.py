"""A tag or pin made while gc runs never lands on a snapshot gc deletes.

tag() resolves its target, writes tags/<hex> (slow under S3 throttling), then inserts
the tag row. Unfenced, that insert could land while gc expires and deletes the target:
tag() would return success, fsck would report a dangling tag and checkout of the tag
raise IntegrityError. The row is fenced like a ref move (the deletion epoch read
before the target is resolved), so tag()/pin() fail with RefNotFound instead; the
PUT of tags/ is held at a gate while gc runs.
Also: set_retention racing gc's expiry. The gate makes each interleaving exact.
"""
from __future__ import annotations

import threading

import pytest
import torch

from _util import in_thread

import tensorstore_ck as tsck
from tensorstore_ck.maintain import lifecycle
from tensorstore_ck.storage.wrappers import WrappedStore


class Gate(WrappedStore):
    """Holds the first put whose key starts with `prefix` until released."""

    def __init__(self, inner, prefix):
        super().__init__(inner)
        self.prefix, self.reached, self.release = prefix, threading.Event(), threading.Event()

    def put_if_absent(self, key, bufs):
        if key.startswith(self.prefix) and not self.reached.is_set():
            self.reached.set()
            assert self.release.wait(30)
        return super().put_if_absent(key, bufs)


def _store(path, gate_prefix=None):
    gate = {}

    def wrap(inner):
        gate["g"] = Gate(inner, gate_prefix or "\0")
        return gate["g"]
    s = tsck.open_store(path, wrap_storage=wrap)
    for step in range(1, 4):
        s.put_snapshot({"w": torch.full((30000,), float(step))}, ref="a/main", step=step)
    s.set_retention("a", tsck.Retention(keep_last=1))
    return s, gate["g"]


def test_tag_of_a_snapshot_gc_deletes_meanwhile_fails_cleanly(tmp_path):
    s, gate = _store(tmp_path / "s", "tags/")
    with s:
        t, out = in_thread(lambda: s.tag("keep-me", "a/main@1"))
        assert gate.reached.wait(30)        # tag() resolved a/main@1 and is writing tags/<hex>
        rep = s.gc()                        # expires step 1 (keep_last=1) and deletes it
        assert rep.expired and rep.deleted_objects > 0
        gate.release.set()
        t.join(30)
        assert isinstance(out.get("error"), tsck.RefNotFound), out
        assert s.tags() == {}
        assert s.fsck().ok
        s.tag("keep-me", "a/main")          # the name is free again
        assert torch.equal(s.checkout("keep-me")["w"], torch.full((30000,), 3.0))


def test_tag_made_during_a_gc_that_keeps_its_target_succeeds(tmp_path):
    s, gate = _store(tmp_path / "s", "tags/")
    with s:
        t, out = in_thread(lambda: s.tag("tip", "a/main"))
        assert gate.reached.wait(30)
        s.gc()
        gate.release.set()
        t.join(30)
        assert "error" not in out, out
        assert s.resolve("tip") == s.resolve("a/main") and s.fsck().ok


def test_pin_fenced_like_a_ref_move(tmp_path):
    """A pin inserted after a deletion phase began is refused and re-checked."""
    s, _gate = _store(tmp_path / "s")
    with s:
        root1 = s.resolve("a/main@1")
        fence = s.publisher.fence()
        s.gc()                              # step 1 expired and deleted since `fence` was read
        with pytest.raises(tsck.Fenced):
            s.reftable.pin(bytes.fromhex(root1), fence=fence)
        with pytest.raises(tsck.RefNotFound):
            lifecycle.fenced(s.core, s.publisher, bytes.fromhex(root1), "a/main@1", fence,
                             lambda f: s.reftable.pin(bytes.fromhex(root1), fence=f))
        assert s.reftable.pins() == set() and s.fsck().ok


def test_set_retention_racing_expiry_drops_nothing(tmp_path):
    """Rules loosened after gc chose what to expire: that gc expires nothing."""
    s, _gate = _store(tmp_path / "s")
    with s:
        rules = s.reftable.retention_all()
        from tensorstore_ck.maintain.gc import plan_expiry
        doomed = plan_expiry(s.core, 1e12, rules)
        assert len(doomed) == 2
        s.set_retention("a", tsck.Retention(keep_last=10))
        assert s.reftable.catalog_expire(doomed, rules=rules) == []
        assert [i.step for i in s.log("a/main")] == [3, 2, 1]


def test_keep_last_follows_publication_order_not_the_clock(tmp_path, monkeypatch):
    """After the clock steps back an hour (NTP, a restored VM, writers on hosts whose
    clocks differ) the newest snapshots carry the oldest times; keep_last=3 of steps
    1..8 must still keep [8, 7, 6] (by the clock it would keep [8, 5, 4, 3])."""
    import tensorstore_ck.write.publish as publish
    real = publish.time.time
    with tsck.open_store(tmp_path / "s") as s:
        for step in range(1, 9):
            if step == 6:
                monkeypatch.setattr(publish.time, "time", lambda: real() - 3600.0)
            s.put_snapshot({"w": torch.full((1000,), float(step))}, ref="a/main", step=step)
        monkeypatch.setattr(publish.time, "time", real)
        s.set_retention("a", tsck.Retention(keep_last=3))
        s.gc()
        assert [i.step for i in s.log("a/main")] == [8, 7, 6]


class ReadGate(WrappedStore):
    """Holds the first read until released (the reader has already listed what to check)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.reached, self.release = threading.Event(), threading.Event()

    def open_read(self, key, max_bytes=None):
        if not self.reached.is_set():
            self.reached.set()
            assert self.release.wait(30)
        return super().open_read(key, max_bytes)


def test_fsck_beside_gc_reports_no_false_damage(tmp_path):
    """Commits gc deletes while fsck walks are not reported missing: fsck on a healthy
    store beside a gc exits 0."""
    _store(tmp_path / "s")[0].close()
    gate = {}

    def wrap(inner):
        gate["g"] = ReadGate(inner)
        return gate["g"]
    with tsck.open_store(tmp_path / "s", wrap_storage=wrap) as s:
        other = s
        t, out = in_thread(lambda: s.fsck())       # lists the 3 catalog rows, then waits at its first read
        assert gate["g"].reached.wait(30)
        assert other.gc().expired                   # steps 1 and 2 expired and deleted meanwhile
        gate["g"].release.set()
        t.join(60)
        rep = out["value"]
        assert rep.ok, [str(f) for f in rep.findings]
        assert rep.gc_ran and rep.dropped_after_gc > 0
        assert other.fsck().ok


class ListGate(WrappedStore):
    """Holds the first listing of commits/ until released: a gc that has expired and
    marked, before its deletion phase (the epoch still even)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.armed, self.reached, self.release = False, threading.Event(), threading.Event()

    def list(self, prefix):
        if self.armed and prefix == "commits/" and not self.reached.is_set():
            self.reached.set()
            assert self.release.wait(30)
        return super().list(prefix)


@pytest.mark.parametrize("how", ["tag", "pin"])
def test_tag_or_pin_of_a_snapshot_expired_meanwhile_fails_cleanly(tmp_path, how):
    """Found by the interleaving harness (tests/sim, seed 20263 on s3+PostgreSQL): tag()
    and pin() resolved their target, then a gc's expiry dropped its catalog row (still in
    the marking phase: the deletion epoch does not move), then the tag or pin row went in.
    The call returned success for a snapshot retention had just dropped: kept by the tag
    or pin, but with no catalog row, so `checkout`/`unpin`/`show` of its root raised
    RefNotFound (a pin that cannot be removed by its root) and `log`/`du` missed it.
    Now the row goes in only while the snapshot is still kept, in the same transaction."""
    gate = {}

    def wrap(inner):
        gate["g"] = ListGate(inner)
        return gate["g"]
    s = tsck.open_store(tmp_path / "s", wrap_storage=wrap)
    with s:
        for step in range(1, 4):
            s.put_snapshot({"w": torch.full((30000,), float(step))}, ref="a/main", step=step)
        root1 = s.resolve("a/main@1")
        s.set_retention("a", tsck.Retention(keep_last=1))
        held, go = threading.Event(), threading.Event()
        if how == "tag":
            g2 = Gate(s.storage.inner, "tags/")  # hold tag() between resolving and its row
            s.storage.inner, s.assets.storage = g2, s.storage
            held, go = g2.reached, g2.release
            call = lambda: s.tag("keep-me", "a/main@1")  # noqa: E731
        else:
            real_pin = s.reftable.pin

            def slow_pin(root, fence=None):  # hold pin() between resolving and its row
                held.set()
                assert go.wait(30)
                return real_pin(root, fence=fence)
            s.reftable.pin = slow_pin
            call = lambda: s.pin("a/main@1")  # noqa: E731
        t, out = in_thread(call)
        assert held.wait(30)
        gate["g"].armed = True
        g, gout = in_thread(s.gc)
        assert gate["g"].reached.wait(30)   # gc expired steps 1 and 2 and marked; epoch still even
        assert s.reftable.catalog_get(bytes.fromhex(root1)) is None
        go.set()
        t.join(30)
        gate["g"].release.set()
        g.join(30)
        assert "error" not in gout, gout
        assert isinstance(out.get("error"), tsck.RefNotFound), out
        assert s.tags() == {} and s.reftable.pins() == set()
        assert s.fsck().ok
        if how == "tag":
            s.tag("keep-me", "a/main")      # the name is free again (its tags/ object was removed)
