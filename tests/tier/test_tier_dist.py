"""Collective snapshots through local tiers (open_store(remote, local=NODE_DIR) on every
rank): each rank writes its part to its own tier and returns; the uploaders make the
snapshot durable (docs/design/tiers.md, "Collective puts").

Real gloo ranks (forked by tests/helpers/tier_dist_worker.py), a real S3 server (moto, or
radosgw via TEST_S3_ENDPOINT) behind one local directory per rank, an LMDB remote ref
table. The ranks only record what they see; the test judges against the data definitions
of tests/helpers/dist_worker.py and against the remote store as it sees it afterwards."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import pytest
import torch

import _util
from _util import load_helper, run_worker_scenario, same_bits

import tensorstore_ck as tsck

HERE = Path(__file__).resolve().parents[1]
WORKER = HERE / "helpers" / "tier_dist_worker.py"
dw = load_helper(HERE / "helpers" / "dist_worker.py")
tdw = load_helper(WORKER, sibling_imports=True)
REF = dw.REF


def _run(tmp_path: Path, scenario: str, cfg: dict, limit: float = 400.0) -> Path:
    f = tmp_path / f"cfg-{scenario}-{cfg.get('phase', '')}.json"
    f.write_text(json.dumps(cfg))
    return run_worker_scenario(WORKER, tmp_path / "out", scenario, f, limit=limit)


def _results(out: Path, phase: str, world: int) -> list[dict]:
    return _util.rank_results(out, phase, world, exit_zero=True)


def _check_view(out: Path, phase: str, world: int, version: int) -> None:
    for r in range(world):
        got = torch.load(out / f"{phase}_rank{r}.pt", weights_only=False)
        for path, (rows, _cols, _dt) in dw.SHARDED.items():
            a, b = dw.row_split(rows, world, r)
            assert same_bits(dw.global_tensor(path, version)[a:b], got["sharded"]["/".join(path)]), (phase, r, path)
        want = dw.rank_local(r, version)
        assert got["local"]["rank"] == r and same_bits(want["rng"], got["local"]["rng"])


def _config(tmp_path, s3_url, s3_server, world: int) -> dict:
    cfg = {"url": s3_url, "opts": s3_server, "refs": str(tmp_path / "refs.lmdb"), "world": world,
           "tiers": str(tmp_path / "nodes")}
    # The remote store is made here, once: the ranks open it, none races to create it.
    tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server, block_size=dw.BLOCK,
                    inline_threshold=dw.INLINE).close()
    (tmp_path / "out").mkdir(exist_ok=True)
    return cfg


@pytest.mark.slow  # real ranks and a real S3 server
@pytest.mark.parametrize("world", [2, 4])
def test_collective_put_through_tiers_becomes_durable_and_restores_from_a_fresh_tier(tmp_path, s3_url, s3_server,
                                                                                     world):
    """Each rank writes its part to its own tier and returns local-only; the uploaders
    (every rank its part, rank 0 the top and the move) make it durable: the remote ref
    names the snapshot, the remote fscks clean, and a collective checkout through fresh,
    empty tiers restores every rank's view bit for bit from the remote."""
    cfg = _config(tmp_path, s3_url, s3_server, world)
    out = _run(tmp_path, "put", cfg)
    res = _results(out, "put", world)
    roots = {tuple(r["roots"]) for r in res}
    assert len(roots) == 1, roots  # one snapshot per put, the same on every rank
    (root0, root1), = roots
    assert root0 != root1
    for r in res:
        assert r["durable_at_return"] == [False, False]  # returned at local speed, before any upload
        assert r["waited"] is True and r["queue_left"] == 0
        assert r["disagree"].startswith("SnapshotAborted") and "differs between ranks" in r["disagree"], r["disagree"]
        assert (r["intents_after_abort"], r["queue_after_abort"]) == (0, 0), r
    # Sixteen puts in a row, the ranks in step (a barrier after each): a key left per call
    # would add twelve from the first four to the last four (the count wavers by a few with
    # when rank 0's deletes of the call before land).
    keys = res[0]["keys"]
    assert sum(keys[-4:]) / 4 - sum(keys[:4]) / 4 < 8, f"the c10d Store grows with every call: {keys}"
    assert res[0]["durable_after"] is True
    with tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server) as remote:
        assert remote.resolve(REF) == root1
        assert remote.fsck(full=True).findings == []

    # The tiers are gone (new nodes): the checkout reads everything from the remote.
    out = _run(tmp_path, "load", {**cfg, "tier": "fresh", "phase": "fresh"})
    res = _results(out, "fresh", world)
    _check_view(out, "fresh", world, 1)
    assert all(r["remote_reads"] for r in res)

    # The tiers intact: every rank reads its region from its own tier, nothing remote,
    # and no rank's remote storage was even opened (the ref tables say which tier is newer).
    out = _run(tmp_path, "load", {**cfg, "tier": "tier", "phase": "same"})
    res = _results(out, "same", world)
    _check_view(out, "same", world, 1)
    assert [r["remote_reads"] for r in res] == [[]] * world
    assert [r["remote_opened"] for r in res] == [False] * world


@pytest.mark.slow
@pytest.mark.parametrize("uploads", ["free", "held"])
def test_checkpoint_manager_over_tiers_needs_no_change(tmp_path, s3_url, s3_server, uploads):
    """CheckpointManager as a DDP job runs it (asynchronous collective snapshots, retention
    pruning on rank 0), each rank's store with a local tier: every snapshot is taken, close()
    leaves them durable, and new processes on new nodes (fresh tiers) resume from the
    remote store with the state of the last snapshot. "held": every remote write waits
    until all three snapshots were taken and rank 0's retention (keep_last=1) expired the
    first two locally, before their upload: rank 0 drops them, rank 1's parts of them do
    not hold up its part of the last one, and the last one lands."""
    world = 2
    cfg = _config(tmp_path, s3_url, s3_server, world)
    extra = {"gate": str(tmp_path / "gate"), "keep": 1, "limit": 150} if uploads == "held" else {}
    out = _run(tmp_path, "manager", {**cfg, **extra, "tier": "tier", "phase": "train", "mode": "train"})
    res = _results(out, "train", world)
    for r in res:
        assert r["failed"] == 0 and r["errors"] == [] and r["prune_errors"] == [], r
        assert [s for s, root in r["steps"].items() if root] == ["2", "4", "6"]
    assert res[0]["steps"] == res[1]["steps"]
    with tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server) as remote:
        assert remote.resolve("llm/main") == res[0]["steps"]["6"]
        assert remote.fsck(full=True).findings == []
    out = _run(tmp_path, "manager", {**cfg, "tier": "fresh", "phase": "resume", "mode": "resume"})
    res = _results(out, "resume", world)
    assert [r["start"] for r in res] == [6, 6]
    for r in range(world):
        saved = torch.load(out / f"train_rank{r}.pt", weights_only=False)
        got = torch.load(out / f"resume_rank{r}.pt", weights_only=False)
        for k, v in saved["model"].items():
            assert same_bits(v, got["model"][k]), (r, k)


