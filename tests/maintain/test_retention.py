"""Retention rules + gc: what is kept, what goes, and that storage is really freed.

A pristine store is built once: job "jobA" (ref jobA/main) with 50 snapshots at
irregular steps (a restart half-way sends the steps back), metrics val_loss
(non-monotonic, with ties, some missing, one NaN) and acc; job "jobB" (ref
jobB/main) with 8 snapshots. Every snapshot holds a tensor of its own (blocks no
other snapshot has), tensors shared by all snapshots of both jobs, tensors shared
by groups of snapshots, a compressible tensor (lz4 blocks) and a shared manifest
subtree. Each case runs gc on a fresh copy and checks the outcome against a model
of the rules (tests/_lifecycle_util.model_kept) and against an independent walk
of the files left in storage.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.maintain.retention import SnapRow, select_kept

from _util import assert_same, object_listing, rand_tensor, run_cli
from _lifecycle_util import Row, StoreWalker, header_of, model_kept, sizes

R = tsck.Retention
BLOCK = 4096
INLINE = 256
REF_A, REF_B = "jobA/main", "jobB/main"
N_A, N_B = 50, 8

SHARED = rand_tensor(torch.float32, (8, 256), seed=1)          # 8 KiB, 2 blocks, in every snapshot
BUFFERS = {f"bn.{k}.running_mean": torch.full((8,), float(k)) for k in range(100)}  # a shared subtree node


def step_a(i: int) -> int:
    if i < 35:                                   # steps 0..344, last digit 0..4
        return 10 * i + (i * 7) % 5
    j = i - 35                                   # restart from 155: steps 155..299, last digit 5..9
    return 155 + 10 * j + (j * 3) % 5


VAL_SPECIAL = {5: 0.50, 20: 0.60, 11: 0.70, 40: 0.70}  # 11 and 40 tie for 3rd best


def metrics_a(i: int) -> dict:
    m = {}
    if i == 17:
        m["val_loss"] = float("nan")
    elif i % 9 != 3:                             # 3, 12, 21, 30, 39, 48 have no val_loss
        m["val_loss"] = VAL_SPECIAL.get(i, 1.0 + ((i * 37) % 50) / 25)
    if i % 11 != 2:                              # 2, 13, 24, 35, 46 have no acc
        m["acc"] = 0.99 if i in (7, 44) else ((i * 13) % 50) / 50  # 7 and 44 tie for best
    return m


def state_a(i: int) -> dict:
    return {
        "model": {
            "shared": SHARED,
            "phase": rand_tensor(torch.float32, (4, 256), seed=100 + i // 10),  # shared by 10 in a row
            "own": rand_tensor(torch.float32, (8, 256), seed=1000 + i),          # this snapshot's alone
        },
        "sched": torch.arange(2048, dtype=torch.int64) // 7 + i // 25,         # compressible, 4 blocks
        "buffers": BUFFERS,
        "step": step_a(i),
        "lr": 1e-3 * 0.99 ** i,
    }


def state_b(j: int) -> dict:
    return {"backbone": SHARED, "head": rand_tensor(torch.bfloat16, (8, 512), seed=5000 + j),
            "step": 100 * j}


@dataclass
class Snap:
    ref: str
    idx: int
    info: tsck.SnapshotInfo

    @property
    def root(self) -> str:
        return self.info.root

    @property
    def step(self) -> int:
        return self.info.step

    def state(self):
        return state_a(self.idx) if self.ref == REF_A else state_b(self.idx)


class Base:
    def __init__(self, path, snaps_a, snaps_b):
        self.path = path
        self.a = snaps_a
        self.b = snaps_b
        self.all = snaps_a + snaps_b
        self.by_root = {s.root: s for s in self.all}
        walker = StoreWalker(path)
        self.walks = {s.root: walker.walk(s.root) for s in self.all}
        holders: dict[str, set] = {}
        for r, w in self.walks.items():
            for k, _p in w.blocks:
                holders.setdefault(k, set()).add(r)
        self.unique_blocks = {r: {k for k, _p in w.blocks if holders[k] == {r}} for r, w in self.walks.items()}

    def rows(self, snaps):
        return [Row(s.root, s.info.step, s.info.time, s.info.metrics) for s in snaps]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Base:
    path = tmp_path_factory.mktemp("retention") / "store"
    snaps_a, snaps_b = [], []
    with tsck.open_store(path, block_size=BLOCK, inline_threshold=INLINE) as s:
        for i in range(N_A):
            info = s.put_snapshot(state_a(i), ref=REF_A, step=step_a(i), metrics=metrics_a(i))
            snaps_a.append(Snap(REF_A, i, info))
            if i % 6 == 0 and len(snaps_b) < N_B:
                j = len(snaps_b)
                info = s.put_snapshot(state_b(j), ref=REF_B, step=100 * j,
                                      metrics={"val_loss": 1.0 - j / 100})
                snaps_b.append(Snap(REF_B, j, info))
    b = Base(path, snaps_a, snaps_b)
    # sanity of the fixture itself
    assert len({s.root for s in b.all}) == N_A + N_B
    assert len({s.info.time for s in snaps_a}) == N_A
    assert len({s.step for s in snaps_a}) == N_A
    for s in b.all:
        assert len(b.unique_blocks[s.root]) >= 2, "every snapshot needs blocks of its own"
    codecs = {header_of(path, k)[0] for w in b.walks.values() for k, _ in w.blocks}
    assert codecs == {0, 1}, "want both raw and lz4 blocks in the store"
    return b


def fresh_copy(base: Base, tmp_path):
    dst = tmp_path / "store"
    shutil.copytree(base.path, dst)
    return dst


def open_copy(path):
    return tsck.open_store(path, create=False)


# ------------------------------------------------------------------ the check
def check_after_gc(store, path, base: Base, kept: set, report, before: dict, *, full_checkout=True):
    """`kept`: root hex of every snapshot that must survive (both jobs)."""
    all_roots = set(base.by_root)
    expired = all_roots - kept
    assert set(report.expired) == expired
    assert len(report.expired) == len(expired)
    assert report.kept_snapshots == len(kept)
    assert report.dry_run is False

    # log lists exactly the kept snapshots, newest first
    for ref, snaps in ((REF_A, base.a), (REF_B, base.b)):
        want = [s.root for s in reversed(snaps) if s.root in kept]
        assert [i.root for i in store.log(ref)] == want, ref
        assert store.resolve(ref) == snaps[-1].root  # the tip never moves

    # expired: gone by REF@STEP and by root hex (full and prefix)
    for r in expired:
        s = base.by_root[r]
        with pytest.raises(tsck.RefNotFound):
            store.checkout(f"{s.ref}@{s.step}")
        with pytest.raises(tsck.RefNotFound):
            store.checkout(r)
        with pytest.raises(tsck.RefNotFound):
            store.show(r[:12])

    # kept: bit-exact, by root and by REF@STEP
    for r in kept:
        s = base.by_root[r]
        assert store.resolve(f"{s.ref}@{s.step}") == r
        if full_checkout:
            assert_same(s.state(), store.checkout(r))
            assert_same(s.state(), store.checkout(f"{s.ref}@{s.step}"))

    # storage: exactly what the kept snapshots reach, found by walking the files
    listing = object_listing(path)
    reach = StoreWalker(path).reachable(sorted(kept))
    assert set(listing) - reach == set(), "leaked objects (unreachable, not deleted)"
    assert reach - set(listing) == set(), "over-deletion (reachable objects gone)"
    assert sum(listing.values()) == sizes(path, reach)
    assert store.du()["physical_bytes"] == sum(listing.values())

    # each expired snapshot's own blocks are gone; each kept one's are there
    for r in all_roots:
        for k in base.unique_blocks[r]:
            assert (k in listing) == (r in kept), (k, r in kept)

    # the report's accounting matches the files that went
    gone = set(before) - set(listing)
    assert set(listing) <= set(before)
    assert report.deleted_objects == len(gone)
    assert report.deleted_bytes == sum(before[k] for k in gone)
    by_kind = {}
    for k in gone:
        by_kind[k.split("/")[0]] = by_kind.get(k.split("/")[0], 0) + 1
    assert {k: v for k, v in report.deleted_by_kind.items() if v} == by_kind

    # the package agrees the result is clean and leak-free
    f = store.fsck(full=False)
    assert f.ok, [str(x) for x in f.findings]
    assert f.orphans == 0


def expected_kept(base: Base, rule_a, rule_b, now: float, extra=()) -> set:
    kept = model_kept(base.rows(base.a), rule_a, now) | model_kept(base.rows(base.b), rule_b, now)
    return kept | {base.a[-1].root, base.b[-1].root} | set(extra)


# ------------------------------------------------------------------ table: rules end to end
CASES = [
    ("last5", R(keep_last=5), None),
    ("last1", R(keep_last=1), None),
    ("last0_tip_only", R(keep_last=0), None),
    ("best3_min_tie_to_newer", R(keep_best=3, metric="val_loss"), None),
    ("best4_min", R(keep_best=4, metric="val_loss", mode="min"), None),
    ("best3_max_skips_nan", R(keep_best=3, metric="val_loss", mode="max"), None),
    ("best1_max_tie_to_newer", R(keep_best=1, metric="acc", mode="max"), None),
    ("best_unknown_metric", R(keep_best=5, metric="bleu"), None),
    ("every100", R(keep_every_steps=100), None),
    ("every37", R(keep_every_steps=37), None),
    ("last3+best2", R(keep_last=3, keep_best=2, metric="val_loss"), None),
    ("last2+every100+best2max", R(keep_last=2, keep_every_steps=100, keep_best=2, metric="acc", mode="max"), None),
    ("age0_keeps_nothing_by_age", R(max_age_days=0), None),
    ("age1_keeps_all", R(max_age_days=1), None),
    ("last3+age0", R(keep_last=3, max_age_days=0), None),
    ("every100+age1", R(keep_every_steps=100, max_age_days=1), None),
    ("two_jobs_own_policies", R(keep_last=3), R(keep_every_steps=250)),
    ("only_jobB", None, R(keep_best=2, metric="val_loss")),
    ("both_best", R(keep_best=2, metric="val_loss"), R(keep_last=2)),
]


@pytest.mark.parametrize("rule_a,rule_b", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_retention_rules_gc(base, tmp_path, rule_a, rule_b):
    path = fresh_copy(base, tmp_path)
    with open_copy(path) as store:
        if rule_a is not None:
            store.set_retention("jobA", rule_a)
        if rule_b is not None:
            store.set_retention("jobB", rule_b)
        assert store.retention() == {j: r for j, r in (("jobA", rule_a), ("jobB", rule_b)) if r is not None}
        before = object_listing(path)
        rep = store.gc()
        now = time.time()
        kept = expected_kept(base, rule_a, rule_b, now)
        # the table must actually exercise something
        assert len(kept) < N_A + N_B or (rule_a is not None and rule_a.max_age_days == 1)
        check_after_gc(store, path, base, kept, rep, before)
        # a second gc with the same rules finds nothing more to do
        after = object_listing(path)
        rep2 = store.gc()
        assert rep2.expired == [] and rep2.deleted_objects == 0
        assert object_listing(path) == after


def test_specific_expectations(base):
    """Hand-checked spot values, so the model in _lifecycle_util is itself checked."""
    rows_a = base.rows(base.a)
    idx = {s.root: s.idx for s in base.a}

    def kept_idx(rule):
        return sorted(idx[r] for r in model_kept(rows_a, rule, time.time()))

    assert kept_idx(R(keep_last=3)) == [47, 48, 49]
    assert kept_idx(R(keep_best=3, metric="val_loss")) == [5, 20, 40]       # 40 beats 11 (tie, newer)
    assert kept_idx(R(keep_best=4, metric="val_loss")) == [5, 11, 20, 40]
    assert 17 not in kept_idx(R(keep_best=3, metric="val_loss", mode="max"))  # NaN is never a candidate
    assert kept_idx(R(keep_best=1, metric="acc", mode="max")) == [44]        # 44 beats 7 (tie, newer)
    # windows of 100 steps: [0,100) -> i=0, [100,200) -> i=10, [200,300) -> i=20, [300,400) -> i=30
    assert kept_idx(R(keep_every_steps=100)) == [0, 10, 20, 30]
    # the restart (steps go back) makes "last" by time differ from "highest steps"
    assert max(step_a(i) for i in range(N_A)) > step_a(N_A - 1)
    assert [step_a(i) for i in (47, 48, 49)] == [276, 289, 297]


# ------------------------------------------------------------------ tags and pins
def test_tags_and_pins_keep_what_retention_drops(base, tmp_path):
    path = fresh_copy(base, tmp_path)
    s10, s20, s30 = base.a[10], base.a[20], base.a[30]
    with open_copy(path) as store:
        store.set_retention("jobA", R(keep_last=2))
        store.tag("golden", f"{REF_A}@{s10.step}")
        assert store.pin(s20.root) == s20.root
        assert store.pin(f"{REF_A}@{s30.step}") == s30.root
        before = object_listing(path)
        rep = store.gc()
        kept = expected_kept(base, R(keep_last=2), None, time.time(), extra={s10.root, s20.root, s30.root})
        assert {s10.root, s20.root, s30.root} <= kept
        check_after_gc(store, path, base, kept, rep, before, full_checkout=False)
        for s in (s10, s20, s30):
            assert_same(s.state(), store.checkout(s.root))
        assert_same(s10.state(), store.checkout("golden"))

        # unpin one: the next gc drops it; the tag and the other pin still hold
        store.unpin(s20.root)
        before = object_listing(path)
        rep = store.gc()
        assert rep.expired == [s20.root]
        kept2 = kept - {s20.root}
        check_after_gc(store, path, base, kept2, _Report(rep, set(base.by_root) - kept2), before,
                       full_checkout=False)
        with pytest.raises(tsck.RefNotFound):
            store.checkout(s20.root)
        assert_same(s10.state(), store.checkout("golden"))
        assert_same(s30.state(), store.checkout(f"{REF_A}@{s30.step}"))


class _Report:
    """A second gc only expires what is new; check_after_gc wants all expired so far."""

    def __init__(self, rep, all_expired):
        self.__dict__.update(vars(rep))
        self.expired = sorted(all_expired)


# ------------------------------------------------------------------ dry run
def test_dry_run_reports_and_changes_nothing(base, tmp_path):
    path = fresh_copy(base, tmp_path)
    rule_a, rule_b = R(keep_last=4, keep_best=2, metric="val_loss"), R(keep_last=1)
    with open_copy(path) as store:
        store.set_retention("jobA", rule_a)
        store.set_retention("jobB", rule_b)
        before = object_listing(path)
        mtimes = {k: os.stat(os.path.join(path, k)).st_mtime_ns for k in before}
        logs = {ref: json.dumps([i.to_json() for i in store.log(ref)]) for ref in (REF_A, REF_B)}
        refs = {n: i.root for n, i in store.refs().items()}

        rep = store.gc(dry_run=True)
        kept = expected_kept(base, rule_a, rule_b, time.time())
        expired = set(base.by_root) - kept
        reach = StoreWalker(path).reachable(sorted(kept))
        doomed = set(before) - reach
        assert rep.dry_run is True
        assert set(rep.expired) == expired and len(rep.expired) == len(expired)
        assert set(rep.would_delete) == doomed and len(rep.would_delete) == len(doomed)
        assert rep.deleted_objects == len(doomed)
        assert rep.deleted_bytes == sum(os.path.getsize(os.path.join(path, k)) for k in doomed)
        assert rep.deleted_bytes == sum(before[k] for k in doomed) > 0
        for s in expired:
            assert base.unique_blocks[s] <= set(rep.would_delete)

        # nothing changed
        assert object_listing(path) == before
        assert {k: os.stat(os.path.join(path, k)).st_mtime_ns for k in before} == mtimes
        assert {ref: json.dumps([i.to_json() for i in store.log(ref)]) for ref in (REF_A, REF_B)} == logs
        assert {n: i.root for n, i in store.refs().items()} == refs
        for r in sorted(expired)[:5]:
            assert_same(base.by_root[r].state(), store.checkout(r))

    # the CLI's dry run says the same and changes nothing either
    cli = run_cli("gc", path, "--dry-run", "--json")
    assert cli.returncode == 0, cli.stderr
    j = json.loads(cli.stdout)
    assert j["dry_run"] is True
    assert set(j["expired"]) == expired
    assert set(j["would_delete"]) == doomed
    assert j["deleted_bytes"] == rep.deleted_bytes
    assert object_listing(path) == before

    # and the real gc deletes exactly what the dry run listed
    with open_copy(path) as store:
        real = store.gc()
        assert set(real.expired) == expired
        assert set(before) - set(object_listing(path)) == doomed
        assert real.deleted_bytes == rep.deleted_bytes
        check_after_gc(store, path, base, kept, real, before, full_checkout=False)


# ------------------------------------------------------------------ persistence, CLI gc
def test_rules_persist_and_cli_gc_applies_them(base, tmp_path):
    path = fresh_copy(base, tmp_path)
    rule = R(keep_last=3, keep_every_steps=200)
    with open_copy(path) as store:
        store.set_retention("jobA", rule)
        store.set_retention("jobB", R(keep_last=1))
        store.set_retention("jobB", None)  # cleared again: jobB keeps everything
    with open_copy(path) as store:
        assert store.retention() == {"jobA": rule}
    before = object_listing(path)
    cli = run_cli("gc", path, "--json")
    assert cli.returncode == 0, cli.stderr
    j = json.loads(cli.stdout)
    kept = expected_kept(base, rule, None, time.time())
    assert set(j["expired"]) == set(base.by_root) - kept
    with open_copy(path) as store:
        rep = store.gc(dry_run=True)  # nothing left to do
        assert rep.expired == [] and rep.would_delete == []
        gone = set(before) - set(object_listing(path))
        assert j["deleted_objects"] == len(gone)
        assert j["deleted_bytes"] == sum(before[k] for k in gone)
        reach = StoreWalker(path).reachable(sorted(kept))
        assert set(object_listing(path)) == reach
        assert [i.root for i in store.log(REF_A)] == [s.root for s in reversed(base.a) if s.root in kept]
        assert len(store.log(REF_B)) == N_B


# ------------------------------------------------------------------ select_kept, pure
NAN = float("nan")
A = SnapRow(b"a", 0, 1000.0, {"loss": 3.0, "acc": 0.1})
B = SnapRow(b"b", 10, 2000.0, {"loss": 1.0, "acc": 0.5})
C = SnapRow(b"c", 15, 3000.0, {"loss": 2.0, "acc": 0.5})
D = SnapRow(b"d", 20, 4000.0, {"loss": 1.0, "acc": 0.2})     # ties with B on loss; newer
E = SnapRow(b"e", 35, 5000.0, {"acc": 0.9})                  # no loss
F = SnapRow(b"f", 40, 6000.0, {"loss": NAN, "acc": NAN})
G = SnapRow(b"g", None, 7000.0, {"loss": 5.0, "acc": 0.3})   # no step
H = SnapRow(b"h", 40, 8000.0, {"loss": 4.0, "acc": 0.4})     # same step as F, newer
I = SnapRow(b"i", 50, 8000.0, {"loss": 0.5, "acc": 0.5})     # same time as H, higher step: newer
ROWS = [A, B, C, D, E, F, G, H, I]
NOW = 8000.0 + 3600.0
HOUR = 1 / 24

SELECT_CASES = [
    (None, "abcdefghi"),
    (R(keep_last=1), "i"),
    (R(keep_last=2), "hi"),
    (R(keep_last=3), "ghi"),
    (R(keep_last=100), "abcdefghi"),
    (R(keep_last=0), ""),
    (R(keep_best=1, metric="loss"), "i"),
    (R(keep_best=2, metric="loss"), "di"),
    (R(keep_best=3, metric="loss"), "bdi"),
    (R(keep_best=2, metric="loss", mode="max"), "gh"),
    (R(keep_best=3, metric="acc", mode="max"), "cei"),
    (R(keep_best=10, metric="loss"), "abcdghi"),
    (R(keep_best=2, metric="bleu"), ""),
    (R(keep_every_steps=20), "adf"),
    (R(keep_every_steps=15), "acei"),
    (R(keep_every_steps=1000), "a"),
    (R(max_age_days=1.5 * HOUR), "ghi"),
    (R(max_age_days=0), ""),
    (R(max_age_days=1), "abcdefghi"),
    (R(keep_last=1, keep_best=1, metric="loss", keep_every_steps=20), "adfi"),
    (R(keep_last=2, keep_best=1, metric="acc", mode="max", max_age_days=2.5 * HOUR), "cdefghi"),
]


@pytest.mark.parametrize("rule,want", SELECT_CASES, ids=[f"{i}" for i in range(len(SELECT_CASES))])
def test_select_kept_table(rule, want):
    want = {c.encode() for c in want}
    got = select_kept(ROWS, rule, NOW)
    assert got == want
    assert model_kept([Row(r.root, r.step, r.time, r.metrics) for r in ROWS], rule, NOW) == want
    # row order must not matter
    assert select_kept(list(reversed(ROWS)), rule, NOW) == want


def test_select_kept_max_age_with_now():
    rows = [SnapRow(bytes([i]), i, NOW - i * 86400.0 - 10.0, {}) for i in range(10)]  # i days (+10 s) old
    for d in (0, 0.5, 1, 3, 9.5, 10, 100):
        got = select_kept(rows, R(max_age_days=d), NOW)
        assert got == {bytes([i]) for i in range(10) if i * 86400 + 10 < d * 86400}, d
    # the same rows seen from later: fewer are young enough
    assert select_kept(rows, R(max_age_days=3), NOW + 86400.0) == {bytes([0]), bytes([1])}


def test_select_kept_matches_model_random():
    rnd = random.Random(1234)
    for it in range(400):
        n = rnd.randint(0, 30)
        times = rnd.sample(range(1, 10_000), n)
        rows = []
        for k in range(n):
            step = rnd.choice([None, rnd.randint(-50, 300), rnd.randint(0, 30) * 10])
            m = {}
            for name in ("loss", "acc"):
                x = rnd.random()
                if x < 0.15:
                    continue
                m[name] = NAN if x < 0.22 else rnd.choice([0.5, 1.0, 1.5, 2, 3, rnd.random()])
            rows.append(SnapRow(k.to_bytes(2, "big"), step, float(times[k]), m))
        kw = {}
        if rnd.random() < 0.5:
            kw["keep_last"] = rnd.randint(0, 6)
        if rnd.random() < 0.5:
            kw.update(keep_best=rnd.randint(0, 6), metric=rnd.choice(["loss", "acc", "nope"]),
                      mode=rnd.choice(["min", "max"]))
        if rnd.random() < 0.5:
            kw["keep_every_steps"] = rnd.choice([1, 7, 10, 25, 100, 1000])
        if rnd.random() < 0.4:
            kw["max_age_days"] = rnd.choice([0, 0.01, 0.05, 0.1, 1]) + rnd.random() * 1e-3
        rule = R(**kw) if kw and any(k != "metric" and k != "mode" for k in kw) else None
        now = 10_000.5 + rnd.random() * 5000
        got = select_kept(rows, rule, now)
        want = model_kept([Row(r.root, r.step, r.time, r.metrics) for r in rows], rule, now)
        assert got == want, (it, rule, rows, now)
        assert got <= {r.root for r in rows}


def test_retention_validation():
    for bad in (dict(keep_last=-1), dict(keep_best=2), dict(keep_every_steps=0), dict(mode="median"),
                dict(max_age_days=-1), dict(keep_last=1.5)):
        with pytest.raises(tsck.InvalidArgument):
            R(**bad)
    assert math.isfinite(R(max_age_days=0.5).max_age_days)


@pytest.mark.parametrize("name", ["keep_last", "keep_best", "keep_every_steps"])
def test_a_count_past_what_the_ref_table_stores_is_refused_naming_its_bound(tmp_path, name):
    """A count of 2**64 or more raised msgpack's OverflowError from set_retention, after
    Retention() had accepted it. Now Retention refuses it (InvalidArgument naming the
    field and the bound) and nothing is written; 2**64-1 is stored and read back."""
    extra = {"metric": "loss"} if name == "keep_best" else {}
    with tsck.open_store(tmp_path / "s") as s:
        s.set_retention("j", R(keep_last=3))
        for big in (2**64, 2**100):
            with pytest.raises(tsck.InvalidArgument, match=rf"Retention\.{name} must be an int from [01] to "
                                                           rf"{2**64 - 1} \(2\*\*64-1"):
                s.set_retention("j", R(**{name: big}, **extra))
        assert s.retention() == {"j": R(keep_last=3)}
        s.set_retention("j", R(**{name: 2**64 - 1}, **extra))
    with tsck.open_store(tmp_path / "s", create=False) as s:
        assert s.retention() == {"j": R(**{name: 2**64 - 1}, **extra)}


def test_empty_retention_is_refused_not_keep_nothing():
    """Retention() with no rule would silently keep only the ref tips: refused instead."""
    with pytest.raises(tsck.InvalidArgument):
        tsck.Retention()
    with pytest.raises(tsck.InvalidArgument):
        tsck.Retention(metric="loss", mode="max")
    assert tsck.Retention(keep_last=0).keep_last == 0  # explicit: tips, tags and pins only
