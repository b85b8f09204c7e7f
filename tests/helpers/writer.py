"""Crash-test writer: loops put_snapshot until killed.

    python writer.py STORE REF START_STEP [--steps N] [--block-size B] [--wait-go] [--freeze-at POINT]

STORE is a local path or a tests/_backends.py Backend.spec() string (target.py).

With --wait-go the writer imports everything, prints "ready" and waits for a line
"go [START]" on stdin (START overrides START_STEP) before it opens the store.

With --freeze-at the writer stops itself (SIGSTOP, after printing "frozen") at one
moment of creating a new store, for a test to kill it exactly there:
    marker-link   a local store's marker written in full to a temp file, not yet linked
                  as tsck.json (the store directory holds a file but no marker)
    marker-made   the marker stored (create_marker returned), the ref table not yet made

Protocol on stdout (each line flushed):
    ready                    imports done (and, with --wait-go, waiting for "go" on stdin)
    frozen                   stopped at --freeze-at's moment (SIGSTOP: only a kill follows)
    opened                   store opened
    committed <step> <root>  printed only after put_snapshot returned for that step
    done                     clean exit after --steps puts
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import statelib  # noqa: E402
from target import open_target  # noqa: E402


def preload(arg: str) -> None:
    """Import the client libraries a remote store needs now, so that the kill clock,
    started at "go", measures store work and not imports (s3fs/aiobotocore, psycopg)."""
    if not arg.startswith("{"):
        return
    spec = json.loads(arg)
    if spec["url"].startswith("s3://"):
        import s3fs  # noqa: F401
    if spec.get("refs") and not os.path.isabs(spec["refs"]):
        import psycopg  # noqa: F401


def freeze_at(point: str) -> None:
    """Stop this process at `point` of the store's creation (see the module's doc). The
    moment is seen from inside, by an audit hook or a profile hook on the main thread,
    so a test catches it every time instead of polling for a window of microseconds."""
    done = []

    def freeze() -> None:
        done.append(True)
        print("frozen", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)

    if point == "marker-link":
        def audit(event, args):
            if not done and event == "os.link" and os.path.basename(os.fsdecode(args[1])) == "tsck.json":
                freeze()
        sys.addaudithook(audit)
    elif point == "marker-made":
        def profile(frame, event, _arg):
            if (event == "return" and frame.f_code.co_name == "create_marker"
                    and frame.f_globals.get("__name__") == "tensorstore_ck.core.assets"):
                sys.setprofile(None)
                freeze()
        sys.setprofile(profile)
    else:
        raise SystemExit(f"unknown --freeze-at {point!r}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("ref")
    ap.add_argument("start", type=int)
    ap.add_argument("--steps", type=int, default=-1, help="stop after N puts (default: never)")
    ap.add_argument("--block-size", type=int, default=1 << 20)
    ap.add_argument("--wait-go", action="store_true")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--freeze-at", choices=["marker-link", "marker-made"])
    a = ap.parse_args()
    preload(a.store)

    print("ready", flush=True)
    if a.wait_go:
        words = sys.stdin.readline().split()
        if not words or words[0] != "go":
            return 3
        if len(words) > 1:
            a.start = int(words[1])
    # Pre-build the first state so that the kill clock mostly measures store work.
    step = a.start
    state = statelib.crash_state(step, a.seed)
    if a.freeze_at:
        freeze_at(a.freeze_at)
    store = open_target(a.store, block_size=a.block_size, inline_threshold=4096)
    print("opened", flush=True)
    n = 0
    while a.steps < 0 or n < a.steps:
        info = store.put_snapshot(
            state, ref=a.ref, step=step, meta={"digest": state["digest"], "writer_pid": os.getpid()}
        )
        sys.stdout.write(f"committed {step} {info.root}\n")
        sys.stdout.flush()
        n += 1
        step += 1
        state = statelib.crash_state(step, a.seed)
    store.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
