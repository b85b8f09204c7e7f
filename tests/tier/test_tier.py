"""A local tier in front of a remote store (open_store(remote, local=PATH)): a put
publishes in the local tier and returns; the uploader sends the objects the remote lacks,
as stored, and then moves the remote ref to the same root (docs/design/tiers.md).

Against a real S3 server (moto, or radosgw via TEST_S3_ENDPOINT) with an LMDB remote ref
table; remote writes are counted or stalled by a WrappedStore around the real S3 store
(wrap_storage= wraps the remote's storage); the crash is a real subprocess killed -9."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.tier import uploader as upload
from tensorstore_ck.storage.wrappers import WrappedStore

import _zygote as zygote
from _util import HoldLookups, Watched, kill_and_close, tier_state

BS = 16 * 1024
DEADLINE = 120.0  # generous: the machine is shared


class Counting(Watched):
    """Records the key of every object written to the remote store."""

    def __init__(self, inner):
        super().__init__(inner)
        self.keys: list[str] = []
        self._lock = threading.Lock()

    def on_write(self, key):
        with self._lock:
            self.keys.append(key)


class Gated(Counting):
    """Holds every remote object write until `gate` is set."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate = threading.Event()

    def put_addressed(self, key, bufs):
        assert self.gate.wait(DEADLINE)
        return super().put_addressed(key, bufs)


def _open(s3_url, s3_server, tmp_path, refs=None, **kw) -> tsck.Store:
    return tsck.open_store(s3_url, refs=refs or str(tmp_path / "refs.lmdb"), storage_options=s3_server,
                           block_size=BS, inline_threshold=256, **kw)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        x.dtype == y.dtype and x.shape == y.shape and x.reshape(-1).view(torch.uint8).equal(y.reshape(-1).view(torch.uint8))
        for x, y in ((a[k].contiguous(), b[k].contiguous()) for k in a))


@pytest.mark.slow  # a real S3 server
@pytest.mark.parametrize("table", ["lmdb", "postgresql"])
def test_put_returns_local_then_wait_durable_lands_it_remotely(s3_url, s3_server, tmp_path, table, request):
    """The put returns while the remote has nothing (its writes are held): durable False,
    in the put's answer and in log; the remote ref does not exist. Once the writes may go,
    wait_durable() returns True, log says durable, and the remote store opened without a
    tier names the same root, checks it out bit for bit and fscks clean. The remote ref
    table is LMDB or PostgreSQL."""
    refs = request.getfixturevalue("pg_dsn") if table == "postgresql" else None
    wrapped = []
    store = _open(s3_url, s3_server, tmp_path, refs=refs, local=str(tmp_path / "nvme"),
                  wrap_storage=lambda s: wrapped.append(Gated(s)) or wrapped[-1])
    gated = wrapped[0]
    state = tier_state(1, step=True)
    info = store.put_snapshot(state, "job/main", step=1)
    assert info.durable is False
    assert [i.durable for i in store.log("job/main")] == [False]
    assert store.show("job/main").durable is False
    assert store.wait_durable(timeout=0.2) is False  # held: not durable yet
    assert store.remote_core.refs.get_or_none("job/main") is None
    gated.gate.set()
    assert store.wait_durable(timeout=DEADLINE) is True
    assert [i.durable for i in store.log("job/main")] == [True]
    assert store.remote_core.refs.get_or_none("job/main") == bytes.fromhex(info.root)
    store.close()

    with _open(s3_url, s3_server, tmp_path, refs=refs) as remote:
        assert remote.resolve("job/main") == info.root
        assert _equal(remote.checkout("job/main"), state)
        report = remote.fsck(full=True)
        assert report.findings == [] and report.snapshots_checked == 1