@pytest.mark.slow
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_collective_put_past_a_tiers_budget_fails_on_every_rank_and_writes_nothing(tmp_path, s3_url, s3_server,
                                                                                     blocking):
    """local_budget= holds for collective puts as for a put, blocking or not: 2 ranks, a
    budget of one byte, the remote's writes held so no upload frees room. The first
    snapshot goes into the empty tiers; the second finds each rank's tier over its budget,
    waits BUDGET_WAIT for uploads (1 s here) and fails on every rank (an asynchronous
    one in its future), TierFull on at least one, the others told the snapshot aborted,
    writing nothing into the tiers. Once the remote takes writes again, the first
    snapshot is durable and the remote ref names it."""
    world = 2
    cfg = {**_config(tmp_path, s3_url, s3_server, world), "budget": 1, "budget_wait": 1.0,
           "gate": str(tmp_path / "gate"), "blocking": blocking}
    res = _results(_run(tmp_path, "budget", cfg), "budget", world)
    assert all(r["second"] != "returned" for r in res), res
    assert any(r["second"].startswith("TierFull") for r in res), res
    assert all(r["tier_bytes"][1] == r["tier_bytes"][0] for r in res), res  # nothing of the second written
    assert all(r["waited"] for r in res), res
    with tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server) as remote:
        assert remote.resolve(REF) == res[0]["first"] == res[0]["tip"]


@pytest.mark.slow
def test_every_ranks_tier_follows_rank_0s_retention(tmp_path, s3_url, s3_server):
    """A job of 3 ranks with replicas=1 takes a snapshot every step for 8 steps, keeping
    the last 2. Every rank's tier, not only rank 0's (where the job's prune runs), ends
    with the snapshots rank 0 keeps and at most the one rank 0 was uploading as it spoke
    last, and nothing else, rank 2's too, whose uploads lag: each tier fscks clean with no orphan (its part, the commit, the top
    nodes and the replicas of what it keeps; the other ranks' sub-trees are not missing
    there) and its gc runs and keeps what rank 0 keeps, rank 1's too, whose last word from
    rank 0 came while a gc held its tier; the job restores from the tiers with no remote
    read."""
    world, steps, keep = 3, 8, 2
    cfg = _config(tmp_path, s3_url, s3_server, world)
    tidy = _run(tmp_path, "tidy", {**cfg, "steps": steps, "keep": keep, "lag_rank": 2}, limit=500)
    res = _results(tidy, "tidy", world)
    taken = [root for _s, root in sorted(res[0]["steps"].items(), key=lambda kv: int(kv[0])) if root]
    last = taken[-1]
    assert len(taken) >= keep + 2, res[0]["steps"]  # (a step may be skipped while one is in flight)
    for r in res:
        assert r["waited"] is True and r["steps"] == res[0]["steps"]
        assert r["fsck"] == [] and r["orphans"] == 0, r
        assert r["gc"] == "ran" and r["fsck_after_gc"] == [], r
    kept0 = set(res[0]["rows"])
    assert len(kept0) == keep and last in kept0
    assert res[1]["held"] in ("met", "idle"), res[1]  # rank 1's last word met a gc holding its tier
    # rank 0's uploads read the other ranks' nodes from the remote by design: no warning
    assert not any("is missing; reading it" in m for m in res[0]["said"]), res[0]["said"][:5]
    for r in res[1:]:
        rows, word = set(r["rows"]), set(r["word"])
        # Each rank's tier keeps what rank 0's last word (with the last snapshot) names and
        # nothing else, rank 2's too, whose uploads lag and whose cleanups ran with its
        # older parts still queued. The word is rank 0's rows then, less what its rules
        # drop, but for the upload rank 0 had in flight (held; pruned by rank 0 after it
        # was sent): one snapshot more at most, any older one where rank 0's uploads lag.
        # (The word names roots by their first KEEP_PREFIX bytes: 16 hex digits.)
        def pre(roots):
            return {h[:16] for h in roots}
        assert all(len(h) == 16 for h in word), word
        assert last[:16] in word and pre(kept0) <= word and len(word - pre(kept0)) <= 1, (word, kept0)
        assert kept0 <= rows and pre(rows) <= word, {"rows": r["rows"], "word": r["word"], "taken": taken}
        assert r["parts"] == len(rows) and r["tidied"] == len(taken) - len(rows), r
        # Its gc applies the job's rules (set on every rank's tier) and agrees with rank 0.
        assert set(r["rows_after_gc"]) == kept0 and (r["gc_deleted"] > 0) == (rows != kept0), r
    with tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server) as remote:
        assert remote.resolve("llm/main") == last
        assert remote.fsck(full=True).findings == []
    out = _run(tmp_path, "manager", {**cfg, "tier": "tier", "phase": "resume", "mode": "resume", "keep": keep})
    for r, got in enumerate(_results(out, "resume", world)):
        assert got["start"] == int(max(s for s, root in res[0]["steps"].items() if root == last)), got
        assert got["remote_reads"] == [], got
        saved = torch.load(tidy / f"tidy_rank{r}.pt", weights_only=False)["model"]
        now = torch.load(out / f"resume_rank{r}.pt", weights_only=False)["model"]
        assert all(same_bits(v, now[k]) for k, v in saved.items()), r


@pytest.mark.slow
@pytest.mark.parametrize("lost,damaged,fan", [([1], [], None), ([1, 2], [], None), ([1], [2], None), ([1], [], 2)],
                         ids=["peer-holds-it", "no-replica-left", "replica-damaged", "peer-under-another-leaf"])
def test_a_rank_that_lost_its_tier_restores_from_its_peer_replica(tmp_path, s3_url, s3_server, lost, damaged,
                                                                  fan):
    """replicas=1 on 3 ranks: each rank's part is copied to the next rank's tier. The job
    restarts after rank 1's node lost its tier: rank 1's checkout gets every object it
    lacks from rank 2, by address, and reads nothing from the remote store; no rank
    even opens the remote storage (rank 1's new tier is made from the remote ref table's
    record of the store, not from the remote's marker). When rank 2's
    tier is lost too (no replica of rank 1's part is left), rank 1 reads the remote store,
    and rank 2 still gets its part from rank 0. When rank 2's tier holds damaged blocks
    (its replica of rank 1's part among them), rank 1 uses none of them: it reads those
    blocks from the remote store. Every rank restores bit for bit. With rank-tree nodes of
    2 ranks (fan=2, as 16 ranks a node at scale), rank 1's holder got another path down the
    rank tree from rank 0 than rank 1's: rank 1 sends its own with its part."""
    world = 3
    cfg = {**_config(tmp_path, s3_url, s3_server, world), "replicas": 1, "fan": fan}
    out = _run(tmp_path, "rput", cfg)
    res = _results(out, "rput", world)
    assert len({tuple(r["roots"]) for r in res}) == 1
    assert all(r["waited"] is True and r["sent"] > 0 and r["refused"] == 0 for r in res)
    # The replicas are kept: a gc of every rank's tier runs and deletes none of its objects
    # (each walks the snapshots through its part and what else it holds).
    assert [r["gc"] for r in res] == ["ran"] * world
    assert all(r["gc_lost"] == [] for r in res), [r["gc_lost"][:3] for r in res]

    phase = "lost" + "".join(map(str, lost)) + ("damaged" + "".join(map(str, damaged)) if damaged else "")
    out = _run(tmp_path, "rload", {**cfg, "lost": lost, "damaged": damaged, "phase": phase})
    res = _results(out, phase, world)
    _check_view(out, phase, world, 1)
    if damaged:
        assert res[1]["bad_copies"] > 0 and res[1]["remote_reads"], res[1]
        return
    for r in range(world):
        peer_has_it = r in lost and (r + 1) % world not in lost
        # each rank's restore line says where it read: its tier, its peer, the remote
        (said,) = res[r]["sources"]
        if r not in lost:  # its own tier holds its region
            assert res[r]["remote_reads"] == [] and res[r]["fetched"] == 0, (r, res[r])
            assert said == "local", (r, said)
        elif peer_has_it:  # from its peer, by address: nothing from the remote
            assert res[r]["remote_reads"] == [] and res[r]["fetched"] > 0, (r, res[r])
            # its blocks in batches, not one request each: a few fetches for all of them
            assert res[r]["streamed"] > 0 and res[r]["stream_fetches"] < res[r]["streamed"], (r, res[r])
            assert "peer" in said.split("+") and "remote" not in said, (r, said)
        if r not in lost or peer_has_it:
            assert res[r]["remote_opened"] is False, (r, res[r])
        else:  # no replica left: the remote store
            assert res[r]["remote_reads"], (r, res[r])
            assert "remote" in said.split("+"), (r, said)


