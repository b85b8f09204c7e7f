"""A full filesystem under the ref table or under the blocks.

Every write operation either succeeds (it did not need that disk) or raises a
StorageError (ENOSPC) that says which filesystem, what it was writing and how much
it needed, and leaves the store as it was: no ref move, no catalog row, no tag in
storage that the table lacks. Once space is freed, the SAME Store object does all of
it, and fsck is clean. Real LMDB on a real, really full tmpfs; no mocks.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import lmdb
import pytest
import torch

import tensorstore_ck as tsck
from _mounts import fill, tmpfs
from tensorstore_ck.refs.txn import TABLES
from tensorstore_ck.storage.wrappers import WrappedStore

from _util import run_cli


def _state(i: int, n: int = 5000) -> dict:
    return {"w": torch.arange(n, dtype=torch.float32) + i, "step": i}


def _compact(path: str) -> None:
    """Rewrite the LMDB file without free pages, so that every later write transaction
    needs new pages at the end of the file (else LMDB reuses freed pages and a small
    transaction may succeed on a full disk, which proves nothing)."""
    tmp = path + ".compact"
    os.makedirs(tmp)
    env = lmdb.open(path, max_dbs=len(TABLES) + 2, subdir=True)
    try:
        env.copy(tmp, compact=True)
    finally:
        env.close()
    shutil.copyfile(os.path.join(tmp, "data.mdb"), os.path.join(path, "data.mdb"))
    shutil.rmtree(tmp)


def _table_state(s) -> dict:
    """Everything a failed write must leave as it was: ref table and stored tags."""
    rt = s.reftable
    gc = rt.gc_state()
    return {"refs": rt.list(), "tags": rt.tags(), "pins": sorted(rt.pins()), "retention": rt.retention_all(),
            "catalog": sorted(rt.catalog_roots()), "reflog": [len(rt.reflog(n)) for n, _ in rt.list()],
            "gc": (gc.get("epoch"), gc.get("phase")),
            "stored_tags": sorted(k for k, _ in s.assets.tags())}


@pytest.fixture(params=["refs", "blocks"])
def full(request, tmp_path):
    """(store, full_dir, refs_path, case): a store whose ref table ("refs") or data
    ("blocks") lies on a small tmpfs, with some history, tags, a pin and retention."""
    case = request.param
    with tmpfs(tmp_path / "small", "8m") as small:
        if case == "refs":
            url, refs = tmp_path / "store", os.path.join(small, "refs.lmdb")
        else:
            url, refs = os.path.join(small, "store"), str(tmp_path / "refs.lmdb")
        with tsck.open_store(url, refs=refs) as s0:
            for i in range(4):
                s0.put_snapshot(_state(i), "a/main", step=i, job="a")
            s0.put_snapshot(_state(9), "b/main", step=9, job="b")
            s0.tag("t0", "a/main@0")
            s0.pin("a/main@1")
            s0.set_retention("a", tsck.Retention(keep_last=10))
            # Work for recover: a snapshot whose catalog row is gone (recover puts it back).
            lost = s0.put_snapshot(_state(5), "d/main", step=5, job="d").root
            s0.reftable._write(lambda t: t.delete("catalog", bytes.fromhex(lost)))
        if case == "refs":
            _compact(refs)
        s = tsck.open_store(url, refs=refs)
        try:
            yield s, small, refs, case, bytes.fromhex(lost)
        finally:
            s.close()


def _write_ops(s) -> list:
    """(name, call, needs) for every write operation; needs: the filesystems it must
    write to ("refs", "blocks"): on any other it may succeed."""
    ops = [
        ("put_snapshot", lambda: s.put_snapshot(_state(20, 200_000), "a/main", step=20, job="a"),
         {"refs", "blocks"}),
        ("put_snapshot small", lambda: s.put_snapshot({"x": 1}, "c/main", step=0, job="c"), {"refs", "blocks"}),
        ("put_snapshot async", lambda: s.put_snapshot(_state(21), "a/main", step=21, job="a",
                                                      blocking=False).result(), {"refs", "blocks"}),
        ("tag", lambda: s.tag("t1", "a/main"), {"refs", "blocks"}),
        ("pin", lambda: s.pin("a/main@3"), {"refs"}),
        ("unpin", lambda: s.unpin("a/main@1"), {"refs"}),
        ("set_retention", lambda: s.set_retention("b", tsck.Retention(keep_last=1)), {"refs"}),
    ]
    # Removal by name (delete_ref / untag / forget, from main): same expectation as pin.
    if hasattr(s, "delete_ref"):
        ops += [("delete_ref", lambda: s.delete_ref("b/main"), {"refs"}),
                ("untag", lambda: s.untag("t0"), {"refs"}),
                ("forget", lambda: s.forget("a/main@2"), {"refs"})]
    # Expiry and sweeping, and recover: last, since on the blocks' disk gc frees space.
    ops += [
        ("set_retention expiring", lambda: s.set_retention("a", tsck.Retention(keep_last=1)), {"refs"}),
        ("prune", lambda: s.prune("a"), {"refs"}),
        ("gc", lambda: s.gc(), {"refs"}),
        ("recover", lambda: s.recover(), {"refs"}),
    ]
    return ops


def _assert_no_space(e: BaseException, where: str) -> None:
    assert isinstance(e, tsck.StorageError), repr(e)
    assert e.errno == errno.ENOSPC, e
    text = str(e)
    assert "no space left" in text and where in text and "bytes free" in text and "needed" in text, text


def test_full_disk_every_write_is_a_storage_error_then_works_on_the_same_store(full):
    s, small, refs, case, lost = full
    where = refs if case == "refs" else small
    fillers = fill(small)
    for name, op, needs in _write_ops(s):
        before = _table_state(s)
        try:
            op()
        except tsck.TsckError as e:
            _assert_no_space(e, where)
            if name == "put_snapshot async":  # raised by its future, and once more by the next call
                with pytest.raises(tsck.StorageError):
                    s.raise_pending_error()
            assert _table_state(s) == before, f"{name}: a failed write changed the store"
            continue
        assert case not in needs, f"{name} succeeded on a full {case} disk"
    if case == "blocks":  # the ref-table-only ops went through; the data ones did not
        assert "t1" not in dict(s.reftable.tags()) and s.reftable.get_or_none("c/main") is None

    for p in fillers:
        os.unlink(p)
    # The same Store object, every operation again.
    info = s.put_snapshot(_state(30, 200_000), "a/main", step=30, job="a")
    assert s.checkout("a/main")["w"].equal(_state(30, 200_000)["w"])
    s.put_snapshot(_state(31), "a/main", step=31, job="a", blocking=False).result()
    s.put_snapshot({"x": 1}, "c/main", step=0, job="c")
    assert s.tag("t1", "a/main").root == s.resolve("a/main@31")  # the failed tag left nothing behind
    s.pin("a/main@30")
    s.unpin("a/main@30")
    s.set_retention("a", tsck.Retention(keep_last=2))
    s.prune("a")
    s.gc()
    s.recover()
    if hasattr(s, "delete_ref"):  # on the blocks' disk the ones of the full phase went through
        s.untag("t1")
        s.delete_ref("c/main")
        s.gc()
    assert s.resolve("a/main@30") == info.root and s.reftable.catalog_has(lost)
    rep = s.fsck()
    assert rep.ok and not rep.findings, [str(f) for f in rep.findings]


@pytest.mark.slow
def test_full_disk_cli_one_line_exit_1(full):
    """tsck pin / gc / tag on a full disk: exit 1, one line naming it; fsck clean after."""
    s, small, refs, case, lost = full
    fillers = fill(small)
    extra = ["--refs", refs]
    url = s.url[len("file://"):]
    for args in (["pin", url, "a/main@2"], ["gc", url], ["tag", url, "t2", "a/main"]):
        if case == "blocks" and args[0] != "tag":  # pin and gc need no space on the blocks' disk
            continue
        before = _table_state(s)
        r = run_cli(*args, *extra)
        assert r.returncode == 1, (args, r.returncode, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tsck: error: ") and "no space left" in lines[0], \
            (args, r.stderr)
        assert _table_state(s) == before
    for p in fillers:
        os.unlink(p)
    for args in (["pin", url, "a/main@2"], ["gc", url], ["tag", url, "t2", "a/main"], ["fsck", url]):
        r = run_cli(*args, *extra)
        assert r.returncode == 0, (args, r.stdout, r.stderr)


def test_put_snapshot_on_a_full_disk_leaves_no_half_state(full):
    """No ref move, no catalog row, no reflog entry; leftovers are gc garbage."""
    s, small, refs, case, lost = full
    before = _table_state(s)
    fillers = fill(small)
    with pytest.raises(tsck.StorageError) as ei:
        s.put_snapshot(_state(40, 300_000), "a/main", step=40, job="a")
    _assert_no_space(ei.value, refs if case == "refs" else small)
    assert _table_state(s) == before
    with pytest.raises(tsck.RefNotFound):
        s.resolve("a/main@40")
    for p in fillers:
        os.unlink(p)
    # recover (what one runs after an incident) does not bring the failed snapshot back
    tip = s.resolve("a/main")
    s.recover()
    assert s.resolve("a/main") == tip
    with pytest.raises(tsck.RefNotFound):
        s.resolve("a/main@40")
    before["catalog"] = sorted(before["catalog"] + [lost])  # the row recover had to put back
    assert _table_state(s) == before
    s.gc()
    assert s.fsck().ok
    assert s.put_snapshot(_state(40, 300_000), "a/main", step=40, job="a").step == 40


class _FillOnClock(WrappedStore):
    """Fills `small` to the last byte the first time the storage's clock is read: gc and
    prune read it just after taking the gc lock, so the disk fills in the middle of them."""

    def __init__(self, inner, small):
        super().__init__(inner)
        self.small, self.armed, self.fillers = small, False, []

    def clock_now(self):
        if self.armed:
            self.armed = False
            self.fillers = fill(self.small)
        return self.inner.clock_now()


@pytest.mark.parametrize("op", ["gc", "prune"])
def test_a_gc_stopped_by_a_full_ref_table_disk_releases_the_store(tmp_path, op):
    """The gc lock taken, then the disk fills: gc fails (StorageError) and cannot record
    its end either. Once space is freed, the same Store's next gc (and every writer)
    goes on at once instead of waiting out the dead gc's lease."""
    with tmpfs(tmp_path / "small", "8m") as small:
        url, refs = tmp_path / "store", os.path.join(small, "refs.lmdb")
        with tsck.open_store(url, refs=refs) as s0:
            for i in range(4):
                s0.put_snapshot(_state(i), "a/main", step=i, job="a")
            s0.set_retention("a", tsck.Retention(keep_last=1))
        _compact(refs)
        with tsck.open_store(url, refs=refs, gc_lease=300, wrap_storage=lambda st: _FillOnClock(st, small)) as s:
            s.storage.armed = True
            with pytest.raises(tsck.StorageError) as ei:
                s.gc() if op == "gc" else s.prune("a")
            _assert_no_space(ei.value, refs)
            assert s.storage.fillers, "the disk was not filled during the gc"
            for p in s.storage.fillers:
                os.unlink(p)
            t0 = time.monotonic()
            rep = s.gc() if op == "gc" else s.prune("a")
            assert time.monotonic() - t0 < 30, "waited out the dead gc's lease"
            assert len(rep.expired) == 3
            assert s.reftable.gc_state()["phase"] == "idle"
            s.put_snapshot(_state(9), "a/main", step=9, job="a")
            assert s.fsck().ok


