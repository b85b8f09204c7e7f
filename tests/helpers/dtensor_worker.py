"""DTensor and FSDP2 scenarios for tests/read/test_dtensor.py (gloo on CPU, forked ranks).

    python dtensor_worker.py SCENARIO OUTDIR [ARG]

SCENARIO is one of: reshard (DTensors saved at world 4 on a 1-D and a 2x2 mesh,
checked out at world 2 with Shard(0), Shard(1), Replicate, at world 4 on a 2x2
mesh, and from the 2x2 snapshot at world 2; Partial refused on put and checkout),
fsdp [1] (an FSDP2 model + Adam saved at world 2, resumed into a fresh one at world 3;
1: the bare model and optimizer as targets, else torchtitan-style wrappers).
Ranks are launched by dist_worker.launch (the c10d store lives in the launcher).
Every rank writes OUTDIR/<phase>_rank<r>.json and .pt with what it observed
(local shards, their offsets, full_tensor() gathered over gloo, block keys read,
errors); the test judges against data computed on its own.
"""

from __future__ import annotations

import os
import zlib

import torch

from dist_worker import counting_store_class, launch, launcher_main

BLOCK = 4096
INLINE = 256
REF, REF2D = "j/dt", "j/dt2d"

# name -> (shape, dtype, placement when saved on the 1-D mesh). Shapes are uneven on
# purpose: 203 rows over 4 ranks is 51, 51, 51, 50; 37 rows over 2 ranks 19, 18;
# "tiny" (10 rows of int64) leaves 4 ranks 3, 3, 3, 1 and is stored inline per piece.
TENSORS = {
    "w": ((203, 48), torch.float32, "S0"),
    "c": ((37, 130), torch.bfloat16, "S1"),
    "r": ((100, 64), torch.float32, "R"),
    "tiny": ((10, 3), torch.int64, "S0"),
}


def global_tensor(name: str) -> torch.Tensor:
    shape, dtype, _ = TENSORS[name]
    g = torch.Generator()
    g.manual_seed(zlib.crc32(name.encode()))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2 ** 40), 2 ** 40, shape, generator=g, dtype=dtype)


def _placement(code: str):
    from torch.distributed.tensor import Replicate, Shard
    return Replicate() if code == "R" else Shard(int(code[1:]))


def _open(out, **kw):
    import tensorstore_ck as tsck
    return tsck.open_store(os.path.join(out, "store"), block_size=BLOCK, inline_threshold=INLINE, **kw)


def _dump(out, phase, rank, obj):
    torch.save(obj, os.path.join(out, f"{phase}_rank{rank}.pt"))


# -- reshard --------------------------------------------------------------------------

def save_1d(rank, world, out, res, _arg):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    state = {n: distribute_tensor(global_tensor(n), mesh, [_placement(p)]) for n, (_s, _d, p) in TENSORS.items()}
    state["step"] = 7
    with _open(out) as store:
        res["root"] = store.put_snapshot(state, REF, step=7, timeout=60).root


def save_2d(rank, world, out, res, _arg):
    """2x2 mesh: w on (Shard(0), Shard(1)) (a grid), c on (Replicate, Shard(0)) (hybrid:
    two identical replicas of each row half), tiny on (Shard(0), Shard(0)) (rows split twice)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (2, 2))
    pl = {"w": [Shard(0), Shard(1)], "c": [Replicate(), Shard(0)], "tiny": [Shard(0), Shard(0)]}
    state = {n: distribute_tensor(global_tensor(n), mesh, p) for n, p in pl.items()}
    with _open(out) as store:
        res["root"] = store.put_snapshot(state, REF2D, step=8, timeout=60).root


def _load(rank, world, out, res, mesh_shape, placements, ref, names, phase):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor
    mesh = init_device_mesh("cpu", mesh_shape)
    holder = {}
    Counting = counting_store_class()
    into = {}
    for n in names:
        shape, dtype, _ = TENSORS[n]
        # Filled with a marker, so that a region left unfilled shows.
        into[n] = distribute_tensor(torch.full(shape, 3, dtype=dtype), mesh, placements)
    with _open(out, wrap_storage=lambda s: holder.setdefault("w", Counting(s))) as store:
        holder["w"].reset()
        got = store.checkout(ref, into=into, timeout=60)
        res["reads"] = list(holder["w"].reads)
    res["same_object"] = got is into
    res["types"] = {n: type(got[n]).__name__ for n in names}
    from tensorstore_ck.write.shard import from_dtensor
    res["offsets"] = {n: list(from_dtensor(into[n]).offsets) for n in names}
    # full_tensor(): an all-gather over gloo, independent of the store.
    _dump(out, phase, rank, {"local": {n: into[n].to_local().clone() for n in names},
                             "full": {n: into[n].full_tensor() for n in names}})


def load_world2(rank, world, out, res, code):
    _load(rank, world, out, res, (world,), [_placement(code)], REF, list(TENSORS), f"load2_{code}")


def load_only_w(rank, world, out, res, _arg):
    """Shard(0) at world 2, only "w" asked for: the blocks read are counted by the test."""
    _load(rank, world, out, res, (world,), [_placement("S0")], REF, ["w"], "loadw")


def load_2x2(rank, world, out, res, _arg):
    from torch.distributed.tensor import Shard
    _load(rank, world, out, res, (2, 2), [Shard(1), Shard(0)], REF, list(TENSORS), "load2x2")


def load_from_2d(rank, world, out, res, _arg):
    _load(rank, world, out, res, (world,), [_placement("S0")], REF2D, ["w", "c", "tiny"], "from2d")


def partial_case(rank, world, out, res, _arg):
    """A Partial DTensor: refused by put (its local values are addends, not values) and as a
    checkout target, on every rank, with the store and the target untouched."""
    import tensorstore_ck as tsck
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    mesh = init_device_mesh("cpu", (world,))
    part = DTensor.from_local(torch.full((4, 4), float(rank + 1)), mesh, [Partial()])
    with _open(out) as store:
        try:
            store.put_snapshot({"p": part}, "j/partial", step=9, timeout=30)
            res["put"] = "no error"
        except tsck.TsckError as e:
            res["put"] = [type(e).__name__, str(e)]
        res["published"] = "j/partial" in store.refs()
        try:
            store.checkout(REF, into={"r": part}, timeout=30)
            res["checkout"] = "no error"
        except tsck.TsckError as e:
            res["checkout"] = [type(e).__name__, str(e)]
        res["target_kept"] = bool((part.to_local() == rank + 1).all())


# -- fsdp ---------------------------------------------------------------------------------

def _fsdp_model(world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    # Uneven on purpose: 7 and 5 rows over 3 ranks.
    model = torch.nn.Sequential(torch.nn.Linear(10, 7), torch.nn.ReLU(), torch.nn.Linear(7, 5))
    for m in (model[0], model[2]):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


class _ModelState:
    """What torchtitan's ModelWrapper is: a Stateful of the model's sharded state dict."""

    def __init__(self, model):
        self.model = model

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(self.model)

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_model_state_dict
        set_model_state_dict(self.model, sd)


class _OptimState:
    """torchtitan's OptimizersContainer: get_optimizer_state_dict creates a fresh
    optimizer's state (as DTensors shaped like the parameters) before it is filled."""

    def __init__(self, model, optim):
        self.model, self.optim = model, optim

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        return get_optimizer_state_dict(self.model, self.optim)

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
        set_optimizer_state_dict(self.model, self.optim, sd)