@pytest.mark.slow  # a real S3 server
def test_unchanged_tensors_are_not_uploaded_again(s3_url, s3_server, tmp_path):
    """A second snapshot that changes one tensor sends only that tensor's blocks, its new
    nodes and its commit: no remote object is written twice."""
    wrapped = []
    store = _open(s3_url, s3_server, tmp_path, local=str(tmp_path / "nvme"),
                  wrap_storage=lambda s: wrapped.append(Counting(s)) or wrapped[-1])
    counting = wrapped[0]
    state = tier_state(2, step=True)
    store.put_snapshot(state, "job/main", step=1)
    assert store.wait_durable(timeout=DEADLINE)
    first = list(counting.keys)
    assert sum(k.startswith("blocks/") for k in first) == 5  # w: 4 blocks, b: 1 ("step" is inline)
    state["b"] = state["b"] + 1  # one block changes
    info = store.put_snapshot(state, "job/main", step=2)
    assert store.wait_durable(timeout=DEADLINE)
    second = counting.keys[len(first):]
    assert len(second) == len(set(second)) and not set(second) & set(first)
    assert sum(k.startswith("blocks/") for k in second) == 1  # b's block only
    assert any(k.startswith("commits/") for k in second) and any(k.startswith("nodes/") for k in second)
    store.close()
    with _open(s3_url, s3_server, tmp_path) as remote:
        assert remote.resolve("job/main") == info.root
        assert [i.step for i in remote.log("job/main")] == [2, 1]
        assert _equal(remote.checkout("job/main"), state)


_WRITER = r"""
import sys, threading, time
import torch
import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import WrappedStore
s3_url, refs, local, opts = sys.argv[1], sys.argv[2], sys.argv[3], __import__("json").loads(sys.argv[4])
lock = threading.Lock()

class Stall(WrappedStore):
    n = 0
    def put_addressed(self, key, bufs):
        with lock:
            Stall.n += 1
            n = Stall.n
        if n > 2:  # the third object write never happens: the upload is killed midway
            time.sleep(3600)
        got = self.inner.put_addressed(key, bufs)
        print("PUT", key, flush=True)
        return got

store = tsck.open_store(s3_url, refs=refs, storage_options=opts, block_size=16384, inline_threshold=256,
                        local=local, wrap_storage=Stall, workers=1)
g = torch.Generator().manual_seed(3)
state = {"w": torch.randn(64, 256, generator=g), "b": torch.randn(300, generator=g), "step": torch.tensor(3)}
info = store.put_snapshot(state, "job/main", step=3)
print("RETURNED", info.root, info.durable, flush=True)
time.sleep(3600)
"""


@pytest.mark.slow  # a real S3 server
def test_kill_9_midway_through_an_upload_resumes_at_the_next_open(s3_url, s3_server, tmp_path):
    """A writer process whose put returned is killed -9 while its upload has sent two
    objects and hangs on the third. The remote ref does not exist then. Reopened with
    the same local tier, the uploader resumes from the queue in the local table: it
    sends only what the remote lacks (none of the two objects again), and the remote ref
    lands on the snapshot, which checks out bit for bit from the remote alone."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    refs, local = str(tmp_path / "refs.lmdb"), str(tmp_path / "nvme")
    proc = zygote.Popen([sys.executable, "-c", _WRITER, s3_url, refs, local, json.dumps(s3_server)],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    sent_before: list[str] = []
    root = None
    try:
        deadline = time.monotonic() + DEADLINE
        while root is None or len(sent_before) < 2:
            assert time.monotonic() < deadline, "the writer did not get there"
            line = proc.stdout.readline()
            assert line, f"the writer ended: {proc.stderr.read()[-2000:]}"
            word, *rest = line.split()
            if word == "PUT":
                sent_before.append(rest[0])
            elif word == "RETURNED":
                root, durable = rest
                assert durable == "False"
    finally:
        kill_and_close(proc)

    with _open(s3_url, s3_server, tmp_path) as remote:  # killed before the move
        assert remote.reftable.get_or_none("job/main") is None

    wrapped = []
    store = _open(s3_url, s3_server, tmp_path, local=local,
                  wrap_storage=lambda s: wrapped.append(Counting(s)) or wrapped[-1])
    assert [i.durable for i in store.log("job/main")] == [False]
    assert store.wait_durable(timeout=DEADLINE) is True
    resumed = wrapped[0].keys
    assert resumed and not set(resumed) & set(sent_before)
    assert store.log("job/main")[0].durable is True
    store.close()
    with _open(s3_url, s3_server, tmp_path) as remote:
        assert remote.resolve("job/main") == root
        g = torch.Generator().manual_seed(3)
        want = {"w": torch.randn(64, 256, generator=g), "b": torch.randn(300, generator=g), "step": torch.tensor(3)}
        assert _equal(remote.checkout("job/main"), want)
        assert remote.fsck(full=True).findings == []


@pytest.mark.slow  # a real S3 server
def test_checkpoint_manager_on_a_tiered_store(s3_url, s3_server, tmp_path):
    """CheckpointManager, unchanged, over a store with a local tier: asynchronous
    snapshots publish locally, restore_latest reads the newest one, and after
    wait_durable the remote store holds the newest snapshot of the job (an older one
    still queued behind a newer one is skipped: the backlog rule, test_tier_backlog.py)."""
    store = _open(s3_url, s3_server, tmp_path, local=str(tmp_path / "nvme"))
    model = torch.nn.Linear(8, 4)
    state = tsck.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    mgr = tsck.CheckpointManager(store, job="job", ref="job/main", state=state, every_steps=2)
    for step in range(1, 7):
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.step(step)
    mgr.wait()
    want = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.zero_()
    assert mgr.restore_latest() == 6
    assert torch.equal(model.weight, want)
    mgr.close()
    assert store.wait_durable(timeout=DEADLINE)
    durable = [i.step for i in store.log("job/main") if i.durable]
    assert durable[0] == 6 and [i.step for i in store.log("job/main")] == [6, 4, 2]
    store.close()
    with _open(s3_url, s3_server, tmp_path) as remote:
        assert [i.step for i in remote.log("job/main")] == durable


class HoldNodes(Counting):
    """Lets blocks through and holds the first node write until `gate` is set."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate, self.waiting = threading.Event(), threading.Event()

    def put_addressed(self, key, bufs):
        if key.startswith("nodes/"):
            self.waiting.set()
            assert self.gate.wait(DEADLINE)
        return super().put_addressed(key, bufs)


