"""Demo: snapshot a small GPT-style model while it trains, watch dedup work,
check a snapshot out bit-exactly, and look at the store with the CLI.

Run from the repository root (README's first command does):
    python examples/demo.py [--store DIR]
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn as nn

import tensorstore_ck as tsck

TEXT = open(os.__file__, encoding="utf-8").read()  # real text that ships with Python


class TinyGPT(nn.Module):
    def __init__(self, vocab=256, d=256, layers=4, heads=4, ctx=64):
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


def batches(data, ctx, bs, gen):
    while True:
        ix = torch.randint(len(data) - ctx - 1, (bs,), generator=gen)
        x = torch.stack([data[i:i + ctx] for i in ix])
        y = torch.stack([data[i + 1:i + ctx + 1] for i in ix])
        yield x, y


def human(n):
    return f"{n / 1e6:8.2f} MB"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=None, help="store directory (default: a fresh temp dir)")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.manual_seed(0)
    root = args.store or os.path.join(tempfile.mkdtemp(prefix="tsck-demo-"), "store")

    data = torch.tensor(list(TEXT.encode("utf-8")), dtype=torch.long)
    model = TinyGPT()
    # The embeddings and the lower half of the blocks are frozen, as in many fine-tunes:
    # their blocks are written once and shared by every later snapshot.
    for p in [*model.tok.parameters(), *model.pos.parameters(), *model.blocks.layers[:2].parameters()]:
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(  # warmup, then cosine
        opt, lambda s: min(1.0, (s + 1) / 10) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    gen = torch.Generator().manual_seed(1)
    it = batches(data, 64, 16, gen)
    nparams = sum(p.numel() for p in model.parameters())
    print(f"model: {nparams / 1e6:.2f}M parameters; store: {root}")

    def state(step):
        return {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "data": gen.get_state()}, "step": step}

    with tsck.open_store(root) as store:
        print(f"{'step':>5} {'loss':>7} {'snapshot':>16} {'total':>11} {'new':>11} {'secs':>6}")
        for step in range(1, args.steps + 1):
            x, y = next(it)
            loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if step % 10 == 0:
                t0 = time.perf_counter()
                info = store.put_snapshot(state(step), ref="demo/main", step=step,
                                          metrics={"loss": loss.item()})
                dt = time.perf_counter() - t0
                print(f"{step:>5} {loss.item():7.3f} {info.root[:16]} {human(info.bytes_total)} "
                      f"{human(info.bytes_new)} {dt:6.2f}")

        # The same state again writes nothing new.
        again = store.put_snapshot(state(args.steps), ref="demo/main", step=args.steps)
        print(f"same state again: {again.blocks_new} new blocks, {again.bytes_new} new bytes")

        # A second job forked from the same weights shares them.
        fork = store.put_snapshot({"model": model.state_dict()}, ref="finetune/main", step=0)
        print(f"second job from the same weights: {human(fork.bytes_new).strip()} new of "
              f"{human(fork.bytes_total).strip()}")

        # Check an older snapshot out and verify it bit-exactly against a reload.
        old = store.checkout("demo/main@20")
        print(f"checkout demo/main@20: step {old['step']}, {len(old['model'])} tensors, verified against "
              f"root {store.resolve('demo/main@20')[:16]}")
        fresh = TinyGPT()
        fresh.load_state_dict(old["model"])
        cur = store.checkout("demo/main")
        same = all(torch.equal(a, b) for a, b in zip(cur["model"].values(), model.state_dict().values()))
        print(f"latest checkout equals the live model bit-for-bit: {same}")
        if not same:
            sys.exit(1)
    print("\n$ tsck du", root)
    subprocess.run([sys.executable, "-m", "tensorstore_ck", "du", root], check=True)
    print("\n$ tsck log", root, "demo/main")
    subprocess.run([sys.executable, "-m", "tensorstore_ck", "log", root, "demo/main"], check=True)
    if args.store is None:
        shutil.rmtree(os.path.dirname(root), ignore_errors=True)


if __name__ == "__main__":
    main()
