"""Seeded fault injection for one harness process: storage delays and failures, ref-table
delays, and kill -9 of the process itself at a chosen fault point.

SimStore wraps the process's BlockStore (open_store(wrap_storage=...), the package's
public hook; outermost, so on s3 it sits above RetryingStore and an injected failure
reaches the caller as a StorageError). slow_reftable() wraps the ref table's two
transaction entry points (RefTable._read/_write, which every ref-table operation goes
through, LMDB and PostgreSQL alike) with the same delays and kill points.

Every call is a "fault point", numbered in the order this process reaches them.
The profile (chosen by the driver from the seed) says, per point:
  delay_p, delay_max   sleep uniform(0, delay_max) with probability delay_p
  slow                 {key prefix or op: extra max delay}: aims at windows, e.g.
                       "tags/" (tag() between resolving its target and the row),
                       "delete" (a long gc deletion phase), "ref-write"
  fail_p, fail_ops     raise an OSError (EIO) with probability fail_p on those ops
  kill_at              SIGKILL this process at that fault point (None: never)
  kill_on              count only these ops toward kill_at (e.g. ["ref-write"])
  kill_after           {"op", "prefix", "p", "during_gc"}: SIGKILL at such a point with
                       probability p (only while a gc runs, if during_gc); e.g. put-done
                       of commits/: a commit landed, its ref not moved
  unreadable           {"p", "errnos"}: with probability p, a worker's fsck or gc runs
                       while 1-2 stored objects (blocks or nodes, seeded) fail every read
                       with a non-transient error (EIO, EACCES, EISDIR): below the retry
                       layer where the store is a filesystem of folders through fsspec
                       (faultyfs://, the harness's dirfs backend), else here. fsck must
                       report them as findings, gc stop naming them (UnreadableObject) or
                       finish without deleting what they hold (check.py, U1)
  kill_raced           p: SIGKILL at the first committed ref-table write ("ref-written")
                       after each race this process's put lost for its ref, with
                       probability p (a stream of its own): the put's re-encoded commit
                       moved the ref, the refused one not removed yet
  kill_upload          {"at", "n"}: a writer with a local tier: SIGKILL inside its
                       uploader at the n-th such stage (upload_point): "block", "node",
                       "commit" (after that many objects of the kind reached the remote),
                       "move" (everything sent and synced, the remote ref not moved),
                       "durable" (the remote ref moved, the tier not told yet)
  slow_head            {"max": s}: a writer with a local tier: each look at a remote object
                       (size_of, the HEAD of an upload's copy) sleeps uniform(0, s), drawn
                       from a stream of its own (no fault point: the other faults' schedule
                       stays as it was), so its uploader trails another process's on the
                       same queued snapshot of a shared tier
  down                 set by a tier writer ending "down" (Faults.remote_down): from then on
                       every request of the remote storage is refused (ECONNREFUSED), as by
                       a server that went away, and a PostgreSQL remote ref table, reached
                       through the writer's own proxy, stops answering or refuses
                       connections; its close(timeout=) must end within its bound
The random choices come from one seeded generator; threads reach points in an order
that varies, so a seed fixes the schedule of faults, not the exact interleaving.
"""

from __future__ import annotations

import errno
import faulthandler
import json
import os
import random
import signal
import sys
import threading
import time

import fsspec
from fsspec.implementations.local import LocalFileSystem

from tensorstore_ck.storage.wrappers import WrappedStore


