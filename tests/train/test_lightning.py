"""PyTorch Lightning's CheckpointIO over a store (tensorstore_ck.lightning), with a real Trainer.

The model, data and run come from examples/lightning_resume.py (Net: an MLP with dropout,
AdamW + StepLR, tsck.ResumableDataLoader with shuffle; ModelCheckpoint top-2 by train_loss,
save_last, every 5 steps). The slow cases: the example itself (a run SIGKILLs itself after
step 17, another resumes with ckpt_path="last"; its losses and final state are compared with an
uninterrupted run's bit for bit), and a 2-rank DDP fit and resume (tests/helpers/lightning_ddp.py).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install -e '.[lightning]')")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import _zygote as zygote
from _util import assert_same  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402
from tensorstore_ck.lightning import POINTER_FORMAT, TsckCheckpointIO, read_pointer, ref_for_path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "lightning_resume.py"

_spec = importlib.util.spec_from_file_location("lightning_resume", EXAMPLE)
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()  # the example's fit() runs on one thread
    yield
    torch.set_num_threads(n)


def _fit(store, ckdir: Path, steps: int = 30, *, job: str = "lt", model=None, wrap=None, **ck):
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    opts = dict(save_top_k=2, monitor="train_loss", save_last=True, every_n_train_steps=5)
    opts.update(ck)
    cb = ModelCheckpoint(dirpath=str(ckdir), **opts)
    io = TsckCheckpointIO(store, job=job)
    trainer = L.Trainer(max_steps=steps, plugins=[wrap(io) if wrap else io], callbacks=[cb], logger=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
    model = model or ex.Net()
    trainer.fit(model)
    return model, cb


def test_path_to_ref():
    assert ref_for_path("lt", "/x/ck/epoch=0-step=10.ckpt") == "lt/epoch_0-step_10"
    assert ref_for_path("lt", "last.ckpt") == "lt/last"
    assert ref_for_path("lt", "ck/last-v1.ckpt") == "lt/last-v1"
    assert ref_for_path("lt", Path("ck/model.pt")) == "lt/model.pt"  # only .ckpt is dropped
    assert ref_for_path("lt", "s3://bucket/run/last.ckpt") == "lt/last"
    assert ref_for_path("lt", "ck/.ckpt") == "lt/.ckpt"
    assert ref_for_path("lt", "ck/..ckpt") == "lt/_."
    assert ref_for_path("lt", "ck/époque=1 loss=0.5.ckpt") == "lt/_poque_1_loss_0.5"
    a, b = ref_for_path("lt", "x" * 300 + "a.ckpt"), ref_for_path("lt", "x" * 300 + "b.ckpt")
    assert a != b and len(a.encode()) <= 255 and len(b.encode()) <= 255
    tsck.format.names.validate_new_name(a)
    with pytest.raises(tsck.InvalidName):
        TsckCheckpointIO(None, job="a/b")


def test_top_k_and_last_live_in_the_store(tmp_path):
    """ModelCheckpoint(save_top_k=2, save_last=True) over the plugin: the directory holds
    pointer files for exactly what Lightning keeps, the store exactly those snapshots (a
    removed top-k path's ref is gone, last.ckpt's older snapshots are forgotten), and each
    loads back as the checkpoint Lightning wrote."""
    ckdir = tmp_path / "ck"
    with tsck.open_store(tmp_path / "store") as store:
        model, cb = _fit(store, ckdir)
        kept = sorted(cb.best_k_models) + [cb.last_model_path]
        assert len(kept) == 3 and sorted(str(p) for p in ckdir.iterdir()) == sorted(kept)
        refs = store.refs()
        assert sorted(refs) == sorted(ref_for_path("lt", p) for p in kept)
        # 6 saves of last.ckpt and 6 top-k saves happened; only the kept ones are in the catalog
        assert store.du()["snapshots"] == 3
        for p in kept:
            ptr = read_pointer(p)
            assert ptr["format"] == POINTER_FORMAT and ptr["ref"] == ref_for_path("lt", p)
            hist = store.log(ptr["ref"])
            assert [h.root for h in hist] == [ptr["root"]]
            if p in cb.best_k_models:
                assert hist[0].metrics == {"train_loss": cb.best_k_models[p].item()}
        assert store.log("lt/last")[0].step == 30
        io = TsckCheckpointIO(store, job="lt")
        last = io.load_checkpoint(cb.last_model_path)
        assert last["global_step"] == 30 and last["pytorch-lightning_version"] == L.__version__
        assert_same(dict(model.state_dict()), dict(last["state_dict"]))
        assert type(last["state_dict"]) is type(model.state_dict())
        assert isinstance(last["optimizer_states"], list)
        assert last["lr_schedulers"][0]["last_epoch"] == 2  # stepped per epoch (13 batches)
        # the ModelCheckpoint state Lightning restores: best_k_models with its tensor scores
        (state,) = [v for k, v in last["callbacks"].items() if k.startswith("ModelCheckpoint")]
        assert_same({k: v for k, v in cb.best_k_models.items()}, state["best_k_models"])
        # removing one (what top-k does) drops its pointer, ref and snapshot, and no other
        victim = sorted(cb.best_k_models)[0]
        io.remove_checkpoint(victim)
        assert not os.path.exists(victim) and ref_for_path("lt", victim) not in store.refs()
        assert store.du()["snapshots"] == 2
        io.remove_checkpoint(victim)  # already gone: nothing to do, as for files
        with pytest.raises(tsck.RefNotFound, match="no checkpoint at"):
            io.load_checkpoint(victim)


def test_under_lightnings_async_checkpoint_io(tmp_path):
    """AsyncCheckpointIO(TsckCheckpointIO(...)): saves run on Lightning's thread. Lightning does
    not order a removal after a pending save of the same file (nor does it for plain files), so
    a removed checkpoint may come back; what is checked is that nothing is lost or dangling:
    every checkpoint ModelCheckpoint keeps is there and loads, and every pointer file left
    names a snapshot that loads."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    ckdir = tmp_path / "ck"
    with tsck.open_store(tmp_path / "store") as store:
        _model, cb = _fit(store, ckdir, wrap=AsyncCheckpointIO)
        kept = sorted(cb.best_k_models) + [cb.last_model_path]
        files = sorted(str(p) for p in ckdir.iterdir())
        assert set(kept) <= set(files)
        assert {ref_for_path("lt", p) for p in kept} <= set(store.refs())
        io = TsckCheckpointIO(store, job="lt")
        for f in files:
            assert io.load_checkpoint(f)["global_step"] > 0, f
        assert 3 <= store.du()["snapshots"] <= len(files)


