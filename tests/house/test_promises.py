"""The README's promises, each a test on every road it names.

"Dedup with integrity": identical content (frozen layers, a shared base model, forks,
repeats) is stored once across steps and jobs. Measured here from outside: the bytes a
snapshot adds to storage, listed with fsspec past tensorstore_ck, on each road a user
takes: a local disk (no packs by default), S3 with its default packs (a real S3 server:
moto, radosgw in CI), and a local tier in front of S3 (what reaches the remote once the
upload is durable, and what the node's disk holds). An optimisation for one figure (packs,
the object count) must not break this one unseen.

The other promises have their tests where their machinery lives, each on every road:
- a committed snapshot is never lost (kill -9 anywhere): tests/write/test_crash.py, tests/sim
  (the harness's invariants after every killed round, on file, pg and s3);
- coordination costs each rank O(1) bytes through the c10d Store, every value changed:
  tests/collective/test_scale.py;
- every call that names a snapshot answers as checkout does across tiers:
  tests/tier/test_tier_answers.py;
- resume is bit-identical: checked below on each road, and in tests/store/test_roundtrip.py.
"""

from __future__ import annotations

import pytest
import torch

import tensorstore_ck as tsck

from _backends import OBJECT_PREFIXES, Backend
from _util import edit_state, peft_state

KiB = 1024
# What a snapshot costs beyond its changed tensors: its commit and the manifest nodes
# that changed (a few hundred leaves here), and a pack's framing. Generous, but far below
# any one rewrite of unchanged content (the smallest below is 1.9 MiB).
OVERHEAD = 256 * KiB


def _adapter_bytes(state):
    return sum(t.numel() * t.element_size() for k, t in state.items() if "lora" in k)


class Road:
    """One way a user stores snapshots: `store` to put into, `stored()` the bytes held
    where the promise is judged (after the upload, for a tier)."""

    def __init__(self, kind, tmp_path, request):
        self.kind = kind
        self.local = Backend("file", tmp_path, name="nvme") if kind == "tier" else None
        if kind in ("file", "file-packed"):  # (file-packed: a local disk with S3's default packs)
            self.remote = Backend("file", tmp_path)
            self.store = self.remote.open(**({"pack_size": 64 * 1024 * KiB} if kind == "file-packed" else {}))
        else:
            self.remote = Backend("s3", tmp_path, s3_options=request.getfixturevalue("s3_server"))
            kw = {"local": str(tmp_path / "nvme")} if kind == "tier" else {}
            self.store = self.remote.open(**kw)
            request.addfinalizer(self.remote.remove)
        request.addfinalizer(lambda: self.store.close())  # (the one open at the end)

    def put(self, state, **kw):
        info = self.store.put_snapshot(state, **kw)
        if self.kind == "tier":
            assert self.store.wait_durable(timeout=120), "the tier's upload did not finish"
        return info

    def stored(self) -> list[int]:
        """Bytes under the object prefixes of each place where the promise is judged: the
        store; for a tier, the remote once durable and the node's own disk, each holding
        the snapshot's new content once."""
        places = [self.remote] + ([self.local] if self.local is not None else [])
        return [sum(b.objects(OBJECT_PREFIXES).values()) for b in places]


ROADS = [pytest.param("file"),
         pytest.param("s3", marks=pytest.mark.slow),
         pytest.param("tier", marks=pytest.mark.slow)]


@pytest.fixture(params=ROADS)
def road(request, tmp_path):
    return Road(request.param, tmp_path, request)


def _grew(road, state, **kw):
    """(the most any one place grew by, the put's SnapshotInfo)"""
    before = road.stored()
    info = road.put(state, **kw)
    return max(b - a for a, b in zip(before, road.stored())), info


def _same(a, b):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_a_one_tensor_edit_stores_about_that_tensor(road):
    s = edit_state()
    road.put(s, ref="j/main", step=1)
    s["t07"] = s["t07"] + 1.0
    grew, info = _grew(road, s, ref="j/main", step=2)
    one = s["t07"].numel() * 4
    assert grew <= one + OVERHEAD, f"a one-tensor edit ({one} B) stored {grew} B on {road.kind}"
    assert info.bytes_new <= one + OVERHEAD
    _same(road.store.checkout("j/main"), s)
    _same(road.store.checkout("j/main@1"), edit_state())


