"""Reading through a local tier (docs/design/tiers.md, "Recovery"): which of two tiers'
snapshots is the newer, the tier's objects read with the remote store behind them,
never the damaged bytes, and which tiers served one checkout (its log line)."""

from __future__ import annotations

import logging
import threading

from ..core.core import Core
from ..errors import IntegrityError, TsckError, UnreadableObject

__all__ = ["newer", "ReadThrough", "Served", "tally"]

log = logging.getLogger(__name__)


def newer(a: dict | None, b: dict | None) -> bool:
    """Whether catalog row `a` names a newer snapshot than row `b` (rows of two tiers'
    tips): the higher step, then (no step on one side, or the same step) the later
    publication time; a tie is not newer. The step first because it is the training's
    own order and is the same number on every host, where the times of two tiers can
    come from two hosts' clocks (a node's tier and the uploads of another node)."""
    if a is None:
        return False
    if b is None:
        return True
    sa, sb = a.get("step"), b.get("step")
    if isinstance(sa, int) and isinstance(sb, int) and sa != sb:
        return sa > sb
    return float(a.get("time", 0.0)) > float(b.get("time", 0.0))


class ReadThrough:
    """The local tier's Assets for reading, with the remote store behind them: a block,
    node or commit missing locally, or failing its check there (frame, length, BLAKE3
    against its address: an IntegrityError, or an unreadable file), is read from the
    remote store instead, and checked there as any read is; never the damaged bytes.
    Each such fall-through is logged once per object. Everything else (writes, gc, fsck,
    the uploader) sees the local Assets alone, so a damaged local copy is still found
    and reported there."""

    def __init__(self, local, remote: Core, evicted=None):
        self.local, self.remote = local, remote
        # -> the roots the tier's budget evicted (TierTable.evicted): their local copies are
        # gone on purpose, so a fall-through for them is the plan, not news (logged at debug).
        self.evicted = evicted
        self._told: set[bytes] = set()
        self.missing = 0  # objects read from the remote because the tier lacks them
        self._told_missing = False
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.local, name)

    def after_fork(self) -> None:
        self._lock = threading.Lock()  # the parent's may have been held by a thread not here

    def _fell(self, what: str, d: bytes, err: BaseException) -> None:
        # A damaged copy is news about this disk: told once per object. A missing one is
        # the ordinary case after the tier was lost or trimmed to its budget (every block
        # of a checkout): told once, then counted, not one line per block; one of a
        # snapshot the budget evicted is the plan, not news: counted, not told.
        missing = getattr(err, "reason", None) == "missing"
        if missing:
            evicted = self.evicted is not None and self._was_evicted(d, err)
            with self._lock:
                self.missing += 1
                quiet = evicted or self._told_missing
                self._told_missing = self._told_missing or not evicted
            if evicted:
                log.debug("local tier: %s %s of an evicted snapshot: reading it from %s", what, d.hex()[:16],
                          self.remote.url)
            if not quiet:
                log.warning("local tier: %s %s is missing; reading it, and any other object the tier lacks, "
                            "from %s", what, d.hex()[:16], self.remote.url)
            return
        with self._lock:
            if d in self._told:
                return
            self._told.add(d)
        log.warning("local tier: %s %s failed its check (%s); reading it from %s", what, d.hex()[:16], err,
                    self.remote.url)

    def _was_evicted(self, d: bytes, err: BaseException) -> bool:
        try:
            evicted = self.evicted()
            snap = getattr(err, "snapshot", None)
            return d in evicted or (isinstance(snap, str) and bytes.fromhex(snap) in evicted)
        except (TsckError, ValueError):
            return False

    # The remote reads pass no fence: the caller's is the local table's gc epoch, and an
    # object recorded present in the remote's presence record under another store's
    # epoch could let the uploader skip it wrongly.
    # served: a Served tally of one checkout (which tier gave each object), or None.
    def read_block_into(self, d: bytes, out, *, verify: bool = True, snapshot=None, path=None,
                        bounce: bool = False, fence: int | None = None, served: Served | None = None) -> None:
        try:
            self.local.read_block_into(d, out, verify=verify, snapshot=snapshot, path=path, bounce=bounce,
                                       fence=fence)
            return tally(served, "local")
        except (IntegrityError, UnreadableObject) as e:
            self._fell("block", d, e)
            err = e
        try:
            self.remote.assets.read_block_into(d, out, verify=verify, snapshot=snapshot, path=path, bounce=bounce)
        except (IntegrityError, UnreadableObject):
            raise err from None  # in neither tier: the local copy's fault says the most
        tally(served, "remote")

    def get_node(self, d: bytes, *, verify: bool = True, snapshot=None, path=None, fence: int | None = None,
                 served: Served | None = None) -> bytes:
        try:
            data = self.local.get_node(d, verify=verify, snapshot=snapshot, path=path, fence=fence)
            tally(served, "local")
            return data
        except (IntegrityError, UnreadableObject) as e:
            self._fell("node", d, e)
            err = e
        try:
            data = self.remote.assets.get_node(d, verify=verify, snapshot=snapshot, path=path)
        except (IntegrityError, UnreadableObject):
            raise err from None
        tally(served, "remote")
        return data

    def get_commit(self, d: bytes, *, verify: bool = True, served: Served | None = None) -> bytes:
        try:
            data = self.local.get_commit(d, verify=verify)
            tally(served, "local")
            return data
        except (IntegrityError, UnreadableObject) as e:
            self._fell("commit", d, e)
            err = e
        try:
            data = self.remote.assets.get_commit(d, verify=verify)
        except (IntegrityError, UnreadableObject):
            raise err from None
        tally(served, "remote")
        return data

    def require_blocks(self, digests, pool, *, snapshot=None, path=None, fence: int | None = None) -> None:
        digests = list(digests)
        try:
            return self.local.require_blocks(digests, pool, snapshot=snapshot, path=path, fence=fence)
        except IntegrityError:
            pass

        def one(d: bytes) -> None:
            if not self.local.block_exists(d):
                self.remote.assets.require_block(d, snapshot=snapshot, path=path)
        list(pool.map(one, digests))


def tally(served: Served | None, source: str) -> None:
    """Count one object `source` gave to the checkout whose tally is `served` (None: none)."""
    if served is not None:
        served.add(source)


class Served:
    """One checkout's view of a ReadThrough: every object it reads is read through, and
    counted by the tier that gave it ("local", "peer": a peer replica, "remote"), which
    the checkout's log line names. A checkout's own object: the ReadThrough is shared by
    every checkout of the Store, at once under threads."""

    SOURCES = ("local", "peer", "remote")

    def __init__(self, reads: ReadThrough):
        self.reads = reads
        self.counts = dict.fromkeys(self.SOURCES, 0)
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.reads, name)

    def add(self, source: str) -> None:
        with self._lock:
            self.counts[source] += 1

    def read_block_into(self, d: bytes, out, **kw) -> None:
        return self.reads.read_block_into(d, out, served=self, **kw)

    def get_node(self, d: bytes, **kw) -> bytes:
        return self.reads.get_node(d, served=self, **kw)

    def get_commit(self, d: bytes, **kw) -> bytes:
        return self.reads.get_commit(d, served=self, **kw)

    def sources(self) -> list[str]:
        """The tiers that gave some object, nearest first."""
        return [s for s in self.SOURCES if self.counts[s]]
