"""The RefTable contract (tensorstore_ck.testing, RefTableTests) and a local tier's table's
(TierTableTests) on every backend: LMDB, its in-memory twin, and PostgreSQL on a real
server (a fresh namespace per test).
Backend-specific tests follow."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pytest

from tensorstore_ck.refs import LmdbRefTable, MemoryRefTable
from tensorstore_ck.testing import RefTableTests, TierTableTests

import _zygote as zygote
from _util import at_once, in_thread


class _Lmdb:
    persistent = True

    @pytest.fixture
    def open_table(self, tmp_path):
        handles = []

        def open_():
            handles.append(LmdbRefTable(str(tmp_path / "refs.lmdb")))
            return handles[-1]

        yield open_
        for h in handles:
            h.close()


class _Memory:
    @pytest.fixture
    def open_table(self):
        t = MemoryRefTable()
        yield lambda: t  # one table, nothing to reopen
        t.close()


class _Postgres:
    persistent = True
    independent_handles = True  # one connection per racing thread: the server serialises

    @pytest.fixture
    def open_table(self, pg_dsn):
        from tensorstore_ck.refs.postgres import PostgresRefTable
        ns, handles = uuid.uuid4().hex, []

        def open_():
            handles.append(PostgresRefTable(pg_dsn, namespace=ns))
            return handles[-1]

        yield open_
        for h in handles:
            h.close()


class TestLmdbRefTable(_Lmdb, RefTableTests):
    pass


class TestMemoryRefTable(_Memory, RefTableTests):
    pass


@pytest.mark.slow
class TestPostgresRefTable(_Postgres, RefTableTests):
    pass


# A local tier's own table (TierTable) lives in its ref table's transactions: the
# embedded table holds it; the others pass the same contract (the remote's table
# records the locations tiered opens verified).
class TestLmdbTierTable(_Lmdb, TierTableTests):
    pass


class TestMemoryTierTable(_Memory, TierTableTests):
    pass


@pytest.mark.slow
class TestPostgresTierTable(_Postgres, TierTableTests):
    pass


_GROW = textwrap.dedent("""
    import os, sys
    import tensorstore_ck.refs.lmdb as L
    L.INITIAL_MAP_SIZE = 256 * 1024      # tiny, so both processes must grow it many times
    t = L.LmdbRefTable(sys.argv[1])
    for i in range(4000):
        t.catalog_put(os.urandom(32), {"pad": b"x" * 300, "i": i})
    t.compare_and_swap("p/" + sys.argv[2], None, os.urandom(32), message="done")
    print(len(list(t.catalog_iter())))
""")


@pytest.mark.slow
def test_lmdb_map_grows_under_two_writer_processes(tmp_path):
    """A full map is grown, not an error, even while another process grows it too."""
    path = str(tmp_path / "refs.lmdb")
    procs = [zygote.Popen([sys.executable, "-c", _GROW, path, str(i)], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]  # 8000 fsynced commits: slow on a busy disk
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    t = LmdbRefTable(path)
    try:
        assert len(list(t.catalog_iter())) == 8000
        assert [n for n, _ in t.list("p/")] == ["p/0", "p/1"]
    finally:
        t.close()
    assert os.path.getsize(os.path.join(path, "data.mdb")) > 8000 * 300


_RACE = textwrap.dedent("""
    import os, sys, time
    from tensorstore_ck.refs.postgres import PostgresRefTable
    from tensorstore_ck.errors import RefConflict
    t = PostgresRefTable(sys.argv[1], namespace=sys.argv[2])
    me, wins = int(sys.argv[3]), 0
    while time.time() < float(sys.argv[4]):
        time.sleep(0.001)
    for i in range(40):
        cur = t.get_or_none("race")
        try:
            t.compare_and_swap("race", cur, os.urandom(32), message=f"{me}:{i}")
            wins += 1
        except RefConflict:
            pass
    print(wins)
