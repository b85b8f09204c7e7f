"""`tsck goodput` and the model behind it (tensorstore_ck/goodput.py): the goodput of a run
from its stall, time to durable, interval, restart and MTBF, and the interval that
maximises it; the stall and interval read from a ref's recorded snapshots in a real store.

The model's optimum is checked against the model itself (no interval in a fine grid does
better), not against a number copied from its formula."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.errors import InvalidArgument
from tensorstore_ck.goodput import goodput, goodput_at, parse_seconds

from _util import cli_here

Q = dict(stall=0.5, durable=2.0, restart=30.0, mtbf=7.9 * 3600)


def test_the_best_interval_is_the_models_maximum():
    g = goodput(**Q, interval=600.0)
    grid = [Q["durable"] + 0.25 * k for k in range(1, 40000)]
    best_on_grid = max(goodput_at(c, **Q)[0] for c in grid)
    assert g.best_goodput >= best_on_grid - 1e-9
    assert g.best_interval == pytest.approx(math.sqrt(2 * 0.5 * (Q["mtbf"] - 30.0 - 2.0)))
    assert not g.best_is_continuous
    # at a given interval: G = (c - δ)/c * (1 - (R + c/2 + S)/M)
    assert g.loss_per_failure == pytest.approx(30.0 + 300.0 + 2.0)
    assert g.goodput == pytest.approx((600 - 0.5) / 600 * (1 - 332.0 / Q["mtbf"]))


def test_a_store_that_stalls_nothing_is_best_snapshotted_continuously():
    """δ = 0 (an asynchronous snapshot that blocks nothing): c* = 0, below the time to
    durable, so the best interval is that time: the continuous trigger's."""
    g = goodput(stall=0.0, durable=5.0, restart=30.0, mtbf=3600.0)
    assert g.best_is_continuous and g.best_interval == 5.0
    assert g.best_goodput == pytest.approx(1 - (30 + 2.5 + 5) / 3600)


@pytest.mark.parametrize("kw, words", [
    (dict(stall=-1, restart=1, mtbf=10), "stall must be a number of seconds >= 0"),
    (dict(stall=1, restart=1, mtbf=0), "mtbf must be a number of seconds > 0"),
    (dict(stall=1, restart=1, mtbf=10, interval=0.5), "interval .* must be above the stall"),
    (dict(stall=1, restart=1, mtbf=10, durable=0.5), "durable .* must be at least the stall"),
    (dict(stall=float("nan"), restart=1, mtbf=10), "stall must be a number"),
])
def test_bad_quantities_are_refused(kw, words):
    with pytest.raises(InvalidArgument, match=words):
        goodput(**kw)


def test_durations_take_units():
    assert parse_seconds("7.9h", "--mtbf") == pytest.approx(28440.0)
    assert [parse_seconds(t, "x") for t in ("90", "90s", "1.5m", "1d")] == [90.0, 90.0, 90.0, 86400.0]
    with pytest.raises(InvalidArgument, match="--mtbf must be a duration"):
        parse_seconds("soon", "--mtbf")


def test_cli_from_options_prints_the_goodput_and_best_interval(capsys):
    rc, out, err = cli_here(capsys, "goodput", "--stall", "0.5", "--durable", "2", "--interval", "10m",
                            "--restart", "30", "--mtbf", "7.9h", "--json")
    assert rc == 0, err
    got = json.loads(out)
    want = goodput(**Q, interval=600.0)
    assert got["goodput"] == pytest.approx(want.goodput)
    assert got["best_interval"] == pytest.approx(want.best_interval)
    rc, out, _ = cli_here(capsys, "goodput", "--stall", "0.5", "--restart", "30", "--mtbf", "7.9h")
    assert rc == 0 and "best interval" in out and "Young/Daly" in out


@pytest.mark.parametrize("argv, words", [
    (["goodput", "--restart", "30", "--mtbf", "1h"], "needs the stall per snapshot"),
    (["goodput", "--stall", "1", "--restart", "30", "--mtbf", "soon"], "--mtbf must be a duration"),
    (["goodput", "--stall", "1", "--restart", "30"], "--mtbf"),
])
def test_cli_bad_input_is_a_usage_error(capsys, argv, words):
    rc, _out, err = cli_here(capsys, *argv)
    assert rc == 2 and words in err and "Traceback" not in err


