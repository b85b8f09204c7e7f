"""torchtitan's own CheckpointManager over a store (tensorstore_ck.torchtitan) on real gloo
ranks with FSDP2 on CPU, driven as torchtitan's Trainer drives it, for
tests/train/test_torchtitan.py.

    python titan_manager.py SCENARIO OUTDIR

SCENARIO is one of:
  base      "straight": 2 ranks train steps 1-6 uninterrupted, a snapshot every 2 steps
            (keep_latest_k=2), dumping the whole state at each saved step; "pick" (from a
            copy of its store): load(step=2) (pruned), load(step=4), steps 5-6 with
            load_only; a second manager with exclude_from_loading=["dataloader"];
            "initial": a DCP folder written as torchtitan's seed checkpoint is, a job
            with no snapshot starts from it (initial_load_path), a restart resumes from
            the store and not from the folder
  disabled  async_mode "disabled": rank 1 SIGKILLed (with the job, as torchrun does) right
            after save(4) ("kstep"), then a fresh job resumes ("rstep"); rank 0 killed
            inside the writer's finish of step 4 ("kfin"), resumed ("rfin")
  async     the same with async_mode "async"

Every run builds what the Trainer builds for the manager: FSDP2 model parts, torchtitan's
OptimizersContainer (Adam) and LRSchedulersContainer, its ParallelAwareDataloader over a
dataset of numbered samples, a Stateful train state {"step"}; then
`config.checkpoint.build(...)`, `load(step=load_step)`, and per step: forward/backward,
`maybe_wait_for_staging()`, the optimizers' and schedulers' step, `save(step,
last_step=step == LAST)`. Every rank sees the whole global batch (so the losses do not
depend on the world size) and FSDP2 reduces in float64 (as fsdp_manager.py explains).

Each rank writes OUTDIR/<phase>_rank<r>.json (start step, losses, the first sample index
its loader gave after the load, errors); rank 0 writes OUTDIR/<phase>.pt (the whole state
at each saved step, after the load and at the end). The test judges.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import shutil  # noqa: E402
import threading  # noqa: E402

import torch  # noqa: E402

import dist_worker as dw  # noqa: E402
from dist_worker import launcher_main  # noqa: E402

# Imported by the launcher, before it forks the ranks (each would import them again).
import torch.distributed.checkpoint as dcp  # noqa: E402
from torchtitan.components.checkpoint import ModelWrapper  # noqa: E402
from torchtitan.components.dataloader import ParallelAwareDataloader  # noqa: E402
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import ParamGroupConfig  # noqa: E402

from tensorstore_ck.torchtitan import TsckCheckpointManager  # noqa: E402

JOB = "titan"
LAST, KILL_AT, INTERVAL, KEEP = 6, 4, 2, 2
BATCH = 8


class Numbered(torch.utils.data.IterableDataset):
    """Sample i: (i, 16 floats drawn from seed i), endless."""

    def __iter__(self):
        i = 0
        while True:
            g = torch.Generator()
            g.manual_seed(i)
            yield i, torch.randn(16, generator=g)
            i += 1


class TrainState:
    """What the Trainer keeps under "train_state" (its state_dict: the step)."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


def _parts(seed: int, world: int, rank: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 23), torch.nn.ReLU(), torch.nn.Linear(23, 7))
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float64)
    for m in (model[0], model[2]):
        fully_shard(m, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opts = OptimizersContainer(OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="Adam", optimizer_kwargs={"lr": 1e-2})],
        implementation="for-loop"), model_parts=[model])
    scheds = LRSchedulersContainer(opts, lambda s: 1.0 / (1 + 0.5 * s))
    # Every rank reads the whole global batch (dp_rank names the loader's state key).
    loader = ParallelAwareDataloader(Numbered(), dp_rank=rank, dp_world_size=world, batch_size=BATCH)
    return model, opts, scheds, loader


