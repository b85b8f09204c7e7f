"""Issue 11, failures 7 and 12: the bytes that land and the bytes that are stored are
exactly the verified / hashed ones.

* checkout(into=) with a corrupt block: no unverified byte ever reaches the caller's
  tensors; each of them ends up wholly old, wholly the snapshot's, or (for the
  tensor whose blocks were being copied when the failure came) a mix of the two,
  never anything else; the error says which paths are which, and nothing else in
  the tree (inline tensors, scalars, missing keys) changed.
* a blocking put whose source tensor changes between hashing and writing (a
  storage wrapper changes it from inside the store's exists / put_if_absent, the
  window of the old code): what is stored under every address hashes to that
  address, and a later put of the same content dedups onto a readable object.
"""

from __future__ import annotations

import re
from pathlib import Path

import blake3
import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.assets import Assets
from tensorstore_ck.errors import IntegrityError, SnapshotAborted
from tensorstore_ck.storage.local import LocalBlockStore
from tensorstore_ck.storage.wrappers import WrappedStore

BLOCK = 64 * 1024
INLINE = 512
REF = "job/main"
HEX64 = re.compile(r"^[0-9a-f]{64}$")
HEADER = 16  # docs/FORMAT.md: the object frame's header



def _blocks(root: Path) -> list[Path]:
    return sorted(p for p in (root / "blocks").rglob("*") if p.is_file() and HEX64.match(p.name))


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

    def put_if_absent(self, key, bufs):
        self._maybe("put", key)
        return self.inner.put_if_absent(key, bufs)


@pytest.mark.parametrize("compress", [True, False])
@pytest.mark.parametrize("op", ["exists", "put"])
def test_tensor_changed_during_blocking_put_never_poisons_an_address(tmp_path, op, compress):
    src: dict = {}
    url = tmp_path / "store"
    opts = dict(block_size=BLOCK, inline_threshold=INLINE, compress=compress, workers=1)
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

