"""The BlockStore contract (tensorstore_ck.testing, BlockStoreTests) on every backend and
on the wrapped stacks open_store builds: local files, memory://, s3:// against a real
S3-compatible server (radosgw in CI, moto otherwise), each wrapper over a local store,
and the exact `.storage` of real stores. Backend-specific tests follow."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import tests.sim.faults  # noqa: F401 - registers dirfs:// (a filesystem with folders)

import tensorstore_ck as tsck
from tensorstore_ck.testing import BlockStoreTests
from tensorstore_ck.storage import FsspecBlockStore, LocalBlockStore, S3BlockStore
from tensorstore_ck.storage.wrappers import (FaultInjectingStore, InjectedFault, ReadOnlyStorage, RetryingStore,
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


class TestDirectoryFsspecBlockStore(BlockStoreTests):
    """The generic fsspec store on a filesystem with real folders (a LocalFileSystem
    subclass registered as dirfs://, as a user registers a share): folders are made as
    writes need them, objects are named whole."""

    @pytest.fixture
    def block_store(self, tmp_path):
        s = FsspecBlockStore(f"dirfs://{tmp_path}/bs")
        assert s.directories
        yield s
        s.close()


class TestFsspecDirFileSystem(BlockStoreTests):
    """fsspec's own DirFileSystem (protocol dir://, a folder of another filesystem as the
    root): folders made as writes need them. Over a local filesystem its paths are this
    host's once joined to its folder, so an object is named by an exclusive hard link: of
    racing creators of one key exactly one is told it made it (tags, markers)."""

    @pytest.fixture
    def block_store(self, tmp_path):
        s = FsspecBlockStore("dir://bs", {"path": str(tmp_path), "target_protocol": "file"})
        assert s.directories and type(s.fs).__name__ == "DirFileSystem"
        yield s
        s.close()


class TestOpenStoreDirectoryFsspecStorage(BlockStoreTests):
    """The exact stack open_store builds for such a URL: RetryingStore(FsspecBlockStore)."""

    @pytest.fixture
    def block_store(self, tmp_path):
        st = tsck.open_store(f"dirfs://{tmp_path}/store", refs=str(tmp_path / "refs.lmdb"))
        assert type(st.storage) is RetryingStore and type(st.storage.inner) is FsspecBlockStore
        yield st.storage
        st.close()


class OnS3(BlockStoreTests):
    """The contract on S3, where the server decides each race (If-None-Match): a few
    rounds tell (see BlockStoreTests)."""
    RACE_ROUNDS = 12


@pytest.mark.slow
class TestS3BlockStore(OnS3):

    @pytest.fixture
    def block_store(self, s3_server, s3_url):
        s = S3BlockStore(s3_url, s3_server)
        yield s
        s.close()


@pytest.mark.slow
class TestS3BlockStoreSmallPages(OnS3):
    """The contract again with pages of 3 keys: every listing crosses page boundaries."""

    test_racing_put_if_absent_has_exactly_one_winner = None  # blind to the page size: TestS3BlockStore races

    @pytest.fixture
    def block_store(self, s3_server, s3_url):
        s = S3BlockStore(s3_url, s3_server)
        s.PAGE_KEYS = 3
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
class TestOpenStoreS3Storage(OnS3):

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
    # ReadOnlyStorage refuses every write, so the contract's write half cannot run on it:
    # tests/store/test_read_only.py reads through it (a read-only Store wraps its storage in it)
    # and checks that every write is refused.
    assert wrappers == {RetryingStore, ThrottledStore, FaultInjectingStore, ReadOnlyStorage}


_USER_SUITE = """
import pytest

from tensorstore_ck.storage import LocalBlockStore
from tensorstore_ck.testing import BlockStoreTests, RefTableTests
from tensorstore_ck.refs import MemoryRefTable