@pytest.mark.slow
def test_a_lost_node_restores_from_the_copies_placed_on_other_nodes(tmp_path, s3_url, s3_server):
    """6 ranks on 3 simulated nodes (TSCK_NODE: a, a, b, b, c, c), replicas=1: each rank's
    copy is placed on another node (tier/placement.py), never on its neighbour of the same
    node as r+1 would (rank 0's on rank 1), and the commit records each rank's node. Node b
    is lost (ranks 2 and 3, tiers and all) and its ranks come back on two new machines, d
    and e: they restore from the copies where the snapshot's placement put them (the
    placement of the nodes now would send rank 2 to rank 1, which holds none of its) and
    read nothing from the remote store; every rank bit for bit."""
    from tensorstore_ck.tier.placement import holders
    world, put_nodes, now_nodes = 6, ["a", "a", "b", "b", "c", "c"], ["a", "a", "d", "e", "c", "c"]
    assert holders(put_nodes, 1)[2] != holders(now_nodes, 1)[2]  # (what makes the record matter here)
    cfg = {**_config(tmp_path, s3_url, s3_server, world), "replicas": 1, "nodes": put_nodes}
    out = _run(tmp_path, "rput", cfg)
    res = _results(out, "rput", world)
    assert all(r["waited"] is True and r["sent"] > 0 and r["refused"] == 0 for r in res)
    assert res[0]["placed"] == {"names": ["a", "b", "c"], "of": [0, 0, 1, 1, 2, 2]}, res[0]["placed"]
    phase = "lostnode"
    out = _run(tmp_path, "rload", {**cfg, "lost": [2, 3], "nodes": now_nodes, "phase": phase})
    res = _results(out, phase, world)
    _check_view(out, phase, world, 1)
    for r in range(world):
        (said,) = res[r]["sources"]
        assert res[r]["remote_reads"] == [], (r, res[r])
        if r in (2, 3):  # from the other nodes' copies, in batches
            assert res[r]["fetched"] > 0 and res[r]["streamed"] > 0 and "peer" in said.split("+"), (r, said)
            assert res[r]["remote_opened"] is False, (r, res[r])
        else:
            assert said == "local" and res[r]["fetched"] == 0, (r, said)


def _memtier(tmp_path, s3_url, s3_server, **extra) -> tuple[dict, Path]:
    """The memory tier's 4 ranks on nodes a, a, b, b: tiers on /dev/shm, replicas=1,
    durable_every=3. -> (the config, the /dev/shm folder to remove after)."""
    shm = Path("/dev/shm") / f"tsck-test-{uuid.uuid4().hex[:12]}"  # (tmp_path names repeat across xdist workers)
    return ({**_config(tmp_path, s3_url, s3_server, 4), "replicas": 1, "nodes": ["a", "a", "b", "b"], "memory": True,
             "durable_every": 3, "tiers": str(shm / "nodes"), **extra}, shm)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="this machine has no tmpfs at /dev/shm for a memory tier")
