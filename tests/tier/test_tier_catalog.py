"""One catalog across a local tier and its remote store (docs/design/tiers.md, "One
catalog"): what a tag, a pin or the job's retention keeps is kept in the tier until it
is durable and then in the remote store, and neither tier's cleanup (the local prune,
the uploader's remote prune, the budget, the backlog rule) loses it.

Each test runs against a file:// remote (fast) and a real S3 server (moto, or radosgw in
CI; slow). The remote's writes are held or throttled by a WrappedStore around its
storage (wrap_storage=): real writes, made to wait."""

from __future__ import annotations

import os
import sys
import textwrap
import threading

import pytest
import _zygote as zygote
from _util import same_bits, tier_state

import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import WrappedStore

BS = 16 * 1024
DEADLINE = 120.0  # generous: the machine is shared


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.slow)])
def remote(request, tmp_path):
    """(url, open_store keywords) of the remote store."""
    if request.param == "file":
        return str(tmp_path / "remote"), {}
    s3_url, s3_server = request.getfixturevalue("s3_url"), request.getfixturevalue("s3_server")
    return s3_url, {"refs": str(tmp_path / "refs.lmdb"), "storage_options": s3_server}


class Gate(WrappedStore):
    """Holds each remote object write while `gate` is clear; `waiting` is set by the first
    write that waits."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate, self.waiting = threading.Event(), threading.Event()
        self.gate.set()

    def put_addressed(self, key, bufs):
        if not self.gate.is_set():
            self.waiting.set()
            assert self.gate.wait(DEADLINE)
        return self.inner.put_addressed(key, bufs)

    def put_if_absent(self, key, bufs):
        if not self.gate.is_set():
            self.waiting.set()
            assert self.gate.wait(DEADLINE)
        return self.inner.put_if_absent(key, bufs)


class SyncGate(WrappedStore):
    """Once armed, holds the next remote sync (the one that ends an upload's sends,
    before its ref move) until `gate` is set; `waiting` says it waits."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate, self.waiting = threading.Event(), threading.Event()
        self.armed = False

    def sync(self):
        if self.armed:
            self.armed = False
            self.waiting.set()
            assert self.gate.wait(DEADLINE)
        return self.inner.sync()


def _open(remote, tmp_path, **kw) -> tsck.Store:
    url, opts = remote
    return tsck.open_store(url, local=str(tmp_path / "nvme"), block_size=BS, inline_threshold=256, **opts, **kw)


def _remote(remote) -> tsck.Store:
    url, opts = remote
    return tsck.open_store(url, create=False, **opts)


def _stored(path) -> int:
    return sum(p.stat().st_size for kind in ("blocks", "nodes", "commits") for p in (path / kind).rglob("*")
               if p.is_file())


@pytest.mark.parametrize("hold", ["tag", "pin"])
def test_a_tagged_or_pinned_snapshot_survives_both_tiers_retention_and_the_budget(remote, tmp_path, hold):
    """keep_last=1 in both tiers (set_retention), a budget smaller than two snapshots, and
    step 3 tagged (or pinned) once it is durable: after every later put, prune and upload
    the tag is the remote's too, so neither the uploader's remote prune nor the budget's
    eviction loses step 3; it checks out bit for bit through the tier and from the remote
    alone, and an offline gc of the remote keeps it."""
    with _open(remote, tmp_path) as probe:  # one snapshot's stored bytes, for the budget
        probe.put_snapshot(tier_state(100, 48), "probe/main", step=0)
        assert probe.wait_durable(timeout=DEADLINE)
    one = _stored(tmp_path / "nvme")
    with _open(remote, tmp_path, local_budget=int(1.5 * one)) as store:
        store.set_retention("job", tsck.Retention(keep_last=1))
        roots = {}
        for step in range(1, 7):
            roots[step] = store.put_snapshot(tier_state(step, 48), "job/main", step=step).root
            assert store.wait_durable(timeout=DEADLINE)
            if step == 3:
                if hold == "tag":
                    store.tag("best", roots[3])
                else:
                    store.pin(roots[3])
            store.prune("job")
            assert store.wait_durable(timeout=DEADLINE)
        target = "best" if hold == "tag" else roots[3]
        assert same_bits(store.checkout(target), tier_state(3, 48))
        r = store.remote_core.refs
        assert r.catalog_has(bytes.fromhex(roots[3]))
        assert (r.tag_get("best") if hold == "tag" else (bytes.fromhex(roots[3]) if bytes.fromhex(roots[3]) in r.pins()
                                                          else None)) == bytes.fromhex(roots[3])
    with _remote(remote) as rem:
        rem.gc()
        assert same_bits(rem.checkout(target), tier_state(3, 48))
        assert rem.fsck(full=True).findings == []
        # Removing the tag or pin in the tier removes it in the remote too.
    with _open(remote, tmp_path) as store:
        if hold == "tag":
            store.untag("best")
        else:
            store.unpin(roots[3])
        r = store.remote_core.refs
        assert r.tag_get("best") is None and bytes.fromhex(roots[3]) not in r.pins()


