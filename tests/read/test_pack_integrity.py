"""A packed leaf's content hash is checked (FORMAT.md LEAF `h`; docs/design/scaling.md, "Packs").

A pack's address covers the whole pack, not what a leaf claims of its part. A leaf whose
`h` does not match its part's bytes (a buggy or hostile writer: stored bytes are untrusted)
must never be read as that tensor, and must not poison dedup: a later put that finds the
claimed hash in what it learned from stored manifests must not name that part. The bad
leaf is written by the project's own writer with one hook: the hash it records for one
packed tensor is that of other bytes. Real LMDB stores on a local disk, packs on.
"""

from __future__ import annotations

import blake3
import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.write import packparts
from tensorstore_ck.core.walk import PackedPart, iter_leaves

from _util import CountingReads

N = 4096  # float32 elements: 16 KiB, packed (under pack_size, over inline_threshold)


def _t(seed: int) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed))


def _h(t: torch.Tensor) -> bytes:
    return blake3.blake3(t.numpy().tobytes()).digest()


X, Y, W, Z = _t(1), _t(2), _t(3), _t(4)


def _open(path, **kw):
    return tsck.open_store(str(path), pack_size=64 << 20, compression="none", **kw)


def _parts(store, target) -> dict:
    """path -> (pack, offset) of each packed tensor `target` names."""
    root = bytes.fromhex(store.resolve(target))
    return {p: (x.digest, x.off) for p, (_d, contents) in iter_leaves(store.core.assets, root).items()
            for x in contents if type(x) is PackedPart}


def _put_lying(monkeypatch, store, ref="bad/main"):
    """{"a": X, "b": Y, "c": W} in one pack, the leaf of "a" claiming Z's hash."""
    real = packparts._hash_members

    def lying(pack):
        real(pack)
        for m in pack.members:
            if m.path == "['a']":
                m.content = _h(Z)

    with monkeypatch.context() as mp:
        mp.setattr(packparts, "_hash_members", lying)
        info = store.put_snapshot({"a": X, "b": Y, "c": W}, ref=ref, step=1)
    parts = _parts(store, ref)
    assert len({d for d, _o in parts.values()}) == 1, parts  # one pack holds all three
    return info


@pytest.fixture
def lying_store(tmp_path, monkeypatch):
    with _open(tmp_path / "s") as s:
        info = _put_lying(monkeypatch, s)
    return tmp_path / "s", info.root


def _names_a(e: tsck.IntegrityError, root: str):
    assert e.path == "['a']" and e.snapshot == root, (e.path, e.snapshot)
    assert "content hash" in str(e) and root[:16] in str(e), str(e)


