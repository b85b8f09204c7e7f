"""tensorstore_ck.metrics: the CheckpointManager's commits as TensorBoard scalars and
Prometheus metrics. A real SummaryWriter writes event files that tensorboard's own
EventAccumulator reads back; a real prometheus_client HTTP exporter on 127.0.0.1 is
scraped over HTTP and its text parsed by prometheus_client's parser. With a local tier
the durable lag (commit to remote ref moved) arrives on the uploader's thread."""

from __future__ import annotations

import json
import logging
import urllib.request

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck import metrics
from tensorstore_ck.train import CheckpointManager, TrainState


def _train(mgr, model, steps):
    for step in steps:
        with torch.no_grad():
            model.weight.add_(1.0)  # a new weight each step: bytes_new > 0; the bias is reused
        mgr.step(step)
    mgr.close()


def _events(logdir):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (the test extra installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _writer(logdir):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (the test extra installs it)")
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(str(logdir))


@pytest.mark.parametrize("async_", [True, False], ids=["async", "blocking"])
def test_tensorboard_scalars_read_back_from_the_event_file(tmp_path, async_):
    logdir = tmp_path / "tb"
    writer = _writer(logdir)
    model = torch.nn.Linear(256, 256)
    infos = []
    with tsck.open_store(tmp_path / "s") as s:
        mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=2, async_=async_,
                                on_commit=[metrics.TensorBoardMetrics(writer), lambda ev: infos.append(ev.info)])
        _train(mgr, model, range(1, 8))
    writer.close()
    assert [i.step for i in infos] == [2, 4, 6]
    got = _events(logdir)
    assert set(got) == {"tsck/snapshot_seconds", "tsck/stall_seconds", "tsck/bytes", "tsck/new_bytes"}
    for info in infos:
        assert got["tsck/bytes"][info.step] == info.bytes_total > 256 * 256 * 4
        assert got["tsck/new_bytes"][info.step] == info.bytes_new > 0
        assert got["tsck/snapshot_seconds"][info.step] == pytest.approx(info.seconds, rel=1e-6)
        assert got["tsck/stall_seconds"][info.step] == pytest.approx(info.stall, rel=1e-6)
        assert 0 <= info.stall <= info.seconds < 60
    assert set(got["tsck/bytes"]) == {2, 4, 6}


def test_tensorboard_durable_lag_with_a_local_tier(tmp_path):
    logdir = tmp_path / "tb"
    writer = _writer(logdir)
    model = torch.nn.Linear(256, 256)
    tb = metrics.TensorBoardMetrics(writer, prefix="ck/")
    with tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme")) as s:
        mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=1, on_commit=tb)
        _train(mgr, model, range(1, 4))
        assert s.wait_durable(timeout=120)
    writer.close()
    got = _events(logdir)
    assert set(got["ck/bytes"]) == {1, 2, 3}
    lag = got["ck/durable_lag_seconds"]
    assert set(lag) == {1, 2, 3}
    assert all(0 <= v < 120 for v in lag.values()), lag


def test_no_durable_lag_without_a_tier(tmp_path):
    logdir = tmp_path / "tb"
    writer = _writer(logdir)
    model = torch.nn.Linear(8, 8)
    with tsck.open_store(tmp_path / "s") as s:
        mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=1,
                                on_commit=metrics.TensorBoardMetrics(writer))
        _train(mgr, model, range(1, 3))
    writer.close()
    assert "tsck/durable_lag_seconds" not in _events(logdir)


class _Broken:
    def __init__(self):
        self.calls = 0

    def add_scalar(self, tag, value, global_step=None):
        self.calls += 1
        raise OSError("disk full")


def test_a_failing_writer_does_not_stop_training(tmp_path, caplog):
    broken = _Broken()
    model = torch.nn.Linear(8, 8)
    committed = []
    with caplog.at_level(logging.WARNING, logger="tensorstore_ck"):
        with tsck.open_store(tmp_path / "s") as s:
            mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=1,
                                    on_commit=[metrics.TensorBoardMetrics(broken), committed.append])
            _train(mgr, model, range(1, 6))
            assert [i.step for i in s.log("run/main")] == [5, 4, 3, 2, 1]
    assert len(committed) == 5  # the hook after the broken one ran each time
    assert broken.calls >= 5
    said = [r for r in caplog.records if "disk full" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]  # warned once, not per snapshot


