"""A local store writes blocks, nodes and commits without an fsync each and names
them together at sync(): durable first (fdatasync), then linked under their
keys, then published. These tests hold the parts of that order a crash or a gc
could break: nothing is named before sync, a killed writer leaves only temp
files that gc removes after their grace, a pending file removed before it was
named fails the put (and only it), and a forked child names its own writes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import _zygote as zygote
from _util import child_env

import tensorstore_ck as tsck
from tensorstore_ck.errors import StorageError
from tensorstore_ck.storage.local import LocalBlockStore

KEY = "blocks/ab/" + "ab" * 32


def _named(root) -> set[str]:
    out = set()
    for d, _dirs, files in os.walk(root):
        rel = os.path.relpath(d, root)
        if rel.split(os.sep)[0] in ("tmp", "refs.lmdb"):
            continue
        out.update(os.path.join(rel, f) for f in files)
    return out


def _pending(root) -> list[str]:
    t = os.path.join(root, "tmp")
    return sorted(f for f in os.listdir(t) if f.endswith(".pending")) if os.path.isdir(t) else []


def test_an_addressed_put_is_named_only_at_sync(tmp_path):
    a, b = LocalBlockStore(str(tmp_path)), LocalBlockStore(str(tmp_path))
    assert a.put_addressed(KEY, [b"x" * 1000, b"y"])
    assert not a.put_addressed(KEY, [b"x" * 1000, b"y"])  # pending here: not written twice
    assert a.get(KEY) == b"x" * 1000 + b"y" and a.size_of(KEY) == 1001  # its own writer sees it
    assert not b.exists(KEY) and b.size_of(KEY) is None  # nobody else does, yet
    assert not os.path.exists(tmp_path / KEY) and len(_pending(tmp_path)) == 1
    a.sync()
    assert b.get(KEY) == b"x" * 1000 + b"y"
    assert _pending(tmp_path) == [] and (tmp_path / KEY).is_file()
    assert not b.put_addressed(KEY, [b"x" * 1000, b"y"])  # stored: nothing written
    b.sync()
    assert _pending(tmp_path) == []


def test_two_writers_of_one_object_both_name_it_safely(tmp_path):
    a, b = LocalBlockStore(str(tmp_path)), LocalBlockStore(str(tmp_path))
    assert a.put_addressed(KEY, [b"same"]) and b.put_addressed(KEY, [b"same"])
    a.sync()
    b.sync()  # link() finds it there: the racing copy is dropped, never swapped in
    assert (tmp_path / KEY).read_bytes() == b"same" and _pending(tmp_path) == []


_KILLED_WRITER = textwrap.dedent("""
    import sys, time, torch, tensorstore_ck as tsck
    from tensorstore_ck.storage.wrappers import WrappedStore

    class Stop(WrappedStore):
        def sync(self):  # the put reached the point where its objects would be named
            print("written", flush=True)
            time.sleep(60)

    store = tsck.open_store(sys.argv[1], wrap_storage=Stop)
    torch.manual_seed(0)
    store.put_snapshot({"w": torch.randn(1 << 20), "b": torch.randn(300_000)}, ref="j/main", step=1)
""")


def test_a_writer_killed_before_sync_leaves_only_temp_files(tmp_path):
    """kill -9 after every block, node and the commit were written and before sync():
    no object of that snapshot is named, no ref moved; gc leaves the pending files
    alone within their grace and removes them after it."""
    root = tmp_path / "store"
    with tsck.open_store(str(root)) as s:
        s.put_snapshot({"first": torch.arange(10)}, ref="j/main", step=0)
    before = _named(root)
    p = zygote.Popen([sys.executable, "-c", _KILLED_WRITER, str(root)], stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, env=child_env(), text=True)
    try:
        line = p.stdout.readline()
        assert line.strip() == "written", p.stderr.read()
        p.send_signal(signal.SIGKILL)
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
        p.stdout.close()
        p.stderr.close()
    assert _named(root) == before  # blocks, nodes and the commit: none under its name
    pending = _pending(root)
    assert len(pending) >= 3  # two tensors' blocks, nodes, the commit
    with tsck.open_store(str(root)) as s:
        assert s.log("j/main")[0].step == 0
        assert s.fsck().ok
        rep = s.gc()
        assert _pending(root) == pending  # within their grace: a live writer may still name them
        old = time.time() - LocalBlockStore.PENDING_GRACE - 3600
        for f in pending:
            os.utime(root / "tmp" / f, (old, old))
        rep = s.gc()
        assert rep.temp_files_removed == len(pending) and _pending(root) == []
        assert s.checkout("j/main")["first"].equal(torch.arange(10))


def test_a_pending_file_removed_before_naming_fails_that_put_only(tmp_path):
    """A pending file that disappears before sync() (a gc that took it for a dead
    writer's) makes that put fail with nothing published, and the next put stores the
    object again instead of trusting what this Store recorded as written."""
    from tensorstore_ck.storage.wrappers import WrappedStore

    class Sweep(WrappedStore):
        armed = False

        def sync(self):
            if Sweep.armed:
                Sweep.armed = False
                for f in _pending(tmp_path):
                    os.unlink(tmp_path / "tmp" / f)
            return self.inner.sync()

    with tsck.open_store(str(tmp_path), wrap_storage=Sweep) as s:
        x = torch.randn(1 << 20)
        s.put_snapshot({"x": torch.zeros(4)}, ref="j/main", step=0)
        Sweep.armed = True
        with pytest.raises(StorageError, match="before it was named"):
            s.put_snapshot({"x": x}, ref="j/main", step=1)
        assert s.log("j/main")[0].step == 0
        s.put_snapshot({"x": x}, ref="j/main", step=1)  # same blocks: written again, not assumed
        assert s.checkout("j/main")["x"].equal(x)
        assert s.fsck().ok


_FORK = textwrap.dedent("""
    import os, sys, torch, tensorstore_ck as tsck
    store = tsck.open_store(sys.argv[1])
    real = store.core.storage
    real.put_addressed("blocks/cd/" + "cd" * 32, [b"parent's"])  # pending in the parent
    pid = os.fork()
    if pid == 0:
        store.put_snapshot({"c": torch.arange(100_000)}, ref="j/child", step=1)
        store.close()  # must not remove the parent's pending file
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert status == 0, status
    store.core.storage.sync()
    print(open(os.path.join(sys.argv[1], "blocks/cd/" + "cd" * 32), "rb").read().decode())
    print(store.checkout("j/child")["c"].equal(torch.arange(100_000)))
    store.close()
""")


def test_a_forked_child_names_its_writes_and_leaves_its_parents(tmp_path):
    out = zygote.run([sys.executable, "-c", _FORK, str(tmp_path)], capture_output=True, text=True,
                     env=child_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["parent's", "True"]
    assert _pending(tmp_path) == []
