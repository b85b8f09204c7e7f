"""A local tier's outages (docs/design/tiers.md, "Outages"): an outage of the remote is a
wait, not an end. The uploader retries a failed upload at a pause that doubles up to a
cap (tier.uploader.RETRY_PAUSE) for as long as the process lives, however many attempts
fail, and the pause is not cut short by the puts that keep coming; with local_budget=, a
put over the budget during the outage fails at once with TierFull naming it, and puts
wait for room again once uploads resume; and the training loop is told how far the
remote is behind (a SnapshotWarning, Store.durability_lag(), the CheckpointManager's
report, close()).

The outages are real: a TCP proxy (tests/sim/netproxy.py) between the store and the
session's S3 server resets every connection while it is cut; the remote ref table is an
LMDB file, not cut. The storage's retry budget is made short (open_store(retry_budget=))
and so is the uploader's pause (tier.uploader.RETRY_PAUSE), so that many attempts fail
within seconds."""

from __future__ import annotations

import math
import time
import warnings

import pytest
import torch
from _util import assert_same, object_listing, tier_state

import tensorstore_ck as tsck
from tensorstore_ck.tier import uploader as upload

pytestmark = pytest.mark.slow  # a real S3 server behind a real proxy

BS = 16 * 1024
DEADLINE = 120.0  # generous: the machine is shared
OLD_ATTEMPTS = 8  # an outage here outlasts this many failed attempts (no count of them stops uploads)


def _open(s3_url, opts, tmp_path, **kw) -> tsck.Store:
    kw.setdefault("retry_budget", 0.5)
    return tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=opts,
                           local=str(tmp_path / "nvme"), block_size=BS, inline_threshold=256, early_upload=False, **kw)


def _until(cond, what: str) -> None:
    """Wait for `cond()` (an event of the uploader's) -> or fail at DEADLINE."""
    deadline = time.monotonic() + DEADLINE
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _failed(store) -> int:
    """Upload attempts that failed since the last success (an uploader that stopped
    raises its error here: wait_durable())."""
    store.wait_durable(timeout=0)
    return store.durability_lag().attempts


def _lag_warnings(rec) -> list[str]:
    return [str(w.message) for w in rec if issubclass(w.category, tsck.SnapshotWarning)
            and "durability lags" in str(w.message)]


def test_uploads_resume_after_an_outage_longer_than_any_count_of_attempts_and_the_loop_is_told(
        s3_url, s3_proxy, tmp_path, monkeypatch):
    """Step 1 durable; the S3 server cut; steps 2-5 put while more attempts fail than the
    uploader once made before it stopped for good: wait_durable() waits (False at its
    timeout, nothing raised), the first put after a failed attempt warns how far the
    remote is behind (snapshots, steps, seconds, the failure), once; durability_lag()
    says so. The server back: every snapshot becomes durable without a restart, the
    remote's tip is step 5 bit for bit, and the lag is gone."""
    proxy, opts = s3_proxy
    monkeypatch.setattr(upload, "RETRY_PAUSE", (0.05, 0.3))
    with _open(s3_url, opts, tmp_path) as store:
        store.put_snapshot(tier_state(1, bias=False, step=True), "job/main", job="job", step=1)
        assert store.wait_durable(timeout=DEADLINE)
        lag = store.durability_lag()
        assert lag.snapshots == 0 and lag.failing is None and not lag.lagging

        proxy.outage(math.inf)
        store.put_snapshot(tier_state(2, bias=False, step=True), "job/main", job="job", step=2)
        _until(lambda: _failed(store) > OLD_ATTEMPTS + 2, "more failed attempts than OLD_ATTEMPTS")
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            for step in (3, 4, 5):
                store.put_snapshot(tier_state(step, bias=False, step=True), "job/main", job="job", step=step)
        told = _lag_warnings(rec)
        assert len(told) == 1, told  # the first put of the outage; the next ones not again so soon
        assert "2 snapshot(s), 2 step(s)" in told[0] and s3_url in told[0] and "StorageError" in told[0], told[0]
        assert store.wait_durable(timeout=0.5) is False  # waited out, not raised

        lag = store.durability_lag()
        assert lag.lagging and (lag.snapshots, lag.steps) == (4, 4), lag
        assert lag.attempts > OLD_ATTEMPTS and lag.failing > 0 and lag.seconds > 0
        assert isinstance(lag.error, tsck.StorageError)

        proxy.outage(0)
        assert store.wait_durable(timeout=DEADLINE)
        lag = store.durability_lag()
        assert (lag.snapshots, lag.failing, lag.attempts) == (0, None, 0), lag
    assert proxy.refused > 0  # the uploads did run into the outage
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=opts) as remote:
        assert [i.step for i in remote.log("job/main")] == [5, 4, 3, 2, 1]
        assert_same(remote.checkout("job/main"), tier_state(5, bias=False, step=True))


