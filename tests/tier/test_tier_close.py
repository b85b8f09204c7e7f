"""close() of a tiered store whose remote is away (Store.close(timeout=), Uploader.drain
and close, the retry policy's stop): it returns within the caller's bound, says with a
SnapshotWarning what stays queued in the tier, prints no asyncio tracebacks, and the
next open of the tier uploads what was left once the remote is back.

Against a moto S3 server in a process of the test's own (_SERVER), which the test stops
(its port closed, its connections cut), stalls (requests accepted, never answered) and
starts again on the same port with the same data; the closing store runs in a subprocess
whose stderr is read whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

import tensorstore_ck as tsck
from tensorstore_ck.util.retry import Backoff
from tensorstore_ck.storage.wrappers import RetryingStore, WrappedStore

import _zygote as zygote

BS = 16 * 1024
DEADLINE = 120.0  # generous: the machine is shared
MARGIN = 6.0  # a close's bound plus this: the subprocess's own shutdown is not timed, the machine is shared

# A moto S3 server that stops (listening socket closed, every connection cut: the
# process of a server that went away) and starts again on the same port with the data
# it held (moto keeps it in this process), or stalls (answers nothing until started).
_SERVER = r"""
import logging, socket, sys, threading
from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import make_server
logging.getLogger("werkzeug").setLevel(logging.ERROR)
app = DomainDispatcherApplication(create_backend_app)
lock, conns_lock, conns, awake = threading.Lock(), threading.Lock(), set(), threading.Event()
awake.set()
def serve(environ, start_response):
    awake.wait()
    with lock:  # one request at a time: moto's conditional PUT is not atomic (tests/conftest.py)
        return list(app(environ, start_response))
class Handler(MotoRequestHandler):
    def setup(self):
        with conns_lock:
            conns.add(self.request)
        super().setup()
port, srv = int(sys.argv[1]), None
def start():
    global srv, port
    awake.set()
    if srv is None:
        srv = make_server("127.0.0.1", port, serve, True, request_handler=Handler)
        port = srv.server_address[1]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
def stop():
    global srv
    srv.shutdown()
    srv.server_close()
    srv = None
    with conns_lock:
        cut = list(conns)
        conns.clear()
    for c in cut:
        try:
            c.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        c.close()
def stall():
    awake.clear()
start()
print("up", port, flush=True)
for line in sys.stdin:
    {"stop": stop, "start": start, "stall": stall}[line.strip()]()
    print(line.strip(), port, flush=True)
"""

# Step 1 put and durable; then (the test stops the server) step 2 put, and close(timeout=)
# timed; one line of JSON: the seconds, what close raised, the warnings it gave.
_SCENARIO = r"""
import json, sys, time, warnings
import torch
import tensorstore_ck as tsck
url, refs, local, opts, budget, timeout = sys.argv[1:7]
def state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 256, generator=g), "b": torch.randn(300, generator=g)}
store = tsck.open_store(url, refs=refs, storage_options=json.loads(opts), block_size=16384, inline_threshold=256,
                        local=local, retry_budget=float(budget))
store.put_snapshot(state(1), "job/main", step=1)
assert store.wait_durable(timeout=120)
print("DURABLE", flush=True)
sys.stdin.readline()
store.put_snapshot(state(2), "job/main", step=2)
err = None
with warnings.catch_warnings(record=True) as ws:
    warnings.simplefilter("always")
    t0 = time.monotonic()
    try:
        store.close(timeout=None if timeout == "none" else float(timeout))
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    took = time.monotonic() - t0
print("CLOSED " + json.dumps({"seconds": took, "error": err,
                              "warnings": [[w.category.__name__, str(w.message)] for w in ws]}), flush=True)
