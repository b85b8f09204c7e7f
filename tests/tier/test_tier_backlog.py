"""A local tier's backlog and byte budget (docs/design/tiers.md, "Backlog" and "Budget"):
when uploads fall behind, a queued snapshot superseded by a newer one of its ref is not
sent unless a tag or pin names it; the tier's bytes are kept under `local_budget=` by
evicting durable snapshots' local copies through the local gc, never what a pending
upload or a local-only snapshot needs; a put over the budget waits for uploads, or
fails (TierFull) before writing (more in test_tier_budget.py).

The remote is a real store (a directory, or moto S3 for the slow tests); its writes are
held or slowed by a WrappedStore around its storage (wrap_storage=)."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import WrappedStore

from _util import Watched, kill_and_close, open_tiered, tier_state

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


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        x.dtype == y.dtype and x.shape == y.shape and x.reshape(-1).view(torch.uint8).equal(y.reshape(-1).view(torch.uint8))
        for x, y in ((a[k].contiguous(), b[k].contiguous()) for k in a))


def test_a_backlog_uploads_the_newest_and_the_tagged_and_skips_the_rest(tmp_path, caplog):
    """Five puts in a row, the job keeping its last snapshot, while the remote's writes
    are held on the first snapshot's upload: the first is in flight (sent whole), the
    second and fourth are superseded by a newer queued snapshot of the ref and no rule
    keeps them, so they are skipped (one warning each naming the ref, the step and the
    root; local-only), the third is tagged and uploaded with its tag, the fifth (the
    newest) is durable and is the remote tip. Another ref's snapshot is not superseded by
    this ref's."""
    wrapped = []
    store = open_tiered(tmp_path, wrap_storage=lambda s: wrapped.append(Held(s)) or wrapped[-1])
    # (the tier's table alone: no remote prune after the uploads, so the tier's catalog
    # keeps the skipped snapshots until a prune of its own)
    store.reftable.retention_set("job", tsck.Retention(keep_last=1).to_dict())
    held = wrapped[0]
    infos = [store.put_snapshot(tier_state(1), "job/main", step=1)]
    assert held.waiting.wait(DEADLINE)  # the first upload is in flight
    for step in (2, 3, 4, 5):
        infos.append(store.put_snapshot(tier_state(step), "job/main", step=step))
    other = store.put_snapshot(tier_state(9), "job/other", step=2)  # queued after main's step 3: its own ref
    store.tag("keep-3", infos[2].root)
    caplog.set_level(logging.INFO, logger="tensorstore_ck.tier")
    held.gate.set()
    assert store.wait_durable(timeout=DEADLINE) is True
    durable = {i.step: i.durable for i in store.log("job/main")}
    assert durable == {5: True, 4: False, 3: True, 2: False, 1: True}
    assert store.show("job/other").durable is True
    assert store.remote_core.refs.get_or_none("job/other") == bytes.fromhex(other.root)
    remote = store.remote_core
    assert remote.refs.get_or_none("job/main") == bytes.fromhex(infos[4].root)
    assert remote.refs.catalog_has(bytes.fromhex(infos[2].root))
    for skipped in (infos[1], infos[3]):
        assert not remote.refs.catalog_has(bytes.fromhex(skipped.root))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "skipping" in r.getMessage()]
    assert len(warned) == 2
    for msg, info in zip(warned, (infos[1], infos[3])):
        assert "job/main" in msg and f"step {info.step}" in msg and info.root[:16] in msg and "newer" in msg
    assert store._tier.uploader.superseded == 2
    store.close()
    with tsck.open_store(str(tmp_path / "remote"), create=False) as r:
        assert [i.step for i in r.log("job/main")] == [5, 3, 1]
        assert r.tags()["keep-3"].step == 3  # the tag is the remote's too
        assert _equal(r.checkout("job/main"), tier_state(5))
        assert r.fsck(full=True).findings == []
    # The skipped snapshots are still in the tier, local-only, and read whole there.
    with open_tiered(tmp_path) as again:
        assert again.show(infos[1].root).durable is False
        assert _equal(again.checkout(infos[1].root), tier_state(2))


def _stored(path) -> int:
    return sum(p.stat().st_size for kind in ("blocks", "nodes", "commits") for p in (path / kind).rglob("*")
               if p.is_file())


