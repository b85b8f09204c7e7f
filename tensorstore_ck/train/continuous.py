"""CheckpointManager(continuous=True): whether the manager's previous snapshot is durable,
asked at each step() without blocking it (manager.py's reasons())."""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future

__all__: list[str] = []  # a part of CheckpointManager (manager.py), nothing public of its own

# How often, at most, a snapshot committed in a local tier and not heard durable is looked
# up in the tier's upload queue (one read of it): the answer for one the uploader dropped
# (retention expired it before it was sent), which no durable event names.
QUEUE_LOOK_EVERY = 1.0


class DurableRoots:
    """The roots of `ref` the store said were durable (Store.on_durable: with a local tier,
    on the uploader's thread once the remote ref moved to them; without one every commit
    is durable and nothing is heard), the newest 64; ended(last) answers for the manager's
    last snapshot."""

    def __init__(self, store, ref: str):
        self.store, self.ref = store, ref
        self._lock = threading.Lock()
        self._heard: collections.deque = collections.deque(maxlen=64)
        self._looked = float("-inf")
        self._remove = store.on_durable(self._on_durable)

    def _on_durable(self, ev) -> None:
        if ev.ref == self.ref:
            with self._lock:
                self._heard.append(ev.root)

    def ended(self, last) -> bool:
        """Whether `last` (what step() returned last: a SnapshotInfo, a future, or None
        before the first) is durable, or ended without a snapshot (a failed one: the next
        takes its place). Never waits."""
        if last is None:
            return True
        if hasattr(last, "add_done_callback"):
            if not last.done():
                return False
            if last.cancelled() or last.failure() is not None:
                return True
            last = Future.result(last, 0)
        if last is None or last.durable:  # (durable at commit: a store without a tier)
            return True
        with self._lock:
            if last.root in self._heard:
                return True
        now = time.monotonic()
        if now - self._looked < QUEUE_LOOK_EVERY:
            return False
        self._looked = now
        lag = self.store.durability_lag()  # nothing queued: sent, or dropped before it was
        return lag is None or lag.snapshots == 0

    def close(self) -> None:
        self._remove()