"""


class Server:
    def __init__(self):
        self.proc = zygote.Popen([sys.executable, "-c", _SERVER, "0"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "up", line
        self.port = int(line[1])
        self.opts = {"endpoint_url": f"http://127.0.0.1:{self.port}", "key": "testing", "secret": "testing"}

    def tell(self, what: str) -> None:
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().split() == [what, str(self.port)]

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def server():
    srv = Server()
    import s3fs
    s3fs.S3FileSystem(**srv.opts, skip_instance_cache=True).mkdir("tsck-close")
    yield srv
    srv.close()


def _close_while_away(server, tmp_path, *, budget: float, timeout, away: str = "stop") -> dict:
    """The scenario in a subprocess, the server made `away` after step 1 is durable ->
    close's result, with the subprocess's stderr under "stderr"."""
    url, refs, local = "s3://tsck-close/s", str(tmp_path / "refs.lmdb"), str(tmp_path / "tier")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.dirname(os.path.dirname(
        os.path.abspath(tsck.__file__))), os.environ.get("PYTHONPATH")) if p))
    proc = zygote.Popen([sys.executable, "-c", _SCENARIO, url, refs, local, json.dumps(server.opts), str(budget),
                             str(timeout).lower()], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "DURABLE", proc.communicate(timeout=DEADLINE)
        server.tell(away)
        out, err = proc.communicate("go\n", timeout=DEADLINE + 600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    closed = [line for line in out.splitlines() if line.startswith("CLOSED ")]
    assert closed, (out, err)
    got = json.loads(closed[0][len("CLOSED "):])
    got.update(stderr=err, url=url, refs=refs, local=local, rc=proc.returncode)
    return got


def _queued_warning(got: dict) -> str:
    ws = [m for cat, m in got["warnings"] if cat == "SnapshotWarning"]
    assert len(ws) == 1, got["warnings"]
    assert "1 snapshot(s)" in ws[0] and got["local"] in ws[0] and f"local={got['local']!r}" in ws[0], ws[0]
    return ws[0]


def _remote_step(server, got) -> int:
    with tsck.open_store(got["url"], refs=got["refs"], storage_options=server.opts) as remote:
        return remote.show("job/main").step


def _resumed(server, got) -> None:
    """A fresh open of the tier, the server back: it uploads step 2."""
    with tsck.open_store(got["url"], refs=got["refs"], storage_options=server.opts, local=got["local"]) as store:
        assert not store.show("job/main").durable
        assert store.wait_durable(timeout=DEADLINE)
        assert store.show("job/main").durable
    assert _remote_step(server, got) == 2


@pytest.mark.slow  # a server process, a subprocess, seconds of waiting
def test_a_close_with_the_remote_stopped_returns_within_its_timeout_and_the_next_open_uploads(server, tmp_path):
    """The server stopped after step 1 is durable, step 2 put: close(timeout=5), with the
    default retry budget (60 s, which alone would hold the close for a minute per try),
    returns within 5 s and a margin, without raising; one SnapshotWarning names the one
    snapshot left queued and the tier; no asyncio traceback on stderr. The server started
    again on the same port: a fresh open of the tier uploads step 2."""
    timeout = 5.0
    got = _close_while_away(server, tmp_path, budget=60, timeout=timeout)
    assert got["error"] is None and got["rc"] == 0, got
    assert got["seconds"] <= timeout + MARGIN, got
    assert "timeout passed" in _queued_warning(got)
    assert "Task exception was never retrieved" not in got["stderr"] and "Traceback" not in got["stderr"], got["stderr"]
    server.tell("start")
    assert _remote_step(server, got) == 1  # nothing moved by the close
    _resumed(server, got)


@pytest.mark.slow  # a server process, a subprocess
def test_a_close_stops_waiting_at_the_first_failed_upload_without_a_bound(server, tmp_path):
    """timeout=None: no bound, yet a remote that cannot be reached ends the wait as soon
    as an upload attempt fails (after the 1 s retry budget), not after the uploader's
    tries and their backoff (8 tries, pauses up to 30 s)."""
    budget = 1.0
    got = _close_while_away(server, tmp_path, budget=budget, timeout=None)
    assert got["error"] is None and got["rc"] == 0, got
    assert got["seconds"] <= budget + MARGIN, got
    assert "an upload failed" in _queued_warning(got)
    assert "Task exception was never retrieved" not in got["stderr"] and "Traceback" not in got["stderr"], got["stderr"]
    server.tell("start")
    _resumed(server, got)


@pytest.mark.slow  # a server process, a subprocess, seconds of waiting
def test_a_close_with_requests_the_remote_never_answers_returns_within_its_timeout(server, tmp_path):
    """The server stalls (connections accepted, nothing answered: each request waits for
    its 60 s read timeout): close(timeout=3) returns within 3 s, the stop's grace and a
    margin; the uploader thread, left in its request, moves no ref; no asyncio traceback
    when the process exits with it. Answered again, the next open uploads step 2."""
    timeout = 3.0
    got = _close_while_away(server, tmp_path, budget=60, timeout=timeout, away="stall")
    assert got["error"] is None and got["rc"] == 0, got
    assert got["seconds"] <= timeout + 2.0 + MARGIN, got
    _queued_warning(got)
    assert "Task exception was never retrieved" not in got["stderr"] and "Traceback" not in got["stderr"], got["stderr"]
    server.tell("start")
    assert _remote_step(server, got) == 1
    _resumed(server, got)


class _Down(WrappedStore):
    """Every request fails as a server that is not there fails."""

    def get(self, key, max_bytes=None):
        raise ConnectionRefusedError(111, "Connection refused")


def test_a_retry_being_waited_out_gives_up_when_its_policy_is_stopped(tmp_path):
    """A request retried under a 60 s budget gives up as soon as the policy's stop is set,
    as a StorageError that says so, and a new request is not sent at all."""
    from tensorstore_ck.storage.local import LocalBlockStore
    backoff = Backoff(budget=60.0).stoppable()
    store = RetryingStore(_Down(LocalBlockStore(str(tmp_path))), backoff=backoff)
    out: list = []
    t = threading.Thread(target=lambda: out.append(pytest.raises(tsck.StorageError, store.get, "k")))
    t0 = time.monotonic()
    t.start()
    time.sleep(0.3)
    backoff.stop.set()
    t.join(10)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    assert "closing" in str(out[0].value) and store.retries >= 1
    before = store.retries
    with pytest.raises(tsck.StorageError, match="closing"):
        store.get("k")
    assert store.retries == before


def test_close_refuses_a_bad_timeout_and_without_a_tier_it_does_nothing(tmp_path):
    s = tsck.open_store(tmp_path / "s")
    with pytest.raises(tsck.InvalidArgument):
        s.close(timeout=-1)
    with pytest.raises(tsck.InvalidArgument):
        s.close(timeout="5")
    s.close(timeout=0)
    assert s.closed
