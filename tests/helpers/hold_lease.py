"""A prune or gc that hangs on its storage while it holds the store's gc lock, to be SIGKILLed.

    python hold_lease.py STORE prune JOB     hangs before its expiry (phase "marking")
    python hold_lease.py STORE gc            hangs at its first delete (phase "deleting", epoch odd)

STORE is a local path or a tests/_backends.py Backend.spec() string (target.py). The
prune hangs on the storage clock's probe (the first storage request after it took the
lock), the gc on its first delete request; neither request ever returns, and the lease
goes on being renewed from its thread, as a live gc's is.

Protocol on stdout (each line flushed):
    ready                       opened; waiting for "go" on stdin
    started                     "go" read; store.prune(JOB) / store.gc() is being called
    holding <pid>               the request hangs: the lock is held
    returned                    the call returned without hanging (the test's setup is wrong)
"""

from __future__ import annotations

import os
import sys
import threading

from target import open_target  # tests/helpers is sys.path[0]

import gc_states
from tensorstore_ck.storage.wrappers import WrappedStore


class Hanging(WrappedStore):
    """Once armed, the chosen request hangs (a storage that stopped answering); the first says so."""

    armed = False
    at = "delete"

    def __init__(self, inner):
        super().__init__(inner)
        self._said = threading.Lock()

    def _hang(self):
        if self._said.acquire(blocking=False):
            print(f"holding {os.getpid()}", flush=True)
        threading.Event().wait()

    def clock_now(self):
        if self.armed and self.at == "clock":
            self._hang()
        return self.inner.clock_now()

    def delete(self, key):
        if self.armed and self.at == "delete":
            self._hang()
        return self.inner.delete(key)

    def delete_many(self, keys, *, deadline=None):
        if self.armed and self.at == "delete":
            self._hang()
        return self.inner.delete_many(keys, deadline=deadline)


def main() -> int:
    spec, what = sys.argv[1], sys.argv[2]
    Hanging.at = "clock" if what == "prune" else "delete"
    store = open_target(spec, block_size=gc_states.CRASH_BLOCK, inline_threshold=gc_states.CRASH_INLINE,
                        wrap_storage=Hanging)
    store.reftable.gc_state()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 3
    print("started", flush=True)
    Hanging.armed = True
    if what == "prune":
        store.prune(sys.argv[3])
    else:
        store.gc()
    print("returned", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
