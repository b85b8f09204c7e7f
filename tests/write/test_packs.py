"""Packs: small tensors packed into shared blocks (open_store(pack_size=), FORMAT.md "LEAF").

A rank of a large job holds thousands of tensors under a block's size; on an object store
each object costs a request, so they are packed, in state order, into blocks of up to
pack_size bytes of one item size, and each leaf names its part: [pack, offset, the pack's
length]. What must hold: every path in and out (blocking and asynchronous puts, the saver
process, kept layouts, checkout whole, into=, by paths, a region of a sharded tensor,
diff, fsck, gc, the tier's uploads) gives the same bits as without packs; a pack is read
once for all the parts a checkout wants; one changed tensor writes itself alone (its
pack-mates name their parts of the pack already stored: test_pack_dedup.py); a damaged
pack is found and never reaches the caller's memory; hostile pack references are refused.
"""

from __future__ import annotations

import collections
import os

import msgpack
import numpy as np
import pytest
import torch

from _util import CountingReads, assert_same

import tensorstore_ck as tsck
from tensorstore_ck.format.tree import decode_value
from tensorstore_ck.format.chunker import default_pack_size
from tensorstore_ck.storage.wrappers import WrappedStore
from tensorstore_ck.core.walk import PackedPart, iter_leaves

PACK = 96 * 1024  # small enough that a test state makes several packs


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": collections.OrderedDict(
            (f"layer.{i}.w", torch.nn.Parameter(torch.randn(40, 100 + i, generator=g))) for i in range(12)),
        "moments": [torch.randn(3000 + 17 * i, generator=g) for i in range(10)],
        "half": [torch.randn(5000, generator=g).to(torch.bfloat16) for _ in range(6)],
        "ids": torch.arange(9000),  # 8-byte items: a pack of its own item size
        "big": torch.randn(200_000, generator=g),  # 800 KB: blocks of its own
        "arr": np.arange(6000, dtype=np.float32),
        "step": 7,
    }


def _blocks(path, kind: str = "blocks") -> set:
    """The objects of `kind` (blocks, nodes) stored under a local store's root."""
    root = os.path.join(path, kind)
    if not os.path.isdir(root):
        return set()
    return {name for d in os.listdir(root) for name in os.listdir(os.path.join(root, d))}


def _open(path, **kw):
    return tsck.open_store(str(path), block_size=256 * 1024, inline_threshold=1024, pack_size=PACK, **kw)


@pytest.mark.parametrize("saver", ["thread", "process"])
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_packed_snapshots_come_back_bit_for_bit_in_few_objects(tmp_path, saver, blocking):
    with _open(tmp_path / "packed", saver=saver) as s, \
            tsck.open_store(str(tmp_path / "plain"), block_size=256 * 1024, inline_threshold=1024,
                            pack_size=0) as plain:
        for step in range(3):  # the first plans whole, the next from the kept layout
            st = _state(step)
            f = s.put_snapshot(st, "j/main", step=step, blocking=blocking)
            info = f if blocking else f.result()
            plain.put_snapshot(st, "j/main", step=step)
            assert_same(s.checkout("j/main"), st)
            assert info.blocks_total < 12, info  # 30 small tensors and 4 blocks of `big`
        packed, unpacked = _blocks(tmp_path / "packed"), _blocks(tmp_path / "plain")
        assert len(packed) * 3 < len(unpacked), (len(packed), len(unpacked))
        assert s.fsck().ok


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
def test_a_tensor_that_would_be_a_node_of_its_own_is_packed(tmp_path, blocking):
    """Inline, a tensor whose value passes NODE_SPLIT is a node of its own: one object per
    tensor, what packs are for (an FSDP rank's 10,000 tensors of 4-16 KiB made 5,000 node
    objects). With packs it is packed; one that shares its node stays inline; without packs
    nothing changes."""
    state = {"mid": [torch.randn(1500 + i) for i in range(40)],  # 6 KB each: inline, a node each
             "tiny": [torch.randn(50) for _ in range(40)], "step": 1}   # 200 B each: they share nodes
    got = {}
    for name, pack in (("packed", 1 << 20), ("plain", 0)):
        with tsck.open_store(str(tmp_path / name), block_size=1 << 20, inline_threshold=16384,
                             pack_size=pack) as s:
            f = s.put_snapshot(state, "j/main", step=1, blocking=blocking)
            _ = f if blocking else f.result()
            assert_same(s.checkout("j/main"), state)
            assert s.fsck().ok
        got[name] = (len(_blocks(tmp_path / name, "nodes")), len(_blocks(tmp_path / name)))
    assert got["packed"][1] == 1 and got["packed"][0] <= 3, got  # one pack; the tree in a node or three
    assert got["plain"][1] == 0 and got["plain"][0] >= 40, got  # a node a "mid" tensor


