"""A collective DCP load through local tiers that differ per rank, for
tests/tier/test_tier_answers.py.

    python tier_answers_worker.py load OUTDIR CONFIG.json

CONFIG: {"url": remote store URL, "opts": storage_options, "refs": the remote ref table,
"tiers": the folder of the nodes' tiers, "tier": [rank 0's tier name, rank 1's]}. Rank 1
first puts a local-only step 3 of another layout into its tier (its remote writes
refused, so it stays there). Each rank records the root it alone would name (resolve),
the root TsckReader read and the step a collective checkout returned
(OUTDIR/load_rank<r>.json), and what dcp.load filled in (OUTDIR/load_rank<r>.pt).
"""

from __future__ import annotations

import errno
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dist_worker as dw  # noqa: E402  (the launcher)
from dist_worker import launcher_main  # noqa: E402
import torch  # noqa: E402

REF = "j/main"
BS = 16 * 1024


def state(step: int) -> dict:
    """The state of step `step` (a "model" sub-tree, as export_weights finds it)."""
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(64, 128, generator=g), "b": torch.randn(64, generator=g)},
            "step": torch.tensor(step)}


def zeros() -> dict:
    """A state_dict of state()'s layout, zeroed: what dcp.load fills."""
    return {"model": {"w": torch.zeros(64, 128), "b": torch.zeros(64)}, "step": torch.tensor(0)}


def _refusing():
    from tensorstore_ck.storage.wrappers import WrappedStore

    class Refuse(WrappedStore):
        """No object reaches the remote store: this tier's new snapshot stays local-only."""

        def put_addressed(self, key, bufs):
            raise OSError(errno.EIO, "remote writes refused by the test")
    return Refuse


def load_body(rank, world, out, res, cfg):
    import torch.distributed.checkpoint as dcp

    import tensorstore_ck as tsck
    from tensorstore_ck.dcp import TsckReader
    kw = {"wrap_storage": _refusing()} if rank == 1 else {}
    store = tsck.open_store(cfg["url"], refs=cfg["refs"], storage_options=cfg["opts"], block_size=BS,
                            inline_threshold=256, local=os.path.join(cfg["tiers"], cfg["tier"][rank]), **kw)
    try:
        if rank == 1:  # ahead of the remote, in another layout
            ahead = state(3)
            ahead["model"]["extra"] = torch.ones(8)
            store.put_snapshot(ahead, REF, step=3, group=False)
        res["own"] = store.resolve(REF)
        sd = zeros()
        reader = TsckReader(store, REF)
        dcp.load(sd, storage_reader=reader)
        res["dcp_root"] = reader.root
        torch.save(sd, os.path.join(out, f"load_rank{rank}.pt"))
        res["checkout_step"] = int(store.checkout(REF)["step"])
    finally:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # rank 1's local-only step stays queued: said, and expected
            try:
                store.close(timeout=5)
            except tsck.StorageError as e:  # rank 1: its uploader stopped on the refused writes
                if rank != 1:
                    raise
                res["close"] = str(e)


def scenarios(scenario: str, out: str, argv: list) -> list | None:
    with open(argv[3]) as f:
        cfg = json.load(f)
    if scenario == "load":
        return [dw.launch("load", 2, load_body, out, cfg, limit=300)]
    return None


if __name__ == "__main__":
    launcher_main(scenarios)
