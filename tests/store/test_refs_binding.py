"""gc with an empty or wrong ref table must never delete the store.

Three ways there: refs.lmdb lost and a scheduled gc runs
before recover; a typo in --refs; $TSCK_REFS exported for another store. Each would open (and create) an empty ref table, and a gc finding nothing kept would
delete every object. So a ref table is created only with its store (or by recover), it is bound
to its store's id, and gc refuses to run over an empty table while storage holds
snapshots.
"""
from __future__ import annotations

import shutil

import pytest
import torch

import tensorstore_ck as tsck

from _util import run_cli



def _objects(path) -> list:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")
                  if p.is_file() and p.parts[len(path.parts)] in ("blocks", "nodes", "commits"))


@pytest.fixture
def two_stores(tmp_path):
    for name in ("a", "b"):
        with tsck.open_store(tmp_path / name) as s:
            for step in range(3):
                s.put_snapshot({"w": torch.full((20000,), float(step)), "n": name}, ref=f"{name}/main", step=step)
    return tmp_path / "a", tmp_path / "b"


def test_lost_ref_table_gc_refuses_and_recover_rebuilds(two_stores):
    a, _b = two_stores
    before = _objects(a)
    shutil.rmtree(a / "refs.lmdb")
    r = run_cli("gc", a)
    assert r.returncode == 2 and "tsck recover" in r.stderr, r.stderr
    assert not (a / "refs.lmdb").exists() and _objects(a) == before
    with pytest.raises(tsck.NotAStore, match="recover"):
        tsck.open_store(a)  # the API does not create it either
    # An empty table made by hand (create_refs=True) still cannot make gc delete the store.
    with tsck.open_store(a, create_refs=True) as s:
        with pytest.raises(tsck.TsckError, match="recover"):
            s.gc()
    assert _objects(a) == before
    r = run_cli("recover", a)
    assert r.returncode == 0, r.stderr
    assert run_cli("gc", a).returncode == 0 and _objects(a) == before  # nothing is garbage
    with tsck.open_store(a, create=False) as s:
        assert s.checkout("a/main")["w"][0].item() == 2.0


def test_a_typo_in_refs_creates_nothing(two_stores):
    a, _b = two_stores
    before = _objects(a)
    r = run_cli("gc", a, "--refs", str(a / "refs.lmbd"))
    assert r.returncode == 2 and "no ref table" in r.stderr, r.stderr
    assert not (a / "refs.lmbd").exists() and _objects(a) == before


def test_another_stores_ref_table_is_refused(two_stores):
    a, b = two_stores
    before = _objects(a)
    for args, env in ((["gc", a], {"TSCK_REFS": str(b / "refs.lmdb")}), (["gc", a, "--refs", b / "refs.lmdb"], {})):
        r = run_cli(*args, env=env)
        assert r.returncode == 2 and "belongs to store" in r.stderr, r.stderr
    assert _objects(a) == before
    with pytest.raises(tsck.NotAStore, match="belongs to store"):
        tsck.open_store(a, refs=str(b / "refs.lmdb"))
    with tsck.open_store(b, create=False) as s:  # b's table is untouched and still b's
        assert [i.step for i in s.log("b/main")] == [2, 1, 0]


@pytest.mark.slow
def test_postgres_ref_table_of_nothing_never_deletes(tmp_path, pg_dsn, two_stores):
    """$TSCK_REFS exported for a PostgreSQL-backed store, then `tsck gc /local/store`:
    the local store's id names an empty namespace; gc refuses instead of deleting."""
    a, _b = two_stores
    before = _objects(a)
    r = run_cli("gc", a, env={"TSCK_REFS": pg_dsn})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "recover" in r.stderr or "no ref table" in r.stderr
    assert _objects(a) == before
