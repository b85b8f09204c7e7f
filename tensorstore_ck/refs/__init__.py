"""Ref tables: ref name -> root, with reflog, catalog, tags and pins.

Its modules:

    base.py           the interface and its logic over a small transactional key-value layer
    history.py        the reflog and REF@STEP's index
    gcstate.py        the gc lock, lease, phases, holds, fences and the prune queue
    tiertable.py      a local tier's own table (TierTable): upload queue, marks, parts
    txn.py            the transactions its parts run in; the tables; the host clock
    lmdb.py           the embedded table (LMDB, beside local data)
    memory.py         the in-memory twin (memory:// stores, tests)
    postgres.py       PostgreSQL, for many hosts sharing one store
"""

from .base import RefTable, ReflogEntry
from .lmdb import LmdbRefTable
from .memory import MemoryRefTable

__all__ = ["RefTable", "ReflogEntry", "LmdbRefTable", "MemoryRefTable"]
