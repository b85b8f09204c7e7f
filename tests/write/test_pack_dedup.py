"""Packs keep dedup (packparts.py; docs/design/scaling.md, "Packs").

A packed tensor whose bytes a stored pack already holds names that part and is not written
again; new packs form from what changed; a pack a snapshot would name less than half of is
not named (its tensors go into new packs), so old packs die with the snapshots that name
them and gc deletes them. Measured from outside: the bytes under the store's object
prefixes, listed past tensorstore_ck, on a local disk with packs forced on and on a real
S3 server (moto) with its default packs.
"""

from __future__ import annotations

import collections

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.write.packparts import LIVE_SHARE
from tensorstore_ck.write.publish import Publisher
from tensorstore_ck.core.walk import PackedPart, iter_leaves

from _backends import OBJECT_PREFIXES, Backend
from _util import edit_state, peft_state

KiB = 1024
MiB = 1 << 20
OVERHEAD = 64 * KiB  # a commit, the changed manifest nodes (a few hundred leaves), framing


def _adapters(state) -> int:
    return sum(t.numel() * 4 for k, t in state.items() if "lora" in k)


def _same(a, b):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.slow)])
def backend(request, tmp_path):
    if request.param == "file":
        return Backend("file", tmp_path)
    b = Backend("s3", tmp_path, s3_options=request.getfixturevalue("s3_server"))
    request.addfinalizer(b.remove)
    return b


def _open(backend, **kw):
    """Packs on: forced on a local disk (64 MiB, the object stores' default), S3's own default."""
    if backend.kind == "file":
        kw.setdefault("pack_size", 64 * MiB)
    s = backend.open(**kw)
    assert s.pack_size > 0
    return s


def _stored(backend) -> int:
    return sum(backend.objects(OBJECT_PREFIXES).values())


def _grew(backend, store, state, **kw):
    before = _stored(backend)
    info = store.put_snapshot(state, **kw)
    return _stored(backend) - before, info


def _packs(store, target) -> dict:
    """pack address -> (its length, the bytes of it `target` names, each part once)."""
    root = bytes.fromhex(store.resolve(target))
    named: dict = collections.defaultdict(dict)
    glen: dict = {}
    for _desc, contents in iter_leaves(store.core.assets, root).values():
        for x in contents:
            if type(x) is PackedPart:
                named[x.digest][x.off] = x.n
                glen[x.digest] = x.glen
    return {d: (glen[d], sum(parts.values())) for d, parts in named.items()}


def test_a_one_tensor_edit_writes_about_that_tensor(backend):
    with _open(backend) as s:
        st = edit_state()
        s.put_snapshot(st, ref="j/main", step=1)
        assert len(_packs(s, "j/main")) == 1  # the 16 tensors share one pack
        st["t07"] = st["t07"] + 1.0
        grew, info = _grew(backend, s, st, ref="j/main", step=2)
        one = st["t07"].numel() * 4
        assert grew <= one + OVERHEAD, f"a one-tensor edit ({one} B) stored {grew} B on {backend.kind}"
        assert one <= info.bytes_new <= one + OVERHEAD and info.blocks_new == 1
        assert info.bytes_total == 16 * one  # the parts it names of the old pack count in its total
        _same(s.checkout("j/main"), st)
        _same(s.checkout("j/main@1"), edit_state())
        assert s.fsck().ok


def test_a_frozen_base_with_adapters_stores_only_the_changed_adapters(backend):
    """120 frozen 64 KiB tensors, each followed by its 8 KiB adapter: every snapshot after the
    first stores its adapters (one new pack) and names the base's parts of the first pack,
    also from a new Store on the same location (it learns them from the ref's snapshot)."""
    with _open(backend) as s:
        s.put_snapshot(peft_state(adapter_seed=1), ref="ft/main", step=1)
        for step in (2, 3):
            st = peft_state(adapter_seed=step)
            grew, info = _grew(backend, s, st, ref="ft/main", step=step)
            limit = _adapters(st) + OVERHEAD
            assert grew <= limit, f"step {step}: {grew} B stored for {_adapters(st)} B of adapters on {backend.kind}"
            assert _adapters(st) <= info.bytes_new <= limit
            _same(s.checkout("ft/main"), st)
    with _open(backend) as s:  # a new process's Store: nothing in memory of the packs
        st = peft_state(adapter_seed=4)
        grew, info = _grew(backend, s, st, ref="ft/main", step=4)
        assert grew <= _adapters(st) + OVERHEAD, f"a new Store stored {grew} B on {backend.kind}"
        for step in (1, 2, 3, 4):
            _same(s.checkout(f"ft/main@{step}"), peft_state(adapter_seed=step))
        assert s.fsck().ok


