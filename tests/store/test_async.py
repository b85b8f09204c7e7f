"""Asynchronous snapshots: put_snapshot(blocking=False), back-pressure, staging buffer reuse,
and how a failed background write surfaces.

The store is a real local store (LMDB refs) whose block storage is wrapped in
FaultInjectingStore. To hold a write "in flight" for as long as a test needs, the
wrapper's `when` hook is a Gate: it blocks any storage operation on a block while the
gate is closed (and never injects a fault), so what is asserted does not depend on
timing. One test uses the wrapper's random `delay` instead.

A failed background write reaches the caller as the store's StorageError (an OSError,
ENOSPC here) chained from the InjectedFault; the tests accept either, and check that
the very same exception object is raised again by the next call.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from _mounts import fill, tmpfs
from _util import assert_same

import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import FaultInjectingStore, InjectedFault

BS = 64 * 1024  # block size: the "big" tensors below span several blocks


class Gate:
    """FaultInjectingStore `when` hook that holds block reads/writes while closed.

    Never injects a fault. If a test forgets it (or the package blocks where it must
    not), it opens by itself after `limit` seconds and records that it timed out."""

    def __init__(self, limit: float = 30.0):
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()
        self.limit = limit
        self.timed_out = False

    def close(self):
        self.entered.clear()
        self.open.clear()

    def __call__(self, op, key):
        if key.startswith("blocks/") and not self.open.is_set():
            self.entered.set()
            if not self.open.wait(self.limit):
                self.timed_out = True
                self.open.set()
        return False


def within(gate, fn, *args, **kw):
    """fn(*args, **kw), which must return while `gate` holds the writes in flight: fails
    (and releases the gate) if it has not returned within 10 s."""
    out = {}

    def call():
        try:
            out["r"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001
            out["e"] = e

    t = threading.Thread(target=call)
    t.start()
    t.join(10)
    if t.is_alive():
        gate.open.set()
        t.join(60)
        raise AssertionError(f"{getattr(fn, '__name__', fn)} did not return while a write was in flight")
    if "e" in out:
        raise out["e"]
    return out["r"]


def gated_store(path, gate, **kw):
    holder = []

    def wrap(s):
        holder.append(FaultInjectingStore(s, rules={}, when=gate))
        return holder[0]

    store = tsck.open_store(path, block_size=BS, wrap_storage=wrap, **kw)
    return store, holder[0]


def big_state(v: float = 0.0) -> dict:
    base = torch.arange(100_000, dtype=torch.float64) + v
    return {
        "big": torch.arange(150_000, dtype=torch.float32) + v,      # 600 KB: 10 blocks
        "arr": np.arange(40_000, dtype=np.int64) + int(v),           # 320 KB
        "view": base[::2],                                           # non-contiguous view
        "small": torch.full((8,), v),                                # inlined
        "step": int(v),
    }


def tiny_state(v: int) -> dict:
    return {"x": torch.full((4,), float(v)), "v": v}


def clone(state: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v.copy() if isinstance(v, np.ndarray) else v)
            for k, v in state.items()}


def test_async_put_returns_before_write_and_state_may_be_mutated(tmp_path):
    gate = Gate()
    store, _ = gated_store(tmp_path / "s", gate)
    with store:
        state = big_state(1.0)
        want = clone(state)
        gate.close()
        fut = within(gate, store.put_snapshot, state, "a/main", step=1, blocking=False)
        assert isinstance(fut, Future)
        assert gate.entered.wait(30), "the background writer never reached storage"
        assert not fut.done()
        assert store.refs() == {}
        # the caller changes everything at once, in place
        state["big"].add_(100.0)
        state["arr"] += 100
        state["view"].fill_(-1.0)  # writes through to the view's base
        state["small"].mul_(0)
        time.sleep(0.1)
        assert not gate.timed_out
        gate.open.set()
        info = fut.result(timeout=60)
        assert info.step == 1 and store.resolve("a/main") == info.root
        assert_same(want, store.checkout("a/main"))
        assert store.fsck().ok


def test_async_commits_keep_their_order(tmp_path):
    """Snapshots commit in the order taken, even when a later one has less to write;
    a blocking put waits for the asynchronous ones before it."""
    gate = Gate()
    store, _ = gated_store(tmp_path / "s", gate, max_inflight=8)
    with store:
        gate.close()
        futs = [within(gate, store.put_snapshot, big_state(1.0), "a/main", step=1, blocking=False)]
        assert gate.entered.wait(30)
        futs += [within(gate, store.put_snapshot, tiny_state(i), "a/main", step=i, blocking=False)
                 for i in range(2, 6)]
        assert all(isinstance(f, Future) for f in futs)
        done = {}
        t = threading.Thread(target=lambda: done.setdefault("info", store.put_snapshot(tiny_state(6), "a/main",
                                                                                         step=6)))
        t.start()
        time.sleep(0.4)  # snapshots 2..6 have no block to write: they could commit now if not ordered
        assert store.refs() == {}, "a later snapshot committed before an earlier one"
        assert not any(f.done() for f in futs) and t.is_alive()
        assert not gate.timed_out
        gate.open.set()
        infos = [f.result(timeout=60) for f in futs]
        t.join(60)
        infos.append(done["info"])
        log = store.log("a/main")
        assert [e.step for e in log] == [6, 5, 4, 3, 2, 1]
        assert [e.root for e in log] == [i.root for i in reversed(infos)]
        for newer, older in zip(log, log[1:]):
            assert newer.parent == older.root
        assert store.show("a/main").step == 6
        assert_same(big_state(1.0), store.checkout("a/main@1"))
        assert_same(tiny_state(4), store.checkout("a/main@4"))


@pytest.mark.parametrize("where", ["store", "call", "manager"])
def test_when_busy_skip(tmp_path, where):
    gate = Gate()
    store, _ = gated_store(tmp_path / "s", gate, max_inflight=1, when_busy="skip" if where == "store" else "wait")
    kw = {"when_busy": "skip"} if where == "call" else {}
    with store:
        mgr = None
        if where == "manager":
            holder = {"s": big_state(0.0)}

            class St:  # anything with state_dict(); the manager snapshots what it returns
                step = 0

                def state_dict(self):
                    return holder["s"]

            mgr = tsck.CheckpointManager(store, job="a", state=St(), every_steps=1, when_busy="skip")

        def put(state, step):
            if mgr is not None:
                holder["s"] = state
                return mgr.step(step)
            return store.put_snapshot(state, "a/main", step=step, blocking=False, **kw)

        gate.close()
        fut1 = within(gate, put, big_state(1.0), 1)
        assert isinstance(fut1, Future)
        assert gate.entered.wait(30)
        assert store.skipped == 0
        t0 = time.monotonic()
        assert within(gate, put, tiny_state(2), 2) is None
        assert within(gate, put, big_state(3.0), 3) is None
        assert time.monotonic() - t0 < 5  # skipping does not wait
        assert store.skipped == 2
        assert not gate.timed_out
        gate.open.set()
        assert fut1.result(timeout=60).step == 1
        store.wait()
        fut4 = put(tiny_state(4), 4)
        assert isinstance(fut4, Future) and fut4.result(timeout=60).step == 4
        assert store.skipped == 2
        assert [e.step for e in store.log("a/main")] == [4, 1]


def test_when_busy_wait_blocks_until_a_slot_frees(tmp_path):
    gate = Gate()
    store, _ = gated_store(tmp_path / "s", gate, max_inflight=1, when_busy="wait")
    with store:
        gate.close()
        fut1 = within(gate, store.put_snapshot, big_state(1.0), "a/main", step=1, blocking=False)
        assert gate.entered.wait(30)
        seen = {}

        def second():
            f = store.put_snapshot(tiny_state(2), "a/main", step=2, blocking=False)
            seen["head_when_returned"] = store.show("a/main").step  # step 1 had committed by then
            seen["fut"] = f

        t = threading.Thread(target=second)
        t.start()
        t.join(0.5)
        assert t.is_alive(), "put_snapshot did not wait for a free slot"
        assert not fut1.done() and store.refs() == {}
        assert not gate.timed_out
        gate.open.set()
        t.join(60)
        assert not t.is_alive()
        assert seen["head_when_returned"] == 1
        assert seen["fut"].result(timeout=60).step == 2
        assert store.skipped == 0
        assert [e.step for e in store.log("a/main")] == [2, 1]


def test_when_busy_wait_with_slow_storage(tmp_path):
    """With max_inflight=1 on a slow store, put k returns only after put k-1 committed."""
    holder = []

    def wrap(s):
        holder.append(FaultInjectingStore(s, rules={}, delay=0.05))
        return holder[0]

    with tsck.open_store(tmp_path / "s", block_size=BS, max_inflight=1, when_busy="wait",
                         wrap_storage=wrap) as store:
        committed_at_return = []
        for k in range(1, 5):
            f = store.put_snapshot(big_state(float(k)), "a/main", step=k, blocking=False)
            assert isinstance(f, Future)
            try:
                committed_at_return.append(store.show("a/main").step)
            except tsck.RefNotFound:
                committed_at_return.append(None)
        store.wait()
        assert committed_at_return[1:] == [1, 2, 3]
        assert [e.step for e in store.log("a/main")] == [4, 3, 2, 1]
        assert store.skipped == 0


def test_staging_buffer_is_reused(tmp_path):
    gate = Gate()
    store, _ = gated_store(tmp_path / "s", gate)
    with store:
        pool = store._puts.staging  # the async queue's buffers (asyncput.py)
        assert pool._free == []
        store.put_snapshot(big_state(1.0), "a/main", step=1, blocking=False).result(timeout=60)
        assert len(pool._free) == 1
        buf = pool._free[0]
        ident, ptr, size = id(buf), buf.data_ptr(), buf.numel()
        gate.close()
        fut = within(gate, store.put_snapshot, big_state(2.0), "a/main", step=2, blocking=False)
        assert gate.entered.wait(30)
        assert pool._free == [], "the second snapshot did not take the free buffer"
        assert not gate.timed_out
        gate.open.set()
        fut.result(timeout=60)
        assert len(pool._free) == 1
        assert id(pool._free[0]) == ident and pool._free[0].data_ptr() == ptr and pool._free[0].numel() == size
        # a smaller state fits in the same buffer
        store.put_snapshot({"big": torch.ones(20_000)}, "a/main", step=3, blocking=False).result(timeout=60)
        assert [b.data_ptr() for b in pool._free] == [ptr]
        # reuse did not disturb what was written from it earlier
        assert_same(big_state(1.0), store.checkout("a/main@1"))
        assert_same(big_state(2.0), store.checkout("a/main@2"))
        assert torch.equal(store.checkout("a/main@3")["big"], torch.ones(20_000))


def injected(e: BaseException) -> bool:
    """The error is the injected ENOSPC, or one of the store's own errors wrapping it."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, InjectedFault):
            return True
        e, seen = e.__cause__, seen + 1
    return False


