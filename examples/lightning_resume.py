"""PyTorch Lightning with its checkpoints in tensorstore_ck: kill -9, then resume bit-identically.

    pip install 'tensorstore_ck[lightning]' && python examples/lightning_resume.py

A child process trains with TsckCheckpointIO (ModelCheckpoint: top-2 by train_loss and last,
every 5 steps) and SIGKILLs itself after step --kill-at; another resumes with
trainer.fit(ckpt_path="last"); this process trains the same run uninterrupted. The resumed
steps' losses and the final weights, optimizer and RNG must equal the reference's bit for bit
(exit 1 if not). Data order: tsck.ResumableDataLoader (exact mid-epoch); dropout's RNG: saved
in the checkpoint by on_save_checkpoint (Lightning saves no RNG state itself).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import tensorstore_ck as tsck
from tensorstore_ck.lightning import TsckCheckpointIO

warnings.filterwarnings("ignore", ".*(does not have many workers|LeafSpec|exists and is not empty).*")
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no banners


class Net(L.LightningModule):
    def __init__(self, echo=False, kill_at=None):
        super().__init__()
        self.echo, self.kill_at, self.losses = echo, kill_at, {}  # losses: step -> repr (round-trips exactly)
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(64, 1))

    def training_step(self, batch, _i):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.losses[self.global_step + 1] = repr(loss.item())
        if self.echo:
            print(f"step {self.global_step + 1} {loss.item()!r}", flush=True)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)]

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(100, 16, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True).sin())
        return tsck.ResumableDataLoader(data, batch_size=8, shuffle=True, seed=1)  # 13 batches an epoch

    def on_save_checkpoint(self, checkpoint):  # Lightning keeps no RNG state itself
        checkpoint["torch_rng"] = torch.get_rng_state()

    def on_load_checkpoint(self, checkpoint):
        torch.set_rng_state(checkpoint["torch_rng"])

    def on_train_batch_end(self, *_):
        if self.global_step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def fit(store_path, job, steps, kill_at=None, resume=False):
    """One run, checkpointing into folder <job> beside the store; -> the trained module."""
    torch.set_num_threads(1)  # the same float sums in every process
    L.seed_everything(0, verbose=False)
    with tsck.open_store(store_path) as store:
        ck = ModelCheckpoint(dirpath=os.path.join(os.path.dirname(store_path), job), save_top_k=2,
                             monitor="train_loss", save_last=True, every_n_train_steps=5)
        trainer = L.Trainer(max_steps=steps, plugins=[TsckCheckpointIO(store, job=job)], callbacks=[ck], logger=False,
                            enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
        model = Net(echo=kill_at is not None or resume, kill_at=kill_at)
        trainer.fit(model, ckpt_path="last" if resume else None)
    return model


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None, help="where the store and checkpoint folders go (default: a temp dir)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kill-at", type=int, default=17)
    ap.add_argument("--json", default=None, help="write every run's per-step losses here")
    ap.add_argument("--child", choices=["victim", "resume"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    store = os.path.join(args.dir or tempfile.mkdtemp(prefix="tsck-lightning-"), "store")
    if args.child:
        fit(store, "lt", args.steps, kill_at=args.kill_at if args.child == "victim" else None,
            resume=args.child == "resume")
        return

    def child(role):
        return subprocess.Popen([sys.executable, __file__, "--dir", os.path.dirname(store), "--steps",
                                 str(args.steps), "--kill-at", str(args.kill_at), "--child", role],
                                stdout=subprocess.PIPE, text=True)

    def losses(p):  # -> exit status, {step: loss}
        lines = [ln.split() for ln in p.communicate()[0].splitlines() if ln.startswith("step ")]
        return p.returncode, {int(s): v for _, s, v in lines}

    tsck.open_store(store, create=True).close()
    victim = child("victim")
    ref = fit(store, "ref", args.steps)  # meanwhile, the uninterrupted reference
    rc, victim = losses(victim)
    if rc != -signal.SIGKILL or max(victim, default=None) != args.kill_at:
        sys.exit(f"the victim should have been killed after step {args.kill_at}: exit {rc}, "
                 f"last step {max(victim, default=None)}")
    with tsck.open_store(store) as s:
        print(f"killed after step {args.kill_at}; its checkpoints:",
              {r: i.step for r, i in sorted(s.refs("lt/").items())})
    rc, resumed = losses(child("resume"))
    if rc != 0 or not resumed:
        sys.exit(f"the resumed run failed: exit {rc}")
    print(f"resumed at step {min(resumed) - 1}; steps redone: {min(resumed)}..{min(args.kill_at, max(resumed))}")
    same_losses = sorted(resumed) == list(range(min(resumed), args.steps + 1)) and all(
        resumed[k] == ref.losses[k] for k in resumed)
    # The two final checkpoints, compared in the store: a tensor's blocks are addressed by the
    # hash of their bytes, so equal addresses are equal bits.
    with tsck.open_store(store) as s:
        d = s.diff("lt/last", "ref/last")
    kept = ("['state_dict']", "['optimizer_states']", "['torch_rng']")
    differ = [p for p in d["added"] + d["removed"] + [c["path"] for c in d["changed"]] if p.startswith(kept)]
    same_state = not differ and d["unchanged"] > 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"victim": victim, "resumed": resumed, "reference": ref.losses}, f)
    print(f"losses of the resumed steps bit-identical: {same_losses}; final weights, optimizer and RNG: {same_state}")
    if args.dir is None:
        shutil.rmtree(os.path.dirname(store), ignore_errors=True)
    sys.exit(0 if same_losses and same_state else 1)


if __name__ == "__main__":
    main()