class TestMyStore(BlockStoreTests):
    @pytest.fixture
    def block_store(self, tmp_path):
        s = LocalBlockStore(str(tmp_path / "bs"))
        yield s
        s.close()

    @pytest.fixture
    def write_around(self, tmp_path):
        def put(key, data):
            p = tmp_path / "bs" / key
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
        return put


class TestMyTable(RefTableTests):
    @pytest.fixture
    def open_table(self):
        t = MemoryRefTable()
        yield lambda: t
        t.close()
"""


@pytest.mark.slow  # a pytest of its own in a subprocess
def test_a_user_runs_the_shipped_suites_on_a_backend_of_their_own(tmp_path):
    """The contract suites ship in the package: a test module outside this repository's
    tests subclasses them, as a user with a backend of their own would, and pytest runs
    every contract test on it; `import tensorstore_ck` alone does not import pytest."""
    (tmp_path / "test_mine.py").write_text(_USER_SUITE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TSCK_", "PYTEST_"))}
    env["PYTHONPATH"] = str(Path(tsck.__file__).resolve().parents[1])
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist",
                        "test_mine.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    counts = {what: int(n) for n, what in re.findall(r"(\d+) (passed|skipped)", p.stdout)}
    from tensorstore_ck.testing import BlockStoreTests, RefTableTests
    n = sum(name.startswith("test_") for c in (BlockStoreTests, RefTableTests) for name in dir(c))
    assert counts["passed"] + counts.get("skipped", 0) == n, (counts, n)
    # every block-store test ran (write_around given); only a memory table's reopen tests skip
    assert "TestMyStore" not in p.stdout.split("short test summary info")[-1], p.stdout[-3000:]
    assert counts.get("skipped", 0) <= 3, p.stdout[-3000:]


def test_importing_the_package_does_not_import_pytest():
    """Only tensorstore_ck.testing needs pytest: a training job's imports never load it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TSCK_", "PYTEST_"))}
    env["PYTHONPATH"] = str(Path(tsck.__file__).resolve().parents[1])
    code = ("import sys, tensorstore_ck, tensorstore_ck.store, tensorstore_ck.storage, tensorstore_ck.refs; "
            "print('pytest' in sys.modules, 'tensorstore_ck.testing' in sys.modules)")
    q = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert q.stdout.split() == ["False", "False"], q.stdout + q.stderr


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
@pytest.mark.parametrize("proto", ["s3", "s3a"])
def test_open_store_builds_an_s3_block_store_under_its_retry_layer(proto, s3_server, s3_url, tmp_path):
    url = s3_url.replace("s3://", f"{proto}://", 1)
    with tsck.open_store(url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server) as s:
        assert type(s.storage) is RetryingStore and type(s.storage.inner) is S3BlockStore
        assert s.storage.url == url and s3_server["secret"] not in repr(s.storage.inner)


def test_memory_store_is_the_generic_fsspec_store(memory_url):
    with tsck.open_store(memory_url) as s:
        assert type(s.storage) is FsspecBlockStore  # in-process: no retry layer either
        # the generic store leaves a foreign failure alone: only S3BlockStore knows botocore's
        assert s.storage._translate(RuntimeError("x")) is None


def test_the_generic_store_has_no_s3_code_path(memory_url):
    """FsspecBlockStore and RetryingStore know no S3: no botocore, no S3 calls, no
    status parsing; an OSError carrying an S3-shaped response passes unclassified."""
    import inspect

    import tensorstore_ck.storage.fsspec as generic_module
    import tensorstore_ck.storage.wrappers as wrappers_module
    from tensorstore_ck.storage import BlockStore
    for mod in (generic_module, wrappers_module):
        src = inspect.getsource(mod)
        assert not [w for w in ("botocore", "call_s3", "HTTPStatusCode", "_s3", "S3FileSystem") if w in src]
    assert FsspecBlockStore.delete_many is BlockStore.delete_many  # S3's is DeleteObjects batches

    def with_response(status):
        e = OSError(errno.EIO, "x")
        e.__cause__ = type("ClientError", (Exception,), {"response": {
            "ResponseMetadata": {"HTTPStatusCode": status}, "Error": {"Code": "X"}}})()
        return e
    generic = FsspecBlockStore(memory_url)
    for status in (412, 503):
        e = with_response(status)
        generic._classify(e)
        assert not hasattr(e, "transient") and not generic._exists_error(e)


