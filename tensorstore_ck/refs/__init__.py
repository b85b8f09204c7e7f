"""Ref tables: ref name -> root, with reflog, catalog, tags and pins."""

from .base import RefTable, ReflogEntry
from .lmdb import LmdbRefTable
from .memory import MemoryRefTable
from .names import validate_name, parse_target

__all__ = ["RefTable", "ReflogEntry", "LmdbRefTable", "MemoryRefTable", "validate_name", "parse_target"]
