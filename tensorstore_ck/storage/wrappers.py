"""BlockStore wrappers: cross-cutting behaviour without flags in the backends."""

from __future__ import annotations

import errno
import io
import logging
import random
import threading
import time
import uuid
from typing import Callable, Sequence

from ..errors import ReadOnlyStore, StorageError
from ..util.retry import DEFAULT_BACKOFF, RETRY_BUDGET_ENV, Backoff, is_transient
from .base import BlockStore, check_deadline, paged_list

__all__ = ["WrappedStore", "FaultInjectingStore", "InjectedFault", "ThrottledStore", "RetryingStore",
           "ReadOnlyStorage"]

log = logging.getLogger(__name__)


class InjectedFault(OSError):
    """An error raised on purpose by FaultInjectingStore. Never retried (whatever its
    errno): a test that injects one means the caller to meet it."""
    transient = False


class WrappedStore(BlockStore):
    """Forwards everything to `inner`; subclasses override what they change."""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        # A wrapper that changes put_if_absent and says nothing of put_addressed sees
        # every put there (written at once, as put_if_absent does): nothing it means to
        # intercept slips past it through a backend's deferred path.
        if "put_if_absent" in cls.__dict__ and "put_addressed" not in cls.__dict__:
            cls.put_addressed = lambda self, key, bufs: self.put_if_absent(key, bufs)

    def __init__(self, inner: BlockStore):
        self.inner = inner
        self.url = inner.url

    def get(self, key, max_bytes=None):
        return self.inner.get(key, max_bytes)

    def open_read(self, key, max_bytes=None):
        return self.inner.open_read(key, max_bytes)

    def put_if_absent(self, key, bufs):
        return self.inner.put_if_absent(key, bufs)

    def put_addressed(self, key, bufs):
        return self.inner.put_addressed(key, bufs)

    def take_lost(self, keys):
        return self.inner.take_lost(keys)

    @property
    def local(self):
        return self.inner.local

    def exists(self, key):
        return self.inner.exists(key)

    def size_of(self, key):
        return self.inner.size_of(key)

    def move(self, key, new_key, *, deadline=None):
        return self.inner.move(key, new_key, deadline=deadline)

    def delete(self, key):
        return self.inner.delete(key)

    def delete_many(self, keys, *, deadline=None):
        return self.inner.delete_many(keys, deadline=deadline)

    @property
    def request_timeout(self) -> float:
        return self.inner.request_timeout

    def clock_now(self):
        return self.inner.clock_now()

    @property
    def pages(self):
        return self.inner.pages

    def list_page(self, prefix, start_after=None):
        return self.inner.list_page(prefix, start_after)

    def list(self, prefix):
        # Paged listings go through this wrapper's list_page, so what a subclass does to
        # a page request (fault, retry) applies to list() too.
        return paged_list(self.list_page, prefix) if self.pages else self.inner.list(prefix)

    def sync(self):
        return self.inner.sync()

    def close(self):
        return self.inner.close()


class ReadOnlyStorage(WrappedStore):
    """The storage of a store opened read-only: reads pass, every write is refused with
    ReadOnlyStore before it reaches the backend (a read-only mount, a published bucket
    without write credentials, or a caller that asked for read_only=True)."""

    def _refuse(self, what: str):
        raise ReadOnlyStore(f"the store at {self.url} is opened read-only: refused to {what}")

    def put_if_absent(self, key, bufs):
        self._refuse(f"write {key}")

    def put_addressed(self, key, bufs):
        self._refuse(f"write {key}")

    def move(self, key, new_key, *, deadline=None):
        self._refuse(f"move {key}")

    def delete(self, key):
        self._refuse(f"delete {key}")

    def delete_many(self, keys, *, deadline=None):
        self._refuse(f"delete {len(keys)} objects")

    def clock_now(self):
        # The storage's clock is read by writing a probe; a reader (gc --dry-run) makes
        # do with this host's.
        return time.time()

    def sync(self):
        pass


