"""The RefTable contract (tests/conformance.py, RefTableTests) on every backend: LMDB,
its in-memory twin, and PostgreSQL on a real server (a fresh namespace per test).
Backend-specific tests follow."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pytest
from conformance import RefTableTests

from tensorstore_ck.refs import LmdbRefTable, MemoryRefTable

import _zygote as zygote


class TestLmdbRefTable(RefTableTests):
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


class TestMemoryRefTable(RefTableTests):
    @pytest.fixture
    def open_table(self):
        t = MemoryRefTable()
        yield lambda: t  # one table, nothing to reopen
        t.close()


@pytest.mark.slow
class TestPostgresRefTable(RefTableTests):
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
