"""The saver process (open_store(saver="process")): an asynchronous put's blocks written by a
child fed through shared memory. What it must keep: the same snapshots bit for bit; the
crash rules of a put (SIGKILL of the saver at any moment: that put fails with SaverDied,
nothing half-published, the next put starts a new saver; SIGKILL of the training process:
the saver exits, the store holds only whole snapshots and resumes); its errors raised as
the put's; and the options it cannot serve refused before anything is written.

Collective puts through saver processes: tests/collective/test_dist_async.py (inflight_saver)."""

from __future__ import annotations

import contextlib
import functools
import os
import random
import select
import signal
import subprocess
import sys
import time

import blake3
import pytest
import torch

from _saver_wrap import BLOCK, open_, state_at
from _util import REPO, assert_same, child_env, object_listing

import tensorstore_ck as tsck
from tensorstore_ck.errors import InvalidArgument, SaverDied, StorageError


def wait_exit(pid: int, timeout: float) -> bool:
    """Whether process `pid` (not our child) exited within `timeout`: an event (pidfd), not a poll."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def saver_files(store) -> int:
    """Temp files the store's writers hold (the saver's blocks not yet named)."""
    tmp = os.path.join(store.url.removeprefix("file://"), "tmp")
    return len(os.listdir(tmp)) if os.path.isdir(tmp) else 0


def test_asynchronous_puts_through_the_saver_are_the_same_snapshots_bit_for_bit(tmp_path):
    with open_(tmp_path / "s") as s:
        info = s.put_snapshot(state_at(0), "j/main", step=0)  # blocking: this process's threads
        assert s._saver.pid is None, "a blocking put must not start the saver"
        st = state_at(1)
        f1 = s.put_snapshot(st, "j/main", step=1, blocking=False)
        st["w"][0].fill_(7.0)  # staged: the snapshot holds the state at its call
        i1 = f1.result(timeout=120)
        saver = s._saver.pid
        assert saver is not None and saver != os.getpid()
        # Below the training process (saver_nice=10): the loop wins the cores.
        assert os.getpriority(os.PRIO_PROCESS, saver) == os.getpriority(os.PRIO_PROCESS, 0) + 10
        f2 = s.put_snapshot(st, "j/main", step=2, blocking=False)  # one tensor changed
        i2 = f2.result(timeout=120)
        assert s._saver.pid == saver and s._saver.started == 1, "the saver is reused between snapshots"
        assert i1.blocks_new > 0 and i2.blocks_new == 1, (i1.blocks_new, i2.blocks_new)
        assert_same(s.checkout(i1.root), state_at(1))
        assert_same(s.checkout("j/main"), st)
        assert_same(s.checkout(info.root), state_at(0))
        assert not s.fsck().findings
    assert wait_exit(saver, 30), "close() stops the saver"


def test_every_address_comes_back_whole_even_one_ending_in_zero_bytes(tmp_path):
    """The saver answers with the blocks' addresses as raw bytes: one whose last byte is 0
    (1 block in 256) must come back 32 bytes long, not stripped (a snapshot of a few
    hundred blocks would otherwise fail to publish)."""
    for k in range(4096):
        t = torch.full((BLOCK // 4,), float(k))
        if blake3.blake3(t.numpy().tobytes()).digest()[-1] == 0:
            break
    else:
        pytest.fail("no block found whose address ends in a zero byte")
    st = {"t": t, "u": t + 1}
    with open_(tmp_path / "s") as s:
        info = s.put_snapshot(st, "j/main", step=1, blocking=False).result(timeout=120)
        assert_same(s.checkout(info.root), st)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by .ci/gpu-check.sh)")
def test_device_tensors_stage_into_page_locked_shared_memory(tmp_path):
    """With CUDA, the shared staging buffers are page-locked in place, so a device tensor's
    copy into one is asynchronous on the side stream as into a pinned buffer; the snapshot
    is the device state bit for bit, and close() unlocks and drops them without error."""
    dev = torch.device("cuda")
    st = {"w": [t.to(dev) for t in state_at(3)["w"]], "b": torch.arange(10, device=dev), "step": 3}
    with open_(tmp_path / "s") as s:
        fut = s.put_snapshot(st, "j/main", step=3, blocking=False)
        st["w"][0].fill_(7.0)  # after the call: not in the snapshot
        torch.cuda.synchronize()
        info = fut.result(timeout=120)
        pool = s._puts.staging
        bufs = list(pool._free)
        assert bufs, "the staging buffer went back to the pool"
        for buf in bufs:
            assert pool.shared_of(buf) is not None and pool.shared_of(buf).pinned
            assert buf.is_pinned(), "a shared staging buffer is page-locked for CUDA"
        got = s.checkout(info.root, map_location=dev)
        assert got["w"][0].device.type == "cuda"
        want = {"w": [t.to(dev) for t in state_at(3)["w"]], "b": torch.arange(10, device=dev), "step": 3}
        assert_same(got, want)
    assert not any(pool.shared_of(b) for b in bufs), "close() let go of every shared buffer"


def test_ctrl_c_is_the_training_processs_to_handle_not_the_savers(tmp_path):
    """An interrupt from a terminal reaches the saver too (one process group): it ignores
    it, and the snapshot in flight commits."""
    with open_(tmp_path / "s") as s:
        s.put_snapshot(state_at(1), "j/main", step=1, blocking=False).result(timeout=120)
        fut = s.put_snapshot(state_at(2), "j/main", step=2, blocking=False)
        os.kill(s._saver.pid, signal.SIGINT)
        assert fut.result(timeout=120).step == 2
        s.put_snapshot(state_at(3), "j/main", step=3, blocking=False).result(timeout=120)
        assert s._saver.started == 1


def test_the_manager_snapshots_through_the_saver(tmp_path):
    with open_(tmp_path / "s") as s:
        model = torch.nn.Linear(64, 64)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        m = tsck.CheckpointManager(s, job="job", state={"model": model, "opt": opt}, every_steps=2, async_=True)
        for step in range(1, 7):
            with torch.no_grad():
                model.weight.add_(1.0)
            m.step(step)
        m.close()
        assert [i.step for i in s.log(m.ref)][:3] == [6, 4, 2]
        assert s._saver.started == 1
        got = s.checkout(m.ref)
        assert torch.equal(got["model"]["weight"], model.weight.detach())


@pytest.mark.parametrize("kw,why", [
    (dict(saver="subprocess"), "saver must be"),
    (dict(saver="process", wrap_storage=lambda st: st), "wrap_storage"),
    (dict(saver="process", saver_nice=20), "saver_nice"),
    (dict(saver="process", saver_nice=True), "saver_nice"),
])
def test_what_a_saver_cannot_serve_is_refused_before_anything_is_written(tmp_path, kw, why):
    with pytest.raises(InvalidArgument, match=why):
        tsck.open_store(tmp_path / "s", **kw)
    assert not (tmp_path / "s").exists()


def test_a_saver_for_a_memory_store_is_refused(tmp_path):
    with pytest.raises(InvalidArgument, match="memory://"):
        tsck.open_store("memory://saver-refused", saver="process")
    with pytest.raises(InvalidArgument, match="memory://"):
        tsck.open_store("memory://saver-refused", local=tmp_path / "tier", saver="process")
    assert not (tmp_path / "tier").exists()


def open_tiered(path, tier, **kw):
    """A float-coded remote behind an lz4 tier, as an object store's is: the saver codes
    each block for the remote as it uploads it."""
    return tsck.open_store(path, local=tier, block_size=BLOCK, inline_threshold=256, compression="float",
                           saver="process", **kw)


def remote_roots(path) -> dict:
    with tsck.open_store(path) as r:
        return {i.step: i.root for i in r.log("j/main")}


def test_a_tiers_uploads_run_in_the_saver_and_arrive_whole(tmp_path):
    """With a local tier, the saver copies the queued snapshots from the tier to the
    remote (the tier's puts write its disk on threads; no early upload): each snapshot
    arrives bit for bit, coded for the remote, and the remote's fsck finds nothing."""
    remote, tier = tmp_path / "remote", tmp_path / "tier"
    with open_tiered(remote, tier) as s:
        up = s._tier.uploader
        assert up.copies.saver is s._saver and not up.early
        assert not s.publisher.executor.shares_memory, "a tier's puts write the tier on threads"
        i1 = s.put_snapshot(state_at(1), "j/main", step=1, blocking=False).result(timeout=120)
        i2 = s.put_snapshot(state_at(2), "j/main", step=2)
        assert s.wait_durable(timeout=120)
        assert s._saver.pid is not None and s._saver.started == 1, "one saver ran both uploads"
        assert up.sent > 0 and up.teed == 0
        assert up.sent_written > 0, "the tier's records of what it wrote reached the saver's copies"
        saver = s._saver.pid
    assert wait_exit(saver, 30), "close() stops the saver"
    assert remote_roots(remote) == {1: i1.root, 2: i2.root}
    with tsck.open_store(remote) as r:
        assert_same(r.checkout(i1.root), state_at(1))
        assert_same(r.checkout(i2.root), state_at(2))
        assert not r.fsck().findings


def test_a_savers_uploads_reuse_its_memory_instead_of_faulting_in_fresh_pages(tmp_path):
    """The saver keeps freed buffers in its heap (saver.py: MALLOC_* in its environment):
    without, glibc returned each block-sized buffer to the kernel and the next one faulted
    fresh pages in, 0.40 faults per 4 KiB uploaded here (2.4 into S3, half the saver's CPU).
    Counted by the kernel (minor faults), not timed."""
    def faults(pid: int) -> int:
        return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[7])
    with tsck.open_store(tmp_path / "remote", local=tmp_path / "tier", compression="float", saver="process") as s:
        per_page = []
        for step in range(4):
            st = {"w": [torch.randn(1 << 20) for _ in range(16)]}  # 64 MiB, every block new
            pid = s._saver.pid
            before = None if pid is None else faults(pid)
            s.put_snapshot(st, "j/main", step=step)
            assert s.wait_durable(timeout=120)
            assert s._saver.pid == pid or pid is None
            if before is not None:
                per_page.append((faults(s._saver.pid) - before) / ((64 << 20) >> 12))
        # The best of three: an upload that spreads over a pool thread new to it grows that
        # thread's arena (fresh pages once, 0.08 per 4 KiB seen under CI's load); without
        # the saver's settings every upload faults (0.40 per 4 KiB here).
        assert min(per_page) < 0.05, per_page


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
def test_the_saver_killed_during_uploads_loses_nothing(tmp_path, seed):
    """SIGKILL of the saver at seeded random moments while it uploads: the upload in
    flight fails with SaverDied and is tried again with a new saver; nothing is moved
    remotely before every object is there, so every snapshot arrives whole."""
    rng = random.Random(seed)
    remote, tier = tmp_path / "remote", tmp_path / "tier"
    with open_tiered(remote, tier, write_bandwidth=4e6) as s:  # uploads long enough to be hit
        infos = [s.put_snapshot(state_at(step), "j/main", step=step) for step in range(1, 5)]
        kills = 0
        while kills < 3 and not s.wait_durable(timeout=0):
            pid = s._saver.pid
            if pid is None:
                time.sleep(0.005)  # waiting for the event "a saver runs"
                continue
            time.sleep(rng.uniform(0.0, 0.3))
            try:
                os.kill(pid, signal.SIGKILL)
                kills += 1
            except ProcessLookupError:
                pass
            wait_exit(pid, 10)
        assert s.wait_durable(timeout=300), "the uploads were tried again and finished"
        up = s._tier.uploader
        assert kills >= 1 and up._failures >= 1, "a kill landed in an upload (its attempt failed)"
        assert isinstance(up._last_failure, SaverDied), up._last_failure
        assert s._saver.started >= 2
    assert remote_roots(remote) == {i.step: i.root for i in infos}
    with tsck.open_store(remote) as r:
        for i in infos:
            assert_same(r.checkout(i.root), state_at(i.step))
        assert not r.fsck().findings