def test_a_tag_on_a_snapshot_the_backlog_skipped_sends_it_without_moving_the_remote_ref(remote, tmp_path):
    """keep_last=1 in the tier's table alone (no remote prune, so the tier's catalog keeps
    what the backlog skipped until a prune), the remote's writes held while steps 2-4 are
    put: one of steps 2 and 3 is superseded and skipped. Tagging it afterwards sends it
    for the tag alone: it is in the remote catalog with the tag and durable, and the
    remote ref stays on step 4."""
    gates = []
    with _open(remote, tmp_path, wrap_storage=lambda s: gates.append(Gate(s)) or gates[-1]) as store:
        store.reftable.retention_set("job", tsck.Retention(keep_last=1).to_dict())
        first = store.put_snapshot(tier_state(1, 48), "job/main", step=1).root
        assert store.wait_durable(timeout=DEADLINE)
        gates[0].gate.clear()
        roots = {s: store.put_snapshot(tier_state(s, 48), "job/main", step=s).root for s in (2, 3, 4)}
        assert gates[0].waiting.wait(DEADLINE)  # step 2's upload waits on its first write...
        gates[0].gate.set()
        assert store.wait_durable(timeout=DEADLINE)
        # One of steps 2 and 3 was in flight when the other was queued behind it, the
        # other superseded (by step 3 or 4) and skipped.
        skipped = [s for s in (2, 3) if not store.show(roots[s]).durable]
        assert len(skipped) == 1 and store.show(roots[4]).durable, skipped
        tagged = skipped[0]
        store.tag("keep", roots[tagged])
        assert store.wait_durable(timeout=DEADLINE)
        assert store.show(roots[tagged]).durable is True
        r = store.remote_core.refs
        assert r.get_or_none("job/main") == bytes.fromhex(roots[4])
        assert r.tag_get("keep") == bytes.fromhex(roots[tagged])
        assert first  # (step 1 is the remote's history)
    with _remote(remote) as rem:
        assert same_bits(rem.checkout("keep"), tier_state(tagged, 48))
        assert same_bits(rem.checkout("job/main"), tier_state(4, 48))


def test_what_retention_keeps_is_uploaded_when_uploads_lag(remote, tmp_path):
    """keep_last=1 and keep_best=1 (loss, min), the remote's writes held while steps 2-8
    are put with the best loss at step 3, the job pruned after each put as the
    CheckpointManager does: the backlog rule skips only what retention expires, so step 3
    becomes durable with step 8; wait_durable() then means every kept snapshot is in the
    remote store."""
    gates = []
    with _open(remote, tmp_path, wrap_storage=lambda s: gates.append(Gate(s)) or gates[-1]) as store:
        store.set_retention("job", tsck.Retention(keep_last=1, keep_best=1, metric="loss"))
        roots = {1: store.put_snapshot(tier_state(1, 48), "job/main", step=1, metrics={"loss": 5.0}).root}
        assert store.wait_durable(timeout=DEADLINE)
        gates[0].gate.clear()
        for step in range(2, 9):
            loss = 0.5 if step == 3 else 4.0 - step / 10
            roots[step] = store.put_snapshot(tier_state(step, 48), "job/main", step=step, metrics={"loss": loss}).root
            store.prune("job")
        gates[0].gate.set()
        assert store.wait_durable(timeout=DEADLINE)
        kept = {i.step: i.durable for i in store.log("job/main")}
        assert kept.get(3) is True and kept.get(8) is True, kept
        r = store.remote_core.refs
        assert r.catalog_has(bytes.fromhex(roots[3])) and r.get_or_none("job/main") == bytes.fromhex(roots[8])
    with _remote(remote) as rem:
        rem.gc()
        assert same_bits(rem.checkout(roots[3]), tier_state(3, 48))
        assert same_bits(rem.checkout("job/main"), tier_state(8, 48))