@pytest.fixture
def s3bs(s3_url, s3_server):
    s = S3BlockStore(s3_url, s3_server)
    yield s
    s.close()


def test_s3_writes_send_a_checksum_and_no_body_signature(s3bs, s3_url, s3_server):
    """A write's body is covered by a CRC32 checksum header (S3 checks it and refuses a
    body that does not match) and not hashed for the signature (SHA-256 of every byte
    over plain http, about 1 s of CPU per GB sent: the objects verify themselves by
    address when read); the body and the stored object are the bytes given. A caller's
    own "s3" settings are kept."""
    import base64
    import zlib
    sent = []
    s3bs.fs.s3.meta.events.register("before-send.s3.PutObject", lambda request, **_: sent.append(request))
    data = bytes(range(256)) * 4096
    assert s3bs.put_addressed("blocks/ab/cd", [data])
    (req,) = sent
    headers = {k.lower(): v.decode() if isinstance(v, bytes) else v for k, v in req.headers.items()}
    assert headers["x-amz-content-sha256"] == "UNSIGNED-PAYLOAD", headers
    assert headers["x-amz-checksum-crc32"] == base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    assert "x-amz-checksum-crc32" in headers["authorization"]  # the checksum header is signed
    import s3fs
    assert s3fs.S3FileSystem(**s3_server, skip_instance_cache=True).cat_file(s3bs._path("blocks/ab/cd")) == data
    signed = S3BlockStore(s3_url, {**s3_server, "config_kwargs": {"s3": {"payload_signing_enabled": True}}})
    try:
        sent.clear()
        signed.fs.s3.meta.events.register("before-send.s3.PutObject", lambda request, **_: sent.append(request))
        assert signed.put_addressed("blocks/ab/ce", [data])
        assert sent[0].headers["X-Amz-Content-SHA256"] not in ("UNSIGNED-PAYLOAD", b"UNSIGNED-PAYLOAD")
    finally:
        signed.close()


def _count_requests(bs) -> list:
    """The S3 operations bs's client sends, by name (botocore's before-call event)."""
    seen = []
    bs.fs.s3.meta.events.register("before-call.s3", lambda model, **_: seen.append(model.name))
    return seen


@pytest.mark.slow
def test_s3_one_request_per_object_and_direction(s3bs, s3_server):
    """put-if-absent is one conditional PUT; when the key exists (written around the
    store, with s3fs) the server's 412 means "exists": False, the stored bytes kept."""
    import s3fs
    s3fs.S3FileSystem(**s3_server, skip_instance_cache=True).pipe_file(s3bs._path("blocks/aa/k"), b"first")
    seen = _count_requests(s3bs)
    assert s3bs.put_if_absent("blocks/aa/k", [b"second"]) is False
    assert seen == ["PutObject"]
    assert s3bs.put_if_absent("blocks/aa/new", [b"x"]) is True
    assert s3bs.get("blocks/aa/k") == b"first"
    assert s3bs.exists("blocks/aa/new") and not s3bs.exists("blocks/aa/none")
    s3bs.delete_many([f"blocks/aa/{k}" for k in ("k", "new", "none")])
    assert seen == ["PutObject", "PutObject", "GetObject", "HeadObject", "HeadObject", "DeleteObjects"]


