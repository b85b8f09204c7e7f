"""Reused host buffers for asynchronous snapshots.

An asynchronous put copies the state into one of these before it returns, so
the training loop waits only for that copy. Buffers are kept and reused
between snapshots: after the first snapshot the copy lands in memory that is
already mapped (a fresh allocation would pay a page fault per 4 KiB, which
here costs more than the copy itself). With CUDA present the buffers are
pinned, so device-to-host copies can run asynchronously on a side stream.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["StagingPool"]


class StagingPool:
    def __init__(self, max_buffers: int):
        self.max_buffers = max_buffers
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` (reused when one is free and big enough)."""
        with self._lock:
            # By position, never by value: list.remove compares tensors with ==, which raises
            # for two buffers of different sizes and is ambiguous for two of the same size.
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            if self._free and len(self._free) >= self.max_buffers:
                # Too small: replace the smallest.
                self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel()))
        import torch  # here: a Store that never snapshots asynchronously never needs it
        pin = torch.cuda.is_available()
        # A little headroom so a state that grows slightly does not reallocate every time.
        return torch.empty(max(1, nbytes + nbytes // 16), dtype=torch.uint8, pin_memory=pin)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if len(self._free) < self.max_buffers:
                self._free.append(buf)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