def test_hparams_and_a_value_that_needs_pickle(tmp_path):
    """save_hyperparameters() (an AttributeDict) is stored as a dict; a value only pickle can
    store is refused, naming the checkpoint and where the value is, and nothing is saved; with
    allow_pickle=True it is stored, and loaded back unless weights_only=True."""

    class WithHparams(ex.Net):
        def __init__(self, width=64, tags=("a", "b"), where=None):
            super().__init__()
            self.save_hyperparameters()

    with tsck.open_store(tmp_path / "store") as store:
        _model, cb = _fit(store, tmp_path / "ck", steps=5, model=WithHparams(tags=("x",)))
        got = TsckCheckpointIO(store, job="lt").load_checkpoint(cb.last_model_path)
        assert got["hyper_parameters"] == {"width": 64, "tags": ("x",), "where": None}
        assert type(got["hyper_parameters"]) is dict

        with pytest.raises(tsck.UnsupportedType) as ei:
            _fit(store, tmp_path / "ck2", steps=5, job="p", model=WithHparams(where=Path("data")))
        msg = str(ei.value)
        assert "['hyper_parameters']['where']" in msg and "allow_pickle=True" in msg and "ck2" in msg
        assert ei.value.path == "['hyper_parameters']['where']"
        assert not [r for r in store.refs() if r.startswith("p/")] and not list((tmp_path / "ck2").glob("*"))

    with tsck.open_store(tmp_path / "store") as store:
        io = TsckCheckpointIO(store, job="p", allow_pickle=True)
        path = tmp_path / "ck3" / "hand.ckpt"
        io.save_checkpoint({"global_step": 3, "hyper_parameters": {"where": Path("data")},
                            "state_dict": {"w": torch.ones(2)}}, path)
        assert io.load_checkpoint(path)["hyper_parameters"]["where"] == Path("data")
        with pytest.raises(tsck.UnsupportedType):
            io.load_checkpoint(path, weights_only=True)
        with pytest.raises(tsck.UnsupportedType):
            TsckCheckpointIO(store, job="p").load_checkpoint(path)
        assert store.log("p/hand")[0].step == 3
        # an AttributeDict anywhere (a callback's or the module's own on_save_checkpoint) is a dict
        from lightning.fabric.utilities.data import AttributeDict
        TsckCheckpointIO(store, job="p").save_checkpoint(
            {"global_step": 4, "extra": [AttributeDict(a=1, b=AttributeDict(c=(2, 3)))]}, path)
        got = io.load_checkpoint(path)["extra"][0]
        assert got == {"a": 1, "b": {"c": (2, 3)}} and type(got) is dict and type(got["b"]) is dict


