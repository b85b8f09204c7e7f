"""A Hugging Face Trainer on 2 processes (torchrun, DDP over gloo on CPU) snapshotted into a
store, one rank SIGKILLed mid-run, resumed with resume_from_checkpoint=True, bit-identical.

    python examples/hf_ddp_resume.py [--world 2] [--steps 20] [--kill-at 12] [--out DIR]

Needs the `hf` extra (transformers, accelerate); no network: the model is a tiny GPT-2
built from a config, the data random token ids. Runs `torchrun --standalone
--nproc_per_node WORLD` three times:
  1. the job with hf.TsckCallback(keep_local=False) and save_total_limit=2: every save
     (each 5 steps) is ONE collective snapshot of every rank's state (model and optimizer
     once, as Replicated; each rank's RNG streams; scheduler; trainer state), the
     Trainer's folder is deleted once it is committed, so the store holds the only copy,
     and the job's retention is keep_last=2. Rank 1 SIGKILLs itself after step
     --kill-at; torchrun takes the job down.
  2. the same script with trainer.train(resume_from_checkpoint=True): the callback writes
     the store's newest snapshot into output_dir when the Trainer is built (every rank
     gets its own rng_state_{rank}.pth), and the Trainer resumes from it.
  3. an uninterrupted run into another store.
Every rank draws dropout from a stream of its own (seeded by rank after the Trainer is
built), so a rank resumed with another rank's RNG would diverge. Each rank's logged losses
and its final parameters must equal the uninterrupted run's bit for bit (exit 1 if not).
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: there may be no network

JOB = "hf-ddp"


def train(args) -> None:
    """One rank of the job (run by torchrun)."""
    import random

    import numpy as np
    import torch
    from transformers import (GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainerCallback,
                              TrainingArguments, set_seed)
    from transformers.utils import logging as hf_logging

    import tensorstore_ck as tsck
    from tensorstore_ck import hf

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    rank = int(os.environ["RANK"])

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n=64, length=16):
            self.x = torch.randint(0, 128, (n, length), generator=torch.Generator().manual_seed(123))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    log = open(os.path.join(args.out, f"{args.tag}_rank{rank}.jsonl"), "a")

    class Record(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            log.write(json.dumps({"start": state.global_step}) + "\n")
            log.flush()

        def on_log(self, a, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                log.write(json.dumps({"step": state.global_step, "loss": repr(logs["loss"])}) + "\n")
                log.flush()

        def on_step_end(self, a, state, control, **kw):
            if rank == 1 and state.global_step == args.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-run, no goodbye: torchrun stops the others

    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))  # dropout on
    targs = TrainingArguments(os.path.join(args.out, f"{args.tag}-output"), max_steps=args.steps, save_steps=5,
                              save_total_limit=2, logging_steps=1, per_device_train_batch_size=4,
                              learning_rate=1e-3, seed=0, use_cpu=True, ddp_backend="gloo", report_to=[],
                              dataloader_num_workers=0, disable_tqdm=True)
    store = tsck.open_store(args.store)
    # async_=False: rank 1 is killed two steps after a save that the resume must find
    # committed (the default, asynchronous, may still be writing it then).
    cb = hf.TsckCallback(store, job=JOB, keep_local=False, async_=False)
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(), callbacks=[cb, Record()])
    trainer.remove_callback(PrinterCallback)
    # a dropout stream of each rank's own (the Trainer seeded every rank alike)
    random.seed(1000 + rank)
    np.random.seed(1000 + rank)
    torch.manual_seed(1000 + rank)
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    digest = hashlib.sha256()
    for k, v in sorted(trainer.model.state_dict().items()):
        digest.update(k.encode() + v.detach().contiguous().view(torch.uint8).numpy().tobytes())
    left = sorted(n for n in os.listdir(targs.output_dir) if n.startswith("checkpoint-"))
    log.write(json.dumps({"params": digest.hexdigest(), "folders_left": left}) + "\n")
    log.close()
    store.close()


def torchrun(args, *, store: str, tag: str, kill_at: int = 0, resume: bool = False) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world}",
           os.path.abspath(__file__), "--train", "--store", store, "--out", args.out, "--tag", tag,
           "--steps", str(args.steps), "--kill-at", str(kill_at)] + (["--resume"] if resume else [])
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR", LOGLEVEL="ERROR")
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0 and not kill_at:
        print(proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode


def read_log(out: str, tag: str, rank: int) -> tuple[list[int], dict[int, str], dict]:
    starts, losses, end = [], {}, {}
    with open(os.path.join(out, f"{tag}_rank{rank}.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "start" in rec:
                starts.append(rec["start"])
            elif "step" in rec:
                losses[rec["step"]] = rec["loss"]
            else:
                end = rec
    return starts, losses, end


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kill-at", type=int, default=12)
    ap.add_argument("--out", default=None, help="a folder for the stores, outputs and logs (default: a temp one)")
    ap.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    ap.add_argument("--tag", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.train:
        train(args)
        return 0
    args.out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="tsck-hf-ddp-"))
    os.makedirs(args.out, exist_ok=True)
    run_store, ref_store = os.path.join(args.out, "store"), os.path.join(args.out, "reference")
    if torchrun(args, store=run_store, tag="run", kill_at=args.kill_at) == 0:
        print(f"the killed run exited 0: rank 1 was not killed at step {args.kill_at}?")
        return 1
    import tensorstore_ck as tsck
    with tsck.open_store(run_store, create=False) as s:
        print("committed snapshots (steps):", sorted(i.step for i in s.log(f"{JOB}/main")))
    if torchrun(args, store=run_store, tag="run", resume=True) != 0:
        print("the resumed run failed")
        return 1
    if torchrun(args, store=ref_store, tag="reference") != 0:
        print("the reference run failed")
        return 1
    ok, starts = True, set()
    for r in range(args.world):
        _s, ref, ref_end = read_log(args.out, "reference", r)
        run_starts, run, end = read_log(args.out, "run", r)
        start = run_starts[-1] if len(run_starts) == 2 else None
        starts.add(start)
        same = sorted(run) == list(range(1, args.steps + 1)) and all(run[s] == ref[s] for s in run)
        same_params = end.get("params") == ref_end.get("params")
        print(f"rank {r}: resumed at step {start}; losses {'identical' if same else 'DIFFER'} to the uninterrupted "
              f"run's; final parameters {'identical' if same_params else 'DIFFER'}; checkpoint folders left: "
              f"{end.get('folders_left')}")
        ok = ok and same and same_params and end.get("folders_left") == []
    if len(starts) != 1 or None in starts:
        print(f"ranks resumed at different steps (or none): {sorted(map(str, starts))}")
        ok = False
    print("bit-identical resume on every rank" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
