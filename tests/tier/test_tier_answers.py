"""One answer through a local tier (docs/design/tiers.md, "One answer"): every call that
names a snapshot (checkout, log, resolve, show, diff, tag, pin, export_weights, the DCP
reader) names the one checkout reads, on a node whose tier is behind the remote and on a
node whose tier holds nothing; every call that removes one (delete_ref, forget, untag)
and undelete act in both tiers' tables; a collective DCP load through tiers that differ
per rank reads one snapshot on every rank (rank 0 resolves, every rank reads its root).

Two nodes are two local tiers over one remote store: a real S3 server (moto, or radosgw
via TEST_S3_ENDPOINT) with an LMDB remote ref table. Node A puts step 1 through its tier,
node B step 2 through its own; the ranks are real gloo processes
(tests/helpers/tier_answers_worker.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

import _util
from _util import load_helper, run_worker_scenario

import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import WrappedStore

HERE = Path(__file__).resolve().parents[1]
aw = load_helper(HERE / "helpers" / "tier_answers_worker.py")
REF, BS = aw.REF, aw.BS
DEADLINE = 120.0  # generous: the machine is shared

pytestmark = pytest.mark.slow  # a real S3 server in every test


def _open(s3_url, s3_server, tmp_path, tier: str, **kw) -> tsck.Store:
    return tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server, block_size=BS,
                           inline_threshold=256, local=str(tmp_path / "nodes" / tier), **kw)


def _remote(s3_url, s3_server, tmp_path) -> tsck.Store:
    """The remote store opened by itself, as `tsck gc URL` opens it (no tier open beside it)."""
    return tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server)


def _put(s3_url, s3_server, tmp_path, tier: str, step: int, ref: str = REF) -> str:
    """Node `tier` puts step `step` of `ref` through its tier and waits until it is durable -> its root."""
    with _open(s3_url, s3_server, tmp_path, tier) as store:
        info = store.put_snapshot(aw.state(step), ref, step=step)
        assert store.wait_durable(timeout=DEADLINE) is True
    return info.root


def _two_nodes(s3_url, s3_server, tmp_path) -> tuple[str, str]:
    """Node A's tier holds step 1; node B's (and the remote's tip) step 2."""
    return _put(s3_url, s3_server, tmp_path, "a", 1), _put(s3_url, s3_server, tmp_path, "b", 2)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        _same(a[k], b[k]) if isinstance(a[k], dict) else _util.same_bits(a[k], b[k]) for k in a)


@pytest.mark.parametrize("node", ["a", "fresh"])
def test_every_call_that_names_a_snapshot_answers_as_checkout_does(s3_url, s3_server, tmp_path, node):
    """On node A (its tier at step 1, the remote at step 2) and on a node whose tier holds
    nothing, each call that names REF names step 2, the snapshot checkout restores."""
    from safetensors.torch import load_file
    import torch.distributed.checkpoint as dcp
    from tensorstore_ck.dcp import TsckReader
    one, two = _two_nodes(s3_url, s3_server, tmp_path)
    with _open(s3_url, s3_server, tmp_path, node) as store:
        assert _same(store.checkout(REF), aw.state(2))  # the reference answer
        assert store.resolve(REF) == two
        shown = store.show(REF)
        assert (shown.root, shown.step, shown.durable) == (two, 2, True)
        assert [i.step for i in store.log(REF)][:1] == [2]
        assert store.diff(REF, two)["changed"] == []
        assert {c["path"] for c in store.diff(REF, one)["changed"]} == {"['model']['w']", "['model']['b']", "['step']"}
        assert store.tag("gold", REF).root == two
        assert store.resolve("gold") == two and _same(store.checkout("gold"), aw.state(2))
        assert store.pin(REF) == two
        got = tsck.export_weights(store, REF, tmp_path / "w.safetensors")
        assert got["root"] == two and _same(load_file(tmp_path / "w.safetensors"), aw.state(2)["model"])
        sd = aw.zeros()
        dcp.load(sd, storage_reader=TsckReader(store, REF))
        assert _same(sd, aw.state(2))
    # The tag and the pin are in the remote table: a node that lost its tier keeps them.
    with _remote(s3_url, s3_server, tmp_path) as remote:
        assert remote.resolve("gold") == two and bytes.fromhex(two) in remote.reftable.pins()


