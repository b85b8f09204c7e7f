"""One process's view of a collective snapshot is the union of the ranks' trees.

Three real gloo ranks (tests/helpers/pipeline_worker.py) put one snapshot: `stage0`
sharded over ranks 0-1 (tsck.Sharded rows), `stage1` over ranks 1-2 (a DTensor on the
mesh [1, 2]: a pipeline stage of which rank 0 holds no piece), rank-local values on every
rank and `stage1_meta` only on ranks 1-2. Every surface that shows that snapshot in one
process must show both stages whole (checkout, paths=, into=, `tsck ls`, `tsck checkout`
to safetensors and torch files, `tsck diff`), and 2 ranks resuming it into live targets
must find stage1. A path one tree cannot show (a rank-local value on rank 0, a sharded
tensor on ranks 1-2) is refused by name, never dropped. The expected data is computed
here (pipeline_worker.global_tensor), not read back from the store.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from _util import load_helper, rank_results, run_worker_scenario

import tensorstore_ck as tsck
from tensorstore_ck import cli

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parents[1]
WORKER = HERE / "helpers" / "pipeline_worker.py"
pw = load_helper(WORKER, sibling_imports=True)


def whole(name: str) -> torch.Tensor:
    return pw.global_tensor(name)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _one_snapshot(tmp_path_factory, scenario: str, phase: str, world: int) -> Path:
    """OUT of SCENARIO, whose PHASE's WORLD ranks saved one snapshot together."""
    out = run_worker_scenario(WORKER, tmp_path_factory.mktemp(scenario), scenario, limit=240)
    saved = rank_results(out, phase, world, exit_zero=True)
    assert len({r["root"] for r in saved}) == 1
    return out


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> Path:
    """OUT of the "pipeline" scenario: the 3-rank put, then the 2-rank resume (OUT/store)."""
    return _one_snapshot(tmp_path_factory, "pipeline", "save", 3)


@pytest.fixture(scope="module")
def conflict(tmp_path_factory) -> Path:
    out = run_worker_scenario(WORKER, tmp_path_factory.mktemp("ppc"), "conflict", limit=240)
    rank_results(out, "conflict", 3, exit_zero=True)
    return out


@pytest.fixture(scope="module")
def stages(tmp_path_factory) -> Path:
    """OUT of the "stages" scenario: 2 pipeline stages with their own module names."""
    return _one_snapshot(tmp_path_factory, "stages", "stages", 2)


def tsck_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    got = capsys.readouterr()
    return rc, got.out, got.err


def test_one_process_checkout_is_the_union_of_the_ranks_trees(pipeline):
    with tsck.open_store(pipeline / "store") as s:
        st = s.checkout(pw.REF)
    assert set(st) == {"stage0", "stage1", "stage1_meta", "step", "who"}
    for name in pw.STAGES:
        assert isinstance(st[name], torch.Tensor) and same(st[name], whole(name)), name
    assert st["who"] == "rank0"  # rank-local: rank 0's
    assert st["stage1_meta"] == {"lr": 0.25, "micro_batches": 4}  # only ranks 1-2: the lowest's
    assert st["step"] == 7


def test_checkout_of_paths_and_into_in_one_process(pipeline):
    with tsck.open_store(pipeline / "store") as s:
        got = s.checkout(pw.REF, paths=["stage1"])
        assert list(got) == ["stage1"] and same(got["stage1"], whole("stage1"))
        assert s.checkout(pw.REF, paths=["stage1_meta.lr"]) == {"stage1_meta": {"lr": 0.25}}
        shape, dtype, _h = pw.STAGES["stage1"]
        into = {"stage1": torch.zeros(shape, dtype=dtype), "stage0": torch.zeros(pw.STAGES["stage0"][0])}
        assert s.checkout(pw.REF, into=into) is into
        assert same(into["stage1"], whole("stage1")) and same(into["stage0"], whole("stage0"))
        # a region of stage1 as a piece, in one process: only ranks 1-2 hold it
        piece = tsck.Sharded(torch.zeros((10,) + shape[1:], dtype=dtype), shape, (10, 0))
        s.checkout(pw.REF, into={"stage1": piece})
        assert same(piece.local, whole("stage1")[10:20])


def test_ls_lists_every_stage(pipeline, capsys):
    rc, out, err = tsck_cli(capsys, "ls", pipeline / "store", pw.REF, "--json")
    assert rc == 0, err
    got = json.loads(out)
    entries = {e["path"]: e for e in got["entries"]}
    assert got["tensors"] == 2
    assert entries["stage1"]["kind"] == "sharded" and entries["stage1"]["shape"] == [30, 300]
    assert entries["stage1"]["dtype"] == "bfloat16" and entries["stage1"]["bytes"] == 30 * 300 * 2
    assert entries["stage1_meta.lr"]["value"] == 0.25 and entries["who"]["value"] == "rank0"
    rc, out, err = tsck_cli(capsys, "ls", pipeline / "store", pw.REF, "stage1", "--json")
    assert rc == 0, err
    assert [e["path"] for e in json.loads(out)["entries"]] == ["stage1"]


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_export_holds_every_stage(pipeline, tmp_path, capsys, fmt):
    dest = tmp_path / ("m.safetensors" if fmt == "safetensors" else "m.pt")
    rc, _out, err = tsck_cli(capsys, "checkout", pipeline / "store", pw.REF, dest, "--format", fmt)
    assert rc == 0, err
    if fmt == "safetensors":
        from safetensors.torch import load_file
        got = load_file(str(dest))
        assert set(got) == {"stage0", "stage1"}
    else:
        got = torch.load(dest, weights_only=True)
        assert set(got) == {"stage0", "stage1", "stage1_meta", "step", "who"}
    for name in pw.STAGES:
        assert same(got[name], whole(name)), name


