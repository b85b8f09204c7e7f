"""The embedded ref table: one LMDB environment beside the local data.

LMDB gives serialised write transactions across every process of the host
(a robust mutex in lock.mdb) and durable commits (fsync on commit), which is
what compare-and-swap and the reflog need. The map grows instead of failing:
on MapFullError the transaction is re-run after doubling the map size; a
process that finds another one grew the map adopts the new size.

The table is an index over storage: a corrupt file is a FormatError that says
how to rebuild it (`tsck recover`); any other LMDB failure is a StorageError
naming it. Across os.fork(): a fork waits for the transaction in flight (every
transaction of the process runs under one lock, taken before the fork), so the
child can close its copy of the environment (closing waits for a write
transaction another thread owns: with one in flight it would wait forever) and
open its own, as LMDB requires.
"""

from __future__ import annotations

import os
import stat
import threading

import lmdb

from ..errors import FormatError, NotAStore, StorageError, StoreClosed, TsckError
from .base import TABLES, RefTable, Txn, track_for_fork

__all__ = ["LmdbRefTable"]

INITIAL_MAP_SIZE = 64 * 1024 * 1024
MAX_MAP_SIZE = 1 << 40

# What a damaged file makes LMDB raise (a bad meta page, a page of the wrong type, a
# page number past the end, another format version).
_CORRUPT = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.InvalidError, lmdb.VersionMismatchError,
            lmdb.PanicError)


def _error(path: str, e: lmdb.Error, what: str) -> TsckError:
    if isinstance(e, _CORRUPT):
        store = os.path.dirname(path) if os.path.basename(path.rstrip("/")) == "refs.lmdb" else "STORE"
        return FormatError(f"the ref table at {path} is corrupt ({type(e).__name__}: {e}); it is an index "
                           f"over storage and can be rebuilt: move it aside (mv {path} {path}.corrupt), then run "
                           f"`tsck recover {store}`" + ("" if store != "STORE" else f" --refs {path}"))
    return StorageError(f"{what} the ref table at {path}: {type(e).__name__}: {e}")


class _LmdbTxn(Txn):
    def __init__(self, txn, dbs):
        self.txn = txn
        self.dbs = dbs

    def get(self, table, key):
        v = self.txn.get(key, db=self.dbs[table])
        return None if v is None else bytes(v)

    def put(self, table, key, value):
        self.txn.put(key, value, db=self.dbs[table])

    def delete(self, table, key):
        self.txn.delete(key, db=self.dbs[table])

    def items(self, table, prefix=b""):
        cur = self.txn.cursor(db=self.dbs[table])
        if not cur.set_range(prefix):
            return
        for k, v in cur:
            if not k.startswith(prefix):
                break
            yield bytes(k), bytes(v)


class LmdbRefTable(RefTable):
    def __init__(self, path: str, *, create: bool = True):
        self.path = path
        if not create and not os.path.isdir(path):
            raise NotAStore(f"no ref table at {path}")
        os.makedirs(path, exist_ok=True)
        self._closed = False
        self.env = self._open()
        # One lock for every transaction of this process: set_mapsize needs no
        # transaction open in the process, and writers serialise anyway.
        self._lock = threading.RLock()
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
        try:
            env = lmdb.open(self.path, map_size=INITIAL_MAP_SIZE, max_dbs=len(TABLES) + 2,
                            subdir=True, sync=True, metasync=True, lock=True, max_readers=256)
        except _CORRUPT as e:
            raise _error(self.path, e, "cannot open") from None
        except lmdb.Error as e:
            raise NotAStore(f"cannot open the ref table at {self.path}: {e}") from None
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

    def _before_fork(self) -> None:
        self._lock.acquire()  # no transaction is half-done at the fork

    def _after_fork_parent(self) -> None:
        self._lock.release()

    def _after_fork(self) -> None:
        # This thread held the lock across the fork, so no transaction is open: closing
        # our copy of the parent's environment touches only this process (its locks are
        # the parent's, fcntl locks are not inherited). The next call opens our own.
        if self.env is not None and not self._closed:
            self.env.close()
        self.env = None
        self._lock = threading.RLock()

    def _run(self, fn, write: bool):
        with self._lock:
            if self._closed:
                raise StoreClosed(f"the ref table at {self.path} is closed")
            if self.env is None:
                self.env = self._open()
            for _ in range(64):
                try:
                    with self.env.begin(write=write) as txn:
                        out = fn(_LmdbTxn(txn, self.dbs))
                        if not write and hasattr(out, "__next__"):
                            out = list(out)
                        return out
                except lmdb.MapFullError:
                    size = self.env.info()["map_size"]
                    self.env.set_mapsize(min(MAX_MAP_SIZE, size * 2))
                except lmdb.MapResizedError:
                    self.env.set_mapsize(0)  # adopt the size another process chose
                except lmdb.Error as e:
                    raise _error(self.path, e, "reading" if not write else "writing") from None
            raise StorageError(f"the ref table at {self.path} could not grow past {MAX_MAP_SIZE} bytes")

    def _read(self, fn):
        return self._run(fn, False)

    def _write(self, fn):
        return self._run(fn, True)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.env is not None:
                self.env.close()
