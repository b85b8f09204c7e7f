"""A ref table on PostgreSQL (psycopg 3 + psycopg_pool), for many hosts sharing one store.

Exactly the LMDB table's semantics, because it is the same code: RefTable's
logic runs over one key-value table, each operation in one SERIALIZABLE
transaction. Two transactions whose reads and writes conflict (two CAS on one
ref, a CAS against a gc freeze) cannot both commit: PostgreSQL aborts one with
a serialization failure and we re-run it from the start, so every check
happens inside the transaction that acts on it, as in LMDB.

    CREATE TABLE tsck_kv (ns text, tbl text, key bytea, value bytea NOT NULL, PRIMARY KEY (ns, tbl, key))

`ns` is the store's id (from its tsck.json), so one database can serve many stores.

A server restart or a dropped connection is ridden out: connections come from a
pool that checks each one before handing it out, and a transaction that lost its
connection is run again with the storage's backoff policy (retry.py). A write
whose COMMIT was sent but not acknowledged may have committed: each write
transaction also writes an idempotency token (table "txn", key: the server's
time in ms + 16 random bytes; value: the operation's result), and the retry
first looks for it. Found: the first attempt committed, its result is returned
and nothing runs twice (a compare-and-swap is neither applied twice nor reported
as a conflict with itself). Absent: it did not commit (a COMMIT still in flight
on the old connection conflicts with the retry on the rows both write, and
SERIALIZABLE aborts one of them), so running it again is safe. The next write of
this handle deletes the tokens whose commits were acknowledged; tokens left by a
killed process are swept after TOKEN_TTL when a table is opened. A server that
stays down past the connect timeout is a StorageError naming the ref table.

Every wait on the server is bounded (docs/design/reftable.md, "Bounded waits"): each
session of the table sets lock_timeout, statement_timeout and
idle_in_transaction_session_timeout (so the server ends a session whose client went
away holding a ref row's lock) and server-side TCP keepalives; the client turns on
libpq's keepalives. A lock or statement timeout is retried within the retry budget,
then is a StorageError (OutcomeUnknown after an unanswered COMMIT), never a hang.

Passwords in the DSN are never printed: errors name the host and database only.
"""

from __future__ import annotations

import logging
import os
import random
import struct
import threading
import time

import msgpack

from ..errors import NotAStore, OutcomeUnknown, StorageError, StoreClosed, TsckError
from ..util.retry import DEFAULT_BACKOFF, Backoff
from .base import RefTable, track_for_fork
from .txn import Txn

