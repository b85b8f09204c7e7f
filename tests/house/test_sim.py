"""The seeded interleaving harness (tests/sim/), on a short budget per backend.

The long run is by hand (docs/TESTING.md): `python -m tests.sim --backend file --seconds 1800`.
Here: a few rounds on each backend with fixed seeds (SIM_SEED overrides), so CI runs
the same schedule of operations, faults and kills each time (the timing still varies).
On a violation the harness prints the seed, the invariant, the journal events and a
replay command, and this test fails with that output.

The default mix runs: gcs declare different leases and writers open with their own gc_lease (the lease of their own gcs: only a gc's
lease decides that it is dead, so nothing may break).
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

import tensorstore_ck as tsck
from tensorstore_ck.tier.memory import fs_type

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.sim import check, content  # noqa: E402

import _zygote as zygote

SEEDS = {"memtier": 4, "memtier-nodes": 1, "file": 20275, "pg": 20262, "s3": 20263, "tier": 20288, "step": 2,
         "tier-down": 20294, "rollback": 5}


# The harness bounds its own rounds (a stuck worker is killed and judged); this limit only
# catches a harness that never ends, so it is far above a loaded machine's run time.
def _run_harness(backend: str, extra_env: dict, args: list, timeout: float = 600, seeds: str | None = None,
                 seed_offset: int = 0) -> str:
    seed = int(os.environ.get("SIM_SEED", SEEDS[seeds or backend])) + seed_offset
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TSCK_", "TEST_S3_"))}
    env.update(extra_env)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "tests.sim", "--backend", backend, "--seed", str(seed), *args]
    t0 = time.time()
    p = zygote.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"harness failed ({time.time() - t0:.0f}s):\n{out[-12000:]}"
    assert f"HARNESS seed={seed} backend={backend}" in out and "rounds OK" in out, out[-4000:]
    return out


@pytest.mark.slow
def test_harness_file():
    def collective(out):  # collective puts by real 2-rank gloo groups (chunk index), judged
        # with the rest (published ones, and ones through the ranks' tiers: local-only)
        return sum(int(n) for pair in re.findall(r"collective_puts=(\d+) \(\d+ async, (\d+) through tiers[,)]", out)
                   for n in pair)
    # A violation fails at once. A run whose rounds ended (a loaded machine's 3 s) before a
    # collective put was judged proved nothing of those: the same seed runs again, up to three times.
    for _ in range(3):
        out = _run_harness("file", {}, ["--rounds", "3", "--round-seconds", "3"])
        if collective(out):
            break
    # the seed's schedule includes a lost ref table and recover, and a round of removals by
    # name beside gc and prune (the flavors' mix changes schedules: rescan seeds when it does)
    assert "recover=yes" in out and "flavor=remove" in out
    assert collective(out) >= 1, out[-3000:]


@pytest.mark.slow
def test_harness_recover_live():
    """recover beside gc, prune and writers, killed -9 and run again (flavor recover-live)."""
    out = _run_harness("file", {}, ["--rounds", "2", "--round-seconds", "2", "--focus", "recover-live"])
    assert out.count("live recover:") == 2, out[-3000:]


@pytest.mark.slow
def test_harness_step():
    """Collective puts that one rank skips (with and without steps) and asynchronous puts of
    states whose size changes (flavor step): the skipped put fails, the next one, made
    alike, is published; nothing raw. The mix's rollbacks (R1) and collective restores with
    one rank's part damaged (R2) come with it: collective puts are frequent here."""
    # A violation fails at once. Whether the rounds drew a skipped collective put, a rollback
    # and a damaged collective restore depends on how fast ranks start (a loaded machine's
    # few seconds may end first): a run that drew none proved nothing either way, so the
    # next seed is run, up to three.
    drawn = (r"skipped_by_a_rank=\S*next:", r"rollbacks=\S*okx", r"crestores=\S*planted:")
    for offset in range(3):
        out = _run_harness("file", {}, ["--rounds", "2", "--round-seconds", "10", "--focus", "step"], seeds="step",
                           seed_offset=offset)
        if all(re.search(d, out) for d in drawn):
            break
    assert all(re.search(d, out) for d in drawn), out[-3000:]
    assert sum(int(n) for n in re.findall(r"grown_async=(\d+)", out)) >= 1, out[-3000:]


@pytest.mark.slow
def test_harness_rollback():
    """Rollbacks, collective restores with one rank's part damaged, and collective puts made
    through an asynchronous CheckpointManager whose state_dict() raises on one rank
    (flavor rollback: R1-R3): the snapshot one rank could not stage ends in an abort naming
    its error on every other rank at once, and the next one commits alike. The seed draws
    stage failures in both rounds (with the manager's abort of an unstageable snapshot
    reverted, this seed fails R3 in its first round)."""
    drawn = r"stagefails=\S*SnapshotAborted/ok"
    for offset in range(3):  # (a loaded machine's rounds may end before one was judged: the next seed)
        out = _run_harness("file", {}, ["--rounds", "2", "--round-seconds", "10", "--focus", "rollback"],
                           seeds="rollback", seed_offset=offset)
        if re.search(drawn, out):
            break
    assert re.search(drawn, out), out[-3000:]


@pytest.mark.slow
def test_harness_tier():
    """Writers through local tiers beside the others (flavor tier): uploads killed at the
    uploader's stages and by the driver, tiers re-opened by later rounds' workers; writers
    with a job of their own (retention, prunes, tags and pins: T11-T14), two of them
    sharing one tier."""
    out = _run_harness("file", {}, ["--rounds", "2", "--round-seconds", "3", "--focus", "tier"], seeds="tier")
    tiers = re.findall(r" tier=(\S+)", out)
    assert len(tiers) == 2 and "off" not in tiers, out[-3000:]
    assert ":keep" in tiers[0] and ":shared" in tiers[0], out[-3000:]
    assert sum(int(n) for n in re.findall(r"upload_kills=(\d+)", out)) >= 1, out[-3000:]