@pytest.mark.parametrize("lost", [(2, 3), (0, 1)], ids=["node-b", "node-a-with-rank-0"])
def test_a_lost_node_restores_a_memory_only_snapshot_from_the_other_nodes_memory(tmp_path, s3_url, s3_server, lost):
    """The memory tier: 4 ranks on 2 simulated nodes (a, a, b, b), each rank's tier in host
    memory (memory=, on /dev/shm), replicas=1, durable_every=3. Step 1 is uploaded, step 2
    stays in memory: every rank's commit says so, and the remote store holds step 1 alone.
    The put of step 2 returns once each part's copy is on a rank of the other node; a tag
    on it is refused (the other ranks' parts would never be sent); a gc of each rank's
    tier keeps its part and the copies it holds. A node is lost (its ranks' memory gone)
    and its ranks come back on new nodes d and e: every rank restores step 2, the newest,
    bit for bit, the lost node's ranks from the other node's memory, and no rank reads the
    remote store. With node a lost, rank 0's new tier knows only the remote's step 1: it
    names step 2 from the tips the other ranks post with their hello."""
    world = 4
    cfg, shm = _memtier(tmp_path, s3_url, s3_server, many=400)
    try:
        out = _run(tmp_path, "rput", cfg)
        res = _results(out, "rput", world)
        assert all(r["tier_only"] == [False, True] for r in res), [r["tier_only"] for r in res]
        assert all(r["waited"] is True and r["sent"] > 0 and r["refused"] == 0 for r in res)
        assert all(r["sent_at_return"] == r["sent"] for r in res), [(r["sent_at_return"], r["sent"]) for r in res]
        # a tag must keep its snapshot durable, and no rank would send the others' parts: refused, nothing made
        assert res[0]["tag"].startswith("refused: ") and "tier-only" in res[0]["tag"], res[0]["tag"]
        assert res[0]["tags"] == [], res[0]["tags"]
        assert all(r["gc"] == "ran" and r["gc_lost"] == [] for r in res), [(r["gc"], r["gc_lost"]) for r in res]
        with tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server) as remote:
            assert [h.step for h in remote.log(REF)] == [1]
        phase = "memlost"
        nodes = ["d", "e", "b", "b"] if lost == (0, 1) else ["a", "a", "d", "e"]
        out = _run(tmp_path, "rload", {**cfg, "lost": list(lost), "nodes": nodes, "phase": phase})
        res = _results(out, phase, world)
        _check_view(out, phase, world, 1)
        for r in range(world):  # (each part's 400 small tensors, one packed block of 1.6 MB: copied whole)
            many = torch.load(out / f"{phase}_rank{r}.pt", weights_only=False)["local"]["many"]
            want = tdw.many_tensors(r, 1, 400)
            assert many.keys() == want.keys() and all(same_bits(many[k], want[k]) for k in want), r
            assert res[r]["remote_reads"] == [], (r, res[r])
            if r in lost:  # (the pack too: in the batches, none of its blocks asked for alone)
                assert res[r]["streamed"] > 0 and "peer" in res[r]["sources"][0].split("+"), (r, res[r])
                assert res[r]["blocks_alone"] == 0, (r, res[r])
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_a_job_whose_remote_holds_nothing_yet_resumes_from_the_other_nodes_memory(tmp_path, s3_url, s3_server):
    """A CheckpointManager over memory tiers (4 ranks on nodes a, a, b, b, replicas=1,
    durable_every=3): step 1 is scheduled durable, but rank 0's moves of the remote ref all
    fail, so the remote lists nothing of the ref; step 2 stays in memory with its copies.
    Node a (rank 0's) is lost and its ranks come back on new nodes: restore_latest on
    every rank resumes step 2, bit for bit, from node b's tiers and copies (rank 0 knows no
    snapshot of the ref: the other ranks' tips name it), not from nothing."""
    world = 4
    cfg, shm = _memtier(tmp_path, s3_url, s3_server)
    try:
        res = _results(_run(tmp_path, "noremote", {**cfg, "mode": "train", "phase": "nrtrain"}), "nrtrain", world)
        assert res[0]["tier_only"] == [False, True], res[0]["tier_only"]
        with tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server) as remote:
            assert not remote.refs()
        res = _results(_run(tmp_path, "noremote", {**cfg, "mode": "resume", "phase": "nrresume", "lost": [0, 1],
                                                   "nodes": ["d", "e", "b", "b"]}), "nrresume", world)
        assert [(r["restored"], r["exact"]) for r in res] == [(2, True)] * world, res
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_a_job_whose_lost_rank_0_names_an_unreadable_snapshot_falls_back_to_the_remotes_newest(tmp_path, s3_url,
                                                                                              s3_server):
    """As above, but rank 0's moves go through: step 1 is in the remote, step 2 stays in
    memory. Node a (rank 0's) is lost and every block node b's tiers hold is damaged, so
    step 2, which the other ranks' tips name, reads whole nowhere. restore_latest falls
    back to step 1, the remote's newest, on every rank, bit for bit (rank 0's history is
    the remote's: its newest is a target of its own after the ref, not skipped)."""
    world = 4
    cfg, shm = _memtier(tmp_path, s3_url, s3_server)
    try:
        res = _results(_run(tmp_path, "noremote", {**cfg, "mode": "train", "moves": True, "phase": "fbtrain"}),
                       "fbtrain", world)
        assert res[0]["tier_only"] == [False, True], res[0]["tier_only"]
        with tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server) as remote:
            assert [h.step for h in remote.log("nr/main")] == [1]
        res = _results(_run(tmp_path, "noremote", {**cfg, "mode": "resume", "phase": "fbresume", "lost": [0, 1],
                                                   "damaged": [2, 3], "nodes": ["d", "e", "b", "b"]}),
                       "fbresume", world)
        assert [(r["restored"], r["exact"]) for r in res] == [(1, True)] * world, res
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_a_lost_rank_0_whose_newest_snapshot_is_whole_nowhere_falls_back_to_an_older_one_only_memory_holds(
        tmp_path, s3_url, s3_server):
    """Steps 1 (in the remote), 2 and 3 (tier-only). Node a (ranks 0 and 1) is cut off as
    step 3 is put: its parts of step 3 reach neither a holder nor the remote, so step 3 is
    whole nowhere once node a is lost, and step 2, which node b holds with node a's copies,
    stays. Rank 0's new tier knows only the remote's step 1; the other ranks post steps 3
    and 2 with their hello. restore_latest tries step 3, then step 2, which every rank
    restores bit for bit (not step 1, the remote's newest: a committed memory snapshot is
    not lost with one node)."""
    world = 4
    cfg, shm = _memtier(tmp_path, s3_url, s3_server)
    try:
        res = _results(_run(tmp_path, "noremote", {**cfg, "mode": "train", "moves": True, "cut": [0, 1],
                                                   "phase": "cuttrain"}), "cuttrain", world)
        assert res[0]["tier_only"] == [False, True, True], res[0]["tier_only"]
        with tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server) as remote:
            assert [h.step for h in remote.log("nr/main")] == [1]
        res = _results(_run(tmp_path, "noremote", {**cfg, "mode": "resume", "phase": "cutresume", "lost": [0, 1],
                                                   "nodes": ["d", "e", "b", "b"]}), "cutresume", world)
        assert [(r["restored"], r["exact"]) for r in res] == [(2, True)] * world, res
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="this machine has no tmpfs at /dev/shm for a memory tier")
@pytest.mark.parametrize("change", ["fewer", "more"])
def test_a_restart_on_fewer_or_more_nodes_restores_the_memory_only_snapshot_from_the_nodes_that_hold_it(
        tmp_path, s3_url, s3_server, change):
    """A memory-only snapshot (step 2; step 1 in the remote), replicas=1. "fewer": 6 ranks
    on nodes a, a, b, b, c, c; node b is lost and the job restarts on a and c alone, 4
    ranks: c's ranks are ranks 2 and 3 now, and open the tiers c's first and second ranks
    had (ranks 4 and 5's). "more": 4 ranks on a, a, b, b restart as 8, nodes d and e added
    (empty tiers; d's ranks' holders now are e's, which lack even the snapshot's commit).
    Every rank reads its rows of the resharded tensors (and its private state: rank r's,
    a rank past the saved world rank 0's) bit for bit from the tiers that hold them now,
    found by node and place on it, not by rank number, and no rank reads the remote
    store."""
    put_nodes, now_nodes, tier_of = {
        "fewer": (["a", "a", "b", "b", "c", "c"], ["a", "a", "c", "c"], [0, 1, 4, 5]),
        "more": (["a", "a", "b", "b"], ["a", "a", "b", "b", "d", "d", "e", "e"], list(range(8)))}[change]
    cfg, shm = _memtier(tmp_path, s3_url, s3_server)
    cfg.update(world=len(put_nodes), nodes=put_nodes)
    try:
        res = _results(_run(tmp_path, "rput", cfg), "rput", len(put_nodes))
        assert all(r["tier_only"] == [False, True] and r["sent"] > 0 for r in res), res
        with tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server) as remote:
            assert [h.step for h in remote.log(REF)] == [1]
        for r in range(len(put_nodes)):  # (node b's tiers gone with it)
            if put_nodes[r] not in now_nodes:
                shutil.rmtree(os.path.join(cfg["tiers"], f"tier{r}"))
        world, phase = len(now_nodes), f"{change}nodes"
        out = _run(tmp_path, "rload", {**cfg, "world": world, "nodes": now_nodes, "tier_of": tier_of, "lost": [],
                                       "phase": phase})
        res = _results(out, phase, world)
        for r in range(world):
            got = torch.load(out / f"{phase}_rank{r}.pt", weights_only=False)
            for path, (rows, _cols, _dt) in dw.SHARDED.items():
                a, b = dw.row_split(rows, world, r)
                assert same_bits(dw.global_tensor(path, 1)[a:b], got["sharded"]["/".join(path)]), (r, path)
            want = dw.rank_local(r if r < len(put_nodes) else 0, 1)
            assert same_bits(want["rng"], got["local"]["rng"]), r
            assert res[r]["remote_reads"] == [], (r, res[r])
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_a_rank_0_whose_tier_was_another_ranks_since_restores_the_newest_the_others_hold(tmp_path, s3_url,
                                                                                        s3_server):
    """Nodes numbered anew at each restart (torchrun's rendezvous may): a run on a, a, b, b
    puts steps 1 (to the remote) and 2 (tier-only); the next on b, b, a, a puts steps 3
    (to the remote) to 5, rank 0 on b; the third is on a, a, b, b again. Rank 0's tier (a's
    first) names step 2, its last move of the ref, and the remote step 3, but the tiers
    hold step 5, committed after that move: every rank restores step 5, bit for bit (not
    step 3, which a rank-0 tier left behind by the renumbering would name). With steps 5
    and 4 unreadable, step 3 is the one restored."""
    world = 4
    cfg, shm = _memtier(tmp_path, s3_url, s3_server)
    cfg = {**cfg, "moves": True, "lost": []}
    try:
        _run(tmp_path, "noremote", {**cfg, "mode": "train", "steps": [1, 2], "phase": "run1"})
        res = _results(_run(tmp_path, "noremote", {**cfg, "mode": "train", "steps": [3, 4, 5],
                                                   "nodes": ["b", "b", "a", "a"], "tier_of": [2, 3, 0, 1],
                                                   "phase": "run2"}), "run2", world)
        assert [r["restored"] for r in res] == [2] * world, res
        with tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server) as remote:
            assert [h.step for h in remote.log("nr/main")] == [3, 1]
        res = _results(_run(tmp_path, "noremote", {**cfg, "mode": "resume", "phase": "run3"}), "run3", world)
        assert [(r["restored"], r["exact"]) for r in res] == [(5, True)] * world, res
        # log() on rank 0 is the remote's history (its tip the newer), not the one of the
        # ref in its tier (step 2), which lists step 3 as a part's row only
        assert res[0]["log"] == [3, 1], res[0]["log"]
        # Every tier's blocks damaged: steps 5 and 4 read whole nowhere, and the next is the
        # remote's step 3 (not step 1, which rank 0's tier's history of the ref goes on to).
        res = _results(_run(tmp_path, "noremote", {**cfg, "mode": "resume", "damaged": [0, 1, 2, 3],
                                                   "phase": "run4"}), "run4", world)
        assert [(r["restored"], r["exact"]) for r in res] == [(3, True)] * world, res
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_a_rollback_holds_against_the_newer_snapshots_the_other_tiers_post(tmp_path, s3_url, s3_server):
    """Steps 1 and 4 reach the remote, 2 and 3 stay in memory; restore(1) moves the ref back
    (in rank 0's tier and the remote). The next restore_latest restores step 1 on every
    rank, not step 4: the other ranks' tiers post their rows of step 4 (and of the
    tier-only steps still kept), committed before the rollback's move, so rank 0's tier
    keeps its ref where the rollback put it."""
    world = 4
    cfg, shm = _memtier(tmp_path, s3_url, s3_server)
    cfg = {**cfg, "moves": True, "lost": []}
    try:
        res = _results(_run(tmp_path, "noremote", {**cfg, "mode": "train", "steps": [1, 2, 3, 4], "phase": "rb1"}),
                       "rb1", world)
        # (steps 1 and 4 durable; the tier-only ones a newer snapshot stood in for may be gone)
        assert res[0]["tier_only"][0] is False and res[0]["tier_only"][-1] is False, res[0]["tier_only"]
        res = _results(_run(tmp_path, "noremote", {**cfg, "mode": "rollback", "to": 1, "phase": "rb2"}), "rb2", world)
        assert [(r["restored"], r["exact"]) for r in res] == [(1, True)] * world, res
        res = _results(_run(tmp_path, "noremote", {**cfg, "mode": "resume", "phase": "rb3"}), "rb3", world)
        assert [(r["restored"], r["exact"]) for r in res] == [(1, True)] * world, res
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_two_stores_with_replicas_in_one_job_send_their_copies_to_their_own_tiers(tmp_path):
    """Each of 2 ranks holds two tiered stores with replicas=1 (remotes A and B, tiers of
    their own), both joined to the job's side channel; a put into A sends each rank's part
    to the other rank's tier A, and nothing into the tiers B (the stores' addresses are
    apart in the c10d Store: with one key per rank, B's servers would have taken A's
    copies)."""
    world = 2
    cfg = {"world": world, "tiers": str(tmp_path / "nodes")}
    (tmp_path / "out").mkdir()
    res = _results(_run(tmp_path, "twostores", cfg), "twostores", world)
    for r in range(world):
        other = res[1 - r]["blocks"]["A"]
        assert other and set(other) <= set(res[r]["blocks"]["A"]), (r, res[r]["blocks"])
        assert res[r]["blocks"]["B"] == [], (r, res[r]["blocks"]["B"][:3])