__all__ = ["PostgresRefTable", "TOKEN_TABLE", "TOKEN_TTL"]

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS tsck_kv (
    ns    text  NOT NULL,
    tbl   text  NOT NULL,
    key   bytea NOT NULL,
    value bytea NOT NULL,
    PRIMARY KEY (ns, tbl, key)
)
"""

# Serializes the first opens of a database, which all create tsck_kv: CREATE TABLE IF NOT
# EXISTS is not safe against itself (the losers fail with DuplicateObject or a unique
# violation in the catalog). A transaction-level advisory lock, so a killed creator's lock
# goes with its session. The number is "tsck_kv" in ASCII.
_SCHEMA_LOCK = 0x7473636B5F6B76
TOKEN_TABLE = "txn"     # idempotency tokens of write transactions (never read by RefTable's logic)
TOKEN_TTL = 86400.0     # a token is needed for seconds (one retry); leftovers of killed processes go after this
DEFAULT_CONNECT_TIMEOUT = 10.0
LOCATIONS_NS = "tsck:locations"  # the stores found at remote locations (location_get), for every store
CHECK_IDLE = 1.0        # seconds idle after which a pooled connection is checked before use
IDLE_IN_TXN_MIN = 5.0   # s: the least idle_in_transaction_session_timeout the table sets
STATEMENT_MIN = 60.0    # s: the least statement_timeout the table sets
KEEPALIVE_COUNT = 3     # unanswered keepalive probes before a peer is dead (client and server)
POOL_STOP = 5.0         # s close() waits for the pool's threads (psycopg_pool's default)
POOL_STOP_AWAY = 0.1    # ... once the store's retries were stopped: the server is away, a close has a deadline
_MS = struct.Struct(">Q")
_ABANDONED: list = []   # pools inherited across a fork: the parent's; never closed by the child


def _safe_dsn(dsn: str) -> str:
    try:
        from psycopg.conninfo import conninfo_to_dict
        d = conninfo_to_dict(dsn)
        return f"postgresql://{d.get('host', 'localhost')}:{d.get('port', 5432)}/{d.get('dbname', '')}"
    except Exception:  # noqa: BLE001 - never echo a DSN we could not parse: it may hold a password
        return "postgresql://<unparseable dsn>"


def _dsn_timeout(dsn: str) -> float | None:
    try:
        from psycopg.conninfo import conninfo_to_dict
        v = conninfo_to_dict(dsn).get("connect_timeout")
        return float(v) if v not in (None, "") and float(v) > 0 else None
    except Exception:  # noqa: BLE001 - an unparseable DSN fails at connect, with its own error
        return None


def _lost(e: Exception, conn) -> bool:
    """Did `e` lose the connection (a retry on a new one may succeed)?"""
    if conn is not None and (conn.broken or conn.closed):
        return True
    state = getattr(e, "sqlstate", None) or ""
    if not state:  # a client-side failure: connect refused, server closed the connection
        return True
    # 08: connection exception; 57P01-03: admin/crash shutdown, cannot connect now;
    # 53300: too many connections (a restarting server's clients all reconnect at once)
    return state.startswith(("08", "57P")) or state == "53300"


# What a server that answered says when it will not take this connection: no retry helps.
_REFUSALS = ("authentication failed", "does not exist", "no pg_hba.conf entry", "permission denied",
             "password authentication", "invalid password")


def _refused(e: Exception) -> bool:
    """A connection the server refused for good (credentials, no such database or role),
    as opposed to one it could not take now (down, starting, failing over)."""
    text = str(e).lower()
    if "the database system is" in text:  # starting up / shutting down / in recovery: transient
        return False
    return any(w in text for w in _REFUSALS)


def session_limits(connect_timeout: float, budget: float) -> dict[str, int]:
    """The server-side bounds the table sets on each of its sessions, in each setting's
    own unit (ms for the timeouts, s for the keepalives), from the connect timeout T and
    the retry budget B (docs/design/reftable.md, "Bounded waits"):

        lock_timeout                         T: a row lock held longer is not a live
                                             writer's (they hold one for milliseconds)
        idle_in_transaction_session_timeout  2T, at least 5 s: our sessions are idle in a
                                             transaction only between two statements; one
                                             idle that long lost its client, and its locks
                                             go with it, inside the default budget
        statement_timeout                    B, at least 60 s: a backstop, no statement of
                                             the table runs near it
        tcp_keepalives_idle/interval/count   the server notices a client host that is gone
    """
    ka_idle, ka_interval = _keepalive(connect_timeout)
    return {"lock_timeout": max(1, int(connect_timeout * 1000)),
            "idle_in_transaction_session_timeout": int(max(IDLE_IN_TXN_MIN, 2 * connect_timeout) * 1000),
            "statement_timeout": int(max(STATEMENT_MIN, budget) * 1000),
            "tcp_keepalives_idle": ka_idle, "tcp_keepalives_interval": ka_interval,
            "tcp_keepalives_count": KEEPALIVE_COUNT}


def _keepalive(connect_timeout: float) -> tuple[int, int]:
    """(idle, interval) seconds of TCP keepalive: a peer silent for about twice the
    connect timeout is dead."""
    return max(1, round(connect_timeout)), max(1, round(connect_timeout / KEEPALIVE_COUNT))


# Each limit is set unless the DSN set it (source 'client': libpq's options=, $PGOPTIONS),
# or a role, database or server setting already has a shorter one (an operator's stricter
# rule stands); 0 (off) is replaced. One statement when a connection is made.
_LIMIT_SESSION = """
SELECT set_config(s.name, w.v::text, false)
  FROM unnest(%s::text[], %s::bigint[]) AS w(name, v) JOIN pg_settings s ON s.name = w.name
 WHERE s.source <> 'client' AND (s.setting::bigint <= 0 OR s.setting::bigint > w.v)
