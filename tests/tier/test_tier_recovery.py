"""Recovery through a local tier (open_store(remote, local=PATH)): checkout and
restore_latest take the newest snapshot that reads whole in either tier (the catalog
rows decide "newest": step, then publication time), and a local object that is missing
or fails its check is read from the remote store instead, never as it is
(docs/design/tiers.md, "Recovery").

Against a real S3 server (moto, or radosgw via TEST_S3_ENDPOINT) with an LMDB remote ref
table; the crash is a real subprocess killed -9; damage is done to the real files."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import tensorstore_ck as tsck

import _zygote as zygote
from _util import HoldLookups, kill_and_close, line_from, tier_state

BS = 16 * 1024
DEADLINE = 120.0  # generous: the machine is shared


def _open(s3_url, s3_server, tmp_path, **kw) -> tsck.Store:
    return tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server,
                           block_size=BS, inline_threshold=256, **kw)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        x.dtype == y.dtype and x.shape == y.shape and x.reshape(-1).view(torch.uint8).equal(y.reshape(-1).view(torch.uint8))
        for x, y in ((a[k].contiguous(), b[k].contiguous()) for k in a))


def _restore(store: tsck.Store) -> tuple[int | None, dict]:
    """restore_latest of a CheckpointManager on `store` into a zeroed state -> (step, state)."""
    model = torch.nn.Linear(256, 64)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    state = tsck.TrainState(model=model)
    mgr = tsck.CheckpointManager(store, job="job", ref="job/main", state=state)
    try:
        step = mgr.restore_latest()
    finally:
        mgr.close()
    return step, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_state(step: int) -> tuple[tsck.TrainState, dict]:
    torch.manual_seed(step)
    model = torch.nn.Linear(256, 64)  # 64 KiB of weight: 4 blocks
    return tsck.TrainState(model=model, step=step), {k: v.detach().clone() for k, v in model.state_dict().items()}


_WRITER = r"""
import sys, threading, time, json
import torch
import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import WrappedStore
s3_url, refs, local, opts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
hold = threading.Event()

class Hold(WrappedStore):  # once `hold` is set, no remote write happens: the second snapshot stays local-only
    def put_addressed(self, key, bufs):
        if hold.is_set():
            time.sleep(3600)
        return self.inner.put_addressed(key, bufs)

store = tsck.open_store(s3_url, refs=refs, storage_options=opts, block_size=16384, inline_threshold=256,
                        local=local, wrap_storage=Hold)
for step in (1, 2):
    torch.manual_seed(step)
    state = tsck.TrainState(model=torch.nn.Linear(256, 64), step=step)
    store.put_snapshot(state.state_dict(), "job/main", job="job", step=step)
    if step == 1:
        assert store.wait_durable(timeout=120)
        hold.set()
