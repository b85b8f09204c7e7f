"""A process forked after its parent used an S3 store (a DataLoader worker, a
multiprocessing fork) uses the store in the child: the child rebuilds its S3 filesystem
on an event loop of its own, whichever at-fork handler (fsspec's or the store's) runs
first. A real S3 server (moto, or radosgw in CI)."""

from __future__ import annotations

import os
import select
import signal

import pytest
import torch

import tensorstore_ck as tsck

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # (fork with threads)


def test_a_forked_child_reads_and_writes_an_s3_store_its_parent_used(s3_url, s3_server, tmp_path):
    x = torch.arange(20000, dtype=torch.float32)
    store = tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server)
    store.put_snapshot({"x": x}, "r")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a checkout and a put, its answer through the pipe
        code = b"?"
        try:
            got = store.checkout("r")
            ok = torch.equal(got["x"], x)
            store.put_snapshot({"x": x + 1}, "child")
            code = b"1" if ok else b"0"
        except BaseException as e:  # noqa: BLE001 - told to the parent
            code = f"{type(e).__name__}: {e}".encode()[:500]
        finally:
            os.write(w, code)
            os._exit(0)
    os.close(w)
    try:
        ready, _, _ = select.select([r], [], [], 120)
        said = os.read(r, 600) if ready else b"(no answer in 120 s: the child hangs)"
    finally:
        if not ready:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
    assert said == b"1", said
    assert torch.equal(store.checkout("child")["x"], x + 1)
    store.close()
