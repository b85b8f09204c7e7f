"""Read-only stores.

A store published on a read-only mount opens (read-only, by itself) and every
reading call works: checkout, log, refs, tags, show, du, diff, fsck, REF@STEP,
gc --dry-run. Every write raises ReadOnlyStore before anything is written.
open_store(read_only=True) / `tsck --read-only` on a writable store touches nothing.
A real read-only mount (tmpfs remounted ro: root ignores file modes, not that);
PostgreSQL: a read-only table issues no writes, and its transactions are READ ONLY
on the server.
"""

from __future__ import annotations

import hashlib
import os
import sys

import pytest
import torch

import tensorstore_ck as tsck
import _zygote as zygote
from _mounts import remount, tmpfs
from _util import run_cli


def _state(i: int) -> dict:
    return {"w": torch.arange(20000, dtype=torch.float32) * i, "b": torch.full((300,), i), "i": i}


def _populate(s) -> None:
    for i in range(3):
        s.put_snapshot(_state(i), "a/main", step=i, job="a", metrics={"loss": 1.0 / (i + 1)})
    s.put_snapshot(_state(7), "b/main", step=7, job="b")
    s.tag("t0", "a/main@0")
    s.pin("a/main@1")
    s.set_retention("a", tsck.Retention(keep_last=1))  # gc would expire a/main@... : it must not run


def _reads(s) -> dict:
    """Every reading call; what they return (compared before / after)."""
    out = {
        "checkout": s.checkout("a/main")["i"], "checkout_tag": s.checkout("t0")["w"].sum().item(),
        "log": [i.root for i in s.log("a/main")], "refs": sorted(s.refs()), "tags": sorted(s.tags()),
        "show": s.show("a/main@1").step, "step": s.resolve("a/main@0"), "du": s.du()["snapshots"],
        "diff": len(s.diff("a/main@0", "a/main@2")["changed"]), "retention": sorted(s.retention()),
    }
    rep = s.fsck()
    assert rep.ok and not rep.findings, [str(f) for f in rep.findings]
    out["fsck"] = rep.snapshots_checked
    out["gc_dry"] = sorted(s.gc(dry_run=True).expired)
    return out


def _writes(s) -> list:
    ops = [
        ("put_snapshot", lambda: s.put_snapshot(_state(9), "a/main", step=9, job="a")),
        ("put_snapshot async", lambda: s.put_snapshot(_state(9), "a/main", step=9, blocking=False)),
        ("put_snapshot new ref", lambda: s.put_snapshot({"x": 1}, "c/main")),
        ("tag", lambda: s.tag("t1", "a/main")),
        ("pin", lambda: s.pin("a/main@2")),
        ("unpin", lambda: s.unpin("a/main@1")),
        ("set_retention", lambda: s.set_retention("b", tsck.Retention(keep_last=1))),
        ("gc", lambda: s.gc()),
        ("prune", lambda: s.prune("a")),
        ("recover", lambda: s.recover()),
        ("fsck --repair", lambda: s.fsck(repair=True)),
        # below the Store's own checks: the ref table and the storage refuse too
        ("ref table write", lambda: s.reftable.retention_set("z", None)),
        ("storage write", lambda: s.assets.put_block(b"\1" * 5000)),
        ("storage delete", lambda: s.storage.delete("tsck.json")),
    ]
    # Removal by name (delete_ref / untag / forget, from main): same expectation.
    if hasattr(s, "delete_ref"):
        ops += [("delete_ref", lambda: s.delete_ref("b/main")), ("untag", lambda: s.untag("t0")),
                ("forget", lambda: s.forget("a/main@0"))]
    return ops


def _refuses_every_write(s) -> None:
    for name, op in _writes(s):
        with pytest.raises(tsck.ReadOnlyStore, match="read-only"):
            op()