@pytest.mark.slow
def test_harness_pg(pg_dsn):
    out = _run_harness("pg", {"TEST_PG_DSN": pg_dsn}, ["--rounds", "2", "--round-seconds", "3", "--pg-dsn", pg_dsn])
    # the workers' ref table is behind the network-fault proxy (tests/sim/netproxy.py), faulting in
    # the seed's schedule; each round reports its calls with unknown outcome
    assert "net=pg:" in out and "unknown_outcomes=" in out, out[-3000:]


@pytest.mark.slow
def test_harness_pg_tier_down(pg_dsn):
    """Tier writers whose remote goes away, its PostgreSQL table too (flavor tier-down):
    the seed's schedule has puts through a tier after that (T18) and closes with the table
    black-holed and refused (T16)."""
    out = _run_harness("pg", {"TEST_PG_DSN": pg_dsn}, ["--rounds", "2", "--round-seconds", "5", "--focus",
                                                       "tier-down", "--pg-dsn", pg_dsn], seeds="tier-down")
    assert ":down" in out, out[-3000:]


@pytest.mark.slow
def test_harness_s3(pg_dsn, s3_server):
    env = {"TEST_S3_ENDPOINT": s3_server["endpoint_url"], "TEST_S3_KEY": s3_server["key"],
           "TEST_S3_SECRET": s3_server["secret"]}
    out = _run_harness("s3", env, ["--rounds", "2", "--round-seconds", "3", "--pg-dsn", pg_dsn])
    assert re.search(r"net=pg:\S*,s3:", out), out[-3000:]  # proxies before the ref table and the S3 server


