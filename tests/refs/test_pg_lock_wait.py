"""Puts behind a PostgreSQL session that holds a ref row's lock while its client is gone.

A network partition right after a client sent the COMMIT of a ref move, the COMMIT lost
with it: the server keeps that session open, idle in its transaction, holding the locks
of the ref move (the ref's row and the reflog sequence every ref move writes). A real
server behind tests/sim/netproxy.py, whose "orphan" fault swallows the COMMIT, kills the
client's side and keeps the server's side open and silent (so TCP keepalives cannot end
it either). Every put then has to end: done once the server ends the orphan session
(the idle_in_transaction_session_timeout the table set on it), or StorageError /
OutcomeUnknown within the retry budget; never a wait without end. Each put runs in a
thread joined with a deadline, so a hang fails the test instead of hanging it."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from pathlib import Path

import psycopg
import pytest

import tensorstore_ck as tsck

from _util import counter_state

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.sim.netproxy import NetProxy  # noqa: E402

T = 1  # the client's connect_timeout (s): lock_timeout 1 s, idle_in_transaction_session_timeout 5 s
BOUND = 30.0  # s: a put that has not ended by then is waiting without end


def _dsn(pg_dsn: str, **kw) -> str:
    from psycopg.conninfo import make_conninfo
    return make_conninfo(pg_dsn, **{"connect_timeout": str(T), **kw})


def _proxied(pg_dsn: str) -> tuple[NetProxy, str]:
    from psycopg.conninfo import conninfo_to_dict
    d = conninfo_to_dict(pg_dsn)
    proxy = NetProxy(int(d.get("port", 5432)), d.get("host", "127.0.0.1"))
    return proxy, _dsn(pg_dsn, host="127.0.0.1", port=str(proxy.port))


def _in_thread(fn):
    box: dict = {}

    def run():
        try:
            box["out"] = fn()
        except BaseException as e:  # noqa: BLE001 - judged by the test
            box["err"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def _ended(t: threading.Thread, what: str, since: float) -> None:
    t.join(max(0.0, since + BOUND - time.monotonic()))
    assert not t.is_alive(), f"{what} still waiting {BOUND:g}s after the lock was taken"


def _orphan_holding_lock(proxy: NetProxy, pg_dsn: str) -> int:
    """Wait until the proxy made an orphan and its server session is idle in its
    transaction holding its transaction's lock (what every waiter queues on); -> its pid."""
    ports = proxy.wait_orphans(1, BOUND)
    assert len(ports) == 1, f"no orphan session ({proxy.orphans} made)"
    deadline = time.monotonic() + BOUND
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        while time.monotonic() < deadline:
            row = c.execute("SELECT a.pid FROM pg_stat_activity a WHERE a.client_port = %s "
                            "AND a.state = 'idle in transaction' AND EXISTS (SELECT 1 FROM pg_locks l "
                            "WHERE l.pid = a.pid AND l.locktype = 'transactionid' AND l.granted)",
                            (ports[0],)).fetchone()
            if row:
                return row[0]
            time.sleep(0.02)
    raise AssertionError("the orphan's server session is not idle in its transaction")


@contextlib.contextmanager
def _two_puts_behind_an_orphan(tmp_path, pg_dsn, budget_a: float, budget_b: float):
    """Client A (through the proxy, retry budget BUDGET_A) puts step 0, then step 1, whose
    COMMIT the proxy swallows: its session is left an orphan holding the ref's row lock.
    Client B (BUDGET_B) puts step 2 to the same ref behind it. Yields (proxy, a, the
    orphan's pid, step 1's outcome, step 2's) once both puts ended within the bound."""
    proxy, via_proxy = _proxied(pg_dsn)
    a = tsck.open_store(str(tmp_path / "store"), refs=via_proxy, retry_budget=budget_a)
    b = None
    try:
        a.put_snapshot(counter_state(0), "a/main", step=0)
        b = tsck.open_store(str(tmp_path / "store"), refs=_dsn(pg_dsn), create=False, retry_budget=budget_b)
        proxy.arm_orphan()
        t1, r1 = _in_thread(lambda: a.put_snapshot(counter_state(1), "a/main", step=1))
        pid = _orphan_holding_lock(proxy, pg_dsn)
        since = time.monotonic()
        t2, r2 = _in_thread(lambda: b.put_snapshot(counter_state(2), "a/main", step=2))
        _ended(t1, "the put whose COMMIT was swallowed", since)
        _ended(t2, "a second client's put to the same ref", since)
        yield proxy, a, pid, r1, r2
    finally:
        proxy.end_orphans()  # on a table without the bounds: lets a hung put end
        proxy.close()
        a.close()
        if b is not None:
            b.close()


@pytest.mark.slow
def test_puts_behind_an_orphan_session_finish_once_the_server_ends_it(tmp_path, pg_dsn):
    """The put whose COMMIT was swallowed retries behind its own orphan session, and a
    second client's put to the same ref waits behind it too; the server ends the orphan
    (idle-in-transaction timeout, set on that session by the table) and both puts are
    published, once each, within the bound. The orphan's move never lands."""
    with _two_puts_behind_an_orphan(tmp_path, pg_dsn, 30, 30) as (proxy, a, pid, r1, r2):
        assert "err" not in r1 and "err" not in r2, (r1, r2)
        assert proxy.wait_orphans_ended(1, 5)
        assert b"idle-in-transaction timeout" in proxy.orphan_words[0], proxy.orphan_words
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            assert c.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()[0] == 0
        assert sorted(i.step for i in a.log("a/main")) == [0, 1, 2]
        assert a.resolve("a/main") in (r1["out"].root, r2["out"].root)
        assert a.fsck().ok