class Faults:
    def __init__(self, profile: dict, seed: int, on_kill=None):
        self.p = dict(profile or {})
        self.seed = seed
        self.rng = random.Random(seed)
        self.unreadable_rng = random.Random(f"{seed}:unreadable")
        self.lock = threading.Lock()
        self.points = 0
        self.kill_at = self.p.get("kill_at")
        self.kill_on = set(self.p.get("kill_on") or ())  # count only these ops toward kill_at
        self.kill_points = 0
        self.on_kill = on_kill
        self.gc_busy = None  # set by the worker: is a gc marking or deleting now?
        self.armed = True
        self.upload_seen: dict[str, int] = {}  # uploader stages reached (kill_upload)
        self.down = False  # the remote storage refuses every request (a tier writer's end "down")
        # A tier writer ending "down" on a PostgreSQL remote table: its own proxy to the
        # server (worker.open_store), taken down with the storage (remote_down).
        self.pg_proxy = None
        self.pg_how: str | None = None
        self.head_rng = random.Random(f"{seed}:head")  # slow_head's delays: a stream of their own
        self.raced = None  # set by the worker: how many races its puts lost so far (kill_raced)
        self.raced_seen = 0
        self.raced_rng = random.Random(f"{seed}:raced")

    def remote_down(self) -> None:
        """The remote goes away: its storage refuses every request, and its PostgreSQL
        ref table (if it has one) stops answering (a blackout: every connection killed,
        new ones black-holed) or refuses connections (an outage), drawn from a stream of
        its own."""
        self.down = True
        if self.pg_proxy is not None and self.pg_how is None:
            self.pg_how = random.Random(f"{self.seed}:pg-down").choice(["blackout", "outage"])
            if self.pg_how == "blackout":
                self.pg_proxy.blackout()
            else:
                self.pg_proxy.outage(float("inf"))

    def upload_point(self, stage: str, key: str = "") -> None:
        """A stage inside a local tier's uploader: SIGKILL at the profile's n-th one."""
        ku = self.p.get("kill_upload")
        if not self.armed or not ku or ku["at"] != stage:
            return
        with self.lock:
            n = self.upload_seen[stage] = self.upload_seen.get(stage, 0) + 1
        if n >= ku.get("n", 1):
            if self.on_kill is not None:
                self.on_kill(n, f"upload-{stage}", key)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)  # never returns

    def slow_head(self) -> None:
        """A look at a remote object (size_of): the profile's slow_head delay, if any."""
        sh = self.p.get("slow_head")
        if not sh or not self.armed:
            return
        with self.lock:
            u = self.head_rng.random()
        time.sleep(u * sh["max"])

    def _kill_raced(self, n: int) -> None:
        """kill_raced: a table write committed after a lost race (the put's next move)."""
        with self.lock:
            races = self.raced()
            if races <= self.raced_seen:
                return
            self.raced_seen = races
            u = self.raced_rng.random()
        if u < self.p["kill_raced"]:
            if self.on_kill is not None:
                self.on_kill(n, "ref-written-after-a-lost-race", "")
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)  # never returns

    def point(self, op: str, key: str = "") -> None:
        if not self.armed:
            return
        with self.lock:
            self.points += 1
            if not self.kill_on or op in self.kill_on:
                self.kill_points += 1
            n = self.kill_points
            r_delay, r_fail, u = self.rng.random(), self.rng.random(), self.rng.random()
        ka = self.p.get("kill_after")  # {"op", "prefix", "p"}: kill right after such a point, by chance
        if op == "ref-written" and self.p.get("kill_raced") and self.raced is not None:
            self._kill_raced(n)
        if (self.kill_at is not None and n >= self.kill_at) or (
                ka and op == ka["op"] and key.startswith(ka["prefix"]) and u < ka["p"]
                and (not ka.get("during_gc") or (self.gc_busy is not None and self.gc_busy(ka["during_gc"])))):
            if self.on_kill is not None:
                self.on_kill(n, op, key)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(10)  # never returns
        extra = 0.0
        for pre, d in (self.p.get("slow") or {}).items():
            if op == pre or (key and key.startswith(pre)):
                extra = max(extra, d)
        if extra:
            time.sleep(u * extra)
        elif r_delay < self.p.get("delay_p", 0.0):
            time.sleep(u * self.p.get("delay_max", 0.0))
        if op in (self.p.get("fail_ops") or ()) and r_fail < self.p.get("fail_p", 0.0):
            raise OSError(errno.EIO, f"sim: injected {op} failure on {key or op}")


# The Faults of each worker process by pid (sim_storage, called in that process).
_HOME: dict[int, Faults] = {}
# What a saver process's storage keeps of its worker's profile: delays and failures. The
# kill points stay the worker's (the saver is killed by the worker's own schedule).
SAVER_FAULTS = ("delay_p", "delay_max", "slow", "fail_p", "fail_ops")


def sim_storage(profile: dict, seed: int, home: int, inner):
    """open_store(wrap_storage=) of a writer whose asynchronous puts go through a saver
    process, given as functools.partial(sim_storage, profile, seed, worker pid) so that
    pickle carries it there: in the worker itself its own Faults (registered in _HOME),
    in the saver the profile's delays and failures on a stream of their own."""
    f = _HOME.get(home) if os.getpid() == home else None
    if f is None:
        kept = {k: v for k, v in profile.items() if k in SAVER_FAULTS}
        f = Faults(kept, random.Random(f"{seed}:saver").getrandbits(62))
    return SimStore(inner, f)


