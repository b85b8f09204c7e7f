"""A collective checkout reads each block several ranks read once (collective/shared.py):
real gloo ranks (tests/helpers/shared_reads.py forks them) restoring a DDP-like snapshot
(the same model on every rank, a tensor of each rank's own) from a real S3 server, its
GET requests counted by a real HTTP proxy in front of it (tests/sim/s3proxy.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from _util import rank_results, run_worker_scenario, same_bits
from tests.sim.s3proxy import ThrottleProxy

import tensorstore_ck as tsck
from tensorstore_ck.errors import InvalidArgument

pytestmark = pytest.mark.slow  # real ranks and a real S3 server

HERE = Path(__file__).resolve().parents[1]
WORKER = HERE / "helpers" / "shared_reads.py"
sys.path.insert(0, str(HERE / "helpers"))


@pytest.fixture
def counted(s3_server):
    """(proxy, storage options through it): GETs counted as the server sees them."""
    proxy = ThrottleProxy(s3_server["endpoint_url"])
    yield proxy, {**s3_server, "endpoint_url": proxy.url}
    proxy.close()


def _run(tmp_path, scenario, spec, tag=""):
    out = run_worker_scenario(WORKER, tmp_path / (scenario + tag), scenario, json.dumps(spec), limit=300)
    return out, rank_results(out, scenario, spec["world"])


def _expected(rank: int, mb: float) -> dict:
    from shared_reads import state
    return state(rank, mb)


def test_ddp_ranks_read_each_block_of_the_model_once_and_get_their_own_state(tmp_path, counted, s3_url):
    """3 ranks, the same 4 MB model on each: with shared reads each block of the model is
    read from S3 once (by its owner) where each rank read all of them; every rank's state
    is what it put, bit for bit, both ways."""
    proxy, opts = counted
    world, mb = 3, 4
    spec = {"url": s3_url, "opts": opts, "refs": str(tmp_path / "refs.lmdb"), "world": world, "mb": mb,
            "shared": False, "liar": None}
    _run(tmp_path, "put", spec)
    gets = {}
    model_blocks = 8 * -(-(mb << 20) // 8 // (1 << 18))  # 8 tensors of mb/8 MB, 256 KB blocks
    for shared in (False, True):
        proxy.reset_counts()
        out, res = _run(tmp_path, "read", {**spec, "shared": shared}, tag=str(shared))
        gets[shared] = proxy.forwarded_by["GET"]
        for r in range(world):
            got = torch.load(out / f"read_rank{r}.pt", weights_only=False)
            assert same_bits(got, _expected(r, mb)), f"rank {r} (shared={shared}) read other bytes"
        if shared:
            fetched = sum(d["sharing"]["fetched"] for d in res)
            got_from_peers = sum(d["sharing"]["got"] for d in res)
            assert fetched == model_blocks, (fetched, model_blocks)  # each shared block read once
            assert got_from_peers == model_blocks * (world - 1)  # each block: from its owner to the others
            assert all(d["sharing"]["bad"] == 0 for d in res)
    # Without sharing each rank GETs every block of the model; with it, one rank does. The
    # rest (each rank's commit, nodes and own tensor) is the same both ways. (+ world: room
    # for a request the client retried under load.)
    assert gets[True] <= gets[False] - (world - 1) * model_blocks + world, gets


def test_a_rank_that_sends_damaged_copies_costs_requests_never_bytes(tmp_path, counted, s3_url):
    """Rank 1's side channel sends every block with a byte changed: each rank that gets
    one finds it does not match its address and reads that block from S3 itself; every
    rank's state is still exactly what was put."""
    proxy, opts = counted
    world, mb = 2, 8  # 32 blocks: each rank owns some
    spec = {"url": s3_url, "opts": opts, "refs": str(tmp_path / "refs.lmdb"), "world": world, "mb": mb,
            "shared": True, "liar": 1}
    _run(tmp_path, "put", spec)
    out, res = _run(tmp_path, "read", spec)
    for r in range(world):
        assert same_bits(torch.load(out / f"read_rank{r}.pt", weights_only=False), _expected(r, mb))
    assert sum(d["sharing"]["bad"] for d in res) > 0  # the lies were caught
    assert res[1]["sharing"]["fetched"] > 0


