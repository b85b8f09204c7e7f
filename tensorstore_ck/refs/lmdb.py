"""The embedded ref table: one LMDB environment beside the local data.

LMDB gives serialised write transactions across every process of the host
(a robust mutex in lock.mdb) and durable commits (fsync on commit), which is
what compare-and-swap and the reflog need. The map grows instead of failing:
on MapFullError the transaction is re-run after doubling the map size; a
process that finds another one grew the map adopts the new size.
"""

from __future__ import annotations

import os
import threading

import lmdb

from ..errors import NotAStore
from .base import TABLES, RefTable, Txn

__all__ = ["LmdbRefTable"]

INITIAL_MAP_SIZE = 64 * 1024 * 1024
MAX_MAP_SIZE = 1 << 40


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
        try:
            self.env = lmdb.open(path, map_size=INITIAL_MAP_SIZE, max_dbs=len(TABLES) + 2,
                                 subdir=True, sync=True, metasync=True, lock=True, max_readers=256)
        except lmdb.Error as e:
            raise NotAStore(f"cannot open the ref table at {path}: {e}") from None
        self.dbs = {t: self.env.open_db(t.encode()) for t in TABLES}
        # One lock for every transaction of this process: set_mapsize needs no
        # transaction open in the process, and writers serialise anyway.
        self._lock = threading.RLock()

    def _run(self, fn, write: bool):
        with self._lock:
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
            raise lmdb.MapFullError("ref table could not grow")

    def _read(self, fn):
        return self._run(fn, False)

    def _write(self, fn):
        return self._run(fn, True)

    def close(self) -> None:
        self.env.close()
