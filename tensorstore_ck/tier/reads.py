"""Reading through a local tier (docs/design/tiers.md, "Recovery"): which of two tiers'
snapshots is the newer, and one reader chain: an object read from the first of its
sources that gives it whole (the tier, then peer replicas, then the remote store), never
the damaged bytes, with a tally of which source gave what (a checkout's log line, the
objects a collective upload found in the remote)."""

from __future__ import annotations

import logging
import threading
from typing import Callable

from ..core.assets import Assets
from ..core.core import Core
from ..errors import IntegrityError, TsckError, UnreadableObject

__all__ = ["newer", "ReadChain", "Source", "Here", "Remote", "NotHere", "Tally", "read_through", "missing_only"]

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


class NotHere(Exception):
    """A source that does not hold the object says so (the chain asks the next one); never
    the error a read reports."""


class Source:
    """One place a chain reads objects from, by `name` (what a tally counts): read a block
    into a buffer, a node, a commit, each checked against its address (IntegrityError,
    UnreadableObject: the chain's next source is asked), and which of some blocks it lacks."""

    name = ""
    where = ""  # in a log line: "reading it from <where>"

    def read_block_into(self, d: bytes, out, *, verify: bool, snapshot, path, bounce: bool, fence) -> None:
        raise NotImplementedError

    def get_node(self, d: bytes, *, verify: bool, snapshot, path, fence) -> bytes:
        raise NotImplementedError

    def get_commit(self, d: bytes, *, verify: bool) -> bytes:
        raise NotImplementedError

    def lacking(self, digests: list, pool, *, snapshot, path, fence) -> list:
        """The blocks of `digests` this source cannot give; the chain's last source raises
        for one it lacks (Assets.require_block)."""
        raise NotImplementedError

    def key(self, kind: str, d: bytes) -> str | None:
        """Where this source keeps object `d` of `kind` ("block", "node", "commit"), for an
        error naming it; None where it keeps none of its own."""
        return None


class Here(Source):
    """The tier's own Assets."""

    name, where = "local", "the local tier"

    def __init__(self, assets):
        self.assets = assets

    def read_block_into(self, d, out, *, verify, snapshot, path, bounce, fence):
        self.assets.read_block_into(d, out, verify=verify, snapshot=snapshot, path=path, bounce=bounce, fence=fence)

    def get_node(self, d, *, verify, snapshot, path, fence):
        return self.assets.get_node(d, verify=verify, snapshot=snapshot, path=path, fence=fence)

    def get_commit(self, d, *, verify):
        return self.assets.get_commit(d, verify=verify)

    def key(self, kind, d):
        return self.assets.object_key(kind + "s", d)

    def lacking(self, digests, pool, *, snapshot, path, fence):
        try:
            self.assets.require_blocks(digests, pool, snapshot=snapshot, path=path, fence=fence)
            return []
        except IntegrityError:
            return [d for d, here in zip(digests, pool.map(self.assets.block_exists, digests)) if not here]


class Remote(Source):
    """The remote store behind a tier. Its reads pass no fence: the caller's is the local
    table's gc epoch, and an object recorded present in the remote's presence record under
    another store's epoch could let the uploader skip it wrongly."""

    name = "remote"

    def __init__(self, core: Core):
        self.core = core

    def read_block_into(self, d, out, *, verify, snapshot, path, bounce, fence):
        self.core.assets.read_block_into(d, out, verify=verify, snapshot=snapshot, path=path, bounce=bounce)

    def get_node(self, d, *, verify, snapshot, path, fence):
        return self.core.assets.get_node(d, verify=verify, snapshot=snapshot, path=path)

    def get_commit(self, d, *, verify):
        return self.core.assets.get_commit(d, verify=verify)

    def lacking(self, digests, pool, *, snapshot, path, fence):
        list(pool.map(lambda d: self.core.assets.require_block(d, snapshot=snapshot, path=path), digests))
        return []


