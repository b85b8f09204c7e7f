"""DDP under torchrun with a CheckpointManager: SIGKILL one rank mid-run, resume, bit-identical.

    python examples/ddp_resume.py [--world 2] [--steps 24] [--kill-at 17]

Runs `torchrun --standalone --nproc_per_node WORLD` three times (gloo on CPU):
  1. a run that snapshots every 5 steps (the manager as the README shows it: asynchronous
     by default, retention keep_last=2) and whose rank 1 SIGKILLs itself after step
     --kill-at: torchrun takes the whole job down;
  2. the same script again: restore_latest() resumes every rank at the same step (the
     newest snapshot) and trains to --steps;
  3. an uninterrupted run into another store.
The resumed run's first snapshot may wait: the killed job's rank 0 may have died inside
its prune's deletion phase, which stays open until that prune's lease runs out; the
snapshot then waits it out and re-validates.
Each rank's losses of the resumed steps must equal the uninterrupted run's bit for bit,
and every rank must have resumed at the same step (exit 1 if not). What makes it exact:
the manager snapshots every rank's state (DDP model, optimizer, RNG streams: dropout)
as one collective snapshot, and each rank's batches come from (rank, step).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile

JOB = "ddp"


def train(args) -> None:
    """One rank of the job (run by torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import tensorstore_ck as tsck

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights everywhere
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                    torch.nn.Linear(64, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(1000 + rank)  # dropout: a stream of each rank's own

    store = tsck.open_store(args.store)
    mgr = tsck.CheckpointManager(store, job=JOB, state=tsck.TrainState(model=model, optimizer=opt),
                                 every_steps=5, retention=tsck.Retention(keep_last=2))
    start = mgr.restore_latest() or 0
    log = open(os.path.join(args.out, f"{args.tag}_rank{rank}.jsonl"), "a")
    log.write(json.dumps({"start": start}) + "\n")
    log.flush()
    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(10_000 * rank + step)
        x = torch.randn(32, 16, generator=g)
        y = x.sum(1, keepdim=True).sin()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        mgr.step(step, metrics={"loss": loss.item()})
        log.write(json.dumps({"step": step, "loss": repr(loss.item())}) + "\n")
        log.flush()
        if rank == 1 and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # mid-run, no goodbye: torchrun stops the others
    mgr.close()
    log.write(json.dumps({"failed_snapshots": mgr.failed_snapshots,
                          "snapshot_errors": [f"{type(e).__name__}: {e}" for e in mgr.snapshot_errors],
                          "prune_errors": [f"{type(e).__name__}: {e}" for e in mgr.prune_errors]}) + "\n")
    log.flush()
    store.close()
    dist.destroy_process_group()


def torchrun(args, *, store: str, tag: str, kill_at: int = 0) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world}",
           os.path.abspath(__file__), "--train", "--store", store, "--out", args.out, "--tag", tag,
           "--steps", str(args.steps), "--kill-at", str(kill_at)]
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR", LOGLEVEL="ERROR")
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0 and not kill_at:
        print(proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode


def read_log(out: str, tag: str, rank: int) -> tuple[list[int], dict[int, str], list]:
    starts, losses, failed = [], {}, []
    with open(os.path.join(out, f"{tag}_rank{rank}.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "start" in rec:
                starts.append(rec["start"])
            elif "step" in rec:
                losses[rec["step"]] = rec["loss"]
            else:
                failed.append(rec["failed_snapshots"])
    return starts, losses, failed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--kill-at", type=int, default=17)
    ap.add_argument("--out", default=None, help="a folder for the stores and the ranks' logs (default: a temp one)")
    ap.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.train:
        train(args)
        return 0
    args.out = args.out or tempfile.mkdtemp(prefix="tsck-ddp-")
    os.makedirs(args.out, exist_ok=True)
    run_store, ref_store = os.path.join(args.out, "store"), os.path.join(args.out, "reference")
    rc = torchrun(args, store=run_store, tag="killed", kill_at=args.kill_at)
    if rc == 0:
        print(f"the killed run exited 0: rank 1 was not killed at step {args.kill_at}?")
        return 1
    if torchrun(args, store=run_store, tag="resumed") != 0:
        print("the resumed run failed")
        return 1
    if torchrun(args, store=ref_store, tag="reference") != 0:
        print("the reference run failed")
        return 1
    ok = True
    starts = set()
    for r in range(args.world):
        _s, ref, _f = read_log(args.out, "reference", r)
        (start,), resumed, failed = read_log(args.out, "resumed", r)
        _s, killed, _f = read_log(args.out, "killed", r)
        starts.add(start)
        same_before = all(killed[s] == ref[s] for s in killed)
        same_after = sorted(resumed) == list(range(start + 1, args.steps + 1)) and all(
            resumed[s] == ref[s] for s in resumed)
        print(f"rank {r}: killed run reached step {max(killed, default=0)}, resumed at step {start}; losses "
              f"{'identical' if same_before and same_after else 'DIFFER'} to the uninterrupted run's; "
              f"snapshots that could not be taken after the resume: {failed[0] if failed else '?'}")
        ok = ok and same_before and same_after and len(failed) == 1
    if len(starts) != 1 or not starts.issubset(range(1, args.kill_at + 1)):
        print(f"ranks resumed at different steps (or none): {sorted(starts)}")
        ok = False
    print("bit-identical resume on every rank" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
