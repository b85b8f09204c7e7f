"""Where the harness's store lives, and how its ref table is lost (for recover).

    file  a local directory, LMDB ref table beside it (refs.lmdb)
    pg    a local directory, ref table on PostgreSQL (one namespace per store)
    s3    s3://tsck-tests/<uuid>/store on a real S3 server, ref table on PostgreSQL
    dirfs faultyfs://<dir>/store: a filesystem of folders through fsspec (FsspecBlockStore
          under its retry layer, faults.FaultyFS), LMDB ref table beside it

PostgreSQL: --pg-dsn / $TEST_PG_DSN, else a throwaway server is started here with the
Debian binaries (initdb/pg_ctl, as tests/conftest.py does). Each run gets a database of
its own on that server, so the run's first opens create tsck_kv (and race to). S3: $TEST_S3_ENDPOINT,
$TEST_S3_KEY, $TEST_S3_SECRET (`bash .ci/start-rgw.sh DIR && source DIR/env`).
"""

from __future__ import annotations

import os
import shutil
import uuid

from tests._pgserver import PgServer, pg_bindir

KINDS = ("file", "pg", "s3", "dirfs")


class Postgres:
    """A PostgreSQL server of our own on 127.0.0.1 (tests/_pgserver.py; stopped by stop())."""

    def __init__(self):
        bindir = pg_bindir()
        if bindir is None:
            raise SystemExit("no PostgreSQL binaries (apt-get install postgresql) and no --pg-dsn given")
        self.server = PgServer(bindir)
        self.dsn = self.server.dsn

    def stop(self) -> None:
        self.server.remove()


class Location:
    def __init__(self, kind: str, run_dir: str, pg_dsn: str | None = None):
        self.kind = kind
        self.refs = None
        self.storage_options = None
        self._pg = None
        self._db = None
        if kind in ("pg", "s3"):
            if not pg_dsn:
                self._pg = Postgres()
                pg_dsn = self._pg.dsn
            self._server_dsn, self._db = pg_dsn, f"tsck_sim_{uuid.uuid4().hex[:12]}"
            import psycopg
            with psycopg.connect(pg_dsn, autocommit=True) as conn:
                conn.execute(f"CREATE DATABASE {self._db}")
            pg_dsn = psycopg.conninfo.make_conninfo(pg_dsn, dbname=self._db)
        if kind == "file":
            self.url = os.path.join(run_dir, "store")
        elif kind == "dirfs":
            # its LMDB table is named by spec() alone: `refs` stays None (no PostgreSQL to proxy)
            self.url, self.lmdb = f"faultyfs://{os.path.join(run_dir, 'store')}", os.path.join(run_dir, "refs.lmdb")
        elif kind == "pg":
            self.url, self.refs = os.path.join(run_dir, "store"), pg_dsn
        elif kind == "s3":
            ep = os.environ.get("TEST_S3_ENDPOINT")
            if not ep:
                raise SystemExit("backend s3 needs TEST_S3_ENDPOINT (bash .ci/start-rgw.sh DIR && source DIR/env)")
            self.storage_options = {"endpoint_url": ep, "key": os.environ.get("TEST_S3_KEY", "x"),
                                    "secret": os.environ.get("TEST_S3_SECRET", "x"),
                                    # short client timeouts, so gc leases of seconds fit (a delete
                                    # request must end well within the lease)
                                    "config_kwargs": {"connect_timeout": 2, "read_timeout": 4}}
            import s3fs
            fs = s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True)
            try:
                fs.mkdir("tsck-tests")
            except (FileExistsError, OSError):
                pass
            self.url, self.refs = f"s3://tsck-tests/{uuid.uuid4().hex}/store", pg_dsn
        else:
            raise SystemExit(f"unknown backend {kind!r} (one of {', '.join(KINDS)})")

    def spec(self) -> dict:
        return {"url": self.url, "refs": self.refs if self.kind != "dirfs" else self.lmdb,
                "storage_options": self.storage_options}

    def delete_ref_table(self, store_id: str) -> None:
        """Lose the ref table, as an operator might (LMDB directory removed; the store's
        PostgreSQL namespace emptied). Nothing may have it open."""
        if self.refs is None:
            shutil.rmtree(self.lmdb if self.kind == "dirfs" else os.path.join(self.url, "refs.lmdb"))
            return
        import psycopg
        with psycopg.connect(self.refs, autocommit=True) as conn:
            conn.execute("DELETE FROM tsck_kv WHERE ns = %s", (store_id,))

    def close(self) -> None:
        if self.kind == "s3":
            try:
                import s3fs
                s3fs.S3FileSystem(**self.storage_options, skip_instance_cache=True).rm(
                    self.url[len("s3://"):].rsplit("/", 1)[0], recursive=True)
            except (FileNotFoundError, OSError):
                pass
        if self._pg is not None:
            self._pg.stop()
        elif self._db is not None:
            import psycopg
            try:
                with psycopg.connect(self._server_dsn, autocommit=True) as conn:
                    conn.execute(f"DROP DATABASE IF EXISTS {self._db} WITH (FORCE)")
            except psycopg.Error:
                pass  # a server gone already: nothing left to drop