def failing_store(path):
    holder = []

    def wrap(s):
        f = FaultInjectingStore(s, when=lambda op, key: op == "put" and key.startswith("blocks/"))
        f.armed = False
        holder.append(f)
        return f

    return tsck.open_store(path, block_size=BS, wrap_storage=wrap), holder[0]


def test_background_failure_surfaces_on_future_and_next_put(tmp_path):
    store, fis = failing_store(tmp_path / "s")
    with store:
        info1 = store.put_snapshot(big_state(1.0), "a/main", step=1)
        fis.armed = True
        fut = store.put_snapshot(big_state(2.0), "a/main", step=2, blocking=False)
        with pytest.raises(OSError) as ei:
            fut.result(timeout=60)
        err = ei.value
        assert injected(err) and err.errno == errno.ENOSPC, repr(err)
        assert fis.faults >= 1
        assert store.resolve("a/main") == info1.root
        assert [e.root for e in store.log("a/main")] == [info1.root]
        # the next put raises the same error, before doing anything
        with pytest.raises(OSError) as ei2:
            store.put_snapshot(tiny_state(3), "a/main", step=3, blocking=False)
        assert ei2.value is err
        assert [e.root for e in store.log("a/main")] == [info1.root]
        store.raise_pending_error()  # raised once only
        fis.armed = False
        info3 = store.put_snapshot(big_state(3.0), "a/main", step=3, blocking=False).result(timeout=60)
        assert [e.step for e in store.log("a/main")] == [3, 1]
        assert info3.parent == info1.root
        assert_same(big_state(3.0), store.checkout("a/main"))
        assert store.fsck().ok