def test_no_pack_passes_pack_size_and_a_pack_holds_one_item_size(tmp_path):
    """Read from the manifest: every part's pack length is at most pack_size, the parts of
    one pack tile it exactly, and a pack's parts share an item size."""
    with _open(tmp_path / "s") as s:
        s.put_snapshot(_state(), "j/main")
        packs: dict = collections.defaultdict(list)
        for desc, parts in _parts(s, "j/main"):
            for x in parts:
                packs[x.digest].append((x.off, x.glen, x.n, ITEMSIZE[desc.split()[0]]))
        assert len(packs) >= 3
        for parts in packs.values():
            assert len(parts) >= 2  # a pack of one is a plain leaf
            glen = parts[0][1]
            assert glen <= PACK and all(g == glen for _o, g, _n, _i in parts)
            ends = 0
            for o, _g, n, _i in sorted(parts):
                assert o == ends  # back to back, no gap, no overlap
                ends = o + n
            assert ends == glen
            assert len({i for *_x, i in parts}) == 1


ITEMSIZE = {"float32": 4, "bfloat16": 2, "int64": 8, "<f4": 4}


def _parts(store, ref) -> list:
    """(dtype/shape, [PackedPart]) of each tensor of `ref` stored in a pack."""
    root = bytes.fromhex(store.resolve(ref))
    out = []
    for desc, contents in iter_leaves(store.core.assets, root).values():
        parts = [x for x in contents if type(x) is PackedPart]
        if parts:
            out.append((desc, parts))
    return out


def test_one_changed_tensor_writes_itself_alone_and_diff_names_only_it(tmp_path):
    with _open(tmp_path / "s") as s:
        st = _state()
        a = s.put_snapshot(st, "j/main", step=1)
        b = s.put_snapshot(st, "j/main", step=2)
        assert b.blocks_new == 0  # nothing changed: every pack reused
        with torch.no_grad():
            st["moments"][4][10] += 1.0
        c = s.put_snapshot(st, "j/main", step=3)
        n = st["moments"][4].numel() * 4
        assert c.blocks_new == 1 and c.bytes_new == n and c.stored_new <= n + 64  # that tensor, nothing else
        d = s.diff(a.root, c.root)
        assert [x["path"] for x in d["changed"]] == ["['moments'][4]"], d
        assert d["unchanged"] == 30  # its pack-mates too
        assert_same(s.checkout("j/main@1")["moments"][4], _state()["moments"][4])


def test_a_pack_is_read_once_for_all_its_parts(tmp_path):
    counting = []
    with _open(tmp_path / "s", wrap_storage=lambda st: counting.append(CountingReads(st)) or counting[-1]) as s:
        st = _state()
        s.put_snapshot(st, "j/main")
        reads = counting[0].reads
        reads.clear()
        assert_same(s.checkout("j/main"), st)
        assert reads and max(reads.values()) == 1, reads
        reads.clear()  # one tensor by path: its pack only
        out = s.checkout("j/main", paths=["moments.3"])
        assert torch.equal(out["moments"][3], st["moments"][3])
        assert sum(reads.values()) == 1, reads


class WriteOrder(WrappedStore):
    """The block objects written, in the order they were written."""

    def __init__(self, inner):
        super().__init__(inner)
        self.order = []

    def put_addressed(self, key, bufs):
        if key.startswith("blocks/"):
            self.order.append(key.rsplit("/", 1)[1])
        return self.inner.put_addressed(key, bufs)


def test_a_puts_packs_are_written_before_its_other_blocks(tmp_path):
    """A pack is the longest block job (up to pack_size where a block is block_size): started
    last, after the large tensors' blocks, it would be the put's tail. The small tensors
    here come last in the state; with one writer thread the packs' objects are still
    written first. (The saver process takes its jobs in the same order: chunker.job_order.)"""
    wrote = []
    g = torch.Generator().manual_seed(3)
    st = {"big": torch.randn(300_000, generator=g), "small": [torch.randn(4000 + i, generator=g) for i in range(8)]}
    with _open(tmp_path / "s", workers=1, wrap_storage=lambda x: wrote.append(WriteOrder(x)) or wrote[-1]) as s:
        s.put_snapshot(st, "j/main")
        packs = {p.digest.hex() for _d, parts in _parts(s, "j/main") for p in parts}
        assert len(packs) >= 2, packs
        assert_same(s.checkout("j/main"), st)
    order = wrote[-1].order
    assert len(order) > len(packs) and set(order[:len(packs)]) == packs, (order, packs)