def test_local_retention_never_expires_the_snapshot_being_uploaded(remote, tmp_path):
    """keep_last=1, every step, the remote's writes held on step 1's upload while steps
    2-5 are put and pruned: step 1 (in flight) is not expired, so the remote ref exists
    as soon as its writes go on, and nothing sent is thrown away; then the newest is
    uploaded and the superseded ones in between are not."""
    gates = []
    with _open(remote, tmp_path, wrap_storage=lambda s: gates.append(Gate(s)) or gates[-1]) as store:
        store.set_retention("job", tsck.Retention(keep_last=1))
        gates[0].gate.clear()
        roots = {1: store.put_snapshot(tier_state(1, 48), "job/main", step=1).root}
        assert gates[0].waiting.wait(DEADLINE)  # step 1's upload has started
        for step in range(2, 6):
            roots[step] = store.put_snapshot(tier_state(step, 48), "job/main", step=step).root
            rep = store.prune("job")
            assert roots[1] not in rep.expired
        assert store.show(roots[1]).step == 1  # still in the tier's catalog
        gates[0].gate.set()
        assert store.wait_durable(timeout=DEADLINE)
        remote_log = [e.new for e in store.remote_core.refs.reflog("job/main") if e.op == "move"]
        assert remote_log[0] == bytes.fromhex(roots[1]) and remote_log[-1] == bytes.fromhex(roots[5])
        assert len(remote_log) == 2  # steps 2-4 superseded: not sent


def test_a_fenced_move_of_a_snapshot_a_prune_tried_to_expire_is_sent_again(remote, tmp_path):
    """An upload whose remote ref move is fenced by a remote gc deletion phase (which
    deleted the objects it had just sent) re-sends them from the tier; a local prune that
    ran meanwhile (keep_last=1, newer puts) did not expire the snapshot being uploaded,
    so the re-send finds every object and the snapshot becomes durable: no IntegrityError,
    the uploader goes on with the next snapshot."""
    gates = []
    with _open(remote, tmp_path, wrap_storage=lambda s: gates.append(SyncGate(s)) or gates[-1]) as store:
        store.set_retention("job", tsck.Retention(keep_last=1))
        gates[0].armed = True
        first = store.put_snapshot(tier_state(1, 48), "job/main", step=1).root
        assert gates[0].waiting.wait(DEADLINE)  # its objects are sent; the move waits
        # A remote gc deletes them (unreferenced yet) and moves the fence.
        from tensorstore_ck.maintain.gc import run_gc
        try:
            assert run_gc(store.remote_core, lease=store.remote_core.settings.gc_lease).deleted_objects > 0
            for step in (2, 3):
                store.put_snapshot(tier_state(step, 48), "job/main", step=step)
                store.prune("job")
        finally:
            gates[0].gate.set()
        assert store.wait_durable(timeout=DEADLINE)
        assert store.remote_core.refs.catalog_has(bytes.fromhex(first)) or any(
            e.new == bytes.fromhex(first) for e in store.remote_core.refs.reflog("job/main"))
    with _remote(remote) as rem:
        assert rem.fsck(full=True).findings == []
        assert same_bits(rem.checkout("job/main"), tier_state(3, 48))


_SHARER = textwrap.dedent("""
    import sys, json
    import tensorstore_ck as tsck
    url, local, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    with tsck.open_store(url, local=local, block_size=16384, inline_threshold=256, local_budget=1, **opts) as s:
        assert s.wait_durable(timeout=120)
    print("DONE", flush=True)
""")