def test_a_stopped_saver_does_not_hold_close_and_the_next_open_uploads(tmp_path, monkeypatch):
    """A saver hung (SIGSTOP) in an upload: close(timeout=) returns about then (the saver
    is killed), the snapshot stays queued in the tier, and the next open uploads it."""
    import tensorstore_ck.write.saver as saver_mod
    monkeypatch.setattr(saver_mod, "SILENCE", 600.0)  # not the heartbeat: close's own bound
    remote, tier = tmp_path / "remote", tmp_path / "tier"
    s = open_tiered(remote, tier, write_bandwidth=1e6)
    first = s.put_snapshot(state_at(1), "j/main", step=1)
    assert s.wait_durable(timeout=120)
    pid = s._saver.pid
    os.kill(pid, signal.SIGSTOP)
    info = s.put_snapshot(state_at(2), "j/main", step=2)
    t0 = time.monotonic()
    with pytest.warns(tsck.SnapshotWarning, match="queued"):
        s.close(timeout=1.0)
    assert time.monotonic() - t0 < 30, "close() waited for a hung saver"
    assert wait_exit(pid, 10), "the hung saver was killed"
    assert remote_roots(remote) == {1: first.root}
    with open_tiered(remote, tier) as s2:
        assert s2.wait_durable(timeout=120)
    assert remote_roots(remote) == {1: first.root, 2: info.root}


