"""Concurrency-test worker: several of these snapshot into one store at once.

    python conc_worker.py STORE REF WORKER NWORKERS ROUNDS MODE BARRIER_DIR

MODE is "uncond" (plain put_snapshot) or "cas" (put_snapshot(expected=<root last
seen>)). Every round starts with a file barrier shared by all NWORKERS workers so
that their puts really overlap. Output lines (flushed):
    ready
    ok <round> <root> <blocks_new> <bytes_new>
    conflict <round> <expected> <actual>
    done
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import statelib  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402


def barrier(bar_dir: str, name: str, me: int, n: int, timeout: float = 120.0) -> None:
    open(os.path.join(bar_dir, f"{name}.{me}"), "w").close()
    want = [os.path.join(bar_dir, f"{name}.{w}") for w in range(n)]
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in want):
        if time.monotonic() > deadline:
            raise SystemExit(f"barrier {name} timed out")
        time.sleep(0.0002)


def main() -> int:
    store_path, ref, worker, nworkers, rounds, mode, bar_dir = sys.argv[1:8]
    worker, nworkers, rounds = int(worker), int(nworkers), int(rounds)
    assert mode in ("uncond", "cas"), mode
    states = [statelib.conc_state(worker, i) for i in range(rounds)]
    barrier(bar_dir, "open", worker, nworkers)  # opens race too (maybe creating the store)
    store = tsck.open_store(store_path, block_size=64 * 1024, inline_threshold=1024)
    print("ready", flush=True)
    barrier(bar_dir, "start", worker, nworkers)
    for i in range(rounds):
        kwargs = {}
        if mode == "cas":
            try:
                seen = store.resolve(ref)
            except tsck.RefNotFound:
                seen = None
            kwargs["expected"] = seen
        barrier(bar_dir, f"r{i}", worker, nworkers)
        try:
            info = store.put_snapshot(
                states[i], ref=ref, step=worker * 100_000 + i, meta={"worker": worker, "i": i}, **kwargs
            )
        except tsck.RefConflict as e:
            print(f"conflict {i} {e.expected} {e.actual}", flush=True)
        else:
            print(f"ok {i} {info.root} {info.blocks_new} {info.bytes_new}", flush=True)
    store.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
