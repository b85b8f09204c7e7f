"""The presence record: which blocks and nodes one Store saw present, under which
gc deletion epoch, so an incremental snapshot asks storage only about what changed.

An object seen present (a HEAD that found it whole, or this Store's own write) is
recorded under the gc epoch read *before* it was seen. A writer fenced on that same
even epoch may reference it without asking storage again: no deletion phase can have
run since (one would have moved the epoch), and one that starts before the ref moves
fences the move, whose re-validation asks storage for every object. Assets
(assets.py) owns one per store and consults it on every put and read.
"""

from __future__ import annotations

import threading

__all__ = ["Presence"]


class Presence:
    """Blocks and nodes this Store saw present, each valid only under the gc deletion
    epoch read *before* it was seen (docs/design/presence.md): a HEAD that
    found it whole, or this Store's own write. A writer that fenced on that same even
    epoch may reference such an object without asking storage again: no deletion phase
    can have run since it was seen (one would have moved the epoch), and one that starts
    before the ref moves fences the move, whose re-validation asks storage for every
    object. In memory only, per Store; another epoch starts it afresh.

    warm(fence): a snapshot was published under this epoch, so whatever it held is
    known here and a miss is most likely new content (written without asking first)."""

    MAX = 1 << 20  # per kind: ~100 bytes each; past it the record starts afresh

    def __init__(self, kind_names: dict[int, str]):
        # frame kind -> the kind's name in what gc reports removed (carry): given by
        # assets.py, the one module that knows how kinds are named in storage
        self._names = dict(kind_names)
        self._lock = threading.Lock()
        # (epoch, {kind: set of digests}, warm): replaced whole, so a reader without the
        # lock never pairs one epoch with another epoch's entries
        self._state: tuple = (None, {}, False)
        self.hits = 0  # lookups answered from the record (tests, the harness)

    def known(self, kind: int, d: bytes, fence: int | None) -> bool:
        if fence is None or fence % 2:
            return False
        epoch, sets, _warm = self._state
        if epoch != fence or d not in sets.get(kind, ()):
            return False
        self.hits += 1
        return True

    def warm(self, fence: int | None) -> bool:
        epoch, _sets, warm = self._state
        return warm and fence is not None and epoch == fence

    def add(self, kind: int, d: bytes, fence: int | None) -> None:
        """`d` was seen present by a writer that read `fence` before it looked."""
        if fence is None or fence % 2:
            return  # odd: a deletion phase may run; nothing seen now is trusted later
        with self._lock:
            epoch, sets, warm = self._state
            if epoch is None or fence > epoch:  # the epoch moved: what was seen before may be gone
                epoch, sets, warm = fence, {}, False
                self._state = (epoch, sets, warm)
            if fence != epoch:
                return  # an older epoch's writer: its sight proves nothing under this one
            if len(sets.get(kind, ())) >= self.MAX:  # bounded memory: start afresh (cold)
                sets = {}
                self._state = (epoch, sets, False)
            sets.setdefault(kind, set()).add(d)

    def warm_for_reading(self) -> bool:
        """Whether anything is recorded (else a reader need not read the epoch)."""
        return any(self._state[1].values())

    def settle(self, fence: int) -> None:
        """A snapshot fenced on `fence` was published: every object it holds was seen."""
        with self._lock:
            epoch, sets, _warm = self._state
            if epoch == fence:
                self._state = (epoch, sets, True)

    def discard(self, kind: int, d: bytes) -> None:
        """`d` was found missing or damaged: ask storage next time."""
        with self._lock:
            self._state[1].get(kind, set()).discard(d)

    def carry(self, before: int, after: int, removed: dict) -> None:
        """This Store's own gc opened the deletion phase at even epoch `before` (its freeze
        moved it to before + 1) and closed it at `after` = before + 2, deleting at most
        `removed` ({"blocks": digests, "nodes": ...}): what was recorded under `before` and
        is not in `removed` is still there (no other phase ran: it would have moved the
        epoch further), so it stays recorded, under `after`. Anything else: nothing carried
        (the next write under a newer fence starts the record afresh)."""
        if after != before + 2 or before % 2:
            return
        with self._lock:
            epoch, sets, warm = self._state
            if epoch != before:
                return
            kept = {k: v - set(removed.get(self._names[k], ())) for k, v in sets.items()}
            self._state = (after, kept, warm)

    def forget(self) -> None:
        """Start afresh: a sync failed, so this Store's own writes since the last one may
        not be stored."""
        with self._lock:
            self._state = (None, {}, False)

    def after_fork(self) -> None:
        """In a forked child: the lock may have been held by a thread that is not there."""
        self._lock = threading.Lock()