def _whole(model, opts, scheds, state) -> dict:
    out = {f"model.{n}": p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    for opt in opts.optimizers:
        for p, st in opt.state.items():
            for k, v in st.items():
                out[f"optim.{names[id(p)]}.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    out["lr"] = torch.tensor([s.get_last_lr()[0] for s in scheds.schedulers], dtype=torch.float64)
    out["step"] = torch.tensor(state.step)
    return out


def _manager(cfg, model, opts, scheds, loader, state):
    """As the Trainer builds its checkpointer: config.checkpoint.build(...)."""
    return cfg.build(dataloader=loader, model_parts=[model], optimizers=opts, lr_schedulers=scheds,
                     states={"train_state": state}, sd_adapter=None, base_folder="")


def _config(store: str, **kw):
    kw = {"enable": True, "store": store, "job": JOB, "interval": INTERVAL, "keep_latest_k": KEEP,
          "last_save_model_only": False, **kw}
    return TsckCheckpointManager.Config(**kw)


def _train(rank, out, res, model, opts, scheds, loader, state, mgr, *, dump=None, kill_after=None):
    res["losses"] = {}
    it = iter(loader)
    first = True
    while state.step < LAST:
        state.step += 1
        idx, x = next(it)
        if first:
            res["first_index"] = int(idx[0])
            first = False
        y = x[:, :7].sin()
        opts.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        mgr.maybe_wait_for_staging()
        opts.step()
        scheds.step()
        res["losses"][state.step] = loss.item()
        mgr.save(state.step, last_step=state.step == LAST)
        if dump is not None and state.step % INTERVAL == 0:
            dump[state.step] = _whole(model, opts, scheds, state)
        if kill_after is not None and state.step == kill_after and rank == 1:
            open(os.path.join(out, "trap_rank1"), "w").close()  # the launcher kills the job now
            threading.Event().wait()


def _trap_finish(out: str, step: int) -> None:
    """Rank 0: the writer's finish of `step` (the commit about to be published) signals the
    launcher, which kills the job there."""
    from tensorstore_ck.dcp import TsckWriter
    real = TsckWriter.finish

    def finish(self, metadata, results):
        if self.step == step:
            open(os.path.join(out, "trap_rank0"), "w").close()
            threading.Event().wait()
        return real(self, metadata, results)
    TsckWriter.finish = finish


def run_phase(rank, world, out, res, arg):
    """arg: {"store", "mode", "kill": None|"step"|"finish", "dump": bool}."""
    store = os.path.join(out, arg["store"])
    if arg.get("kill") == "finish" and rank == 0:
        _trap_finish(out, KILL_AT)
    model, opts, scheds, loader = _parts(0, world, rank)
    state = TrainState()
    mgr = _manager(_config(store, async_mode=arg["mode"]), model, opts, scheds, loader, state)
    mgr.load(step=-1)
    res["start"] = state.step
    dump = {"restored": _whole(model, opts, scheds, state)}
    _train(rank, out, res, model, opts, scheds, loader, state, mgr, dump=dump,
           kill_after=KILL_AT if arg.get("kill") == "step" else None)
    mgr.close()
    dump["final"] = _whole(model, opts, scheds, state)
    if rank == 0:
        torch.save(dump, os.path.join(out, f"{res['phase']}.pt"))


def run_pick(rank, world, out, res, arg):
    """load_step and exclude_from_loading, from a copy of the straight run's store."""
    from tensorstore_ck.errors import TsckError
    store = os.path.join(out, arg["store"])
    model, opts, scheds, loader = _parts(1, world, rank)
    state = TrainState()
    mgr = _manager(_config(store, load_only=True, load_step=2), model, opts, scheds, loader, state)
    try:
        mgr.load(step=2)  # the Trainer's load(step=config.checkpoint.load_step)
    except TsckError as e:
        res["pruned_error"] = type(e).__name__
    mgr.load(step=KILL_AT)
    res["start"] = state.step
    dump = {"restored": _whole(model, opts, scheds, state)}
    _train(rank, out, res, model, opts, scheds, loader, state, mgr)
    dump["final"] = _whole(model, opts, scheds, state)
    mgr.close()
    # exclude_from_loading: the loader keeps its own position, the rest is restored
    model, opts, scheds, loader = _parts(1, world, rank)
    state = TrainState()
    mgr = _manager(_config(store, load_only=True, exclude_from_loading=["dataloader"]), model, opts, scheds,
                   loader, state)
    mgr.load(step=KILL_AT)
    dump["excluded"] = _whole(model, opts, scheds, state)
    res["excluded_first_index"] = int(next(iter(loader))[0][0])
    mgr.close()
    if rank == 0:
        torch.save(dump, os.path.join(out, "pick.pt"))


def run_initial(rank, world, out, res, arg):
    """initial_load_path: a DCP folder written as torchtitan's seed checkpoint is (the model
    parts' flattened state_dict, dcp.save to a folder)."""
    folder = os.path.join(out, "seed", "step-0")
    model, _o, _s, _l = _parts(5, world, rank)
    dcp.save(ModelWrapper([model]).state_dict(), checkpoint_id=folder)
    seed = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    store = os.path.join(out, arg["store"])
    cfg = _config(store, initial_load_path=folder, initial_load_model_only=True)
    model, opts, scheds, loader = _parts(0, world, rank)
    state = TrainState()
    mgr = _manager(cfg, model, opts, scheds, loader, state)
    res["loaded"] = mgr.load(step=-1)
    res["same_as_seed"] = all(torch.equal(seed[n], p.full_tensor()) for n, p in model.named_parameters())
    state.step = LAST - INTERVAL
    _train(rank, out, res, model, opts, scheds, loader, state, mgr)
    mgr.close()
    # A restart: the job has a snapshot now, so the folder is not read.
    model, opts, scheds, loader = _parts(0, world, rank)
    state = TrainState()
    mgr = _manager(cfg, model, opts, scheds, loader, state)
    res["reloaded"] = mgr.load(step=-1)
    res["restart_step"] = state.step
    res["restart_same_as_seed"] = all(torch.equal(seed[n], p.full_tensor()) for n, p in model.named_parameters())
    mgr.close()


def scenarios(scenario: str, out: str, argv: list) -> list | None:
    import tensorstore_ck as tsck
    infos = []
    if scenario == "base":
        for name in ("straight", "initial"):
            tsck.open_store(os.path.join(out, name)).close()
        infos.append(dw.launch("straight", 2, run_phase, out, {"store": "straight", "mode": "disabled"},
                               limit=120.0))
        shutil.copytree(os.path.join(out, "straight"), os.path.join(out, "pick"))
        infos.append(dw.launch("pick", 2, run_pick, out, {"store": "pick"}, limit=120.0))
        infos.append(dw.launch("initial", 2, run_initial, out, {"store": "initial"}, limit=120.0))
        return infos
    if scenario not in ("disabled", "async"):
        return None
    for kill, victim in (("step", 1), ("finish", 0)):
        store = f"store_{kill}"
        infos.append(dw.launch(f"k{kill}", 2, run_phase, out, {"store": store, "mode": scenario, "kill": kill},
                               kill_rank=victim, kill_job=True, limit=120.0))
        for f in ("trap_rank0", "trap_rank1"):
            if os.path.exists(os.path.join(out, f)):
                os.remove(os.path.join(out, f))
        infos.append(dw.launch(f"r{kill}", 2, run_phase, out, {"store": store, "mode": scenario}, limit=120.0))
    return infos


if __name__ == "__main__":
    launcher_main(scenarios)
