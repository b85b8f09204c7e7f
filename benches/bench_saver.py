#!/usr/bin/env python
"""Saver benchmark: what asynchronous snapshots cost a training loop, with the snapshot's
background work on threads of the training process (saver="thread") or in a saver process
(saver="process"), against the same loop taking no snapshot, on 1 and 2 ranks.

The loop trains an MLP whose state (weights and both AdamW moments) is --gb GB in all
(split over the ranks: each rank trains a model of its own share, the ranks meeting in an
all_reduce of the loss every step, and the snapshot is collective). Every weight changes
every step, so each snapshot writes the whole state anew.

A round runs one segment of --steps steps per mode (after --warmup rounds not counted: the
first segments after the warm snapshots ran 2-3x slower), in an order rotated each round (drift
of the machine's speed cancels in a round's ratios). A snapshot mode takes one asynchronous
snapshot at the segment's first step and waits for it at the segment's end, so the segment
holds all of its cost: the staging stall, the contention for the cores and the GIL, and any
wait for a put still running after the steps (the saver process is niced, saver_nice=10:
it takes what the loop leaves, and may finish after the steps). "none" takes no snapshot.
With segments of about a minute, a round is literally one snapshot a minute. Per round:

    cost per snapshot = segment(mode) - segment(none)      (seconds of training lost)
    throughput ratio  = segment(none) / segment(mode)      (snapshots every --steps steps)
    overhead at one snapshot a minute = cost per snapshot / 60 s

The machine's speed drifts from segment to segment by more than a snapshot costs (on the
project's VM a segment of 20 s without snapshots swings by 2-4 s), so the cost is also read
within each segment: the steps from the put's call until --margin s after its commit took
what they took beyond as many of the segment's later steps at their median pace. That
reading is blind to any cost lasting past the margin; the same reading of the round's
"none" segment, over the same window, says how far it is from zero by chance alone.

--loop python instead trains --layers 32-wide layers with a per-parameter AdamW (a step
bound by Python dispatch: the loop holds the GIL most of the time), the state's bulk a
tensor of --gb GB whose every block is changed before each snapshot; with small blocks
(--block-size 65536) the put's own Python work (a call per block) grows too. That is
where a saver process should pay: the background work then competes for the GIL, not
only for cores.

--tier-s3: each store is a local tier in front of S3 (a radosgw started here, or
$TEST_S3_ENDPOINT): the put writes the tier on threads in both modes, and the upload runs
on threads (saver="thread") or in the saver process; a segment then also waits for the
upload (wait_durable), so it holds the upload's cost to the loop too.

Medians and spreads over the rounds. Between segments (untimed) the store keeps the job's
newest snapshot only and gc reclaims the rest, and the disk is flushed.

    python benches/bench_saver.py [--gb 1.0] [--steps 40] [--rounds 4] [--ranks 1 2]
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

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from bench_core import cpu_counters, fmt_s, summ  # noqa: E402

MODES = ("none", "thread", "process")


def log(*a):
    print(*a, flush=True)


def build(gb_rank: float, width: int, seed: int):
    """An MLP of `width`-wide layers whose weights + 2 AdamW moments are ~gb_rank GB."""
    per_layer = width * width + width
    layers = max(1, round(gb_rank * 1e9 / 4 / 3 / per_layer))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def state_bytes(model, opt) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return n


def rank_main(rank: int, world: int, args, port: int, out: str) -> None:
    import torch.distributed as dist
    sys.path.insert(0, REPO)
    import tensorstore_ck as tsck
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    big = None
    if args.loop == "mlp":
        model, opt = build(args.gb / world, args.width, seed=rank)
        x = torch.randn(args.batch, args.width)
    else:  # "python": a loop bound by Python dispatch, holding the GIL most of each step
        torch.manual_seed(rank)
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(args.layers)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)  # a Python loop per parameter
        x = torch.randn(4, 32)
        big = torch.randn(int(args.gb / world * 1e9) // 4)  # the rest of the state: changed per snapshot

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        if world > 1:
            dist.all_reduce(loss.detach())

    for _ in range(3):  # the moments exist (the state's full size) and the code is warm
        step()
    state = {"model": model, "opt": opt}
    if big is not None:
        state["big"] = big
    nbytes = state_bytes(model, opt) + (0 if big is None else big.numel() * 4)
    per_block = args.block_size // 4

    def touch(k):
        """Every block of `big` differs from the last snapshot's (one element a block)."""
        if big is not None:
            big[::per_block] = float(k)

    stores = {}
    for mode in MODES[1:]:
        path = os.path.join(args.dir, mode)
        if args.endpoint:  # a local tier in front of S3: the put writes the tier, the uploads follow
            opts = {"endpoint_url": args.endpoint, "key": args.key, "secret": args.secret}
            stores[mode] = tsck.open_store(f"s3://{args.bucket}/{os.path.basename(args.dir)}-{rank}/{mode}",
                                           refs=path + "-refs.lmdb", storage_options=opts, local=path + "-tier",
                                           saver=mode, block_size=args.block_size, saver_nice=args.saver_nice)
        else:
            stores[mode] = tsck.open_store(path, saver=mode, block_size=args.block_size, saver_nice=args.saver_nice)
        if rank == 0 and not args.endpoint:  # (a tier's retention would run in its uploader: timed)
            stores[mode].set_retention("job", tsck.Retention(keep_last=1))
    # Warm each store: a first snapshot (the staging buffer mapped, the saver started).
    n = 0
    for mode, s in stores.items():
        n += 1
        s.put_snapshot(state, "job/main", step=n, blocking=False).result()
        if args.endpoint:
            s.wait_durable()
    rows = []
    for r in range(-args.warmup, args.rounds):
        order = MODES[r % 3:] + MODES[:r % 3]
        seg = {}
        for mode in order:
            if world > 1:
                dist.barrier()
            os.sync()
            j0, p0 = cpu_counters(), proc_cpu()
            t0 = time.perf_counter()
            fut, stall, ends = None, 0.0, []
            for i in range(args.steps):
                if i == 0 and mode != "none":
                    n += 1
                    touch(n)
                    a = time.perf_counter()
                    fut = stores[mode].put_snapshot(state, "job/main", step=n, blocking=False)
                    stall = time.perf_counter() - a
                step()
                ends.append(time.perf_counter() - t0)
            waited = took = 0.0
            trained = time.perf_counter() - t0
            if fut is not None:
                took = fut.result().seconds  # the put, from its call to its commit
                if args.endpoint:  # and its upload: the segment holds all of its cost
                    stores[mode].wait_durable()
                    took = time.perf_counter() - t0  # from the put's call (the segment's start) to durable
                waited = time.perf_counter() - t0 - trained
            j1, p1 = cpu_counters(), proc_cpu()
            steal = (j1.get("steal_j", 0) - j0.get("steal_j", 0)) / max(1, j1.get("all_j", 0) - j0.get("all_j", 0))
            seg[mode] = {"s": trained + waited, "steps_s": trained, "stall": stall, "waited": waited, "steal": steal,
                         "ends": ends,
                         "took": took, "cpu": {k: p1[k] - p0[k] for k in p1},
                         "idle": (j1.get("idle_j", 0) - j0.get("idle_j", 0)) / max(1, j1.get("all_j", 0) - j0.get("all_j", 0))}
            if mode != "none" and rank == 0 and not args.endpoint:  # untimed: keep the newest only, reclaim the rest
                stores[mode].prune("job")
                stores[mode].gc()
        if r >= 0:
            rows.append(seg)
        if rank == 0:
            log(f"  {'warm-up' if r < 0 else 'round'} {r}: " + "  ".join(f"{m} {seg[m]['s']:.2f}s steal {seg[m]['steal']:.0%}" + (
                f" (stall {seg[m]['stall']:.2f}, waited {seg[m]['waited']:.2f})" if m != "none" else "")
                for m in MODES))
            log("      CPU s (trainer/saver/server/other, idle): " + "  ".join(
                f"{m} " + "/".join(f"{seg[m]['cpu'][k]:.1f}" for k in ("trainer", "saver", "server", "other"))
                + f" {seg[m]['idle']:.0%}" for m in MODES))
    for s in stores.values():
        s.close()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"rows": rows, "state_bytes_rank": nbytes, "world": world}, f)
    if world > 1:
        dist.destroy_process_group()