def test_the_pause_after_a_failed_upload_is_not_cut_short_by_puts(s3_url, s3_proxy, tmp_path, monkeypatch):
    """With the S3 server cut and no storage retries (retry_budget=0: each attempt fails
    at once), twenty puts in a row make no more attempts than the pauses allow: one per
    pause (RETRY_PAUSE: 3 s), not one per put. The server back, the snapshots go up."""
    proxy, opts = s3_proxy
    pause = 3.0
    monkeypatch.setattr(upload, "RETRY_PAUSE", (pause, pause))
    with _open(s3_url, opts, tmp_path, retry_budget=0) as store:
        store.put_snapshot(tier_state(1, bias=False, step=True), "job/main", job="job", step=1)
        assert store.wait_durable(timeout=DEADLINE)
        proxy.outage(math.inf)
        store.put_snapshot(tier_state(2, bias=False, step=True), "job/main", job="job", step=2)
        _until(lambda: _failed(store) >= 1, "a failed attempt")
        before, t0 = _failed(store), time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tsck.SnapshotWarning)
            for step in range(3, 23):
                store.put_snapshot(tier_state(step, bias=False, step=True), "job/main", job="job", step=step)
        took, made = time.monotonic() - t0, _failed(store) - before
        assert made <= took / pause + 1, f"{made} attempts during {took:.1f}s of puts, with a {pause}s pause"
        proxy.outage(0)
        assert store.wait_durable(timeout=DEADLINE)
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=opts) as remote:
        assert remote.log("job/main")[0].step == 22


def test_a_budget_refuses_puts_during_an_outage_and_admits_them_once_uploads_resume(s3_url, s3_proxy, tmp_path,
                                                                                  monkeypatch):
    """local_budget= over an outage longer than any count of attempts: the pending
    snapshots fill the tier, and the next put fails at once with TierFull naming the
    failing uploads, nothing written (not after BUDGET_WAIT). The server back, the backlog
    is uploaded and evicted, and the puts go through again, the tier within its bound."""
    proxy, opts = s3_proxy
    monkeypatch.setattr(upload, "RETRY_PAUSE", (0.05, 0.3))
    monkeypatch.setattr(upload, "BUDGET_WAIT", 20.0)  # (the put is refused long before)
    budget = 150_000
    local = tmp_path / "nvme"
    with _open(s3_url, opts, tmp_path, local_budget=budget) as store:
        store.put_snapshot(tier_state(1, bias=False, step=True), "job/main", job="job", step=1)
        assert store.wait_durable(timeout=DEADLINE)
        proxy.outage(math.inf)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tsck.SnapshotWarning)
            step = 1
            while True:  # puts until the pending snapshots alone fill the tier
                step += 1
                _until(lambda: step == 2 or _failed(store) >= 1, "a failed attempt")
                objects = object_listing(local)
                t0 = time.monotonic()
                try:
                    store.put_snapshot(tier_state(step, bias=False, step=True), "job/main", job="job", step=step)
                except tsck.TierFull as e:
                    assert time.monotonic() - t0 < upload.BUDGET_WAIT
                    assert "have failed for" in str(e) and "retried for as long as" in str(e), e
                    assert object_listing(local) == objects  # nothing written
                    break
                assert step < 10, "the budget never refused a put"
        assert store.durability_lag().snapshots == step - 2
        _until(lambda: _failed(store) > OLD_ATTEMPTS + 2, "more failed attempts than OLD_ATTEMPTS")
        with pytest.raises(tsck.TierFull, match="have failed for"):  # still refused, still at once
            store.put_snapshot(tier_state(step, bias=False, step=True), "job/main", job="job", step=step)
        proxy.outage(0)
        assert store.wait_durable(timeout=DEADLINE)
        for more in range(step, step + 3):
            store.put_snapshot(tier_state(more, bias=False, step=True), "job/main", job="job", step=more)
            assert store.wait_durable(timeout=DEADLINE)
            assert sum(object_listing(local).values()) <= budget + 80_000  # the budget plus one snapshot
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=opts) as remote:
        assert remote.log("job/main")[0].step == step + 2
        assert_same(remote.checkout("job/main"), tier_state(step + 2, bias=False, step=True))


