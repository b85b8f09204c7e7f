"""S3 requests in proportion to change: a Store remembers the blocks
and nodes it saw present under the gc deletion epoch it read before looking
(assets.Presence), so an incremental snapshot asks storage only about what changed, and
a checkout of a big tensor does not HEAD blocks it knows. Safety: nothing seen before a
gc deletion phase is trusted after it (docs/design/presence.md).

Requests are counted at the S3 client (botocore's before-call event) on a real S3
server (moto, or radosgw via TEST_S3_ENDPOINT)."""

from __future__ import annotations

import collections
import json
import os
import sys
import threading

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.read import read
from tensorstore_ck.storage.wrappers import WrappedStore

import _zygote as zygote

pytestmark = pytest.mark.slow  # a real S3 server

BS = 16 * 1024


def _open(s3_url, s3_server, tmp_path, **kw) -> tsck.Store:
    return tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server,
                           block_size=BS, inline_threshold=256, **kw)


def _counter(store) -> collections.Counter:
    """The S3 operations the store's client sends from now on, by name."""
    s = store.storage
    while not hasattr(s, "fs"):
        s = s.inner
    seen: collections.Counter = collections.Counter()
    s.fs.s3.meta.events.register("before-call.s3", lambda model, **_: seen.update([model.name]))
    return seen


def _objects(store) -> set:
    return {(k, o.digest) for k in ("blocks", "nodes", "commits") for o in store.assets.list_objects(k)}


