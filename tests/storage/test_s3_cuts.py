"""S3 connections cut during a put: the put fails with one clear StorageError, and
nothing else reaches stderr. aiohttp (under s3fs) sends a PUT's headers from a task of
its own when the request expects "100 Continue"; a connection reset just as that task
starts fails it, and aiohttp, having already failed the request itself, never retrieves
the task's exception: asyncio then printed "Task exception was never retrieved" with a
traceback for each such request, a dozen per cut, hundreds over an outage, with no
logging configured.

The cut is real: tests/sim/netproxy.py's NetProxy between the store and the session's S3
server resets every connection (and each new one) from the moment the put has written a
few objects. The put runs in a child process whose stderr is read whole."""

from __future__ import annotations

import subprocess
import sys

import pytest

from _util import REPO, child_env

pytestmark = pytest.mark.slow  # a real S3 server, a child process, seconds of retries

_CHILD = r"""
import json, sys
from urllib.parse import urlsplit
import torch
import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import WrappedStore
from tests.sim.netproxy import NetProxy

url, refs, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
ep = urlsplit(opts["endpoint_url"])
proxy = NetProxy(ep.port, ep.hostname, marker=None)
opts = {**opts, "endpoint_url": f"http://127.0.0.1:{proxy.port}",
        "config_kwargs": {"connect_timeout": 2, "read_timeout": 5}}


class CutAfter(WrappedStore):
    '''The connections cut once `n` more objects are written: mid-put, an event.'''
    n = None

    def put_addressed(self, key, bufs):
        new = self.inner.put_addressed(key, bufs)
        if CutAfter.n is not None:
            CutAfter.n -= 1
            if CutAfter.n == 0:
                proxy.outage(1e9)
        return new


def state(v):
    return {f"t{i}": torch.full((16 << 10,), float(v * 1000 + i)) for i in range(256)}


with tsck.open_store(url, refs=refs, storage_options=opts, retry_budget=8, block_size=64 << 10, pack_size=0,
                     workers=16, wrap_storage=CutAfter) as s:
    s.put_snapshot(state(0), ref="j/main", step=1)  # the client warm: the next put's blocks are PUTs alone
    CutAfter.n = 8
    try:
        s.put_snapshot(state(1), ref="j/main", step=2)
        print("put: no error", flush=True)
    except Exception as e:
        print("put:", type(e).__name__, "|", e, flush=True)
    print("refs:", proxy.refused, flush=True)
"""


def test_a_put_whose_connections_are_cut_fails_with_one_clear_error_and_a_quiet_stderr(tmp_path, s3_server, s3_url):
    import json
    p = subprocess.run([sys.executable, "-c", _CHILD, s3_url, str(tmp_path / "refs.lmdb"), json.dumps(s3_server)],
                       capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    put = [x for x in lines if x.startswith("put:")]
    assert len(put) == 1 and put[0].startswith("put: StorageError |"), p.stdout
    assert "retry budget" in put[0] and "Connection" in put[0], put[0]
    assert int(lines[-1].split()[1]) > 0, "the proxy refused nothing: the put never met the cut"
    assert p.stderr == "", f"stderr got:\n{p.stderr[-4000:]}"


_OTHERS = r"""
import asyncio, gc, json, sys
import tensorstore_ck as tsck
url, refs, opts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
with tsck.open_store(url, refs=refs, storage_options=opts) as s:
    import fsspec.asyn
    loop = fsspec.asyn.get_loop()  # fsspec's IO loop, s3fs's requests' (given the store's handler)
    assert loop.get_exception_handler() is not None

    async def boom(e):
        raise e

    async def leave():  # tasks nobody awaits: their exceptions never retrieved
        for e in (ValueError("not a cut"), ConnectionResetError("a cut, but not in aiohttp")):
            asyncio.ensure_future(boom(e))
        await asyncio.sleep(0)
    asyncio.run_coroutine_threadsafe(leave(), loop).result()
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result()
    gc.collect()
"""


def test_other_unretrieved_task_exceptions_on_the_loop_are_still_reported(tmp_path, s3_server, s3_url):
    """Only aiohttp's own tasks' cut connections are quieted: another task's unretrieved
    exception on fsspec's loop (the caller's code, any other library) still reaches
    asyncio's handler and stderr."""
    import json
    p = subprocess.run([sys.executable, "-c", _OTHERS, s3_url, str(tmp_path / "refs.lmdb"), json.dumps(s3_server)],
                       capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stderr.count("Task exception was never retrieved") == 2, p.stderr
    assert "ValueError: not a cut" in p.stderr and "ConnectionResetError: a cut, but not in aiohttp" in p.stderr