def test_a_storage_error_in_the_saver_is_the_puts_error_and_publishes_nothing(tmp_path):
    """A block's directory taken by a file: the saver cannot name the block; the put's future
    and the next put raise that StorageError; the ref stays where it was; the saver lives on."""
    st = state_at(3)
    with open_(tmp_path / "s") as s:
        s.put_snapshot(state_at(0), "j/main", step=0, blocking=False).result(timeout=120)
        first = blake3.blake3(st["w"][0].numpy().tobytes()[:BLOCK]).hexdigest()
        os.makedirs(tmp_path / "s" / "blocks", exist_ok=True)
        (tmp_path / "s" / "blocks" / first[:2]).write_bytes(b"not a folder")
        fut = s.put_snapshot(st, "j/main", step=3, blocking=False)
        with pytest.raises(StorageError):
            fut.result(timeout=120)
        assert [i.step for i in s.log("j/main")] == [0]
        (tmp_path / "s" / "blocks" / first[:2]).unlink()
        with pytest.raises(StorageError):
            s.put_snapshot(st, "j/main", step=4, blocking=False)  # the failure, raised once more
        info = s.put_snapshot(st, "j/main", step=4, blocking=False).result(timeout=120)
        assert s._saver.started == 1, "an error in a job does not cost the saver"
        assert_same(s.checkout(info.root), st)


