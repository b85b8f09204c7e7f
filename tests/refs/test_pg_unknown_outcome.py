"""Ref-table writes whose answer never came (PostgreSQL behind a real TCP proxy that
holds or drops a COMMIT and then black-holes the server for longer than the
client's connect timeout): nothing the write may have published is deleted, a
write that landed is reported as done, and one that cannot be told is
OutcomeUnknown (with the root and ref to check), never a plain failure."""

from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import pytest

import tensorstore_ck as tsck

from _util import counter_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.sim.netproxy import WRITE, NetProxy  # noqa: E402

TIMEOUT = 3  # the client's connect_timeout (s)


class _Proxied:
    """A store whose ref table is reached through a NetProxy in front of the session's server."""

    def __init__(self, tmp_path, pg_dsn: str, **proxy_kw):
        from psycopg.conninfo import conninfo_to_dict
        d = conninfo_to_dict(pg_dsn)
        self.proxy = NetProxy(int(d.get("port", 5432)), d.get("host", "127.0.0.1"), **proxy_kw)
        d.update(host="127.0.0.1", port=str(self.proxy.port), connect_timeout=str(TIMEOUT))
        self.dsn = " ".join(f"{k}={v}" for k, v in d.items())
        # The retry budget of the first write these cases were written for (about 1.5 s): a
        # write whose COMMIT went unanswered gives up when its connect timeout ends, before
        # the restorer ends the blackout (the default budget would ride the blackout out).
        self.store = tsck.open_store(str(tmp_path / "store"), refs=self.dsn, retry_budget=1.5)

    def close(self):
        self.proxy.restore()
        self.proxy.release()
        self.store.close()
        self.proxy.close()


class _Restorer(logging.Handler):
    """Ends the proxy's blackout `after` seconds past the client's "commit unanswered"
    warning: its retry has waited out the connect timeout by then (the write gives
    up), and the clean-up that follows can reach the server again."""

    def __init__(self, proxy: NetProxy, after: float):
        super().__init__(logging.WARNING)
        self.proxy, self.after = proxy, after
        self.seen = threading.Event()

    def emit(self, record):
        if "commit unanswered" in record.getMessage() and not self.seen.is_set():
            self.seen.set()
            threading.Timer(self.after, self.proxy.restore).start()


@pytest.fixture
def restorer():
    made = []

    def make(proxy, after):
        h = _Restorer(proxy, after)
        logging.getLogger("tensorstore_ck").addHandler(h)
        made.append(h)
        return h
    yield make
    for h in made:
        logging.getLogger("tensorstore_ck").removeHandler(h)


@pytest.mark.slow
def test_pg_commit_held_past_connect_timeout_leaves_no_ref_to_a_deleted_commit(tmp_path, pg_dsn, restorer):
    """The COMMIT of a ref move is held in the network, the connection dies and the
    server is unreachable past the connect timeout; the put gives up while the COMMIT
    is still in flight, then it lands. The put said the outcome is unknown and deleted
    nothing: the ref's snapshot checks out and fsck is clean."""
    p = _Proxied(tmp_path, pg_dsn)
    s = p.store
    try:
        r0 = s.put_snapshot(counter_state(0), "a/main", step=0).root
        p.proxy.arm_hold()
        p.proxy.blackout_after_fault = float("inf")  # until the restorer ends it
        h = restorer(p.proxy, TIMEOUT + 0.3)
        with pytest.raises(tsck.StorageError) as ei:
            s.put_snapshot(counter_state(1), "a/main", step=1)
        assert h.seen.is_set() and p.proxy.holds == 1
        assert p.proxy.release() == 1  # the delayed COMMIT lands now
        root = s.resolve("a/main")
        assert root != r0
        assert s.checkout("a/main")["step"] == 1  # the commit object is there
        assert [i.step for i in s.log("a/main")] == [1, 0]
        assert s.fsck().ok
        assert isinstance(ei.value, tsck.OutcomeUnknown), ei.value
        assert ei.value.root.hex() == root and ei.value.ref == "a/main"
        assert "may or may not be published" in str(ei.value) and "tsck log" in str(ei.value)
    finally:
        p.close()


@pytest.mark.slow
def test_pg_commit_landed_answer_lost_put_returns_the_snapshot(tmp_path, pg_dsn, restorer):
    """The COMMIT lands, its answer is lost, the server is unreachable a little longer
    than the connect timeout: the put's own check finds the ref at its root and returns
    that snapshot (not "server is down"); it is in the history once."""
    p = _Proxied(tmp_path, pg_dsn)
    s = p.store
    try:
        r0 = s.put_snapshot(counter_state(0), "a/main", step=0).root
        p.proxy.arm_drop()
        p.proxy.blackout_after_fault = float("inf")
        h = restorer(p.proxy, TIMEOUT + 0.3)
        info = s.put_snapshot(counter_state(1), "a/main", step=1)
        assert h.seen.is_set() and p.proxy.drops == 1
        assert s.reftable.unknown_commits == 1
        assert isinstance(info, tsck.SnapshotInfo) and info.step == 1 and info.parent == r0
        assert s.resolve("a/main") == info.root
        assert [(i.root, i.step) for i in s.log("a/main")] == [(info.root, 1), (r0, 0)]
        assert s.checkout("a/main")["step"] == 1 and s.fsck().ok
    finally:
        p.close()


