"""Hostile files in a store: an object that cannot be read,
and special files where objects should be.

- An I/O error (EIO) on one object, or a folder in its place (EISDIR), is an
  `unreadable` finding of fsck with its errno, and fsck goes on to check the rest;
  checkout raises UnreadableObject (a StorageError) naming the object; gc stops
  before deleting anything when a kept snapshot's node or commit cannot be read.
- A FIFO where a block, node, commit, tsck.json or tag object should be, or a link
  to /dev/zero, is never read: no hang, no MemoryError. Local reads open regular
  files only (O_NONBLOCK, fstat after open) and every read is bounded.

What this guards against: fsck stopping with StorageError at the first EIO, `tsck fsck`
ending in `tsck: error: [Errno 21]` on a folder, a FIFO hanging fsck/checkout/gc/`tsck
refs` forever, /dev/zero as tsck.json or a tag ending in MemoryError. Every test here
ends in bounded time: in-process calls run under `bounded()`, the CLI under a
subprocess timeout.
"""
from __future__ import annotations

import errno
import os
import stat
import threading

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import FaultInjectingStore
from tensorstore_ck.core.walk import walk_commit

from _util import bounded, nested_state, plant_special, run_cli, unblock_fifos

BLOCK = 4096


def _fill(s) -> dict:
    """j/main at steps 1..3, j/exp at 10, a tag on step 2, retention keep_last=1 for job j."""
    roots = {}
    for i in (1, 2, 3):
        roots[i] = s.put_snapshot(nested_state(i, BLOCK), "j/main", step=i).root
    roots[10] = s.put_snapshot(nested_state(10, BLOCK), "j/exp", step=10).root
    s.tag("golden", "j/main@2")
    s.set_retention("j", tsck.Retention(keep_last=1))
    return roots


def _objects(s, root: str) -> dict:
    """kind -> [(key, path)] of everything the snapshot reaches."""
    out: dict = {"commit": [], "node": [], "block": []}
    for o in walk_commit(s.assets, bytes.fromhex(root)):
        out[o.kind].append((s.assets.object_key(o.kind + "s", o.digest), o.path))
    return out


def _own_block(s, roots, step: int) -> str:
    """A block only snapshot `step` holds (its "own" tensor)."""
    mine = [k for k, p in _objects(s, roots[step])["block"] if p == "['own']"]
    others = {k for st, r in roots.items() if st != step for k, _p in _objects(s, r)["block"]}
    return next(k for k in mine if k not in others)


def _listing(path) -> dict:
    out = {}
    for d, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, path)] = os.lstat(p).st_size
    return out


def _one_error_line(r) -> str:
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tsck: error: "), r.stderr
    return lines[0]


# ----------------------------------------------------------------- EIO on file and s3
def _eio_store(backend, target: dict):
    """The backend's store under a fault wrapper that fails every read of target["key"] with EIO."""
    def wrap(st):
        f = FaultInjectingStore(st, when=lambda op, key: op == "get" and key == target.get("key"))
        target["faults"] = f
        return f
    return backend.open(block_size=BLOCK, inline_threshold=256, wrap_storage=wrap)


@pytest.mark.parametrize("full", [True, False], ids=["full", "quick"])
def test_fsck_reports_an_eio_block_and_checks_the_rest(backend, full):
    target: dict = {}
    with _eio_store(backend, target) as s:
        roots = _fill(s)
        bad = _own_block(s, roots, 3)
        gone = _own_block(s, roots, 10)
        s.storage.inner.delete(gone)  # a second, ordinary fault after the unreadable one
        target["key"] = bad
        rep = bounded(lambda: s.fsck(full=full))
        target.clear()
    got = {(f.problem, f.key) for f in rep.findings}
    assert ("unreadable", bad) in got and ("missing", gone) in got, [str(f) for f in rep.findings]
    f = next(f for f in rep.findings if f.problem == "unreadable")
    assert f.errno == errno.EIO and f.snapshot == roots[3] and f.path == "['own']"
    assert "errno 5" in str(f) and bad in str(f)
    assert rep.snapshots_checked == 4 and len(rep.findings) == 2
    assert [x["errno"] for x in rep.to_json()["findings"] if x["problem"] == "unreadable"] == [errno.EIO]


def test_checkout_of_an_eio_block_names_it(backend):
    target: dict = {}
    with _eio_store(backend, target) as s:
        roots = _fill(s)
        target["key"] = bad = _own_block(s, roots, 3)
        with pytest.raises(tsck.UnreadableObject) as ei:
            bounded(lambda: s.checkout("j/main"))
        assert isinstance(ei.value, tsck.StorageError) and ei.value.errno == errno.EIO
        assert ei.value.key == bad and bad in str(ei.value) and "['own']" in str(ei.value)
        target.clear()
        assert torch.equal(s.checkout("j/main")["own"], nested_state(3, BLOCK)["own"])