def test_the_saver_writes_through_the_callers_storage_wrapper(tmp_path):
    """open_store(wrap_storage=) with saver="process": the saver process imports the
    wrapper (by reference) and wraps the storage it writes, so every block an asynchronous
    put writes goes through it, in the saver's process."""
    import _saver_wrap
    book = tmp_path / "ledger"
    with open_(tmp_path / "s", wrap_storage=functools.partial(_saver_wrap.ledger, str(book))) as s:
        st = state_at(5)
        info = s.put_snapshot(st, "j/main", step=5, blocking=False).result(timeout=120)
        saver = s._saver.pid
        assert_same(s.checkout(info.root), st)
    written = {}
    for line in book.read_text().splitlines():
        pid, key = line.split(" ", 1)
        written.setdefault(key, set()).add(int(pid))
    blocks = [k for k in object_listing(tmp_path / "s") if k.startswith("blocks/")]
    assert blocks and all(written.get(k) == {saver} for k in blocks), (saver, written)
    assert any(k.startswith("commits/") and os.getpid() in p for k, p in written.items())  # the commit: here


def test_a_wrappers_fault_in_the_saver_fails_the_put_and_publishes_nothing(tmp_path):
    """A wrapper failing the saver's block writes (not this process's): the put raises
    StorageError, nothing is published, and the store is whole."""
    import _saver_wrap
    with open_(tmp_path / "s", wrap_storage=functools.partial(_saver_wrap.fail_blocks_elsewhere, os.getpid())) as s:
        info = s.put_snapshot(state_at(0), "j/main", step=0)  # blocking: this process writes
        with pytest.raises(StorageError, match="injected"):
            s.put_snapshot(state_at(1), "j/main", step=1, blocking=False).result(timeout=120)
        assert [i.step for i in s.log("j/main")] == [0] and s.resolve("j/main") == info.root
        assert s.fsck().ok


