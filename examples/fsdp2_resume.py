"""FSDP2 under torchrun with a CheckpointManager: SIGKILL one rank mid-run, resume on MORE ranks,
bit-identical.

    python examples/fsdp2_resume.py [--world 2] [--resume-world 3] [--steps 24] [--kill-at 17]

Runs `torchrun --standalone` three times (gloo on CPU):
  1. an FSDP2 job on --world ranks (every layer and the whole model fully_shard'ed, Adam) that
     snapshots every 5 steps with the manager as the README shows it for one process (default
     options, retention keep_last=2), and whose rank 1 SIGKILLs itself after step --kill-at:
     torchrun takes the whole job down;
  2. the same script on --resume-world ranks: fresh models and optimizers, restore_latest()
     resumes every rank at the newest snapshot, each rank reading only the blocks of its own
     (new) shards of the parameters and of Adam's state, and trains to --steps;
  3. an uninterrupted run on --world ranks into another store.

What "bit-identical" means across world sizes, and why it holds: a step's loss and the
parameters after it must be the same bits whatever the number of ranks. So every step trains
on one global batch (32 samples drawn from the step number, plus noise from the global torch
RNG, which is the same stream on every rank and is snapshotted and restored with the rest),
and every rank computes that whole batch: every rank's gradient is then the same bits, and
FSDP2 reduces gradients in float64 (MixedPrecisionPolicy(reduce_dtype=torch.float64)), where
the mean of W copies of a float32 gradient is within a few float64 ulps of it and rounds back
to exactly it, for any W. Adam's update is elementwise, so no parameter depends on how the
parameters are sharded. (Splitting the batch over the ranks would make the gradient a float
sum whose order depends on the world size: the same up to rounding, not bit for bit.) The
example's point is the sharded state: FSDP2 parameters and Adam state as DTensors, saved as
one collective snapshot by 2 ranks and read back into 3 ranks' shards.

The check (exit 1 if it fails): every rank of every run logs its loss of every step; the
killed run's losses equal the uninterrupted run's, every rank of the resumed run resumed at
the same step and its losses of the redone steps equal the uninterrupted run's, bit for bit
(repr of the float); and the SHA-256 of the final parameters (gathered whole) is the same
in the resumed and the uninterrupted run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile

JOB = "fsdp2"


def build(world: int):
    """The model (each Linear and the whole model an FSDP2 unit, on a 1-D mesh of `world` ranks) and Adam."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the initial weights (replaced by restore_latest on a resume)
    model = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.GELU(), torch.nn.Linear(96, 96), torch.nn.GELU(),
                                torch.nn.Linear(96, 8))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float64)  # see the docstring: exact means across world sizes
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, torch.optim.Adam(model.parameters(), lr=3e-3)


def train(args) -> None:
    """One rank of the job (run by torchrun)."""
    import torch
    import torch.distributed as dist

    import tensorstore_ck as tsck

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = build(world)
    torch.manual_seed(1)  # the data noise: one stream, the same on every rank

    store = tsck.open_store(args.store)
    mgr = tsck.CheckpointManager(store, job=JOB, state=tsck.TrainState(model=model, optimizer=opt),
                                 every_steps=5, retention=tsck.Retention(keep_last=2))
    start = mgr.restore_latest() or 0
    log = open(os.path.join(args.out, f"{args.tag}_rank{rank}.jsonl"), "a")
    log.write(json.dumps({"start": start, "world": world}) + "\n")
    log.flush()
    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(32, 32, generator=g)
        x = x + 0.05 * torch.randn_like(x)
        y = torch.tanh(x[:, :8] * x[:, 8:16])
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
    digest = hashlib.sha256()
    for name, p in model.named_parameters():  # full_tensor(): an all-gather, on every rank
        digest.update(name.encode() + p.full_tensor().detach().contiguous().view(torch.uint8).numpy().tobytes())
    log.write(json.dumps({"failed_snapshots": mgr.failed_snapshots, "params_sha256": digest.hexdigest(),
                          "snapshot_errors": [f"{type(e).__name__}: {e}" for e in mgr.snapshot_errors],
                          "prune_errors": [f"{type(e).__name__}: {e}" for e in mgr.prune_errors]}) + "\n")
    log.flush()
    store.close()
    dist.destroy_process_group()


def torchrun(args, *, world: int, store: str, tag: str, kill_at: int = 0) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           os.path.abspath(__file__), "--train", "--store", store, "--out", args.out, "--tag", tag,
           "--steps", str(args.steps), "--kill-at", str(kill_at)]
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR", LOGLEVEL="ERROR")
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0 and not kill_at:
        print(proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode


def read_log(out: str, tag: str, rank: int) -> tuple[list[int], dict[int, str], list[dict]]:
    starts, losses, ends = [], {}, []
    with open(os.path.join(out, f"{tag}_rank{rank}.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "start" in rec:
                starts.append(rec["start"])
            elif "step" in rec:
                losses[rec["step"]] = rec["loss"]
            else:
                ends.append(rec)
    return starts, losses, ends


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--resume-world", type=int, default=3)
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
    if args.world < 2:
        ap.error("--world must be at least 2 (rank 1 is the one killed)")
    args.out = args.out or tempfile.mkdtemp(prefix="tsck-fsdp2-")
    os.makedirs(args.out, exist_ok=True)
    run_store, ref_store = os.path.join(args.out, "store"), os.path.join(args.out, "reference")
    rc = torchrun(args, world=args.world, store=run_store, tag="killed", kill_at=args.kill_at)
    if rc == 0:
        print(f"the killed run exited 0: rank 1 was not killed at step {args.kill_at}?")
        return 1
    if torchrun(args, world=args.resume_world, store=run_store, tag="resumed") != 0:
        print("the resumed run failed")
        return 1
    if torchrun(args, world=args.world, store=ref_store, tag="reference") != 0:
        print("the reference run failed")
        return 1
    _s, ref, ref_end = read_log(args.out, "reference", 0)
    ok = True
    for r in range(1, args.world):  # the rule makes every rank's loss the same: check it did
        if read_log(args.out, "reference", r)[1] != ref:
            print(f"the uninterrupted run's rank {r} logged other losses than its rank 0")
            ok = False
    for r in range(args.world):
        _s, killed, _e = read_log(args.out, "killed", r)
        if any(killed[s] != ref[s] for s in killed):
            print(f"the killed run's rank {r} logged other losses than the uninterrupted run")
            ok = False
    starts = set()
    for r in range(args.resume_world):
        (start,), resumed, ends = read_log(args.out, "resumed", r)
        starts.add(start)
        same = sorted(resumed) == list(range(start + 1, args.steps + 1)) and all(resumed[s] == ref[s] for s in resumed)
        params = len(ends) == 1 and ends[0]["params_sha256"] == ref_end[0]["params_sha256"]
        print(f"rank {r} of {args.resume_world}: resumed at step {start}; losses "
              f"{'identical' if same else 'DIFFER'} to the uninterrupted {args.world}-rank run's; final parameters "
              f"{'identical' if params else 'DIFFER'}; snapshots that could not be taken after the resume: "
              f"{ends[0]['failed_snapshots'] if ends else '?'}")
        ok = ok and same and params
    if len(starts) != 1 or not starts.issubset(range(1, args.kill_at + 1)):
        print(f"ranks resumed at different steps (or none): {sorted(starts)}")
        ok = False
    print(f"bit-identical resume from {args.world} ranks on {args.resume_world}" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