@pytest.mark.slow  # a real S3 server
def test_gc_deleting_an_upload_in_flight_fences_the_move_and_it_revalidates(s3_url, s3_server, tmp_path):
    """The remote blocks of an upload in flight are garbage to a remote gc (no remote
    snapshot names them yet): a gc that runs while the upload holds its first node deletes
    them. The remote ref move, fenced on the epoch read before the upload, is refused;
    the uploader waits out the phase, asks for every object again, sends what the gc
    removed, and only then moves the ref: the remote snapshot is whole (fsck clean)."""
    from tensorstore_ck.maintain.gc import run_gc
    wrapped = []
    store = _open(s3_url, s3_server, tmp_path, local=str(tmp_path / "nvme"),
                  wrap_storage=lambda s: wrapped.append(HoldNodes(s)) or wrapped[-1])
    held = wrapped[0]
    state = tier_state(4, step=True)
    info = store.put_snapshot(state, "job/main", step=1)
    assert held.waiting.wait(DEADLINE)
    blocks = [k for k in held.keys if k.startswith("blocks/")]
    assert len(blocks) == 5
    remote = store.remote_core
    report = run_gc(remote, grace=0.0)
    assert report.deleted_objects >= 5
    assert not any(remote.storage.exists(k) for k in blocks)  # the gc took them
    held.gate.set()
    assert store.wait_durable(timeout=DEADLINE) is True
    assert [k for k in held.keys if k.startswith("blocks/")].count(blocks[0]) == 2  # sent again
    store.close()
    with _open(s3_url, s3_server, tmp_path) as r:
        assert r.resolve("job/main") == info.root
        assert r.fsck(full=True).findings == []
        assert _equal(r.checkout("job/main"), state)


