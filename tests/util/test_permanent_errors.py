"""Errors that no retry cures fail at once; those a retry may cure are retried.

- The rule (tensorstore_ck/util/retry.py, is_transient) on the errors backends raise.
- fsck on an fsspec filesystem with folders (tests/sim/faults.py's faultyfs://, a
  LocalFileSystem subclass) whose reads of one block fail with EIO, as a bad sector's do,
  and a block missing in another snapshot: both snapshots reported, exit 1, in seconds
  (not the 60 s retry budget). gc beside such a block deletes nothing a kept snapshot
  needs; a kept snapshot's unreadable node stops it at once, naming the object.
- Any fsspec filesystem with folders: put, checkout, gc and fsck on dirfs://.
- S3 (the session's real server): an open without credentials, or with a wrong secret,
  fails at once naming the cause; a burst of 500s is still ridden out.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time

import numpy as np
import pytest

import tensorstore_ck as tsck
from tests.sim.faults import FAULTY_ENV, arm_faulty

import _zygote as zygote

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_rule_on_what_backends_raise(tmp_path):
    from tensorstore_ck.util.retry import is_transient
    d = tmp_path / "d"
    d.mkdir()
    real = []
    for call in (lambda: open(d, "rb"), lambda: open(tmp_path / "none", "rb"),
                 lambda: open(tmp_path / "none" / "x", "wb"), lambda: os.mkdir(d),
                 lambda: open(d / "x" / "y", "rb") if (d / "x").write_bytes(b"") is not None else None):
        try:
            call()
        except OSError as e:
            real.append(e)
    assert {type(e) for e in real} == {IsADirectoryError, FileNotFoundError, FileExistsError, NotADirectoryError}
    permanent = real + [OSError(errno.EIO, "bad sector"), PermissionError(errno.EACCES, "denied"),
                        OSError(errno.EPERM, "not permitted"), OSError(errno.ENOSPC, "full"),
                        OSError(errno.EROFS, "read-only"), OSError(errno.EINVAL, "bad")]
    transient = [ConnectionResetError(errno.ECONNRESET, "reset"), TimeoutError("timed out"),
                 OSError(errno.ETIMEDOUT, "timed out"), OSError(errno.EBUSY, "busy"),
                 OSError(errno.EAGAIN, "again"), OSError("a network backend's failure, undescribed")]
    assert [is_transient(e) for e in permanent] == [False] * len(permanent)
    assert [is_transient(e) for e in transient] == [True] * len(transient)
    marked = OSError(errno.EIO, "what a server said")
    marked.transient = True  # a backend that knows (S3: a 500) wins over the errno
    assert is_transient(marked)


def test_s3_client_refusals_are_permanent_and_transport_failures_transient():
    """What S3BlockStore makes of botocore's own exceptions (raised by the client, no
    request sent): refused credentials fail at once as PermissionError naming them."""
    from botocore import exceptions as bx

    from tensorstore_ck.util.retry import is_transient
    from tensorstore_ck.storage.s3 import S3BlockStore
    tr = S3BlockStore._translate
    e = tr(None, bx.NoCredentialsError())
    assert isinstance(e, PermissionError) and not is_transient(e) and "NoCredentialsError" in str(e)
    e = tr(None, bx.PartialCredentialsError(provider="env", cred_var="AWS_SECRET_ACCESS_KEY"))
    assert isinstance(e, PermissionError) and not is_transient(e)
    assert not is_transient(tr(None, bx.ParamValidationError(report="bad")))
    assert not is_transient(tr(None, bx.NoRegionError()))
    for err in (bx.EndpointConnectionError(endpoint_url="http://x"), bx.ReadTimeoutError(endpoint_url="http://x"),
                bx.ConnectTimeoutError(endpoint_url="http://x"), bx.ConnectionClosedError(endpoint_url="http://x")):
        assert is_transient(tr(None, err)), err


# -- a filesystem with folders, one block unreadable -------------------------------------------------
def _state(tag: float) -> dict:
    return {"w": np.full(64 * 1024, tag, dtype=np.float32), "b": np.arange(40_000, dtype=np.int64) + int(tag)}


def _blocks_of(store, root: str) -> list[str]:
    from tensorstore_ck.core.walk import walk_commit
    return sorted({f"blocks/{o.digest.hex()[:2]}/{o.digest.hex()}"
                   for o in walk_commit(store.core.assets, bytes.fromhex(root)) if o.kind == "block"})


def _nodes_of(store, root: str) -> list[str]:
    from tensorstore_ck.core.walk import walk_commit
    return sorted({f"nodes/{o.digest.hex()[:2]}/{o.digest.hex()}"
                   for o in walk_commit(store.core.assets, bytes.fromhex(root)) if o.kind == "node"})


@pytest.fixture
def damaged(tmp_path, monkeypatch):
    """A store on faultyfs:// with snapshots a/main (one block's reads fail with EIO),
    b/main (one block deleted) and c/main (healthy)."""
    ctl = str(tmp_path / "faulty.json")
    monkeypatch.setenv(FAULTY_ENV, ctl)
    url, refs = f"faultyfs://{tmp_path}/store", str(tmp_path / "refs.lmdb")
    with tsck.open_store(url, refs=refs, block_size=64 * 1024) as s:
        roots = {r: s.put_snapshot(_state(i + 1), ref=f"{r}/main", step=1).root for i, r in enumerate("abc")}
        only = {r: set(_blocks_of(s, roots[r])) - {b for o in "abc" if o != r for b in _blocks_of(s, roots[o])}
                for r in "abc"}
    eio, gone = sorted(only["a"])[0], sorted(only["b"])[0]
    os.remove(f"{tmp_path}/store/{gone}")
    arm_faulty(ctl, {f"{tmp_path}/store/{eio}": errno.EIO})
    return {"url": url, "refs": refs, "roots": roots, "eio": eio, "gone": gone, "ctl": ctl, "dir": f"{tmp_path}/store"}


def test_fsck_reports_an_unreadable_block_and_a_missing_one_in_seconds(damaged):
    """The default retry budget (60 s) stays on: EIO is not retried, it is a finding."""
    d = damaged
    env = {**os.environ, "PYTHONPATH": ROOT, "TSCK_REFS": d["refs"]}
    env.pop("TSCK_RETRY_BUDGET", None)
    code = ("import sys, tests.sim.faults; from tensorstore_ck.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    t0 = time.monotonic()
    p = zygote.run([sys.executable, "-c", code, "fsck", d["url"], "--json"], cwd=ROOT, env=env,
                   capture_output=True, text=True, timeout=30)
    took = time.monotonic() - t0
    assert p.returncode == 1, (p.stdout, p.stderr)
    assert took < 20, took
    rep = json.loads(p.stdout)
    by = {(f["problem"], f["snapshot"]) for f in rep["findings"]}
    assert by == {("unreadable", d["roots"]["a"]), ("missing", d["roots"]["b"])}, rep["findings"]
    (u,) = [f for f in rep["findings"] if f["problem"] == "unreadable"]
    assert u["key"] == d["eio"] and u["errno"] == errno.EIO and u["names"] == ["ref:a/main"] and u["path"] == "w"
    (m,) = [f for f in rep["findings"] if f["problem"] == "missing"]
    assert m["key"] == d["gone"] and m["names"] == ["ref:b/main"]
    # the text form names each snapshot and its ref
    p = zygote.run([sys.executable, "-c", code, "fsck", d["url"]], cwd=ROOT, env=env, capture_output=True,
                   text=True, timeout=30)
    assert p.returncode == 1
    for r in "ab":
        assert d["roots"][r][:16] in p.stdout and f"ref:{r}/main" in p.stdout, p.stdout
    assert d["roots"]["c"][:16] not in p.stdout


def test_gc_beside_an_unreadable_object_deletes_nothing_kept(damaged):
    d = damaged
    with tsck.open_store(d["url"], refs=d["refs"]) as s:
        s.set_retention("c", tsck.Retention(keep_last=1))
        s.put_snapshot(_state(10), ref="c/main", step=2)  # c@1 expires: its own blocks are garbage
        t0 = time.monotonic()
        r = s.gc()  # blocks are named by the walk, never read: an unreadable one is kept like any other
        assert time.monotonic() - t0 < 20
        assert r.expired and os.path.exists(f"{d['dir']}/{d['eio']}")
        assert s.fsck().findings and {f.snapshot for f in s.fsck().findings} == {d["roots"]["a"], d["roots"]["b"]}
        # a kept snapshot's node unreadable: its children are unknown, so gc stops before
        # deleting anything, at once, naming the object (never taking it for absent)
        node = _nodes_of(s, d["roots"]["a"])[0]
        arm_faulty(d["ctl"], {f"{d['dir']}/{d['eio']}": errno.EIO, f"{d['dir']}/{node}": errno.EACCES})
        s.set_retention("c", tsck.Retention(keep_last=1))
        s.put_snapshot(_state(11), ref="c/main", step=3)
        before = {p for p, _, fs in os.walk(d["dir"]) for p in [os.path.join(p, f) for f in fs]}
        t0 = time.monotonic()
        with pytest.raises(tsck.UnreadableObject) as ei:
            s.gc()
        assert time.monotonic() - t0 < 20
        assert ei.value.key == node and ei.value.errno == errno.EACCES and "gc stopped" in str(ei.value)
        after = {p for p, _, fs in os.walk(d["dir"]) for p in [os.path.join(p, f) for f in fs]}
        assert {p for p in before - after if "/tmp/" not in p} == set()


def test_any_fsspec_filesystem_with_folders(tmp_path):
    """dirfs:// (a LocalFileSystem subclass): put, checkout, gc and fsck, as on a local path."""
    url, refs = f"dirfs://{tmp_path}/store", str(tmp_path / "refs.lmdb")
    with tsck.open_store(url, refs=refs, block_size=64 * 1024) as s:
        assert s.storage.inner.directories
        s.set_retention("j", tsck.Retention(keep_last=1))
        s.put_snapshot(_state(1), ref="j/main", step=1)
        two = s.put_snapshot(_state(2), ref="j/main", step=2)
        got = s.checkout("j/main")
        assert all(np.array_equal(got[k], _state(2)[k]) for k in ("w", "b"))
        r = s.gc()
        assert r.expired and sum(r.deleted_by_kind.values()) > 0
        rep = s.fsck()
        assert rep.ok and rep.orphans == 0 and rep.snapshots_checked == 1
        assert s.log("j/main")[0].root == two.root
    # no temp file left behind, every object under its folder
    assert not [f for f in os.listdir(tmp_path / "store" / "tmp") if f.endswith(".partial")]


