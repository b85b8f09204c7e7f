"""CheckpointManager under FSDP2 and hybrid sharding (HSDP) on real gloo ranks, for
tests/train/test_fsdp_manager.py.

    python fsdp_manager.py SCENARIO OUTDIR

SCENARIO is one of:
  fsdp   FSDP2 on 2 ranks trains steps 1-6 (a snapshot at every step, keep_last=2); fresh
         models and optimizers restore_latest() and train on to step 10 on 2 ranks ("same")
         on 3 ranks ("grow") and on one ("one": a 1-rank mesh, where the manager is not
         collective), each from its own copy of the store; an uninterrupted
         10-step run on 2 ranks ("straight") into another store
  hsdp   the same with HSDP on 4 ranks (a (replicate 2, shard 2) mesh); resumed as HSDP on
         4 ranks ("hsame") and as FSDP2 on 2 ranks ("hshrink"); "hstraight" uninterrupted
Every rank constructs the manager as the README's quick start does for one process
(TrainState(model=model, optimizer=opt), retention, restore_latest, step, close).

What makes a run's losses the same bits whatever the world size or mesh: every step trains
on one global batch drawn from the step number (and the global torch RNG, the same on every
rank), which every rank computes whole, so every rank's gradient is the same bits; FSDP2
reduces gradients in float64 (MixedPrecisionPolicy(reduce_dtype=float64)), in which the mean
of W copies of a float32 value is within a few float64 ulps of it and rounds back to it
exactly. The optimizer's update is elementwise, so the parameters do not depend on how they
are sharded either.

The ranks are forked by dist_worker.launch. Each rank writes OUTDIR/<phase>_rank<r>.json
(start step, losses, the manager's counters, local shard shapes) and OUTDIR/<phase>_rank<r>.pt
(every parameter and optimizer tensor gathered whole, at the end of the phase, and for a
resumed phase also right after restore_latest()). The test judges.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import math  # noqa: E402
import shutil  # noqa: E402

import torch  # noqa: E402

import dist_worker as dw  # noqa: E402
from dist_worker import launcher_main  # noqa: E402

JOB = "fsdp"
REF = f"{JOB}/main"
FIRST, LAST = 6, 10
BATCH = 24


def _model_and_opt(mesh_shape: tuple, seed: int):
    """An FSDP2 (1-D mesh) or HSDP (2-D mesh: replicate, shard) model and its Adam. Rows
    are uneven on purpose: 23 over 3 ranks is 8, 8, 7; 7 is 4, 3 on 2 ranks and 3, 3, 1 on 3."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    names = ("dp_replicate", "dp_shard") if len(mesh_shape) == 2 else ("dp",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 23), torch.nn.ReLU(), torch.nn.Linear(23, 7))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float64)
    for m in (model[0], model[2]):
        fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _train_step(model, opt, step: int) -> float:
    g = torch.Generator()
    g.manual_seed(step)
    x = torch.randn(BATCH, 16, generator=g)
    x = x + 0.01 * torch.randn_like(x)  # the global RNG too: a resume must restore it
    y = x[:, :7].sin()
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.item()


def _full_state(model, opt) -> dict:
    """Every parameter and optimizer tensor, gathered whole (a gloo all-gather), copied (on a
    1-rank mesh full_tensor() is the parameter's own memory, which training goes on changing)."""
    out = {f"model.{n}": p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"optim.{names[id(p)]}.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    return out


def run_case(rank, world, out, res, arg):
    """arg = (store name, mesh shape, last step, seed of the initial weights): the README's
    manager code, as every rank runs it."""
    import tensorstore_ck as tsck
    name, mesh_shape, last, seed = arg
    model, opt = _model_and_opt(tuple(mesh_shape), seed)
    torch.manual_seed(7)  # the data noise: the same stream on every rank
    phase = res["phase"]
    store = tsck.open_store(os.path.join(out, name))
    mgr = tsck.CheckpointManager(store, job=JOB, state=tsck.TrainState(model=model, optimizer=opt),
                                 every_steps=1, retention=tsck.Retention(keep_last=2))
    start = mgr.restore_latest()
    res["start"] = start
    dump = {}
    if start is not None:
        dump["restored"] = _full_state(model, opt)
    res["losses"] = {}
    for step in range((start or 0) + 1, last + 1):
        res["losses"][step] = _train_step(model, opt, step)
        mgr.step(step, metrics={"loss": res["losses"][step]})
    mgr.close()
    dump["final"] = _full_state(model, opt)
    res["local_shapes"] = {n: list(p.to_local().shape) for n, p in model.named_parameters()}
    p = mgr._pruner
    res.update(failed=mgr.failed_snapshots, errors=[f"{type(e).__name__}: {e}" for e in mgr.snapshot_errors],
               prune_runs=None if p is None else p.runs,
               prune_errors=[f"{type(e).__name__}: {e}" for e in mgr.prune_errors])
    store.close()
    torch.save(dump, os.path.join(out, f"{phase}_rank{rank}.pt"))


def scenarios(scenario: str, out: str, argv: list) -> list | None:
    """SCENARIO -> the launch infos of its runs (tests/_util.launcher_main runs this)."""
    import tensorstore_ck as tsck
    if scenario == "fsdp":
        big, phases = [2], [("same", [2]), ("grow", [3]), ("one", [1])]
        first, straight = "first", "straight"
    elif scenario == "hsdp":
        big, phases = [2, 2], [("hsame", [2, 2]), ("hshrink", [2])]
        first, straight = "hfirst", "hstraight"
    else:
        return None
    world = math.prod(big)
    # Made here, before any rank opens them: ranks racing to create a new store can find its
    # ref table unbound and mark it for a rebuild.
    for name in ("store", "straight"):
        tsck.open_store(os.path.join(out, name)).close()
    infos = [dw.launch(first, world, run_case, out, ("store", big, FIRST, 0), limit=240.0)]
    for phase, _mesh in phases:  # each resume from its own copy of the first run's store
        shutil.copytree(os.path.join(out, "store"), os.path.join(out, f"store_{phase}"))
    for phase, mesh in phases:
        infos.append(dw.launch(phase, math.prod(mesh), run_case, out, (f"store_{phase}", mesh, LAST, 1), limit=240.0))
    infos.append(dw.launch(straight, world, run_case, out, ("straight", big, LAST, 0), limit=240.0))
    return infos


if __name__ == "__main__":
    launcher_main(scenarios)
