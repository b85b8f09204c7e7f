"""Contract tests every BlockStore and every RefTable must pass, as importable classes
(zarr's `zarr.testing.store.StoreTests` style).

A concrete suite subclasses one of them and provides the backend under test:

    class TestLocalBlockStore(BlockStoreTests):
        @pytest.fixture
        def block_store(self, tmp_path):
            s = LocalBlockStore(str(tmp_path / "bs"))
            yield s
            s.close()

    class TestLmdbRefTable(RefTableTests):
        persistent = True

        @pytest.fixture
        def open_table(self, tmp_path):
            handles = []
            def open_():                       # a new handle on this test's table
                handles.append(LmdbRefTable(str(tmp_path / "refs.lmdb")))
                return handles[-1]
            yield open_
            for h in handles:
                h.close()

The class names do not start with "Test", so pytest collects them only through a
subclass. Every test goes through the interface only (storage/base.py,
refs/base.py): what those docstrings promise is what is asserted here.
"""

from __future__ import annotations

import array
import contextlib
import os
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import ClassVar

import pytest

from tensorstore_ck.errors import Fenced, GcBusy, InvalidArgument, RebuildUnfinished, RefConflict, RefNotFound
from tensorstore_ck.format.records import encode_record, encode_reflog
from tensorstore_ck.storage import BlockStore
from tensorstore_ck.storage.base import DeadlinePassed

__all__ = ["BlockStoreTests", "RefTableTests"]


