"""The bytes that land and the bytes that are stored are
exactly the verified / hashed ones.

* checkout(into=) with a corrupt block: no unverified byte ever reaches the caller's
  tensors; each of them ends up wholly old, wholly the snapshot's, or (for the
  tensor whose blocks were being copied when the failure came) a mix of the two,
  never anything else; the error says which paths are which, and nothing else in
  the tree (inline tensors, scalars, missing keys) changed.
* a blocking put whose source tensor changes between hashing and writing (a
  storage wrapper changes it from inside the store's exists / put_if_absent, the
  window between hashing and writing): what is stored under every address hashes to that
  address, and a later put of the same content dedups onto a readable object.
* a put whose block write fails returns only once its writes still running ended (one
  running after would read a buffer lent out again).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

import blake3
import pytest
import torch

from _util import same_bits

import tensorstore_ck as tsck
from tensorstore_ck.core.assets import Assets
from tensorstore_ck.errors import IntegrityError, SnapshotAborted
from tensorstore_ck.storage.local import LocalBlockStore
from tensorstore_ck.storage.wrappers import WrappedStore

BLOCK = 64 * 1024
INLINE = 512
REF = "job/main"
HEX64 = re.compile(r"^[0-9a-f]{64}$")
HEADER = 16  # docs/FORMAT.md: the object frame's header


# --------------------------------------------------------------------------------------
# 7: checkout(into=) never leaves unverified bytes in the caller's memory
# --------------------------------------------------------------------------------------

def _state() -> dict:
    g = torch.Generator().manual_seed(11)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731 - random floats: stored raw
    return {
        "model": {
            "a": r(96, 256),       # 96 KiB: 2 blocks
            "b": r(256, 256),      # 256 KiB: 4 blocks
            "c": r(64, 256),       # 64 KiB: 1 block
            "bias": r(16),         # inline
            "d": r(300, 256),      # 300 KiB: 5 blocks
        },
        "opt": [{"m": r(128, 256), "v": r(200, 256)}],
        "step": 5,
        "name": "new",
    }


def _tensors(state, prefix=""):
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from _tensors(v, f"{prefix}[{k!r}]")
    elif isinstance(state, list):
        for i, v in enumerate(state):
            yield from _tensors(v, f"{prefix}[{i}]")


def _old_like(state):
    """A tree shaped like `state` whose every tensor byte differs from the snapshot's
    byte and from that byte with its low bit flipped (the corruption below)."""
    if isinstance(state, torch.Tensor):
        u = state.reshape(-1).view(torch.uint8) ^ 0xF0
        return u.view(state.dtype).reshape(state.shape).clone()
    if isinstance(state, dict):
        return {k: _old_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_old_like(v) for v in state]
    return state


def _blocks(root: Path) -> list[Path]:
    return sorted(p for p in (root / "blocks").rglob("*") if p.is_file() and HEX64.match(p.name))


@pytest.fixture(scope="module")
def snap(tmp_path_factory):
    root = tmp_path_factory.mktemp("into") / "store"
    state = _state()
    with tsck.open_store(root, block_size=BLOCK, inline_threshold=INLINE) as s:
        s.put_snapshot(state, ref=REF)
    assert len(_blocks(root)) == 2 + 4 + 1 + 5 + 2 + 4
    return root, state


def _classify(old: torch.Tensor, new: torch.Tensor, got: torch.Tensor) -> str:
    o, n, g = (t.reshape(-1).view(torch.uint8) for t in (old, new, got))
    is_old, is_new = g == o, g == n
    assert bool((is_old | is_new).all()), "a byte that is neither the old value nor the snapshot's"
    if bool(is_new.all()):
        return "replaced"
    if bool(is_old.all()):
        return "untouched"
    return "partial"


@pytest.mark.parametrize("workers", [1, 4])
def test_checkout_into_corrupt_block_leaves_only_old_or_verified_bytes(snap, tmp_path, workers):
    root, state = snap
    import shutil
    for victim_i, victim in enumerate(_blocks(root)):
        copy = tmp_path / f"s{workers}-{victim_i}"
        shutil.copytree(root, copy)
        vfile = copy / victim.relative_to(root)
        data = bytearray(vfile.read_bytes())
        data[HEADER + len(data[HEADER:]) // 2] ^= 0x01  # one flipped bit in the payload
        vfile.write_bytes(bytes(data))

        into = {"model": {k: _old_like(v) for k, v in state["model"].items() if k != "d"},
                "opt": [{"m": _old_like(state["opt"][0]["m"]), "v": _old_like(state["opt"][0]["v"])}],
                "step": 1, "name": "old"}  # no "d": checkout would add it
        before = {p: t.clone() for p, t in _tensors(into)}
        with tsck.open_store(copy, create=False, workers=workers) as s:
            try:
                s.checkout(REF, into=into)
            except IntegrityError as err:
                e = err
            else:
                # The bad block is d's, which into= leaves out: it was never read.
                with pytest.raises(IntegrityError):
                    s.checkout(REF, paths=["model.d"])
                assert "d" not in into["model"] and into["step"] == state["step"]
                continue
        msg = str(e)

        # Every byte of every given tensor is its old value or the snapshot's: no corrupt byte.
        new = dict(_tensors(state))
        seen = {p: _classify(before[p], new[p], t) for p, t in _tensors(into)}
        # Nothing but blocks of given tensors was written before the failure.
        assert into["step"] == 1 and into["name"] == "old" and "d" not in into["model"], msg
        assert seen["['model']['bias']"] == "untouched", "inline tensor written"
        # The error says exactly which paths were replaced and which partly; the rest are untouched.
        assert sorted(e.replaced) == sorted(p for p, c in seen.items() if c == "replaced"), msg
        assert sorted(e.partial) == sorted(p for p, c in seen.items() if c == "partial"), msg
        assert e.path not in e.replaced  # the tensor with the bad block cannot be whole
        assert "untouched" in msg, msg
        if e.replaced or e.partial:
            assert "only verified snapshot bytes" in msg, msg
        for p in e.replaced + e.partial:
            assert p in msg, (p, msg)
        # only the failing tensor and those with blocks in flight when it failed
        assert len(e.partial) <= workers + 1, msg


def test_checkout_into_mismatch_leaves_tree_untouched(snap):
    """A CheckoutMismatch found half-way through the tree: nothing before it was written."""
    root, state = snap
    into = {"model": {k: _old_like(v) for k, v in state["model"].items()}, "step": 1, "name": "old",
            "opt": [{"m": _old_like(state["opt"][0]["m"]), "v": torch.zeros(3)}]}  # wrong shape, last
    before = {p: t.clone() for p, t in _tensors(into)}
    with tsck.open_store(root, create=False) as s:
        with pytest.raises(tsck.errors.CheckoutMismatch):
            s.checkout(REF, into=into)
    assert into["step"] == 1 and into["name"] == "old"
    for p, t in _tensors(into):
        assert same_bits(t, before[p]), p


def test_checkout_into_intact_snapshot_is_exact(snap):
    root, state = snap
    into = {"model": {k: _old_like(v) for k, v in state["model"].items() if k != "d"},
            "opt": [{"m": _old_like(state["opt"][0]["m"]), "v": _old_like(state["opt"][0]["v"])}],
            "step": 1, "name": "old"}
    with tsck.open_store(root, create=False) as s:
        out = s.checkout(REF, into=into)
    assert out is into
    # into= names what is read: "d", which it lacks, is neither read nor added.
    want = dict(state, model={k: v for k, v in state["model"].items() if k != "d"})
    assert "d" not in into["model"]
    assert same_bits(into, want), "checkout(into=) differs from the snapshot"


# --------------------------------------------------------------------------------------
# 12: what is stored under an address is exactly what was hashed
# --------------------------------------------------------------------------------------

class MutateOnce(WrappedStore):
    """Changes the source tensor (from inside the store, i.e. after the block was
    hashed and before its bytes are written) on the first block `op` call: what a
    training thread does to a tensor while a background thread runs a blocking put."""

    def __init__(self, inner, op: str, src: dict):
        super().__init__(inner)
        self.op, self.src, self.fired = op, src, 0

    def _maybe(self, op, key):
        if op == self.op and key.startswith("blocks/") and self.src.get("t") is not None and not self.fired:
            self.fired += 1
            self.src["t"].fill_(1.0)  # content B

    def exists(self, key):
        self._maybe("exists", key)
        return self.inner.exists(key)

    def size_of(self, key):  # a put's existence check (it also reads the size)
        self._maybe("exists", key)
        return self.inner.size_of(key)

    def put_if_absent(self, key, bufs):
        self._maybe("put", key)
        return self.inner.put_if_absent(key, bufs)


@pytest.mark.parametrize("compression", ["auto", "none"])
@pytest.mark.parametrize("op", ["exists", "put"])
def test_tensor_changed_during_blocking_put_never_poisons_an_address(tmp_path, op, compression):
    src: dict = {}
    url = tmp_path / "store"
    opts = dict(block_size=BLOCK, inline_threshold=INLINE, compression=compression, workers=1)
    with tsck.open_store(url, wrap_storage=lambda s: MutateOnce(s, op, src), **opts) as s:
        moments = torch.zeros(BLOCK // 4)  # content A: one all-zero block, as in fresh Adam moments
        src["t"] = moments
        info = s.put_snapshot({"exp_avg": moments}, ref=REF)
        fired = s.storage.fired
        src["t"] = None
    assert fired == 1, "the test's window was not hit"

    with tsck.open_store(url, create=False, **opts) as s:
        rep = s.fsck(full=True)
        assert rep.ok, [str(f) for f in rep.findings]
        got = s.checkout(info.root)["exp_avg"]
        # The block is the tensor's old or its new content, never another block's address.
        assert bool((got == 0).all()) or bool((got == 1).all()), got
        # Content A again, later: dedup must land on a readable object holding A.
        s.put_snapshot({"exp_avg": torch.zeros(BLOCK // 4)}, ref="job/later")
        again = s.checkout("job/later")["exp_avg"]
        assert bool((again == 0).all())

    # Every stored block hashes to its name (also the unreferenced ones fsck does not read).
    store = Assets(LocalBlockStore(str(url)))
    for p in _blocks(url):
        d = bytes.fromhex(p.name)
        buf = bytearray(int.from_bytes(p.read_bytes()[8:16], "little"))
        store.read_block_into(d, buf, verify=True)
        assert blake3.blake3(buf).digest() == d


def test_put_block_with_a_known_digest_refuses_other_bytes(tmp_path):
    """revalidate_plan re-writes a block under the address it computed earlier: if the
    bytes changed since, they must not be stored under that address."""
    a = Assets(LocalBlockStore(str(tmp_path)))
    want = blake3.blake3(bytes(4096)).digest()
    with pytest.raises(SnapshotAborted):
        a.put_block(bytearray(b"\1" * 4096), 1, want)
    assert not a.block_exists(want)
    assert a.put_block(bytearray(4096), 1, want).digest == want


def test_dcp_load_corrupt_block_leaves_only_old_or_verified_bytes(tmp_path):
    """dcp.load with TsckReader reads into the caller's state dict too: same rule."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from tensorstore_ck.dcp import TsckReader, TsckWriter

    new = {"w": torch.randn(64, 256), "v": torch.randn(32, 256)}  # 4 + 2 blocks of 16 KiB
    root = tmp_path / "store"
    with tsck.open_store(root, block_size=16384) as s:
        dcp.save(new, storage_writer=TsckWriter(s, ref=REF, step=1))
    files = _blocks(root)
    assert len(files) == 6
    for i, victim in enumerate(files):
        data = bytearray(victim.read_bytes())
        data[HEADER + 100] ^= 0x01
        victim.write_bytes(bytes(data))
        into = {k: _old_like(v) for k, v in new.items()}
        before = {k: t.clone() for k, t in into.items()}
        with tsck.open_store(root, create=False, workers=2) as s:
            with pytest.raises(CheckpointException) as ei:
                dcp.load(into, storage_reader=TsckReader(s, REF))
        assert "content does not match its address" in str(ei.value), str(ei.value)
        for k in into:
            _classify(before[k], new[k], into[k])  # every byte old or the snapshot's
        data[HEADER + 100] ^= 0x01
        victim.write_bytes(bytes(data))


