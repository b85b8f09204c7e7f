"""A real Lightning DDP run (2 CPU ranks, gloo) over TsckCheckpointIO, for tests/train/test_lightning.py.

    python lightning_ddp.py OUTDIR

Two phases: fit 10 steps (checkpoints at steps 5 and 10), then, in new ranks, fit on to 15
with ckpt_path="last". Lightning saves and removes checkpoints on global rank 0 only and
loads them on every rank, so the plugin must never turn a save or a load into a collective.

The ranks are forked from this process once lightning is imported (one import for all),
each told by its environment that it was launched from outside (LOCAL_RANK, as torchrun
does), so Lightning runs DDP in them without launching processes itself. Each rank writes
OUTDIR/<phase>_rank<r>.json (its first and last step, a digest of its final parameters).
Exit status: 0 when every rank of both phases exited 0; 3 when one did not end in time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import multiprocessing as mp
import os
import socket
import sys
import warnings
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lightning_resume", REPO / "examples" / "lightning_resume.py")
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)  # imports lightning here, before the fork

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402
from tensorstore_ck.lightning import TsckCheckpointIO  # noqa: E402

WORLD = 2
TIMEOUT = 120


def rank_main(out: Path, phase: str, rank: int, port: int) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    steps, resume = (10, False) if phase == "fit" else (15, True)
    with tsck.open_store(out / "store") as store:
        cb = ModelCheckpoint(dirpath=str(out / "ck"), save_top_k=1, monitor="train_loss", save_last=True,
                             every_n_train_steps=5)
        trainer = L.Trainer(max_steps=steps, strategy="ddp", devices=WORLD, accelerator="cpu",
                            plugins=[TsckCheckpointIO(store, job="ddp")], callbacks=[cb], logger=False,
                            enable_progress_bar=False, enable_model_summary=False)
        model = ex.Net()
        trainer.fit(model, ckpt_path="last" if resume else None)
        h = hashlib.sha256()
        for k, v in sorted(model.state_dict().items()):
            h.update(k.encode() + v.detach().contiguous().view(torch.uint8).numpy().tobytes())
        (out / f"{phase}_rank{rank}.json").write_text(json.dumps(
            {"first": min(model.losses), "last": max(model.losses), "params": h.hexdigest(),
             "global_step": trainer.global_step}))


def main() -> int:
    out = Path(sys.argv[1])
    ctx = mp.get_context("fork")
    for phase in ("fit", "resume"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = [ctx.Process(target=rank_main, args=(out, phase, r, port)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(TIMEOUT)
        hung = [p for p in procs if p.is_alive()]
        for p in hung:
            p.kill()
            p.join()
        codes = [p.exitcode for p in procs]
        print(phase, "exit codes", codes, "(hung)" if hung else "", flush=True)
        if hung:
            return 3
        if any(codes):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