""")


@pytest.mark.slow
def test_postgres_cas_race_between_processes(pg_dsn):
    """Several processes racing compare-and-swap on one ref: every move that
    reported success is in the reflog, chained old -> new without a gap."""
    import time
    from tensorstore_ck.refs.postgres import PostgresRefTable
    ns = uuid.uuid4().hex
    start = str(time.time() + 2.0)
    procs = [zygote.Popen([sys.executable, "-c", _RACE, pg_dsn, ns, str(i), start], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) for i in range(4)]
    outs = [p.communicate(timeout=600) for p in procs]  # 8000 fsynced commits: slow on a busy disk
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    wins = sum(int(o[0]) for o in outs)
    t = PostgresRefTable(pg_dsn, namespace=ns)
    log = t.reflog("race")
    assert len(log) == wins and wins >= 40
    for a, b in zip(log, log[1:]):
        assert b.old == a.new  # a linear history: no lost update
    assert t.get("race") == log[-1].new
    t.close()


_GROW_ONCE = textwrap.dedent("""
    import os, sys
    import tensorstore_ck.refs.lmdb as L
    L.INITIAL_MAP_SIZE = 256 * 1024
    t = L.LmdbRefTable(sys.argv[1])
    for i in range(300):  # ~1 MB in 300 commits (each one fsync'd): the map grows past 256 KiB
        t.catalog_put(os.urandom(32), {"pad": b"x" * 3000, "i": i})
    t.close()
""")


def test_lmdb_open_adopts_a_map_another_process_grew_meanwhile(tmp_path, monkeypatch):
    """The window CI once hit: another process grows the map between our
    lmdb.open and the first transaction (open_db). Made deterministic by growing
    it from a child right after lmdb.open returns."""
    import lmdb
    import tensorstore_ck.refs.lmdb as L
    path = str(tmp_path / "refs.lmdb")
    L.LmdbRefTable(path).close()
    monkeypatch.setattr(L, "INITIAL_MAP_SIZE", 256 * 1024)
    real_open = lmdb.open

    def open_then_grow(*a, **kw):
        env = real_open(*a, **kw)
        zygote.run([sys.executable, "-c", _GROW_ONCE, path], check=True, timeout=300)
        return env

    monkeypatch.setattr(L.lmdb, "open", open_then_grow)
    t = L.LmdbRefTable(path)
    monkeypatch.setattr(L.lmdb, "open", real_open)
    try:
        assert t.env.info()["map_size"] > 256 * 1024
        assert len(list(t.catalog_iter())) == 300
    finally:
        t.close()


@pytest.mark.slow
def test_postgres_first_opens_race_to_create_the_table(pg_dsn):
    """Every rank of a job opens the ref table at once, and the first opens of a new
    database all try to create tsck_kv. PostgreSQL's CREATE TABLE IF NOT EXISTS is not
    safe against itself (the losers fail on the catalog's unique index or with
    DuplicateObject): each open must still succeed and the tables agree afterwards."""
    import psycopg
    from tensorstore_ck.refs.postgres import PostgresRefTable
    errors, tables = [], []
    for _ in range(6):
        db = f"tsck_race_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {db}")
        dsn = psycopg.conninfo.make_conninfo(pg_dsn, dbname=db)
        got, failed = at_once(8, lambda: PostgresRefTable(dsn, namespace="race"))
        tables += got
        errors += failed
    try:
        assert not errors, errors
        tables[0].compare_and_swap("r", None, b"\1" * 32, message="after the race")
        assert tables[-1].get_or_none("r") is None  # another database: its own table
    finally:
        for t in tables:
            t.close()


def test_postgres_role_that_cannot_create_the_table_is_told_so(pg_dsn, caplog):
    """A role the server lets in but not create tsck_kv gets a StorageError that says the
    setup was refused, at once, not one that blames the network."""
    import psycopg
    import tensorstore_ck as tsck
    from tensorstore_ck.refs.postgres import PostgresRefTable
    db, role = f"tsck_nocreate_{uuid.uuid4().hex[:12]}", f"tsck_r_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {db}")
        conn.execute(f"CREATE ROLE {role} LOGIN")
    with psycopg.connect(psycopg.conninfo.make_conninfo(pg_dsn, dbname=db), autocommit=True) as conn:
        conn.execute(f"REVOKE CREATE ON SCHEMA public FROM PUBLIC, {role}")
    with pytest.raises(tsck.StorageError, match=r"cannot set up the ref table .*InsufficientPrivilege.*refused creating"):
        PostgresRefTable(psycopg.conninfo.make_conninfo(pg_dsn, dbname=db, user=role), namespace="x")
    assert "retrying" not in caplog.text  # a refusal spends no retry budget


def test_lmdb_table_opened_twice_in_one_process_shares_one_environment(tmp_path):
    """LMDB forbids a second environment on one directory in a process: a second Store on
    a local store in the same process (an evaluator thread, a test) shares the first's.
    Each sees the other's writes, and closing one leaves the other working."""
    import torch
    import tensorstore_ck as tsck
    path = str(tmp_path / "s")
    stores, errors = at_once(4, lambda: tsck.open_store(path))
    assert not errors and len({s.config["id"] for s in stores}) == 1, errors
    a, b, *rest = stores
    info = a.put_snapshot({"x": torch.arange(10)}, ref="r")
    assert b.resolve("r") == info.root
    a.close()
    info2 = b.put_snapshot({"x": torch.arange(11)}, ref="r")
    assert rest[0].resolve("r") == info2.root
    for s in [b, *rest]:
        s.close()
    with tsck.open_store(path) as c:  # all closed: a fresh environment
        assert c.resolve("r") == info2.root


