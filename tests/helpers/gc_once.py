"""GC crash-test collector: one store.gc(), started on demand, to be SIGKILLed.

    python gc_once.py STORE LEASE [--delete-rate OBJECTS_PER_SECOND]

STORE is a local path or a tests/_backends.py Backend.spec() string (target.py).
Imports and opens the store first, so that the kill clock, started when the
test writes "go", measures gc work only. With --delete-rate the store's
deletes are paced to at most that many objects a second across all threads
(a slow object store, one request per object), so a deletion phase lasts long
with few objects. LEASE: the gc's lease (seconds).

Protocol on stdout (each line flushed):
    ready                       waiting for "go" on stdin
    started                     "go" read; store.gc() is being called
    report <deleted> <expired> <candidates> <seconds>   gc returned
    done
"""

from __future__ import annotations

import sys
import threading
import time

from target import open_target  # tests/helpers is sys.path[0]

from tensorstore_ck.storage.base import check_deadline
from tensorstore_ck.storage.wrappers import WrappedStore


class SlowDeletes(WrappedStore):
    """Deletes at most `rate` objects a second (all threads together); each call
    returns once its share of the time has passed. Everything else is untouched."""

    def __init__(self, inner, rate: float):
        super().__init__(inner)
        self.rate = rate
        self._lock = threading.Lock()
        self._free_at = time.monotonic()

    def _pace(self, n: int) -> None:
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + n / self.rate
            wait = self._free_at - now
        time.sleep(wait)

    def delete(self, key):
        self._pace(1)
        return self.inner.delete(key)

    def delete_many(self, keys, *, deadline=None):
        for key in keys:  # one slow request per object, each started within the deadline
            check_deadline(deadline)
            self.delete(key)

    @property
    def request_timeout(self) -> float:
        return self.inner.request_timeout + 1.0 / self.rate


def main() -> int:
    store_path, lease = sys.argv[1], float(sys.argv[2])
    kw = {}
    if sys.argv[3:5] and sys.argv[3] == "--delete-rate":
        rate = float(sys.argv[4])
        kw["wrap_storage"] = lambda inner: SlowDeletes(inner, rate)
    store = open_target(store_path, gc_lease=lease, **kw)
    store.reftable.gc_state()  # touch the ref table so its first use is not on the clock
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 3
    print("started", flush=True)
    r = store.gc()
    print(f"report {r.deleted_objects} {len(r.expired)} {r.candidates} {r.seconds:.4f}", flush=True)
    store.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
