"""A local-filesystem BlockStore: atomic, durable writes with plain os calls.

fsspec's LocalFileSystem cannot fsync, so local stores use os directly (as
zarr's LocalStore does); every other URL goes through FsspecBlockStore.

Only regular files are read: a folder, a FIFO or a device found under an
object's name (a symlink to /dev/zero included) is an OSError naming it, never
opened for a read that would block forever or never end (see _open_regular).
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import uuid
from typing import BinaryIO, Iterator, Sequence

from ..errors import no_space, storage_error
from ..localfile import not_regular, open_regular
from .base import BlockStore, Deadline, ObjectInfo, check_deadline

__all__ = ["LocalBlockStore"]

TMP_DIR = BlockStore.TEMP_PREFIX.rstrip("/")


def _write_all(fd: int, bufs: Sequence) -> None:
    for b in bufs:
        mv = memoryview(b).cast("B")
        while mv:
            n = os.write(fd, mv)
            mv = mv[n:]


_NOTE = "never read or replaced as a stored object"


def _not_regular(path: str, mode: int) -> OSError:
    return not_regular(path, mode, _NOTE)


def _open_regular(path: str) -> int:
    """A descriptor of the regular file at `path` (localfile.open_regular: a FIFO is
    never waited on, a device never read)."""
    return open_regular(path, _NOTE)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalBlockStore(BlockStore):
    local = True
    # Every call is a synchronous system call: once it returns, its effect is done.
    request_timeout = 0.1

    def __init__(self, root: str, *, fsync: bool = True):
        self.root = os.path.abspath(root)
        self.url = "file://" + self.root
        self._fsync = fsync
        self._dirs: set[str] = set()
        self._dirty: set[str] = set()
        self._lock = threading.Lock()

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key)

    def _ensure_dir(self, d: str) -> None:
        if d in self._dirs:
            return
        # Record every directory we create so sync() makes its entry durable too.
        missing = []
        p = d
        while not os.path.isdir(p):
            missing.append(p)
            p = os.path.dirname(p)
        for m in reversed(missing):
            try:
                os.mkdir(m)
            except FileExistsError:
                pass
            with self._lock:
                self._dirty.add(os.path.dirname(m))
        with self._lock:
            self._dirs.add(d)

    # docstring inherited
    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        with open(_open_regular(self._path(key)), "rb") as f:
            return f.read() if max_bytes is None else f.read(max_bytes)

    def open_read(self, key: str, max_bytes: int | None = None) -> BinaryIO:
        return open(_open_regular(self._path(key)), "rb", buffering=0)

    def put_if_absent(self, key: str, bufs: Sequence) -> bool:
        try:
            return self._put_if_absent(key, bufs)
        except OSError as e:
            # Name the object and the space it needed: a bare "[Errno 28]" says neither
            # which disk to clean nor by how much.
            n = sum(memoryview(b).nbytes for b in bufs)
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise no_space(f"writing {key}", self.root, needed=f"{n} bytes",
                               cause=os.strerror(e.errno)) from e
            raise storage_error(e, f"writing {key} ({n} bytes) to {self.url}") from e

    def _put_if_absent(self, key: str, bufs: Sequence) -> bool:
        path = self._path(key)
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None:
            if not stat.S_ISREG(mode):  # a FIFO or folder in its place: "already stored" would be a lie
                raise _not_regular(path, mode)
            return False
        d = os.path.dirname(path)
        self._ensure_dir(d)
        tmpdir = os.path.join(self.root, TMP_DIR)
        self._ensure_dir(tmpdir)
        tmp = os.path.join(tmpdir, f"{uuid.uuid4().hex}.partial")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(fd, bufs)
            if self._fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(tmp)
            raise
        os.close(fd)
        try:
            # link() never replaces: a racing writer of the same content wins cleanly,
            # and readers only ever see a complete file under the final name.
            os.link(tmp, path)
            created = True
        except FileExistsError:
            created = False
        finally:
            os.unlink(tmp)
        if created:
            with self._lock:
                self._dirty.add(d)
        return created

    def exists(self, key: str) -> bool:
        return os.path.exists(self._path(key))

    def size_of(self, key: str) -> int | None:
        try:
            st = os.stat(self._path(key))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None  # a folder is no object

    def move(self, key: str, new_key: str, *, deadline: Deadline | None = None) -> bool:
        src, dst = self._path(key), self._path(new_key)
        d = os.path.dirname(dst)
        self._ensure_dir(d)
        check_deadline(deadline)
        try:
            os.rename(src, dst)  # atomic: the object is under one of the two names, never neither
        except FileNotFoundError:
            if os.path.exists(src):  # not the source: the destination folder went (rmtree'd meanwhile)
                raise
            return False
        with self._lock:
            self._dirty.update((d, os.path.dirname(src)))
        return True

    def delete(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass
        with self._lock:
            self._dirty.add(os.path.dirname(self._path(key)))

    def clock_now(self) -> float:
        # The filesystem's clock: the mtime of a file created now (docstring in base).
        tmpdir = os.path.join(self.root, TMP_DIR)
        self._ensure_dir(tmpdir)
        probe = os.path.join(tmpdir, f"clock-{uuid.uuid4().hex}")
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            return os.fstat(fd).st_mtime
        finally:
            os.close(fd)
            os.unlink(probe)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self._path(prefix.rstrip("/"))
        if not os.path.isdir(base):
            return
        for dirpath, _dirnames, filenames in os.walk(base):
            rel = os.path.relpath(dirpath, self.root)
            for fn in filenames:
                try:
                    st = os.stat(os.path.join(dirpath, fn))
                except FileNotFoundError:
                    continue
                key = fn if rel == "." else f"{rel}/{fn}".replace(os.sep, "/")
                yield ObjectInfo(key, st.st_size, st.st_mtime)

    def sync(self) -> None:
        if not self._fsync:
            return
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        # Deepest first, so a new directory's own entries are durable before its name.
        for d in sorted(dirty, key=len, reverse=True):
            try:
                _fsync_dir(d)
            except FileNotFoundError:
                pass