def test_local_tier_in_front_of_a_local_store(tmp_path, capsys):
    """No server: the tier works in front of any store (here a directory). The put's
    answer says local-only; the remote store, opened by itself, names the snapshot once
    wait_durable() returned; the tier opened as a store of its own (`tsck log
    /nvme/tsck REF`) marks a queued snapshot local-only and the uploaded one not."""
    from tensorstore_ck.cli import main
    store = tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=BS,
                            inline_threshold=256)
    state = tier_state(5, step=True)
    info = store.put_snapshot(state, "job/main", step=7)
    assert info.durable is False
    assert store.wait_durable() is True
    assert store.show(info.root).durable is True
    store.close()
    with tsck.open_store(str(tmp_path / "remote"), create=False) as remote:
        assert remote.resolve("job/main") == info.root and _equal(remote.checkout("job/main"), state)
    # A snapshot still in the queue (here put into the tier by itself and queued by hand,
    # as a put killed before its upload leaves it):
    with tsck.open_store(str(tmp_path / "nvme"), create=False) as tier:
        late = tier.put_snapshot(tier_state(6, step=True), "job/main", step=8)
        tier.reftable.tier_rows.upload_enqueue(bytes.fromhex(late.root), "job/main", 8)
        assert [(i.step, i.durable) for i in tier.log("job/main")] == [(8, False), (7, True)]
    capsys.readouterr()
    assert main(["log", str(tmp_path / "nvme"), "job/main"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [("local-only" in line) for line in lines] == [True, False]
    assert main(["log", "--json", str(tmp_path / "nvme"), "job/main"]) == 0
    assert [e["durable"] for e in json.loads(capsys.readouterr().out)] == [False, True]


def test_a_damaged_local_block_is_never_uploaded_and_stops_the_uploader(tmp_path):
    """Stored bytes are untrusted, the tier's too: a local block damaged after the put
    returned is checked before it is sent, so the remote never receives it and its ref
    does not move; wait_durable() raises the IntegrityError naming the object, once
    (close() then says nothing more); the snapshot stays queued. The early upload is off
    here (early_upload=False): a block it sends leaves from memory, before any damage, and the
    next test shows that case."""
    wrapped = []
    store = tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=BS,
                            inline_threshold=256, early_upload=False, wrap_storage=lambda s: wrapped.append(HoldLookups(s)) or wrapped[-1])
    info = store.put_snapshot(tier_state(7, step=True), "job/main", step=1)
    blocks = sorted((tmp_path / "nvme" / "blocks").rglob("*"))
    victim = [p for p in blocks if p.is_file()][0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    wrapped[0].gate.set()
    with pytest.raises(tsck.IntegrityError) as e:
        store.wait_durable(timeout=DEADLINE)
    assert victim.name in str(e.value)
    assert store.remote_core.refs.get_or_none("job/main") is None
    assert not store.remote_core.storage.exists(f"blocks/{victim.parent.name}/{victim.name}")
    assert [i.durable for i in store.log("job/main")] == [False]
    store.close()  # heard already: not raised again
    with tsck.open_store(str(tmp_path / "nvme"), create=False) as tier:
        assert [e["root"].hex() for _, e in tier.reftable.tier_rows.upload_pending()] == [info.root]


def test_the_early_upload_sends_blocks_as_they_are_written_and_the_uploader_only_the_rest(tmp_path):
    """The early upload (tee): each new block a tiered put writes is sent to the remote
    from memory as it is written, so the uploader, after publication, finds the blocks
    there (recorded present under the fence read before they were sent) and sends only
    the nodes and the commit. A local block damaged after the put returned changes
    nothing remotely: the remote copy left from memory, and the durable snapshot reads
    whole from the remote alone."""
    wrapped = []
    store = tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=BS,
                            inline_threshold=256, early_upload=True,
                            wrap_storage=lambda s: wrapped.append(HoldLookups(s)) or wrapped[-1])
    state = tier_state(7, step=True)
    info = store.put_snapshot(state, "job/main", step=1)
    up = store._tier.uploader
    blocks = [p for p in sorted((tmp_path / "nvme" / "blocks").rglob("*")) if p.is_file()]
    victim = blocks[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    wrapped[0].gate.set()
    assert store.wait_durable(timeout=DEADLINE)
    assert up.teed == len(blocks) > 1 and up.tee_dropped == 0
    assert up.sent < len(blocks) and up.skipped >= len(blocks), (up.sent, up.skipped)
    store.close()
    with tsck.open_store(str(tmp_path / "remote"), create=False) as remote:
        assert remote.refs()["job/main"].root == info.root
        assert remote.fsck().ok
        assert _equal(remote.checkout("job/main"), state)


def test_early_upload_over_its_memory_bound_leaves_the_rest_to_the_uploader(tmp_path, monkeypatch):
    """At most TEE_BYTES of early sends are held in memory: past that a block is left to
    the uploader, which reads it back from the tier (checked) after publication. The
    snapshot is durable and whole either way."""
    monkeypatch.setattr(upload, "TEE_BYTES", BS + 64)  # about one block in flight
    store = tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=BS,
                            inline_threshold=256, early_upload=True)
    state = tier_state(8, step=True)
    info = store.put_snapshot(state, "job/main", step=1)
    assert store.wait_durable(timeout=DEADLINE)
    up = store._tier.uploader
    blocks = [p for p in (tmp_path / "nvme" / "blocks").rglob("*") if p.is_file()]
    assert up.tee_dropped > 0 and up.teed + up.tee_dropped == len(blocks), (up.teed, up.tee_dropped, len(blocks))
    store.close()
    with tsck.open_store(str(tmp_path / "remote"), create=False) as remote:
        assert remote.refs()["job/main"].root == info.root
        assert remote.fsck().ok
        assert _equal(remote.checkout("job/main"), state)


def test_early_upload_defaults_by_the_hosts_cores_and_checks_its_value(tmp_path):
    """early_upload=None (the default) is on where the host has upload.EARLY_UPLOAD_CORES
    cores or more, off below (its sends would take the put's CPU); True and False say so;
    anything else, or True without a local tier, is refused before anything is made."""
    for given, want in ((None, (os.cpu_count() or 1) >= upload.EARLY_UPLOAD_CORES), (True, True), (False, False)):
        with tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=BS,
                             inline_threshold=256, early_upload=given) as store:
            assert store._tier.uploader.early is want, given
    for bad in ("yes", 1, 0.0):
        with pytest.raises(tsck.InvalidArgument, match="early_upload"):
            tsck.open_store(str(tmp_path / "r2"), local=str(tmp_path / "n2"), early_upload=bad)
    with pytest.raises(tsck.InvalidArgument, match="needs local="):
        tsck.open_store(str(tmp_path / "r3"), early_upload=True)
    assert not (tmp_path / "r2").exists() and not (tmp_path / "n2").exists() and not (tmp_path / "r3").exists()


