"""BlockStoreTests: the BlockStore contract (tensorstore_ck/storage/base.py), for any
backend or wrapper. Subclass it in a test module and provide the fixture `block_store`:

    class TestMyStore(BlockStoreTests):
        @pytest.fixture
        def block_store(self, tmp_path):
            s = MyBlockStore(str(tmp_path / "bs"))
            yield s
            s.close()

        @pytest.fixture  # only for a backend the default below cannot write into
        def write_around(self, tmp_path):
            return lambda key, data: my_backend_put(tmp_path / "bs", key, data)

Every test goes through the interface only: what storage/base.py's docstrings promise is
what is asserted here. A few put objects into the backend behind the store's back (another
writer's object, a dead writer's temp file, a writer filling the same folders meanwhile):
they take them from the fixture `write_around`, whose default writes into the project's
backends (local files, fsspec filesystems, S3) under any wrapper with an `inner` store."""

from __future__ import annotations

import array
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, ClassVar

import pytest

from ..storage import BlockStore, FsspecBlockStore, LocalBlockStore
from ..storage.base import DeadlinePassed
from ._common import fast_switching, key, run_threads

__all__ = ["BlockStoreTests", "default_write_around"]


def default_write_around(store: BlockStore) -> Callable[[str, bytes], None] | None:
    """A writer of whole objects straight into the backend under `store` (through the
    `inner` stores of its wrappers), as another process would write them: no temp file,
    no lock or cache of the store's. None for a backend it does not know."""
    while isinstance(getattr(store, "inner", None), BlockStore):
        store = store.inner
    if isinstance(store, LocalBlockStore):
        root = store.root

        def put_file(key: str, data: bytes) -> None:
            path = os.path.join(root, *key.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data)
        return put_file
    if isinstance(store, FsspecBlockStore):
        fs, root, folders = store.fs, store.root, store.directories

        def put_fsspec(key: str, data: bytes) -> None:
            path = f"{root}/{key}"
            if folders:
                fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            fs.pipe_file(path, data)
        return put_fsspec
    return None


