"""The retry budget: a store rides out an outage of its PostgreSQL ref table or of its S3
endpoint that lasts longer than a few retries (a failover, a restart, throttling), for
retry_budget seconds (open_store(retry_budget=), $TSCK_RETRY_BUDGET, default 60), and a
failure that no retry cures still fails at once.

The outages are real: a TCP proxy between the store and the server (PostgreSQL, the S3
server of the session) that, for a few seconds, resets every connection it carries and
closes each new one as soon as it is accepted, as a server that went away does. The
servers themselves are never touched.
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.cli import main
from tests.sim.netproxy import NetProxy

pytestmark = pytest.mark.slow  # real servers, outages of seconds


@pytest.fixture
def pg_proxy(pg_dsn):
    from psycopg.conninfo import conninfo_to_dict
    d = conninfo_to_dict(pg_dsn)
    proxy = NetProxy(int(d.get("port") or 5432), d.get("host") or "127.0.0.1", marker=None)
    d.update(host="127.0.0.1", port=str(proxy.port), connect_timeout="2")
    yield proxy, " ".join(f"{k}={v}" for k, v in d.items())
    proxy.close()


def _state(v: float) -> dict:
    return {"w": torch.full((4096,), v)}


OUTAGE = 6.0  # seconds: four times the whole budget retries had before it was an option


def test_a_pg_ref_table_outage_is_ridden_out(tmp_path, pg_proxy, caplog):
    proxy, dsn = pg_proxy
    with tsck.open_store(tmp_path / "store", refs=dsn) as store:  # the default budget
        store.put_snapshot(_state(1), ref="j/main", job="j", step=1)
        proxy.outage(OUTAGE)
        with caplog.at_level(logging.WARNING, logger="tensorstore_ck"):
            info = store.put_snapshot(_state(2), ref="j/main", job="j", step=2)
        assert not proxy.down() and proxy.refused > 0  # it did run into the outage
        assert store.resolve("j/main") == info.root
        assert [e.step for e in store.log("j/main")] == [2, 1]
    assert any("ref table" in r.getMessage() and "retry" in r.getMessage() for r in caplog.records)


def test_a_pg_outage_longer_than_retry_budget_is_reported(tmp_path, pg_proxy):
    proxy, dsn = pg_proxy
    with tsck.open_store(tmp_path / "store", refs=dsn, retry_budget=0.5) as store:
        store.put_snapshot(_state(1), ref="j/main", job="j", step=1)
        proxy.outage(120)
        with pytest.raises(tsck.StorageError) as e:
            store.put_snapshot(_state(2), ref="j/main", job="j", step=2, blocking=True)
        assert "retry budget 0.5s" in str(e.value)
        assert proxy.down()  # given up long before the outage ended
        proxy.outage(0)
        assert [x.step for x in store.log("j/main")] == [1]


def test_the_cli_takes_the_budget_from_the_environment(tmp_path, pg_proxy, monkeypatch, capsys):
    proxy, dsn = pg_proxy
    url = str(tmp_path / "store")
    with tsck.open_store(url, refs=dsn) as store:
        store.put_snapshot(_state(1), ref="j/main", job="j", step=1)
    monkeypatch.setenv("TSCK_RETRY_BUDGET", "0")
    proxy.outage(OUTAGE)
    assert main(["log", url, "j/main", "--refs", dsn]) == 1  # no retry: the outage is reported
    assert "tsck: error:" in capsys.readouterr().err
    monkeypatch.setenv("TSCK_RETRY_BUDGET", "120")
    proxy.outage(OUTAGE)
    assert main(["log", url, "j/main", "--refs", dsn]) == 0
    out = capsys.readouterr().out
    assert "step" in out and " 1 " in out
    monkeypatch.setenv("TSCK_RETRY_BUDGET", "soon")
    assert main(["log", url, "j/main", "--refs", dsn]) == 2
    assert "TSCK_RETRY_BUDGET" in capsys.readouterr().err


def test_an_s3_outage_is_ridden_out(tmp_path, s3_proxy, s3_url, caplog):
    proxy, opts = s3_proxy
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=opts) as store:
        store.put_snapshot(_state(1), ref="j/main", job="j", step=1)
        proxy.outage(OUTAGE)
        with caplog.at_level(logging.WARNING, logger="tensorstore_ck"):
            store.put_snapshot(_state(2), ref="j/main", job="j", step=2)
        assert not proxy.down() and proxy.refused > 0
        assert torch.equal(store.checkout("j/main")["w"], _state(2)["w"])
    assert any("storage" in r.getMessage() and "retry" in r.getMessage() for r in caplog.records)


def test_what_no_retry_cures_fails_at_once_whatever_the_budget(tmp_path, s3_server, pg_dsn):
    from psycopg.conninfo import conninfo_to_dict
    t0 = time.monotonic()
    # S3: a bucket that does not exist (404 NoSuchBucket): not transient
    with pytest.raises(tsck.TsckError):
        with tsck.open_store("s3://tsck-no-such-bucket-here/p", refs=str(tmp_path / "r1.lmdb"),
                             storage_options=s3_server, retry_budget=600) as s:
            s.put_snapshot(_state(1), ref="j/main", job="j", step=1)
    # PostgreSQL: a database that does not exist (the server answered and refused)
    d = conninfo_to_dict(pg_dsn)
    d["dbname"] = "tsck_no_such_database"
    with pytest.raises(tsck.StorageError) as e:
        tsck.open_store(tmp_path / "store", refs=" ".join(f"{k}={v}" for k, v in d.items()), retry_budget=600)
    assert "tsck_no_such_database" in str(e.value)
    assert time.monotonic() - t0 < 300  # far below either budget: neither was retried for it


def test_retry_budget_is_checked(tmp_path):
    for bad in (-1, "60", float("inf"), True):
        with pytest.raises(tsck.InvalidArgument, match="retry_budget"):
            tsck.open_store(tmp_path / "s", retry_budget=bad)


def test_s3_client_makes_one_attempt_per_call(tmp_path, s3_server, s3_url):
    """botocore's and s3fs's own retry loops stay at one attempt (RetryingStore is the one
    loop, by time). The client's rate limiter on throttling: tests/storage/test_s3_throttle.py."""
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server) as store:
        store.put_snapshot(_state(1), ref="j/main", job="j", step=1)
        fs = store.core.storage.inner.fs
        client = fs.s3  # the live aiobotocore client s3fs made with these options
        assert client.meta.config.retries.get("total_max_attempts", client.meta.config.retries.get("max_attempts")) == 1
        assert fs.retries == 1
