"""Dedup: identical content is stored once, across steps, tensors and jobs.

The counters in SnapshotInfo (blocks_new / bytes_new) are checked against what
actually appeared in storage: the test lists blocks/ before and after a put and
reads the raw length out of each new block object's 16-byte header. Every test
runs on each backend (file, s3, pg: tests/_backends.py), reading the stored
objects through the Backend (fsspec), not through tensorstore_ck.
"""

from __future__ import annotations

import re
import struct

import blake3
import numpy as np
import pytest
import torch

from _util import assert_same, same_bits

KiB = 1024
MiB = 1024 * 1024
BLOCK = 64 * KiB
TENSOR_SHAPE = (256, 256)  # float32: 256 KiB = 4 blocks of 64 KiB (64 rows each)
TENSOR_BYTES = 256 * 256 * 4
HEX64 = re.compile(r"^[0-9a-f]{64}$")


# ---------------------------------------------------------------- helpers


def all_files(backend, kind_dir: str) -> set[str]:
    """Every stored object under kind_dir/ (keys), whatever its name (temporaries too)."""
    return set(backend.objects((kind_dir + "/",)))


def object_files(backend, kind_dir: str = "blocks") -> dict[str, str]:
    """{64-hex address: key} of the objects under kind_dir/."""
    out = {}
    for key in backend.objects((kind_dir + "/",)):
        name = key.rsplit("/", 1)[-1]
        if HEX64.match(name):
            out[name] = key
    return out


def header(backend, key: str) -> tuple[int, int, int, int, int]:
    """(version, codec, itemsize, kind, raw_len) from a stored object's 16-byte header."""
    h = backend.read(key)[:16]
    assert len(h) == 16, key
    assert h[:4] == b"TSKO", (key, h[:4])
    version, codec, itemsize, kind = h[4], h[5], h[6], h[7]
    (raw_len,) = struct.unpack_from("<Q", h, 8)
    return version, codec, itemsize, kind, raw_len


def raw_len(backend, key: str) -> int:
    return header(backend, key)[4]


def physical_bytes(backend) -> int:
    """Stored size of every block object, as the backend reports it."""
    sizes = backend.objects(("blocks/",))
    return sum(size for key, size in sizes.items() if HEX64.match(key.rsplit("/", 1)[-1]))


