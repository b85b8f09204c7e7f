"""The in-memory twin of LmdbRefTable (for memory:// stores and tests)."""

from __future__ import annotations

import threading

from .base import RefTable, track_for_fork
from .txn import TABLES, Txn

__all__ = ["MemoryRefTable"]


class _MemTxn(Txn):
    def __init__(self, data: dict):
        self.data = data

    def get(self, table, key):
        return self.data[table].get(key)

    def put(self, table, key, value):
        self.data[table][key] = bytes(value)

    def delete(self, table, key):
        self.data[table].pop(key, None)

    def items(self, table, prefix=b""):
        d = self.data[table]
        return iter([(k, d[k]) for k in sorted(d) if k.startswith(prefix)])


class MemoryRefTable(RefTable):
    def __init__(self):
        self._data = {t: {} for t in TABLES}
        self._lock = threading.RLock()
        track_for_fork(self)

    def _after_fork(self) -> None:
        self._lock = threading.RLock()  # a thread of the parent may have held it

    def _read(self, fn):
        with self._lock:
            return fn(_MemTxn(self._data))

    def _write(self, fn):
        self._refuse_write("memory://")
        # Work on a copy and swap it in only on success: a raising fn leaves no trace,
        # like an aborted LMDB transaction.
        with self._lock:
            work = {t: dict(v) for t, v in self._data.items()}
            out = fn(_MemTxn(work))
            self._data = work
            return out
