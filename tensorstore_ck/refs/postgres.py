"""A ref table on PostgreSQL (psycopg 3), for many hosts sharing one store.

Exactly the LMDB table's semantics, because it is the same code: RefTable's
logic runs over one key-value table, each operation in one SERIALIZABLE
transaction. Two transactions whose reads and writes conflict (two CAS on one
ref, a CAS against a gc freeze) cannot both commit: PostgreSQL aborts one with
a serialization failure and we re-run it from the start, so every check
happens inside the transaction that acts on it, as in LMDB.

    CREATE TABLE tsck_kv (ns text, tbl text, key bytea, value bytea NOT NULL, PRIMARY KEY (ns, tbl, key))

`ns` is the store's id (from its tsck.json), so one database can serve many stores.

Passwords in the DSN are never printed: errors name the host and database only.
"""

from __future__ import annotations

import random
import threading
import time

from ..errors import NotAStore, TsckError
from .base import RefTable, Txn

__all__ = ["PostgresRefTable"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tsck_kv (
    ns    text  NOT NULL,
    tbl   text  NOT NULL,
    key   bytea NOT NULL,
    value bytea NOT NULL,
    PRIMARY KEY (ns, tbl, key)
)
"""


def _safe_dsn(dsn: str) -> str:
    try:
        from psycopg.conninfo import conninfo_to_dict
        d = conninfo_to_dict(dsn)
        return f"postgresql://{d.get('host', 'localhost')}:{d.get('port', 5432)}/{d.get('dbname', '')}"
    except Exception:  # noqa: BLE001 - never echo a DSN we could not parse: it may hold a password
        return "postgresql://<unparseable dsn>"


class _PgTxn(Txn):
    def __init__(self, cur, ns: str):
        self.cur = cur
        self.ns = ns

    def get(self, table, key):
        self.cur.execute("SELECT value FROM tsck_kv WHERE ns = %s AND tbl = %s AND key = %s", (self.ns, table, key))
        row = self.cur.fetchone()
        return None if row is None else bytes(row[0])

    def put(self, table, key, value):
        self.cur.execute("INSERT INTO tsck_kv (ns, tbl, key, value) VALUES (%s, %s, %s, %s) "
                         "ON CONFLICT (ns, tbl, key) DO UPDATE SET value = EXCLUDED.value",
                         (self.ns, table, bytes(key), bytes(value)))

    def delete(self, table, key):
        self.cur.execute("DELETE FROM tsck_kv WHERE ns = %s AND tbl = %s AND key = %s", (self.ns, table, key))

    def clock(self):
        # The server's clock: one for every host, whatever their own clocks say.
        return "pg", self.wall()

    def wall(self):
        self.cur.execute("SELECT extract(epoch FROM clock_timestamp())::float8")
        return float(self.cur.fetchone()[0])

    def items(self, table, prefix=b""):
        if prefix:
            self.cur.execute("SELECT key, value FROM tsck_kv WHERE ns = %s AND tbl = %s "
                             "AND substring(key from 1 for %s) = %s ORDER BY key",
                             (self.ns, table, len(prefix), prefix))
        else:
            self.cur.execute("SELECT key, value FROM tsck_kv WHERE ns = %s AND tbl = %s ORDER BY key",
                             (self.ns, table))
        return iter([(bytes(k), bytes(v)) for k, v in self.cur.fetchall()])


class PostgresRefTable(RefTable):
    def __init__(self, dsn: str, *, namespace: str = "default", connect_timeout: float = 10.0):
        try:
            import psycopg
        except ImportError:
            raise NotAStore("PostgreSQL ref tables need psycopg: pip install 'tensorstore_ck[postgres]'") from None
        self._psycopg = psycopg
        self.where = _safe_dsn(dsn)
        self.namespace = namespace
        try:
            self.conn = psycopg.connect(dsn, autocommit=False, connect_timeout=int(connect_timeout))
        except psycopg.Error as e:
            raise NotAStore(f"cannot connect to the ref table at {self.where}: {type(e).__name__}") from None
        self.conn.execute("SET default_transaction_isolation TO 'serializable'")
        self.conn.commit()
        self._lock = threading.Lock()  # one connection: one transaction at a time per process
        self._write(lambda t: (t.cur.execute(_SCHEMA), None)[1])

    def _run(self, fn, write: bool):
        errors = self._psycopg.errors
        delay = 0.002
        with self._lock:
            for _attempt in range(200):
                try:
                    with self.conn.cursor() as cur:
                        out = fn(_PgTxn(cur, self.namespace))
                        if hasattr(out, "__next__") and not hasattr(out, "execute"):
                            out = list(out)
                    self.conn.commit()
                    return out
                except (errors.SerializationFailure, errors.DeadlockDetected, errors.UniqueViolation):
                    self.conn.rollback()  # another transaction won: re-run ours from its first read
                    time.sleep(delay * (1 + random.random()))
                    delay = min(0.2, delay * 2)
                except TsckError:
                    self.conn.rollback()
                    raise
                except self._psycopg.OperationalError as e:
                    self.conn.rollback() if not self.conn.closed else None
                    raise NotAStore(f"ref table at {self.where} failed: {type(e).__name__}") from None
                except BaseException:
                    if not self.conn.closed:
                        self.conn.rollback()
                    raise
            raise TsckError(f"ref table at {self.where}: too much contention, gave up after 200 retries")

    def _read(self, fn):
        return self._run(fn, False)

    def _write(self, fn):
        return self._run(fn, True)

    def close(self) -> None:
        self.conn.close()
