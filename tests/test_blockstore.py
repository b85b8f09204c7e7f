"""One conformance suite for every BlockStore: local files, memory://, and s3://
against a real S3-compatible server (radosgw in CI, moto otherwise). The suite's
own checks go around the store under test where they can (the local file
system, s3fs directly)."""

from __future__ import annotations

import errno
import threading
import uuid

import pytest

import tensorstore_ck as tsck
from tensorstore_ck.storage import FsspecBlockStore, LocalBlockStore
from tensorstore_ck.storage.wrappers import FaultInjectingStore, InjectedFault, RetryingStore


@pytest.fixture(params=["local", "memory", pytest.param("s3", marks=pytest.mark.slow)])
def bs(request, tmp_path):
    if request.param == "local":
        yield LocalBlockStore(str(tmp_path / "bs"))
    elif request.param == "memory":
        yield FsspecBlockStore(f"memory://bs-{uuid.uuid4().hex}")
    else:
        opts = request.getfixturevalue("s3_server")
        yield FsspecBlockStore(request.getfixturevalue("s3_url"), opts)


def test_put_if_absent_get_exists_delete(bs):
    assert not bs.exists("blocks/ab/x")
    with pytest.raises(FileNotFoundError):
        bs.get("blocks/ab/x")
    assert bs.put_if_absent("blocks/ab/x", [b"hello ", memoryview(b"world")]) is True
    assert bs.exists("blocks/ab/x")
    assert bs.get("blocks/ab/x") == b"hello world"
    with bs.open_read("blocks/ab/x") as f:
        assert f.read(5) == b"hello"
        buf = bytearray(6)
        assert f.readinto(buf) == 6 and bytes(buf) == b" world"
    # never replaced: a second writer of the key is told it was there
    assert bs.put_if_absent("blocks/ab/x", [b"other"]) is False
    assert bs.get("blocks/ab/x") == b"hello world"
    bs.delete("blocks/ab/x")
    bs.delete("blocks/ab/x")  # absent is not an error
    assert not bs.exists("blocks/ab/x")
    bs.sync()


def test_list_reports_keys_and_sizes(bs):
    for k, n in [("blocks/00/a", 3), ("blocks/ff/b", 10), ("nodes/01/c", 1)]:
        bs.put_if_absent(k, [b"x" * n])
    got = {o.key: o.size for o in bs.list("blocks/")}
    assert got == {"blocks/00/a": 3, "blocks/ff/b": 10}
    assert {o.key for o in bs.list("nodes/")} == {"nodes/01/c"}
    assert list(bs.list("commits/")) == []
    assert all(o.mtime > 0 for o in bs.list("blocks/"))


def test_delete_many_removes_exactly_the_keys_given(bs):
    # 1100 keys: more than one DeleteObjects request (1000 keys each) on s3.
    keys = [f"blocks/{i % 256:02x}/{i:064x}" for i in range(1100)]
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(16) as ex:
        assert all(ex.map(lambda k: bs.put_if_absent(k, [b"x"]), keys))
    bs.delete_many(keys[:1050] + ["blocks/ff/" + "f" * 64])  # one absent key: not an error
    bs.delete_many([])
    assert sorted(o.key for o in bs.list("blocks/")) == sorted(keys[1050:])


def test_racing_writers_of_one_key_have_one_winner(bs):
    """Content-addressed put-if-absent: of 8 threads, exactly one creates the object."""
    results, barrier = [], threading.Barrier(8)

    def put():
        barrier.wait()
        results.append(bs.put_if_absent("blocks/12/race", [b"same content"]))

    ts = [threading.Thread(target=put) for _ in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert sorted(results) == [False] * 7 + [True]
    assert bs.get("blocks/12/race") == b"same content"


def test_retrying_store_retries_transient_errors_only(tmp_path):
    inner = LocalBlockStore(str(tmp_path / "bs"))
    fails = {"n": 0}

    def flaky(op, key):
        if op == "put" and fails["n"] < 3:
            fails["n"] += 1
            return True
        return False

    class Resets(FaultInjectingStore):  # a connection reset, as a network backend reports it
        def put_if_absent(self, key, bufs):
            if self._fault("put", key):
                raise ConnectionResetError(errno.ECONNRESET, "injected reset")
            return self.inner.put_if_absent(key, bufs)

    rs = RetryingStore(Resets(inner, when=flaky), base_delay=0.001, seed=1)
    assert rs.put_if_absent("blocks/aa/k", [b"data"]) is True
    assert rs.retries == 3 and inner.get("blocks/aa/k") == b"data"
    # ENOSPC is not transient: surfaced at once, not retried
    full = RetryingStore(FaultInjectingStore(inner, rules={"put": 1.0}), base_delay=0.001)
    with pytest.raises(InjectedFault) as ei:
        full.put_if_absent("blocks/aa/j", [b"data"])
    assert ei.value.errno == errno.ENOSPC and full.retries == 0


@pytest.mark.slow
def test_store_on_s3_with_postgres_refs(s3_url, s3_server, pg_dsn):
    """The Store end to end on s3:// with the PostgreSQL ref table: round trip,
    dedup, gc, fsck, and credentials never in what it prints."""
    import torch
    s = tsck.open_store(s3_url, refs=pg_dsn, storage_options=s3_server, block_size=64 * 1024)
    try:
        st = {"w": torch.randn(256, 256), "b": torch.arange(10), "meta": {"k": (1, 2.5)}}
        a = s.put_snapshot(st, "job/main", step=1)
        assert a.blocks_new == a.blocks_total > 1
        b = s.put_snapshot(st, "job/main", step=2)
        assert b.blocks_new == 0 and b.bytes_new == 0
        st["w"][0, 0] += 1
        c = s.put_snapshot(st, "job/main", step=3)
        assert c.blocks_new == 1
        out = s.checkout("job/main@1")
        assert torch.equal(out["b"], st["b"]) and out["meta"] == {"k": (1, 2.5)}
        assert torch.equal(s.checkout("job/main")["w"], st["w"])
        s.set_retention("job", tsck.Retention(keep_last=1))
        r = s.gc()
        assert r.expired and r.deleted_by_kind.get("blocks") == 1  # step 1/2's version of the changed block
        rep = s.fsck()
        assert rep.ok and rep.orphans == 0
        with pytest.raises(tsck.RefNotFound):
            s.checkout("job/main@1")
        secret = s3_server["secret"]
        assert secret not in repr(s.storage) and secret not in s.url
    finally:
        s.close()
