"""A DCP snapshot's durations: dcp.save and dcp.async_save through TsckWriter record the
save's seconds and stall as put_snapshot does (SnapshotInfo, `tsck log --json`, the INFO
line): dcp.save blocks its caller all along; async_save only while it stages."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tensorstore_ck as tsck
from tensorstore_ck.cli import main
from tensorstore_ck.dcp import TsckWriter
from tensorstore_ck.storage.wrappers import WrappedStore

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

DEADLINE = 120.0


class HeldWrites(WrappedStore):
    """Object writes wait for `gate` once `armed`: a save whose writes take as long as the test says."""

    def __init__(self, inner):
        super().__init__(inner)
        self.armed, self.gate, self.waiting = False, threading.Event(), threading.Event()

    def put_addressed(self, key, bufs):
        if self.armed:
            self.waiting.set()
            assert self.gate.wait(DEADLINE)
        return self.inner.put_addressed(key, bufs)


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(256, 1024, generator=g), "b": torch.randn(1024, generator=g)}}


def test_dcp_save_and_async_save_record_seconds_and_stall(tmp_path, capsys, caplog):
    caplog.set_level(logging.INFO, logger="tensorstore_ck")
    path = tmp_path / "s"
    wrapped: list[HeldWrites] = []
    with tsck.open_store(path, wrap_storage=lambda st: wrapped.append(HeldWrites(st)) or wrapped[-1]) as s:
        held = wrapped[0]
        t0 = time.monotonic()
        w = TsckWriter(s, ref="job/main", step=1)
        dcp.save(_state(1), storage_writer=w)
        t1 = time.monotonic()
        saved = w.info
        # blocking: the caller waited for all of it
        assert saved.seconds is not None and 0 < saved.seconds <= t1 - t0 and saved.stall == saved.seconds

        held.armed = True  # the async save's writes wait until the caller has long returned
        w = TsckWriter(s, ref="job/main", step=2)
        t0 = time.monotonic()
        fut = dcp.async_save(_state(2), storage_writer=w)
        t1 = time.monotonic()
        assert held.waiting.wait(DEADLINE)
        time.sleep(0.2)
        t2 = time.monotonic()
        held.gate.set()
        fut.result(timeout=DEADLINE)
        asynced = w.info
        # the caller was blocked while the state was staged, at most t1 - t0; the save
        # went on after it returned until the writes were let through (t2)
        assert asynced.stall is not None and asynced.stall <= t1 - t0
        assert asynced.seconds is not None and asynced.seconds >= t2 - t1 and asynced.stall < asynced.seconds
    capsys.readouterr()
    assert main(["log", str(path), "job/main", "--json"]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert (rows[1]["seconds"], rows[1]["stall"]) == pytest.approx((saved.seconds, saved.stall))
    assert (rows[2]["seconds"], rows[2]["stall"]) == pytest.approx((asynced.seconds, asynced.stall))
    lines = [r for r in caplog.records if getattr(r, "tsck", {}).get("event") == "committed"]
    assert [r.tsck["step"] for r in lines] == [1, 2]
    assert all("(stall " in r.getMessage() for r in lines)


def test_a_writer_used_again_times_each_save_alone(tmp_path):
    """One TsckWriter for several saves (dcp.save's checkpoint_id names the ref): each
    save's durations are its own, and an async save's staging does not leak into a
    dcp.save after it."""
    with tsck.open_store(tmp_path / "s") as s:
        w = TsckWriter(s, ref="job/main", step=1)
        dcp.async_save(_state(1), storage_writer=w).result(timeout=DEADLINE)
        first = w.info
        time.sleep(0.2)
        t0 = time.monotonic()
        dcp.save(_state(2), storage_writer=w, checkpoint_id="job/main@2")
        t1 = time.monotonic()
        second = w.info
    assert first.step == 1 and first.stall is not None and first.stall <= first.seconds
    assert second.step == 2 and second.seconds <= t1 - t0 and second.stall == second.seconds
