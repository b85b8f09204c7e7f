"""A local tier's backlog and byte budget (docs/design/tiers.md, "Backlog" and "Budget"):
when uploads fall behind, a queued snapshot superseded by a newer one of its ref is not
sent unless a tag or pin names it; the tier's bytes are kept under `local_budget=` by
evicting durable snapshots' local copies through the local gc, never what a pending
upload or a local-only snapshot needs.

The remote is a real store (a directory, or moto S3 for the slow tests); its writes are
held or slowed by a WrappedStore around its storage (wrap_storage=)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import WrappedStore

BS = 16 * 1024
DEADLINE = 120.0  # generous: the machine is shared


class Held(WrappedStore):
    """Holds every remote object write until `gate` is set; `waiting` is set by the first."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate, self.waiting = threading.Event(), threading.Event()

    def put_addressed(self, key, bufs):
        self.waiting.set()
        assert self.gate.wait(DEADLINE)
        return self.inner.put_addressed(key, bufs)


def _state(seed: int, n: int = 64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, 256, generator=g), "b": torch.randn(300, generator=g)}


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        x.dtype == y.dtype and x.shape == y.shape and x.reshape(-1).view(torch.uint8).equal(y.reshape(-1).view(torch.uint8))
        for x, y in ((a[k].contiguous(), b[k].contiguous()) for k in a))


def _open(tmp_path, **kw) -> tsck.Store:
    return tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=BS,
                           inline_threshold=256, **kw)


def test_a_backlog_uploads_the_newest_and_the_tagged_and_skips_the_rest(tmp_path, caplog):
    """Five puts in a row while the remote's writes are held on the first snapshot's
    upload: the first is in flight (sent whole), the second and fourth are superseded by
    a newer queued snapshot of the ref and skipped (one warning each naming the ref, the
    step and the root; local-only), the third is tagged and uploaded, the fifth (the
    newest) is durable and is the remote tip. Another ref's snapshot is not superseded by
    this ref's."""
    wrapped = []
    store = _open(tmp_path, wrap_storage=lambda s: wrapped.append(Held(s)) or wrapped[-1])
    held = wrapped[0]
    infos = [store.put_snapshot(_state(1), "job/main", step=1)]
    assert held.waiting.wait(DEADLINE)  # the first upload is in flight
    for step in (2, 3, 4, 5):
        infos.append(store.put_snapshot(_state(step), "job/main", step=step))
    other = store.put_snapshot(_state(9), "job/other", step=2)  # queued after main's step 3: its own ref
    store.tag("keep-3", infos[2].root)
    caplog.set_level(logging.INFO, logger="tensorstore_ck.upload")
    held.gate.set()
    assert store.wait_durable(timeout=DEADLINE) is True
    durable = {i.step: i.durable for i in store.log("job/main")}
    assert durable == {5: True, 4: False, 3: True, 2: False, 1: True}
    assert store.show("job/other").durable is True
    remote = store.remote_core
    assert remote.refs.get_or_none("job/main") == bytes.fromhex(infos[4].root)
    assert remote.refs.catalog_has(bytes.fromhex(infos[2].root))
    for skipped in (infos[1], infos[3]):
        assert not remote.refs.catalog_has(bytes.fromhex(skipped.root))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "skipping" in r.getMessage()]
    assert len(warned) == 2
    for msg, info in zip(warned, (infos[1], infos[3])):
        assert "job/main" in msg and f"step {info.step}" in msg and info.root[:16] in msg and "newer" in msg
    assert store._uploader.superseded == 2
    store.close()
    with tsck.open_store(str(tmp_path / "remote"), create=False) as r:
        assert [i.step for i in r.log("job/main")] == [5, 3, 1]
        assert _equal(r.checkout("job/main"), _state(5))
        assert r.fsck(full=True).findings == []
    # The skipped snapshots are still in the tier, local-only, and read whole there.
    with _open(tmp_path) as again:
        assert again.show(infos[1].root).durable is False
        assert _equal(again.checkout(infos[1].root), _state(2))