def test_the_manager_report_and_close_say_how_far_the_remote_is_behind(s3_url, s3_proxy, tmp_path, monkeypatch):
    """A CheckpointManager over a tier whose S3 server is cut: its report's `durability`
    says how far the remote is behind; its close() warns so, and so does the store's
    close() (the snapshots stay queued). The next open with the server back uploads them."""
    proxy, opts = s3_proxy
    monkeypatch.setattr(upload, "RETRY_PAUSE", (0.05, 0.3))
    store = _open(s3_url, opts, tmp_path)
    model = torch.nn.Linear(64, 32)
    mgr = tsck.CheckpointManager(store, job="job", ref="job/main", state=tsck.TrainState(model=model),
                                 every_steps=1)
    mgr.step(1)
    mgr.wait()
    assert store.wait_durable(timeout=DEADLINE)
    assert not mgr.report().durability.lagging
    proxy.outage(math.inf)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        mgr.step(2)
        mgr.wait()
        _until(lambda: _failed(store) >= 1, "a failed attempt")
        mgr.step(3)
        mgr.wait()
        rep = mgr.report()
        assert rep.ok and rep.durability.lagging, rep
        assert (rep.durability.snapshots, rep.durability.steps) == (2, 2), rep.durability
        assert rep.last_committed_step == 3
        assert mgr.close().durability.lagging
        store.close(timeout=DEADLINE)
    said = _lag_warnings(rec)
    assert any(m.startswith("durability lags") and "2 snapshot(s), 2 step(s)" in m for m in said), said
    assert any(m.startswith("CheckpointManager job: durability lags") for m in said), said
    closing = [str(w.message) for w in rec if "stay queued in the local tier" in str(w.message)]
    assert len(closing) == 1 and "uploads have failed for" in closing[0], closing
    proxy.outage(0)
    with _open(s3_url, opts, tmp_path) as store:
        assert store.wait_durable(timeout=DEADLINE)
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=opts) as remote:
        assert remote.log("job/main")[0].step == 3


def test_a_refused_credential_stops_the_uploader_at_its_first_attempt(s3_url, s3_server, s3_signatures_checked,
                                                                     tmp_path, monkeypatch):
    """What no wait cures stops the uploader rather than being waited out: the tier opened
    again with a wrong secret (its remote storage opened at first use) restores from the
    tier, and the first upload's 403 stops the uploader: wait_durable() raises it, after
    no second attempt (the pause is made longer than the wait). The queue keeps the
    snapshot: the next open with the right key uploads it."""
    monkeypatch.setattr(upload, "RETRY_PAUSE", (2 * DEADLINE, 2 * DEADLINE))
    with s3_signatures_checked() as good:
        with _open(s3_url, good, tmp_path) as store:
            store.put_snapshot(tier_state(1, bias=False, step=True), "job/main", job="job", step=1)
            assert store.wait_durable(timeout=DEADLINE)
        store = _open(s3_url, {**good, "secret": "tsck-wrong-secret"}, tmp_path)
        try:
            assert_same(store.checkout("job/main"), tier_state(1, bias=False, step=True))
            store.put_snapshot(tier_state(2, bias=False, step=True), "job/main", job="job", step=2)
            with pytest.raises(tsck.StorageError) as e:
                store.wait_durable(timeout=DEADLINE)
            assert isinstance(e.value.__cause__, PermissionError), repr(e.value)
            assert "tsck-wrong-secret" not in str(e.value)
            assert store.durability_lag().attempts == 0  # stopped, not waited out
        finally:
            store.close()
        with _open(s3_url, good, tmp_path) as store:
            assert store.wait_durable(timeout=DEADLINE)
        with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=good) as remote:
            assert_same(remote.checkout("job/main"), tier_state(2, bias=False, step=True))