def test_background_failure_surfaces_in_checkpoint_manager(tmp_path):
    store, fis = failing_store(tmp_path / "s")
    with store:
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)  # 256 KB of weights: several blocks
        mgr = tsck.CheckpointManager(store, job="m", state=tsck.TrainState(model=model), every_steps=10)
        first = mgr.step(10).result(timeout=60)
        fis.armed = True
        with torch.no_grad():
            model.weight.add_(1.0)
        fut = mgr.step(20)
        with pytest.raises(OSError) as ei:
            fut.result(timeout=60)
        assert injected(ei.value), repr(ei.value)
        assert mgr.reasons(21) == []
        with pytest.raises(OSError) as ei2:
            mgr.step(21)  # no trigger fires at 21, the failure is raised anyway
        assert ei2.value is ei.value
        assert store.resolve("m/main") == first.root
        assert [e.step for e in store.log("m/main")] == [10]
        fis.armed = False
        assert mgr.step(22) is None  # raised once
        info = mgr.step(30).result(timeout=60)
        assert [e.step for e in store.log("m/main")] == [30, 10]
        assert info.parent == first.root
        assert torch.equal(store.checkout("m/main")["model"]["weight"], model.weight.detach())
        # close() raises a failure still pending
        fis.armed = True
        with torch.no_grad():
            model.weight.add_(1.0)
        mgr.step(40)
        with pytest.raises(OSError) as ei3:
            mgr.close()
        assert injected(ei3.value)
        fis.armed = False
        assert [e.step for e in store.log("m/main")] == [30, 10]


