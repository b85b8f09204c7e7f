"""Hugging Face: a real Trainer on a real tiny GPT-2 (built from a config: no downloads, there
is no network), snapshotted by hf.TsckCallback and resumed from the store; save_pretrained
folders in and out, checked with transformers' own from_pretrained.

The resume checks compare every step's loss and the final parameters bit for bit with an
uninterrupted run, as examples/demo.py does; the SIGKILL case runs
examples/hf_trainer_resume.py (a child killed mid-run, resumed in a fresh process).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers, accelerate) is not installed")
pytest.importorskip("accelerate", reason="the hf extra (transformers, accelerate) is not installed")

import torch  # noqa: E402
from transformers import GPT2LMHeadModel, TrainerCallback, set_seed  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402
from tensorstore_ck import hf  # noqa: E402
from tensorstore_ck.errors import InvalidArgument  # noqa: E402
from tensorstore_ck.interchange.export import export_file  # noqa: E402

import _zygote as zygote

from _util import assert_same, child_env, hf_trainer, object_listing, run_cli, tiny_model


ROOT = Path(__file__).resolve().parents[2]
STEPS = 20


class Losses(TrainerCallback):
    def __init__(self):
        self.by_step = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.by_step[state.global_step] = logs["loss"]


def trainer(out, callbacks, steps=STEPS, **kw):
    """The suite's run (hf_trainer), STEPS long."""
    return hf_trainer(out, callbacks, steps, **kw)


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    """An uninterrupted run with the callback: its losses, final weights, store and model."""
    base = tmp_path_factory.mktemp("hf")
    store = tsck.open_store(base / "store")
    rec = Losses()
    cb = hf.TsckCallback(store, job="gpt")
    t = trainer(base / "out", [cb, rec])
    t.train()
    yield {"base": base, "store": store, "losses": rec.by_step, "params": params(t.model), "model": t.model,
           "out": base / "out"}
    store.close()


def test_callback_snapshots_every_save(run_a):
    s = run_a["store"]
    log = s.log("gpt/main")
    assert [i.step for i in log] == [20, 15, 10, 5]
    assert log[0].metrics["loss"] == run_a["losses"][20]
    assert log[0].meta["hf_trainer"] == {"layout": hf.LAYOUT, "transformers": transformers.__version__}
    assert log[0].meta["hf"]["tied"] == {"lm_head.weight": "transformer.wte.weight"}
    state = s.checkout("gpt/main")
    assert set(state) == {"model", "optimizer", "scheduler", "rng", "trainer_state"}
    assert_same(run_a["params"], dict(state["model"]), loose_types=True)
    # the trainer state is the text the Trainer wrote beside its own checkpoint, to the byte
    assert state["trainer_state"] == (run_a["out"] / "checkpoint-20" / "trainer_state.json").read_text()
    # GPT-2's tied head is stored once: the two names share their blocks (a pack holds a
    # tensor named twice twice: docs/design/scaling.md, "Packs")
    if s.pack_size == 0:
        assert s.show("gpt/main").bytes_new < s.show("gpt/main").bytes_total


def test_resume_from_the_store_is_bit_identical(run_a, tmp_path):
    """A fresh Trainer resumed from the store's step-10 snapshot, in a fresh output dir:
    the losses of steps 11..20 and the final parameters equal run A's bit for bit."""
    s = run_a["store"]
    ten = next(i for i in s.log("gpt/main") if i.step == 10)
    path = hf.resume_checkpoint(s, ten.root, tmp_path / "b")
    assert path == str(tmp_path / "b" / "checkpoint-10")
    assert sorted(os.listdir(path)) == ["config.json", "generation_config.json", "model.safetensors",
                                        "optimizer.pt", "rng_state.pth", "scheduler.pt", "trainer_state.json"]
    rec = Losses()
    t = trainer(tmp_path / "b", [rec])
    t.train(resume_from_checkpoint=path)
    assert sorted(rec.by_step) == list(range(11, STEPS + 1))
    assert all(rec.by_step[k] == run_a["losses"][k] for k in rec.by_step), (rec.by_step, run_a["losses"])
    assert_same(run_a["params"], params(t.model))