def test_the_budget_holds_after_many_puts_and_evicted_snapshots_read_from_the_remote(tmp_path, caplog):
    """Eight puts of unrelated states (each about 64 KiB stored) under a budget of three
    snapshots' bytes: once wait_durable() returns, the tier's objects fit the budget; the
    newest snapshot is still whole locally, the oldest were evicted (their rows, log and
    refs stay) and check out bit for bit through the remote; the tier fscks clean and
    says how many it evicted; a local gc keeps the rest. Reading an evicted snapshot
    through the remote is the plan: no warning per object."""
    nvme = tmp_path / "nvme"
    with open_tiered(tmp_path) as probe:
        probe.put_snapshot(tier_state(100), "job/probe", step=0)
        assert probe.wait_durable(timeout=DEADLINE)
    one = _stored(nvme)
    budget = 3 * one + one // 2
    with open_tiered(tmp_path, local_budget=budget) as store:
        infos = []
        for step in range(1, 9):
            infos.append(store.put_snapshot(tier_state(step), "job/main", step=step))
            assert store.wait_durable(timeout=DEADLINE)
            assert _stored(nvme) <= budget
        assert [i.step for i in store.log("job/main")] == list(range(8, 0, -1))
        evicted = store.reftable.tier_rows.evicted()
        assert bytes.fromhex(infos[-1].root) not in evicted and bytes.fromhex(infos[0].root) in evicted
        assert len(evicted) >= 5
        caplog.set_level(logging.WARNING, logger="tensorstore_ck.tier")
        for step in (1, 8):
            assert _equal(store.checkout(infos[step - 1].root), tier_state(step))
        assert not [r for r in caplog.records if "reading it from" in r.getMessage()]  # evicted: not news
        report = store.fsck(full=True)
        assert report.findings == [] and report.evicted == len(evicted)
        store.gc()
        assert _equal(store.checkout("job/main"), tier_state(8))
    with tsck.open_store(str(nvme), create=False) as tier:  # the tier by itself: nothing evicted is missing
        assert tier.fsck(full=True).findings == []


def test_a_budget_smaller_than_one_snapshot_never_evicts_a_pending_or_local_only_one(tmp_path, caplog):
    """A budget of one byte. The first put writes (the tier was empty); its upload is
    held, and it is never evicted while pending. The next put waits for that upload (one
    warning naming the budget and the wait) and goes on once it ended and its eviction
    emptied the tier. A local-only snapshot (put into the tier opened by itself, never
    queued) is never evicted either: with it over the budget, a put fails at once with
    TierFull naming the local-only bytes, before writing anything; forgotten and
    collected, the next put goes through."""
    nvme = tmp_path / "nvme"
    wrapped = []
    caplog.set_level(logging.WARNING, logger="tensorstore_ck.tier")
    store = open_tiered(tmp_path, local_budget=1, wrap_storage=lambda s: wrapped.append(Held(s)) or wrapped[-1])
    held = wrapped[0]
    a = store.put_snapshot(tier_state(1), "job/main", step=1)
    assert held.waiting.wait(DEADLINE)
    seen = {}

    def release():  # what the tier holds while the upload is held, then let it through
        seen["evicted"], seen["bytes"] = store.reftable.tier_rows.evicted(), _stored(nvme)
        held.gate.set()
    timer = threading.Timer(1.0, release)
    timer.start()
    t0 = time.monotonic()
    b = store.put_snapshot(tier_state(2), "job/main", step=2)
    assert time.monotonic() - t0 >= 1.0  # it waited for a's upload
    timer.join()
    assert seen["evicted"] == set() and seen["bytes"] > 1  # nothing durable yet: nothing went
    assert bytes.fromhex(a.root) in store.reftable.tier_rows.evicted()
    waited = [r.getMessage() for r in caplog.records if "the put waits for uploads" in r.getMessage()]
    assert len(waited) == 1 and "budget of 1 bytes" in waited[0]
    assert store.wait_durable(timeout=DEADLINE) is True
    assert [(i.step, i.durable) for i in store.log("job/main")] == [(2, True), (1, True)]
    assert store.reftable.tier_rows.evicted() == {bytes.fromhex(a.root), bytes.fromhex(b.root)}
    store.close()

    with tsck.open_store(str(nvme), create=False) as tier:  # no uploader: c is local-only, d the side ref's tip
        c = tier.put_snapshot(tier_state(3), "job/side", step=3)
        tier.put_snapshot(tier_state(4), "job/side", step=4)
    with open_tiered(tmp_path, local_budget=1) as store:  # d is queued at open, uploaded and evicted
        assert store.wait_durable(timeout=DEADLINE) is True
        before = (_stored(nvme), store.reftable.catalog_roots(), store.resolve("job/main"))
        assert before[0] > 1
        t0 = time.monotonic()
        with pytest.raises(tsck.TierFull, match="local-only") as got:
            store.put_snapshot(tier_state(5), "job/main", step=5)
        assert time.monotonic() - t0 < 30.0  # at once: no upload can free it
        assert "forget or prune the local-only snapshots" in str(got.value)
        assert got.value.usage["local_only"]["snapshots"] == 1
        assert (_stored(nvme), store.reftable.catalog_roots(), store.resolve("job/main")) == before
        assert bytes.fromhex(c.root) not in store.reftable.tier_rows.evicted()
        assert _equal(store.checkout(c.root), tier_state(3))  # whole in the tier
        assert store.fsck(full=True).findings == []
        store.forget(c.root)
        store.gc()
        e = store.put_snapshot(tier_state(5), "job/main", step=5)
        assert store.wait_durable(timeout=DEADLINE) is True
        assert store.show("job/main").root == e.root
    with open_tiered(tmp_path) as again:
        assert _equal(again.checkout("job/main"), tier_state(5))