# -- close() and a background failure nobody heard of ---------------------------------
# The failure is real: the store's data lies on a small tmpfs filled to the last byte
# (the ref table beside it, on the ordinary disk), so the background put's block writes
# get ENOSPC from the kernel.

@contextlib.contextmanager
def full_disk_store(tmp_path, gate=None):
    """(store, first_root): a store whose data disk is full; its ref "a/main" holds
    one committed snapshot. gate: a Gate holding block writes (it injects nothing)."""
    with tmpfs(tmp_path / "small", "8m") as small:
        wrap = None if gate is None else (lambda s: FaultInjectingStore(s, rules={}, when=gate))
        store = tsck.open_store(os.path.join(small, "store"), refs=str(tmp_path / "refs.lmdb"), block_size=BS,
                                wrap_storage=wrap)
        try:
            first = store.put_snapshot(big_state(1.0), "a/main", step=1)
            fill(small)
            yield store, first.root
        finally:
            if gate is not None:
                gate.open.set()
            store.close()


def no_space(e: BaseException) -> bool:
    return isinstance(e, tsck.StorageError) and e.errno == errno.ENOSPC


def test_close_raises_a_background_failure_nobody_retrieved(tmp_path):
    with full_disk_store(tmp_path) as (store, first):
        fut = store.put_snapshot(big_state(2.0), "a/main", step=2, blocking=False)
        with pytest.raises(tsck.StorageError) as ei:
            store.close()
        assert no_space(ei.value), repr(ei.value)
        assert "a/main" in "".join(getattr(ei.value, "__notes__", [])), ei.value
        assert fut.done() and fut.failure() is ei.value
        assert store.closed
        store.close()  # raised once: a second close() is quiet
        # close() released the ref table before raising: it opens again in this process
        with tsck.open_store(store.url, refs=str(tmp_path / "refs.lmdb"), create=False, read_only=True) as s2:
            assert s2.resolve("a/main") == first


