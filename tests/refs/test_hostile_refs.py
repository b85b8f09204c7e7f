"""The ref table and the Store's lifecycle under hostile environments:
a restarted or vanished PostgreSQL server, a commit whose answer is lost, a fork,
use after close, a corrupt LMDB file, an empty ref table over a full store, and
the logging of retries and fences. Real servers, real files, real forks."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import threading
import time

import numpy as np
import pytest

import tensorstore_ck as tsck
from tensorstore_ck.cli import main as cli
from tensorstore_ck.refs.lmdb import LmdbRefTable
from tensorstore_ck.refs.postgres import CHECK_IDLE
from tensorstore_ck.storage.wrappers import RetryingStore, WrappedStore

from _util import counter_state


def _open_pg(tmp_path, dsn: str, **kw) -> tsck.Store:
    return tsck.open_store(str(tmp_path / "store"), refs=dsn, **kw)


# ------------------------------------------------------------------ PostgreSQL
@pytest.mark.slow
def test_pg_restart_between_puts_same_store(tmp_path, pg_server):
    """A server restart (fast shutdown ends every session) between two puts: the same
    Store goes on putting, checking out and listing; only a new Store worked before."""
    s = _open_pg(tmp_path, pg_server.dsn)
    try:
        roots = [s.put_snapshot(counter_state(0), "a/main", step=0).root]
        for i in (1, 2):
            if i == 2:  # idle long enough that the pool checks a connection before handing it out
                time.sleep(CHECK_IDLE + 0.2)
            pg_server.restart()
            roots.append(s.put_snapshot(counter_state(i), "a/main", step=i).root)
            assert s.checkout("a/main")["step"] == i
        pg_server.stop()
        pg_server.start()
        assert [x.root for x in s.log("a/main")] == roots[::-1]
        assert s.resolve("a/main@1") == roots[1]
        assert s.gc().deleted_objects == 0  # the gc lease (server clock) works on new connections too
        assert s.fsck().ok
        # The restarts did end this Store's sessions: a transaction lost its connection and
        # was run again (restart 1), the pool's check found an idle one dead (restart 2).
        assert s.reftable.reconnects >= 1
        assert s.reftable._pool.get_stats().get("connections_lost", 0) >= 1
    finally:
        s.close()


@pytest.mark.slow
def test_pg_server_down_is_storage_error_then_recovers(tmp_path, pg_server):
    """A server that stays down: StorageError naming the ref table, in bounded time (not
    NotAStore, not a hang: the store's retry budget, 5 s here); once it is back the same
    Store works again."""
    s = _open_pg(tmp_path, pg_server.dsn + " connect_timeout=2", retry_budget=5)
    try:
        s.put_snapshot(counter_state(0), "a/main", step=0)
        pg_server.stop()
        for call in (lambda: s.put_snapshot(counter_state(1), "a/main", step=1), lambda: s.checkout("a/main"),
                     lambda: s.log("a/main")):
            t0 = time.monotonic()
            with pytest.raises(tsck.StorageError, match="ref table at postgresql://127.0.0.1") as ei:
                call()
            assert not isinstance(ei.value, tsck.NotAStore)
            assert time.monotonic() - t0 < 20
        pg_server.start()
        s.put_snapshot(counter_state(2), "a/main", step=2)
        assert [i.step for i in s.log("a/main")] == [2, 0]
    finally:
        s.close()
    # Opening against a server that is down is the same StorageError.
    pg_server.stop()
    with pytest.raises(tsck.StorageError, match="ref table"):
        _open_pg(tmp_path, pg_server.dsn + " connect_timeout=1", retry_budget=5)


@pytest.mark.slow
def test_pg_reconnects_at_once_after_a_long_outage(tmp_path, pg_server):
    """The pool's own reconnection backs off (1, 2, 4, 8, 16 s...): after an outage of 20 s
    its next attempt can be 16 s away, past a 5 s retry budget, with the server long back.
    A call that finds no connection renews the pool, which connects at once: the first
    put after the restart succeeds within its budget."""
    s = _open_pg(tmp_path, pg_server.dsn + " connect_timeout=2", retry_budget=5)
    try:
        s.put_snapshot(counter_state(0), "a/main", step=0)
        pg_server.stop()
        down = time.monotonic()
        with pytest.raises(tsck.StorageError, match="ref table at postgresql://127.0.0.1"):
            s.log("a/main")  # the pool finds its connection gone and starts reconnecting
        # The outage is the scenario, not a wait for the code: 20 s of backoff doubling.
        time.sleep(max(0.0, 20.0 - (time.monotonic() - down)))
        pg_server.start()
        # Within its 5 s retry budget, or StorageError: the budget is the bound, not a clock here.
        assert s.put_snapshot(counter_state(1), "a/main", step=1).step == 1
        assert [i.step for i in s.log("a/main")] == [1, 0]
    finally:
        s.close()


@pytest.mark.slow
def test_pg_retry_wait_ends_when_the_stores_retries_stop(pg_server, caplog):
    """A call waiting to retry the ref table (the server down) ends as soon as the
    store's retries are stopped (Backoff.stop: a tiered store's close with its remote
    away), with a StorageError that says why, not when its wait would have ended."""
    from tensorstore_ck.refs.postgres import PostgresRefTable
    from tensorstore_ck.util.retry import Backoff
    backoff = Backoff(budget=3600.0, base_delay=600.0, max_delay=600.0).stoppable()  # waits of 5-15 minutes
    table = PostgresRefTable(pg_server.dsn, namespace="stop", connect_timeout=1.0, backoff=backoff)
    try:
        table.get_or_none("r")
        pg_server.stop()
        with caplog.at_level(logging.WARNING, logger="tensorstore_ck"):
            out = {}

            def call():
                try:
                    out["value"] = table.get_or_none("r")
                except BaseException as e:  # noqa: BLE001 - judged below
                    out["error"] = e
            # daemon: a thread the fix fails to stop must not hold the suite's exit for minutes
            t = threading.Thread(target=call, daemon=True)
            t.start()
            deadline = time.monotonic() + 120  # the event: the call logged its wait to retry
            while not any("retry 1 in" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert any("retry 1 in" in r.getMessage() for r in caplog.records), caplog.text
            backoff.stop.set()
            t.join(timeout=120)  # a bound for a loaded machine; unstopped, the wait is 5-15 minutes
        assert not t.is_alive(), "the retry wait did not end when the retries were stopped"
        assert isinstance(out.get("error"), tsck.StorageError), out
        assert "retries were stopped" in str(out["error"])
    finally:
        pg_server.start()
        table.close()


class _CommitDropper:
    """A TCP proxy in front of the server that, when armed, forwards a transaction's
    COMMIT (of a transaction that moved a ref), lets the server
    answer it, and then drops both connections instead of forwarding the answer: the
    commit landed, the client never hears so."""

    def __init__(self, port: int):
        self.upstream = port
        self.armed = 0
        self.dropped = 0
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(16)
        self.port = self.lsock.getsockname()[1]
        self._lock = threading.Lock()
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._stop:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            u = socket.create_connection(("127.0.0.1", self.upstream))
            st = {"ref_write": False, "drop_reply": False}
            threading.Thread(target=self._up, args=(c, u, st), daemon=True).start()
            threading.Thread(target=self._down, args=(u, c, st), daemon=True).start()

    def _up(self, c, u, st):
        try:
            while data := c.recv(65536):
                if b"reflog_seq" in data:  # only a ref move (compare_and_swap) touches this key
                    st["ref_write"] = True
                if b"COMMIT" in data:
                    with self._lock:
                        if st["ref_write"] and self.armed:
                            self.armed -= 1
                            st["drop_reply"] = True
                    st["ref_write"] = False
                u.sendall(data)
        except OSError:
            pass
        finally:
            _close(c, u)

    def _down(self, u, c, st):
        try:
            while data := u.recv(65536):
                if st["drop_reply"]:  # the server answered the COMMIT: it landed. Say nothing.
                    with self._lock:
                        self.dropped += 1
                    break
                c.sendall(data)
        except OSError:
            pass
        finally:
            _close(c, u)

    def close(self):
        self._stop = True
        self.lsock.close()


def _close(*socks):
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        s.close()


@pytest.mark.slow
def test_pg_lost_commit_answer_is_not_applied_twice(tmp_path, pg_server):
    """The connection drops right after the server committed a ref move: the retry
    finds that it landed (idempotency token), so a conditional put succeeds instead of
    a RefConflict with itself, and an unconditional one is in the history once, not
    chained onto itself a second time."""
    proxy = _CommitDropper(pg_server.port)
    s = _open_pg(tmp_path, f"host=127.0.0.1 port={proxy.port} user=postgres dbname=postgres")
    try:
        r0 = s.put_snapshot(counter_state(0), "a/main", step=0).root
        proxy.armed = 1
        r1 = s.put_snapshot(counter_state(1), "a/main", step=1, expected=r0).root  # conditional
        assert proxy.dropped == 1 and s.reftable.unknown_commits == 1
        proxy.armed = 1
        i2 = s.put_snapshot(counter_state(2), "a/main", step=2)  # unconditional: chains on a lost race
        assert proxy.dropped == 2 and s.reftable.unknown_commits == 2
        assert i2.parent == r1
        assert s.resolve("a/main") == i2.root
        moves = [(e.old.hex() if e.old else None, e.new.hex()) for e in s.reftable.reflog("a/main")]
        assert moves == [(None, r0), (r0, r1), (r1, i2.root)]
        assert [i.step for i in s.log("a/main")] == [2, 1, 0]
        assert s.checkout("a/main")["step"] == 2
    finally:
        s.close()
        proxy.close()
    # The tokens of acknowledged commits are deleted; none is left behind by close().
    import psycopg
    with psycopg.connect(pg_server.dsn) as conn:
        n = conn.execute("SELECT count(*) FROM tsck_kv WHERE tbl = 'txn'").fetchone()[0]
    assert n == 0


# ------------------------------------------------------------------ fork
def _in_forked_child(fn, timeout: float = 30.0) -> tuple[int, str]:
    """Run fn() in a child made by os.fork(); (exit status, what it wrote). A child
    that hangs is killed at `timeout` and the test fails instead of hanging CI."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        code = 0
        try:
            msg = str(fn())
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            msg, code = f"{type(e).__name__}: {e}", 1
        os.write(w, msg.encode()[:4000])
        os._exit(code)
    os.close(w)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(r)
            pytest.fail(f"the forked child hung for {timeout}s")
        time.sleep(0.05)
    out = os.read(r, 4096).decode()
    os.close(r)
    return os.waitstatus_to_exitcode(status), out