def test_a_wrapper_the_saver_cannot_import_is_refused_at_open(tmp_path):
    def here(st):  # a local function: pickle cannot name it
        return st
    with pytest.raises(InvalidArgument, match="saver process cannot be given it"):
        open_(tmp_path / "s", wrap_storage=here)
    here.__module__, here.__qualname__ = "__main__", "here"
    with pytest.raises(InvalidArgument, match="wrap_storage"):
        open_(tmp_path / "s", wrap_storage=here)
    assert not (tmp_path / "s").exists()


def test_a_wrapper_the_saver_process_fails_to_import_fails_the_put_with_a_clear_error(tmp_path, monkeypatch):
    """A wrapper of a module only this process holds (built at run time): it pickles, and
    the saver cannot import it; the put raises InvalidArgument saying so, nothing is
    published."""
    import types
    ghost = types.ModuleType("tsck_ghost_wrap")
    exec("def wrap(st):\n    return st\n", ghost.__dict__)
    monkeypatch.setitem(sys.modules, "tsck_ghost_wrap", ghost)
    with open_(tmp_path / "s", wrap_storage=ghost.wrap) as s:
        with pytest.raises(InvalidArgument, match="could not load.*tsck_ghost_wrap"):
            s.put_snapshot(state_at(0), "j/main", step=0, blocking=False).result(timeout=120)
        assert s.refs() == {}


@pytest.mark.slow
def test_the_saver_killed_at_random_moments_never_publishes_a_torn_snapshot(tmp_path):
    """Seeded: each round stages a put (its saver writing at a throttled 8 MB/s), kills the
    saver with SIGKILL after a random delay, and judges: the put either committed the
    whole state or raised SaverDied; the ref points at the last committed one; the next
    put starts a new saver; fsck finds nothing wrong at the end. The first round kills
    it once it is seen writing, so a kill mid-write is always among them."""
    rng = random.Random(20261127)
    committed: dict[int, str] = {}
    died = 0
    with open_(tmp_path / "s", write_bandwidth=8e6) as s:
        for step in range(1, 9):
            st = state_at(step)  # ~2.4 MB: ~0.3 s of writes
            fut = s.put_snapshot(st, "j/main", step=step, blocking=False)
            started = s._saver.started
            deadline = time.monotonic() + 60
            while s._saver.pid is None or s._saver.started != started or (step == 1 and not saver_files(s)):
                if fut.done() or time.monotonic() > deadline:
                    break
                time.sleep(0.002)  # waiting for the event "the saver is writing"
            pid = s._saver.pid
            if step > 1:
                time.sleep(rng.uniform(0.0, 0.4))
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                info = fut.result(timeout=120)
                if pid is not None:
                    # The kill may land after the put committed: let it end before the next
                    # put, which otherwise finds a saver dying under it (that put's SaverDied).
                    assert wait_exit(pid, 30)
            except SaverDied as e:
                died += 1
                assert "nothing was published" in str(e)
                with pytest.raises(SaverDied):
                    s.raise_pending_error()  # (the next put would raise it once more)
            else:
                committed[step] = info.root
            if committed:
                last = max(committed)
                assert s.resolve("j/main") == committed[last]
        assert died >= 1, "no kill landed while the saver wrote"
        # The saver comes back for the next put, and the store resumes from what was committed.
        s.put_snapshot(state_at(99), "j/main", step=99, blocking=False).result(timeout=120)
        assert s._saver.started >= died
        for step, root in committed.items():
            assert_same(s.checkout(root), state_at(step))
        report = s.fsck()
        assert not report.findings, report.findings


