"""The saver process: an asynchronous put's blocks hashed, coded and written outside the
training process (open_store(saver="process")).

On threads of the training process, hashing, coding and the storage client's Python work
contend with the training loop for its GIL. With a saver process, put_snapshot(
blocking=False) stages the state as before, into reused buffers that are shared memory
(memfd, passed once to the saver as a file descriptor), and the background publisher
hands the saver the staged plan's block jobs (offsets into the buffer, no bytes): the
saver hashes, codes and writes them with its own threads, makes them durable and named
(storage sync), and answers with their addresses. Everything else stays in the training
process: the fence, the manifest nodes, the commit and the ref's move, the collective
protocol, the futures. So the saver never publishes anything, and the crash rules are
those of a put's block writes:

- the saver killed (SIGKILL, OOM) while it writes: the put fails with SaverDied and
  publishes nothing (its blocks so far are unreferenced, gc's to sweep); the next put
  starts a new saver;
- the training process killed: the saver exits at once, whatever it is doing (the
  kernel's parent-death signal on Linux; else its heartbeat's failed send, or the end of
  its socket when idle), publishing nothing; the snapshots in flight are lost as they
  would be on threads, and the next open resumes from the last published.

The saver is a plain `python -c ...main(FD)` child (not multiprocessing's
spawn, which would run the training script's main module again), started on the first
asynchronous put and stopped by Store.close().
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle

import numpy as np

from ..core.assets import Assets, PutResult
from ..errors import InvalidArgument, SaverDied, StorageError, TsckError
from ..format.chunker import job_order
from . import packparts
from .executor import Threads, only_hashed, run_copies, run_jobs

__all__ = ["SaverRecipe", "Saver", "SaverExecutor", "executor_for", "CLOSE_WAIT", "GIVE_UP_WAIT"]

# Seconds close() waits for the saver to finish and exit before it kills it.
CLOSE_WAIT = 30.0
# ... where the store's close already waited for the saver's work (a local tier's uploads,
# up to close(timeout=)): an upload still running in the saver then is given up on.
GIVE_UP_WAIT = 2.0
# While it runs a job the saver says it is alive every HEARTBEAT seconds (from a thread of
# its own: a job waiting on a slow storage request still beats). A saver silent for
# SILENCE seconds (stopped, hung, its machine thrashing) is killed and its put fails with
# SaverDied: a put must not wait forever, nor Store.close() behind it.
HEARTBEAT = 1.0
SILENCE = 60.0
# One block job: its offset in the buffer, its length, its itemsize and its kind.
_JOB = np.dtype([("off", "<i8"), ("n", "<i8"), ("itemsize", "<i4"), ("hash_only", "<i4")])
# (Not "S32": numpy's bytes strip trailing zero bytes, and 1 digest in 256 ends with one.)
_RESULT = np.dtype([("digest", "u1", (32,)), ("new", "<i1"), ("stored", "<i8")])
# One object to copy from the tier (an upload): its address and, where this process's put
# wrote it new, the length and CRC32 of its frame as written (n -1: no record; crc -1: a block
# kept raw, recorded by its length alone); the element size its tensor is coded by (0: unknown).
_COPY = np.dtype([("digest", "u1", (32,)), ("n", "<i8"), ("crc", "<i8"), ("itemsize", "<i8")])


@dataclass(frozen=True)
class SaverRecipe:
    """How the saver opens the store's storage as the training process opened it."""
    proto: str
    rest: str                      # a local store's absolute path, else the URL's rest
    storage_options: dict | None
    retry_budget: float
    write_bandwidth: float | None
    write_concurrency: int | None
    codecs: str
    workers: int
    nice: int                      # the saver's niceness (open_store(saver_nice=))
    # A local tier's path: the saver serves its uploader (copies the tier's objects to this
    # storage), not asynchronous puts (a tier's puts write the tier on threads).
    src: str | None = None
    # open_store(wrap_storage=), pickled by reference (opener._saver_can_wrap): the saver's
    # writes go through the caller's wrapper as the training process's do.
    wrap_storage: object = None

    def open_src(self) -> Assets | None:
        if self.src is None:
            return None
        from ..storage.local import LocalBlockStore
        return Assets(LocalBlockStore(self.src))

    def open_assets(self) -> Assets:
        from ..core.locate import remote_storage, wrapped
        from ..util.retry import Backoff
        if self.proto == "file":
            from ..storage.local import LocalBlockStore
            storage = LocalBlockStore(self.rest)
        else:
            storage = remote_storage(self.proto, self.rest, self.storage_options, Backoff(budget=self.retry_budget))
        return Assets(wrapped(storage, self.write_bandwidth, self.write_concurrency, self.wrap_storage),
                      codecs=self.codecs)