def _big(i: int) -> dict:
    """Several blocks: a put runs block jobs on the Store's I/O pool."""
    return {"w": np.arange(600_000, dtype=np.float32) + i, "step": i}


def _child_work(s: tsck.Store, step: int) -> str:
    s.put_snapshot(_big(step), "child/main", step=step)
    fut = s.put_snapshot(_big(step + 1), "child/main", step=step + 1, blocking=False)
    fut.result(timeout=30)
    assert s.checkout("child/main")["step"] == step + 1
    return ",".join(str(i.step) for i in s.log("child/main"))


@pytest.mark.parametrize("busy", [False, True])
def test_store_used_after_fork(store, busy):
    """A Store opened (and used: its pools have threads) before os.fork() works in the
    child: puts (blocking and not), checkout and log; the parent's Store is unharmed
    and sees what the child published. busy: a thread of the parent is inside a ref
    table transaction when fork() is called (a gc renewal, an async put committing):
    the fork waits for it, so the child neither inherits a lock held for good nor a
    half-done LMDB transaction."""
    store.put_snapshot(_big(0), "a/main", step=0)
    store.checkout("a/main")
    release = threading.Event()
    threading.Timer(1.0, release.set).start()  # the holder lets go after a while
    if busy:
        held = threading.Event()

        def hold():
            store.reftable._run(lambda t: (held.set(), release.wait(10)), True)
        th = threading.Thread(target=hold)
        th.start()
        held.wait(10)
    try:
        code, out = _in_forked_child(lambda: _child_work(store, 10))
    finally:
        release.set()
    assert code == 0, out
    assert out == "11,10"
    store.put_snapshot(counter_state(1), "a/main", step=1)
    assert [i.step for i in store.log("child/main")] == [11, 10]
    assert [i.step for i in store.log("a/main")] == [1, 0]
    assert store.fsck().ok


