"""The memory tier and the schedule of durable snapshots (open_store(remote, memory=DIR,
durable_every=N); tier/memory.py, docs/design/memtier.md), in one process against a
remote on this machine's disk: where the tier may live, which snapshots reach the
remote, and that a snapshot kept out of it holds its tier's room only until a newer one
of its ref stands in for it. Across ranks and nodes: tests/tier/test_tier_dist.py."""

from __future__ import annotations

import datetime
import os
import shutil
import threading
import uuid

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.errors import InvalidArgument
from tensorstore_ck.tier.memory import fs_type, memory_dir
from tensorstore_ck.tier.uploader import Uploader

SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(fs_type(SHM) not in ("tmpfs", "ramfs"),
                                reason="this machine has no tmpfs at /dev/shm for a memory tier")


@pytest.fixture
def shm():
    d = os.path.join(SHM, f"tsck-test-{uuid.uuid4().hex[:12]}")
    os.makedirs(d)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _state(v: int) -> dict:
    # each step's own bytes (a block of its own) and one tensor every step shares
    return {"w": torch.full((4096,), float(v)), "frozen": torch.arange(4096, dtype=torch.float32)}


def _open(tmp_path, shm, **kw) -> tsck.Store:
    return tsck.open_store(str(tmp_path / "remote"), memory=os.path.join(shm, "tier"), block_size=16384, **kw)


def _blocks(d: str) -> set:
    return {f for _r, _d, fs in os.walk(os.path.join(d, "blocks")) for f in fs}


def test_the_tier_must_be_in_host_memory(tmp_path, shm, monkeypatch):
    assert fs_type(str(tmp_path)) not in ("tmpfs", "ramfs")  # (this machine's /tmp is a disk)
    with pytest.raises(InvalidArgument, match="not in host memory"):
        tsck.open_store(str(tmp_path / "remote"), memory=str(tmp_path / "tier"))
    assert not (tmp_path / "remote").exists()  # refused before anything was made
    assert memory_dir(os.path.join(shm, "a", "b"), "x").startswith(shm)  # (a directory not made yet)
    # One tier per node and local rank: a restart that numbers the nodes otherwise finds
    # each node's tiers again (placement.read_from).
    for var in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TSCK_NODE", "node/a")
    here = memory_dir(True, str(tmp_path / "remote"))
    assert here.startswith(SHM + "/") and here.endswith("/node_a.0")
    monkeypatch.setenv("RANK", "3")
    assert memory_dir(True, str(tmp_path / "remote")) == here[:-1] + "3"
    monkeypatch.setenv("LOCAL_RANK", "1")  # (torchrun's: the node's 2nd rank, whatever its rank)
    assert memory_dir(True, str(tmp_path / "remote")) == here[:-1] + "1"
    monkeypatch.setenv("TSCK_NODE", "b")
    assert memory_dir(True, str(tmp_path / "remote")) == here[:-len("node_a.0")] + "b.1"
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(InvalidArgument, match="LOCAL_RANK"):
        memory_dir(True, str(tmp_path / "remote"))
    for var in ("RANK", "LOCAL_RANK", "TSCK_NODE"):
        monkeypatch.delenv(var)
    for bad in (dict(memory=os.path.join(shm, "t"), local=str(tmp_path / "nvme")), dict(memory=7),
                dict(durable_every=2), dict(local=str(tmp_path / "nvme"), durable_every=0),
                dict(local=str(tmp_path / "nvme"), durable_every=True), dict(durable_every=datetime.timedelta(0)),
                dict(durable_every=datetime.timedelta(minutes=5)),
                dict(local=str(tmp_path / "nvme"), durable_every=2.5),
                dict(local=str(tmp_path / "nvme"), durable_every=datetime.timedelta(seconds=-1))):
        with pytest.raises(InvalidArgument):
            tsck.open_store(str(tmp_path / "remote"), **bad)
    with _open(tmp_path, shm) as store, pytest.raises(InvalidArgument, match="tier_only"):
        store.put_snapshot(_state(0), ref="j/main", meta={"tier_only": True})  # the store's own mark


