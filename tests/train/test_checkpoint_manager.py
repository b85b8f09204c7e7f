"""CheckpointManager: triggers (every_steps, every_seconds, on_metric), restore_latest, and
several jobs with their own policies in one store.

Time comes from an injected fake clock; snapshots are synchronous (async_=False) into a
real LMDB store in tmp_path, and what fired is read back from store.log() (steps and the
"triggers" each snapshot's meta records), not from the manager's own bookkeeping.
"""

from __future__ import annotations

import math

import pytest
import torch

import tensorstore_ck as tsck

NAN = math.nan


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def small_state(seed: int = 0) -> tsck.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return tsck.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def snapshots(store, ref) -> list[tuple[int, list]]:
    """(step, triggers) of every snapshot of `ref`, oldest first."""
    try:
        log = store.log(ref)
    except tsck.RefNotFound:
        return []
    return [(e.step, e.meta.get("triggers")) for e in reversed(log)]


# Each row: manager options, events [(step, clock time, metrics)], expected snapshots
# [(step, sorted triggers)]. The manager is created at clock time 0.
S, T, M = "steps", "seconds", "metric"
ROWS = {
    "every_steps": (
        dict(every_steps=3),
        [(s, s, None) for s in range(1, 11)],
        [(3, [S]), (6, [S]), (9, [S])],
    ),
    "every_steps_1": (
        dict(every_steps=1),
        [(s, 0, None) for s in range(1, 4)],
        [(1, [S]), (2, [S]), (3, [S])],
    ),
    "every_seconds": (
        dict(every_seconds=10),
        # 10 s after creation (>=, not >), then 10 s after each snapshot; a long gap fires once
        [(1, 0, None), (2, 5, None), (3, 10, None), (4, 15, None), (5, 19.9, None), (6, 20, None),
         (7, 55, None), (8, 56, None), (9, 64.9, None), (10, 65, None)],
        [(3, [T]), (6, [T]), (7, [T]), (10, [T])],
    ),
    "metric_min": (
        dict(on_metric=("loss", "min")),
        [(1, 0, {"loss": 5.0}),            # first value fires
         (2, 0, {"loss": 6.0}),            # worse
         (3, 0, {"loss": 4.0}),            # better
         (4, 0, {"loss": 4.0}),            # equal: not strictly better
         (5, 0, {"loss": NAN}),            # NaN never
         (6, 0, {"acc": 0.1}),             # metric missing
         (7, 0, None),                     # no metrics at all
         (8, 0, {"loss": 3.5, "acc": 9.0}),
         (9, 0, {"loss": -math.inf}),
         (10, 0, {"loss": -1e300})],
        [(1, [M]), (3, [M]), (8, [M]), (9, [M])],
    ),
    "metric_max": (
        dict(on_metric=("acc", "max")),
        [(1, 0, {"acc": 0.5}), (2, 0, {"acc": 0.4}), (3, 0, {"acc": 0.6}), (4, 0, {"acc": NAN}),
         (5, 0, {"acc": 0.6}), (6, 0, {"loss": 0.0}), (7, 0, {"acc": 0.7}), (8, 0, {"acc": 0.65})],
        [(1, [M]), (3, [M]), (7, [M])],
    ),
    "metric_nan_first": (
        # a NaN or missing first value does not count as "seen": the first real value fires
        dict(on_metric=("loss", "min")),
        [(1, 0, {"loss": NAN}), (2, 0, {}), (3, 0, {"loss": 2.0}), (4, 0, {"loss": 2.5}), (5, 0, {"loss": NAN}),
         (6, 0, {"loss": 1.0})],
        [(3, [M]), (6, [M])],
    ),
    "metric_int_values": (
        dict(on_metric=("errors", "min")),
        [(1, 0, {"errors": 10}), (2, 0, {"errors": 10}), (3, 0, {"errors": 9})],
        [(1, [M]), (3, [M])],
    ),
    "steps_and_seconds": (
        # a snapshot for any reason restarts the seconds clock
        dict(every_steps=4, every_seconds=10),
        [(1, 1, None), (2, 2, None), (3, 10, None), (4, 11, None), (5, 15, None), (6, 20, None),
         (7, 21, None), (8, 22, None), (9, 31.9, None), (10, 32, None), (11, 33, None), (12, 50, None)],
        [(3, [T]), (4, [S]), (7, [T]), (8, [S]), (10, [T]), (12, [S, T])],
    ),
    "steps_and_metric": (
        dict(every_steps=5, on_metric=("loss", "min")),
        [(1, 0, {"loss": 3.0}), (2, 0, {"loss": 3.1}), (3, 0, {"loss": 3.2}), (4, 0, {"loss": 3.3}),
         (5, 0, {"loss": 2.0}), (6, 0, {"loss": 2.5}), (7, 0, {"loss": 1.5}), (8, 0, {"loss": NAN}),
         (9, 0, None), (10, 0, {"loss": 9.0})],
        [(1, [M]), (5, [M, S]), (7, [M]), (10, [S])],
    ),
    "all_three": (
        dict(every_steps=10, every_seconds=100, on_metric=("acc", "max")),
        [(1, 1, {"acc": 0.1}), (2, 50, {"acc": 0.05}), (3, 101, {"acc": 0.05}), (4, 150, {"acc": 0.05}),
         (5, 202, {"acc": 0.2}), (6, 250, {}), (7, 301, {}), (8, 302, {}), (9, 303, {"acc": NAN}),
         (10, 304, {"acc": 0.3}), (11, 404, {"acc": 0.31})],
        # 1: first acc; 3: 101-1 >= 100; 5: better acc and 202-101 >= 100; 7: 301-202 < 100;
        # 8: 302-202 >= 100; 10: steps + better acc; 11: better acc and 404-304 >= 100
        [(1, [M]), (3, [T]), (5, [M, T]), (8, [T]), (10, [M, S]), (11, [M, T])],
    ),
    "same_step_twice": (
        # nothing fires twice for the step of the last snapshot...
        dict(every_steps=5, on_metric=("loss", "min")),
        [(5, 0, {"loss": 3.0}), (5, 0, {"loss": 2.0}),
         # ...but the better value seen there is still remembered as the best
         (6, 0, {"loss": 2.5}), (7, 0, {"loss": 1.9})],
        [(5, [M, S]), (7, [M])],
    ),
    "step_not_monotonic": (
        # the step-trigger is step % N == 0, whatever came before
        dict(every_steps=5),
        [(5, 0, None), (3, 0, None), (10, 0, None), (10, 0, None), (5, 0, None)],
        [(5, [S]), (10, [S]), (5, [S])],
    ),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_triggers(tmp_path, name):
    opts, events, expected = ROWS[name]
    clock = FakeClock(0.0)
    with tsck.open_store(tmp_path / "s") as store:
        mgr = tsck.CheckpointManager(store, job="j", state=small_state(), async_=False, clock=clock, **opts)
        returned = []
        for step, t, metrics in events:
            clock.t = t
            predicted = mgr.reasons(step, metrics)
            assert mgr.reasons(step, metrics) == predicted  # reasons() changes nothing
            res = mgr.step(step, metrics)
            if res is not None:
                assert isinstance(res, tsck.SnapshotInfo) and res.step == step
                assert sorted(res.meta["triggers"]) == sorted(predicted)
                returned.append((step, metrics or {}))
            else:
                assert predicted == []
        got = [(s, sorted(tr)) for s, tr in snapshots(store, "j/main")]
        assert got == [(s, sorted(tr)) for s, tr in expected]
        assert [s for s, _ in returned] == [s for s, _ in expected]
        # each snapshot records the metrics passed with it (NaN compared as NaN)
        for e, (step, passed) in zip(reversed(store.log("j/main")), returned):
            assert e.step == step and list(e.metrics) == list(passed)
            for k, v in passed.items():
                assert e.metrics[k] == v or (v != v and e.metrics[k] != e.metrics[k]), (e.step, k)


def test_force_and_no_state(tmp_path):
    clock = FakeClock()
    with tsck.open_store(tmp_path / "s") as store:
        mgr = tsck.CheckpointManager(store, job="j", state=small_state(), async_=False, clock=clock,
                                     every_steps=100)
        assert mgr.step(1) is None
        info = mgr.step(2, force=True)
        assert info.step == 2 and info.meta["triggers"] == ["forced"]
        assert snapshots(store, "j/main") == [(2, ["forced"])]
        bare = tsck.CheckpointManager(store, job="k", async_=False, every_steps=1)
        with pytest.raises(tsck.TsckError):
            bare.step(1)


@pytest.mark.parametrize("bad", [dict(every_steps=0), dict(every_steps=2.0), dict(every_seconds=0),
                                 dict(every_seconds=-1), dict(on_metric="loss"), dict(on_metric=("loss", "up"))])
def test_bad_options(tmp_path, bad):
    with tsck.open_store(tmp_path / "s") as store:
        with pytest.raises(ValueError):
            tsck.CheckpointManager(store, job="j", state=small_state(), async_=False, **bad)


def test_restore_latest_empty_store(tmp_path):
    with tsck.open_store(tmp_path / "s") as store:
        # another job's snapshots do not count
        tsck.CheckpointManager(store, job="other", state=small_state(), async_=False, every_steps=1).step(1)
        mgr = tsck.CheckpointManager(store, job="j", state=small_state(), async_=False, every_steps=1)
        assert mgr.restore_latest() is None
        assert mgr.step(1) is not None  # and it still works afterwards


def test_the_safe_resume_form_refuses_a_typo_instead_of_starting_over(tmp_path):
    """open_store(create=False) + restore_latest(must_exist=True): a mistyped path is an
    error, never a fresh start."""
    path = tmp_path / "ckpts"
    with tsck.open_store(path) as store:
        mgr = tsck.CheckpointManager(store, job="llm", state=small_state(3), async_=False, every_steps=1)
        mgr.step(7)
    # A mistyped path: no store is made there.
    with pytest.raises(tsck.NotAStore, match=r"no store at .*ckpst.*check the path.*create=True"):
        tsck.open_store(tmp_path / "ckpst", create=False)
    assert not (tmp_path / "ckpst").exists()
    with tsck.open_store(path, create=False) as store:
        # A mistyped job: the error names the store, the ref and what the store holds.
        mgr = tsck.CheckpointManager(store, job="lmm", state=small_state(), async_=False, every_steps=1)
        with pytest.raises(tsck.RefNotFound, match=r"'lmm/main'.*ckpts.*holds 1 ref\(s\): llm/main"):
            mgr.restore_latest(must_exist=True)
        assert mgr.restore_latest() is None  # the lenient form, for a first run
        st = small_state()
        mgr = tsck.CheckpointManager(store, job="llm", state=st, async_=False, every_steps=1)
        assert mgr.restore_latest(must_exist=True) == 7
    with tsck.open_store(tmp_path / "fresh") as store:  # an empty store says it holds nothing
        mgr = tsck.CheckpointManager(store, job="llm", state=small_state(), async_=False)
        with pytest.raises(tsck.RefNotFound, match="holds no snapshot at all"):
            mgr.restore_latest(must_exist=True)


def test_restore_latest_loads_newest_and_best_metric(tmp_path):
    clock = FakeClock(0.0)
    with tsck.open_store(tmp_path / "s") as store:
        st = small_state(0)
        mgr = tsck.CheckpointManager(store, job="j", state=st, async_=False, clock=clock,
                                     on_metric=("loss", "min"), every_steps=10)
        for step, loss in [(1, 3.0), (2, 2.0), (3, 2.5), (4, 2.2)]:
            with torch.no_grad():
                st.components["model"].weight.add_(1.0)
            mgr.step(step, {"loss": loss})
        st.components["model"].weight.data.fill_(0.0)
        assert [s for s, _ in snapshots(store, "j/main")] == [1, 2]
        want_w = store.checkout("j/main")["model"]["weight"].clone()
        assert not torch.equal(want_w, st.components["model"].weight.detach())

        # a new process: fresh state, fresh manager, same store
        clock2 = FakeClock(1000.0)
        st2 = small_state(1)
        mgr2 = tsck.CheckpointManager(store, job="j", state=st2, async_=False, clock=clock2,
                                      on_metric=("loss", "min"), every_steps=10, every_seconds=50)
        clock2.t = 1040.0
        assert mgr2.restore_latest() == 2
        assert st2.step == 2
        assert torch.equal(st2.components["model"].weight.detach(), want_w)
        # best restored from the history (2.0): a worse value does not fire
        clock2.t = 1041.0
        assert mgr2.step(3, {"loss": 2.1}) is None
        # restore reset the seconds clock (to 1040, not the manager's creation at 1000): 49 s
        clock2.t = 1089.0
        assert mgr2.step(4, {"loss": 2.05}) is None
        clock2.t = 1090.0
        info = mgr2.step(5, {"loss": 2.1})
        assert info is not None and info.meta["triggers"] == ["seconds"]
        info = mgr2.step(6, {"loss": 1.9})
        assert info is not None and info.meta["triggers"] == ["metric"]
        assert [s for s, _ in snapshots(store, "j/main")] == [1, 2, 5, 6]


def test_restore_latest_best_metric_from_history(tmp_path):
    """The best comes from the ref's whole history, not just the newest snapshot."""
    with tsck.open_store(tmp_path / "s") as store:
        mgr = tsck.CheckpointManager(store, job="j", state=small_state(), async_=False,
                                     every_steps=2, on_metric=("acc", "max"))
        for step, acc in [(1, 0.9), (2, 0.1), (3, 0.2), (4, 0.3)]:
            mgr.step(step, {"acc": acc})
        assert [s for s, _ in snapshots(store, "j/main")] == [1, 2, 4]
        mgr2 = tsck.CheckpointManager(store, job="j", state=small_state(), async_=False,
                                      every_steps=2, on_metric=("acc", "max"))
        assert mgr2.restore_latest() == 4
        assert mgr2.step(5, {"acc": 0.8}) is None       # below 0.9 (step 1), above the newest 0.3
        assert mgr2.step(7, {"acc": 0.95}) is not None


def test_two_jobs_in_one_store_stay_independent(tmp_path):
    clock = FakeClock(0.0)
    with tsck.open_store(tmp_path / "s") as store:
        # prune=False: every snapshot stays until the offline gc below (tests/train/test_prune.py
        # covers pruning while training)
        a = tsck.CheckpointManager(store, job="jobA", state=small_state(0), async_=False, clock=clock,
                                   every_steps=2, retention=tsck.Retention(keep_last=2), prune=False)
        b = tsck.CheckpointManager(store, job="jobB", state=small_state(1), async_=False, clock=clock,
                                   every_seconds=10, on_metric=("acc", "max"),
                                   retention=tsck.Retention(keep_best=1, metric="acc", mode="max"), prune=False)
        accs = {1: 0.5, 2: 0.4, 3: 0.9, 4: 0.1, 5: 0.2, 6: 0.3, 7: 0.35, 8: 0.2, 9: 0.1, 10: 0.05}
        for step in range(1, 11):
            clock.t = step * 3.0
            a.step(step, {"acc": 1.0})  # jobA ignores metrics
            b.step(step, {"acc": accs[step]})
        # A: every 2 steps. B: first value (1), better (3), 10 s after its last snapshot (step 3 @ 9 s ->
        # step 7 @ 21 s); A's snapshots do not reset B's clock nor B's A's.
        assert [s for s, _ in snapshots(store, "jobA/main")] == [2, 4, 6, 8, 10]
        assert snapshots(store, "jobB/main") == [(1, ["metric"]), (3, ["metric"]), (7, ["seconds"])]
        assert {e.job for e in store.log("jobA/main")} == {"jobA"}
        assert {e.job for e in store.log("jobB/main")} == {"jobB"}
        ret = store.retention()
        assert ret["jobA"].keep_last == 2 and ret["jobB"].keep_best == 1 and ret["jobB"].metric == "acc"

        rep = store.gc()
        assert len(rep.expired) == 3 + 1
        assert [e.step for e in store.log("jobA/main")] == [10, 8]
        assert [e.step for e in store.log("jobB/main")] == [7, 3]  # tip + best
        for target in ("jobA/main@8", "jobA/main@10", "jobB/main@3", "jobB/main@7"):
            store.checkout(target)
        for target in ("jobA/main@6", "jobB/main@1"):
            with pytest.raises(tsck.RefNotFound):
                store.checkout(target)

        # each job restores its own newest snapshot
        a2 = tsck.CheckpointManager(store, job="jobA", state=small_state(5), async_=False)
        b2 = tsck.CheckpointManager(store, job="jobB", state=small_state(6), async_=False,
                                    on_metric=("acc", "max"))
        assert a2.restore_latest() == 10 and b2.restore_latest() == 7
        assert b2.step(11, {"acc": 0.85}) is None  # best survives gc: 0.9 at step 3
        assert b2.step(12, {"acc": 0.91}) is not None
        assert store.fsck().ok


def test_numpy_float_metric_is_recorded_and_its_best_restored(tmp_path):
    """A metric given as a numpy float64 (a float subclass, what np.mean() returns) fires
    on_metric, so it must also be recorded with the snapshot: otherwise restore_latest()
    cannot restore the best from the ref's history and a worse value fires again.
    (A regression test: the manager once kept only metrics whose type was exactly int or float.)"""
    import numpy as np

    with tsck.open_store(tmp_path / "s") as store:
        mgr = tsck.CheckpointManager(store, job="j", state=small_state(), async_=False,
                                     on_metric=("loss", "min"))
        info = mgr.step(1, {"loss": np.float64(2.0)})
        assert info is not None and info.meta["triggers"] == ["metric"]
        mgr2 = tsck.CheckpointManager(store, job="j", state=small_state(), async_=False,
                                      on_metric=("loss", "min"))
        assert mgr2.restore_latest() == 1
        assert store.log("j/main")[0].metrics == {"loss": 2.0}
        assert mgr2.step(2, {"loss": 3.0}) is None  # worse than the restored best
