"""GC crash-test collector: one store.gc(), started on demand, to be SIGKILLed.

    python gc_once.py STORE STALE_AFTER

Imports and opens the store first, so that the kill clock, started when the
test writes "go", measures gc work only.

Protocol on stdout (each line flushed):
    ready                       waiting for "go" on stdin
    started                     "go" read; store.gc() is being called
    report <deleted> <expired> <candidates> <seconds>   gc returned
    done
"""

from __future__ import annotations

import sys

import tensorstore_ck as tsck


def main() -> int:
    store_path, stale = sys.argv[1], float(sys.argv[2])
    store = tsck.open_store(store_path, gc_stale_after=stale)
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