def test_resume_refusals_change_nothing(run_a, tmp_path, store):
    s = run_a["store"]
    path = hf.resume_checkpoint(s, "gpt/main", tmp_path / "c")
    before = {n: (Path(path) / n).read_bytes() for n in os.listdir(path)}
    with pytest.raises(InvalidArgument, match="exists"):
        hf.resume_checkpoint(s, "gpt/main", tmp_path / "c")
    assert {n: (Path(path) / n).read_bytes() for n in os.listdir(path)} == before
    hf.resume_checkpoint(s, "gpt/main", tmp_path / "c", force=True)
    store.put_snapshot({"w": torch.ones(3)}, "plain/main")
    with pytest.raises(InvalidArgument, match="not a Trainer snapshot"):
        hf.resume_checkpoint(store, "plain/main", tmp_path / "d")
    assert not (tmp_path / "d").exists()


def _ts(**kw) -> str:
    return json.dumps({"global_step": 10, "epoch": 1.0, "log_history": [], **kw})


# A snapshot shaped like TsckCallback's with one hostile or foreign value: (id, change).
# Each change takes (state, meta) and edits them in place.
HOSTILE = [
    ("step escapes", lambda st, m: st.update(trainer_state=_ts(global_step="../../../../escaped"))),
    ("step absolute", lambda st, m: st.update(trainer_state=_ts(global_step="/tmp/escaped"))),
    ("step negative", lambda st, m: st.update(trainer_state=_ts(global_step=-1))),
    ("step bool", lambda st, m: st.update(trainer_state=_ts(global_step=True))),
    ("step float", lambda st, m: st.update(trainer_state=_ts(global_step=5.0))),
    ("step numeric text", lambda st, m: st.update(trainer_state=_ts(global_step="10"))),
    ("step past int64", lambda st, m: st.update(trainer_state=_ts(global_step=2**64))),
    ("step missing", lambda st, m: st.update(trainer_state=json.dumps({"epoch": 1.0}))),
    ("trainer_state missing", lambda st, m: st.pop("trainer_state")),
    ("trainer_state not JSON", lambda st, m: st.update(trainer_state="{global_step: 10")),
    ("trainer_state a list", lambda st, m: st.update(trainer_state="[10]")),
    ("trainer_state not text", lambda st, m: st.update(trainer_state=10)),
    ("model missing", lambda st, m: st.pop("model")),
    ("model a tensor", lambda st, m: st.update(model=torch.ones(3))),
    ("model holds text", lambda st, m: st["model"].update({"x": "y"})),
    ("rng missing torch", lambda st, m: st["rng"].pop("torch")),
    ("rng_ranks a dict", lambda st, m: st.update(rng_ranks={"0": st["rng"]})),
    ("rng_ranks empty", lambda st, m: st.update(rng_ranks=[])),
    ("rng_ranks holds no rng", lambda st, m: st.update(rng_ranks=[st["rng"], {"python": 1}])),
    ("hf meta a list", lambda st, m: m.update(hf=[1])),
    ("tied a list", lambda st, m: m["hf"].update(tied=["a"])),
    ("config not JSON", lambda st, m: m["hf"].update(config="{")),
    ("config a number", lambda st, m: m["hf"].update(config=3)),
]


@pytest.mark.parametrize("change", [c for _n, c in HOSTILE], ids=[n for n, _c in HOSTILE])
def test_resume_of_a_snapshot_the_callback_did_not_write_is_refused_and_writes_nothing(run_a, tmp_path, store,
                                                                                       change):
    """Stored values are untrusted: global_step names the folder resume writes, and
    "../../../../escaped" must not write the checkpoint above output_dir.
    A snapshot crafted through the public API, with the callback's meta: InvalidArgument
    naming it, not a KeyError/TypeError/JSONDecodeError, and no file anywhere."""
    state = run_a["store"].checkout("gpt/main")
    meta = json.loads(json.dumps(run_a["store"].show("gpt/main").meta))
    change(state, meta)
    info = store.put_snapshot(state, "evil/main", meta=meta)
    work = tmp_path / "work"
    (work / "a" / "b").mkdir(parents=True)
    with pytest.raises(InvalidArgument) as ei:
        hf.resume_checkpoint(store, "evil/main", work / "a" / "b" / "out")
    assert info.root[:16] in str(ei.value) and "evil/main" in str(ei.value), ei.value
    assert [str(p.relative_to(work)) for p in sorted(work.rglob("*"))] == ["a", "a/b"]