def _stored(path) -> int:
    return sum(p.stat().st_size for kind in ("blocks", "nodes", "commits") for p in (path / kind).rglob("*")
               if p.is_file())


def test_the_budget_holds_after_many_puts_and_evicted_snapshots_read_from_the_remote(tmp_path):
    """Eight puts of unrelated states (each about 64 KiB stored) under a budget of three
    snapshots' bytes: once wait_durable() returns, the tier's objects fit the budget; the
    newest snapshot is still whole locally, the oldest were evicted (their rows, log and
    refs stay) and check out bit for bit through the remote; the tier fscks clean and
    says how many it evicted; a local gc keeps the rest."""
    nvme = tmp_path / "nvme"
    with _open(tmp_path) as probe:
        probe.put_snapshot(_state(100), "job/probe", step=0)
        assert probe.wait_durable(timeout=DEADLINE)
    one = _stored(nvme)
    budget = 3 * one + one // 2
    with _open(tmp_path, local_budget=budget) as store:
        infos = []
        for step in range(1, 9):
            infos.append(store.put_snapshot(_state(step), "job/main", step=step))
            assert store.wait_durable(timeout=DEADLINE)
            assert _stored(nvme) <= budget
        assert [i.step for i in store.log("job/main")] == list(range(8, 0, -1))
        evicted = store.reftable.evicted()
        assert bytes.fromhex(infos[-1].root) not in evicted and bytes.fromhex(infos[0].root) in evicted
        assert len(evicted) >= 5
        for step in (1, 8):
            assert _equal(store.checkout(infos[step - 1].root), _state(step))
        report = store.fsck(full=True)
        assert report.findings == [] and report.evicted == len(evicted)
        store.gc()
        assert _equal(store.checkout("job/main"), _state(8))
    with tsck.open_store(str(nvme), create=False) as tier:  # the tier by itself: nothing evicted is missing
        assert tier.fsck(full=True).findings == []


def test_a_budget_smaller_than_one_snapshot_never_evicts_a_pending_or_local_only_one(tmp_path, caplog):
    """A budget of one byte: a snapshot held in the upload queue (the remote's writes
    held) and a local-only one (skipped by the backlog rule) are never evicted; the put
    never fails; a warning says the budget cannot hold them. Once they are durable, the
    older durable ones go, and the local-only one stays whole."""
    wrapped = []
    caplog.set_level(logging.WARNING, logger="tensorstore_ck.upload")
    store = _open(tmp_path, local_budget=1, wrap_storage=lambda s: wrapped.append(Held(s)) or wrapped[-1])
    held = wrapped[0]
    a = store.put_snapshot(_state(1), "job/main", step=1)
    assert held.waiting.wait(DEADLINE)
    b = store.put_snapshot(_state(2), "job/main", step=2)  # superseded by c: stays local-only
    c = store.put_snapshot(_state(3), "job/main", step=3)
    assert store.wait_durable(timeout=0.5) is False
    assert store.reftable.evicted() == set()  # nothing durable yet: nothing may go
    held.gate.set()
    assert store.wait_durable(timeout=DEADLINE) is True
    assert [(i.step, i.durable) for i in store.log("job/main")] == [(3, True), (2, False), (1, True)]
    evicted = store.reftable.evicted()
    assert bytes.fromhex(b.root) not in evicted
    assert {bytes.fromhex(a.root), bytes.fromhex(c.root)} == evicted
    assert any("cannot hold" in r.getMessage() for r in caplog.records)
    assert store.fsck(full=True).findings == []
    store.close()
    with tsck.open_store(str(tmp_path / "nvme"), create=False) as tier:  # b read from the tier alone
        assert _equal(tier.checkout(b.root), _state(2))
        assert tier.fsck(full=True).findings == []
    with _open(tmp_path) as again:
        assert _equal(again.checkout("job/main"), _state(3))
