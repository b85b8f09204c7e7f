"""The transaction protocol a ref table backend provides, and the clocks read in it.

RefTable's logic (refs/base.py and its parts, refs/history.py, refs/gcstate.py) and a
tier's TierTable (refs/tiertable.py) are written once over this: run fn(txn) in one read or one write transaction, where a
Txn offers get / put / delete / items over the sub-tables in TABLES, and the table's
two clocks (the lease clock gc's lock is judged on, the calendar clock commit times
are stamped with).
"""

from __future__ import annotations

import socket
import time
from abc import ABC, abstractmethod
from typing import Iterator

__all__ = ["TABLES", "Txn", "host_clock"]

TABLES = ("refs", "reflog", "catalog", "tags", "pins", "retention", "gc", "meta", "steps")


class Txn(ABC):
    @abstractmethod
    def get(self, table: str, key: bytes) -> bytes | None: ...
    @abstractmethod
    def put(self, table: str, key: bytes, value: bytes) -> None: ...
    @abstractmethod
    def delete(self, table: str, key: bytes) -> None: ...
    @abstractmethod
    def items(self, table: str, prefix: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """Sorted by key."""

    def clock(self) -> tuple[str, float]:
        """The ref table's lease clock, read inside the transaction: (clock id, seconds).
        Two readings compare only under one id. Every party that judges a gc's lease
        reads this clock, never its own: an embedded table's is its host's boot clock
        (one per boot; never steps), PostgreSQL's is the server's."""
        return host_clock()

    def wall(self) -> float:
        """The ref table's calendar clock (seconds since the epoch): commit times, and
        so retention's ages, are read from it."""
        return time.time()


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


_BOOT = _boot_id()


def host_clock() -> tuple[str, float]:
    """This host's monotonic clock across processes: CLOCK_BOOTTIME, named by the boot
    (a lease from an earlier boot is over, whatever its numbers say); elsewhere the wall
    clock, named by the host."""
    if _BOOT is not None and hasattr(time, "CLOCK_BOOTTIME"):
        return "boot:" + _BOOT, time.clock_gettime(time.CLOCK_BOOTTIME)
    return "wall:" + socket.gethostname(), time.time()
