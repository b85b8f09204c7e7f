"""The host-memory bound of asynchronous snapshots (open_store(host_memory=)).

Real stores on a local folder, real saver processes, real gloo ranks. What is measured:
the bytes the staging holds (Store.staging: bound, held, peak), and the process's memory
from /proc (VmRSS; VmHWM, the peak, reset through /proc/self/clear_refs before the put).
A state three times the bound is staged in waves: the staging never holds more than the
bound plus one block, the process's peak grows by far less than the state, and a
checkout gives back the state as it was when put_snapshot returned, bit for bit, though
the caller changed it at once. Memory after many snapshots is memory after the first.
The figures over 100 snapshots, and the stall against the bound: benches/bench_host_memory.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from _util import HELPERS, REPO, Watched, assert_same, child_env, rank_results, run_cli, run_worker_scenario

import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import FaultInjectingStore
from tensorstore_ck.write.staging import default_host_memory

MiB = 1 << 20
BLOCK = 256 * 1024
SAVERS = ["thread", pytest.param("process", marks=pytest.mark.skipif(not hasattr(os, "memfd_create"),
                                                                       reason="the saver needs memfd (Linux)"))]


def status(field: str, pid: str = "self") -> int:
    """A /proc/PID/status field in bytes (VmRSS, VmHWM)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def reset_peak() -> None:
    """VmHWM back to VmRSS (Linux: clear_refs 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def big_state(seed: int, mib: int = 12) -> dict:
    """About `mib` MiB: one tensor over several waves, a few blocks' worth, and small ones
    (packed where pack_size is set), of several dtypes."""
    g = torch.Generator().manual_seed(seed)
    n = (mib - 2) * MiB // 4
    return {"w": torch.randn(n, generator=g),
            "b": torch.randint(-2 ** 40, 2 ** 40, (MiB // 8,), generator=g, dtype=torch.int64),
            "h": torch.randn(MiB // 2, generator=g).to(torch.bfloat16),
            "small": [torch.randn(1000 + i, generator=g) for i in range(40)],
            "step": seed}


def copy_of(state):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else [t.clone() for t in v] if isinstance(v, list) else v)
            for k, v in state.items()}


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "lots", "1GB"])
def test_a_bad_host_memory_is_refused_before_anything_is_made(tmp_path, bad):
    path = tmp_path / "s"
    with pytest.raises(tsck.InvalidArgument, match="host_memory must be"):
        tsck.open_store(path, host_memory=bad)
    assert not path.exists()


def test_the_default_bound_is_the_machines_share(tmp_path, monkeypatch):
    """'auto': a quarter of the memory (MemTotal or the cgroup's limit) per rank of the node."""
    with open("/proc/meminfo") as f:
        mem = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    one = default_host_memory()
    assert 0 < one <= mem // 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_host_memory() in (one // 4, one // 4 - 1, one // 4 + 1)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with tsck.open_store(tmp_path / "a") as s:
        assert s.host_memory == one and s.staging.bound == one
    with tsck.open_store(tmp_path / "b", host_memory=None) as s:
        assert s.host_memory is None


@pytest.mark.parametrize("saver", SAVERS)
def test_a_state_three_times_the_bound_is_staged_in_waves_within_it(tmp_path, saver):
    bound = 4 * MiB
    state = big_state(1)
    with tsck.open_store(tmp_path / "s", host_memory=bound, saver=saver, block_size=BLOCK,
                         pack_size=MiB) as s:
        # A first put (small) starts the saver and the store's pools: the peak is the big one's.
        s.put_snapshot({"x": torch.ones(10)}, ref="j/x", step=0, blocking=False).result()
        want = copy_of(state)
        total = sum(t.nbytes for t in [state["w"], state["b"], state["h"], *state["small"]])
        assert total >= 3 * bound
        before = s.staging
        rss = status("VmRSS")
        reset_peak()
        fut = s.put_snapshot(state, ref="j/m", step=1, blocking=False)
        # The caller's state is its own again at once: changed now, the snapshot is the state as put.
        state["w"].zero_()
        state["small"][3].fill_(7.0)
        info = fut.result()
        grew = status("VmHWM") - rss
        use = s.staging
        assert use.waved == before.waved + 1 and use.waves - before.waves >= 3
        assert use.peak <= bound + BLOCK and use.held <= bound + BLOCK
        # The process's peak: the bound's buffer and the writers' working memory (measured:
        # 4-5 MiB here; staged whole, 12 MiB and more), not the state.
        assert grew < bound + BLOCK + 2 * MiB, f"the put's peak grew {grew} bytes for a state of {total}"
        assert info.stall is not None and info.bytes_total == total
        got = s.checkout("j/m")
        assert_same(want, got)
        assert s.fsck().ok


@pytest.mark.parametrize("saver", SAVERS)
def test_a_block_larger_than_the_bound_is_one_wave_of_its_own(tmp_path, saver):
    """A bound under one block: each wave holds one block, at most the bound plus one block."""
    bound = 100 * 1024
    state = {"w": torch.randn(MiB // 4 * 3), "v": torch.arange(1000)}
    with tsck.open_store(tmp_path / "s", host_memory=bound, saver=saver, block_size=BLOCK) as s:
        s.put_snapshot(state, ref="j/m", step=1, blocking=False).result()
        assert s.staging.peak <= bound + BLOCK and s.staging.waves >= 3
        assert_same(state, s.checkout("j/m"))


class Gate:
    """Holds the writes of blocks while closed (a put stays in flight for as long as the test needs)."""

    def __init__(self):
        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Event()

    def __call__(self, op, key):
        if key.startswith("blocks/") and not self.open.is_set():
            self.entered.set()
            assert self.open.wait(60), "the gate was never opened"
        return False


def test_a_put_past_the_bound_waits_for_the_snapshots_in_flight(tmp_path):
    """max_inflight has a slot free, the bound has not: with when_busy="skip" the put is
    skipped; once the one in flight is written, the next is staged in the buffer it gave back."""
    gate = Gate()
    state = {"w": torch.randn(MiB)}  # 4 MiB
    with tsck.open_store(tmp_path / "s", host_memory=6 * MiB, max_inflight=2, block_size=BLOCK,
                         wrap_storage=lambda st: FaultInjectingStore(st, when=gate)) as s:
        gate.open.clear()
        first = s.put_snapshot(state, ref="j/m", step=1, blocking=False)
        assert gate.entered.wait(60)
        assert s.put_snapshot(state, ref="j/m", step=2, blocking=False, when_busy="skip") is None
        assert s.skipped == 1 and s.staging.held <= 6 * MiB
        gate.open.set()
        first.result()
        second = s.put_snapshot(state, ref="j/m", step=3, blocking=False, when_busy="skip")
        assert second is not None and second.result().step == 3
        assert s.staging.peak <= 6 * MiB
        assert [i.step for i in s.log("j/m")] == [3, 1]


@pytest.mark.parametrize("saver", SAVERS)
def test_memory_after_many_snapshots_is_memory_after_one(tmp_path, saver):
    """Puts of a changing 8 MiB state (under the bound) and of a waved 12 MiB one: the
    staging holds the same bytes after the first and after the last, and so does the
    process's (and the saver's) resident memory, within a few MiB of allocator noise."""
    n = 15
    with tsck.open_store(tmp_path / "s", host_memory=10 * MiB, saver=saver, block_size=BLOCK) as s:
        small = {"w": torch.randn(2 * MiB), "step": 0}
        waved = big_state(2)

        def round_(i):
            small["w"].add_(1.0)
            small["step"] = i
            s.put_snapshot(small, ref="j/small", step=i, blocking=False)
            waved["w"].add_(1.0)
            s.put_snapshot(waved, ref="j/big", step=i, blocking=False)
            s.wait()

        round_(0)
        round_(1)
        held, rss = s.staging.held, status("VmRSS")
        saver_rss = status("VmRSS", str(s._saver.pid)) if saver == "process" else 0
        for i in range(2, n):
            round_(i)
        assert s.staging.held == held and s.staging.peak <= 10 * MiB + BLOCK
        grew = status("VmRSS") - rss
        assert grew < 4 * MiB, f"RSS grew {grew} bytes over {n - 2} rounds of snapshots"
        if saver == "process":
            grew = status("VmRSS", str(s._saver.pid)) - saver_rss
            assert grew < 4 * MiB, f"the saver's RSS grew {grew} bytes over {n - 2} rounds"
        assert_same(small, s.checkout("j/small"))
        assert_same(waved, s.checkout("j/big"))


@pytest.mark.slow
@pytest.mark.parametrize("saver", SAVERS)
def test_two_ranks_memory_stays_flat_and_a_state_past_the_bound_is_refused(tmp_path, saver):
    """2 gloo ranks: asynchronous collective puts hold no more than the bound and their
    memory after many snapshots is that after the first; a rank's state past the bound
    is refused at once (InvalidArgument), and the call aborts on every rank."""
    out = run_worker_scenario(HELPERS / "host_memory_worker.py", tmp_path, "flat", saver, limit=300)
    for r in rank_results(out, "flat", 2):
        assert r["peak"] <= r["bound"], r
        assert r["held_last"] == r["held_first"], r
        assert r["rss_last"] - r["rss_first"] < 4 * MiB, r
        if saver == "process":
            assert r["saver_rss_last"] - r["saver_rss_first"] < 4 * MiB, r
        assert r["restored"], r
    big, small = rank_results(out, "flat", 2)
    assert big["past_bound"].startswith("InvalidArgument"), big
    assert small["past_bound"].startswith("SnapshotAborted"), small


def test_a_waved_put_through_a_local_tier_is_uploaded_whole(tmp_path):
    """With local=: the waves write the tier, the upload sends the snapshot whole."""
    state = big_state(3)
    want = copy_of(state)
    with tsck.open_store(tmp_path / "remote", local=tmp_path / "tier", host_memory=4 * MiB, block_size=BLOCK) as s:
        fut = s.put_snapshot(state, ref="j/m", step=1, blocking=False)
        state["w"].zero_()
        fut.result()
        assert s.wait_durable(timeout=120)
        assert s.staging.waved == 1 and s.staging.peak <= 4 * MiB + BLOCK
        assert_same(want, s.checkout("j/m"))
    with tsck.open_store(tmp_path / "remote") as r:
        assert_same(want, r.checkout("j/m"))
        assert r.fsck().ok


def test_the_package_imports_without_torch():
    """The waves (which copy tensors) load torch where they run, not at the package's
    import: the saver process and `tsck refs` import the package without torch."""
    code = "import sys, tensorstore_ck; sys.exit(3 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=REPO).returncode == 0


def test_a_wave_that_fails_to_write_fails_the_put_itself_and_publishes_nothing(tmp_path):
    """The waves run in the call: a full disk in the second wave is put_snapshot's own
    StorageError (no future), the ref stays where it was, the buffer and slot come back,
    and the next put, the disk freed, publishes."""
    calls = {"n": 0}

    def full_after_some(op, key):
        if op == "put" and key.startswith("blocks/"):
            calls["n"] += 1
            return calls["n"] > 20  # past the first wave's blocks (16 of 256 KiB)
        return False

    state = big_state(4)
    with tsck.open_store(tmp_path / "s", host_memory=4 * MiB, block_size=BLOCK,
                         wrap_storage=lambda st: FaultInjectingStore(st, when=full_after_some)) as s:
        s.put_snapshot({"x": torch.ones(3)}, ref="j/m", step=0)
        before = s.resolve("j/m")
        with pytest.raises(tsck.StorageError):
            s.put_snapshot(state, ref="j/m", step=1, blocking=False)
        assert s.resolve("j/m") == before and s.staging.held <= 4 * MiB
        calls["n"] = -10 ** 9  # the disk freed
        info = s.put_snapshot(state, ref="j/m", step=2, blocking=False).result()
        assert info.step == 2
        assert_same(state, s.checkout("j/m"))



class _HeldAtWave2(Watched):
    """Holds the first block write of the second wave (the 17th block: the first wave is
    16 blocks of a 4 MiB bound, all written before the next is copied) until `go`, and
    says when it got there (`at_wave2`): the first wave's blocks are stored, referenced by
    nothing yet."""

    def __init__(self, inner):
        super().__init__(inner)
        self.lock = threading.Lock()
        self.blocks = 0
        self.at_wave2, self.go = threading.Event(), threading.Event()

    def on_write(self, key):
        if not key.startswith("blocks/"):
            return
        with self.lock:
            self.blocks += 1
            first_of_wave2 = self.blocks == 17
        if first_of_wave2:
            self.at_wave2.set()
            self.go.wait(DEADLINE)


DEADLINE = 120.0  # generous (the machine is shared): an event that never comes fails the test


def test_a_gc_between_two_waves_publishes_the_put_whole_or_aborts_it_and_a_retry_publishes(backend):
    """A waved put (48 blocks, waves of 16) held after its first wave while a real `tsck
    gc` runs in another process. On object storage the first wave's blocks are stored and
    referenced by nothing, so the gc deletes them; the put's ref move is then fenced, and
    since its bytes are no longer held it cannot write them again: SnapshotAborted
    (Publisher.revalidate_written), nothing published. On local files a put's blocks stay
    pending temporary files until its sync, which no gc of this age removes: the put
    publishes whole. Either way the store is fsck-clean, the ref is on a whole snapshot,
    and putting the state again publishes it."""
    g = torch.Generator().manual_seed(5)
    state = {"w": torch.randn(12 * MiB // 4, generator=g)}
    held: list = []
    with backend.open(host_memory=4 * MiB, block_size=BLOCK, saver="thread",
                      wrap_storage=lambda st: held.append(_HeldAtWave2(st)) or held[-1]) as s:
        s.put_snapshot({"x": torch.ones(3)}, ref="j/m", step=0)
        before, log_before = s.resolve("j/m"), [i.root for i in s.log("j/m")]
        gate = held[0]
        put: dict = {}

        def put_it():
            try:
                put["fut"] = s.put_snapshot(state, ref="j/m", step=1, blocking=False)
            except BaseException as e:  # noqa: BLE001 - said by the test below
                put["error"] = e
        t = threading.Thread(target=put_it)
        t.start()
        try:
            assert gate.at_wave2.wait(DEADLINE), "the put never reached its second wave"
            gc = run_cli("gc", backend, "--json", timeout=DEADLINE)
            assert gc.returncode == 0, gc.stderr
        finally:
            gate.go.set()
            t.join(DEADLINE)
        assert not t.is_alive(), "the put did not return once its second wave was let go"
        assert "error" not in put, put.get("error")
        deleted = json.loads(gc.stdout)["deleted_by_kind"].get("blocks", 0)
        if backend.kind == "s3":
            assert deleted >= 16, gc.stdout  # the first wave's, stored and referenced by nothing
        else:
            assert deleted == 0, gc.stdout  # pending until the put's sync
        if deleted:
            with pytest.raises(tsck.SnapshotAborted, match="gc removed .* block"):
                put["fut"].result(timeout=DEADLINE)
            with pytest.raises(tsck.SnapshotAborted):
                s.raise_pending_error()  # (else the next put raises it, once)
            assert s.resolve("j/m") == before and [i.root for i in s.log("j/m")] == log_before
        else:
            info = put["fut"].result(timeout=DEADLINE)
            assert s.resolve("j/m") == info.root and info.blocks_total == 48
            assert_same(state, s.checkout("j/m"))
        report = s.fsck(full=True)
        assert report.ok, report
        info = s.put_snapshot(state, ref="j/m", step=2, blocking=False).result(timeout=DEADLINE)
        assert s.resolve("j/m") == info.root and info.step == 2
        assert_same(state, s.checkout("j/m"))
        assert s.fsck(full=True).ok
