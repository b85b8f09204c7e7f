"""A torch.distributed.checkpoint script moved onto tensorstore_ck by changing one argument.

    dcp.save(state, checkpoint_id="/ckpt/step-4")                                 # before: a folder
    dcp.save(state, storage_writer=TsckWriter(store, ref="swap/main", step=4))    # after: a snapshot

    dcp.load(state, checkpoint_id="/ckpt/step-4")                                 # before
    dcp.load(state, storage_reader=TsckReader(store, "swap/main"))                # after

Then both APIs read each other's snapshots: store.checkout(into=) resumes from the
dcp.save snapshot, and dcp.load reads one taken with store.put_snapshot. Each resume
must continue with bit-identical losses; the script exits 1 otherwise.

    python examples/dcp_swap.py [--store DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings

import torch
import torch.distributed.checkpoint as dcp

import tensorstore_ck as tsck
from tensorstore_ck.dcp import TsckReader, TsckWriter

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")  # single process


def build(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        loss = (model(x) - x[:, :4]).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def warm(seed):
    """A fresh model and optimizer with optimizer state, which dcp.load fills in place."""
    model, opt = build(seed)
    train(model, opt, 1, seed=seed)
    return model, opt


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", default=None)
    args = ap.parse_args()
    store = tsck.open_store(args.store or tempfile.mkdtemp(prefix="tsck-dcp-swap-"))

    model, opt = build(0)
    train(model, opt, 4, seed=1)
    # The one changed argument: storage_writer= instead of checkpoint_id=.
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()},
             storage_writer=TsckWriter(store, ref="swap/main", step=4))
    store.put_snapshot({"model": model, "optim": opt}, ref="swap/native", step=4)
    want = train(model, opt, 5, seed=2)

    def dcp_resume(target, seed):
        m, o = warm(seed)
        state = {"model": m.state_dict(), "optim": o.state_dict()}
        dcp.load(state, storage_reader=TsckReader(store, target))  # the one changed argument
        m.load_state_dict(state["model"])
        o.load_state_dict(state["optim"])
        return train(m, o, 5, seed=2)

    ok = True
    # 1. dcp.load through TsckReader, as before with a folder.
    ok &= report("dcp.save -> dcp.load", dcp_resume("swap/main", 10), want)

    # 2. The same DCP snapshot through the native API: the objects themselves as into=.
    m, o = warm(11)
    store.checkout("swap/main", into={"model": m, "optim": o})
    ok &= report("dcp.save -> store.checkout", train(m, o, 5, seed=2), want)

    # 3. A put_snapshot snapshot through dcp.load.
    ok &= report("put_snapshot -> dcp.load", dcp_resume("swap/native", 12), want)
    store.close()
    return 0 if ok else 1


def report(what, got, want) -> bool:
    same = got == want
    print(f"{what:28s} losses after resume {'bit-identical' if same else 'DIFFER'}: {got[-1]:.6f}")
    return same


if __name__ == "__main__":
    sys.exit(main())
