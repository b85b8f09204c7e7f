"""A removal through a local tier holds against the tier's own upload queue: a snapshot
of the deleted ref that a pin or tag keeps, still queued when the ref is deleted (the
remote away), is sent for its pin or tag once the remote is back and moves no remote ref,
which would bring back the ref the removal took from both tables (found by the harness,
tests/sim/tierops.py: I7 on a tier writer's delete_ref, `--focus tier-ops --seed 5`)."""

from __future__ import annotations

import errno
import threading

import pytest

import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import WrappedStore
from tensorstore_ck.tier import holds
from tensorstore_ck.tier import uploader as upload

from _util import tier_state

DEADLINE = 120.0  # generous: the machine is shared


class Away(WrappedStore):
    """The remote storage refuses every request while `away` is set (a server gone)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.away = threading.Event()

    def _check(self, what: str) -> None:
        if self.away.is_set():
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"test: the remote is away ({what})")

    def get(self, key, max_bytes=None):
        self._check("get")
        return self.inner.get(key, max_bytes)

    def open_read(self, key, max_bytes=None):
        self._check("read")
        return self.inner.open_read(key, max_bytes)

    def put_if_absent(self, key, bufs):
        self._check("put")
        return self.inner.put_if_absent(key, bufs)

    def put_addressed(self, key, bufs):
        self._check("put")
        return self.inner.put_addressed(key, bufs)

    def exists(self, key):
        self._check("exists")
        return self.inner.exists(key)

    def size_of(self, key):
        self._check("size")
        return self.inner.size_of(key)


@pytest.mark.parametrize("hold", ["pin", "tag"])
def test_a_kept_snapshot_queued_when_its_ref_is_deleted_moves_no_remote_ref(tmp_path, monkeypatch, hold):
    monkeypatch.setattr(upload, "RETRY_PAUSE", (0.05, 0.1))
    # The upload that keeps failing counts as in flight: the delete waits this long for it.
    monkeypatch.setattr(holds, "REMOVE_WAIT", 0.5)
    remote = str(tmp_path / "remote")
    tsck.open_store(remote, block_size=16384, inline_threshold=256).close()
    wraps: list[Away] = []
    with tsck.open_store(remote, local=str(tmp_path / "tier"), early_upload=False,
                         wrap_storage=lambda s: wraps.append(Away(s)) or wraps[-1]) as store:
        store.put_snapshot(tier_state(1, 32, cols=128, bias=False, step=True), "j/keep", step=1)  # another ref: the remote stays a store in use
        assert store.wait_durable(timeout=DEADLINE) is True
        wraps[0].away.set()
        root = store.put_snapshot(tier_state(2, 32, cols=128, bias=False, step=True), "j/main", step=2).root  # queued: the remote is away
        if hold == "pin":
            store.pin(root)
        else:
            store.tag("kept", root)
        out = store.delete_ref("j/main")
        assert out["root"] == root
        assert store.reftable.get_or_none("j/main") is None
        wraps[0].away.clear()
        assert store.wait_durable(timeout=DEADLINE) is True
    with tsck.open_store(remote) as r:
        assert r.reftable.get_or_none("j/main") is None, "the queued upload brought back the deleted ref"
        kept = root in {x.hex() for x in r.reftable.pins()} if hold == "pin" else r.reftable.tag_get("kept")
        assert kept, f"the {hold} that keeps the snapshot is not made at the remote"
        assert r.reftable.catalog_has(bytes.fromhex(root))
        assert r.checkout(root)["step"].item() == 2


class Gate(WrappedStore):
    """Remote object writes wait while `shut` is set: an upload stays in flight."""

    def __init__(self, inner):
        super().__init__(inner)
        self.shut = threading.Event()

    def put_addressed(self, key, bufs):
        while self.shut.is_set():
            threading.Event().wait(0.01)
        return self.inner.put_addressed(key, bufs)


def test_an_upload_in_flight_when_its_ref_is_deleted_leaves_no_remote_ref(tmp_path):
    """The ref's first snapshot is being uploaded (its writes held) as the ref is deleted
    through the tier: the delete waits for that upload, whose move makes the ref at the
    remote, and then removes it there too."""
    remote = str(tmp_path / "remote")
    tsck.open_store(remote, block_size=16384, inline_threshold=256).close()
    gates: list[Gate] = []
    with tsck.open_store(remote, local=str(tmp_path / "tier"), early_upload=False,
                         wrap_storage=lambda s: gates.append(Gate(s)) or gates[-1]) as store:
        gates[0].shut.set()
        root = store.put_snapshot(tier_state(1, 32, cols=128, bias=False, step=True), "j/main", step=1).root
        deadline = threading.Event()
        for _ in range(int(DEADLINE / 0.01)):  # the upload has begun (marked in flight)
            if bytes.fromhex(root) in store.reftable.tier_rows.uploading():
                break
            deadline.wait(0.01)
        assert bytes.fromhex(root) in store.reftable.tier_rows.uploading()
        done: list = []
        t = threading.Thread(target=lambda: done.append(store.delete_ref("j/main")))
        t.start()
        for _ in range(int(DEADLINE / 0.01)):  # the tier's ref is gone: the delete waits for the upload
            if store.reftable.get_or_none("j/main") is None:
                break
            deadline.wait(0.01)
        gates[0].shut.clear()
        t.join(DEADLINE)
        assert done and done[0]["root"] == root
        assert store.wait_durable(timeout=DEADLINE) is True
    with tsck.open_store(remote) as r:
        assert r.reftable.get_or_none("j/main") is None, "the upload in flight left the deleted ref at the remote"
