"""recover under gc: while a rebuild of a lost ref table is unfinished (recover running,
or killed part-way), no gc or prune deletes anything; a recover run again finishes it.

Six refs, the ref table lost, a real `tsck recover` process stopped after it adopted
one commit (tests/helpers/recover_gated.py: its storage waits before the second
commit), then killed -9 or left running beside a `tsck gc`. On LMDB and PostgreSQL
(the latter slow: it needs the session's server).
"""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tensorstore_ck as tsck
import _zygote as zygote
from _backends import Backend, lose_ref_table
from _util import child_env

HERE = Path(__file__).resolve().parents[1]
REPO = HERE.parent
GATED = HERE / "helpers" / "recover_gated.py"
REFS = [f"j/r{i}" for i in range(6)]
SHARED = torch.arange(20000, dtype=torch.float32)  # in every snapshot: what a prune of one would take


@pytest.fixture(params=["file", pytest.param("pg", marks=pytest.mark.slow)])
def where(request, tmp_path) -> Backend:
    if request.param == "pg":
        return Backend("pg", tmp_path, pg_dsn=request.getfixturevalue("pg_dsn"))
    return Backend("file", tmp_path)


def _env(b: Backend) -> dict:
    return child_env(drop=("TSCK_",), **b.cli_env())


def _tsck(b: Backend, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    return zygote.run([sys.executable, "-m", "tensorstore_ck", *args], cwd=REPO, env=_env(b),
                      capture_output=True, text=True, timeout=timeout)


def _six(b: Backend, *, lose: bool = True) -> dict:
    with b.open(create=True) as s:
        for i, ref in enumerate(REFS):
            s.put_snapshot({"shared": SHARED, "own": torch.full((3000,), float(i))}, ref=ref, step=i + 1)
        roots = {ref: s.resolve(ref) for ref in REFS}
        store_id = s.config["id"]
    if lose:
        lose_ref_table(b, store_id)
    return roots


def _wait_for(cond, what: str, proc=None, seconds: float = 120.0) -> None:
    until = time.monotonic() + seconds
    while not cond():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"recover exited {proc.returncode} before {what}: {out}\n{err}")
        assert time.monotonic() < until, f"timed out waiting for {what}"
        time.sleep(0.02)


def _gated_recover(b: Backend, gate: Path) -> subprocess.Popen:
    """A `tsck recover` stopped after adopting one commit (one catalog row written)."""
    gate.mkdir()
    p = zygote.Popen([sys.executable, str(GATED), b.url, str(gate)], cwd=REPO, env=_env(b),
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: (gate / "reached").exists(), "the second commit", p)
        with b.open(read_only=True) as s:
            assert len(s.reftable.catalog_roots()) == 1 and s.reftable.list() == []
            assert s.reftable.rebuild_unfinished()["owner"].startswith("recover:")
    except BaseException:
        p.kill()  # held at its gate, it would outlive the failed test
        p.wait()
        raise
    return p


def _check_all_six(b: Backend, roots: dict) -> None:
    with b.open() as s:
        for i, ref in enumerate(REFS):
            assert s.resolve(ref) == roots[ref]
            got = s.checkout(ref)
            assert torch.equal(got["shared"], SHARED) and torch.equal(got["own"], torch.full((3000,), float(i)))
        assert s.fsck().ok


def _refused(p: subprocess.CompletedProcess) -> None:
    assert p.returncode != 0, p.stdout + p.stderr
    assert "`tsck recover`" in p.stderr and "nothing was deleted" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr


def test_gc_after_a_recover_killed_part_way_refuses_and_a_second_recover_finishes(where, tmp_path):
    roots = _six(where)
    p = _gated_recover(where, tmp_path / "gate")
    p.send_signal(signal.SIGKILL)
    p.communicate()
    before = where.objects()
    _refused(_tsck(where, "gc", where.url))
    _refused(_tsck(where, "gc", "--dry-run", where.url))
    assert where.objects() == before  # nothing deleted
    with where.open() as s:
        with pytest.raises(tsck.RebuildUnfinished, match="tsck recover"):
            s.gc()
    assert where.objects() == before
    # run again, recover finishes the rebuild: all six back, the mark gone, gc as usual
    r = _tsck(where, "recover", where.url)
    assert r.returncode == 0 and "unreadable" not in r.stdout, r.stdout + r.stderr
    _check_all_six(where, roots)
    g = _tsck(where, "gc", where.url)
    assert g.returncode == 0, g.stdout + g.stderr
    with where.open() as s:
        assert s.reftable.rebuild_unfinished() is None
    assert where.objects() == before  # nothing was garbage: every object is a kept snapshot's
    _check_all_six(where, roots)


