"""tensorstore_ck.torchtitan: torchtitan's own CheckpointManager (TsckCheckpointManager, its
subclass) on 2 real gloo ranks with FSDP2 on CPU, built and driven as torchtitan's Trainer
does (tests/helpers/titan_manager.py forks the ranks): SIGKILL mid-run and inside the
writer's finish, then a resume bit-identical to an uninterrupted run, in each async mode
that runs on CPU ("disabled", "async"; "async_with_pinned_mem" needs an accelerator for its
pinned buffers); keep_latest_k as the job's retention; load_step; exclude_from_loading;
the initial load from a folder. The fast tests: one process, bad input refused with the
project's errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _util import rank_results, run_worker_scenario, same_bits

import tensorstore_ck as tsck

HERE = Path(__file__).resolve().parents[1]
WORKER = HERE / "helpers" / "titan_manager.py"
REF = "titan/main"
LAST, KILL_AT = 6, 4


def kept(store: Path) -> list[int]:
    with tsck.open_store(store, create=False) as s:
        return sorted(e.step for e in s.log(REF))


def dumped(out: Path, phase: str) -> dict:
    return torch.load(out / f"{phase}.pt", weights_only=False)


def assert_same_state(want: dict, got: dict, what: str) -> None:
    assert sorted(want) == sorted(got), what
    for k in want:
        assert same_bits(want[k], got[k]), f"{what}: {k} differs"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return run_worker_scenario(WORKER, tmp_path_factory.mktemp("titan"), "base", limit=300.0)


@pytest.fixture(scope="module", params=["disabled", "async"])
def killed(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, run_worker_scenario(WORKER, tmp_path_factory.mktemp("titan"), request.param, limit=300.0)


@pytest.mark.slow
def test_uninterrupted_run_snapshots_every_interval_and_keep_latest_k_is_retention(base):
    ranks = rank_results(base, "straight", 2)
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == LAST
    assert kept(base / "straight") == [LAST - 2, LAST]  # keep_latest_k=2: steps 2 pruned
    with tsck.open_store(base / "straight", create=False) as s:
        assert s.fsck(full=True).ok  # the pruned snapshot went whole, the kept ones are whole


@pytest.mark.slow
def test_resume_after_sigkill_is_bit_identical(base, killed):
    """kstep: rank 1 SIGKILLed right after save(4) returned (the job with it, as torchrun does);
    kfinish: rank 0 killed inside the writer's finish of step 4, before its commit. A fresh job
    resumes from the newest committed snapshot (4 after kstep in "disabled"; 4 or 2 in "async",
    whose step-4 save may still have been in the background; 2 after kfinish) and its losses,
    parameters, Adam moments, LR and train state equal the uninterrupted run's bit for bit."""
    mode, out = killed
    straight = rank_results(base, "straight", 2)[0]["losses"]
    at = dumped(base, "straight")
    for kill in ("step", "finish"):
        rank_results(out, f"k{kill}", 2, dead=(0, 1))
        got = rank_results(out, f"r{kill}", 2)
        start = got[0]["start"]
        if kill == "finish":
            assert start == KILL_AT - 2, (mode, kill, start)
        elif mode == "disabled":
            assert start == KILL_AT, (mode, kill, start)
        else:
            assert start in (KILL_AT - 2, KILL_AT), (mode, kill, start)
        for d in got:
            assert d["start"] == start
            assert d["first_index"] == start * 8, "the data loader resumes at its position"
            assert d["losses"] == {str(s): straight[str(s)] for s in range(start + 1, LAST + 1)}, (mode, kill)
        run = dumped(out, f"r{kill}")
        assert_same_state(at[start], run["restored"], f"{mode} {kill}: restored")
        assert_same_state(at["final"], run["final"], f"{mode} {kill}: final")
        assert kept(out / f"store_{kill}") == [LAST - 2, LAST]


