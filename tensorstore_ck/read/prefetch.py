"""A restart's reads begun before the job needs them: the blocks of a ref's newest snapshot
that this store holds on a local disk (a local store, or a rank's local tier: its part of a
collective snapshot) read once through the page cache in the background (Store.prefetch).

A restarting rank spends its first seconds importing torch, building its model and
optimizer (whose construction imports torch._dynamo) and joining the process group; none
of that touches the disk. Started before them, the prefetch reads the snapshot's files at
the disk's speed meanwhile, so the restore that follows finds them in memory and pays
only the verification and the copies (docs/design/reading.md, "Prefetch"; the restart
benchmark measures it). It is a hint: it reads nothing into the process's tensors, checks
nothing (the restore verifies every byte as always), and any failure of its own is logged
and ends it, never the job. Object stores are not prefetched: their reads are requests
the restore makes in parallel anyway.
"""

from __future__ import annotations

import logging
import threading
import time

from ..core.walk import walk_commit

__all__ = ["Prefetch"]

log = logging.getLogger(__name__)

_CHUNK = 1 << 20


class Prefetch:
    """One prefetch in its thread: wait() for it; `files` and `bytes` read, `error` (a
    string) when it ended early, `seconds` it took."""

    def __init__(self, core, ref: str, workers: int = 4):
        self.ref = ref
        self.files = self.bytes = 0
        self.error: str | None = None
        self.seconds = 0.0
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._stop = False
        if not core.storage.local:
            self._done.set()  # an object store: nothing to read ahead of the restore
            return
        threading.Thread(target=self._run, args=(core, workers), name="tsck-prefetch", daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        """True once the prefetch has ended (read everything, or stopped)."""
        return self._done.wait(timeout)

    def cancel(self) -> None:
        self._stop = True

    def _run(self, core, workers: int) -> None:
        t0 = time.monotonic()
        try:
            root = core.refs.get_or_none(self.ref)
            if root is None:
                return
            part = core.refs.tier_rows.parts().get(root) if hasattr(core.refs, "tier_rows") else None
            blocks = []
            for obj in walk_commit(core.assets, root, verify=False, part=part):
                if self._stop:
                    return
                if obj.kind == "block":
                    blocks.append(obj.digest)
            self._read_all(core.assets, list(dict.fromkeys(blocks)), workers)
        except Exception as e:  # noqa: BLE001 - a hint: it ends, the restore reads as always
            self.error = f"{type(e).__name__}: {e}"
            log.info("prefetch of %s ended early: %s", self.ref, self.error)
        finally:
            self.seconds = time.monotonic() - t0
            self._done.set()

    def _read_all(self, assets, blocks: list, workers: int) -> None:
        it = iter(blocks)
        take = threading.Lock()

        def reader() -> None:
            buf = bytearray(_CHUNK)
            view = memoryview(buf)
            while not self._stop:
                with take:
                    d = next(it, None)
                if d is None:
                    return
                try:
                    f = assets.open_stored("block", d)
                except OSError:
                    continue  # not held here (a block another rank's tier holds)
                n = 0
                with f:
                    while True:
                        k = f.readinto(view)
                        if not k:
                            break
                        n += k
                with self._lock:
                    self.files += 1
                    self.bytes += n

        threads = [threading.Thread(target=reader, name="tsck-prefetch-read", daemon=True)
                   for _ in range(max(1, workers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
