import contextlib as _contextlib
import os
import sys

import pytest

# The contract suites ship in the package (tensorstore_ck.testing): rewrite their asserts too.
pytest.register_assert_rewrite("tensorstore_ck.testing")

# A developer's AWS_*/TSCK_* settings must not leak into the tests. One knob passes on
# purpose: TESTS_PACK_SIZE=N runs the whole suite with packs of N bytes as every store's
# default ($TSCK_PACK_SIZE, chunker.default_pack_size), its subprocesses included.
_pack = os.environ.get("TESTS_PACK_SIZE")
for _k in list(os.environ):
    if _k.startswith(("AWS_", "TSCK_")):
        del os.environ[_k]
if _pack:
    os.environ["TSCK_PACK_SIZE"] = _pack

# Bytecode caches for the suite's processes. Where PYTHONDONTWRITEBYTECODE is set (this
# project's CI machine sets it), each of the hundreds of fresh interpreters the suite starts
# (torchrun's ranks, the harness's, CLI calls) would compile the package, and every module
# pip was told not to compile, again. They are written to a folder of their own
# (PYTHONPYCACHEPREFIX), never beside the sources.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    import tempfile as _tempfile
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(_tempfile.gettempdir(), "tsck-tests-pycache"))
    sys.dont_write_bytecode, sys.pycache_prefix = False, os.environ["PYTHONPYCACHEPREFIX"]

# The test files live in folders under tests/ (read/, tier/, ...) and import the shared
# modules beside those folders by name (_util, _zygote, _backends, ...).
_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

import tensorstore_ck as tsck  # noqa: E402
import _zygote  # noqa: E402


@pytest.fixture(autouse=True)
def _import_time_environment_kept():
    """Some imports set import-time variables in this process's environment (lightning:
    PYTORCH_NVML_BASED_CUDA_CHECK; torch's inductor: TORCHINDUCTOR_CACHE_DIR), during a
    test or while the tests are collected. Left there, they reach every later child of
    this worker, and the zygote runs a child whose import-time environment differs from
    its own as a plain interpreter (_zygote.IMPORT_TIME): each test ends with them as they
    were when this process started its zygote."""
    yield
    want = _zygote.started_with
    if want is None:
        return
    for k in [k for k in os.environ if _zygote.import_time_name(k) and k not in want]:
        del os.environ[k]
    for k, v in want.items():
        if os.environ.get(k) != v:
            os.environ[k] = v