@pytest.mark.slow
def test_load_step_and_exclude_from_loading(base):
    """load(step=2) of a step retention dropped is RefNotFound; load(step=4) restores step 4
    and training on reproduces steps 5-6; exclude_from_loading=["dataloader"] restores all
    but the loader, which starts at its first sample."""
    at = dumped(base, "straight")
    straight = rank_results(base, "straight", 2)[0]["losses"]
    pick = dumped(base, "pick")
    for d in rank_results(base, "pick", 2):
        assert d["pruned_error"] == "RefNotFound"
        assert d["start"] == KILL_AT and d["first_index"] == KILL_AT * 8
        assert d["losses"] == {str(s): straight[str(s)] for s in (5, 6)}
        assert d["excluded_first_index"] == 0
    assert_same_state(at[KILL_AT], pick["restored"], "load_step")
    assert_same_state(at["final"], pick["final"], "load_step, trained on")
    assert_same_state(at[KILL_AT], pick["excluded"], "exclude_from_loading")
    assert kept(base / "pick") == [LAST - 2, LAST]  # load_only: nothing saved


@pytest.mark.slow
def test_initial_load_from_a_folder_then_resume_from_the_store(base):
    for d in rank_results(base, "initial", 2):
        assert d["loaded"] and d["same_as_seed"], "a job with no snapshot starts from initial_load_path"
        assert d["reloaded"] and d["restart_step"] == LAST and not d["restart_same_as_seed"], \
            "once the job has a snapshot, a restart resumes from the store, not from the folder"
    assert kept(base / "initial") == [LAST]


# -- one process ----------------------------------------------------------------------

def _build(where, **kw):
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from tensorstore_ck.torchtitan import TsckCheckpointManager
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opts = OptimizersContainer(OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="Adam", optimizer_kwargs={"lr": 0.1})],
        implementation="for-loop"), model_parts=[model])
    cfg = TsckCheckpointManager.Config(**{"enable": True, "store": str(where), "job": "one", "interval": 1,
                                          "keep_latest_k": 2, **kw})
    return model, opts, cfg.build(dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=None,
                                  states={}, sd_adapter=None)


def test_one_process_saves_prunes_and_resumes(tmp_path):
    model, opts, mgr = _build(tmp_path / "s")
    assert mgr.load(step=-1) is False  # a fresh start
    for step in range(1, 5):
        model(torch.ones(2, 4)).sum().backward()
        opts.step()
        opts.zero_grad()
        mgr.save(step)
    mgr.close()
    model2, _opts2, mgr2 = _build(tmp_path / "s")
    assert mgr2.load(step=-1) is True
    assert same_bits(model.weight.detach(), model2.weight.detach())
    mgr2.close()
    assert [e.step for e in tsck.open_store(tmp_path / "s", create=False).log("one/main")] == [4, 3]


@pytest.mark.parametrize("kw, err, words", [
    ({"store": ""}, tsck.errors.InvalidArgument, "checkpoint.store"),
    ({"job": "a/b"}, tsck.errors.InvalidArgument, "checkpoint.job"),
    ({"job": ""}, tsck.errors.InvalidArgument, "checkpoint.job"),
    ({"last_save_in_hf": True}, tsck.errors.InvalidArgument, "export-weights"),
    ({"exclude_from_loading": ["nope"]}, tsck.errors.InvalidArgument, "nope"),
])
def test_bad_settings_are_refused_with_the_projects_errors(tmp_path, kw, err, words):
    with pytest.raises(err, match=words):
        _build(tmp_path / "s", **kw)


def test_a_load_step_the_store_does_not_keep_is_ref_not_found(tmp_path):
    _model, _opts, mgr = _build(tmp_path / "s")
    with pytest.raises(tsck.RefNotFound):
        mgr.load(step=7)
    mgr.close()


def test_an_initial_load_path_that_is_not_a_folder_is_refused(tmp_path):
    _model, _opts, mgr = _build(tmp_path / "s", initial_load_path=str(tmp_path / "missing"))
    with pytest.raises(tsck.errors.InvalidArgument, match="initial_load_path"):
        mgr.load(step=-1)
    mgr.close()