@pytest.mark.slow
def test_s3_delete_many_raises_on_a_per_key_failure(s3_server):
    """A bucket policy denies deletes under keep/: the DeleteObjects request succeeds,
    and its per-key AccessDenied must not be dropped (s3fs's rm() would drop it)."""
    import json

    import boto3
    c = boto3.client("s3", endpoint_url=s3_server["endpoint_url"], aws_access_key_id=s3_server["key"],
                     aws_secret_access_key=s3_server["secret"], region_name="us-east-1")
    bucket = f"tsck-deny-{uuid.uuid4().hex[:12]}"
    c.create_bucket(Bucket=bucket)
    try:
        c.put_bucket_policy(Bucket=bucket, Policy=json.dumps({"Version": "2012-10-17", "Statement": [{
            "Effect": "Deny", "Principal": "*", "Action": "s3:DeleteObject",
            "Resource": f"arn:aws:s3:::{bucket}/p/keep/*"}]}))
        bs = S3BlockStore(f"s3://{bucket}/p", s3_server)
        for k in ("keep/a", "free/b"):
            bs.put_if_absent(k, [b"x"])
        try:
            bs.delete_many(["free/b", "keep/a", "gone/c"])
        except OSError as e:
            assert "AccessDenied" in str(e) and "1 object(s)" in str(e)
            assert s3_server["secret"] not in str(e)
        else:
            if not bs.exists("keep/a"):
                pytest.skip("this S3 server does not enforce bucket policies (moto)")
            pytest.fail("a per-key DeleteObjects error was dropped")
        assert not bs.exists("free/b") and bs.exists("keep/a")
    finally:
        c.delete_bucket_policy(Bucket=bucket)
        for o in c.list_objects_v2(Bucket=bucket).get("Contents", []):
            c.delete_object(Bucket=bucket, Key=o["Key"])
        c.delete_bucket(Bucket=bucket)


def _s3_ops(bs) -> dict:
    return {"get": lambda: bs.get("blocks/aa/k"), "put_if_absent": lambda: bs.put_if_absent("blocks/aa/j", [b"x"]),
            "exists": lambda: bs.exists("blocks/aa/k"), "list": lambda: list(bs.list("")),
            "delete": lambda: bs.delete("blocks/aa/k"), "delete_many": lambda: bs.delete_many(["blocks/aa/k"])}


def test_s3_transport_failure_is_an_oserror():
    """Nothing listening: botocore's EndpointConnectionError (not an OSError) arrives as
    ConnectionError from every operation, which RetryingStore retries (StorageError above)."""
    import socket

    from tensorstore_ck.util.retry import is_transient as _transient
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    s = S3BlockStore("s3://bucket/p", {"endpoint_url": f"http://127.0.0.1:{port}", "key": "k", "secret": "s",
                                       "config_kwargs": {"connect_timeout": 1, "read_timeout": 1}})
    for name, op in _s3_ops(s).items():
        with pytest.raises(OSError) as ei:
            op()
        assert isinstance(ei.value, ConnectionError) and _transient(ei.value), (name, repr(ei.value))


@pytest.mark.slow
def test_s3_refused_credentials_are_permanent(s3_url, s3_server, s3_signatures_checked):
    """A wrong secret (403 from the server) is PermissionError, marked not transient from
    the status: RetryingStore surfaces it at once; the secret is not echoed."""
    S3BlockStore(s3_url, s3_server).put_if_absent("blocks/aa/k", [b"x"])
    with s3_signatures_checked() as good:
        assert S3BlockStore(s3_url, good).exists("blocks/aa/k")  # the key itself is good
        bad = S3BlockStore(s3_url, {**good, "secret": "tsck-wrong-secret"})
        for name, op in _s3_ops(bad).items():
            with pytest.raises(PermissionError) as ei:
                op()
            assert ei.value.transient is False and "tsck-wrong-secret" not in str(ei.value), name
        rs = RetryingStore(bad, base_delay=0.001)
        with pytest.raises(PermissionError):
            rs.get("blocks/aa/k")
    assert rs.retries == 0 and S3BlockStore(s3_url, s3_server).exists("blocks/aa/k")


