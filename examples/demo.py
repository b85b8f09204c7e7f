"""Demo: train a small GPT-style model, get killed mid-run, resume exactly, and look after the store.

    python examples/demo.py [--store DIR] [--steps 120]

1. A training run (a child process) trains on real text that ships with Python,
   snapshotting by policy (every 20 steps, and whenever the validation loss
   improves) asynchronously into a local store, and is killed with SIGKILL
   between two snapshots.
2. The run is resumed from the newest committed snapshot and trained to the end;
   the losses of the steps it redoes are compared with those the killed run
   printed: they are bit-identical.
   Both runs prune while they train: the manager applies the job's retention (keep
   the last 3 and the best 1) in the background after each snapshot.
3. The store is inspected with the CLI: `tsck log` (only what retention keeps),
   `tsck du`, `tsck fsck`, `tsck gc --dry-run` (each snapshot, keep or remove, and
   the rule that decided) and `tsck gc`; then `tsck ls` and `tsck export-weights`
   take the model's weights out as a safetensors file that load_state_dict takes,
   without Python.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.nn as nn

import tensorstore_ck as tsck

TEXT = open(os.__file__, encoding="utf-8").read()  # real text that ships with Python
CTX = 64


class TinyGPT(nn.Module):
    def __init__(self, vocab=256, d=192, layers=4, heads=4, ctx=CTX):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        block = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.1, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(ctx), persistent=False)

    def forward(self, x):
        t = x.shape[1]
        h = self.tok(x) + self.pos(torch.arange(t))
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.ln(h))


class TextWindows(torch.utils.data.Dataset):
    """Windows of CTX+1 bytes; each fetch starts at a random jitter (the data pipeline's own RNG)."""

    def __init__(self, data: torch.Tensor):
        self.data = data
        self.n = (len(data) - 2 * CTX - 2) // CTX

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        start = i * CTX + int(np.random.randint(0, CTX))
        chunk = self.data[start:start + CTX + 1]
        return chunk[:-1], chunk[1:]


def build(total_steps: int):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    data = torch.tensor(list(TEXT.encode("utf-8")), dtype=torch.long)
    split = int(len(data) * 0.9)
    model = TinyGPT()
    # Frozen embeddings and lower half, as in many fine-tunes: their blocks are stored once
    # and shared by every snapshot (see the dedup figure of `tsck du`).
    for p in [*model.tok.parameters(), *model.pos.parameters(), *model.blocks.layers[:2].parameters()]:
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-3, weight_decay=0.1)
    warmup = 10
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (
        1 + math.cos(math.pi * min(1.0, max(0, s - warmup) / max(1, total_steps - warmup)))))
    loader = tsck.ResumableDataLoader(TextWindows(data[:split]), batch_size=16, shuffle=True, seed=1)
    val = data[split:]
    ts = tsck.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    return model, opt, sched, loader, val, ts


@torch.no_grad()
def val_loss(model, val):
    model.eval()
    g = torch.Generator().manual_seed(0)
    ix = torch.randint(len(val) - CTX - 1, (32,), generator=g)
    x = torch.stack([val[i:i + CTX] for i in ix])
    y = torch.stack([val[i + 1:i + CTX + 1] for i in ix])
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    model.train()
    return loss


def train(store_path: str, total: int, resume: bool) -> None:
    """The training job. Prints 'step N LOSS' per step (the parent watches these)."""
    from tqdm import tqdm

    model, opt, sched, loader, val, ts = build(total)
    # A resume never creates a store, and must find a snapshot: a mistyped path or job is an
    # error here, not a silent restart from step 0.
    with tsck.open_store(store_path, create=not resume) as store:
        # With retention, the manager prunes in the background after each snapshot: the
        # store stays at what the rules keep while the job trains (no offline gc needed).
        mgr = tsck.CheckpointManager(store, job="demo", state=ts, every_steps=20, on_metric=("val_loss", "min"),
                                     retention=tsck.Retention(keep_last=3, keep_best=1, metric="val_loss"))
        step = mgr.restore_latest(must_exist=True) if resume else None
        if resume:
            print(f"resumed at step {step} (epoch {loader.epoch}, batch {loader.batches_consumed})", flush=True)
        step = step or 0
        bar = tqdm(total=total, initial=step, desc="train", unit="step", file=sys.stderr, leave=False)
        while step < total:
            for x, y in loader:
                step += 1
                loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                metrics = {"loss": loss.item()}
                if step % 10 == 0:
                    metrics["val_loss"] = val_loss(model, val)
                mgr.step(step, metrics=metrics)
                print(f"step {step} {loss.item()!r}", flush=True)
                bar.update(1)
                if step >= total:
                    break
        bar.close()
        mgr.close()


