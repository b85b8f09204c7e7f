"""A Hugging Face Trainer run snapshotted into a store, killed, and resumed bit-identically.

    python examples/hf_trainer_resume.py [--store DIR] [--steps 20] [--kill-at 12]

Needs the `hf` extra (transformers, accelerate); no network: the model is a tiny
GPT-2 built from a config, the data random token ids.

1. Run A trains uninterrupted (in this process) and records each step's loss and
   the final weights.
2. Run B (a child process) trains the same job with hf.TsckCallback(keep_local=False):
   at every save (each 5 steps) the model, optimizer, scheduler, RNG streams and
   trainer state go into the store and the Trainer's own checkpoint folder is
   deleted, so the store holds the only copy. It is killed with SIGKILL at step
   --kill-at.
3. Run B is resumed in a fresh process and a fresh output directory:
   hf.resume_checkpoint writes the newest snapshot as a checkpoint folder and
   trainer.train(resume_from_checkpoint=...) continues from it.
The losses of every step B ran and its final weights must equal A's to the bit;
the exit status is 1 when they do not.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: there may be no network

import torch  # noqa: E402
from transformers import (GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments, set_seed)
from transformers.utils import logging as hf_logging  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402
from tensorstore_ck import hf  # noqa: E402

JOB = "hf-demo"


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=16, vocab=128):
        self.x = torch.randint(0, vocab, (n, length), generator=torch.Generator().manual_seed(123))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


class PrintLoss(TrainerCallback):
    """'step N LOSS' per step on stdout (the parent reads these); with pause_at, the run
    stops there and waits to be killed."""

    def __init__(self, pause_at=None, quiet=False):
        self.pause_at = pause_at
        self.quiet = quiet
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]
            if not self.quiet:
                print(f"step {state.global_step} {logs['loss']!r}", flush=True)
        if state.global_step == self.pause_at:
            print("waiting to be killed", flush=True)
            signal.pause()


def make_trainer(out: str, steps: int, callbacks) -> Trainer:
    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    set_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)  # dropout on: the resumed run must get the RNG streams back too
    args = TrainingArguments(out, max_steps=steps, save_steps=5, logging_steps=1, per_device_train_batch_size=4,
                             learning_rate=1e-3, seed=0, use_cpu=True, report_to=[], dataloader_num_workers=0,
                             disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=RandomTokens(), callbacks=callbacks)
    trainer.remove_callback(PrinterCallback)  # its dict per step; this script prints its own lines
    return trainer


def child(store_path: str, out: str, steps: int, kill_at: int | None, resume: bool, final: str) -> None:
    with tsck.open_store(store_path, create=not resume) as store:
        # async_=False: the kill comes two steps after a save, and the parent checks that
        # save is committed. The default (asynchronous) commits it in the background, so a
        # process killed within the put's time would resume from the save before.
        trainer = make_trainer(out, steps, [hf.TsckCallback(store, job=JOB, keep_local=False, async_=False),
                                            PrintLoss(pause_at=kill_at)])
        path = None
        if resume:
            path = hf.resume_checkpoint(store, f"{JOB}/main", out)
            print(f"resuming from {path}", flush=True)
        trainer.train(resume_from_checkpoint=path)
        left = [n for n in os.listdir(out) if n.startswith("checkpoint-") and os.path.join(out, n) != path]
        assert not left, f"keep_local=False left the Trainer's folders {left}"
        torch.save(trainer.model.state_dict(), final)


def run_child(argv: list, kill: bool) -> dict:
    losses = {}
    p = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv], stdout=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.startswith("step "):
            _, s, loss = line.split()
            losses[int(s)] = float(loss)
        elif line.startswith("resuming"):
            print("  " + line.strip())
        elif kill and line.startswith("waiting"):
            os.kill(p.pid, signal.SIGKILL)
    p.wait()
    if p.returncode != (-signal.SIGKILL if kill else 0):
        sys.exit(f"the child {argv} ended with status {p.returncode}")
    return losses


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=None, help="store directory (default: a fresh temp dir)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kill-at", type=int, default=12)
    ap.add_argument("--child", nargs=3, metavar=("OUT", "RESUME", "FINAL"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        out, resume, final = a.child
        child(a.store, out, a.steps, None if resume == "1" else a.kill_at, resume == "1", final)
        return 0

    work = tempfile.mkdtemp(prefix="tsck-hf-")
    store = a.store or os.path.join(work, "store")
    print(f"store: {store}\nrun A: {a.steps} steps, uninterrupted")
    rec = PrintLoss(quiet=True)
    trainer = make_trainer(os.path.join(work, "a"), a.steps, [rec])
    trainer.train()
    want = {k: v.clone() for k, v in trainer.model.state_dict().items()}

    print(f"run B: the same job snapshotted into the store; SIGKILL at step {a.kill_at}")
    final = os.path.join(work, "b-final.pt")
    base = ["--store", store, "--steps", str(a.steps), "--kill-at", str(a.kill_at)]
    got = run_child(base + ["--child", os.path.join(work, "b1"), "0", final], kill=True)
    with tsck.open_store(store, create=False) as s:
        print("  committed snapshots (steps):", [i.step for i in reversed(s.log(f"{JOB}/main"))])
    print("run B resumed in a fresh process and output directory")
    got2 = run_child(base + ["--child", os.path.join(work, "b2"), "1", final], kill=False)
    redone = sorted(set(got) & set(got2))
    got.update(got2)
    same_losses = got == rec.losses
    params = torch.load(final, weights_only=True)
    same_params = want.keys() == params.keys() and all(
        want[k].dtype == params[k].dtype and want[k].shape == params[k].shape
        and want[k].view(torch.uint8).equal(params[k].contiguous().view(torch.uint8)) for k in want)
    print(f"steps run twice (killed run, then resumed): {redone}")
    print(f"losses of all {len(got)} steps bit-identical to run A: {same_losses}")
    print(f"final parameters bit-identical to run A: {same_params}")
    return 0 if same_losses and same_params else 1


if __name__ == "__main__":
    sys.exit(main())