def test_a_leaf_whose_part_does_not_match_its_hash_is_refused_on_every_read(lying_store):
    path, root = lying_store
    with _open(path) as s:
        with pytest.raises(tsck.IntegrityError) as e:
            s.checkout("bad/main")
        _names_a(e.value, root)
        with pytest.raises(tsck.IntegrityError) as e:
            s.checkout("bad/main", paths=["a"])
        _names_a(e.value, root)
        got = s.checkout("bad/main", paths=["b", "c"])  # its pack-mates read right
        assert torch.equal(got["b"], Y) and torch.equal(got["c"], W)
        # Into the caller's tensors: the bounce buffer's bytes are checked before any copy.
        mine = {"a": torch.zeros(N), "b": torch.zeros(N), "c": torch.zeros(N)}
        with pytest.raises(tsck.IntegrityError) as e:
            s.checkout("bad/main", into=mine)
        _names_a(e.value, root)
        assert not mine["a"].any(), "a leaf's unverified bytes reached the caller's tensor"
        # A region of it into a sharded piece (the collective and resharding read path).
        piece = {"a": tsck.Sharded(torch.zeros(N // 2), (N,), (N // 4,))}
        with pytest.raises(tsck.IntegrityError) as e:
            s.checkout("bad/main", paths=["a"], into=piece)
        _names_a(e.value, root)
        assert not piece["a"].local.any()


def test_the_dcp_reader_refuses_it(lying_store):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from tensorstore_ck.dcp import TsckReader
    path, root = lying_store
    with _open(path) as s:
        target = {"a": torch.zeros(N), "b": torch.zeros(N), "c": torch.zeros(N)}
        with pytest.raises(CheckpointException) as e:
            dcp.load(target, storage_reader=TsckReader(s, "bad/main"))
        ((err, _trace),) = e.value.failures.values()  # DCP wraps what a reader raises
        assert isinstance(err, tsck.IntegrityError) and err.path == "'a'" and err.snapshot == root, err
        assert not target["a"].any()


def test_fsck_names_the_snapshot_and_path_of_the_lying_leaf(lying_store):
    path, root = lying_store
    with _open(path) as s:
        rep = s.fsck()
        assert not rep.ok
        bad = [f for f in rep.findings if f.problem == "bad_part"]
        assert len(bad) == 1 and len(rep.findings) == 1, [str(f) for f in rep.findings]
        assert bad[0].snapshot == root and bad[0].path == "['a']" and "ref:bad/main" in bad[0].names, str(bad[0])
        # Its pack is whole: a repair moves nothing aside (the leaf, not the pack, is wrong).
        rep = s.fsck(repair=True)
        assert not rep.moved and [f.problem for f in rep.findings] == ["bad_part"]
        assert s.checkout("bad/main", paths=["b"])["b"].equal(Y)


def test_a_later_put_of_the_claimed_bytes_does_not_name_the_lying_part(lying_store):
    """A new Store learns the lying snapshot's parts from its manifest: the entry claiming
    Z's hash is checked against the pack's bytes before it is named, found false and
    dropped; Z is written anew and reads back bit for bit. The pack's honest parts (b, c)
    are still named (checked the same way): dedup holds."""
    path, _root = lying_store
    with _open(path) as s:
        old = _parts(s, "bad/main")
        info = s.put_snapshot({"z": Z, "b": Y, "c": W}, ref="bad/main", step=2)
        got = s.checkout("bad/main")
        assert torch.equal(got["z"], Z) and torch.equal(got["b"], Y) and torch.equal(got["c"], W)
        new = _parts(s, "bad/main")
        assert new.get("['z']") != old["['a']"], "the put named the part whose bytes are not Z"
        assert new["['b']"] == old["['b']"] and new["['c']"] == old["['c']"]  # honest parts named again
        assert N * 4 <= info.bytes_new < 2 * N * 4  # Z alone written
        rep = s.fsck()
        assert [(f.problem, f.snapshot, f.path) for f in rep.findings] == [("bad_part", _root, "['a']")]


def test_parts_learned_from_a_stored_manifest_are_checked_once_per_pack(tmp_path):
    """A new Store reads a stored pack once to check the parts it learned of it before
    naming them, and not again for its later puts; a Store that wrote the pack names its
    parts without reading it (it hashed them itself)."""
    counting = []
    st = {f"t{i}": _t(10 + i) for i in range(8)}
    with _open(tmp_path / "s", wrap_storage=lambda x: counting.append(CountingReads(x)) or counting[-1]) as s:
        s.put_snapshot(st, ref="j/main", step=1)
        (pack,) = {d for d, _o in _parts(s, "j/main").values()}
        st["t0"], st["t1"] = _t(98), _t(99)
        s.put_snapshot(st, ref="j/main", step=2)
        assert counting[0].reads[pack.hex()] == 0  # its own parts: named unread
    counting.clear()
    with _open(tmp_path / "s", wrap_storage=lambda x: counting.append(CountingReads(x)) or counting[-1]) as s:
        for step in (3, 4, 5):
            st["t2"] = _t(100 + step)
            info = s.put_snapshot(st, ref="j/main", step=step)
            assert info.bytes_new < 2 * N * 4  # the unchanged tensors named, not written
        assert counting[0].reads[pack.hex()] == 1, counting[0].reads
        got = s.checkout("j/main")
        assert all(torch.equal(got[k], v) for k, v in st.items())


def test_export_and_diff_refuse_it(lying_store):
    """A standalone file of the snapshot is never written with the wrong bytes, and diff,
    which reads a part's bytes when the same tensor sits elsewhere in another snapshot,
    checks them as checkout does."""
    from tensorstore_ck.interchange.export import export_file
    path, root = lying_store
    with tsck.open_store(str(path), pack_size=0) as s:  # "a" in a block of its own
        s.put_snapshot({"a": X}, ref="plain/main", step=1)
        with pytest.raises(tsck.IntegrityError) as e:
            export_file(s, "bad/main", path.parent / "out.safetensors", fmt="safetensors")
        _names_a(e.value, root)
        assert not (path.parent / "out.safetensors").exists()
        with pytest.raises(tsck.IntegrityError) as e:
            s.diff("plain/main", "bad/main")
        assert e.value.path == "['a']" and e.value.snapshot == root, str(e.value)