@pytest.mark.parametrize("how", ["result", "exception", "next put", "raise_pending_error"])
def test_close_does_not_raise_a_failure_already_heard(tmp_path, how):
    with full_disk_store(tmp_path) as (store, first):
        fut = store.put_snapshot(big_state(2.0), "a/main", step=2, blocking=False)
        if how == "result":
            with pytest.raises(tsck.StorageError):
                fut.result(timeout=60)
        elif how == "exception":
            assert no_space(fut.exception(timeout=60))
        else:
            store.wait()
            with pytest.raises(tsck.StorageError):
                if how == "next put":
                    store.put_snapshot(tiny_state(3), "a/main", step=3)
                else:
                    store.raise_pending_error()
        store.close()  # quiet
        assert store.closed


def test_close_raises_the_first_of_several_unheard_failures(tmp_path):
    gate = Gate()
    with full_disk_store(tmp_path, gate) as (store, first):
        gate.close()  # the first stays in flight while the second is taken: neither put raises
        f2 = store.put_snapshot(big_state(2.0), "a/main", step=2, blocking=False)
        f3 = store.put_snapshot(big_state(3.0), "b/main", step=3, blocking=False)
        gate.open.set()
        with pytest.raises(tsck.StorageError) as ei:
            store.close()
        assert ei.value is f2.failure() and no_space(f3.failure()) and not gate.timed_out
        notes = "".join(ei.value.__notes__)
        assert "'a/main'" in notes and "1 later asynchronous snapshot(s) failed too" in notes, notes


def test_a_with_block_leaving_on_an_exception_keeps_it(tmp_path):
    """close() from __exit__ does not replace the exception on its way out; the
    snapshot's failure is attached to it as a note."""
    with tmpfs(tmp_path / "small", "8m") as small:
        store = tsck.open_store(os.path.join(small, "store"), refs=str(tmp_path / "refs.lmdb"), block_size=BS)
        with pytest.raises(KeyError, match="training went wrong") as ei:
            with store:
                store.put_snapshot(big_state(1.0), "a/main", step=1)
                fill(small)
                store.put_snapshot(big_state(2.0), "a/main", step=2, blocking=False)
                raise KeyError("training went wrong")
        assert store.closed
        notes = "".join(getattr(ei.value, "__notes__", []))
        assert "while closing the store" in notes and "StorageError" in notes, notes
        store.close()  # the failure was reported (as the note): not raised again


def test_close_raises_an_unheard_failure_under_a_checkpoint_manager(tmp_path):
    """The manager's own look at a snapshot's future (its prune after a commit) is not
    the caller hearing the outcome: a script that closes only the store hears it."""
    with full_disk_store(tmp_path) as (store, first):
        torch.manual_seed(0)
        model = torch.nn.Linear(256, 256)
        mgr = tsck.CheckpointManager(store, job="a", state=tsck.TrainState(model=model), every_steps=10,
                                     async_=True, retention=tsck.Retention(keep_last=3))
        mgr.step(10)
        with pytest.raises(tsck.StorageError) as ei:
            store.close()
        assert no_space(ei.value), repr(ei.value)


def test_checkpoint_manager_close_raises_it_and_the_store_does_not_again(tmp_path):
    with full_disk_store(tmp_path) as (store, first):
        torch.manual_seed(0)
        mgr = tsck.CheckpointManager(store, job="a", state=tsck.TrainState(model=torch.nn.Linear(256, 256)),
                                     every_steps=10, async_=True, retention=tsck.Retention(keep_last=3))
        mgr.step(10)
        with pytest.raises(tsck.StorageError) as ei:
            mgr.close()
        assert no_space(ei.value), repr(ei.value)
        store.close()  # heard through the manager: not raised a second time


