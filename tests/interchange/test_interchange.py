"""Snapshots in and out as files other tools read: `tsck checkout`, `tsck import`, `tsck ls`.

The CLI runs as the real entry point in subprocesses (`python -m tensorstore_ck`), launched
by a module fixture in three waves (each invocation imports torch): reads and refusals,
then imports, then what needs those imports; about 30 processes, so those tests are marked
slow. The in-process tests at the end (quick) check the same functions through the API.
The files written and read are checked with safetensors and torch themselves.
"""
from __future__ import annotations

import collections
import json
import os
import re
import shutil
import zipfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import tensorstore_ck as tsck
from tensorstore_ck.errors import FormatError, InvalidArgument, UnsupportedType
from tensorstore_ck.interchange.export import export_file
from tensorstore_ck.interchange.importing import import_files
from tensorstore_ck.read.listing import list_tree

from _util import assert_same, object_listing, rand_tensor, refs_snapshot, run_cli, tensor_bytes


BS = 64 * 1024

ST_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
             torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64,
             torch.float8_e4m3fn, torch.float8_e5m2]


def tensor_state():
    """Tensors of every dtype safetensors holds, nested, with scalars beside them."""
    big = rand_tensor(torch.float32, (256, 256), seed=1)  # several blocks
    return {
        "model": {
            "enc": {"weight": big, "bias": rand_tensor(torch.bfloat16, (256,), seed=2)},
            "dec": {"weight": rand_tensor(torch.float16, (64, 33), seed=3).t(),  # a non-contiguous view
                    "scale": torch.tensor(1.5)},  # 0-d
            "empty": torch.zeros((0, 3)),
        },
        "by_dtype": {str(d).removeprefix("torch."): rand_tensor(d, (17, 5), seed=10 + i)
                     for i, d in enumerate(ST_DTYPES)},
        "layers": [rand_tensor(torch.float32, (8,), seed=40), rand_tensor(torch.float32, (8,), seed=41)],
        "step": 1234, "lr": 0.1, "name": "run-7", "flag": True, "nothing": None,
        "np_loss": np.float32(2.5), "betas": (0.9, 0.999),
    }


def flat_tensors(state, prefix=""):
    out, meta = {}, {}
    items = state.items() if isinstance(state, dict) else enumerate(state)
    for k, v in items:
        p = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, (dict, list, tuple)):
            a, b = flat_tensors(v, p)
            out.update(a)
            meta.update(b)
        elif isinstance(v, torch.Tensor):
            out[p] = v
        else:
            meta[p] = v
    return out, meta


def same_tensor(a: torch.Tensor, b: torch.Tensor, where: str):
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), f"{where}: {a.dtype}{a.shape} {b.dtype}{b.shape}"
    assert tensor_bytes(a) == tensor_bytes(b), f"{where}: bytes differ"


def hf_weights(seed_head: int):
    """A small model's state_dict (flat dotted keys, as Hugging Face writes them)."""
    sd = {}
    for i in range(3):
        sd[f"model.layers.{i}.self_attn.q_proj.weight"] = rand_tensor(torch.bfloat16, (128, 256), seed=100 + i)
        sd[f"model.layers.{i}.mlp.up_proj.weight"] = rand_tensor(torch.bfloat16, (256, 128), seed=200 + i)
        sd[f"model.layers.{i}.input_layernorm.weight"] = rand_tensor(torch.float32, (256,), seed=300 + i)
    sd["model.embed_tokens.weight"] = rand_tensor(torch.bfloat16, (512, 128), seed=400)
    sd["lm_head.weight"] = rand_tensor(torch.bfloat16, (512, 128), seed=seed_head)  # fine-tuned: differs
    return sd


def write_hf_sharded(folder, sd, shards=2):
    """model-0000i-of-0000n.safetensors + model.safetensors.index.json, as transformers writes them."""
    folder.mkdir()
    names = list(sd)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k].contiguous() for k in names[s::shards]}
        save_file(part, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in part})
    total = sum(t.numel() * t.element_size() for t in sd.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 128}))