def test_delete_ref_through_a_tier_removes_the_run_from_the_remote_and_gc_reclaims_it(s3_url, s3_server, tmp_path):
    """delete_ref on a tiered store removes the ref from the remote too: a fresh tier's
    checkout, log and a restarted job's restore_latest no longer find the run, and a gc
    of the remote reclaims its snapshot."""
    root = _put(s3_url, s3_server, tmp_path, "a", 1)
    with _open(s3_url, s3_server, tmp_path, "a") as store:
        out = store.delete_ref(REF)
        assert out["root"] == root and out["snapshots_dropped"] >= 1
        with pytest.raises(tsck.RefNotFound):
            store.checkout(REF)
    with _open(s3_url, s3_server, tmp_path, "fresh") as store:
        for call in (store.checkout, store.log, store.resolve, store.show):
            with pytest.raises(tsck.RefNotFound):
                call(REF)
        model = torch.nn.Linear(4, 2)
        mgr = tsck.CheckpointManager(store, job="j", ref=REF, state=tsck.TrainState(model=model))
        try:
            assert mgr.restore_latest() is None  # a first run: nothing to resume
        finally:
            mgr.close()
    with _remote(s3_url, s3_server, tmp_path) as remote:
        assert remote.assets.has_commit(bytes.fromhex(root))
        assert remote.gc().deleted_objects > 0
        assert not remote.assets.has_commit(bytes.fromhex(root))
        assert remote.fsck(full=True).findings == []


def test_undelete_through_a_tier_brings_the_ref_back_in_both(s3_url, s3_server, tmp_path):
    """A ref deleted through a tier and brought back by undelete is back in the tier and in
    the remote; deleted again, a node whose tier never held it brings it back from the
    remote's reflog. A fresh tier then restores it, and a gc of the remote keeps it."""
    root = _put(s3_url, s3_server, tmp_path, "a", 1)
    with _open(s3_url, s3_server, tmp_path, "a") as store:
        store.delete_ref(REF)
        assert store.remote_core.refs.get_or_none(REF) is None
        info = store.undelete(REF)
        assert (info.root, info.durable) == (root, True)
        assert store.reftable.get_or_none(REF) == bytes.fromhex(root)
        assert store.remote_core.refs.get_or_none(REF) == bytes.fromhex(root)
        store.delete_ref(REF)
    with _open(s3_url, s3_server, tmp_path, "c") as store:
        assert store.undelete(REF).root == root
        assert store.remote_core.refs.get_or_none(REF) == bytes.fromhex(root)
    with _open(s3_url, s3_server, tmp_path, "fresh") as store:
        assert _same(store.checkout(REF), aw.state(1)) and [i.root for i in store.log(REF)] == [root]
    with _remote(s3_url, s3_server, tmp_path) as remote:
        remote.gc()
        assert _same(remote.checkout(REF), aw.state(1))


def test_forget_through_a_tier_forgets_in_the_remote_too(s3_url, s3_server, tmp_path):
    """forget of REF@1 on a tiered store drops step 1 from the remote catalog too: a fresh
    tier neither lists nor restores it, and a gc of the remote reclaims its commit."""
    with _open(s3_url, s3_server, tmp_path, "a") as store:
        one = store.put_snapshot(aw.state(1), REF, step=1).root
        store.put_snapshot(aw.state(2), REF, step=2)
        assert store.wait_durable(timeout=DEADLINE) is True
        assert store.forget(f"{REF}@1").root == one
        assert not store.remote_core.refs.catalog_has(bytes.fromhex(one))
    with _open(s3_url, s3_server, tmp_path, "fresh") as store:
        assert [i.step for i in store.log(REF)] == [2]
        with pytest.raises(tsck.RefNotFound):
            store.checkout(f"{REF}@1")
    with _remote(s3_url, s3_server, tmp_path) as remote:
        remote.gc()
        assert not remote.assets.has_commit(bytes.fromhex(one))
        assert _same(remote.checkout(REF), aw.state(2))