def test_a_local_tip_never_queued_is_queued_at_open(tmp_path):
    """The state a put killed between its local ref move and its enqueue leaves: a local
    snapshot neither queued nor durable (made here by putting into the tier opened as a
    store of its own). The next open with local= queues the ref's tip and uploads it."""
    tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=BS,
                    inline_threshold=256).close()
    state = tier_state(8, step=True)
    with tsck.open_store(str(tmp_path / "nvme"), create=False) as tier:
        info = tier.put_snapshot(state, "job/main", step=4)
        assert tier.reftable.tier_rows.upload_pending() == []
    with tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme")) as store:
        assert store.wait_durable(timeout=DEADLINE) is True
        assert store.show("job/main").durable is True
    with tsck.open_store(str(tmp_path / "remote"), create=False) as remote:
        assert remote.resolve("job/main") == info.root and _equal(remote.checkout("job/main"), state)


def test_a_part_intent_left_by_a_killed_rank_is_sent_at_open(tmp_path):
    """The state a rank other than 0 leaves when it is killed after saying "done" for its
    part of a collective snapshot, before the snapshot's row reached its tier: the part's
    objects and an intent naming its sub-tree, no row (made here by putting into the tier
    opened as a store of its own, then dropping the ref and the row). The next open with
    local= queues the part and sends its blocks and nodes (not the commit: rank 0 sends
    it), leaving no intent and no durable mark. An intent whose objects are gone is
    dropped with a warning; the uploader goes on."""
    from tensorstore_ck.core.walk import walk_tree
    tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=BS,
                    inline_threshold=256).close()
    with tsck.open_store(str(tmp_path / "nvme"), create=False) as tier:
        info = tier.put_snapshot(tier_state(11, step=True), "job/main", step=7)
        root = bytes.fromhex(info.root)
        tree = tier.reftable.catalog_get(root)["tree"]
        objs = {(o.kind, o.digest) for o in walk_tree(tier.assets, tree, snapshot="t")}
        tier.delete_ref("job/main")  # (its only snapshot's row goes with it)
        assert tier.reftable.catalog_get(root, checked=False) is None and tier.assets.has_commit(root)
        tier.reftable.tier_rows.intent_put(tree, {"ref": "job/main", "step": 7, "job": "job"})
        tier.reftable.tier_rows.intent_put(bytes(32), {"ref": "job/main", "step": 6, "job": "job"})  # nothing of it here
    with tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme")) as store:
        assert store.wait_durable(timeout=DEADLINE) is True
        assert store._tier.uploader.orphans == 1 and store._tier.uploader.error is None
        refs = store.core.refs
        assert refs.tier_rows.intents() == {} and refs.tier_rows.upload_pending() == [] and refs.tier_rows.durable([tree, root]) == set()
        remote = store.remote_core
        assert objs and all(remote.storage.exists(remote.assets.object_key(k + "s", d)) for k, d in objs), objs
        assert not remote.assets.has_commit(root)
        # A row that reaches the tier clears the part's intent (TierTable.catalog_put_part).
        refs.tier_rows.intent_put(tree, {"ref": "job/main", "step": 7, "job": "job"})
        refs.tier_rows.catalog_put_part(root, {"job": "job", "ref": "job/main", "step": 7, "tree": tree}, tree)
        assert refs.tier_rows.intents() == {}


