"""A BlockStore over any fsspec filesystem (memory://, s3://, ...)."""

from __future__ import annotations

import io
from typing import BinaryIO, Iterator, Sequence

import fsspec

from .base import BlockStore, ObjectInfo

__all__ = ["FsspecBlockStore"]


class FsspecBlockStore(BlockStore):
    def __init__(self, url: str, storage_options: dict | None = None):
        fs, path = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.fs = fs
        self.root = path.rstrip("/")
        self.url = url

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}"

    def get(self, key: str) -> bytes:
        try:
            return self.fs.cat_file(self._path(key))
        except (FileNotFoundError, KeyError):
            raise FileNotFoundError(key) from None

    def open_read(self, key: str) -> BinaryIO:
        return io.BytesIO(self.get(key))

    def put_if_absent(self, key: str, bufs: Sequence) -> bool:
        path = self._path(key)
        if self.fs.exists(path):
            return False
        # Joining copies the caller's memory: a later mutation of a staged tensor
        # must not rewrite a stored object (in-memory backends keep what they get).
        data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except TypeError:  # backends without mode=: no atomic create; content-addressed, so benign
            self.fs.pipe_file(path, data)
        return True

    def exists(self, key: str) -> bool:
        return self.fs.exists(self._path(key))

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self._path(key))
        except FileNotFoundError:
            pass

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self._path(prefix.rstrip("/"))
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return
        head = self.root + "/"
        for p, info in found.items():
            if not p.startswith(head):
                continue
            key = p[len(head):]
            mtime = info.get("mtime") or info.get("created") or 0.0
            if hasattr(mtime, "timestamp"):
                mtime = mtime.timestamp()
            yield ObjectInfo(key, int(info.get("size") or 0), float(mtime))