@pytest.mark.slow
def test_s3_client_error_is_not_retried_and_server_error_marks_are_s3s(s3_server, s3_url):
    """S3BlockStore marks what S3 said (4xx: not transient); RetryingStore obeys the mark
    and knows nothing of botocore."""
    if os.environ.get("TEST_S3_ENDPOINT"):  # a real server: a key over S3's 1024 bytes is a 400
        s = RetryingStore(S3BlockStore(s3_url, s3_server), attempts=5, base_delay=0.001)
        key = "k" * 1100
    else:  # moto takes any key length, but refuses a storage class it does not know (a 400)
        s = RetryingStore(S3BlockStore(s3_url, {**s3_server, "s3_additional_kwargs": {
            "StorageClass": "TSCK_NO_SUCH_CLASS"}}), attempts=5, base_delay=0.001)
        key = "blocks/aa/k"
    with pytest.raises(OSError) as ei:
        s.put_if_absent(key, [b"x"])
    assert getattr(ei.value, "transient", None) is False
    assert s.retries == 0  # not retried (counted, not timed: a first request can take 0.3 s)


class _ListResets(FaultInjectingStore):
    """A connection reset on page requests, as a network backend reports it (transient,
    unlike InjectedFault)."""

    def list_page(self, prefix, start_after=None):
        if self._fault("list", start_after or ""):
            raise ConnectionResetError(errno.ECONNRESET, f"injected reset listing after {start_after!r}")
        return self.inner.list_page(prefix, start_after)


