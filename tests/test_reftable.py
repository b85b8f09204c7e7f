"""One conformance suite for every RefTable backend (LMDB and its in-memory twin)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pytest

import tensorstore_ck as tsck
from tensorstore_ck.refs import LmdbRefTable, MemoryRefTable
from tensorstore_ck.errors import Fenced, GcBusy

R = [bytes([i]) * 32 for i in range(8)]


@pytest.fixture(params=["lmdb", "memory", pytest.param("postgres", marks=pytest.mark.slow)])
def table(request, tmp_path):
    if request.param == "postgres":
        from tensorstore_ck.refs.postgres import PostgresRefTable
        t = PostgresRefTable(request.getfixturevalue("pg_dsn"), namespace=uuid.uuid4().hex)
    elif request.param == "lmdb":
        t = LmdbRefTable(str(tmp_path / "refs.lmdb"))
    else:
        t = MemoryRefTable()
    yield t
    t.close()


def test_cas_create_move_and_conflicts(table):
    with pytest.raises(tsck.RefNotFound):
        table.get("a/b")
    table.compare_and_swap("a/b", None, R[1], message="create")
    assert table.get("a/b") == R[1]
    with pytest.raises(tsck.RefConflict) as ei:
        table.compare_and_swap("a/b", None, R[2], message="create again")
    assert (ei.value.expected, ei.value.actual) == (None, R[1].hex())
    with pytest.raises(tsck.RefConflict) as ei:
        table.compare_and_swap("a/b", R[3], R[2], message="stale")
    assert (ei.value.expected, ei.value.actual) == (R[3].hex(), R[1].hex())
    assert table.get("a/b") == R[1]  # a refused move changes nothing
    table.compare_and_swap("a/b", R[1], R[2], message="move", catalog_row={"step": 2})
    assert table.get("a/b") == R[2]
    assert [(e.old, e.new, e.message) for e in table.reflog("a/b")] == [
        (None, R[1], "create"), (R[1], R[2], "move")]
    assert table.catalog_get(R[2]) == {"step": 2}
    assert table.catalog_get(R[1]) is None


def test_list_prefix_and_reflog_isolation(table):
    for i, name in enumerate(["a/x", "a/y", "b/x", "ab"]):
        table.compare_and_swap(name, None, R[i], message="c")
    assert [n for n, _ in table.list("a/")] == ["a/x", "a/y"]
    assert [n for n, _ in table.list()] == ["a/x", "a/y", "ab", "b/x"]
    # "a" is a prefix of "ab" as bytes: reflogs must not bleed into each other
    table.compare_and_swap("a", None, R[5], message="c")
    assert [e.new for e in table.reflog("a")] == [R[5]]


def test_tags_are_immutable_and_disjoint_from_refs(table):
    table.compare_and_swap("r", None, R[1], message="c")
    table.tag_create("t", R[1])
    with pytest.raises(tsck.RefConflict):
        table.tag_create("t", R[2])
    with pytest.raises(tsck.RefConflict):
        table.tag_create("r", R[1])      # a ref has that name
    with pytest.raises(tsck.RefConflict):
        table.compare_and_swap("t", None, R[2], message="c")  # a tag has that name
    assert table.tags() == [("t", R[1])]


def test_pins_retention_catalog_expiry(table):
    for i in range(1, 5):
        table.catalog_put(R[i], {"i": i})
    table.compare_and_swap("r", None, R[1], message="c")
    table.tag_create("t", R[2])
    table.pin(R[3])
    assert table.pins() == {R[3]}
    # tips, tags and pins are never expired, whatever the caller asks
    assert sorted(table.catalog_expire([R[1], R[2], R[3], R[4]])) == [R[4]]
    assert {r for r, _ in table.catalog_iter()} == {R[1], R[2], R[3]}
    table.unpin(R[3])
    assert table.catalog_expire([R[3]]) == [R[3]]
    table.retention_set("job", {"keep_last": 3})
    assert table.retention_all() == {"job": {"keep_last": 3}}
    table.retention_set("job", None)
    assert table.retention_all() == {}
    assert table.catalog_put_if_absent(R[6], {"x": 1}) is True
    assert table.catalog_put_if_absent(R[6], {"x": 2}) is False
    assert table.catalog_get(R[6]) == {"x": 1}
    assert [r for r in table.catalog_prefix(R[6][:2])] == [R[6]]


def test_gc_state_machine_and_fence(table):
    st = table.gc_state()
    assert (st["epoch"], st["phase"]) == (0, "idle")
    table.gc_begin("g1", now=100.0, stale_after=10)
    with pytest.raises(GcBusy):
        table.gc_begin("g2", now=105.0, stale_after=10)  # g1 is alive
    # A writer fenced at epoch 0 may move refs while gc only marks...
    table.compare_and_swap("r", None, R[1], message="c", fence=0)
    st = table.gc_freeze("g1", now=106.0)
    assert (st["epoch"], st["phase"]) == (1, "deleting")
    # ...but not once a deletion phase has started: neither with the old fence nor the odd one
    for fence in (0, 1):
        with pytest.raises(Fenced):
            table.compare_and_swap("r", R[1], R[2], message="m", fence=fence)
    assert table.get("r") == R[1]
    st = table.gc_finish("g1", now=107.0)
    assert (st["epoch"], st["phase"]) == (2, "idle")
    with pytest.raises(Fenced):
        table.compare_and_swap("r", R[1], R[2], message="m", fence=0)
    table.compare_and_swap("r", R[1], R[2], message="m", fence=2)
    # A gc that died in its deletion phase: the next gc, or a writer, closes the epoch once stale.
    table.gc_begin("g3", now=200.0, stale_after=10)
    table.gc_freeze("g3", now=201.0)
    assert table.gc_abort_stale(now=205.0, stale_after=10)["epoch"] == 3  # still fresh: untouched
    assert table.gc_abort_stale(now=215.0, stale_after=10)["epoch"] == 4
    with pytest.raises(GcBusy):
        table.gc_heartbeat("g3", now=216.0)  # the dead gc lost its lock
    table.gc_begin("g4", now=300.0, stale_after=10)
    table.gc_freeze("g4", now=301.0)
    st = table.gc_begin("g5", now=400.0, stale_after=10)  # takes over a stale deleting gc
    assert st["epoch"] % 2 == 0 and st["owner"] == "g5"


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
    procs = [subprocess.Popen([sys.executable, "-c", _GROW, path, str(i)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
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
    procs = [subprocess.Popen([sys.executable, "-c", _RACE, pg_dsn, ns, str(i), start], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1] for o in outs]
    wins = sum(int(o[0]) for o in outs)
    t = PostgresRefTable(pg_dsn, namespace=ns)
    log = t.reflog("race")
    assert len(log) == wins and wins >= 40
    for a, b in zip(log, log[1:]):
        assert b.old == a.new  # a linear history: no lost update
    assert t.get("race") == log[-1].new
    t.close()