def test_lmdb_read_only_beside_writable_in_one_process(tmp_path):
    """A read-only Store beside a writable one on the same local store reads through the
    shared environment and still refuses writes; a writable open while only a read-only
    one is open is refused with a clear error, and works once that one is closed."""
    import torch
    import tensorstore_ck as tsck
    path = str(tmp_path / "s")
    with tsck.open_store(path) as w:
        info = w.put_snapshot({"x": torch.arange(3)}, ref="r")
        with tsck.open_store(path, read_only=True) as ro:
            assert ro.resolve("r") == info.root
            with pytest.raises(tsck.ReadOnlyStore):
                ro.reftable.compare_and_swap("r", info.root, b"\1" * 32, message="no")
        assert w.resolve("r") == info.root
    ro = tsck.open_store(path, read_only=True)
    with pytest.raises(tsck.StorageError, match="open read-only.*close that one first"):
        tsck.open_store(path)
    ro.close()
    with tsck.open_store(path) as w:
        assert w.resolve("r") == info.root


def test_lmdb_shared_environment_survives_a_fork(tmp_path):
    """Two tables sharing an environment across os.fork(): the child reopens its own once
    and both of its tables work; the parent's are untouched."""
    path = str(tmp_path / "t")
    a, b = LmdbRefTable(path), LmdbRefTable(path)
    a.compare_and_swap("r", None, b"\1" * 32, message="parent")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            b.compare_and_swap("r", b"\1" * 32, b"\2" * 32, message="child")
            code = 0 if a.get_or_none("r") == b"\2" * 32 else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert a.get_or_none("r") == b.get_or_none("r") == b"\2" * 32
    a.close()
    b.close()


