"""The BlockStore contract (tests/conformance.py, BlockStoreTests) on every backend and
on the wrapped stacks open_store builds: local files, memory://, s3:// against a real
S3-compatible server (radosgw in CI, moto otherwise), each wrapper over a local store,
and the exact `.storage` of real stores. Backend-specific tests follow."""

from __future__ import annotations

import errno
import uuid

import pytest
from conformance import BlockStoreTests

import tensorstore_ck as tsck
from tensorstore_ck.storage import FsspecBlockStore, LocalBlockStore, S3BlockStore
from tensorstore_ck.storage.wrappers import (FaultInjectingStore, InjectedFault, RetryingStore,
                                             ThrottledStore, WrappedStore)


@pytest.fixture
def memory_url():
    """A fresh memory:// location, forgotten afterwards (the memory file system is one
    dict per process)."""
    import fsspec
    url = f"memory://bs-{uuid.uuid4().hex}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url[len("memory://"):]):
        fs.rm(url[len("memory://"):], recursive=True)


class TestLocalBlockStore(BlockStoreTests):
    @pytest.fixture
    def block_store(self, tmp_path):
        s = LocalBlockStore(str(tmp_path / "bs"))
        yield s
        s.close()


class TestMemoryBlockStore(BlockStoreTests):
    @pytest.fixture
    def block_store(self, memory_url):
        s = FsspecBlockStore(memory_url)
        yield s
        s.close()


@pytest.mark.slow
class TestS3BlockStore(BlockStoreTests):
    @pytest.fixture
    def block_store(self, s3_server, s3_url):
        s = S3BlockStore(s3_url, s3_server)
        yield s
        s.close()


# The wrappers over memory://: the wrapper is under test, and no fsync is paid for it.
class TestRetryingStore(BlockStoreTests):
    @pytest.fixture
    def block_store(self, memory_url):
        s = RetryingStore(FsspecBlockStore(memory_url), base_delay=0.001)
        yield s
        s.close()
        assert s.retries == 0  # nothing here is transient


class TestThrottledStore(BlockStoreTests):
    @pytest.fixture
    def block_store(self, memory_url):
        # 64 MiB/s with a 16 MiB bucket: the few-MiB and racing tests wait on it, and
        # 15 racing writers contend for the 3 slots.
        s = ThrottledStore(FsspecBlockStore(memory_url), bytes_per_second=64 * 2**20, max_concurrent=3)
        yield s
        s.close()


class TestFaultInjectingStore(BlockStoreTests):
    @pytest.fixture
    def block_store(self, memory_url):
        s = FaultInjectingStore(FsspecBlockStore(memory_url))  # no rules: no faults
        yield s
        s.close()
        assert s.faults == 0


class TestOpenStoreLocalStorage(BlockStoreTests):
    """The exact stack a local store with write caps uses: ThrottledStore(LocalBlockStore)."""

    @pytest.fixture
    def block_store(self, tmp_path):
        st = tsck.open_store(tmp_path / "store", write_bandwidth=256 * 2**20, write_concurrency=4)
        assert type(st.storage) is ThrottledStore and type(st.storage.inner) is LocalBlockStore
        yield st.storage
        st.close()


class TestOpenStoreMemoryStorage(BlockStoreTests):
    @pytest.fixture
    def block_store(self, memory_url):
        st = tsck.open_store(memory_url)
        assert type(st.storage) is FsspecBlockStore
        yield st.storage
        st.close()


@pytest.mark.slow
class TestOpenStoreS3Storage(BlockStoreTests):
    @pytest.fixture
    def block_store(self, tmp_path, s3_server, s3_url):
        st = tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server)
        assert type(st.storage) is RetryingStore and type(st.storage.inner) is S3BlockStore
        yield st.storage
        st.close()


def test_every_wrapper_is_covered():
    """A new BlockStore wrapper gets a conformance class here."""
    import tensorstore_ck.storage.wrappers as w
    wrappers = {c for c in vars(w).values() if isinstance(c, type) and issubclass(c, WrappedStore)} - {WrappedStore}
    assert wrappers == {RetryingStore, ThrottledStore, FaultInjectingStore}


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


# -- which store open_store builds, and S3's error classification ------------------------
@pytest.mark.slow
def test_open_store_builds_an_s3_block_store_under_its_retry_layer(s3_server, s3_url, tmp_path):
    from tensorstore_ck.storage.wrappers import RetryingStore
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server) as s:
        assert type(s.storage) is RetryingStore and type(s.storage.inner) is S3BlockStore


def test_memory_store_is_the_generic_fsspec_store(memory_url):
    with tsck.open_store(memory_url) as s:
        assert type(s.storage) is FsspecBlockStore
        # the generic store leaves a foreign failure alone: only S3BlockStore knows botocore's
        assert s.storage._translate(RuntimeError("x")) is None


def test_s3_transport_failure_is_an_oserror():
    """A server that refuses connections: ConnectionError (an OSError RetryingStore retries),
    not botocore's EndpointConnectionError."""
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    s = S3BlockStore("s3://bucket/p", {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s"})
    with pytest.raises(OSError) as ei:
        s.exists("blocks/00/" + "0" * 64)
    assert "EndpointConnectionError" in str(ei.value) or isinstance(ei.value, ConnectionError)


@pytest.mark.slow
def test_s3_client_error_is_not_retried_and_server_error_marks_are_s3s(s3_server, s3_url):
    """S3BlockStore marks what S3 said (4xx: not transient); RetryingStore obeys the mark
    and knows nothing of botocore."""
    import time as _time

    from tensorstore_ck.storage.wrappers import RetryingStore
    inner = S3BlockStore(s3_url, s3_server)
    s = RetryingStore(inner, attempts=5, base_delay=0.3)
    t = _time.monotonic()
    with pytest.raises(OSError) as ei:
        s.put_if_absent("k" * 1100, [b"x"])           # an invalid key: a 4xx
    assert getattr(ei.value, "transient", None) is False
    assert _time.monotonic() - t < 0.3                 # no backoff was slept: not retried