def test_another_process_evicting_a_snapshot_this_one_uploads_is_not_damage(remote, tmp_path):
    """Two processes share a tier: this one's upload of step 1 waits on the remote's
    writes; the other, with a budget of one byte, uploads step 1 from the shared queue,
    marks it durable and evicts its local copy. This one then finds its objects gone:
    not damage (it is durable); its uploader goes on, wait_durable() and close() succeed."""
    import json
    gates = []
    url, opts = remote
    store = _open(remote, tmp_path, wrap_storage=lambda s: gates.append(Gate(s)) or gates[-1])
    try:
        gates[0].gate.clear()
        root = store.put_snapshot(tier_state(1, 48), "job/main", step=1).root
        assert gates[0].waiting.wait(DEADLINE)
        env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(tsck.__file__)))
        out = zygote.run([sys.executable, "-c", _SHARER, url, str(tmp_path / "nvme"), json.dumps(opts)],
                         capture_output=True, text=True, timeout=DEADLINE, env=env)
        assert out.returncode == 0 and "DONE" in out.stdout, out.stderr[-3000:]
        assert store.show(root).durable is True
        gates[0].gate.set()
        store.put_snapshot(tier_state(2, 48), "job/main", step=2)
        assert store.wait_durable(timeout=DEADLINE) is True
    finally:
        gates[0].gate.set()
        store.close()  # raises the uploader's failure, if it stopped on one
    with _remote(remote) as rem:
        assert same_bits(rem.checkout("job/main"), tier_state(2, 48))


def test_the_budget_never_evicts_a_copy_the_remote_retention_expired(remote, tmp_path):
    """keep_last=1 in both tiers and a budget of about one and a half snapshots, no prune
    called by hand: after each upload the remote's retention expires the older snapshot
    and the tier's does too (one decision), before the budget evicts anything; so no
    snapshot is left listed in the tier, marked evicted, with no copy in the remote."""
    with _open(remote, tmp_path) as probe:
        probe.put_snapshot(tier_state(100, 48), "probe/main", step=0)
        assert probe.wait_durable(timeout=DEADLINE)
    one = _stored(tmp_path / "nvme")
    with _open(remote, tmp_path, local_budget=int(1.5 * one)) as store:
        store.set_retention("job", tsck.Retention(keep_last=1))
        for step in range(1, 5):
            store.put_snapshot(tier_state(step, 48), "job/main", step=step)
            assert store.wait_durable(timeout=DEADLINE)
            refs, r = store.reftable, store.remote_core.refs
            stranded = [root.hex()[:16] for root in refs.tier_rows.evicted() if refs.catalog_has(root) and not r.catalog_has(root)]
            assert stranded == [], (step, stranded)
        assert [i.step for i in store.log("job/main")] == [4]
        assert same_bits(store.checkout("job/main"), tier_state(4, 48))


def test_a_tier_pin_is_made_again_in_a_remote_table_rebuilt_by_recover(tmp_path, monkeypatch):
    """A pin made through the tier lives in the remote ref table only (tags have storage
    objects, pins none): after that table is lost and rebuilt by `tsck recover`, the next
    open of the tier makes the pin there again, so the remote's retention keeps it; its
    wait_durable() waits for that (a loaded machine starts the uploader's thread late:
    held here until the first wait has returned)."""
    import shutil

    from tensorstore_ck.tier.uploader import Uploader
    remote = (str(tmp_path / "remote"), {})
    with _open(remote, tmp_path) as store:
        store.set_retention("job", tsck.Retention(keep_last=1))
        roots = [store.put_snapshot(tier_state(s, 48), "job/main", step=s).root for s in (1, 2)]
        store.pin(roots[0])
        assert store.wait_durable(timeout=DEADLINE)
        assert bytes.fromhex(roots[0]) in store.remote_core.refs.pins()
    shutil.rmtree(tmp_path / "remote" / "refs.lmdb")
    out = zygote.run([sys.executable, "-m", "tensorstore_ck", "recover", str(tmp_path / "remote")],
                     capture_output=True, text=True, timeout=DEADLINE)
    assert out.returncode == 0, out.stderr[-2000:]
    gate, republish = threading.Event(), Uploader._republish_holds
    monkeypatch.setattr(Uploader, "_republish_holds", lambda self: (gate.wait(DEADLINE), republish(self)))
    with _open(remote, tmp_path) as store:
        assert store.wait_durable(timeout=0.2) is False  # the open's own work is not done
        gate.set()
        assert store.wait_durable(timeout=DEADLINE)
        assert bytes.fromhex(roots[0]) in store.remote_core.refs.pins()
        store.put_snapshot(tier_state(3, 48), "job/main", step=3)
        assert store.wait_durable(timeout=DEADLINE)
    with _remote(remote) as rem:
        rem.gc()
        assert same_bits(rem.checkout(roots[0]), tier_state(1, 48))
