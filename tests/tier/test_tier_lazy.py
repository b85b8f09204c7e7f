"""A tiered store opens its remote storage on first use (docs/design/tiers.md, "Opening
the remote on first use"): a restore from the local tier in a fresh process makes no
request to the remote store; a tier of another store is refused before any; a remote
that is down at open leaves the local tier to read and fails where it is first used.

Against a real S3 server (moto, or radosgw via TEST_S3_ENDPOINT) reached through a real
TCP proxy that counts what the client sends; the fresh process is a real subprocess."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import torch

import tensorstore_ck as tsck

import _zygote as zygote
from _util import tier_state

BS = 16 * 1024
DEADLINE = 120.0  # generous: the machine is shared


class CountingProxy:
    """127.0.0.1:<port> -> the S3 server. `sent`: bytes clients sent through it,
    `conns`: connections accepted; with `down` set, a connection is reset as soon as it
    is accepted (a server that is not there)."""

    def __init__(self, endpoint: str):
        host, port = endpoint.split("://", 1)[1].rsplit(":", 1)
        self.upstream = (host, int(port.rstrip("/")))
        self.sent = self.conns = 0
        self.down = False
        self._lock = threading.Lock()
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", 0))
        self.lsock.listen(64)
        self.endpoint = f"http://127.0.0.1:{self.lsock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.lsock.accept()
            except OSError:
                return
            with self._lock:
                self.conns += 1
            if self.down:
                c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                c.close()
                continue
            try:
                u = socket.create_connection(self.upstream)
            except OSError:
                c.close()
                continue
            threading.Thread(target=self._pump, args=(c, u, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(u, c, False), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket, count: bool) -> None:
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                if count:
                    with self._lock:
                        self.sent += len(data)
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()

    def close(self) -> None:
        self.lsock.close()


@pytest.fixture
def proxy(s3_server):
    p = CountingProxy(s3_server["endpoint_url"])
    yield p
    p.close()


def _opts(s3_server, proxy) -> dict:
    return dict(s3_server, endpoint_url=proxy.endpoint)


def _open(url, opts, refs, **kw) -> tsck.Store:
    return tsck.open_store(url, refs=str(refs), storage_options=opts, block_size=BS, inline_threshold=256, **kw)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(x.view(torch.uint8).equal(y.view(torch.uint8)) for x, y in
                                        ((a[k].contiguous().reshape(-1), b[k].contiguous().reshape(-1)) for k in a))


_RESTORE = r"""
import json, sys
import torch
import tensorstore_ck as tsck
url, refs, local, opts, seed = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])
store = tsck.open_store(url, refs=refs, storage_options=opts, block_size=16384, inline_threshold=256, local=local)
got = store.checkout("job/main")
g = torch.Generator().manual_seed(seed)
want = {"w": torch.randn(64, 256, generator=g), "b": torch.randn(300, generator=g)}
same = all(got[k].view(torch.uint8).equal(want[k].view(torch.uint8)) for k in want)
print("RESTORED", same, getattr(store.remote_core.storage, "opened", None), flush=True)
sys.stdin.readline()  # the test reads the proxy's counters here, then lets the store close
store.close()
"""


@pytest.mark.slow  # a real S3 server, a subprocess
def test_a_restore_from_the_local_tier_in_a_fresh_process_makes_no_request_to_the_remote(
        s3_url, s3_server, proxy, tmp_path):
    """A snapshot put through a tier and uploaded; then a fresh process opens the store
    with that tier and checks it out: bit for bit, and not one byte reaches the S3 server
    (the remote ref table, an LMDB file, is what decides which tier is newer). A put in
    that process then opens the remote storage and uploads."""
    opts, refs, local = _opts(s3_server, proxy), tmp_path / "refs.lmdb", str(tmp_path / "nvme")
    with _open(s3_url, opts, refs, local=local) as store:
        store.put_snapshot(tier_state(1), "job/main", step=1)
        assert store.wait_durable(timeout=DEADLINE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    before = proxy.sent, proxy.conns
    proc = zygote.Popen([sys.executable, "-c", _RESTORE, s3_url, str(refs), local, json.dumps(opts), "1"],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                        env=env)
    try:
        line = proc.stdout.readline()
        assert line.split()[:2] == ["RESTORED", "True"], (line, proc.stderr.read()[-3000:] if not line else "")
        assert (proxy.sent, proxy.conns) == before, "the restore made requests to the remote store"
        assert line.split()[2] == "False"  # the remote storage was never opened
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=DEADLINE) == 0, proc.stderr.read()[-3000:]
        assert (proxy.sent, proxy.conns) == before, "closing the store made requests to the remote store"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        proc.stdin.close()
    with _open(s3_url, opts, refs, local=local) as store:
        assert not store.remote_core.storage.opened
        store.put_snapshot(tier_state(2), "job/main", step=2)
        assert store.wait_durable(timeout=DEADLINE)
        assert store.remote_core.storage.opened and proxy.sent > before[0]
    with _open(s3_url, opts, refs) as remote:  # no tier: the upload is there, whole
        assert remote.show("job/main").step == 2 and _equal(remote.checkout("job/main"), tier_state(2))
        assert remote.fsck().ok


@pytest.mark.slow  # a real S3 server (and a real PostgreSQL server)
@pytest.mark.parametrize("table", ["lmdb", "postgresql"])
def test_a_lost_tier_is_made_again_from_the_ref_tables_record_without_a_request(
        s3_url, s3_server, proxy, tmp_path, table, request):
    """The node's disk is lost: the tier's directory is gone, or empty. The open makes
    the tier again from the remote ref table's record of the store at that location
    (written by the first, eager open): no request reaches the S3 server at open. The
    restore then needs the remote, opens it, checks its marker first and restores bit
    for bit; the tier now records the location verified. A record naming another
    store, or no record at all, leaves the open eager, as before (a tier of another
    store is never made from it)."""
    opts, local = _opts(s3_server, proxy), tmp_path / "nvme"
    refs = request.getfixturevalue("pg_dsn") if table == "postgresql" else str(tmp_path / "refs.lmdb")
    url = f"{s3_url}/{table}"
    with _open(url, opts, refs, local=str(local)) as store:
        store.put_snapshot(tier_state(1), "job/main", step=1)
        assert store.wait_durable(timeout=DEADLINE)
        store_id = store.config["id"]
    from tensorstore_ck.tier.opening import remote_location as _location
    location = _location("s3", url[len("s3://"):], opts)
    for lost in ("removed", "emptied"):
        shutil.rmtree(local)
        if lost == "emptied":
            local.mkdir()
        before = proxy.sent, proxy.conns
        with _open(url, opts, refs, local=str(local)) as store:
            assert (proxy.sent, proxy.conns) == before, "the open of a lost tier made requests to the remote"
            assert not store.remote_core.storage.opened
            assert json.loads((local / "tsck.json").read_text())["id"] == store_id
            assert _equal(store.checkout("job/main"), tier_state(1))
            assert store.remote_core.storage.opened and proxy.sent > before[0]
            assert store.core.refs.tier_rows.verified_get(location) == store_id
    # A record that does not read, or one of another store: the eager open reads the marker.
    def record(data=None):  # (the LMDB table is opened once per process at a time: a store of its own)
        with _open(url, opts, refs) as remote:
            if data is not None:
                remote.reftable.location_put(location, data)
            return remote.reftable.location_get(location)
    cfg = json.loads(record())
    for data in (b"{}", json.dumps(dict(cfg, id="0" * 32)).encode()):  # unreadable; another store's
        record(data)
        shutil.rmtree(local)
        before = proxy.sent
        with _open(url, opts, refs, local=str(local)) as store:
            assert proxy.sent > before  # the marker was read at open
            assert json.loads((local / "tsck.json").read_text())["id"] == store_id
            assert _equal(store.checkout("job/main"), tier_state(1))
        assert json.loads(record())["id"] == store_id  # the eager open wrote it again


@pytest.mark.slow  # a real S3 server
def test_a_tier_of_another_store_is_refused_before_any_request(s3_url, s3_server, proxy, tmp_path):
    """Store A and store B (each its own prefix and ref table), B with a tier. Opening A
    with B's tier is refused (NotAStore, naming both ids) before a byte is sent to the S3
    server: A's ref table is bound to A. Opening A's URL with B's table and B's tier (the
    tier never saw A's location) opens the remote to check, and is refused too."""
    opts = _opts(s3_server, proxy)
    url_a, url_b = s3_url + "/a", s3_url + "/b"
    refs_a, refs_b, local_b = tmp_path / "a.lmdb", tmp_path / "b.lmdb", str(tmp_path / "nvme-b")
    _open(url_a, opts, refs_a).close()
    with _open(url_b, opts, refs_b, local=local_b) as store:
        store.put_snapshot(tier_state(1), "job/main", step=1)
        assert store.wait_durable(timeout=DEADLINE)
    before = proxy.sent
    with pytest.raises(tsck.NotAStore, match="belongs to store"):
        _open(url_a, opts, refs_a, local=local_b)
    assert proxy.sent == before, "the remote store was asked before the tier was refused"
    with pytest.raises(tsck.NotAStore):
        _open(url_a, opts, refs_b, local=local_b)
    with _open(url_b, opts, refs_b, local=local_b) as store:  # its own store still opens it, lazily
        assert _equal(store.checkout("job/main"), tier_state(1)) and not store.remote_core.storage.opened


@pytest.mark.slow  # a real S3 server
def test_a_store_replaced_at_the_tiers_location_is_refused_at_first_use(s3_url, s3_server, proxy, tmp_path):
    """The tier saw its store at this location; since then another store's marker took
    its place there. The open stays lazy (nothing asks the remote), and the first read
    that falls through to the remote checks the marker first: NotAStore, never a block
    of the other store; an upload is refused so too, and stops the uploader (no retry
    makes it the right store)."""
    import s3fs
    opts, refs, local = _opts(s3_server, proxy), tmp_path / "refs.lmdb", tmp_path / "nvme"
    with _open(s3_url, opts, refs, local=str(local)) as store:
        store.put_snapshot(tier_state(1), "job/main", step=1)
        assert store.wait_durable(timeout=DEADLINE)
    fs = s3fs.S3FileSystem(**s3_server, skip_instance_cache=True)
    marker = f"{s3_url[len('s3://'):]}/tsck.json"
    cfg = json.loads(fs.cat_file(marker))
    fs.pipe_file(marker, json.dumps(dict(cfg, id="0" * 32)).encode())
    next(p for p in (local / "blocks").rglob("*") if p.is_file()).unlink()  # a read falls through
    with _open(s3_url, opts, refs, local=str(local)) as store:
        with pytest.raises(tsck.NotAStore, match="belongs to store"):
            store.checkout("job/main")
        store.put_snapshot(tier_state(2), "job/main", step=2)  # its upload: the same refusal stops the uploader
        with pytest.raises(tsck.NotAStore, match="belongs to store"):
            store.wait_durable()


@pytest.mark.slow  # a real S3 server
def test_a_remote_down_at_open_leaves_the_local_restore_and_fails_clearly_on_the_first_upload(
        s3_url, s3_server, proxy, tmp_path, caplog):
    """The S3 server is away (every connection reset) when the store is opened with its
    tier: the open and a restore from the tier succeed; the first upload fails with the
    eager open's error (StorageError: cannot open the store at URL), said in the log and
    retried; once the server is back, the upload lands."""
    opts, refs, local = _opts(s3_server, proxy), tmp_path / "refs.lmdb", str(tmp_path / "nvme")
    with _open(s3_url, opts, refs, local=local) as store:
        store.put_snapshot(tier_state(1), "job/main", step=1)
        assert store.wait_durable(timeout=DEADLINE)
    proxy.down = True
    with caplog.at_level(logging.WARNING, logger="tensorstore_ck.tier"):
        with _open(s3_url, opts, refs, local=local, retry_budget=0) as store:
            assert _equal(store.checkout("job/main"), tier_state(1))
            store.put_snapshot(tier_state(2), "job/main", step=2)
            deadline = time.monotonic() + DEADLINE
            while not any("cannot open the store at " + s3_url in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
                time.sleep(0.2)
            assert not store.show("job/main").durable
            proxy.down = False
            assert store.wait_durable(timeout=DEADLINE)
    with _open(s3_url, _opts(s3_server, proxy), refs) as remote:
        assert remote.show("job/main").step == 2 and _equal(remote.checkout("job/main"), tier_state(2))


@pytest.mark.slow  # a real S3 server
def test_the_early_upload_opens_the_remote_from_the_io_threads(s3_url, s3_server, proxy, tmp_path):
    """With early_upload=True a put's first new blocks are what open the remote storage,
    from several I/O threads at once: it opens once, the blocks are sent early, and the
    snapshot lands whole."""
    opts, refs, local = _opts(s3_server, proxy), tmp_path / "refs.lmdb", str(tmp_path / "nvme")
    with _open(s3_url, opts, refs, local=local) as store:
        store.put_snapshot(tier_state(1), "job/main", step=1)
        assert store.wait_durable(timeout=DEADLINE)
    with _open(s3_url, opts, refs, local=local, early_upload=True, workers=8) as store:
        assert not store.remote_core.storage.opened
        store.put_snapshot(tier_state(2), "job/main", step=2)
        assert store.wait_durable(timeout=DEADLINE)
        assert store.remote_core.storage.opened and store._tier.uploader.teed > 0
    with _open(s3_url, opts, refs) as remote:
        assert remote.show("job/main").step == 2 and _equal(remote.checkout("job/main"), tier_state(2))
        assert remote.fsck().ok
