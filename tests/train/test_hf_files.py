"""Hugging Face: what the Trainer writes beside the model goes through the store too, and
save_total_limit bounds the store as it bounds the folders.

A real Trainer on a tiny GPT-2 (built from a config) with a real tokenizer (a byte-level BPE
built from a local vocabulary and merges: no downloads) as its processing_class: the
tokenizer's files are snapshotted and written back by resume_checkpoint, byte for byte, so
keep_local=False loses nothing; with load_best_model_at_end the job's retention keeps the
best snapshot as the Trainer keeps the best folder.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers, accelerate) is not installed")
pytest.importorskip("accelerate", reason="the hf extra (transformers, accelerate) is not installed")

import torch  # noqa: E402
from transformers import AutoTokenizer, GPT2Tokenizer, default_data_collator  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402
from tensorstore_ck import hf  # noqa: E402
from tensorstore_ck.errors import InvalidArgument  # noqa: E402


from _util import hf_trainer, run_cli


def trainer(out, callbacks, steps=20, processing_class=None, **kw):
    """The suite's run (hf_trainer), with a processing_class."""
    return hf_trainer(out, callbacks, steps, trainer_kw={"processing_class": processing_class,
                                                         "data_collator": default_data_collator}, **kw)


def tiny_tokenizer(where: Path):
    """A GPT-2 tokenizer over 128 ids (the tiny model's vocabulary), with a chat template:
    save_pretrained writes tokenizer.json, tokenizer_config.json and chat_template.jinja."""
    where.mkdir(parents=True, exist_ok=True)
    vocab = {chr(c): i for i, c in enumerate(range(33, 127))}
    for w in ("ab", "abc", "th", "the", "in", "ing"):
        vocab[w] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (where / "vocab.json").write_text(json.dumps(vocab))
    (where / "merges.txt").write_text("#version: 0.2\na b\nab c\nt h\nth e\ni n\nin g\n")
    tok = GPT2Tokenizer(str(where / "vocab.json"), str(where / "merges.txt"))
    tok.pad_token = tok.eos_token
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert len(tok) <= 128
    return tok


def _files(folder) -> dict:
    return {n: (Path(folder) / n).read_bytes() for n in os.listdir(folder)}


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """Two runs with the tokenizer as processing_class: one keeping its folders (the
    reference), one keep_local=False (the store holds the only copy)."""
    base = tmp_path_factory.mktemp("hftok")
    tok = tiny_tokenizer(base / "src")
    store = tsck.open_store(base / "store")
    t = trainer(base / "kept", [hf.TsckCallback(store, job="kept")], steps=10, processing_class=tok)
    t.train()
    t = trainer(base / "gone", [hf.TsckCallback(store, job="gone", keep_local=False)], steps=10,
                processing_class=tok)
    t.train()
    yield {"base": base, "store": store, "tok": tok}
    store.close()


def test_the_tokenizer_goes_through_the_store(with_tokenizer, tmp_path):
    base, store, tok = with_tokenizer["base"], with_tokenizer["store"], with_tokenizer["tok"]
    assert not [n for n in os.listdir(base / "gone") if n.startswith("checkpoint-")]
    kept = _files(base / "kept" / "checkpoint-10")
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(kept)
    path = hf.resume_checkpoint(store, "gone/main", tmp_path / "out")
    back = _files(path)
    # every file of the Trainer's own folder, but training_args.bin (the Trainer writes its own)
    assert set(back) == set(kept) - {"training_args.bin"}
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert back[name] == kept[name], name
    again = AutoTokenizer.from_pretrained(path)
    text = "the thing abc"
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.chat_template == tok.chat_template
    # the snapshot holds them as files, each the bytes of the file
    assert sorted(store.checkout("gone/main", paths=["files"])["files"]) == sorted(
        n for n in kept if n.startswith(("tokenizer", "chat_template")))


