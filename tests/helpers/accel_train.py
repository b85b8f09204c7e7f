"""A real accelerate training loop snapshotted by tensorstore_ck.accelerate, for
tests/train/test_accelerate.py.

    python accel_train.py CONFIG.json           # one process
    torchrun --nproc-per-node=2 accel_train.py CONFIG.json   # DDP, gloo on CPU

CONFIG: {"out": folder, "store": path, "job": name, "steps": total steps, "every": snapshot
every N steps, "async": bool, "resume": bool, "hold_at": a step to wait at (for the test's
SIGKILL) once the snapshot of step `every`*k is committed, "total_limit": N or null,
"api": "manager" | "functions", "generator": false for a DataLoader without one}.

A model with dropout (the torch RNG of each rank), an AdamW, a LambdaLR scheduler, a shuffled
loader prepared by the Accelerator (stateful, seedable sampler, a generator on the DataLoader),
a numpy draw and a python draw per step (their global RNGs) and a registered counter object.
Each rank writes OUT/<phase>_rank<r>_<name> files: started (its pid), committed_<step> (as each
snapshot commits), and result.json at the end: per step the batch's sample ids and the loss's
bits, the final parameters', optimizer's and RNG streams' digests, the scheduler's state, the
loader's epoch and position, accelerator.step, the checkpoint counter and the
registered object's count."""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch

import tensorstore_ck as tsck
from tensorstore_ck import accelerate as tsck_accelerate


class Counter:
    """An object of the user's, registered for checkpointing."""

    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def _digest(obj) -> str:
    h = hashlib.sha256()

    def walk(x):
        if isinstance(x, torch.Tensor):
            h.update(str((x.dtype, tuple(x.shape))).encode())
            h.update(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if x.numel() else b"")
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, np.ndarray):
            h.update(x.tobytes())
        else:
            h.update(repr(x).encode())
    walk(obj)
    return h.hexdigest()


def main(conf_path: str) -> None:
    cfg = json.loads(open(conf_path).read())
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, set_seed

    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(total_limit=cfg.get("total_limit")),
                      dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True,
                                                                use_seedable_sampler=True))
    rank = acc.process_index
    out = cfg["out"]
    tag = f"{cfg['phase']}_rank{rank}_"

    def mark(name, text=""):
        tmp = os.path.join(out, f".{tag}{name}")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(out, tag + name))

    set_seed(1234)
    xs = torch.randn(24, 8)
    ys = torch.randn(24, 1)
    ids = torch.arange(24)
    ds = torch.utils.data.TensorDataset(xs, ys, ids)
    gen = torch.Generator().manual_seed(7) if cfg.get("generator", True) else None  # (False: see docs/guide/accelerate.md)
    loader = torch.utils.data.DataLoader(ds, batch_size=3, shuffle=True, generator=gen)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    store = tsck.open_store(cfg["store"])

    def on_commit(ev):
        mark(f"committed_{ev.step}")

    functions = cfg.get("api") == "functions"
    mgr = None
    if not functions:
        mgr = tsck_accelerate.checkpoint_manager(acc, store, cfg["job"], every_steps=cfg["every"],
                                                 async_=cfg["async"], on_commit=on_commit, preempt_signals=())
    mark("started", str(os.getpid()))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's dump of a run past its deadline
    step = 0
    if cfg["resume"]:
        step = (tsck_accelerate.load_state(acc, store, cfg["job"], must_exist=True) if functions
                else mgr.restore_latest(must_exist=True))
    trace = {}
    while step < cfg["steps"]:
        for x, y, i in loader:
            step += 1
            noise = np.random.rand() + random.random()
            loss = torch.nn.functional.mse_loss(model(x), y) * (1 + noise)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            counter.n += int(i.sum())
            trace[step] = [i.tolist(), loss.detach().view(torch.int32).item(), acc.step]
            if functions:
                if step % cfg["every"] == 0:
                    res = tsck_accelerate.save_state(acc, store, cfg["job"], step=step, blocking=not cfg["async"])
                    if not cfg["async"]:
                        mark(f"committed_{res.step}")
                    else:
                        res.add_done_callback(lambda f, s=step: mark(f"committed_{s}"))
            else:
                mgr.step(step)
            if step == cfg.get("hold_at"):
                while True:  # the test SIGKILLs this process here
                    time.sleep(0.05)
            if step >= cfg["steps"]:
                break
    if mgr is not None:
        mgr.close()
    store.wait()
    rng = tsck.train.capture_rng()
    inner = acc.unwrap_model(model)
    result = {
        "trace": trace,
        "params": _digest(inner.state_dict()),
        "optimizer": _digest(opt.state_dict()),
        "scheduler": repr(sorted((k, v) for k, v in sched.state_dict().items() if k != "lr_lambdas")),
        "rng": _digest([rng["python"], rng["numpy"], rng["torch"]]),
        "epoch": loader.iteration,
        "loader": _digest(loader.state_dict()),
        "accelerator_step": acc.step,
        "iteration": acc.project_configuration.iteration,
        "counter": counter.n,
    }
    store.close()
    mark("result.json", json.dumps(result))
    acc.end_training()
    # Every store and manager is closed and the results are written. What is left is the
    # release of this function's objects and the interpreter's teardown, where DDP's native
    # objects at times blocked on a gloo peer that had already exited (a rank's only Python
    # frame the call of main(), its threads in native code, past the test's deadline):
    # torch's teardown, not what this run tests.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