# ---------------------------------------------------------------- `tsck checkout` onto a full disk
def _export_store(path) -> None:
    """A snapshot of about 1 MB of tensors (random: it does not compress)."""
    g = torch.Generator().manual_seed(3)
    with tsck.open_store(path) as s:
        s.put_snapshot({"w": torch.rand(200_000, generator=g), "b": torch.rand(60_000, generator=g)}, "a/main")


_DESTS = {"torch": "w.pt", "safetensors": "w.safetensors", "folder": "model" + os.sep}


@pytest.mark.slow
@pytest.mark.parametrize("fmt", sorted(_DESTS))
def test_checkout_onto_a_full_disk_is_one_line_and_leaves_no_file(tmp_path, fmt):
    """torch.save raises RuntimeError and safetensors SafetensorError for a full disk
    (torch's says only "unexpected pos"), so catching OSError alone would end `tsck
    checkout` in a traceback. The CLI gives exit 1, one line saying which disk is full and
    about how much the file needed; DEST (new, or replaced with --force) is untouched and
    nothing is left beside it. A real tmpfs filled to the last byte; no fakes."""
    _export_store(tmp_path / "s")
    with tmpfs(tmp_path / "small", "4m") as small:
        old = os.path.join(small, "old" + (".pt" if fmt == "torch" else ".safetensors"))
        with open(old, "wb") as f:
            f.write(b"the old file")
        if fmt == "folder":
            os.unlink(old)
            old = os.path.join(small, "old")  # a folder written into with --force
            os.mkdir(old)
            with open(os.path.join(old, "model.safetensors"), "wb") as f:
                f.write(b"the old file")
        fillers = fill(small)
        before = sorted(os.listdir(small))
        new = os.path.join(small, _DESTS[fmt])
        with ThreadPoolExecutor(2) as ex:
            runs = list(ex.map(lambda a: run_cli("checkout", tmp_path / "s", "a/main", *a),
                               [(new,), (old + (os.sep if fmt == "folder" else ""), "--force")]))
        for r in runs:
            assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
            assert "Traceback" not in r.stdout + r.stderr, r.stderr
            lines = r.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("tsck: error: [Errno 28] no space left on the filesystem "
                                                           f"of {small} writing "), r.stderr
            assert "it needed about 1040000 bytes" in lines[0] and "is untouched" in lines[0], lines[0]
        assert sorted(os.listdir(small)) == before  # no DEST, no temporary file
        if fmt == "folder":
            assert os.listdir(old) == ["model.safetensors"]
            old = os.path.join(old, "model.safetensors")
        with open(old, "rb") as f:
            assert f.read() == b"the old file"
        for p in fillers:
            os.unlink(p)
        r = run_cli("checkout", tmp_path / "s", "a/main", new)  # with room: the whole file
        assert r.returncode == 0, r.stderr
        with tsck.open_store(tmp_path / "s", create=False) as s:
            want = s.checkout("a/main")
        if fmt == "torch":
            got = torch.load(new, weights_only=True)
        else:
            from safetensors.torch import load_file
            got = load_file(os.path.join(new, "model.safetensors") if fmt == "folder" else new)
        assert set(got) == set(want) and all(got[k].equal(want[k]) for k in want)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_export_file_onto_a_full_disk_raises_no_space(tmp_path, fmt):
    """The same through the API: StorageError ENOSPC (not RuntimeError / SafetensorError)."""
    from tensorstore_ck.interchange.export import export_file
    _export_store(tmp_path / "s")
    with tmpfs(tmp_path / "small", "4m") as small, tsck.open_store(tmp_path / "s", create=False) as s:
        fill(small)
        before = sorted(os.listdir(small))
        with pytest.raises(tsck.StorageError) as ei:
            export_file(s, "a/main", os.path.join(small, _DESTS[fmt]))
        _assert_no_space(ei.value, small)
        assert sorted(os.listdir(small)) == before