def proc_cpu() -> dict:
    """CPU seconds so far of this process, of its children (the saver), of the object
    store's server (Ceph's processes: radosgw, ceph-osd, ceph-mon) and of everything else,
    from /proc/*/stat: which of them an upload's CPU went to."""
    me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    out = {"trainer": 0.0, "saver": 0.0, "server": 0.0, "other": 0.0}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                raw = f.read()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        ppid, cpu = int(fields[1]), (int(fields[11]) + int(fields[12])) / tick
        who = ("trainer" if int(pid) == me else "saver" if ppid == me
               else "server" if comm.startswith(("radosgw", "ceph-")) else "other")
        out[who] += cpu
    return out


def run_world(world: int, args) -> dict:
    out = os.path.join(args.dir, f"w{world}.json")
    import socket
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    procs = []
    for rank in range(world):  # every rank writes to one store per mode (collective snapshots)
        cmd = [sys.executable, os.path.abspath(__file__), "--rank", str(rank), "--world", str(world),
               "--port", str(port), "--out", out, "--dir", os.path.join(args.dir, f"w{world}"),
               "--gb", str(args.gb), "--steps", str(args.steps), "--rounds", str(args.rounds),
               "--width", str(args.width), "--batch", str(args.batch), "--warmup", str(args.warmup),
               "--loop", args.loop, "--layers", str(args.layers), "--block-size", str(args.block_size),
               "--saver-nice", str(args.saver_nice)]
        if args.endpoint:
            cmd += ["--endpoint", args.endpoint, "--key", args.key, "--secret", args.secret, "--bucket", args.bucket]
        procs.append(subprocess.Popen(cmd))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"world {world}: a rank failed ({codes})")
    with open(out) as f:
        return json.load(f)


