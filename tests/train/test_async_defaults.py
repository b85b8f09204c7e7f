"""CheckpointManager and the Hugging Face TsckCallback agree: both snapshot asynchronously
by default (the state is staged, the put runs on the store's publisher, the training step
goes on), and both have async_=False to make each snapshot blocking. Through the real
entry points: a torch loop with CheckpointManager, a real transformers Trainer.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

import tensorstore_ck as tsck


def _is_future(res) -> bool:
    return hasattr(res, "add_done_callback") and not isinstance(res, tsck.SnapshotInfo)


def test_the_defaults_agree_in_the_signatures():
    pytest.importorskip("transformers", reason="the hf extra (transformers, accelerate) is not installed")
    from tensorstore_ck import hf
    mgr = inspect.signature(tsck.CheckpointManager).parameters["async_"].default
    cb = inspect.signature(hf.TsckCallback).parameters["async_"].default
    assert mgr is cb is True


def test_checkpoint_manager_is_asynchronous_by_default(tmp_path):
    model = torch.nn.Linear(4, 4)
    with tsck.open_store(tmp_path / "store") as store:
        mgr = tsck.CheckpointManager(store, job="j", every_steps=1, state=tsck.TrainState(model=model))
        res = mgr.step(1)
        assert _is_future(res)
        with torch.no_grad():
            model.weight.fill_(3.0)  # after step() returned: the snapshot holds what it staged
        mgr.close()
        assert res.result().step == 1
        got = store.checkout("j/main")["model"]["weight"]
        assert not torch.equal(got, model.weight.detach())
        blocking = tsck.CheckpointManager(store, job="b", every_steps=1, async_=False,
                                          state=tsck.TrainState(model=model))
        assert isinstance(blocking.step(1), tsck.SnapshotInfo)


@pytest.mark.slow
def test_hf_callback_is_asynchronous_by_default(tmp_path):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    pytest.importorskip("transformers", reason="the hf extra (transformers, accelerate) is not installed")
    pytest.importorskip("accelerate", reason="the hf extra (transformers, accelerate) is not installed")
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed
    from transformers.utils import logging as hf_logging

    from tensorstore_ck import hf

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.x = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(1))

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    seen = []

    class AfterSave(TrainerCallback):  # runs after TsckCallback's on_save: what it returned
        def on_save(self, args, state, control, **kwargs):
            seen.append(cb.last)

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    set_seed(0)
    with tsck.open_store(tmp_path / "store") as store:
        cb = hf.TsckCallback(store, job="j")
        args = TrainingArguments(str(tmp_path / "out"), max_steps=4, save_steps=2, per_device_train_batch_size=4,
                                 use_cpu=True, report_to=[], disable_tqdm=True, dataloader_num_workers=0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16,
                                           bos_token_id=0, eos_token_id=0))
        Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[cb, AfterSave()]).train()
        assert len(seen) == 2 and all(_is_future(r) for r in seen)
        # on_train_end waited for them: both committed when train() returned
        assert all(r.done() and r.failure() is None for r in seen)
        assert [e.step for e in store.log("j/main")] == [4, 2]
