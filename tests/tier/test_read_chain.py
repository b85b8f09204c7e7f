"""The tier's one reader chain (tensorstore_ck/tier/reads.py, ReadChain) over real stores:
an object comes from the first source that gives it whole, in the chain's order; its
tally names which; when none can, the nearest source's error is raised (or the chain's
exhausted()); with falls=missing_only a damaged copy is raised at once instead of read
elsewhere; require_blocks asks each source only for what the ones before it lack."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import tensorstore_ck as tsck
from tensorstore_ck.core.walk import walk_commit
from tensorstore_ck.errors import IntegrityError
from tensorstore_ck.tier.reads import Here, NotHere, ReadChain, Remote, Source, missing_only, read_through

BLOCK = 4096


class _Refuses(Source):
    """A source that holds nothing (a peer with no copy): asked, it says so."""

    name, where = "peer", "peer replicas"

    def __init__(self):
        self.asked = 0

    def read_block_into(self, d, out, **kw):
        self.asked += 1
        raise NotHere(d)

    def get_node(self, d, **kw):
        self.asked += 1
        raise NotHere(d)

    def get_commit(self, d, **kw):
        self.asked += 1
        raise NotHere(d)

    def lacking(self, digests, pool, **kw):
        self.asked += 1
        return list(digests)


def _put(path, x):
    with tsck.open_store(str(path), block_size=BLOCK, inline_threshold=64) as s:
        s.put_snapshot({"x": x}, "r")
        root = bytes.fromhex(s.resolve("r"))
        blocks = [o.digest for o in walk_commit(s.assets, root) if o.kind == "block"]
    return root, blocks


@pytest.fixture
def two(tmp_path):
    """The same snapshot in store a (the near one) and store b (the far one), both open."""
    x = np.arange(3 * BLOCK // 4, dtype=np.float32)
    root, blocks = _put(tmp_path / "a", x)
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # the same objects, a store of its own
    a = tsck.open_store(str(tmp_path / "a"))
    b = tsck.open_store(str(tmp_path / "b"))
    yield a, b, x, root, blocks, tmp_path
    a.close()
    b.close()


def _block_file(store_dir, d):
    return next((store_dir / "blocks").rglob(d.hex()))


def _read(reads, d):
    out = np.empty(BLOCK // 4, dtype=np.float32)
    reads.read_block_into(d, out)
    return out


def test_each_object_from_the_first_source_that_gives_it_whole(two, caplog):
    a, b, x, root, blocks, tmp = two
    _block_file(tmp / "a", blocks[0]).unlink()  # missing near
    f = _block_file(tmp / "a", blocks[1])
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))  # damaged near
    peer = _Refuses()
    reads = ReadChain([Here(a.assets), peer, Remote(b.core)]).tallied()
    for i, d in enumerate(blocks):
        assert np.array_equal(_read(reads, d), x[i * BLOCK // 4:(i + 1) * BLOCK // 4])
    assert reads.get_commit(root) == b.assets.get_commit(root)
    assert reads.tally.counts == {"local": 2, "peer": 0, "remote": 2}  # block 2 and the commit near
    assert peer.asked == 2  # asked only for what the near store could not give
    assert reads.missing == 1
    # The far store's tally is this reader's own; the chain it came from counts nothing.
    assert read_through(a.assets, b.core).tally is None


def test_none_gives_it_the_nearest_error_or_exhausted(two):
    a, b, x, root, blocks, tmp = two
    f = _block_file(tmp / "a", blocks[0])
    f.write_bytes(f.read_bytes()[:10])  # truncated near
    _block_file(tmp / "b", blocks[0]).unlink()  # and missing far
    reads = ReadChain([Here(a.assets), _Refuses(), Remote(b.core)])
    with pytest.raises(IntegrityError) as ei:
        _read(reads, blocks[0])
    assert ei.value.reason != "missing"  # the near copy's fault says the most

    class Pending(Exception):
        pass
    strict = ReadChain([Here(a.assets), Remote(b.core)], falls=missing_only,
                       exhausted=lambda kind, d, path, err: Pending(kind))
    with pytest.raises(IntegrityError):  # damaged near: raised at once, not read far
        _read(strict, blocks[0])
    _block_file(tmp / "a", blocks[0]).unlink()
    with pytest.raises(Pending):  # missing in both
        _read(strict, blocks[0])


def test_require_blocks_asks_each_source_for_what_the_ones_before_lack(two):
    a, b, x, root, blocks, tmp = two
    _block_file(tmp / "a", blocks[2]).unlink()
    peer = _Refuses()
    reads = ReadChain([Here(a.assets), peer, Remote(b.core)])
    with ThreadPoolExecutor(2) as pool:
        reads.require_blocks(blocks, pool)  # the far store has the one the near lacks
        assert peer.asked == 1
        _block_file(tmp / "b", blocks[2]).unlink()
        with pytest.raises(IntegrityError) as ei:
            reads.require_blocks(blocks, pool)
        assert ei.value.reason == "missing"
        full = ReadChain([Here(b.assets), _Refuses()])
        with pytest.raises(IntegrityError):
            full.require_blocks(blocks, pool)  # nobody behind to give it: the nearest says missing


def test_a_chain_whose_sources_all_hold_nothing_says_missing(two):
    a, b, x, root, blocks, tmp = two
    nobody = ReadChain([_Refuses(), _Refuses()])
    with pytest.raises(IntegrityError) as ei:
        _read(nobody, blocks[0])
    assert ei.value.reason == "missing"