def test_a_checkouts_packs_are_read_before_its_other_blocks(tmp_path):
    """The read side of the rule above: a checkout starts its packs' reads first."""
    g = torch.Generator().manual_seed(4)
    st = {"big": torch.randn(300_000, generator=g), "small": [torch.randn(4000 + i, generator=g) for i in range(8)]}
    with _open(tmp_path / "s") as s:
        s.put_snapshot(st, "j/main")
    read = []
    with _open(tmp_path / "s", workers=1, wrap_storage=lambda x: read.append(CountingReads(x)) or read[-1]) as s:
        packs = {p.digest.hex() for _d, parts in _parts(s, "j/main") for p in parts}
        assert len(packs) >= 2, packs
        read[-1].order.clear()
        assert_same(s.checkout("j/main"), st)
    order = read[-1].order
    assert len(order) > len(packs) and set(order[:len(packs)]) == packs, (order, packs)


def test_checkout_into_the_callers_tensors_fills_parts_and_a_damaged_pack_leaves_them_as_they_were(tmp_path):
    with _open(tmp_path / "s") as s:
        st = _state()
        s.put_snapshot(st, "j/main")
        into = _state(5)
        s.checkout("j/main", into=into)
        assert_same({k: into[k] for k in ("model", "moments", "half", "ids")},
                    {k: st[k] for k in ("model", "moments", "half", "ids")})
        # Damage every pack: a checkout into the caller's tensors fails and changes none.
        packs = _packs_of(s, "j/main")
        for d in packs:
            p = tmp_path / "s" / "blocks" / d[:2] / d
            data = bytearray(p.read_bytes())
            data[-1] ^= 0xFF
            os.chmod(p, 0o644)
            p.write_bytes(bytes(data))
        mine = _state(9)
        before = {k: [t.clone() for t in mine["moments"]] for k in ("moments",)}
        with pytest.raises(tsck.IntegrityError):
            s.checkout("j/main", into=mine)
        assert all(torch.equal(a, b) for a, b in zip(mine["moments"], before["moments"]))
        report = s.fsck()
        assert not report.ok
        named = " ".join(str(f) for f in report.findings)
        assert all(d in named for d in packs), named


def _packs_of(store, ref) -> set:
    return {x.digest.hex() for _d, parts in _parts(store, ref) for x in parts}