@pytest.mark.slow
def test_every_rank_drops_a_superseded_memory_only_part_once_a_newer_one_is_committed(tmp_path, s3_url, s3_server):
    """4 ranks on nodes a, a, b, b, memory tiers, replicas=1, durable_every=3: step 1 is
    durable, 2 and 3 stay in memory. Once step 3's put returned (its copies agreed), step 2
    is gone from every rank's tier (its part and the copies held of it), not only rank 0's:
    a rank other than 0 applies the same rule itself instead of waiting for rank 0's word
    with the next snapshot, after it made room for that one."""
    world = 4
    cfg, shm = _memtier(tmp_path, s3_url, s3_server, puts=3)
    try:
        res = _results(_run(tmp_path, "rput", cfg), "rput", world)
        assert all(r["tier_only"] == [False, True, True] for r in res), [r["tier_only"] for r in res]
        one, two, three = res[0]["roots"]
        for r in res:
            assert two not in r["rows"] and three in r["rows"], (r["rank"], r["rows"], two)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_a_memory_only_snapshot_stays_until_the_remote_lists_the_durable_one_after_it(tmp_path, s3_url, s3_server):
    """4 ranks on nodes a, a, b, b, memory tiers, replicas=1, durable_every=2: step 1 is
    durable, step 2 stays in memory, step 3 is durable, but rank 0's move of the remote ref
    to step 3 is held. Ranks 1-3 have sent their parts of step 3 (each part marked durable
    in its own tier) and applied their tier's rule: step 2, its parts and the copies they
    hold, stays in every tier, since step 3 is not in the remote yet (node b lost now would
    leave step 2 the newest whole snapshot). Once rank 0 moved the ref, step 3 is durable."""
    world = 4
    cfg, shm = _memtier(tmp_path, s3_url, s3_server, durable_every=2)
    try:
        res = _results(_run(tmp_path, "heldmove", cfg), "heldmove", world)
        assert all(r["tier_only"] == [False, True, False] for r in res), [r["tier_only"] for r in res]
        one, two, three = res[0]["roots"]
        for r in res[1:]:
            assert two in r["held"] and three in r["held"], (r["rank"], r["held"])
        assert all(r["waited"] is True for r in res)
        with tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server) as remote:
            assert [h.step for h in remote.log(REF)] == [3, 1]
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
def test_a_memory_only_snapshot_one_of_whose_copies_failed_is_uploaded_in_its_place(tmp_path, s3_url, s3_server):
    """As above (4 ranks on nodes a, a, b, b, memory tiers, replicas=1, durable_every=3),
    but rank 3's peer server stops listening after step 1: the copy of step 2's part
    that a rank of node a sends it fails. The ranks agree that a part lacks its copy, and
    every rank queues its part after all: the remote store lists step 2 (its commit still
    says the schedule kept it out), so losing node a now would not lose it."""
    world = 4
    cfg, shm = _memtier(tmp_path, s3_url, s3_server, deaf=3)
    try:
        res = _results(_run(tmp_path, "rput", cfg), "rput", world)
        assert all(r["tier_only"] == [False, True] for r in res), [r["tier_only"] for r in res]
        assert all(r["waited"] is True for r in res), [r["waited"] for r in res]
        with tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server) as remote:
            assert [h.step for h in remote.log(REF)] == [2, 1]
            assert remote.show(REF).root == res[0]["roots"][1]
    finally:
        shutil.rmtree(shm, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("trap,wipe", [("adopt", False), ("published", False), ("adopt", True)],
                         ids=["before-its-row", "after-its-row", "its-tier-lost"])
def test_a_rank_killed_after_its_done_still_sends_its_part(tmp_path, s3_url, s3_server, trap, wipe):
    """Rank 1 is killed (SIGKILL) after snapshot A was published: before its tier had A's
    row (it holds only the intent written before it said "done") or after the row and
    before it queued its part. After the restart its open queues the part again and
    sends it, and rank 0's uploader, which waits for that part, makes A durable before
    B is put. With rank 1's tier lost as well, no rank will ever send that part: once
    snapshot B of the ref is queued and A's part has stalled (SUPERSEDED_PART_WAIT, set
    to 5 s in the ranks) the backlog rule drops A, B becomes durable without A's wait (PART_WAIT, 15 minutes),
    and A stays local-only."""
    world = 2
    cfg = _config(tmp_path, s3_url, s3_server, world)
    out = _run(tmp_path, "stuckkill", {**cfg, "trap": trap})
    launcher = json.loads((out / "stuckkill_launcher.json").read_text())
    assert launcher.get("killed") == 1, launcher
    res0 = json.loads((out / "stuckkill_rank0.json").read_text())
    assert res0["ok"], res0.get("error")
    out = _run(tmp_path, "stuckresume", {**cfg, "root_a": res0["root"], "wipe": wipe, "first_a": not wipe})
    res = _results(out, "stuckresume", world)
    assert all(r["waited"] is True for r in res), [(r["waited"], r["wait_s"]) for r in res]
    assert res[1]["intents"] == 0
    if wipe:
        assert res[0]["superseded"] == 1 and res[1]["orphans"] == 0
        assert res[0]["durable"] == {res[0]["root"]: True, res0["root"]: False}
    else:
        assert [r["a_first"] for r in res] == [True, True], res
        assert res[0]["superseded"] == 0 and res[0]["durable"] == {res[0]["root"]: True, res0["root"]: True}, res[0]
        # Killed before its row: sent from the intent (no row here to mark durable).
        assert (res[1]["orphans"], res[1]["a_part_sent"]) == ((1, False) if trap == "adopt" else (0, True)), res[1]
    with tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server) as remote:
        assert remote.resolve(REF) == res[0]["root"]
        if not wipe:
            assert res0["root"] in [i.root for i in remote.log(REF)]
            assert remote.fsck(full=True).findings == []