def test_gc_stops_before_deleting_when_a_kept_node_cannot_be_read(backend):
    target: dict = {}
    with _eio_store(backend, target) as s:
        roots = _fill(s)
        before = backend.objects()
        node = _objects(s, roots[10])["node"][0][0]  # the top node of j/exp's tip (kept)
        target["key"] = node
        with pytest.raises(tsck.UnreadableObject) as ei:
            bounded(lambda: s.gc())
        assert "gc stopped before deleting anything" in str(ei.value) and node in str(ei.value)
        assert backend.objects() == before  # step 1 was due, nothing went
        target.clear()
        assert s.gc().deleted_objects > 0
        assert s.fsck().ok


# ----------------------------------------------------------------- special files on a local store
@pytest.fixture
def filled(tmp_path):
    path = tmp_path / "s"
    with tsck.open_store(path, block_size=BLOCK, inline_threshold=256) as s:
        roots = _fill(s)
        keys = {"own3": _own_block(s, roots, 3), "own10": _own_block(s, roots, 10),
                "top10": _objects(s, roots[10])["node"][0][0],
                "sub3": next(k for k, p in _objects(s, roots[3])["node"] if p == "['sub']"),
                "commit3": _objects(s, roots[3])["commit"][0][0],
                "commit1": _objects(s, roots[1])["commit"][0][0],
                "tag": "tags/" + b"golden".hex()}
    yield path, roots, keys
    unblock_fifos(path)


def _plant(path, key: str, what: str) -> None:
    plant_special(os.path.join(path, key), what)


@pytest.mark.parametrize("what,code", [("dir", errno.EISDIR), ("fifo", errno.EINVAL), ("zero", errno.EINVAL)])
def test_fsck_reports_special_files_in_place_of_objects(filled, what, code):
    path, roots, keys = filled
    _plant(path, keys["own3"], what)
    _plant(path, keys["sub3"], what)
    _plant(path, keys["own10"], "dir" if what != "dir" else "fifo")
    with tsck.open_store(path) as s:
        for full in (True, False):
            rep = bounded(lambda: s.fsck(full=full), unblock=path)
            got = {(f.problem, f.snapshot, f.key, f.errno) for f in rep.findings}
            assert got == {("unreadable", roots[3], keys["sub3"], code),
                           ("unreadable", roots[3], keys["own3"], code),
                           ("unreadable", roots[10], keys["own10"],
                            errno.EISDIR if what != "dir" else errno.EINVAL)}, [str(f) for f in rep.findings]
    r = run_cli("fsck", path, timeout=30)
    assert r.returncode == 1 and "Traceback" not in r.stderr and not r.stderr.strip(), r.stderr
    assert r.stdout.count("unreadable: ") == 3 and keys["own3"] in r.stdout, r.stdout


@pytest.mark.parametrize("what", ["fifo", "dir", "zero"])
def test_checkout_of_a_special_block_node_or_commit_is_a_clear_error(filled, what):
    path, roots, keys = filled
    for key in ("own3", "top10", "commit1"):
        _plant(path, keys[key], what)
    with tsck.open_store(path) as s:
        for target, key in (("j/main", keys["own3"]), ("j/exp", keys["top10"]), ("j/main@1", keys["commit1"])):
            with pytest.raises(tsck.UnreadableObject) as ei:
                bounded(lambda: s.checkout(target), unblock=path)
            assert ei.value.key == key and key in str(ei.value)
            assert {"fifo": "a FIFO", "dir": "a directory", "zero": "a character device"}[what] in str(ei.value)
        assert torch.equal(s.checkout("golden")["own"], nested_state(2, BLOCK)["own"])  # the rest reads


def test_put_over_a_special_file_is_refused_not_reused(filled):
    """A FIFO where a block of the new snapshot belongs: "already stored" would publish a
    snapshot nobody can read. The put fails naming it; the ref does not move."""
    path, roots, keys = filled
    _plant(path, keys["own3"], "fifo")
    with tsck.open_store(path) as s:
        with pytest.raises(tsck.StorageError, match="a FIFO"):
            bounded(lambda: s.put_snapshot(nested_state(3, BLOCK), "j/other", step=3), unblock=path)
        assert s.reftable.get_or_none("j/other") is None


@pytest.mark.parametrize("what", ["fifo", "dir"])
def test_gc_with_a_special_kept_node_or_commit_stops_before_deleting(filled, what):
    path, roots, keys = filled
    for key in ("top10", "commit3"):
        saved = (path / keys[key]).read_bytes()
        _plant(path, keys[key], what)
        before = _listing(path / "blocks"), _listing(path / "nodes"), _listing(path / "commits")
        with tsck.open_store(path) as s:
            with pytest.raises(tsck.StorageError, match="gc stopped before deleting anything"):
                bounded(lambda: s.gc(), unblock=path)
        assert (_listing(path / "blocks"), _listing(path / "nodes"), _listing(path / "commits")) == before
        r = run_cli("gc", path, timeout=30)
        assert r.returncode == 1 and keys[key] in _one_error_line(r)  # a StorageError: exit 1
        os.rmdir(path / keys[key]) if what == "dir" else os.unlink(path / keys[key])
        (path / keys[key]).write_bytes(saved)
    with tsck.open_store(path) as s:
        assert s.gc().deleted_objects > 0 and s.fsck().ok


