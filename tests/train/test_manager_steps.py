"""CheckpointManager's steps: all_steps(), latest_step(), restore(step), and rolling a run
back to an older step and training on from there.

What the manager says is checked against the store (store.log, the catalog), never
against the manager's own bookkeeping: a manager made in another process, or after the
writer closed, must see the same steps. Bit-identity is assert_same over the TrainState's
state_dict (model, optimizer, scheduler, every RNG stream). Both the asynchronous manager
(async_=True, the default) and the blocking one are run where the snapshot's path differs.

The rollback decision under test (CheckpointManager.restore's docstring): restore(step)
moves the ref back to the restored snapshot (a ref move in the reflog; it deletes nothing),
so a crash before the new run's first snapshot resumes there; the snapshots taken after it
publish on the ref, and take the abandoned run's steps again without a StepReusedWarning;
the abandoned snapshots stay for as long as retention keeps them, keep_last counting
publication order (the move back counts as the restored snapshot's), so they are the first
to go as the new run publishes.
"""

from __future__ import annotations

import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

import tensorstore_ck as tsck
import _zygote as zygote
from _util import assert_same, child_env, frozen_state, manager_state, run_steps, train_step
from tensorstore_ck.errors import StepReusedWarning

ASYNC = pytest.mark.parametrize("async_", [True, False], ids=["async", "blocking"])


def roots_by_step(store, ref) -> list[tuple[int, str]]:
    """(step, root) of every kept snapshot of the ref, newest first (the store's word)."""
    return [(e.step, e.root) for e in store.log(ref)]


def no_step_reused(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, StepReusedWarning)]


# ---------------------------------------------------------------- all_steps, latest_step

def test_a_fresh_process_sees_the_steps_another_manager_wrote(tmp_path):
    path = tmp_path / "store"
    writer = textwrap.dedent(f"""
        import torch, tensorstore_ck as tsck
        model = torch.nn.Linear(4, 3)
        ts = tsck.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        with tsck.open_store({str(path)!r}) as store:
            mgr = tsck.CheckpointManager(store, job="run", state=ts, every_steps=5,
                                         retention=tsck.Retention(keep_last=3))
            for n in range(1, 23):
                mgr.step(n)
            mgr.close()
    """)
    zygote.run([sys.executable, "-c", writer], env=child_env(), check=True, timeout=120)
    with tsck.open_store(path, create=False) as store:
        mgr = tsck.CheckpointManager(store, job="run", state=manager_state())
        # 5 was pruned by keep_last=3 in the writer: only what the catalog keeps is listed
        assert mgr.all_steps() == [10, 15, 20] == sorted(s for s, _ in roots_by_step(store, "run/main"))
        assert mgr.latest_step() == 20
        other = tsck.CheckpointManager(store, job="other", state=manager_state())
        assert other.all_steps() == [] and other.latest_step() is None  # a ref with no snapshot
        mgr.close()
        other.close()


@ASYNC
def test_latest_step_and_all_steps_restore_nothing(store, async_):
    ts = manager_state()
    mgr = tsck.CheckpointManager(store, job="run", state=ts, every_steps=2, async_=async_)
    run_steps(mgr, ts, range(1, 8))
    mgr.wait()
    before, rng_before = frozen_state(ts), torch.get_rng_state()
    assert mgr.latest_step() == 6 and mgr.all_steps() == [2, 4, 6]
    assert_same(before, frozen_state(ts))  # weights, Adam moments, scheduler, every RNG stream
    assert torch.equal(rng_before, torch.get_rng_state())
    assert ts.step == 6 and mgr.last_step == 6  # nothing of the manager moved either
    assert mgr.step(8) is not None  # the policy goes on as before: 8 is a snapshot step
    mgr.close()
    assert mgr.all_steps() == [2, 4, 6, 8]


# ---------------------------------------------------------------- restore(step)

@ASYNC
def test_restore_step_is_bit_identical(store, async_):
    ts = manager_state()
    mgr = tsck.CheckpointManager(store, job="run", state=ts, every_steps=5, async_=async_)
    taken: dict = {}
    run_steps(mgr, ts, range(1, 16), record=taken)
    mgr.close()

    fresh = manager_state(seed=99)  # other weights, other RNG streams: all must be overwritten
    again = tsck.CheckpointManager(store, job="run", state=fresh, async_=async_)
    # what restore_latest restores, restore(latest_step()) restores alike
    latest = manager_state(seed=7)
    assert again.restore_latest(latest) == 15
    by_step = manager_state(seed=8)
    assert again.restore(again.latest_step(), by_step) == 15
    assert_same(taken[15], frozen_state(latest))
    assert_same(frozen_state(latest), frozen_state(by_step))
    assert again.restore(10) == 10 and fresh.step == 10
    assert_same(taken[10], frozen_state(fresh))
    # the RNG streams continue where step 10's did
    again.restore(10)
    train_step(fresh)
    mgr2_state = manager_state(seed=5)
    again.restore(10, mgr2_state)
    train_step(mgr2_state)
    assert_same(frozen_state(fresh), frozen_state(mgr2_state))
    again.close()


