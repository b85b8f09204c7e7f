"""A local tier's uploader: snapshots published in the local store, sent to the remote one.

open_store(remote, local=PATH) gives a Store whose Core is the local tier (a local disk
and an LMDB ref table under PATH) and an Uploader holding the remote Core. A put
publishes locally and queues its root in the local ref table (RefTable.upload_enqueue);
one background thread per Store then, for each queued snapshot, oldest first:

    read the remote gc fence -> walk the snapshot in the local tier (walk.py) ->
    blocks, then nodes, then the commit: skip what the remote's presence record or a
    HEAD says is there, copy the rest as stored (checked first, the same bytes under
    the same address) -> remote sync -> fenced compare-and-swap of the remote ref to
    the same root (Publisher.move_to; a fenced move re-validates every object) ->
    mark the root durable in the local table and drop it from the queue (one transaction).

The remote ref therefore never names an object the remote store lacks: every object
is there and synced before the move, and a gc deletion phase that overlaps the upload
fences the move, which then asks the remote for every object again
(docs/design/tiers.md). The queue lives in the local table, so a process killed at any
moment resumes at its next open: what the remote has is skipped, the move is made once
(a root the remote catalog lists is published already).
"""

from __future__ import annotations

import logging
import threading
import time

from .core import Core
from .errors import IntegrityError, StorageError, TsckError, UnreadableObject
from .publish import Publisher
from .walk import walk_commit

__all__ = ["Uploader", "UPLOAD_ATTEMPTS", "ReadThrough", "newer"]

log = logging.getLogger(__name__)

UPLOAD_ATTEMPTS = 8  # tries of one snapshot (storage or ref-table failures) before the uploader gives up
_BACKOFF = (0.5, 30.0)  # first and longest pause between tries, seconds


