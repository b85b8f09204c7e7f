"""collective.StoreGroup: a collective put_snapshot / checkout whose members talk through a c10d
Store of their own, without a torch.distributed process group (what benches/bench_scale.py
uses to run thousands of ranks as threads)."""

from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.collective import CALLS, CollectiveContext, StoreGroup
from tensorstore_ck.errors import InvalidArgument

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


@pytest.mark.parametrize("rank,world,name", [(2, 2, "g"), (-1, 2, "g"), (0, 0, "g"), (0, 2, ""), (0, 2, "a/b"),
                                             (True, 2, "g")])
def test_a_bad_store_group_is_refused(rank, world, name):
    with pytest.raises(InvalidArgument):
        StoreGroup(object(), rank, world, name)


def test_two_ranks_as_threads_put_and_check_out_through_one_tcpstore(tmp_path):
    import torch.distributed as dist
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, use_libuv=False,
                           timeout=datetime.timedelta(seconds=60))
    first = tsck.open_store(str(tmp_path / "s"))
    before = dict(CALLS._seq)
    W, out, errs, stores = 2, {}, [], {}

    def rank_main(r):
        try:
            kv = dist.TCPStore("127.0.0.1", server.port, None, False, timeout=datetime.timedelta(seconds=60))
            # (not closed here: a Store closes its ref table, which the ranks share)
            store = stores[r] = tsck.open_store(str(tmp_path / "s"), refs=first.reftable)
            store._collective = CollectiveContext()  # one per simulated rank (CALLS is per process)
            g = StoreGroup(kv, r, W, "t")
            st = {"w": tsck.Sharded(torch.full((2, 3), float(r)), (4, 3), (2 * r, 0)), "step": 7}
            info = store.put_snapshot(st, "m", step=7, group=g, timeout=60)
            into = {"w": tsck.Sharded(torch.zeros(2, 3), (4, 3), (2 * (1 - r), 0))}  # the other rank's rows
            got = store.checkout("m", into=into, group=g, timeout=60)
            out[r] = (info.root, got["w"].local.clone())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errs.append(e)
    ts = [threading.Thread(target=rank_main, args=(r,)) for r in range(W)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errs, errs
    assert out[0][0] == out[1][0]  # one snapshot
    assert torch.equal(out[0][1], torch.full((2, 3), 1.0)) and torch.equal(out[1][1], torch.zeros(2, 3))
    assert not dist.is_initialized()
    assert dict(CALLS._seq) == before  # the simulated ranks counted their calls in their own contexts
    whole = first.checkout("m")  # one snapshot of both ranks' rows, readable without any group
    assert torch.equal(whole["w"], torch.tensor([[0.0] * 3] * 2 + [[1.0] * 3] * 2))
    for s in stores.values():
        s.close()
    first.close()


def test_a_tcpstore_wait_blocks_in_the_server_and_wakes_on_a_set_not_a_compare_set():
    """What the protocol's waits rest on (torch's TCPStore, checked through a byte-counting TCP
    proxy): a wait on a missing key is one request, answered by the server when the key is
    set; the client sends nothing while it blocks (no polling). A compare_set that creates the
    key does not wake the waiter: so every key a rank blocks on is written with set (or add)."""
    import socket
    import time
    import torch.distributed as dist
    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False, use_libuv=False,
                           timeout=datetime.timedelta(seconds=60))
    ls = socket.create_server(("127.0.0.1", 0))
    sent = [0]
    socks = []

    def pump(a, b, count):
        try:
            while d := a.recv(65536):
                if count:
                    sent[0] += len(d)
                b.sendall(d)
        except OSError:
            pass

    def accept():
        c, _ = ls.accept()
        s = socket.create_connection(("127.0.0.1", server.port))
        socks.extend((c, s))
        threading.Thread(target=pump, args=(c, s, True), daemon=True).start()
        threading.Thread(target=pump, args=(s, c, False), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    client = dist.TCPStore("127.0.0.1", ls.getsockname()[1], None, False, timeout=datetime.timedelta(seconds=60))
    client.set("warm", b"1")
    woke = threading.Event()

    def waiter(key):
        client.wait([key], datetime.timedelta(seconds=60))
        woke.set()
    before = sent[0]
    t = threading.Thread(target=waiter, args=("k",), daemon=True)
    t.start()
    time.sleep(0.5)
    asked = sent[0]
    time.sleep(1.5)  # blocked all along: one request of a few bytes, then nothing
    assert not woke.is_set() and 0 < asked - before < 100 and sent[0] == asked, (before, asked, sent[0])
    server.set("k", b"v")
    assert woke.wait(30)
    t.join(30)
    woke.clear()
    t = threading.Thread(target=waiter, args=("c",), daemon=True)
    t.start()
    time.sleep(0.5)
    assert server.compare_set("c", b"", b"v") == b"v"
    assert not woke.wait(1.5)  # (the key exists, the waiter still blocks)
    server.set("c", b"v")
    assert woke.wait(30)
    t.join(30)
    for s in socks:
        s.close()
    ls.close()
