"""S3 throttling: a store rides out S3 saying "slow down" (503 SlowDown, 429 Too Many
Requests, bursts of 500 InternalError) for as long as its retry budget lasts, slows its
client down meanwhile, and past the budget fails with a StorageError that says so and
leaves the store as it was.

The throttling is real HTTP: tests/sim/s3proxy.py's ThrottleProxy stands between the
store and the session's S3 server (moto's, or radosgw in CI) and, while a throttle window
is on, answers requests with S3's own error responses instead of forwarding them. What it
refused is counted, so every test here can tell that the store did meet the throttling.
"""

from __future__ import annotations

import pytest
import torch

import tensorstore_ck as tsck
from tests.sim.s3proxy import ThrottleProxy

pytestmark = pytest.mark.slow  # a real S3 server, throttle windows of seconds


@pytest.fixture
def throttle(s3_server):
    """(proxy, storage_options through it)."""
    proxy = ThrottleProxy(s3_server["endpoint_url"])
    yield proxy, {**s3_server, "endpoint_url": proxy.url}
    proxy.close()


def _open(tmp_path, s3_url, opts, **kw):
    return tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=opts, **kw)


def _state(v: float, n: int = 24) -> dict:
    return {f"layer{i}": torch.full((4096,), v + i) for i in range(n)}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


WINDOW = 3.0  # seconds of throttling: many retries' worth, well inside the default budget


@pytest.mark.parametrize("status,code,share", [
    (503, "SlowDown", 1.0),  # S3's own throttling
    (429, "TooManyRequests", 1.0),  # what S3-compatible servers and gateways send instead
    (500, "InternalError", 0.5),  # a burst of S3's "we encountered an internal error, try again"
], ids=["503-SlowDown", "429", "500-burst"])
def test_put_and_checkout_ride_out_throttling(tmp_path, throttle, s3_url, status, code, share):
    proxy, opts = throttle
    with _open(tmp_path, s3_url, opts) as store:  # the default budget, 60 s
        store.put_snapshot(_state(0), ref="j/main", job="j", step=1)
        st = _state(100)
        proxy.throttle(WINDOW, status=status, code=code, share=share, retry_after=1)
        info = store.put_snapshot(st, ref="j/main", job="j", step=2)
        assert proxy.refused_by["PUT"] > 0, proxy.refused_by  # it did meet the throttling
        assert store.resolve("j/main") == info.root
        proxy.throttle(0)
    proxy.reset_counts()
    with _open(tmp_path, s3_url, opts) as store:  # a new client: nothing cached, its own rate limiter
        proxy.throttle(WINDOW, status=status, code=code, share=share)
        got = store.checkout("j/main")
        assert proxy.refused_by["GET"] > 0, proxy.refused_by
        assert _equal(got, st)  # bit-identical
        proxy.throttle(0)
        assert [e.step for e in store.log("j/main")] == [2, 1]
        assert store.fsck().ok


def test_throttling_past_the_budget_fails_clearly_and_changes_nothing(tmp_path, throttle, s3_url):
    proxy, opts = throttle
    with _open(tmp_path, s3_url, opts, retry_budget=1) as store:
        first = store.put_snapshot(_state(0), ref="j/main", job="j", step=1)
        proxy.throttle()  # until told otherwise: far past the budget
        with pytest.raises(tsck.StorageError) as e:
            store.put_snapshot(_state(100), ref="j/main", job="j", step=2)
        msg = str(e.value)
        assert "throttling" in msg and "SlowDown" in msg and "1s retry budget spent" in msg, msg
        assert "no request of this store succeeded for" in msg, msg  # no progress: why it gave up
        assert "retry_budget" in msg and "TSCK_RETRY_BUDGET" in msg  # how to give it more
        assert proxy.refused > 0 and proxy.throttling()  # given up while it still throttled
        with pytest.raises(tsck.StorageError, match="throttling"):  # a read too, named as such
            store.checkout("j/main")
        proxy.throttle(0)
        assert store.resolve("j/main") == first.root  # no ref moved
        assert [x.step for x in store.log("j/main")] == [1]
        assert _equal(store.checkout("j/main"), _state(0))
        rep = store.fsck()
        assert rep.ok, rep


KINDS = ["HEAD", "GET", "PUT", "LIST"]


def _request(storage, kind: str, n: int):
    """One request of `kind` through the store's storage stack (RetryingStore over S3BlockStore)."""
    if kind == "HEAD":
        return storage.exists("x/seed")
    if kind == "GET":
        return storage.get("x/seed")
    if kind == "PUT":
        return storage.put_if_absent(f"x/new{n}", [b"new"])
    return storage.list_page("x/")