def test_a_fifo_block_nobody_keeps_is_swept_by_gc(filled):
    """gc deletes an unreachable object without reading it, whatever it is."""
    path, roots, keys = filled
    with tsck.open_store(path) as s:
        g = s.gc(dry_run=True)
    doomed = [k for k in g.would_delete if k.startswith("blocks/")][0]
    _plant(path, doomed, "fifo")
    with tsck.open_store(path) as s:
        rep = bounded(lambda: s.gc(), unblock=path)
        assert rep.deleted_objects > 0 and not os.path.lexists(os.path.join(path, doomed))
        assert bounded(lambda: s.fsck()).ok


# ----------------------------------------------------------------- tsck.json and tag objects
@pytest.mark.parametrize("what", ["fifo", "zero", "dir"])
def test_special_marker_is_a_clear_error(filled, what):
    path, _roots, _keys = filled
    _plant(path, "tsck.json", what)
    with pytest.raises(tsck.TsckError) as ei:
        bounded(lambda: tsck.open_store(path), unblock=path)
    assert "tsck.json" in str(ei.value)
    r = run_cli("refs", path, timeout=30)  # every other command: tests/cli/test_cli_faults.py
    assert r.returncode == 1, (r.stdout, r.stderr)  # a StorageError (the environment's): exit 1
    assert "tsck.json" in _one_error_line(r)


def test_a_huge_marker_is_refused_without_reading_it(filled):
    """A sparse 1 TB tsck.json: read up to the marker cap (64 KiB + 1), not to the end."""
    path, _roots, _keys = filled
    with open(path / "tsck.json", "r+b") as f:
        f.truncate(1 << 40)
    with pytest.raises(tsck.NotAStore, match="tsck.json"):
        bounded(lambda: tsck.open_store(path))
    r = run_cli("refs", path, timeout=30)
    assert r.returncode == 2 and "tsck.json" in _one_error_line(r)


@pytest.mark.parametrize("what", ["zero", "fifo", "dir", "huge"])
def test_special_tag_object_is_reported_not_read(filled, what):
    path, roots, keys = filled
    if what == "huge":
        with open(path / keys["tag"], "r+b") as f:
            f.truncate(1 << 40)
    else:
        _plant(path, keys["tag"], what)
    with tsck.open_store(path) as s:
        assert s.resolve("golden") == roots[2]  # the ref table still has it
        rec = bounded(lambda: s.recover(), unblock=path)
        if what != "dir":  # a folder is no object: it is not listed at all
            assert any(keys["tag"] in u for u in rec.unreadable), rec.unreadable
        with pytest.raises(tsck.RefConflict):  # the name is taken in the ref table
            bounded(lambda: s.tag("golden", "j/main"), unblock=path)
        rep = bounded(lambda: s.fsck(), unblock=path)
        assert rep.ok, [str(f) for f in rep.findings]
    r = run_cli("recover", path, timeout=30)  # every other command: tests/cli/test_cli_faults.py
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr


def test_an_oversized_block_is_read_only_as_far_as_its_manifest_declares(backend):
    """A block object with 1 MiB appended: fsck and checkout ask storage for at most
    header + declared length + 1 bytes of it (object stores fetch only that, one ranged
    GET), and call it damaged."""
    import io

    from tensorstore_ck.storage.wrappers import WrappedStore
    asked: dict = {}

    class Counting(WrappedStore):
        def open_read(self, key, max_bytes=None):
            f = self.inner.open_read(key, max_bytes)
            if self.inner.local:  # a local file is read as far as the caller reads
                asked.setdefault(key, []).append((max_bytes, None))
                return f
            data = f.read()
            asked.setdefault(key, []).append((max_bytes, len(data)))
            return io.BytesIO(data)

    with backend.open(block_size=BLOCK, inline_threshold=256, wrap_storage=Counting) as s:
        roots = _fill(s)
        bad = _own_block(s, roots, 3)
        backend.write(bad, backend.read(bad) + bytes(1 << 20))
        rep = bounded(lambda: s.fsck())
        # raw frame: "truncated" (oversized); a compressed one (the float codec, auto's choice on
        # object stores): "corrupt" (a payload longer than its raw length)
        found = {(f.problem, f.key) for f in rep.findings}
        assert ("truncated", bad) in found or ("corrupt", bad) in found, [str(f) for f in rep.findings]
        with pytest.raises(tsck.IntegrityError):
            bounded(lambda: s.checkout("j/main"))
    assert asked[bad] and all(m is not None and m <= 16 + BLOCK + 1 for m, _n in asked[bad]), asked[bad]
    assert all(n is None or n <= 16 + BLOCK + 1 for _m, n in asked[bad]), asked[bad]