def test_gc_beside_a_running_recover_deletes_nothing(where, tmp_path):
    roots = _six(where)
    gate = tmp_path / "gate"
    p = _gated_recover(where, gate)
    try:
        before = where.objects()
        _refused(_tsck(where, "gc", where.url))  # cron's gc while recover runs
        assert where.objects() == before
    finally:
        (gate / "open").touch()
        out, err = p.communicate(timeout=300)
    assert p.returncode == 0, out + err
    assert "unreadable" not in out and "6 commits found, 6 catalog rows added" in out, out
    _check_all_six(where, roots)
    g = _tsck(where, "gc", where.url)
    assert g.returncode == 0, g.stdout + g.stderr
    _check_all_six(where, roots)


def test_prune_over_an_unfinished_rebuild_refuses(where, tmp_path):
    roots = _six(where)
    p = _gated_recover(where, tmp_path / "gate")
    p.send_signal(signal.SIGKILL)
    p.communicate()
    with where.open() as s:
        # A job that trains on: a new snapshot without the shared tensor and its rules set
        # again; keep_last=1 expires the adopted commit, whose objects (the shared tensor
        # among them) no snapshot the table knows reaches any more.
        s.put_snapshot({"own": torch.zeros(3000)}, ref="j/new", step=100)
        s.set_retention("j", tsck.Retention(keep_last=1))
        before = where.objects()
        with pytest.raises(tsck.RebuildUnfinished, match=r"prune refused.*`tsck recover`"):
            s.prune("j")
        assert where.objects() == before
        # ... and so does a CheckpointManager's background prune (kept in prune_errors)
        model = torch.nn.Linear(3, 2)
        mgr = tsck.CheckpointManager(s, job="j", ref="j/new", state=tsck.TrainState(model=model), async_=False,
                                     every_steps=1, retention=tsck.Retention(keep_last=1))
        for step in (101, 102):
            mgr.step(step)
        mgr.wait()
        assert mgr.prune_errors and all(isinstance(e, tsck.RebuildUnfinished) for e in mgr.prune_errors)
        assert mgr.last_prune is None
        assert before.items() <= where.objects().items()  # only added to
        mgr.close()
        s.set_retention("j", None)  # recover must not meet rules that expire what it adopts
    r = _tsck(where, "recover", where.url)
    assert r.returncode == 0, r.stdout + r.stderr
    _check_all_six(where, roots)


def test_recover_refuses_while_a_gc_holds_the_store(tmp_path):
    b = Backend("file", tmp_path)
    roots = _six(b, lose=False)  # an operator runs recover over the live table, say
    with b.open() as s:
        s.reftable.gc_begin("gc:elsewhere", lease=300)  # a live gc (of another host, say)
        with pytest.raises(tsck.GcBusy, match=r"recover refused.*`tsck recover` again"):
            s.recover()
        assert s.reftable.rebuild_unfinished() is None
        r = _tsck(b, "recover", b.url)
        assert r.returncode != 0 and "recover refused" in r.stderr and "Traceback" not in r.stderr, r.stderr
        s.reftable.gc_finish("gc:elsewhere")
        s.recover()
        assert s.reftable.rebuild_unfinished() is None
    _check_all_six(b, roots)


def test_a_lost_table_written_to_before_any_recover_refuses_gc(where):
    """A writer goes on over the recreated (LMDB) or emptied (PostgreSQL) table before
    anyone ran recover: the table is no longer empty, but it still lacks six snapshots."""
    roots = _six(where)
    with where.open(create_refs=True) as s:
        s.put_snapshot({"own": torch.zeros(3000)}, ref="j/new", step=100)
        before = where.objects()
        with pytest.raises(tsck.RebuildUnfinished, match=r"found empty.*`tsck recover` first"):
            s.gc()
        assert where.objects() == before
    _refused(_tsck(where, "gc", where.url))
    r = _tsck(where, "recover", where.url)
    assert r.returncode == 0, r.stdout + r.stderr
    g = _tsck(where, "gc", where.url)
    assert g.returncode == 0 and where.objects() == before, g.stdout + g.stderr
    _check_all_six(where, roots)
