"""A tiered store whose remote PostgreSQL ref table is away (the session's real server
behind tests/sim/netproxy.py, which black-holes or resets every connection): the tier's
puts go on, close(timeout=) keeps its bound and says what stays queued, and the next open
with the server back uploads it."""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

import tensorstore_ck as tsck
from tensorstore_ck.tier.local import STOP_GRACE

from _util import counter_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.sim.netproxy import NetProxy  # noqa: E402

# A close's bound plus this (the machine is shared): 3.0-3.3 s in all here, against 10.1 s
# when a close waited for the pool's threads in a connect (5 s) and tried its token clean-up (2 s).
MARGIN = 4.5


def _proxied(pg_dsn: str) -> tuple[NetProxy, str]:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo
    d = conninfo_to_dict(pg_dsn)
    proxy = NetProxy(int(d.get("port") or 5432), d.get("host") or "127.0.0.1", marker=None)
    return proxy, make_conninfo(pg_dsn, host="127.0.0.1", port=str(proxy.port))


@pytest.mark.slow  # a real server, seconds of a close's bound
@pytest.mark.parametrize("early", [False, True], ids=["late", "early"])
@pytest.mark.parametrize("away", ["blackout", "outage"])
def test_puts_through_a_tier_go_on_while_the_remote_ref_table_is_away(tmp_path, pg_dsn, away, early):
    """The remote table stops answering (blackout) or refuses connections (outage) after
    step 0 is durable. Steps 1 and 2 put through the tier return, not durable, without a
    request to the remote table: a put that asked it would wait out the retry budget (5 s
    here: show() resolves the ref in both tables and waits it out) and fail. close(timeout=1) returns within its bound
    (timeout, the uploader's stop grace, a margin: its pool's threads in a connect are not
    waited for) and says that 2 snapshots stay queued. With the server back, a fresh open
    of the tier makes step 2 durable. With the early upload too (its fence is the one the
    uploader read last)."""
    proxy, dsn = _proxied(pg_dsn)
    remote, tier = f"file://{tmp_path}/remote", str(tmp_path / "tier")
    try:
        s = tsck.open_store(remote, refs=dsn, local=tier, early_upload=early, retry_budget=5)
        s.put_snapshot(counter_state(0, 4096), ref="job/main", step=0)
        assert s.wait_durable(timeout=120)
        proxy.blackout() if away == "blackout" else proxy.outage(float("inf"))
        for i in (1, 2):
            assert not s.put_snapshot(counter_state(i, 4096), ref="job/main", step=i).durable
        assert s.show("job/main").step == 2  # (the tier's own ref moved)
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            t0 = time.monotonic()
            s.close(timeout=1.0)
            took = time.monotonic() - t0
        said = [str(w.message) for w in ws if issubclass(w.category, tsck.SnapshotWarning)]
        assert took <= 1.0 + STOP_GRACE + MARGIN, took
        assert any("2 snapshot(s) not uploaded stay queued" in m for m in said), said
    finally:
        proxy.restore()
        proxy.outage(0)
        proxy.close()
    with tsck.open_store(remote, refs=pg_dsn, local=tier) as s:
        assert s.wait_durable(timeout=120)
        assert s.show("job/main").step == 2 and s.show("job/main").durable
    with tsck.open_store(remote, refs=pg_dsn) as r:  # the remote itself, no tier
        assert r.show("job/main").step == 2
        got = r.checkout("job/main")
        assert np.array_equal(np.asarray(got["w"]), counter_state(2, 4096)["w"])


@pytest.mark.slow  # a real server
def test_early_puts_go_on_when_the_remote_table_went_away_before_any_fence_was_read(tmp_path, pg_dsn):
    """The early upload on, the remote table black-holed before the uploader read any fence
    (nothing uploaded since the open), and a retry budget of an hour: the first put's first
    send reads the fence on a send thread and waits; the puts themselves return, the second
    too (its start does not wait for that read). Both stay queued, and the next open with
    the server back makes the second durable."""
    import threading

    proxy, dsn = _proxied(pg_dsn)
    remote, tier = f"file://{tmp_path}/remote", str(tmp_path / "tier")
    try:
        s = tsck.open_store(remote, refs=dsn, local=tier, early_upload=True, retry_budget=3600)
        proxy.blackout()
        out: dict = {}

        def puts():
            out["infos"] = [s.put_snapshot(counter_state(i, 4096), ref="job/main", step=i) for i in (1, 2)]
        t = threading.Thread(target=puts, daemon=True)
        t.start()
        t.join(120)  # (a bound for a loaded machine; a put that waits on the remote waits an hour)
        assert not t.is_alive(), "a put waited on the remote table"
        assert [i.durable for i in out["infos"]] == [False, False]
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            s.close(timeout=1.0)
    finally:
        proxy.restore()
        proxy.close()
    with tsck.open_store(remote, refs=pg_dsn, local=tier) as s:
        assert s.wait_durable(timeout=120)
        assert s.show("job/main").step == 2 and s.show("job/main").durable