@pytest.mark.slow
def test_puts_behind_an_orphan_session_past_the_budget_fail_clearly(tmp_path, pg_dsn):
    """A retry budget shorter than the orphan's life: the put whose COMMIT was swallowed
    ends in OutcomeUnknown (it cannot tell), a second client's put in a plain StorageError
    naming the lock wait (nothing of it was written), each within the bound; once the
    server has ended the orphan a put goes through, and the swallowed move never landed."""
    with _two_puts_behind_an_orphan(tmp_path, pg_dsn, 1.5, 0.5) as (proxy, a, _pid, r1, r2):
        e1, e2 = r1.get("err"), r2.get("err")
        assert isinstance(e1, tsck.OutcomeUnknown), r1
        assert e1.ref == "a/main"
        assert isinstance(e2, tsck.StorageError) and not isinstance(e2, tsck.OutcomeUnknown), r2
        assert "lock_timeout" in str(e2) and "did not happen" in str(e2), e2
        assert proxy.wait_orphans_ended(1, BOUND)
        info = a.put_snapshot(counter_state(3), "a/main", step=3)
        assert [i.step for i in a.log("a/main")] == [3, 0]
        assert e1.root.hex() not in [i.root for i in a.log("a/main")]  # the caller's check: not published
        assert info.root == a.resolve("a/main") and a.fsck().ok


@pytest.mark.slow
def test_put_behind_another_clients_long_transaction_is_a_clear_error(tmp_path, pg_dsn):
    """A lock held by a session that is not the table's (an operator's open transaction,
    which no timeout of ours ends): the put gives up within its retry budget with a
    StorageError naming the lock wait, publishes nothing, and goes through once the
    lock is released."""
    s = tsck.open_store(str(tmp_path / "store"), refs=_dsn(pg_dsn), retry_budget=0.5)
    try:
        s.put_snapshot(counter_state(0), "a/main", step=0)
        assert s.reftable.lock_waits == 0
        with psycopg.connect(pg_dsn) as op:
            op.execute("SELECT 1 FROM tsck_kv WHERE ns = %s AND tbl = 'meta' AND key = 'reflog_seq' FOR UPDATE",
                       (s.reftable.namespace,))
            since = time.monotonic()
            t, r = _in_thread(lambda: s.put_snapshot(counter_state(1), "a/main", step=1))
            _ended(t, "a put behind an operator's transaction", since)
            e = r.get("err")
            assert isinstance(e, tsck.StorageError) and not isinstance(e, tsck.OutcomeUnknown), r
            assert "lock_timeout" in str(e), e
            assert s.reftable.lock_waits >= 1  # each attempt that gave up on the lock is counted
            op.rollback()
        assert [i.step for i in s.log("a/main")] == [0]
        s.put_snapshot(counter_state(2), "a/main", step=2)
        assert [i.step for i in s.log("a/main")] == [2, 0] and s.fsck().ok
    finally:
        s.close()


def _show(s, name: str) -> str:
    return s.reftable._read(lambda t: (t.cur.execute(f"SHOW {name}"), t.cur.fetchone()[0])[1])


def test_session_bounds_and_what_an_operator_sets(tmp_path, pg_dsn):
    """Each session of the table carries the bounds; a shorter one set on the role stays,
    0 (off) on the role is replaced, and a value the DSN's options give is kept as is."""
    with psycopg.connect(pg_dsn, autocommit=True) as c:
        if not c.execute("SELECT 1 FROM pg_roles WHERE rolname = 'tsck_strict'").fetchone():
            c.execute("CREATE ROLE tsck_strict LOGIN")
        c.execute("ALTER ROLE tsck_strict SET lock_timeout = '300ms'")
        c.execute("ALTER ROLE tsck_strict SET idle_in_transaction_session_timeout = 0")
    s = tsck.open_store(str(tmp_path / "store"), refs=_dsn(pg_dsn), retry_budget=90)
    try:
        assert [_show(s, n) for n in ("lock_timeout", "idle_in_transaction_session_timeout",
                                      "statement_timeout", "tcp_keepalives_idle")] == ["1s", "5s", "90s", "1"]
        with psycopg.connect(pg_dsn, autocommit=True) as c:
            c.execute("GRANT ALL ON tsck_kv TO tsck_strict")
            c.execute("GRANT CREATE ON SCHEMA public TO tsck_strict")  # the table's CREATE ... IF NOT EXISTS
        with tsck.open_store(str(tmp_path / "store"), refs=_dsn(pg_dsn, user="tsck_strict"), create=False) as st:
            assert _show(st, "lock_timeout") == "300ms"  # the operator's shorter rule stands
            assert _show(st, "idle_in_transaction_session_timeout") == "5s"  # off on the role: ours
        with tsck.open_store(str(tmp_path / "store"), refs=_dsn(pg_dsn, options="-c lock_timeout=7s"),
                             create=False) as so:
            assert _show(so, "lock_timeout") == "7s"  # the DSN's own choice
            assert _show(so, "statement_timeout") == "1min"
    finally:
        s.close()
