"""The one backoff policy for transient failures of a backend.

Storage requests (storage/wrappers.py RetryingStore) and ref-table transactions
(refs/postgres.py) retry with the same policy, bounded by time, not by a count: a
failed request is tried again until `budget` seconds have passed since its first
failure (the attempts' own time included), waiting base_delay * 2**n between tries,
capped at max_delay, times a jitter in [0.5, 1.5) (so many processes that lost one
server do not come back in lockstep). The default budget, 60 s, rides out what
operators see in practice: a PostgreSQL failover to a standby (10-60 s), S3
throttling (SlowDown for tens of seconds), a load balancer's restart. A failure that
retrying cannot cure (a refused credential, a missing bucket, a full disk) is raised
at once whatever the budget: the callers only retry what is_transient() says a retry
may cure.

Which failures are transient (is_transient, the one rule every storage backend's
errors go through; docs/design/storage.md, "Which errors are retried"):

    retried     a backend's own mark `e.transient` (S3: 5xx, 408, 429, throttling codes);
                ConnectionError, TimeoutError; errnos of the network or of a busy
                resource (ECONNRESET, ECONNREFUSED, ETIMEDOUT, EHOSTUNREACH, EPIPE,
                EAGAIN, EBUSY, EINTR, EREMOTEIO, ...); an OSError with no errno and no
                mark (a network backend's failure it did not describe); a non-OSError
                whose type names a timeout or a lost connection
    at once     FileNotFoundError, FileExistsError, PermissionError (EACCES, EPERM, a
                403), IsADirectoryError, NotADirectoryError; every other errno (EIO: a
                bad sector is not cured by asking again; ENOSPC, EDQUOT, EROFS, EINVAL,
                ENAMETOOLONG, ...); refused credentials (the S3 store turns botocore's
                NoCredentialsError and its kin into PermissionError marked so); anything
                else

A mark wins over the rest: a backend that knows its protocol (S3's status codes) says
so, and a StorageError that already spent a retry budget is marked not transient.

open_store(retry_budget=seconds) sets the budget of a store's storage and ref table;
$TSCK_RETRY_BUDGET is its default (so the `tsck` CLI and scripts that do not pass it
take it from the environment).

A policy may carry a `stop` event (Backoff.stoppable): once it is set, a retry loop
gives up at once instead of waiting, and starts no new request. A local tier's
uploader sets it when the store is closed (tier/uploader.py): a close with the remote away
must not wait out the budget.
"""

from __future__ import annotations

import errno
import math
import os
import random
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

from ..errors import InvalidArgument

__all__ = ["Backoff", "DEFAULT_BACKOFF", "DEFAULT_RETRY_BUDGET", "RETRY_BUDGET_ENV", "backoff_for", "is_transient"]

DEFAULT_RETRY_BUDGET = 60.0
RETRY_BUDGET_ENV = "TSCK_RETRY_BUDGET"


@dataclass(frozen=True)
class Backoff:
    """budget: seconds from the first failure after which no new attempt starts.
    attempts: an optional cap on the attempts in all (None: the budget alone decides).
    stop: once set, no retry and no new request (pause() says so)."""
    budget: float = DEFAULT_RETRY_BUDGET
    base_delay: float = 0.05
    max_delay: float = 5.0
    attempts: int | None = None
    stop: threading.Event | None = field(default=None, compare=False, repr=False)

    def stoppable(self) -> "Backoff":
        """This policy with a stop event of its own (the shared default has none)."""
        return replace(self, stop=threading.Event())

    @property
    def stopped(self) -> bool:
        return self.stop is not None and self.stop.is_set()

    def pause(self, seconds: float) -> bool:
        """Wait `seconds` before a retry -> whether to retry: False as soon as `stop` is
        set (the wait ends then, not when it would have)."""
        if self.stop is None:
            time.sleep(seconds)
            return True
        return not self.stop.wait(seconds)

    def delays(self, rng: random.Random | None = None,
               clock: Callable[[], float] = time.monotonic) -> Iterator[float]:
        """The waits before each retry, as long as the budget lasts: the clock starts at
        the first next() (the first failure); a wait that would end past the budget is
        cut to what is left, and none is given once nothing is left."""
        rng = rng or random
        start = clock()
        delay = self.base_delay
        n = 1
        while self.attempts is None or n < self.attempts:
            left = start + self.budget - clock()
            if left <= 0:
                return
            yield min(left, min(self.max_delay, delay * (0.5 + rng.random())))
            delay = min(self.max_delay, delay * 2)
            n += 1


DEFAULT_BACKOFF = Backoff()


def check_budget(budget) -> float:
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not (0 <= budget < math.inf):
        raise InvalidArgument(f"retry_budget must be a number of seconds >= 0, got {budget!r}")
    return float(budget)


def backoff_for(retry_budget: float | None) -> Backoff:
    """The policy of a store opened with retry_budget= (None: $TSCK_RETRY_BUDGET, else
    DEFAULT_RETRY_BUDGET). 0 retries nothing."""
    if retry_budget is None:
        env = os.environ.get(RETRY_BUDGET_ENV)
        if env is None or not env.strip():
            return DEFAULT_BACKOFF
        try:
            retry_budget = float(env)
        except ValueError:
            raise InvalidArgument(f"${RETRY_BUDGET_ENV} must be a number of seconds, got {env!r}") from None
    return Backoff(budget=check_budget(retry_budget))


# A network's or a busy resource's errnos: the same request may succeed a moment later.
TRANSIENT_ERRNOS = frozenset(getattr(errno, n) for n in (
    "ECONNRESET", "ECONNREFUSED", "ECONNABORTED", "ETIMEDOUT", "EHOSTUNREACH", "EHOSTDOWN",
    "ENETUNREACH", "ENETDOWN", "ENETRESET", "EPIPE", "EAGAIN", "EWOULDBLOCK", "EBUSY", "EINTR",
    "EINPROGRESS", "EREMOTEIO", "ENOBUFS") if hasattr(errno, n))
_PERMANENT_TYPES = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)
_TRANSIENT_NAMES = ("Timeout", "Connection", "ServerDisconnected", "ClientPayloadError")


def is_transient(e: BaseException) -> bool:
    """May a retry of the request that raised `e` succeed? The module docstring's table."""
    if isinstance(e, OSError):
        marked = getattr(e, "transient", None)
        if isinstance(marked, bool):  # the backend knew (S3BlockStore: the status code)
            return marked
        if isinstance(e, _PERMANENT_TYPES):
            return False
        if isinstance(e, (ConnectionError, TimeoutError)):
            return True
        if e.errno is None:
            return True
        return e.errno in TRANSIENT_ERRNOS
    return any(w in type(e).__name__ for w in _TRANSIENT_NAMES)