def test_diff_names_stage1(pipeline, capsys):
    """diff walks every rank's tree: stage1 is a tensor of the snapshot like stage0."""
    with tsck.open_store(pipeline / "store") as s:
        s.put_snapshot({"stage0": whole("stage0")}, "pp/one")
    rc, out, err = tsck_cli(capsys, "diff", pipeline / "store", "pp/one", pw.REF, "--json")
    assert rc == 0, err
    d = json.loads(out)
    assert d["added"] == ["stage1"] and [c["path"] for c in d["changed"]] == ["stage0"]


def test_two_ranks_resume_the_three_rank_pipeline_into_live_targets(pipeline):
    res = rank_results(pipeline, "resume2", 2, exit_zero=True)
    for r, got in enumerate(res):
        assert "error_type" not in got, f"rank {r}: {got['error_type']}: {got['error_text']}"
        assert got["step"] == 7
        local = torch.load(pipeline / f"resume2_rank{r}.pt", weights_only=True)
        for name, (shape, _dt, _h) in pw.STAGES.items():
            a, b = pw.rows(shape[0], 2, r)
            assert got["offsets"][name] == [a, 0]
            assert same(local[name], whole(name)[a:b]), (r, name)


def test_what_one_tree_cannot_show_is_refused_by_path(conflict, tmp_path, capsys):
    """`x` is an int on rank 0 and a tensor sharded over ranks 1-2: one tree cannot hold
    both, and neither may be dropped. paths= around it still reads the rest."""
    store = conflict / "store"
    with tsck.open_store(store) as s:
        with pytest.raises(tsck.errors.CheckoutMismatch, match=r"\['x'\].*rank 0 holds a rank-local int.*"
                                                               r"rank 1 a sharded tensor float32 \[12, 64\]"):
            s.checkout(pw.CONFLICT_REF)
        assert s.checkout(pw.CONFLICT_REF, paths=["ok"]) == {"ok": 0}
    rc, _out, err = tsck_cli(capsys, "ls", store, pw.CONFLICT_REF)
    assert rc == 2 and "['x']" in err and "sharded tensor" in err
    rc, out, err = tsck_cli(capsys, "ls", store, pw.CONFLICT_REF, "ok", "--json")
    assert rc == 0, err
    assert [e["path"] for e in json.loads(out)["entries"]] == ["ok"]
    dest = tmp_path / "c.safetensors"
    rc, _out, err = tsck_cli(capsys, "checkout", store, pw.CONFLICT_REF, dest)
    assert rc == 2 and "['x']" in err and not dest.exists()


def test_dcp_load_in_one_process_finds_stage1(pipeline):
    """TsckReader's metadata is every rank's tree merged: dcp.load without a process group
    fills both stages."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from tensorstore_ck.dcp import TsckReader
    sd = {name: torch.zeros(shape, dtype=dtype) for name, (shape, dtype, _h) in pw.STAGES.items()}
    with tsck.open_store(pipeline / "store") as s, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # DCP: "assuming the intent is to load in a single process"
        dcp.load(sd, storage_reader=TsckReader(s, pw.REF))
    for name in pw.STAGES:
        assert same(sd[name], whole(name)), name


def test_stages_that_name_their_modules_alike_are_refused_by_path_not_dropped(stages, tmp_path, capsys):
    """Stage 0's `0.weight` is [16, 8], stage 1's [32, 16]: one tree cannot show both, and
    showing stage 0's would drop stage 1's (an export mixing stage 0's `0.*` with stage 1's
    `1.*` and `2.*`). Every one-process surface refuses it by name; what the ranks hold alike
    (a per-rank tensor of one shape, the step) still reads; each rank's collective checkout
    gets its own stage."""
    store = stages / "store"
    want = (r"\['model'\]\['0\.weight'\].*rank 0 holds a rank-local tensor float32 \[16, 8\].*"
            r"rank 1 a rank-local tensor float32 \[32, 16\]")
    with tsck.open_store(store) as s:
        with pytest.raises(tsck.errors.CheckoutMismatch, match=want):
            s.checkout(pw.STAGES_REF)
        with pytest.raises(tsck.errors.CheckoutMismatch, match=r"\['model'\]\['0\.weight'\]"):
            s.checkout(pw.STAGES_REF, paths=["model.0.weight"])
        got = s.checkout(pw.STAGES_REF, paths=["rng", "step"])
        assert same(got["rng"], pw.stage_state(0)["rng"]) and got["step"] == 5  # rank 0's, as before
    rc, _out, err = tsck_cli(capsys, "ls", store, pw.STAGES_REF)
    assert rc == 2 and "['model']['0.weight']" in err and "[32, 16]" in err, err
    for argv, dest in ((("export-weights",), tmp_path / "w.safetensors"), (("checkout",), tmp_path / "all.pt")):
        rc, _out, err = tsck_cli(capsys, *argv, store, pw.STAGES_REF, dest)
        assert rc == 2 and "['model']['0.weight']" in err and not dest.exists(), (argv, err)
    for r in range(2):
        got = torch.load(stages / f"stages_rank{r}.pt", weights_only=True)
        mine = pw.stage_state(r)
        assert list(got["model"]) == list(mine["model"]), r
        assert all(same(got["model"][k], v) for k, v in mine["model"].items()), r
        assert same(got["rng"], mine["rng"]) and got["step"] == 5
