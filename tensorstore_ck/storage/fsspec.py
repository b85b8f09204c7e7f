"""A BlockStore over any fsspec filesystem (memory://, s3://, ...).

Object stores: put-if-absent is one conditional PUT (If-None-Match: *, what
s3fs sends for mode="create"), so two writers of one key cannot race a
read-modify-write; a 412 from a server that does not label it (Ceph RGW) is
recognised too. Listing caches are switched off: a cached "exists" could hide
a gc deletion from a writer that re-validates its objects.
"""

from __future__ import annotations

import contextlib
import functools
import io
import threading
from typing import BinaryIO, Iterator, Sequence

import fsspec

from .base import BlockStore, ObjectInfo

__all__ = ["FsspecBlockStore"]

# fsspec's MemoryFileSystem creates (mode="create") with exists() and then a write, unlocked,
# over one dict per process: racing creates of one key could all report True.
_MEMORY_CREATE_LOCK = threading.Lock()


def _as_oserror(fn):
    """botocore/aiohttp transport errors (ReadTimeoutError, EndpointConnectionError,
    ...) are not OSErrors; make them TimeoutError/ConnectionError so RetryingStore
    retries them and the store reports StorageError, never a foreign exception."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OSError:
            raise
        except Exception as e:  # noqa: BLE001 - only transport errors are translated
            name = type(e).__name__
            mod = type(e).__module__ or ""
            if not mod.startswith(("botocore", "aiobotocore", "aiohttp", "urllib3")):
                raise
            cls = TimeoutError if "Timeout" in name else ConnectionError
            raise cls(f"{name}: {e}") from e
    return wrapper


def _is_precondition_failed(e: BaseException) -> bool:
    """A conditional PUT refused because the key exists (HTTP 412), however the client reports it."""
    if isinstance(e, FileExistsError):
        return True
    cause = e.__cause__ or e.__context__
    resp = getattr(cause, "response", None)
    if isinstance(resp, dict):
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = resp.get("Error", {}).get("Code")
        return status == 412 or code == "PreconditionFailed"
    return False


class FsspecBlockStore(BlockStore):
    def __init__(self, url: str, storage_options: dict | None = None):
        opts = dict(storage_options or {})
        proto = url.split("://", 1)[0]
        if proto in ("s3", "s3a", "gs", "gcs", "az", "abfs"):
            opts.setdefault("use_listings_cache", False)
            opts.setdefault("skip_instance_cache", True)
        if proto in ("s3", "s3a"):
            # A hung connection becomes a timeout that RetryingStore retries, not a
            # snapshot that never finishes; the caller's config_kwargs win.
            cfg = dict(opts.get("config_kwargs") or {})
            cfg.setdefault("connect_timeout", 10)
            cfg.setdefault("read_timeout", 60)
            # One retry layer, RetryingStore (backoff with jitter, 5xx/throttling/resets):
            # botocore's and s3fs's own retries would multiply with it (a hung server
            # took minutes per request with all three).
            cfg.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
            opts["config_kwargs"] = cfg
        fs, path = fsspec.core.url_to_fs(url, **opts)
        self.fs = fs
        self.root = path.rstrip("/")
        self.url = url  # never the storage options: they may hold credentials
        self._s3 = type(fs).__name__ == "S3FileSystem"
        if self._s3:
            fs.retries = 1  # s3fs's own retry loop (a class attribute, 5): see above
        self._atomic_create = True
        self._create_lock = _MEMORY_CREATE_LOCK if proto == "memory" else contextlib.nullcontext()

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    @_as_oserror
    def get(self, key: str) -> bytes:
        try:
            if self._s3:
                # One GET: s3fs's cat_file otherwise HEADs first to decide on ranged reads,
                # which never pays for our <= block-size objects (we parallelise across objects).
                return self.fs.cat_file(self._path(key), max_concurrency=1)
            return self.fs.cat_file(self._path(key))
        except (FileNotFoundError, KeyError):
            raise FileNotFoundError(key) from None

    def open_read(self, key: str) -> BinaryIO:
        return io.BytesIO(self.get(key))

    @_as_oserror
    def put_if_absent(self, key: str, bufs: Sequence) -> bool:
        path = self._path(key)
        # Joining copies the caller's memory: a later mutation of a staged tensor
        # must not rewrite a stored object (in-memory backends keep what they get).
        data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
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
                if _is_precondition_failed(e):
                    return False
                raise
        # Check-then-put: not atomic, but objects are content-addressed, so a lost race
        # rewrites the same bytes.
        if self.exists(key):
            return False
        self.fs.pipe_file(path, data)
        return True

    def __repr__(self) -> str:
        return f"FsspecBlockStore({self.url!r})"

    @_as_oserror
    def exists(self, key: str) -> bool:
        path = self._path(key)
        if self._s3:
            # One HEAD: s3fs's exists() also lists the key as a "directory" when it is absent.
            bucket, _, obj = path.partition("/")
            try:
                self.fs.call_s3("head_object", Bucket=bucket, Key=obj)
                return True
            except FileNotFoundError:
                return False
        return self.fs.exists(path)

    @_as_oserror
    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    @_as_oserror
    def delete_many(self, keys: Sequence[str]) -> None:
        if not self._s3:
            return super().delete_many(keys)
        keys = list(keys)
        # One DeleteObjects request per 1000 keys (s3fs's rm() would drop per-key
        # errors silently). A key that is already gone is not an error in S3.
        bucket, _, base = self.root.partition("/")
        pre = f"{base}/" if base else ""
        for i in range(0, len(keys), 1000):
            out = self.fs.call_s3("delete_objects", Bucket=bucket, Delete={
                "Objects": [{"Key": pre + k} for k in keys[i:i + 1000]], "Quiet": True})
            errs = [e for e in out.get("Errors") or [] if e.get("Code") != "NoSuchKey"]
            if errs:
                raise OSError(f"delete of {len(errs)} object(s) failed under {self.url}: "
                              f"{errs[0].get('Code')}: {errs[0].get('Message')}")

    @_as_oserror
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
