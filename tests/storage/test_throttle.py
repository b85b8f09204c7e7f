"""The per-process write caps: bandwidth (token bucket) and concurrency."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import tensorstore_ck as tsck
from tensorstore_ck.storage import LocalBlockStore
from tensorstore_ck.storage.wrappers import ThrottledStore, WrappedStore


def test_bandwidth_cap_bounds_the_write_rate(tmp_path):
    rate = 4e6  # 4 MB/s
    store = tsck.open_store(tmp_path / "s", write_bandwidth=rate, block_size=1 << 20)
    data = {"w": np.random.default_rng(0).random(6_000_000 // 8)}  # 6 MB, incompressible
    t0 = time.perf_counter()
    info = store.put_snapshot(data, "j/m")
    dt = time.perf_counter() - t0
    # the bucket holds 0.25 s of burst (1 MB); the other 5 MB must wait for tokens: >= 1.25 s
    assert info.bytes_new >= 5_900_000
    assert dt >= (info.bytes_new - 0.25 * rate) / rate * 0.9, dt
    store.close()
    fast = tsck.open_store(tmp_path / "f", block_size=1 << 20)
    t0 = time.perf_counter()
    fast.put_snapshot(data, "j/m")
    assert time.perf_counter() - t0 < dt  # the cap, not the disk, set the pace
    fast.close()


def test_concurrency_cap_bounds_writes_in_flight(tmp_path):
    active, peak, lock = [0], [0], threading.Lock()

    class Slow(WrappedStore):
        def put_if_absent(self, key, bufs):
            with lock:
                active[0] += 1
                peak[0] = max(peak[0], active[0])
            time.sleep(0.02)
            try:
                return self.inner.put_if_absent(key, bufs)
            finally:
                with lock:
                    active[0] -= 1

    store = tsck.open_store(tmp_path / "s", block_size=64 * 1024, workers=8, write_concurrency=2)
    store.storage.inner = Slow(store.storage.inner)  # count below the throttle
    store.put_snapshot({"w": np.random.default_rng(1).random(200_000)}, "j/m")
    assert 1 <= peak[0] <= 2
    store.close()


def test_bad_caps_are_refused(tmp_path):
    with pytest.raises(tsck.InvalidArgument):
        tsck.open_store(tmp_path / "s", write_bandwidth=0)
    with pytest.raises(ValueError):
        ThrottledStore(LocalBlockStore(str(tmp_path / "b")), bytes_per_second=-1)