def test_a_snapshot_expired_locally_during_its_upload_is_dropped_not_fatal(tmp_path, monkeypatch):
    """A local prune or gc may remove a queued snapshot before or while it is sent (here:
    forget + gc while its upload waits on its first remote question). The uploader finds
    its objects gone and its catalog row too: it drops it from the queue and goes on
    with the next, instead of stopping on the missing objects. (The forget waits for the
    upload in flight until REMOVE_WAIT, then goes on: a second here, not a minute.)"""
    from tensorstore_ck.tier import holds
    monkeypatch.setattr(holds, "REMOVE_WAIT", 1.0)
    wrapped = []
    store = tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=BS,
                            inline_threshold=256, wrap_storage=lambda s: wrapped.append(HoldLookups(s)) or wrapped[-1])
    a = store.put_snapshot(tier_state(9, step=True), "job/main", step=1)
    b = store.put_snapshot(tier_state(10, step=True), "job/main", step=2)
    store.forget(a.root)
    assert store.gc().deleted_objects > 0
    wrapped[0].gate.set()
    assert store.wait_durable(timeout=DEADLINE) is True
    assert [(i.step, i.durable) for i in store.log("job/main")] == [(2, True)]
    assert store.remote_core.refs.get_or_none("job/main") == bytes.fromhex(b.root)
    assert not store.remote_core.refs.catalog_has(bytes.fromhex(a.root))
    store.close()


class Slow(WrappedStore):
    """Each remote object write takes a while: uploads are still queued when close() begins."""

    def put_addressed(self, key, bufs):
        time.sleep(0.2)
        return self.inner.put_addressed(key, bufs)


def test_close_finishes_the_queued_uploads(tmp_path):
    """close() right after two puts, with remote writes slow enough that both are still
    queued: it returns once the queue is empty (as it finishes asynchronous puts), so a
    job that ends with close() leaves its newest snapshot remote and nothing queued (the
    first is remote too unless the second was queued before its upload began: the
    backlog rule skips it then)."""
    store = tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=BS,
                            inline_threshold=256, wrap_storage=Slow)
    store.put_snapshot(tier_state(11, step=True), "job/main", step=1)
    last = store.put_snapshot(tier_state(12, step=True), "job/main", step=2)
    store.close()
    with tsck.open_store(str(tmp_path / "remote"), create=False) as remote:
        assert [i.step for i in remote.log("job/main")] in ([2, 1], [2])
        assert remote.resolve("job/main") == last.root
    with tsck.open_store(str(tmp_path / "nvme"), create=False) as tier:
        assert tier.reftable.tier_rows.upload_pending() == []


def test_a_forked_child_queues_and_the_parent_uploads(tmp_path):
    """After os.fork() the child has no uploader thread: its put publishes in the tier
    and queues the snapshot in the shared table, and the parent's uploader sends it."""
    store = tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=BS,
                            inline_threshold=256)
    store.put_snapshot(tier_state(13, step=True), "job/main", step=1)
    assert store.wait_durable(timeout=DEADLINE)
    pid = os.fork()
    if pid == 0:  # the child: put, and leave without running the parent's cleanup
        code = 1
        try:
            info = store.put_snapshot(tier_state(14, step=True), "job/child", step=2)
            code = 0 if info.durable is False else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert store.wait_durable(timeout=DEADLINE) is True
    assert store.show("job/child").durable is True
    assert store.remote_core.refs.get_or_none("job/child") == bytes.fromhex(store.resolve("job/child"))
    store.close()


