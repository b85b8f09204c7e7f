"""A Lightning checkpoint taken through TsckCheckpointIO, used outside the Trainer.

The file at a checkpoint path is a pointer into the store. torch.load and
Net.load_from_checkpoint of it fail, with an error that names the way out;
tensorstore_ck.lightning.load_checkpoint / open_checkpoint read it, and
`tsck checkout STORE POINTER OUT.ckpt` writes the real .ckpt that plain torch.load,
Net.load_from_checkpoint and a Trainer without the plugin read; `tsck export-weights STORE
POINTER FILE` the model's weights, for load_state_dict. Real Trainer, real CLI.
"""

from __future__ import annotations

import importlib.util
import json
import shlex
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install -e '.[lightning]')")

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from _util import assert_same, run_cli  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402
from tensorstore_ck.cli import main as cli_main  # noqa: E402
from tensorstore_ck.lightning import (POINTER_FORMAT, TsckCheckpointIO, load_checkpoint, open_checkpoint,  # noqa: E402
                                      read_pointer)

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lightning_resume", REPO / "examples" / "lightning_resume.py")
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """A 10-step fit through the plugin: (store path, checkpoint dir, model, ModelCheckpoint)."""
    tmp = tmp_path_factory.mktemp("ptr")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        L.seed_everything(0, verbose=False)
        cb = ModelCheckpoint(dirpath=str(tmp / "ck"), save_top_k=1, monitor="train_loss", save_last=True,
                             every_n_train_steps=5)
        with tsck.open_store(tmp / "store") as store:
            trainer = L.Trainer(max_steps=10, plugins=[TsckCheckpointIO(store, job="lt")], callbacks=[cb],
                                logger=False, enable_progress_bar=False, enable_model_summary=False,
                                accelerator="cpu", devices=1)
            model = ex.Net()
            trainer.fit(model)
    finally:
        torch.set_num_threads(n)
    return tmp / "store", tmp / "ck", model, cb


def test_torch_load_of_a_pointer_names_the_way_out(fitted, tmp_path):
    store, ck, _, cb = fitted
    last = cb.last_model_path
    ptr = read_pointer(last)
    # torch's default loader (weights_only=True), Lightning's (which calls it), and the full unpickler
    # all say what the file is: the store, the snapshot, the command; never torch's advice to load
    # with weights_only=False
    msgs = []
    for load in (lambda: torch.load(last), lambda: ex.Net.load_from_checkpoint(last),
                 lambda: torch.load(last, weights_only=False)):
        with pytest.raises(Exception) as e:
            load()
        msgs.append(str(e.value))
    for msg in msgs:
        assert "tensorstore_ck pointer" in msg and "tensorstore_ck.lightning.load_checkpoint(path)" in msg
        assert f"tsck checkout {ptr['store']} {ptr['root']} OUT.ckpt --format lightning" in msg
        assert "weights_only" not in msg and "add_safe_globals" not in msg
    msg = msgs[0]
    # the command it names works as written
    cmd = shlex.split(msg.split("write a real .ckpt with: ")[1].replace("OUT.ckpt", str(tmp_path / "out.ckpt")))
    assert cmd[:2] == ["tsck", "checkout"]
    r = run_cli(*cmd[1:], timeout=300)
    assert r.returncode == 0, r.stderr
    assert torch.load(tmp_path / "out.ckpt")["global_step"] == 10
    # and a person reading the file sees it too
    text = Path(last).read_text()
    assert "tsck checkout" in text and json.loads(text.splitlines()[-1])["root"] == ptr["root"]


def test_load_checkpoint_and_load_from_checkpoint(fitted):
    store, ck, model, cb = fitted
    ck_last = load_checkpoint(cb.last_model_path)  # opens the store the pointer names
    assert ck_last["global_step"] == 10
    assert_same(ck_last["state_dict"], model.state_dict())
    net = ex.Net.load_from_checkpoint(open_checkpoint(cb.last_model_path))
    assert_same(net.state_dict(), model.state_dict())
    with tsck.open_store(store) as st:  # or a store the caller holds
        best = load_checkpoint(cb.best_model_path, store=st)
    assert best["global_step"] == int(Path(cb.best_model_path).stem.split("step=")[1])
    assert_same(ex.Net.load_from_checkpoint(open_checkpoint(cb.best_model_path)).state_dict(), best["state_dict"])


def test_tsck_checkout_writes_a_real_ckpt(fitted, tmp_path):
    store, ck, model, cb = fitted
    out = tmp_path / "best.ckpt"
    r = run_cli("checkout", store, cb.best_model_path, out, timeout=300)  # from the pointer file; format by the suffix
    assert r.returncode == 0, r.stderr
    assert "Lightning checkpoint" in r.stdout
    plain = torch.load(out)  # torch's default, weights_only=True
    assert_same(plain, load_checkpoint(cb.best_model_path))
    assert_same(ex.Net.load_from_checkpoint(out).state_dict(), plain["state_dict"])
    # by ref, --format lightning, to a name of any suffix
    assert cli_main(["checkout", str(store), "lt/last", str(tmp_path / "last.bin"), "--format", "lightning"]) == 0
    last = torch.load(tmp_path / "last.bin")
    assert last["global_step"] == 10 and set(last) >= {"state_dict", "optimizer_states", "loops", "callbacks"}
    # a Trainer without the plugin resumes from it
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = L.Trainer(max_steps=12, logger=False, enable_progress_bar=False, enable_model_summary=False,
                            enable_checkpointing=False, accelerator="cpu", devices=1)
        trainer.fit(ex.Net(), ckpt_path=str(tmp_path / "last.bin"))
        assert trainer.global_step == 12
    finally:
        torch.set_num_threads(n)