def test_files_that_are_not_pointers(tmp_path):
    with tsck.open_store(tmp_path / "store") as store:
        io = TsckCheckpointIO(store, job="lt")
        torch.save({"state_dict": {}}, tmp_path / "old.ckpt")
        with pytest.raises(tsck.FormatError, match="old.ckpt is not a checkpoint saved by TsckCheckpointIO.*torch"):
            io.load_checkpoint(tmp_path / "old.ckpt")
        (tmp_path / "x.ckpt").write_text("{}")
        with pytest.raises(tsck.FormatError, match="x.ckpt"):
            io.load_checkpoint(tmp_path / "x.ckpt")
        with pytest.raises(tsck.RefNotFound, match="no checkpoint at"):
            io.load_checkpoint(tmp_path / "none.ckpt")
        with pytest.raises(tsck.InvalidArgument, match="storage_options"):
            io.save_checkpoint({"global_step": 1}, tmp_path / "a.ckpt", storage_options={"x": 1})
        io.remove_checkpoint(tmp_path / "old.ckpt")  # Lightning asked: the file goes, the store is untouched
        assert not (tmp_path / "old.ckpt").exists() and store.refs() == {}


def test_a_snapshot_another_path_names_is_kept(tmp_path):
    """Copies and links (save_last="link" makes last.ckpt one) name a snapshot too:
    removing or overwriting one path never forgets what another still names."""
    with tsck.open_store(tmp_path / "store") as store:
        io = TsckCheckpointIO(store, job="lt")
        a = tmp_path / "ck" / "a.ckpt"
        io.save_checkpoint({"global_step": 1, "w": torch.zeros(3)}, a)
        shutil.copy(a, tmp_path / "ck" / "copy.ckpt")
        (tmp_path / "ck" / "link.ckpt").symlink_to("a.ckpt")
        io.remove_checkpoint(tmp_path / "ck" / "link.ckpt")  # the link only
        assert a.exists() and io.load_checkpoint(a)["global_step"] == 1
        io.save_checkpoint({"global_step": 2, "w": torch.ones(3)}, a)  # overwrite: the copy keeps step 1
        assert io.load_checkpoint(tmp_path / "ck" / "copy.ckpt")["global_step"] == 1
        io.remove_checkpoint(a)
        assert_same(torch.zeros(3), io.load_checkpoint(tmp_path / "ck" / "copy.ckpt")["w"])
        io.remove_checkpoint(tmp_path / "ck" / "copy.ckpt")  # the last one naming it: forgotten
        assert store.du()["snapshots"] == 0


def test_two_directories_under_one_job_keep_their_own(tmp_path):
    """Two checkpoint directories with the same file names under one job share refs; saving
    over or removing a path in one never forgets a snapshot the other's files name."""
    with tsck.open_store(tmp_path / "store") as store:
        io = TsckCheckpointIO(store, job="lt")
        a, b = tmp_path / "v0" / "last.ckpt", tmp_path / "v1" / "last.ckpt"
        io.save_checkpoint({"global_step": 5, "w": torch.zeros(2)}, a)
        io.save_checkpoint({"global_step": 7, "w": torch.ones(2)}, b)
        io.save_checkpoint({"global_step": 9, "w": torch.ones(2) * 2}, b)
        assert io.load_checkpoint(a)["global_step"] == 5 and io.load_checkpoint(b)["global_step"] == 9
        assert [h.step for h in store.log("lt/last")] == [9, 5]
        io.remove_checkpoint(b)  # the ref's tip stays: the older snapshot is v0's
        assert io.load_checkpoint(a)["global_step"] == 5
        io.remove_checkpoint(a)
        assert [h.step for h in store.log("lt/last")] == [9]