@pytest.mark.slow
def test_s3_listing_is_retried_page_by_page_and_resumes_after_the_last_key(s3bs):
    """Every page request fails once (a reset), mid-listing included: RetryingStore
    retries that page alone, with the same start key, so each key comes exactly once,
    in key order, and no page is asked for twice once it was answered."""
    keys = sorted(f"blocks/{i % 7:02x}/{i:064x}" for i in range(23))
    for k in keys:
        s3bs.put_if_absent(k, [b"x"])
    s3bs.PAGE_KEYS = 4
    asked: list = []

    def reset_first_ask(op, key):
        if op != "list":
            return False
        asked.append(key)
        return asked.count(key) == 1

    rs = RetryingStore(_ListResets(s3bs, when=reset_first_ask), base_delay=0.001)
    it = rs.list("blocks/")
    first = next(it)
    assert first.key == keys[0] and rs.retries == 1  # one page fetched, after one retry
    got = [first.key] + [o.key for o in it]
    assert got == keys
    pages = -(-len(keys) // 4)
    assert rs.retries == pages and len(asked) == 2 * pages
    assert asked[::2] == asked[1::2] == [""] + keys[3:-1:4]  # each retry asks for its own page again


@pytest.mark.slow
def test_s3_listing_that_keeps_failing_stops_with_the_error(s3bs):
    """A page that fails on every attempt ends the listing with the error after the keys
    before it were yielded once each (nothing yielded twice, no silent truncation)."""
    keys = sorted(f"blocks/00/{i:064x}" for i in range(6))
    for k in keys:
        s3bs.put_if_absent(k, [b"x"])
    s3bs.PAGE_KEYS = 4
    rs = RetryingStore(_ListResets(s3bs, when=lambda op, key: op == "list" and key == keys[3]),
                       attempts=3, base_delay=0.001)
    got = []
    with pytest.raises(tsck.StorageError) as ei:  # the reset, named as a retry loop given up
        for o in rs.list("blocks/"):
            got.append(o.key)
    assert isinstance(ei.value.__cause__, ConnectionResetError) and ei.value.errno == errno.ECONNRESET
    assert "3 attempts spent" in str(ei.value)
    assert got == keys[:4] and rs.retries == 2


def _bucket_and_prefix(url: str) -> tuple[str, str]:
    bucket, _, base = url[len("s3://"):].partition("/")
    return bucket, f"{base}/" if base else ""


def _fill_s3(bs: S3BlockStore, s3_server: dict, n: int) -> list[str]:
    """n tiny objects under bs's root, as fast as the server can be given them; their keys.
    The in-process moto server (no TEST_S3_ENDPOINT) takes about 100 PUTs/s on 2 cores, so
    its backend is filled directly there; the listing still goes through its HTTP server.
    Any other server gets the PUTs, 32 at a time."""
    keys = sorted(f"blocks/{i % 256:02x}/{i:064x}" for i in range(n))
    bucket, pre = _bucket_and_prefix(bs.url)
    if not os.environ.get("TEST_S3_ENDPOINT"):
        from moto.core import DEFAULT_ACCOUNT_ID
        from moto.s3.models import s3_backends
        backend = s3_backends[DEFAULT_ACCOUNT_ID]["aws"]
        for k in keys:
            backend.put_object(bucket, pre + k, b"x")
        return keys
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(32) as ex:
        list(ex.map(lambda k: bs.fs.call_s3("put_object", Bucket=bucket, Key=pre + k, Body=b"x"), keys,
                    chunksize=64))
    return keys


def _drop_s3(bs: S3BlockStore, keys: list[str]) -> None:
    if os.environ.get("TEST_S3_ENDPOINT"):
        bs.delete_many(keys)
        return
    # The in-process moto lists all of a bucket's keys for every page (about 1 s per 20k
    # keys): the fixture's recursive rm would take minutes, so moto's backend drops them.
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends
    bucket, pre = _bucket_and_prefix(bs.url)
    stored = s3_backends[DEFAULT_ACCOUNT_ID]["aws"].get_bucket(bucket).keys
    for k in keys:
        if pre + k in stored:
            stored.pop(pre + k)


@pytest.mark.slow
def test_s3_listing_holds_one_page_when_the_first_object_comes(s3bs, s3_server):
    """gc and fsck list every object of a store: on S3 the first object must come after
    one ListObjectsV2 page, with the memory of one page held, however many objects the
    store has (s3fs's find() held all of them: about 1.2 KB per object, 23 MiB at 20k,
    some 230 MiB at 200k, and the first object only after the last page)."""
    import tracemalloc
    # s3fs's find() would hold ~5 MiB at 4k objects, past the bound of 2.5 MiB (one page
    # of 1,000 objects and the client: radosgw takes each upload, ~200 a second on 2 cores;
    # moto's listing is cheap to fill far larger).
    n = 4_000 if os.environ.get("TEST_S3_ENDPOINT") else 200_000
    keys = _fill_s3(s3bs, s3_server, n)
    try:
        s3bs.exists("blocks/none")  # the client is built before measuring
        got: list[int] = []  # objects in each page answered (a request retried under load is asked twice)

        def on_list(**_):
            if got and not yielded:  # fail now, not after the store's every page
                raise RuntimeError("a second page was asked for before the first object was yielded")

        def on_answer(http_response=None, parsed=None, **_):
            if http_response is not None and http_response.status_code == 200:
                got.append(len((parsed or {}).get("Contents") or ()))
        yielded = False
        s3bs.fs.s3.meta.events.register("before-call.s3.ListObjectsV2", on_list)
        s3bs.fs.s3.meta.events.register("after-call.s3.ListObjectsV2", on_answer)
        tracemalloc.start()
        try:
            it = s3bs.list("blocks/")
            first = next(it)
            yielded = True
            held = tracemalloc.get_traced_memory()[0]
        finally:
            tracemalloc.stop()
        assert first.key == keys[0] and len(got) == 1
        assert held < 2.5 * 2**20, f"{held / 2**20:.1f} MiB held for the first of {n} objects"
        # No read-ahead: every page but the last one fetched was needed for these 2501
        # objects (a server may send short pages; CI once saw 4 requests for 3 pages).
        assert [o.key for _, o in zip(range(2500), it)] == keys[1:2501]
        assert got and sum(got[:-1]) < 2501, f"pages of {got} objects fetched for 2501"
    finally:
        _drop_s3(s3bs, keys)