def test_a_saver_stopped_mid_write_is_killed_after_its_silence_and_the_put_fails(tmp_path, monkeypatch):
    """SIGSTOP (a hung saver): no heartbeat comes; after SILENCE seconds the training
    process kills it and the put fails with SaverDied instead of waiting forever; the
    next put starts a new saver. A saver that only writes slowly keeps beating: a put
    through 0.5 MB/s (longer than SILENCE) still commits."""
    import tensorstore_ck.write.saver as saver_mod
    monkeypatch.setattr(saver_mod, "SILENCE", 3.0)
    with open_(tmp_path / "s", write_bandwidth=0.5e6) as s:
        slow = s.put_snapshot(state_at(1), "j/main", step=1, blocking=False).result(timeout=120)
        assert slow.seconds > 3.0, "the slow put must outlast SILENCE to show the heartbeat"
        fut = s.put_snapshot(state_at(2), "j/main", step=2, blocking=False)
        deadline = time.monotonic() + 60
        while not saver_files(s) and not fut.done() and time.monotonic() < deadline:
            time.sleep(0.002)  # waiting for the event "the saver is writing"
        pid = s._saver.pid
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(SaverDied, match="silent"):
            fut.result(timeout=120)
        assert time.monotonic() - t0 < 30
        assert wait_exit(pid, 10), "the stopped saver was killed"
        with pytest.raises(SaverDied):
            s.raise_pending_error()
        assert s.resolve("j/main") == slow.root
        info = s.put_snapshot(state_at(3), "j/main", step=3, blocking=False).result(timeout=120)
        assert s._saver.started == 2
        assert_same(s.checkout(info.root), state_at(3))


@contextlib.contextmanager
def _trainer(script: str, *args):
    """A training process running SCRIPT with ARGS, killed (SIGKILL) at the block's end:
    yields (its Popen, its saver's pid, its helper's pid, 0 for none), the pids the
    process prints first."""
    proc = subprocess.Popen([sys.executable, "-c", script, *map(str, args)], stdout=subprocess.PIPE,
                            env=child_env(), cwd=REPO)
    try:
        line = proc.stdout.readline().decode()
        assert line.startswith("saver "), line
        saver, helper = map(int, line.split()[1:3])
        yield proc, saver, helper
    finally:
        proc.kill()
        proc.wait()


_TRAINER = r"""
import os, sys, time, torch
sys.path.insert(0, sys.argv[2])
from _saver_wrap import open_, state_at
with open_(sys.argv[1], write_bandwidth=float(sys.argv[3])) as s:
    for step in range(1, 1000):
        f = s.put_snapshot(state_at(step), "j/main", step=step, blocking=False)
        if step == 1:
            f.result()
            helper = os.fork()  # a forked helper (a DataLoader worker) outliving the trainer
            if helper == 0:
                time.sleep(600)
                os._exit(0)
            print("saver", s._saver.pid, helper, flush=True)
        f.add_done_callback(lambda f, step=step: print("committed", step, flush=True)
                            if f.exception() is None else None)
"""


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_training_process_killed_leaves_whole_snapshots_and_its_saver_exits(tmp_path, seed):
    """A training process putting asynchronously through its saver is killed with SIGKILL
    at a random moment after its first commit: its saver exits (the socket's end; a helper
    the trainer forked, still alive, holds no copy of it), the store holds only whole
    snapshots, and the next open resumes from the newest."""
    rng = random.Random(seed)
    with _trainer(_TRAINER, tmp_path / "s", REPO / "tests", "20e6") as (proc, saver, helper):
        want = rng.randint(1, 4)
        seen = 0
        while seen < want:  # the event: that many commits announced
            line = proc.stdout.readline().decode()
            assert line, "the trainer ended early"
            seen += line.startswith("committed")
        time.sleep(rng.uniform(0.0, 0.3))
    try:
        assert wait_exit(saver, 60), "the saver outlived its training process (a forked helper kept its socket?)"
    finally:
        try:
            os.kill(helper, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError):
            pass
    with open_(tmp_path / "s") as s:
        log = s.log("j/main")
        assert len(log) >= want
        for info in log:
            assert_same(s.checkout(info.root), state_at(info.step))
        report = s.fsck()
        assert not report.findings, report.findings
        nxt = log[0].step + 1  # resumes: the next snapshot through a new saver
        s.put_snapshot(state_at(nxt), "j/main", step=nxt, blocking=False).result(timeout=120)
        assert s.log("j/main")[0].step == nxt


