"""Store.prefetch (read/prefetch.py): the blocks of a ref's newest snapshot on a local disk
read into the page cache in the background, so a restart's restore finds them in memory.

Whether a file's pages are in memory is asked of the kernel: a read with RWF_NOWAIT fails
(EAGAIN) where it would have to wait for the disk. Each test first drops the pages of the
store's files (posix_fadvise DONTNEED), then prefetches and waits for it to end."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.errors import InvalidArgument

pytestmark = pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="needs preadv2's RWF_NOWAIT (Linux)")


def _files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, "blocks")) for f in fs]


def _evict(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _cached(p) -> bool:
    """Whether every page of the file is in memory: mincore(2) over a mapping of it, which
    reads nothing (a read, even one that may not wait, can start the disk's readahead)."""
    size = os.path.getsize(p)
    if size == 0:
        return True
    page = mmap.PAGESIZE
    with open(p, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as m:
        n = -(-size // page)
        vec = (ctypes.c_ubyte * n)()
        base = ctypes.c_void_p(_address(m))
        if _libc.mincore(base, ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return all(b & 1 for b in vec)


_libc = ctypes.CDLL(None, use_errno=True)


def _address(m: mmap.mmap) -> int:
    """The address of a read-only mapping (ctypes cannot take a buffer of one)."""
    import numpy as np
    return np.frombuffer(m, dtype=np.uint8).ctypes.data


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(1 << 20, generator=g) for i in range(6)}


@pytest.mark.parametrize("tier", [False, True], ids=["disk", "tier"])
def test_prefetch_reads_the_newest_snapshot_of_the_ref_into_memory(tmp_path, tier):
    kw = {"local": tmp_path / "tier", "pack_size": 0} if tier else {}
    where = str(tmp_path / ("tier" if tier else "s"))
    with tsck.open_store(tmp_path / "s", **kw) as s:
        s.put_snapshot(_state(1), ref="old/main", step=1)
        s.put_snapshot(_state(2), ref="j/main", step=1)
        s.put_snapshot(_state(3), ref="j/main", step=2)
        if tier:
            assert s.wait_durable(timeout=60)
        newest = {d.hex() for d in _digests(s, "j/main")}
    files = _files(where)
    _evict(files)
    wanted = [p for p in files if os.path.basename(p).split(".")[0] in newest]
    assert len(wanted) == 6 and not any(_cached(p) for p in files), "the pages were dropped"
    with tsck.open_store(tmp_path / "s", **kw) as s:
        pf = s.prefetch("j/main")
        assert pf.wait(timeout=60) and pf.error is None
        assert pf.files == 6 and pf.bytes >= 6 * (4 << 20)
        assert all(_cached(p) for p in wanted)
        assert not any(_cached(p) for p in set(files) - set(wanted)), "only the newest snapshot's blocks"
        got = s.checkout("j/main")
    assert all(torch.equal(got[k], v) for k, v in _state(3).items())


def _digests(store, ref) -> list[bytes]:
    from tensorstore_ck.core.walk import walk_commit
    root = store.core.refs.get_or_none(ref)
    return [o.digest for o in walk_commit(store.core.assets, root, verify=False) if o.kind == "block"]


def test_prefetch_of_nothing_reads_nothing_and_a_bad_name_is_refused(tmp_path, s3_url, s3_server):
    with tsck.open_store(tmp_path / "s") as s:
        pf = s.prefetch("none/main")
        assert pf.wait(timeout=60) and (pf.files, pf.bytes, pf.error) == (0, 0, None)
        with pytest.raises(InvalidArgument):
            s.prefetch("../bad")
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server) as s:  # an object store: the restore's own requests run in parallel
        s.put_snapshot(_state(1), ref="j/main", step=1)
        pf = s.prefetch("j/main")
        assert pf.wait(timeout=60) and (pf.files, pf.bytes) == (0, 0)