def test_a_rank_killed_while_owners_send_leaves_the_others_reading_storage_within_the_timeout(
        tmp_path, counted, s3_url):
    """3 ranks check out with shared reads; rank 1 is SIGKILLed the moment it first reads a
    block to send a peer (it owns some: each rank does), its side channel cut mid-checkout.
    Ranks 0 and 2 neither hang nor take wrong bytes: each reads from S3 what rank 1 would
    have sent and returns its state bit for bit, well within the checkout's timeout (a
    failure would have to be a TsckError, and is not what happens here: after the
    agreement a checkout waits for no rank)."""
    proxy, opts = counted
    world, mb, timeout = 3, 4, 60.0
    spec = {"url": s3_url, "opts": opts, "refs": str(tmp_path / "refs.lmdb"), "world": world, "mb": mb,
            "shared": True, "liar": None}
    _run(tmp_path, "put", spec)
    spec = {**spec, "killed": 1, "timeout": timeout}
    out = run_worker_scenario(WORKER, tmp_path / "killed", "killed", json.dumps(spec), limit=300)
    launcher = json.loads((out / "killed_launcher.json").read_text())
    assert launcher["exitcodes"][1] == -9, launcher  # killed by its trap, not ended some other way
    res = rank_results(out, "killed", world, dead=(1,))
    for r in (0, 2):
        assert res[r]["failed"] is None, (r, res[r]["failed"])
        assert res[r]["seconds"] < timeout, (r, res[r]["seconds"])
        got = torch.load(out / f"killed_rank{r}.pt", weights_only=False)
        assert same_bits(got, _expected(r, mb)), f"rank {r} read other bytes"
        assert res[r]["sharing"]["bad"] == 0
    # The kill cut what the survivors were getting from rank 1: read around, and said so.
    assert any(w.startswith("shared reads: rank 1 ") for r in (0, 2) for w in res[r]["warnings"]), \
        [res[r]["warnings"] for r in (0, 2)]


def test_a_rank_killed_before_the_agreement_fails_the_others_checkout_within_its_timeout(tmp_path, counted, s3_url):
    """3 ranks check out with shared reads; rank 1 is SIGKILLed as it first tells an owner
    which of its blocks it reads, before the ranks agree that every rank has. Ranks 0 and 2
    cannot know who reads what (the agreement waits for every rank), so each fails its
    checkout with a TsckError naming rank 1 as behind once the checkout's timeout passed:
    no hang, and nothing returned."""
    proxy, opts = counted
    world, mb, timeout = 3, 1, 10.0
    spec = {"url": s3_url, "opts": opts, "refs": str(tmp_path / "refs.lmdb"), "world": world, "mb": mb,
            "shared": True, "liar": None}
    _run(tmp_path, "put", spec)
    spec = {**spec, "killed": 1, "killed_at": "register", "timeout": timeout}
    out = run_worker_scenario(WORKER, tmp_path / "killed", "killed", json.dumps(spec), limit=300)
    launcher = json.loads((out / "killed_launcher.json").read_text())
    assert launcher["exitcodes"][1] == -9, launcher  # killed by its trap, not ended some other way
    res = rank_results(out, "killed", world, dead=(1,))
    for r in (0, 2):
        assert res[r]["failed"] is not None and "ranks [1] are behind" in res[r]["failed"], (r, res[r]["failed"])
        assert res[r]["seconds"] < 4 * timeout, (r, res[r]["seconds"])  # (its timeout, not the worker's limit)
        assert not (out / f"killed_rank{r}.pt").exists()


def test_a_stranger_is_refused_by_every_side_channel(tmp_path, counted, s3_url):
    """The shared reads' server and the peer replicas' servers (requests, and the block
    stream a restore reads in batches) answer only a connection
    that proves it holds the job's secret (from the c10d Store): a stranger who does not
    answer the challenge, or answers it with another secret, gets nothing back for a read
    and stores nothing for a write; and no server listens on an address the job did not
    announce (TSCK_PEER_HOST=127.0.0.2: the kernel's table of rank 0's listening sockets
    names that address alone for each server's port)."""
    proxy, opts = counted
    spec = {"url": s3_url, "opts": opts, "refs": str(tmp_path / "refs.lmdb"), "world": 2, "mb": 2,
            "shared": True, "liar": None}
    _run(tmp_path, "put", spec)
    out, res = _run(tmp_path, "stranger", spec)
    r0, r1 = res
    assert r0["read"] and r1["read"]  # the job's own ranks are served as before
    assert r1["hosts"] == ["127.0.0.2"] * 3
    assert len(r1["probes"]) == 7
    for name, p in r1["probes"].items():
        assert p["answer"] == 0, (name, p)  # hung up on, nothing sent back
    assert r0["refused"] == 2 and r0["strangers"] == 5  # (the replicas' two servers count together)
    assert not r0["peer_stored"]
    # each server listens on the announced address alone (an unannounced one is refused)
    assert r1["listening"] == {"share": ["127.0.0.2"], "peer": ["127.0.0.2"], "stream": ["127.0.0.2"]}


def test_shared_reads_is_refused_with_a_local_tier_and_checked(tmp_path):
    with pytest.raises(InvalidArgument, match="shared_reads"):
        tsck.open_store(tmp_path / "s", local=tmp_path / "t", shared_reads=True)
    with pytest.raises(InvalidArgument, match="shared_reads"):
        tsck.open_store(tmp_path / "s", shared_reads="yes")
    assert not (tmp_path / "s").exists()
