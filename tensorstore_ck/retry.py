"""The one backoff policy for transient failures of a backend.

Storage requests (storage/wrappers.py RetryingStore) and ref-table transactions
(refs/postgres.py) retry with the same policy: `attempts` tries in all, the n-th
wait is base_delay * 2**n (capped at max_delay) times a jitter in [0.5, 1.5), so
many processes that lost one server do not come back in lockstep. With the
defaults the waits add up to about 1.5 s: a server that restarts in about a
second is ridden out; one that stays down is reported after that.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Iterator

__all__ = ["Backoff", "DEFAULT_BACKOFF"]


@dataclass(frozen=True)
class Backoff:
    attempts: int = 6
    base_delay: float = 0.05
    max_delay: float = 5.0

    def delays(self, rng: random.Random | None = None) -> Iterator[float]:
        """The waits before attempts 2..attempts (attempts - 1 of them)."""
        rng = rng or random
        delay = self.base_delay
        for _ in range(self.attempts - 1):
            yield delay * (0.5 + rng.random())
            delay = min(self.max_delay, delay * 2)


DEFAULT_BACKOFF = Backoff()
