"""A local tier's outages: which upload failures the uploader waits out, how long its
uploads have been failing, and how far the remote store is behind the tier
(docs/design/tiers.md, "Outages").

An outage is a wait, not an end: the uploader retries a failed upload at a pause that
doubles up to a cap (tier.uploader.RETRY_PAUSE) for as long as the process lives, and
stops only for a failure that no wait cures (heals() False). While uploads fail, the
training loop is told how far the remote is behind: a SnapshotWarning at the next put
(then at most every LAG_TELL_EVERY seconds), Store.durability_lag(), the
CheckpointManager's report, and close().
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

from ..errors import (FormatError, IntegrityError, InvalidArgument, NotAStore, ReadOnlyStore, StoreClosed, TsckError,
                      UnsupportedType)
from ..util.retry import is_transient

__all__ = ["Lag", "Outage", "heals", "said_after_stop", "measure", "LAG_TELL_EVERY", "caller_level"]

# Seconds between two SnapshotWarnings of one outage (the first comes at the first put
# after an upload attempt failed).
LAG_TELL_EVERY = 300.0

# What no wait cures: a local object missing or damaged (the tier's own bytes, read again
# the same), another store (or none) at the remote's location, a store or table opened
# read-only or closed, a record or argument the code refuses.
_NEVER = (IntegrityError, FormatError, NotAStore, ReadOnlyStore, StoreClosed, InvalidArgument, UnsupportedType)


def heals(e: BaseException) -> bool:
    """May the upload that failed with `e` succeed later, unchanged? Yes for the remote
    away or failing (a connection refused or reset, a timeout, 5xx, throttling: what
    retry.is_transient retries, also once a request's retry budget is spent, which
    StorageError chains), for a ref table away, a gc holding the remote, a saver that
    died (the next try starts another), the other ranks' parts still to come. No for
    _NEVER, and for a storage failure whose cause (the deepest OSError of its chain: the
    backend's own) retry.is_transient says no retry cures (a refused credential or
    permission, a missing bucket, EIO, a full or read-only remote filesystem): those stop
    the uploader, and wait_durable() and close() raise them."""
    if isinstance(e, _NEVER):
        return False
    if not isinstance(e, OSError):
        return isinstance(e, TsckError)
    # The deepest OSError of the chain decides: a wrapper names where it failed, the
    # backend what (a 403 wrapped as "cannot open the store" is still a 403; a spent retry
    # budget chains the transient failure); below it are a library's own exceptions.
    deepest, seen = e, e.__cause__
    for _ in range(16):  # (a chain is short; a cycle is not followed)
        if seen is None:
            break
        if isinstance(seen, OSError):
            deepest = seen
        seen = seen.__cause__
    return is_transient(deepest)


def said_after_stop(e: BaseException) -> bool:
    """Is `e`, a failure that reached the uploader after close() stopped it, still to be
    raised? Only what a close cannot cause: a damaged local object or record, a remote
    of another store. The rest is the close's own doing, not an outage or a fault: the
    retries of a request given up at the stop, the remote's table or storage closed
    under a request that close()'s timeout left running (StoreClosed)."""
    return isinstance(e, (IntegrityError, FormatError, NotAStore))


class Outage:
    """Upload attempts failing since the last one that succeeded. The uploader's thread
    writes (failed, succeeded); puts and reports read."""

    def __init__(self):
        self._lock = threading.Lock()
        self.since: float | None = None  # time.monotonic() of the first failure since the last success
        self.attempts = 0  # failed attempts since the last success
        self.error: BaseException | None = None  # the last failure
        self._told: float | None = None  # when the loop was last told of this outage

    def failed(self, e: BaseException) -> None:
        with self._lock:
            if self.since is None:
                self.since, self._told = time.monotonic(), None
            self.attempts += 1
            self.error = e

    def succeeded(self) -> tuple[float, int] | None:
        """An upload succeeded -> (seconds, attempts) of the outage it ended, or None."""
        with self._lock:
            if self.since is None:
                return None
            out = (time.monotonic() - self.since, self.attempts)
            self.since, self.attempts, self.error, self._told = None, 0, None, None
            return out

    def failing(self) -> tuple[float, int, BaseException | None] | None:
        """(seconds failing, attempts, last error) while uploads fail; None otherwise."""
        with self._lock:
            if self.since is None:
                return None
            return time.monotonic() - self.since, self.attempts, self.error

    def due(self) -> bool:
        """Whether the training loop is to be told of the outage now (and it counts as told)."""
        with self._lock:
            now = time.monotonic()
            if self.since is None or (self._told is not None and now - self._told < LAG_TELL_EVERY):
                return False
            self._told = now
            return True


