"""CheckpointManager(continuous=True, min_interval=): a snapshot starts at the first step()
where the previous one is durable (committed; with a local tier, uploaded) and min_interval
seconds passed since it started, and at no other step.

The store's object writes are held by a storage wrapper (a gate the test opens), so "not
durable yet" is a state the test makes, not a race it hopes for; the clock is the manager's
clock= (a number the test sets), so "within min_interval" is exact. Under torch.distributed
(2 real gloo ranks, tests/helpers/continuous_ranks.py) rank 0's clock and rank 0's view of
durability decide on every rank."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.errors import InvalidArgument

from _util import Watched, rank_results, run_worker_scenario

HOLD_FOR = 120.0  # a gate the test forgets opens by itself (the test then fails on its steps)
DEADLINE = 120.0  # generous (the machine is shared): a snapshot that should end and does not fails the test
WORKER = Path(__file__).resolve().parents[1] / "helpers" / "continuous_ranks.py"


class Held(Watched):
    """Holds every object write while `gate` is clear."""

    def __init__(self, inner):
        super().__init__(inner)
        self.gate = threading.Event()
        self.gate.set()

    def on_write(self, key):
        self.gate.wait(HOLD_FOR)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _state():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    return model, tsck.TrainState(model=model)


def _train(model):
    with torch.no_grad():
        model.weight.add_(0.01)


def _ended(fut, what: str):
    """fut's outcome (a SnapshotInfo, or the exception it failed with), waited for until
    DEADLINE; past it the test fails saying what it waited for."""
    try:
        return fut.exception(timeout=DEADLINE) or fut.result(timeout=0)
    except TimeoutError:
        pytest.fail(f"{what} did not end within {DEADLINE:g} s")


def _none_while_held(got, step: int, what: str) -> None:
    """A step while the previous snapshot is held in flight takes none: one that does is
    the durability check's failure, said at once (its snapshot's writes are held too, so
    waiting for it would only wait out the gate)."""
    assert got[step] is None, f"step {step} took a snapshot while {what} (not durable yet)"


def _open(path, wrapped, **kw):
    return tsck.open_store(str(path), block_size=4096, inline_threshold=256,
                           wrap_storage=lambda s: wrapped.append(Held(s)) or wrapped[-1], **kw)


def test_the_next_snapshot_waits_for_the_previous_commit_and_min_interval(tmp_path):
    """min_interval=10, the clock at 4 s per step: none before t=10 (step 3); the writes of
    step 3's snapshot are held through steps 4-6, which take none though 10 s passed; the
    gate opens and the snapshot commits; step 7 takes the next at once; then steps 8 and 9
    are within min_interval of step 7 (durable at once) and step 10 takes one."""
    wrapped: list = []
    clock = Clock()
    model, state = _state()
    with _open(tmp_path / "store", wrapped) as store:
        mgr = tsck.CheckpointManager(store, job="j", state=state, continuous=True, min_interval=10, clock=clock)
        held, got = wrapped[0], {}
        try:
            for step in range(1, 11):
                clock.t = 4.0 * step
                if step == 3:
                    held.gate.clear()
                if step == 7:
                    held.gate.set()
                    _ended(got[3], "step 3's snapshot, its writes let go")  # committed now
                _train(model)
                got[step] = mgr.step(step)
                if step == 4:
                    assert not got[3].done()  # still held: steps 4-6 ran while it was in flight
                if 4 <= step <= 6:
                    _none_while_held(got, step, "step 3's snapshot was held in flight")
                if step != 3 and got[step] is not None:
                    _ended(got[step], f"step {step}'s snapshot")
        finally:
            held.gate.set()  # a failed check leaves no write held for close()
        mgr.close()
        assert [s for s, r in got.items() if r is not None] == [3, 7, 10]
        assert [e.step for e in store.log("j/main")] == [10, 7, 3]
        assert [e.meta["triggers"] for e in store.log("j/main")] == [["continuous"]] * 3


def test_with_no_min_interval_each_snapshot_starts_once_the_previous_committed(tmp_path):
    """min_interval left at 0, blocking puts: every step's previous snapshot is durable when
    step() returns, so every step takes one (the first at once)."""
    with tsck.open_store(str(tmp_path / "store")) as store:
        model, state = _state()
        mgr = tsck.CheckpointManager(store, job="j", state=state, continuous=True, async_=False)
        taken = []
        for step in range(1, 5):
            _train(model)
            if mgr.step(step) is not None:
                taken.append(step)
        mgr.close()
    assert taken == [1, 2, 3, 4]


def test_with_a_local_tier_the_next_snapshot_waits_for_the_upload(tmp_path):
    """With open_store(remote, local=): the remote's writes are held, so step 1's snapshot
    commits in the tier and is not durable; steps 2-3 take none; once the upload landed
    (wait_durable), step 4 takes one."""
    wrapped: list = []
    model, state = _state()
    store = _open(tmp_path / "remote", wrapped, local=str(tmp_path / "nvme"))
    try:
        remote = wrapped[0]
        remote.gate.clear()
        mgr = tsck.CheckpointManager(store, job="j", state=state, continuous=True)
        got = {}
        for step in range(1, 5):
            if step == 4:
                remote.gate.set()
                assert store.wait_durable(timeout=HOLD_FOR) is True
            _train(model)
            got[step] = mgr.step(step)
            if step in (2, 3):
                _none_while_held(got, step, "step 1's upload was held")
            if got[step] is not None:
                info = _ended(got[step], f"step {step}'s snapshot (its commit in the tier)")
                if step == 1:
                    assert info.durable is False
        assert [s for s, r in got.items() if r is not None] == [1, 4]
        mgr.close()
        assert store.wait_durable(timeout=HOLD_FOR) is True
        assert [e.step for e in store.log("j/main")] == [4, 1]
    finally:
        for w in wrapped:
            w.gate.set()
        store.close()


@pytest.mark.parametrize("kw, words", [
    ({"continuous": "yes"}, "continuous must be True or False"),
    ({"continuous": True, "min_interval": -1}, "min_interval must be a number of seconds >= 0"),
    ({"continuous": True, "min_interval": True}, "min_interval must be a number of seconds >= 0"),
    ({"min_interval": 5}, "min_interval= bounds the continuous trigger"),
])
def test_bad_continuous_arguments_are_refused(tmp_path, kw, words):
    with tsck.open_store(str(tmp_path / "store")) as store:
        with pytest.raises(InvalidArgument, match=words):
            tsck.CheckpointManager(store, job="j", state=_state()[1], **kw)


@pytest.mark.slow  # 2 real gloo ranks
def test_under_torch_distributed_rank_0_decides_when_the_previous_is_durable(tmp_path):
    """Rank 0's clock (4 s a step) and its view of the snapshot in flight decide on both
    ranks (rank 1's clock alone would fire at every step): snapshots at steps 3, 7 and 10,
    the same roots on both ranks, none failed."""
    out = run_worker_scenario(WORKER, tmp_path, "continuous", limit=300.0)
    r0, r1 = rank_results(out, "continuous", 2)
    assert r0["early"] is None and r1["early"] is None, (r0["early"], r1["early"])
    assert r0["steps"] == r1["steps"]
    assert [int(s) for s, root in r0["steps"].items() if root is not None] == [3, 7, 10]
    assert r0["failed"] == r1["failed"] == 0, (r0["errors"], r1["errors"])
