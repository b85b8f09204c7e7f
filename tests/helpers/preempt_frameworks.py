"""A Hugging Face Trainer or a Lightning DDP run with tsck's preemption, as torchrun runs it on
every rank, for tests/train/test_preempt_torchrun.py (its Run harness starts it).

    python -m torch.distributed.run --standalone --nproc-per-node W preempt_frameworks.py OUT CONFIG.json

CONFIG: {"phase": name of this run, "kind": "hf" (hf.TsckCallback) or "lightning"
(TsckCheckpointIO + TsckPreemption), "hold": the step at whose end every rank waits for the
test (None: none), "end": the last step, "store": the store's directory under OUT,
"resume": start from the store (hf: resume_from_checkpoint=True, the store's newest;
lightning: ckpt_path=<OUT>/ck/preempted.ckpt, the pointer TsckPreemption wrote),
"reference": then train again from scratch, uninterrupted, in the same processes (the
framework's imports, most of a run's time, paid once), into a store of its own}.

Each rank (gloo on CPU) writes, by path under OUT, the same events as preempt_torchrun.py:
  <phase>_rank<r>_start.json   {"pid"}, once the Trainer is built
  <phase>_rank<r>_ready        it reached the hold step's end and waits for OUT/go
  <phase>_rank<r>_heard        one line per SIGTERM its own handler (chained) heard
  <phase>_rank<r>_end.json     how training ended (Preempted's step, durable, code; code 0
                               when it ran to the end) and "digests": step -> a digest of
                               the model's parameters after that step, for every step run
                               ("reference": the same of the uninterrupted run)
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (_util)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

OUT = CFG = None
RANK = int(os.environ.get("RANK", "0"))
DIGESTS: dict[int, str] = {}


def path(name: str) -> str:
    return os.path.join(OUT, f"{CFG['phase']}_rank{RANK}_{name}")


def until(name: str) -> None:
    while not os.path.exists(os.path.join(OUT, name)):
        time.sleep(0.01)


def on_signal(signum, frame) -> None:
    with open(path("heard"), "a") as f:
        f.write(f"{signum}\n")


def digest(model) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.removeprefix("module.").encode() + v.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def after_step(step: int, model) -> None:
    """Every step's end, before the preemption callback's own (it runs first)."""
    DIGESTS[step] = digest(model)
    if step == CFG.get("hold"):
        open(path("ready"), "w").close()
        until("go")


def started() -> None:
    with open(path("start.json"), "w") as f:
        json.dump({"pid": os.getpid()}, f)


def ended(**how) -> None:
    with open(path("end.json"), "w") as f:
        json.dump({**how, "digests": DIGESTS}, f)


def run_hf(store, name: str, resume: bool) -> None:
    import random

    import numpy as np
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments, set_seed
    from transformers.utils import logging as hf_logging

    from _util import Tokens, tiny_model
    from tensorstore_ck import hf

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            after_step(state.global_step, model)

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    set_seed(0)
    # No interval save (save_steps past the end): the store holds the preemption's save only.
    args = TrainingArguments(os.path.join(OUT, f"{CFG['phase']}_{name}"), max_steps=CFG["end"], save_steps=1000,
                             logging_steps=1, per_device_train_batch_size=4, learning_rate=1e-3, seed=0,
                             use_cpu=True, ddp_backend="gloo", report_to=[], dataloader_num_workers=0,
                             disable_tqdm=True)
    # Steps first: the preemption's agreement (TsckCallback.on_step_end) comes after the hold.
    t = Trainer(model=tiny_model(), args=args, train_dataset=Tokens(48),
                callbacks=[Steps(), hf.TsckCallback(store, job="hf", async_=False, preempt_grace=60)])
    t.remove_callback(PrinterCallback)
    random.seed(1000 + RANK)  # dropout: a stream of each rank's own (the Trainer seeded every rank alike)
    np.random.seed(1000 + RANK)
    torch.manual_seed(1000 + RANK)
    started()
    t.train(resume_from_checkpoint=True if resume else None)


def run_lightning(store, name: str, resume: bool) -> None:
    import importlib.util
    import warnings

    import lightning as L
    from lightning.pytorch.callbacks import Callback

    from tensorstore_ck.lightning import TsckCheckpointIO, TsckPreemption

    warnings.filterwarnings("ignore")
    spec = importlib.util.spec_from_file_location("lightning_resume", os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples", "lightning_resume.py"))
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)

    class Steps(Callback):
        def on_train_batch_end(self, trainer, pl_module, *_):
            after_step(trainer.global_step, pl_module)

    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)  # every rank alike: its RNG (saved by rank 0 alone) is every rank's
    ck = os.path.join(OUT, "ck" if name == "output" else f"ck_{name}")
    # use_distributed_sampler=False: the example's ResumableDataLoader keeps its place itself.
    trainer = L.Trainer(max_steps=CFG["end"], strategy="ddp", devices=int(os.environ["WORLD_SIZE"]),
                        accelerator="cpu", plugins=[TsckCheckpointIO(store, job="lt")],
                        callbacks=[Steps(), TsckPreemption(dirpath=ck, preempt_grace=60)], logger=False,
                        enable_checkpointing=False, use_distributed_sampler=False, enable_progress_bar=False,
                        enable_model_summary=False)
    started()
    trainer.fit(ex.Net(), ckpt_path=os.path.join(ck, "preempted.ckpt") if resume else None)


def main() -> None:
    global OUT, CFG
    import tensorstore_ck as tsck
    OUT = sys.argv[1]
    with open(sys.argv[2]) as f:
        CFG = json.load(f)
    signal.signal(signal.SIGTERM, on_signal)  # the program's own handler: tsck's chains to it
    run = run_hf if CFG["kind"] == "hf" else run_lightning
    with tsck.open_store(os.path.join(OUT, "store")) as store:
        try:
            run(store, "output", bool(CFG.get("resume")))
        except tsck.Preempted as e:
            ended(step=e.step, durable=e.durable, code=e.code, why=e.why)
            raise
    reference = None
    if CFG.get("reference"):
        got = dict(DIGESTS)
        DIGESTS.clear()
        with tsck.open_store(os.path.join(OUT, f"{CFG['phase']}_reference_store")) as store:
            run(store, "reference", False)
        reference = dict(DIGESTS)
        DIGESTS.clear()
        DIGESTS.update(got)
    ended(step=None, code=0, reference=reference)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # (as preempt_torchrun.py: no gloo teardown after a run that ended well)


if __name__ == "__main__":
    main()
