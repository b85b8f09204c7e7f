"""LocalTier: what a Store over a local tier holds, in one object (docs/design/tiers.md).

The Store's Core is the tier's (a local disk and an LMDB table under PATH); the LocalTier
holds the rest: the uploader (the queue, the remote Core), the reads that fall through to
the remote, the peer replicas, and the rules where the two catalogs meet (tags, pins,
retention). The Store calls it at a few points of its own work (a put's start and end,
a checkout's resolution and reads, tags and pins, close) and knows nothing else of tiers.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import time
import warnings

import msgpack

from ..core.core import Core
from ..errors import InvalidArgument, RefNotFound, SnapshotWarning, StorageError, TsckError
from ..util.ids import DIGEST_SIZE, Digest
from ..write.saver import Saver
from .collective import CollectiveTier
from .holds import (delete_ref_both, forget_both, held, pin_both, tag_both, undelete_both, unheld, unpin_both,
                    untag_both)
from .memory import TIER_ONLY, Schedule, drop_superseded, scheduled, tier_only
from .outage import Lag, caller_level, measure
from .reads import ReadChain, newer, read_through
from .uploader import Uploader, early_default

__all__ = ["LocalTier", "STOP_GRACE"]

log = logging.getLogger(__name__)

TIPS = 4  # snapshots of a ref each rank posts in a collective checkout's hello (own_tip)
_newest_first = functools.cmp_to_key(lambda a, b: -1 if newer(a, b) else int(newer(b, a)))  # catalog rows
STOP_GRACE = 2.0  # seconds close() gives an uploader still in a request past its deadline


class LocalTier:
    """A Store's local tier: `uploader` (its `remote` Core), `reads` (the tier's objects,
    the remote behind), `peers` (replicas=k: this rank's side of the peer replicas). A
    Store without a tier holds a NoTier (tier/none.py), which answers the same calls."""

    uploads = True          # an uploader: snapshots queued, durable once uploaded
    costs_requests = True   # a put's objects go to an object store in the end (its pack default)
    learns_parts = False    # a checkout's parts may be the remote's, not this store's own

    def __init__(self, core: Core, remote: Core, *, budget: int | None = None, early: bool | None = None,
                 stop=None, replicas: int = 0, saver: Saver | None = None, durable_every=1,
                 memory: bool = False):
        """saver: the saver process (open_store(saver="process")) runs the uploads; the
        tier's puts write its disk on threads. durable_every: which snapshots the remote
        gets (memory.Schedule: an int N or a timedelta; 1: every one). memory: the tier is
        host memory (memory=): a durable snapshot's copy is dropped once a newer one of its
        ref stands in for it."""
        self.core = core
        self.uploader = Uploader(core, remote, budget, early=early_default() if early is None else early, stop=stop,
                                 saver=saver, lean=memory, schedules=scheduled(durable_every))
        self.reads = read_through(core.assets, remote, evicted=core.refs.tier_rows.evicted)
        self.schedule = Schedule(durable_every) if scheduled(durable_every) else None
        self.peers = None
        if replicas:
            from .replicas import Peers  # (the side channel's server starts at the first collective put)
            # (keyed by the remote's URL in the c10d Store: each store with replicas its own channel)
            ident = hashlib.blake2b(str(remote.url).encode(), digest_size=6).hexdigest()
            self.peers = Peers(core, replicas, ident=ident)
        # Rank 0 with its tier lost: what the other ranks' tiers posted beyond the newest
        # (newest_of), by ref (a restore's fallbacks name them by root).
        self._elsewhere: dict = {}

    @property
    def remote(self) -> Core:
        return self.uploader.remote

    def after_fork(self) -> None:
        """In a forked child: the uploader's thread is the parent's (the child's puts are
        queued in the table; the parent's uploader, or the next open, sends them); the
        peer server and sender are the parent's too, so the child neither serves nor
        sends replicas (its collective checkouts read the tier, then the remote)."""
        self.uploader.after_fork()
        self.reads.after_fork()
        self.peers = None

    # -- a put ---------------------------------------------------------------------
    def begin(self) -> None:
        """Before a writer (a put, the DCP writer) writes blocks: room under the budget
        (Uploader.make_room: it may wait for uploads, or raise TierFull with nothing
        written), then the remote fence its early uploads are recorded under."""
        self.uploader.make_room()
        self.uploader.tee_begin()

    def scheduled(self, args):
        """A put's arguments, its commit marked tier-only when the schedule keeps the
        snapshot out of the remote (durable_every)."""
        if self.schedule is None or self.schedule.durable(args.ref):
            return args
        return dataclasses.replace(args, meta={**args.meta, TIER_ONLY: True})

    def published(self, info):
        """After a writer published `info` in the tier: queued for upload (durable once
        the uploader has moved the remote ref), unless its commit is tier-only."""
        if not tier_only(info.meta):
            self.uploader.enqueue(bytes.fromhex(info.root), info.ref, info.step)
            self.tell_lag()
        elif self.peers is None:  # (no copies to wait for: committed as published)
            self.core.refs.tier_rows.committed.add(bytes.fromhex(info.root))
        if self.schedule is not None:
            drop_superseded(self.core, info.job)
        if bytes.fromhex(info.root) in self.core.refs.tier_rows.committed:
            self.uploader.lean_due()  # (after the prune: a budget's check then sees what stays)
        return dataclasses.replace(info, durable=False)

    def tell_lag(self) -> None:
        """While uploads fail, the put's caller hears how far the remote is behind: a
        SnapshotWarning at the first put of an outage, then at most every
        tier.outage.LAG_TELL_EVERY seconds (nothing is read while uploads succeed)."""
        if not self.uploader.outage.due():
            return
        try:
            lag = self.lag()
        except TsckError as e:  # (the table refused: the next put tells)
            log.debug("local tier: the remote's lag could not be measured (%s)", e)
            return
        if lag.lagging:
            warnings.warn(f"durability lags: {lag}", SnapshotWarning, stacklevel=caller_level())

    def lag(self) -> Lag:
        """How far the remote store is behind this tier now (tier.outage.Lag)."""
        return measure(self.uploader, self.core.url)

    def on_durable(self, fn):
        """fn(root, row, at) on the uploader's thread after each snapshot became durable
        (its remote ref moved) -> a function that removes fn."""
        listeners = self.uploader.listeners
        listeners.append(fn)

        def remove() -> None:
            if fn in listeners:
                listeners.remove(fn)
        return remove

    def collective(self) -> CollectiveTier:
        """What a collective put does besides the protocol (each rank publishes in its own
        tier and queues its own upload: collective.py)."""
        peers = self.peers if self.peers is not None and self.peers.join() else None
        return CollectiveTier(self.core, self.uploader, peers, self.schedule)

    def wait_durable(self, timeout: float | None) -> bool:
        if self.peers is not None:  # (the replicas go first: a part is sent to the peers, then uploaded)
            t0 = time.monotonic()
            self.peers.wait(timeout)
            timeout = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        return self.uploader.wait_durable(timeout)

    # -- one catalog -------------------------------------------------------------------
    def set_retention(self, job: str, record: dict | None) -> None:
        """The job's rules in the remote table too: the uploader prunes the job there
        after each upload, and an offline `tsck gc` of the remote applies them."""
        self.remote.refs.retention_set(job, record)

    # Tags, pins and removals act in both tiers' tables, or refuse naming the remote
    # (holds.py); named_of(target): the root checkout reads, or None for a removed one.
    def tag(self, publisher, name: str, target: str, named_of):
        root = named_of(target)
        self._holdable(root, f"tag {name!r}")
        return tag_both(self.uploader, publisher, name, target, root)

    def pin(self, publisher, target: str, named_of) -> str:
        root = named_of(target)
        self._holdable(root, "pin")
        return pin_both(self.uploader, publisher, target, root)

    def _holdable(self, root, what: str) -> None:
        """A tag or pin makes its snapshot durable (holds.held); a tier-only collective
        snapshot cannot be: the other ranks' parts were never queued, and no rank sends
        them later. InvalidArgument, nothing changed."""
        row = None if root is None else self.core.refs.catalog_get(bytes(root), checked=False)
        meta = (row or {}).get("meta")
        if tier_only(meta) and isinstance(meta.get("world"), int) and meta["world"] > 1:
            raise InvalidArgument(f"{what}: snapshot {bytes(root).hex()[:16]} is tier-only (open_store(durable_every=) "
                                  "kept it out of the remote store) and collective: its ranks' parts are in their "
                                  "tiers only, and a tag or pin must keep it durable. Tag a durable snapshot of the "
                                  "ref (every durable_every-th), or put one now with durable_every=1")

    def unpin(self, root: bytes) -> None:
        unpin_both(self.uploader, bytes(root))

    def delete_ref(self, ref: str, expected, named_of, *, dry_run: bool) -> dict:
        return delete_ref_both(self.uploader, ref, expected, named_of(ref), dry_run=dry_run)

    def undelete(self, publisher, ref: str, to, named_of):
        named = None if to is None else named_of(to)
        return undelete_both(self.uploader, publisher, ref, to if named is None else named.hex())

    def untag(self, name: str) -> str:
        return untag_both(self.uploader, name)

    def forget(self, publisher, target: str, root_of, info_of, *, dry_run: bool):
        root = bytes(root_of(target))
        info = info_of(root)  # (durable as it was: a local-only snapshot's row goes)
        forget_both(self.uploader, publisher, root, dry_run)
        return info

    def held(self, root: bytes) -> None:
        held(self.uploader, root)

    def unheld(self, *, tag_name: str | None = None, pin: bytes | None = None, root: bytes | None = None) -> None:
        unheld(self.uploader, tag_name=tag_name, pin=pin, root=root)

    # -- reading -------------------------------------------------------------------------
    def roots(self, target: str) -> list:
        """The snapshots `target` names in the tiers, the newest first (reads.newer on
        their catalog rows): the local one and the remote one where they differ (after a
        process crash the local tip is the newer; after the node's disk was lost, or when
        another node wrote on, the remote one). RefNotFound when no tier knows it."""
        remote = self.remote
        found, missing, away = [], None, None
        for core in (self.core, remote):
            try:
                root = core.resolve(target)
                found.append((core, root, core.refs.catalog_get(root)))
            except RefNotFound as e:
                missing = missing or e
            except (StorageError, OSError) as e:
                if core is self.core:
                    raise
                # The remote store is unreachable: the local tier alone is what can be
                # read. With nothing local, its error, not RefNotFound (which
                # restore_latest would take for a first run, and start over).
                log.warning("resolving %s: the remote store at %s is unreachable (%s); using the local tier only",
                            target, remote.url, e)
                away = e
        if not found:
            raise away or missing
        if len(found) == 2 and found[0][1] == found[1][1]:
            found = found[:1]  # the same snapshot: read it where it is nearest
        if len(found) == 2 and newer(found[1][2], found[0][2]):
            found.reverse()
        return [root for _, root, _ in found]

    def own_tip(self, target: str) -> bytes:
        """A collective checkout's hello (with replicas): this rank's tier's newest
        snapshots of ref `target` (a rank other than 0 keeps its part's rows, not the ref),
        at most TIPS, the newest first, as msgpack [[root, step, time], ...]; b"" for none,
        or without replicas (a part lost with rank 0's node would have no copy to read it
        from)."""
        if self.peers is None:
            return b""
        rows = [(root, row) for root, row in self.core.refs.catalog_iter(bad=[]) if row.get("ref") == target]
        rows.sort(key=lambda r: _newest_first(r[1]))
        return msgpack.packb([[bytes(root), row.get("step"), row.get("time")] for root, row in rows[:TIPS]]) \
            if rows else b""

    def newest_of(self, target: str, root, posted) -> Digest | None:
        """Rank 0 of a collective checkout (with replicas), `root` resolved through its
        tiers (None: neither tier knows `target`): where this rank's own tier lacks the
        ref (its node lost: a new one), the newest snapshot another rank's tier holds
        (posted(): their own_tip), if it is newer than `root`; where its tier knows the
        ref, the newest of those committed after the tier's last move of it (a restart
        that numbered the nodes otherwise: this tier was another rank's since, and a
        rank's tier other than 0's keeps its part's rows, not the ref; a move after them,
        a rollback, keeps the ref where it put it). A
        tier-only snapshot is then read, rank 0's part from the peers holding its copies,
        not the older durable one the remote names, or no snapshot at all where the remote
        holds none of the ref yet (its first upload was not done when the node was lost);
        every rank reads the one root rank 0 names (never a mix). The others posted that
        are newer than `root` too are remembered, the newest first (held_elsewhere): a
        restore that cannot read the newest whole tries them next, by root, and a root
        this rank's tiers do not know but remembers so is the one named. None: none
        anywhere."""
        if self.peers is None:
            return root
        if root is None and any(d.hex() == target for held in self._elsewhere.values() for d in held):
            return Digest.parse(target)
        try:
            self.core.resolve(target)
            moved = [e.time for e in self.core.refs.reflog(target) if e.op == "move"]
            since = moved[-1] if moved else None  # (this host's clock; a row's is its rank 0's then)
        except RefNotFound:
            since = None
        else:
            if since is None:
                return root
        floor = None if root is None else (self.core.refs.catalog_get(root, checked=False)
                                           or self.remote.refs.catalog_get(root, checked=False))
        seen: dict = {}
        for tip in posted():
            for root_, row in _posted(tip):
                if since is not None and not row["time"] > since:
                    continue  # (committed before this tier's last move of the ref: the ref says)
                if newer(row, floor) and (root_ not in seen or newer(row, seen[root_])):
                    seen[root_] = row
        order = sorted(seen, key=lambda d: _newest_first(seen[d]))
        # (then what the tiers name: restore_latest's history goes on after the newest of it)
        self._elsewhere[target] = order[1:] + ([root] if order and root is not None else [])
        if not order:
            return root
        best = order[0]
        log.info("collective checkout of %s: this rank's tier %s; snapshot %s (step %s), which the other ranks' "
                 "tiers hold, is newer than what the tiers name (%s)", target,
                 "lost it" if since is None else "names an older one (it was another rank's tier since)",
                 best.hex()[:16], seen[best].get("step"), "nothing" if root is None else root.hex()[:16])
        return best

    def held_elsewhere(self, target: str) -> list:
        """Rank 0, after a collective checkout of ref `target` that newest_of answered
        from the other ranks' tips: the older snapshots they posted, still newer than what
        the tiers name, the newest first, then the one the tiers name (roots): what
        restore_latest tries, by root, when the newest does not read whole on every rank.
        [] otherwise."""
        return list(self._elsewhere.get(target, ()))

    def read_core(self) -> Core:
        """The Core to read a snapshot roots() named through: the tier's objects, the
        remote's behind (reads.read_through), so a snapshot only the remote holds reads as
        checkout reads it."""
        c = self.core
        return Core(c.storage, self.reads, c.refs, c.pool, c.settings)

    def remote_info(self, root: bytes):
        """The SnapshotInfo of a snapshot only the remote store lists (another node's
        upload, a lost tier), or None (the tier lists it, or nobody does)."""
        if self.core.refs.catalog_has(root):
            return None
        remote = self.uploader.publisher
        return remote.info(root) if remote.reftable.catalog_has(root) else None

    def history_core(self, ref: str) -> Core:
        """Whose history of `ref` log() reads: the remote's where its tip is the newer (the
        local tier lost, or behind another node's uploads: what checkout(ref) reads). Which
        tier's tip it is, not whether this tier lists that snapshot: a tier that was
        another rank's than rank 0's holds rows of its part's snapshots, not the ref's
        moves, and its own tip of the ref can be far older."""
        newest = self.roots(ref)[0]
        try:
            return self.core if self.core.resolve(ref) == newest else self.remote
        except RefNotFound:
            return self.remote

    def reads_for(self, collective: bool):
        """What a checkout reads through: the tier, the remote behind; a collective
        checkout with replicas also asks the ranks holding this rank's replicas for what
        its tier lacks (lost with its node) before the remote."""
        if collective and self.peers is not None and self.peers.join():
            from .peerreads import peer_reads
            return peer_reads(self.reads, self.peers)
        return self.reads

    def reading(self):
        """While a checkout reads: the copies its peers gave are kept in the tier once it
        is done (Peers.keeping_after), not on the cores and the holders it reads from."""
        import contextlib
        return contextlib.nullcontext() if self.peers is None else self.peers.keeping_after()

    @staticmethod
    def read_plan(served: ReadChain, commit: dict):
        """What plans a checkout's block reads through `served` (Reader's plan) of the
        snapshot whose decoded commit is `commit`, or None: with peer replicas, the blocks
        the tier lacks fetched in batches from the holders that snapshot's placement chose."""
        from .peerreads import FromPeers
        for src in served.sources:
            if isinstance(src, FromPeers):
                src.learn(commit)
                return lambda jobs, base: src.plan(jobs, base, served.tally)
        return None

    @staticmethod
    def served(reads: ReadChain) -> ReadChain:
        """One checkout's view of `reads` (reads_for): its objects counted by the tier that
        gave them (its tally), for its log line (source)."""
        return reads.tallied()

    def source(self, served: ReadChain) -> tuple[str, str]:
        """Where a checkout read its snapshot -> (the tiers, "+"-joined: "local", "peer",
        "remote"; the words of its log line): one tier by its name, several with the
        objects each gave."""
        names = {"local": f"the local tier at {self.core.url}", "peer": "peer replicas",
                 "remote": f"the remote store at {self.remote.url}"}
        used = served.tally.sources() or ["local"]
        if len(used) == 1:
            return used[0], names[used[0]]
        parts = [f"{names[s]} ({served.tally.counts[s]} objects)" for s in used]
        return "+".join(used), ", ".join(parts[:-1]) + " and " + parts[-1]

    # -- close ---------------------------------------------------------------------------
    def close(self, deadline: float | None, path: str, stacklevel: int) -> None:
        """Finish the uploads queued (as close() finishes asynchronous puts: a job that
        ends with close() leaves its snapshots in the remote store) until `deadline`
        (time.monotonic(); None: no bound) or a failed upload attempt, then stop the
        uploader and release the remote store. An uploader that stopped on a failure is
        not waited for (the Store's close raises it at the end, unless wait_durable()
        did); whatever stays queued (a failure, the deadline, an interrupt) is resumed by
        the next open of the tier at `path`, and a SnapshotWarning says so."""
        if self.peers is not None:  # the replicas being sent (the server goes once the uploads are done)
            self.peers.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        up = self.uploader
        why = "close() was interrupted"
        try:
            try:
                why = up.drain(None if deadline is None else max(0.0, deadline - time.monotonic()))
            finally:
                ended = up.close(None if deadline is None else max(STOP_GRACE, deadline - time.monotonic()))
                if not ended:
                    log.warning("local tier: the uploader to %s is still in a request after close's timeout; it is "
                                "left to end by itself (it publishes nothing wrongly: its storage requests now fail, "
                                "and a ref moves only after every object was sent)", up.remote.url)
                try:
                    queued = up.queued()
                    lag = self.lag() if queued else None
                except TsckError:  # (the local table refused: what is queued stays, said by the next open)
                    lag, queued = None, 0
                remote = up.remote
                # Under a deadline, a copy still in a request (the remote answers nothing) is
                # not waited for: closing the storage below ends it.
                remote.pool.shutdown(wait=ended and deadline is None, cancel_futures=True)
                remote.refs.release_abandoned_gc()
                remote.refs.close()
                remote.storage.close()
                if queued and up.error is None:  # (a failure that stopped the uploader says it all: raised)
                    behind = f"; {lag}" if lag is not None and lag.failing is not None else ""
                    warnings.warn(f"store {remote.url}: {queued} snapshot(s) not uploaded stay queued in the local "
                                  f"tier {path} ({why or 'close() ended first'}); they are safe there, and the next "
                                  f"open_store(..., local={path!r}) uploads them{behind}", SnapshotWarning,
                                  stacklevel=stacklevel)
        finally:
            if self.peers is not None:
                self.peers.close(deadline)

    def unheard(self) -> BaseException | None:
        return self.uploader.unheard()


def _posted(tip: bytes) -> list:
    """Another rank's own_tip -> [(root, row)]; anything but a list of [root, step,
    time] (another rank's word) is passed over."""
    try:
        items = msgpack.unpackb(tip) if tip else []
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.UnpackException):
        return []
    out = []
    for item in items[:TIPS] if isinstance(items, list) else []:
        try:
            root, step, when = item
            if type(root) is bytes and len(root) == DIGEST_SIZE:
                out.append((Digest(root), {"step": step if type(step) is int else None, "time": float(when)}))
        except (ValueError, TypeError):
            continue
    return out
