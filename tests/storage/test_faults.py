"""Storage that fails, delays and cuts operations short at random: put_snapshot
commits a complete snapshot or raises (a StorageError), the ref never moves to a
partial one, a retry succeeds; gc and fsck under the same faults never delete a
referenced object. On local storage and on s3:// (a real server)."""

from __future__ import annotations

import random

import pytest
import torch

from _util import same_bits

import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import FaultInjectingStore

RULES = {"put": 0.08, "get": 0.05, "exists": 0.05, "delete": 0.2, "sync": 0.05}


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.slow)])
def faulty(request, tmp_path):
    box = {}

    def wrap(s):
        box["f"] = FaultInjectingStore(s, rules=RULES, truncate=request.param == "file", seed=7)
        box["f"].armed = False
        return box["f"]

    if request.param == "file":
        store = tsck.open_store(tmp_path / "s", block_size=16 * 1024, inline_threshold=256, wrap_storage=wrap)
    else:
        opts = request.getfixturevalue("s3_server")
        store = tsck.open_store(request.getfixturevalue("s3_url"), refs=str(tmp_path / "refs.lmdb"),
                                storage_options=opts, block_size=16 * 1024, inline_threshold=256, wrap_storage=wrap)
    yield store, box["f"]
    store.close()


def _state(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"shared": torch.ones(64, 256), "own": torch.randn(32, 256, generator=g), "i": i}


def test_put_commits_whole_or_raises_and_retry_succeeds(faulty):
    store, f = faulty
    acked: dict[int, str] = {}
    raised = 0
    for i in range(25):
        before = store.reftable.get_or_none("job/main")
        f.armed = True
        try:
            info = store.put_snapshot(_state(i), "job/main", step=i)
            acked[i] = info.root
        except tsck.TsckError as e:
            assert isinstance(e, (tsck.StorageError, tsck.IntegrityError)), repr(e)
            raised += 1
            f.armed = False
            assert store.reftable.get_or_none("job/main") == before  # never a partial snapshot
            acked[i] = store.put_snapshot(_state(i), "job/main", step=i).root  # the retry succeeds
        finally:
            f.armed = False
        assert store.resolve("job/main") == acked[i]
    assert raised > 0 and f.faults > 0  # the faults really happened
    for i, root in acked.items():
        assert same_bits(store.checkout(root), _state(i))
    rep = store.fsck()
    assert rep.ok, [str(x) for x in rep.findings]


def test_gc_and_fsck_under_faults_never_delete_referenced_objects(faulty):
    store, f = faulty
    roots = {i: store.put_snapshot(_state(i), "job/main", step=i).root for i in range(12)}
    store.set_retention("job", tsck.Retention(keep_last=4))
    rnd = random.Random(3)
    for _ in range(6):
        f.armed = True
        for op in (store.gc, store.fsck):
            try:
                op()
            except tsck.TsckError:
                pass  # a failed gc or fsck is fine; a wrong deletion is not
        f.armed = False
        # keep writing between runs so gc has live writers' objects to respect
        i = max(roots) + 1
        roots[i] = store.put_snapshot(_state(i), "job/main", step=i).root
        if rnd.random() < 0.5:
            store.gc()
    f.armed = False
    store.gc()
    rep = store.fsck()
    assert rep.ok and rep.orphans == 0, [str(x) for x in rep.findings]
    kept = [x.step for x in store.log("job/main")]
    assert kept == sorted(roots)[-4:][::-1]
    for step in kept:
        assert same_bits(store.checkout(f"job/main@{step}"), _state(step))


def test_truncated_reads_are_detected_not_returned(tmp_path):
    """A short read from storage is an IntegrityError, never wrong bytes."""
    box = {}
    store = tsck.open_store(tmp_path / "s", block_size=16 * 1024, inline_threshold=256,
                            wrap_storage=lambda s: box.setdefault("f", FaultInjectingStore(
                                s, when=lambda op, key: op == "get" and key.startswith("blocks/"), truncate=True)))
    box["f"].armed = False
    store.put_snapshot(_state(1), "job/main", step=1)
    box["f"].armed = True
    with pytest.raises(tsck.IntegrityError):
        store.checkout("job/main")
    box["f"].armed = False
    assert same_bits(store.checkout("job/main"), _state(1))
    store.close()


def test_a_server_that_never_answers_is_a_timeout_not_a_hang(tmp_path):
    """A real socket that accepts connections and never replies (a hung S3 endpoint):
    the read timeout turns it into StorageError after the retries, instead of a
    put or open that never returns. The default timeouts are set when the caller
    gives none."""
    import socket
    import threading
    import time

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])  # keep it open, say nothing
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    opts = {"endpoint_url": f"http://127.0.0.1:{srv.getsockname()[1]}", "key": "k", "secret": "s",
            "config_kwargs": {"read_timeout": 0.5, "connect_timeout": 0.5, "retries": {"max_attempts": 1}}}
    try:
        t0 = time.monotonic()
        with pytest.raises(tsck.StorageError, match="cannot open the store"):
            # bounded by the store's retry budget (5 s here; 60 by default)
            tsck.open_store("s3://hung/p", refs=str(tmp_path / "refs.lmdb"), storage_options=opts, retry_budget=5)
        assert time.monotonic() - t0 < 60
        assert held, "the client never reached the server"
    finally:
        stop.set()
        t.join()
        for c in held:
            c.close()
        srv.close()

    # Nothing listening at all: botocore's EndpointConnectionError (not an OSError)
    # must also arrive as StorageError.
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = s.getsockname()[1]
    s.close()
    with pytest.raises(tsck.StorageError, match="cannot open the store"):
        tsck.open_store("s3://dead/p", refs=str(tmp_path / "refs2.lmdb"), retry_budget=5,
                        storage_options={**opts, "endpoint_url": f"http://127.0.0.1:{dead}"})

    from tensorstore_ck.storage import S3BlockStore
    cfg = S3BlockStore("s3://b/p", {"endpoint_url": "http://127.0.0.1:9"}).fs.config_kwargs
    assert cfg["connect_timeout"] == 10 and cfg["read_timeout"] == 60
    cfg = S3BlockStore("s3://b/p", {"endpoint_url": "http://127.0.0.1:9",
                                    "config_kwargs": {"read_timeout": 5}}).fs.config_kwargs
    assert cfg["read_timeout"] == 5 and cfg["connect_timeout"] == 10