def test_resume_from_checkpoint_true_restores_the_tokenizer(with_tokenizer):
    """keep_local=False, a fresh output_dir: train(resume_from_checkpoint=True) goes on
    from the store's newest snapshot, whose folder (written at the Trainer's init) carries
    the tokenizer the Trainer saved."""
    base, store, tok = with_tokenizer["base"], with_tokenizer["store"], with_tokenizer["tok"]
    seen = {}

    class Look(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen["files"] = sorted(os.listdir(os.path.join(args.output_dir, "checkpoint-10")))

    t = trainer(base / "fresh", [hf.TsckCallback(store, job="gone", keep_local=False), Look()], steps=15,
                processing_class=tok)
    t.train(resume_from_checkpoint=True)
    assert "tokenizer.json" in seen["files"] and "chat_template.jinja" in seen["files"]
    assert [i.step for i in store.log("gone/main")][:2] == [15, 10]


HOSTILE_FILES = [
    ("a path", {"../escaped": torch.zeros(3, dtype=torch.uint8)}),
    ("a hidden name", {".bashrc": torch.zeros(3, dtype=torch.uint8)}),
    ("the Trainer's own file", {"optimizer.pt": torch.zeros(3, dtype=torch.uint8)}),
    ("weights", {"model.safetensors": torch.zeros(3, dtype=torch.uint8)}),
    ("not bytes", {"tokenizer.json": torch.zeros(3)}),
    ("not a tensor", {"tokenizer.json": "{}"}),
    ("a list", ["tokenizer.json"]),
]


@pytest.mark.parametrize("files", [f for _n, f in HOSTILE_FILES], ids=[n for n, _f in HOSTILE_FILES])
def test_stored_files_are_checked_before_anything_is_written(with_tokenizer, tmp_path, files):
    store = with_tokenizer["store"]
    state = store.checkout("kept/main")
    meta = json.loads(json.dumps(store.show("kept/main").meta))
    state["files"] = files
    info = store.put_snapshot(state, "evil/main", meta=meta)
    (tmp_path / "a").mkdir()
    with pytest.raises(InvalidArgument, match="'files'") as ei:
        hf.resume_checkpoint(store, "evil/main", tmp_path / "a" / "out")
    assert info.root[:16] in str(ei.value)
    with pytest.raises(InvalidArgument, match="'files'"):  # and as a model folder
        hf.export_pretrained(store, "evil/main", tmp_path / "a" / "model")
    assert [p.name for p in tmp_path.rglob("*")] == ["a"]


def test_a_model_folder_out_of_the_store_carries_the_tokenizer(with_tokenizer, tmp_path):
    """export_pretrained and `tsck checkout STORE REF DIR/`: the weights, config.json and the
    tokenizer's files, so from_pretrained of the folder gives the model and its tokenizer."""
    store, tok = with_tokenizer["store"], with_tokenizer["tok"]
    r = hf.export_pretrained(store, "gone/main", tmp_path / "model")
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "model.safetensors",
            "config.json"} <= set(r["files"])
    assert AutoTokenizer.from_pretrained(tmp_path / "model")("the thing")["input_ids"] == tok("the thing")["input_ids"]
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model") is not None
    p = run_cli("checkout", with_tokenizer["base"] / "store", "gone/main", str(tmp_path / "cli") + "/")
    assert p.returncode == 0, p.stderr
    assert "tokenizer.json" in p.stdout
    assert (tmp_path / "cli" / "tokenizer.json").read_bytes() == (tmp_path / "model" / "tokenizer.json").read_bytes()


def test_save_total_limit_keeps_the_best_snapshot_as_the_trainer_keeps_its_folder(tmp_path):
    """load_best_model_at_end with save_total_limit=2: the Trainer keeps its best folder past
    the limit; the job's rules keep the 2 newest snapshots and the best by the same metric,
    so the store holds every checkpoint the Trainer still has (greater_is_better=True on
    eval_loss makes the first evaluation the best: one the 2 newest are not)."""
    with tsck.open_store(tmp_path / "store") as s:
        cb = hf.TsckCallback(s, job="best")
        t = trainer(tmp_path / "out", [cb], save_total_limit=2, load_best_model_at_end=True,
                    eval_strategy="steps", eval_steps=5, metric_for_best_model="loss", greater_is_better=True)
        t.train()
        assert s.retention()["best"] == tsck.Retention(keep_last=2, keep_best=1, metric="eval_loss", mode="max")
        best = int(t.state.best_model_checkpoint.rsplit("-", 1)[1])
        folders = {int(n.split("-")[1]) for n in os.listdir(tmp_path / "out") if n.startswith("checkpoint-")}
        steps = [i.step for i in s.log("best/main")]
        assert best not in (15, 20) and best in folders  # the case this test is about
        assert set(steps) >= folders and best in steps and len(steps) <= 3, (steps, folders, best)
        assert cb.prune_errors == []