# What a put or an upload hears after its saver died.
_PUT_THEN = "nothing was published, and the next snapshot starts a new saver"
_UPLOAD_THEN = "the upload is tried again with a new saver (nothing is moved remotely before every object is there)"

# The saver's program (not `-m tensorstore_ck.write.saver`: the package imports this module first).
# Its first lines ask the kernel for a signal when the training process dies (Linux's
# PR_SET_PDEATHSIG), before the package's import (about 1 s): argv is FD PARENT_PID.
# The signal also comes when only the thread that started the saver ends (the kernel's
# "parent" is a thread), so its handler exits only once the parent pid is gone; a parent
# that died before prctl() is seen by the same check, right after it.
_CHILD = """
import os, signal, sys
def _parent_gone(*_):
    if os.getppid() != int(sys.argv[2]):
        os._exit(3)
signal.signal(signal.SIGUSR2, _parent_gone)
if sys.platform.startswith("linux"):
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGUSR2), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # no prctl: the socket's end and the heartbeat's failed send still end the saver
_parent_gone()
from tensorstore_ck.write.saver import main
sys.exit(main(sys.argv[1:2]))
"""


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Saver:
    """The training process's end: starts the saver on first use (again after it died),
    sends it the buffers' descriptors once and each staged plan's block jobs."""

    def __init__(self, recipe: SaverRecipe):
        self.recipe = recipe
        self.proc: subprocess.Popen | None = None
        self.conn: Connection | None = None
        self.mapped: set[int] = set()  # ids of the buffers this saver has mapped
        self.started = 0  # savers started so far (a restart after one died counts)
        self.lock = threading.Lock()  # one exchange with the saver at a time
        self.dropped: list[int] = []  # buffers the staging pool let go, for the saver to unmap
        self.dropped_lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def _start(self, doing: str, then: str) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        # glibc's malloc hands each block-sized buffer (a frame read, a coded copy) back to
        # the kernel when it is freed and faults fresh pages in for the next one: in a
        # saver, whose heap never warms up as a long-lived training process's does, that was
        # ~2 page faults per 4 KiB it uploads and half its CPU (1.2 GB of fresh pages per
        # 0.5 GB). Kept in its heap instead: every buffer from the heap (glibc takes no
        # threshold past 32 MiB, and a pack is 64 MiB: no mmap at all), and freed memory
        # returned only past 256 MiB. A caller's own settings win.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
        env.setdefault("MALLOC_MMAP_MAX_", "0")
        env.setdefault("MALLOC_TRIM_THRESHOLD_", str(256 << 20))
        # A caller's storage wrapper comes by reference to its module: the saver imports
        # what this process can (its sys.path after the package's own root).
        importable = [p for p in sys.path if p and os.path.isdir(p)] if self.recipe.wrap_storage is not None else []
        given = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([_package_root()] + importable + given)
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(theirs.fileno()), str(os.getpid())],
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=env)
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        self.mapped = set()
        self.started += 1
        self.conn.send(self.recipe)
        self._reply(doing, then)  # ("ready",) once its storage is open; its failure to open is raised here

    def _reply(self, doing: str, then: str):
        """The saver's answer to the last request (its heartbeats skipped)."""
        while True:
            try:
                if not self.conn.poll(SILENCE):
                    code = self._reap()
                    raise SaverDied(f"the saver process was silent for {SILENCE:g} s (stopped or hung) while it "
                                    f"{doing} and was killed ({_exit_text(code)}); {then}")
                msg = self.conn.recv()
            except (EOFError, OSError):
                code = self._reap()
                raise SaverDied(f"the saver process exited ({_exit_text(code)}) while it {doing}; {then}") from None
            if msg[0] == "err":
                raise _error_from(msg[1])
            if msg[0] != "alive":
                return msg

    def _ask(self, msg: tuple, doing: str, then: str, before=None):
        """Send `msg` (after before(), under the lock, the saver started if it is not
        running) and return the saver's answer. SaverDied if it dies meanwhile."""
        with self.lock:
            try:
                if self.proc is None or self.proc.poll() is not None:
                    self._reap()
                    self._start(doing, then)
                self._send_drops()
                if before is not None:
                    before()
                self.conn.send(msg)
            except (BrokenPipeError, ConnectionResetError):
                self._reap()
                raise SaverDied(f"the saver process was gone before it {doing}; {then}") from None
            return self._reply(doing, then)

    def _reap(self) -> int | None:
        """The saver is gone (or must go): kill what is left of it -> its exit code."""
        proc, conn, self.proc, self.conn = self.proc, self.conn, None, None
        if conn is not None:
            conn.close()
        if proc is None:
            return None
        if proc.poll() is None:
            proc.kill()
        return proc.wait()

    def write_blocks(self, plan, shared, owns=None, fence: int | None = None) -> None:
        """Have the saver hash and write the block jobs of `plan`, staged in `shared`
        (staging.SharedBuffer); owns(leaf, i) as run_block_jobs takes it. Fills each
        leaf's results in order. SaverDied if the saver dies meanwhile."""
        jobs, leaves = [], []
        for leaf in job_order(plan.leaves):
            at = shared.offset_of(leaf.raw)  # every leaf of a staged plan is a view of its buffer
            for i, (a, b) in enumerate(leaf.ranges):
                jobs.append((at + a, b - a, leaf.itemsize, only_hashed(leaf, i, owns)))
                leaves.append(leaf)
        table = np.array(jobs, dtype=_JOB)

        def map_buffer():
            if shared.id not in self.mapped:
                self.conn.send(("map", shared.id, shared.nbytes))
                send_handle(self.conn, shared.fd, self.proc.pid)
                self.mapped.add(shared.id)
        msg = self._ask(("write", shared.id, table.tobytes(), fence), "wrote this snapshot's blocks", _PUT_THEN,
                        before=map_buffer)
        got = np.frombuffer(msg[1], dtype=_RESULT)
        if len(got) != len(table):  # pragma: no cover - a saver out of step with its jobs
            raise StorageError(f"the saver process answered {len(got)} blocks for {len(table)}; nothing was published")
        for leaf, job, r in zip(leaves, table, got):
            leaf.results.append(PutResult(r["digest"].tobytes(), bool(r["new"]), int(job["n"]),
                                          counted=not job["hash_only"], stored=int(r["stored"])))

    def copy(self, kind: str, digests: list, fence: int | None, written: list, sync: bool,
             itemsizes: list | None = None) -> list[bool]:
        """Have the saver copy objects `digests` of `kind` from the local tier to its
        storage (Assets.copy_from, each with its `written` record or None and its element
        size or 0), then, with `sync`, sync that storage -> whether each was written.
        SaverDied if the saver dies meanwhile (the upload is tried again)."""
        table = np.zeros(len(digests), dtype=_COPY)
        for row, d, w, k in zip(table, digests, written, itemsizes or [0] * len(digests)):
            row["digest"] = np.frombuffer(d, dtype=np.uint8)
            row["n"], row["crc"] = (-1, -1) if w is None else (w[0], -1 if w[1] is None else w[1])
            row["itemsize"] = k
        msg = self._ask(("copy", kind, table.tobytes(), fence, sync), "uploaded a snapshot", _UPLOAD_THEN)
        return [bool(x) for x in np.frombuffer(msg[1], dtype=np.int8)]

    def forget(self, buf_id: int) -> None:
        """The staging pool dropped a buffer: the saver unmaps it before its next job (not
        now: the caller is the training thread, and a job may hold the socket)."""
        with self.dropped_lock:
            self.dropped.append(buf_id)

    def _send_drops(self) -> None:
        with self.dropped_lock:
            dropped, self.dropped = self.dropped, []
        for buf_id in dropped:
            if buf_id in self.mapped:
                self.mapped.discard(buf_id)
                self.conn.send(("drop", buf_id))

    def close(self, timeout: float = CLOSE_WAIT) -> None:
        """Tell the saver to exit once its current job is done; kill it past `timeout`
        (also when a job still holds it then: an upload the store's close gave up on)."""
        if not self.lock.acquire(timeout=timeout):
            proc = self.proc
            if proc is not None and proc.poll() is None:
                proc.kill()  # the job's caller hears SaverDied
            return
        try:
            if self.proc is None:
                return
            try:
                self.conn.send(("close",))
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
            self._reap()
        finally:
            self.lock.release()

    def after_fork(self) -> None:
        """In a forked child: the saver and its socket are the parent's. The child's copy of
        the socket is closed: the saver sees its end (EOF) only once every copy is gone, so a
        forked DataLoader worker must not keep a dead trainer's saver alive."""
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
        self.proc = self.conn = None
        self.mapped = set()
        self.lock = threading.Lock()
        self.dropped, self.dropped_lock = [], threading.Lock()