def test_a_frozen_base_with_adapters_stores_only_the_adapters(road):
    road.put(peft_state(adapter_seed=1), ref="ft/main", step=1)
    for step in (2, 3):
        s = peft_state(adapter_seed=step)
        grew, info = _grew(road, s, ref="ft/main", step=step)
        limit = _adapter_bytes(s) + OVERHEAD
        assert grew <= limit, f"step {step}: {grew} B stored for {_adapter_bytes(s)} B of changed adapters on {road.kind}"
        assert info.bytes_new <= limit
    _same(road.store.checkout("ft/main"), peft_state(adapter_seed=3))
    _same(road.store.checkout("ft/main@2"), peft_state(adapter_seed=2))


def test_a_second_job_on_one_base_shares_it(road):
    road.put(peft_state(adapter_seed=1), ref="a/main", step=1)
    s = peft_state(adapter_seed=99)
    grew, info = _grew(road, s, ref="b/main", step=1)
    limit = _adapter_bytes(s) + OVERHEAD
    assert grew <= limit, f"a fork of one base stored {grew} B for {_adapter_bytes(s)} B of its own adapters on {road.kind}"
    _same(road.store.checkout("b/main"), s)


def test_a_repeat_stores_nothing_but_its_commit(road):
    s = peft_state()
    road.put(s, ref="r/main", step=1)
    grew, info = _grew(road, s, ref="r/main", step=2)
    assert grew <= OVERHEAD and info.bytes_new <= OVERHEAD


# -- the DCP road: dcp.save through TsckWriter (its packs follow put_snapshot's rules) ----

DCP_ROADS = [pytest.param("file"), pytest.param("file-packed"), pytest.param("s3", marks=pytest.mark.slow)]


@pytest.fixture(params=DCP_ROADS)
def dcp_road(request, tmp_path):
    return Road(request.param, tmp_path, request)


def _dcp_grew(road, state, ref, step):
    """(the bytes the store grew by, the save's SnapshotInfo) of one dcp.save."""
    import torch.distributed.checkpoint as dcp

    from tensorstore_ck.dcp import TsckWriter
    before = road.stored()
    w = TsckWriter(road.store, ref=ref, step=step)
    dcp.save(state, storage_writer=w)
    return max(b - a for a, b in zip(before, road.stored())), w.info


def _dcp_load(road, ref, like):
    import torch.distributed.checkpoint as dcp

    from tensorstore_ck.dcp import TsckReader
    target = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(target, storage_reader=TsckReader(road.store, ref))
    return target


def test_dcp_a_one_tensor_edit_stores_about_that_tensor(dcp_road):
    s = edit_state()
    _dcp_grew(dcp_road, s, "d/main", 1)
    s["t07"] = s["t07"] + 1.0
    grew, info = _dcp_grew(dcp_road, s, "d/main", 2)
    one = s["t07"].numel() * 4
    assert grew <= one + OVERHEAD, f"a one-tensor edit ({one} B) stored {grew} B through DCP on {dcp_road.kind}"
    assert info.bytes_new <= one + OVERHEAD
    _same(_dcp_load(dcp_road, "d/main", s), s)
    _same(dcp_road.store.checkout("d/main"), s)


def test_dcp_a_frozen_base_with_adapters_stores_only_the_adapters(dcp_road, tmp_path):
    _dcp_grew(dcp_road, peft_state(adapter_seed=1), "ft/main", 1)
    for step in (2, 3):
        if step == 3:  # a restarted job: a new Store, nothing in memory but what it learns
            dcp_road.store.close()
            dcp_road.store = dcp_road.remote.open(
                **({"pack_size": 64 * 1024 * KiB} if dcp_road.kind == "file-packed" else {}))
        s = peft_state(adapter_seed=step)
        grew, info = _dcp_grew(dcp_road, s, "ft/main", step)
        limit = _adapter_bytes(s) + OVERHEAD
        assert grew <= limit, (f"step {step}: {grew} B stored through DCP for {_adapter_bytes(s)} B of changed "
                               f"adapters on {dcp_road.kind}")
        assert info.bytes_new <= limit
    _same(_dcp_load(dcp_road, "ft/main", peft_state(adapter_seed=3)), peft_state(adapter_seed=3))
    _same(dcp_road.store.checkout("ft/main@2"), peft_state(adapter_seed=2))