def test_a_second_job_on_one_base_shares_it_from_another_store(backend):
    """A fork: one job stores the base; another job, in a Store opened afresh, puts the same
    base with adapters of its own on a new ref and names the first job's parts."""
    with _open(backend) as s:
        s.put_snapshot(peft_state(adapter_seed=1), ref="base/main", step=1)
    with _open(backend) as s:
        st = peft_state(adapter_seed=99)
        grew, info = _grew(backend, s, st, ref="fork/main", step=1)
        assert grew <= _adapters(st) + OVERHEAD, f"a fork stored {grew} B for {_adapters(st)} B on {backend.kind}"
        _same(s.checkout("fork/main"), st)
        _same(s.checkout("base/main"), peft_state(adapter_seed=1))


def test_old_packs_are_abandoned_below_half_and_gc_reclaims_them(tmp_path):
    """20 tensors in one pack, 2 of them (10%) changed per snapshot, only the newest kept:
    what the snapshots write stays near what changed (at most 1/(1 - LIVE_SHARE) of it, plus
    the first), every pack the kept snapshot names is at least LIVE_SHARE its own, and gc
    leaves no other pack: the store stays within 1/LIVE_SHARE of the state (and framing)."""
    b = Backend("file", tmp_path)
    g = torch.Generator().manual_seed(5)
    st = {f"w{i:02d}": torch.randn(8 * KiB, generator=g) for i in range(20)}  # 32 KiB each, 640 KiB
    size = 20 * 32 * KiB
    with _open(b) as s:
        s.set_retention("j", tsck.Retention(keep_last=1))
        written = 0
        for step in range(1, 31):
            if step > 1:
                for k in (2 * step) % 20, (2 * step + 1) % 20:
                    st[f"w{k:02d}"] = torch.randn(8 * KiB, generator=g)
            info = s.put_snapshot(st, ref="j/main", step=step)
            written += info.bytes_new
            s.gc()
            _same(s.checkout("j/main"), st)
        changed = 29 * 2 * 32 * KiB
        assert written <= size + changed / (1 - LIVE_SHARE) + 30 * OVERHEAD, (written, changed)
        packs = _packs(s, "j/main")
        for d, (glen, named) in packs.items():
            assert named >= LIVE_SHARE * glen, (d.hex()[:12], named, glen)
        blocks = b.objects(("blocks/",))
        assert set(k.rsplit("/", 1)[1] for k in blocks) <= {d.hex() for d in packs} | _own_blocks(s), blocks
        assert sum(blocks.values()) <= size / LIVE_SHARE + 64 * KiB
        assert s.fsck().ok


def _own_blocks(store) -> set:
    root = bytes.fromhex(store.resolve("j/main"))
    return {x.hex() for _d, contents in iter_leaves(store.core.assets, root).values()
            for x in contents if type(x) is bytes and len(x) == 32}


def test_a_pack_gc_removes_while_a_put_names_it_is_written_anew(tmp_path, monkeypatch):
    """A put names parts of a pack no kept snapshot names any more; a gc deletes the pack
    between the put's blocks and its move. The fenced move re-validates, finds the pack
    gone, and the put writes those tensors into a new pack and publishes: whole."""
    b = Backend("file", tmp_path)
    st = edit_state(1)
    with _open(b) as s:
        s.put_snapshot(st, ref="a/main", step=1)
        s.put_snapshot(edit_state(2), ref="a/main", step=2)
        (old,) = _packs(s, "a/main@1")
        ran = []
        real = Publisher.write_nodes

        def gc_first(self, *a, **kw):
            if not ran:
                ran.append(True)
                s.forget("a/main@1")
                assert s.gc().deleted_objects > 0
                assert not s.core.assets.block_exists(old)
            return real(self, *a, **kw)

        monkeypatch.setattr(Publisher, "write_nodes", gc_first)
        info = s.put_snapshot(st, ref="b/main", step=1)
        assert ran
        _same(s.checkout("b/main"), st)
        assert s.fsck().ok
        assert info.bytes_new >= 16 * 256 * KiB  # written anew (the same bytes: the same address)