class _Leaves:
    """A part of a plan's block jobs, to write on their own (an executor takes it as a plan)."""

    def __init__(self, leaves: list):
        self.leaves = leaves


class SaverExecutor:
    """Block jobs and copies in the saver process (roles.Executor): a plan staged in shared
    memory (an asynchronous put's) has its blocks written there, packs made again at write
    time (not in the staging buffer) and any other plan on `threads`; an upload's copies
    all run there."""

    shares_memory = True  # the staging buffers are memfd shared memory the saver maps

    def __init__(self, saver: Saver, threads: Threads):
        self.saver, self.threads = saver, threads

    def write_blocks(self, plan, assets: Assets, owns=None, progress=None, fence: int | None = None) -> None:
        if plan.shared is None or progress is not None:
            return self.threads.write_blocks(plan, assets, owns=owns, progress=progress, fence=fence)
        # Packs made again at write time, and blocks of unchanged tensors (only looked for;
        # their bytes are not in the shared buffer): here.
        own = packparts.gathered(plan) + [x for x in plan.leaves if x.known is not None]
        if own:
            self.threads.write_blocks(_Leaves(own), assets, owns=owns, fence=fence)
            mine = set(map(id, own))
            rest = _Leaves([x for x in plan.leaves if id(x) not in mine])
            if rest.leaves:
                self.saver.write_blocks(rest, plan.shared, owns=owns, fence=fence)
        else:
            self.saver.write_blocks(plan, plan.shared, owns=owns, fence=fence)

    def copy(self, dst: Assets, src: Assets, kind: str, digests: list, fence: int | None, written: list,
             sync: bool, itemsizes: list | None = None) -> list[bool]:
        # The saver opened its own ends of both (SaverRecipe: the remote, the tier as src).
        return self.saver.copy(kind, digests, fence, written, sync, itemsizes=itemsizes)

    def forget(self, buf_id: int) -> None:
        self.saver.forget(buf_id)