def _full_state(model, optim) -> dict:
    """Every parameter and optimizer tensor, gathered whole (a gloo all-gather)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    out = {f"model.{k}": v.full_tensor() for k, v in get_model_state_dict(model).items()}
    osd = get_optimizer_state_dict(model, optim)
    for k, st in osd["state"].items():
        for name, v in st.items():
            out[f"optim.{k}.{name}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    return out


def _train(model, optim, rank, steps, seed):
    g = torch.Generator()
    g.manual_seed(seed + rank)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(8, 10, generator=g)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _targets(model, optim, bare):
    """bare: the model and optimizer themselves (their own state_dict(): the optimizer's
    keyed by parameter index), as the README's one-process form; else torchtitan's wrappers."""
    if bare:
        return {"model": model, "optim": optim}
    return {"model": _ModelState(model), "optim": _OptimState(model, optim)}


def fsdp_save(rank, world, out, res, bare):
    model, optim = _fsdp_model(world, seed=1)
    res["losses"] = _train(model, optim, rank, 3, seed=10)
    res["param_types"] = sorted({type(p).__name__ for p in model.parameters()})
    with _open(out) as store:
        store.put_snapshot({**_targets(model, optim, bare), "step": 3}, f"j/fsdp{bare}", step=3, timeout=60)
    _dump(out, f"fsdp{bare}_save", rank, _full_state(model, optim))


def fsdp_resume(rank, world, out, res, bare):
    model, optim = _fsdp_model(world, seed=2)  # other initial values: the checkout must replace them all
    with _open(out) as store:
        got = store.checkout(f"j/fsdp{bare}", into={**_targets(model, optim, bare), "step": None}, timeout=60)
    res["step"] = got["step"]
    res["local_shapes"] = {n: list(p.to_local().shape) for n, p in model.named_parameters()}
    _dump(out, f"fsdp{bare}_resume", rank, _full_state(model, optim))
    res["losses"] = _train(model, optim, rank, 2, seed=20)  # training goes on from the restored state


def scenarios(scenario: str, out: str, argv: list) -> list | None:
    """SCENARIO -> the launch infos of its runs (tests/_util.launcher_main runs this)."""
    # Made here, before any rank opens it: ranks racing to create a new store can find its
    # ref table unbound and mark it for a rebuild (gc then refuses until a recover).
    with _open(out):
        pass
    if scenario == "reshard":
        infos = [launch("save", 4, save_1d, out), launch("save2d", 4, save_2d, out)]
        for code in ("S0", "S1", "R"):
            infos.append(launch(f"load2_{code}", 2, load_world2, out, code))
        infos += [launch("loadw", 2, load_only_w, out), launch("load2x2", 4, load_2x2, out),
                  launch("from2d", 2, load_from_2d, out), launch("partial", 2, partial_case, out)]
    elif scenario == "fsdp":  # ARG 1: the bare model and optimizer as targets, not wrappers
        bare = int(argv[3]) if len(argv) > 3 else 0
        infos = [launch(f"fsdp{bare}_save", 2, fsdp_save, out, bare, limit=120.0),
                 launch(f"fsdp{bare}_resume", 3, fsdp_resume, out, bare, limit=120.0)]
    else:
        return None
    return infos


if __name__ == "__main__":
    launcher_main(scenarios)
