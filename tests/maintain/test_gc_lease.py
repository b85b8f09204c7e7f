"""A gc holds the store under a lease it declares; nobody else's clock or setting
decides that it is dead, and it never deletes after the moment another party may
consider it dead (docs/design/gc.md, "The gc lease and the one clock").

- A gc whose renewals stall (a hung ref-table connection, a paused process) stops
  starting delete requests a margin before its lease could run out on the ref
  table's clock; a writer that meanwhile closes the expired lease and commits a
  snapshot reusing condemned blocks loses nothing, and the gc ends with GcBusy.
- Hosts with wrong wall clocks (a gc an hour behind, a writer an hour ahead) share
  a PostgreSQL ref table: the gc's lease is judged on the server's clock, so the
  writer waits for the live gc instead of declaring it dead at once.
"""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.errors import GcBusy
from tensorstore_ck.refs.base import RefTable
from tensorstore_ck.storage.base import check_deadline
from tensorstore_ck.storage.wrappers import WrappedStore

from _backends import Backend  # noqa: E402
from _util import load_helper, run_cli  # noqa: E402

gc_proc = load_helper("gc_proc")
gc_states = gc_proc.load("gc_states")


class StallingRefs(RefTable):
    """The store's real ref table, whose gc renewals hang while `stalled` is set (a
    hung connection to the table, seen from the gc). Everything else goes through."""

    def __init__(self, inner: RefTable):
        self.inner = inner
        self.stalled = threading.Event()
        self.released = threading.Event()

    def _read(self, fn):
        return self.inner._read(fn)

    def _write(self, fn):
        return self.inner._write(fn)

    def gc_heartbeat(self, owner, **kw):
        if self.stalled.is_set():
            self.released.wait()
        return super().gc_heartbeat(owner, **kw)

    def close(self):
        pass  # the writer's Store owns the table


class TimedDeletes(WrappedStore):
    """One delete request per object, `seconds` each (a slow object store); records when
    each request started and ended on the ref table's clock (this host's boot clock)."""

    def __init__(self, inner, seconds: float):
        super().__init__(inner)
        self.seconds = seconds
        self.log: list[tuple[float, float, str]] = []
        self._lock = threading.Lock()

    @property
    def request_timeout(self) -> float:
        return self.inner.request_timeout + self.seconds

    def delete_many(self, keys, *, deadline=None):
        for key in keys:
            check_deadline(deadline)
            t0 = time.clock_gettime(time.CLOCK_BOOTTIME)
            time.sleep(self.seconds)
            self.inner.delete(key)
            with self._lock:
                self.log.append((t0, time.clock_gettime(time.CLOCK_BOOTTIME), key))


def _junk_nodes(path: Path, n: int) -> None:
    """Leftover node objects (what crashed writers leave): valid names, unreachable."""
    for _ in range(n):
        h = secrets.token_hex(32)
        (path / "nodes" / h[:2]).mkdir(parents=True, exist_ok=True)
        (path / "nodes" / h[:2] / h).write_bytes(b"junk")


@pytest.mark.skipif(not hasattr(time, "CLOCK_BOOTTIME"), reason="the LMDB table's lease clock is CLOCK_BOOTTIME")
def test_a_gc_whose_renewals_stall_stops_deleting_before_its_lease_can_run_out(tmp_path):
    lease = 1.0
    path = tmp_path / "store"
    writer = tsck.open_store(str(path), block_size=gc_states.CRASH_BLOCK, inline_threshold=gc_states.CRASH_INLINE)
    refs = StallingRefs(writer.reftable)
    slow: list[TimedDeletes] = []
    gcs = tsck.open_store(str(path), refs=refs, block_size=gc_states.CRASH_BLOCK,
                          inline_threshold=gc_states.CRASH_INLINE,
                          wrap_storage=lambda inner: slow.append(TimedDeletes(inner, 0.01)) or slow[0])
    try:
        writer.set_retention("a", tsck.Retention(keep_last=1))
        x, y = gc_states.crash_state("a", 0), gc_states.crash_state("a", 1)
        writer.put_snapshot(x, ref="a/main", step=0)
        writer.put_snapshot(y, ref="a/main", step=1)  # a@0 expires: its blocks are condemned
        _junk_nodes(path, 600)  # ~0.75 s of node deletes (8 threads), then the blocks
        time.sleep(0.05)

        out: dict = {}

        def run_gc():
            try:
                out["report"] = gcs.gc(lease=lease)
            except BaseException as e:  # noqa: BLE001 - examined below
                out["error"] = e

        t = threading.Thread(target=run_gc)
        t.start()
        while writer.reftable.gc_state()["phase"] != "deleting":
            assert t.is_alive(), out
            time.sleep(0.001)
        refs.stalled.set()  # from now on the gc cannot renew
        time.sleep(lease / 2)  # a renewal already sent has landed by now
        expires = writer.reftable.gc_state()["expires"]

        # The writer reuses a@0's content while the gc is (or was) deleting it. It waits
        # for the lease to run out on the table's clock, closes the deletion epoch,
        # re-validates (re-uploading what the gc already removed) and commits.
        info = writer.put_snapshot(x, ref="a/main", step=2)
        committed = time.clock_gettime(time.CLOCK_BOOTTIME)
        assert committed >= expires, "the writer committed while the gc's lease still ran"
        time.sleep(0.5)  # a gc that went on deleting would be deleting now
        refs.released.set()
        t.join(60)
        assert not t.is_alive()

        late = [(a, b, k) for a, b, k in slow[0].log if b > expires]
        assert not late, (f"{len(late)} delete request(s) ran past the gc's lease (expires {expires:.3f} on the "
                          f"table's clock), e.g. {late[:2]}")
        assert isinstance(out.get("error"), GcBusy), out  # it lost the store and said so
        assert slow[0].log, "the gc deleted nothing: the scenario did not happen"
        rep = writer.fsck(full=True)
        assert rep.ok and not rep.findings, [str(f) for f in rep.findings[:5]]
        assert gc_states.same_bits(x, writer.checkout("a/main"))
        assert writer.log("a/main")[0].root == info.root
    finally:
        refs.released.set()
        gcs.close()
        writer.close()