def test_restore_a_missing_step_names_the_nearest_and_changes_nothing(store):
    ts = manager_state()
    mgr = tsck.CheckpointManager(store, job="run", state=ts, every_steps=10, async_=False)
    run_steps(mgr, ts, range(1, 31))
    before = frozen_state(ts)
    with pytest.raises(tsck.RefNotFound, match=r"step 25 .*20 below and 30 above.*3 kept, from 10 to 30"):
        mgr.restore(25)
    with pytest.raises(tsck.RefNotFound, match=r"step 99 .*30 below"):
        mgr.restore(99)
    with pytest.raises(tsck.RefNotFound, match=r"step 3 .*10 above"):
        mgr.restore(3)
    for bad in (True, "10", 10.0, None):
        with pytest.raises(tsck.errors.InvalidArgument):
            mgr.restore(bad)
    assert_same(before, frozen_state(ts))
    assert mgr.all_steps() == [10, 20, 30] and mgr.last_step == 30
    empty = tsck.CheckpointManager(store, job="none", state=manager_state())
    with pytest.raises(tsck.RefNotFound, match="has no snapshot"):
        empty.restore(10)


# ---------------------------------------------------------------- rolling back

@ASYNC
def test_rollback_then_step_on(store, async_, caplog):
    ts = manager_state()
    mgr = tsck.CheckpointManager(store, job="run", state=ts, every_steps=10, async_=async_)
    old: dict = {}
    run_steps(mgr, ts, range(1, 31), record=old)
    mgr.wait()
    abandoned = roots_by_step(store, "run/main")
    assert [s for s, _ in abandoned] == [30, 20, 10]

    assert mgr.restore(10) == 10
    # restore moved the ref back to step 10 (its newest move), and deleted nothing
    assert roots_by_step(store, "run/main") == [abandoned[2], abandoned[0], abandoned[1]]
    assert store.resolve("run/main") == abandoned[2][1] and mgr.latest_step() == 10
    new: dict = {}
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING", logger="tensorstore_ck"):
        warnings.simplefilter("always")
        run_steps(mgr, ts, range(11, 26), scale=3.0, record=new)  # another run from step 10: other weights
        mgr.wait()
    assert no_step_reused(caught) == []
    assert not [r for r in caplog.records if "already had a snapshot" in r.getMessage()]
    assert mgr.report().failed == 0

    log = store.log("run/main")
    assert [e.step for e in log] == [20, 10, 30, 20]  # the new run's snapshot first, the old ones kept
    assert log[0].root not in {r for _, r in abandoned}
    assert log[0].meta["resumed_from"] == {"step": 10, "root": abandoned[2][1]}
    assert store.resolve("run/main") == log[0].root and store.resolve("run/main@20") == log[0].root
    assert mgr.all_steps() == [10, 20, 30] and mgr.latest_step() == 20

    # restore_latest (a new manager, as a resume script) returns the new run's newest
    fresh = manager_state(seed=3)
    other = tsck.CheckpointManager(store, job="run", state=fresh, async_=async_)
    assert other.restore_latest() == 20
    assert_same(new[20], frozen_state(fresh))
    assert not same_weights(old[20], new[20])
    # restore(20) names the newer of the two snapshots at 20; 30 is still the old run's
    assert other.restore(20) == 20
    assert_same(new[20], frozen_state(fresh))
    assert other.restore(30) == 30
    assert_same(old[30], frozen_state(fresh))
    mgr.close()
    other.close()


def same_weights(a: dict, b: dict) -> bool:
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@ASYNC
def test_a_resume_after_a_rollback_steps_on_quietly(store, async_):
    """A process that resumes with restore_latest() after another rolled back (and died
    before passing the abandoned run's steps) takes the rest of them again without the
    warning: what was abandoned is read from the store, not from the dead manager."""
    ts = manager_state()
    mgr = tsck.CheckpointManager(store, job="run", state=ts, every_steps=10, async_=async_)
    run_steps(mgr, ts, range(1, 41))
    mgr.restore(10)
    run_steps(mgr, ts, range(11, 21), scale=2.0)
    mgr.close()  # "dies" with the new run at 20 and the old run's 30 and 40 kept

    ts2 = manager_state(seed=1)
    again = tsck.CheckpointManager(store, job="run", state=ts2, every_steps=10, async_=async_)
    assert again.restore_latest() == 20
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_steps(again, ts2, range(21, 51), scale=2.0)
        again.close()
    assert no_step_reused(caught) == []
    assert [e.step for e in store.log("run/main")] == [50, 40, 30, 20, 10, 40, 30, 20]
    assert again.latest_step() == 50


