"""A local-filesystem BlockStore: atomic, durable writes with plain os calls.

fsspec's LocalFileSystem cannot fsync, so local stores use os directly (as
zarr's LocalStore does); every other URL goes through FsspecBlockStore.

Content-addressed objects (put_addressed: blocks, nodes, commits) are written
to temp files without an fsync each and named together at the next sync().
Blocks (1 MiB and more) are written with O_DIRECT (see DIRECT_MIN); a smaller
file's writeback is started as soon as it is written (sync_file_range, no
waiting). Either way the disk works while the workers hash the next blocks instead of
idling through N fsyncs waited on in turn; at sync() the files are fdatasync'ed
together (the journal commits them in a few transactions), then each is linked
to its name and the directories are fsynced. The order that makes a crash safe
is unchanged: bytes durable, then named, then published. Everything else (tags,
markers, probes) goes through put_if_absent: durable and named before it returns.

Only regular files are read: a folder, a FIFO or a device found under an
object's name (a symlink to /dev/zero included) is an OSError naming it, never
opened for a read that would block forever or never end (see _open_regular).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, Iterator, Sequence

from ..errors import no_space, storage_error
from ..util.localfile import in_memory, not_regular, open_regular
from .base import BlockStore, Deadline, ObjectInfo, check_deadline

__all__ = ["LocalBlockStore"]

TMP_DIR = BlockStore.TEMP_PREFIX.rstrip("/")


def _write_all(fd: int, bufs: Sequence) -> None:
    for b in bufs:
        mv = memoryview(b).cast("B")
        while mv:
            n = os.write(fd, mv)
            mv = mv[n:]


# Objects of at least DIRECT_MIN bytes are written with O_DIRECT, through a page-aligned
# bounce buffer of DIRECT_CHUNK bytes per thread: the bytes go from the writer's memory to
# the disk without taking page-cache pages. A buffered write copies each byte into a page
# the kernel has just allocated, and on a VM that returns free memory to its host (virtio
# free page reporting) that first touch of a page costs a fault in the host: the same put
# copied at 0.5 GB/s or at 1.6 GB/s depending on which free pages it was given (a 2x swing
# of the put's CPU from one repeat to the next). Nor does a snapshot evict what the
# training job keeps in the page cache. Small objects (manifest nodes, commits) stay
# buffered: padding them to the alignment would cost more than the copy.
DIRECT_MIN = 1 << 20
DIRECT_CHUNK = 4 << 20
DIRECT_ALIGN = 4096  # a multiple of every logical block size in use
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_bounce = threading.local()


def _bounce_buffer() -> mmap.mmap:
    buf = getattr(_bounce, "buf", None)
    if buf is None:
        buf = _bounce.buf = mmap.mmap(-1, DIRECT_CHUNK)  # anonymous: page-aligned
    return buf


def _write_direct(fd: int, bufs: Sequence, total: int) -> None:
    """Write `bufs` (`total` bytes) to `fd`, opened with O_DIRECT, chunk by chunk through
    the thread's bounce buffer; the last chunk is padded to the alignment with zeros and
    the file cut back to `total`."""
    buf = _bounce_buffer()
    out = memoryview(buf)
    fill = 0
    for b in bufs:
        mv = memoryview(b).cast("B")
        while mv:
            k = min(len(mv), DIRECT_CHUNK - fill)
            out[fill:fill + k] = mv[:k]
            fill += k
            mv = mv[k:]
            if fill == DIRECT_CHUNK:
                _write_aligned(fd, out, DIRECT_CHUNK)
                fill = 0
    if fill:
        pad = -fill % DIRECT_ALIGN
        out[fill:fill + pad] = bytes(pad)
        _write_aligned(fd, out, fill + pad)
        if pad:
            os.ftruncate(fd, total)


def _write_aligned(fd: int, out: memoryview, n: int) -> None:
    done = 0
    while done < n:
        k = os.write(fd, out[done:n])
        if k <= 0 or (k % DIRECT_ALIGN and done + k < n):  # a short, unaligned write: cannot go on
            raise OSError(errno.EIO, f"short direct write ({done + k} of {n} bytes)")
        done += k


_NOTE = "never read or replaced as a stored object"


def _not_regular(path: str, mode: int) -> OSError:
    return not_regular(path, mode, _NOTE)


def _open_regular(path: str) -> int:
    """A descriptor of the regular file at `path` (localfile.open_regular: a FIFO is
    never waited on, a device never read)."""
    return open_regular(path, _NOTE)


def _load_sync_file_range():
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # start writeback of the range; wait for nothing

SYNC_THREADS = 8  # fdatasyncs in flight at a sync (each mostly waits for the journal)

# A live writer names its pending objects at least this often (seconds) even inside one
# long put: gc leaves a pending file alone for its lease plus PENDING_GRACE, far longer.
FLUSH_AGE = 10.0
# At most this many lost naming races are remembered for take_lost (a collective put asks
# for its own at once; the others are forgotten past this).
LOST_KEEP = 1 << 18


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
        # key -> its temp file, written whole, not yet durable or named (put_addressed);
        # in write order, so a commit is named after what it references
        self._pending: dict[str, str] = {}
        self._pending_since: float | None = None  # monotonic time of the oldest pending write
        self._flush_lock = threading.Lock()  # one naming pass at a time (sync())
        # O_DIRECT for large pending objects, until the filesystem refuses it once; never
        # on a file system whose files are memory (tmpfs: a memory tier), where it would
        # only add a copy through the bounce buffer. None: not decided yet (first large put).
        self._direct: bool | None = None if _O_DIRECT and fsync else False
        # Keys put_addressed said it wrote whose naming another writer won (take_lost)
        self._lost: set[str] = set()

    def _after_fork(self) -> None:
        # Threads of the parent may have held them. The pending files stay this child's
        # to name too: naming one twice is harmless (content-addressed, link never replaces).
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()

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

    def _pending_path(self, key: str) -> str | None:
        if not self._pending:  # the common case, without the lock
            return None
        with self._lock:
            return self._pending.get(key)

    def _open_object(self, key: str) -> int:
        # This object's own pending writes are readable before they are named (the named
        # one is the same bytes: the key is their hash); a sync may name it meanwhile.
        p = self._pending_path(key)
        if p is not None:
            try:
                return _open_regular(p)
            except FileNotFoundError:
                pass
        return _open_regular(self._path(key))

    # docstring inherited
    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        with open(self._open_object(key), "rb") as f:
            return f.read() if max_bytes is None else f.read(max_bytes)

    def open_read(self, key: str, max_bytes: int | None = None) -> BinaryIO:
        return open(self._open_object(key), "rb", buffering=0)

    def _write_error(self, e: OSError, key: str, bufs: Sequence) -> Exception:
        # Name the object and the space it needed: a bare "[Errno 28]" says neither
        # which disk to clean nor by how much.
        n = sum(memoryview(b).nbytes for b in bufs)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return no_space(f"writing {key}", self.root, needed=f"{n} bytes", cause=os.strerror(e.errno))
        return storage_error(e, f"writing {key} ({n} bytes) to {self.url}")

    def put_if_absent(self, key: str, bufs: Sequence) -> bool:
        try:
            return self._put_if_absent(key, bufs)
        except OSError as e:
            raise self._write_error(e, key, bufs) from e

    def put_addressed(self, key: str, bufs: Sequence) -> bool:
        if not self._fsync:  # nothing to batch: written and named at once
            return self.put_if_absent(key, bufs)
        try:
            created = self._put_pending(key, bufs)
        except OSError as e:
            raise self._write_error(e, key, bufs) from e
        if self._pending_since is not None and time.monotonic() - self._pending_since > FLUSH_AGE:
            self._flush(block=False)  # a long put names what it wrote so far (see FLUSH_AGE)
        return created

    def take_lost(self, keys) -> set[str]:
        if not self._lost:
            return set()
        with self._lock:
            lost = self._lost.intersection(keys)
            self._lost -= lost
        return lost

    def _stored(self, path: str) -> bool:
        """Whether a regular file is stored at `path` (anything else there is an error:
        "already stored" would be a lie)."""
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(mode):
            raise _not_regular(path, mode)
        return True

    def _put_pending(self, key: str, bufs: Sequence) -> bool:
        if self._pending_path(key) is not None:
            return False  # this object wrote it and names it at the next sync
        path = self._path(key)
        if self._stored(path):
            return False
        self._ensure_dir(os.path.dirname(path))
        tmpdir = os.path.join(self.root, TMP_DIR)
        self._ensure_dir(tmpdir)
        tmp = os.path.join(tmpdir, f"{os.getpid()}-{uuid.uuid4().hex}{self.PENDING_SUFFIX}")
        total = sum(memoryview(b).nbytes for b in bufs)
        if self._direct is None and total >= DIRECT_MIN:
            self._direct = not in_memory(self.root)
        if not (self._direct and total >= DIRECT_MIN and self._put_direct(tmp, bufs, total)):
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                _write_all(fd, bufs)
                if _sync_file_range is not None:
                    # Start its writeback now without waiting for it, so the disk works while
                    # the workers hash and write the next blocks and the sync() before the
                    # commit finds little left to do. A hint only: a failure here changes
                    # nothing (the fdatasync at sync() decides what is durable).
                    _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)
            except BaseException:
                os.close(fd)
                os.unlink(tmp)
                raise
            os.close(fd)
        with self._lock:
            if key in self._pending:  # another thread of this object wrote it meanwhile
                dup = True
            else:
                dup = False
                self._pending[key] = tmp
                self._lost.discard(key)  # a race lost earlier and never asked for is not this write's
                if self._pending_since is None:
                    self._pending_since = time.monotonic()
        if dup:
            os.unlink(tmp)
        return not dup

    def _put_direct(self, tmp: str, bufs: Sequence, total: int) -> bool:
        """Write the pending file `tmp` with O_DIRECT -> False where this filesystem
        refuses O_DIRECT (EINVAL: then this store writes buffered from now on, and the
        caller writes this one so)."""
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self._direct = False
            return False
        try:
            _write_direct(fd, bufs, total)
        except BaseException as e:
            os.close(fd)
            os.unlink(tmp)
            if isinstance(e, OSError) and e.errno == errno.EINVAL:
                self._direct = False
                return False
            raise
        os.close(fd)
        return True

    def _put_if_absent(self, key: str, bufs: Sequence) -> bool:
        path = self._path(key)
        if self._stored(path):
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
        return self._pending_path(key) is not None or os.path.exists(self._path(key))

    def size_of(self, key: str) -> int | None:
        p = self._pending_path(key)
        if p is not None:
            try:
                return os.stat(p).st_size
            except FileNotFoundError:
                pass  # named meanwhile
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
        if self._pending and self._fsync:
            self._flush()  # this object's own writes are listed too, as they are read
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

    def _durable(self, tmps: list[str]) -> None:
        """Make the bytes of `tmps` durable: an fdatasync of each, from a few threads at
        once (the filesystem's journal commits them together). Not syncfs: that waits
        for every dirty page on the filesystem, other writers' included (a database, a
        second job), so one put's latency would be everybody's."""
        def one(t: str) -> None:
            try:
                fd = os.open(t, os.O_RDONLY)
            except FileNotFoundError:
                return  # removed unnamed: the naming pass below reports it lost
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        if len(tmps) <= 2:
            for t in tmps:
                one(t)
            return
        with ThreadPoolExecutor(min(SYNC_THREADS, len(tmps)), thread_name_prefix="tsck-sync") as ex:
            for f in [ex.submit(one, t) for t in tmps]:
                f.result()  # the first error, after every submitted one ran

    def _flush(self, block: bool = True) -> None:
        """Name every pending object: durable first (fdatasync), then linked under its
        key in write order. block=False: skip if another thread is at it."""
        if not self._flush_lock.acquire(blocking=block):
            return
        try:
            with self._lock:
                batch = list(self._pending.items())
                self._pending_since = time.monotonic() if batch else None
            if not batch:
                return
            try:
                self._durable([t for _, t in batch])
            except OSError as e:
                # Their bytes may not be on disk: never name them. Whoever referenced one
                # fails its put (this sync raises), and the next writer writes it again.
                self._drop(batch)
                raise storage_error(e, f"making {len(batch)} objects durable in {self.url}") from e
            lost = []
            for key, tmp in batch:
                final = self._path(key)
                try:
                    os.link(tmp, final)  # never replaces: a racing writer's copy is the same bytes
                except FileExistsError:
                    with self._lock:  # named by another writer: not this one's new object (take_lost)
                        if len(self._lost) >= LOST_KEEP:
                            self._lost.clear()  # nobody asked for them: keep memory bounded
                        self._lost.add(key)
                except FileNotFoundError:
                    if not os.path.exists(final):
                        lost.append(key)  # removed unnamed (a gc swept it as a dead writer's)
                    continue
                with self._lock:
                    self._dirty.add(os.path.dirname(final))
            self._drop(batch)
            if lost:
                raise storage_error(FileNotFoundError(errno.ENOENT, "temp file removed before it was named"),
                                    f"naming {len(lost)} objects written to {self.url} (first: {lost[0]}); "
                                    "a snapshot referencing them was not published")
        finally:
            self._flush_lock.release()

    def _drop(self, batch: list[tuple[str, str]]) -> None:
        """Forget `batch` as pending (named, or never to be) and remove its temp files."""
        with self._lock:
            for key, tmp in batch:
                if self._pending.get(key) == tmp:
                    del self._pending[key]
            if not self._pending:
                self._pending_since = None
        mine = f"{os.getpid()}-"
        for _key, tmp in batch:
            if not os.path.basename(tmp).startswith(mine):
                continue  # a forked child's copy of its parent's: the parent removes its own
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass

    def sync(self) -> None:
        if not self._fsync:
            return
        self._flush()
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        # Deepest first, so a new directory's own entries are durable before its name.
        for d in sorted(dirty, key=len, reverse=True):
            try:
                _fsync_dir(d)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        # Pending objects nobody synced belong to no snapshot (a put that references one
        # syncs before it publishes): drop their temp files rather than leave them to gc.
        with self._lock:
            batch = list(self._pending.items())
        if batch and self._flush_lock.acquire(blocking=False):
            try:
                self._drop(batch)
            finally:
                self._flush_lock.release()
