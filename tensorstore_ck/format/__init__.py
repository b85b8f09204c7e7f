"""Bytes <-> objects for everything stored. No I/O happens in this package."""
