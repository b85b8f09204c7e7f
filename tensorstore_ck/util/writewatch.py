"""Which pages of this process were written since they were last looked at, as the kernel
tells it: userfaultfd write-protection in its asynchronous mode, read back (and armed
again) by the PAGEMAP_SCAN ioctl of /proc/self/pagemap (Linux 6.7 and later).

A watched page is write-protected; the first write to it, by any thread of this process
and through any path (an in-place op, `.data`, a numpy or DLPack view, a syscall such as
recv() writing into it, another process through /proc/PID/mem), faults once, and the
kernel itself lifts the protection and marks the page written: no handler runs in user
space and no write can be missed. `written(a, b)` reports the written pages of a range
and protects them again in the same walk, so a write that lands after the walk is seen by
the next one.

What it cannot see, and so what callers must not watch: memory written by a device
through DMA (pinned host memory, memory registered with a NIC), memory shared with
another process (its writes use that process's page tables), and file mappings (the
file may change underneath). Only anonymous private memory is watched (`watch` refuses
the rest), and the write path leaves pinned and shared tensors alone.

Where the kernel, its configuration or a sandbox (seccomp filters often refuse
userfaultfd) does not offer this, open() raises OSError and nothing is watched.
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import os
import platform
import struct

__all__ = ["WriteWatch", "PAGE"]

PAGE = os.sysconf("SC_PAGE_SIZE")

_NR_USERFAULTFD = {"x86_64": 323, "aarch64": 282}.get(platform.machine())


def _iowr(kind: int, nr: int, size: int) -> int:
    return (3 << 30) | (size << 16) | (kind << 8) | nr


_UFFD_API = 0xAA
_UFFDIO_API = _iowr(0xAA, 0x3F, 24)
_UFFDIO_REGISTER = _iowr(0xAA, 0x00, 32)
_UFFDIO_REGISTER_MODE_WP = 1 << 1
_UFFD_FEATURE_WP_UNPOPULATED = 1 << 13  # a page never touched is protected too
_UFFD_FEATURE_WP_ASYNC = 1 << 15        # the kernel resolves the fault itself
_PAGEMAP_SCAN = _iowr(ord("f"), 16, 96)
_PM_SCAN_WP_MATCHING = 1 << 0           # protect again the pages reported
_PM_SCAN_CHECK_WPASYNC = 1 << 1         # refuse (EPERM) a range not watched
_PAGE_IS_WRITTEN = 1 << 1
_VEC = 64                               # regions per ioctl; a longer answer is read in turns


class WriteWatch:
    """A userfaultfd of this process in asynchronous write-protect mode and the pagemap it
    is read through. Not thread-safe: its owner serialises the calls."""

    def __init__(self, uffd: int, pagemap: int):
        self._uffd, self._pagemap = uffd, pagemap
        self._vec = (ctypes.c_uint64 * (3 * _VEC))()
        self._starts: list[int] = []  # the ranges registered, sorted, disjoint
        self._ends: list[int] = []

    @classmethod
    def open(cls) -> "WriteWatch":
        """OSError where the kernel or the sandbox does not offer it."""
        if _NR_USERFAULTFD is None:
            raise OSError(f"userfaultfd: no syscall number known for {platform.machine()}")
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        fd = libc.syscall(_NR_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK)
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"userfaultfd: {os.strerror(e)}")
        pagemap = -1
        try:
            want = _UFFD_FEATURE_WP_ASYNC | _UFFD_FEATURE_WP_UNPOPULATED
            api = bytearray(struct.pack("QQQ", _UFFD_API, want, 0))
            fcntl.ioctl(fd, _UFFDIO_API, api, True)
            if struct.unpack("QQQ", api)[1] & want != want:
                raise OSError("userfaultfd: asynchronous write-protection not offered by this kernel")
            pagemap = os.open("/proc/self/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            watch = cls(fd, pagemap)
            watch._probe()
            return watch
        except BaseException:
            os.close(fd)
            if pagemap >= 0:
                os.close(pagemap)
            raise

    def _probe(self) -> None:
        """One page watched, written and read back: the kernel must say so (PAGEMAP_SCAN
        arrived in 6.7; a kernel may offer the userfaultfd and not the scan)."""
        import mmap
        m = mmap.mmap(-1, PAGE)
        a = ctypes.addressof(ctypes.c_char.from_buffer(m))
        try:
            if not self.watch(a, a + PAGE):
                raise OSError("userfaultfd: an anonymous page could not be watched")
            self.written(a, a + PAGE)
            if self.written(a, a + PAGE):
                raise OSError("pagemap: a watched page reads written before any write")
            m[0] = 1
            if self.written(a, a + PAGE) != [(a, a + PAGE)]:
                raise OSError("pagemap: a write to a watched page was not reported")
        finally:
            self.forget(a, a + PAGE)
            m.close()

    def close(self) -> None:
        for fd in (self._uffd, self._pagemap):
            try:
                os.close(fd)
            except OSError:
                pass
        self._uffd = self._pagemap = -1

    @staticmethod
    def pages(start: int, end: int) -> tuple[int, int]:
        """[start, end) widened to whole pages."""
        return start - start % PAGE, -(-end // PAGE) * PAGE

    def watched(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and self._ends[i] >= end

    def watch(self, start: int, end: int) -> bool:
        """Watch the pages of [start, end) (anonymous private memory only: the caller
        checks the mapping); False where the kernel refuses them. Every page counts as
        written until the first written() over it."""
        start, end = self.pages(start, end)
        if self.watched(start, end):
            return True
        reg = bytearray(struct.pack("QQQQ", start, end - start, _UFFDIO_REGISTER_MODE_WP, 0))
        try:
            fcntl.ioctl(self._uffd, _UFFDIO_REGISTER, reg, True)
        except OSError:
            return False
        self._add(start, end)
        return True

    def _add(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        # merge with the neighbours it touches or overlaps
        while i > 0 and self._ends[i - 1] >= start:
            i -= 1
            start = min(start, self._starts[i])
            end = max(end, self._ends[i])
            del self._starts[i], self._ends[i]
        while i < len(self._starts) and self._starts[i] <= end:
            end = max(end, self._ends[i])
            del self._starts[i], self._ends[i]
        self._starts.insert(i, start)
        self._ends.insert(i, end)

    def forget(self, start: int, end: int) -> None:
        """Memory unmapped since it was watched (freed, mapped anew): every range of the
        bookkeeping that touches [start, end) is forgotten, so watch() registers it again."""
        start, end = self.pages(start, end)
        i = bisect.bisect_right(self._starts, start) - 1
        i = max(i, 0)
        while i < len(self._starts) and self._starts[i] < end:
            if self._ends[i] > start:
                del self._starts[i], self._ends[i]
            else:
                i += 1

    def written(self, start: int, end: int) -> list[tuple[int, int]] | None:
        """The written page ranges of [start, end) since the last call over them (all of
        them the first time), each protected again as it is reported; None when the
        range is no longer watched (its mapping was replaced: unmapped, remapped), which
        the caller takes as written."""
        start, end = self.pages(start, end)
        out: list[tuple[int, int]] = []
        vec = self._vec
        at = start
        while at < end:
            arg = bytearray(struct.pack("12Q", 96, _PM_SCAN_WP_MATCHING | _PM_SCAN_CHECK_WPASYNC, at, end, 0,
                                        ctypes.addressof(vec), _VEC, 0, 0, _PAGE_IS_WRITTEN, 0, _PAGE_IS_WRITTEN))
            try:
                n = fcntl.ioctl(self._pagemap, _PAGEMAP_SCAN, arg, True)
            except OSError:
                return None  # EPERM: part of it is not watched (any more)
            for k in range(n):
                a, b = vec[3 * k], vec[3 * k + 1]
                if out and out[-1][1] == a:
                    out[-1] = (out[-1][0], b)
                else:
                    out.append((a, b))
            walk_end = struct.unpack_from("Q", arg, 32)[0]
            if walk_end <= at:  # pragma: no cover - the kernel made no progress
                return None
            at = walk_end
        return out
