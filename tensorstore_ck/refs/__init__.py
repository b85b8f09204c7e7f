"""Ref tables: ref name -> root, with reflog, catalog, tags and pins."""

from .base import RefTable, ReflogEntry
from .lmdb import LmdbRefTable
from .memory import MemoryRefTable

__all__ = ["RefTable", "ReflogEntry", "LmdbRefTable", "MemoryRefTable"]