def rand_tensor(seed: int, shape=TENSOR_SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def block_addrs(t: torch.Tensor, block: int = BLOCK) -> list[str]:
    """BLAKE3 addresses of a contiguous tensor's fixed-size blocks."""
    b = t.contiguous().numpy().tobytes()
    return [blake3.blake3(b[i : i + block]).hexdigest() for i in range(0, len(b), block)]


def model_state(n: int = 64, seed0: int = 0) -> dict:
    return {"model": {f"layers.{i}.weight": rand_tensor(seed0 + i) for i in range(n)}, "step": 0}


class Snap:
    """Stored objects before a put, so the put's additions can be measured."""

    def __init__(self, backend):
        self.backend = backend
        self.blocks = object_files(backend)
        self.block_paths = all_files(backend, "blocks")
        self.nodes = all_files(backend, "nodes")

    def new_blocks(self) -> dict[str, str]:
        """{address: key} of block objects that appeared since."""
        now = object_files(self.backend)
        return {a: k for a, k in now.items() if a not in self.blocks}


@pytest.fixture
def bstore(backend):
    s = backend.open(block_size=BLOCK, inline_threshold=1024)
    yield s, backend
    s.close()


# ------------------------------------------------------------------ tests


def test_first_put_counts_match_disk(bstore):
    s, bk = bstore
    state = model_state(16)
    before = Snap(bk)
    info = s.put_snapshot(state, ref="jobA/main", step=1)
    new = before.new_blocks()
    assert info.blocks_new == info.blocks_total == 16 * 4 == len(new)
    assert info.bytes_new == info.bytes_total == 16 * TENSOR_BYTES
    assert sum(raw_len(bk, k) for k in new.values()) == info.bytes_new
    for k in new.values():
        version, _codec, _itemsize, kind, _ = header(bk, k)
        assert version == 1 and kind == 0, k  # a block object
    # addresses are BLAKE3 of the raw (uncompressed) block bytes
    want = {a for t in state["model"].values() for a in block_addrs(t)}
    assert set(new) == want


def test_same_state_twice_writes_nothing(bstore):
    s, bk = bstore
    state = model_state(16)
    first = s.put_snapshot(state, ref="jobA/main", step=1)
    assert first.blocks_new == 64
    before = Snap(bk)
    second = s.put_snapshot(state, ref="jobA/main", step=1)
    assert second.blocks_new == 0
    assert second.bytes_new == 0
    assert second.blocks_total == first.blocks_total
    assert second.bytes_total == first.bytes_total
    assert all_files(bk, "blocks") == before.block_paths, "a second identical put created block objects"
    # unchanged subtrees are shared: an identical tree needs no new manifest node
    assert all_files(bk, "nodes") == before.nodes
    assert second.parent == first.root
    assert_same(state["model"], s.checkout("jobA/main")["model"])


def test_one_element_changed_writes_one_block(bstore):
    s, bk = bstore
    state = model_state(64)
    first = s.put_snapshot(state, ref="jobA/main", step=1)
    assert first.blocks_new == first.blocks_total == 256
    assert first.bytes_total == 64 * TENSOR_BYTES == 16 * MiB
    old17 = state["model"]["layers.17.weight"].clone()

    state["model"]["layers.17.weight"][100, 7] += 1.0  # row 100 -> second block of 4
    before = Snap(bk)
    info = s.put_snapshot(state, ref="jobA/main", step=2)
    new = before.new_blocks()
    assert info.blocks_new == 1
    assert len(new) == 1
    (k,) = new.values()
    assert info.bytes_new == raw_len(bk, k) == BLOCK
    assert info.blocks_total == 256 and info.bytes_total == 16 * MiB
    t17 = state["model"]["layers.17.weight"]
    assert set(new) == {block_addrs(t17)[1]}
    assert set(block_addrs(t17)) - set(block_addrs(old17)) == set(new)

    # both snapshots still give back their own bytes
    assert_same(state["model"], s.checkout("jobA/main")["model"])
    old = s.checkout(first.root)
    assert same_bits(old["model"]["layers.17.weight"], old17)
    assert not same_bits(old["model"]["layers.17.weight"], t17)

    # one element in each of three tensors: three blocks
    for i, (r, c) in zip((3, 30, 63), ((0, 0), (255, 255), (130, 1))):
        state["model"][f"layers.{i}.weight"][r, c] *= -1.0
    before = Snap(bk)
    info3 = s.put_snapshot(state, ref="jobA/main", step=3)
    new = before.new_blocks()
    assert info3.blocks_new == len(new) == 3
    assert info3.bytes_new == sum(raw_len(bk, k) for k in new.values()) == 3 * BLOCK
    assert_same(state["model"], s.checkout("jobA/main")["model"])


def test_whole_tensor_changed_writes_exactly_its_blocks(bstore):
    s, bk = bstore
    state = model_state(64)
    s.put_snapshot(state, ref="jobA/main", step=1)
    state["model"]["layers.40.weight"] = rand_tensor(10_000)
    before = Snap(bk)
    info = s.put_snapshot(state, ref="jobA/main", step=2)
    new = before.new_blocks()
    assert info.blocks_new == len(new) == 4
    assert info.bytes_new == sum(raw_len(bk, k) for k in new.values()) == TENSOR_BYTES
    assert set(new) == set(block_addrs(state["model"]["layers.40.weight"]))
    assert_same(state["model"], s.checkout("jobA/main")["model"])


def test_duplicate_tensors_in_one_snapshot_stored_once(bstore):
    s, bk = bstore
    t = rand_tensor(5)
    state = {"a": t, "b": t.clone(), "c": [t.clone(), t.clone()]}
    before = Snap(bk)
    info = s.put_snapshot(state, ref="jobA/main")
    new = before.new_blocks()
    assert len(new) == 4
    assert info.blocks_new == 4
    assert info.bytes_new == sum(raw_len(bk, k) for k in new.values()) == TENSOR_BYTES
    got = s.checkout("jobA/main")
    assert same_bits(got["a"], t) and same_bits(got["b"], t)
    assert same_bits(got["c"][0], t) and same_bits(got["c"][1], t)


def test_small_tensors_are_inlined_not_blocks(backend):
    with backend.open(block_size=BLOCK, inline_threshold=16 * KiB) as s:
        g = torch.Generator().manual_seed(3)
        state = {f"p{i}": torch.randn(256, generator=g) for i in range(50)}  # 1 KiB each
        info = s.put_snapshot(state, ref="jobA/main")
        assert info.blocks_new == 0 and object_files(backend) == {}
        # new: the tensor bytes inlined in the (new) node that holds them (SnapshotInfo)
        assert info.bytes_new == info.bytes_total == 50 * KiB
        got = s.checkout("jobA/main")
        for k, v in state.items():
            assert same_bits(got[k], v), k


def test_a_change_to_an_inlined_tensor_alone_is_new_bytes(backend, caplog):
    """A snapshot whose only change is a tensor inlined in a manifest node (a 16x16 fp32
    Linear weight: under the 16 KiB default threshold, and small enough to share its node,
    so inline with packs too) stores a new node: its inlined tensor bytes are new, in
    SnapshotInfo, the log and the committed log line; the same state again adds nothing."""
    import logging
    with backend.open(block_size=BLOCK) as s:
        lin = torch.nn.Linear(16, 16)
        big = torch.randn(4 * BLOCK // 4, generator=torch.Generator().manual_seed(1))
        first = s.put_snapshot({"lin": lin.state_dict(), "big": big}, ref="jobA/main", step=1)
        assert first.blocks_new == 4 and first.bytes_new == first.bytes_total == 4 * BLOCK + 16 * 16 * 4 + 16 * 4
        assert s.put_snapshot({"lin": lin.state_dict(), "big": big}, ref="jobA/main", step=2).bytes_new == 0
        with torch.no_grad():
            lin.weight[0, 0] += 1
        before = Snap(backend)
        with caplog.at_level(logging.INFO, logger="tensorstore_ck.write.publish"):
            third = s.put_snapshot({"lin": lin.state_dict(), "big": big}, ref="jobA/main", step=3)
        assert all_files(backend, "blocks") == before.block_paths and third.blocks_new == 0
        assert all_files(backend, "nodes") - before.nodes  # the node holding the Linear is new
        assert third.bytes_new == 16 * 16 * 4 + 16 * 4  # weight and bias share that node
        assert [i.bytes_new for i in s.log("jobA/main")] == [third.bytes_new, 0, first.bytes_new]
        line = next(r.getMessage() for r in caplog.records if "snapshot committed" in r.getMessage())
        assert "(1.09 kB new)" in line, line


def test_numpy_arrays_dedup_too(bstore):
    s, bk = bstore
    rng = np.random.default_rng(0)
    state = {"x": rng.standard_normal((512, 128)).astype(np.float32)}  # 256 KiB
    a = s.put_snapshot(state, ref="np/main")
    assert a.blocks_new == 4
    state["x"][511, 0] = 0.5  # last block
    before = Snap(bk)
    b = s.put_snapshot(state, ref="np/main")
    new = before.new_blocks()
    assert b.blocks_new == len(new) == 1
    assert b.bytes_new == raw_len(bk, next(iter(new.values()))) == BLOCK
    got = s.checkout("np/main")["x"]
    assert isinstance(got, np.ndarray) and got.tobytes() == state["x"].tobytes()


def test_two_jobs_share_base_weights(bstore):
    s, bk = bstore
    base = {f"layers.{i}.weight": rand_tensor(i) for i in range(32)}  # 8 MiB, shared
    base_bytes = 32 * TENSOR_BYTES

    def job_state(tag: int) -> dict:
        return {
            "model": dict(base),
            "head": {"w": rand_tensor(50_000 + tag), "b": rand_tensor(60_000 + tag)},
        }

    a_state, b_state = job_state(1), job_state(2)
    head_bytes = 2 * TENSOR_BYTES

    before = Snap(bk)
    phys0 = physical_bytes(bk)
    a = s.put_snapshot(a_state, ref="jobA/main", step=0)
    assert a.job == "jobA"
    assert a.bytes_new == base_bytes + head_bytes
    assert a.bytes_new == sum(raw_len(bk, k) for k in before.new_blocks().values())
    phys_a = physical_bytes(bk) - phys0

    before = Snap(bk)
    b = s.put_snapshot(b_state, ref="jobB/main", step=0)
    new = before.new_blocks()
    assert b.job == "jobB"
    assert b.parent is None
    # only jobB's own tensors were new
    assert b.blocks_new == len(new) == 8
    assert b.bytes_new == head_bytes == sum(raw_len(bk, k) for k in new.values())
    assert set(new) == set(block_addrs(b_state["head"]["w"]) + block_addrs(b_state["head"]["b"]))
    assert b.bytes_total == a.bytes_total == base_bytes + head_bytes
    # and the disk grew by about the heads only, not by another copy of the base
    phys_b = physical_bytes(bk) - phys0 - phys_a
    assert 0 < phys_b <= head_bytes + 8 * 1024
    assert phys_b < 0.25 * phys_a

    # jobB fine-tunes its head only: the frozen base is never written again
    b_state["head"]["w"][0, 0] += 1.0
    before = Snap(bk)
    b2 = s.put_snapshot(b_state, ref="jobB/main", step=1)
    assert b2.blocks_new == len(before.new_blocks()) == 1
    assert b2.parent == b.root

    got_a, got_b = s.checkout("jobA/main"), s.checkout("jobB/main")
    for k in base:
        assert same_bits(got_a["model"][k], base[k]) and same_bits(got_b["model"][k], base[k])
    for k in ("w", "b"):
        assert same_bits(got_a["head"][k], a_state["head"][k])
        assert same_bits(got_b["head"][k], b_state["head"][k])
    assert not same_bits(got_a["head"]["w"], got_b["head"]["w"])
    old_b = s.checkout(b.root)
    assert not same_bits(old_b["head"]["w"], b_state["head"]["w"])

    du = s.du()
    assert {"jobA", "jobB"} <= set(du["jobs"])
    assert du["physical_bytes"] < du["logical_bytes"]
    assert du["dedup_ratio"] > 1.0
