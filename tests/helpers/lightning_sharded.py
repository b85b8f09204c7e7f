"""A real Lightning ModelParallelStrategy run (FSDP2 via fully_shard, one CPU process over
gloo) with TsckCheckpointIO, for tests/train/test_lightning.py.

    python lightning_sharded.py MODE OUTDIR

MODE "gathered": save_distributed_checkpoint=False (Lightning gathers the state and saves
through the CheckpointIO on rank 0, but loads the file itself); "distributed": the default
(torch.distributed.checkpoint folders, written by Lightning itself; the plugin is reached
only when ModelCheckpoint removes an older checkpoint). A process of its own: the strategy
initialises torch.distributed and sets MASTER_ADDR/PORT in the environment.
Prints one JSON line: the error fit raised (type, message), the store's refs, the files
in the checkpoint directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lightning_resume", REPO / "examples" / "lightning_resume.py")
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402
from tensorstore_ck.lightning import TsckCheckpointIO  # noqa: E402


class Net(ex.Net):
    def configure_model(self):  # ModelParallelStrategy requires the parallelisation here
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])


def main():
    mode, out = sys.argv[1], Path(sys.argv[2])
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    store = tsck.open_store(out / "store")
    strategy = ModelParallelStrategy(save_distributed_checkpoint=(mode == "distributed"))
    trainer = L.Trainer(max_steps=10, accelerator="cpu", devices=1, strategy=strategy,
                        plugins=[TsckCheckpointIO(store, job="mp")], logger=False, enable_progress_bar=False,
                        enable_model_summary=False,
                        callbacks=[ModelCheckpoint(dirpath=str(out / "ck"), every_n_train_steps=5)])
    err = None
    try:
        trainer.fit(Net())
    except Exception as e:  # noqa: BLE001 - reported to the test
        err = [type(e).__name__, str(e)]
    ck = out / "ck"
    print(json.dumps({"error": err, "refs": sorted(store.refs()),
                      "files": sorted(os.listdir(ck)) if ck.exists() else []}))


if __name__ == "__main__":
    main()