@pytest.mark.slow
def test_a_rank_whose_rank_0_died_publishing_keeps_its_part_to_send(tmp_path, s3_url, s3_server):
    """Rank 0 is killed (SIGKILL) once snapshot A is published in its tier, before it told
    rank 1. Rank 1 cannot ask rank 0's tier whether A was published: it reports
    OutcomeUnknown (not SnapshotAborted, which would be false here) and keeps its part's
    intent; rank 0's tier, its part of A marked with its local move, checks clean. After the
    restart rank 0's uploader sends A and waits for rank 1's part, which rank 1's open sends
    from the intent: A becomes durable before B is put, and every tier checks clean."""
    world = 2
    cfg = _config(tmp_path, s3_url, s3_server, world)
    out = _run(tmp_path, "deadzero", cfg)
    launcher = json.loads((out / "deadzero_launcher.json").read_text())
    assert launcher.get("killed") == 0, launcher
    r1 = json.loads((out / "deadzero_rank1.json").read_text())
    assert r1["ok"], r1.get("error")
    assert r1["outcome"] == "OutcomeUnknown", (r1["outcome"], r1.get("message"))
    assert "rank 0's tier" in r1["message"] and REF in r1["message"], r1["message"]
    assert r1["intents"] == 1
    with tsck.open_store(tmp_path / "nodes" / "tier0", create=False) as t0:  # A, published there
        root_a = t0.resolve(REF)
        assert t0.show(root_a).step == 1
        # killed right after its local move: its own part was marked with it, so the tier does
        # not take A for a whole snapshot (it holds only rank 0's blocks)
        assert t0.fsck(full=True).findings == []
    out = _run(tmp_path, "stuckresume", {**cfg, "root_a": root_a, "wipe": False, "first_a": True})
    res = _results(out, "stuckresume", world)
    assert [r["a_first"] for r in res] == [True, True], res
    assert all(r["waited"] is True for r in res), [(r["waited"], r["wait_s"]) for r in res]
    assert (res[1]["orphans"], res[1]["intents"]) == (1, 0), res[1]
    assert res[0]["superseded"] == 0 and res[0]["durable"] == {res[0]["root"]: True, root_a: True}, res[0]
    with tsck.open_store(s3_url, refs=cfg["refs"], storage_options=s3_server) as remote:
        assert remote.resolve(REF) == res[0]["root"]
        assert root_a in [i.root for i in remote.log(REF)]
        assert remote.fsck(full=True).findings == []
    for r in range(world):
        with tsck.open_store(tmp_path / "nodes" / f"tier{r}", create=False) as t:
            assert t.fsck(full=True).findings == [], (r, t.fsck(full=True).findings)



@pytest.fixture
def side(monkeypatch):
    """A real c10d Store (the job's secret lives there) and the side channels on 127.0.0.1."""
    import datetime

    import torch.distributed as dist
    monkeypatch.setenv("TSCK_PEER_HOST", "127.0.0.1")
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))


def _peers(core, kv, listen: bool = False):
    """A rank's Peers over `core` in the job whose c10d Store is `kv` -> (it, its port if listening)."""
    from tensorstore_ck.tier.replicas import Peers
    p = Peers(core, 1)
    p.kv = kv
    for r in range(2):  # both ranks on one host (what joining posts): the holder is the next rank
        kv.set(f"tsck/node/{r}", b"host")
    if listen:
        return p, int(p._listen().rsplit(":", 1)[1])
    p._secret = __import__("tensorstore_ck.util.net", fromlist=["x"]).job_secret(kv)
    return p, None

