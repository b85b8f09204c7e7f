"""Helpers the contract suites share: threads started together, a switch interval short
enough to show a check-then-act race, keys shaped like the store's, and the fixtures of the
suites over a ref table (TableSuite)."""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import ClassVar

import pytest

__all__ = ["fast_switching", "run_threads", "key", "TableSuite"]


@contextlib.contextmanager
def fast_switching():
    """Switch threads every microsecond, so a check-then-act race in a backend shows up
    within a few rounds instead of once in a thousand runs."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def run_threads(n: int, fn) -> list:
    """fn(i) on n threads started together; their results (or exceptions) in thread order."""
    out: list = [None] * n
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait()
        try:
            out[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - reported to the caller as a value
            out[i] = e

    ts = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return out


def key(i: int, kind: str = "blocks") -> str:
    """A key shaped like the ones the store writes: blocks/ab/<64 hex>."""
    h = f"{i:064x}"
    return f"{kind}/{h[-2:]}/{h}"



class TableSuite:
    """What a suite over a ref table asks of its subclass: the fixture `open_table`, a
    callable that opens a new handle on this test's table (an empty one, of its own: a
    fresh path or namespace per test) and closes every handle it opened afterwards. Class
    flags:

    persistent          the table outlives its handle: close and reopen keeps everything
    independent_handles several handles may be open at once (one per racing thread);
                        otherwise racing threads share one handle, as a Store's do
    """

    persistent: ClassVar[bool] = False
    independent_handles: ClassVar[bool] = False

    R = [bytes([i]) * 32 for i in range(16)]

    @pytest.fixture
    def open_table(self):
        raise NotImplementedError(f"{type(self).__name__} provides no open_table fixture")

    @pytest.fixture
    def table(self, open_table):
        return open_table()
