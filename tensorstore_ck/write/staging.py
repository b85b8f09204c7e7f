"""Reused host buffers for asynchronous snapshots.

An asynchronous put copies the state into one of these before it returns, so
the training loop waits only for that copy. Buffers are kept and reused
between snapshots: after the first snapshot the copy lands in memory that is
already mapped (a fresh allocation would pay a page fault per 4 KiB, which
here costs more than the copy itself). With CUDA present the buffers are
pinned, so device-to-host copies can run asynchronously on a side stream.

shared=True (a store with a saver process, saver.py): each buffer is shared memory
(a memfd the saver maps once, by its file descriptor), so the saver reads the staged
bytes where they are. With CUDA present the mapping is page-locked in place
(cudaHostRegister), so device copies into it are asynchronous as into a pinned
buffer; where the driver refuses (a locked-memory limit, say) the buffer stays
pageable and those copies are synchronous, slower but the same bytes.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

__all__ = ["StagingPool", "SharedBuffer"]

_IDS = itertools.count(1)
log = logging.getLogger(__name__)


class SharedBuffer:
    """A staging buffer in shared memory: `tensor` over a memfd mapping; `fd` for the saver."""

    def __init__(self, nbytes: int, pin: bool = False):
        import torch
        self.id = next(_IDS)
        self.nbytes = nbytes
        self.fd = os.memfd_create("tsck-staging", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self.tensor = torch.frombuffer(mmap.mmap(self.fd, nbytes), dtype=torch.uint8)
        except BaseException:
            os.close(self.fd)
            raise
        self.address = self.tensor.data_ptr()
        self.pinned = pin and _register(self.address, nbytes)

    def offset_of(self, arr) -> int:
        """Where the numpy view `arr` starts in this buffer."""
        off = arr.__array_interface__["data"][0] - self.address
        if not 0 <= off <= self.nbytes - arr.nbytes:
            raise RuntimeError("a staged leaf lies outside its staging buffer")  # pragma: no cover - a bug
        return off

    def close(self) -> None:
        """The descriptor goes, and the page lock (no copy is in flight: the pool lets go of
        free buffers only); the mapping lives while a view of the tensor does."""
        if self.pinned:
            self.pinned = False
            import torch
            torch.cuda.cudart().cudaHostUnregister(self.address)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _register(address: int, nbytes: int) -> bool:
    """Page-lock `nbytes` at `address` for CUDA (portable: every device sees it as pinned)."""
    import torch
    err = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1))  # 1: cudaHostRegisterPortable
    if err != 0:
        log.warning("staging buffer of %d bytes not page-locked (cudaHostRegister error %d): "
                    "device copies into it are synchronous", nbytes, err)
    return err == 0


class StagingPool:
    def __init__(self, max_buffers: int, shared: bool = False, on_drop: Callable[[int], None] | None = None):
        self.max_buffers = max_buffers
        self.shared = shared
        self.on_drop = on_drop  # on_drop(buffer id): a shared buffer let go (the saver unmaps it)
        self._free: list[torch.Tensor] = []
        self._shared: dict[int, SharedBuffer] = {}  # data_ptr -> the shared buffer of a tensor it handed out
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
                self._let_go(self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel())))
        # A little headroom so a state that grows slightly does not reallocate every time.
        n = max(1, nbytes + nbytes // 16)
        if self.shared:
            import torch
            sb = SharedBuffer(n, pin=torch.cuda.is_available())
            with self._lock:
                self._shared[sb.address] = sb
            return sb.tensor
        import torch  # here: a Store that never snapshots asynchronously never needs it
        return torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())

    def shared_of(self, buf: torch.Tensor) -> SharedBuffer | None:
        """The shared buffer `buf` is (None: not a shared one)."""
        with self._lock:
            return self._shared.get(buf.data_ptr())

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if len(self._free) < self.max_buffers:
                self._free.append(buf)
            else:
                self._let_go(buf)

    def clear(self) -> None:
        with self._lock:
            for buf in self._free:
                self._let_go(buf)
            self._free.clear()

    def _let_go(self, buf: torch.Tensor) -> None:
        sb = self._shared.pop(buf.data_ptr(), None)
        if sb is not None:
            sb.close()
            if self.on_drop is not None:
                self.on_drop(sb.id)
