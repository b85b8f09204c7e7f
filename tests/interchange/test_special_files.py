"""Special files outside the store: a FIFO (or a folder, or a link to /dev/zero) where the
package reads a file a user named (`tsck import`'s inputs and the files of a Hugging Face
model folder, Lightning's checkpoint paths and the files beside them, a Trainer's
scaler.pt) is refused by name, never opened for a read that waits for a writer forever.

The rule is the store's own (localfile.open_regular): open with O_NONBLOCK, then fstat the
open file and refuse anything but a regular file. Before it, `tsck import STORE REF fifo`
blocked in open(), and a FIFO in a Lightning checkpoint folder froze remove_checkpoint,
save_checkpoint over an existing pointer and load_checkpoint (ModelCheckpoint's top-k
removal makes exactly those calls). Real FIFOs (os.mkfifo); every call runs under a
deadline (a thread joined with a timeout, a subprocess timeout), so a regression fails
instead of hanging the run.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import save_file

import tensorstore_ck as tsck
from tensorstore_ck.errors import FormatError, InvalidArgument
from tensorstore_ck.interchange.importing import import_files

from _util import bounded, object_listing, refs_snapshot, run_cli


DEADLINE = 60.0  # seconds; the calls take well under one, but the machine may be loaded


def _special(p, what: str) -> None:
    if what == "fifo":
        os.mkfifo(p)
    elif what == "dir":
        os.mkdir(p)
    else:
        os.symlink("/dev/zero", p)


def _hf_folder(folder, special: str, what: str = "fifo"):
    """A sharded Hugging Face model folder with `special` (one of its files) replaced."""
    folder.mkdir()
    save_file({"a": torch.ones(4)}, str(folder / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(4)}, str(folder / "model-00002-of-00002.safetensors"))
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    (folder / "config.json").write_text("{}")
    os.unlink(folder / special)
    _special(folder / special, what)
    return folder


@pytest.mark.parametrize("what", ["fifo", "dev-zero"])
@pytest.mark.parametrize("special", ["input", "model.safetensors.index.json", "model-00002-of-00002.safetensors",
                                     "config.json"])
def test_import_refuses_a_special_file_by_name(tmp_path, special, what):
    if special == "input":
        src = tmp_path / "in.pt"
        _special(src, what)
        named = src
    else:
        src = _hf_folder(tmp_path / "hf", special, what)
        named = src / special
    with tsck.open_store(tmp_path / "s") as s:
        s.put_snapshot({"w": torch.ones(10)}, ref="a/main")
        before = (object_listing(tmp_path / "s"), refs_snapshot(s))
        kind = "a FIFO" if what == "fifo" else "a character device"
        with pytest.raises(InvalidArgument, match=f"{named} is {kind}, not a regular file"):
            bounded(lambda: import_files(s, "imp/main", [src]), timeout=DEADLINE, unblock=tmp_path)
        assert (object_listing(tmp_path / "s"), refs_snapshot(s)) == before


def test_cli_import_of_a_fifo_is_a_one_line_error(tmp_path):
    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)
    with tsck.open_store(tmp_path / "s") as s:
        s.put_snapshot({"w": torch.ones(10)}, ref="a/main")
    try:
        r = run_cli("import", tmp_path / "s", "imp/main", fifo, timeout=DEADLINE * 2)
    except subprocess.TimeoutExpired:
        pytest.fail("tsck import of a FIFO still running after its deadline: it hangs in open()")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == f"tsck: error: {fifo} is a FIFO, not a regular file (tsck import reads regular " \
                               "files only)"
    with tsck.open_store(tmp_path / "s", create=False) as s:
        assert list(s.refs()) == ["a/main"]


# ---------------------------------------------------------------- Lightning's checkpoint folder
def _io(store):
    pytest.importorskip("lightning", reason="PyTorch Lightning is not installed (pip install -e '.[lightning]')")
    from tensorstore_ck.lightning import TsckCheckpointIO
    return TsckCheckpointIO(store, job="lt")


def _ckpt(step: int) -> dict:
    return {"state_dict": {"w": torch.full((100,), float(step))}, "global_step": step}


def test_lightning_calls_with_a_fifo_in_the_checkpoint_folder(tmp_path):
    """ModelCheckpoint's top-k removal and saves read every pointer in the folder (to keep a
    snapshot another pointer names): a FIFO among them is passed over, not opened."""
    ck = tmp_path / "ck"
    ck.mkdir()
    os.mkfifo(ck / "stray.ckpt")
    with tsck.open_store(tmp_path / "s") as s:
        io = _io(s)
        io.save_checkpoint(_ckpt(1), ck / "a.ckpt")
        io.save_checkpoint(_ckpt(2), ck / "b.ckpt")
        bounded(lambda: io.save_checkpoint(_ckpt(3), ck / "a.ckpt"), timeout=DEADLINE, unblock=ck)  # over a pointer
        got = bounded(lambda: io.load_checkpoint(ck / "a.ckpt"), timeout=DEADLINE, unblock=ck)
        assert got["global_step"] == 3 and got["state_dict"]["w"].equal(torch.full((100,), 3.0))
        bounded(lambda: io.remove_checkpoint(ck / "b.ckpt"), timeout=DEADLINE, unblock=ck)
        assert sorted(os.listdir(ck)) == ["a.ckpt", "stray.ckpt"]
        assert [i.step for i in s.log("lt/a")] == [3]
        with pytest.raises(tsck.RefNotFound):
            s.log("lt/b")  # its only snapshot was forgotten, its ref dropped


def test_lightning_load_and_remove_of_a_fifo_path(tmp_path):
    """A FIFO at the checkpoint path itself: load_checkpoint says it is not a checkpoint
    (FormatError naming it), remove_checkpoint removes the name as asked."""
    ck = tmp_path / "ck"
    ck.mkdir()
    os.mkfifo(ck / "last.ckpt")
    with tsck.open_store(tmp_path / "s") as s:
        io = _io(s)
        with pytest.raises(FormatError, match="last.ckpt is not a checkpoint saved by TsckCheckpointIO: it is a FIFO, "
                                              "not a regular file"):
            bounded(lambda: io.load_checkpoint(ck / "last.ckpt"), timeout=DEADLINE, unblock=ck)
        bounded(lambda: io.remove_checkpoint(ck / "last.ckpt"), timeout=DEADLINE, unblock=ck)
        assert os.listdir(ck) == []
        os.mkfifo(ck / "last.ckpt")  # and a save over it replaces it with a pointer
        bounded(lambda: io.save_checkpoint(_ckpt(5), ck / "last.ckpt"), timeout=DEADLINE, unblock=ck)
        assert io.load_checkpoint(ck / "last.ckpt")["global_step"] == 5


def test_hf_callback_passes_over_a_fifo_scaler(tmp_path):
    """TsckCallback reads the scaler.pt the Trainer wrote; a FIFO there is no scaler state."""
    pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[hf]')")
    from tensorstore_ck.hf import _read_scaler
    os.mkfifo(tmp_path / "scaler.pt")
    assert bounded(lambda: _read_scaler(str(tmp_path / "scaler.pt")), timeout=DEADLINE, unblock=tmp_path) is None
    torch.save({"scale": torch.tensor(2.0 ** 16)}, tmp_path / "real.pt")
    assert _read_scaler(str(tmp_path / "real.pt"))["scale"].item() == 2.0 ** 16
