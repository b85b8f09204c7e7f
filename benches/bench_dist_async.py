#!/usr/bin/env python
"""Asynchronous collective snapshots on 2 and 4 gloo ranks: what they cost the training loop.

W ranks are forked processes (gloo on 127.0.0.1, the c10d TCPStore hosted by this
launcher), all writing one local store. Two measurements per W, each against a peer
timed in the same run on the same ranks (only same-run ratios mean anything here):

1. Stall per snapshot. Each rank holds its own GPT-style state (fp32 weights + AdamW
   moments, --mb MB per rank: a shard of a larger job). Before each snapshot every
   tensor changes (under Adam every value does). ``put_snapshot(state, blocking=False)``
   under torch.distributed returns once the rank's state is staged; that time is the
   stall. It is compared with a plain copy of the same state into preallocated, touched
   tensors, timed the same way after the same pause. Each snapshot is waited for (every
   rank's future done) before the next timed region, so disk and coordination speed do
   not leak into the stall. Also per snapshot: call to committed (wall), and the process
   CPU time from the call to the future's result (staging, hashing, compression, writes,
   the c10d coordination: everything the snapshot costs this rank's cores).

2. Training throughput. Each rank trains three DDP copies of a small GPT-style model side
   by side: with ``CheckpointManager(every_steps=N)`` (asynchronous, the default), with
   ``async_=False``, and without snapshots; they advance in turn, one segment of N steps
   each per round (order rotated every round, the same on every rank), so drift in machine
   speed cancels in the per-round ratios. A segment starts with the step that snapshots and
   ends waiting for the snapshots in flight (whatever the background has not finished is
   charged to its own run). Reported: steps/s ÷ no snapshots, per round, median and range.

On 2 cores, W ranks plus their background threads share the CPU: an asynchronous
snapshot's hashing and writing compete with training compute directly, which part 1's CPU
figure states.

    .venv/bin/python benches/bench_dist_async.py | tee benches/results/dist_async.txt
    .venv/bin/python benches/bench_dist_async.py --worlds 2 --snapshots 3 --rounds 3 --mb 32   # smoke
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench_core import GPT, build_state, iter_tensors  # noqa: E402
from bench_dist import free_port  # noqa: E402

REF = "bench/main"


def log(*a):
    print(*a, flush=True)


def pause(dist, rest: float) -> None:
    """Before a timed region, on every rank alike: flush, line up, rest (see bench_train.quiesce)."""
    os.sync()
    dist.barrier()
    time.sleep(rest)


def part_stall(tsck, dist, rank, world, args, base) -> dict:
    state, _model, _opt = build_state(args.mb * 1e6, d=args.d, seed=rank, vocab=8192, log=lambda *a: None)
    src = [t for _, t in iter_tensors(state)]
    dst = [torch.zeros_like(t) for t in src]
    for a, b in zip(dst, src):  # touched: a copy into memory already mapped
        a.copy_(b)
    nbytes = sum(t.numel() * t.element_size() for t in src)
    out = {"bytes": nbytes, "tensors": len(src), "stall": [], "copy": [], "commit": [], "cpu": [], "cold": None}
    with tsck.open_store(os.path.join(base, "stall_store")) as store:
        for k in range(args.snapshots + 1):
            with torch.no_grad():
                for t in src:
                    if t.dtype.is_floating_point:
                        t.add_(1e-3 * (k + 1))
            pause(dist, args.rest)
            c0, t0 = time.process_time(), time.perf_counter()
            fut = store.put_snapshot(state, REF, step=k, blocking=False)
            t1 = time.perf_counter()
            fut.result()
            t2, c2 = time.perf_counter(), time.process_time()
            dist.barrier()  # every rank's future done: the next region starts clean
            pause(dist, args.rest)
            t3 = time.perf_counter()
            for a, b in zip(dst, src):
                a.copy_(b)
            t4 = time.perf_counter()
            if k == 0:  # cold: the staging buffer was allocated and faulted in
                out["cold"] = {"stall": t1 - t0, "copy": t4 - t3, "commit": t2 - t0}
                continue
            out["stall"].append(t1 - t0)
            out["copy"].append(t4 - t3)
            out["commit"].append(t2 - t0)
            out["cpu"].append(c2 - c0)
    return out


def train_steps(run, n: int) -> float:
    """n training steps of run's model (its batches seeded by rank and step), its manager's
    step() after each (the seconds inside it noted where it snapshotted), then its
    snapshots waited for -> the seconds of it all. run: .args, .rank, .step, .model, .opt,
    .mgr (None: no snapshots), .in_step, .snapshots."""
    V, a = run.args.vocab, run.args
    t0 = time.perf_counter()
    for _ in range(n):
        g = torch.Generator().manual_seed(1_000_003 * run.rank + run.step)
        x = torch.randint(0, V, (a.batch, a.ctx + 1), generator=g)
        loss = F.cross_entropy(run.model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))
        loss.backward()
        run.opt.step()
        run.opt.zero_grad(set_to_none=True)
        if run.mgr is not None:
            s0 = time.perf_counter()
            if run.mgr.step(run.step) is not None:
                run.in_step.append(time.perf_counter() - s0)
                run.snapshots += 1
        run.step += 1
    if run.mgr is not None:
        run.mgr.wait()
    return time.perf_counter() - t0


class Run:
    """One DDP training run on this rank: "none", "async" (the manager's default) or "sync"."""

    def __init__(self, tsck, mode, args, base, rank):
        from torch.nn.parallel import DistributedDataParallel as DDP
        self.mode, self.args, self.rank = mode, args, rank
        torch.manual_seed(0)
        self.model = DDP(GPT(args.vocab, args.ctx, args.train_d, args.train_layers, max(1, args.train_d // 64)))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, weight_decay=0.1)
        self.ts = tsck.TrainState(model=self.model, optimizer=self.opt)
        self.store = self.mgr = None
        if mode != "none":
            self.store = tsck.open_store(os.path.join(base, f"train_{mode}"))
            self.mgr = tsck.CheckpointManager(self.store, job=f"train-{mode}", state=self.ts,
                                              every_steps=args.every, async_=(mode == "async"))
        self.step = args.every  # each segment starts with the step that snapshots
        self.snapshots = 0
        self.in_step: list[float] = []  # seconds inside mgr.step() when it snapshotted

    def segment(self) -> float:
        return train_steps(self, self.args.every)

    def close(self) -> dict:
        out = {"snapshots": self.snapshots, "in_step": self.in_step}
        if self.mgr is not None:
            self.mgr.close()
            out["failed"] = self.mgr.failed_snapshots
            self.store.close()
        return out


def rotated_rounds(dist, runs: dict, rounds: int, rest: float) -> list[dict]:
    """`rounds` rounds of one segment of each run, their order rotated every round, a pause
    (and barrier) before each -> per round, {mode: the segment's seconds}."""
    order, per_round = list(runs), []
    for r in range(rounds):
        k = r % len(order)
        secs = {}
        for m in order[k:] + order[:k]:
            pause(dist, rest)
            secs[m] = runs[m].segment()
        per_round.append(secs)
    return per_round


def part_train(tsck, dist, rank, world, args, base) -> dict:
    runs = {m: Run(tsck, m, args, base, rank) for m in ("none", "async", "sync")}
    per_round = rotated_rounds(dist, runs, args.rounds, args.rest / 5)
    return {"rounds": per_round, **{m: run.close() for m, run in runs.items()}}


def rank_main(rank, world, port, args, base, out_path):
    res = {"rank": rank}
    try:
        import torch.distributed as dist
        import tensorstore_ck as tsck
        torch.set_num_threads(1)
        kv = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=120))
        dist.init_process_group("gloo", store=kv, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        if rank == 0:
            tsck.open_store(os.path.join(base, "stall_store")).close()  # created once, before the others open it
            for m in ("async", "sync"):
                tsck.open_store(os.path.join(base, f"train_{m}")).close()
        dist.barrier()
        res["stall"] = part_stall(tsck, dist, rank, world, args, base)
        res["train"] = part_train(tsck, dist, rank, world, args, base)
        res["ok"] = True
    except BaseException:  # noqa: BLE001 - reported by the launcher
        res["ok"], res["error"] = False, traceback.format_exc()
    with open(out_path, "w") as f:
        json.dump(res, f)
    os._exit(0)


def launch_ranks(world: int, target, rank_args: tuple, base: str, limit: float) -> list[dict]:
    """Fork `world` ranks running target(rank, world, port, *rank_args, out) with the c10d
    Store hosted here; each writes its result (JSON, "ok" and "rank" at least) to `out`
    under `base`. All are killed past `limit` seconds; a rank that failed ends the run."""
    from torch.distributed import TCPStore
    port = free_port()
    ctx = mp.get_context("fork")
    outs = [os.path.join(base, f"rank{r}.json") for r in range(world)]
    procs = [ctx.Process(target=target, args=(r, world, port, *rank_args, outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    master = TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=120),
                      wait_for_workers=False)
    deadline = time.monotonic() + limit
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
        if p.is_alive():
            for q in procs:
                if q.is_alive():
                    os.kill(q.pid, signal.SIGKILL)
            raise SystemExit(f"W={world}: ranks ran past {limit}s")
    del master
    res = []
    for r, o in enumerate(outs):
        try:
            res.append(json.load(open(o)))
        except (OSError, ValueError):
            res.append({"rank": r, "ok": False, "error": f"no result file (exit code {procs[r].exitcode})"})
    for r in res:
        if not r["ok"]:
            raise SystemExit(f"W={world} rank {r['rank']} failed:\n{r['error']}")
    return res


def run_world(world, args) -> list[dict]:
    base = tempfile.mkdtemp(prefix=f"tsck-bench-async{world}-", dir=args.dir)
    try:
        return launch_ranks(world, rank_main, (args, base), base, args.limit)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def report(world, res, args) -> dict:
    st = [r["stall"] for r in res]
    ratios = [s / c for r in st for s, c in zip(r["stall"], r["copy"])]
    per_rank_med = [med([s / c for s, c in zip(r["stall"], r["copy"])]) for r in st]
    mb = st[0]["bytes"] / 1e6
    log(f"\n## W = {world} ranks, {mb:.0f} MB of state per rank in {st[0]['tensors']} tensors "
        f"({world * mb:.0f} MB per snapshot)")
    log("| what (per rank, per snapshot) | median (range over ranks x snapshots) |")
    log("|---|---|")
    all_ = lambda key: [x for r in st for x in r[key]]  # noqa: E731
    rng = lambda xs, f=1e3: f"{med(xs)*f:.0f} ({min(xs)*f:.0f}-{max(xs)*f:.0f})"  # noqa: E731
    log(f"| put_snapshot(blocking=False) returns (the stall), ms | {rng(all_('stall'))} |")
    log(f"| plain copy into preallocated tensors, ms | {rng(all_('copy'))} |")
    log(f"| **stall ÷ plain copy** | **{med(ratios):.2f}x** ({min(ratios):.2f}-{max(ratios):.2f}); "
        f"per-rank medians {', '.join(f'{x:.2f}' for x in per_rank_med)} |")
    log(f"| call to committed on every rank, ms | {rng(all_('commit'))} |")
    log(f"| process CPU from the call to the result, ms | {rng(all_('cpu'))} |")
    cold = [r["cold"] for r in st]
    log(f"| first snapshot (cold staging buffer): stall / copy, ms | "
        f"{med([c['stall'] for c in cold])*1e3:.0f} / {med([c['copy'] for c in cold])*1e3:.0f} |")
    rounds = res[0]["train"]["rounds"]  # rank 0's clock (the all-reduces keep the ranks in step)
    ra = [r["none"] / r["async"] for r in rounds]
    rs = [r["none"] / r["sync"] for r in rounds]
    tr = res[0]["train"]
    log(f"\nTraining throughput (DDP, GPT d={args.train_d} x{args.train_layers} layers, vocab {args.vocab}, "
        f"every_steps={args.every}, {args.rounds} rounds; steps/s ÷ no snapshots, per round):")
    log("| mode | steps/s ÷ none, median (range) | time inside mgr.step() per snapshot, rank 0, median ms |")
    log("|---|---|---|")
    log(f"| async (default) | **{med(ra):.2f}** ({min(ra):.2f}-{max(ra):.2f}) | "
        f"{med(tr['async']['in_step'])*1e3:.0f} |")
    log(f"| async_=False | {med(rs):.2f} ({min(rs):.2f}-{max(rs):.2f}) | {med(tr['sync']['in_step'])*1e3:.0f} |")
    failed = sum(r["train"][m].get("failed", 0) for r in res for m in ("async", "sync"))
    log(f"(snapshots taken per run on rank 0: {tr['async']['snapshots']} async, {tr['sync']['snapshots']} sync; "
        f"failed on any rank: {failed})")
    return {"world": world, "stall_ratio_median": med(ratios), "per_rank": per_rank_med,
            "throughput_async": med(ra), "throughput_sync": med(rs), "cpu_ms": med(all_("cpu")) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--mb", type=float, default=256, help="MB of state per rank in part 1")
    ap.add_argument("--d", type=int, default=512, help="model width of part 1's state (256: 5x as many tensors)")
    ap.add_argument("--snapshots", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--train-d", type=int, default=128)
    ap.add_argument("--train-layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rest", type=float, default=0.5)
    ap.add_argument("--limit", type=float, default=1500)
    ap.add_argument("--dir", default=None, help="where the stores go (default: the temp dir)")
    args = ap.parse_args()
    log(f"# bench_dist_async: {platform.node()} {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}, loadavg {os.getloadavg()[0]:.1f}")
    log(f"# args: {vars(args)}")
    summary = []
    for w in [int(x) for x in args.worlds.split(",")]:
        summary.append(report(w, run_world(w, args), args))
    log("\n# summary " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