class Uploader:
    """Sends a local tier's queued snapshots to the remote store, on one thread.

    Counters (tests, the harness): `sent` objects written remotely, `skipped` objects
    the remote had."""

    def __init__(self, local: Core, remote: Core):
        self.local, self.remote = local, remote
        self.publisher = Publisher(remote.assets, remote.refs, remote.pool)
        self._cond = threading.Condition()
        self._stop = False
        self.error: BaseException | None = None  # the failure that stopped the uploader
        self._heard = False  # wait_durable raised it (close() does not raise it again)
        self._forked = False
        self.sent = self.skipped = 0
        self._requeue_unqueued()
        self._thread = threading.Thread(target=self._run, name="tsck-upload", daemon=True)
        self._thread.start()

    # -- the queue -----------------------------------------------------------------
    def enqueue(self, root: bytes, ref: str, step, part: bytes | None = None) -> int:
        """part: this rank's sub-tree of a collective snapshot (peers.py), not the snapshot."""
        seq = self.local.refs.upload_enqueue(root, ref, step, part=part)
        with self._cond:
            self._cond.notify_all()
        return seq

    def _requeue_unqueued(self) -> None:
        """A put killed between its local ref move and its enqueue left a local tip that
        is neither durable nor queued: queue it (the ref's tip is what counts; an older
        snapshot of that ref superseded before the kill is not sent)."""
        refs = self.local.refs
        queued = {e["root"] for _, e in refs.upload_pending()}
        tips = [(name, root) for name, root in refs.list() if root not in queued]
        done = refs.durable(root for _, root in tips)
        for name, root in tips:
            if root not in done:
                row = refs.catalog_get(root) or {}
                log.info("local tier: queueing the tip of ref %s (%s), published locally and never queued",
                         name, root.hex()[:16])
                refs.upload_enqueue(root, name, row.get("step"))

    def is_durable(self, roots) -> set[bytes]:
        return self.local.refs.durable(roots)

    def wait_durable(self, timeout: float | None = None) -> bool:
        """Wait until every snapshot queued before this call is durable -> True, or False
        once `timeout` seconds passed. Raises the failure that stopped the uploader."""
        target = self.local.refs.upload_last_seq()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self.error is not None:
                    self._heard = True
                    raise self.error
                pending = [seq for seq, _ in self.local.refs.upload_pending() if seq <= target]
                if not pending:
                    return True
                if self._stop:
                    raise TsckError("the uploader stopped (the store was closed, or this is a forked child) before "
                                    "these uploads finished; they resume at the next open_store(..., local=) of "
                                    "this local tier")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.5 if left is None else min(0.5, left))

    def drain(self) -> None:
        """Wait until the queue is empty, or the uploader stopped (its error is kept for
        unheard()); no timeout: Store.close() finishes uploads as it finishes puts."""
        with self._cond:
            while self.error is None and not self._stop and self.local.refs.upload_pending():
                self._cond.wait(0.5)

    def close(self) -> None:
        """Stop after the upload in progress; what is queued stays queued (the next open resumes)."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if not self._forked:
            self._thread.join()

    def unheard(self) -> BaseException | None:
        """The failure that stopped the uploader, if wait_durable() never raised it:
        Store.close() raises it, so a script that ends with close() hears it."""
        return None if self._heard else self.error

    def after_fork(self) -> None:
        """In a forked child: no uploader thread here (the parent's sends what the child
        queues); the remote core drops the parent's pool and locks."""
        self._forked, self._stop = True, True
        self._cond = threading.Condition()
        self.remote.after_fork()

    # -- the thread ------------------------------------------------------------------
    def _run(self) -> None:
        tries = 0
        while True:
            with self._cond:
                if self._stop:
                    return
            try:
                pending = self.local.refs.upload_pending()
            except Exception as e:  # noqa: BLE001 - the local table is gone (closed): stop
                self._fail(e)
                return
            if not pending:
                with self._cond:
                    if not self._stop:
                        self._cond.wait(1.0)
                continue
            seq, entry = pending[0]
            try:
                self._upload(seq, entry)
                tries = 0
            except IntegrityError as e:  # a damaged local object: no retry makes it whole
                self._fail(e)
                return
            except (StorageError, TsckError, OSError) as e:
                tries += 1
                if tries >= UPLOAD_ATTEMPTS:
                    self._fail(e)
                    return
                pause = min(_BACKOFF[1], _BACKOFF[0] * 2 ** (tries - 1))
                log.warning("upload of %s to %s failed (%s); try %d of %d in %.1fs", entry["root"].hex()[:16],
                            self.remote.url, e, tries + 1, UPLOAD_ATTEMPTS, pause)
                with self._cond:
                    if not self._stop:
                        self._cond.wait(pause)
            except BaseException as e:  # noqa: BLE001 - said by wait_durable and close
                self._fail(e)
                return

    def _fail(self, e: BaseException) -> None:
        log.error("local tier: uploads to %s stopped: %s", self.remote.url, e)
        with self._cond:
            self.error = e
            self._cond.notify_all()

    def _upload(self, seq: int, entry: dict) -> None:
        root, local = entry["root"], self.local
        if entry.get("part") is not None:  # a rank's part of a collective snapshot (peers.py)
            from .peers import upload_part
            return upload_part(self, seq, entry)
        row = local.refs.catalog_get(root)
        if row is None:
            self._expired(seq, root)
            return
        world = (row.get("meta") or {}).get("world") if isinstance(row.get("meta"), dict) else None
        if isinstance(world, int) and world > 1:  # a collective snapshot: the other ranks send their parts
            from .peers import upload_world
            return upload_world(self, seq, entry, row)
        fence = self.publisher.fence()  # before the remote is asked about any object
        objs = {"block": [], "node": [], "commit": []}
        seen: set[bytes] = set()
        try:
            for o in walk_commit(local.assets, root, verify=True):
                if o.digest not in seen:
                    seen.add(o.digest)
                    objs[o.kind].append(o.digest)
            self._send(objs, fence)
        except IntegrityError:
            # Missing or damaged here: a local prune may have expired the snapshot (and
            # deleted its objects) meanwhile; otherwise the tier is damaged, and that stops us.
            if local.refs.catalog_get(root) is None:
                self._expired(seq, root)
                return
            raise
        info = self.publisher.move_to(root, row, fence=fence, revalidate=lambda f: self._send(objs, f))
        local.refs.upload_done(seq, root)
        with self._cond:
            self._cond.notify_all()
        log.info("local tier: snapshot %s of ref %s durable at %s", info.root[:16], info.ref, self.remote.url)

    def _expired(self, seq: int, root: bytes) -> None:
        log.warning("local tier: queued snapshot %s left the local catalog (expired by retention) before it was "
                    "uploaded; dropped from the queue", root.hex()[:16])
        self.local.refs.upload_drop(seq)

    def _send(self, objs: dict, fence: int) -> None:
        """Blocks, then nodes, then the commit: each kind complete before the next, so
        the remote never holds a node whose blocks are not there yet; then one sync."""
        for kind in ("block", "node", "commit"):
            for new in self.remote.pool.map(lambda d, kind=kind: self._copy(kind, d, fence), objs[kind]):
                if new:
                    self.sent += 1
                else:
                    self.skipped += 1
        self.remote.assets.sync()

    def _copy(self, kind: str, d: bytes, fence: int) -> bool:
        return self.remote.assets.copy_from(self.local.assets, kind, d, fence)


