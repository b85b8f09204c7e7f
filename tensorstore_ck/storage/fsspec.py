"""A BlockStore over any fsspec filesystem (memory://, gs://, az://, sftp://, ...).

Generic: it knows fsspec's interface and nothing of any one service. Object
stores (a flat namespace, a PUT that is atomic): put-if-absent is fsspec's atomic
create (mode="create") where the backend has one, else a check-then-put (safe for
content-addressed keys). Listing caches are switched off: a cached "exists" could
hide a gc deletion from a writer that re-validates its objects. S3's request model
and error classification are S3BlockStore's (s3.py).

Filesystems with directories (every protocol not known to be an object store: a
LocalFileSystem subclass, sftp, hdfs, smb, a share mounted through fsspec): a write
there is not atomic and its folder must exist. An object is written whole to
tmp/<random>.partial (what gc sweeps when a writer dies) and then named: by a hard
link where the filesystem's paths are this host's (a LocalFileSystem, or fsspec's
DirFileSystem over one: exclusive, so racing creators of one key have exactly one
winner), else by a rename after an
existence check (two racing creators of one key may both be told they made it; for
content-addressed keys they wrote the same bytes). A missing parent folder is made
when a write or rename reports it missing, once per folder and process, so a store
whose folders exist costs no mkdir at all. Local paths get their file and folders
fsync'ed (the file before it is named, the folders at sync()).
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import posixpath
import threading
import uuid
import weakref
from typing import BinaryIO, Iterator, Sequence

import fsspec

from .base import BlockStore, Deadline, ObjectInfo, check_deadline

__all__ = ["FsspecBlockStore", "translated"]  # translated: S3BlockStore's calls are wrapped by it too

log = logging.getLogger(__name__)

# fsspec's MemoryFileSystem creates (mode="create") with exists() and then a write, unlocked,
# over one dict per process: racing creates of one key could all report True.
_MEMORY_CREATE_LOCK = threading.Lock()


# The event loops given _quiet_cut_connections (fsspec's IO loop; a new one after a fork).
_QUIETED: "weakref.WeakSet" = weakref.WeakSet()
_QUIETED_LOCK = threading.Lock()


def _orphaned_cut(context: dict) -> bool:
    """An exception asyncio found unretrieved in a task of aiohttp's that is a cut
    connection's. aiohttp sends a request's headers and body from a task of its own (at
    once where the request expects "100 Continue", as object-store clients' PUTs do); when the
    connection is reset as that task starts, the request itself fails (the caller hears
    it: a retry, then a StorageError) and aiohttp forgets the task without retrieving its
    exception, the same failure once more."""
    exc, task = context.get("exception"), context.get("future") or context.get("task")
    if not isinstance(exc, ConnectionError) or task is None or not hasattr(task, "get_coro"):
        return False
    code = getattr(task.get_coro(), "cr_code", None)
    path = getattr(code, "co_filename", "") or ""
    return f"{os.sep}aiohttp{os.sep}" in path


def _loop_of(fs):
    """The event loop an async filesystem (s3fs, gcsfs, adlfs) runs its requests on, or None."""
    return getattr(fs, "loop", None) if getattr(fs, "async_impl", False) else None


def _quiet_cut_connections(loop) -> None:
    """Give `loop` an exception handler that logs _orphaned_cut's exceptions at debug
    level instead of asyncio's "Task exception was never retrieved" traceback on stderr
    (printed even with no logging configured: logging's last resort); every other one
    goes to the handler the loop had, or asyncio's default."""
    if loop is None:
        return
    with _QUIETED_LOCK:
        if loop in _QUIETED:
            return
        _QUIETED.add(loop)
        before = loop.get_exception_handler()

    def handler(lp, context: dict) -> None:
        if _orphaned_cut(context):
            log.debug("a request's connection was cut (its request failed and was handled): %s: %s",
                      type(context["exception"]).__name__, context["exception"])
            return
        if before is not None:
            before(lp, context)
        else:
            lp.default_exception_handler(context)
    loop.set_exception_handler(handler)


def translated(fn):
    """Run a storage call; a backend's own non-OSError failure becomes the OSError its
    store's _translate() names (so RetryingStore and StorageError see one kind)."""
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        try:
            return fn(self, *args, **kwargs)
        except OSError as e:
            self._classify(e)
            raise
        except Exception as e:  # noqa: BLE001 - the store decides which ones are its
            err = self._translate(e)
            if err is None:
                raise
            raise err from e
    return wrapper


class FsspecBlockStore(BlockStore):
    REMOTE = ("s3", "s3a", "gs", "gcs", "az", "abfs")
    # Object stores: no folders to make, and a PUT is atomic. Any other protocol is
    # taken to have directories (the safe side: it costs a rename per object).
    FLAT = REMOTE + ("abfss", "adl", "oci", "oss", "memory")

    def __init__(self, url: str, storage_options: dict | None = None):
        # memory:// works in-process; a remote filesystem without known timeouts keeps
        # the conservative default (BlockStore.request_timeout).
        if url.startswith("memory://"):
            self.request_timeout = 0.1
        opts = dict(storage_options or {})
        proto = url.split("://", 1)[0]
        if proto in self.REMOTE:
            opts.setdefault("use_listings_cache", False)
            opts.setdefault("skip_instance_cache", True)
        fs, path = fsspec.core.url_to_fs(url, **self._options(opts))
        self.fs = fs
        _quiet_cut_connections(_loop_of(fs))
        self._fs_args = (url, opts) if proto in self.REMOTE else None
        self.root = path.rstrip("/")
        self.url = url  # never the storage options: they may hold credentials
        self._atomic_create = True
        self._create_lock = _MEMORY_CREATE_LOCK if proto == "memory" else contextlib.nullcontext()
        self.directories = proto not in self.FLAT
        # This host's paths (a LocalFileSystem or a subclass, or a DirFileSystem over one:
        # its paths joined to its folder): link, fsync.
        from fsspec.implementations.dirfs import DirFileSystem
        from fsspec.implementations.local import LocalFileSystem
        self._os_path = None  # a path of fs -> this host's path of the same file
        if self.directories and isinstance(fs, LocalFileSystem):
            self._os_path = str
        elif self.directories and isinstance(fs, DirFileSystem) and isinstance(fs.fs, LocalFileSystem):
            base = fs.path.rstrip("/")  # (its folder; our paths are keys under the root, never absolute)
            self._os_path = lambda p: f"{base}/{p}"
        self._os_paths = self._os_path is not None
        if self._os_paths:  # synchronous local calls, as LocalBlockStore's
            self.request_timeout = 0.1
        self._made: set[str] = set()      # folders known to exist (made or seen)
        self._unsynced: set[str] = set()  # folders that got an entry since the last sync()
        self._dirs_lock = threading.Lock()

    def _after_fork(self) -> None:
        """In a forked child (Store._after_fork): an async filesystem (s3fs) runs on the
        parent's event-loop thread, which the child lacks; build a new one."""
        if self._fs_args is not None:
            # fsspec's own at-fork reset of its loop may run after this hook (handlers run
            # in the order they were registered, and tensorstore_ck's may come first): a
            # filesystem built before it would run on the parent's loop, whose thread the
            # child lacks, and its first request would wait forever. Reset it here first.
            import fsspec.asyn
            fsspec.asyn.reset_lock()
            url, opts = self._fs_args
            fs = fsspec.core.url_to_fs(url, **self._options(dict(opts)))[0]
            _quiet_cut_connections(_loop_of(fs))
            self.fs = fs

    # -- hooks a service-specific store overrides ---------------------------------
    def _options(self, opts: dict) -> dict:
        """fsspec options, adjusted before the filesystem is built."""
        return opts

    def _translate(self, e: Exception) -> OSError | None:
        """A backend failure that is not an OSError, as one (None: not ours, re-raise)."""
        return None

    def _classify(self, e: OSError) -> None:
        """Mark `e.transient` (bool) where the protocol tells whether a retry may help;
        RetryingStore reads the mark. Generic fsspec errors carry no such knowledge."""

    def _exists_error(self, e: OSError) -> bool:
        """A create refused because the key exists."""
        return isinstance(e, FileExistsError)

    def _read(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def _read_head(self, path: str, n: int) -> bytes:
        """At most the first n bytes of an object (one ranged read)."""
        return self.fs.cat_file(path, start=0, end=n)

    # -- BlockStore --------------------------------------------------------------
    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    @translated
    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        path = self._path(key)
        try:
            return self._read(path) if max_bytes is None else self._read_head(path, max_bytes)
        except (FileNotFoundError, KeyError):
            raise FileNotFoundError(key) from None

    def open_read(self, key: str, max_bytes: int | None = None) -> BinaryIO:
        return io.BytesIO(self.get(key, max_bytes))

    @translated
    def put_if_absent(self, key: str, bufs: Sequence) -> bool:
        path = self._path(key)
        # Joining copies the caller's memory: a later mutation of a staged tensor
        # must not rewrite a stored object (in-memory backends keep what they get).
        # One copy: join takes the views. A copy of each into bytes first would fault in a
        # fresh 4 MiB object's pages per block (12x the cost of the join on this VM).
        data = b"".join(memoryview(b).cast("B") for b in bufs)
        if self.directories:
            return self._put_in_folders(path, data)
        if self._atomic_create:
            # One conditional PUT (If-None-Match: *) is both the existence check and
            # the write; callers that want to skip the upload HEAD first themselves.
            try:
                with self._create_lock:
                    self.fs.pipe_file(path, data, mode="create")
                return True
            except TypeError:  # this backend has no atomic create
                self._atomic_create = False
            except OSError as e:
                if self._exists_error(e):
                    return False
                raise
        # Check-then-put: not atomic, but objects are content-addressed, so a lost race
        # rewrites the same bytes.
        if self.exists(key):
            return False
        self.fs.pipe_file(path, data)
        return True

    # -- filesystems with directories ---------------------------------------------
    def _in_folder(self, path: str, call):
        """call(); once more after making path's folder if it reported something missing
        and the folder was not known to exist when it started (threads racing into a new
        folder may each make it once; a known folder costs nothing)."""
        parent = posixpath.dirname(path)
        with self._dirs_lock:
            known = parent in self._made
        try:
            return call()
        except FileNotFoundError:
            if known:
                raise
        self.fs.makedirs(parent, exist_ok=True)
        with self._dirs_lock:
            self._made.add(parent)
        return call()

    def _put_in_folders(self, path: str, data: bytes) -> bool:
        tmp = f"{self.root}/{self.TEMP_PREFIX}{uuid.uuid4().hex}.partial"

        def write():
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
                if self._os_paths:  # durable before it is named
                    f.flush()
                    os.fsync(f.fileno())
        self._in_folder(tmp, write)
        try:
            if self._os_paths:
                try:  # exclusive: an existing name is never replaced
                    self._in_folder(path, lambda: os.link(self._os_path(tmp), self._os_path(path)))
                except FileExistsError:
                    return False
            else:
                if self.fs.exists(path):
                    return False
                self._in_folder(path, lambda: self.fs.mv(tmp, path))
                tmp = None
            with self._dirs_lock:
                self._unsynced.add(posixpath.dirname(path))  # (sync() names it on this host)
            return True
        finally:
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(tmp)

    def sync(self) -> None:
        if not self._os_paths:
            return
        with self._dirs_lock:
            dirs, self._unsynced = self._unsynced, set()
        for d in sorted(dirs):  # the new names durable, as the bytes already are
            fd = os.open(self._os_path(d), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    @translated
    def exists(self, key: str) -> bool:
        return self.fs.exists(self._path(key))

    @translated
    def size_of(self, key: str) -> int | None:
        try:
            info = self.fs.info(self._path(key))
        except (FileNotFoundError, KeyError):
            return None
        if info.get("type") == "directory":
            return None
        return int(info.get("size") or 0)

    @translated
    def move(self, key: str, new_key: str, *, deadline: Deadline | None = None) -> bool:
        # Copy first, then delete: a crash in between leaves the object under both names
        # (a server-side copy on object stores: the bytes do not travel through here).
        src, dst = self._path(key), self._path(new_key)
        if self.directories:  # a rename, into a folder made if need be
            if not self.fs.exists(src):
                return False
            check_deadline(deadline)
            try:
                self._in_folder(dst, lambda: self.fs.mv(src, dst))
            except FileNotFoundError:
                if self.fs.exists(src):
                    raise
                return False  # gone meanwhile
            return True
        try:
            self.fs.cp_file(src, dst)
        except (FileNotFoundError, KeyError):
            return False
        check_deadline(deadline)
        self.delete(key)
        return True

    @translated
    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    @translated
    def _find(self, base: str) -> dict:
        try:
            return self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        found = self._find(self._path(prefix.rstrip("/")))
        head = self.root + "/"
        for p, info in found.items():
            if not p.startswith(head):
                continue
            key = p[len(head):]
            mtime = info.get("mtime") or info.get("LastModified") or info.get("created") or 0.0
            if hasattr(mtime, "timestamp"):
                mtime = mtime.timestamp()
            yield ObjectInfo(key, int(info.get("size") or 0), float(mtime))