def test_a_writer_without_add_scalar_is_refused():
    with pytest.raises(tsck.InvalidArgument, match="add_scalar"):
        metrics.TensorBoardMetrics(object())


def _scrape(port) -> dict:
    parser = pytest.importorskip("prometheus_client.parser")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for fam in parser.text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_prometheus_exporter_scraped_over_http(tmp_path):
    prom = pytest.importorskip("prometheus_client", reason="prometheus_client is not installed (the test extra "
                                                           "installs it)")
    registry = prom.CollectorRegistry()
    pm = metrics.PrometheusMetrics(registry=registry)
    server = metrics.start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.port
        assert port > 0
        model = torch.nn.Linear(256, 256)
        infos = []
        with tsck.open_store(tmp_path / "s") as s:
            mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=1,
                                    on_commit=[pm, lambda ev: infos.append(ev.info)])
            _train(mgr, model, range(1, 5))
            other = s.put_snapshot({"w": torch.ones(100)}, ref="eval/main", step=7)
            pm(other)  # a SnapshotInfo of a plain put counts too
        got = _scrape(port)
    finally:
        server.close()
    lab = (("job", "run"), ("ref", "run/main"))
    assert len(infos) == 4
    assert got[("tsck_snapshots_total", lab)] == 4
    assert got[("tsck_snapshot_bytes_total", lab)] == sum(i.bytes_total for i in infos)
    assert got[("tsck_snapshot_new_bytes_total", lab)] == sum(i.bytes_new for i in infos)
    assert got[("tsck_snapshot_seconds_count", lab)] == 4
    assert got[("tsck_snapshot_seconds_sum", lab)] == pytest.approx(sum(i.seconds for i in infos))
    assert got[("tsck_snapshot_stall_seconds_count", lab)] == 4
    assert got[("tsck_snapshot_stall_seconds_sum", lab)] == pytest.approx(sum(i.stall for i in infos))
    assert got[("tsck_last_snapshot_timestamp_seconds", lab)] == pytest.approx(infos[-1].time)
    assert got[("tsck_last_snapshot_step", lab)] == 4
    ev = (("job", "eval"), ("ref", "eval/main"))
    assert got[("tsck_snapshots_total", ev)] == 1
    assert got[("tsck_snapshot_bytes_total", ev)] == other.bytes_total == 400
    # no tier: no durable lag reported
    assert not any(name == "tsck_durable_lag_seconds" for name, _ in got)


def _families(text: str) -> dict:
    parser = pytest.importorskip("prometheus_client.parser")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in parser.text_string_to_metric_families(text) for s in fam.samples}


def _tsck_points(logdir) -> dict:
    """tag -> [(file, step)] of every tsck/ scalar in every event file under `logdir`
    (one file per SummaryWriter: per rank, as the README's line makes one on each)."""
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (the test extra installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out: dict = {}
    files = sorted(p for p in logdir.iterdir() if "tfevents" in p.name)
    assert files, list(logdir.iterdir())
    for f in files:
        acc = EventAccumulator(str(f), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            if tag.startswith("tsck/"):
                out.setdefault(tag, []).extend((f.name, e.step) for e in acc.Scalars(tag))
    return out


@pytest.mark.slow
def test_the_readme_lines_on_every_rank_under_torchrun(tmp_path):
    """torchrun runs the script on every rank: start_http_server(PORT) serves on one rank
    of the host (the other does not die of EADDRINUSE), on loopback only; the exporter's
    and TensorBoard's numbers count each snapshot once for the job, not once per rank."""
    pytest.importorskip("prometheus_client", reason="prometheus_client is not installed")
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    import sys

    import _zygote as zygote
    from _util import REPO, child_env
    import socket
    with socket.socket() as sock:  # a free port for the README's fixed one
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = child_env(TORCH_CPP_LOG_LEVEL="ERROR", **{zygote.SUBPROCESS: "1"})  # torchrun's agent and ranks
    env.pop("LOCAL_RANK", None)
    r = zygote.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    str(REPO / "tests" / "helpers" / "metrics_worker.py"), str(tmp_path), str(port)],
                   cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) if (tmp_path / f"rank{i}.json").exists()
             else None for i in range(2)]
    assert r.returncode == 0, (ranks, r.stderr[-3000:])
    assert [(x["local_rank"], x["serving"]) for x in ranks] == [("0", True), ("1", False)]
    assert ranks[0]["addr"] == "127.0.0.1" and ranks[0]["port"] == port and ranks[1]["port"] is None
    assert ranks[0]["other_address"].startswith("refused"), ranks[0]["other_address"]  # not every interface
    assert ranks[0]["steps"] == ranks[1]["steps"] == [3, 2, 1]
    got = _families(ranks[0]["scrape"])
    lab = (("job", "run"), ("ref", "run/main"))
    assert got[("tsck_snapshots_total", lab)] == 3  # one snapshot of the job counted once, not per rank
    assert got[("tsck_snapshot_seconds_count", lab)] == 3 and got[("tsck_last_snapshot_step", lab)] == 3
    points = _tsck_points(tmp_path / "tb")
    assert set(points) == {"tsck/snapshot_seconds", "tsck/stall_seconds", "tsck/bytes", "tsck/new_bytes"}
    for tag, pts in points.items():
        assert sorted(step for _f, step in pts) == [1, 2, 3], (tag, pts)  # once per snapshot, one writer
        assert len({f for f, _s in pts}) == 1, (tag, pts)


