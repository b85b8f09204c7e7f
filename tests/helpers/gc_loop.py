"""GC race collector: runs store.gc() back to back until told to stop.

    python gc_loop.py STORE LEASE STOP_FILE [MAX_PAUSE_SECONDS]

STORE is a local path or a tests/_backends.py Backend.spec() string (target.py).

Between two gc runs it sleeps a random time in [0, MAX_PAUSE_SECONDS] (default 0:
back to back), so freezes land at varied moments of the writers' commits.

Protocol on stdout (each line flushed):
    ready                      store opened; waiting for "go" on stdin
    gc <n> expired=<e> candidates=<c> deleted=<d> rescued=<r> kept=<k> seconds=<s>
    gcerror <n> <error kind> <message>     a gc raised (it should never)
    done <runs> <errors>       STOP_FILE appeared; the last gc had finished
"""

from __future__ import annotations

import os
import random
import sys
import time

from target import open_target  # tests/helpers is sys.path[0]

import tensorstore_ck as tsck


def main() -> int:
    store_path, lease, stop_file = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    store = open_target(store_path, gc_lease=lease)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 3
    n = errors = 0
    while not os.path.exists(stop_file):
        try:
            r = store.gc()
        except tsck.TsckError as e:
            errors += 1
            print(f"gcerror {n} {e.kind} {str(e).replace(chr(10), ' ')}", flush=True)
        else:
            print(f"gc {n} expired={len(r.expired)} candidates={r.candidates} deleted={r.deleted_objects} "
                  f"rescued={r.rescued} kept={r.kept_snapshots} seconds={r.seconds:.4f}", flush=True)
        n += 1
        if pause:
            time.sleep(random.uniform(0.0, pause))
    store.close()
    print(f"done {n} {errors}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
