"""The embedded ref table: one LMDB environment beside the local data.

LMDB gives serialised write transactions across every process of the host
(a robust mutex in lock.mdb) and durable commits (fsync on commit), which is
what compare-and-swap and the reflog need. The map grows instead of failing:
on MapFullError the transaction is re-run after doubling the map size; a
process that finds another one grew the map adopts the new size.

The table is an index over storage: a corrupt file is a FormatError that says
how to rebuild it (`tsck recover`); any other LMDB failure is a StorageError
naming it. One process opens one environment per directory, which every table
on it shares (LMDB forbids a second). Across os.fork(): a fork waits for the
transaction in flight (every transaction on an environment runs under its one
lock, taken before the fork), so the child can close its copy of the
environment (closing waits for a write transaction another thread owns: with
one in flight it would wait forever) and open its own, as LMDB requires.
"""

from __future__ import annotations

import mmap
import os
import stat
import threading
import weakref

import lmdb

from ..errors import FormatError, NotAStore, StorageError, StoreClosed, TsckError, free_bytes, no_space
from .base import RefTable, track_for_fork
from .txn import TABLES, Txn

__all__ = ["LmdbRefTable"]

INITIAL_MAP_SIZE = 64 * 1024 * 1024
MAX_MAP_SIZE = 1 << 40

# What a damaged file makes LMDB raise (a bad meta page, a page of the wrong type, a
# page number past the end, another format version).
_CORRUPT = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
            lmdb.PanicError)


# Below this much free space, a failed write is put down to a full filesystem: LMDB
# reports a short write (ENOSPC after part of a page) as EIO.
_NEARLY_FULL = 1 << 20


def _full(path: str, e: lmdb.Error) -> bool:
    if isinstance(e, lmdb.DiskError):  # ENOSPC
        return True
    if isinstance(e, (lmdb.MapFullError, lmdb.MapResizedError)) or "Input/output error" not in str(e):
        return False
    free = free_bytes(path)
    return free is not None and free < _NEARLY_FULL


def _error(path: str, e: lmdb.Error, what: str) -> TsckError:
    if _full(path, e):
        # Copy-on-write: a write transaction writes a new copy of every page it changes
        # (the B-tree path from each changed leaf to the root), in free pages of the file
        # or else at its end; the rolled-back transaction changed nothing.
        return no_space(f"{what} the ref table there", path, needed=f"a few free pages of {mmap.PAGESIZE} "
                        f"bytes beyond data.mdb's {_file_size(path)}", cause=f"{type(e).__name__}: {e}",
                        outcome="the transaction was rolled back, the table is as it was")
    if isinstance(e, _CORRUPT):
        store = os.path.dirname(path) if os.path.basename(path.rstrip("/")) == "refs.lmdb" else "STORE"
        return FormatError(f"the ref table at {path} is corrupt ({type(e).__name__}: {e}); it is an index "
                           f"over storage and can be rebuilt: move it aside (mv {path} {path}.corrupt), then run "
                           f"`tsck recover {store}`" + ("" if store != "STORE" else f" --refs {path}"))
    return StorageError(f"{what} the ref table at {path}: {type(e).__name__}: {e}")


def _file_size(path: str) -> int | None:
    try:
        return os.path.getsize(os.path.join(path, "data.mdb"))
    except OSError:
        return None


class _LmdbTxn(Txn):
    def __init__(self, txn, dbs):
        self.txn = txn
        self.dbs = dbs

    def get(self, table, key):
        db = self.dbs[table]
        if db is None:  # read-only, and the file lacks this table
            return None
        v = self.txn.get(key, db=db)
        return None if v is None else bytes(v)

    def put(self, table, key, value):
        self.txn.put(key, value, db=self.dbs[table])

    def delete(self, table, key):
        self.txn.delete(key, db=self.dbs[table])

    def items(self, table, prefix=b""):
        if self.dbs[table] is None:
            return
        cur = self.txn.cursor(db=self.dbs[table])
        if not cur.set_range(prefix):
            return
        for k, v in cur:
            if not k.startswith(prefix):
                break
            yield bytes(k), bytes(v)