@pytest.mark.parametrize("kind", KINDS)
def test_each_request_kind_is_retried_within_the_one_budget(tmp_path, throttle, s3_url, kind):
    """HEAD, GET, PUT and LIST throttled alone: each is retried until the window ends
    (well inside the budget), and with the throttling on for good each gives up at the
    store's budget with the same error."""
    proxy, opts = throttle
    with _open(tmp_path, s3_url, opts, retry_budget=30) as store:
        storage = store.core.storage
        storage.put_if_absent("x/seed", [b"seed"])
        for status, code in ((503, "SlowDown"), (429, "TooManyRequests")):
            proxy.reset_counts()
            proxy.throttle(1.5, status=status, code=code, kinds={kind})
            _request(storage, kind, status)  # no error: ridden out
            assert proxy.refused_by[kind] > 0 and proxy.refused == proxy.refused_by[kind], proxy.refused_by
        assert storage.get("x/seed") == b"seed"
        proxy.throttle(0)
    with _open(tmp_path, s3_url, opts, retry_budget=0.5) as store:
        proxy.reset_counts()
        proxy.throttle(kinds={kind})
        with pytest.raises(tsck.StorageError, match=r"0\.5s retry budget spent: the server is throttling"):
            _request(store.core.storage, kind, 0)
        assert proxy.refused_by[kind] > 1  # retried, then given up
        proxy.throttle(0)


WORKERS = 16


@pytest.mark.parametrize("status,code", [(503, "SlowDown"), (429, "TooManyRequests")], ids=["503-SlowDown", "429"])
def test_the_client_slows_down_while_throttled(tmp_path, throttle, s3_url, status, code):
    """A new process's put HEADs its blocks first (is it there already?), from WORKERS
    threads at once. Throttled, each thread's own backoff alone still lets the client
    send ~WORKERS requests a second at first (over a hundred in the window); the client's
    rate limiter (botocore's adaptive mode) slows every request of the client once S3
    says slow down, to about one a second. What the proxy was asked during the window
    counts that; load only lowers it."""
    proxy, opts = throttle
    with _open(tmp_path, s3_url, opts) as store:
        store.put_snapshot(_state(0, 1), ref="j/main", job="j", step=1)
    # A block each: unpacked (packed, the tensors are one object, two requests in all,
    # which pass without any limiter).
    st = {f"t{i}": torch.full((16384,), float(i)) for i in range(4 * WORKERS)}
    with _open(tmp_path, s3_url, opts, workers=WORKERS, block_size=64 * 1024, pack_size=0) as store:  # a new client
        proxy.reset_counts()
        proxy.throttle(4.0, status=status, code=code)
        store.put_snapshot(st, ref="j/main", job="j", step=2)
        refused = proxy.refused
        # every thread's first request may be out before the first answer; then about
        # one a second (botocore's floor is one every two seconds)
        assert 0 < refused <= 2 * WORKERS, (refused, proxy.refused_by)
        assert _equal(store.checkout("j/main"), st)


# (a 70% share passes too, but its put's time is its unluckiest request's run of refusals
# and backoffs: 84-264 s for 6 to 40 objects, against 47 s for this one)
@pytest.mark.parametrize("share,n", [(0.5, 100)])
def test_a_steady_share_of_slowdown_answers_slows_the_put_but_never_starves_it(tmp_path, throttle, s3_url, share, n):
    """Every request of a put of n objects (their HEADs and PUTs, the nodes', the
    commit's) answered SlowDown with a seeded probability, from its first request to
    its last (a prefix shared with other busy clients): cutting the send rate does not
    lower that share, so the client stops cutting where it does not help, and the
    throttled requests keep their place while others succeed (the retry budget, 60 s,
    counts from the store's last success). The put commits whole; with the rate cut to
    the floor on every SlowDown and each request's budget counted alone, it ran for
    minutes and failed."""
    proxy, opts = throttle
    st = {f"t{i}": torch.full((4096,), float(i) + share) for i in range(n)}
    with _open(tmp_path, s3_url, opts, workers=16, block_size=64 * 1024, pack_size=0) as store:
        proxy.throttle(share=share, seed=7)  # until told otherwise
        info = store.put_snapshot(st, ref="j/main", job="j", step=1)
        assert proxy.throttling() and proxy.refused_by["PUT"] > 0, proxy.refused_by
        proxy.throttle(0)
        assert proxy.forwarded_by["PUT"] >= n
        assert store.resolve("j/main") == info.root
        assert _equal(store.checkout("j/main"), st)