def executor_for(saver: Saver | None, owner):
    """The one executor of a store's publisher or a tier's uploader, chosen once: the saver
    process where there is one, else threads of `owner`'s pool (Threads)."""
    threads = Threads(owner)
    return threads if saver is None else SaverExecutor(saver, threads)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "not started"
    if code < 0:
        import signal
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _error_payload(e: BaseException) -> bytes:
    """An error of the saver as bytes the training process turns back into it (its own
    type where it pickles and unpickles, else a StorageError naming it)."""
    try:
        data = pickle.dumps(e)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001 - an error type that does not survive pickling
        return pickle.dumps(StorageError(f"in the saver process: {type(e).__name__}: {e}"))


def _error_from(payload: bytes) -> BaseException:
    try:
        err = pickle.loads(payload)
    except Exception as e:  # noqa: BLE001
        return StorageError(f"the saver process failed and its error could not be read: {type(e).__name__}: {e}")
    return err if isinstance(err, BaseException) else TsckError(f"the saver process failed: {err!r}")


# -- the saver's side -------------------------------------------------------------------------

def _run_jobs(assets: Assets, pool: ThreadPoolExecutor, view: np.ndarray, table: np.ndarray, fence) -> bytes:
    jobs = ((view[int(j["off"]):int(j["off"]) + int(j["n"])], int(j["n"]), int(j["itemsize"]), bool(j["hash_only"]),
             True) for j in table)
    results = run_jobs(assets, pool, jobs, fence)
    out = np.zeros(len(results), dtype=_RESULT)
    for i, r in enumerate(results):
        out[i]["digest"] = np.frombuffer(r.digest, dtype=np.uint8)
        out[i]["new"], out[i]["stored"] = r.new, r.stored
    assets.sync()  # the blocks durable and named before the training process writes a node over them
    return out.tobytes()