def test_every_nth_snapshot_reaches_the_remote_and_the_others_hold_the_tier_until_superseded(tmp_path, shm):
    """durable_every=3: steps 1 and 4 are uploaded, 2, 3 and 5 stay in memory (their commit
    says so). Each tier-only snapshot is dropped from the tier, its own blocks deleted, once
    the next snapshot of its ref is published there; the durable ones stay (no budget), and
    the newest, step 5, is what a checkout of the ref reads, from memory. A new process
    (the same tier reopened) queues none of the tier-only snapshots."""
    tier = os.path.join(shm, "tier")
    with _open(tmp_path, shm, durable_every=3) as store:
        infos = []
        for step in range(1, 6):
            infos.append(store.put_snapshot(_state(step), ref="j/main", step=step))
            if step == 2:
                mine = _blocks(tier)
        assert store.wait_durable(timeout=60)
        only = [i.step for i in infos if i.meta.get("tier_only")]
        assert only == [2, 3, 5], only
        assert [h.step for h in store.log("j/main")] == [5, 4, 1]  # 2 and 3 superseded, gone
        assert [h.durable for h in store.log("j/main")] == [False, True, True]
        assert torch.equal(store.checkout("j/main")["w"], _state(5)["w"])
        # step 2's own block left the tier with it (the shared one stays)
        gone = mine - _blocks(tier)
        assert len(gone) == 1, gone
    with tsck.open_store(str(tmp_path / "remote"), create=False) as remote:
        assert [h.step for h in remote.log("j/main")] == [4, 1]
        assert remote.resolve("j/main") == infos[3].root
    with _open(tmp_path, shm, durable_every=3) as store:  # a new process: nothing tier-only queued
        assert store.wait_durable(timeout=60)
        assert store.resolve("j/main") == infos[4].root
    with tsck.open_store(str(tmp_path / "remote"), create=False) as remote:
        assert [h.step for h in remote.log("j/main")] == [4, 1]


def test_a_time_schedule_uploads_the_first_snapshot_once_its_time_passed(tmp_path, shm):
    """durable_every=timedelta(minutes=10): the first snapshot of each ref is uploaded, then
    the first put once ten minutes passed since the ref's last uploaded one (the tier's
    schedule reads the process's monotonic clock, here a clock the test moves); the puts
    between stay in memory, each until the next is published."""
    now = [1000.0]
    with _open(tmp_path, shm, durable_every=datetime.timedelta(minutes=10)) as store:
        store._tier.schedule._clock = lambda: now[0]
        infos = []
        for step, minutes in [(1, 0), (2, 4), (3, 9.9), (4, 10.1), (5, 15), (6, 20.1)]:
            now[0] = 1000.0 + 60 * minutes
            infos.append(store.put_snapshot(_state(step), ref="j/main", step=step))
        other = store.put_snapshot(_state(7), ref="j/other", step=1)  # (its own first: uploaded)
        assert store.wait_durable(timeout=60)
        assert [i.step for i in infos if i.meta.get("tier_only")] == [2, 3, 5], [i.meta for i in infos]
        assert not other.meta.get("tier_only")
        assert torch.equal(store.checkout("j/main")["w"], _state(6)["w"])
    with tsck.open_store(str(tmp_path / "remote"), create=False) as remote:
        assert [h.step for h in remote.log("j/main")] == [6, 4, 1]


def test_a_tag_on_a_tier_only_snapshot_makes_it_durable(tmp_path, shm):
    """A tag is a promise to keep: the tier-only snapshot it names is sent to the remote
    (with the tag), and the tier keeps it after a newer snapshot supersedes it."""
    with _open(tmp_path, shm, durable_every=5) as store:
        store.put_snapshot(_state(1), ref="j/main", step=1)
        two = store.put_snapshot(_state(2), ref="j/main", step=2)
        assert two.meta.get("tier_only") is True
        store.tag("best", "j/main")
        assert store.wait_durable(timeout=60)
        store.put_snapshot(_state(3), ref="j/main", step=3)
        assert [h.step for h in store.log("j/main")] == [3, 2, 1]  # the tag keeps 2 here too
    with tsck.open_store(str(tmp_path / "remote"), create=False) as remote:
        assert remote.resolve("best") == two.root
        assert torch.equal(remote.checkout("best")["w"], _state(2)["w"])
        assert remote.resolve("j/main") != two.root  # held, not moved to: the remote ref stays on step 1