def test_a_peer_refuses_a_copy_that_is_not_the_object_of_its_address(tmp_path, side):
    """The receiving side of the replicas (a real server on a real socket): a copy whose
    bytes are not the object of the address it is sent under, or that is damaged, is
    refused and not stored; the genuine copy is stored, and served back only whole."""
    import socket

    from tensorstore_ck.core.assets import Assets
    from tensorstore_ck.util.net import job_secret, prove

    with tsck.open_store(str(tmp_path / "a"), block_size=dw.BLOCK, inline_threshold=dw.INLINE) as a, \
            tsck.open_store(str(tmp_path / "b"), block_size=dw.BLOCK, inline_threshold=dw.INLINE) as b:
        a.put_snapshot({"x": torch.arange(4096, dtype=torch.float32)}, "r")
        d = next(iter(o.digest for o in __import__("tensorstore_ck.core.walk", fromlist=["x"]).walk_commit(
            a.assets, bytes.fromhex(a.resolve("r"))) if o.kind == "block"))
        good = a.assets.stored_frame("block", d)
        other = bytes(32)
        peers, port = _peers(b.core, side, listen=True)
        try:
            def ask(op, digest, data=b""):
                with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
                    prove(c, job_secret(side))
                    c.sendall(op + b"b" + digest + len(data).to_bytes(8, "big") + data)
                    if op == b"G":
                        n = int.from_bytes(c.recv(8), "big")
                        return None if n == (1 << 64) - 1 else n
                    return c.recv(1)
            bad = bytearray(good)
            bad[-1] ^= 1
            assert ask(b"P", other, good) == b"\x00"  # another address's bytes
            assert ask(b"P", d, bytes(bad)) == b"\x00"  # damaged
            assert peers.refused == 2
            assert not b.assets.block_exists(d) and not b.assets.block_exists(other)
            assert ask(b"G", d) is None
            assert ask(b"P", d, good) == b"\x01"
            assert b.assets.block_exists(d) and b.assets.stored_frame("block", d) == good
            assert ask(b"G", d) == len(good)
            assert ask(b"S", bytes(32)) == b"\x01"  # (named on disk at the sync: the store batches its writes)
            # The asking side: a rank whose holder is this server.
            asker, _ = _peers(a.core, side)
            asker.rank, asker.world, asker._addrs[1] = 0, 2, ("127.0.0.1", port)
            assert asker.present("block", [d, other]) == {d}
            got = asker.fetch_checked("block", d)
            assert got is not None and bytes(got[0]) == good and asker.fetched == 1
            key = tmp_path / "b" / Assets.object_key("blocks", d)
            key.chmod(0o644)
            key.write_bytes(bytes(bad))  # the holder's own copy damaged: sent as stored, never used
            assert ask(b"G", d) == len(bad)
            assert asker.fetch_checked("block", d) is None and asker.fetched == 1
            # A length no object can take is refused before a buffer is made: the
            # connection is closed at once (no answer), and the server goes on serving.
            with socket.create_connection(("127.0.0.1", port), timeout=30) as c:
                prove(c, job_secret(side))
                c.sendall(b"P" + b"b" + d + ((1 << 62)).to_bytes(8, "big"))
                assert c.recv(1) == b""
            assert ask(b"H", d) == b"\x01"
        finally:
            peers.close()