class BlockStoreTests:
    """The BlockStore contract (tensorstore_ck/storage/base.py).

    Subclasses provide the fixture `block_store`: an empty store (apart from what its
    opener writes, such as a store marker), closed by the fixture afterwards.
    RACE_ROUNDS: rounds of the put_if_absent race (and three fifths as many of the race
    with another writer's folders). A store that creates by check-then-write loses about
    one round in five; one that leans on the server's conditional PUT (S3) loses every
    round if it does not send the condition or reads its refusal wrong, so fewer rounds
    find that."""

    RACE_ROUNDS: ClassVar[int] = 40

    @pytest.fixture
    def block_store(self) -> BlockStore:
        raise NotImplementedError("a BlockStoreTests subclass provides the block_store fixture")

    @pytest.fixture
    def write_around(self, block_store) -> Callable[[str, bytes], None]:
        """write_around(key, data): store `data` whole under `key` in the backend behind
        `block_store`, not through it (another process's write). Override it for a backend
        default_write_around does not know; its tests skip until then."""
        put = default_write_around(block_store)
        if put is None:
            pytest.skip(f"{type(block_store).__name__}: give the suite a write_around fixture")
        return put

    # -- put_if_absent, get, exists -------------------------------------------------------
    def test_put_if_absent_creates_once_and_never_overwrites(self, block_store):
        k = key(1)
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
        k = key(2)
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
        k = key(3)
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
        assert block_store.put_if_absent(key(4), bufs) is True
        assert block_store.get(key(4)) == expect
        assert {o.key: o.size for o in block_store.list("blocks/")} == {key(4): len(expect)}

    def test_put_copies_the_callers_memory(self, block_store):
        """A later mutation of the caller's buffer (a staged tensor) must not rewrite a
        stored object (STYLE.md: in-memory backends copy what they are given)."""
        data = bytearray(b"original")
        block_store.put_if_absent(key(5), [memoryview(data)])
        data[:] = b"mutated!"
        assert block_store.get(key(5)) == b"original"

    def test_empty_objects(self, block_store):
        assert block_store.put_if_absent(key(6), []) is True
        assert block_store.put_if_absent(key(7), [b"", memoryview(b"")]) is True
        for k in (key(6), key(7)):
            assert block_store.exists(k)
            assert block_store.get(k) == b""
            with block_store.open_read(k) as f:
                assert f.read() == b""
        assert {o.key: o.size for o in block_store.list("blocks/")} == {key(6): 0, key(7): 0}
        assert block_store.put_if_absent(key(6), [b"x"]) is False
        assert block_store.get(key(6)) == b""

    def test_get_reads_at_most_max_bytes(self, block_store):
        """get(key, max_bytes): a prefix of at most max_bytes (how small records are read
        bounded: a caller accepting N bytes asks for N + 1); empty and missing objects too."""
        block_store.put_if_absent(key(8), [b"0123456789"])
        block_store.put_if_absent(key(9), [])
        assert block_store.get(key(8), 4) == b"0123"
        assert block_store.get(key(8), 10) == block_store.get(key(8), 11) == b"0123456789"
        assert block_store.get(key(8), None) == block_store.get(key(8)) == b"0123456789"
        assert block_store.get(key(9), 4) == b""
        with pytest.raises(FileNotFoundError):
            block_store.get(key(10), 4)

    def test_object_of_a_few_mib(self, block_store):
        data = os.urandom(3 * 1024 * 1024 + 123)
        mv = memoryview(data)
        cuts = [0, 1, 1024 * 1024, 2 * 1024 * 1024 + 7, len(data)]
        assert block_store.put_if_absent(key(8), [mv[a:b] for a, b in zip(cuts, cuts[1:])]) is True
        assert block_store.get(key(8)) == data
        got = bytearray(len(data))
        with block_store.open_read(key(8)) as f:
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

    def test_list_pages_come_in_key_order_and_resume_after_anykey(self, block_store):
        """base.py `pages`/list_page: where a store lists in pages, list() is the pages one
        after the other, in key order, and a page asked for after a key (listed or not)
        starts at the next key: what a retried page request relies on."""
        keys = sorted([key(i) for i in range(40, 52)] + ["blocks/a/x", "blocks/ab/z", "blocks/abc"])
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
        block_store.put_if_absent(key(9), [b"x"])
        block_store.put_if_absent(key(10), [b"y"])
        block_store.delete(key(9))
        block_store.delete(key(9))  # absent is not an error
        block_store.delete(key(11))  # never existed, nor its folder
        block_store.delete("nowhere/at/all")
        assert not block_store.exists(key(9))
        assert block_store.get(key(10)) == b"y"
        assert [o.key for o in block_store.list("blocks/")] == [key(10)]

    def test_delete_many_removes_exactly_the_keys_given(self, block_store):
        # 1100 keys: more than one DeleteObjects request (1000 keys each) on s3.
        keys = [key(i) for i in range(1100)]
        with ThreadPoolExecutor(16) as ex:
            assert all(ex.map(lambda k: block_store.put_if_absent(k, [b"x"]), keys))
        block_store.delete_many(keys[:1050] + [key(5000), "nowhere/x"])  # absent keys: not errors
        block_store.delete_many([])
        block_store.delete_many((keys[0],))  # gone already; any sequence of keys
        assert sorted(o.key for o in block_store.list("blocks/")) == sorted(keys[1050:])
        assert not any(block_store.exists(k) for k in keys[1040:1050])

    def test_deleted_key_can_be_created_again(self, block_store):
        """gc removes an object; a writer that re-validates re-uploads it."""
        assert block_store.put_if_absent(key(12), [b"v"]) is True
        block_store.delete(key(12))
        assert block_store.put_if_absent(key(12), [b"v"]) is True
        assert block_store.get(key(12)) == b"v"
        block_store.delete_many([key(12)])
        assert block_store.put_if_absent(key(12), [b"v"]) is True
        assert block_store.exists(key(12))

    # -- size_of, move ---------------------------------------------------------------------
    def test_size_of_present_absent_and_deleted(self, block_store):
        k = key(14)
        assert block_store.size_of(k) is None
        block_store.put_if_absent(k, [b"abc", b"defg"])
        assert block_store.size_of(k) == 7
        block_store.put_if_absent(key(15), [])
        assert block_store.size_of(key(15)) == 0
        assert block_store.size_of(k[:-1] + "f") is None  # a sibling under an existing folder
        assert block_store.size_of("blocks/") is None and block_store.size_of("nowhere/x") is None
        block_store.delete(k)
        assert block_store.size_of(k) is None

    def test_move_puts_the_bytes_under_the_new_key_only(self, block_store):
        """fsck --repair moves damaged objects aside (quarantine/...): the bytes are kept,
        the old name is free for a fresh put."""
        k, aside = key(16), "quarantine/blocks/" + key(16).rsplit("/", 1)[1] + ".x1"
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

        with fast_switching():
            results = [run_threads(n, lambda i, k=key(100 + r): put_or_read(i, k)) for r in range(rounds)]
        errors = [e for res in results for e in res if isinstance(e, BaseException)]
        assert not errors, errors
        assert [res[:-1].count(True) for res in results] == [1] * rounds
        assert torn == []
        for r in range(rounds):
            assert block_store.get(key(100 + r)) == data

    def test_concurrent_puts_of_different_keys(self, block_store):
        keys = [key(200 + i) for i in range(64)]
        with ThreadPoolExecutor(8) as ex:
            assert list(ex.map(lambda k: block_store.put_if_absent(k, [k.encode()] * 3), keys)) == [True] * 64
        block_store.sync()
        assert {o.key: o.size for o in block_store.list("blocks/")} == {k: 3 * len(k) for k in keys}

    # -- objects written around the store ---------------------------------------------------
    def test_an_object_another_writer_stored_is_read_as_found(self, block_store, write_around):
        """Another process wrote the key: this store sees it at once (no cached "absent"),
        reads it whole and in part, lists it, never overwrites it, and can delete it."""
        k = key(20)
        assert block_store.exists(k) is False and block_store.size_of(k) is None
        write_around(k, b"from elsewhere")
        assert block_store.exists(k) is True and block_store.size_of(k) == 14
        assert block_store.get(k) == b"from elsewhere" and block_store.get(k, 4) == b"from"
        with block_store.open_read(k) as f:
            assert f.read() == b"from elsewhere"
        assert block_store.put_if_absent(k, [b"mine"]) is False
        wrote = block_store.put_addressed(k, [b"from elsewhere"])  # True only if it learns at sync
        block_store.sync()
        assert block_store.take_lost([k]) == ({k} if wrote else set())
        assert block_store.get(k) == b"from elsewhere"
        assert [(o.key, o.size) for o in block_store.list("blocks/")] == [(k, 14)]
        block_store.delete(k)
        assert block_store.exists(k) is False and block_store.put_if_absent(k, [b"mine"]) is True
        assert block_store.get(k) == b"mine"

    def test_temp_files_a_dead_writer_left_are_not_objects(self, block_store, write_around):
        """A writer killed mid-write leaves a .partial, one killed before its sync a
        .pending (under TEMP_PREFIX): temp_files() shows them to gc, nothing else counts
        them as objects, and gc's delete_many removes them."""
        empty = block_store.is_empty()
        partial = f"{block_store.TEMP_PREFIX}{'a' * 32}.partial"
        pending = f"{block_store.TEMP_PREFIX}{'b' * 32}{block_store.PENDING_SUFFIX}"
        write_around(partial, b"half an obj")
        write_around(pending, b"a whole object")
        assert sorted((o.key, o.size) for o in block_store.temp_files()) == [(partial, 11), (pending, 14)]
        assert block_store.is_empty() is empty
        assert list(block_store.list("blocks/")) == []
        assert block_store.put_if_absent(key(22), [b"x"]) is True  # writes beside them
        assert sorted(o.key for o in block_store.temp_files()) == [partial, pending]
        block_store.delete_many([partial, pending])
        assert list(block_store.temp_files()) == []
        assert [o.key for o in block_store.list("blocks/")] == [key(22)]

    def test_an_addressed_object_another_writer_names_first(self, block_store, write_around):
        """put_addressed, then another writer stores the same object (a content address:
        the same bytes) before this store's sync: the sync succeeds, the object is whole,
        no temp file is left, and take_lost tells it at most once."""
        data = os.urandom(50_000)
        k = key(21)
        assert block_store.put_addressed(k, [data]) is True
        write_around(k, data)
        block_store.sync()
        assert block_store.take_lost([k]) <= {k}
        assert block_store.take_lost([k]) == set()
        assert block_store.get(k) == data and block_store.size_of(k) == len(data)
        assert [o.key for o in block_store.list("blocks/")] == [k]
        assert list(block_store.temp_files()) == []

    def test_another_writer_filling_the_same_folders_meanwhile(self, block_store, write_around):
        """Another process writes into the folders this store is writing into, at the same
        time: on a filesystem with folders each side may find a folder made by the other
        between its look and its mkdir; no write fails, every object is stored."""
        n, rounds = 16, max(4, self.RACE_ROUNDS * 3 // 5)

        def work(i, r):
            folder = f"blocks/{r:02x}/{i // 2:02x}"
            if i % 2:
                write_around(f"{folder}/theirs", b"t")
                return None
            return block_store.put_if_absent(f"{folder}/mine", [b"m"])

        with fast_switching():
            results = [run_threads(2 * n, lambda i, r=r: work(i, r)) for r in range(rounds)]
        errors = [e for res in results for e in res if isinstance(e, BaseException)]
        assert not errors, errors
        assert all(res[0::2] == [True] * n for res in results)
        block_store.sync()
        listed = {o.key for o in block_store.list("blocks/")}
        assert listed == {f"blocks/{r:02x}/{j:02x}/{who}" for r in range(rounds) for j in range(n)
                          for who in ("mine", "theirs")}

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
        block_store.put_if_absent(key(13), [b"x"])
        block_store.sync()
        block_store.close()
        block_store.close()
