"""How a CheckpointManager reports snapshots it could not take, with nothing configured:
a SnapshotWarning per kind of failure (shown by the default warning filters), a failure
that is not the store's never raised into training, and close() refusing to end a run
quietly whose newest snapshot failed (SnapshotsFailed, its CloseReport).

The failure is real fault injection below the store (wrap_storage=: the block store's
writes raise), not a stand-in for the manager."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import WrappedStore

import _zygote as zygote


class Broken(WrappedStore):
    """When armed, every object write raises `exc` (a broken backend or disk)."""

    def __init__(self, inner, exc):
        super().__init__(inner)
        self.armed, self.exc = False, exc

    def put_if_absent(self, key, bufs):
        if self.armed:
            raise self.exc
        return self.inner.put_if_absent(key, bufs)


def _manager(tmp_path, exc, **kw):
    holder = {}
    store = tsck.open_store(str(tmp_path / "s"), create=True,
                            wrap_storage=lambda s: holder.setdefault("w", Broken(s, exc)))
    state = {"w": torch.zeros(50_000)}
    mgr = tsck.CheckpointManager(store, job="j", state=state, every_steps=1, **kw)
    return store, mgr, holder, state


@pytest.mark.parametrize("async_", [False, True])
def test_an_unexpected_exception_is_reported_never_raised_into_training(tmp_path, async_):
    store, mgr, holder, state = _manager(tmp_path, RuntimeError("a backend bug"), async_=async_)
    with store:
        mgr.step(1)
        mgr.wait()
        holder["w"].armed = True
        with pytest.warns(tsck.SnapshotWarning, match="step 2 could not be taken: RuntimeError: a backend bug"):
            state["w"] += 1
            mgr.step(2)
            mgr.store.wait()
            state["w"] += 1
            mgr.step(3)  # (the asynchronous failure of step 2 is not raised here)
            mgr.store.wait()
        holder["w"].armed = False
        state["w"] += 1
        mgr.step(4)
        rep = mgr.close()
        assert rep.ok and rep.attempted == 4 and rep.committed == 2 and rep.failed == 2
        assert [i.step for i in store.log("j/main")] == [4, 1]


def test_close_raises_when_the_newest_snapshot_failed(tmp_path):
    store, mgr, holder, state = _manager(tmp_path, RuntimeError("a backend bug"), async_=True)
    with store:
        mgr.step(1)
        mgr.wait()
        holder["w"].armed = True
        state["w"] += 1
        with pytest.warns(tsck.SnapshotWarning):
            mgr.step(2)
            with pytest.raises(tsck.SnapshotsFailed, match=r"step 2\) was not committed.*newest committed by this "
                                                           r"run is of step 1") as ei:
                mgr.close()
        rep = ei.value.report
        assert (rep.attempted, rep.committed, rep.failed, rep.last_attempted_step, rep.last_committed_step) == \
            (2, 1, 1, 2, 1)
        assert not rep.ok


def test_a_script_whose_last_snapshot_fails_shows_it_and_exits_non_zero(tmp_path):
    """The README's loop as a script that configures nothing: the failure is printed on
    stderr once (a second failure of the same kind is counted, not printed again), and
    close() makes the script exit non-zero."""
    script = textwrap.dedent(f"""
        import errno, torch, tensorstore_ck as tsck
        from tensorstore_ck.storage.wrappers import WrappedStore
        class Full(WrappedStore):
            armed = False
            def put_if_absent(self, key, bufs):
                if self.armed:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return self.inner.put_if_absent(key, bufs)
        h = {{}}
        store = tsck.open_store({str(tmp_path / "s")!r}, create=True, wrap_storage=lambda s: h.setdefault("w", Full(s)))
        state = {{"w": torch.zeros(50_000)}}
        mgr = tsck.CheckpointManager(store, job="j", state=state, every_steps=1, async_=False)
        for step in range(1, 6):
            state["w"] += 1
            h["w"].armed = step >= 4
            try:
                mgr.step(step)
            except tsck.TsckError:
                pass  # (one process: the store's failure is raised; this script goes on)
        mgr.close()
        print("closed quietly")
    """)
    p = zygote.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0, p.stdout + p.stderr
    assert "closed quietly" not in p.stdout
    assert p.stderr.count("SnapshotWarning") == 1, p.stderr  # step 4 shown; step 5, of the same kind, counted
    assert "the snapshot of step 4 could not be taken" in p.stderr
    assert "SnapshotsFailed" in p.stderr and "step 5) was not committed" in p.stderr, p.stderr