def test_export_weights_from_a_pointer(fitted, tmp_path, capsys):
    """The weights of a Lightning checkpoint (its 'state_dict'), named as the module names them."""
    from safetensors.torch import load_file
    store, ck, model, cb = fitted
    out = tmp_path / "net.safetensors"
    assert cli_main(["export-weights", str(store), cb.last_model_path, str(out)]) == 0
    assert "names without 'state_dict.'" in capsys.readouterr().out
    fresh = ex.Net()
    fresh.load_state_dict(load_file(out), strict=True)
    assert_same(fresh.state_dict(), model.state_dict())


def test_checkout_refusals(fitted, tmp_path, capsys):
    store, ck, model, cb = fitted
    with tsck.open_store(store) as st:
        st.put_snapshot({"w": torch.zeros(2)}, "plain/main")
    assert cli_main(["checkout", str(store), "plain/main", str(tmp_path / "x.ckpt")]) == 2
    assert "not a Lightning checkpoint" in capsys.readouterr().err and not (tmp_path / "x.ckpt").exists()
    assert cli_main(["checkout", str(store), "lt/last", str(tmp_path / "x.ckpt"), "--path", "state_dict"]) == 2
    assert "drop --path" in capsys.readouterr().err
    torch.save({"state_dict": {}}, tmp_path / "real.ckpt")
    assert cli_main(["checkout", str(store), str(tmp_path / "real.ckpt"), str(tmp_path / "y.ckpt")]) == 2
    assert "is not a tensorstore_ck pointer file" in capsys.readouterr().err
    other = tmp_path / "other"
    tsck.open_store(other).close()
    assert cli_main(["checkout", str(other), cb.last_model_path, str(tmp_path / "z.ckpt")]) == 2
    err = capsys.readouterr().err
    assert str(store) in err and "does not hold" in err


def test_a_pointer_file_written_before_the_preamble_still_reads(fitted, tmp_path):
    """Version 1 pointer files (the JSON line alone) load as before, by every way in."""
    store, ck, model, cb = fitted
    ptr = read_pointer(cb.last_model_path)
    old = tmp_path / "last.ckpt"
    old.write_text(json.dumps({**ptr, "format": "tensorstore_ck.lightning-pointer/1"}, sort_keys=True) + "\n")
    assert_same(load_checkpoint(old)["state_dict"], model.state_dict())
    with tsck.open_store(store) as st:
        assert TsckCheckpointIO(st, job="lt").load_checkpoint(old)["global_step"] == 10
    assert cli_main(["checkout", str(store), str(old), str(tmp_path / "out.ckpt")]) == 0
    assert torch.load(tmp_path / "out.ckpt")["global_step"] == 10
    # a version 2 or 3 format without its preamble is not a pointer
    (tmp_path / "bad.ckpt").write_text(json.dumps({**ptr}) + "\n")
    with pytest.raises(tsck.FormatError, match="no preamble"):
        read_pointer(tmp_path / "bad.ckpt")


def test_saving_over_and_removing_a_version_1_pointer(tmp_path):
    """A directory of pointers written before the preamble: a save over one forgets the
    snapshot it named and leaves a pointer of today's version; a removal forgets its snapshot."""
    with tsck.open_store(tmp_path / "store") as store:
        io = TsckCheckpointIO(store, job="lt")
        a, b = tmp_path / "ck" / "epoch=0-step=5.ckpt", tmp_path / "ck" / "last.ckpt"
        io.save_checkpoint({"global_step": 5, "state_dict": {"w": torch.zeros(2)}}, a)
        io.save_checkpoint({"global_step": 5, "state_dict": {"w": torch.ones(2)}, "last": True}, b)
        for p in (a, b):  # as the previous version wrote them
            ptr = read_pointer(p)
            p.write_text(json.dumps({**ptr, "format": "tensorstore_ck.lightning-pointer/1"}, sort_keys=True) + "\n")
        old = read_pointer(b)["root"]
        io.save_checkpoint({"global_step": 10, "state_dict": {"w": torch.ones(2)}, "last": True}, b)
        assert read_pointer(b)["format"] == POINTER_FORMAT
        assert [h.step for h in store.log("lt/last")] == [10] and old not in {h.root for h in store.log("lt/last")}
        io.remove_checkpoint(a)
        assert not a.exists() and sorted(store.refs()) == ["lt/last"] and store.du()["snapshots"] == 1
