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
