"""Pipeline-stage scenarios for tests/read/test_pipeline_view.py (gloo on CPU, forked ranks).

    python pipeline_worker.py SCENARIO OUTDIR

SCENARIO is one of:
  pipeline  "save" then "resume2" in one store (OUTDIR/store);
  save      3 ranks put one snapshot: `stage0` sharded over ranks 0-1 (tsck.Sharded
            rows), `stage1` over ranks 1-2 (a DTensor on the mesh [1, 2]: a pipeline
            stage rank 0 has no piece of), rank-local values on every rank and a
            `stage1_meta` dict only ranks 1-2 hold;
  resume2   2 ranks resume that snapshot into live targets laid out for 2 ranks (both
            stages row-split over ranks 0-1): rank 0 needs `stage1`, which the saved
            rank 0 never held;
  conflict  3 ranks put `x` as a rank-local int on rank 0 and as a tensor sharded over
            ranks 1-2 (what one process cannot show as one value), beside `ok`;
  stages    2 ranks, each a pipeline stage that names its own modules (nn.Sequential:
            stage 0's `0.*`, stage 1's `0.*`, `1.*`, `2.*`, of other shapes), put
            {"model": its state_dict, "rng": a per-rank tensor of one shape, "step"}
            (TrainState's layout), then each checks it out collectively.
Ranks are launched by dist_worker.launch (the c10d store lives in the launcher). Each
rank writes OUTDIR/<phase>_rank<r>.json (and .pt with what it read); the test judges
against data computed on its own (global_tensor).
"""

from __future__ import annotations

import os
import zlib

import torch

from dist_worker import launch, launcher_main

BLOCK = 4096
INLINE = 256
REF = "pp/main"
CONFLICT_REF = "pp/conflict"
STAGES_REF = "pp/stages"

# name -> (global shape, dtype, the ranks of the 3-rank job that hold its rows)
STAGES = {
    "stage0": ((40, 24), torch.float32, (0, 1)),
    "stage1": ((30, 300), torch.bfloat16, (1, 2)),
}


def global_tensor(name: str) -> torch.Tensor:
    shape, dtype, _ = STAGES[name]
    g = torch.Generator()
    g.manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g).to(dtype)


def rows(n: int, parts: int, i: int) -> tuple[int, int]:
    """Rows [a, b) of part i of n rows cut in `parts` (torch.chunk's ceil sizes)."""
    step = -(-n // parts)
    return min(n, i * step), min(n, (i + 1) * step)


def rank_state(rank: int) -> dict:
    """What rank `rank` of the 3-rank job puts (stage1 as a Sharded piece; save() makes it
    a DTensor)."""
    import tensorstore_ck as tsck
    st: dict = {}
    for name, (shape, _dt, holders) in STAGES.items():
        if rank in holders:
            a, b = rows(shape[0], len(holders), holders.index(rank))
            st[name] = tsck.Sharded(global_tensor(name)[a:b].clone(), shape, (a, 0))
    if rank in STAGES["stage1"][2]:
        st["stage1_meta"] = {"lr": 0.25, "micro_batches": 4}
    st["step"] = 7
    st["who"] = f"rank{rank}"
    return st


def _open(out, **kw):
    import tensorstore_ck as tsck
    return tsck.open_store(os.path.join(out, "store"), block_size=BLOCK, inline_threshold=INLINE, **kw)


def save(rank, world, out, res, _arg):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    holders = STAGES["stage1"][2]
    mesh = DeviceMesh("cpu", torch.tensor(holders))  # every rank makes it (new_group is collective)
    st = rank_state(rank)
    if rank in holders:
        st["stage1"] = DTensor.from_local(st["stage1"].local, mesh, [Shard(0)], run_check=False)
    with _open(out) as store:
        res["root"] = store.put_snapshot(st, REF, step=7, timeout=60).root


def resume2(rank, world, out, res, _arg):
    """Both stages row-split over the 2 ranks, filled in place by a collective checkout."""
    import tensorstore_ck as tsck
    into: dict = {}
    for name, (shape, dtype, _h) in STAGES.items():
        a, b = rows(shape[0], world, rank)
        # a marker value, so that a region left unfilled shows
        into[name] = tsck.Sharded(torch.full((b - a,) + shape[1:], 3, dtype=dtype), shape, (a, 0))
    into["step"] = None
    with _open(out) as store:
        try:
            got = store.checkout(REF, into=into, timeout=60)
        except tsck.TsckError as e:
            res["error_type"] = type(e).__name__
            res["error_text"] = str(e)
            return
    res["step"] = got["step"]
    res["offsets"] = {n: list(into[n].offsets) for n in STAGES}
    torch.save({n: into[n].local for n in STAGES}, os.path.join(out, f"resume2_rank{rank}.pt"))


def conflict(rank, world, out, res, _arg):
    import tensorstore_ck as tsck
    shape = (12, 64)
    full = torch.arange(12 * 64, dtype=torch.float32).reshape(shape)
    st: dict = {"ok": rank * 10}
    if rank == 0:
        st["x"] = 5
    else:
        a, b = rows(shape[0], 2, rank - 1)
        st["x"] = tsck.Sharded(full[a:b].clone(), shape, (a, 0))
    with _open(out) as store:
        res["root"] = store.put_snapshot(st, CONFLICT_REF, step=1, timeout=60).root


def stage_module(rank: int) -> torch.nn.Module:
    """Pipeline stage `rank` of a 2-stage model, each built as its own nn.Sequential (its
    names start at 0 again), with seeded weights the test rebuilds."""
    with torch.random.fork_rng():  # the caller's RNG stays as it was
        torch.manual_seed(100 + rank)
        if rank == 0:
            return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), torch.nn.Linear(16, 4))


def stage_state(rank: int) -> dict:
    g = torch.Generator()
    g.manual_seed(7 + rank)
    return {"model": stage_module(rank).state_dict(), "rng": torch.randint(0, 255, (64,), generator=g,
                                                                            dtype=torch.uint8), "step": 5}


def stages(rank, world, out, res, _arg):
    """Each stage puts its own state; a collective checkout gives each its own back."""
    with _open(out) as store:
        res["root"] = store.put_snapshot(stage_state(rank), STAGES_REF, step=5, timeout=60).root
        got = store.checkout(STAGES_REF, timeout=60)
    torch.save(got, os.path.join(out, f"stages_rank{rank}.pt"))


def scenarios(scenario: str, out: str, argv: list) -> list | None:
    """SCENARIO -> the launch infos of its runs (tests/_util.launcher_main runs this)."""
    if scenario == "pipeline":  # the put, then the resume on 2 ranks, in one store
        return [launch("save", 3, save, out), launch("resume2", 2, resume2, out)]
    if scenario == "conflict":
        return [launch("conflict", 3, conflict, out)]
    if scenario == "stages":
        return [launch("stages", 2, stages, out)]
    return None


if __name__ == "__main__":
    launcher_main(scenarios)
