"""A DDP training script that runs a CheckpointManager, as torchrun runs it on every rank,
for tests/train/test_preempt_torchrun.py.

    python -m torch.distributed.run --standalone --nproc-per-node W preempt_torchrun.py OUT CONFIG.json

CONFIG: {"phase": name of this run, "hold": the step at which every rank waits for the
test (None: none), "end": the last step, "grace": preempt_grace, "every": every_steps,
"store": {"url", "refs", "opts", "tier", "retry_budget"} (tier: a local directory per rank,
<tier>/rank<r>; absent: a local store at OUT/store), "hold_save": hold the final
snapshot's first write (see Hold)}.

Each rank (gloo on CPU) trains a DDP model with Adam, resumes with restore_latest(), and
writes, by path under OUT (all events the test waits for):
  <phase>_rank<r>_start.json   {"start": the step resumed at, "pid"}; after restore_latest()
  <phase>_rank<r>_restored.pt  its model and optimizer state right after restore_latest()
  <phase>_rank<r>_step<s>.pt   its model and optimizer state after training step s
  <phase>_rank<r>_ready        it reached the hold step and waits for OUT/go
  <phase>_rank<r>_heard        one line per preemption signal it received (its own
                               handler, installed before the manager's: chained)
  <phase>_rank<r>_saving       the final snapshot's first write (hold_save)
  <phase>_rank<r>_log          the store's warnings (logging: a process ending in os._exit says why there)
  <phase>_rank<r>_end.json     how step() ended: Preempted's step, durable, code, why, the
                               seconds from the first signal to the raise, and the
                               warnings of that step() call
The test sends the signals (to the ranks, or to the torchrun agent) and judges.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (_util)

from _util import Watched  # noqa: E402

OUT = CFG = None
RANK = 0
SIGNALLED: list[float] = []  # monotonic times of the preemption signals this rank heard
COMMITS: dict[int, float] = {}  # step -> monotonic time its snapshot committed (on_commit)


def path(name: str) -> str:
    return os.path.join(OUT, f"{CFG['phase']}_rank{RANK}_{name}")


def until(name: str) -> None:
    """Wait for OUT/<name>, a file the test creates (the event it sends)."""
    while not os.path.exists(os.path.join(OUT, name)):
        time.sleep(0.01)


def on_signal(signum, frame) -> None:
    SIGNALLED.append(time.monotonic())
    with open(path("heard"), "a") as f:
        f.write(f"{signum}\n")


class Hold(Watched):
    """Once a preemption signal came, the first write of the store's storage says so
    (OUT/<phase>_rank<r>_saving) and waits for OUT/release: the test acts while the
    final snapshot is half written (a second signal, a SIGKILL)."""

    held = False

    def on_write(self, key: str) -> None:
        if SIGNALLED and not Hold.held:
            Hold.held = True
            open(path("saving"), "w").close()
            until("release")


def open_the_store():
    import tensorstore_ck as tsck
    s = CFG.get("store") or {}
    kw = {"wrap_storage": Hold} if CFG.get("hold_save") else {}
    if s.get("tier"):
        return tsck.open_store(s["url"], refs=s["refs"], storage_options=s["opts"], retry_budget=0.5,
                               local=os.path.join(s["tier"], f"rank{RANK}"), **kw)
    if s.get("url"):
        return tsck.open_store(s["url"], refs=s["refs"], storage_options=s["opts"],
                               retry_budget=s.get("retry_budget"), **kw)
    return tsck.open_store(os.path.join(OUT, "store"), **kw)


def save_state(model, opt, name: str) -> None:
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path(name))


def main() -> int:
    global OUT, CFG, RANK
    import tensorstore_ck as tsck
    from torch.nn.parallel import DistributedDataParallel as DDP
    OUT = sys.argv[1]
    with open(sys.argv[2]) as f:
        CFG = json.load(f)
    dist.init_process_group("gloo")
    RANK = dist.get_rank()
    import logging  # the store's warnings, in <phase>_rank<r>_log (a process that ends in os._exit says why there)
    handler = logging.FileHandler(path("log"))
    handler.setLevel(logging.WARNING)
    logging.getLogger("tensorstore_ck").addHandler(handler)
    signal.signal(signal.SIGTERM, on_signal)  # the program's own handler: the manager chains to it
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with open_the_store() as store:  # (its close, on Preempted too, waits for uploads: see the guide)
        mgr = tsck.CheckpointManager(store, job="run", state=tsck.TrainState(model=model, optimizer=opt),
                                     every_steps=CFG.get("every", 100), preempt_grace=CFG.get("grace", 60),
                                     on_commit=lambda e: COMMITS.setdefault(e.step, time.monotonic()))
        start = mgr.restore_latest() or 0
        save_state(model, opt, "restored.pt")
        with open(path("start.json"), "w") as f:
            json.dump({"start": start, "pid": os.getpid()}, f)
        for step in range(start + 1, CFG["end"] + 1):
            g = torch.Generator().manual_seed(1000 * step + RANK)  # each rank its own batch, per step
            x = torch.randn(8, 16, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True) * 0.1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            save_state(model, opt, f"step{step}.pt")
            caught: list = []
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    mgr.step(step)
            except tsck.Preempted as e:
                with open(path("end.json"), "w") as f:
                    json.dump({"step": e.step, "durable": e.durable, "code": e.code, "why": e.why, "at": step,
                               "seconds": time.monotonic() - SIGNALLED[0] if SIGNALLED else None,
                               "committed": COMMITS[step] - SIGNALLED[0] if SIGNALLED and step in COMMITS else None,
                               "text": str(e), "warnings": [f"{w.category.__name__}: {w.message}" for w in caught]},
                              f)
                raise
            finally:
                for w in caught:  # (shown too, in the log)
                    warnings.showwarning(w.message, w.category, w.filename, w.lineno)
            if step == CFG.get("hold"):
                mgr.wait()  # the interval snapshots are done: a held write (Hold) is the final one's
                store.wait_durable(timeout=120)  # (with a tier: uploaded, before the test cuts the remote)
                open(path("ready"), "w").close()
                until("go")
        mgr.close()
    with open(path("end.json"), "w") as f:
        json.dump({"step": None, "code": 0, "at": CFG["end"]}, f)
    # No teardown after a run that ended well: gloo's and DDP's destructors, run as this
    # frame's locals go, now and then block on a peer that already exited (seen at 3 ranks).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