# -- S3: credentials --------------------------------------------------------------------------------
@pytest.fixture
def no_aws_credentials(monkeypatch, tmp_path):
    """Nowhere for botocore to find credentials: no variables, no files, no instance metadata."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.slow
def test_open_store_without_credentials_fails_at_once(tmp_path, s3_server, s3_url, no_aws_credentials):
    opts = {"endpoint_url": s3_server["endpoint_url"]}  # no key, no secret
    t0 = time.monotonic()
    with pytest.raises(tsck.StorageError) as ei:
        tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=opts, retry_budget=60)
    took = time.monotonic() - t0
    assert took < 10, took
    msg = str(ei.value)
    assert "NoCredentialsError" in msg and s3_url in msg and "retry budget" not in msg, msg
    assert ei.value.errno == errno.EACCES


@pytest.mark.slow
def test_open_store_with_a_wrong_secret_fails_at_once(tmp_path, s3_server, s3_url, s3_signatures_checked):
    with s3_signatures_checked() as good:
        t0 = time.monotonic()
        with pytest.raises(tsck.StorageError) as ei:
            tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), retry_budget=60,
                            storage_options={**good, "secret": "tsck-wrong-secret"})
        assert time.monotonic() - t0 < 10
    msg = str(ei.value)
    assert "PermissionError" in msg and "tsck-wrong-secret" not in msg and "retry budget" not in msg, msg


@pytest.mark.slow
def test_a_burst_of_server_errors_is_still_retried(tmp_path, s3_server, s3_url):
    from tests.sim.s3proxy import ThrottleProxy
    import threading
    with ThrottleProxy(s3_server["endpoint_url"]) as proxy:
        with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), retry_budget=60,
                             storage_options={**s3_server, "endpoint_url": proxy.url}) as s:
            # The burst is counted, not timed: every request fails with a 500 until three
            # have, however slowly the machine brings the put's first request.
            proxy.throttle(status=500, code="InternalError", message="We encountered an internal error.")
            done = threading.Event()

            def end_burst():
                while proxy.refused < 3 and not done.wait(0.01):
                    pass
                proxy.throttle(0)
            t = threading.Thread(target=end_burst, daemon=True)
            t.start()
            try:
                s.put_snapshot(_state(1), ref="j/main", step=1)
            finally:
                done.set()
                t.join(60)
            assert proxy.refused >= 3  # it met the 500s, and rode them out
            assert np.array_equal(s.checkout("j/main")["w"], _state(1)["w"])