def sparkline(values) -> str:
    ticks = "▁▂▃▄▅▆▇█"
    lo, hi = min(values), max(values)
    return "".join(ticks[int((v - lo) / (hi - lo + 1e-12) * (len(ticks) - 1))] for v in values)


def cli(*args) -> None:
    print(f"\n$ tsck {' '.join(args)}", flush=True)
    subprocess.run([sys.executable, "-m", "tensorstore_ck", *args], check=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=None, help="store directory (default: a fresh temp dir)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--kill-at", type=int, default=70, help="SIGKILL the first run after this step")
    ap.add_argument("--train", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--resume", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.train:
        return train(args.store, args.steps, args.resume)

    root = args.store or os.path.join(tempfile.mkdtemp(prefix="tsck-demo-"), "store")
    print(f"store: {root}\nrun 1: training {args.steps} steps; it will be killed (SIGKILL) after step {args.kill_at}")
    me = [sys.executable, os.path.abspath(__file__), "--train", "--store", root, "--steps", str(args.steps)]
    first: dict[int, str] = {}
    child = subprocess.Popen(me, stdout=subprocess.PIPE, text=True)
    for line in child.stdout:
        if line.startswith("step "):
            _, s, loss = line.split()
            first[int(s)] = loss
            if int(s) >= args.kill_at:
                os.kill(child.pid, signal.SIGKILL)
                break
    child.wait()
    print(f"run 1 killed at step {max(first)} (exit {child.returncode})")

    with tsck.open_store(root) as store:
        print("committed snapshots:", [i.step for i in store.log("demo/main")])
    print("run 2: resume from the newest committed snapshot")
    second: dict[int, str] = {}
    out = subprocess.run(me + ["--resume"], stdout=subprocess.PIPE, text=True, check=True).stdout
    for line in out.splitlines():
        if line.startswith("resumed"):
            print(line)
        elif line.startswith("step "):
            _, s, loss = line.split()
            second[int(s)] = loss
    redone = sorted(set(first) & set(second))
    same = all(first[s] == second[s] for s in redone)
    print(f"steps redone after the resume: {redone[0] if redone else '-'}..{redone[-1] if redone else '-'}; "
          f"losses bit-identical to the killed run: {same}")
    losses = [float(second.get(s, first.get(s))) for s in range(1, args.steps + 1)]
    means = [sum(losses[i:i + 10]) / len(losses[i:i + 10]) for i in range(0, len(losses), 10)]
    print("loss per 10 steps:", " ".join(f"{m:.2f}" for m in means))
    print("loss curve:       ", sparkline(means))

    cli("log", root, "demo/main")
    cli("du", root)
    cli("fsck", root)
    cli("gc", root, "--dry-run")  # the manager pruned while training: little or nothing is left to reclaim
    cli("gc", root)
    # Restoring without Python: the weights as a safetensors file other tools read, named as
    # the model's state_dict names them (model.load_state_dict(safetensors.torch.load_file(out))).
    cli("ls", root, "demo/main", "model.head")
    out = os.path.join(os.path.dirname(root), "model.safetensors")
    cli("export-weights", root, "demo/main", out, "--force")
    if not same:
        sys.exit(1)
    if args.store is None:
        shutil.rmtree(os.path.dirname(root), ignore_errors=True)


if __name__ == "__main__":
    main()