def _gc_elsewhere(s3_url, s3_server, tmp_path) -> dict:
    """`tsck gc --grace 0` in another process (its own Store): its report."""
    env = {**os.environ, "TSCK_REFS": str(tmp_path / "refs.lmdb"), "TSCK_STORAGE_OPTIONS": json.dumps(s3_server)}
    r = zygote.run([sys.executable, "-m", "tensorstore_ck", "gc", s3_url, "--grace", "0", "--json"],
                   capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _state(n: int = 40, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"layer{i}": torch.randn(4 * BS // 4, generator=g) for i in range(n)}, "step": seed}


def test_incremental_put_asks_only_about_what_changed(s3_url, s3_server, tmp_path):
    """(a) After ~10% of the tensors changed, a put costs <= 1.2 x the new objects + a
    constant; before the record every unchanged block and node cost a HEAD."""
    store = _open(s3_url, s3_server, tmp_path)
    state = _state()
    seen = _counter(store)
    store.put_snapshot(state, ref="j/main", step=1)  # cold: asks about everything
    first = sum(seen.values())
    seen.clear()
    store.put_snapshot(state, ref="j/main", step=2)  # nothing changed: the commit only
    unchanged = dict(seen)
    assert sum(unchanged.values()) <= 3, unchanged
    for i in range(4):  # 10% of the tensors
        state["model"][f"layer{i}"].add_(1.0)
    state["step"] = 3
    before = _objects(store)
    seen.clear()
    info = store.put_snapshot(state, ref="j/main", step=3)
    counted = dict(seen)
    new = len(_objects(store) - before)
    assert info.blocks_new == 16 and new >= 17, (info, new)
    assert sum(counted.values()) <= 1.2 * new + 3, (counted, new, first)
    assert counted.get("HeadObject", 0) <= 3, counted
    assert store.checkout("j/main")["model"]["layer0"].equal(state["model"]["layer0"])
    assert not store.fsck().findings
    store.close()


@pytest.mark.parametrize("how", ["delete_ref", "forget", "read"])
def test_a_gc_between_puts_voids_the_record(s3_url, s3_server, tmp_path, how):
    """(b) The record says block X is present (this Store wrote it, or read it: "read");
    another process's gc deletes X in a deletion phase between two puts of this Store. The
    next put of a state holding X must write X again: a record trusted across the phase
    would publish a snapshot whose block is missing."""
    writer = _open(s3_url, s3_server, tmp_path)
    x = torch.randn(8 * BS // 4, generator=torch.Generator().manual_seed(7))
    writer.put_snapshot({"x": x, "i": 0}, ref="tmp/x", step=0)
    if how == "read":  # a fresh Store that knows X from a checkout only
        writer.close()
        writer = _open(s3_url, s3_server, tmp_path)
        assert writer.checkout("tmp/x")["x"].equal(x)
    writer.put_snapshot({"y": torch.zeros(64)}, ref="j/main", step=1)  # warm: a snapshot published
    if how in ("delete_ref", "read"):
        writer.delete_ref("tmp/x")
    else:
        writer.put_snapshot({"y": torch.ones(64)}, ref="tmp/x", step=1)  # the old tip of tmp/x ...
        writer.forget(writer.log("tmp/x")[-1].root)                       # ... is forgotten
    rep = _gc_elsewhere(s3_url, s3_server, tmp_path)
    assert rep["deleted_by_kind"].get("blocks", 0) >= 8, rep
    info = writer.put_snapshot({"x": x, "i": 1}, ref="j/main", step=2)
    rep = writer.fsck()
    assert not rep.findings, rep.findings  # a record kept across the epoch: 8 missing blocks here
    assert writer.checkout("j/main")["x"].equal(x)
    assert info.blocks_new == 8, info  # written again: the record died with the epoch
    writer.close()


class _PauseFirstCommit(WrappedStore):
    """Holds the first commit object's write until released: the writer has reused (or
    written) every block and node, and its ref has not moved yet."""

    def __init__(self, inner):
        super().__init__(inner)
        self.reached, self.go = threading.Event(), threading.Event()

    def put_if_absent(self, key, bufs):
        if key.startswith("commits/") and not self.reached.is_set():
            self.reached.set()
            assert self.go.wait(120)
        return self.inner.put_if_absent(key, bufs)


def test_a_gc_during_a_put_that_reused_recorded_blocks(s3_url, s3_server, tmp_path):
    """(b) The other order: the put reuses X from its record (same epoch at its fence),
    then a gc elsewhere deletes X before the ref moves. The move is fenced; re-validation
    must ask storage about X (the record is of the old epoch) and write it again."""
    box = {}

    def wrap(s):
        box["w"] = _PauseFirstCommit(s)
        box["w"].reached.set()  # not yet
        return box["w"]

    writer = _open(s3_url, s3_server, tmp_path, wrap_storage=wrap)
    x = torch.randn(8 * BS // 4, generator=torch.Generator().manual_seed(11))
    writer.put_snapshot({"x": x}, ref="tmp/x", step=0)
    writer.put_snapshot({"y": torch.zeros(64)}, ref="j/main", step=1)
    writer.delete_ref("tmp/x")  # X is garbage now, and in the writer's record
    box["w"].reached.clear()
    seen = _counter(writer)
    out = {}
    t = threading.Thread(target=lambda: out.update(info=writer.put_snapshot({"x": x, "i": 1}, ref="j/main",
                                                                             step=2)))
    t.start()
    assert box["w"].reached.wait(120)
    assert seen.get("HeadObject", 0) + seen.get("PutObject", 0) <= 2, dict(seen)  # X came from the record
    rep = _gc_elsewhere(s3_url, s3_server, tmp_path)
    assert rep["deleted_by_kind"].get("blocks", 0) >= 8, rep
    box["w"].go.set()
    t.join(120)
    assert "info" in out
    rep = writer.fsck()
    assert not rep.findings, rep.findings
    assert writer.checkout("j/main")["x"].equal(x)
    writer.close()


def test_record_is_not_used_while_a_deletion_phase_may_run(s3_url, s3_server, tmp_path):
    """An odd epoch (a gc deleting) records nothing and trusts nothing: the put asks
    storage and its move is fenced (it waits the phase out, then re-validates)."""
    store = _open(s3_url, s3_server, tmp_path)
    p = store.assets.presence
    p.add(1, b"d" * 32, 4)
    assert p.known(1, b"d" * 32, 4)
    assert not p.known(1, b"d" * 32, 5) and not p.known(1, b"d" * 32, 6) and not p.known(1, b"d" * 32, 2)
    p.add(1, b"e" * 32, 5)
    assert not p.known(1, b"e" * 32, 5)
    p.add(1, b"f" * 32, 2)  # a writer of an older epoch: proves nothing now
    assert not p.known(1, b"f" * 32, 2) and not p.known(1, b"f" * 32, 4)
    p.add(1, b"g" * 32, 6)  # a newer epoch starts the record afresh
    assert not p.known(1, b"d" * 32, 6) and p.known(1, b"g" * 32, 6)
    store.close()


def test_checkout_of_a_big_tensor_heads_only_unknown_blocks(s3_url, s3_server, tmp_path, monkeypatch):
    """(c) The presence check before a big tensor's memory is taken skips the blocks this
    Store saw under the current epoch; after a gc moved the epoch it HEADs each one again."""
    monkeypatch.setattr(read, "PRESENCE_CHECK_ABOVE", 64 * 1024)  # "big": 64 KiB here, 64 MiB by default
    store = _open(s3_url, s3_server, tmp_path)
    big = torch.randn(16 * BS // 4, generator=torch.Generator().manual_seed(3))  # 16 blocks
    store.put_snapshot({"big": big}, ref="j/main", step=1)
    seen = _counter(store)
    assert store.checkout("j/main")["big"].equal(big)
    assert seen.get("HeadObject", 0) == 0, dict(seen)

    store.put_snapshot({"tmp": torch.randn(4096)}, ref="tmp/a", step=1)
    store.delete_ref("tmp/a")
    assert _gc_elsewhere(s3_url, s3_server, tmp_path)["deleted_objects"]  # a deletion phase: the epoch moves
    seen.clear()
    assert store.checkout("j/main")["big"].equal(big)
    assert seen.get("HeadObject", 0) == 16, dict(seen)
    seen.clear()  # that checkout read every block under the new epoch: known now
    assert store.checkout("j/main")["big"].equal(big)
    assert seen.get("HeadObject", 0) == 0, dict(seen)
    store.close()


def test_a_put_after_a_checkout_asks_nothing_about_what_was_read(s3_url, s3_server, tmp_path):
    """Resuming: a fresh Store checks out the last snapshot; its next put of the state,
    unchanged but for the step, asks storage nothing about the blocks and nodes it read."""
    store = _open(s3_url, s3_server, tmp_path)
    store.put_snapshot(_state(), ref="j/main", step=1)
    store.close()
    store = _open(s3_url, s3_server, tmp_path)
    state = store.checkout("j/main")
    seen = _counter(store)
    store.put_snapshot(state, ref="j/main", step=2)
    assert sum(seen.values()) <= 3, dict(seen)  # the commit (and one node: the top holds the step)
    store.close()


def test_own_prune_keeps_the_record_less_what_it_deleted(s3_url, s3_server, tmp_path):
    """A job that prunes after each snapshot (CheckpointManager with retention) moves the
    epoch at every prune that deletes; this Store's own prune knows what it deleted, so
    its record survives the phase less exactly that. The next put asks nothing about the
    unchanged tensors, and writes again a block the prune deleted."""
    store = _open(s3_url, s3_server, tmp_path)
    store.set_retention("j", tsck.Retention(keep_last=1))
    state = _state()
    old_b = state["model"]["layer1"].clone()
    store.put_snapshot(state, ref="j/main", step=1)
    state["model"]["layer1"].add_(1.0)  # layer1's blocks of step 1: held by step 1 only
    state["step"] = 2
    store.put_snapshot(state, ref="j/main", step=2)
    epoch = store.gc_fence()
    rep = store.prune("j")
    assert rep.deleted_by_kind.get("blocks") == 4 and store.gc_fence() == epoch + 2, rep
    seen = _counter(store)
    state["step"] = 3
    store.put_snapshot(state, ref="j/main", step=3)  # unchanged tensors: nothing asked
    assert sum(seen.values()) <= 4, dict(seen)
    state["model"]["layer1"].copy_(old_b)  # back to what the prune deleted
    state["step"] = 4
    info = store.put_snapshot(state, ref="j/main", step=4)
    rep = store.fsck()
    assert not rep.findings, rep.findings  # carried with the deleted blocks: 4 missing here
    assert info.blocks_new == 4, info
    assert store.checkout("j/main")["model"]["layer1"].equal(old_b)
    store.close()


def test_a_warm_miss_that_exists_is_judged_as_a_head_would(s3_url, s3_server, tmp_path):
    """Warm, a miss goes out as the conditional PUT alone; if the server says the object
    exists, its size is judged as dedup's HEAD did: an oversized (damaged) one is moved
    aside and the block written again under its address."""
    import blake3
    import s3fs

    from tensorstore_ck.core.assets import block_key
    store = _open(s3_url, s3_server, tmp_path)
    store.put_snapshot({"a": torch.zeros(64)}, ref="j/main", step=1)  # warm
    z = torch.randn(BS // 4, generator=torch.Generator().manual_seed(5))  # one block
    key = block_key(blake3.blake3(z.numpy().tobytes()).digest())
    fs = s3fs.S3FileSystem(**s3_server, skip_instance_cache=True)
    fs.pipe_file(f"{s3_url[len('s3://'):]}/{key}", b"\0" * (BS + 100))  # damaged, written around the store
    seen = _counter(store)
    info = store.put_snapshot({"a": torch.zeros(64), "z": z}, ref="j/main", step=2)
    assert info.blocks_new == 1, info
    assert seen["CopyObject"] == 1, dict(seen)  # moved aside after the 412 and its HEAD
    assert not store.fsck().findings
    assert store.checkout("j/main")["z"].equal(z)
    assert len(list(store.assets.list_aside())) == 1
    store.close()