class SimStore(WrappedStore):
    def __init__(self, inner, faults: Faults):
        super().__init__(inner)
        self.f = faults
        self.unreadable: dict[str, int] = {}  # key -> errno, raised here (no folder filesystem below)
        self._faulty: dict[str, int] = {}     # path -> errno, armed in FaultyFS.bad

    # -- the `unreadable` fault ---------------------------------------------------------
    def arm_unreadable(self, op: str) -> dict | None:
        """Before a worker's fsck or gc: with the profile's probability, make 1-2 stored
        objects unreadable until disarm_unreadable(). Returns {key: errno} (journaled)."""
        u = self.f.p.get("unreadable")
        if not u or not self.f.armed:
            return None
        rng = self.f.unreadable_rng  # a stream of its own: the other faults' schedule is unchanged
        if rng.random() >= u.get("p", 0.5):
            return None
        keys = [o.key for pre in ("blocks/", "nodes/") for _, o in zip(range(2000), self.inner.list(pre))]
        if not keys:
            return None
        errnos = u.get("errnos") or [errno.EIO]
        picked = {k: rng.choice(errnos) for k in rng.sample(sorted(keys), min(len(keys), rng.choice([1, 2])))}
        base = self._folder_store()
        if base is not None:  # a real fsspec filesystem's error, under the store's retry layer
            self._faulty = {f"{base.root}/{k}": code for k, code in picked.items()}
            FaultyFS.bad = {**FaultyFS.bad, **self._faulty}
        else:
            self.unreadable = dict(picked)
        return picked

    def disarm_unreadable(self) -> None:
        self.unreadable = {}
        if self._faulty:
            FaultyFS.bad = {p: c for p, c in FaultyFS.bad.items() if p not in self._faulty}
            self._faulty = {}

    def _folder_store(self):
        """The FsspecBlockStore on a FaultyFS under this wrapper, if there is one."""
        s = self.inner
        while s is not None and not isinstance(getattr(s, "fs", None), FaultyFS):
            s = getattr(s, "inner", None)
        return s

    def _point(self, op: str, key: str = "") -> None:
        if self.f.down:
            raise ConnectionRefusedError(errno.ECONNREFUSED, f"sim: the remote is down ({op} {key})")
        self.f.point(op, key)

    def _read_fault(self, key: str) -> None:
        code = self.unreadable.get(key)
        if code is not None:
            raise _unreadable_error(code, key)

    def get(self, key, max_bytes=None):
        self._point("get", key)
        self._read_fault(key)
        return self.inner.get(key, max_bytes)

    def open_read(self, key, max_bytes=None):
        self._point("get", key)
        self._read_fault(key)
        return self.inner.open_read(key, max_bytes)

    def put_if_absent(self, key, bufs):
        self._point("put", key)
        out = self.inner.put_if_absent(key, bufs)
        self.f.point("put-done", key)  # a kill here: the object landed, the caller never heard
        if self.f.p.get("kill_upload"):
            self.f.upload_point(key.split("/", 1)[0].rstrip("s"), key)
        return out

    def put_addressed(self, key, bufs):
        self._point("put", key)
        out = self.inner.put_addressed(key, bufs)  # local disks: named only at the next sync
        self.f.point("put-done", key)
        if self.f.p.get("kill_upload"):  # behind a local tier only the uploader writes here
            self.f.upload_point(key.split("/", 1)[0].rstrip("s"), key)
        return out

    def exists(self, key):
        self._point("exists", key)
        return self.inner.exists(key)

    def size_of(self, key):
        self.f.slow_head()
        return self.inner.size_of(key)

    def delete(self, key):
        self._point("delete", key)
        return self.inner.delete(key)

    def delete_many(self, keys, *, deadline=None):  # one point per key: a gc killed part-way through
        keys = list(keys)                             # a batch; the deadline is checked when it starts
        for k in keys:
            self._point("delete", k)
        return self.inner.delete_many(keys, deadline=deadline)

    def list(self, prefix):
        self._point("list", prefix)
        return self.inner.list(prefix)

    def sync(self):
        self._point("sync")
        out = self.inner.sync()
        self.f.point("sync-done")  # a kill here: every pending object named, no ref moved
        return out


def _unreadable_error(code: int, where: str) -> OSError:
    """What a read of an unreadable file raises: "sim: injected" in its text tells the
    checks (I4) that the environment, not the store, made it."""
    cls = {errno.EACCES: PermissionError, errno.EPERM: PermissionError, errno.EISDIR: IsADirectoryError}.get(code, OSError)
    return cls(code, f"sim: injected {os.strerror(code)}", where)


# A PostgreSQL ref-table transaction still running after HUNG_S is a hang: the table
# bounds every wait on the server (lock and idle-in-transaction timeouts, the workers'
# 1 s connect timeout and 1.5 s retry budget: a few seconds at worst), so the process
# prints its threads' stacks and exits HUNG_EXIT, which the driver reports as I4
# (before its own kill of a worker past the round's end would hide it as "stuck").
HUNG_S = 8.0
HUNG_EXIT = 3