def test_a_tier_only_snapshot_stays_until_a_newer_one_is_safe(tmp_path, shm, monkeypatch):
    """durable_every=2: step 2 stays in memory, step 3 goes to the remote. While step 3's
    upload is held back (at the uploader's door), step 2 stays in the tier: lost then, a
    node would leave step 1 as the newest whole snapshot, though step 2 was committed.
    Once step 3 is durable, step 2 goes. A tier-only step 4 does not drop step 3 (durable),
    and step 4 itself stays, the newest."""
    gate, upload = threading.Event(), Uploader._upload

    def held_back(up, seq, entry):
        assert gate.wait(60)
        return upload(up, seq, entry)
    with _open(tmp_path, shm, durable_every=2) as store:
        store.put_snapshot(_state(1), ref="j/main", step=1)
        assert store.wait_durable(timeout=60)
        monkeypatch.setattr(Uploader, "_upload", held_back)
        assert store.put_snapshot(_state(2), ref="j/main", step=2).meta.get("tier_only") is True
        assert not store.put_snapshot(_state(3), ref="j/main", step=3).meta.get("tier_only")
        assert [h.step for h in store.log("j/main")] == [3, 2, 1]  # (3 queued, held back: 2 stays)
        store.prune("j")  # (a prune now, as a CheckpointManager runs one: 3 is not durable yet)
        assert [h.step for h in store.log("j/main")] == [3, 2, 1]
        gate.set()
        assert store.wait_durable(timeout=60)
        assert [h.step for h in store.log("j/main")] == [3, 1]
        store.put_snapshot(_state(4), ref="j/main", step=4)
        assert [h.step for h in store.log("j/main")] == [4, 3, 1]
        assert torch.equal(store.checkout("j/main")["w"], _state(4)["w"])


def test_a_memory_tier_drops_the_copies_of_superseded_durable_snapshots(tmp_path, shm):
    """Host memory holds what a restore needs first: durable_every=2 over six steps leaves
    the remote with 1, 3 and 5 and the tier with 6 alone (the newest, tier-only, committed
    as its put returned: it stands in for every older one). The copies of 1, 3 and 5 are
    evicted (their rows stay, their reads go to the remote), 2 and 4 expired. A disk tier
    (local=) keeps its durable copies (a budget evicts them)."""
    tier = os.path.join(shm, "tier")
    with _open(tmp_path, shm, durable_every=2) as store:
        infos = [store.put_snapshot(_state(s), ref="j/main", step=s) for s in range(1, 7)]
        assert store.wait_durable(timeout=60)
        evicted = store.core.refs.tier_rows.evicted()
        assert evicted == {bytes.fromhex(infos[i].root) for i in (0, 2, 4)}, evicted
        assert [h.step for h in store.log("j/main")] == [6, 5, 3, 1]
        assert torch.equal(store.checkout(infos[4].root)["w"], _state(5)["w"])  # (from the remote)
        assert torch.equal(store.checkout("j/main")["w"], _state(6)["w"])
        assert len(_blocks(tier)) == 2  # 6's own block and the shared one
    with tsck.open_store(str(tmp_path / "remote2"), local=str(tmp_path / "disk"), block_size=16384,
                         durable_every=2) as disk:
        for s in range(1, 7):
            disk.put_snapshot(_state(s), ref="j/main", step=s)
        assert disk.wait_durable(timeout=60)
        assert disk.core.refs.tier_rows.evicted() == set()


def test_a_memory_tiers_default_budget_is_half_its_tmpfs_shared_by_the_nodes_ranks(tmp_path, shm, monkeypatch):
    """Without local_budget=, a memory tier may take half its tmpfs, shared by the node's
    ranks ($LOCAL_WORLD_SIZE); local_budget= given wins. Past it a put raises TierFull
    (a node's memory does not run out): here a node of so many ranks that a tier's share
    is below a snapshot, whose tier-only snapshot cannot be evicted to make room."""
    st = os.statvfs(shm)
    half = int(st.f_blocks * st.f_frsize * 0.5)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with _open(tmp_path, shm) as s:
        assert s._tier.uploader.budget == half
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with _open(tmp_path, shm) as s:
        assert s._tier.uploader.budget == half // 8
    with _open(tmp_path, shm, local_budget=1 << 30) as s:
        assert s._tier.uploader.budget == 1 << 30
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(half // (48 << 10)))  # a tier's share: about 48 KiB
    with _open(tmp_path, shm, durable_every=3) as s:
        s.put_snapshot(_state(1), ref="r", step=1)
        # tier-only, 256 KiB: the tier fitted its budget when the put began
        s.put_snapshot({"big": torch.randn(64 << 10)}, ref="r", step=2)
        assert s.wait_durable(timeout=60)
        with pytest.raises(tsck.TierFull):
            s.put_snapshot(_state(3), ref="r", step=3)
        assert [h.step for h in s.log("r")] == [2, 1]