class Tally:
    """Which source gave each object of one read (a checkout): counts by source name, and,
    for the source named `record`, the objects themselves as (kind, digest). A read's own
    object, counted under threads."""

    SOURCES = ("local", "peer", "remote")

    def __init__(self, record: str | None = None):
        self.counts = dict.fromkeys(self.SOURCES, 0)
        self.record, self.recorded = record, []
        self._lock = threading.Lock()

    def add(self, source: str, kind: str, d: bytes) -> None:
        with self._lock:
            self.counts[source] += 1
            if source == self.record:
                self.recorded.append((kind, d))

    def sources(self) -> list[str]:
        """The sources that gave some object, nearest first."""
        return [s for s in self.SOURCES if self.counts[s]]


def any_fault(err: BaseException) -> bool:
    return True


def missing_only(err: BaseException) -> bool:
    """Fall through only for an object a source lacks: a damaged copy is that source's
    fault, raised as it is."""
    return getattr(err, "reason", None) == "missing"


class _Notes:
    """What a chain and its tallied copies tell once (shared by them): the objects the
    first source failed for, and how many it lacked."""

    def __init__(self):
        self.told: set[bytes] = set()
        self.missing = 0
        self.told_missing = False
        self.lock = threading.Lock()


class ReadChain:
    """An ObjectReader over sources in order: each object is read from the first source
    that gives it whole, each later source the fallback of those before; when none does,
    the first source's error (the nearest copy's fault says the most), or exhausted()'s.
    A read past the first source is logged (once per damaged object; a missing one once,
    then counted; one of a snapshot the tier's budget evicted, `evicted()`, is the plan,
    not news). tally: this reader's Tally, or None (tallied() makes a copy with one).

    Everything else (writes, gc, fsck, the uploader) sees the tier's own Assets, so a
    damaged local copy is still found and reported there."""

    def __init__(self, sources: list[Source], *, falls: Callable[[BaseException], bool] = any_fault,
                 exhausted: Callable | None = None, evicted: Callable[[], set] | None = None,
                 tally: Tally | None = None, notes: _Notes | None = None, lacks_by_design: bool = False):
        self.sources = list(sources)
        self.falls, self.exhausted, self.evicted, self.tally = falls, exhausted, evicted, tally
        self._notes = notes or _Notes()
        # An object the first source lacks is the plan, not news (rank 0's uploader walking
        # a collective snapshot: the other ranks' parts are in their tiers): logged at debug.
        self.lacks_by_design = lacks_by_design

    @property
    def missing(self) -> int:
        """Objects read past the first source because it lacked them."""
        return self._notes.missing

    def with_source(self, at: int, source: Source) -> "ReadChain":
        """This chain with `source` asked at position `at` (the same notes)."""
        return ReadChain(self.sources[:at] + [source] + self.sources[at:], falls=self.falls,
                         exhausted=self.exhausted, evicted=self.evicted, tally=self.tally, notes=self._notes,
                         lacks_by_design=self.lacks_by_design)

    def tallied(self, record: str | None = None) -> "ReadChain":
        """This chain with a Tally of its own (one checkout's: its log line names the sources)."""
        return ReadChain(self.sources, falls=self.falls, exhausted=self.exhausted, evicted=self.evicted,
                         tally=Tally(record), notes=self._notes, lacks_by_design=self.lacks_by_design)

    def after_fork(self) -> None:
        self._notes.lock = threading.Lock()  # the parent's may have been held by a thread not here

    def _read(self, kind: str, d: bytes, path, call):
        first = None
        for src in self.sources:
            try:
                out = call(src)
            except NotHere:
                continue
            except (IntegrityError, UnreadableObject) as e:
                if not self.falls(e):
                    raise
                if first is None:
                    first = e
                    if len(self.sources) > 1:
                        self._fell(kind, d, e)
                continue
            if self.tally is not None:
                self.tally.add(src.name, kind, d)
            return out
        if self.exhausted is not None:
            raise self.exhausted(kind, d, path, first) from None
        if first is None:  # every source said it holds none (no copy was even tried)
            raise IntegrityError("missing object", key=self.sources[0].key(kind, d), reason="missing", path=path)
        raise first

    def read_block_into(self, d: bytes, out, *, verify: bool = True, snapshot=None, path=None,
                        bounce: bool = False, fence: int | None = None) -> None:
        self._read("block", d, path, lambda s: s.read_block_into(d, out, verify=verify, snapshot=snapshot, path=path,
                                                                 bounce=bounce, fence=fence))

    def get_node(self, d: bytes, *, verify: bool = True, snapshot=None, path=None, fence: int | None = None) -> bytes:
        return self._read("node", d, path, lambda s: s.get_node(d, verify=verify, snapshot=snapshot, path=path,
                                                                fence=fence))

    def get_commit(self, d: bytes, *, verify: bool = True) -> bytes:
        return self._read("commit", d, None, lambda s: s.get_commit(d, verify=verify))

    def require_blocks(self, digests, pool, *, snapshot=None, path=None, fence: int | None = None) -> None:
        todo = list(digests)
        for src in self.sources:
            if not todo:
                return
            todo = src.lacking(todo, pool, snapshot=snapshot, path=path, fence=fence)
        if todo:  # lacked by every source, the last included
            raise IntegrityError("missing object", key=self.sources[0].key("block", todo[0]), reason="missing",
                                 snapshot=snapshot, path=path)

    def node_error(self, d: bytes, msg: str, *, snapshot=None, path=None) -> Exception:
        return Assets.node_error(d, msg, snapshot=snapshot, path=path)

    def _fell(self, what: str, d: bytes, err: BaseException) -> None:
        # A damaged copy is news about this disk: told once per object. A missing one is
        # the ordinary case after the tier was lost or trimmed to its budget (every block
        # of a checkout): told once, then counted, not one line per block; one of a
        # snapshot the budget evicted is the plan, not news: counted, not told.
        n, behind = self._notes, " then ".join(_where(s) for s in self.sources[1:])
        if missing_only(err):
            evicted = self.lacks_by_design or (self.evicted is not None and self._was_evicted(d, err))
            with n.lock:
                n.missing += 1
                quiet = evicted or n.told_missing
                n.told_missing = n.told_missing or not evicted
            if evicted:
                log.debug("local tier: %s %s %s: reading it from %s", what, d.hex()[:16],
                          "is another rank's" if self.lacks_by_design else "of an evicted snapshot", behind)
            if not quiet:
                log.warning("local tier: %s %s is missing; reading it, and any other object the tier lacks, "
                            "from %s", what, d.hex()[:16], behind)
            return
        with n.lock:
            if d in n.told:
                return
            n.told.add(d)
        log.warning("local tier: %s %s failed its check (%s); reading it from %s", what, d.hex()[:16], err, behind)

    def _was_evicted(self, d: bytes, err: BaseException) -> bool:
        try:
            evicted = self.evicted()
            snap = getattr(err, "snapshot", None)
            return d in evicted or (isinstance(snap, str) and bytes.fromhex(snap) in evicted)
        except (TsckError, ValueError):
            return False


def _where(src: Source) -> str:
    return src.core.url if isinstance(src, Remote) else src.where


def read_through(local, remote: Core, evicted: Callable[[], set] | None = None) -> ReadChain:
    """The local tier's Assets for reading, with the remote store behind them: a block,
    node or commit missing locally, or failing its check there (frame, length, BLAKE3
    against its address: an IntegrityError, or an unreadable file), is read from the
    remote store instead, and checked there as any read is; never the damaged bytes.
    evicted() -> the roots the tier's budget evicted (TierTable.evicted)."""
    return ReadChain([Here(local), Remote(remote)], evicted=evicted)