def _tree(root) -> dict:
    """path -> (size, mtime_ns, sha256) of every file; folders with their mtimes."""
    out = {}
    for d, dirs, files in os.walk(root):
        out[d] = ("dir", os.stat(d).st_mtime_ns)
        for f in files:
            p = os.path.join(d, f)
            st = os.stat(p)
            with open(p, "rb") as fh:
                out[p] = (st.st_size, st.st_mtime_ns, hashlib.sha256(fh.read()).hexdigest())
    return out


@pytest.fixture
def ro_store(tmp_path):
    """A store made on a tmpfs, then the tmpfs remounted read-only."""
    with tmpfs(tmp_path / "mnt", "32m") as mnt:
        path = os.path.join(mnt, "store")
        with tsck.open_store(path) as s:
            _populate(s)
            expected = _reads(s)
        remount(mnt, "ro")
        yield path, expected


def test_a_store_on_a_read_only_mount_opens_read_only_and_reads(ro_store):
    path, expected = ro_store
    with pytest.raises(OSError):  # it is really read-only, for root too
        open(os.path.join(path, "probe"), "wb")
    before = _tree(path)
    with tsck.open_store(path) as s:  # automatically: its files are not writable
        assert s.read_only
        assert _reads(s) == expected
        _refuses_every_write(s)
        assert _reads(s) == expected
    with tsck.open_store(path, read_only=True) as s:
        assert s.read_only and _reads(s) == expected
    assert _tree(path) == before
    # Asked to write there anyway: a clear error that says what to do.
    with pytest.raises(tsck.TsckError, match="read_only=True"):
        tsck.open_store(path, read_only=False)


@pytest.mark.slow
def test_cli_on_a_read_only_mount(ro_store):
    path, _ = ro_store
    for args in (["refs"], ["log", "a/main"], ["show", "t0"], ["du"], ["fsck"], ["diff", "a/main@0", "a/main"],
                 ["gc", "--dry-run"], ["refs", "--read-only"]):
        r = run_cli(args[0], path, *args[1:])
        assert r.returncode == 0 and "Traceback" not in r.stderr, (args, r.stdout, r.stderr)
    for args in (["pin", "a/main"], ["tag", "t9", "a/main"], ["gc"], ["recover"], ["fsck", "--repair"]):
        r = run_cli(args[0], path, *args[1:])
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "read-only" in lines[0], (args, r.returncode, r.stderr)


def test_read_only_true_on_a_writable_store_touches_nothing(tmp_path):
    path = tmp_path / "store"
    with tsck.open_store(path) as s:
        _populate(s)
        expected = _reads(s)
    before = _tree(path)
    with tsck.open_store(path, read_only=True) as s:
        assert s.read_only
        assert _reads(s) == expected
        _refuses_every_write(s)
    after = _tree(path)
    # The one file a read-only open writes is LMDB's lock file: its reader slot keeps a
    # writer elsewhere from reusing the pages being read. Its bytes, and every other
    # file and folder (mtimes included), are as they were.
    lock = str(path / "refs.lmdb" / "lock.mdb")
    assert {k: v for k, v in after.items() if k != lock} == {k: v for k, v in before.items() if k != lock}
    assert after[lock][0] == before[lock][0]
    # A writable open afterwards finds everything as it was, and writes.
    with tsck.open_store(path) as s:
        assert not s.read_only and _reads(s) == expected
        s.put_snapshot(_state(9), "a/main", step=9, job="a")


def test_read_only_never_creates(tmp_path):
    with pytest.raises(tsck.NotAStore, match="no store"):
        tsck.open_store(tmp_path / "new", read_only=True)
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(tsck.NotAStore, match="nothing is created"):
        tsck.open_store(tmp_path / "empty", read_only=True)
    assert os.listdir(tmp_path / "empty") == []
    with pytest.raises(tsck.InvalidArgument):
        tsck.open_store(tmp_path / "empty", read_only="yes")


