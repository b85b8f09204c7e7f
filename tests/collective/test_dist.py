"""Collective snapshots under torch.distributed (gloo on CPU, forked ranks).

Every scenario runs in tests/helpers/dist_worker.py, a launcher that forks real
ranks (real process group, real LMDB ref table, real SIGKILL) and hosts the
c10d TCPStore itself, so that any rank may die. The ranks only record what
they observe (roots, timings, block keys they read or wrote, the tensors they
got back); everything is judged here, against data and block layouts computed
independently in this file, and against the store as the test process sees it
afterwards.
"""

from __future__ import annotations

import collections
import json
import math
import re
import signal
from pathlib import Path

import blake3
import pytest
import torch

import _util
from _util import load_helper, run_worker_scenario, same_bits

import tensorstore_ck as tsck

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parents[1]
REPO = HERE.parent
WORKER = HERE / "helpers" / "dist_worker.py"


dw = load_helper(WORKER)  # data definitions shared with the ranks (specs, contents, row splits)
REF = dw.REF
SAVE_WORLD = 4


# -- running a scenario ------------------------------------------------------------

def run_scenario(tmp_path: Path, scenario: str, *args, limit: float = 100.0) -> Path:
    return run_worker_scenario(WORKER, tmp_path, scenario, *args, limit=limit)


def rank_results(out: Path, phase: str, world: int, *, dead=()) -> list[dict | None]:
    return _util.rank_results(out, phase, world, dead=dead, exit_zero=True)


# -- independent oracle: bytes, block layout, block keys --------------------------------

def tbytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def block_size_of(shape: tuple, dtype: torch.dtype) -> int:
    """Documented layout: blocks are cut at whole rows (bytes of shape[1:]) when a row
    fits in a block, else at whole elements."""
    item = dtype.itemsize
    row = item * math.prod(shape[1:]) if len(shape) > 1 else item
    unit = row if row <= dw.BLOCK else item
    return (dw.BLOCK // unit) * unit


def block_keys(t: torch.Tensor) -> list[str]:
    """Keys of a stored chunk's blocks: block i holds bytes [i*bs, (i+1)*bs) of its
    C-contiguous bytes, addressed by blake3 of the raw bytes."""
    raw = tbytes(t)
    if len(raw) <= dw.INLINE:
        return []
    bs = block_size_of(tuple(t.shape), t.dtype)
    keys = []
    for i in range(0, len(raw), bs):
        h = blake3.blake3(raw[i:i + bs]).hexdigest()
        keys.append(f"blocks/{h[:2]}/{h}")
    return keys


def needed_blocks(rank: int, world: int) -> list[str]:
    """The blocks rank `rank` of a `world`-rank checkout must read: those of every saved
    chunk whose byte range intersects the rows it asks for, plus the blocks of the
    rank-local tensor of the rank whose view it gets."""
    keys = []
    for path, (rows, cols, dtype) in dw.SHARDED.items():
        g = dw.global_tensor(path)
        c, d = dw.row_split(rows, world, rank)
        row = dtype.itemsize * cols
        for s in range(SAVE_WORLD):
            a, b = dw.row_split(rows, SAVE_WORLD, s)
            lo, hi = max(a, c), min(b, d)
            if lo >= hi:
                continue
            chunk_keys = block_keys(g[a:b])
            bs = block_size_of((b - a, cols), dtype)
            i0, i1 = (lo - a) * row // bs, -(-(hi - a) * row // bs)
            keys += chunk_keys[i0:i1]
    keys += block_keys(dw.rank_local(rank if rank < SAVE_WORLD else 0)["rng"])
    return keys


def stored_keys(store_dir: Path, kind: str) -> set[str]:
    return {f"{kind}/{p.parent.name}/{p.name}" for p in (store_dir / kind).glob("*/*")}


def commit_roots(store_dir: Path) -> set[str]:
    return {p.name for p in (store_dir / "commits").glob("*/*")}


# -- tests -------------------------------------------------------------------------

def test_sharded_save_4_checkout_4_2_8_reads_only_needed_blocks(tmp_path):
    out = run_scenario(tmp_path, "sharded")
    saved = rank_results(out, "save", SAVE_WORLD)
    root = saved[0]["root"]
    assert all(r["root"] == root for r in saved), "ranks returned different roots"

    store_dir = out / "store"
    on_disk = stored_keys(store_dir, "blocks")
    all_chunk_keys = set()
    for path, (rows, _c, _d) in dw.SHARDED.items():
        for s in range(SAVE_WORLD):
            a, b = dw.row_split(rows, SAVE_WORLD, s)
            all_chunk_keys |= set(block_keys(dw.global_tensor(path)[a:b]))
    for s in range(SAVE_WORLD):
        all_chunk_keys |= set(block_keys(dw.rank_local(s)["rng"]))
    # The oracle's layout is the store's: every block it predicts was written, and nothing else.
    assert all_chunk_keys == on_disk

    for world in (4, 2, 8):
        res = rank_results(out, f"load{world}", world)
        for r, d in enumerate(res):
            got = torch.load(out / f"load{world}_rank{r}.pt", weights_only=False)
            assert d["same_object"], "checkout(into=...) must return the into tree"
            for path, (rows, _cols, _dt) in dw.SHARDED.items():
                name = "/".join(path)
                a, b = dw.row_split(rows, world, r)
                assert d["types"][name] == "Sharded"
                assert same_bits(dw.global_tensor(path)[a:b], got["sharded"][name]), \
                    f"world {world} rank {r}: {name} rows [{a},{b}) differ"
            sel = r if r < SAVE_WORLD else 0  # rank-local values: rank 0's for ranks the snapshot lacked
            want = dw.rank_local(sel)
            assert (got["local"]["rank"], got["local"]["name"]) == (want["rank"], want["name"])
            assert same_bits(want["rng"], got["local"]["rng"])
            assert got["step"] == 100

            need = needed_blocks(r, world)
            assert len(set(need)) == len(need)  # random data: every block distinct
            reads = collections.Counter(d["reads"])
            extra = set(reads) - set(need)
            missing = set(need) - set(reads)
            assert not extra and not missing, (f"world {world} rank {r}: read {len(extra)} blocks it does not "
                                               f"need, missed {len(missing)}")
            assert max(reads.values()) == 1, f"world {world} rank {r}: a block was read more than once"
            if world == 8:
                assert len(need) < len(on_disk) / 4  # the check is not vacuous: a small part of the store

    # Non-collective checkout (group=False) inside a live 2-rank process group (rank 1; a
    # collective one would have waited for rank 0 and aborted after its 5 s timeout).
    d1 = rank_results(out, "load2", 2)[1]
    got = torch.load(out / "load2_rank1.pt", weights_only=False)
    assert d1["full_elapsed"] < 5
    for path in dw.SHARDED:
        name = "/".join(path)
        assert d1["full_types"][name] == "Tensor"
        assert same_bits(dw.global_tensor(path), got["full"][name]), name
    assert got["full_local"]["rank"] == 0 and same_bits(dw.rank_local(0)["rng"], got["full_local"]["rng"])

    # And from this (single, non-distributed) process.
    with tsck.open_store(store_dir, create=False) as s:
        full = s.checkout(REF, group=False)
        for path in dw.SHARDED:
            assert same_bits(dw.global_tensor(path), dw.get_path(full, path)), path
        assert full["local"]["rank"] == 0 and full["step"] == 100
        info = s.show(REF)
        assert info.root == root and info.step == 100 and info.meta.get("world") == SAVE_WORLD
        assert s.fsck().ok


def test_replicated_blocks_written_once_spread_over_ranks(tmp_path):
    out = run_scenario(tmp_path, "replicated")
    res = rank_results(out, "rep", 4)
    root = res[0]["root"]
    assert all(d["root"] == root for d in res)

    reps = dw.replicated_tensors()
    expected = block_keys(reps["emb"]) + block_keys(reps["head"])
    assert len(expected) == 32 + 15 and len(set(expected)) == len(expected)

    created = collections.Counter()
    writer_of: dict[str, set] = collections.defaultdict(set)
    for d in res:
        for key, ok in d["puts"]:
            writer_of[key].add(d["rank"])
            if ok:
                created[key] += 1
        for key in d["exists"]:
            writer_of[key].add(d["rank"])  # a rank that even checks a block is about to write it
    assert set(created) == set(expected), "blocks written differ from the replicated tensors' blocks"
    assert all(n == 1 for n in created.values()), "a replicated block was created more than once"
    attempts = collections.Counter(k for d in res for k, _ok in d["puts"])
    assert all(n == 1 for n in attempts.values()), "a replicated block was written by several ranks"
    multi = {k: sorted(v) for k, v in writer_of.items() if len(v) != 1}
    assert not multi, f"blocks touched by several ranks: {list(multi.items())[:3]}"
    per_rank = collections.Counter(next(iter(writer_of[k])) for k in expected)
    assert len(per_rank) > 1, "all replicated blocks were written by one rank"
    assert max(per_rank.values()) <= math.ceil(len(expected) / 4) + 2, f"unbalanced: {dict(per_rank)}"
    assert stored_keys(out / "store", "blocks") == set(expected)
    assert all(d["blocks_new"] == len(expected) for d in res)

    for d in res:
        got = torch.load(out / f"rep_rank{d['rank']}.pt", weights_only=False)
        assert same_bits(reps["emb"], got["emb"]) and same_bits(reps["head"], got["head"])
        assert d["rank_view"] == d["rank"]
    with tsck.open_store(out / "store", create=False) as s:
        full = s.checkout(REF, group=False)
        assert same_bits(reps["emb"], full["emb"]) and same_bits(reps["head"], full["head"]) and full["rank"] == 0
        assert s.fsck().ok
        # replicated bytes are counted once per snapshot, not once per rank
        info = s.show(REF)
        nbytes = sum(t.numel() * t.element_size() for t in (reps["emb"], reps["head"]))
        assert info.blocks_total == len(expected) and info.bytes_total <= nbytes + 4096
        # what the ranks stored, summed once: the blocks on disk (the first snapshot of the store)
        on_disk = sum(p.stat().st_size for p in (out / "store" / "blocks").glob("*/*"))
        assert info.stored_new == on_disk


@pytest.mark.parametrize("victim", [2, 0])
def test_rank_killed_mid_snapshot_aborts_others_and_survivors_regroup(tmp_path, victim):
    out = run_scenario(tmp_path, "kill", victim)
    launcher = json.loads((out / "kill_launcher.json").read_text())
    assert launcher.get("killed") == victim, "the victim never reached its block writes"
    assert launcher["exitcodes"][victim] == -signal.SIGKILL
    res = rank_results(out, "kill", 4, dead=(victim,))
    survivors = [r for r in range(4) if r != victim]
    root1 = res[survivors[0]]["root1"]
    for r in survivors:
        d = res[r]
        T = d["timeout"]
        assert d["root1"] == root1
        assert d["t_start"] < launcher["kill_time"] < d["t_end"], "the kill was not mid-snapshot"
        assert d["second"] == "aborted", f"rank {r}: {d['second']}"
        assert 0.8 * T <= d["elapsed"] <= T + 3.0, f"rank {r} aborted after {d['elapsed']:.2f}s (timeout {T}s)"
        assert d["allreduce"] == sum(s + 1 for s in survivors)
    root3 = res[survivors[0]]["root3"]
    assert all(res[r]["root3"] == root3 for r in survivors)

    with tsck.open_store(out / "store", create=False) as s:
        assert s.resolve(REF) == root1, "the ref moved although the snapshot was aborted"
        assert [i.root for i in s.log(REF)] == [root1]
        assert commit_roots(out / "store") == {root1, root3}, "an aborted snapshot left a commit"
        after = s.show("j/after")
        assert after.root == root3 and after.meta.get("world") == 3
        full = s.checkout("j/after", group=False)
        assert full["rank"] == survivors[0] and torch.equal(full["x"], torch.full((5000,), float(survivors[0])))
        assert s.fsck().ok


def test_rank_stalled_mid_snapshot_aborts_all_then_group_goes_on(tmp_path):
    victim = 1
    out = run_scenario(tmp_path, "stall", victim)
    res = rank_results(out, "stall", 4)
    root1 = res[0]["root1"]
    for d in res:
        r, T, stall = d["rank"], d["timeout"], d["stall"]
        assert d["root1"] == root1
        assert d["second"] == "aborted", f"rank {r}: {d['second']}"
        if r == victim:  # wakes up after the others gave up, and learns the snapshot was aborted
            assert stall <= d["elapsed"] <= stall + 3.0, d["elapsed"]
        else:
            assert 0.8 * T <= d["elapsed"] <= T + 2.0, f"rank {r} aborted after {d['elapsed']:.2f}s (timeout {T}s)"
        assert d["allreduce"] == 10.0
    root3 = res[0]["root3"]
    assert all(d["root3"] == root3 for d in res)

    with tsck.open_store(out / "store", create=False) as s:
        log = s.log(REF)
        assert [i.root for i in log] == [root3, root1], "the aborted snapshot moved the ref"
        assert [i.step for i in log] == [3, 1] and log[0].parent == root1
        assert commit_roots(out / "store") == {root1, root3}, "the aborted snapshot left a commit"
        full = s.checkout(REF, group=False)
        for path in dw.SHARDED:
            assert same_bits(dw.global_tensor(path, 2), dw.get_path(full, path)), path
        assert s.fsck().ok


def test_step_mismatch_aborts_every_rank_and_the_next_call_realigns(tmp_path):
    """Rank 2 passes step 6 where the others pass 5: two calls, neither complete. Both end
    as OutOfStep naming the steps, within seconds (not the 30 s timeout); the next put
    that every rank makes alike (step 7) is published."""
    out = run_scenario(tmp_path, "mismatch", 2)
    res = rank_results(out, "mismatch", 4)
    root1 = res[0]["root1"]
    for d in res:
        assert d["root1"] == root1
        assert d["second"] == "aborted", f"rank {d['rank']}: {d['second']}"
        assert "out of step" in d["message"] and "step 6" in d["message"], d["message"]
        # (at once, or at rank 0's first look after a quarter of the 30 s timeout)
        assert d["elapsed"] < 20.0, "a mismatch must end before the 30 s timeout"
        assert d["third_elapsed"] < 20.0
        assert d["allreduce"] == 10.0
    root3 = {d["root3"] for d in res}
    assert len(root3) == 1
    with tsck.open_store(out / "store", create=False) as s:
        assert s.resolve(REF) == root3.pop()
        assert [i.step for i in s.log(REF)] == [7, 1]
        assert len(commit_roots(out / "store")) == 2


def test_a_checkout_where_the_others_put_costs_those_two_calls_alone(tmp_path):
    """Rank 1 makes a checkout where rank 0 makes the put of step 2: both end as OutOfStep
    (each names what the other is in when it asks: rank 1, its checkout over, may be in
    its next call, the put of step 3, by then), and the next put and checkout, made
    alike, succeed."""
    out = run_scenario(tmp_path, "swap", 1)
    r0, r1 = rank_results(out, "swap", 2)
    # rank 1 is in its checkout, or (that over) in its put of step 3: asked, or seen not arriving
    assert r0["second"].startswith("OutOfStep") and ("checkout" in r0["second"] or re.search(
        r"rank 1 (skipped this call: it )?is in put_snapshot of 'j/m' at step 3", r0["second"])), r0["second"]
    assert r1["second"].startswith("OutOfStep") and "put_snapshot" in r1["second"], r1["second"]
    assert r0["put3"] == r1["put3"]
    assert r0["checkout_v"] == r1["checkout_v"] == 3
    with tsck.open_store(out / "store", create=False) as s:
        assert [i.step for i in s.log(REF)] == [3, 1]


@pytest.mark.parametrize("mode", ["blocking", "async"])
def test_a_rank_that_skips_a_put_costs_that_put_alone(tmp_path, mode, monkeypatch):
    """Rank 1 skips the put of step 2: the others' step 2 ends as OutOfStep at once (no
    wait for the timeout), step 3 is published with every rank's own step-3 state (never
    rank 1's step 3 mixed into the others' step 2), and step 4 and a checkout are aligned."""
    monkeypatch.setenv("TSCK_SKIP_MODE", mode)
    out = run_scenario(tmp_path, "skip", 1)
    res = rank_results(out, "skip", 3)
    for d in res:
        assert d["no_step"].startswith("InvalidArgument: a collective put_snapshot needs step="), d["no_step"]
        o = d["outcomes"]
        if d["rank"] != 1:
            assert o["2"][0] == "OutOfStep", o["2"]
            assert o["2"][2] < 20.0, o["2"]  # (at once, or at the first look after a quarter of the 30 s timeout)
        assert o["3"][0] == o["4"][0] == "ok", o
        assert d["checkout_v"] == 4
    assert len({d["outcomes"]["3"][1] for d in res}) == 1
    with tsck.open_store(out / "store", create=False) as s:
        assert [i.step for i in s.log(REF)] == [4, 3, 1]
        three = s.checkout(f"{REF}@3")
        assert three["v"] == 3 and torch.equal(three["w"], dw.small_global(3))


# -- regressions: both were bugs found by these tests ---------------------------------------

def test_local_argument_error_on_one_rank_does_not_break_later_snapshots(tmp_path):
    out = run_scenario(tmp_path, "desync", 2)
    res = rank_results(out, "desync", 4)
    assert res[2]["second"] == "InvalidArgument"
    for d in res:
        assert d["second"] != "returned"
        assert d["third"] == "returned", f"rank {d['rank']}: {d['third']}"
    with tsck.open_store(out / "store", create=False) as s:
        assert s.show(REF).step == 3


def test_collective_checkout_of_missing_ref_raises_ref_not_found(tmp_path):
    out = run_scenario(tmp_path, "notfound")
    for d in rank_results(out, "notfound", 4):
        assert d["checkout"] == "RefNotFound", f"rank {d['rank']}: {d['checkout']}"


# -- collective outcomes, replicas, tiling ----------------------------------------------------

def test_script_that_exits_right_after_its_collective_gets_the_outcome_on_every_rank(tmp_path):
    """init via MASTER_ADDR/PORT puts the c10d store in rank 0. Each rank does its put (or
    checkout), destroy_process_group() and exits at once: rank 0 must not take the store
    down before every rank has read the outcome (else the others raise SnapshotAborted:
    Connection reset by peer, for a snapshot rank 0 published)."""
    rounds = 6  # without the outcome round each round fails with p ~ 0.4 (put) / 0.6 (checkout)
    out = run_scenario(tmp_path, "exit", rounds, limit=200.0)
    roots = []
    for i in range(rounds):
        res = rank_results(out, f"exitput{i}", 4)
        assert len({d["root"] for d in res}) == 1, f"round {i}: ranks returned different roots"
        roots.append(res[0]["root"])
        for d in rank_results(out, f"exitco{i}", 4):
            assert d["step"] == 100 and d["local_rank"] == d["rank"]
    with tsck.open_store(out / "store", create=False) as s:
        assert [i.root for i in s.log(REF)] == roots[::-1]


def test_diverged_replicas_abort_every_rank_naming_tensor_and_ranks(tmp_path):
    """Rank 2's replica of "emb" differs: every rank aborts. Unchecked, every put would
    return, each rank's manifest naming its own replica's blocks while each block is
    written by one rank only (a committed snapshot referencing blocks nobody wrote)."""
    out = run_scenario(tmp_path, "diverged", 2)
    res = rank_results(out, "diverged", 4)
    for d in res:
        assert d["first"] == "SnapshotAborted", f"rank {d['rank']}: {d['first']}"
        msg = d["first_message"]
        assert "['emb']" in msg and "rank 2 disagrees with ranks [0, 1, 3]" in msg and "['head']" not in msg, msg
        assert d["second"] == "returned", f"rank {d['rank']}: {d['second']}: {d.get('second_message')}"
    root2 = res[0]["second_root"]
    assert all(d["second_root"] == root2 for d in res)
    reps = dw.replicated_tensors()
    with tsck.open_store(out / "store", create=False) as s:
        assert [i.root for i in s.log(REF)] == [root2], "the diverged snapshot was published"
        assert commit_roots(out / "store") == {root2}
        full = s.checkout(REF, group=False)
        assert same_bits(reps["emb"], full["emb"]) and same_bits(reps["head"], full["head"])
        assert s.fsck().ok


def test_overlapping_shards_refused_on_every_rank(tmp_path):
    """Rows [0, 3072) from rank 0 and [0, 1024) from rank 1: the sizes add up, the pieces
    overlap and leave rows [3072, 4096) unwritten. Unchecked, the put would succeed and checkout return those rows as whatever
    torch.empty() left there."""
    out = run_scenario(tmp_path, "tiling")
    res = rank_results(out, "tiling", 2)
    for d in res:
        assert d["first"] == "InvalidArgument", f"rank {d['rank']}: {d['first']}"
        msg = d["first_message"]
        assert "['w']" in msg and "overlap" in msg and "rank 0" in msg and "rank 1" in msg, msg
        assert d["second"] == "returned", f"rank {d['rank']}: {d['second']}: {d.get('second_message')}"
    with tsck.open_store(out / "store", create=False) as s:
        assert [i.step for i in s.log(REF)] == [2]
        assert commit_roots(out / "store") == {res[0]["second_root"]}
        assert same_bits(dw.tile_global(), s.checkout(REF, group=False)["w"])


@pytest.mark.parametrize("world", [4, 16, 32])  # (32: a rank tree of two levels, FAN=16)
def test_multi_rank_checkout_reads_o_w_nodes_with_the_chunk_index(tmp_path, world):
    """With the rank tree and chunk index rank 0 writes at commit, a rank that checks out
    its own pieces reads the commit's top, its path in the rank tree and its own tree: a
    number of nodes that does not grow with W (O(W) in all, where merging every rank's tree
    is O(W^2))."""
    out = run_scenario(tmp_path, "index", world, limit=600.0)
    loads = rank_results(out, "indexed", world)
    assert all(r["mismatches"] == [] for r in loads), [r["mismatches"] for r in loads]
    nodes = [r["nodes"] for r in loads]
    # top + index + this rank's tree (a handful of nodes), whatever W is
    assert max(nodes) <= 8, nodes
    with tsck.open_store(out / "store") as s:
        full = s.checkout(REF)  # a fresh whole checkout still gathers every rank's chunks
        for path in dw.SHARDED:
            assert torch.equal(dw.get_path(full, path), dw.global_tensor(path)), path


def test_gc_keeps_the_rank_tree_and_the_chunk_index(tmp_path):
    """The top of a collective snapshot points at its rank tree and its chunk index (fan
    trees of nodes, format/world.py): gc keeps both (it walks them), and a lost index
    node is damage fsck names."""
    from tensorstore_ck.core.assets import node_key
    from tensorstore_ck.format.manifest import decode_commit, decode_node
    out = run_scenario(tmp_path, "index", 4, limit=300.0)
    with tsck.open_store(out / "store") as s:
        root = bytes.fromhex(s.resolve(REF))
        top = decode_node(s.assets.get_node(decode_commit(s.assets.get_commit(root))["tree"]))
        rt, ri = top["W"]["rt"], top["W"]["ri"]
        assert isinstance(ri, bytes) and len(ri) == 32 and isinstance(rt, bytes) and len(rt) == 32
        before = s.checkout(REF)
        s.gc(grace=0)
        assert s.storage.exists(node_key(ri)) and s.storage.exists(node_key(rt)), "gc must keep the index nodes"
        after = s.checkout(REF)
        for path in dw.SHARDED:
            assert torch.equal(dw.get_path(after, path), dw.get_path(before, path)), path
        s.storage.delete(node_key(ri))
        findings = [str(f) for f in s.fsck(full=True).findings]
        assert any(ri.hex()[:16] in f or "missing" in f for f in findings), findings


# -- the collective protocol's outcomes: call naming, rank 0's liveness, late ranks, members,
# -- checkout targets -------------------------------------------------------------------------

def _small_full(version: int) -> torch.Tensor:
    return dw.small_global(version)


def test_collective_puts_through_new_or_several_stores_publish_each_call_once(tmp_path):
    """A Store opened per call, and two Stores used in turn, with 2 ranks: each call is its own
    snapshot on every rank. Call names must not depend on the Store object: a counter kept
    in it would make a new Store (or the second one) reuse the previous call's keys: stale
    hellos, go, done and result, a commit claim taken as its own."""
    rounds = 3
    out = run_scenario(tmp_path, "newstore", rounds, limit=200.0)
    res = rank_results(out, "newstore", 2)
    for name in ("percall", "fast", "durable"):
        roots = []
        for v in range(1, rounds + 1):
            key = f"{name}{v}"
            for d in res:
                assert d[key] == "returned", f"{key}, rank {d['rank']}: {d[key]}: {d.get(key + '_message')}"
            assert len({d[key + "_root"] for d in res}) == 1, f"{key}: ranks returned different roots"
            roots.append(res[0][key + "_root"])
        with tsck.open_store(out / name, create=False) as s:
            assert [i.root for i in s.log(REF)] == roots[::-1], name
            for v, root in enumerate(roots, 1):
                got = s.checkout(root, group=False)
                assert got["v"] == v and s.show(root).step == v
                assert same_bits(_small_full(v), got["w"]), f"{name}: the snapshot of step {v} holds other rows"
            assert s.fsck().ok
    # After each round (3 calls): rank 0 deletes what every rank has acked. Keys left behind
    # would add several per call (hellos, go, done, result), 15+ per round, 30+ over the
    # three rounds; the keys of calls a rank is still closing when the count is taken (a
    # loaded machine's ranks lag) may be there or not, fewer than a round's worth.
    keys = res[0]["keys"]
    assert max(keys) - min(keys) < 15, f"the c10d Store grows with every call: {keys}"


def test_slow_rank_0_publishing_is_reported_published_on_every_rank(tmp_path):
    """timeout=4 and rank 0's commit object write takes 12 s: rank 0 is slow, not dead. Before
    the fix rank 1 gave rank 0 one more timeout after its commit claim and raised
    SnapshotAborted (at ~2x the timeout); then the ref moved. Rank 0's heartbeat now decides."""
    out = run_scenario(tmp_path, "slowcommit")
    res = rank_results(out, "slowcommit", 2)
    for d in res:
        assert d["first"] == "returned", d.get("first_message")
        assert d["second"] == "returned", f"rank {d['rank']}: {d['second']}: {d.get('second_message')}"
        assert d["second_elapsed"] >= 3 * d["timeout"] * 0.9  # it did wait for the slow write
    root = res[0]["second_root"]
    assert res[1]["second_root"] == root
    with tsck.open_store(out / "store", create=False) as s:
        assert s.resolve(REF) == root and s.show(REF).step == 2


def test_rank_0_dead_after_its_commit_claim_ends_in_an_abort_not_a_hang(tmp_path):
    """The other side of the heartbeat: rank 0 is killed as it writes the commit object (its
    commit claim taken, the ref not moved). Rank 1 waits while the beat moves, then gives up
    once it has stood still for the timeout, asks the ref table (which did not move) and
    raises SnapshotAborted."""
    out = run_scenario(tmp_path, "deadcommit")
    launcher = json.loads((out / "deadcommit_launcher.json").read_text())
    assert launcher["exitcodes"][0] == -signal.SIGKILL
    r1 = rank_results(out, "deadcommit", 2, dead=(0,))[1]
    assert r1["first"] == "returned"
    assert r1["second"] == "SnapshotAborted", f"{r1['second']}: {r1.get('second_message')}"
    assert "no sign of life" in r1["second_message"], r1["second_message"]
    with tsck.open_store(out / "store", create=False) as s:
        assert s.resolve(REF) == r1["first_root"] and [i.step for i in s.log(REF)] == [1]


def test_rank_stopped_across_two_later_puts_learns_the_true_outcome(tmp_path):
    """Rank 1 is SIGSTOPped after posting done for put 1; rank 0 publishes put 1, put 2
    aborts (rank 1 is missing), rank 0 starts put 3, then rank 1 resumes: put 1's outcome
    must still be there for it (deleted at put 3, rank 1 would raise SnapshotAborted for
    the published put 1)."""
    out = run_scenario(tmp_path, "stopped", limit=200.0)
    res = rank_results(out, "stopped", 2)
    r0, r1 = res
    assert "resume_error" not in r0, r0["resume_error"]
    assert r0["put1"] == "returned", r0.get("put1_message")
    assert r1["put1"] == "returned", f"rank 1 was told {r1['put1']}: {r1.get('put1_message')}"
    assert r1["put1_root"] == r0["put1_root"]
    for d in res:
        assert d["put2"] == "SnapshotAborted", f"rank {d['rank']}: {d['put2']}"
        assert d["put3"] == "returned", f"rank {d['rank']}: {d['put3']}: {d.get('put3_message')}"
    assert r1["put3_root"] == r0["put3_root"]
    with tsck.open_store(out / "store", create=False) as s:
        assert [i.root for i in s.log(REF)] == [r0["put3_root"], r0["put1_root"]]
        assert [i.step for i in s.log(REF)] == [3, 1]


def test_rank_outside_the_group_is_refused(tmp_path):
    """group= holds ranks 0 and 1 of 3; rank 2 passes it too: rank 2 is refused (taking part, it
    would be told "published" although its state is in no snapshot)."""
    out = run_scenario(tmp_path, "nonmember")
    res = rank_results(out, "nonmember", 3)
    for op in ("put", "checkout"):
        assert res[2][op] == "InvalidArgument", f"rank 2 {op}: {res[2][op]}: {res[2].get(op + '_message')}"
        assert "not a member" in res[2][op + "_message"], res[2][op + "_message"]
        for d in res[:2]:
            assert d[op] == "returned", f"rank {d['rank']} {op}: {d[op]}: {d.get(op + '_message')}"
    assert res[0]["put_root"] == res[1]["put_root"]
    with tsck.open_store(out / "store", create=False) as s:
        info = s.show(REF)
        assert info.root == res[0]["put_root"] and info.meta.get("world") == 2
        assert [i.root for i in s.log(REF)] == [info.root]


def test_collective_checkout_refuses_ranks_asking_for_different_snapshots(tmp_path):
    """Rank 0 asks for the head, rank 1 for step 1's root: unchecked, rank 1 would silently
    receive the head. Every rank raises InvalidArgument naming both targets; the head
    spelled as its ref and as its root is one snapshot and is read."""
    out = run_scenario(tmp_path, "cotarget")
    res = rank_results(out, "cotarget", 2)
    for d in res:
        assert d["differ"] == "InvalidArgument", f"rank {d['rank']}: {d['differ']}: {d.get('differ_message')}"
        msg = d["differ_message"]
        assert "disagree" in msg and REF in msg and d["roots"][0][:16] in msg, msg
        assert d["spelled"] == "returned", f"rank {d['rank']}: {d['spelled']}: {d.get('spelled_message')}"
        assert d["same"] == "returned", f"rank {d['rank']}: {d['same']}: {d.get('same_message')}"
        assert d["got_v"] == [2, 1], d["got_v"]


# -- a gc or prune deletion phase overlapping a collective put; a lost ref-move answer -------

@pytest.mark.parametrize("world", [2, 4])
def test_a_deletion_phase_overlapping_a_collective_put_is_revalidated_not_aborted(tmp_path, world):
    """A gc (grace 0, another process) runs its whole deletion phase while rank 0 writes the
    commit object of put 2, deleting every block and node the ranks just wrote; then a
    prune expires put 1, whose blocks and nodes put 3 reused, while rank 0 writes put 3's
    commit. Both moves are fenced; each rank re-uploads its own part from the state it
    still holds, rank 0 re-writes the top, and the ref moves: published on every rank (it
    raised SnapshotAborted on every rank), bit-exact, fsck clean."""
    out = run_scenario(tmp_path, "gcphase", world, limit=300.0)
    res = rank_results(out, "gcphase", world)
    for key in ("put1", "put2", "put3"):
        got = {d[key] + " " + d.get(key + "_message", "") for d in res}
        assert got == {"returned "}, f"{key}: {got}"
        roots = {d[key + "_root"] for d in res}
        assert len(roots) == 1, f"{key}: ranks returned different roots {roots}"
    phase2, phase3 = res[0]["put2_phase"], res[0]["put3_phase"]
    # The phases did happen and deleted what the puts had written or reused.
    assert phase2["deleted"].get("blocks", 0) >= world and phase2["deleted"].get("nodes", 0) >= world, phase2
    assert phase3["expired"] == 1 and phase3["deleted"].get("blocks", 0) >= world, phase3

    store_dir = out / "store"
    with tsck.open_store(str(store_dir)) as s:
        assert s.fsck().ok
        log = s.log(REF)
        assert [e.step for e in log] == [3, 2]  # put 1 expired by the prune
        assert [e.root for e in log] == [res[0]["put3_root"], res[0]["put2_root"]]
        for e, version in zip(log, (0, 1)):
            got = s.checkout(e.root)
            for path in dw.SHARDED:
                assert same_bits(dw.global_tensor(path, version), dw.get_path(got, path)), (e.step, path)
            assert same_bits(dw.rank_local(0, version)["rng"], got["local"]["rng"])
    on_disk = stored_keys(store_dir, "blocks")
    for version in (0, 1):
        for path, (rows, _c, _d) in dw.SHARDED.items():
            for r in range(world):
                a, b = dw.row_split(rows, world, r)
                assert set(block_keys(dw.global_tensor(path, version)[a:b])) <= on_disk


def test_a_lost_answer_to_rank_0s_ref_move_is_outcome_unknown_on_every_rank(tmp_path):
    """Rank 0's ref move ends in OutcomeUnknown (its COMMIT went out, the answer was lost,
    the table cannot be asked): the snapshot may be published, so every rank raises
    OutcomeUnknown with the same root and ref, never SnapshotAborted ("nothing was
    published"), which may be false."""
    out = run_scenario(tmp_path, "unknown")
    res = rank_results(out, "unknown", 2)
    assert [d["put1"] for d in res] == ["returned", "returned"]
    assert [d["put2"] for d in res] == ["OutcomeUnknown", "OutcomeUnknown"], [d.get("put2_message") for d in res]
    assert res[0]["put2_root"] and res[1]["put2_root"] == res[0]["put2_root"]
    assert res[0]["put2_ref"] == res[1]["put2_ref"] == REF
    assert "may or may not be published" in res[1]["put2_message"]


def test_a_rank_that_cannot_reupload_after_a_deletion_phase_aborts_every_rank(tmp_path):
    """The re-validation round fails on one rank (its storage refuses the blocks the gc
    deleted): rank 0 must not move the ref; rank 1 raises its own StorageError, the others
    SnapshotAborted naming rank 1; the ref stays at put 1, and the next put publishes."""
    out = run_scenario(tmp_path, "gcfail", limit=300.0)
    res = rank_results(out, "gcfail", 3)
    assert [d["put1"] for d in res] == ["returned"] * 3
    assert [d["put2"] for d in res] == ["SnapshotAborted", "StorageError", "SnapshotAborted"], \
        [d.get("put2_message") for d in res]
    assert "no space left on device" in res[1]["put2_message"]
    for r in (0, 2):
        assert "rank 1 could not re-validate its part" in res[r]["put2_message"]
        assert "nothing was published" in res[r]["put2_message"]
    assert res[0]["put2_phase"]["deleted"].get("blocks", 0) >= 3  # the phase did delete the put's blocks
    assert [d["put3"] for d in res] == ["returned"] * 3
    with tsck.open_store(str(out / "store")) as s:
        assert [e.step for e in s.log(REF)] == [3, 1]
        assert s.fsck().ok
        got = s.checkout(REF)
        for path in dw.SHARDED:
            assert same_bits(dw.global_tensor(path, 2), dw.get_path(got, path)), path


def test_a_held_commit_of_rank_0s_ref_move_is_outcome_unknown_on_every_rank(tmp_path, pg_dsn, monkeypatch):
    """The same against a real PostgreSQL behind a real TCP proxy: rank 0's COMMIT is held
    in the network past the connect timeout (OutcomeUnknown on rank 0), then lands: the
    snapshot rank 1 would have called "nothing was published" is the ref's head."""
    monkeypatch.setenv("TSCK_DIST_PG_DSN", pg_dsn)
    out = run_scenario(tmp_path, "pgunknown", limit=150.0)
    res = rank_results(out, "pgunknown", 2)
    assert [d["put1"] for d in res] == ["returned", "returned"]
    assert res[0]["held"] == 1 and res[0]["released"] == 1
    assert [d["put2"] for d in res] == ["OutcomeUnknown", "OutcomeUnknown"], [d.get("put2_message") for d in res]
    assert res[1]["put2_root"] == res[0]["put2_root"] and res[1]["put2_ref"] == REF
    with tsck.open_store(str(out / "store"), refs=pg_dsn) as s:
        assert s.resolve(REF) == res[0]["put2_root"]  # it was published after all
        assert s.checkout(REF)["v"] == 2
        assert s.fsck().ok


def test_ddp_ranks_holding_the_same_model_count_each_new_object_once(tmp_path):
    """DDP: two ranks put the same plain state. What is new is counted once per store,
    however many ranks wrote it: the first snapshot's bytes_new is one copy of the
    state, its blocks_new and stored_new are the blocks on disk (what du lists); the same
    state again adds nothing; a change to an inlined tensor alone adds the tensor bytes
    inlined in the one new node, and no block (SnapshotInfo.bytes_new)."""
    out = run_scenario(tmp_path, "ddpnew")
    res = rank_results(out, "ddpnew", 2)
    first, same, inl = res[0]["infos"]
    assert [i["root"] for i in res[1]["infos"]] == [first["root"], same["root"], inl["root"]]

    state = dw.ddp_state(0)
    one_copy = sum(t.numel() * t.element_size() for t in state.values())
    inlined = sum(t.numel() * t.element_size() for t in state.values() if t.numel() * t.element_size() <= dw.INLINE)
    assert 0 < inlined < one_copy
    blocks = {k: p.stat().st_size for k, p in ((p.name, p) for p in (out / "store" / "blocks").glob("*/*"))}
    assert first["bytes_total"] == 2 * one_copy  # each rank's part holds its copy
    assert first["bytes_new"] == one_copy
    assert first["blocks_new"] == len(blocks) == first["blocks_total"] // 2
    assert first["stored_new"] == sum(blocks.values())
    with tsck.open_store(out / "store", create=False) as s:
        du = s.du()
        log = {i.step: i for i in s.log(REF)}
    assert (du["blocks"], du["block_bytes"]) == (first["blocks_new"], first["stored_new"])
    assert log[1].bytes_new == first["bytes_new"]

    assert (same["bytes_new"], same["blocks_new"], same["stored_new"]) == (0, 0, 0)
    assert same["bytes_total"] == first["bytes_total"]
    assert (inl["blocks_new"], inl["stored_new"]) == (0, 0)
    assert inl["bytes_new"] == inlined  # the biases share the ranks' one new node
    assert log[3].bytes_new == inlined and log[2].bytes_new == 0


def test_bytes_new_counts_each_new_block_once_when_ranks_hold_the_same_bytes(tmp_path):
    """4 ranks whose states share bytes: a sharded piece equal on every rank, a plain tensor
    equal on every rank (DDP's weights), a Replicated tensor, and a sharded piece of each
    rank's own. Every rank writes the shared blocks at once; each counts what it named in the
    store, so the sums rank 0 makes count each block once: blocks_new and stored_new are
    the block files the snapshot added, bytes_new their raw bytes, with every value changed
    too; the same state again adds nothing."""
    out = run_scenario(tmp_path, "samebytes")
    res = rank_results(out, "samebytes", 4)
    infos, files = res[0]["infos"], res[0]["blocks"]
    assert all([i["root"] for i in r["infos"]] == [i["root"] for i in infos] for r in res)
    piece = dw.BLOCK  # each sharded piece; "emb" is 4 blocks, "w" 2
    before: dict = {}
    for info, now in zip(infos[:2], files[:2]):
        added = {k: v for k, v in now.items() if k not in before}
        assert info["blocks_new"] == len(added) == 1 + 4 + 4 + 2, (info, len(added))
        assert info["stored_new"] == sum(added.values())
        assert info["bytes_new"] == (1 + 4 + 4 + 2) * piece
        # each rank's part holds its pieces and its copy of "w"; "emb" once
        assert info["bytes_total"] == 4 * (2 + 2) * piece + 4 * piece
        before = now
    assert (infos[2]["blocks_new"], infos[2]["bytes_new"], infos[2]["stored_new"]) == (0, 0, 0)
    assert files[2] == files[1]


def test_a_restarted_jobs_first_collective_put_writes_only_what_changed_in_its_packs(tmp_path):
    """Two ranks put 16 small packed pieces each; a new job (new processes: nothing in
    memory) puts them again with one piece per rank edited. Each rank learns the parts of
    its own tree of the ref's snapshot, so its new pack holds only the edited piece: the
    other 15 name their stored parts instead of being written again."""
    out = run_scenario(tmp_path, "packrestart")
    first = rank_results(out, "pack0", 2)
    second = rank_results(out, "pack1", 2)
    assert first[0]["info"]["root"] == first[1]["info"]["root"]
    info = second[0]["info"]
    assert info["root"] == second[1]["info"]["root"]
    piece = 128 * 4
    assert first[0]["info"]["bytes_new"] >= 2 * 16 * piece
    assert info["bytes_new"] == 2 * piece, info  # one piece per rank, not two whole packs
    with tsck.open_store(str(out / "store")) as store:
        got = store.checkout(dw.REF)
    for r in range(2):
        want = dw.pack_state(r, 2, True)
        for k, v in want.items():
            assert torch.equal(got[k][r:r + 1], v.local), k


def test_a_local_store_tells_the_writer_whose_naming_another_won(tmp_path):
    """Two writers (two Store objects, as two ranks are) put the same object at once: both
    hear "written" (each names its writes at sync), the first sync names it, and the second
    writer's sync finds it named: take_lost tells that writer, once, and only that one."""
    from tensorstore_ck.storage.local import LocalBlockStore
    a, b = LocalBlockStore(str(tmp_path)), LocalBlockStore(str(tmp_path))
    key, other = "blocks/ab/" + "ab" * 32, "blocks/cd/" + "cd" * 32
    assert a.put_addressed(key, [b"same bytes"]) and b.put_addressed(key, [b"same bytes"])
    assert b.put_addressed(other, [b"b's own"])
    a.sync()
    b.sync()
    assert a.take_lost([key]) == set()
    assert b.take_lost([key, other]) == {key}
    assert b.take_lost([key]) == set()  # told once
    assert b.get(key) == b"same bytes" and not b.put_addressed(key, [b"same bytes"])