@ASYNC
def test_a_rerun_without_restore_still_warns(store, async_):
    """Not every step taken twice is a rollback: a script re-run from its start, with no
    restore, still gets its StepReusedWarning."""
    ts = manager_state()
    mgr = tsck.CheckpointManager(store, job="run", state=ts, every_steps=10, async_=async_)
    run_steps(mgr, ts, range(1, 21))
    mgr.close()
    rerun = tsck.CheckpointManager(store, job="run", state=manager_state(), every_steps=10, async_=async_)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_steps(rerun, rerun.state, range(1, 11))
        rerun.wait()
    assert len(no_step_reused(caught)) == 1
    # and after a rollback, going back below the restored step is a step reused too
    rerun.restore(20)
    rerun.restore(10)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rerun.step(10, force=True)
        rerun.close()
    assert len(no_step_reused(caught)) == 1


@ASYNC
def test_retention_after_a_rollback(store, async_):
    """keep_last counts publication order, the move back to the restored snapshot included:
    the abandoned run's snapshots are kept until the new run has published keep_last of its
    own; restore() itself prunes nothing."""
    ts = manager_state()
    mgr = tsck.CheckpointManager(store, job="run", state=ts, every_steps=10, async_=async_,
                                 retention=tsck.Retention(keep_last=2))
    run_steps(mgr, ts, range(1, 31))
    mgr.wait()
    old = dict(roots_by_step(store, "run/main"))
    assert sorted(old) == [20, 30] and mgr.all_steps() == [20, 30]  # 10 pruned

    assert mgr.restore(20) == 20
    mgr.wait()
    assert dict(roots_by_step(store, "run/main")) == old  # restore deleted nothing
    assert roots_by_step(store, "run/main")[0] == (20, old[20])  # the ref is back on 20

    new: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_steps(mgr, ts, range(21, 31), scale=2.0, record=new)
        mgr.wait()
        # the two last published: the new 30 and the restored 20 (the ref moved back to it
        # after the abandoned 30 was published); the abandoned 30 went
        assert roots_by_step(store, "run/main")[1] == (20, old[20])
        assert [s for s, _ in roots_by_step(store, "run/main")] == [30, 20]
        assert mgr.all_steps() == [20, 30] and mgr.latest_step() == 30
        run_steps(mgr, ts, range(31, 41), scale=2.0, record=new)
        mgr.wait()
    assert no_step_reused(caught) == []
    log = roots_by_step(store, "run/main")
    assert [s for s, _ in log] == [40, 30] and old[30] not in {r for _, r in log}  # the abandoned run is gone
    assert mgr.all_steps() == [30, 40]
    assert mgr.prune_errors == []
    check = manager_state(seed=4)
    assert mgr.restore(30, check) == 30
    assert_same(new[30], frozen_state(check))
    mgr.close()


# ---------------------------------------------------------------- the store's word for it

def test_put_snapshot_resumed_from(store):
    w = {"w": torch.ones(3)}
    for n in (1, 2, 3):
        store.put_snapshot(w, ref="a/main", step=n)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        store.put_snapshot(w, ref="a/main", step=2, resumed_from=1)  # past the step resumed from
        assert no_step_reused(caught) == []
        store.put_snapshot(w, ref="a/main", step=1, resumed_from=1)  # the step resumed from itself
        assert len(no_step_reused(caught)) == 1
    before = roots_by_step(store, "a/main")
    for bad in ("1", 1.5, True, 2**63):
        with pytest.raises(tsck.errors.InvalidArgument, match="resumed_from"):
            store.put_snapshot(w, ref="a/main", step=4, resumed_from=bad)
    assert roots_by_step(store, "a/main") == before  # nothing published


@ASYNC
def test_a_crash_after_a_rollback_resumes_at_the_restored_step(store_path, async_):
    """restore(10) on a run that reached 30, then the process dies before the new run's first
    snapshot: the restart's restore_latest() (what an elastic restart runs) resumes at 10, not
    at the abandoned 30, and the new run takes steps 11-30 again without a StepReusedWarning.
    The dying process is a real one, killed (SIGKILL) right after restore() returned."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        import tensorstore_ck as tsck
        from _util import manager_state, run_steps
        store = tsck.open_store({str(store_path)!r}, create=True)
        ts = manager_state()
        mgr = tsck.CheckpointManager(store, job="run", state=ts, every_steps=10, async_={async_!r})
        run_steps(mgr, ts, range(1, 31))
        mgr.wait()
        assert mgr.restore(10) == 10
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    p = zygote.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=child_env())
    assert p.returncode == -9, p.stderr
    with tsck.open_store(store_path) as store:
        steps = [e.step for e in store.log("run/main")]
        assert steps == [10, 30, 20]  # the ref is back on 10; nothing was deleted
        ts = manager_state(seed=2)
        mgr = tsck.CheckpointManager(store, job="run", state=ts, every_steps=10, async_=async_)
        assert mgr.restore_latest() == 10 and mgr.latest_step() == 10
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_steps(mgr, ts, range(11, 31), scale=2.0)
            mgr.close()
        assert no_step_reused(caught) == []
        assert [e.step for e in store.log("run/main")] == [30, 20, 10, 30, 20]
        assert [e.message for e in store.reftable.reflog("run/main")][3].startswith("rolled back to step 10")