class _Watchdog:
    def __init__(self):
        self.lock = threading.Lock()
        self.running: dict[int, tuple[float, str]] = {}
        self.n = 0
        self.thread = None

    def enter(self, what: str) -> int:
        with self.lock:
            self.n += 1
            self.running[self.n] = (time.monotonic(), what)
            if self.thread is None:
                self.thread = threading.Thread(target=self._watch, daemon=True, name="sim-hung-watch")
                self.thread.start()
            return self.n

    def leave(self, n: int) -> None:
        with self.lock:
            self.running.pop(n, None)

    def _watch(self) -> None:
        while True:
            time.sleep(0.1)
            now = time.monotonic()
            with self.lock:
                hung = [(now - t0, what) for t0, what in self.running.values() if now - t0 > HUNG_S]
            if hung:
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                sys.stderr.write(f"\nsim: HUNG: a {hung[0][1]} of the PostgreSQL ref table still running after "
                                 f"{hung[0][0]:.1f}s (bound {HUNG_S:g}s)\n")
                sys.stderr.flush()
                os._exit(HUNG_EXIT)


_WATCHDOG = _Watchdog()


def slow_reftable(rt, faults: Faults) -> None:
    """Route the ref table's transactions through fault points (delays, kill points; no
    failures: a ref-table error is a different fault, out of this harness's scope); on
    PostgreSQL each transaction is bounded (HUNG_S)."""
    read, write = rt._read, rt._write
    if type(rt).__name__ == "PostgresRefTable":
        read, write = _bounded(read, "read"), _bounded(write, "write")

    def _read(fn):
        faults.point("ref-read")
        return read(fn)

    def _write(fn):
        faults.point("ref-write")
        out = write(fn)
        faults.point("ref-written")  # committed, the caller not told yet
        return out

    rt._read, rt._write = _read, _write


def _bounded(run, what: str):
    def bounded(fn):
        n = _WATCHDOG.enter(f"{what} transaction")
        try:
            return run(fn)
        finally:
            _WATCHDOG.leave(n)
    return bounded


# -- filesystems with directories, through fsspec -----------------------------------------
# A store at dirfs:///PATH or faultyfs:///PATH goes through FsspecBlockStore (under its
# RetryingStore), not LocalBlockStore: the generic store on a filesystem with real folders.

class DirFS(LocalFileSystem):
    """A LocalFileSystem subclass under a protocol of its own: what a user registers for
    a share, an sftp or hdfs mount (folders must exist before a file is written in them)."""
    protocol = ("dirfs",)


# FAULTY_ENV: the path of a JSON file {"<absolute path>": errno, ...}: reads of those files
# fail with that errno (re-read when it changes, so a harness driver arms it for workers
# that are already running).
FAULTY_ENV = "TSCK_SIM_FAULTY"


class FaultyFS(DirFS):
    """DirFS whose reads of chosen files fail with a non-transient error, as a disk's bad
    sector (EIO), a file a user cannot read (EACCES) or a folder in a file's place (EISDIR)
    does: opening for a read raises OSError(errno), while stat (exists, size) still works,
    as it does on a real disk with a bad sector. Which files: FaultyFS.bad in this process,
    and the JSON file named by $TSCK_SIM_FAULTY."""
    protocol = ("faultyfs",)
    bad: dict = {}
    _seen: tuple = (None, {})  # (mtime_ns of the control file, what it said)

    @classmethod
    def _errno_of(cls, path: str) -> int | None:
        code = cls.bad.get(path)
        if code is not None:
            return code
        ctl = os.environ.get(FAULTY_ENV)
        if not ctl:
            return None
        try:
            m = os.stat(ctl).st_mtime_ns
        except FileNotFoundError:
            return None
        if cls._seen[0] != m:
            try:
                with open(ctl) as f:
                    cls._seen = (m, {k: int(v) for k, v in json.load(f).items()})
            except (OSError, ValueError):  # being rewritten: the next read sees it
                return None
        return cls._seen[1].get(path)

    def _open(self, path, mode="rb", *args, **kwargs):
        if "r" in mode:
            code = self._errno_of(self._strip_protocol(path))
            if code is not None:
                raise _unreadable_error(code, path)
        return super()._open(path, mode, *args, **kwargs)


def arm_faulty(ctl: str, paths: dict) -> None:
    """Write the control file (atomically): reads of `paths` {abs path: errno} fail."""
    tmp = f"{ctl}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(paths, f)
    os.replace(tmp, ctl)


fsspec.register_implementation("dirfs", DirFS, clobber=True)
fsspec.register_implementation("faultyfs", FaultyFS, clobber=True)