def test_resume_takes_a_step_of_zero_and_a_config_as_a_dict(run_a, tmp_path, store):
    state = run_a["store"].checkout("gpt/main")
    meta = json.loads(json.dumps(run_a["store"].show("gpt/main").meta))
    state["trainer_state"] = _ts(global_step=0)
    meta["hf"]["config"] = json.loads(meta["hf"]["config"])  # JSON object, as export_pretrained takes it
    store.put_snapshot(state, "zero/main", meta=meta)
    path = hf.resume_checkpoint(store, "zero/main", tmp_path / "out")
    assert path == str(tmp_path / "out" / "checkpoint-0")
    assert json.loads((Path(path) / "config.json").read_text()) == meta["hf"]["config"]


def test_keep_local_false_leaves_the_store_the_only_copy(tmp_path):
    with tsck.open_store(tmp_path / "store") as s:
        t = trainer(tmp_path / "out", [hf.TsckCallback(s, job="j", keep_local=False, async_=True)])
        t.train()
        assert [i.step for i in s.log("j/main")] == [20, 15, 10, 5]
        assert not [n for n in os.listdir(tmp_path / "out") if n.startswith("checkpoint-")]
        with pytest.raises(InvalidArgument, match="load_best_model_at_end"):
            trainer(tmp_path / "out2", [hf.TsckCallback(s, job="k", keep_local=False)],
                    load_best_model_at_end=True, eval_strategy="steps", eval_steps=5).train()


class WriteScaler(TrainerCallback):
    """Writes the scaler.pt a mixed-precision run on a GPU gets (there is no scaler on CPU)."""

    def on_save(self, args, state, control, **kwargs):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0 + state.global_step)
        torch.save(scaler.state_dict(), os.path.join(args.output_dir, f"checkpoint-{state.global_step}", "scaler.pt"))


def test_the_grad_scaler_goes_through_the_store(tmp_path, store):
    t = trainer(tmp_path / "out", [WriteScaler(), hf.TsckCallback(store, job="amp")], steps=5)
    t.train()
    assert store.checkout("amp/main")["scaler"]["scale"] == 1029.0
    path = hf.resume_checkpoint(store, "amp/main", tmp_path / "again")
    assert_same(torch.load(tmp_path / "out" / "checkpoint-5" / "scaler.pt", weights_only=True),
                torch.load(os.path.join(path, "scaler.pt"), weights_only=True))


def test_export_pretrained_loads_with_from_pretrained(run_a, tmp_path):
    s = run_a["store"]
    r = hf.export_pretrained(s, "gpt/main", tmp_path / "m")
    assert sorted(r["files"]) == ["config.json", "generation_config.json", "model.safetensors"]
    m = GPT2LMHeadModel.from_pretrained(tmp_path / "m")
    assert_same(run_a["params"], params(m))  # the tied head included: from_pretrained ties it back
    assert (tmp_path / "m" / "config.json").read_text() == run_a["model"].config.to_json_string()
    loaded = m.config.to_dict()
    assert loaded.pop("_name_or_path") == str(tmp_path / "m")
    assert loaded == {k: v for k, v in run_a["model"].config.to_dict().items() if k != "_name_or_path"}
    # sharded past max_shard_bytes, as save_pretrained shards: model-0000i-of-0000n + index
    r = hf.export_pretrained(s, "gpt/main", tmp_path / "sh", max_shard_bytes=20_000)
    assert "model.safetensors.index.json" in r["files"] and len(r["files"]) > 4
    assert_same(run_a["params"], params(GPT2LMHeadModel.from_pretrained(tmp_path / "sh")))
    # into an existing folder: refused without force, nothing written; with force, the
    # older export's shards go, so the folder never mixes two exports
    with pytest.raises(InvalidArgument, match="exists"):
        hf.export_pretrained(s, "gpt/main", tmp_path / "sh")
    hf.export_pretrained(s, "gpt/main", tmp_path / "sh", force=True)
    assert sorted(os.listdir(tmp_path / "sh")) == ["config.json", "generation_config.json", "model.safetensors"]


def test_import_a_save_pretrained_folder_and_round_trip(tmp_path, store):
    set_seed(1)
    m = tiny_model()
    m.save_pretrained(tmp_path / "src", max_shard_size="20KB")  # sharded, with an index
    info = hf.import_pretrained(store, tmp_path / "src", ref="base/main")
    assert info.meta["hf"]["config"] == (tmp_path / "src" / "config.json").read_text()
    got = store.checkout("base/main")
    # in the index's (sorted) order; save_pretrained leaves the tied head out
    want = {k: v for k, v in sorted(params(m).items()) if k != "lm_head.weight"}
    assert_same(want, dict(got), loose_types=True)
    hf.export_pretrained(store, "base/main", tmp_path / "out")
    for name in ("config.json", "generation_config.json"):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "src" / name).read_bytes()
    assert_same(params(m), params(GPT2LMHeadModel.from_pretrained(tmp_path / "out")))
    # a second import of the same weights writes no new block
    again = hf.import_pretrained(store, tmp_path / "out", ref="copy/main")
    assert again.bytes_new == 0