@contextlib.contextmanager
def _fast_switching():
    """Switch threads every microsecond, so a check-then-act race in a backend shows up
    within a few rounds instead of once in a thousand runs."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _run_threads(n: int, fn) -> list:
    """fn(i) on n threads started together; their results (or exceptions) in thread order."""
    out: list = [None] * n
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait()
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - reported to the caller as a value
            out[i] = e

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def _key(i: int, kind: str = "blocks") -> str:
    """A key shaped like the ones the store writes: blocks/ab/<64 hex>."""
    h = f"{i:064x}"
    return f"{kind}/{h[-2:]}/{h}"


class BlockStoreTests:
    """The BlockStore contract (tensorstore_ck/storage/base.py).

    Subclasses provide the fixture `block_store`: an empty store (apart from what its
    opener writes, such as a store marker), closed by the fixture afterwards.
    RACE_ROUNDS: rounds of the put_if_absent race. A store that creates by
    check-then-write loses about one round in five; one that leans on the server's
    conditional PUT (S3) loses every round if it does not send the condition or reads
    its refusal wrong, so fewer rounds find that."""

    RACE_ROUNDS: ClassVar[int] = 40

    @pytest.fixture
    def block_store(self) -> BlockStore:
        raise NotImplementedError("a BlockStoreTests subclass provides the block_store fixture")

    # -- put_if_absent, get, exists -------------------------------------------------------
    def test_put_if_absent_creates_once_and_never_overwrites(self, block_store):
        k = _key(1)
        assert block_store.put_if_absent(k, [b"hello ", memoryview(b"world")]) is True
        assert block_store.exists(k) is True
        assert block_store.get(k) == b"hello world"
        # a second writer of the key is told it was there, whatever bytes it brings
        assert block_store.put_if_absent(k, [b"hello world"]) is False
        assert block_store.put_if_absent(k, [b"other, longer bytes"]) is False
        assert block_store.put_if_absent(k, []) is False
        assert block_store.get(k) == b"hello world"
        assert [(o.key, o.size) for o in block_store.list("blocks/")] == [(k, 11)]

    def test_missing_key_is_file_not_found(self, block_store):
        k = _key(2)
        assert block_store.exists(k) is False
        with pytest.raises(FileNotFoundError):
            block_store.get(k)
        with pytest.raises(FileNotFoundError):
            block_store.open_read(k)
        # ... under a folder that exists, too, and once the object was deleted
        block_store.put_if_absent(k, [b"x"])
        sibling = k[:-1] + "f"
        assert block_store.exists(sibling) is False
        with pytest.raises(FileNotFoundError):
            block_store.get(sibling)
        block_store.delete(k)
        assert block_store.exists(k) is False
        with pytest.raises(FileNotFoundError):
            block_store.get(k)
        with pytest.raises(FileNotFoundError):
            block_store.open_read(k)

    def test_open_read_reads_and_reads_into(self, block_store):
        k = _key(3)
        block_store.put_if_absent(k, [b"hello world"])
        with block_store.open_read(k) as f:
            assert f.read(5) == b"hello"
            buf = bytearray(6)
            assert f.readinto(buf) == 6 and bytes(buf) == b" world"
            assert f.read() == b""
        with block_store.open_read(k) as f:
            assert f.read() == b"hello world"

    def test_put_of_many_buffers_stores_their_concatenation(self, block_store):
        floats = array.array("d", [1.5, -2.25, 3e300])  # a non-byte memoryview format
        big = bytes(range(256)) * 4
        bufs = [b"ab", bytearray(b"cd"), memoryview(big)[10:500], b"", memoryview(floats),
                memoryview(bytearray(b"tail"))]
        expect = b"abcd" + big[10:500] + floats.tobytes() + b"tail"
        assert block_store.put_if_absent(_key(4), bufs) is True
        assert block_store.get(_key(4)) == expect
        assert {o.key: o.size for o in block_store.list("blocks/")} == {_key(4): len(expect)}

    def test_put_copies_the_callers_memory(self, block_store):
        """A later mutation of the caller's buffer (a staged tensor) must not rewrite a
        stored object (STYLE.md: in-memory backends copy what they are given)."""
        data = bytearray(b"original")
        block_store.put_if_absent(_key(5), [memoryview(data)])
        data[:] = b"mutated!"
        assert block_store.get(_key(5)) == b"original"

    def test_empty_objects(self, block_store):
        assert block_store.put_if_absent(_key(6), []) is True
        assert block_store.put_if_absent(_key(7), [b"", memoryview(b"")]) is True
        for k in (_key(6), _key(7)):
            assert block_store.exists(k)
            assert block_store.get(k) == b""
            with block_store.open_read(k) as f:
                assert f.read() == b""
        assert {o.key: o.size for o in block_store.list("blocks/")} == {_key(6): 0, _key(7): 0}
        assert block_store.put_if_absent(_key(6), [b"x"]) is False
        assert block_store.get(_key(6)) == b""

    def test_get_reads_at_most_max_bytes(self, block_store):
        """get(key, max_bytes): a prefix of at most max_bytes (how small records are read
        bounded: a caller accepting N bytes asks for N + 1); empty and missing objects too."""
        block_store.put_if_absent(_key(8), [b"0123456789"])
        block_store.put_if_absent(_key(9), [])
        assert block_store.get(_key(8), 4) == b"0123"
        assert block_store.get(_key(8), 10) == block_store.get(_key(8), 11) == b"0123456789"
        assert block_store.get(_key(8), None) == block_store.get(_key(8)) == b"0123456789"
        assert block_store.get(_key(9), 4) == b""
        with pytest.raises(FileNotFoundError):
            block_store.get(_key(10), 4)

    def test_object_of_a_few_mib(self, block_store):
        data = os.urandom(3 * 1024 * 1024 + 123)
        mv = memoryview(data)
        cuts = [0, 1, 1024 * 1024, 2 * 1024 * 1024 + 7, len(data)]
        assert block_store.put_if_absent(_key(8), [mv[a:b] for a, b in zip(cuts, cuts[1:])]) is True
        assert block_store.get(_key(8)) == data
        got = bytearray(len(data))
        with block_store.open_read(_key(8)) as f:
            view, n = memoryview(got), 0
            while n < len(got):
                r = f.readinto(view[n:n + 1024 * 1024])
                assert r > 0
                n += r
        assert got == data
        assert [o.size for o in block_store.list("blocks/")] == [len(data)]

    # -- list ------------------------------------------------------------------------------
    def test_list_reports_key_size_and_mtime(self, block_store):
        t0 = time.time()
        for k, n in [("blocks/00/a", 3), ("blocks/ff/b", 10), ("nodes/01/c", 1)]:
            block_store.put_if_absent(k, [b"x" * n])
        got = {o.key: o.size for o in block_store.list("blocks/")}
        assert got == {"blocks/00/a": 3, "blocks/ff/b": 10}
        assert {o.key for o in block_store.list("nodes/")} == {"nodes/01/c"}
        assert list(block_store.list("commits/")) == []
        for o in block_store.list("blocks/"):
            assert isinstance(o.key, str) and isinstance(o.size, int) and isinstance(o.mtime, float)
            # seconds since the epoch (an S3 server's clock may differ from ours by a little)
            assert t0 - 600 < o.mtime < time.time() + 600

    def test_list_prefix_is_a_folder(self, block_store):
        """base.py: every object whose key starts with `prefix` (a folder, ending in '/').
        "blocks/a/" never reaches "blocks/ab/...", nor does "blocks/a" without its '/'."""
        for k in ["blocks/a/x", "blocks/a/y", "blocks/ab/z", "blocks/abc", "blocks/b/a/x"]:
            block_store.put_if_absent(k, [b"1"])
        assert sorted(o.key for o in block_store.list("blocks/a/")) == ["blocks/a/x", "blocks/a/y"]
        assert sorted(o.key for o in block_store.list("blocks/a")) == ["blocks/a/x", "blocks/a/y"]
        assert sorted(o.key for o in block_store.list("blocks/ab/")) == ["blocks/ab/z"]
        assert sorted(o.key for o in block_store.list("blocks/")) == [
            "blocks/a/x", "blocks/a/y", "blocks/ab/z", "blocks/abc", "blocks/b/a/x"]
        assert list(block_store.list("blocks/c/")) == []
        assert list(block_store.list("nothing/here/")) == []

    def test_list_nested_prefixes(self, block_store):
        before = {o.key for o in block_store.list("")}
        keys = ["a/b/c/d/e", "a/b/c/f", "a/b/g", "a/h", "i"]
        for k in keys:
            block_store.put_if_absent(k, [k.encode()])
        assert {o.key: o.size for o in block_store.list("a/b/c/d/")} == {"a/b/c/d/e": 9}
        assert sorted(o.key for o in block_store.list("a/b/c/")) == ["a/b/c/d/e", "a/b/c/f"]
        assert sorted(o.key for o in block_store.list("a/b/")) == ["a/b/c/d/e", "a/b/c/f", "a/b/g"]
        assert sorted(o.key for o in block_store.list("a/")) == keys[:4]
        # "" is everything (open_store's "is this folder empty?")
        everything = {o.key for o in block_store.list("") if not o.key.startswith("tmp/")}
        assert everything - before == set(keys)
        for k in keys:
            assert block_store.get(k) == k.encode()

    def test_list_pages_come_in_key_order_and_resume_after_any_key(self, block_store):
        """base.py `pages`/list_page: where a store lists in pages, list() is the pages one
        after the other, in key order, and a page asked for after a key (listed or not)
        starts at the next key: what a retried page request relies on."""
        keys = sorted([_key(i) for i in range(40, 52)] + ["blocks/a/x", "blocks/ab/z", "blocks/abc"])
        for k in keys + ["nodes/00/n"]:
            block_store.put_if_absent(k, [k.encode()])
        if not block_store.pages:
            with pytest.raises(NotImplementedError):
                block_store.list_page("blocks/")
            return

        def pages_after(start):
            got, after, n = [], start, 0
            while True:
                page, after = block_store.list_page("blocks/", after)
                got += [o.key for o in page]
                n += 1
                if after is None:
                    return got, n
        got, _ = pages_after(None)
        assert got == keys == [o.key for o in block_store.list("blocks/")]
        for i, k in enumerate(keys):
            assert pages_after(k)[0] == keys[i + 1:], k
        assert pages_after("blocks/a/y")[0] == keys[keys.index("blocks/ab/z"):]  # not a key itself
        assert pages_after("blocks/zzz") == ([], 1)

    # -- delete ----------------------------------------------------------------------------
    def test_delete_of_present_and_absent_keys(self, block_store):
        block_store.put_if_absent(_key(9), [b"x"])
        block_store.put_if_absent(_key(10), [b"y"])
        block_store.delete(_key(9))
        block_store.delete(_key(9))  # absent is not an error
        block_store.delete(_key(11))  # never existed, nor its folder
        block_store.delete("nowhere/at/all")
        assert not block_store.exists(_key(9))
        assert block_store.get(_key(10)) == b"y"
        assert [o.key for o in block_store.list("blocks/")] == [_key(10)]

    def test_delete_many_removes_exactly_the_keys_given(self, block_store):
        # 1100 keys: more than one DeleteObjects request (1000 keys each) on s3.
        keys = [_key(i) for i in range(1100)]
        with ThreadPoolExecutor(16) as ex:
            assert all(ex.map(lambda k: block_store.put_if_absent(k, [b"x"]), keys))
        block_store.delete_many(keys[:1050] + [_key(5000), "nowhere/x"])  # absent keys: not errors
        block_store.delete_many([])
        block_store.delete_many((keys[0],))  # gone already; any sequence of keys
        assert sorted(o.key for o in block_store.list("blocks/")) == sorted(keys[1050:])
        assert not any(block_store.exists(k) for k in keys[1040:1050])

    def test_deleted_key_can_be_created_again(self, block_store):
        """gc removes an object; a writer that re-validates re-uploads it."""
        assert block_store.put_if_absent(_key(12), [b"v"]) is True
        block_store.delete(_key(12))
        assert block_store.put_if_absent(_key(12), [b"v"]) is True
        assert block_store.get(_key(12)) == b"v"
        block_store.delete_many([_key(12)])
        assert block_store.put_if_absent(_key(12), [b"v"]) is True
        assert block_store.exists(_key(12))

    # -- size_of, move ---------------------------------------------------------------------
    def test_size_of_present_absent_and_deleted(self, block_store):
        k = _key(14)
        assert block_store.size_of(k) is None
        block_store.put_if_absent(k, [b"abc", b"defg"])
        assert block_store.size_of(k) == 7
        block_store.put_if_absent(_key(15), [])
        assert block_store.size_of(_key(15)) == 0
        assert block_store.size_of(k[:-1] + "f") is None  # a sibling under an existing folder
        assert block_store.size_of("blocks/") is None and block_store.size_of("nowhere/x") is None
        block_store.delete(k)
        assert block_store.size_of(k) is None

    def test_move_puts_the_bytes_under_the_new_key_only(self, block_store):
        """fsck --repair moves damaged objects aside (quarantine/...): the bytes are kept,
        the old name is free for a fresh put."""
        k, aside = _key(16), "quarantine/blocks/" + _key(16).rsplit("/", 1)[1] + ".x1"
        data = os.urandom(70_000)
        block_store.put_if_absent(k, [data])
        with pytest.raises(DeadlinePassed):  # past the caller's deadline: the object stays
            block_store.move(k, aside + "z", deadline=lambda: 0.0)
        assert block_store.get(k) == data
        block_store.delete(aside + "z")  # an object store may have copied it already
        assert block_store.move(k, aside) is True
        block_store.sync()
        assert not block_store.exists(k) and block_store.get(aside) == data
        assert [o.key for o in block_store.list("blocks/")] == []
        assert [(o.key, o.size) for o in block_store.list("quarantine/")] == [(aside, len(data))]
        assert block_store.move(k, aside + "y") is False  # gone: nothing moved, nothing made
        assert not block_store.exists(aside + "y")
        assert block_store.put_if_absent(k, [b"fresh"]) is True  # the name is free again
        assert block_store.get(k) == b"fresh" and block_store.get(aside) == data
        block_store.delete(aside)
        assert list(block_store.list("quarantine/")) == []

    # -- concurrency -----------------------------------------------------------------------
    def test_racing_put_if_absent_has_exactly_one_winner(self, block_store):
        """Threads racing put_if_absent on one key: exactly one True per key, and a
        reader never sees the object half-written. (fsspec's memory file system failed
        this: a check-then-write create showed in about one round in five.)"""
        n, rounds = 16, self.RACE_ROUNDS
        data = os.urandom(64 * 1024)
        torn = []

        def put_or_read(i, key):
            if i == n - 1:  # one reader polls the key while the others write it
                for _ in range(20):
                    try:
                        got = block_store.get(key)
                    except FileNotFoundError:
                        continue
                    if got != data:
                        torn.append(len(got))
                return None
            return block_store.put_if_absent(key, [data[:1000], memoryview(data)[1000:]])

        with _fast_switching():
            results = [_run_threads(n, lambda i, k=_key(100 + r): put_or_read(i, k)) for r in range(rounds)]
        errors = [e for res in results for e in res if isinstance(e, BaseException)]
        assert not errors, errors
        assert [res[:-1].count(True) for res in results] == [1] * rounds
        assert torn == []
        for r in range(rounds):
            assert block_store.get(_key(100 + r)) == data

    def test_concurrent_puts_of_different_keys(self, block_store):
        keys = [_key(200 + i) for i in range(64)]
        with ThreadPoolExecutor(8) as ex:
            assert list(ex.map(lambda k: block_store.put_if_absent(k, [k.encode()] * 3), keys)) == [True] * 64
        block_store.sync()
        assert {o.key: o.size for o in block_store.list("blocks/")} == {k: 3 * len(k) for k in keys}

    # -- sync, close -----------------------------------------------------------------------
    def test_sync_at_any_time(self, block_store):
        block_store.sync()  # nothing written yet
        block_store.sync()
        block_store.put_if_absent("a/b/c/d", [b"deep"])  # new folders: their entries too
        block_store.sync()
        block_store.delete("a/b/c/d")
        block_store.delete("x/never")
        block_store.sync()
        block_store.sync()
        assert not block_store.exists("a/b/c/d")

    def test_close_is_idempotent(self, block_store):
        block_store.put_if_absent(_key(13), [b"x"])
        block_store.sync()
        block_store.close()
        block_store.close()


class RefTableTests:
    """The RefTable contract (tensorstore_ck/refs/base.py): the logic is written once in
    RefTable, so what differs between backends is their transactions (_read/_write over
    a Txn) and close(); this suite runs the logic over each.

    Subclasses provide the fixture `open_table`: a callable that opens a new handle on
    this test's table (an empty one, of its own: a fresh path or namespace per test) and
    that closes every handle it opened afterwards. Class flags:

    persistent          the table outlives its handle: close and reopen keeps everything
    independent_handles several handles may be open at once (one per racing thread);
                        otherwise racing threads share one handle, as a Store's do
    """

    persistent: ClassVar[bool] = False
    independent_handles: ClassVar[bool] = False

    R = [bytes([i]) * 32 for i in range(16)]

    @pytest.fixture
    def open_table(self):
        raise NotImplementedError("a RefTableTests subclass provides the open_table fixture")

    @pytest.fixture
    def table(self, open_table):
        return open_table()

    def _handles(self, table, open_table, n):
        return [open_table() for _ in range(n)] if self.independent_handles else [table] * n

    # -- refs: get, compare-and-swap -------------------------------------------------------
    def test_missing_ref(self, table):
        with pytest.raises(RefNotFound):
            table.get("a/b")
        with pytest.raises(KeyError):  # RefNotFound is a KeyError too
            table.get("a/b")
        assert table.get_or_none("a/b") is None
        assert table.list() == [] and table.reflog("a/b") == []

    def test_cas_create_move_and_conflicts(self, table):
        R = self.R
        table.compare_and_swap("a/b", None, R[1], message="create")
        assert table.get("a/b") == R[1] and table.get_or_none("a/b") == R[1]
        with pytest.raises(RefConflict) as ei:  # expected None: the ref must not exist
            table.compare_and_swap("a/b", None, R[2], message="create again")
        assert (ei.value.name, ei.value.expected, ei.value.actual) == ("a/b", None, R[1].hex())
        with pytest.raises(RefConflict) as ei:  # a stale expected
            table.compare_and_swap("a/b", R[3], R[2], message="stale")
        assert (ei.value.expected, ei.value.actual) == (R[3].hex(), R[1].hex())
        with pytest.raises(RefConflict) as ei:  # expected a tip, but there is no such ref
            table.compare_and_swap("c", R[1], R[2], message="absent")
        assert (ei.value.name, ei.value.expected, ei.value.actual) == ("c", R[1].hex(), None)
        assert table.get("a/b") == R[1]
        table.compare_and_swap("a/b", R[1], R[2], message="move", catalog_row={"step": 2})
        assert table.get("a/b") == R[2]
        table.compare_and_swap("a/b", R[2], R[2], message="same")  # a move to itself is a move
        assert table.catalog_get(R[2]) == {"step": 2}
        assert table.catalog_get(R[1]) is None
        assert [e.message for e in table.reflog("a/b")] == ["create", "move", "same"]

    def test_refused_moves_leave_no_trace(self, table):
        R = self.R
        table.compare_and_swap("r", None, R[1], message="c", catalog_row={"step": 1})
        with pytest.raises(RefConflict):
            table.compare_and_swap("r", R[5], R[2], message="stale", catalog_row={"step": 2})
        table.gc_begin("g", lease=10, now=1.0)
        table.gc_freeze("g", now=2.0)
        with pytest.raises(Fenced):
            table.compare_and_swap("r", R[1], R[3], message="fenced", catalog_row={"step": 3}, fence=0)
        assert table.get("r") == R[1]
        assert [e.new for e in table.reflog("r")] == [R[1]]
        assert table.catalog_get(R[2]) is None and table.catalog_get(R[3]) is None
        assert [k for k, _ in table.catalog_iter()] == [R[1]]
        table.gc_finish("g", now=3.0)
        table.compare_and_swap("r", R[1], R[4], message="m")  # the reflog goes on without a gap
        assert [(e.old, e.new) for e in table.reflog("r")] == [(None, R[1]), (R[1], R[4])]

    # -- reflog, list ----------------------------------------------------------------------
    def test_reflog_one_entry_per_move_oldest_first(self, table):
        R = self.R
        t0 = time.time()
        prev = None
        for i in range(1, 8):
            table.compare_and_swap("job/main", prev, R[i], message=f"step {i}")
            prev = R[i]
        # other refs whose names extend this one's as bytes must not bleed into its log
        table.compare_and_swap("job/main2", None, R[9], message="x")
        table.compare_and_swap("job/main/sub", None, R[10], message="x")
        table.compare_and_swap("job", None, R[11], message="x")
        log = table.reflog("job/main")
        assert [(e.name, e.old, e.new, e.message) for e in log] == [
            ("job/main", R[i - 1] if i > 1 else None, R[i], f"step {i}") for i in range(1, 8)]
        times = [e.time for e in log]
        assert times == sorted(times) and t0 - 1 <= times[0] and times[-1] <= time.time() + 1
        assert [e.new for e in table.reflog("job")] == [R[11]]
        assert [e.new for e in table.reflog("job/main2")] == [R[9]]
        assert table.reflog("job/mai") == []

    # -- history: the steps index (REF@STEP) and gc's compaction -------------------------------
    def test_step_index_and_history(self, table):
        R = self.R
        prev = None
        for i, step in enumerate([1, 2, 2, 3], start=1):
            table.compare_and_swap("j/m", prev, R[i], message="m", catalog_row={"step": step, "ref": "j/m"})
            prev = R[i]
        table.compare_and_swap("j/m2", None, R[5], message="m", catalog_row={"step": 2})
        assert table.step_root("j/m", 2) == R[3]  # the newest move at that step
        assert table.step_root("j/m", 1) == R[1] and table.step_root("j/m", 4) is None
        assert table.step_root("j/m2", 2) == R[5] and table.step_root("j", 2) is None
        assert [r for r, _row in table.history("j/m")] == [R[4], R[3], R[2], R[1]]
        assert table.history("nope") is None
        assert table.catalog_expire([R[3]]) == [R[3]]
        assert table.step_root("j/m", 2) == R[2]  # R[3] is no longer kept
        table.compare_and_swap("j/m", R[4], R[1], message="back")  # no row given: indexed from R[1]'s
        assert table.step_root("j/m", 1) == R[1]
        assert [r for r, _row in table.history("j/m")] == [R[1], R[4], R[2]]

    def test_step_index_is_rebuilt_for_moves_it_does_not_cover(self, table):
        """A table written by code from before the index (or by such code since) gets the
        index rebuilt on the first REF@STEP lookup."""
        R, seq = self.R, struct.Struct(">Q")
        table.compare_and_swap("o/m", None, R[1], message="m", catalog_row={"step": 1})

        def drop_index(t):
            for k, _v in list(t.items("steps")):
                t.delete("steps", k)
            t.delete("meta", b"steps_seq")

        table._write(drop_index)
        assert table.step_root("o/m", 1) == R[1]

        def old_move(t):  # an older writer's move: reflog, counter and catalog, no index
            n = seq.unpack(t.get("meta", b"reflog_seq"))[0] + 1
            t.put("meta", b"reflog_seq", seq.pack(n))
            t.put("refs", b"o/m", R[2])
            t.put("reflog", b"o/m\0" + seq.pack(n), encode_reflog(R[1], R[2], "old", 0.0))
            t.put("catalog", R[2], encode_record({"step": 7}))

        table._write(old_move)
        assert table.step_root("o/m", 7) == R[2]
        table.compare_and_swap("o/m", R[2], R[3], message="m", catalog_row={"step": 8})
        assert table.step_root("o/m", 8) == R[3] and table.step_root("o/m", 1) == R[1]

    def test_compact_history_keeps_kept_moves_and_a_tail(self, table):
        R = self.R
        prev = None
        for i in range(1, 16):
            table.compare_and_swap("c/m", prev, R[i], message=f"step {i}", catalog_row={"step": i})
            prev = R[i]
        table.compare_and_swap("c/other", None, R[2], message="x")  # another ref's tip
        table.tag_create("t", R[3])
        table.pin(R[4])
        before = table.publication_order()
        table.catalog_expire([R[i] for i in range(1, 15)])
        removed = table.compact_history(tail=3, batch=4)
        assert removed > 0 and table.compact_history(tail=3) == 0
        assert [e.new for e in table.reflog("c/m")] == [R[2], R[3], R[4], R[13], R[14], R[15]]
        assert [e.new for e in table.reflog("c/other")] == [R[2]]
        kept = {R[2], R[3], R[4], R[15]}
        after = table.publication_order()
        assert {r: s for r, s in after.items() if r in kept} == {r: s for r, s in before.items() if r in kept}
        assert table.step_root("c/m", 4) == R[4] and table.step_root("c/m", 5) is None
        assert table._read(lambda t: {v for _k, v in t.items("steps")}) <= kept
        table.compare_and_swap("c/m", R[15], R[5], message="after", catalog_row={"step": 5})
        assert table.step_root("c/m", 5) == R[5]  # the sequence goes on, the index still covers it

    def test_publication_record_says_which_moves_were_recovers(self, table):
        """The latest move to a root decides its number and whether it was recover's
        (retention ranks recover's numbers within one ref only)."""
        from tensorstore_ck.refs.history import RECOVERED
        R = self.R
        table.compare_and_swap("p/a", None, R[1], message=RECOVERED)
        table.compare_and_swap("p/a", R[1], R[2], message="put")
        table.compare_and_swap("p/b", None, R[3], message=RECOVERED)
        table.compare_and_swap("p/b", R[3], R[1], message="reset")  # a writer's later move to R1
        table.catalog_put_if_absent(R[4], {"ref": "p/c", "step": 1})  # a row recover added, no move
        rec = table.publication_record()
        assert set(rec) == {R[1], R[2], R[3]}
        assert [rec[r][1] for r in (R[1], R[2], R[3])] == [False, False, True]
        assert rec[R[1]][0] > rec[R[3]][0] > rec[R[2]][0]
        assert table.publication_order() == {r: seq for r, (seq, _rec) in rec.items()}

    def test_list_is_a_sorted_string_prefix(self, table):
        names = ["a/x", "a/y", "b/x", "ab", "a", "a-b", "a.b", "a_b", "aB", "a/x/y"]
        for i, name in enumerate(names):
            table.compare_and_swap(name, None, self.R[i], message="c")
        assert table.list("a/") == [("a/x", self.R[0]), ("a/x/y", self.R[9]), ("a/y", self.R[1])]
        # bytewise order, in every backend
        assert [n for n, _ in table.list()] == sorted(names, key=str.encode)
        assert [n for n, _ in table.list("")] == sorted(names, key=str.encode)
        # a ref-table prefix is a plain string prefix, not a folder
        assert [n for n, _ in table.list("a")] == sorted((n for n in names if n.startswith("a")), key=str.encode)
        assert [n for n, _ in table.list("ab")] == ["ab"]
        assert table.list("c") == [] and table.list("a/x/y/z") == []

    def test_every_valid_name_is_kept_exactly(self, table):
        """Names are validated above the table (the Store, tsck's parser: at most 255 bytes of
        '/'-separated [A-Za-z0-9._-] components); whatever passes must be stored, listed and
        logged byte for byte, as a ref and as a tag: the longest, every allowed character,
        names that differ only in case."""
        R = self.R
        longest = "/".join(["x" * 63] * 4)  # 4 * 63 + 3 = 255 bytes
        charset = "AZaz09._-/-_.90zaZA"
        names = [longest, charset, "Main", "main", "MAIN", "...", "a..b", "-", "_/_"]
        assert len(longest.encode()) == 255
        for i, name in enumerate(names):
            table.compare_and_swap(name, None, R[i], message=name, catalog_row={"ref": name})
            table.tag_create("t/" + name[:253], R[i])
        assert table.list() == sorted(((n, R[i]) for i, n in enumerate(names)), key=lambda x: x[0].encode())
        for i, name in enumerate(names):
            assert table.get(name) == R[i]
            assert [(e.name, e.new, e.message) for e in table.reflog(name)] == [(name, R[i], name)]
            assert table.catalog_get(R[i]) == {"ref": name}
            assert table.tag_get("t/" + name[:253]) == R[i]
        assert [n for n, _ in table.tags()] == sorted(("t/" + n[:253] for n in names), key=str.encode)
        assert table.list(longest) == [(longest, R[0])] and table.list(longest + "x") == []

    # -- catalog ---------------------------------------------------------------------------
    def test_catalog_get_put_iter_prefix(self, table):
        R = self.R
        row = {"job": "j", "ref": "j/main", "step": 7, "time": 1.5, "metrics": {"loss": 0.25, "n": 3},
               "meta": {"k": "v"}, "bytes_total": 10, "bytes_new": 4, "blocks_total": 2, "blocks_new": 1}
        assert table.catalog_get(R[1]) is None
        table.catalog_put(R[1], row)
        assert table.catalog_get(R[1]) == row
        table.catalog_put(R[1], {"step": 8})  # catalog_put replaces
        assert table.catalog_get(R[1]) == {"step": 8}
        a, b, c = b"\xab\xcd" + bytes(30), b"\xab\xcd" + b"\x01" * 30, b"\xab\xce" + bytes(30)
        for r in (c, a, b):
            table.catalog_put(r, {"step": 1})
        assert [k for k, _ in table.catalog_iter()] == sorted([R[1], a, b, c])
        assert dict(table.catalog_iter())[a] == {"step": 1}
        assert table.catalog_prefix(b"\xab\xcd") == [a, b]
        assert table.catalog_prefix(b"\xab") == [a, b, c]
        assert table.catalog_prefix(b"\xab\xcd\x01") == [b]
        assert table.catalog_prefix(b"\xff") == []

    def test_catalog_put_if_absent(self, table):
        R = self.R
        assert table.catalog_put_if_absent(R[6], {"x": 1}) is True
        assert table.catalog_put_if_absent(R[6], {"x": 2}) is False
        assert table.catalog_get(R[6]) == {"x": 1}
        table.compare_and_swap("r", None, R[7], message="c", catalog_row={"x": 3})
        assert table.catalog_put_if_absent(R[7], {"x": 4}) is False
        assert table.catalog_get(R[7]) == {"x": 3}

    def test_catalog_expire_never_drops_a_tip_a_tag_target_or_a_pin(self, table):
        R = self.R
        for i in range(1, 6):
            table.catalog_put(R[i], {"step": i})
        table.compare_and_swap("r", None, R[1], message="c")
        table.tag_create("t", R[2])
        table.pin(R[3])
        # R[6] has no catalog row: not reported as dropped
        assert sorted(table.catalog_expire([R[1], R[2], R[3], R[4], R[6]])) == [R[4]]
        assert {r for r, _ in table.catalog_iter()} == {R[1], R[2], R[3], R[5]}
        assert table.catalog_expire([R[4]]) == []  # gone already
        table.unpin(R[3])
        assert table.catalog_expire([R[3]]) == [R[3]]
        table.compare_and_swap("r", R[1], R[5], message="m")  # R[1] is no longer a tip
        assert table.catalog_expire([R[1], R[5]]) == [R[1]]
        assert table.catalog_expire([]) == []
        assert {r for r, _ in table.catalog_iter()} == {R[2], R[5]}

    # -- tags, pins, retention -------------------------------------------------------------
    def test_tags_are_immutable_and_disjoint_from_refs(self, table):
        R = self.R
        assert table.tag_get("t") is None and table.tags() == []
        table.compare_and_swap("r", None, R[1], message="c")
        table.tag_create("t", R[1])
        assert table.tag_get("t") == R[1]
        for root in (R[2], R[1]):  # not even to the same target
            with pytest.raises(RefConflict) as ei:
                table.tag_create("t", root)
            assert (ei.value.name, ei.value.expected, ei.value.actual) == ("t", None, R[1].hex())
        with pytest.raises(RefConflict) as ei:
            table.tag_create("r", R[2])  # a ref has that name
        assert ei.value.actual == R[1].hex()
        with pytest.raises(RefConflict):
            table.compare_and_swap("t", None, R[2], message="c")  # a tag has that name
        assert table.get_or_none("t") is None and table.reflog("t") == []
        assert table.tag_get("r") is None and table.tag_get("t") == R[1]
        table.tag_create("b", R[3])
        table.tag_create("t2", R[1])  # many tags may name one root
        assert table.tags() == [("b", R[3]), ("t", R[1]), ("t2", R[1])]
        assert [n for n, _ in table.list()] == ["r"]  # tags are not refs

    def test_pins(self, table):
        R = self.R
        assert table.pins() == set()
        table.pin(R[1])
        table.pin(R[1])  # idempotent
        table.pin(R[2])
        assert table.pins() == {R[1], R[2]}
        table.unpin(R[1])
        table.unpin(R[1])  # absent is not an error
        table.unpin(R[9])
        assert table.pins() == {R[2]}

    # -- removals: delete_ref, forget, tag_delete ------------------------------------------
    def test_delete_ref_drops_its_history_but_not_what_others_keep(self, table):
        R = self.R
        prev = None
        for i in (1, 2, 3, 4):  # r: R1 -> R2 -> R3 -> R4
            table.compare_and_swap("r", prev, R[i], message=f"m{i}", catalog_row={"ref": "r", "step": i})
            prev = R[i]
        table.compare_and_swap("o", None, R[5], message="o", catalog_row={"ref": "o", "step": 0})
        table.compare_and_swap("o", R[5], R[2], message="o->R2")  # o's tip is in r's history
        table.tag_create("t", R[3])
        table.pin(R[1])
        table.catalog_put_if_absent(R[6], {"ref": "r", "step": 9})  # a row recover added, no move
        with pytest.raises(RefConflict) as ei:
            table.delete_ref("r", R[3])
        assert (ei.value.expected, ei.value.actual) == (R[3].hex(), R[4].hex())
        assert table.get("r") == R[4]  # a refused delete changes nothing
        with pytest.raises(RefNotFound):
            table.delete_ref("nope")
        assert table.delete_ref("r", R[4], message="bye") == (R[4], 2)  # R4 and R6; R1-R3 kept by others
        assert table.get_or_none("r") is None and [n for n, _ in table.list()] == ["o"]
        assert {k for k, _ in table.catalog_iter()} == {R[1], R[2], R[3], R[5]}
        assert table.history("r") is None and table.step_root("r", 4) is None
        last = table.reflog("r")[-1]
        assert (last.op, last.old, last.new, last.message) == ("delete", R[4], R[4], "bye")
        deleted, forgotten = table.removed()
        assert set(deleted) == {"r"} and forgotten == set()
        order = table.publication_order()  # removals are not publications: R4's rank is its move's
        assert order[R[2]] > order[R[4]] > order[R[3]]  # o's move to R2 came after R4's publication
        # A snapshot of the deleted history that another ref still kept, forgotten later: the
        # record goes to the deleted ref's reflog, which stays a deleted ref's.
        table.compare_and_swap("o", R[2], R[5], message="o moves on")
        table.forget(R[2], "r")
        assert table.history("r") is None and table.catalog_get(R[2]) is None
        # The name is free again; its new history starts after the removal.
        table.compare_and_swap("r", None, R[7], message="again", catalog_row={"ref": "r", "step": 1})
        assert [root for root, _row in table.history("r")] == [R[7]]
        assert table.step_root("r", 1) == R[7] and table.removed()[0] == {}

    def test_undelete_and_the_shared_namespace_of_refs_and_tags(self, table):
        R = self.R
        table.compare_and_swap("r", None, R[1], message="m1", catalog_row={"ref": "r", "step": 1})
        table.compare_and_swap("r", R[1], R[2], message="m2", catalog_row={"ref": "r", "step": 2})
        epoch = table.gc_state()["epoch"]
        with pytest.raises(RefConflict, match="exists again"):
            table.undelete("r", R[2], {"ref": "r", "step": 2}, fence=epoch)
        with pytest.raises(RefConflict, match="a ref has this name"):
            table.tag_create("r", R[1])
        assert table.deleted_ref_root("r") is None
        table.delete_ref("r")
        assert table.deleted_ref_root("r") == R[2] and table.catalog_get(R[2]) is None
        with pytest.raises(RefConflict, match="a deleted ref has this name"):
            table.tag_create("r", R[2])
        with pytest.raises(RefConflict, match="a deleted ref has this name"):
            table.tag_adopt("r", R[2], {"ref": "r", "step": 2}, fence=epoch)
        assert table.tags() == [] and table.catalog_get(R[2]) is None
        with pytest.raises(Fenced):
            table.undelete("r", R[2], {"ref": "r", "step": 2}, fence=epoch + 2)
        with pytest.raises(RefNotFound):
            table.undelete("never", R[2], {"ref": "never", "step": 2}, fence=epoch)
        assert table.get_or_none("r") is None
        table.undelete("r", R[2], {"ref": "r", "step": 2}, fence=epoch)
        assert table.get("r") == R[2] and table.catalog_get(R[2])["step"] == 2
        assert [root for root, _row in table.history("r")] == [R[2]] and table.step_root("r", 2) == R[2]
        assert table.reflog("r")[-1].op == "move" and table.deleted_ref_root("r") is None
        assert table.removed()[0] == {}  # recover no longer skips it
        # A ref is never created over a tag either.
        table.tag_create("t", R[1])
        with pytest.raises(RefConflict, match="a tag has this name"):
            table.compare_and_swap("t", None, R[3], message="x")

    def test_forget_refuses_what_is_kept_and_is_recorded(self, table):
        R = self.R
        prev = None
        for i in (1, 2, 3):
            table.compare_and_swap("r", prev, R[i], message=f"m{i}", catalog_row={"ref": "r", "step": i})
            prev = R[i]
        table.tag_create("t", R[2])
        for root in (R[3], R[2]):  # the tip, a tag's target
            with pytest.raises(InvalidArgument):
                table.forget(root, "r")
        table.pin(R[1])
        with pytest.raises(InvalidArgument):
            table.forget(R[1], "r")
        table.unpin(R[1])
        table.forget(R[1], "r")
        with pytest.raises(RefNotFound):
            table.forget(R[1], "r")  # forgotten already
        assert table.catalog_get(R[1]) is None and table.step_root("r", 1) is None
        assert [root for root, _row in table.history("r")] == [R[3], R[2]]
        assert table.reflog("r")[-1].op == "forget" and table.removed() == ({}, {R[1]})
        assert table.get("r") == R[3]
        table.compact_history(tail=0)
        assert [e.op for e in table.reflog("r")] == ["move", "move", "forget"]  # removals stay

    def test_a_move_drops_the_rows_of_the_encodings_it_supersedes_unless_kept(self, table):
        """compare_and_swap(superseded=): rows a recover gave a put's earlier encodings go
        in the move's transaction, each recorded as a forget; a tag's target, a pin or a
        ref's tip stays; a root with no row and the new root itself are left alone."""
        R = self.R
        table.compare_and_swap("r", None, R[1], message="m1", catalog_row={"ref": "r", "step": 1})
        for root in (R[2], R[3], R[4]):  # adopted by a recover
            table.catalog_put_if_absent(root, {"ref": "r", "step": 2})
        table.tag_create("t", R[3])
        table.pin(R[4])
        table.compare_and_swap("r", R[1], R[5], message="m5", catalog_row={"ref": "r", "step": 2},
                               superseded=(R[2], R[3], R[4], R[6], R[5]))
        assert table.get("r") == R[5] and table.catalog_get(R[2]) is None
        assert all(table.catalog_get(root) is not None for root in (R[1], R[3], R[4], R[5]))
        assert [(e.op, e.new) for e in table.reflog("r")] == [("move", R[1]), ("move", R[5]), ("forget", R[2])]
        assert table.removed() == ({}, {R[2]})

    def test_tag_delete(self, table):
        R = self.R
        table.compare_and_swap("r", None, R[1], message="c")
        table.tag_create("t", R[1])
        assert table.tag_delete("t") == R[1]
        assert table.tag_get("t") is None and table.tags() == []
        with pytest.raises(RefNotFound):
            table.tag_delete("t")
        table.tag_create("t", R[1])  # the name is free again
        assert table.tag_get("t") == R[1]

    def test_retention_set_and_all(self, table):
        assert table.retention_all() == {}
        table.retention_set("job", {"keep_last": 3})
        table.retention_set("other/job", {"keep_best": ["loss", "min", 2], "max_age_days": 1.5})
        assert table.retention_all() == {"job": {"keep_last": 3},
                                         "other/job": {"keep_best": ["loss", "min", 2], "max_age_days": 1.5}}
        table.retention_set("job", {"keep_last": 5})  # replaces
        assert table.retention_all()["job"] == {"keep_last": 5}
        table.retention_set("job", None)  # None clears
        table.retention_set("never-set", None)
        assert table.retention_all() == {"other/job": {"keep_best": ["loss", "min", 2], "max_age_days": 1.5}}

    # -- gc state machine ------------------------------------------------------------------
    def test_gc_state_machine(self, table):
        st = table.gc_state()
        assert (st["epoch"], st["phase"]) == (0, "idle")
        st = table.gc_begin("g1", lease=10, now=100.0)
        assert (st["epoch"], st["phase"], st["owner"]) == (0, "marking", "g1")
        assert table.gc_state()["phase"] == "marking"
        assert table.gc_heartbeat("g1", now=104.0)["expires"] == 114.0  # renewed: lease from now
        with pytest.raises(GcBusy):
            table.gc_heartbeat("someone-else", now=104.0)
        with pytest.raises(GcBusy):
            table.gc_freeze("someone-else", now=104.0)
        st = table.gc_freeze("g1", now=106.0)
        assert (st["epoch"], st["phase"]) == (1, "deleting")  # odd exactly while deleting
        assert table.gc_state()["epoch"] == 1
        with pytest.raises(GcBusy):
            table.gc_freeze("g1", now=106.5)  # only a marking gc freezes
        table.gc_heartbeat("g1", now=107.0)
        st = table.gc_finish("g1", now=108.0, deleted=5)
        assert (st["epoch"], st["phase"], st["owner"]) == (2, "idle", None)
        assert table.gc_state()["deleted"] == 5
        with pytest.raises(GcBusy):
            table.gc_heartbeat("g1", now=109.0)  # finished: it holds nothing
        # a dry run: marking -> idle, no deletion phase, the epoch does not move
        table.gc_begin("g2", lease=10, now=200.0)
        st = table.gc_finish("g2", now=201.0)
        assert (st["epoch"], st["phase"]) == (2, "idle")

    def test_a_second_gc_is_busy_until_the_first_is_stale(self, table):
        table.gc_begin("g1", lease=10, now=100.0)
        with pytest.raises(GcBusy):
            table.gc_begin("g2", lease=10, now=105.0)  # g1 is alive
        table.gc_heartbeat("g1", now=108.0)
        with pytest.raises(GcBusy):
            table.gc_begin("g2", lease=10, now=115.0)  # the heartbeat renewed the lease
        st = table.gc_begin("g2", lease=10, now=118.0)  # a stale marking gc is taken over
        assert (st["epoch"], st["owner"]) == (0, "g2")
        with pytest.raises(GcBusy):
            table.gc_heartbeat("g1", now=119.0)  # g1 lost its lock
        table.gc_freeze("g2", now=119.0)
        with pytest.raises(GcBusy):
            table.gc_begin("g3", lease=10, now=120.0)
        st = table.gc_begin("g3", lease=10, now=200.0)  # a stale deleting gc: epoch closed
        assert (st["epoch"], st["phase"], st["owner"]) == (2, "marking", "g3")
        with pytest.raises(GcBusy):
            table.gc_finish("g2", now=201.0)

    # -- the rebuild mark (recover under gc) ------------------------------------------------
    def test_an_unfinished_rebuild_refuses_every_gc_lock_for_deleting(self, table):
        assert table.rebuild_unfinished() is None  # a table without the mark is complete
        assert table.rebuild_begin("rec1") is None
        mark = table.rebuild_unfinished()
        assert mark["owner"] == "rec1" and isinstance(mark["started"], float)
        for what in ("gc", "prune"):
            with pytest.raises(RebuildUnfinished, match=rf"{what} refused.*`tsck recover`.*nothing was deleted"):
                table.gc_begin("g", lease=10, now=100.0, what=what)
        assert table.gc_state()["phase"] == "idle"
        st = table.gc_begin("fsck", lease=10, now=100.0, rebuilding_ok=True)  # deletes nothing reachable
        table.gc_finish(st["owner"], now=101.0)
        # a second recover (the first was killed) takes the mark over; only a finish clears it
        assert table.rebuild_begin("rec2")["owner"] == "rec1"
        assert table.rebuild_unfinished()["owner"] == "rec2"
        table.rebuild_finish()
        assert table.rebuild_unfinished() is None
        table.gc_begin("g", lease=10, now=200.0)
        table.gc_finish("g", now=201.0)
        # stored bytes are untrusted: a mark that does not decode, or odd fields, still refuses
        for raw in (b"\xc1", encode_record({"owner": ["x"], "started": "soon"}), encode_record({"started": 1e300})):
            table._write(lambda t, raw=raw: t.put("meta", b"rebuild", raw))
            assert table.rebuild_unfinished() is not None
            with pytest.raises(RebuildUnfinished, match="`tsck recover`"):
                table.gc_begin("g", lease=10, now=300.0)
        table.rebuild_finish()

    def test_a_rebuild_waits_for_a_live_gc_and_closes_a_dead_ones_lock(self, table):
        table.gc_begin("g1", lease=10, now=100.0)
        table.gc_freeze("g1", now=101.0)
        with pytest.raises(GcBusy):
            table.rebuild_begin("rec", now=105.0)  # g1's lease runs: it may be deleting
        assert table.rebuild_unfinished() is None
        table.rebuild_begin("rec", now=200.0)  # g1's lease ran out: closed, epoch even again
        st = table.gc_state()
        assert (st["phase"], st["owner"], st["epoch"] % 2) == ("idle", None, 0)
        with pytest.raises(GcBusy):
            table.gc_heartbeat("g1", now=201.0)  # a gc that outlived its lease cannot go on
        with pytest.raises(RebuildUnfinished):
            table.gc_begin("g2", lease=10, now=300.0)

    def test_fenced_compare_and_swap(self, table):
        R = self.R
        table.gc_begin("g1", lease=10, now=100.0)
        # a writer fenced at epoch 0 may move refs while gc only marks ...
        table.compare_and_swap("r", None, R[1], message="c", fence=0)
        table.gc_freeze("g1", now=106.0)
        # ... but not once a deletion phase started: neither with the old fence nor the odd one
        for fence in (0, 1, 2):
            with pytest.raises(Fenced):
                table.compare_and_swap("r", R[1], R[2], message="m", fence=fence)
        table.compare_and_swap("u", None, R[3], message="unfenced")  # fence=None: not checked
        assert table.get("r") == R[1]
        table.gc_finish("g1", now=107.0)
        with pytest.raises(Fenced):
            table.compare_and_swap("r", R[1], R[2], message="m", fence=0)  # the fence moved
        table.compare_and_swap("r", R[1], R[2], message="m", fence=2)
        # the fence is checked before the ref: a stale fence is Fenced, not RefConflict
        table.gc_begin("g2", lease=10, now=300.0)
        table.gc_freeze("g2", now=301.0)
        with pytest.raises(Fenced):
            table.compare_and_swap("r", R[9], R[4], message="m", fence=2)
        assert [e.new for e in table.reflog("r")] == [R[1], R[2]]

    def test_a_writers_hold_defers_the_deletion_phase(self, table):
        """Liveness for fenced writers: a hold taken while the epoch is even keeps a gc
        from freezing until the hold's move releases it, or it runs out on the table's clock."""
        R = self.R
        table.gc_begin("g1", lease=10, now=100.0)
        assert table.gc_hold("w1", seconds=5, now=100.5) == 0  # marking: even, the new fence
        st = table.gc_freeze("g1", now=101.0)
        assert (st["epoch"], st["phase"]) == (0, "marking") and st["held"] == pytest.approx(4.5)
        assert table.gc_hold("w1", seconds=5, now=102.0) == 0  # renewed: until 107
        st = table.gc_freeze("g1", now=106.0)
        assert st["epoch"] == 0 and st["held"] == pytest.approx(1.0)
        # the writer's fenced move goes through and releases the hold in its transaction
        table.compare_and_swap("r", None, R[1], message="c", fence=0, hold="w1")
        st = table.gc_freeze("g1", now=106.5)
        assert (st["epoch"], st["phase"], st["held"]) == (1, "deleting", 0.0)
        assert table.gc_hold("w2", now=106.6) is None  # a deletion phase runs: no hold
        table.gc_finish("g1", now=107.0)
        # a hold that runs out no longer defers anything; two holders: the longer one counts
        table.gc_begin("g2", lease=10, now=200.0)
        assert table.gc_hold("w2", seconds=3, now=200.0) == 2
        assert table.gc_hold("w3", seconds=8, now=200.0) == 2
        assert table.gc_freeze("g2", now=202.0)["held"] == pytest.approx(6.0)
        table.gc_unhold("w3")
        table.gc_unhold("w3")  # releasing twice is harmless
        assert table.gc_freeze("g2", now=203.5)["epoch"] == 3  # w2 ran out at 203
        with pytest.raises(Fenced):
            table.compare_and_swap("r", R[1], R[2], message="m", fence=2, hold="w2")
        table.gc_finish("g2", now=204.0)
        assert "holds" not in table.gc_state()  # the freeze cleared them
        assert table.get("r") == R[1]

    def test_a_gc_deletes_in_phases_and_a_hold_taken_during_one_defers_the_next(self, table):
        """gc_thaw closes a phase and keeps the lock; a writer fenced by that phase takes
        its hold while the phase still runs (None: no fence yet), and the next freeze
        waits for it, so the gap between two phases cannot be missed by polling."""
        R = self.R
        table.gc_begin("g1", lease=10, now=100.0)
        assert table.gc_freeze("g1", now=100.5)["epoch"] == 1
        assert table.gc_hold("w1", seconds=5, now=101.0) is None  # recorded, no fence yet
        st = table.gc_thaw("g1", now=101.5)
        assert (st["epoch"], st["phase"], st["owner"]) == (2, "marking", "g1")
        st = table.gc_freeze("g1", now=102.0)
        assert (st["epoch"], st["phase"]) == (2, "marking") and st["held"] == pytest.approx(4.0)
        assert table.gc_hold("w1", seconds=5, now=102.5) == 2  # the new fence
        table.compare_and_swap("r", None, R[1], message="c", fence=2, hold="w1")
        assert table.gc_freeze("g1", now=103.0)["epoch"] == 3  # the move released the hold
        with pytest.raises(GcBusy):
            table.gc_thaw("g2", now=103.5)  # not the owner
        table.gc_thaw("g1", now=104.0)
        with pytest.raises(GcBusy):
            table.gc_thaw("g1", now=104.5)  # no phase open
        st = table.gc_finish("g1", now=105.0)
        assert (st["epoch"], st["phase"]) == (4, "idle")

    def test_prune_requests_are_queued_and_served_by_an_expiry(self, table):
        R = self.R
        table.compare_and_swap("a", None, R[1], message="c", catalog_row={"job": "a"})
        table.compare_and_swap("a", R[1], R[2], message="c", catalog_row={"job": "a"})
        tok_a = table.prune_request("a")
        tok_b = table.prune_request("b")
        assert table.prune_pending("a", tok_a) and table.prune_pending("b", tok_b)
        read = table.prune_requests()
        assert set(read) == {"a", "b"}
        tok_b2 = table.prune_request("b")  # queued again after the read: not served by it
        assert not table.prune_pending("b", tok_b)
        assert table.catalog_expire([R[1]], served=read) == [R[1]]
        assert not table.prune_pending("a", tok_a)
        assert table.prune_pending("b", tok_b2)
        assert set(table.prune_requests()) == {"b"}
        assert table.gc_state()["epoch"] == 0  # the queue is beside the gc state, not in it

    def test_gc_abort_stale_closes_a_dead_deletion_phase(self, table):
        st = table.gc_abort_stale(now=50.0)
        assert (st["epoch"], st["phase"]) == (0, "idle")  # nothing to close
        table.gc_begin("g3", lease=10, now=200.0)
        assert table.gc_abort_stale(now=300.0)["phase"] == "marking"  # marking deletes nothing
        table.gc_freeze("g3", now=301.0)
        assert table.gc_abort_stale(now=305.0)["epoch"] == 1  # still fresh: untouched
        st = table.gc_abort_stale(now=315.0)
        assert (st["epoch"], st["phase"], st["owner"]) == (2, "idle", None)
        assert table.gc_state()["epoch"] == 2
        with pytest.raises(GcBusy):
            table.gc_heartbeat("g3", now=316.0)  # the dead gc lost its lock
        table.compare_and_swap("r", None, self.R[1], message="c", fence=2)

    # -- concurrency -----------------------------------------------------------------------
    def test_racing_compare_and_swap_has_one_winner_per_round(self, table, open_table):
        n, rounds = 6, 15
        handles = self._handles(table, open_table, n)
        table.compare_and_swap("race", None, self.R[0], message="start")
        wins = []
        for r in range(rounds):
            cur = table.get("race")
            news = [os.urandom(32) for _ in range(n)]
            with _fast_switching():
                res = _run_threads(n, lambda i: handles[i].compare_and_swap(
                    "race", cur, news[i], message=f"{r}:{i}"))
            winners = [i for i, x in enumerate(res) if x is None]
            assert len(winners) == 1, res
            losers = [x for x in res if x is not None]
            assert all(isinstance(x, RefConflict) for x in losers), losers
            assert {x.actual for x in losers} <= {news[winners[0]].hex()}
            assert table.get("race") == news[winners[0]]
            wins.append(news[winners[0]])
        log = table.reflog("race")
        assert [e.new for e in log] == [self.R[0]] + wins
        assert all(b.old == a.new for a, b in zip(log, log[1:]))

    def test_racing_exclusive_operations_have_one_winner(self, table, open_table):
        """tag_create, catalog_put_if_absent and gc_begin are exclusive under threads too."""
        n = 6
        handles = self._handles(table, open_table, n)
        roots = [os.urandom(32) for _ in range(n)]

        def tag(i):
            handles[i].tag_create("v1", roots[i])

        with _fast_switching():
            res = _run_threads(n, tag)
            assert sum(x is None for x in res) == 1, res
            assert all(isinstance(x, RefConflict) for x in res if x is not None)
            assert table.tag_get("v1") == roots[res.index(None)]

            res = _run_threads(n, lambda i: handles[i].catalog_put_if_absent(self.R[1], {"step": i}))
            assert res.count(True) == 1 and res.count(False) == n - 1, res
            assert table.catalog_get(self.R[1]) == {"step": res.index(True)}

            res = _run_threads(n, lambda i: handles[i].gc_begin(f"g{i}", lease=10, now=100.0))
            assert sum(isinstance(x, dict) for x in res) == 1, res
            assert all(isinstance(x, GcBusy) for x in res if not isinstance(x, dict))
            assert table.gc_state()["owner"] == f"g{[isinstance(x, dict) for x in res].index(True)}"

    # -- persistence -----------------------------------------------------------------------
    def test_state_persists_across_reopen(self, table, open_table):
        if not self.persistent:
            pytest.skip(f"{type(table).__name__} keeps nothing once closed")
        R = self.R
        table.compare_and_swap("r", None, R[1], message="c", catalog_row={"step": 1})
        table.compare_and_swap("r", R[1], R[2], message="m", catalog_row={"step": 2})
        table.tag_create("t", R[1])
        table.pin(R[2])
        table.retention_set("job", {"keep_last": 2})
        table.gc_begin("g", lease=10, now=10.0)
        table.gc_freeze("g", now=11.0)
        table.close()
        again = open_table()
        assert again.get("r") == R[2]
        assert [(e.old, e.new, e.message) for e in again.reflog("r")] == [(None, R[1], "c"), (R[1], R[2], "m")]
        assert dict(again.catalog_iter()) == {R[1]: {"step": 1}, R[2]: {"step": 2}}
        assert again.tags() == [("t", R[1])] and again.pins() == {R[2]}
        assert again.retention_all() == {"job": {"keep_last": 2}}
        st = again.gc_state()
        assert (st["epoch"], st["phase"], st["owner"]) == (1, "deleting", "g")
        again.compare_and_swap("r", R[2], R[3], message="after")  # the reflog sequence goes on
        assert [e.message for e in again.reflog("r")] == ["c", "m", "after"]