# -- recovery: the newest trusted copy in either tier -------------------------------
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

    def __init__(self, local, remote: Core):
        self.local, self.remote = local, remote
        self._told: set[bytes] = set()
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.local, name)

    def after_fork(self) -> None:
        self._lock = threading.Lock()  # the parent's may have been held by a thread not here

    def _fell(self, what: str, d: bytes, err: BaseException) -> None:
        with self._lock:
            if d in self._told:
                return
            self._told.add(d)
        log.warning("local tier: %s %s %s (%s); reading it from %s", what, d.hex()[:16],
                    "is missing" if getattr(err, "reason", None) == "missing" else "failed its check", err,
                    self.remote.url)

    # The remote reads pass no fence: the caller's is the local table's gc epoch, and an
    # object recorded present in the remote's presence record under another store's
    # epoch could let the uploader skip it wrongly.
    def read_block_into(self, d: bytes, out, *, verify: bool = True, snapshot=None, path=None,
                        bounce: bool = False, fence: int | None = None) -> None:
        try:
            return self.local.read_block_into(d, out, verify=verify, snapshot=snapshot, path=path, bounce=bounce,
                                              fence=fence)
        except (IntegrityError, UnreadableObject) as e:
            self._fell("block", d, e)
            err = e
        try:
            self.remote.assets.read_block_into(d, out, verify=verify, snapshot=snapshot, path=path, bounce=bounce)
        except (IntegrityError, UnreadableObject):
            raise err from None  # in neither tier: the local copy's fault says the most

    def get_node(self, d: bytes, *, verify: bool = True, snapshot=None, path=None, fence: int | None = None) -> bytes:
        try:
            return self.local.get_node(d, verify=verify, snapshot=snapshot, path=path, fence=fence)
        except (IntegrityError, UnreadableObject) as e:
            self._fell("node", d, e)
            err = e
        try:
            return self.remote.assets.get_node(d, verify=verify, snapshot=snapshot, path=path)
        except (IntegrityError, UnreadableObject):
            raise err from None

    def get_commit(self, d: bytes, *, verify: bool = True) -> bytes:
        try:
            return self.local.get_commit(d, verify=verify)
        except (IntegrityError, UnreadableObject) as e:
            self._fell("commit", d, e)
            err = e
        try:
            return self.remote.assets.get_commit(d, verify=verify)
        except (IntegrityError, UnreadableObject):
            raise err from None

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