class _HeldWrite(WrappedStore):
    """Block writes of a put: the first fails at once; the second is held until released,
    then notes whether the put had already returned (its buffer lent out again)."""

    def __init__(self, inner, state: dict):
        super().__init__(inner)
        self.state, self.lock, self.n = state, threading.Lock(), 0

    def put_addressed(self, key, bufs):
        return self._put(key, bufs, self.inner.put_addressed)

    def put_if_absent(self, key, bufs):
        return self._put(key, bufs, self.inner.put_if_absent)

    def _put(self, key, bufs, put):
        if not key.startswith("blocks/") or not self.state["armed"]:
            return put(key, bufs)
        with self.lock:
            self.n += 1
            n = self.n
        if n == 1:
            self.state["held"].wait(60)  # (the second write has begun: it is running when this fails)
            raise OSError(28, "injected: no space left")
        if n == 2:
            self.state["held"].set()
            self.state["release"].wait(120)
            self.state["after_return"] = self.state["returned"].is_set()
        return put(key, bufs)


def test_a_failed_put_returns_only_once_its_running_block_writes_ended(tmp_path):
    """A put whose block write fails raises only after the writes still running ended: one
    still running after it returned would read a buffer lent out again (the next put's
    bytes, hashed under the old one's addresses)."""
    state = {"armed": False, "held": threading.Event(), "release": threading.Event(),
             "returned": threading.Event(), "after_return": None}
    with tsck.open_store(tmp_path / "s", block_size=64 * 1024, workers=4,
                         wrap_storage=lambda st: _HeldWrite(st, state)) as s:
        s.put_snapshot({"x": torch.ones(3)}, ref="j/m", step=0)
        state["armed"] = True

        def release():  # the put may return at once (the fault) or only after this
            state["returned"].wait(2.0)
            state["release"].set()
        t = threading.Thread(target=release)
        t.start()
        with pytest.raises(tsck.StorageError):
            s.put_snapshot({"w": torch.arange(4 * 16384, dtype=torch.float32)}, ref="j/m", step=1)
        state["returned"].set()
        t.join()
    assert state["after_return"] is False  # the held write ended before the put returned