def _run_copies(dst: Assets, src: Assets, pool: ThreadPoolExecutor, kind: str, table: np.ndarray, fence,
                sync: bool) -> bytes:
    def written(row):
        n, crc = int(row["n"]), int(row["crc"])
        return None if n < 0 else (n, None if crc < 0 else crc)
    rows = ((row["digest"].tobytes(), written(row), int(row["itemsize"])) for row in table)
    return np.array(run_copies(dst, src, pool, kind, rows, fence, sync), dtype=np.int8).tobytes()


class _Heartbeat:
    """("alive",) every HEARTBEAT seconds while a job runs; stopped (and joined) before
    the job's answer is sent, so the two never interleave on the socket."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="tsck-saver-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(HEARTBEAT):
            try:
                self.conn.send(("alive",))
            except OSError:
                # The training process is gone: the job it holds is no one's (only that
                # process publishes), so the saver ends now rather than writing it out.
                os._exit(3)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def serve(conn: Connection) -> None:
    """The saver's loop: map buffers, run block jobs, answer; exit at "close" or when the
    training process's end of the socket closes."""
    import mmap
    try:
        recipe = conn.recv()
    except EOFError:
        return
    except Exception as e:  # noqa: BLE001 - a recipe this process cannot load (a wrapper's module): said
        conn.send(("err", _error_payload(InvalidArgument(
            f"the saver process could not load how to open the storage (open_store(wrap_storage=) must be "
            f"importable there): {type(e).__name__}: {e}"))))
        return
    try:
        # Below the training process: the loop wins the cores, the saver takes what they
        # leave. (A thread cannot be deprioritised so: it would hold the GIL the loop needs.)
        os.nice(recipe.nice)
        assets = recipe.open_assets()
        src = recipe.open_src()
    except BaseException as e:  # noqa: BLE001 - said to the training process, which raises it
        conn.send(("err", _error_payload(e)))
        return
    pool = ThreadPoolExecutor(recipe.workers, thread_name_prefix="tsck-saver")
    views: dict[int, np.ndarray] = {}
    conn.send(("ready",))
    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return  # the training process is gone (ECONNRESET: it left unread data behind)
            if msg[0] == "map":
                fd = recv_handle(conn)
                try:
                    views[msg[1]] = np.frombuffer(mmap.mmap(fd, msg[2]), dtype=np.uint8)
                finally:
                    os.close(fd)
            elif msg[0] == "drop":
                views.pop(msg[1], None)
            elif msg[0] in ("write", "copy"):
                with _Heartbeat(conn):
                    try:
                        if msg[0] == "write":
                            _, buf_id, jobs, fence = msg
                            out = _run_jobs(assets, pool, views[buf_id], np.frombuffer(jobs, dtype=_JOB), fence)
                        else:
                            _, kind, table, fence, sync = msg
                            out = _run_copies(assets, src, pool, kind, np.frombuffer(table, dtype=_COPY), fence, sync)
                        reply = ("ok", out)
                    except BaseException as e:  # noqa: BLE001 - the put's failure, raised in the training process
                        reply = ("err", _error_payload(e))
                try:
                    conn.send(reply)
                except OSError:
                    return  # the training process is gone
            elif msg[0] == "close":
                return
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        assets.storage.close()
        if src is not None:
            src.storage.close()


def main(argv: list[str]) -> int:
    import signal
    # Ctrl-C in a terminal reaches the whole foreground process group: the training
    # process decides what an interrupt means (close() waits for the snapshot in flight);
    # the saver goes when the training process does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    try:
        serve(conn)
    finally:
        conn.close()
    return 0
