#!/usr/bin/env python
"""Host-memory benchmark: what asynchronous snapshots hold in host memory, over many
snapshots, and what the host-memory bound (open_store(host_memory=)) costs in stall.

1. Memory over snapshots. One process puts a --mib MiB state (int32, its values toggled
   each round and one block changed, so every put stages and hashes all of it and writes
   a block new) asynchronously --snapshots times, waiting for each, with saver="thread"
   and saver="process"; the process's VmRSS (and its saver's) after the first snapshot and
   after the last, and the staging's bytes held and peak (Store.staging). Then the same
   on 2 gloo ranks (tests/helpers/host_memory_worker.py, --rank-mib MiB a rank, the bound
   1.5 times it), each rank's RSS after the first and after the last.

2. The stall against the bound. A --stall-mib MiB state (float32, random, rewritten
   before every put, so every block is new) put asynchronously under host_memory= None
   (no bound), the state's size, half of it and a quarter of it (below the state: staged
   in waves, each wave written before put_snapshot returns), each in a fresh store, the
   median over --repeats puts after one warm put; its peer in the same run: a plain copy of
   the state into a preallocated buffer (torch's copy_, what staging does at best). Each
   bound runs in a process of its own, which also reports its peak memory over all its
   puts over its memory before the store was opened (VmHWM, reset through
   /proc/self/clear_refs).

    python benches/bench_host_memory.py [--mib 64] [--snapshots 100] [--rank-mib 16]
                                        [--stall-mib 256] [--repeats 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402

MiB = 1 << 20
BLOCK = 1 << 20


def status(field: str, pid="self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def mb(n: int) -> str:
    return f"{n / MiB:.1f}"


def memory_one_process(saver: str, mib: int, snapshots: int, root: str) -> dict:
    d = tempfile.mkdtemp(dir=root)
    try:
        n = mib * MiB // 4
        state = {"w": torch.randint(-2 ** 31, 2 ** 31 - 1, (n,), dtype=torch.int32), "step": 0}
        flip = torch.full((n,), 0x5A5A5A5A, dtype=torch.int32)
        with tsck.open_store(d, saver=saver, block_size=BLOCK) as s:
            out = {"bound": s.host_memory}
            for i in range(snapshots):
                state["w"].bitwise_xor_(flip)  # two versions of most blocks, stored once each
                state["w"][(i * BLOCK // 4) % n] = i  # one block new each time
                state["step"] = i
                s.put_snapshot(state, ref="j/m", step=i, blocking=False).result()
                if i == 0:
                    out["rss_first"], out["held_first"] = status("VmRSS"), s.staging.held
                    out["saver_first"] = status("VmRSS", s._saver.pid) if saver == "process" else 0
            out["rss_last"], out["held_last"], out["peak"] = status("VmRSS"), s.staging.held, s.staging.peak
            out["saver_last"] = status("VmRSS", s._saver.pid) if saver == "process" else 0
        return out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def memory_two_ranks(saver: str, mib: int, snapshots: int, root: str) -> list:
    out = tempfile.mkdtemp(dir=root)
    try:
        env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   TORCH_CPP_LOG_LEVEL="ERROR")
        subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "host_memory_worker.py"), "flat",
                        os.path.join(out, "run"), saver, str(snapshots), str(mib)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        ranks = [json.loads((Path(out) / "run" / f"flat_rank{r}.json").read_text()) for r in range(2)]
        for r in ranks:
            if not r["ok"]:
                raise SystemExit(f"rank {r['rank']} failed:\n{r.get('error')}")
        return ranks
    finally:
        shutil.rmtree(out, ignore_errors=True)


def stall_at(bound, saver: str, state: dict, repeats: int, root: str) -> dict:
    d = tempfile.mkdtemp(dir=root)
    stalls = []
    try:
        rss = status("VmRSS")
        reset_peak()
        with tsck.open_store(d, saver=saver, host_memory=bound, block_size=BLOCK) as s:
            for i in range(repeats + 1):
                state["w"].normal_()  # every block new
                t0 = time.perf_counter()
                fut = s.put_snapshot(state, ref="j/m", step=i, blocking=False)
                stall = time.perf_counter() - t0
                fut.result()
                if i:  # the first: the saver's start, the buffer's first pages
                    stalls.append(stall)
            grew = status("VmHWM") - rss
            use = s.staging
        return {"stall": statistics.median(stalls), "min": min(stalls), "max": max(stalls),
                "grew": grew, "peak": use.peak, "waves": use.waves / max(1, use.waved)}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def stall_in_child(bound, saver: str, mib: int, repeats: int, root: str) -> dict:
    """stall_at in a fresh process: its peak memory is this bound's alone (memory an earlier
    bound's puts left in the allocator would hide this one's)."""
    got = subprocess.run([sys.executable, __file__, "--one", saver, str(bound), str(mib), str(repeats), root],
                         check=True, capture_output=True, text=True)
    return json.loads(got.stdout.splitlines()[-1])


def one(saver: str, bound: str, mib: int, repeats: int, root: str) -> None:
    state = {"w": torch.empty(mib * MiB // 4).normal_(), "step": 0}  # its pages in before the baseline
    print(json.dumps(stall_at(None if bound == "None" else int(bound), saver, state, repeats, root)))


def plain_copy(state: dict, repeats: int) -> float:
    dst = torch.empty_like(state["w"])
    dst.copy_(state["w"])  # its pages faulted in, as a reused staging buffer's are
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(state["w"])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    if sys.argv[1:2] == ["--one"]:  # a child of stall_in_child
        saver, bound, mib, repeats, root = sys.argv[2:7]
        return one(saver, bound, int(mib), int(repeats), root)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--snapshots", type=int, default=100)
    ap.add_argument("--rank-mib", type=int, default=16)
    ap.add_argument("--stall-mib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    root = a.dir or tempfile.gettempdir()
    print(f"# bench_host_memory: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"python {platform.python_version()}")
    print(f"# args: {vars(a)}")

    print(f"\n## Memory over {a.snapshots} asynchronous snapshots (MiB; RSS of the process, and of its saver)")
    print("| setting | state | bound | RSS after 1 | RSS after N | growth | saver after 1 | saver after N | "
          "staging held 1 -> N | staging peak |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for saver in ("thread", "process"):
        r = memory_one_process(saver, a.mib, a.snapshots, root)
        print(f"| 1 process, {saver} | {a.mib} | {mb(r['bound'])} | {mb(r['rss_first'])} | {mb(r['rss_last'])} | "
              f"{mb(r['rss_last'] - r['rss_first'])} | {mb(r['saver_first'])} | {mb(r['saver_last'])} | "
              f"{mb(r['held_first'])} -> {mb(r['held_last'])} | {mb(r['peak'])} |", flush=True)
    for saver in ("thread", "process"):
        for r in memory_two_ranks(saver, a.rank_mib, a.snapshots, root):
            print(f"| 2 ranks (rank {r['rank']}), {saver} | {a.rank_mib} | {mb(r['bound'])} | {mb(r['rss_first'])} | "
                  f"{mb(r['rss_last'])} | {mb(r['rss_last'] - r['rss_first'])} | {mb(r['saver_rss_first'])} | "
                  f"{mb(r['saver_rss_last'])} | {mb(r['held_first'])} -> {mb(r['held_last'])} | {mb(r['peak'])} |",
                  flush=True)

    S = a.stall_mib * MiB
    state = {"w": torch.empty(S // 4), "step": 0}
    copy = plain_copy(state, a.repeats)
    print(f"\n## Stall per asynchronous snapshot against the bound ({a.stall_mib} MiB float32 state, every block new; "
          f"median of {a.repeats}, seconds)")
    print(f"peer: a plain copy of the state into a preallocated buffer: {copy:.4f} s")
    print("| saver | host_memory | stall (min-max) | stall / plain copy | waves | staging peak MiB | "
          "process peak over before open MiB |")
    print("|---|---|---|---|---|---|---|")
    for saver in ("thread", "process"):
        for name, bound in (("none", None), ("state", S), ("state/2", S // 2), ("state/4", S // 4)):
            r = stall_in_child(bound, saver, a.stall_mib, a.repeats, root)
            print(f"| {saver} | {name} | {r['stall']:.3f} ({r['min']:.3f}-{r['max']:.3f}) | "
                  f"{r['stall'] / copy:.1f}x | {r['waves']:.0f} | {mb(r['peak'])} | {mb(r['grew'])} |", flush=True)


if __name__ == "__main__":
    main()