# By (st_dev, st_ino) of data.mdb, which an open environment holds: never reused while it
# is listed. Weak: an environment whose tables were dropped unclosed goes with them.
_ENVS: "weakref.WeakValueDictionary[tuple[int, int], _Env]" = weakref.WeakValueDictionary()
_ENVS_LOCK = threading.Lock()


def _new_envs_lock() -> None:
    global _ENVS_LOCK
    _ENVS_LOCK = threading.Lock()  # another thread may have held it at the fork: gone in the child


os.register_at_fork(after_in_child=_new_envs_lock)


class _Env:
    """The process's one LMDB environment on a directory, shared by every table opened
    on it: LMDB forbids opening one environment twice in a process (its lock-file locks
    are per process) and py-lmdb refuses to, so a second Store on one local store in one
    process uses the first one's. Every transaction of the process runs under its lock."""

    def __init__(self, path: str, read_only: bool):
        self.path, self.read_only = path, read_only
        self.locked = True  # False: opened without lock.mdb (read-only, see LmdbRefTable)
        self.users = 0
        self.key: tuple[int, int] | None = None
        self.lock = threading.RLock()
        self.env = self._open()
        track_for_fork(self)

    def _open(self):
        for name in ("data.mdb", "lock.mdb"):  # LMDB would wait forever reading a FIFO, and mmap no folder
            try:
                mode = os.stat(os.path.join(self.path, name)).st_mode
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(mode):
                what = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device"
                raise StorageError(f"cannot open the ref table at {self.path}: its {name} is {what}, not a regular "
                                   "file (not opened)")
        if self.read_only:
            return self._open_read_only()
        try:
            env = lmdb.open(self.path, map_size=INITIAL_MAP_SIZE, max_dbs=len(TABLES) + 2,
                            subdir=True, sync=True, metasync=True, lock=True, max_readers=256)
        except _CORRUPT as e:
            raise _error(self.path, e, "cannot open") from None
        except lmdb.Error as e:
            if _full(self.path, e):
                raise _error(self.path, e, "opening") from None
            hint = ("; its filesystem or files are read-only: open it with read_only=True (tsck --read-only)"
                    if "Read-only file system" in str(e) or "Permission denied" in str(e) else "")
            raise NotAStore(f"cannot open the ref table at {self.path}: {e}{hint}") from None
        for _ in range(64):
            try:
                self.dbs = {t: env.open_db(t.encode()) for t in TABLES}
                return env
            except lmdb.MapResizedError:
                # Another process grew the map between our open and this first
                # transaction (open_db runs one): adopt its size and go on.
                env.set_mapsize(0)
            except lmdb.Error as e:
                env.close()
                raise _error(self.path, e, "cannot open") from None
        env.close()
        raise StorageError(f"cannot open the ref table at {self.path}: its map kept being resized by other processes")

    def _open_read_only(self):
        env = None
        for lock in (True, False):
            try:
                env = lmdb.open(self.path, readonly=True, lock=lock, create=False, max_dbs=len(TABLES) + 2,
                                subdir=True, max_readers=256)
                self.locked = lock
                break
            except _CORRUPT as e:
                raise _error(self.path, e, "cannot open") from None
            except lmdb.Error as e:
                if not lock:
                    raise NotAStore(f"cannot open the ref table at {self.path} read-only: {e}") from None
        try:
            # No txn= here: py-lmdb then runs a read transaction of its own and commits it,
            # which is what makes the handles usable by later transactions (one of ours
            # is only reset at its end, and the handles would be invalid: EINVAL).
            self.dbs = {}
            for t in TABLES:
                try:
                    self.dbs[t] = env.open_db(t.encode(), create=False)
                except lmdb.NotFoundError:  # a table newer than this file: empty here
                    self.dbs[t] = None
            return env
        except lmdb.Error as e:
            env.close()
            raise _error(self.path, e, "cannot open") from None

    def current(self):
        """The environment, reopened where a fork closed the parent's copy (under self.lock)."""
        if self.env is None:
            self.env = self._open()
        return self.env

    def _before_fork(self) -> None:
        self.lock.acquire()  # no transaction is half-done at the fork

    def _after_fork_parent(self) -> None:
        self.lock.release()

    def _after_fork(self) -> None:
        # This thread held the lock across the fork, so no transaction is open: closing
        # our copy of the parent's environment touches only this process (its locks are
        # the parent's, fcntl locks are not inherited). The next call opens our own.
        if self.env is not None:
            self.env.close()
        self.env = None
        self.lock = threading.RLock()


