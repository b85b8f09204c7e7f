"""A local tier's byte budget is a bound (docs/design/tiers.md, "Budget: the tier's
bytes"): a put starts writing only once the tier fits its budget, so after every put the
tier holds at most the budget plus that put's new bytes. Over the budget, a put evicts
durable copies, then waits for queued uploads (each upload's eviction frees its
snapshot's copy), bounded by tier.uploader.BUDGET_WAIT; then, or at once where waiting cannot
help, TierFull before anything is written.

The remote is a real S3-compatible server (moto, or radosgw in CI), or a directory for
the DCP writer and the forked child; its writes are slowed by the store's own bandwidth
throttle (write_bandwidth=, a token bucket) or held by a WrappedStore around its
storage (wrap_storage=)."""

from __future__ import annotations

import logging
import threading
import time
import warnings

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.tier import uploader as upload
from tensorstore_ck.core.walk import walk_commit

from _util import Watched, tier_state

BS = 16 * 1024
DEADLINE = 120.0  # generous: the machine is shared
BUDGET = 300_000


class Held(Watched):
    """Holds every remote object write (plain or conditional) until `gate` is set."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate, self.waiting = threading.Event(), threading.Event()

    def on_write(self, key):
        self.waiting.set()
        assert self.gate.wait(DEADLINE)


def _open(s3_url, s3_server, tmp_path, **kw) -> tsck.Store:
    return tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server,
                           local=str(tmp_path / "nvme"), block_size=BS, inline_threshold=256, **kw)


def _stored(path) -> int:
    return sum(p.stat().st_size for kind in ("blocks", "nodes", "commits") for p in (path / kind).rglob("*")
               if p.is_file())


def _snapshot_bytes(store: tsck.Store, root: str) -> int:
    """The stored bytes of every object one snapshot reaches in the tier (at least its new bytes)."""
    assets = store.core.assets
    sizes = {(kind[:-1], o.digest): o.size for kind in ("commits", "nodes", "blocks") for o in assets.list_objects(kind)}
    return sum(sizes[(o.kind, o.digest)] for o in walk_commit(assets, bytes.fromhex(root), verify=False))


def _rows(store: tsck.Store) -> set:
    return {root for root, _ in store.reftable.catalog_iter(bad=[])}


@pytest.mark.slow  # a real S3 server
def test_twelve_puts_under_slowed_uploads_keep_the_tier_within_its_budget(s3_url, s3_server, tmp_path, caplog):
    """Twelve puts of about 100 KB each (84 KB in the remote: float-coded), the remote's writes slowed to 150 KB/s by the
    store's throttle, local_budget=300_000 and no retention: the uploads fall behind,
    and a put over the budget waits for them (one warning each naming the budget and
    the wait). After every put the tier holds at most the budget plus that snapshot's
    bytes; at the end all twelve are durable, in the remote, and check out bit for bit."""
    caplog.set_level(logging.INFO, logger="tensorstore_ck.tier")
    nvme = tmp_path / "nvme"
    store = _open(s3_url, s3_server, tmp_path, local_budget=BUDGET, write_bandwidth=150_000)
    infos, over = [], []
    for step in range(1, 13):
        info = store.put_snapshot(tier_state(step, 96), "job/main", step=step)
        # Each is tagged so the backlog rule sends every one: this test is about the budget.
        store.tag(f"s{step}", info.root)
        infos.append(info)
        held, one = _stored(nvme), _snapshot_bytes(store, info.root)
        over.append(held - BUDGET)
        assert held <= BUDGET + one, f"put {step}: the tier holds {held} bytes, over {BUDGET} + {one}"
    assert store.wait_durable(timeout=DEADLINE) is True
    assert [(i.step, i.durable) for i in store.log("job/main")] == [(s, True) for s in range(12, 0, -1)]
    assert _stored(nvme) <= BUDGET
    waited = [r.getMessage() for r in caplog.records
              if r.levelno == logging.WARNING and "the put waits for uploads" in r.getMessage()]
    assert waited, f"no put waited (the uploads did not fall behind?): {over}"
    assert all(str(BUDGET) in m for m in waited)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    store.close()
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server,
                         create=False) as remote:
        assert [i.step for i in remote.log("job/main")] == list(range(12, 0, -1))
        for step in (1, 7, 12):
            got = remote.checkout(infos[step - 1].root)
            assert all(torch.equal(got[k], v) for k, v in tier_state(step, 96).items())
        assert remote.fsck(full=True).findings == []


@pytest.mark.slow  # a real S3 server
def test_a_put_over_the_budget_fails_at_the_deadline_and_writes_nothing(s3_url, s3_server, tmp_path, caplog,
                                                                         monkeypatch):
    """The remote's writes held completely, local_budget=240_000 (about 2.4 snapshots),
    tier.uploader.BUDGET_WAIT set to 3 s: three puts go (each starts under the budget); the
    fourth waits for the
    uploads (one warning), and at the deadline raises TierFull (a StorageError, errno
    ENOSPC) naming the budget, the bytes held by the snapshots waiting for upload and
    what to do. Nothing was written: no new object, catalog row, queue entry or ref
    move. Once the writes flow, the same put goes through."""
    import errno
    monkeypatch.setattr(upload, "BUDGET_WAIT", 3.0)
    caplog.set_level(logging.WARNING, logger="tensorstore_ck.tier")
    nvme, budget = tmp_path / "nvme", 240_000
    wrapped = []
    store = _open(s3_url, s3_server, tmp_path, local_budget=budget,
                  wrap_storage=lambda s: wrapped.append(Held(s)) or wrapped[-1])
    infos = [store.put_snapshot(tier_state(step, 96), "job/main", step=step) for step in (1, 2, 3)]
    assert wrapped[0].waiting.wait(DEADLINE)  # the first upload is in flight, held
    before = (_stored(nvme), _rows(store), store.reftable.tier_rows.upload_pending(), store.resolve("job/main"))
    assert before[0] > budget
    t0 = time.monotonic()
    with pytest.raises(tsck.TierFull) as got:
        store.put_snapshot(tier_state(4, 96), "job/main", step=4)
    took = time.monotonic() - t0
    assert 3.0 <= took < 3.0 + 30.0
    e = got.value
    assert isinstance(e, tsck.StorageError) and e.errno == errno.ENOSPC
    assert e.budget == budget and e.held == before[0] and e.usage["pending"]["snapshots"] == 3
    msg = str(e)
    assert f"budget of {budget} bytes" in msg and "waiting for upload" in msg and "nothing was written" in msg
    assert "within 3s" in msg and "local_budget=" in msg and "wait_durable" in msg
    assert (_stored(nvme), _rows(store), store.reftable.tier_rows.upload_pending(), store.resolve("job/main")) == before
    waited = [r.getMessage() for r in caplog.records if "the put waits for uploads" in r.getMessage()]
    assert len(waited) == 1 and str(budget) in waited[0] and str(before[0]) in waited[0]
    wrapped[0].gate.set()
    info = store.put_snapshot(tier_state(4, 96), "job/main", step=4)
    assert store.wait_durable(timeout=DEADLINE) is True
    assert [i.step for i in store.log("job/main")] == [4, 3, 2, 1]
    assert store.resolve("job/main") == info.root
    store.close()


@pytest.mark.slow  # a real S3 server
def test_an_asynchronous_put_and_a_checkpoint_manager_see_the_failure(s3_url, s3_server, tmp_path, monkeypatch):
    """The remote's writes held, a budget of one byte, tier.uploader.BUDGET_WAIT 1 s. An
    asynchronous put into the empty tier commits; the next one runs the same check on
    the background publisher and its future raises TierFull. A CheckpointManager's
    asynchronous snapshot then fails the same way: step() returns, a SnapshotWarning
    names TierFull, wait() raises it and the report counts it; once the writes flow, its next snapshot
    commits and close() reports the newest committed."""
    monkeypatch.setattr(upload, "BUDGET_WAIT", 1.0)
    wrapped = []
    store = _open(s3_url, s3_server, tmp_path, local_budget=1,
                  wrap_storage=lambda s: wrapped.append(Held(s)) or wrapped[-1])
    first = store.put_snapshot(tier_state(1, 96), "job/raw", step=1, blocking=False).result(timeout=DEADLINE)
    assert wrapped[0].waiting.wait(DEADLINE)
    fut = store.put_snapshot(tier_state(2, 96), "job/raw", step=2, blocking=False)
    with pytest.raises(tsck.TierFull, match="budget of 1 bytes"):
        fut.result(timeout=DEADLINE)
    with pytest.raises(tsck.TierFull):  # told again by the next put, as any background failure
        store.put_snapshot(tier_state(3, 96), "job/raw", step=3, blocking=False)
    assert [i.step for i in store.log("job/raw")] == [1] and store.resolve("job/raw") == first.root

    model = torch.nn.Linear(64, 64)
    mgr = tsck.CheckpointManager(store, job="job", ref="job/main", state=tsck.TrainState(model=model), every_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mgr.step(1)  # returns at once: the snapshot runs in the background
        with pytest.raises(tsck.TierFull):  # wait() raises a failed snapshot, as documented
            mgr.wait()
    told = [w for w in caught if issubclass(w.category, tsck.SnapshotWarning)]
    assert len(told) == 1 and "TierFull" in str(told[0].message)
    rep = mgr.report()
    assert rep.failed == 1 and rep.committed == 0 and isinstance(rep.errors[-1], tsck.TierFull)
    wrapped[0].gate.set()
    assert store.wait_durable(timeout=DEADLINE) is True
    mgr.step(2)
    mgr.wait()
    with pytest.warns(tsck.SnapshotWarning, match="TierFull x1"):  # close() sums up the run's failures
        report = mgr.close()
    assert report.committed == 1 and report.newest_committed and report.last_committed_step == 2
    assert store.wait_durable(timeout=DEADLINE) is True
    assert [(i.step, i.durable) for i in store.log("job/main")] == [(2, True)]
    store.close()



def _held_file_store(tmp_path, wrapped: list, **kw) -> tsck.Store:
    return tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=BS,
                           inline_threshold=256, wrap_storage=lambda s: wrapped.append(Held(s)) or wrapped[-1], **kw)


def test_a_dcp_save_over_the_budget_is_refused_before_it_writes(tmp_path, monkeypatch):
    """The DCP writer makes the same check before its first block: with a put's upload
    held and a budget of one byte, dcp.save fails with TierFull in its chain after
    tier.uploader.BUDGET_WAIT, and the tier is unchanged."""
    import torch.distributed.checkpoint as dcp
    from tensorstore_ck.dcp import TsckWriter
    monkeypatch.setattr(upload, "BUDGET_WAIT", 0.5)
    wrapped = []
    store = _held_file_store(tmp_path, wrapped, local_budget=1)
    store.put_snapshot(tier_state(1, 96), "job/main", step=1)
    assert wrapped[0].waiting.wait(DEADLINE)
    before = (_stored(tmp_path / "nvme"), _rows(store))
    with pytest.raises(BaseException) as got:  # DCP's CheckpointException is a BaseException
        dcp.save({"w": torch.randn(64, 64)}, storage_writer=TsckWriter(store, ref="job/main", step=2))
    # DCP gathers each rank's failure into a CheckpointException (.failures: rank -> (error, trace))
    assert [type(err) for err, _ in got.value.failures.values()] == [tsck.TierFull], got.value
    assert (_stored(tmp_path / "nvme"), _rows(store)) == before
    wrapped[0].gate.set()
    assert store.wait_durable(timeout=DEADLINE) is True
    store.close()


def test_a_forked_child_over_the_budget_fails_at_once(tmp_path):
    """A forked child has no uploader to wait for (its parent's sends what it queues and
    keeps the budget): over the budget, its put raises TierFull at once, writing nothing;
    the parent's uploads go on."""
    import os
    wrapped = []
    store = _held_file_store(tmp_path, wrapped, local_budget=1)
    store.put_snapshot(tier_state(1, 96), "job/main", step=1)
    assert wrapped[0].waiting.wait(DEADLINE)
    before = _stored(tmp_path / "nvme")
    pid = os.fork()
    if pid == 0:  # the child: put, and leave without running the parent's cleanup
        code = 1
        try:
            t0 = time.monotonic()
            try:
                store.put_snapshot(tier_state(2, 96), "job/child", step=2)
            except tsck.TierFull as e:
                code = 0 if time.monotonic() - t0 < 30.0 and "forked child" in str(e) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert _stored(tmp_path / "nvme") == before and store.reftable.tier_rows.upload_pending()[-1][1]["ref"] == "job/main"
    wrapped[0].gate.set()
    assert store.wait_durable(timeout=DEADLINE) is True
    store.close()