@pytest.mark.slow
def test_hosts_with_wrong_clocks_share_a_postgresql_ref_table(tmp_path, pg_dsn):
    """The gc runs on a host whose clock is an hour behind, the writer on one an hour
    ahead. Before leases, the writer read the gc's heartbeat as two hours old, closed
    its deletion epoch at once and committed over it; the gc went on deleting the
    reused blocks. Now both judge the lease on PostgreSQL's clock."""
    be = Backend("pg", tmp_path, pg_dsn=pg_dsn)
    store = be.open(block_size=gc_states.CRASH_BLOCK, inline_threshold=gc_states.CRASH_INLINE)
    procs = []
    try:
        store.set_retention("a", tsck.Retention(keep_last=1))
        x, y = gc_states.crash_state("a", 0), gc_states.crash_state("a", 1)
        store.put_snapshot(x, ref="a/main", step=0)
        store.put_snapshot(y, ref="a/main", step=1)
        _junk_nodes(Path(be.url), 600)
        time.sleep(0.05)
        gcp = gc_proc.Proc("skewed.py", [-3600, "gc_once.py", be.spec(), 3.0, "--delete-rate", 300],
                           tmp_path / "gc.err")
        w = gc_proc.Proc("skewed.py", [3600, "put_once.py", be.spec(), "a", 0, 2], tmp_path / "w.err")
        procs += [gcp, w]
        gcp.wait_line("ready", 90)
        w.wait_line("ready", 90)
        gcp.send("go\n")
        while store.reftable.gc_state()["phase"] != "deleting":
            assert gcp.proc.poll() is None, gcp.stderr()[-3000:]
            time.sleep(0.005)
        w.send("go\n")  # the writer reuses a@0's content while the gc deletes it
        assert w.wait(120) == 0, w.stderr()[-3000:]
        rc = gcp.wait(120)
        lines = [line for _, line in gcp.lines]
        assert rc == 0 and lines[-1:] == ["done"], (
            f"the live gc lost its lock to a writer with another clock: {gcp.stderr().strip().splitlines()[-1:]}")
        rep = store.fsck(full=True)
        assert rep.ok and not rep.findings, [str(f) for f in rep.findings[:5]]
        assert gc_states.same_bits(x, store.checkout("a/main"))
    finally:
        for p in procs:
            p.close()
        store.close()


def test_tsck_gc_declares_the_lease_it_was_given(tmp_path):
    path = tmp_path / "s"
    with tsck.open_store(str(path)) as s:
        s.put_snapshot({"w": gc_states.crash_state("a", 0)["own"]}, ref="a/main", step=0)
    bad = run_cli("gc", path, "--lease", "0")
    assert bad.returncode == 2 and "positive number of seconds" in bad.stderr, bad.stderr
    ok = run_cli("gc", path, "--lease", "30")
    assert ok.returncode == 0, ok.stderr
    with tsck.open_store(str(path)) as s:
        st = s.reftable.gc_state()
        assert st["lease"] == 30.0 and st["phase"] == "idle"
        with pytest.raises(tsck.InvalidArgument, match="too short"):
            s.gc(lease=0.1)  # a delete request could outlast it
        assert s.reftable.gc_state()["phase"] == "idle"  # refused before taking the lock


def test_gc_grace_leaves_young_objects_to_a_later_gc(tmp_path):
    """A snapshot in flight has written objects nothing references yet; a gc with a grace
    period leaves them (the writer would otherwise be fenced and re-upload them), and a
    later gc without one removes them if they stay unreferenced."""
    path = tmp_path / "s"
    with tsck.open_store(str(path)) as s:
        s.put_snapshot({"w": torch.zeros(10)}, ref="a/main", step=0)
        young = s.assets.put_block(torch.arange(70000, dtype=torch.int32).numpy().tobytes()).digest
        s.assets.sync()  # named, not yet referenced: the moment between a put's sync and its ref move
        rep = s.gc(grace=3600)
        assert rep.candidates == 0 and s.assets.block_exists(young)
        assert s.reftable.gc_state()["epoch"] == 0  # nothing to delete: no deletion phase, no fence moved
        bad = run_cli("gc", path, "--grace", "-1")
        assert bad.returncode == 2, bad.stderr
        with pytest.raises(tsck.InvalidArgument):
            s.gc(grace=-1)
        rep = s.gc()
        assert rep.deleted_objects == 1 and not s.assets.block_exists(young)
        assert s.fsck().ok