def write_inputs(base):
    """The files `tsck import` is given: torch.save files (zip and legacy), safetensors files,
    two Hugging Face folders sharing all but the head, and broken ones."""
    torch_state = {"model": collections.OrderedDict(
        [("w", rand_tensor(torch.float32, (300, 200), seed=60)), ("b", rand_tensor(torch.float16, (200,), seed=61))]),
        "optim": {"state": {0: {"exp_avg": rand_tensor(torch.float32, (300, 200), seed=62),
                                "step": torch.tensor(10.0)}},
                  "param_groups": [{"lr": 0.001, "betas": (0.9, 0.999), "params": [0]}]},
        "epoch": 3, "view": rand_tensor(torch.int64, (40, 30), seed=63)[:, 5:20]}
    torch.save(torch_state, base / "ckpt.pt")
    legacy = {"w": rand_tensor(torch.float32, (16, 16), seed=64)}
    torch.save(legacy, base / "legacy.pt", _use_new_zipfile_serialization=False)
    torch.save({"w": torch.ones(3), "rng": np.random.RandomState(0).get_state()[1]}, base / "pickled.pt")
    save_file({"a": torch.arange(1000.0)}, str(base / "ok.safetensors"))
    data = (base / "ok.safetensors").read_bytes()
    (base / "truncated.safetensors").write_bytes(data[:-100])
    (base / "ckpt_trunc.pt").write_bytes((base / "ckpt.pt").read_bytes()[:500])
    (base / "notes.txt").write_text("hello")
    hf_a, hf_b = hf_weights(seed_head=500), hf_weights(seed_head=501)
    write_hf_sharded(base / "hf_a", hf_a)
    (base / "hf_b").mkdir()
    save_file({k: v.contiguous() for k, v in hf_b.items()}, str(base / "hf_b" / "model.safetensors"),
              metadata={"format": "pt"})
    (base / "hf_bad").mkdir()
    (base / "hf_bad" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../ok.safetensors"}}))
    (base / "hf_none").mkdir()
    (base / "hf_none" / "config.json").write_text("{}")
    return {"torch_state": torch_state, "legacy": legacy, "hf_a": hf_a, "hf_b": hf_b}


cli = pytest.mark.slow  # the tests that use `world` (about 30 CLI processes)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("interchange")
    path = base / "store"
    out = base / "out"
    out.mkdir()
    st_state = tensor_state()
    flat = {"model.layers.0.weight": rand_tensor(torch.float32, (64, 64), seed=50),
            "model.layers.0.bias": rand_tensor(torch.float32, (64,), seed=51),
            "model.layers.1.weight": rand_tensor(torch.float32, (64, 64), seed=52)}
    with tsck.open_store(path, block_size=BS, inline_threshold=256) as s:
        s.put_snapshot(st_state, ref="st/main", step=1)
        s.put_snapshot(flat, ref="flat/main", step=1)
        s.put_snapshot({"w": torch.ones(4), "c": torch.zeros(3, dtype=torch.complex128)}, ref="cplx/main")
        s.put_snapshot({"w": torch.ones(4), "raw": b"\x00\x01"}, ref="raw/main")

    inputs = write_inputs(base)
    # a copy of the store without its blocks: ls must not need them, checkout must fail whole
    noblocks = base / "noblocks"
    shutil.copytree(path, noblocks)
    shutil.rmtree(noblocks / "blocks")
    (out / "exists.safetensors").write_bytes(b"precious")

    def run_all(cmds):
        with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as ex:
            futs = {k: ex.submit(run_cli, *v) for k, v in cmds.items()}
            return {k: f.result() for k, f in futs.items()}

    before = (object_listing(path), _refs(path))
    res = run_all({
        "co_st": ("checkout", path, "st/main", out / "st.safetensors"),
        "co_st_json": ("checkout", path, "st/main", out / "st2.data", "--format", "safetensors", "--json"),
        "co_pt": ("checkout", path, "st/main@1", out / "st.pt"),
        "co_path": ("checkout", path, "st/main", out / "enc.safetensors", "--path", "model.enc"),
        "co_flat": ("checkout", path, "flat/main", out / "flat0.safetensors", "--path", "model.layers.0"),
        "co_flat_pt": ("checkout", path, "flat/main", out / "flat0.pt", "--path", "model.layers.0"),
        "co_one_pt": ("checkout", path, "flat/main", out / "one.pt", "--path", "model.layers.1.weight"),
        "ls": ("ls", path, "st/main"),
        "ls_json": ("ls", path, "st/main", "--json"),
        "ls_sub_json": ("ls", path, "st/main", "model.enc", "--json"),
        "ls_flat_json": ("ls", path, "flat/main", "model.layers.0", "--json"),
        "ls_noblocks": ("ls", noblocks, "st/main", "--json"),
        # refusals: exit 2, one line, the store as it was
        "err_co_noblocks": ("checkout", noblocks, "st/main", out / "nb.safetensors"),
        "err_cplx": ("checkout", path, "cplx/main", out / "cplx.safetensors"),
        "err_bytes": ("checkout", path, "raw/main", out / "raw.safetensors"),
        "err_exists": ("checkout", path, "st/main", out / "exists.safetensors"),
        "err_suffix": ("checkout", path, "st/main", out / "st.npz"),
        "err_nopath": ("checkout", path, "st/main", out / "np.safetensors", "--path", "model.nope"),
        "err_ls_nopath": ("ls", path, "st/main", "model.nope"),
        "err_truncated": ("import", path, "imp/main", base / "truncated.safetensors"),
        "err_truncated_pt": ("import", path, "imp/main", base / "ckpt_trunc.pt"),
        "err_pickle": ("import", path, "imp/main", base / "pickled.pt"),
        "err_missing": ("import", path, "imp/main", base / "nope.pt"),
        "err_notes": ("import", path, "imp/main", base / "notes.txt"),
        "err_hf_bad": ("import", path, "imp/main", base / "hf_bad"),
        "err_hf_none": ("import", path, "imp/main", base / "hf_none"),
        "err_dup": ("import", path, "imp/main", base / "hf_b", base / "hf_b" / "model.safetensors"),
        "err_badref": ("import", path, "bad//ref", base / "ok.safetensors"),
    })
    after = (object_listing(path), _refs(path))
    res.update(run_all({
        "imp_pt": ("import", path, "imp/torch", base / "ckpt.pt", "--step", "7", "--json"),
        "imp_legacy": ("import", path, "imp/legacy", base / "legacy.pt", "--job", "old"),
        "imp_hf_a": ("import", path, "hf/base", base / "hf_a", "--json"),
    }))
    res.update(run_all({
        "imp_hf_b": ("import", path, "hf/tuned", base / "hf_b", "--json"),
        "co_imp_pt": ("checkout", path, "imp/torch", out / "imp.pt"),
    }))
    return {"path": path, "out": out, "base": base, "res": res, "st_state": st_state, "flat": flat,
            **inputs, "unchanged": before == after}


def _refs(path):
    with tsck.open_store(path, create=False) as s:
        return refs_snapshot(s)


def ok(world, key):
    r = world["res"][key]
    assert r.returncode == 0, f"{key}: rc={r.returncode}\nstdout={r.stdout}\nstderr={r.stderr}"
    assert "Traceback" not in r.stdout + r.stderr
    return r


def err(world, key, *words):
    r = world["res"][key]
    assert r.returncode == 2, f"{key}: rc={r.returncode}\nstdout={r.stdout}\nstderr={r.stderr}"
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tsck: error: "), f"{key}: {r.stderr!r}"
    for w in words:
        assert w in lines[0], f"{key}: {w!r} not in {lines[0]!r}"
    return lines[0]


# ---------------------------------------------------------------- checkout
@cli
def test_checkout_safetensors_bit_exact(world):
    ok(world, "co_st")
    got = load_file(str(world["out"] / "st.safetensors"))
    want, plain = flat_tensors(world["st_state"])
    assert list(got) == sorted(got) or set(got) == set(want)
    assert set(got) == set(want)
    for k, t in want.items():
        same_tensor(t, got[k], k)
    with safe_open(str(world["out"] / "st.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt"
    assert meta["step"] == "1234" and meta["lr"] == "0.1" and meta["name"] == "run-7"
    assert meta["flag"] == "true" and meta["nothing"] == "null" and meta["np_loss"] == "2.5"
    assert meta["betas.0"] == "0.9" and meta["betas.1"] == "0.999"
    assert set(meta) == set(plain) | {"format"}
    assert oct(os.stat(world["out"] / "st.safetensors").st_mode & 0o777) != oct(0o600)


@cli
def test_checkout_format_flag_and_json(world):
    doc = json.loads(ok(world, "co_st_json").stdout)
    assert doc["format"] == "safetensors" and doc["tensors"] == len(flat_tensors(world["st_state"])[0])
    assert doc["bytes"] == os.path.getsize(world["out"] / "st2.data")
    got = load_file(str(world["out"] / "st2.data"))
    same_tensor(world["st_state"]["model"]["enc"]["weight"], got["model.enc.weight"], "enc")


@cli
def test_checkout_torch_is_exact(world):
    ok(world, "co_pt")
    got = torch.load(world["out"] / "st.pt", weights_only=False)
    assert_same(world["st_state"], got)


@cli
def test_checkout_path(world):
    ok(world, "co_path")
    got = load_file(str(world["out"] / "enc.safetensors"))
    enc = world["st_state"]["model"]["enc"]
    assert set(got) == {"model.enc.weight", "model.enc.bias"}  # full names: loadable into the model
    same_tensor(enc["weight"], got["model.enc.weight"], "w")
    same_tensor(enc["bias"], got["model.enc.bias"], "b")


@cli
def test_checkout_path_in_flat_keys(world):
    ok(world, "co_flat")
    flat = world["flat"]
    got = load_file(str(world["out"] / "flat0.safetensors"))
    assert set(got) == {"model.layers.0.weight", "model.layers.0.bias"}
    for k in got:
        same_tensor(flat[k], got[k], k)
    ok(world, "co_flat_pt")
    pt = torch.load(world["out"] / "flat0.pt", weights_only=True)
    assert set(pt) == {"model.layers.0.weight", "model.layers.0.bias"}
    ok(world, "co_one_pt")
    same_tensor(flat["model.layers.1.weight"], torch.load(world["out"] / "one.pt", weights_only=True), "one")


# ---------------------------------------------------------------- ls
@cli
def test_ls_lists_the_tree(world):
    out = ok(world, "ls").stdout
    assert "model.enc.weight" in out and "float32" in out and "[256, 256]" in out
    assert "by_dtype.float8_e4m3fn" in out and "step" in out and "1234" in out
    doc = json.loads(ok(world, "ls_json").stdout)
    entries = {e["path"]: e for e in doc["entries"]}
    want, plain = flat_tensors(world["st_state"])
    assert set(entries) == set(want) | set(plain)
    for k, t in want.items():
        e = entries[k]
        assert e["kind"] == "tensor" and e["dtype"] == str(t.dtype).removeprefix("torch.")
        assert e["shape"] == list(t.shape) and e["bytes"] == t.numel() * t.element_size()
    assert entries["step"]["value"] == 1234 and entries["name"]["value"] == "run-7"
    assert entries["model.enc.weight"]["blocks"] == 4  # 256 KB in 64 KB blocks
    assert doc["tensor_bytes"] == sum(t.numel() * t.element_size() for t in want.values())


@cli
def test_ls_subtree_and_flat_keys(world):
    doc = json.loads(ok(world, "ls_sub_json").stdout)
    assert [e["path"] for e in doc["entries"]] == ["model.enc.weight", "model.enc.bias"]
    doc = json.loads(ok(world, "ls_flat_json").stdout)
    assert {e["path"] for e in doc["entries"]} == {"model.layers.0.weight", "model.layers.0.bias"}


@cli
def test_ls_reads_no_block(world):
    """The store copy has no blocks at all: ls still lists every tensor (nodes only);
    checkout fails as a whole (exit 2) and leaves no file behind."""
    doc = json.loads(ok(world, "ls_noblocks").stdout)
    assert len(doc["entries"]) == len(json.loads(ok(world, "ls_json").stdout)["entries"])
    err(world, "err_co_noblocks", "missing")
    assert not [p for p in os.listdir(world["out"]) if p.startswith(("nb.", ".nb."))]


# ---------------------------------------------------------------- refusals
@cli
def test_bad_inputs_exit_2_and_change_nothing(world):
    err(world, "err_cplx", "complex128", "at c", "cplx/main")
    err(world, "err_bytes", "bytes", "at raw")
    err(world, "err_exists", "exists", "--force")
    assert (world["out"] / "exists.safetensors").read_bytes() == b"precious"
    err(world, "err_suffix", "--format")
    err(world, "err_nopath", "model.nope")
    err(world, "err_ls_nopath", "model.nope")
    err(world, "err_truncated", "truncated.safetensors", "not a readable safetensors file")
    err(world, "err_truncated_pt", "ckpt_trunc.pt", "not a readable torch.save file")
    err(world, "err_pickle", "pickled.pt", "needs pickle", "numpy")
    err(world, "err_missing", "nope.pt", "no such file")
    err(world, "err_notes", "notes.txt", "neither")
    err(world, "err_hf_bad", "../ok.safetensors")
    err(world, "err_hf_none", "not a Hugging Face model folder")
    err(world, "err_dup", "lm_head.weight", "in both")
    err(world, "err_badref", "bad//ref")
    assert world["unchanged"], "a refused command changed the store"
    for name in ("cplx.safetensors", "raw.safetensors", "st.npz", "np.safetensors"):
        assert not (world["out"] / name).exists()
    assert not [p for p in os.listdir(world["out"]) if p.endswith(".partial")]


# ---------------------------------------------------------------- import
@cli
def test_import_torch_file_round_trip(world):
    doc = json.loads(ok(world, "imp_pt").stdout)
    assert doc["ref"] == "imp/torch" and doc["step"] == 7
    ok(world, "imp_legacy")
    with tsck.open_store(world["path"], create=False) as s:
        assert_same(world["torch_state"], s.checkout("imp/torch"))
        assert_same(world["legacy"], s.checkout("imp/legacy"))
        assert s.show("imp/legacy").job == "old"
        src = s.show("imp/torch").meta["import"][0]
        assert src["format"] == "torch" and src["source"].endswith("ckpt.pt")
    # and out again, as torch.save, loadable with weights_only
    ok(world, "co_imp_pt")
    assert_same(world["torch_state"], torch.load(world["out"] / "imp.pt", weights_only=True))


@cli
def test_import_hf_folders_dedup(world):
    """Two Hugging Face folders (one sharded with an index, one single file) that share
    all but the head: the second import writes only the head's blocks."""
    a = json.loads(ok(world, "imp_hf_a").stdout)
    b = json.loads(ok(world, "imp_hf_b").stdout)
    hf_a, hf_b = world["hf_a"], world["hf_b"]
    total = sum(t.numel() * t.element_size() for t in hf_a.values())
    head = hf_b["lm_head.weight"]
    assert a["bytes_total"] == b["bytes_total"] == total
    assert b["bytes_new"] == head.numel() * head.element_size()
    assert b["blocks_new"] == -(-head.numel() * head.element_size() // BS)
    with tsck.open_store(world["path"], create=False) as s:
        got_a, got_b = s.checkout("hf/base"), s.checkout("hf/tuned")
        assert list(got_a) == sorted(hf_a)  # the index's order
        for k in hf_a:
            same_tensor(hf_a[k], got_a[k], k)
            same_tensor(hf_b[k], got_b[k], k)
        assert s.show("hf/base").meta["import"][0]["format"] == "hf:safetensors"


# ---------------------------------------------------------------- in-process (API) checks
def test_refusal_comes_before_any_block_is_read(tmp_path):
    """safetensors refusals come from the manifest: with every block gone, the error is the
    refusal naming the path, not a missing block."""
    p = tmp_path / "s"
    with tsck.open_store(p, block_size=BS) as s:
        s.put_snapshot({"w": rand_tensor(torch.float32, (256, 256)), "z": rand_tensor(torch.complex64, (256, 256))},
                       ref="a/main")
    shutil.rmtree(p / "blocks")
    with tsck.open_store(p, create=False) as s:
        with pytest.raises(UnsupportedType, match=r"complex64.* at z"):
            export_file(s, "a/main", tmp_path / "x.safetensors")
        assert not (tmp_path / "x.safetensors").exists()


def test_ls_bounds_a_dag_bomb(tmp_path):
    """A node named at many paths: the listing counts the paths it visits and stops at the cap."""
    leaf = {"x": 1}
    state = leaf
    for _ in range(12):
        state = {"a": state, "b": state}  # identical sub-trees: one node each level, 2^12 paths
    with tsck.open_store(tmp_path / "s") as s:
        s.put_snapshot(state, ref="a/main")
        root, entries = list_tree(s.core, s.resolve("a/main"))
        assert len(entries) == 2 ** 12
        with pytest.raises(FormatError, match="more than 1000 values"):
            list_tree(s.core, s.resolve("a/main"), limit=1000)
        _, sub = list_tree(s.core, s.resolve("a/main"), "a.b.a")
        assert len(sub) == 2 ** 9 and all(e.path.startswith("a.b.a.") for e in sub)
        with pytest.raises(InvalidArgument, match="holds nothing at 'a.c'"):
            list_tree(s.core, s.resolve("a/main"), "a.c")


def test_api_round_trips(tmp_path):
    """The same functions in-process: safetensors out bit-exact, torch file in exact, two
    Hugging Face folders in with the shared blocks stored once."""
    inputs = write_inputs(tmp_path)
    with tsck.open_store(tmp_path / "s", block_size=BS, inline_threshold=256) as s:
        state = tensor_state()
        s.put_snapshot(state, ref="st/main")
        r = export_file(s, "st/main", tmp_path / "st.safetensors")
        got = load_file(str(tmp_path / "st.safetensors"))
        want, _plain = flat_tensors(state)
        assert r["tensors"] == len(want) == len(got)
        for k, t in want.items():
            same_tensor(t, got[k], k)
        # numpy arrays go in as tensors of the same values (big-endian ones in native order)
        arrays = {"be": np.arange(12, dtype=">f4").reshape(3, 4), "fo": np.asfortranarray(np.arange(6.0).reshape(2, 3))}
        s.put_snapshot(arrays, ref="np/main")
        export_file(s, "np/main", tmp_path / "np.safetensors")
        got = load_file(str(tmp_path / "np.safetensors"))
        for k, a in arrays.items():
            assert got[k].dtype == torch.from_numpy(a.astype(a.dtype.newbyteorder("="))).dtype
            assert np.array_equal(got[k].numpy(), a), k
        s.put_snapshot({"u": np.array(["x", "y"])}, ref="str/main")
        with pytest.raises(UnsupportedType, match="numpy array of str32 at u"):
            export_file(s, "str/main", tmp_path / "str.safetensors")
        import_files(s, "imp/torch", [tmp_path / "ckpt.pt"], step=7)
        assert_same(inputs["torch_state"], s.checkout("imp/torch"))
    with tsck.open_store(tmp_path / "hf", block_size=BS, inline_threshold=256, compression="none") as s:
        a = import_files(s, "hf/base", [tmp_path / "hf_a"])
        b = import_files(s, "hf/tuned", [tmp_path / "hf_b"])
        head = inputs["hf_b"]["lm_head.weight"]
        head_bytes = head.numel() * head.element_size()
        assert a.bytes_total == b.bytes_total and b.bytes_new == head_bytes
        got = s.checkout("hf/tuned")
        for k, t in inputs["hf_b"].items():
            same_tensor(t, got[k], k)
        # stored once: the blocks on disk are one model plus the second head (and frame headers)
        d = s.du()
        assert a.bytes_total + head_bytes <= d["block_bytes"] < a.bytes_total + head_bytes + 64 * d["blocks"]
        assert d["logical_bytes"] == 2 * a.bytes_total


@pytest.mark.parametrize("files, exc, words", [
    (["truncated.safetensors"], InvalidArgument, "not a readable safetensors file"),
    (["ckpt_trunc.pt"], InvalidArgument, "not a readable torch.save file"),
    (["pickled.pt"], UnsupportedType, "needs pickle"),
    (["nope.pt"], InvalidArgument, "no such file"),
    (["notes.txt"], InvalidArgument, "neither"),
    (["hf_bad"], InvalidArgument, "a shard is a file in the model's folder"),
    (["hf_none"], InvalidArgument, "not a Hugging Face model folder"),
    (["hf_b", "hf_b/model.safetensors"], InvalidArgument, "in both"),
    (["ok.safetensors", "ckpt.pt", "pickled.pt"], UnsupportedType, "needs pickle"),
])
def test_api_bad_inputs_change_nothing(tmp_path, files, exc, words):
    write_inputs(tmp_path)
    with tsck.open_store(tmp_path / "s") as s:
        s.put_snapshot({"w": torch.ones(10000)}, ref="a/main")
        before = (object_listing(tmp_path / "s"), refs_snapshot(s))
        with pytest.raises(exc, match=words):
            import_files(s, "imp/main", [tmp_path / f for f in files])
        assert (object_listing(tmp_path / "s"), refs_snapshot(s)) == before


# ---------------------------------------------------------------- hostile torch.save zips, reserved names
def _torch_zip(path, state) -> None:
    torch.save(state, path)
    assert zipfile.is_zipfile(path)


def _rewrite_records(src, dst, *, method=zipfile.ZIP_STORED, cut=0) -> None:
    """A copy of the torch.save zip `src` whose tensor records (ARCHIVE/data/N) are stored
    by `method` (DEFLATE: compressed) and each cut short by `cut` bytes; every other
    record as it was. Python's zipfile writes a well-formed zip: only those records differ."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if re.fullmatch(r"[^/]+/data/\d+", info.filename):
                zout.writestr(info.filename, data[:len(data) - cut], compress_type=method)
            else:
                zout.writestr(info.filename, data, compress_type=zipfile.ZIP_STORED)


def _hostile_state():
    # A record that deflates well before one that does not: an mmap read of the first past
    # its compressed bytes lands inside the file (on the second's), not past its end.
    return {"a": torch.arange(1.0, 1001.0), "b": rand_tensor(torch.float32, (4096,), seed=7)}


def test_a_compressed_tensor_record_is_refused_not_stored_as_its_compressed_bytes(tmp_path):
    """torch.load reads a DEFLATE-compressed record right (1, 2, 3, ...); the mmap load
    read its compressed bytes as the tensor's, and import stored those. Now refused
    by name, nothing published."""
    state = _hostile_state()
    _torch_zip(tmp_path / "ok.pt", state)
    _rewrite_records(tmp_path / "ok.pt", tmp_path / "deflated.pt", method=zipfile.ZIP_DEFLATED)
    assert_same(state, torch.load(tmp_path / "deflated.pt", weights_only=True))  # a file torch reads
    with tsck.open_store(tmp_path / "s") as s:
        s.put_snapshot({"w": torch.ones(10)}, ref="a/main")
        before = (object_listing(tmp_path / "s"), refs_snapshot(s))
        with pytest.raises(InvalidArgument, match=r"deflated\.pt holds the tensor record \S+/data/0 compressed"):
            import_files(s, "imp/main", [tmp_path / "deflated.pt"])
        assert (object_listing(tmp_path / "s"), refs_snapshot(s)) == before
        import_files(s, "imp/main", [tmp_path / "ok.pt"])  # the same tensors, stored as torch.save stores them
        assert_same(state, s.checkout("imp/main"))


def test_a_tensor_record_cut_short_is_refused_not_read_into_the_zip_entries_after_it(tmp_path):
    """A record 8 bytes short of its tensor: torch.load refuses the file; the mmap load
    took the next zip entry's header as the tensor's last two floats."""
    _torch_zip(tmp_path / "ok.pt", _hostile_state())
    _rewrite_records(tmp_path / "ok.pt", tmp_path / "short.pt", cut=8)
    with pytest.raises(RuntimeError, match="does not match expected size"):
        torch.load(tmp_path / "short.pt", weights_only=True)
    with tsck.open_store(tmp_path / "s") as s:
        before = (object_listing(tmp_path / "s"), refs_snapshot(s))
        with pytest.raises(InvalidArgument, match=r"short\.pt is not a readable torch.save file: its record "
                                                  r"\S+/data/0 holds 3992 bytes where its tensor needs 4000"):
            import_files(s, "imp/main", [tmp_path / "short.pt"])
        assert (object_listing(tmp_path / "s"), refs_snapshot(s)) == before


def test_a_blocked_global_is_named(tmp_path):
    """torch.load's first line for a global of a blocked module (os, sys) is "Weights only
    load failed..."; the error names the global, as for any other refused one."""
    torch.save({"w": torch.ones(3), "f": os.getcwd}, tmp_path / "blocked.pt")
    with tsck.open_store(tmp_path / "s") as s:
        with pytest.raises(UnsupportedType, match=r"blocked\.pt needs pickle to load \(it holds (posix|nt)\.getcwd"):
            import_files(s, "imp/main", [tmp_path / "blocked.pt"])
        assert s.refs() == {}


@pytest.mark.parametrize("where", ["top", "path", "folder", "folder-path"])
def test_a_tensor_named_like_the_safetensors_metadata_is_refused_before_writing(tmp_path, where):
    """A tensor at `__metadata__` made a safetensors header with two `__metadata__` keys (or
    a tensor where the metadata's strings belong): a file no reader opens, exit 0. Refused
    from the manifest, before a block is read, and nothing is written."""
    big = torch.ones(4096)  # stored in blocks, not inline
    state = {"__metadata__": big, "w": torch.zeros(2), "sub": {"__metadata__": big + 1}}
    dest = {"top": tmp_path / "out" / "m.safetensors", "path": tmp_path / "out" / "m.safetensors",
            "folder": str(tmp_path / "out" / "model") + os.sep, "folder-path": str(tmp_path / "out" / "model") + os.sep}[where]
    path = {"top": None, "path": None, "folder": None, "folder-path": "sub"}[where]
    if where == "path":
        state = {"x": {"__metadata__": big}}  # a nested one keeps its dotted name: x.__metadata__
    (tmp_path / "out").mkdir()
    p = tmp_path / "s"
    with tsck.open_store(p, block_size=BS, inline_threshold=256) as s:
        s.put_snapshot(state, ref="a/main")
    if where == "path":
        with tsck.open_store(p, create=False) as s:  # not reserved once it has a prefix: written, and it opens
            export_file(s, "a/main", dest, path="x")
        assert load_file(str(dest))["x.__metadata__"].equal(big)
        return
    shutil.rmtree(p / "blocks")  # refused from the manifest: no block is needed
    with tsck.open_store(p, create=False) as s:
        with pytest.raises(UnsupportedType, match=r"would be named '__metadata__', which safetensors reserves"):
            export_file(s, "a/main", dest, path=path)
    assert os.listdir(tmp_path / "out") == []


def test_cli_hostile_imports_and_reserved_names_are_one_line_errors(tmp_path):
    """Through the real entry point: exit 2, one line, no traceback, nothing published."""
    _torch_zip(tmp_path / "ok.pt", _hostile_state())
    _rewrite_records(tmp_path / "ok.pt", tmp_path / "deflated.pt", method=zipfile.ZIP_DEFLATED)
    _rewrite_records(tmp_path / "ok.pt", tmp_path / "short.pt", cut=8)
    torch.save({"w": torch.ones(3), "f": os.getcwd}, tmp_path / "blocked.pt")
    p = tmp_path / "s"
    with tsck.open_store(p) as s:
        s.put_snapshot({"__metadata__": torch.ones(3)}, ref="m/main")
        before = (object_listing(p), refs_snapshot(s))
    out = tmp_path / "out"
    out.mkdir()
    argvs = {"deflated": ("import", p, "imp/main", tmp_path / "deflated.pt"),
             "short": ("import", p, "imp/main", tmp_path / "short.pt"),
             "blocked": ("import", p, "imp/main", tmp_path / "blocked.pt"),
             "st": ("checkout", p, "m/main", out / "m.safetensors"),
             "folder": ("checkout", p, "m/main", str(out / "model") + os.sep)}
    with ThreadPoolExecutor(max_workers=len(argvs)) as ex:
        res = dict(zip(argvs, ex.map(lambda a: run_cli(*a), argvs.values())))
    words = {"deflated": "compressed", "short": "holds 3992 bytes where its tensor needs 4000",
             "blocked": "getcwd", "st": "__metadata__", "folder": "__metadata__"}
    for k, r in res.items():
        assert r.returncode == 2, f"{k}: rc={r.returncode}\n{r.stdout}\n{r.stderr}"
        assert "Traceback" not in r.stdout + r.stderr, f"{k}: {r.stderr}"
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("tsck: error: ") and words[k] in lines[0], f"{k}: {r.stderr}"
    with tsck.open_store(p, create=False) as s:
        assert (object_listing(p), refs_snapshot(s)) == before
    assert os.listdir(out) == []


def test_a_safetensors_file_whose_header_length_begins_with_0x80_is_read_as_safetensors(tmp_path):
    """A header of 384 bytes begins the file with 0x80, the byte that begins a pickle: the
    file was taken for a legacy torch file (torch.load itself reads it as safetensors
    only when its name ends in .safetensors, which the name of an open file does not)."""
    t = {"w": torch.arange(6.0)}
    for n in range(512):  # a metadata value that makes the header's length 0x?80
        save_file(t, str(tmp_path / "w.bin"), metadata={"pad": "x" * n})
        head = (tmp_path / "w.bin").read_bytes()[:9]
        if head[0] == 0x80:
            break
    assert head[0] == 0x80 and head[8:9] == b"{"
    with tsck.open_store(tmp_path / "s") as s:
        import_files(s, "imp/main", [tmp_path / "w.bin"])
        assert s.checkout("imp/main")["w"].equal(t["w"])