def _data_key(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(os.path.join(path, "data.mdb"))
    except FileNotFoundError:  # a new table, or another's file gone (an env open on it holds its own)
        return None
    return st.st_dev, st.st_ino


def _acquire(path: str, read_only: bool) -> _Env:
    with _ENVS_LOCK:  # opens of this process one at a time: two creating one table make one
        key = _data_key(path)
        env = _ENVS.get(key) if key is not None else None
        if env is not None and env.read_only and not read_only:
            raise StorageError(f"cannot open the ref table at {path} for writing: this process has it open "
                               "read-only (a Store opened with read_only=True); close that one first")
        if env is None:
            env = _Env(path, read_only)
            env.key = _data_key(path)
            if env.key is not None:
                _ENVS[env.key] = env
        env.users += 1
        return env


def _release(env: _Env) -> None:
    with _ENVS_LOCK:
        env.users -= 1
        if env.users:
            return
        if _ENVS.get(env.key) is env:
            del _ENVS[env.key]
        with env.lock:
            if env.env is not None:
                env.env.close()
                env.env = None


class LmdbRefTable(RefTable):
    """read_only: open the environment read-only (MDB_RDONLY): no write transaction is
    begun, nothing is created. The reader slot in lock.mdb is still taken when the lock
    file can be opened (so a writer elsewhere does not reuse the pages being read); on
    a read-only filesystem LMDB goes on without it, and where lock.mdb cannot be opened
    for another reason (permissions) the table is opened with lock=False: right for a
    published, unchanging table; a writer at work meanwhile could be read torn.

    Tables opened on one directory in one process share its environment (_Env): a
    read-only table beside a writable one reads through the writable environment and
    still refuses every write itself."""

    def __init__(self, path: str, *, create: bool = True, read_only: bool = False):
        self.path = path
        self.read_only = read_only
        if (not create or read_only) and not os.path.isdir(path):
            raise NotAStore(f"no ref table at {path}")
        if read_only and not os.path.isfile(os.path.join(path, "data.mdb")):
            raise NotAStore(f"no ref table at {path} (no data.mdb in it)")
        if (not create or read_only) and _file_size(path) == 0:  # (LMDB would make it afresh: a lost table)
            raise NotAStore(f"no ref table at {path} (its data.mdb is empty: 0 bytes)")
        if not read_only:
            os.makedirs(path, exist_ok=True)
        self._closed = False
        self._env = _acquire(path, read_only)
        self.locked = self._env.locked

    @property
    def env(self):
        return self._env.env

    def _run(self, fn, write: bool):
        shared = self._env
        with shared.lock:
            if self._closed:
                raise StoreClosed(f"the ref table at {self.path} is closed")
            if write:
                self._refuse_write(self.path)
            env = shared.current()
            for _ in range(64):
                try:
                    with env.begin(write=write) as txn:
                        out = fn(_LmdbTxn(txn, shared.dbs))
                        if not write and hasattr(out, "__next__"):
                            out = list(out)
                        return out
                except lmdb.MapFullError:
                    size = env.info()["map_size"]
                    env.set_mapsize(min(MAX_MAP_SIZE, size * 2))
                except lmdb.MapResizedError:
                    env.set_mapsize(0)  # adopt the size another process chose
                except lmdb.Error as e:
                    raise _error(self.path, e, "reading" if not write else "writing") from None
            raise StorageError(f"the ref table at {self.path} could not grow past {MAX_MAP_SIZE} bytes")

    def _read(self, fn):
        return self._run(fn, False)

    def _write(self, fn):
        return self._run(fn, True)

    def close(self) -> None:
        with self._env.lock:
            if self._closed:
                return
            self._closed = True
        _release(self._env)