def test_what_a_killed_save_leaves_is_forgotten_by_the_next(tmp_path):
    """A save killed between its commit and its pointer leaves the ref's tip on a snapshot no
    file names (the pointer still names the one before, which loads). The next save over
    that path forgets both; the store holds just the new one."""
    with tsck.open_store(tmp_path / "store") as store:
        io = TsckCheckpointIO(store, job="lt")
        p = tmp_path / "ck" / "last.ckpt"
        io.save_checkpoint({"global_step": 5, "w": torch.zeros(2)}, p)
        # the state the kill leaves: the commit of step 10's save, no pointer to it
        store.put_snapshot({"global_step": 10, "w": torch.ones(2)}, "lt/last", job="lt", step=10,
                           meta={"lightning_path": str(p)})
        assert io.load_checkpoint(p)["global_step"] == 5 and len(store.log("lt/last")) == 2
        io.save_checkpoint({"global_step": 15, "w": torch.full((2,), 2.0)}, p)
        assert [h.step for h in store.log("lt/last")] == [15] and store.du()["snapshots"] == 1
        assert io.load_checkpoint(p)["global_step"] == 15


def test_save_last_link_and_resume_from_it(tmp_path):
    """save_last="link": last.ckpt is a symlink to the newest top-k pointer; it loads that
    snapshot, and ckpt_path="last" resolves through it."""
    ckdir = tmp_path / "ck"
    with tsck.open_store(tmp_path / "store") as store:
        model, cb = _fit(store, ckdir, save_last="link", save_top_k=-1)
        last = ckdir / "last.ckpt"
        assert last.is_symlink()
        io = TsckCheckpointIO(store, job="lt")
        assert_same(dict(model.state_dict()), dict(io.load_checkpoint(last)["state_dict"]))
        assert "lt/last" not in store.refs()
        torch.set_num_threads(1)
        trainer = L.Trainer(max_steps=35, plugins=[io], callbacks=[ModelCheckpoint(dirpath=str(ckdir))],
                            logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
        again = ex.Net()
        trainer.fit(again, ckpt_path="last")
        assert trainer.global_step == 35 and again.losses and min(again.losses) == 31


def test_checkpoint_paths_on_an_fsspec_filesystem(tmp_path):
    """Lightning's dirpath may be a URL (s3://, memory://): the pointer files go there
    through fsspec, the snapshots into the store."""
    import fsspec
    mem = fsspec.filesystem("memory")
    with tsck.open_store(tmp_path / "store") as store:
        io = TsckCheckpointIO(store, job="lt")
        a, b = "memory://tsck-lt/ck/epoch=0-step=5.ckpt", "memory://tsck-lt/ck/last.ckpt"
        try:
            io.save_checkpoint({"global_step": 5, "w": torch.zeros(2)}, a)
            io.save_checkpoint({"global_step": 5, "w": torch.zeros(2), "last": True}, b)
            io.save_checkpoint({"global_step": 10, "w": torch.ones(2), "last": True}, b)
            assert read_pointer(b)["ref"] == "lt/last" and mem.cat_file("/tsck-lt/ck/last.ckpt").startswith(b"c")
            assert io.load_checkpoint(b)["global_step"] == 10 and io.load_checkpoint(a)["global_step"] == 5
            assert sorted(store.refs()) == ["lt/epoch_0-step_5", "lt/last"] and store.du()["snapshots"] == 2
            io.remove_checkpoint(a)
            assert not mem.exists("/tsck-lt/ck/epoch=0-step=5.ckpt") and sorted(store.refs()) == ["lt/last"]
        finally:
            mem.rm("/tsck-lt", recursive=True)


def test_map_location(tmp_path):
    with tsck.open_store(tmp_path / "store") as store:
        io = TsckCheckpointIO(store, job="lt")
        p = tmp_path / "m.ckpt"
        io.save_checkpoint({"global_step": 1, "w": torch.arange(4.0)}, p)
        seen = []
        got = io.load_checkpoint(p, map_location=lambda t, loc: seen.append(loc) or t)
        assert seen == ["cpu"] and torch.equal(got["w"], torch.arange(4.0))
        assert io.load_checkpoint(p, map_location="cpu")["w"].device.type == "cpu"
        assert io.load_checkpoint(p, map_location={"cuda:0": "cpu"})["w"].device.type == "cpu"
        assert io.load_checkpoint(p)["w"].device.type == "cpu"  # the default, as TorchCheckpointIO's
        if not torch.cuda.is_available():
            with pytest.raises(tsck.errors.DeviceUnavailable, match="cuda"):
                io.load_checkpoint(p, map_location="cuda:0")


def test_the_base_package_never_imports_lightning():
    """Only `tensorstore_ck.lightning` needs the extra; without it, importing that module says
    how to install it."""
    code = ("import sys, tensorstore_ck, tensorstore_ck.cli\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')]\n"
            "sys.modules['lightning'] = None\n"
            "try:\n    import tensorstore_ck.lightning\nexcept ImportError as e:\n    print(e)\n")
    p = zygote.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120, fresh=True)
    assert p.returncode == 0, p.stderr
    assert "pip install 'tensorstore_ck[lightning]'" in p.stdout