"""


def _limit_session(conn, limits: dict[str, int]) -> None:
    conn.execute(_LIMIT_SESSION, (list(limits), list(limits.values())))


def _client_keepalives(dsn: str, connect_timeout: float) -> dict:
    """libpq's keepalives (and TCP_USER_TIMEOUT for data the server never acknowledges),
    as connect() keywords, for those the DSN does not set itself: a client waiting for
    an answer from a server host that went away notices it instead of waiting forever."""
    try:
        from psycopg import pq
        from psycopg.conninfo import conninfo_to_dict
        given = conninfo_to_dict(dsn)
        user_timeout = pq.version() >= 120000
    except Exception:  # noqa: BLE001 - an unparseable DSN fails at connect, with its own error
        return {}
    idle, interval = _keepalive(connect_timeout)
    want = {"keepalives": 1, "keepalives_idle": idle, "keepalives_interval": interval,
            "keepalives_count": KEEPALIVE_COUNT}
    if user_timeout:
        want["tcp_user_timeout"] = (idle + interval * KEEPALIVE_COUNT) * 1000
    return {k: v for k, v in want.items() if k not in given}


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


def _put_token(cur, ns: str, value: bytes, acked: list[bytes]) -> bytes:
    """Write this transaction's token (key: the server's clock in ms, big-endian, + 16
    random bytes) and delete the acknowledged ones, in one statement. -> the key."""
    cur.execute("WITH gone AS (DELETE FROM tsck_kv WHERE ns = %s AND tbl = %s AND key = ANY(%s)) "
                "INSERT INTO tsck_kv (ns, tbl, key, value) VALUES (%s, %s, "
                "int8send((extract(epoch FROM clock_timestamp()) * 1000)::int8) || %s, %s) RETURNING key",
                (ns, TOKEN_TABLE, acked, ns, TOKEN_TABLE, os.urandom(16), value))
    return bytes(cur.fetchone()[0])


def _encode_out(out) -> bytes:
    return msgpack.packb(out, use_bin_type=True)


def _decode_out(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class PostgresRefTable(RefTable):
    """connect_timeout: seconds to wait for the server (at open, and for a connection
    after one was lost) before StorageError; default: the DSN's connect_timeout, else 10.
    backoff: the retry policy after a lost connection (default: storage's).
    read_only: issue no writes: no table is created, no token swept, every transaction
    is READ ONLY on the server (so even a write that got past RefTable's refusal would
    fail there), and a write is refused with ReadOnlyStore before it starts.
    limits: the server-side bounds set on each session (session_limits())."""

    def __init__(self, dsn: str, *, namespace: str = "default", connect_timeout: float | None = None,
                 backoff: Backoff = DEFAULT_BACKOFF, pool_size: int = 4, read_only: bool = False):
        try:
            import psycopg
            import psycopg_pool
        except ImportError:
            raise NotAStore("PostgreSQL ref tables need psycopg and psycopg_pool: "
                            "pip install 'tensorstore_ck[postgres]'") from None
        self._psycopg = psycopg
        self._psycopg_pool = psycopg_pool
        self._dsn = dsn
        self.where = _safe_dsn(dsn)
        self.namespace = namespace
        self.timeout = float(connect_timeout or _dsn_timeout(dsn) or DEFAULT_CONNECT_TIMEOUT)
        self.backoff = backoff
        self.pool_size = pool_size
        self.read_only = read_only
        self.limits = session_limits(self.timeout, backoff.budget)  # set on each session (session_limits)
        self._connect_kw = {"connect_timeout": max(1, int(self.timeout)), **_client_keepalives(dsn, self.timeout)}
        self.lock_waits = 0       # statements that gave up on a lock (lock_timeout) or ran out of time
        self.pool_waits = 0       # waits for a connection while this process's own calls held them all
        self._held: dict[int, int] = {}  # id(pool) -> its connections this process's calls hold now
        self.reconnects = 0       # transactions re-run after a lost connection
        self.unknown_commits = 0  # ... of which had sent COMMIT without an answer
        self._rng = random.Random()
        self._closed = False
        self._acked: list[bytes] = []  # tokens of acknowledged commits: deleted by the next write
        self._lock = threading.Lock()  # guards _acked and the pool's (re)creation
        self._setup()
        self._pool = self._new_pool()
        track_for_fork(self)

    # The stores found at remote locations (RefTable.location_get) are looked up before
    # the store's id, hence its namespace, is known: they live in a namespace of their own
    # (no store id has a colon).
    def location_get(self, location: str) -> bytes | None:
        return self._read(lambda t: _PgTxn(t.cur, LOCATIONS_NS).get("meta", b"location:" + location.encode()))

    def location_put(self, location: str, marker: bytes) -> None:
        self._write(lambda t: _PgTxn(t.cur, LOCATIONS_NS).put("meta", b"location:" + location.encode(),
                                                               bytes(marker)))

    # -- connections -------------------------------------------------------------------
    def _new_pool(self):
        pool_cls = self._psycopg_pool.ConnectionPool
        level = self._psycopg.IsolationLevel.SERIALIZABLE

        read_only = self.read_only
        limits = self.limits

        def configure(conn):
            _limit_session(conn, limits)
            conn.commit()
            conn.isolation_level = level
            conn.read_only = read_only  # BEGIN ... READ ONLY: the server refuses any write

        def check(conn):
            # A connection used a moment ago is alive or fails its first statement, which
            # the retry loop handles; one idle for a while (between two snapshots, across a
            # server restart) is checked with an empty query before it is handed out.
            if time.monotonic() - getattr(conn, "_tsck_used", 0.0) > CHECK_IDLE:
                pool_cls.check_connection(conn)

        pool = pool_cls(self._dsn, min_size=1, max_size=self.pool_size, open=False, name=f"tsck-refs {self.where}",
                        kwargs={"autocommit": False, **self._connect_kw},
                        configure=configure, check=check, timeout=self.timeout)
        pool.open(wait=False)
        return pool

    def _setup(self) -> None:
        """Create the table, sweep stale tokens; the first contact, so its failure says why."""
        psycopg = self._psycopg
        delays = self.backoff.delays(self._rng)
        while True:
            try:
                with psycopg.connect(self._dsn, autocommit=True, **self._connect_kw) as conn:
                    _limit_session(conn, self.limits)
                    if self.read_only:  # look, touch nothing
                        if conn.execute("SELECT to_regclass('tsck_kv')").fetchone()[0] is None:
                            raise NotAStore(f"no ref table at {self.where} (no tsck_kv table; opened read-only: "
                                            "nothing is created)")
                        return
                    if conn.execute("SELECT to_regclass('tsck_kv')").fetchone()[0] is None:
                        with conn.transaction():
                            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                            conn.execute(_SCHEMA)
                    now = conn.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchone()[0]
                    conn.execute("DELETE FROM tsck_kv WHERE ns = %s AND tbl = %s AND key < %s",
                                 (self.namespace, TOKEN_TABLE, _MS.pack(max(0, int((now - TOKEN_TTL) * 1000)))))
                return
            except (psycopg.errors.UniqueViolation, psycopg.errors.DuplicateObject, psycopg.errors.DuplicateTable,
                    psycopg.errors.LockNotAvailable) as e:
                # A creator that does not take _SCHEMA_LOCK raced this one, or one holding it
                # outlasted lock_timeout: the next try most likely finds the table made.
                delay = next(delays, None)
                if delay is None:
                    raise StorageError(f"cannot set up the ref table at {self.where}: {type(e).__name__} until the "
                                       f"retry budget ({self.backoff.budget:g}s) was spent") from None
                time.sleep(delay)
            except psycopg.Error as e:
                # libpq's message says which (refused, no such database, authentication
                # failed: it names host, port, user and database, never a password); it
                # carries no SQLSTATE. What the server refused (a credential, a database or
                # role that does not exist) fails at once; the rest is retried like an
                # outage, for the retry budget (a server failing over refuses connections).
                delay = next(delays, None) if _lost(e, None) and not _refused(e) else None
                if delay is None:
                    why = " ".join(str(e).split())[:300]
                    if getattr(e, "sqlstate", None) and not _lost(e, None):  # connected; a statement failed
                        raise StorageError(f"cannot set up the ref table at {self.where}: {type(e).__name__}: {why} "
                                           "(the server refused creating or reading tsck_kv)") from None
                    raise StorageError(f"cannot reach the ref table at {self.where}: {type(e).__name__}: {why} "
                                       "(server down, unreachable, or refused the connection)") from None
                log.warning("ref table %s: cannot connect (%s); retrying in %.2fs", self.where,
                            type(e).__name__, delay)
                time.sleep(delay)

    def _after_fork(self) -> None:
        # In a forked child the pool's connections are the parent's sessions (using them
        # would interleave two processes' bytes on one socket) and its worker threads do
        # not exist: abandon it, unclosed (closing would end the parent's sessions), and
        # connect afresh on first use.
        _ABANDONED.append(self._pool)
        self._pool = None
        self._lock = threading.Lock()
        self._acked = []
        self._held = {}  # (the parent's calls' connections)

    def _get_pool(self):
        with self._lock:
            if self._closed:
                raise StoreClosed(f"the ref table at {self.where} is closed")
            if self._pool is None:
                self._pool = self._new_pool()
            return self._pool

    def _renew_pool(self, old):
        """A pool whose connection attempts failed tries again on its own backoff (1, 2, 4,
        8 s... up to minutes), even once the server is back: after a 20 s outage its next
        attempt can be 16 s away. Replace it by one that connects at once; calls waiting on
        the old one get PoolClosed and move to the new one (_pool_after_closed)."""
        with self._lock:
            if self._closed:
                raise StoreClosed(f"the ref table at {self.where} is closed")
            if self._pool is not None and self._pool is not old:
                return self._pool  # renewed by another call meanwhile
            self._pool = self._new_pool()
            new = self._pool
        if old is not None:
            old.close(timeout=0)
        return new

    def _pool_after_closed(self, pool):
        """`pool` refused a connection as closed: the pool that replaced it, or StoreClosed."""
        with self._lock:
            current = None if self._closed else self._pool
        if current is None or current is pool:
            raise StoreClosed(f"the ref table at {self.where} is closed")
        return current

    def _down(self, why: str) -> StorageError:
        return StorageError(f"ref table at {self.where}: {why}; the server is down or unreachable "
                            f"(waited {self.timeout:g}s for it)")

    def _unknown(self, why: str) -> OutcomeUnknown:
        return OutcomeUnknown(f"ref table at {self.where}: a write's COMMIT was sent and its answer lost, and the "
                              f"table could not be asked since ({why}): it may have been applied")

    def _give_up(self, why: str, pending: bytes | None) -> StorageError:
        # After an unanswered COMMIT the write may have landed (or may still land: the
        # COMMIT can be in flight on the old session), so failure would be a guess.
        if pending is None:
            return self._down(why)
        return self._unknown(f"{why}; the server is down or unreachable, waited {self.timeout:g}s for it")

    def _pause(self, delay: float, pending: bytes | None) -> None:
        """Wait `delay` before a retry. The store's retries stopped (a tiered store's close
        with its remote away: Backoff.stop) end the wait and the call at once."""
        if not self.backoff.pause(delay):
            why = "the store is closing: its retries were stopped"
            if pending is not None:
                raise self._unknown(why) from None
            raise StorageError(f"ref table at {self.where}: {why}; the call was given up") from None

    def _what_waited(self, e: Exception) -> str:
        if isinstance(e, self._psycopg.errors.LockNotAvailable):
            return (f"a row stayed locked by another session past lock_timeout "
                    f"({self.limits['lock_timeout'] / 1000:g}s)")
        return f"a statement ran past statement_timeout ({self.limits['statement_timeout'] / 1000:g}s) or was cancelled"

    def _waited_out(self, e: Exception, write: bool, pending: bytes | None) -> StorageError:
        why = (f"{self._what_waited(e)} until the retry budget ({self.backoff.budget:g}s) was spent; "
               "a session whose client went away mid-transaction holds its locks until the server ends "
               f"it (idle_in_transaction_session_timeout "
               f"{self.limits['idle_in_transaction_session_timeout'] / 1000:g}s on this table's sessions)")
        if pending is not None:  # an earlier attempt's COMMIT went unanswered: it may have landed
            return self._unknown(why)
        what = "the write did not happen" if write else "the read was given up"
        return StorageError(f"ref table at {self.where}: {why}; {what}, try again later")

    # -- transactions ------------------------------------------------------------------
    def _run(self, fn, write: bool):
        psycopg = self._psycopg
        errors = psycopg.errors
        pool = self._get_pool()
        delays = self.backoff.delays(self._rng)
        contention, delay_c = 0, 0.002
        pending = None  # token of an attempt whose COMMIT was sent and not answered
        lost = 0
        taken: list[bytes] = []
        if write:
            self._refuse_write(self.where)
            with self._lock:
                taken, self._acked = self._acked, []
        try:
            while True:
                try:
                    conn = pool.getconn(timeout=self.timeout)
                except self._psycopg_pool.PoolClosed:
                    pool = self._pool_after_closed(pool)  # another call renewed it: go on with the new one
                    continue
                except self._psycopg_pool.PoolTimeout:
                    with self._lock:
                        busy = self._held.get(id(pool), 0)
                    if busy >= self.pool_size:
                        # Every connection is held by this process's own calls (one waits on
                        # a lock, or more threads call than pool_size): the server answers, and
                        # a fresh pool would only add connections. Wait on, within the budget.
                        self.pool_waits += 1
                        delay = next(delays, None)
                        why = (f"no free connection: all {self.pool_size} were held by this process's own calls "
                               f"for the retry budget ({self.backoff.budget:g}s; a call waiting on a lock, or more "
                               f"threads than pool_size={self.pool_size})")
                        if delay is None:
                            if pending is not None:
                                raise self._unknown(why) from None
                            raise StorageError(f"ref table at {self.where}: {why}") from None
                        log.warning("ref table %s: all %d connections held by this process's calls for %gs; "
                                    "retry in %.2fs (retry budget %gs)", self.where, self.pool_size, self.timeout,
                                    delay, self.backoff.budget)
                        self._pause(delay, pending)
                        continue
                    # No connection within the connect timeout: a server failing over takes
                    # longer; a fresh pool tries again after each delay while the retry budget lasts.
                    lost += 1
                    delay = next(delays, None)
                    if delay is None:
                        raise self._give_up(f"no connection (retry budget {self.backoff.budget:g}s spent)",
                                            pending) from None
                    log.warning("ref table %s: no connection in %gs; retry %d in %.2fs (retry budget %gs)",
                                self.where, self.timeout, lost, delay, self.backoff.budget)
                    self._pause(delay, pending)
                    pool = self._renew_pool(pool)
                    continue
                with self._lock:
                    self._held[id(pool)] = self._held.get(id(pool), 0) + 1
                token = None
                committing = False
                try:
                    with conn.cursor() as cur:
                        t = _PgTxn(cur, self.namespace)
                        if pending is not None:
                            row = t.get(TOKEN_TABLE, pending)
                            if row is not None:  # the unanswered COMMIT had landed
                                conn.rollback()
                                log.warning("ref table %s: the commit whose answer was lost had landed; "
                                            "not running it again", self.where)
                                taken = [pending]  # its transaction deleted the older ones
                                return _decode_out(row)
                        out = fn(t)
                        if hasattr(out, "__next__") and not hasattr(out, "execute"):
                            out = list(out)
                        if write:
                            token = _put_token(cur, self.namespace, _encode_out(out), taken)
                    committing = True
                    conn.commit()
                    if write:
                        taken = [token]
                    if lost:
                        log.debug("ref table %s: reconnected after %d lost connection(s)", self.where, lost)
                    return out
                except (errors.SerializationFailure, errors.DeadlockDetected, errors.UniqueViolation):
                    _rollback(conn)  # another transaction won: re-run ours from its first read
                    contention += 1
                    if contention >= 200:
                        raise TsckError(f"ref table at {self.where}: too much contention, gave up after "
                                        "200 retries") from None
                    log.debug("ref table %s: serialization conflict, re-running", self.where)
                    time.sleep(delay_c * (1 + self._rng.random()))
                    delay_c = min(0.2, delay_c * 2)
                except TsckError:
                    _rollback(conn)
                    raise
                except (errors.LockNotAvailable, errors.QueryCanceled) as e:
                    # A lock held past lock_timeout (by a session whose client went away,
                    # until the server ends it; or by someone else's long transaction), or a
                    # statement past statement_timeout: rolled back on the server, so this
                    # attempt wrote nothing. Tried again within the retry budget.
                    _rollback(conn)
                    self.lock_waits += 1
                    delay = next(delays, None)
                    if delay is None:
                        raise self._waited_out(e, write, pending) from None
                    log.warning("ref table %s: %s; retry in %.2fs (retry budget %gs)", self.where,
                                self._what_waited(e), delay, self.backoff.budget)
                    self._pause(delay, pending)
                except psycopg.Error as e:
                    if not _lost(e, conn):
                        _rollback(conn)
                        why = f"{type(e).__name__} ({getattr(e, 'sqlstate', None) or 'no sqlstate'})"
                        if pending is not None:
                            raise self._unknown(why) from None
                        raise StorageError(f"ref table at {self.where} failed: {why}") from None
                    if committing and write:
                        pending = token  # outcome unknown: the next attempt looks for the token first
                        self.unknown_commits += 1
                    lost += 1
                    self.reconnects += 1
                    delay = next(delays, None)
                    if delay is None:
                        raise self._give_up(f"lost the connection {lost} times ({type(e).__name__}; retry budget "
                                            f"{self.backoff.budget:g}s spent)", pending) from None
                    log.warning("ref table %s: connection lost (%s)%s; retry %d in %.2fs (retry budget %gs)",
                                self.where, type(e).__name__, ", commit unanswered" if pending is not None else "",
                                lost, delay, self.backoff.budget)
                    self._pause(delay, pending)
                except BaseException:
                    _rollback(conn)
                    raise
                finally:
                    conn._tsck_used = time.monotonic()
                    pool.putconn(conn)
                    with self._lock:
                        n = self._held.pop(id(pool)) - 1
                        if n:
                            self._held[id(pool)] = n
        finally:
            if taken:  # acknowledged tokens still to delete (ours, or older ones not yet deleted)
                with self._lock:
                    self._acked.extend(taken)

    def _read(self, fn):
        return self._run(fn, False)

    def _write(self, fn):
        return self._run(fn, True)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True  # from here no call makes a pool (_get_pool, _renew_pool)
            pool, self._pool = self._pool, None
            acked, self._acked = self._acked, []
        # The store's retries stopped (a tiered store closing with its remote away,
        # retry.Backoff.stop): no new request, and its pool's threads, which may be in a
        # connect that waits out the connect timeout, are not waited for: they end by
        # themselves, and the close keeps its deadline.
        away = self.backoff.stopped
        if pool is not None and acked and not away:
            try:  # best effort: leave no token behind (they would be swept after TOKEN_TTL anyway)
                with pool.connection(timeout=min(2.0, self.timeout)) as conn:
                    conn.execute("DELETE FROM tsck_kv WHERE ns = %s AND tbl = %s AND key = ANY(%s)",
                                 (self.namespace, TOKEN_TABLE, acked))
            except Exception as e:  # noqa: BLE001 - closing must not fail on a server that went away
                log.debug("ref table %s: tokens left for the sweep (%s)", self.where, type(e).__name__)
        if pool is not None:
            pool.close(timeout=POOL_STOP_AWAY if away else POOL_STOP)


def _rollback(conn) -> None:
    if not conn.closed and not conn.broken:
        try:
            conn.rollback()
        except Exception:  # noqa: BLE001 - the connection is going back to the pool, which checks it
            pass