class FaultInjectingStore(WrappedStore):
    """Fails, delays or truncates operations, at random or on demand.

    rules: op name ("put", "get", "exists", "delete", "move", "sync", "list": a page request
    of a paged listing, its key the key it starts after) -> probability in [0, 1]
    of failing; `when(op, key) -> bool` fails deterministically instead. A failing put
    raises ENOSPC (with truncate=True, after leaving its partial bytes in tmp/, as a
    write cut short does); a failing read raises EIO (with truncate=True, returns the
    object one byte short). `armed` switches all faults on and off.
    """

    def __init__(self, inner: BlockStore, *, rules: dict | None = None,
                 when: Callable[[str, str], bool] | None = None, delay: float = 0.0,
                 truncate: bool = False, seed: int = 0):
        super().__init__(inner)
        self.rules = dict(rules or {})
        self.when = when
        self.delay = delay
        self.truncate = truncate
        self.armed = True
        self.faults = 0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _after_fork(self) -> None:  # a thread of the parent may have held it
        self._lock = threading.Lock()

    def _fault(self, op: str, key: str) -> bool:
        if not self.armed:
            return False
        if self.delay:
            time.sleep(self._rng.random() * self.delay)
        with self._lock:
            hit = (self.when is not None and self.when(op, key)) or self._rng.random() < self.rules.get(op, 0.0)
            if hit:
                self.faults += 1
        return hit

    def _put_fault(self, key: str, bufs: Sequence) -> None:
        if self._fault("put", key):
            if self.truncate:  # a write cut short: its partial bytes stay behind, never under `key`
                data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
                self.inner.put_if_absent(f"tmp/{uuid.uuid4().hex}.partial", [data[: len(data) // 2]])
            raise InjectedFault(errno.ENOSPC, f"injected: no space left writing {key}")

    def put_if_absent(self, key: str, bufs: Sequence) -> bool:
        self._put_fault(key, bufs)
        return self.inner.put_if_absent(key, bufs)

    def put_addressed(self, key: str, bufs: Sequence) -> bool:
        self._put_fault(key, bufs)
        return self.inner.put_addressed(key, bufs)

    def get(self, key, max_bytes=None):
        if self._fault("get", key):
            if self.truncate:  # a short read
                return self.inner.get(key, max_bytes)[:-1]
            raise InjectedFault(errno.EIO, f"injected: read error on {key}")
        return self.inner.get(key, max_bytes)

    def open_read(self, key, max_bytes=None):
        if self._fault("get", key):
            if self.truncate:
                return io.BytesIO(self.inner.get(key, max_bytes)[:-1])
            raise InjectedFault(errno.EIO, f"injected: read error on {key}")
        return self.inner.open_read(key, max_bytes)

    def exists(self, key):
        if self._fault("exists", key):
            raise InjectedFault(errno.ECONNRESET, f"injected: connection reset on {key}")
        return self.inner.exists(key)

    def size_of(self, key):
        if self._fault("exists", key):
            raise InjectedFault(errno.ECONNRESET, f"injected: connection reset on {key}")
        return self.inner.size_of(key)

    def move(self, key, new_key, *, deadline=None):
        if self._fault("move", key):
            raise InjectedFault(errno.EIO, f"injected: move failed on {key}")
        return self.inner.move(key, new_key, deadline=deadline)

    def delete(self, key):
        if self._fault("delete", key):
            raise InjectedFault(errno.EIO, f"injected: delete failed on {key}")
        return self.inner.delete(key)

    def delete_many(self, keys, *, deadline=None):  # each key faces the rules, as one-by-one deletes would
        for key in keys:
            check_deadline(deadline)
            self.delete(key)

    def list_page(self, prefix, start_after=None):
        if self._fault("list", start_after or ""):
            raise InjectedFault(errno.EIO, f"injected: listing of {prefix!r} failed after {start_after!r}")
        return self.inner.list_page(prefix, start_after)

    def sync(self):
        if self._fault("sync", ""):
            raise InjectedFault(errno.EIO, "injected: sync failed")
        return self.inner.sync()


class ThrottledStore(WrappedStore):
    """A per-process cap on write bandwidth (bytes/s, token bucket) and on concurrent
    writes, so snapshots can be kept off the paths the data loaders use."""

    def __init__(self, inner: BlockStore, *, bytes_per_second: float | None = None,
                 max_concurrent: int | None = None, burst: float = 0.25):
        super().__init__(inner)
        if bytes_per_second is not None and not bytes_per_second > 0:
            raise ValueError("bytes_per_second must be > 0")
        self.rate = bytes_per_second
        self.capacity = (bytes_per_second or 0) * burst  # tokens that may be spent at once
        self._tokens = self.capacity
        self._stamp = time.monotonic()
        self._lock = threading.Lock()
        self._sem = threading.BoundedSemaphore(max_concurrent) if max_concurrent else None

    def _after_fork(self) -> None:  # threads of the parent may have held them (the lock across a sleep)
        self._lock = threading.Lock()
        if self._sem is not None:
            self._sem = threading.BoundedSemaphore(self._sem._initial_value)

    def _take(self, n: int) -> None:
        if self.rate is None:
            return
        with self._lock:  # one writer reserves at a time, so the bucket is never overdrawn twice
            now = time.monotonic()
            self._tokens = min(self.capacity, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            self._tokens -= n
            debt = -self._tokens
            if debt > 0:
                time.sleep(debt / self.rate)
                self._tokens = 0.0
                self._stamp = time.monotonic()

    def _throttled(self, put, key, bufs):
        n = sum(memoryview(b).nbytes for b in bufs)
        if self._sem is None:
            self._take(n)
            return put(key, bufs)
        with self._sem:
            self._take(n)
            return put(key, bufs)

    def put_if_absent(self, key, bufs):
        return self._throttled(self.inner.put_if_absent, key, bufs)

    def put_addressed(self, key, bufs):
        return self._throttled(self.inner.put_addressed, key, bufs)




class RetryingStore(WrappedStore):
    """Retries transient failures (5xx, throttling, connection resets, timeouts: retry.py's
    is_transient) with exponential backoff and jitter; a permanent one (EIO, a permission,
    credentials, other 4xx) is raised at once, as it came. Safe for every operation because objects are
    immutable and content-addressed: a put whose first attempt landed but whose
    answer was lost is retried and reports "already there", which is true."""

    def __init__(self, inner: BlockStore, *, attempts: int | None = DEFAULT_BACKOFF.attempts,
                 base_delay: float = DEFAULT_BACKOFF.base_delay, max_delay: float = DEFAULT_BACKOFF.max_delay,
                 seed: int | None = None, budget: float = DEFAULT_BACKOFF.budget, backoff: Backoff | None = None):
        super().__init__(inner)
        # The policy the ref table retries with too (retry.py): until `budget` seconds
        # have passed since a request's first failure.
        self.backoff = backoff or Backoff(budget=budget, base_delay=base_delay, max_delay=max_delay,
                                          attempts=attempts)
        self.retries = 0
        self._rng = random.Random(seed)
        # When a request of this store last succeeded: a throttled request gives up only
        # once none has for the whole budget (_throttled_delay).
        self._progress = time.monotonic()

    @property
    def attempts(self) -> int | None:
        return self.backoff.attempts

    def _throttled_delay(self, n: int, first: float, attempt: int) -> float | None:
        """The wait before retry n (0, 1, ...) of a request the server throttled since
        `first`, or None to give up. Throttling is the server pacing its clients, not a
        fault of this request: while other requests of the store succeed the server is
        serving this client (a share of its requests answered SlowDown), and the client's
        rate limiter (storage/aimd.py) slows it to what the server serves. So the budget
        runs from the later of this request's first throttled answer and the store's last
        success: it runs out only when no request has succeeded for all of it, when no
        progress is possible."""
        if self.backoff.attempts is not None and attempt >= self.backoff.attempts:
            return None
        left = max(first, self._progress) + self.backoff.budget - time.monotonic()
        if left <= 0:
            return None
        d = min(self.backoff.max_delay, self.backoff.base_delay * 2 ** min(n, 30))
        return min(left, d * (0.5 + self._rng.random()))

    def _call(self, fn, *args):
        delays = None  # the budget's clock starts at the first failure
        attempt = 0
        t0 = time.monotonic()
        throttled = 0  # throttled answers so far, and when the first came
        first_throttled = t0
        while True:
            if self.backoff.stopped:
                raise self._stopped(fn, args, attempt, None)
            attempt += 1
            try:
                out = fn(*args)
                self._progress = time.monotonic()
                return out
            except Exception as e:  # noqa: BLE001 - filtered by retry.is_transient (the one rule)
                transient = is_transient(e)
                if transient and getattr(e, "throttled", False):
                    if not throttled:
                        first_throttled = time.monotonic()
                    delay = self._throttled_delay(throttled, first_throttled, attempt)
                    throttled += 1
                elif transient:
                    if delays is None:
                        delays = self.backoff.delays(self._rng)
                    delay = next(delays, None)
                else:
                    delay = None
                if delay is None:
                    if attempt > 1:
                        log.warning("storage %s: %s failed after %d attempts in %.1fs (retry budget %gs): %s: %s",
                                    self.url, getattr(fn, "__name__", "request"), attempt, time.monotonic() - t0,
                                    self.backoff.budget, type(e).__name__, e)
                    if not transient:
                        raise  # no retry cures it: as it came
                    raise self._spent(fn, args, e, attempt, time.monotonic() - t0) from e
                self.retries += 1
                # Silent retries are how operators lose days: each one is logged.
                log.warning("storage %s: %s failed (%s: %s); retry %d in %.2fs (%.1fs of the %gs retry budget "
                            "spent)", self.url, getattr(fn, "__name__", "request"), type(e).__name__, e, attempt,
                            delay, time.monotonic() - t0, self.backoff.budget)
                if not self.backoff.pause(delay):
                    raise self._stopped(fn, args, attempt, e) from e

    def _stopped(self, fn, args, attempts: int, e: BaseException | None) -> StorageError:
        """The policy's stop was set (the store is closing: a tier's uploader gave up on
        the remote): no retry, no new request."""
        what = getattr(fn, "__name__", "request")
        if args and isinstance(args[0], str):
            what += f" {args[0]}"
        cause = f" after {attempts} attempt(s): {type(e).__name__}: {e}" if e is not None else ""
        err = StorageError(f"storage {self.url}: {what} given up, the store is closing{cause}")
        err.transient = False
        return err

    def _spent(self, fn, args, e: BaseException, attempts: int, elapsed: float) -> StorageError:
        """A transient failure that outlasted the retry budget, as StorageError naming the
        request, what the server said (throttling, where it was), the budget and how to
        give it more: an operator's next step, where the bare error ("Please reduce your
        request rate.") left them guessing. errno kept."""
        what = getattr(fn, "__name__", "request")
        if args and isinstance(args[0], str):
            what += f" {args[0]}"
        said = getattr(e, "response_status", None)
        cause = f"{type(e).__name__}{f' ({said})' if said else ''}: {getattr(e, 'strerror', None) or e}"
        if getattr(e, "throttled", False):
            idle = time.monotonic() - self._progress
            cause = f"the server is throttling requests (no request of this store succeeded for {idle:.1f}s): {cause}"
        if self.attempts is not None and attempts >= self.attempts:
            limit, more = f"its {self.attempts} attempts", ""
        else:
            limit = f"the {self.backoff.budget:g}s retry budget"
            more = f", or open the store with a longer retry_budget (open_store(retry_budget=), ${RETRY_BUDGET_ENV})"
        text = f"storage {self.url}: {what} failed {attempts} time(s) in {elapsed:.1f}s, {limit} spent: {cause}; " \
               f"try again later{more}"
        errno_ = getattr(e, "errno", None)
        err = StorageError(errno_, text) if errno_ is not None else StorageError(text)
        err.transient = False  # retried already: a RetryingStore above this one does not start over
        return err

    def get(self, key, max_bytes=None):
        return self._call(self.inner.get, key, max_bytes)

    def open_read(self, key, max_bytes=None):
        return self._call(self.inner.open_read, key, max_bytes)

    def put_if_absent(self, key, bufs):
        return self._call(self.inner.put_if_absent, key, bufs)

    def put_addressed(self, key, bufs):
        return self._call(self.inner.put_addressed, key, bufs)

    def exists(self, key):
        return self._call(self.inner.exists, key)

    def size_of(self, key):
        return self._call(self.inner.size_of, key)

    def move(self, key, new_key, *, deadline=None):
        # A retry after a move that landed but whose answer was lost finds `key` gone:
        # False, and the caller sees the object under `new_key` (Assets.move_aside checks).
        def attempt():
            check_deadline(deadline)  # no retry starts past the caller's deadline either
            return self.inner.move(key, new_key, deadline=deadline)
        return self._call(attempt)

    def delete(self, key):
        return self._call(self.inner.delete, key)

    def delete_many(self, keys, *, deadline=None):  # idempotent: a retried batch re-deletes what is gone
        keys = list(keys)

        def attempt():
            check_deadline(deadline)  # no retry starts past the caller's deadline either
            return self.inner.delete_many(keys, deadline=deadline)
        return self._call(attempt)

    def list_page(self, prefix, start_after=None):
        return self._call(self.inner.list_page, prefix, start_after)

    def list(self, prefix):
        if self.pages:  # each page retried on its own: a retry resumes where the listing stood
            return paged_list(self.list_page, prefix)
        # One call (a local walk, fsspec's find): a retry lists again from the start, so the
        # listing is taken whole first lest a retry yield a key twice.
        return iter(self._call(lambda: list(self.inner.list(prefix))))

    def sync(self):
        return self._call(self.inner.sync)
