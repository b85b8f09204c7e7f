"""A local store writes its large objects with O_DIRECT: the bytes go from the writer's
memory to the disk, not through page-cache pages (storage/local.py, DIRECT_MIN).

The kernel says which pages of a file are in the page cache (mincore(2) on a mapping of
it): a block written buffered stays cached after its fdatasync, one written direct is
not. Sizes around the alignment and the bounce buffer's chunk are written and read back
byte for byte, and the files are exactly as long as the objects.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.storage import local
from tensorstore_ck.storage.local import LocalBlockStore

pytestmark = pytest.mark.skipif(not getattr(os, "O_DIRECT", 0), reason="no O_DIRECT on this platform")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def cached_pages(path: str) -> tuple[int, int]:
    """(pages of the file in the page cache, pages of the file): mincore(2) on a read-only
    mapping of it (mapping faults nothing in)."""
    size = os.path.getsize(path)
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    if size == 0:
        return 0, 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        a = np.frombuffer(m, dtype=np.uint8)
        vec = (ctypes.c_ubyte * pages)()
        try:
            if _libc.mincore(ctypes.c_void_p(a.ctypes.data), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            del a
    return sum(v & 1 for v in vec), pages


def _sizes():
    a, c = local.DIRECT_ALIGN, local.DIRECT_CHUNK
    return [local.DIRECT_MIN, local.DIRECT_MIN + 1, 3 * a * 256 + 7, c - 1, c, c + 1, 2 * c + a, 3 * c + 12345]


@pytest.mark.parametrize("n", _sizes())
def test_large_objects_are_written_around_the_page_cache_and_read_back_whole(tmp_path, n):
    bs = LocalBlockStore(str(tmp_path / "s"))
    data = os.urandom(n)
    head, tail = data[:100], data[100:]  # two buffers, as a frame's header and payload
    assert bs.put_addressed("blocks/ab/x", [head, memoryview(tail)])
    bs.sync()
    path = str(tmp_path / "s" / "blocks" / "ab" / "x")
    assert os.path.getsize(path) == n
    cached, pages = cached_pages(path)
    assert cached == 0, f"{cached} of {pages} pages in the page cache: written buffered"
    assert bs.get("blocks/ab/x") == data


def test_small_objects_stay_buffered(tmp_path):
    """The control: the same check sees a buffered write (so a direct write that silently
    went buffered would fail the test above)."""
    bs = LocalBlockStore(str(tmp_path / "s"))
    data = os.urandom(local.DIRECT_MIN - 1)
    assert bs.put_addressed("blocks/ab/y", [data])
    bs.sync()
    path = str(tmp_path / "s" / "blocks" / "ab" / "y")
    cached, pages = cached_pages(path)
    assert cached == pages > 0
    assert bs.get("blocks/ab/y") == data


def test_a_put_writes_its_blocks_direct_and_checks_out_bit_identical(tmp_path):
    state = {"w": torch.randn(3_000_000), "b": torch.randn(10), "e": torch.randn(300_001, dtype=torch.float64)}
    with tsck.open_store(str(tmp_path / "s"), compression="none") as s:
        s.put_snapshot(state, ref="j/main", step=1)
        blocks = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "s" / "blocks") for f in fs]
        big = [p for p in blocks if os.path.getsize(p) >= local.DIRECT_MIN]
        assert big, blocks
        for p in big:  # before the checkout reads them into the cache
            assert cached_pages(p)[0] == 0, p
        got = s.checkout("j/main")
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_a_store_on_a_memory_file_system_writes_buffered_and_one_on_a_disk_direct(tmp_path, monkeypatch):
    """On a tmpfs (a memory tier) the page cache is the storage: O_DIRECT would only add a
    copy through the bounce buffer, so large objects are written as they are; on a disk
    they go direct. Every write read back whole."""
    import uuid

    from tensorstore_ck.util.localfile import in_memory
    if not in_memory("/dev/shm"):
        pytest.skip("/dev/shm is not a tmpfs here")
    direct = []
    real = local._write_direct
    monkeypatch.setattr(local, "_write_direct", lambda fd, bufs, total: (direct.append(total), real(fd, bufs, total)))
    data = os.urandom(local.DIRECT_MIN + 4096)
    shm = f"/dev/shm/tsck-direct-{uuid.uuid4().hex}"
    try:
        mem = LocalBlockStore(shm)
        assert mem.put_addressed("blocks/ab/m", [data])
        mem.sync()
        assert direct == [] and mem.get("blocks/ab/m") == data
    finally:
        import shutil
        shutil.rmtree(shm, ignore_errors=True)
    disk = LocalBlockStore(str(tmp_path / "s"))
    assert disk.put_addressed("blocks/ab/d", [data])
    disk.sync()
    assert direct == [len(data)] and disk.get("blocks/ab/d") == data