def test_export_refuses_what_a_model_folder_cannot_hold(run_a, tmp_path, store):
    store.put_snapshot({"w": torch.ones(3), "note": "x"}, "odd/main")
    listing = object_listing(tmp_path)
    with pytest.raises(tsck.UnsupportedType, match="not a tensor"):
        hf.export_pretrained(store, "odd/main", tmp_path / "m")
    assert not (tmp_path / "m").exists() and object_listing(tmp_path) == listing
    with pytest.raises(InvalidArgument, match="not a JSON object"):
        hf.export_pretrained(run_a["store"], "gpt/main", tmp_path / "m", config="[1]")
    assert not (tmp_path / "m").exists()
    with pytest.raises(InvalidArgument, match="names a folder"):
        export_file(run_a["store"], "gpt/main", str(tmp_path / "m") + os.sep, fmt="torch")
    assert not (tmp_path / "m").exists()


def test_the_package_does_not_import_transformers():
    code = ("import sys, tensorstore_ck, tensorstore_ck.cli, tensorstore_ck.interchange.export, tensorstore_ck.interchange.importing, tensorstore_ck.interchange.hf_folder; "
            "assert 'transformers' not in sys.modules, 'transformers imported'")
    zygote.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120, fresh=True)


@pytest.mark.slow
def test_cli_checkout_to_a_folder_and_import_it(run_a, tmp_path):
    """`tsck checkout STORE TARGET DIR/` writes the same folder as export_pretrained;
    `tsck import` of it carries config.json."""
    path = run_a["base"] / "store"
    run_a["store"].wait()
    r = run_cli("checkout", path, "gpt/main", str(tmp_path / "cli") + os.sep, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["format"] == "hf-folder" and out["config"] is True
    assert_same(run_a["params"], params(GPT2LMHeadModel.from_pretrained(tmp_path / "cli")))
    r = run_cli("import", path, "cli/main", tmp_path / "cli", "--json")
    assert r.returncode == 0, r.stderr
    cfg = run_a["store"].show("cli/main").meta["hf"]["config"]
    assert cfg == (tmp_path / "cli" / "config.json").read_text()


@pytest.mark.slow
def test_example_killed_and_resumed_is_bit_identical(tmp_path):
    """examples/hf_trainer_resume.py: a child killed with SIGKILL at step 12, resumed from
    the store in a fresh process and output dir; exit 0 only if every loss and the final
    parameters equal an uninterrupted run's."""
    r = zygote.run([sys.executable, str(ROOT / "examples" / "hf_trainer_resume.py"), "--store",
                    str(tmp_path / "store")], capture_output=True, text=True, timeout=300, cwd=ROOT,
                   env=dict(os.environ, **{zygote.SUBPROCESS: "1"}))  # its runs: forks of the zygote
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "committed snapshots (steps): [5, 10]" in r.stdout
    assert "losses of all 20 steps bit-identical to run A: True" in r.stdout
    assert "final parameters bit-identical to run A: True" in r.stdout


class StopAt(TrainerCallback):
    """Ends training after step `at` (the save at that step is taken first)."""

    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            control.should_training_stop = True


def test_resume_from_checkpoint_true_finds_the_stores_newest_snapshot(run_a, tmp_path):
    """keep_local=False leaves no checkpoint folder behind, so HF's "latest checkpoint in
    output_dir" would find nothing: the callback writes the store's newest snapshot there
    when the Trainer is built. Steps 11..20 and the final parameters equal run A's bit for
    bit, and the folder it wrote goes again at the next save."""
    out = tmp_path / "out"
    with tsck.open_store(tmp_path / "store") as s:
        trainer(out, [hf.TsckCallback(s, job="j", keep_local=False), StopAt(10)]).train()
        assert [i.step for i in s.log("j/main")] == [10, 5]
        assert not [n for n in os.listdir(out) if n.startswith("checkpoint-")]
        rec = Losses()
        t = trainer(out, [hf.TsckCallback(s, job="j", keep_local=False), rec])
        assert os.listdir(out / "checkpoint-10")  # written when the Trainer was built
        t.train(resume_from_checkpoint=True)
        assert sorted(rec.by_step) == list(range(11, STEPS + 1))
        assert all(rec.by_step[k] == run_a["losses"][k] for k in rec.by_step), (rec.by_step, run_a["losses"])
        assert_same(run_a["params"], params(t.model))
        assert not [n for n in os.listdir(out) if n.startswith("checkpoint-")]
        assert [i.step for i in s.log("j/main")][:2] == [20, 15]


def test_latest_leaves_an_output_dir_that_has_that_checkpoint_or_a_newer_one(run_a, tmp_path):
    out = run_a["out"]  # run A kept its folders (keep_local=True): checkpoint-20 is there
    before = {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out)}
    trainer(out, [hf.TsckCallback(run_a["store"], job="gpt")])
    assert {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out)} == before
    trainer(tmp_path / "none", [hf.TsckCallback(run_a["store"], job="gpt", latest=False)])
    assert not (tmp_path / "none").exists() or not os.listdir(tmp_path / "none")
    trainer(tmp_path / "fresh", [hf.TsckCallback(run_a["store"], job="gpt")])
    assert sorted(os.listdir(tmp_path / "fresh")) == ["checkpoint-20"]