@pytest.fixture(scope="session", autouse=True)
def _zygote_server():
    """The fork server the suite's Python helpers start from (tests/_zygote.py): its
    preload runs while the first tests do."""
    _zygote.start()
    yield
    _zygote.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With $TESTS_CPU_LOG: each test's CPU in this worker, its fixtures' included, and in
    the plain child processes it reaped (the zygote logs its forks: tests/census/by_test.py)."""
    if not os.environ.get("TESTS_CPU_LOG"):
        yield
        return
    import resource
    import time
    t, ch = time.process_time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    yield
    ch2 = resource.getrusage(resource.RUSAGE_CHILDREN)
    _zygote.cpu_log(item.nodeid, time.process_time() - t, "worker")
    zygote, _zygote.reaped_cpu = _zygote.reaped_cpu, 0.0  # (stopped at the last test's teardown)
    _zygote.cpu_log(item.nodeid, ch2.ru_utime + ch2.ru_stime - ch.ru_utime - ch.ru_stime - zygote, "plain child")


@pytest.fixture
def procs():
    """Helper processes a test started (objects with close(): helpers/gc_proc.py's), each
    closed at the test's end however it ends."""
    live: list = []
    yield live
    for p in live:
        p.close()


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def store(store_path):
    s = tsck.open_store(store_path)
    yield s
    s.close()


@pytest.fixture
def small_store(tmp_path):
    """A store of 16 KiB blocks, so that modest tensors span many blocks."""
    s = tsck.open_store(tmp_path / "store", block_size=16384)
    yield s
    s.close()


# ---------------------------------------------------------------- real servers
from _pgserver import PgServer, pg_bindir  # noqa: E402


@pytest.fixture(scope="session")
def pg_dsn():
    """A real PostgreSQL server on 127.0.0.1 for this test session (initdb in a temp dir)."""
    if os.environ.get("TEST_PG_DSN"):
        yield os.environ["TEST_PG_DSN"]
        return
    bindir = pg_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries are not installed here (.ci/run installs Debian's postgresql)")
    srv = PgServer(bindir)
    try:
        yield srv.dsn
    finally:
        srv.remove()


@pytest.fixture
def pg_server():
    """A PostgreSQL server of this test's own, which it may stop and restart."""
    bindir = pg_bindir()
    if bindir is None:
        pytest.skip("PostgreSQL server binaries are not installed here (.ci/run installs Debian's postgresql)")
    srv = PgServer(bindir)
    try:
        yield srv
    finally:
        srv.remove()


def _ensure_bucket(opts: dict, bucket: str = "tsck-tests") -> dict:
    import s3fs
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True)
    try:
        fs.mkdir(bucket)
    except (FileExistsError, OSError):
        pass
    return opts


def _serial_moto_server():
    """moto's threaded server on 127.0.0.1, handling one request at a time: moto checks
    a conditional PUT's If-None-Match and then stores the object without a lock, so
    racing creates of one key could all win, where S3 and radosgw let exactly one win
    (what put_if_absent promises). Connections are still accepted concurrently."""
    import threading

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from moto.server import ThreadedMotoServer
    from werkzeug.serving import make_server

    class SerialMotoServer(ThreadedMotoServer):
        def _server_entry(self) -> None:  # ThreadedMotoServer's, with the app behind a lock
            app = DomainDispatcherApplication(create_backend_app)
            lock = threading.Lock()

            def one_at_a_time(environ, start_response):
                with lock:
                    return list(app(environ, start_response))
            self._server = make_server(self._ip_address, self._port, one_at_a_time, True,
                                       request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()
    return SerialMotoServer(ip_address="127.0.0.1", port=0, verbose=False)


@pytest.fixture(scope="session")
def s3_server():
    """storage_options for a real S3-compatible server on 127.0.0.1.

    .ci/run starts Ceph's radosgw and exports TEST_S3_ENDPOINT (plus key and
    secret); without it, a moto server is started in-process."""
    if os.environ.get("TEST_S3_ENDPOINT"):
        yield _ensure_bucket({"endpoint_url": os.environ["TEST_S3_ENDPOINT"],
                              "key": os.environ.get("TEST_S3_KEY", "x"),
                              "secret": os.environ.get("TEST_S3_SECRET", "x")})
        return
    try:
        srv = _serial_moto_server()
    except ImportError:
        pytest.skip("no S3-compatible server: TEST_S3_ENDPOINT unset and moto not installed "
                    "(the README's test command installs it)")
    import logging
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    srv.start()
    host, port = srv.get_host_and_port()
    try:
        yield _ensure_bucket({"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"})
    finally:
        srv.stop()


@_contextlib.contextmanager
def _signatures_checked(s3_server: dict):
    """storage_options of a key the server knows, while it checks signatures. A real
    server always does; moto does only with its IAM simulation on (in-process, as our
    moto server is), for an access key its IAM issued."""
    if os.environ.get("TEST_S3_ENDPOINT"):
        yield s3_server
        return
    import json as _json
    import uuid as _uuid

    import boto3
    from moto.core.authorization import enable_iam_authentication
    iam = boto3.client("iam", endpoint_url=s3_server["endpoint_url"], region_name="us-east-1",
                       aws_access_key_id=s3_server["key"], aws_secret_access_key=s3_server["secret"])
    user = f"tsck-{_uuid.uuid4().hex[:12]}"
    iam.create_user(UserName=user)
    iam.put_user_policy(UserName=user, PolicyName="all", PolicyDocument=_json.dumps(
        {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    with enable_iam_authentication():
        yield {**s3_server, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}


@pytest.fixture
def s3_signatures_checked(s3_server):
    """`with s3_signatures_checked() as opts:` the S3 server checks signatures, and opts
    are storage options of a key it knows (change the secret to be refused)."""
    return lambda: _signatures_checked(s3_server)


@pytest.fixture
def s3_url(s3_server, _s3_admin, request):
    """A fresh bucket prefix on the session's S3 server."""
    import uuid as _uuid
    url = f"s3://tsck-tests/{_uuid.uuid4().hex}"
    yield url
    try:
        _s3_admin.rm(url[len("s3://"):], recursive=True)
    except (FileNotFoundError, OSError):
        pass


@pytest.fixture
def s3_proxy(s3_server):
    """(a real TCP proxy in front of the session's S3 server, storage options that reach
    the server through it): `proxy.blackout()` cuts the network, `proxy.outage(s)` for a while."""
    from urllib.parse import urlsplit
    from tests.sim.netproxy import NetProxy
    ep = urlsplit(s3_server["endpoint_url"])
    proxy = NetProxy(ep.port or 80, ep.hostname, marker=None)
    opts = {**s3_server, "endpoint_url": f"http://127.0.0.1:{proxy.port}",
            "config_kwargs": {"connect_timeout": 2, "read_timeout": 5}}
    yield proxy, opts
    proxy.close()


@pytest.fixture(scope="session")
def _s3_admin(s3_server):
    """One S3 client for the tests' own housekeeping (a client costs ~0.2 CPU-s to build)."""
    import s3fs
    return s3fs.S3FileSystem(**s3_server, skip_instance_cache=True)


# ---------------------------------------------------------------- backends
from _backends import KINDS, Backend  # noqa: E402


def _make_backend(request, tmp_path, kind: str, name: str = "store") -> Backend:
    if kind == "s3":
        return Backend(kind, tmp_path, s3_options=request.getfixturevalue("s3_server"), name=name)
    if kind == "pg":
        return Backend(kind, tmp_path, pg_dsn=request.getfixturevalue("pg_dsn"), name=name)
    return Backend(kind, tmp_path, name=name)


@pytest.fixture(params=[pytest.param(k, marks=[] if k == "file" else [pytest.mark.slow]) for k in KINDS])
def backend(request, tmp_path) -> Backend:
    """One store location per test, on each backend: local files + LMDB, s3:// on
    a real server, local files + the PostgreSQL ref table (see tests/_backends.py)."""
    b = _make_backend(request, tmp_path, request.param)
    yield b
    b.remove()  # the CI server keeps objects in memory (radosgw memstore): leave nothing behind


@pytest.fixture(scope="module", params=[pytest.param(k, marks=[] if k == "file" else [pytest.mark.slow])
                                        for k in KINDS])
def module_backend(request, tmp_path_factory) -> Backend:
    """The same, shared by a module's tests (for stores built once and only read)."""
    b = _make_backend(request, tmp_path_factory.mktemp(f"mb-{request.param}"), request.param)
    yield b
    b.remove()


def pytest_configure(config):
    # xdist's loadscope hands out modules largest first by test count, which sends the
    # modules of a few long tests (ranks, servers, crash loops) out last, where one made the
    # run's tail. Handed out in collection order instead: see pytest_collection_modifyitems.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The modules with the most slow tests first (each keeps its tests' order; the quick
    modules follow, as collected, and fill the workers' ends): long work first shortens a
    run spread over a few workers."""
    import collections
    module = lambda it: it.nodeid.split("::", 1)[0]  # noqa: E731
    slow = collections.Counter(module(it) for it in items if it.get_closest_marker("slow"))
    first = {m: i for i, m in enumerate(dict.fromkeys(map(module, items)))}
    items.sort(key=lambda it: (-slow[module(it)], first[module(it)]))