def test_store_used_after_multiprocessing_fork(store):
    """The same through multiprocessing's fork start method (a worker pool of a data
    loader, fork-based checkpointing)."""
    import multiprocessing as mp
    store.put_snapshot(_big(0), "a/main", step=0)
    ctx = mp.get_context("fork")
    q = ctx.Queue()

    def work():
        try:
            q.put(_child_work(store, 20))
        except BaseException as e:  # noqa: BLE001
            q.put(f"{type(e).__name__}: {e}")

    p = ctx.Process(target=work)
    p.start()
    p.join(30)
    if p.is_alive():
        p.kill()
        p.join()
        pytest.fail("the multiprocessing child hung")
    assert q.get(timeout=5) == "21,20"
    assert [i.step for i in store.log("child/main")] == [21, 20]


@pytest.mark.slow
def test_pg_store_used_after_fork(tmp_path, pg_dsn):
    """With a PostgreSQL ref table: the child connects afresh and the parent's sessions
    (which the child must neither use nor close) go on working."""
    def session(t):
        t.cur.execute("SELECT pg_backend_pid()")
        return t.cur.fetchone()[0]

    def sessions(t):  # every client session of the server (this test's process is its only client)
        t.cur.execute("SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend'")
        return {r[0] for r in t.cur.fetchall()}

    s = _open_pg(tmp_path, pg_dsn)
    try:
        s.put_snapshot(_big(0), "a/main", step=0)
        parents = s.reftable._read(sessions)
        code, out = _in_forked_child(lambda: f"{_child_work(s, 30)} {s.reftable._read(session)}")
        assert code == 0, out
        steps, child = out.split()
        assert steps == "31,30"
        assert int(child) not in parents  # the child did not talk on a session of the parent
        s.put_snapshot(_big(1), "a/main", step=1)
        # ... which go on working, untouched (none was found dead by the pool's check).
        assert s.reftable._pool.get_stats().get("connections_lost", 0) == 0
        assert [i.step for i in s.log("child/main")] == [31, 30]
    finally:
        s.close()