@dataclass(frozen=True)
class Lag:
    """How far the remote store is behind a local tier (Store.durability_lag()).

    snapshots: snapshots published in the tier and not yet in the remote store (a rank's
    parts of collective snapshots count one each); steps: the most, over the refs they
    belong to, by which the newest step published in the tier is ahead of that ref's
    newest durable step (None: unknown, or a ref none of whose snapshots is durable yet);
    seconds: since the oldest of them was published (what a loss of the node now would
    lose); failing: seconds since uploads began to fail (None: they are not failing);
    attempts: failed upload attempts since the last success; error: the last failure."""
    remote: str
    tier: str
    snapshots: int
    steps: int | None
    seconds: float
    failing: float | None
    attempts: int
    error: BaseException | None

    @property
    def lagging(self) -> bool:
        """Uploads fail while snapshots wait for them: durability lags."""
        return self.failing is not None and self.snapshots > 0

    def __str__(self) -> str:
        if not self.snapshots:
            return f"the remote store {self.remote} holds every snapshot of the local tier {self.tier}"
        steps = f"{self.steps} step(s), " if self.steps is not None else ""
        behind = (f"the remote store {self.remote} is {self.snapshots} snapshot(s), {steps}{self.seconds:.0f}s "
                  f"behind the local tier {self.tier}")
        if self.failing is None:
            return f"{behind} (uploads in progress)"
        why = f"{type(self.error).__name__}: {self.error}" if self.error is not None else "?"
        return (f"{behind}: uploads have failed for {self.failing:.0f}s ({self.attempts} attempt(s); last: {why}); "
                "those snapshots are on this node's disk only until the uploads resume (retried for as long as "
                "this process lives; a restart resumes them too)")


def _durable_step(up, ref: str):
    """The newest step of `ref` that is durable (remembered per ref by the uploader as its
    uploads end; else read from the tier's catalog once) -> int or None."""
    steps = up.durable_steps
    if ref in steps:
        return steps[ref]
    refs = up.local.refs
    rows = {root: row.get("step") for root, row in refs.catalog_iter(bad=[]) if row.get("ref") == ref}
    durable = refs.tier_rows.durable(rows)
    done = [s for r, s in rows.items() if r in durable and isinstance(s, int) and not isinstance(s, bool)]
    best = max(done) if done else None
    steps.setdefault(ref, best)
    return steps[ref]


def measure(up, tier: str) -> Lag:
    """The Lag of the uploader `up`'s tier (at `tier`, its path) now: one read of its queue
    and of the catalog rows of what is queued."""
    refs = up.local.refs
    entries = [e for _, e in refs.tier_rows.upload_pending() if not e.get("hold")]
    rows = [refs.catalog_get(e["root"], checked=False) or {} for e in entries]
    times = [r["time"] for r in rows if isinstance(r.get("time"), (int, float))]
    seconds = max(0.0, refs.wall_now() - min(times)) if times else 0.0
    newest: dict[str, int] = {}
    for e in entries:
        step, ref = e.get("step"), e.get("ref")
        if isinstance(step, int) and not isinstance(step, bool) and isinstance(ref, str) and e.get("part") is None:
            newest[ref] = max(step, newest.get(ref, step))
    steps = None
    for ref, step in newest.items():
        done = _durable_step(up, ref)
        if done is not None:
            steps = max(steps or 0, step - done)
    out = up.outage.failing()
    failing, attempts, error = out if out is not None else (None, 0, None)
    return Lag(remote=up.remote.url, tier=tier, snapshots=len(entries), steps=steps, seconds=seconds,
               failing=failing, attempts=attempts, error=error)


def caller_level() -> int:
    """warnings.warn's stacklevel naming the first frame outside the tensorstore_ck package."""
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    f, level = sys._getframe(1), 1
    while f is not None and os.path.abspath(f.f_code.co_filename).startswith(pkg):
        f, level = f.f_back, level + 1
    return level