def test_a_tier_over_a_new_budget_is_evicted_at_open_and_bad_budgets_are_refused(tmp_path):
    """Four durable snapshots put without a budget; the tier reopened with a budget of
    about one snapshot evicts at open (wait_durable() returns once that is done), the
    ref's newest tip last: it alone stays. A budget that is not a positive int, or one
    without local=, is refused before anything is written."""
    with open_tiered(tmp_path) as store:
        infos = [store.put_snapshot(tier_state(s), "job/main", step=s) for s in range(1, 5)]
        assert store.wait_durable(timeout=DEADLINE)
    one = _stored(tmp_path / "nvme") // 4
    with open_tiered(tmp_path, local_budget=one + one // 2) as store:
        assert store.wait_durable(timeout=DEADLINE)
        assert store.reftable.tier_rows.evicted() == {bytes.fromhex(i.root) for i in infos[:3]}
        assert _stored(tmp_path / "nvme") <= one + one // 2
        assert _equal(store.checkout("job/main"), tier_state(4)) and _equal(store.checkout(infos[0].root), tier_state(1))
    for bad in (0, -1, 1.5, True, "1G"):
        with pytest.raises(tsck.InvalidArgument, match="local_budget"):
            open_tiered(tmp_path, local_budget=bad)
    with pytest.raises(tsck.InvalidArgument, match="needs local="):
        tsck.open_store(str(tmp_path / "elsewhere"), local_budget=1 << 30)
    assert not (tmp_path / "elsewhere").exists()


_WRITER = r"""
import json, sys, threading, time
import torch
import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import WrappedStore
s3_url, refs, local, opts, it = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])

class Told(WrappedStore):  # says each remote write once it is done; a little slow, so uploads lag the puts
    def put_addressed(self, key, bufs):
        time.sleep(0.02)
        got = self.inner.put_addressed(key, bufs)
        print("PUT", key, flush=True)
        return got
    def put_if_absent(self, key, bufs):
        got = self.inner.put_if_absent(key, bufs)
        print("PUT", key, flush=True)
        return got

store = tsck.open_store(s3_url, refs=refs, storage_options=opts, block_size=16384, inline_threshold=256,
                        local=local, wrap_storage=Told, workers=2)
shared = torch.arange(8192, dtype=torch.float32)  # the same blocks in every snapshot: sent once, ever
for j in range(4):
    g = torch.Generator().manual_seed(100 * it + j)
    store.put_snapshot({"shared": shared, "w": torch.randn(48, 256, generator=g)}, "job/main", step=10 * it + j)
    print("RETURNED", flush=True)
store.wait_durable()
print("DURABLE", flush=True)
time.sleep(3600)
"""


class PerKey(Watched):
    """Counts the remote writes per key (put_addressed and put_if_absent)."""

    def __init__(self, inner):
        super().__init__(inner)
        self.writes: dict[str, int] = {}
        self._lock = threading.Lock()

    def on_write(self, key):
        with self._lock:
            self.writes[key] = self.writes.get(key, 0) + 1


def _remote_keys(remote: tsck.Store) -> set[str]:
    return {remote.core.assets.object_key(kind, o.digest)
            for kind in ("commits", "nodes", "blocks") for o in remote.core.assets.list_objects(kind)}


@pytest.mark.slow  # a real S3 server, real processes killed -9 in a loop
def test_kill_9_at_random_moments_of_uploads_then_resume(s3_url, s3_server, tmp_path):
    """A writer process puts four snapshots through a tier into S3 (moto or radosgw),
    its uploads lagging, and is killed -9 after a seeded random number of remote writes
    plus a seeded random delay; five times, each run adding snapshots to the same tier.
    After each kill: every remote ref names only objects the remote holds (remote fsck
    clean, before and after the resume); reopened with the tier, the uploader resumes and
    writes no object the remote held at the restart, and none twice; in the end the
    remote tip is the newest snapshot and checks out bit for bit."""
    import json
    import os
    import random
    import signal
    import subprocess
    import _zygote as zygote
    import sys
    import time

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    refs, local = str(tmp_path / "refs.lmdb"), str(tmp_path / "nvme")
    opts = dict(refs=refs, storage_options=s3_server, block_size=16384, inline_threshold=256)
    rng = random.Random(27)
    midway = 0
    for it in range(5):
        kill_after = rng.randint(1, 9)  # remote writes seen before the kill (a run makes 10 or more)
        delay = rng.uniform(0.0, 0.15)
        proc = zygote.Popen([sys.executable, "-c", _WRITER, s3_url, refs, local, json.dumps(s3_server), str(it)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            seen, deadline = 0, time.monotonic() + DEADLINE
            while seen < kill_after:
                assert time.monotonic() < deadline, "the writer did not get there"
                line = proc.stdout.readline()
                assert line, f"the writer ended: {proc.stderr.read()[-2000:]}"
                if line.startswith("PUT"):
                    seen += 1
                elif line.startswith("DURABLE"):
                    break
            time.sleep(delay)
        finally:
            kill_and_close(proc)

        with tsck.open_store(s3_url, create=False, **opts) as remote:
            assert remote.fsck(full=True).findings == []  # the refs name whole snapshots, killed or not
            held = _remote_keys(remote)
        wrapped = []
        store = tsck.open_store(s3_url, local=local, wrap_storage=lambda s: wrapped.append(PerKey(s)) or wrapped[-1],
                                **opts)
        if store.reftable.tier_rows.upload_pending():
            midway += 1
        assert store.wait_durable(timeout=DEADLINE) is True
        writes = wrapped[0].writes
        assert not set(writes) & held, f"sent again: {sorted(set(writes) & held)[:5]}"
        assert all(n == 1 for n in writes.values()), {k: n for k, n in writes.items() if n > 1}
        tip = store.resolve("job/main")
        store.close()
        with tsck.open_store(s3_url, create=False, **opts) as remote:
            assert remote.fsck(full=True).findings == []
            assert remote.resolve("job/main") == tip
    assert midway >= 2  # kills landed with uploads queued (most do; the count depends on timing)
    with tsck.open_store(s3_url, create=False, **opts) as remote:
        info = remote.show("job/main")
        assert info.step == 43
        g = torch.Generator().manual_seed(403)
        want = {"shared": torch.arange(8192, dtype=torch.float32), "w": torch.randn(48, 256, generator=g)}
        assert _equal(remote.checkout("job/main"), want)


def test_the_tiers_retention_expires_evicted_snapshots_quietly(tmp_path, caplog):
    """A budget of one byte evicts every durable snapshot; the job's retention (keep the
    newest one) expires the older ones in the remote after each upload, and with them in
    the tier (one decision for both: a row with no copy in either tier would stay
    otherwise): the prune has nothing of theirs to walk or delete (no warning about
    objects it could not walk), and the tier fscks clean."""
    caplog.set_level(logging.WARNING)
    with open_tiered(tmp_path, local_budget=1) as store:
        store.set_retention("job", tsck.Retention(keep_last=1))
        for step in (1, 2, 3):
            store.put_snapshot(tier_state(step), "job/main", job="job", step=step)
            assert store.wait_durable(timeout=DEADLINE)
        assert store.prune("job").expired == []
        assert not [r for r in caplog.records if "not walked" in r.getMessage()]
        assert [i.step for i in store.log("job/main")] == [3]
        assert len(store.reftable.tier_rows.evicted()) == 1  # the expired ones' marks went with their rows
        report = store.fsck(full=True)
        assert report.findings == [] and report.evicted == 1
        assert _equal(store.checkout("job/main"), tier_state(3))