@pytest.mark.slow
def test_postgres_first_open_waits_out_a_held_schema_lock_within_its_budget(pg_dsn):
    """The creation lock held by a session that stays (a creator stuck mid-transaction):
    an open waits lock_timeout, tries again within its retry budget, and succeeds once the
    lock is let go; held past the budget, it fails with a StorageError that says so."""
    import time
    import psycopg
    import tensorstore_ck as tsck
    from tensorstore_ck.refs.postgres import _SCHEMA_LOCK, PostgresRefTable
    from tensorstore_ck.util.retry import Backoff

    db = f"tsck_lock_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {db}")
    dsn = psycopg.conninfo.make_conninfo(pg_dsn, dbname=db)
    with psycopg.connect(dsn) as holder:  # a transaction holding the lock until commit
        holder.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
        with pytest.raises(tsck.StorageError, match="cannot set up the ref table .*LockNotAvailable.*retry budget"):
            PostgresRefTable(dsn, namespace="x", connect_timeout=0.5, backoff=Backoff(budget=1.5))
        t, out = in_thread(lambda: PostgresRefTable(dsn, namespace="x", connect_timeout=0.5,
                                                    backoff=Backoff(budget=60.0)))
        with psycopg.connect(dsn, autocommit=True) as look:  # the event: the open waits on the lock
            deadline = time.monotonic() + 60
            while not look.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                                   ).fetchone()[0] and time.monotonic() < deadline:
                time.sleep(0.01)
        holder.commit()  # the lock goes
    t.join()
    assert "error" not in out, out
    table = out["value"]
    table.compare_and_swap("r", None, b"\1" * 32, message="after the wait")
    table.close()


def _hold_every_connection(table, n: int):
    """n calls of `table` that each hold a connection (inside a transaction) until the
    returned event is set; returns once all n are inside."""
    import threading
    gate, inside = threading.Event(), threading.Semaphore(0)

    def hold(_t):
        inside.release()
        gate.wait(120)
    threads = [threading.Thread(target=table._read, args=(hold,), daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for _ in range(n):
        assert inside.acquire(timeout=120), "a holding call never got a connection"
    return gate, threads


def test_postgres_pool_held_by_the_processs_own_calls_is_waited_for_not_renewed(pg_dsn, caplog):
    """Every connection of the pool held by this process's own calls (here 2 of 2, in
    transactions that wait): a third call waits for one within its retry budget, says why,
    and gets it once one is let go. The pool is not replaced, nor the server called down:
    it answers. Held past the budget, the call fails saying the connections were held."""
    import logging
    import time

    import tensorstore_ck as tsck
    from tensorstore_ck.refs.postgres import PostgresRefTable
    from tensorstore_ck.util.retry import Backoff

    table = PostgresRefTable(pg_dsn, namespace=f"held-{uuid.uuid4().hex[:8]}", connect_timeout=1.0, pool_size=2,
                             backoff=Backoff(budget=60.0))
    try:
        table.compare_and_swap("r", None, b"\1" * 32, message="first")
        gate, holders = _hold_every_connection(table, 2)
        pool = table._pool
        with caplog.at_level(logging.WARNING, logger="tensorstore_ck"):
            t, out = in_thread(lambda: table.get_or_none("r"))
            deadline = time.monotonic() + 120  # the event: the call said it waits for a held connection
            while not table.pool_waits and time.monotonic() < deadline:
                time.sleep(0.01)
            assert table.pool_waits, caplog.text
            gate.set()
            t.join(120)
        assert out.get("value") == b"\1" * 32, out
        assert table._pool is pool, "the pool was replaced while the server answered"
        assert "held by this process's calls" in caplog.text and "no connection in" not in caplog.text, caplog.text
        for h in holders:
            h.join(120)
    finally:
        table.close()
    short = PostgresRefTable(pg_dsn, namespace=f"held-{uuid.uuid4().hex[:8]}", connect_timeout=0.5, pool_size=1,
                             backoff=Backoff(budget=1.5))
    try:
        short.get_or_none("r")
        gate, holders = _hold_every_connection(short, 1)
        with pytest.raises(tsck.StorageError, match="all 1 were held by this process's own calls") as e:
            short.get_or_none("r")
        assert "server is down" not in str(e.value)
        gate.set()
        holders[0].join(120)
    finally:
        short.close()