@pytest.mark.slow
def test_pg_commit_landed_server_still_away_is_outcome_unknown(tmp_path, pg_dsn):
    """The same, but the server stays away through the put's check: the put cannot tell
    and says so (OutcomeUnknown, a StorageError, with .root and .ref), never a plain
    failure; a caller that checks before retrying finds the snapshot and does not
    publish it twice."""
    p = _Proxied(tmp_path, pg_dsn)
    s = p.store
    try:
        s.put_snapshot(counter_state(0), "a/main", step=0)
        p.proxy.arm_drop()
        p.proxy.blackout_after_fault = float("inf")
        with pytest.raises(tsck.StorageError) as ei:
            s.put_snapshot(counter_state(1), "a/main", step=1)
        e = ei.value
        assert isinstance(e, tsck.OutcomeUnknown), e
        assert e.ref == "a/main" and isinstance(e.root, bytes)
        p.proxy.restore()
        # the caller's check: published, so no retry
        assert e.root.hex() in [i.root for i in s.log(e.ref)]
        assert [i.step for i in s.log("a/main")] == [1, 0]
        assert s.checkout("a/main")["step"] == 1 and s.fsck().ok
    finally:
        p.close()


@pytest.mark.slow
def test_pg_tag_and_pin_answer_lost_are_not_plain_failures(tmp_path, pg_dsn, restorer):
    """tag and pin whose COMMIT landed unanswered, server away past the timeout:
    OutcomeUnknown while the table cannot be asked, not a failure, and the stored tag
    object is kept; a tag whose check finds it in the table returns it."""
    p = _Proxied(tmp_path, pg_dsn, marker=WRITE)
    s = p.store
    try:
        root = s.put_snapshot(counter_state(0), "a/main", step=0).root
        for call in (lambda: s.tag("t0", root), lambda: s.pin(root)):
            p.proxy.arm_drop()
            p.proxy.blackout_after_fault = float("inf")
            with pytest.raises(tsck.StorageError) as ei:
                call()
            assert isinstance(ei.value, tsck.OutcomeUnknown), ei.value
            assert ei.value.root == bytes.fromhex(root)
            p.proxy.blackout_after_fault = 0.0
            p.proxy.restore()
        assert s.resolve("t0") == root
        assert bytes.fromhex(root) in set(s.reftable.pins())
        p.proxy.arm_drop()
        p.proxy.blackout_after_fault = float("inf")
        h = restorer(p.proxy, TIMEOUT + 0.3)
        assert s.tag("t1", root).root == root  # its check saw the tag: done
        assert h.seen.is_set() and s.resolve("t1") == root
        assert s.fsck().ok
        assert s.assets.tag_object("t0") is not None and s.assets.tag_object("t1") is not None  # kept for recover
        assert sorted(s.tags()) == ["t0", "t1"]
    finally:
        p.close()


@pytest.mark.slow
def test_async_checkpoint_manager_goes_on_over_a_snapshot_that_landed(tmp_path, pg_dsn):
    """An asynchronous CheckpointManager whose background put ended in OutcomeUnknown
    (the move landed, its answer lost, the server away through the put's check): once
    the table can be asked again, the next step finds the snapshot published and goes
    on instead of stopping training; nothing is published twice."""
    p = _Proxied(tmp_path, pg_dsn)
    s = p.store
    try:
        mgr = tsck.CheckpointManager(s, job="a", ref="a/main", state=tsck.TrainState(), every_steps=1,
                                     async_=True)
        mgr.step(0).result()
        p.proxy.arm_drop()
        p.proxy.blackout_after_fault = float("inf")
        fut = mgr.step(1)
        assert isinstance(fut.exception(timeout=120), tsck.OutcomeUnknown)
        p.proxy.blackout_after_fault = 0.0
        p.proxy.restore()
        mgr.step(2).result()  # the pending OutcomeUnknown resolved: published, training goes on
        mgr.wait()
        assert [i.step for i in s.log("a/main")] == [2, 1, 0]
        st = tsck.TrainState()
        assert tsck.CheckpointManager(s, job="a", ref="a/main").restore_latest(st) == 2
    finally:
        p.close()


@pytest.mark.slow
def test_pg_tag_made_then_server_away_returns_the_tag(tmp_path, pg_dsn):
    """The tag's COMMIT is answered and the server goes away right after: tag() made the
    tag and returns it (described from the commit object), not a failure."""
    p = _Proxied(tmp_path, pg_dsn, marker=WRITE)
    s = p.store
    try:
        root = s.put_snapshot(counter_state(0), "a/main", step=0).root
        p.proxy.arm_dark_after_answer()
        p.proxy.blackout_after_fault = float("inf")
        info = s.tag("t0", root)
        assert p.proxy.blackouts == 1
        assert info.root == root and info.step == 0
        p.proxy.restore()
        assert s.resolve("t0") == root
    finally:
        p.close()
