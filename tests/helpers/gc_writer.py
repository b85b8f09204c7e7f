"""GC race writer: commits deduplicating snapshots in a loop while a gc runs.

    python gc_writer.py STORE WRITER STEPS [MAX_PAUSE_SECONDS]

STORE is a local path or a tests/_backends.py Backend.spec() string (target.py).

Commits gc_states.race_state(WRITER, k) for k = 0..STEPS-1 to ref "w<WRITER>/main".
After committing k it checks out snapshot k-1 (retention keep_last=2 keeps k-1
and k, so a correct gc never touches it) and compares it bit for bit, so a
block that gc deleted under a committed snapshot is caught while the race runs.
Between two commits it sleeps a random time in [0, MAX_PAUSE_SECONDS] (default
0), so that gc runs land at every offset of the writer's cycle: some condemn and
delete k-3's blocks before k looks them up, some while k is being written.

Protocol on stdout (each line flushed):
    ready                                   store opened; waiting for "go" on stdin
    (before its last commit it waits for "last" on stdin: the test lets it end once gc has
    run enough times beside the commits, whatever the machine's load)
    committed <step> <root> <blocks_new> <put_seconds>   after put_snapshot returned
    verified <step>                          snapshot <step> read back bit-exact
    damaged <step> <root> <error kind> <message>          it did not
    done <n damaged>
"""

from __future__ import annotations

import logging
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gc_states  # noqa: E402
from target import open_target  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402


def main() -> int:
    # The publisher's waits and re-validations (DEBUG) go to stderr, which the test keeps and shows.
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("tensorstore_ck.write.publish").setLevel(logging.DEBUG)
    store_path, writer, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    pause = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
    rng = random.Random(writer)
    ref = f"w{writer}/main"
    store = open_target(store_path, block_size=gc_states.RACE_BLOCK,
                        inline_threshold=gc_states.RACE_INLINE)
    gc_states.race_state(writer, 0)  # warm the caches of base and variants
    for v in range(gc_states.RACE_VARIANTS):
        gc_states.race_state(writer, v)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 3
    damaged = 0
    prev = None
    for k in range(steps):
        if k == steps - 1 and sys.stdin.readline().strip() != "last":
            return 3
        state = gc_states.race_state(writer, k)
        t = time.monotonic()
        info = store.put_snapshot(state, ref=ref, step=k, meta={"writer": writer})
        dt = time.monotonic() - t
        print(f"committed {k} {info.root} {info.blocks_new} {dt:.4f}", flush=True)
        if prev is not None:
            pk, proot = prev
            try:
                got = store.checkout(proot)
                ok = gc_states.same_bits(gc_states.race_state(writer, pk), got)
                err = ("mismatch", "content differs")
            except tsck.TsckError as e:
                ok, err = False, (e.kind, str(e).replace("\n", " "))
            if ok:
                print(f"verified {pk}", flush=True)
            else:
                damaged += 1
                print(f"damaged {pk} {proot} {err[0]} {err[1]}", flush=True)
        prev = (k, info.root)
        if pause:
            time.sleep(rng.uniform(0.0, pause))
    store.close()
    print(f"done {damaged}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
