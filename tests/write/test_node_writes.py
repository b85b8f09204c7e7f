"""A put's manifest nodes on an object store go out in parallel (a request costs
milliseconds there; thousands of tensors make hundreds of nodes), all stored before the
commit; a failed one publishes nothing; a pool worker that writes nodes does not wait
on its own pool."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.core.core import POOL_PREFIX
from tensorstore_ck.errors import TsckError
from tensorstore_ck.write.publish import Publisher
from tensorstore_ck.storage.wrappers import InjectedFault, WrappedStore

WAIT = 60.0  # seconds an event may take on a loaded machine before the test calls it missing


def many_nodes_state(n: int = 16) -> dict:
    # Modules whose entries encode past tree.NODE_SPLIT (the text): a manifest node each,
    # holding a tensor in a block and one inlined.
    return {f"m{i}": {"w": torch.arange(20_000, dtype=torch.float32) + i, "b": torch.full((16,), float(i)),
                      "note": f"{i}" + "x" * 5000}
            for i in range(n)} | {"step": 7}


class RemoteLike(WrappedStore):
    """A local folder that calls itself remote (local=False), as S3 does, so the put takes
    the object-store path. Node writes meet at a rendezvous: the first waits until a
    second is in flight beside it, which only a parallel writer brings."""

    def __init__(self, inner, fail_node: int | None = None, meet: bool = True):
        super().__init__(inner)
        self.meet = meet
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most = 0
        self.nodes = 0
        self.met = threading.Event()
        self.fail_node = fail_node

    @property
    def local(self):
        return False

    def put_addressed(self, key, bufs):
        if not key.startswith("nodes/"):
            return self.inner.put_addressed(key, bufs)
        with self.lock:
            self.nodes += 1
            nth = self.nodes
            self.in_flight += 1
            self.most = max(self.most, self.in_flight)
            if self.in_flight >= 2:
                self.met.set()
        try:
            if nth == 1 and self.meet:
                self.met.wait(WAIT)
            if self.fail_node is not None and nth == self.fail_node:
                raise InjectedFault(28, f"injected: no space left writing {key}")
            return self.inner.put_addressed(key, bufs)
        finally:
            with self.lock:
                self.in_flight -= 1


def _open(path, pack_size=None, **kw):
    holder = []

    def wrap(s):
        holder.append(RemoteLike(s, **kw))
        return holder[0]
    return tsck.open_store(str(path), wrap_storage=wrap, pack_size=pack_size), holder


def test_nodes_of_an_object_store_put_go_out_in_parallel_and_read_back_whole(tmp_path):
    state = many_nodes_state()
    st, holder = _open(tmp_path / "remote", pack_size=0)
    info = st.put_snapshot(state, ref="j/main", step=1)
    rs = holder[0]
    assert rs.nodes > 10
    assert rs.met.is_set() and rs.most >= 2, "the node writes went out one at a time"
    assert st.fsck().ok
    got = st.checkout("j/main")
    assert set(got) == set(state)
    for k, v in state.items():
        if isinstance(v, dict):
            assert torch.equal(got[k]["w"], v["w"]) and torch.equal(got[k]["b"], v["b"]) and got[k]["note"] == v["note"]
    st.close()
    # The same statistics as a store whose nodes are written one by one (a local disk).
    ref = tsck.open_store(str(tmp_path / "local"), pack_size=0)
    seq = ref.put_snapshot(state, ref="j/main", step=1)
    ref.close()
    # All new, the inlined tensors included (counted from the nodes stored new).
    assert info.bytes_new == info.bytes_total > info.blocks_total * 80_000
    assert (info.bytes_new, info.bytes_total, info.blocks_total, info.blocks_new) == \
        (seq.bytes_new, seq.bytes_total, seq.blocks_total, seq.blocks_new)


def test_a_failed_node_write_publishes_nothing(tmp_path):
    st, holder = _open(tmp_path / "remote", meet=False)
    first = st.put_snapshot({"x": torch.ones(5000)}, ref="j/main", step=1)
    holder[0].nodes, holder[0].fail_node = 0, 5
    with pytest.raises(TsckError, match="no space left"):
        st.put_snapshot(many_nodes_state(), ref="j/main", step=2)
    assert holder[0].nodes >= 5
    assert st.resolve("j/main") == first.root
    assert torch.equal(st.checkout("j/main")["x"], torch.ones(5000))
    assert st.fsck().ok
    st.close()


def test_a_pool_worker_writes_its_nodes_itself(tmp_path):
    # On a pool of one worker, a write_nodes run by that worker must not queue its nodes behind itself.
    st, holder = _open(tmp_path / "remote", meet=False)
    one = ThreadPoolExecutor(1, thread_name_prefix=POOL_PREFIX)
    pub = Publisher(st.core.assets, st.core.refs, one)
    # A node per entry (past tree.NODE_SPLIT).
    value = st.planner().plan({f"m{i}": {"v": i, "s": f"{i}" + "x" * 5000} for i in range(20)}).value
    try:
        fut = pub.pool.submit(pub.write_nodes, value, None, [])
        top, payloads = fut.result(timeout=WAIT)
    finally:
        pub.pool.shutdown(wait=False, cancel_futures=True)  # a worker stuck on its own queue is let go
    assert len(payloads) > 1 and len(top) == 32 and holder[0].nodes == len(payloads)
    st.close()
