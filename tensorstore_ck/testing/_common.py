"""Helpers the contract suites share: threads started together, a switch interval short
enough to show a check-then-act race, keys shaped like the store's."""

from __future__ import annotations

import contextlib
import sys
import threading

__all__ = ["fast_switching", "run_threads", "key"]


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

