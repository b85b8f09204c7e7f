"""Training script for the exact-resume tests (tests/train/test_train_resume.py).

    python train_run.py STORE --steps N --every K [--workers W] [--async] [--resume]
                        [--out FINAL.pt] [--hold-at S [--settle]] [--slow-from S --delay D]

A tiny MLP with dropout, AdamW and a warmup+cosine LambdaLR, trained on a
dataset whose __getitem__ draws augmentation noise from numpy's global RNG,
python's `random` and torch's global RNG, read through
tsck.ResumableDataLoader(shuffle=True, num_workers=W). The loop itself also
draws from a numpy Generator (registered in TrainState(numpy_generators=...)),
from python `random` and numpy's global RNG, and dropout draws from torch's.
Snapshots go through tsck.CheckpointManager(every_steps=K).

stdout protocol (every line flushed):
    start                 store opened, nothing trained yet
    resumed <step|none>   with --resume: what restore_latest() returned
    step <n> <repr(loss)> after training step n and its mgr.step() call
    snap <n> inflight|done  after mgr.step(n) started an async snapshot (state of its future then)
    hold <n>              with --hold-at n: the process now sleeps until it is killed
    final                 the final state was written to --out; clean exit follows

--hold-at S: after step S stop and sleep forever (the test SIGKILLs it there), so
the kill lands at a known step. With --settle the snapshots already started are
first waited for (so the newest snapshot before S is committed when it dies).
--slow-from S --delay D: the store's storage is wrapped in a FaultInjectingStore
(no faults, only a random delay of up to D seconds per storage operation) that is
switched on just before mgr.step(S) (after waiting for the snapshots already in
flight, so those commit), so the snapshot S triggers is still being written when
the test kills the process right after step S.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time

import numpy as np
import torch
import torch.nn as nn

import tensorstore_ck as tsck
from tensorstore_ck.storage.wrappers import FaultInjectingStore

N_ITEMS = 97      # 13 batches of 8 per epoch (the last one short): not a multiple of K
BATCH = 8
DIM = 8
CLASSES = 3


class NoisyDataset(torch.utils.data.Dataset):
    """Fixed base data plus augmentation noise drawn from three global RNGs."""

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(N_ITEMS, DIM, generator=g)
        self.y = torch.randint(0, CLASSES, (N_ITEMS,), generator=g)

    def __len__(self):
        return N_ITEMS

    def __getitem__(self, i):
        noise = np.random.normal(size=DIM).astype(np.float32) * 0.1      # numpy global RNG
        jitter = random.random() * 0.05                                  # python random
        flip = torch.rand(DIM) * 0.01                                    # torch global RNG
        label = int(self.y[i]) if random.random() > 0.1 else random.randrange(CLASSES)  # label noise
        return self.x[i] + torch.from_numpy(noise) + jitter + flip, label


def build(workers: int):
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(DIM, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 32), nn.ReLU(),
                          nn.Dropout(0.2), nn.Linear(32, CLASSES))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    warmup, total = 6, 60

    def lr_lambda(s):
        if s < warmup:
            return (s + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / (total - warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    loader = tsck.ResumableDataLoader(NoisyDataset(), batch_size=BATCH, shuffle=True, num_workers=workers,
                                      seed=11)
    gen = np.random.default_rng(5)
    ts = tsck.TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader,
                         numpy_generators={"aug": gen})
    return model, opt, sched, loader, gen, ts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--job", default="train")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, required=True)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--async", dest="async_", action="store_true")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--hold-at", type=int)
    ap.add_argument("--settle", action="store_true")
    ap.add_argument("--slow-from", type=int)
    ap.add_argument("--delay", type=float, default=0.0)
    a = ap.parse_args()

    fis = []

    def wrap(s):
        f = FaultInjectingStore(s, rules={}, delay=a.delay)
        f.armed = False  # only delays once switched on
        fis.append(f)
        return f

    store = tsck.open_store(a.store, wrap_storage=wrap if a.slow_from is not None else None)
    model, opt, sched, loader, gen, ts = build(a.workers)
    mgr = tsck.CheckpointManager(store, job=a.job, state=ts, every_steps=a.every, async_=a.async_)
    print("start", flush=True)
    step = 0
    if a.resume:
        got = mgr.restore_latest()
        print(f"resumed {'none' if got is None else got}", flush=True)
        step = got or 0
    model.train()
    while step < a.steps:
        for x, y in loader:
            step += 1
            out = model(x)
            # randomness in the loop itself: a registered Generator, python random, numpy global
            out = out + torch.from_numpy(gen.normal(size=CLASSES).astype(np.float32)) * 0.01
            scale = 1.0 + 0.01 * random.random() + 0.01 * float(np.random.random())
            loss = nn.functional.cross_entropy(out, y) * scale
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if a.slow_from is not None and step == a.slow_from:
                mgr.wait()  # earlier snapshots commit at full speed; only this step's is slowed
                fis[0].armed = True
            res = mgr.step(step, metrics={"loss": loss.item()})
            print(f"step {step} {loss.item()!r}", flush=True)
            if res is not None and not isinstance(res, tsck.SnapshotInfo):
                print(f"snap {step} {'done' if res.done() else 'inflight'}", flush=True)
            if step == a.hold_at:
                if a.settle:
                    mgr.wait()
                print(f"hold {step}", flush=True)
                while True:
                    time.sleep(3600)
            if step >= a.steps:
                break
    mgr.close()
    if a.out:
        torch.save({
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "scheduler": sched.state_dict(),
            "loader": loader.state_dict(),
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(),
                    "torch": torch.get_rng_state(), "aug": gen.bit_generator.state},
        }, a.out)
    store.close()
    print("final", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
