"""Asynchronous CheckpointManagers close what they open: a run of several, each pruning
its job as it trains (gc's candidate spool, a temporary file per prune), and a dry-run
gc after them, leave no ResourceWarning behind once the collector has run.

A warning raised by a finalizer is not an exception at the call that leaked, so it is
recorded (warnings.catch_warnings, every ResourceWarning shown) across gc.collect().
"""

from __future__ import annotations

import gc
import warnings

import torch

import tensorstore_ck as tsck


def _unclosed(fn) -> list[str]:
    """The ResourceWarnings raised while fn runs and after, once the collector has run."""
    gc.collect()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always", ResourceWarning)
        fn()
        gc.collect()
        gc.collect()
    return [str(w.message) for w in got if issubclass(w.category, ResourceWarning)]


def test_async_managers_with_prune_leave_no_unclosed_file(tmp_path):
    def run():
        with tsck.open_store(tmp_path / "store") as store:
            for j in range(4):
                torch.manual_seed(j)
                model = torch.nn.Linear(8, 8)
                ts = tsck.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
                mgr = tsck.CheckpointManager(store, job=f"job{j}", state=ts, every_steps=1,
                                             retention=tsck.Retention(keep_last=2))
                assert mgr.async_
                for step in range(1, 6):
                    with torch.no_grad():
                        model.weight.add_(1.0)
                    mgr.step(step)
                mgr.close()
                assert mgr.prune_errors == []
                assert mgr.last_prune is not None  # prunes ran (which one deleted what: timing)
                assert [e.step for e in store.log(f"job{j}/main")] == [5, 4]
            assert store.gc(dry_run=True).candidates == 0
    assert _unclosed(run) == []


def test_cli_gc_leaves_no_unclosed_file(tmp_path, capsys):
    from tensorstore_ck.cli import main
    url = str(tmp_path / "store")
    with tsck.open_store(url) as store:
        for step in (1, 2, 3):
            store.put_snapshot({"w": torch.full((64,), float(step))}, ref="a/main", job="a", step=step)
        store.set_retention("a", tsck.Retention(keep_last=1))

    def run():
        assert main(["gc", url, "--dry-run"]) == 0
        assert main(["gc", url]) == 0
    assert _unclosed(run) == []
    assert "deleted" in capsys.readouterr().out
