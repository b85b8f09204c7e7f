"""Hugging Face Trainer under DDP on real gloo ranks, for tests/train/test_hf_dist.py.

    python hf_ddp.py SCENARIO OUTDIR

SCENARIO is one of:
  keep     2 ranks train 10 steps (saves at 5 and 10) with hf.TsckCallback(keep_local=True),
           each rank drawing dropout from a stream of its own; then every rank calls
           hf.resume_checkpoint of the newest snapshot (collective: one folder, every rank
           returns its path), of a snapshot that is not a Trainer's, and of a missing ref
  fsdp     the same Trainer with fsdp="full_shard" (accelerate trains DDP on CPU): the
           callback takes its collective snapshots as for DDP
The ranks are forked by dist_worker.launch_env (env://, as torchrun starts them). Each
rank writes OUTDIR/<scenario>_rank<r>.json: what it observed (paths returned, files there
on return, errors). The Trainer's folders are in OUTDIR/output, the store in OUTDIR/store.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402,F401 - imported once here, not in every forked rank

import dist_worker as dw  # noqa: E402
from _util import Tokens  # noqa: E402  (tests/ is on sys.path: dist_worker puts it there)

JOB = "j"


def _tokenizer(out):
    """A tiny byte-level BPE tokenizer (no downloads): the Trainer saves its files into every
    checkpoint folder, and the collective snapshot must keep them."""
    import json

    from transformers import GPT2Tokenizer
    where = os.path.join(out, f"tok{os.getpid()}")
    os.makedirs(where, exist_ok=True)
    vocab = {chr(c): i for i, c in enumerate(range(33, 127))}
    vocab.update({"ab": len(vocab), "<|endoftext|>": len(vocab) + 1})
    with open(os.path.join(where, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(where, "merges.txt"), "w") as f:
        f.write("#version: 0.2\na b\n")
    tok = GPT2Tokenizer(os.path.join(where, "vocab.json"), os.path.join(where, "merges.txt"))
    tok.pad_token = tok.eos_token
    return tok


def _trainer(out, rank, callbacks, **kw):
    import random

    import numpy as np
    from transformers import (GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainingArguments,
                              default_data_collator, set_seed)
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=64,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(os.path.join(out, "output"), max_steps=10, save_steps=5, logging_steps=1,
                             per_device_train_batch_size=4, learning_rate=1e-3, seed=0, use_cpu=True,
                             ddp_backend="gloo", report_to=[], dataloader_num_workers=0, disable_tqdm=True, **kw)
    t = Trainer(model=model, args=args, train_dataset=Tokens(48), callbacks=callbacks, processing_class=_tokenizer(out),
                data_collator=default_data_collator)
    t.remove_callback(PrinterCallback)
    random.seed(1000 + rank)  # dropout: a stream of each rank's own (the Trainer seeded every rank alike)
    np.random.seed(1000 + rank)
    torch.manual_seed(1000 + rank)
    return t


def _error(f):
    try:
        f()
    except Exception as e:  # noqa: BLE001 - recorded for the test
        return [type(e).__name__, str(e)]
    return None


def body_keep(rank, world, out, res, arg, cb=None):
    import tensorstore_ck as tsck
    from tensorstore_ck import hf
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # what torchrun sets besides env://
    store = tsck.open_store(os.path.join(out, "store"))
    # "keep" is the blocking collective save ("async" the default, asynchronous one)
    t = _trainer(out, rank, [hf.TsckCallback(store, job=JOB, **{"async_": False, **(cb or {})})], **(arg or {}))
    t.train()
    res["folders"] = sorted(os.listdir(os.path.join(out, "output")))
    path = hf.resume_checkpoint(store, f"{JOB}/main", os.path.join(out, "again"))
    res["again"] = path
    res["again_files"] = sorted(os.listdir(path))  # whole on every rank when the call returns
    store.put_snapshot({"w": torch.ones(3)}, "plain/main", step=1)  # collective, every rank
    res["not_trainer"] = _error(lambda: hf.resume_checkpoint(store, "plain/main", os.path.join(out, "bad")))
    res["missing"] = _error(lambda: hf.resume_checkpoint(store, "nope/main", os.path.join(out, "bad")))
    res["bad_exists"] = os.path.exists(os.path.join(out, "bad"))
    store.close()


def body_fsdp(rank, world, out, res, arg):
    body_keep(rank, world, out, res, {"fsdp": "full_shard"})


def body_async(rank, world, out, res, arg):
    body_keep(rank, world, out, res, None, {"async_": True})


SCENARIOS = {"keep": body_keep, "fsdp": body_fsdp, "async": body_async}


def main():
    scenario, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    info = dw.launch_env(scenario, 2, SCENARIOS[scenario], out, limit=240.0)
    sys.exit(0 if not info["timed_out"] else 1)


if __name__ == "__main__":
    main()
