"""Asynchronous collective puts under a host-memory bound, with real gloo ranks, for
tests/write/test_host_memory.py and benches/bench_host_memory.py.

    python host_memory_worker.py flat OUTDIR SAVER [ROUNDS [MIB]]

SAVER: "thread" or "process" (open_store(saver=)). Two ranks forked by dist_worker.launch
each put their own state of MIB MiB (default 8; the bound is 1.5 times it) ROUNDS times
(default 12) asynchronously, changing it in place after each put returns, and record the
staging's counters (Store.staging) and their resident memory (and their saver's) after
the first snapshot and after the last, then check out the last. Then rank 0 puts a state
past the bound (refused at once: InvalidArgument) while rank 1 puts its own (that call
aborts there: SnapshotAborted), and both put once more. Every rank writes
OUTDIR/flat_rank<r>.json; the test judges.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_worker as dw  # noqa: E402  (the launcher)
from dist_worker import launcher_main  # noqa: E402
import torch  # noqa: E402

REF = "j/m"
MiB = 1 << 20


def rss(pid="self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def flat_case(rank, world, out, res, arg):
    import tensorstore_ck as tsck
    saver, rounds, mib = arg
    bound = mib * MiB * 3 // 2
    state = {"w": torch.randn(mib * MiB // 4, generator=torch.Generator().manual_seed(rank)), "step": 0}
    with tsck.open_store(os.path.join(out, "store"), block_size=1 << 20, saver=saver, host_memory=bound) as s:
        res["bound"] = s.host_memory

        last = torch.empty_like(state["w"])

        def put(i):
            t0 = time.monotonic()
            fut = s.put_snapshot(state, REF, step=i, blocking=False, timeout=120)
            stall = time.monotonic() - t0
            last.copy_(state["w"])  # (in place: the worker's own allocations are not what is measured)
            state["w"].add_(1.0)  # what the next training step does, at once
            state["step"] = i + 1
            fut.result(timeout=240)
            return stall

        stalls = [put(0)]
        res["rss_first"], res["held_first"] = rss(), s.staging.held
        res["saver_rss_first"] = rss(s._saver.pid) if saver == "process" else 0
        res["rss_each"] = []
        for i in range(1, rounds):
            stalls.append(put(i))
            res["rss_each"].append(rss())
        res["rss_last"], res["held_last"], res["peak"] = rss(), s.staging.held, s.staging.peak
        res["saver_rss_last"] = rss(s._saver.pid) if saver == "process" else 0
        res["stall_median"] = sorted(stalls)[len(stalls) // 2]
        got = s.checkout(REF)
        res["restored"] = bool(torch.equal(got["w"], last)) and got["step"] == rounds - 1
        # Past the bound on rank 0 only: its call raises at once, and the call aborts on rank 1.
        past = {"w": torch.randn(2 * mib * MiB // 4)} if rank == 0 else state
        try:
            fut = s.put_snapshot(past, REF, step=rounds, blocking=False, timeout=120)
            fut.result(timeout=240)
            res["past_bound"] = "returned"
        except Exception as e:  # noqa: BLE001 - recorded for the test
            res["past_bound"] = f"{type(e).__name__}: {e}"
        s.put_snapshot(state, REF, step=rounds + 1, blocking=False, timeout=120).result(timeout=240)
        res["after"] = "returned"


def scenarios(scenario: str, out: str, argv: list) -> list | None:
    """SCENARIO -> the launch infos of its runs (tests/_util.launcher_main runs this)."""
    torch.set_num_threads(1)
    if scenario != "flat":
        return None
    saver = argv[3] if len(argv) > 3 else "thread"
    rounds = int(argv[4]) if len(argv) > 4 else 12
    mib = int(argv[5]) if len(argv) > 5 else 8
    return [dw.launch("flat", 2, flat_case, out, (saver, rounds, mib), limit=60.0 + 3.0 * rounds)]


if __name__ == "__main__":
    launcher_main(scenarios)
