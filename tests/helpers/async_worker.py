"""Asynchronous collective puts (put_snapshot(..., blocking=False) under torch.distributed)
with real gloo ranks, for tests/collective/test_dist_async.py.

    python async_worker.py SCENARIO OUTDIR [ARG]

SCENARIO: inflight (ARG: world), inflight_saver (the same with saver="process"), localerr, dies, mixed, gcphase. The ranks are forked
by dist_worker.launch (the c10d TCPStore hosted by the launcher); every rank writes
OUTDIR/<phase>_rank<r>.json with what it saw (roots, errors, what the call returned
and when); the test judges.
"""

from __future__ import annotations

import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_worker as dw  # noqa: E402  (the launcher and the shared state definitions)
from dist_worker import launcher_main  # noqa: E402
import torch  # noqa: E402

REF = dw.REF
SAVER = "thread"  # open_store(saver=) of the stores the ranks open ("inflight_saver": "process")


def _wait(fut, res, key):
    """The outcome of an asynchronous put's future: its root, or its error's type and message."""
    t0 = time.monotonic()
    try:
        info = fut.result(timeout=240)
        res[key] = "returned"
        res[key + "_root"] = info.root
    except Exception as e:  # noqa: BLE001 - recorded for the test
        res[key], res[key + "_message"] = type(e).__name__, str(e)
    res[key + "_waited"] = time.monotonic() - t0


def inflight_case(rank, world, out, res, _arg):
    """Four asynchronous collective puts in a row with max_inflight=2, each rank changing
    its tensors in place as soon as a put returns (what a training step does): each
    snapshot must hold the state as it was at its call. Then a store opened per call
    (closed at once: close() waits for the collective), and a blocking put after an
    asynchronous one (it waits for it: the ref never moves back)."""
    import tensorstore_ck as tsck
    with dw._open(out, max_inflight=2, saver=SAVER) as s:
        st = dw.small_state(rank, world, 1)
        futs = []
        for v in range(1, 5):
            st["w"].local.copy_(dw.small_state(rank, world, v)["w"].local)  # in place: the same buffers
            st["v"] = v
            futs.append(s.put_snapshot(st, REF, step=v, blocking=False, timeout=60))
            res[f"type{v}"] = type(futs[-1]).__name__
        st["w"].local.fill_(-1.0)  # scribbled over: the snapshots were staged before this
        for v, f in enumerate(futs, 1):
            _wait(f, res, f"put{v}")
        res["cancel_refused"] = futs[-1].cancel() is False
        f5 = s.put_snapshot(dw.small_state(rank, world, 5), REF, step=5, blocking=False, timeout=60)
        info6 = s.put_snapshot(dw.small_state(rank, world, 6), REF, step=6, timeout=60)  # blocking: after 5
        res["put5_done_before_6"] = f5.done()
        _wait(f5, res, "put5")
        res["put6_root"] = info6.root
        res["savers"] = 0 if s._saver is None else s._saver.started
    for v in (7, 8):  # a Store per call, closed right after the call returned
        with tsck.open_store(os.path.join(out, "percall"), block_size=dw.BLOCK, inline_threshold=dw.INLINE,
                             saver=SAVER) as s2:
            f = s2.put_snapshot(dw.small_state(rank, world, v), REF, step=v, blocking=False, timeout=60)
        _wait(f, res, f"percall{v}")


def localerr_case(rank, world, out, res, _arg):
    """Rank 1's state for put 2 cannot be snapshotted (a lambda in it): its call raises at
    once; the others' futures fail fast (its abort reaches them; the deadline is far);
    put 3 then works on every rank (the calls stay named alike)."""
    with dw._open(out) as s:
        _wait(s.put_snapshot(dw.small_state(rank, world, 1), REF, step=1, blocking=False, timeout=120), res, "put1")
        st = dw.small_state(rank, world, 2)
        if rank == 1:
            st["bad"] = lambda: None
        try:
            f = s.put_snapshot(st, REF, step=2, blocking=False, timeout=120)
            _wait(f, res, "put2")
        except Exception as e:  # noqa: BLE001
            res["put2"], res["put2_message"], res["put2_raised"] = type(e).__name__, str(e), True
        _wait(s.put_snapshot(dw.small_state(rank, world, 3), REF, step=3, blocking=False, timeout=120), res, "put3")


def dies_case(rank, world, out, res, timeout):
    """Put 1 is published; rank 1 stages put 2 and is killed (SIGKILL) at once; the other
    ranks stage puts 2 and 3. Their futures must fail within the deadline rules, never hang,
    and close() must return."""
    with dw._open(out) as s:
        _wait(s.put_snapshot(dw.small_state(rank, world, 1), REF, step=1, blocking=False, timeout=timeout),
              res, "put1")
        f2 = s.put_snapshot(dw.small_state(rank, world, 2), REF, step=2, blocking=False, timeout=timeout)
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        f3 = s.put_snapshot(dw.small_state(rank, world, 3), REF, step=3, blocking=False, timeout=timeout)
        _wait(f2, res, "put2")
        _wait(f3, res, "put3")
        t0 = time.monotonic()
    res["close_elapsed"] = time.monotonic() - t0


def gcphase_case(rank, world, out, res, _arg):
    """Asynchronous collective puts while whole gcs (grace 0) run in another process: a put
    whose ref move a deletion phase fences is revalidated in the background, on every rank."""
    import subprocess
    import torch.distributed as dist
    dw._create_first(rank, out)
    gc_proc = None
    if rank == 0:
        gc_proc = subprocess.Popen([sys.executable, "-c", (
            "import sys, time, tensorstore_ck as tsck\n"
            "s = tsck.open_store(sys.argv[1])\n"
            "end = time.monotonic() + float(sys.argv[2])\n"
            "n = 0\n"
            "while time.monotonic() < end:\n"
            "    s.gc(grace=0); n += 1\n"
            "print(n)\n"), os.path.join(out, "store"), "8"], stdout=subprocess.PIPE)
    dist.barrier()
    with dw._open(out) as s:
        futs = [s.put_snapshot(dw.small_state(rank, world, v), REF, step=v, blocking=False, timeout=120)
                for v in range(1, 9)]
        for v, f in enumerate(futs, 1):
            _wait(f, res, f"put{v}")
    if gc_proc is not None:
        res["gcs"] = int(gc_proc.communicate(timeout=120)[0] or 0)


def scenarios(scenario: str, out: str, argv: list) -> list | None:
    """SCENARIO -> the launch infos of its runs (tests/_util.launcher_main runs this)."""
    arg = int(argv[3]) if len(argv) > 3 else None
    torch.set_num_threads(1)
    if scenario == "inflight":
        infos = [dw.launch("inflight", arg or 2, inflight_case, out, limit=180.0)]
    elif scenario == "inflight_saver":  # the same, each rank's blocks written by its saver process
        global SAVER
        SAVER = "process"
        infos = [dw.launch("inflight", arg or 2, inflight_case, out, limit=180.0)]
    elif scenario == "localerr":
        infos = [dw.launch("localerr", 3, localerr_case, out, limit=60.0)]
    elif scenario == "dies":
        infos = [dw.launch("dies", 3, dies_case, out, arg or 3, limit=120.0)]
    elif scenario == "gcphase":
        infos = [dw.launch("gcphase", 2, gcphase_case, out, limit=240.0)]
    else:
        return None
    return infos


if __name__ == "__main__":
    launcher_main(scenarios)
