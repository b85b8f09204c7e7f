"""dist.StoreGroup: a collective put_snapshot / checkout whose members talk through a c10d
Store of their own, without a torch.distributed process group (what benches/bench_scale.py
uses to run thousands of ranks as threads)."""

from __future__ import annotations

import datetime
import os
import threading

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.dist import CALLS, CollectiveContext, StoreGroup
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