@pytest.mark.slow
def test_a_saver_writes_to_an_object_store_as_the_training_process_would(s3_url, s3_server, tmp_path):
    """The saver opens the S3 store from the same URL and storage options (its own client)
    and codes as this process would (compression "auto": the float codec on object stores):
    a snapshot through it equals one through threads, object for object."""
    st = state_at(5)
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server, block_size=BLOCK,
                         inline_threshold=256, saver="process") as s:
        info = s.put_snapshot(st, "j/main", step=5, blocking=False).result(timeout=120)
        assert s._saver.started == 1 and info.blocks_new > 0
        assert_same(s.checkout(info.root), st)
        saver_stored, tree = info.stored_new, s.reftable.catalog_get(bytes.fromhex(info.root))["tree"]
    with tsck.open_store(s3_url + "-threads", refs=str(tmp_path / "refs2.lmdb"), storage_options=s3_server,
                         block_size=BLOCK, inline_threshold=256) as t:
        again = t.put_snapshot(st, "j/main", step=5, blocking=False).result(timeout=120)
        assert t.reftable.catalog_get(bytes.fromhex(again.root))["tree"] == tree, \
            "the same state is the same manifest tree, whoever wrote its blocks"
    assert again.stored_new == saver_stored, "the saver coded the blocks as this process does"


_SLOW_TRAINER = r"""
import os, subprocess, sys, time
sys.path.insert(0, sys.argv[2])
from _saver_wrap import open_, state_at
s = open_(sys.argv[1], write_bandwidth=float(sys.argv[3]))
f = s.put_snapshot(state_at(1), "j/main", step=1, blocking=False)
while s._saver.pid is None:  # started on the publisher's thread
    time.sleep(0.01)
helper = 0
if sys.argv[4] == "holder":  # a child started without the at-fork hooks, holding the saver's socket
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                              pass_fds=[s._saver.conn.fileno()]).pid
print("saver", s._saver.pid, helper, flush=True)
f.result()
print("committed", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("holder", [False, True], ids=["alone", "socket-held-by-a-child"])
def test_the_saver_exits_as_soon_as_its_training_process_dies_mid_write(tmp_path, holder):
    """SIGKILL of the training process while its saver writes a snapshot capped to take
    over a minute (write_bandwidth): the saver is gone long before that write could end
    (its heartbeat's send fails; on Linux the kernel's parent-death signal), having named
    no block of it. With a child of the trainer still holding a copy of the socket (one
    started without the at-fork hooks that close it), no send fails and no EOF comes: the
    parent-death signal alone ends the saver."""
    cap = 25e3  # bytes/s: the state's ~2.3 MB take over 60 s through it
    raw = sum(t.numel() * t.element_size() for t in state_at(1)["w"])
    assert raw / cap > 60
    store = tmp_path / "s"
    with _trainer(_SLOW_TRAINER, store, REPO / "tests", cap, "holder" if holder else "alone") as (proc, saver, helper):
        deadline = time.monotonic() + 120
        while not os.path.isdir(store / "tmp") or not os.listdir(store / "tmp"):  # the event: it writes
            assert time.monotonic() < deadline and proc.poll() is None, "the saver never started writing"
            time.sleep(0.01)
    try:
        # A generous deadline for a loaded machine, a third of the write the cap allows.
        assert wait_exit(saver, 20), "the saver outlived its training process, still writing its blocks"
    finally:
        if helper:
            os.kill(helper, signal.SIGKILL)
    assert not object_listing(store), "the saver named blocks of a snapshot no one will publish"
    with open_(store) as s:
        assert "j/main" not in s.refs()
        s.put_snapshot(state_at(2), "j/main", step=2, blocking=False).result(timeout=120)
        assert_same(s.checkout("j/main"), state_at(2))


def test_a_saver_started_by_a_thread_that_ends_lives_on(tmp_path):
    """The kernel's parent-death signal comes when the thread that started the saver ends,
    though the training process lives on: the saver tells the two apart (its parent pid)
    and keeps serving."""
    import threading
    with open_(tmp_path / "s") as s:
        def start():
            with s._saver.lock:
                s._saver._start("started", "")
        t = threading.Thread(target=start)
        t.start()
        t.join()
        pid = s._saver.pid
        info = s.put_snapshot(state_at(1), "j/main", step=1, blocking=False).result(timeout=120)
        assert s._saver.pid == pid and s._saver.started == 1, "the saver died with the thread that started it"
        assert not wait_exit(pid, 0.5)
        assert_same(s.checkout(info.root), state_at(1))
