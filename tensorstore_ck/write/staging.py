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

The bound (open_store(host_memory=)): the bytes of every buffer the pool holds, lent to a
snapshot in flight or kept free for the next one, stay within `bound`. A take that would
pass it lets go of free buffers first, then waits for a lent one to come back. One buffer
larger than the bound (a single block bigger than it, waves.py) is made only once no
other buffer is held: the pool then holds that one buffer alone, at most the bound plus
one block. `held` and `peak` count what it holds (StagingUse, Store.staging).
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

__all__ = ["StagingPool", "SharedBuffer", "StagingUse", "default_host_memory", "HOST_MEMORY_SHARE"]

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


# The default bound: this share of the memory the process may use (the machine's MemTotal,
# or its cgroup's limit where lower), divided among the ranks of one node (LOCAL_WORLD_SIZE,
# which torchrun sets): the staged copies of one node's ranks together stay within a
# quarter of its memory, leaving the rest to the training processes, their data loaders
# and the page cache.
HOST_MEMORY_SHARE = 0.25


def _machine_memory() -> int | None:
    """The bytes this process may use: MemTotal, or the cgroup's limit where lower (None: unknown)."""
    limits = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    limits.append(int(line.split()[1]) * 1024)
                    break
    except (OSError, ValueError, IndexError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max", or cgroup v1's "no limit" (near 2**63)
            limits.append(int(text))
    if not limits:
        try:
            limits.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):
            return None
    return min(limits)


def default_host_memory() -> int | None:
    """open_store(host_memory=)'s default: HOST_MEMORY_SHARE of the memory this process may
    use (MemTotal, or its cgroup's limit where lower), divided by $LOCAL_WORLD_SIZE (the
    ranks on this node) -> bytes; None (no bound) where the memory cannot be read."""
    mem = _machine_memory()
    if mem is None:
        return None
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    except ValueError:
        local = 1
    return max(1, int(mem * HOST_MEMORY_SHARE) // local)


@dataclass(frozen=True)
class StagingUse:
    """What an asynchronous put's staging holds in host memory (Store.staging).
    bound: open_store(host_memory=) in bytes (None: no bound). held: the bytes of the
    staging buffers now (lent to snapshots in flight, or kept for the next). peak: the most
    held at once since the store was opened. waved: asynchronous puts staged in waves (a
    state larger than the bound); waves: the waves they took."""
    bound: int | None
    held: int
    peak: int
    waved: int
    waves: int


class StagingPool:
    def __init__(self, max_buffers: int, shared: bool = False, on_drop: Callable[[int], None] | None = None,
                 bound: int | None = None):
        self.max_buffers = max_buffers
        self.shared = shared
        self.on_drop = on_drop  # on_drop(buffer id): a shared buffer let go (the saver unmaps it)
        self.bound = bound  # bytes every buffer held together stays within (None: no bound)
        self.held = 0  # bytes of the buffers lent or free now
        self.peak = 0
        self.waved = self.waves = 0  # puts staged in waves, and their waves (waves.py)
        self._free: list[torch.Tensor] = []
        self._shared: dict[int, SharedBuffer] = {}  # data_ptr -> the shared buffer of a tensor it handed out
        self._lock = threading.Condition()

    def use(self) -> StagingUse:
        with self._lock:
            return StagingUse(self.bound, self.held, self.peak, self.waved, self.waves)

    def counted_waves(self, n: int) -> None:
        with self._lock:
            self.waved += 1
            self.waves += n

    def size_for(self, nbytes: int) -> int:
        """The bytes of a buffer made for `nbytes`: a little headroom so a state that grows
        slightly does not reallocate every time, within the bound (unless `nbytes` alone
        passes it)."""
        n = max(1, nbytes + nbytes // 16)
        return n if self.bound is None else max(nbytes, min(n, self.bound), 1)

    def take(self, nbytes: int, wait: bool = True) -> torch.Tensor | None:
        """A uint8 buffer of at least `nbytes` (reused when one is free and big enough).
        Within the bound: free buffers are let go, then (wait) it waits for lent ones to
        come back; None where it would have to wait and not wait. `nbytes` past the bound
        waits until the pool holds nothing else."""
        with self._lock:
            while True:
                # By position, never by value: list.remove compares tensors with ==, which raises
                # for two buffers of different sizes and is ambiguous for two of the same size.
                fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
                if fits:
                    return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                n = self.size_for(nbytes)
                over = self.bound is not None and self.held + n > self.bound and self.held > 0
                if self._free and (over or len(self._free) >= self.max_buffers):
                    # Too small (or in the way of the bound): let go of the smallest.
                    self._let_go(self._free.pop(min(range(len(self._free)), key=lambda i: self._free[i].numel())))
                    continue
                if not over:
                    break
                if not wait:
                    return None
                self._lock.wait()  # for a lent buffer to come back (give)
            self.held += n
            self.peak = max(self.peak, self.held)
        try:
            if self.shared:
                import torch
                sb = SharedBuffer(n, pin=torch.cuda.is_available())
                with self._lock:
                    self._shared[sb.address] = sb
                return sb.tensor
            import torch  # here: a Store that never snapshots asynchronously never needs it
            return torch.empty(n, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        except BaseException:
            with self._lock:
                self.held -= n
                self._lock.notify_all()
            raise

    def shared_of(self, buf: torch.Tensor) -> SharedBuffer | None:
        """The shared buffer `buf` is (None: not a shared one)."""
        with self._lock:
            return self._shared.get(buf.data_ptr())

    def give(self, buf: torch.Tensor | None) -> None:
        if buf is None:  # (a waved put's background part holds none)
            return
        with self._lock:
            if len(self._free) < self.max_buffers:
                self._free.append(buf)
            else:
                self._let_go(buf)
            self._lock.notify_all()

    def clear(self) -> None:
        with self._lock:
            for buf in self._free:
                self._let_go(buf)
            self._free.clear()

    def _let_go(self, buf: torch.Tensor) -> None:
        """Under the lock. The buffer's memory goes with the last view of it: the pool's
        reference here, the views a plan made of it (plancache: kept on the buffer itself)."""
        self.held -= buf.numel()
        self._lock.notify_all()
        sb = self._shared.pop(buf.data_ptr(), None)
        if sb is not None:
            sb.close()
            if self.on_drop is not None:
                self.on_drop(sb.id)