@pytest.mark.slow
def test_ddp_saves_on_rank_zero_and_every_rank_loads(tmp_path):
    """A real DDP Trainer (2 CPU ranks, gloo; tests/helpers/lightning_ddp.py): Lightning saves
    and removes on rank 0 alone and loads on every rank, so neither may be a collective of the
    store (put_snapshot's default under torch.distributed); before the plugin said so, rank 0's
    first save waited for ranks that never came. Both ranks resume from "last" at step 10 and
    end with the same parameters."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    p = zygote.run([sys.executable, str(REPO / "tests" / "helpers" / "lightning_ddp.py"), str(tmp_path)],
                   cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    runs = {f.stem: json.loads(f.read_text()) for f in tmp_path.glob("*_rank*.json")}
    assert sorted(runs) == ["fit_rank0", "fit_rank1", "resume_rank0", "resume_rank1"]
    assert runs["fit_rank0"]["params"] == runs["fit_rank1"]["params"]
    assert runs["resume_rank0"]["params"] == runs["resume_rank1"]["params"] != runs["fit_rank0"]["params"]
    assert all(runs[f"resume_rank{r}"]["first"] == 11 and runs[f"resume_rank{r}"]["global_step"] == 15
               for r in range(2))
    with tsck.open_store(tmp_path / "store") as store:
        assert sorted(store.refs()) == ["ddp/epoch_1-step_15", "ddp/last"] and store.du()["snapshots"] == 2
        assert store.log("ddp/last")[0].step == 15


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gathered", "distributed"])
def test_a_sharded_strategy_is_refused_and_nothing_goes_into_the_store(tmp_path, mode):
    """A real ModelParallelStrategy (FSDP2 through fully_shard, one CPU process over gloo;
    Lightning's FSDPStrategy refuses a CPU accelerator). It loads checkpoints itself, never
    through the CheckpointIO: a gathered save (save_distributed_checkpoint=False) taken into
    the store resumed with a raw torch.load RuntimeError on the pointer file. So its first
    save is refused (InvalidArgument naming the strategy and what to use instead) before a
    snapshot or a pointer is written. Its torch.distributed.checkpoint saves bypass the
    plugin altogether; the first call that reaches it (ModelCheckpoint removing the older
    checkpoint at step 10) is refused the same way."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", TORCH_CPP_LOG_LEVEL="ERROR")
    p = zygote.run([sys.executable, str(REPO / "tests" / "helpers" / "lightning_sharded.py"), mode,
                        str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["error"] is not None and got["error"][0] == "InvalidArgument", got
    doing = "saving" if mode == "gathered" else "removing"
    assert f"cannot take ModelParallelStrategy's checkpoints ({doing} " in got["error"][1]
    assert "strategy='ddp'" in got["error"][1] and "TsckWriter" in got["error"][1]
    assert got["refs"] == []
    if mode == "gathered":
        assert got["files"] == []  # no pointer file either


@pytest.mark.slow
def test_example_kill_and_resume_is_bit_identical(tmp_path):
    """examples/lightning_resume.py: the killed run's and the resumed run's losses equal the
    uninterrupted run's step for step, and the final checkpoints (weights, optimizer, scheduler,
    RNG, loop counters) are equal bit for bit."""
    out = tmp_path / "losses.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1", **{zygote.SUBPROCESS: "1"})  # its runs: forks of the zygote
    p = zygote.run([sys.executable, str(EXAMPLE), "--dir", str(tmp_path), "--json", str(out)], cwd=REPO,
                   env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    runs = json.loads(out.read_text())
    victim, resumed, ref = ({int(k): v for k, v in runs[r].items()} for r in ("victim", "resumed", "reference"))
    assert sorted(victim) == list(range(1, 18)) and sorted(ref) == list(range(1, 31))
    assert sorted(resumed) == list(range(16, 31))  # the last checkpoint before the kill was at step 15
    assert {k: victim[k] for k in victim} == {k: ref[k] for k in victim}
    assert resumed == {k: ref[k] for k in resumed}
    with tsck.open_store(tmp_path / "store") as store:
        got = TsckCheckpointIO(store, job="lt").load_checkpoint(tmp_path / "lt" / "last.ckpt")
        want = TsckCheckpointIO(store, job="ref").load_checkpoint(tmp_path / "ref" / "last.ckpt")
        assert sorted(store.refs("lt/")) == ["lt/epoch_1-step_25", "lt/epoch_2-step_30", "lt/last"]
    for k in ("state_dict", "optimizer_states", "lr_schedulers", "torch_rng", "loops", "global_step", "epoch"):
        assert_same(want[k], got[k], k)


PREEMPT_CHILD = r"""
import importlib.util, json, os, sys
import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
import tensorstore_ck as tsck
from tensorstore_ck.lightning import TsckCheckpointIO, TsckPreemption

out, example = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("lightning_resume", example)
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)

class Pause(Callback):  # at step 7's end: say so, wait for the test's signal (stdin)
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == 7:
            print("step 7", flush=True)
            input()

torch.set_num_threads(1)
L.seed_everything(0, verbose=False)
store = tsck.open_store(os.path.join(out, "store"))
pre = TsckPreemption(preempt_grace=60)
trainer = L.Trainer(max_steps=30, plugins=[TsckCheckpointIO(store, job="lt")], logger=False,
                    callbacks=[Pause(), pre, ModelCheckpoint(dirpath=os.path.join(out, "ck"), every_n_train_steps=5)],
                    enable_progress_bar=False, enable_model_summary=False, accelerator="cpu", devices=1)
try:
    trainer.fit(ex.Net())
except tsck.Preempted as e:
    with open(os.path.join(out, "res.json"), "w") as f:
        json.dump({"step": e.step, "durable": e.durable, "code": e.code, "text": str(e)}, f)
    raise
"""


@pytest.mark.slow
def test_a_sigterm_mid_training_saves_that_step_and_ends_with_143(tmp_path):
    """Real Lightning, SIGTERM at step 7's end (ModelCheckpoint every 5 steps): Lightning's
    handler chains to TsckPreemption's; at that batch's end it saves ck/preempted.ckpt
    through TsckCheckpointIO (the store, step 7) and raises Preempted: exit status 143
    (Lightning's own SIGTERMException would end with 0, nothing saved)."""
    import signal
    import subprocess

    from _util import child_env
    p = zygote.Popen([sys.executable, "-c", PREEMPT_CHILD, str(tmp_path), str(EXAMPLE)], cwd=REPO, env=child_env(),
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.strip() == "step 7":
            break
    p.send_signal(signal.SIGTERM)
    p.stdin.write("go\n")
    p.stdin.flush()
    _out, err = p.communicate(timeout=300)
    assert p.returncode == 143, err[-3000:]
    res = json.loads((tmp_path / "res.json").read_text())
    assert (res["step"], res["durable"], res["code"]) == (7, True, 143), res
    assert read_pointer(tmp_path / "ck" / "preempted.ckpt")["step"] == 7
    with tsck.open_store(tmp_path / "store", create=False) as s:
        assert [i.step for i in s.log("lt/preempted")] == [7]