def test_a_part_goes_to_its_holder_whole_and_a_damaged_copy_in_it_is_refused(tmp_path, side):
    """A rank's part sent to its holder (real servers, real sockets), its copies sent from
    their files: every object arrives whole and checked; a part
    the holder has whole sends nothing; a block damaged in the sender's own tier is not
    checked by the sender but refused by the holder, which keeps the rest of the part, and
    the send reports the part not whole (the remote store stays its copy)."""
    from tensorstore_ck.core.assets import Assets
    from tensorstore_ck.core.walk import walk_tree
    from tensorstore_ck.format.manifest import decode_commit

    def part(store, ref):
        root = bytes.fromhex(store.resolve(ref))
        tree = decode_commit(store.assets.get_commit(root))["tree"]
        return root, tree, [(o.kind, o.digest) for o in walk_tree(store.assets, tree, snapshot=root.hex())]

    with tsck.open_store(str(tmp_path / "a"), block_size=dw.BLOCK, inline_threshold=dw.INLINE) as a, \
            tsck.open_store(str(tmp_path / "b"), block_size=dw.BLOCK, inline_threshold=dw.INLINE) as b:
        gen = torch.Generator().manual_seed(0)
        state = {f"w{i}": torch.randn(5 * dw.BLOCK // 4, generator=gen) for i in range(12)}  # 60 blocks
        a.put_snapshot(state, "r")
        root, tree, objs = part(a, "r")
        holder, port = _peers(b.core, side, listen=True)
        sender, _ = _peers(a.core, side)
        sender.rank, sender.world, sender._addrs[1] = 0, 2, ("127.0.0.1", port)
        try:
            assert sender.replicate(root, tree).result(60) is True
            assert sender.sent == len(set(objs)) > 60
            for kind, d in objs:
                assert b.assets.storage.exists(Assets.object_key(kind + "s", d)), (kind, d.hex())
                assert Assets.object_frame_error(kind, d, b.assets.stored_frame(kind, d)) is None
            # (the holder has them all: nothing more is sent)
            assert sender.replicate(root, tree).result(60) is True and sender.sent == len(set(objs))

            state["w3"] = torch.randn(5 * dw.BLOCK // 4, generator=gen)
            a.put_snapshot(state, "r")
            root2, tree2, objs2 = part(a, "r")
            new = set(objs2) - set(objs)
            bad = next(d for kind, d in objs2 if kind == "block" and (kind, d) in new)  # (the first sent)
            path = tmp_path / "a" / Assets.object_key("blocks", bad)
            frame = bytearray(path.read_bytes())
            frame[-1] ^= 1
            path.chmod(0o644)
            path.write_bytes(bytes(frame))
            assert sender.replicate(root2, tree2).result(60) is False
            assert holder.refused == 1
            assert not b.assets.block_exists(bad)
            for kind, d in new - {("block", bad)}:
                assert b.assets.storage.exists(Assets.object_key(kind + "s", d)), (kind, d.hex())
        finally:
            sender.close()
            holder.close()


def test_a_copy_from_a_peer_is_used_when_the_tier_cannot_keep_it(tmp_path, side):
    """A rank restoring from a peer whose own tier is on a full disk: the checked copy
    goes to the caller all the same (keeping it in the tier is a cache, with a warning),
    never an error that fails the restore."""
    import _mounts
    from tensorstore_ck.tier.peerreads import peer_reads
    from tensorstore_ck.tier.replicas import Peers
    from tensorstore_ck.tier.reads import read_through
    from tensorstore_ck.core.walk import walk_commit

    x = torch.arange(4096, dtype=torch.float32)
    with tsck.open_store(str(tmp_path / "b"), block_size=dw.BLOCK, inline_threshold=dw.INLINE) as b, \
            _mounts.tmpfs(tmp_path / "small", "2m") as small:
        b.put_snapshot({"x": x}, "r")
        blocks = [o.digest for o in walk_commit(b.assets, bytes.fromhex(b.resolve("r"))) if o.kind == "block"]
        holder, port = _peers(b.core, side, listen=True)
        try:
            with tsck.open_store(small + "/a", block_size=dw.BLOCK, inline_threshold=dw.INLINE) as a:
                _mounts.fill(small)
                asker, _ = _peers(a.core, side)
                asker.rank, asker.world, asker._addrs[1] = 0, 2, ("127.0.0.1", port)
                reads = peer_reads(read_through(a.assets, b.core), asker)
                out = torch.empty(dw.BLOCK // 4, dtype=torch.float32)
                reads.read_block_into(blocks[0], out.numpy())
                assert torch.equal(out, x[:dw.BLOCK // 4]) and asker.fetched == 1
                asker.close()  # (the copy is kept in the background: done here)
                assert not a.assets.block_exists(blocks[0])  # (not kept: the disk is full)
        finally:
            holder.close()


def test_a_copy_fetched_from_a_peer_is_kept_in_the_tier_off_the_checkouts_path(tmp_path, side):
    """The blocks a checkout fetched from a peer go to the caller at once and are kept in
    the rank's tier by a background thread: once it is done (at the latest when the store
    closes) they are stored under their addresses, durable, and a later open finds them
    (so the next restore needs no peer)."""
    from tensorstore_ck.tier.peerreads import peer_reads
    from tensorstore_ck.tier.replicas import Peers
    from tensorstore_ck.tier.reads import read_through
    from tensorstore_ck.core.walk import walk_commit

    x = torch.arange(4 * dw.BLOCK // 4, dtype=torch.float32)
    with tsck.open_store(str(tmp_path / "b"), block_size=dw.BLOCK, inline_threshold=dw.INLINE) as b:
        b.put_snapshot({"x": x}, "r")
        blocks = [o.digest for o in walk_commit(b.assets, bytes.fromhex(b.resolve("r"))) if o.kind == "block"]
        assert len(blocks) == 4
        holder, port = _peers(b.core, side, listen=True)
        try:
            with tsck.open_store(str(tmp_path / "a"), block_size=dw.BLOCK, inline_threshold=dw.INLINE) as a:
                asker, _ = _peers(a.core, side)
                asker.rank, asker.world, asker._addrs[1] = 0, 2, ("127.0.0.1", port)
                reads = peer_reads(read_through(a.assets, b.core), asker)
                for i, d in enumerate(blocks):
                    out = torch.empty(dw.BLOCK // 4, dtype=torch.float32)
                    reads.read_block_into(d, out.numpy())
                    assert torch.equal(out, x[i * (dw.BLOCK // 4):(i + 1) * (dw.BLOCK // 4)])
                assert asker.fetched == 4
                asker.close()
        finally:
            holder.close()
    with tsck.open_store(str(tmp_path / "a")) as a:
        assert all(a.assets.block_exists(d) for d in blocks)
        assert not list((tmp_path / "a").glob("tmp/*"))  # (no copy left pending)


def test_a_fetch_over_a_connection_the_holder_closed_meanwhile_opens_a_new_one(tmp_path, monkeypatch, side):
    """A checkout's fetches reuse their connection to a holder; one left idle past the
    holder's timeout is closed at that end. The next fetch over it opens a new connection
    and gets the copy from the peer (not a failure that sends the read to the remote)."""
    import time

    import tensorstore_ck.tier.replicas as peers_mod
    from tensorstore_ck.tier.peerreads import peer_reads
    from tensorstore_ck.tier.replicas import Peers
    from tensorstore_ck.tier.reads import read_through
    from tensorstore_ck.core.walk import walk_commit

    monkeypatch.setattr(peers_mod, "PEER_TIMEOUT", 0.5)  # the holder closes a connection idle this long
    x = torch.arange(2 * dw.BLOCK // 4, dtype=torch.float32)
    with tsck.open_store(str(tmp_path / "b"), block_size=dw.BLOCK, inline_threshold=dw.INLINE) as b:
        b.put_snapshot({"x": x}, "r")
        blocks = [o.digest for o in walk_commit(b.assets, bytes.fromhex(b.resolve("r"))) if o.kind == "block"]
        holder, port = _peers(b.core, side, listen=True)
        try:
            with tsck.open_store(str(tmp_path / "a"), block_size=dw.BLOCK, inline_threshold=dw.INLINE) as a:
                asker, _ = _peers(a.core, side, listen=True)  # (a rank's Peers serves too: its idle connections are kept)
                asker.rank, asker.world, asker._addrs[1] = 0, 2, ("127.0.0.1", port)
                reads = peer_reads(read_through(a.assets, b.core), asker).tallied()
                try:
                    for i, d in enumerate(blocks):
                        if i:
                            assert asker._idle.get(1), "the first fetch's connection was not kept"
                            time.sleep(1.5)  # past the holder's timeout: it closed that connection
                        out = torch.empty(dw.BLOCK // 4, dtype=torch.float32)
                        reads.read_block_into(d, out.numpy())
                        assert torch.equal(out, x[i * (dw.BLOCK // 4):(i + 1) * (dw.BLOCK // 4)])
                    assert asker.fetched == 2  # both from the peer, none from the remote
                    assert reads.tally.counts == {"local": 0, "peer": 2, "remote": 0}
                finally:
                    asker.close()
        finally:
            holder.close()


def test_a_close_past_its_timeout_cuts_the_replicas_sent_to_a_peer_that_stopped_answering(tmp_path, monkeypatch):
    """A holder that stopped answering (a real socket whose server never reads: its process
    stopped, its host hung) holds a replica's send in a receive. A close with a deadline
    cuts it when the deadline passes and returns, instead of waiting PEER_TIMEOUT per
    request (here an hour: without the cut, this close would not return)."""
    import socket
    import threading
    import time

    import tensorstore_ck.tier.replicas as peers_mod
    from tensorstore_ck.format.manifest import decode_commit
    from tensorstore_ck.tier.replicas import Peers

    monkeypatch.setattr(peers_mod, "PEER_TIMEOUT", 3600.0)
    stalled = socket.socket()
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(8)  # the kernel completes the connection; nobody ever reads from it
    try:
        with tsck.open_store(str(tmp_path / "a"), block_size=dw.BLOCK, inline_threshold=dw.INLINE) as a:
            a.put_snapshot({"x": torch.arange(4 * dw.BLOCK // 4, dtype=torch.float32)}, "r")
            root = bytes.fromhex(a.resolve("r"))
            tree = decode_commit(a.assets.get_commit(root))["tree"]
            asker = Peers(a.core, 1)
            asker._secret = b"x"  # (the holder never says a word: it is never asked for the proof)
            asker.rank, asker.world, asker._addrs[1] = 0, 2, stalled.getsockname()
            asker.replicate(root, tree)
            stalled.settimeout(120)
            held, _ = stalled.accept()  # the send is under way before the close is asked for
            closer = threading.Thread(target=asker.close, args=(time.monotonic() + 0.5,), daemon=True)
            closer.start()
            closer.join(120)  # (an event with a bound: the close returns once its deadline passed)
            assert not closer.is_alive(), "close() waited on a holder that never answers"
            asker._pending[0].result(timeout=120)  # the send itself ended (cut), not an hour later
            assert asker.sent == 0
            held.close()
    finally:
        stalled.close()
