"""Put one crash-test state: python put_once.py STORE JOB VARIANT STEP

Opens the store, prints "ready", waits for "go" on stdin, then commits
gc_states.crash_state(JOB, VARIANT) to JOB/main at STEP and prints
"committed <root>"."""

from __future__ import annotations

import sys

import gc_states
from target import open_target  # tests/helpers is sys.path[0]


def main() -> int:
    spec, job, variant, step = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    store = open_target(spec, block_size=gc_states.CRASH_BLOCK, inline_threshold=gc_states.CRASH_INLINE)
    state = gc_states.crash_state(job, variant)
    store.reftable.gc_state()
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 3
    info = store.put_snapshot(state, ref=f"{job}/main", step=step)
    print(f"committed {info.root}", flush=True)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