print("LOCAL-ONLY", store.resolve("job/main"), store.show("job/main").durable, flush=True)
time.sleep(3600)
"""


@pytest.mark.slow  # a real S3 server, a subprocess
def test_process_killed_after_a_local_only_put_restores_the_newest_local_snapshot(s3_url, s3_server, tmp_path):
    """A training process puts step 1 (uploaded: the remote ref is there) and step 2, whose
    upload never happens, and is killed -9. The remote tip is step 1; the local tier,
    intact, holds step 2. Reopened with the same local tier, restore_latest restores step 2
    (the newer by step) bit for bit, not the remote's step 1."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    refs, local = str(tmp_path / "refs.lmdb"), str(tmp_path / "nvme")
    proc = zygote.Popen([sys.executable, "-c", _WRITER, s3_url, refs, local, json.dumps(s3_server)],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        _, root, durable = line_from(proc, "LOCAL-ONLY", DEADLINE).split()
        assert durable == "False"
    finally:
        kill_and_close(proc)
    with _open(s3_url, s3_server, tmp_path) as remote:
        assert remote.show("job/main").step == 1  # the remote tip is the older one
    _, want = _train_state(2)
    with _open(s3_url, s3_server, tmp_path, local=local) as store:
        step, got = _restore(store)
        assert step == 2 and _equal(got, want)
        assert store.log("job/main")[0].root == root
        assert store.wait_durable(timeout=DEADLINE)  # and the upload resumed


def _put_durable(store: tsck.Store, step: int) -> dict:
    state, want = _train_state(step)
    store.put_snapshot(state.state_dict(), "job/main", job="job", step=step)
    assert store.wait_durable(timeout=DEADLINE)
    return want


@pytest.mark.slow  # a real S3 server
def test_local_tier_lost_restores_the_remote_tip(s3_url, s3_server, tmp_path, caplog):
    """The node's disk is lost (the local tier deleted): open_store(remote, local=) on the
    same, now empty, path restores the remote tip, through restore_latest and through
    checkout(ref), and log(ref) lists the remote history. The objects the tier lacks are
    told once, not one warning per block."""
    local = tmp_path / "nvme"
    with _open(s3_url, s3_server, tmp_path, local=str(local)) as store:
        _put_durable(store, 1)
        want = _put_durable(store, 2)
    shutil.rmtree(local)
    with _open(s3_url, s3_server, tmp_path, local=str(local)) as store:
        with caplog.at_level(logging.WARNING, logger="tensorstore_ck.tier"):
            step, got = _restore(store)
            assert step == 2 and _equal(got, want)
            assert _equal(store.checkout("job/main")["model"], want)
        assert [(i.step, i.durable) for i in store.log("job/main")] == [(2, True), (1, True)]
        told = [r.getMessage() for r in caplog.records if "is missing" in r.getMessage()]
        assert len(told) == 1 and store._tier.reads.missing > 2, (told, store._tier.reads.missing)


@pytest.mark.slow  # a real S3 server
def test_a_local_tier_older_than_the_remote_restores_the_remote_tip(s3_url, s3_server, tmp_path):
    """A node's local tier holds step 1; another node (its own tier) went on to step 2 and
    uploaded it. Back on the first node, with its old tier: the remote tip (step 2, the
    newer by step) is restored, not the local step 1."""
    with _open(s3_url, s3_server, tmp_path, local=str(tmp_path / "a")) as store:
        _put_durable(store, 1)
    with _open(s3_url, s3_server, tmp_path, local=str(tmp_path / "b")) as store:
        want = _put_durable(store, 2)
    with _open(s3_url, s3_server, tmp_path, local=str(tmp_path / "a")) as store:
        step, got = _restore(store)
        assert step == 2 and _equal(got, want)
        assert _equal(store.checkout("job/main")["model"], want)


@pytest.mark.slow  # a real S3 server
def test_damaged_local_blocks_are_read_from_the_remote_copy(s3_url, s3_server, tmp_path, caplog):
    """A local tier that lies: after the snapshot is durable, one local block file is
    truncated and another has a byte flipped. checkout reads both from the remote store
    (checked there) and gives the state bit for bit; each fall-through is logged once per
    object, not again on a second checkout."""
    local = tmp_path / "nvme"
    state = tier_state(3, step=True)
    with _open(s3_url, s3_server, tmp_path, local=str(local)) as store:
        store.put_snapshot(state, "job/main", step=1)
        assert store.wait_durable(timeout=DEADLINE)
        blocks = sorted(p for p in (local / "blocks").rglob("*") if p.is_file())
        assert len(blocks) == 5
        cut, flip = blocks[0], blocks[1]
        data = cut.read_bytes()
        cut.write_bytes(data[: len(data) // 2])
        data = bytearray(flip.read_bytes())
        data[-1] ^= 0xFF
        flip.write_bytes(bytes(data))
        with caplog.at_level(logging.WARNING, logger="tensorstore_ck.tier"):
            assert _equal(store.checkout("job/main"), state)
            assert _equal(store.checkout("job/main"), state)
        told = [r.getMessage() for r in caplog.records if "reading it from" in r.getMessage()]
        assert len(told) == 2, told
        assert any(cut.name[:16] in m for m in told) and any(flip.name[:16] in m for m in told)


def test_a_local_only_snapshot_that_does_not_read_whole_gives_the_older_durable_one(tmp_path, caplog):
    """The newest snapshot is local-only and one of its blocks is damaged: no tier holds it
    whole (the early upload is off, so no block of it reached the remote).
    checkout(ref) and restore_latest take the newest one that reads whole, the durable
    older one, and say so; never the damaged bytes. (The uploader, let go, then stops on
    the damaged block, as it does without recovery.)"""
    remote, local = str(tmp_path / "remote"), tmp_path / "nvme"
    with tsck.open_store(remote, local=str(local), block_size=BS, inline_threshold=256) as store:
        want = _put_durable(store, 1)
    before = {p for p in (local / "blocks").rglob("*") if p.is_file()}
    wrapped = []
    store = tsck.open_store(remote, local=str(local), block_size=BS, inline_threshold=256, early_upload=False,
                            wrap_storage=lambda s: wrapped.append(HoldLookups(s)) or wrapped[-1])
    try:
        state, _ = _train_state(2)
        store.put_snapshot(state.state_dict(), "job/main", job="job", step=2)
        assert store.show("job/main").durable is False
        new = sorted(p for p in (local / "blocks").rglob("*") if p.is_file() and p not in before)
        assert new
        data = bytearray(new[0].read_bytes())
        data[-1] ^= 0xFF
        new[0].write_bytes(bytes(data))
        with caplog.at_level(logging.WARNING):
            step, got = _restore(store)
            assert step == 1 and _equal(got, want)
            assert _equal(store.checkout("job/main")["model"], want)
        assert any("reading the older" in r.getMessage() for r in caplog.records)
    finally:
        wrapped[0].gate.set()
        with pytest.raises(tsck.IntegrityError):
            store.close()


@pytest.mark.slow  # PostgreSQL behind a real TCP proxy
def test_remote_unreachable_reads_the_local_tier_and_never_looks_like_a_first_run(tmp_path, pg_dsn, caplog):
    """The remote ref table (PostgreSQL through a real TCP proxy) goes dark. With the
    local tier intact, restore_latest restores the local tip, with a warning. With the
    local tier lost, restore_latest raises the remote's StorageError: it does not
    return None, which a training script takes for a first run and starts over from step 0."""
    from psycopg.conninfo import conninfo_to_dict
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    from tests.sim.netproxy import NetProxy
    d = conninfo_to_dict(pg_dsn)
    proxy = NetProxy(int(d.get("port", 5432)), d.get("host", "127.0.0.1"), marker=None)
    d.update(host="127.0.0.1", port=str(proxy.port), connect_timeout="2")
    dsn = " ".join(f"{k}={v}" for k, v in d.items())
    remote, local = str(tmp_path / "remote"), str(tmp_path / "nvme")
    opened = []
    try:
        # The outage lasts until restore(): a short retry budget, or each read waits out 60 s.
        store = tsck.open_store(remote, refs=dsn, local=local, block_size=BS, inline_threshold=256, retry_budget=2)
        opened.append(store)
        want = _put_durable(store, 1)
        proxy.blackout()
        with caplog.at_level(logging.WARNING):
            step, got = _restore(store)
        assert step == 1 and _equal(got, want)
        assert any("unreachable" in r.getMessage() for r in caplog.records)
        proxy.restore()
        lost = tsck.open_store(remote, refs=dsn, local=str(tmp_path / "empty"), block_size=BS, inline_threshold=256,
                               retry_budget=2)
        opened.append(lost)
        proxy.blackout()
        with pytest.raises(tsck.StorageError):
            _restore(lost)
    finally:
        proxy.restore()
        proxy.release()
        for s in opened:
            s.close()
        proxy.close()