# -- the checker bites: planted damage and false claims are reported ----------------------
def _journal(tmp_path, records):
    (tmp_path / "journal").mkdir(exist_ok=True)
    with open(tmp_path / "journal" / "w.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def test_checker_reports_damage_and_false_claims(tmp_path):
    url = tmp_path / "store"
    s = tsck.open_store(url, block_size=content.BLOCK_SIZE, inline_threshold=content.INLINE_THRESHOLD)
    with s:
        specs = [content.make_spec("w", i, i % content.VARIANTS, i) for i in range(3)]
        infos = [s.put_snapshot(content.state(sp), ref="ja/main", step=sp["s"], meta={"sim": sp}) for sp in specs]
        s.tag("t", infos[0].root)
        t = time.time()
        assert check.check_readable(s) == [] and check.check_fsck(s, "x") == []
        good = [{"w": "w", "i": k, "op": "put", "args": {"ref": "ja/main", "spec": sp}, "start": t + k}
                for k, sp in enumerate(specs)]
        ends = [{"w": "w", "i": k, "end": t + k + 0.5, "result": "ok", "root": inf.root}
                for k, inf in enumerate(infos)]
        _journal(tmp_path, good + ends)
        assert check.check_history(s, check.load_ops(str(tmp_path)), []) == []

        # A put that "returned ok" for a snapshot that is not there; a tag that "returned ok"
        # on another root; a concurrent fsck that reported damage.
        lies = [{"w": "w", "i": 10, "op": "put", "args": {"ref": "jb/main", "spec": specs[0]}, "start": t + 9},
                {"w": "w", "i": 10, "end": t + 9.5, "result": "ok", "root": "ab" * 32},
                {"w": "w", "i": 11, "op": "tag", "args": {"name": "t", "target": "x"}, "start": t + 10},
                {"w": "w", "i": 11, "end": t + 10.5, "result": "ok", "root": infos[1].root},
                {"w": "w", "i": 12, "op": "fsck", "args": {}, "start": t + 11},
                {"w": "w", "i": 12, "end": t + 11.5, "result": "ok", "findings": ["missing: ..."]}]
        _journal(tmp_path, good + ends + lies)
        bad = check.check_history(s, check.load_ops(str(tmp_path)), [])
        assert any(b.startswith("I3 put returned ok but its snapshot is gone") for b in bad), bad
        assert any(b.startswith("I3 ref jb/main is gone") for b in bad), bad
        assert any(b.startswith("I3 tag t returned ok") for b in bad), bad
        assert any(b.startswith("I4 fsck beside") for b in bad), bad

        # Removals that "returned ok" but did not hold: a deleted ref still there, a
        # forgotten snapshot with its row back, an untagged tag still there (I7).
        removed = [{"w": "w", "i": 20, "op": "delete_ref", "args": {"ref": "ja/main"}, "start": t + 20},
                   {"w": "w", "i": 20, "end": t + 20.5, "result": "ok", "root": infos[-1].root},
                   {"w": "w", "i": 21, "op": "forget", "args": {"target": "ja/main@1"}, "start": t + 21},
                   {"w": "w", "i": 21, "end": t + 21.5, "result": "ok", "root": infos[1].root},
                   {"w": "w", "i": 22, "op": "untag", "args": {"name": "t"}, "start": t + 22},
                   {"w": "w", "i": 22, "end": t + 22.5, "result": "ok", "root": infos[0].root}]
        _journal(tmp_path, good + ends + removed)
        bad = check.check_removed(s, check.load_ops(str(tmp_path)), [])
        assert [b.split(" was ")[0] for b in bad] == ["I7 ref ja/main", "I7 snapshot " + infos[1].root[:16],
                                                      "I7 tag t"], bad
        barred = check.check_removed(s, check.load_ops(str(tmp_path)), [t + 30])  # the table lost since:
        assert len(barred) == 1 and barred[0].startswith("I7 tag t")  # only the untag must still hold

        # A block of the tagged snapshot removed behind the store's back: I1 and I2 see it.
        blocks = [p for p in (url / "blocks").rglob("*") if p.is_file()]
        var0 = content.state(specs[0])["own"]
        import blake3  # a block's key is the BLAKE3 of its bytes
        want = blake3.blake3(var0.numpy().tobytes()[:content.BLOCK_SIZE]).hexdigest()
        victim = [p for p in blocks if p.name.startswith(want)]
        assert victim, "the first block of snapshot 0's own tensor is stored under its hash"
        victim[0].unlink()
        assert any(b.startswith("I1 tag t") for b in check.check_readable(s))
        assert check.check_fsck(s, "x")


def test_checker_counts_a_failed_put_a_recover_may_have_adopted_toward_retention(tmp_path):
    """A put that raised may leave its commit in storage (the ref table was unreachable at
    its move, and its clean-up too); a recover after it adopts that commit, which then
    counts for the job's keep_last. An ok put of the job dropped that way is no I3
    violation; with no recover since, the failed put cannot have pushed it out."""
    with tsck.open_store(tmp_path / "store") as s:
        t = time.time()
        spec = content.make_spec("w", 0, 0, 1)
        gone = [{"w": "w", "i": 0, "op": "retention", "args": {"job": "jb", "keep_last": 1}, "start": t},
                {"w": "w", "i": 0, "end": t + 0.1, "result": "ok"},
                {"w": "w", "i": 1, "op": "put", "args": {"ref": "jb/main", "spec": spec}, "start": t + 1},
                {"w": "w", "i": 1, "end": t + 1.5, "result": "ok", "root": "cd" * 32},
                {"w": "w", "i": 2, "op": "put", "args": {"ref": "jb/main", "spec": dict(spec, o=2)}, "start": t + 2},
                {"w": "w", "i": 2, "end": t + 2.5, "result": "StorageError", "error": "no connection"}]
        recover = [{"w": "driver", "i": 0, "op": "recover", "args": {}, "start": t + 3},
                   {"w": "driver", "i": 0, "end": t + 3.5, "result": "ok"}]
        said = "I3 put returned ok but its snapshot is gone"
        _journal(tmp_path, gone)
        assert any(b.startswith(said) for b in check.check_history(s, check.load_ops(str(tmp_path)), []))
        _journal(tmp_path, gone + recover)
        assert not any(b.startswith(said) for b in check.check_history(s, check.load_ops(str(tmp_path)), [t + 3]))


def test_checker_reports_a_second_snapshot_of_one_put(tmp_path):
    """A put that lost a race for its ref wrote a commit the table refused; left in
    storage (its clean-up failed), a recover that adopted it as a snapshot of its own made
    one put two snapshots. The checker reports a catalog row holding an ok put's spec
    under another root than the put returned, whether a recover ran beside it or not, and
    two rows holding the spec of a put killed after its move."""
    url = tmp_path / "store"
    with tsck.open_store(url, block_size=content.BLOCK_SIZE, inline_threshold=content.INLINE_THRESHOLD) as s:
        spec = content.make_spec("w", 0, 0, 1)
        # The refused commit and the published one: the same state and spec, two roots.
        first, second = (s.put_snapshot(content.state(spec), ref="ja/main", step=1, meta={"sim": spec})
                         for _ in range(2))
        t = time.time()
        put = [{"w": "w", "i": 0, "op": "put", "args": {"ref": "ja/main", "spec": spec}, "start": t}]
        said = "I3 one put, two snapshots: " + first.root[:16]
        beside = [{"w": "rec", "i": 0, "op": "recover", "args": {}, "start": t + 0.2},
                  {"w": "rec", "i": 0, "end": t + 0.3, "result": "ok"}]
        after = [dict(beside[0], start=t + 1), dict(beside[1], end=t + 1.1)]
        for recover in ([], beside, after):
            _journal(tmp_path, put + [{"w": "w", "i": 0, "end": t + 0.5, "result": "ok", "root": second.root}]
                     + recover)
            bad = check.check_history(s, check.load_ops(str(tmp_path)), [])
            assert any(b.startswith(said) for b in bad), (recover, bad)
        # A put killed after its move (its clean-up never ran), a recover of its round beside
        # the workers or after them.
        killed = [dict(put[0], w="r0w0")]
        for recover in (after, [dict(r, w="r0live0") for r in after]):
            _journal(tmp_path, killed + recover)
            bad = check.check_history(s, check.load_ops(str(tmp_path)), [])
            assert any(b.startswith("I3 one put, two snapshots: ") for b in bad), (recover, bad)


def test_checker_reports_tier_violations(tmp_path):
    """check_tiers (T1-T18) bites: a durable-marked snapshot the remote lacks, a remote ref
    on a missing block, a damaged tier, a remote root for a tier put that the tier never
    published, a wait_durable that said True too early, and a remote ref moved back to a
    tier snapshot it had left, and a rank's part intent outliving a heard outcome; a
    tagged snapshot held in neither tier, a kept one missing remotely after close, a tier
    past its budget, an IntegrityError where nothing was damaged, a close with the remote
    down past its bound or silent on what stays queued, a put through a tier failed on
    its remote being down, a rank's tier past its budget are each reported."""
    from tensorstore_ck.core.walk import walk_commit
    url, tier = tmp_path / "store", tmp_path / "tier"
    tsck.open_store(url, block_size=content.BLOCK_SIZE, inline_threshold=content.INLINE_THRESHOLD).close()
    specs = [content.make_spec("w", i, i % content.VARIANTS, i) for i in range(3)]
    with tsck.open_store(url, local=tier) as s:
        infos = [s.put_snapshot(content.state(sp), ref="ja/main", step=sp["s"], meta={"sim": sp}) for sp in specs]
        assert s.wait_durable(timeout=60)
    t = time.time()
    recs = []
    for k, (sp, inf) in enumerate(zip(specs, infos)):
        recs += [{"w": "w", "i": k, "op": "put", "args": {"ref": "ja/main", "step": sp["s"], "spec": sp, "tier": "t0"},
                  "start": t + k},
                 {"w": "w", "i": k, "end": t + k + 0.5, "result": "ok", "root": inf.root, "durable": False}]
    recs += [{"w": "w", "i": 5, "op": "close", "args": {"tier": "t0"}, "start": t + 5},
             {"w": "w", "i": 5, "end": t + 5.5, "result": "ok"}]
    _journal(tmp_path, recs)
    tiers = {"t0": str(tier)}
    with tsck.open_store(url) as s:
        ops = check.load_ops(str(tmp_path))
        assert all(o.local_only and o.unknown and not o.ok for o in ops if o.op == "put")  # to I3/I9: unknown
        bad, stats = check.check_tiers(s, tiers, ops)
        assert bad == [] and stats == {"puts": 3, "durable": 3, "budget_over": 0}, bad

        # The remote catalog loses a snapshot the tier marked durable, behind the harness's back.
        s.forget(infos[0].root)
        # A remote snapshot of a tier put's spec under another root (a re-commit, not the tier's).
        s.put_snapshot(content.state(specs[1]), ref="jb/main", step=specs[1]["s"], meta={"sim": specs[1]})
        # A remote block of the ref tip removed.
        tip = bytes.fromhex(infos[-1].root)
        blk = next(o.digest for o in walk_commit(s.assets, tip) if o.kind == "block").hex()
        next(p for p in (url / "blocks").rglob("*") if p.name.startswith(blk)).unlink()
        # A wait_durable that said True with an earlier put unmarked; a close that hit damage.
        _journal(tmp_path, recs + [
            {"w": "w", "i": 6, "op": "durable", "args": {"tier": "t0", "timeout": 1}, "start": t + 6},
            {"w": "w", "i": 6, "end": t + 6.5, "result": "ok", "durable": True, "unmarked": [infos[0].root]},
            {"w": "w", "i": 7, "op": "close", "args": {"tier": "t0"}, "start": t + 7},
            {"w": "w", "i": 7, "end": t + 7.5, "result": "IntegrityError", "error": "damaged"},
            # A catalog writer's job (no snapshot of it), a tag it made on a root neither tier
            # holds, a kept snapshot missing remotely after its close, a put past the budget.
            {"w": "w", "i": 10, "op": "retention", "args": {"job": "jx", "keep_last": 1, "tier": "t0"}, "start": t + 1},
            {"w": "w", "i": 10, "end": t + 1.1, "result": "ok"},
            {"w": "w", "i": 11, "op": "tag", "args": {"name": "t-w-11", "target": "ab" * 32, "tier": "t0"},
             "start": t + 8},
            {"w": "w", "i": 11, "end": t + 8.1, "result": "ok", "root": "ab" * 32},
            {"w": "w", "i": 12, "op": "kept", "args": {"tier": "t0", "job": "ja", "before": [infos[0].root]},
             "start": t + 8},
            {"w": "w", "i": 12, "end": t + 8.1, "result": "ok", "kept": 1, "not_remote": [infos[0].root]},
            {"w": "w", "i": 13, "op": "put", "start": t + 9,
             "args": {"ref": "jx/main", "step": 9, "spec": content.make_spec("w", 13, 0, 9), "tier": "t0",
                      "budget": 1000, "sharing": 1}},
            {"w": "w", "i": 13, "end": t + 9.1, "result": "ok", "root": "cd" * 32, "tier_bytes": 10 ** 7},
            # A close with the remote down past its bound, and one that left 3 queued unsaid.
            {"w": "v", "i": 14, "op": "close", "args": {"tier": "t0", "down": True, "timeout": 1.0, "sharing": 1},
             "start": t + 10},
            {"w": "v", "i": 14, "end": t + 40, "result": "ok", "took": 30.0, "queued_before": 0,
             "stays_queued": False},
            {"w": "u", "i": 14, "op": "close", "args": {"tier": "t0", "down": True, "timeout": 3.0, "sharing": 1},
             "start": t + 10},
            {"w": "u", "i": 14, "end": t + 11, "result": "ok", "took": 1.0, "queued_before": 3,
             "stays_queued": False},
            # A put through the tier that failed on the remote being down (T18), and one
            # that failed so before its writer's remote went down (not judged by T18).
            {"w": "u", "i": 15, "op": "put", "start": t + 9.2,
             "args": {"ref": "ju/main", "step": 15, "spec": content.make_spec("u", 15, 0, 15), "tier": "t0"}},
            {"w": "u", "i": 15, "end": t + 9.3, "result": "StorageError", "error": "before"},
            {"w": "u", "i": 99, "op": "remote_down", "args": {"tier": "t0"}, "start": t + 9.5},
            {"w": "u", "i": 99, "end": t + 9.5, "result": "ok"},
            {"w": "u", "i": 16, "op": "put", "start": t + 9.6,
             "args": {"ref": "ju/main", "step": 16, "spec": content.make_spec("u", 16, 0, 16), "tier": "t0"}},
            {"w": "u", "i": 16, "end": t + 9.7, "result": "StorageError", "error": "no connection"},
            # A collective put whose rank 1's tier held past its budget plus a snapshot as it returned.
            {"w": "x", "i": 17, "op": "put", "start": t + 9.8,
             "args": {"ref": "jx/main", "step": 17, "spec": content.make_spec("x", 17, 0, 17), "tier": "c0",
                      "rank_tiers": ["c0", "c1"], "rank_budget": 1000}},
            {"w": "x", "i": 17, "end": t + 9.9, "result": "ok", "root": "ef" * 32,
             "rank_tier_bytes": [10, 10 ** 7]}])
        # A tier block damaged (flipped byte).
        lblk = next(p for p in (tier / "blocks").rglob("*") if p.is_file())
        data = bytearray(lblk.read_bytes())
        data[-1] ^= 0xFF
        lblk.write_bytes(bytes(data))
        bad, _ = check.check_tiers(s, tiers, check.load_ops(str(tmp_path)))
    for code, what in [("T1", "missing remotely"), ("T2", infos[0].root[:16]), ("T3", "tier t0 fsck"),
                       ("T4", "never published that root"), ("T5", "tier t0"), ("T6", infos[0].root[:16]),
                       ("T7", "IntegrityError"), ("T11", "abababababababab"), ("T12", infos[0].root[:16]),
                       ("T13", "past its budget"), ("T14", "raised IntegrityError"),
                       ("T16", "took 30.0s, past its bound"), ("T16", "left 3 snapshot(s) queued"),
                       ("T18", "u#16 put"), ("T13", "rank tier c1 held 10000000 B")]:
        assert any(b.startswith(code) and what in b for b in bad), (code, bad)
    assert not any(b.startswith("T18") and "u#15 put" in b for b in bad), bad
    assert not any(b.startswith("T13 rank tier c0") for b in bad), bad
    assert not any(b.startswith("T8") for b in bad), bad
    # The remote ref moved back to a tier snapshot it had left (as a resumed upload did).
    with tsck.open_store(url) as s:
        back = bytes.fromhex(infos[1].root)
        s.reftable.compare_and_swap("ja/main", tip, back, message=f"snapshot step {specs[1]['s']}")
        bad, _ = check.check_tiers(s, tiers, check.load_ops(str(tmp_path)))
    assert any(b.startswith("T8 remote ref ja/main moved back to " + infos[1].root[:16]) for b in bad), bad
    # A rank's tier keeps the intent to upload its part of a collective put that every rank
    # heard aborted: T9. The same intent after a put whose worker was killed, or whose rank 1
    # was told OutcomeUnknown (rank 0 went silent: it cannot know), is allowed.
    t1 = tmp_path / "tier1"
    with tsck.open_store(t1) as r1:
        r1.reftable.tier_rows.intent_put(bytes(32), {"ref": "ja/main", "step": 99, "job": "ja"})
    cput = {"w": "w", "i": 8, "op": "put", "start": t + 8,
            "args": {"ref": "ja/main", "step": 99, "spec": specs[0], "collective": 2, "tier": "t0",
                     "rank_tiers": ["t0", "t1"]}}
    aborted = {"w": "w", "i": 8, "end": t + 8.5, "result": "SnapshotAborted", "error": "x"}
    for end, t9 in (([], False), ([aborted], True), ([{**aborted, "ranks": ["SnapshotAborted"] * 2}], True),
                    ([{**aborted, "ranks": ["SnapshotAborted", "OutcomeUnknown"]}], False)):
        _journal(tmp_path, recs + [cput] + end)
        with tsck.open_store(url) as s:
            bad, _ = check.check_tiers(s, {**tiers, "t1": str(t1)}, check.load_ops(str(tmp_path)))
        assert any(b.startswith("T9 tier t1") for b in bad) is t9, bad


def test_checker_judges_rollbacks_and_collective_restores(tmp_path):
    """R1: a rollback that returned ok leaves its ref on the restored snapshot (or on what
    may have moved it since), never on the abandoned run's tip; I3 lets a ref go back only
    where a journaled rollback to that tip may have moved it. R2: every rank of a
    collective restore gets the same outcome, its rows its spec's. An fsck beside a block
    damaged on purpose for a collective restore names it without an I4."""
    from tests.sim import rollback
    with tsck.open_store(tmp_path / "store", block_size=content.BLOCK_SIZE,
                         inline_threshold=content.INLINE_THRESHOLD) as s:
        specs = [content.make_spec("w", i, i % content.VARIANTS, i) for i in range(2)]
        a, b = (s.put_snapshot(content.state(sp), ref="ja/main", step=sp["s"], meta={"sim": sp}) for sp in specs)
        t = time.time()
        puts = [r for k, (sp, inf) in enumerate(zip(specs, (a, b))) for r in (
            {"w": "w", "i": k, "op": "put", "args": {"ref": "ja/main", "step": sp["s"], "spec": sp}, "start": t + k},
            {"w": "w", "i": k, "end": t + k + 0.5, "result": "ok", "root": inf.root})]
        back = [{"w": "w", "i": 4_000_002, "op": "rollback", "start": t + 2,
                 "args": {"ref": "ja/main", "step": 0, "root": a.root, "from": b.root}},
                {"w": "w", "i": 4_000_002, "end": t + 2.5, "result": "ok", "root": a.root, "restored": 0}]

        def judged(records, barriers=()):
            _journal(tmp_path, records)
            ops = check.load_ops(str(tmp_path))
            return check.check_history(s, ops, list(barriers)) + rollback.check_rollbacks(s, ops, list(barriers))

        # The rollback returned ok but the ref stayed on the abandoned run's tip.
        bad = judged(puts + back)
        assert [x[:2] for x in bad] == ["R1"] and "the abandoned run's tip" in bad[0], bad
        assert judged(puts + back, [t + 3]) == []  # (a lost table since: recover rebuilt the refs)
        # A put of the new branch after it explains a tip past the restored snapshot.
        later = content.make_spec("w", 3, 0, 3)
        c = s.put_snapshot(content.state(later), ref="ja/main", step=3, meta={"sim": later})
        branch = [{"w": "w", "i": 3, "op": "put", "args": {"ref": "ja/main", "step": 3, "spec": later},
                   "start": t + 3}, {"w": "w", "i": 3, "end": t + 3.5, "result": "ok", "root": c.root}]
        assert judged(puts + back + branch) == []
        # Moved back to A: what the rollback said, and no I3 although B's put returned after A's.
        s.reftable.compare_and_swap("ja/main", bytes.fromhex(c.root), bytes.fromhex(a.root),
                                    message="rolled back to step 0 (CheckpointManager.restore)")
        assert judged(puts + back) == []
        # The same move with no rollback journaled is a ref gone back (I3 not loosened), and
        # so is one whose rollback ended before the put that overtook it began.
        bad = judged(puts)
        assert any(x.startswith("I3 ref ja/main is on " + a.root[:16]) for x in bad), bad
        early = [dict(back[0], start=t + 0.6), dict(back[1], end=t + 0.7)]
        bad = judged(puts + early)
        assert any(x.startswith("I3 ref ja/main is on " + a.root[:16]) for x in bad), bad
        # A rollback publishes its snapshot again (keep_last ranks it newest): with keep_last=1
        # a put whose snapshot is gone is explained by a rollback after it, not without one.
        keep = [{"w": "w", "i": 9, "op": "retention", "args": {"job": "jb", "keep_last": 1}, "start": t},
                {"w": "w", "i": 9, "end": t + 0.1, "result": "ok"},
                {"w": "w", "i": 10, "op": "put", "args": {"ref": "jb/main", "step": 7, "spec": later},
                 "start": t + 4}, {"w": "w", "i": 10, "end": t + 4.5, "result": "ok", "root": "ef" * 32}]
        gone = "I3 put returned ok but its snapshot is gone"
        assert any(x.startswith(gone) for x in judged(puts + back + keep)), "no rollback of jb since"
        jb = [dict(back[0], start=t + 5, args=dict(back[0]["args"], ref="jb/main")), dict(back[1], end=t + 5.5)]
        assert not any(x.startswith(gone) for x in judged(puts + back + keep + jb))

    def restore(*ranks, digest=None):
        args = {"ref": "ja/main", "root": "ab" * 32, "damaged_rank": 1 if digest else None}
        if digest:
            args.update(digest=digest, key=f"blocks/{digest[:2]}/{digest}")
        return [{"w": "w", "i": 5_000_000, "op": "crestore", "args": args, "start": t + 10},
                {"w": "w", "i": 5_000_000, "end": t + 11, "result": "ok", "ranks": list(ranks)}]
    ok4 = {"restored": 4, "note": "w:4", "rows_ok": True}
    err = {"result": "IntegrityError", "error": "rank 1: content does not match its address"}
    for ranks, said in (((ok4, ok4), []), ((err, dict(err, error="other words")), []),
                        ((ok4, err), ["R2 the ranks"]), ((ok4, dict(ok4, restored=2, note="w:2")), ["R2 the ranks"]),
                        ((ok4, dict(ok4, rows_ok=False)), ["R2 rank 1 restored"])):
        _journal(tmp_path, restore(*ranks))
        assert [x[:len(said[0])] if said else x for x in rollback.check_restores(check.load_ops(str(tmp_path)))] \
            == said, ranks
    # An fsck beside the damage names the block: no I4 while it was planted, an I4 after.
    d = "cd" * 32
    fsck = [{"w": "v", "i": 1, "op": "fsck", "args": {}, "start": t + 10.5},
            {"w": "v", "i": 1, "end": t + 10.8, "result": "ok", "findings": [f"corrupt: blocks/cd/{d}"]}]
    with tsck.open_store(tmp_path / "store") as s:
        _journal(tmp_path, restore(ok4, ok4, digest=d) + fsck)
        assert not [x for x in check.check_history(s, check.load_ops(str(tmp_path)), []) if x.startswith("I4")]
        fsck = [dict(fsck[0], start=t + 12), dict(fsck[1], end=t + 12.5)]
        _journal(tmp_path, restore(ok4, ok4, digest=d) + fsck)
        assert [x[:22] for x in check.check_history(s, check.load_ops(str(tmp_path)), [])] == \
            ["I4 fsck beside the oth"]


def test_checker_judges_stage_failures(tmp_path):
    """R3: a snapshot one rank could not stage ends on every other rank in an abort naming
    that rank's error, within the bound of the later rank's call; the next one commits one
    root on every rank and each manager closes clean. A rank still waiting at the bound (the
    skipped call of a manager that does not abort it), a root, another error, a next
    snapshot that split are findings; a worker killed meanwhile or an injected fault not."""
    from tests.sim import rollback
    t = time.time()
    said = rollback.STAGE_ERROR.format(rank=1, step=4)
    sf = {"rank": 1, "deadline": 45.0, "bound": 5.0, "ref": "ja/main", "step": 4, "put": 4}
    aborted = {"called": t, "ended": t + 0.1, "error": f"SnapshotAborted: snapshot aborted: rank 1: {said}"}
    own = {"called": t + 0.05, "ended": t + 0.06, "error": f"RuntimeError: {said}"}
    done = {"second": {"called": t + 1, "ended": t + 1.2, "root": "ab" * 32}, "closed": "ok", "failed": 1}

    def judged(first=(aborted, own), second=(done, done), ended=True):
        recs = [{"w": "w", "i": 8_000_004, "op": "stagefail", "args": sf, "start": t}]
        if ended:
            recs.append({"w": "w", "i": 8_000_004, "end": t + 0.2, "result": "ok",
                         "ranks": [{"first": c} for c in first]})
        recs += [{"w": "w", "i": 5, "op": "put", "start": t + 0.3,
                  "args": {"ref": "ja/main", "step": 5, "spec": {}, "after_stagefail": 4}},
                 {"w": "w", "i": 5, "end": t + 1.3, "result": "ok", "stagefail": list(second)}]
        _journal(tmp_path, recs)
        return [x[:2] for x in rollback.check_stagefails(check.load_ops(str(tmp_path)))]

    assert judged() == []
    assert judged(ended=False) == []  # (killed before every rank said)
    waited = {"called": t}  # not ended when its rank reported, at the bound
    assert judged(first=(waited, own)) == ["R3"]
    assert judged(first=(dict(aborted, ended=t + 45.1), own)) == ["R3"]  # ended at the deadline
    assert judged(first=(dict(aborted, error="OutOfStep: out of step"), own)) == ["R3"]
    assert judged(first=(dict(aborted, error="SnapshotAborted: snapshot aborted by another rank"), own)) == ["R3"]
    assert judged(first=(dict(aborted, error=None, root="cd" * 32), own)) == ["R3"]
    injected = {"called": t, "ended": t + 0.1, "error": "StorageError: sim: injected put failure on blocks/x"}
    assert judged(first=(injected, own)) == []
    split = dict(done, second=dict(done["second"], root="ef" * 32))
    assert judged(second=(done, split)) == ["R3"]
    lost = dict(done, second={"called": t + 1, "ended": t + 1.1, "error": "OutOfStep: out of step"},
                closed="SnapshotsFailed: the newest snapshot attempted (step 5) was not committed")
    assert judged(second=(lost, lost)) == ["R3", "R3", "R3"]  # (and neither manager closed clean)
    assert judged(second=(done, dict(done, closed="SnapshotsFailed: ..."))) == ["R3"]
    fault = dict(done, second={"called": t + 1, "ended": t + 1.1, "error": "StorageError: sim: injected get"})
    assert judged(second=(fault, dict(fault, closed="SnapshotsFailed: ..."))) == []


def test_checker_judges_preemptions(tmp_path):
    """P1: every rank of a preemption is told of it at one step with one outcome (the same
    step and root saved, or none); a step saved reads back as the ranks' states and is on
    its ref. A rank never told, ranks told different steps or roots, a saved step that reads
    back other bytes or was never on the ref are findings; a worker killed meanwhile, a
    final snapshot that failed on every rank, or a read that raised (a gc beside it) not."""
    from tests.sim import preempt
    t = time.time()
    args = {"who": [1], "when": "thread", "at": 1, "n": 4, "ref": "ja/main", "step": 10, "put": 10}
    saved = {"steps": [{"step": 10, "root": "aa" * 32}, {"step": 11, "none": True}, {"step": 12, "root": "bb" * 32}],
             "preempted": {"step": 12, "durable": True, "why": "", "at": 12}, "closed": "ok"}
    read = {"root": "bb" * 32, "on_ref": True, "read": "ok"}

    def judged(ranks=(saved, saved), ended=True, got=read, more=()):
        recs = [{"w": "w", "i": preempt.PRE_I + 10, "op": "preempt", "args": args, "start": t}, *more]
        if ended:
            recs.append({"w": "w", "i": preempt.PRE_I + 10, "end": t + 1, "result": "ok", "ranks": list(ranks),
                         **({"saved": got} if got is not None else {})})
        _journal(tmp_path, recs)
        return [x[:2] for x in preempt.check_preempts(check.load_ops(str(tmp_path)))]

    assert judged() == []
    assert judged(ended=False) == []  # (killed: unknown)
    assert judged(ranks=(saved, dict(saved, preempted=None))) == ["P1"]
    later = dict(saved, preempted=dict(saved["preempted"], at=13, step=13),
                 steps=saved["steps"] + [{"step": 13, "root": "cc" * 32}])
    assert judged(ranks=(saved, later)) == ["P1"]
    other = dict(saved, steps=saved["steps"][:2] + [{"step": 12, "root": "dd" * 32}])
    assert judged(ranks=(saved, other)) == ["P1"]
    failed = dict(saved, preempted=dict(saved["preempted"], step=None, durable=False, why="the final snapshot failed"),
                  steps=saved["steps"][:2] + [{"step": 12, "error": "SnapshotAborted: sim: injected"}])
    assert judged(ranks=(failed, failed), got=None) == []
    assert judged(ranks=(saved, failed)) == ["P1"]
    assert judged(got=dict(read, read="mismatch", diff=["own differs"])) == ["P1"]
    assert judged(got=dict(read, read="SnapshotNotFound: gone")) == []
    assert judged(got=dict(read, on_ref=False)) == ["P1"]
    dropped = [{"w": "v", "i": 3, "op": "delete_ref", "args": {"ref": "ja/main"}, "start": t + 0.5},
               {"w": "v", "i": 3, "end": t + 0.6, "result": "ok"}]
    assert judged(got=dict(read, on_ref=False), more=dropped) == []


def test_checker_judges_removals_answers_and_outages_through_tiers(tmp_path):
    """T20-T22 and I7 on calls through a tier: a delete_ref through a tier that returned ok
    while the remote keeps the ref (no later put or undelete explains it), and the tier's
    table keeps it; an untag through a tier whose tag the remote keeps; a refusal that
    changed the tier's table; resolve naming no ref where checkout restored one; an
    outage that stopped the uploads, said nothing, and after which wait_durable raised."""
    from tests.sim import tierops
    remote, tier = tmp_path / "store", tmp_path / "tier"
    tsck.open_store(remote, block_size=content.BLOCK_SIZE, inline_threshold=content.INLINE_THRESHOLD).close()
    sp = content.make_spec("w", 0, 0, 1)
    with tsck.open_store(remote, local=tier) as s:
        root = s.put_snapshot(content.state(sp), ref="jt0/main", step=1, meta={"sim": sp}).root
        s.tag("kept", root)
        assert s.wait_durable(timeout=60)
    t = time.time()
    put = [{"w": "w", "i": 0, "op": "put", "args": {"ref": "jt0/main", "step": 1, "spec": sp, "tier": "t0"},
            "start": t}, {"w": "w", "i": 0, "end": t + 0.5, "result": "ok", "root": root}]
    held = {"tier": True, "remote": True}
    calls = [
        {"w": "w", "i": 1, "op": "delete_ref", "args": {"ref": "jt0/main", "tier": "t0", "through": True},
         "start": t + 1}, {"w": "w", "i": 1, "end": t + 1.5, "result": "ok", "root": root},
        {"w": "w", "i": 2, "op": "untag", "args": {"name": "kept", "tier": "t0", "through": True}, "start": t + 2},
        {"w": "w", "i": 2, "end": t + 2.5, "result": "ok", "root": root},
        {"w": "v", "i": 3, "op": "delete_ref", "args": {"ref": "jt0/main", "tier": "t0", "through": True},
         "start": t + 3}, {"w": "v", "i": 3, "end": t + 3.5, "result": "RefConflict", "before": held,
                           "after": {"tier": False, "remote": True}},
        {"w": "w", "i": 4, "op": "answer", "args": {"ref": "jt0/main", "tier": "t0", "through": True},
         "start": t + 4}, {"w": "w", "i": 4, "end": t + 4.5, "result": "ok", "roots": ["none"] * 3,
                           "read": root, "moved": []},
        {"w": "w", "i": 5, "op": "outage", "args": {"tier": "t0", "pause": [0.05, 0.1]}, "start": t + 5},
        {"w": "w", "i": 5, "end": t + 6, "result": "ok", "attempts": 8, "lagging": False, "told": [],
         "stopped": "StorageError"},
        {"w": "w", "i": 6, "op": "durable", "args": {"tier": "t0", "timeout": 30, "after_outage": True},
         "start": t + 6.5}, {"w": "w", "i": 6, "end": t + 6.6, "result": "StorageError", "error": "stopped"}]
    _journal(tmp_path, put + calls)
    ops = check.load_ops(str(tmp_path))
    with tsck.open_store(remote) as s:
        bad = check.check_removed(s, ops, []) + tierops.check_tier_ops({"t0": str(tier)}, ops, [])
    for code, what in [("I7", "ref jt0/main was deleted"), ("I7", "tag kept was removed"),
                       ("T20", "ref jt0/main was deleted through tier t0"), ("T20", "tag kept was removed through"),
                       ("T20", "refused (RefConflict) but the local tier table lost ref"),
                       ("T21", "resolve none"), ("T22", "was not told"), ("T22", "did not resume")]:
        assert any(b.startswith(code) and what in b for b in bad), (code, what, bad)
    # The refused delete_ref that lost the tier's ref, with a rollback of the ref in the
    # remote overlapping it: the tier's ref went first, then the moved remote ref refused
    # it (tier/holds.py delete_ref_both says so): explained.
    moved = [{"w": "u", "i": 7, "op": "rollback", "args": {"ref": "jt0/main", "root": root}, "start": t + 3.1},
             {"w": "u", "i": 7, "end": t + 3.2, "result": "ok", "root": root}]
    _journal(tmp_path, put + calls[4:6] + moved)
    ops = check.load_ops(str(tmp_path))
    assert not [b for b in tierops.check_tier_ops({"t0": str(tier)}, ops, []) if "refused" in b]
    # The same calls where both tables are as they say (the ref and the tag gone from
    # both), and an answer that found no ref where checkout found none, are no violation.
    with tsck.open_store(remote, local=tier) as s:
        s.delete_ref("jt0/main")
        s.untag("kept")
    ok = calls[:4] + [calls[6], dict(calls[7], read="none")]
    _journal(tmp_path, put + ok)
    ops = check.load_ops(str(tmp_path))
    with tsck.open_store(remote) as s:
        assert check.check_removed(s, ops, []) + tierops.check_tier_ops({"t0": str(tier)}, ops, []) == []


@pytest.mark.slow
@pytest.mark.skipif(fs_type("/dev/shm") not in ("tmpfs", "ramfs"),
                    reason="this machine has no tmpfs at /dev/shm for a memory tier")
@pytest.mark.parametrize("nodes", ["same", "changing"])
def test_harness_memtier(nodes):
    """The memory tier's harness (tests/sim/memtier.py): rounds of a job of two ranks a
    node, killed (ranks, or a whole node and its memory) at seeded moments, some with a
    lying peer; M1-M4 after every round. "same": every round on nodes a and b; its seed
    finds M2 broken (round 2) when a tier-only snapshot is expired as soon as a newer one
    is published. "changing": 2 or 3 of the nodes a, b, c a round, numbered anew; its seed
    finds M2 broken (round 5) when rank 0's tier, another rank's in the round before,
    names the ref's older tip and the newer snapshot the other tiers hold is not read."""
    key = "memtier" if nodes == "same" else "memtier-nodes"
    seed = int(os.environ.get("SIM_SEED", SEEDS[key]))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TSCK_", "TEST_S3_"))}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-W", "ignore::UserWarning", "-m", "tests.sim.memtier", "--seed", str(seed),
           "--rounds", "8"] + (["--same-nodes"] if nodes == "same" else [])
    p = zygote.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "memtier: 8 rounds OK" in out, out[-8000:]
    ended = re.findall(r"ended (node [abc]|ranks|cleanly)", out)
    assert len(ended) == 8 and any(e.startswith("node") for e in ended), out[-3000:]
    if nodes == "changing":  # (the draws it is there for: fewer nodes, more, rank 0's node another)
        shapes = re.findall(r"nodes ([abc]+),", out)
        assert {len(x) for x in shapes} == {2, 3} and len({x[0] for x in shapes}) > 1, shapes