# ------------------------------------------------------------------ use after close
def test_every_public_method_of_a_closed_store_raises_store_closed(store_path):
    s = tsck.open_store(store_path)
    r0 = s.put_snapshot(counter_state(0), "a/main", step=0).root
    s.close()
    s.close()  # twice is fine
    assert s.closed
    calls = {
        "put": lambda: s.put_snapshot(counter_state(1), "a/main", step=1),
        "async put": lambda: s.put_snapshot(counter_state(1), "a/main", step=1, blocking=False),
        "checkout": lambda: s.checkout("a/main"),
        "log": lambda: s.log("a/main"),
        "refs": lambda: s.refs(),
        "tags": lambda: s.tags(),
        "tag": lambda: s.tag("t", "a/main"),
        "pin": lambda: s.pin(r0),
        "unpin": lambda: s.unpin(r0),
        "show": lambda: s.show(r0),
        "resolve": lambda: s.resolve("a/main"),
        "diff": lambda: s.diff("a/main", "a/main"),
        "du": lambda: s.du(),
        "gc": lambda: s.gc(),
        "fsck": lambda: s.fsck(),
        "recover": lambda: s.recover(),
        "set_retention": lambda: s.set_retention("a", tsck.Retention(keep_last=1)),
        "retention": lambda: s.retention(),
        "gc_fence": lambda: s.gc_fence(),
        "wait_gc_idle": lambda: s.wait_gc_idle(),
    }
    for what, call in calls.items():
        with pytest.raises(tsck.StoreClosed, match="closed"):
            call()
    # The ref table itself refuses too (a handle kept by a tool after close).
    with pytest.raises(tsck.StoreClosed):
        s.reftable.get_or_none("a/main")
    s.wait()  # nothing in flight: a no-op, not an error


# ------------------------------------------------------------------ corrupt LMDB
def _corrupt_lmdb(path) -> None:
    """Zero every page after the two meta pages of data.mdb (a torn or scribbled file)."""
    data = os.path.join(path, "data.mdb")
    size = os.path.getsize(data)
    with open(data, "r+b") as f:
        f.seek(2 * 4096)
        f.write(b"\0" * (size - 2 * 4096))


def _corrupt_meta(path) -> None:
    with open(os.path.join(path, "data.mdb"), "r+b") as f:
        f.write(b"\xa5" * 8192)