@pytest.mark.slow
def test_postgres_read_only_issues_no_writes(tmp_path, pg_dsn):
    import psycopg

    path = tmp_path / "store"
    with tsck.open_store(path, refs=pg_dsn) as s:
        _populate(s)
        expected = _reads(s)
        ns = s.reftable.namespace

    def rows():
        with psycopg.connect(pg_dsn) as c:
            return c.execute("SELECT tbl, key, value FROM tsck_kv WHERE ns = %s ORDER BY tbl, key",
                             (ns,)).fetchall()

    before = rows()
    with tsck.open_store(path, refs=pg_dsn, read_only=True) as s:
        assert _reads(s) == expected
        _refuses_every_write(s)
        # Even a write that got past the refusal fails: the server runs the table's
        # transactions READ ONLY.
        with pytest.raises(tsck.TsckError):
            s.reftable._run(lambda t: t.put("meta", b"x", b"y"), False)
    assert rows() == before


_AS_READER = r"""
import sys
import tensorstore_ck as tsck
s = tsck.open_store(sys.argv[1])
assert s.read_only and "not writable" in s._read_only, s._read_only
assert s.reftable.locked is False  # lock.mdb cannot be opened for writing: lock=False
assert s.checkout("a/main")["i"] == 2 and len(s.log("a/main")) == 3 and s.fsck().ok
try:
    s.put_snapshot({"x": 1}, "a/main")
except tsck.ReadOnlyStore:
    print("refused")
s.close()
"""


def test_a_store_published_with_read_only_permissions(tmp_path):
    """Files owned by another user (nobody), mode 644/755; the reader is root without
    its capabilities (setpriv), so the modes bind it: the store opens read-only by
    itself, and LMDB's lock file cannot be opened for writing, so the table is read
    without it (lock=False)."""
    import shutil

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv(1), to run a reader that file modes bind")
    path = tmp_path / "store"
    with tsck.open_store(path) as s:
        _populate(s)
    for d, dirs, files in os.walk(path):
        os.chown(d, 65534, 65534)
        os.chmod(d, 0o755)
        for f in files:
            os.chown(os.path.join(d, f), 65534, 65534)
            os.chmod(os.path.join(d, f), 0o644)
    before = _tree(path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TSCK_"))}
    r = zygote.run(["setpriv", "--inh-caps=-all", "--bounding-set=-all", "--", sys.executable, "-c",
                        _AS_READER, str(path)], capture_output=True, text=True, env=env, timeout=120)
    if r.returncode != 0 and "setpriv:" in r.stderr:
        pytest.skip(f"setpriv cannot drop capabilities here: {r.stderr.strip()}")
    assert r.returncode == 0 and r.stdout.strip() == "refused", r.stdout + r.stderr
    assert _tree(path) == before


@pytest.mark.parametrize("made", [True, False], ids=["tier", "empty"])
def test_a_local_tier_on_a_read_only_mount_is_refused_naming_the_tier(tmp_path, made):
    """A tier on a read-only mount (made before, or an empty directory) is refused with
    ReadOnlyStore naming the tier's path, not the remote's URL, and advising what fits a
    tier: a writable directory, or the store read without local= (never read_only=True
    with local=, which open_store refuses)."""
    remote = str(tmp_path / "remote")
    with tmpfs(tmp_path / "mnt", "16m") as mnt:
        tier = os.path.join(mnt, "tier")
        os.makedirs(tier)
        if made:
            with tsck.open_store(remote, local=tier) as s:
                s.put_snapshot(_state(1), "a/main", step=1)
                assert s.wait_durable(timeout=120)
        remount(mnt, "ro")
        with pytest.raises(tsck.ReadOnlyStore) as e:
            tsck.open_store(remote, local=tier)
        msg = str(e.value)
        assert f"the local tier {tier} cannot be written" in msg and "writable directory" in msg
        assert "without local=" in msg and "open it with read_only=True" not in msg and remote not in msg