def test_cli_reads_the_stall_and_interval_from_a_jobs_snapshots(tmp_path, capsys):
    """A manager's blocking snapshots at every step record their stall and seconds; the
    command takes their medians, and the interval between their commits."""
    path = tmp_path / "store"
    model = torch.nn.Linear(64, 64)
    with tsck.open_store(str(path)) as store:
        mgr = tsck.CheckpointManager(store, job="j", state=tsck.TrainState(model=model), every_steps=1, async_=False)
        for step in range(1, 6):
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.step(step)
        mgr.close()
        infos = store.log("j/main")
    rc, out, err = cli_here(capsys, "goodput", path, "j/main", "--restart", "30", "--mtbf", "1h", "--json")
    assert rc == 0, err
    got = json.loads(out)
    stalls = sorted(i.stall for i in infos)
    times = sorted(i.time for i in infos)
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    assert got["stall"] == pytest.approx(stalls[2])
    assert got["interval"] == pytest.approx((gaps[1] + gaps[2]) / 2)
    assert got["sources"]["stall"] == "median of 5 snapshots of j/main"
    rc, _out, err = cli_here(capsys, "goodput", path, "--restart", "30", "--mtbf", "1h")
    assert rc == 2 and "name the ref" in err


def _remote_down(remote) -> None:
    """The file remote away for real: a plain file where its directory was, so every
    write of an upload fails (ENOTDIR)."""
    remote.rename(remote.with_name("remote.away"))
    remote.write_bytes(b"")


def _remote_back(remote) -> None:
    remote.unlink()
    remote.with_name("remote.away").rename(remote)


def test_cli_times_a_tiered_snapshot_to_its_upload_and_a_local_only_one_is_not_durable(tmp_path, capsys):
    """A tier (LMDB) over a file remote. Each of steps 1-3 is put with the remote down; the
    uploader fails on it (wait_durable raises: the event), the remote comes back and a
    reopen uploads it. Its time to durable is therefore at least from its put's call to
    the remote's return (lo) and at most to wait_durable's (hi), however fast its local
    commit was: the command's median lies between those medians, read from the remote
    store and from the tier opened by itself. Step 4's upload is held back (the remote
    down at close): not in the remote's log, and left out of the tier's durable figure."""
    remote, local = tmp_path / "remote", str(tmp_path / "nvme")
    tsck.open_store(str(remote)).close()
    lo, hi = [], []
    for step in (1, 2, 3):
        with tsck.open_store(str(remote), local=local, early_upload=False) as store:
            _remote_down(remote)
            info = store.put_snapshot({"w": torch.full((256, 64), float(step))}, "j/main", step=step)
            with pytest.raises(tsck.StorageError, match="Not a directory"):
                store.wait_durable()
            start = info.time - info.seconds
            lo.append(time.time() - start)
            _remote_back(remote)
        with tsck.open_store(str(remote), local=local, early_upload=False) as store:
            assert store.wait_durable(timeout=120.0), "the held-back upload never landed once the remote was back"
        hi.append(time.time() - start)
    with tsck.open_store(str(remote), local=local) as store:
        assert all(i.durable for i in store.log("j/main"))
        commit_med = sorted(i.seconds for i in store.log("j/main"))[1]
    lo_med, hi_med = sorted(lo)[1], sorted(hi)[1]
    assert commit_med < lo_med  # (what a figure read from the local commit would be)

    with tsck.open_store(str(remote), local=local, early_upload=False) as store:
        _remote_down(remote)
        store.put_snapshot({"w": torch.full((256, 64), 4.0)}, "j/main", step=4)
        with pytest.raises(tsck.StorageError, match="Not a directory"):
            store.wait_durable()
        _remote_back(remote)

    for where, n, note in ((remote, 3, ""), (local, 4, " (1 only in the local tier)")):
        rc, out, err = cli_here(capsys, "goodput", where, "j/main", "--restart", "30", "--mtbf", "1h", "--json")
        assert rc == 0, err
        got = json.loads(out)
        assert lo_med <= got["durable"] <= hi_med, (where, got["durable"], lo, hi)
        assert got["sources"]["durable"] == f"median of 3 durable snapshots of j/main{note}"
        assert got["sources"]["stall"] == f"median of {n} snapshots of j/main"


def test_cli_refuses_a_durable_figure_from_a_tier_with_nothing_uploaded(tmp_path, capsys):
    """Only in the tier (the remote down at every upload): no snapshot is durable, and
    the command says to give --durable rather than take the stall for it."""
    remote, local = tmp_path / "remote", str(tmp_path / "nvme")
    tsck.open_store(str(remote)).close()
    with tsck.open_store(str(remote), local=local, early_upload=False) as store:
        _remote_down(remote)
        store.put_snapshot({"w": torch.ones(256, 64)}, "j/main", step=1)
        with pytest.raises(tsck.StorageError, match="Not a directory"):
            store.wait_durable()
        _remote_back(remote)
    rc, _out, err = cli_here(capsys, "goodput", local, "j/main", "--restart", "30", "--mtbf", "1h")
    assert rc == 2 and "none of the 1 snapshots of j/main is durable" in err and "--durable" in err
    rc, out, err = cli_here(capsys, "goodput", local, "j/main", "--restart", "30", "--mtbf", "1h", "--durable", "5",
                            "--json")
    assert rc == 0 and json.loads(out)["durable"] == 5.0, err