class Gate(WrappedStore):
    """Remote object writes wait while `open` is clear: what is put meanwhile stays local-only."""

    def __init__(self, inner):
        super().__init__(inner)
        self.open = threading.Event()
        self.open.set()

    def put_addressed(self, key, bufs):
        assert self.open.wait(DEADLINE)
        return self.inner.put_addressed(key, bufs)


def test_forget_refused_by_the_remote_names_it_and_changes_neither_tier(s3_url, s3_server, tmp_path):
    """Step 2 is local-only (its upload held), so step 1 is still the remote ref's tip:
    forget of step 1 through the tier is refused naming the remote store, and both tables
    keep it; once step 2 is uploaded the same forget goes through in both."""
    gates = []
    with _open(s3_url, s3_server, tmp_path, "a", wrap_storage=lambda s: gates.append(Gate(s)) or gates[-1]) as store:
        one = store.put_snapshot(aw.state(1), REF, step=1).root
        assert store.wait_durable(timeout=DEADLINE) is True
        gates[0].open.clear()
        try:
            store.put_snapshot(aw.state(2), REF, step=2)
            with pytest.raises(tsck.InvalidArgument, match=f"remote store at {s3_url}.*tip of ref"):
                store.forget(f"{REF}@1")
            root = bytes.fromhex(one)
            assert store.reftable.catalog_has(root) and store.remote_core.refs.catalog_has(root)
        finally:
            gates[0].open.set()
        assert store.wait_durable(timeout=DEADLINE) is True
        assert store.forget(f"{REF}@1").root == one
        assert not store.reftable.catalog_has(root) and not store.remote_core.refs.catalog_has(root)


def test_untag_through_a_tier_removes_a_tag_only_the_remote_has(s3_url, s3_server, tmp_path):
    """Node B tags its snapshot (in its tier and the remote table); on node A, whose tier
    never had the tag, untag removes it from the remote, and no node resolves it any more."""
    _, two = _two_nodes(s3_url, s3_server, tmp_path)
    with _open(s3_url, s3_server, tmp_path, "b") as store:
        store.tag("gold", REF)
    with _open(s3_url, s3_server, tmp_path, "a") as store:
        assert store.resolve("gold") == two
        assert store.untag("gold") == two
        with pytest.raises(tsck.RefNotFound):
            store.resolve("gold")
    with _remote(s3_url, s3_server, tmp_path) as remote:
        assert remote.reftable.tag_get("gold") is None


def test_a_collective_dcp_load_through_tiers_that_differ_reads_one_step(s3_url, s3_server, tmp_path):
    """Two gloo ranks, each with its own tier: rank 0's tier is behind the remote (step 1,
    the remote at step 2) and rank 1's is ahead of it (a local-only step 3 of another
    layout, its uploads refused). Alone, each would name another snapshot; dcp.load
    through TsckReader and a collective checkout read step 2 on both ranks: rank 0
    resolves, every rank reads that root."""
    one, two = _two_nodes(s3_url, s3_server, tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    cfg = {"url": s3_url, "opts": s3_server, "refs": str(tmp_path / "refs.lmdb"), "tiers": str(tmp_path / "nodes"),
           "tier": ["a", "b"]}
    f = tmp_path / "cfg.json"
    f.write_text(json.dumps(cfg))
    got = run_worker_scenario(HERE / "helpers" / "tier_answers_worker.py", out, "load", f, limit=400)
    res = _util.rank_results(got, "load", 2, exit_zero=True)
    assert res[0]["own"] == two and res[1]["own"] != two  # each rank alone: two answers
    for r in range(2):
        assert res[r]["dcp_root"] == two and res[r]["checkout_step"] == 2, res[r]
        assert _same(torch.load(got / f"load_rank{r}.pt"), aw.state(2)), r
