"""The copies a restore fetched from peers, kept in the rank's tier off the restore's path
(tier/replicas.py's Peers.keep and keep_from_holders): a cache for the next restore,
written by a background thread at a low priority once the checkout is done, synced once
they settle. A batched restore uses each block up as it arrives (one buffer per fetching
thread, reused), so what it fetched is fetched again from the holders to be kept; a single
fetch's frame is kept as it was received."""

from __future__ import annotations

import logging

from ..errors import TsckError

__all__ = ["Keeper", "keep_copy", "KEEP_QUEUED"]

log = logging.getLogger(__name__)


class Keeper:
    """Keeps the blocks a checkout fetched from peers in this rank's tier, off the
    checkout's path: a background thread writes them (and makes them durable once it has
    nothing queued), so the restore spends its CPU and disk on the restore. Only a cache
    for the next restore: past KEEP_QUEUED bytes waiting, a copy is not kept; a tier that
    cannot take one costs a warning (keep_copy)."""

    def __init__(self, storage):
        import threading
        self.storage = storage
        self._queue: list = []
        self._queued = 0
        self._cond = threading.Condition()
        self._thread = None
        self._closed = self._dirty = False
        self._paused = 0  # restores fetching now: the writes wait for them (the disk is theirs)

    def pause(self) -> None:
        """A restore's batched fetches begin: what is queued meanwhile is written once they
        end (resume), not on the disk and cores the restore is using."""
        with self._cond:
            self._paused += 1

    def resume(self) -> None:
        with self._cond:
            self._paused -= 1
            self._cond.notify()

    def keep(self, key: str, data) -> None:
        n = len(data)
        with self._cond:
            if self._closed or self._queued + n > KEEP_QUEUED:
                log.debug("peer replicas: %s fetched from a peer is not kept (%d bytes wait already)", key,
                          self._queued)
                return
            self._queue.append((key, data))
            self._queued += n
            self._start()
            self._cond.notify()

    def refetch(self, digests: list, fetch, per: int) -> None:
        """Keep the blocks `digests` by fetching them again, `per` at a time, once no
        checkout pauses this (fetch(some digests, take): each checked frame given to
        take(digest, frame) as it arrives): a restore that used them up held no frame."""
        with self._cond:
            if self._closed:
                return
            self._queue.append((None, (list(digests), fetch, per)))
            self._start()
            self._cond.notify()

    def wrote(self) -> None:
        """A copy was written into the tier by the caller (a node, read back at once): the
        thread makes it durable with the rest."""
        with self._cond:
            if self._closed:
                return
            self._dirty = True
            self._start()
            self._cond.notify()

    def _start(self) -> None:
        import threading
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tsck-peer-keep", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        import os
        import threading
        try:  # a cache's writes yield the CPU to the restore and the training it serves
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), KEEP_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            with self._cond:
                if not self._queue and self._dirty and not self._closed:
                    self._cond.wait(KEEP_SETTLE)  # more may come: one sync for a checkout's copies
                while (self._paused or (not self._queue and not self._dirty)) and not self._closed:
                    self._cond.wait()
                batch, self._queue, self._queued = self._queue, [], 0
                closed = self._closed
            wrote = False
            for key, data in batch:
                wrote = (self._fetched(*data) if key is None else keep_copy(self.storage, key, data)) or wrote
            with self._cond:
                self._dirty = self._dirty or wrote
                sync = self._dirty and (closed or not self._queue)
                if sync:
                    self._dirty = False
            if sync:  # nothing more came: the copies are named and durable
                try:
                    self.storage.sync()
                except (OSError, TsckError) as e:
                    log.warning("peer replicas: the copies fetched from peers could not be synced in this "
                                "rank's tier (%s)", e)
            if closed:
                with self._cond:
                    if not self._queue and not self._dirty:
                        return

    def _fetched(self, digests: list, fetch, per: int) -> bool:
        from ..core.assets import Assets
        wrote = []

        def take(d, frame):
            wrote.append(keep_copy(self.storage, Assets.object_key("blocks", d), frame))
        for i in range(0, len(digests), per):
            try:
                fetch(digests[i:i + per], take)
            except (OSError, TsckError) as e:
                log.debug("peer replicas: %d block(s) to keep could not be fetched again (%s)", len(digests) - i, e)
                break
        return any(wrote)

    def close(self) -> None:
        """Write and sync what is queued (fetching again what is to be), then stop."""
        with self._cond:
            thread, self._closed = self._thread, True
            self._cond.notify()
        if thread is not None:
            thread.join()


KEEP_QUEUED = 256 << 20  # bytes of fetched copies that may wait to be kept
KEEP_SETTLE = 0.5  # seconds without a new copy before the kept ones are synced
KEEP_NICE = 10  # the keeping thread's nice value (Linux: per thread)


def keep_copy(storage, key: str, data) -> bool:
    """Keep a checked copy fetched from a peer in this rank's tier -> whether it is there.
    Only a cache for the next restore: a tier that cannot take it (a full disk) costs a
    warning, never the restore, which has the checked bytes (a node or commit not kept is
    read from the remote)."""
    try:
        storage.put_addressed(key, [data])
        return True
    except (OSError, TsckError) as e:
        log.warning("peer replicas: %s fetched from a peer could not be kept in this rank's tier (%s)", key, e)
        return False