def test_a_put_cancelled_while_queued_gives_back_its_slot(tmp_path):
    gate = Gate()
    store, _ = gated_store(tmp_path / "s", gate, max_inflight=2)
    with store:
        gate.close()
        f1 = store.put_snapshot(big_state(1.0), "a/main", step=1, blocking=False)
        f2 = store.put_snapshot(big_state(2.0), "a/main", step=2, blocking=False)
        assert gate.entered.wait(30)
        assert f2.cancel()  # still queued behind f1
        gate.open.set()
        f1.result(timeout=60)
        # The background publisher is first-in first-out: once f3 is done, f2's turn
        # (which finds it cancelled) has passed.
        store.put_snapshot(tiny_state(3), "a/main", step=3, blocking=False).result(timeout=60)
        gate.close()  # the next two stay in flight: each holds its slot
        taken = [store.put_snapshot(big_state(4.0 + i), "b/main", step=4 + i, blocking=False, when_busy="skip")
                 for i in range(2)]
        gate.open.set()
        assert None not in taken and store.skipped == 0  # both slots were free
        for f in taken:
            f.result(timeout=60)
        assert [e.step for e in store.log("a/main")] == [3, 1] and not gate.timed_out


def test_staging_pool_holds_several_buffers_of_any_sizes(tmp_path):
    """With max_inflight=2 the pool keeps two buffers; taking one must pick it by identity
    (list.remove compares tensors with ==: two of different sizes raise, two of the same
    size are ambiguous). A state whose size changes between asynchronous snapshots (one
    taken before the optimizer's first step) met it on the third put."""
    with tsck.open_store(str(tmp_path / "s"), create=True, max_inflight=2) as store:
        pool = store._puts.staging
        sizes = (1_000, 200_000, 200_000, 200_000)
        for i, n in enumerate(sizes, 1):
            state = {"w": torch.full((n,), float(i))}
            store.put_snapshot(state, "a/main", step=i, blocking=False).result(timeout=60)
        assert len(pool._free) == 2, "the pool never held two buffers: the case is not exercised"
        for i, n in enumerate(sizes, 1):
            assert torch.equal(store.checkout(f"a/main@{i}")["w"], torch.full((n,), float(i)))


def test_staging_pool_two_buffers_of_one_size(tmp_path):
    """Two snapshots in flight at once leave two buffers of the same size in the pool;
    the next put takes one of them (by value, "Boolean value of Tensor is ambiguous")."""
    gate = Gate()
    store, _ = gated_store(tmp_path / "s", gate)
    with store:
        pool = store._puts.staging
        gate.close()
        f1 = within(gate, store.put_snapshot, big_state(1.0), "a/main", step=1, blocking=False)
        assert gate.entered.wait(30)
        f2 = store.put_snapshot(big_state(2.0), "a/main", step=2, blocking=False)  # staged meanwhile
        gate.open.set()
        f1.result(timeout=60), f2.result(timeout=60)
        assert len(pool._free) == 2 and pool._free[0].numel() == pool._free[1].numel()
        store.put_snapshot(big_state(3.0), "a/main", step=3, blocking=False).result(timeout=60)
        assert_same(big_state(3.0), store.checkout("a/main@3"))
        assert_same(big_state(1.0), store.checkout("a/main@1"))


def test_staging_pool_take_and_give_by_identity():
    from tensorstore_ck.write.staging import StagingPool
    pool = StagingPool(3)
    a, b, c = pool.take(100), pool.take(100), pool.take(5_000)
    for buf in (c, a, b):  # the one taken is not the first: a comparison by value would meet c
        pool.give(buf)
    got = pool.take(50)
    assert got is a or got is b  # the smallest that fits, the others stay
    assert len(pool._free) == 2 and any(x is c for x in pool._free)
    big = pool.take(10_000)  # none fits, the pool is not full: a new one, the free ones stay
    assert all(big is not x for x in (a, b, c)) and len(pool._free) == 2
