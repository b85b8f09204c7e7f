"""Multi-process DCP check: save at 4 ranks, load at 2 with another sharding.

    python dcp_dist.py STORE OUTDIR [--save-world 4] [--load-world 2] [--async-world 2]

Phase 1 (save): SAVE_WORLD forked ranks (gloo on 127.0.0.1) hold an FSDP-style
state: DTensors with Shard(0) on a 1-D cpu DeviceMesh (rows split unevenly),
a replicated plain tensor, optimizer state and non-tensor values; they
`dcp.save` it through TsckWriter into STORE at ref jobA/main.

Phase 2 (load): LOAD_WORLD forked ranks build the same state with another
placement (Shard(1) for the embedding: columns; Shard(0) for the rest, split
at other rows than when saved), zero-filled, and `dcp.load` it through TsckReader; DCP does
the resharding. Each rank compares its local shards bit for bit with the
original global tensors and counts the blocks it read.

Phase 3 (async): ASYNC_WORLD ranks save the state at ref jobP/main with
dcp.async_save, first with the default thread executor, then with
AsyncCheckpointerType.PROCESS (the writer is pickled into DCP's daemon).

Every rank writes OUTDIR/<phase>-rank<r>.json; the process exits 0 only if
every rank finished. Global tensors come from make_globals() (seeded), which
the test imports to check a plain store.checkout of the snapshot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from datetime import timedelta

import torch

SHAPES = {"emb.weight": (30, 1000), "lin.weight": (64, 48), "lin.bias": (64,), "norm.scale": (48,),
          "head.weight": (3, 700)}  # 3 rows over 4 ranks: one rank's shard is empty
BLOCK_SIZE = 16384  # 4 embedding rows per block: partial chunk reads touch few blocks
REF = "jobA/main"


def make_globals() -> dict:
    g = torch.Generator().manual_seed(1234)
    out = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    out["emb.exp_avg"] = torch.randn(SHAPES["emb.weight"], generator=g)
    out["lin.exp_avg"] = torch.randn(SHAPES["lin.weight"], generator=g).to(torch.bfloat16)
    return out


def _dt(glob, mesh, placements):
    from torch.distributed.tensor import distribute_tensor
    return distribute_tensor(glob.clone(), mesh, placements)


def _state(mesh, phase: str, zero: bool):
    from torch.distributed.tensor import Replicate, Shard
    G = make_globals()
    if zero:
        G = {k: torch.zeros_like(v) for k, v in G.items()}
    # Loading: the embedding by columns, its Adam moment by rows split elsewhere.
    emb_pl = [Shard(0)] if phase == "save" else [Shard(1)]
    avg_pl = [Shard(0)]
    return {
        "model": {
            "emb.weight": _dt(G["emb.weight"], mesh, emb_pl),
            "lin.weight": _dt(G["lin.weight"], mesh, [Shard(0)]),
            "lin.bias": G["lin.bias"].clone(),                         # plain tensor, same on every rank
            "norm.scale": _dt(G["norm.scale"], mesh, [Replicate()]),   # replicated DTensor
            "head.weight": _dt(G["head.weight"], mesh, [Shard(0)]),
        },
        "optim": {
            "state": {"emb.weight": {"exp_avg": _dt(G["emb.exp_avg"], mesh, avg_pl),
                                     "step": torch.tensor(0.0 if zero else 5.0)},
                      "lin.weight": {"exp_avg": _dt(G["lin.exp_avg"], mesh, [Shard(0)])}},
            "param_groups": [{"lr": 0.0 if zero else 0.125, "betas": (0.0, 0.0) if zero else (0.9, 0.999),
                              "params": ["emb.weight", "lin.weight"]}],
        },
        "step": 0 if zero else 100,
        "note": "" if zero else "fsdp-like",
    }


def _check(sd, rank) -> list[str]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    G = make_globals()
    bad = []

    def cmp(name, t, glob):
        if isinstance(t, DTensor):
            shape, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            loc = t.to_local()
            want = glob[tuple(slice(o, o + s) for o, s in zip(off, shape))]
        else:
            loc, want = t, glob
        if loc.dtype != want.dtype or loc.shape != want.shape or \
                loc.contiguous().view(torch.uint8).numpy().tobytes() != \
                want.contiguous().view(torch.uint8).numpy().tobytes():
            bad.append(name)

    m = sd["model"]
    for k in SHAPES:
        cmp(k, m[k], G[k])
    cmp("emb.exp_avg", sd["optim"]["state"]["emb.weight"]["exp_avg"], G["emb.exp_avg"])
    cmp("lin.exp_avg", sd["optim"]["state"]["lin.weight"]["exp_avg"], G["lin.exp_avg"])
    if float(sd["optim"]["state"]["emb.weight"]["step"]) != 5.0:
        bad.append("step tensor")
    pg = sd["optim"]["param_groups"][0]
    if pg["lr"] != 0.125 or tuple(pg["betas"]) != (0.9, 0.999) or sd["step"] != 100 or sd["note"] != "fsdp-like":
        bad.append(f"non-tensor values {pg} {sd['step']} {sd['note']}")
    return bad


def run(rank: int, world: int, port: int, store_path: str, out: str, phase: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    res = {"rank": rank, "phase": phase, "ok": False}
    t0 = time.time()
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh

        import tensorstore_ck as tsck
        from tensorstore_ck.dcp import TsckReader, TsckWriter
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        mesh = init_device_mesh("cpu", (world,))
        store = tsck.open_store(store_path, block_size=BLOCK_SIZE, workers=2)
        reads = [0]
        orig = store.assets.read_block_into

        def counting(*a, **kw):
            reads[0] += 1
            return orig(*a, **kw)
        store.assets.read_block_into = counting
        res["setup_s"] = round(time.time() - t0, 3)
        t1 = time.time()
        if phase == "async":
            # dcp.async_save with the default (thread) executor, then with the
            # process executor (the writer is pickled into a checkpoint daemon).
            from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
            sd = _state(mesh, "save", zero=False)
            dcp.async_save(sd, storage_writer=TsckWriter(store, ref="jobP/main", step=1)).result(timeout=120)
            dcp.async_save(sd, storage_writer=TsckWriter(store, ref="jobP/main", step=2),
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result(timeout=120)
            dist.barrier()
            if rank == 0:
                res["log"] = [i.to_json() for i in store.log("jobP/main")]
        elif phase == "save":
            sd = _state(mesh, "save", zero=False)
            w = TsckWriter(store, ref=REF, step=100, metrics={"loss": 1.5})
            dcp.save(sd, storage_writer=w)
            if rank == 0:
                res["info"] = w.info.to_json()
        else:
            sd = _state(mesh, "load", zero=True)
            dcp.load(sd, storage_reader=TsckReader(store, REF))
            res["mismatches"] = _check(sd, rank)
        res["blocks_read"] = reads[0]
        res["op_s"] = round(time.time() - t1, 3)
        dist.barrier()
        dist.destroy_process_group()
        store.close()
        res["ok"] = True
    except BaseException:
        res["error"] = traceback.format_exc()
    with open(os.path.join(out, f"{phase}-rank{rank}.json"), "w") as f:
        json.dump(res, f)
    if not res["ok"]:
        os._exit(1)


def launch(world: int, phase: str, store: str, out: str) -> None:
    import torch.multiprocessing as mp
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _pgserver
    from _pgserver import free_port
    port = free_port()
    mp.start_processes(run, args=(world, port, store, out, phase), nprocs=world, join=True, start_method="fork")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("out")
    ap.add_argument("--save-world", type=int, default=4)
    ap.add_argument("--load-world", type=int, default=2)
    ap.add_argument("--async-world", type=int, default=2, help="0: skip the async_save phase")
    a = ap.parse_args()
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    t = time.time()
    launch(a.save_world, "save", a.store, a.out)
    t_save = time.time() - t
    t = time.time()
    launch(a.load_world, "load", a.store, a.out)
    t_load = time.time() - t
    t = time.time()
    if a.async_world:
        launch(a.async_world, "async", a.store, a.out)
    print(json.dumps({"save_wall_s": round(t_save, 2), "load_wall_s": round(t_load, 2),
                      "async_wall_s": round(time.time() - t, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