def test_a_region_of_a_packed_sharded_piece_is_read_from_its_part(tmp_path):
    """A Sharded piece under pack_size is packed; checkout into another piece of the same
    tensor reads the rows it needs out of its part (read_box)."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(64, 50, generator=g)
    with _open(tmp_path / "s") as s:
        st = {"w": tsck.Sharded(full[:32].clone(), (64, 50), (0, 0)),
              "v": tsck.Sharded(full[32:].clone(), (64, 50), (32, 0)),
              "other": [torch.randn(2000, generator=g) for _ in range(4)]}
        s.put_snapshot(st, "j/main")
        assert _packs_of(s, "j/main")
        target = {"w": tsck.Sharded(torch.zeros(20, 50), (64, 50), (10, 0))}
        s.checkout("j/main", paths=["w"], into=target)
        assert torch.equal(target["w"].local, full[10:30])


def test_gc_keeps_the_packs_a_kept_snapshot_names_and_deletes_the_rest(tmp_path):
    with _open(tmp_path / "s") as s:
        s.put_snapshot(_state(1), "j/main", step=1)
        s.put_snapshot(_state(2), "j/main", step=2)
        old, new = _packs_of(s, "j/main@1"), _packs_of(s, "j/main")
        assert old and new and not old & new
        s.set_retention("j", tsck.Retention(keep_last=1))
        s.prune("j")
        s.gc()
        left = _blocks(tmp_path / "s")
        assert new <= left and not old & left
        assert_same(s.checkout("j/main"), _state(2))
        assert s.fsck().ok


def test_a_tier_packs_by_default_and_the_remote_alone_restores(tmp_path):
    """With local= the packs are on by default (an object store's request rate); the
    uploader sends each pack as one object, recoded for the remote, same address."""
    st = _state()
    with tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "tier"), block_size=256 * 1024,
                         inline_threshold=1024) as s:
        assert s.pack_size == default_pack_size(True) > 0  # (DEFAULT_PACK_SIZE unless TESTS_PACK_SIZE)
        s.put_snapshot(st, "j/main")
        assert s.wait_durable(timeout=60)
        packs = _packs_of(s, "j/main")
    assert len(packs) >= 2
    assert packs <= _blocks(tmp_path / "remote")
    with tsck.open_store(str(tmp_path / "remote"), create=False) as r:  # the remote alone
        assert r.pack_size == default_pack_size(False)  # a local disk: 0 (unless TESTS_PACK_SIZE); read
        assert_same(r.checkout("j/main"), st)
        assert r.fsck().ok


def _leaf_body(**g) -> dict:
    body = {"dt": "float32", "sh": [4], "n": 16}
    body.update(g)
    return {"T": body}


@pytest.mark.parametrize("bad", [
    dict(g=[b"\0" * 32, 0]),                      # not three fields
    dict(g=[b"\0" * 31, 0, 64]),                  # not an address
    dict(g=[b"\0" * 32, -1, 64]),                 # negative offset
    dict(g=[b"\0" * 32, 60, 64]),                 # the part passes the pack's end
    dict(g=[b"\0" * 32, 0, 0]),                   # an empty pack
    dict(g=[b"\0" * 32, 0, (256 << 20) + 1]),     # a pack past the block limit
    dict(g=[b"\0" * 32, 0, 64], bs=16, b=[b"\0" * 32]),  # a part and blocks at once
    dict(g=[b"\0" * 32, True, 64]),               # a bool is not an offset
    dict(g=(b"\0" * 32, 0, 64, 1)),               # four fields
    dict(g=[b"\0" * 32, 0, 64], x=b"\0" * 16),     # a part and inline bytes at once
    dict(g=[b"\0" * 32, 0, 64], h=b"\0" * 31),    # a content hash that is not one
    dict(g=[b"\0" * 32, 0, 64], h="x" * 32),       # nor a str
], ids=lambda b: repr(b)[:40])
def test_hostile_pack_references_are_refused(bad):
    raw = msgpack.unpackb(msgpack.packb(_leaf_body(**bad), use_bin_type=True), raw=False)
    with pytest.raises(tsck.FormatError, match="pack reference|block layout|inline tensor bytes|content hash"):
        decode_value(raw)


def test_a_sound_pack_reference_decodes_to_its_part():
    raw = msgpack.unpackb(msgpack.packb(_leaf_body(g=[b"\1" * 32, 48, 64]), use_bin_type=True), raw=False)
    leaf = decode_value(raw)
    assert leaf.part == (48, 64) and leaf.blocks == [b"\1" * 32] and list(leaf.stored_blocks()) == [(b"\1" * 32, 64)]
    assert leaf.content is None  # written before parts named their content: read all the same
    raw = msgpack.unpackb(msgpack.packb(_leaf_body(g=[b"\1" * 32, 48, 64], h=b"\2" * 32), use_bin_type=True),
                          raw=False)
    assert decode_value(raw).content == b"\2" * 32


@pytest.mark.parametrize("value", ["1.5", "-1", str((256 << 20) + 1), "x"])
def test_a_bad_pack_size_from_the_environment_is_refused(tmp_path, monkeypatch, value):
    monkeypatch.setenv("TSCK_PACK_SIZE", value)
    with pytest.raises(tsck.InvalidArgument, match="TSCK_PACK_SIZE"):
        tsck.open_store(str(tmp_path / "s"))


def test_dcp_save_packs_small_items_and_dcp_load_and_checkout_read_them(tmp_path):
    """TsckWriter packs a rank's small items as put_snapshot does (DCP's own write items);
    dcp.load through TsckReader and store.checkout give the saved bits back, and a second
    save of the same state writes no pack anew."""
    import torch.distributed.checkpoint as dcp
    from tensorstore_ck.dcp import TsckReader, TsckWriter
    g = torch.Generator().manual_seed(11)
    sd = {"layers": {f"{i}": torch.randn(30, 50 + i, generator=g) for i in range(20)},
          "half": {f"{i}": torch.randn(3000, generator=g).to(torch.bfloat16) for i in range(4)},
          "big": torch.randn(150_000, generator=g)}
    with _open(tmp_path / "s") as s, \
            tsck.open_store(str(tmp_path / "plain"), block_size=256 * 1024, inline_threshold=1024,
                            pack_size=0) as plain:
        w = TsckWriter(s, ref="d/main", step=1)
        dcp.save(sd, storage_writer=w)
        dcp.save(sd, storage_writer=TsckWriter(plain, ref="d/main", step=1))
        assert len(_blocks(tmp_path / "s")) * 3 < len(_blocks(tmp_path / "plain"))
        assert _packs_of(s, "d/main")
        target = {"layers": {k: torch.zeros_like(v) for k, v in sd["layers"].items()},
                  "half": {k: torch.zeros_like(v) for k, v in sd["half"].items()},
                  "big": torch.zeros_like(sd["big"])}
        dcp.load(target, storage_reader=TsckReader(s, "d/main"))
        assert_same(target, sd)
        assert_same(s.checkout("d/main"), sd)
        again = TsckWriter(s, ref="d/main", step=2)
        dcp.save(sd, storage_writer=again)
        assert again.info.blocks_new == 0 and again.info.blocks_total == w.info.blocks_total
        assert s.fsck().ok
