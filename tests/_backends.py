"""The backends the core suites run on, behind one small interface.

    file  a local directory, LMDB ref table beside it (the embedded default)
    s3    s3://tsck-tests/<uuid> on the session's real S3 server (radosgw in CI),
          LMDB ref table in the test's tmp dir
    pg    a local directory with the ref table on the session's real PostgreSQL

`Backend.open()` opens the store; `objects()/read()/write()/delete()` reach the
stored objects directly through fsspec (not through tensorstore_ck) so tests
can inspect, corrupt or remove them the same way on every backend; `spec()` is
what a helper subprocess passes to tests/helpers/target.py; `cli_env()` is the
environment under which `tsck STORE ...` finds the same store.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid

import fsspec

import tensorstore_ck as tsck

KINDS = ("file", "s3", "pg")
OBJECT_PREFIXES = ("blocks/", "nodes/", "commits/")


class Backend:
    def __init__(self, kind: str, tmp_path, *, s3_options: dict | None = None, pg_dsn: str | None = None,
                 name: str = "store"):
        self.kind = kind
        self.storage_options = None
        self.refs = None
        if kind == "file":
            self.url = str(tmp_path / name)
        elif kind == "s3":
            self.url = f"s3://tsck-tests/{uuid.uuid4().hex}/{name}"
            self.storage_options = dict(s3_options)
            self.refs = str(tmp_path / f"{name}-refs.lmdb")
        elif kind == "pg":
            self.url = str(tmp_path / name)
            self.refs = pg_dsn  # each new store gets its own namespace (its id) in the shared table
        else:
            raise ValueError(kind)
        self._fs = None

    def __repr__(self) -> str:
        return f"Backend({self.kind}, {self.url})"

    # -- the store
    def open(self, **kw) -> tsck.Store:
        return tsck.open_store(self.url, refs=self.refs, storage_options=self.storage_options, **kw)

    def sibling(self, tmp_path, name: str) -> "Backend":
        """Another, empty store location of the same kind (same servers)."""
        pg_dsn = self.refs if self.kind == "pg" else None
        return Backend(self.kind, tmp_path, s3_options=self.storage_options, pg_dsn=pg_dsn, name=name)

    def spec(self) -> str:
        if self.kind == "file":
            return self.url
        return json.dumps({"url": self.url, "refs": self.refs, "storage_options": self.storage_options})

    def cli_env(self) -> dict:
        env = {}
        if self.refs:
            env["TSCK_REFS"] = self.refs
        if self.storage_options:
            env["TSCK_STORAGE_OPTIONS"] = json.dumps(self.storage_options)
        return env

    def remove(self) -> None:
        """Delete everything stored under an s3 location (local dirs go with tmp_path)."""
        if self.kind != "s3":
            return
        try:
            self.fs.rm(self._root, recursive=True)
        except (FileNotFoundError, OSError):
            pass

    # -- raw objects, bypassing tensorstore_ck
    @property
    def fs(self):
        if self._fs is None:
            opts = dict(self.storage_options or {})
            if self.kind == "s3":
                opts.update(skip_instance_cache=True, use_listings_cache=False)
            self._fs, self._root = fsspec.core.url_to_fs(self.url, **opts)
            self._root = self._root.rstrip("/")
        return self._fs

    def _path(self, key: str) -> str:
        self.fs  # noqa: B018 - sets _root
        return f"{self._root}/{key}"

    def objects(self, prefixes=OBJECT_PREFIXES) -> dict:
        """{key: size} of every stored object under `prefixes`."""
        out = {}
        fs = self.fs
        for pre in prefixes:
            base = self._path(pre.rstrip("/"))
            try:
                found = fs.find(base, detail=True)
            except FileNotFoundError:
                continue
            for p, info in found.items():
                key = p[len(self._root) + 1:] if p.startswith(self._root + "/") else os.path.relpath(p, self._root)
                out[key] = int(info.get("size") or 0)
        return out

    def read(self, key: str) -> bytes:
        return self.fs.cat_file(self._path(key))

    def write(self, key: str, data: bytes) -> None:
        """Overwrite (or create) an object in place: how tests corrupt stored bytes."""
        self.fs.pipe_file(self._path(key), bytes(data))

    def delete(self, key: str) -> None:
        self.fs.rm_file(self._path(key))

    def exists(self, key: str) -> bool:
        try:
            self.fs.info(self._path(key))
            return True
        except FileNotFoundError:
            return False

    def size(self, key: str) -> int:
        return int(self.fs.info(self._path(key))["size"])

    def flip_byte(self, key: str, offset: int = -1) -> None:
        data = bytearray(self.read(key))
        data[offset] ^= 0x01
        self.write(key, bytes(data))

    def truncate(self, key: str, keep: int) -> None:
        self.write(key, self.read(key)[:keep])


def lose_ref_table(b: Backend, store_id: str) -> None:
    """The ref table lost as an operator loses it: the LMDB directory removed, or the
    store's rows deleted from PostgreSQL (the objects stay)."""
    if b.kind == "file":
        shutil.rmtree(os.path.join(b.url, "refs.lmdb"))
        return
    import psycopg
    with psycopg.connect(b.refs, autocommit=True) as conn:
        conn.execute("DELETE FROM tsck_kv WHERE ns = %s", (store_id,))