def test_start_http_server_listens_on_loopback_by_default(tmp_path):
    """The job's names, steps and sizes stay on this host unless addr= says otherwise."""
    prom = pytest.importorskip("prometheus_client", reason="prometheus_client is not installed")
    registry = prom.CollectorRegistry()
    metrics.PrometheusMetrics(registry=registry)
    with metrics.start_http_server(0, registry=registry) as server:
        assert server.serving and server.addr == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as r:
            assert "tsck_snapshots_total" in r.read().decode()
        with pytest.raises(OSError):  # loopback too, but not the address it bound
            urllib.request.urlopen(f"http://127.0.0.2:{server.port}/metrics", timeout=30)
    with pytest.raises(tsck.InvalidArgument, match="addr"):
        metrics.start_http_server(0, addr="")


def test_prometheus_durable_lag_with_a_local_tier(tmp_path):
    prom = pytest.importorskip("prometheus_client", reason="prometheus_client is not installed")
    registry = prom.CollectorRegistry()
    pm = metrics.PrometheusMetrics(registry=registry)
    model = torch.nn.Linear(16, 16)
    with tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme")) as s:
        mgr = CheckpointManager(s, job="run", state=TrainState(model=model), every_steps=1, on_commit=pm)
        _train(mgr, model, range(1, 3))
        assert s.wait_durable(timeout=120)
    lag = registry.get_sample_value("tsck_durable_lag_seconds", {"job": "run", "ref": "run/main"})
    assert lag is not None and 0 <= lag < 120
    assert registry.get_sample_value("tsck_snapshots_total", {"job": "run", "ref": "run/main"}) == 2


def test_store_on_durable_reports_each_snapshot_once(tmp_path):
    """Store.on_durable: the listener the manager's durable events come from."""
    seen = []
    with tsck.open_store(str(tmp_path / "remote"), local=str(tmp_path / "nvme")) as s:
        remove = s.on_durable(seen.append)
        a = s.put_snapshot({"w": torch.zeros(1000)}, ref="j/main", step=1)
        b = s.put_snapshot({"w": torch.ones(1000)}, ref="j/main", step=2)
        assert s.wait_durable(timeout=120)
        remove()
        s.put_snapshot({"w": torch.full((1000,), 2.0)}, ref="j/main", step=3)
        assert s.wait_durable(timeout=120)
    assert [(e.root, e.ref, e.step) for e in seen] == [(a.root, "j/main", 1), (b.root, "j/main", 2)]
    assert all(0 <= e.lag < 120 and e.time >= e.committed for e in seen)
    with tsck.open_store(tmp_path / "plain") as s:  # without a tier every put is durable at commit: no events
        s.on_durable(seen.append)()


def test_example_runs(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed")
    pytest.importorskip("prometheus_client", reason="prometheus_client is not installed")
    import _zygote as zygote
    import sys

    from _util import REPO, child_env
    r = zygote.run([sys.executable, str(REPO / "examples" / "metrics.py"), str(tmp_path)], env=child_env(),
                   capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tsck_snapshots_total" in r.stdout and "tsck/bytes" in r.stdout, r.stdout