def window_excess(seg: dict, until: float) -> float | None:
    """Seconds the steps that started before `until` (from the segment's start) took
    beyond the same number of the segment's later steps at their median pace."""
    ends = seg["ends"]
    starts = [0.0] + ends[:-1]
    inside = [e - b for b, e in zip(starts, ends) if b < until]
    later = [e - b for b, e in zip(starts, ends) if b >= until]
    if len(later) < 5:
        return None  # too few steps after the window to pace it: not read
    return sum(inside) - len(inside) * statistics.median(later) + seg["waited"]


def report(world: int, res: dict, args) -> dict:
    rows = res["rows"]
    out = {"world": world, "state_gb": res["state_bytes_rank"] * world / 1e9}
    none = [r["none"]["s"] for r in rows]
    log(f"\n{world} rank(s), loop {args.loop}, blocks of {args.block_size >> 10} KiB: state "
        f"{out['state_gb']:.2f} GB in all ({res['state_bytes_rank'] / 1e9:.2f} GB a rank), "
        f"segments of {args.steps} steps, {len(rows)} rounds")
    steal = [r[m]["steal"] * 100 for r in rows for m in MODES]
    log(f"  segment without a snapshot: {fmt_s(summ(none), unit=' s')} "
        f"({args.steps / statistics.median(none):.2f} steps/s); the hypervisor stole "
        f"{fmt_s(summ(steal), '{:.0f}', '%')} of the machine's CPU per segment")
    for mode in MODES[1:]:
        cost = [r[mode]["s"] - r["none"]["s"] for r in rows]
        ratio = [r["none"]["s"] / r[mode]["s"] for r in rows]
        stall = [r[mode]["stall"] for r in rows]
        waited = [r[mode]["waited"] for r in rows]
        took = [r[mode]["took"] for r in rows]
        per_min = [c / 60 * 100 for c in cost]
        out[mode] = {"cost_s": summ(cost), "throughput": summ(ratio), "stall_s": summ(stall),
                     "waited_s": summ(waited), "put_s": summ(took), "overhead_pct_per_minute": summ(per_min)}
        log(f"  saver={mode:8s} cost per snapshot {fmt_s(summ(cost), unit=' s')}; throughput with one every "
            f"{args.steps} steps {fmt_s(summ(ratio), '{:.3f}', 'x')} of none; stall {fmt_s(summ(stall), unit=' s')}; "
            f"the put took {fmt_s(summ(took), unit=' s')} to {'durable' if args.tier_s3 else 'commit'}, "
            f"{fmt_s(summ(waited), unit=' s')} of it waited for "
            "after the segment's steps")
        log(f"      -> at one snapshot a minute: overhead {fmt_s(summ(per_min), '{:.1f}', '%')}")
        # The same cost read within each segment (the module's docstring says why).
        local = [window_excess(r[mode], r[mode]["took"] + args.margin) for r in rows]
        null = [window_excess(r["none"], r[mode]["took"] + args.margin) for r in rows]
        if None in local or None in null:
            log(f"      within the segment: not read (the window of {args.margin:g} s after a commit leaves "
                "too few steps; more --steps)")
            continue
        local_min = [c / 60 * 100 for c in local]
        out[mode].update({"local_cost_s": summ(local), "local_null_s": summ(null),
                          "local_overhead_pct_per_minute": summ(local_min)})
        log(f"      within the segment (the steps until {args.margin:g} s after the commit, against its later "
            f"steps' pace): cost per snapshot {fmt_s(summ(local), unit=' s')}, overhead at one a minute "
            f"{fmt_s(summ(local_min), '{:.1f}', '%')}; the same reading of the none segment "
            f"{fmt_s(summ(null), unit=' s')}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="the job's state in GB, over all ranks (default 1.0)")
    ap.add_argument("--steps", type=int, default=40, help="steps per segment (default 40)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds of the three modes (default 4)")
    ap.add_argument("--warmup", type=int, default=1,
                    help="rounds run first and not counted (default 1: the first segment after the warm "
                         "snapshots ran 2-3x slower in every run)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes (default 1 2)")
    ap.add_argument("--loop", choices=("mlp", "python"), default="mlp",
                    help="mlp: large layers (the steps release the GIL); python: --layers 32-wide layers and "
                         "a per-parameter AdamW (the steps hold the GIL), the state's bulk a tensor whose every "
                         "block changes before each snapshot")
    ap.add_argument("--layers", type=int, default=200, help="layers of the python loop (default 200)")
    ap.add_argument("--block-size", type=int, default=4 << 20, help="the stores' block size (default 4 MiB)")
    ap.add_argument("--width", type=int, default=2048, help="layer width (default 2048)")
    ap.add_argument("--batch", type=int, default=16, help="batch rows per step (default 16)")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /work)")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--tier-s3", action="store_true",
                    help="each store a local tier in front of S3 (a radosgw started here, or $TEST_S3_ENDPOINT): "
                         "the put writes the tier and a segment also waits for the upload (wait_durable); "
                         "saver=process runs the uploads in the saver")
    ap.add_argument("--saver-nice", type=int, default=10, help="open_store(saver_nice=) (default 10)")
    ap.add_argument("--margin", type=float, default=2.0,
                    help="seconds after a commit still counted to the snapshot, within a segment (default 2)")
    ap.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--key", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--secret", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bucket", default="bench-saver", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.world, args, args.port, args.out)
        return 0
    base = args.dir or tempfile.mkdtemp(prefix="bench-saver-", dir="/work" if os.path.isdir("/work") else None)
    args.dir = base
    log(f"bench_saver: {platform.node()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"python {platform.python_version()}; load average {os.getloadavg()[0]:.2f} at start; scratch {base}")
    results = []
    rgw_dir = None
    try:
        if args.tier_s3:
            import bench_s3
            args.endpoint = args.endpoint or os.environ.get("TEST_S3_ENDPOINT")
            args.key = args.key or os.environ.get("TEST_S3_KEY", "testkey")
            args.secret = args.secret or os.environ.get("TEST_S3_SECRET", "testsecret")
            rgw_dir, _opts, _fs = bench_s3.connect(args)
            log(f"  stores: a local tier each, in front of S3 at {args.endpoint}")
        for world in args.ranks:
            results.append(report(world, run_world(world, args), args))
    finally:
        if rgw_dir is not None:
            import bench_s3
            bench_s3.stop_rgw(rgw_dir)
        if args.dir is base and not ap.parse_args(argv).dir:
            shutil.rmtree(base, ignore_errors=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
