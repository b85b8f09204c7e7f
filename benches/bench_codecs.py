"""Does compression pay on training state? lz4 vs byte-shuffle + lz4, per 4 MiB block.

Trains the demo's GPT-style model on real text for a few steps (so the
weights and AdamW moments are not just their initial values), then for fp32
weights, bf16 weights, exp_avg and exp_avg_sq reports the compression ratio
and speed of each codec next to the disk speed they would compete with.

    .venv/bin/python benches/bench_codecs.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import lz4.block
import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from demo import TEXT, TinyGPT, batches  # noqa: E402

from tensorstore_ck.format.frame import _shuffle  # noqa: E402

BLOCK = 4 << 20


def blocks_of(tensors):
    raw = np.concatenate([t.detach().contiguous().reshape(-1).view(torch.uint8).numpy() for t in tensors])
    return [raw[i:i + BLOCK] for i in range(0, len(raw) - BLOCK + 1, BLOCK)] or [raw]


def measure(name, tensors, itemsize):
    bl = blocks_of(tensors)
    total = sum(b.nbytes for b in bl)
    rows = []
    for codec in ("lz4", "shuffle+lz4"):
        t0 = time.perf_counter()
        out = 0
        for b in bl:
            data = _shuffle(b, itemsize) if codec != "lz4" else b
            out += len(lz4.block.compress(data, store_size=False))
        dt = time.perf_counter() - t0
        rows.append((codec, total / out, total / dt / 1e9))
    print(f"| {name} | {total / 1e6:.0f} MB | " + " | ".join(f"{r:.3f}x at {s:.2f} GB/s" for _, r, s in rows) + " |")


def main():
    torch.manual_seed(0)
    model = TinyGPT(d=384, layers=6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    it = batches(data, 64, 8, torch.Generator().manual_seed(0))
    for _ in range(20):
        x, y = next(it)
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = [p for p in model.parameters()]
    st = [opt.state[p] for p in params]
    print("| data | size | lz4 | byte-shuffle + lz4 |")
    print("|---|---|---|---|")
    measure("fp32 weights", params, 4)
    measure("bf16 weights", [p.to(torch.bfloat16) for p in params], 2)
    measure("AdamW exp_avg", [s["exp_avg"] for s in st], 4)
    measure("AdamW exp_avg_sq", [s["exp_avg_sq"] for s in st], 4)


if __name__ == "__main__":
    main()
