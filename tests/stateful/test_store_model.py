"""Model-based test of the Store: a hypothesis RuleBasedStateMachine drives a
memory:// store and a plain in-memory model through random sequences of
put (plain and expected= conditional moves), checkout (by ref, tag, REF@STEP,
full root and root prefix), tag (immutable), pin / unpin, set_retention
(keep_last), gc, fsck and log; after every step refs() and tags() agree
with the model.

The model is deliberately simple: snapshots are numbered in the order they
were taken (steps increase with them, so the store's (time, step) order is
the same), a job's retention is keep_last=N or nothing, and gc keeps the N
newest catalogued snapshots of each job with a rule plus every ref tip, tag
and pin; a job without a rule keeps everything.
"""
from __future__ import annotations

import sys
import uuid
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import tensorstore_ck as tsck

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fuzz"))
from _common import drop_memory_store, same  # noqa: E402

REFS = ["a/main", "a/dev", "b/main", "c/x.y"]
TAGS = ["t1", "t2", "t3", "rel-1.0", "v2"]
JOBS = ["a", "b", "c"]

# Tensors shared by every snapshot (dedup, and gc must never delete them while used).
_SHARED = torch.arange(4096, dtype=torch.float32).reshape(64, 64)


def make_state(seed: int, variant: int):
    """A small training-like state, a pure function of (seed, variant)."""
    g = torch.Generator().manual_seed(seed)
    state = {
        "model": OrderedDict([("w", torch.randn((32, 16), generator=g)),   # 2 KiB: blocks
                              ("b", torch.randn((16,), generator=g))]),    # inline
        "shared": _SHARED,
        "step": seed,
        "np": np.arange(seed % 7 + 1, dtype=np.int64) * seed,
    }
    if variant == 1:
        state["big"] = torch.full((2048,), float(seed))                     # 8 KiB: two blocks
    elif variant == 2:
        state["opt"] = {"lr": 1e-3 * (seed + 1), "betas": (0.9, 0.999), "names": ["x", "y"]}
    elif variant == 3:
        state["model"]["w"] = torch.zeros((32, 16))                         # the same block in many snapshots
    return state


class StoreModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.url = f"memory://tsck-model-{uuid.uuid4().hex}"
        self.store = tsck.open_store(self.url, block_size=4096, inline_threshold=64)
        self.snaps: dict[str, dict] = {}      # root hex -> {"state", "ref", "job", "step", "seq"}
        self.live: set[str] = set()           # catalogued (not expired by gc)
        self.history: dict[str, list] = {}    # ref -> roots it pointed at, oldest first
        self.tags: dict[str, str] = {}
        self.pins: set[str] = set()
        self.keep_last: dict[str, int] = {}
        self.seq = 0

    def teardown(self):
        drop_memory_store(self.store)

    # -- helpers ------------------------------------------------------------
    def tip(self, ref):
        h = self.history.get(ref)
        return h[-1] if h else None

    def record(self, info, ref, key):
        self.seq += 1
        assert info.ref == ref and info.job == ref.split("/")[0] and info.step == self.seq
        self.snaps[info.root] = {"state": key, "ref": ref, "job": info.job, "step": info.step, "seq": self.seq}
        self.live.add(info.root)
        self.history.setdefault(ref, []).append(info.root)

    def by_seq(self, roots):
        """Roots in the order they were taken: root hashes change from run to run
        (commit times), so draws must never depend on their sort order."""
        return sorted(roots, key=lambda r: self.snaps[r]["seq"])

    def any_live(self, data):
        return data.draw(st.sampled_from(self.by_seq(self.live)))

    # -- rules --------------------------------------------------------------
    @initialize(keep=st.integers(0, 2))
    def first(self, keep):
        """Three snapshots on a/main and a keep_last rule for job a, so gc has work from the start."""
        for i in range(3):
            info = self.store.put_snapshot(make_state(i, i), ref="a/main", step=self.seq + 1,
                                           metrics={"loss": 1.0})
            self.record(info, "a/main", (i, i))
        self.set_retention("a", keep)

    @rule(ref=st.sampled_from(REFS), seed=st.integers(0, 40), variant=st.integers(0, 3),
          mode=st.sampled_from(["plain", "plain", "expected_tip", "expected_stale", "expected_none"]))
    def put(self, ref, seed, variant, mode):
        state = make_state(seed, variant)
        step = self.seq + 1
        tip = self.tip(ref)
        kw = {}
        conflict = False
        if mode == "expected_tip":
            kw["expected"] = tip
        elif mode == "expected_none":
            kw["expected"] = None
            conflict = tip is not None
        elif mode == "expected_stale":
            others = [r for r in self.by_seq(self.snaps) if r != tip]
            kw["expected"] = others[0] if others else "0" * 64
            conflict = True
        if conflict:
            with pytest.raises(tsck.RefConflict):
                self.store.put_snapshot(state, ref=ref, step=step, **kw)
            return
        info = self.store.put_snapshot(state, ref=ref, step=step, metrics={"loss": float(seed)}, **kw)
        if tip is not None:
            assert info.parent == tip
        self.record(info, ref, (seed, variant))

    @rule(ref=st.sampled_from(REFS), seeds=st.lists(st.integers(0, 40), min_size=1, max_size=3))
    def put_several(self, ref, seeds):
        for seed in seeds:
            self.put(ref, seed, seed % 4, "plain")

    @rule(data=st.data(), how=st.sampled_from(["ref", "tag", "step", "root", "prefix"]))
    def checkout(self, data, how):
        if how == "ref":
            ref = data.draw(st.sampled_from(sorted(self.history)))
            target, root = ref, self.tip(ref)
        elif how == "tag":
            if not self.tags:
                return
            target = data.draw(st.sampled_from(sorted(self.tags)))
            root = self.tags[target]
        else:
            root = self.any_live(data)
            s = self.snaps[root]
            target = {"step": f"{s['ref']}@{s['step']}", "root": root, "prefix": root[:12]}[how]
        got = self.store.checkout(target)
        same(make_state(*self.snaps[root]["state"]), got)

    @precondition(lambda self: any(r not in self.live for r in self.snaps))
    @rule(data=st.data())
    def checkout_expired(self, data):
        root = data.draw(st.sampled_from(self.by_seq(r for r in self.snaps if r not in self.live)))
        s = self.snaps[root]
        for target in (root, f"{s['ref']}@{s['step']}"):
            with pytest.raises(tsck.RefNotFound):
                self.store.checkout(target)

    @rule(name=st.sampled_from(TAGS), ref=st.sampled_from(REFS))
    def tag(self, name, ref):
        if self.tip(ref) is None:
            with pytest.raises(tsck.RefNotFound):
                self.store.tag(name, ref)
            return
        if name in self.tags:
            with pytest.raises(tsck.RefConflict):
                self.store.tag(name, ref)
            return
        info = self.store.tag(name, ref)
        assert info.root == self.tip(ref)
        self.tags[name] = info.root

    @rule(name=st.sampled_from(TAGS), ref=st.sampled_from(REFS), seed=st.integers(0, 40))
    def tag_move_on_then_gc(self, name, ref, seed):
        """Tag a ref's tip, move the ref on, then collect: the tag must keep the old snapshot."""
        self.tag(name, ref)
        self.put(ref, seed, seed % 4, "plain")
        self.gc(False)
        if name in self.tags:
            same(make_state(*self.snaps[self.tags[name]]["state"]), self.store.checkout(name))

    @rule(ref=st.sampled_from(REFS))
    def tag_with_a_ref_name(self, ref):
        if self.tip(ref) is None:
            return
        with pytest.raises(tsck.RefConflict):
            self.store.tag(ref, ref)

    @rule(data=st.data())
    def pin(self, data):
        tips = {h[-1] for h in self.history.values()}
        older = self.by_seq(self.live - tips)  # pinning an old snapshot is what changes gc's outcome
        root = data.draw(st.sampled_from(older)) if older else self.any_live(data)
        assert self.store.pin(root[:16]) == root
        self.pins.add(root)

    @rule(data=st.data())
    def pin_then_gc(self, data):
        """Pin an old snapshot, then collect: the pin must keep it (and its blocks)."""
        self.pin(data)
        self.gc(False)

    @precondition(lambda self: bool(self.pins))
    @rule(data=st.data())
    def unpin(self, data):
        root = data.draw(st.sampled_from(self.by_seq(self.pins)))
        assert self.store.unpin(root) == root
        self.pins.discard(root)

    @rule(job=st.sampled_from(JOBS), keep=st.one_of(st.none(), st.integers(0, 2)))
    def set_retention(self, job, keep):
        self.store.set_retention(job, None if keep is None else tsck.Retention(keep_last=keep))
        if keep is None:
            self.keep_last.pop(job, None)
        else:
            self.keep_last[job] = keep
        assert {j: r.keep_last for j, r in self.store.retention().items()} == self.keep_last

    @rule(dry_run=st.sampled_from([False, False, True]))
    def gc(self, dry_run):
        protected = {h[-1] for h in self.history.values()} | set(self.tags.values()) | self.pins
        expired = set()
        for job, n in self.keep_last.items():
            rows = sorted((r for r in self.live if self.snaps[r]["job"] == job),
                          key=lambda r: self.snaps[r]["seq"], reverse=True)
            expired |= set(rows[n:]) - protected
        rep = self.store.gc(dry_run=dry_run)
        assert set(rep.expired) == expired
        if not dry_run:
            self.live -= expired
            assert rep.rescued == 0

    @rule()
    def fsck(self):
        rep = self.store.fsck(full=True)
        assert rep.ok, rep.findings
        assert rep.snapshots_checked == len(self.live | {h[-1] for h in self.history.values()}
                                            | set(self.tags.values()) | self.pins)

    @rule(ref=st.sampled_from(REFS))
    def log(self, ref):
        if ref not in self.history:
            with pytest.raises(tsck.RefNotFound):
                self.store.log(ref)
            return
        want = [r for r in reversed(self.history[ref]) if r in self.live]
        got = self.store.log(ref)
        assert [i.root for i in got] == want
        assert [i.step for i in got] == [self.snaps[r]["step"] for r in want]

    # -- invariants ---------------------------------------------------------
    @invariant()
    def refs_agree(self):
        assert {n: i.root for n, i in self.store.refs().items()} == {r: h[-1] for r, h in self.history.items()}

    @invariant()
    def tags_agree(self):
        assert {n: i.root for n, i in self.store.tags().items()} == self.tags


StoreModel.TestCase.settings = settings(max_examples=50, stateful_step_count=30, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow,
                                                               HealthCheck.filter_too_much])
TestStoreModel = StoreModel.TestCase