@pytest.mark.parametrize("damage", [_corrupt_lmdb, _corrupt_meta])
def test_corrupt_lmdb_ref_table_says_how_to_rebuild(store_path, capsys, damage):
    s = tsck.open_store(store_path)
    roots = [s.put_snapshot(counter_state(i), "a/main", step=i).root for i in range(3)]
    s.close()
    refs = store_path / "refs.lmdb"
    damage(str(refs))
    with pytest.raises(tsck.FormatError, match="corrupt.*tsck recover"):
        tsck.open_store(store_path)
    for cmd in (["refs"], ["fsck"], ["log", "a/main"], ["gc"]):
        assert cli([cmd[0], str(store_path), *cmd[1:]]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("tsck: error: ") and "tsck recover" in err, err
        assert "mv " in err and "Traceback" not in err
    # What the message says works.
    shutil.move(str(refs), str(refs) + ".corrupt")
    assert cli(["recover", str(store_path)]) == 0
    capsys.readouterr()
    with tsck.open_store(store_path) as s:
        assert [i.root for i in s.log("a/main")] == roots[::-1]


# ------------------------------------------------------------------ tsck refs on an empty table
def test_tsck_refs_on_an_empty_table_over_a_full_store_says_recover(store_path, capsys):
    s = tsck.open_store(store_path)
    s.put_snapshot(counter_state(0), "a/main", step=0)
    store_id = s.config["id"]
    s.close()
    refs = store_path / "refs.lmdb"
    shutil.rmtree(refs)
    t = LmdbRefTable(str(refs))  # an empty table (bound to the store, not born with it)
    t.bind_store(store_id)
    t.close()
    assert cli(["refs", str(store_path)]) == 1
    out = capsys.readouterr().out
    assert "tsck recover" in out and "holds snapshots" in out
    assert cli(["refs", str(store_path), "--json"]) == 1
    assert "tsck recover" in capsys.readouterr().out
    assert cli(["recover", str(store_path)]) == 0
    capsys.readouterr()
    assert cli(["refs", str(store_path)]) == 0
    assert "a/main" in capsys.readouterr().out


def test_tsck_refs_on_a_new_empty_store_is_fine(store_path, capsys):
    tsck.open_store(store_path).close()
    assert cli(["refs", str(store_path)]) == 0
    assert capsys.readouterr().out.strip() == "(no refs)"


# ------------------------------------------------------------------ logging
class _ResetsOnce(WrappedStore):
    """The network: the first object put is reset by the peer."""

    def __init__(self, inner):
        super().__init__(inner)
        self.failed = False

    def put_if_absent(self, key, bufs):
        if not self.failed:
            self.failed = True
            raise ConnectionResetError(104, "Connection reset by peer")
        return self.inner.put_if_absent(key, bufs)


def test_retries_and_fence_waits_are_logged(store_path, caplog):
    """A storage retry is a WARNING; a fence wait and a gc's phases are DEBUG (what the
    store does by itself: INFO is the committed snapshots and restores), and a gc whose
    lease ran out, closed by the writer, a WARNING."""
    caplog.set_level(logging.DEBUG, logger="tensorstore_ck")
    s = tsck.open_store(store_path, wrap_storage=lambda st: RetryingStore(_ResetsOnce(st), base_delay=0.001))
    try:
        s.put_snapshot(counter_state(0), "a/main", step=0)
        retry = [r for r in caplog.records if r.name == "tensorstore_ck.storage.wrappers"]
        assert len(retry) == 1 and retry[0].levelno == logging.WARNING
        assert "ConnectionResetError" in retry[0].getMessage() and "retry 1 in" in retry[0].getMessage()
        assert "retry budget" in retry[0].getMessage()  # how long it will go on, for the operator
        # A gc in its deletion phase whose lease runs out: the writer waits it out, logged.
        s.reftable.gc_begin("test-gc", lease=0.5)
        s.reftable.gc_freeze("test-gc")
        caplog.clear()
        s.put_snapshot(counter_state(1), "a/main", step=1)
        recs = [r for r in caplog.records if r.name == "tensorstore_ck.write.publish"]
        msgs = [r.getMessage() for r in recs]
        (wait,) = [r for r in recs if "waiting for gc test-gc's deletion phase" in r.getMessage()]  # once per wait
        assert wait.levelno == logging.DEBUG, msgs
        assert [r.levelno for r in recs if "lease ran out" in r.getMessage()] == [logging.WARNING], msgs
        caplog.clear()
        s.gc()
        gc = [r for r in caplog.records if r.name == "tensorstore_ck.maintain.gc"]
        phases = " | ".join(r.getMessage() for r in gc)
        assert "began" in phases and "finished" in phases
        assert {r.levelno for r in gc} == {logging.DEBUG}, phases
    finally:
        s.close()