def test_save_total_limit_is_the_jobs_retention_unless_one_is_given(tmp_path):
    """save_total_limit=2: the Trainer keeps 2 folders, the store keeps the job's 2 newest
    snapshots (Retention(keep_last=2), applied after each save); retention= wins."""
    with tsck.open_store(tmp_path / "store") as s:
        cb = hf.TsckCallback(s, job="lim")
        trainer(tmp_path / "a", [cb], save_total_limit=2).train()
        assert s.retention()["lim"] == tsck.Retention(keep_last=2)
        assert [i.step for i in s.log("lim/main")] == [20, 15]
        assert cb.prune_errors == []
        trainer(tmp_path / "b", [hf.TsckCallback(s, job="own", retention=tsck.Retention(keep_last=3))],
                save_total_limit=2).train()
        assert s.retention()["own"] == tsck.Retention(keep_last=3)
        assert [i.step for i in s.log("own/main")] == [20, 15, 10]


PREEMPT_CHILD = r"""
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[2], "tests"))
from transformers import TrainerCallback
import tensorstore_ck as tsck
from tensorstore_ck import hf
from _util import hf_trainer

out = sys.argv[1]

class Pause(TrainerCallback):  # at step 7's end: say so, wait for the test's signal (stdin)
    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 7:
            print("step 7", flush=True)
            input()

store = tsck.open_store(os.path.join(out, "store"))
cb = hf.TsckCallback(store, job="gpt", preempt_grace=60)
t = hf_trainer(os.path.join(out, "run"), [Pause(), cb], 20)
try:
    t.train()
except tsck.Preempted as e:
    with open(os.path.join(out, "res.json"), "w") as f:
        json.dump({"step": e.step, "durable": e.durable, "code": e.code, "text": str(e)}, f)
    raise
"""


@pytest.mark.slow
def test_a_sigterm_mid_training_saves_that_step_and_ends_with_143(tmp_path):
    """The real Trainer in its own process, SIGTERM at step 7's end (saves every 5 steps):
    the callback tells the Trainer to save and stop at the next step end (7 here: the
    signal came during it), saves that step blocking and raises Preempted: exit status 143,
    the store's newest snapshot of step 7, beside the Trainer's own checkpoint-7."""
    import signal
    import subprocess
    p = zygote.Popen([sys.executable, "-c", PREEMPT_CHILD, str(tmp_path), str(ROOT)], cwd=ROOT,
                     env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE, text=True)
    for line in p.stdout:
        if line.strip() == "step 7":
            break
    p.send_signal(signal.SIGTERM)
    p.stdin.write("go\n")
    p.stdin.flush()
    out, err = p.communicate(timeout=300)
    assert p.returncode == 143, err[-3000:]
    res = json.loads((tmp_path / "res.json").read_text())
    assert (res["step"], res["durable"], res["code"]) == (7, True, 143), res
    with tsck.open_store(tmp_path / "store", create=False) as s:
        assert [i.step for i in s.log("gpt/main")] == [7, 5]
    assert (tmp_path / "run" / "checkpoint-7").is_dir()
