"""What the package logs at INFO: one line per committed snapshot and one per restore
(what it resumed from and where it read it: the local tier, peer replicas, the remote
store or a store without tiers), plus what needs the user (warnings). Everything a
training job does on its own besides (background prunes and their gc phases, fence
waits, re-validations, uploads) is DEBUG, so a job's INFO log reads as its history."""

from __future__ import annotations

import logging
import shutil

import torch

import tensorstore_ck as tsck
from tensorstore_ck.train import CheckpointManager, TrainState

STEPS = 16


def _info(caplog) -> list:
    return [r for r in caplog.records if r.name.startswith("tensorstore_ck") and r.levelno == logging.INFO]


def _event(records: list, event: str) -> list:
    return [r for r in records if getattr(r, "tsck", {}).get("event") == event]


def _text(records: list) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in records]


def _restore(store: tsck.Store, job: str) -> tuple[int | None, torch.nn.Module]:
    model = torch.nn.Linear(64, 64)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    mgr = CheckpointManager(store, job=job, state=TrainState(model=model))
    try:
        return mgr.restore_latest(), model
    finally:
        mgr.close()


def test_a_manager_run_logs_one_info_line_per_snapshot_and_one_per_restore(tmp_path, caplog):
    """Sixteen asynchronous snapshots, a snapshot every step and keep_last=2, so the
    manager's background prune runs after each commit (gc deletion phases, the writers
    they fence): at INFO, exactly the sixteen committed lines, in step order. A
    restore_latest is then one INFO line naming the ref, the step, the root and the
    store it was read from."""
    caplog.set_level(logging.INFO, logger="tensorstore_ck")
    torch.manual_seed(0)
    with tsck.open_store(tmp_path / "s") as store:
        model = torch.nn.Linear(64, 64)
        mgr = CheckpointManager(store, job="run", state=TrainState(model=model), every_steps=1,
                                retention=tsck.Retention(keep_last=2))
        for step in range(1, STEPS + 1):
            with torch.no_grad():
                model.weight.add_(torch.randn_like(model.weight))
            mgr.step(step)
        mgr.close()
        # Prunes ran (their gc phases log at DEBUG); the newest may have found nothing left,
        # so that they deleted is shown at the end: an offline gc finds nothing to delete.
        assert mgr.prune_errors == [] and mgr.last_prune is not None
        assert [i.step for i in store.log("run/main")] == [STEPS, STEPS - 1]
        info = _info(caplog)
        committed = _event(info, "committed")
        assert [r.tsck["step"] for r in committed] == list(range(1, STEPS + 1)), _text(info)
        assert len(info) == STEPS, _text([r for r in info if r not in committed])
        for r in committed:
            msg = r.getMessage()
            assert f"step {r.tsck['step']}" in msg and r.tsck["root"][:16] in msg and " new)" in msg
            assert " in " in msg and "(stall " in msg, msg

        want = store.show("run/main")
        caplog.clear()
        step, got = _restore(store, "run")
        assert step == STEPS and torch.equal(got.weight, model.weight)
        info = _info(caplog)
        assert len(info) == 1, _text(info)
        (r,) = _event(info, "restored")
        assert (r.tsck["ref"], r.tsck["step"], r.tsck["root"], r.tsck["source"]) == ("run/main", STEPS, want.root,
                                                                                   "store")
        msg = r.getMessage()
        assert f"ref run/main step {STEPS}" in msg and want.root[:16] in msg and store.url in msg, msg
        assert store.gc().deleted_objects == 0


def test_a_tiered_restore_says_which_tier_it_read(tmp_path, caplog):
    """A store with a local tier: a restore whose snapshot the tier holds says "local
    tier"; after the node's tier is lost (its directory deleted), the same restore reads
    the remote store's copy and says so, with the remote's URL (the missing objects are
    the WARNING they were: one line)."""
    remote, local = tmp_path / "remote", tmp_path / "nvme"
    torch.manual_seed(1)
    model = torch.nn.Linear(64, 64)
    with tsck.open_store(str(remote), local=str(local)) as store:
        mgr = CheckpointManager(store, job="job", state=TrainState(model=model), every_steps=1)
        for step in (1, 2):
            with torch.no_grad():
                model.weight.add_(torch.randn_like(model.weight))
            mgr.step(step)
        mgr.close()
        assert store.wait_durable(timeout=60)
        root = store.show("job/main").root
        caplog.set_level(logging.INFO, logger="tensorstore_ck")
        step, got = _restore(store, "job")
        assert step == 2 and torch.equal(got.weight, model.weight)
        info = _info(caplog)
        assert len(info) == 1, _text(info)
        (r,) = _event(info, "restored")
        assert (r.tsck["ref"], r.tsck["step"], r.tsck["root"], r.tsck["source"]) == ("job/main", 2, root, "local")
        assert "from the local tier" in r.getMessage() and "remote" not in r.getMessage(), r.getMessage()
    shutil.rmtree(local)
    caplog.clear()
    with tsck.open_store(str(remote), local=str(local)) as store:
        step, got = _restore(store, "job")
        assert step == 2 and torch.equal(got.weight, model.weight)
        remote_url = store.remote_core.url
    info = _info(caplog)
    assert len(info) == 1, _text(info)
    (r,) = _event(info, "restored")
    assert (r.tsck["ref"], r.tsck["step"], r.tsck["root"], r.tsck["source"]) == ("job/main", 2, root, "remote")
    msg = r.getMessage()
    assert "from the remote store at " + remote_url in msg and "local tier" not in msg, msg
    assert len([r for r in caplog.records if r.levelno == logging.WARNING and "is missing" in r.getMessage()]) == 1