def test_bad_local_tiers_are_refused_before_anything_is_written(tmp_path):
    """local= naming the store itself, or not a path, or with read_only=True: InvalidArgument,
    and nothing is created; a tier of another store: NotAStore."""
    for kw in (dict(local=str(tmp_path / "s")), dict(local=3), dict(local=""),
               dict(local=str(tmp_path / "t"), read_only=True)):
        with pytest.raises(tsck.InvalidArgument):
            tsck.open_store(str(tmp_path / "s"), **kw)
    assert not (tmp_path / "s").exists() and not (tmp_path / "t").exists()
    tsck.open_store(str(tmp_path / "a"), local=str(tmp_path / "t")).close()
    with pytest.raises(tsck.NotAStore, match="belongs to store"):
        tsck.open_store(str(tmp_path / "b"), local=str(tmp_path / "t"))


def test_a_dcp_save_through_the_tier_is_queued_and_becomes_durable(tmp_path):
    """dcp.save with TsckWriter into a tiered store publishes in the tier and queues the
    snapshot like a put: the writer's info says local-only, wait_durable() lands it, and
    the remote alone loads it back bit for bit through TsckReader."""
    import torch.distributed.checkpoint as dcp
    from tensorstore_ck.dcp import TsckReader, TsckWriter
    store = tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=BS,
                            inline_threshold=256)
    sd = tier_state(11, step=True)
    w = TsckWriter(store, ref="job/main", step=3)
    dcp.save(sd, storage_writer=w)
    assert w.info is not None and w.info.durable is False
    assert store.wait_durable(timeout=DEADLINE)
    assert store.show("job/main").durable is True
    store.close()
    with tsck.open_store(str(tmp_path / "remote"), create=False) as remote:
        assert remote.refs()["job/main"].root == w.info.root
        assert remote.fsck().ok
        target = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(target, storage_reader=TsckReader(remote, "job/main"))
        assert _equal(target, sd)


_DCP_RANK = r"""
import sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
import tensorstore_ck as tsck
from tensorstore_ck.dcp import TsckWriter
rank, init, remote, tier = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
store = tsck.open_store(remote, local=tier)
try:
    dcp.save({"w": torch.full((8,), float(rank))}, storage_writer=TsckWriter(store, ref="job/main", step=1))
    print("SAVED")
except BaseException as e:  # DCP raises its CheckpointException, a BaseException
    print("REFUSED", type(e).__name__, str(e).replace("\n", " "))
store.close()
dist.destroy_process_group()
"""


@pytest.mark.slow  # two real gloo ranks
def test_a_multi_rank_dcp_save_through_tiers_is_refused_before_any_write(tmp_path):
    """Two gloo ranks, each with its own tier (a node each): the coordinator's commit
    would name blocks its tier lacks, so TsckWriter refuses before any rank writes, with
    a clear error, and neither tier nor the remote holds a snapshot."""
    remote = str(tmp_path / "remote")
    tsck.open_store(remote).close()
    init = f"file://{tmp_path / 'rdv'}"
    procs = [zygote.Popen([sys.executable, "-c", _DCP_RANK, str(r), init, remote, str(tmp_path / f"tier{r}")],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=DEADLINE) for p in procs]
    for out, err in outs:
        assert "REFUSED" in out and "local tier" in out, (out, err[-2000:])
    for path in [remote] + [str(tmp_path / f"tier{r}") for r in range(2)]:
        with tsck.open_store(path, create=False) as s:
            assert s.refs() == {}


def test_the_jobs_retention_is_applied_to_the_remote_store_after_each_upload(tmp_path):
    """A job's retention set on a tiered store is set in both tiers' tables, and the
    uploader prunes the job in the remote store after each upload, as a CheckpointManager
    prunes after each snapshot: the remote keeps the job's last two snapshots and holds
    nothing else (a gc of it finds nothing to delete), instead of growing without end."""
    store = tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme"), block_size=BS,
                            inline_threshold=256)
    store.set_retention("job", tsck.Retention(keep_last=2))
    for step in range(1, 6):
        store.put_snapshot(tier_state(20 + step, step=True), "job/main", job="job", step=step)
        assert store.wait_durable(timeout=DEADLINE)  # each durable: none skipped by the backlog rule
    store.close()
    with tsck.open_store(str(tmp_path / "remote"), create=False) as remote:
        assert [i.step for i in remote.log("job/main")] == [5, 4]
        assert remote.retention()["job"].keep_last == 2
        assert remote.gc(dry_run=True).candidates == 0
        assert remote.fsck().ok
        assert _equal(remote.checkout("job/main"), tier_state(25, step=True))