@pytest.mark.parametrize("saver", ["thread", "process"])
def test_asynchronous_puts_from_a_kept_layout_name_the_parts_too(tmp_path, saver):
    """Staged puts planned from the kept layout (the staging buffer holds the planned packs)
    and, with saver="process", written by the saver process: the leftovers of partly named
    packs are packed into a buffer of their own and written here, the rest by the saver."""
    b = Backend("file", tmp_path)
    with _open(b, saver=saver) as s:
        for step in (1, 2, 3):
            st = peft_state(adapter_seed=step)
            before = _stored(b)
            info = s.put_snapshot(st, ref="ft/main", step=step, blocking=False).result()
            if step > 1:
                assert _stored(b) - before <= _adapters(st) + OVERHEAD
                assert info.bytes_new <= _adapters(st) + OVERHEAD
            _same(s.checkout("ft/main"), st)
        assert s.fsck().ok


def _dcp_save(store, state, step):
    import torch.distributed.checkpoint as dcp

    from tensorstore_ck.dcp import TsckWriter
    w = TsckWriter(store, ref="d/main", step=step)
    dcp.save(state, storage_writer=w)
    return w.info


def test_dcp_save_writes_only_the_changed_small_tensors(backend):
    """dcp.save through TsckWriter keeps the packs' rule: a one-tensor edit of 16 packed
    tensors writes that tensor (one new pack), also from a new Store (it learns the parts
    of the ref's snapshot); dcp.load through TsckReader and checkout give the bits back."""
    import torch.distributed.checkpoint as dcp

    from tensorstore_ck.dcp import TsckReader
    st = edit_state()
    one = st["t07"].numel() * 4
    with _open(backend) as s:
        _dcp_save(s, st, 1)
        assert len(_packs(s, "d/main")) == 1
        st["t07"] = st["t07"] + 1.0
        before = _stored(backend)
        info = _dcp_save(s, st, 2)
        assert _stored(backend) - before <= one + OVERHEAD, (_stored(backend) - before, backend.kind)
        assert one <= info.bytes_new <= one + OVERHEAD and info.blocks_new == 1, info
    with _open(backend) as s:  # a new process's Store
        st["t03"] = st["t03"] * 2.0
        before = _stored(backend)
        info = _dcp_save(s, st, 3)
        assert _stored(backend) - before <= one + OVERHEAD, (_stored(backend) - before, backend.kind)
        assert info.blocks_new == 1, info
        target = {k: torch.zeros_like(v) for k, v in st.items()}
        dcp.load(target, storage_reader=TsckReader(s, "d/main"))
        _same(target, st)
        _same(s.checkout("d/main"), st)
        assert s.fsck().ok


def test_dcp_a_tensor_changing_during_the_save_leaves_a_snapshot_that_reads(tmp_path):
    """A tensor whose value changes between the writer's look for stored parts and its
    write (a planner resolving it again, as a training thread would change it) is stored
    whole and named with the hash of the bytes its pack holds: the snapshot reads back,
    with the value written, never an IntegrityError."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultSavePlanner

    from tensorstore_ck.dcp import TsckReader, TsckWriter

    class Changing(DefaultSavePlanner):
        seen: dict = {}

        def resolve_data(self, item):
            t = super().resolve_data(item)
            n = self.seen[item.index.fqn] = self.seen.get(item.index.fqn, 0) + 1
            return t + (n - 1) if isinstance(t, torch.Tensor) else t

    st = edit_state()
    with tsck.open_store(str(tmp_path / "s"), pack_size=64 * MiB) as s:
        dcp.save(st, storage_writer=TsckWriter(s, ref="d/main", step=1), planner=Changing())
        target = {k: torch.zeros_like(v) for k, v in st.items()}
        dcp.load(target, storage_reader=TsckReader(s, "d/main"))
        _same(target, {k: v + 1 for k, v in st.items()})  # the second look's bytes were written
        assert s.fsck().ok
