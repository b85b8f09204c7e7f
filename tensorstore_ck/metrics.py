"""Snapshot metrics where trainers and operators look: TensorBoard scalars and Prometheus.

    from torch.utils.tensorboard import SummaryWriter
    from tensorstore_ck.metrics import PrometheusMetrics, TensorBoardMetrics, start_http_server

    tb = TensorBoardMetrics(SummaryWriter("runs/a"))           # scalars under "tsck/", step = the snapshot's
    prom = PrometheusMetrics()                                  # the default registry
    start_http_server(9108)                                     # GET 127.0.0.1:9108/metrics
    mgr = CheckpointManager(store, job="a", state=ts, every_steps=100, on_commit=[tb, prom])

The same lines run unchanged on every rank under torchrun (`torchrun --nproc_per_node 8
train.py`): a snapshot is one for the whole job, so the hooks report it once, on rank 0
of the default process group (the others' hooks do nothing; every_rank=True reports on
each rank, with a writer or registry of its own); and start_http_server serves once per
host, on local rank 0 (LOCAL_RANK, as torchrun sets it; without it, under a process
group, rank 0 alone), so the other ranks of a host do not fail on a port taken. It
listens on loopback unless told otherwise: start_http_server(9108, addr="0.0.0.0") for a
Prometheus server on another host (the job's names, steps and sizes go to whoever can
reach the port).

Each hook is a callable taking what CheckpointManager(on_commit=) hands (a CommitEvent)
or a SnapshotInfo (what put_snapshot returns, for scripts without a manager), and has
an on_durable(DurableEvent) method: with a local tier (open_store(local=)) the manager
wires it to Store.on_durable, so the durable lag (seconds from the commit in the tier
to the remote ref's move) is reported too, when the uploader makes the snapshot durable.
A hook never raises into training: a failing writer or registry is logged once as a
warning (logger tensorstore_ck.metrics), then at DEBUG.

What is reported, per committed snapshot (SnapshotInfo's fields):

    TensorBoard scalar (global_step: the step)   Prometheus (labels job, ref)
    tsck/snapshot_seconds   (seconds)            tsck_snapshot_seconds          Histogram
    tsck/stall_seconds      (stall)              tsck_snapshot_stall_seconds    Histogram
    tsck/bytes              (bytes_total)        tsck_snapshot_bytes_total      Counter
    tsck/new_bytes          (bytes_new)          tsck_snapshot_new_bytes_total  Counter
    -                                            tsck_snapshots_total           Counter
    -                                            tsck_last_snapshot_timestamp_seconds, tsck_last_snapshot_step  Gauges
    tsck/durable_lag_seconds (a local tier)      tsck_durable_lag_seconds       Gauge (the newest durable snapshot's)

The bytes are the snapshot's uncompressed bytes (bytes_new: those this snapshot added
to the store; the rest deduplicated). Nothing here imports TensorBoard: any object with
add_scalar(tag, value, global_step) is a writer. prometheus_client is imported by
PrometheusMetrics and start_http_server only (the [prometheus] extra).
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from .errors import InvalidArgument

__all__ = ["TensorBoardMetrics", "PrometheusMetrics", "MetricsServer", "start_http_server",
           "SECONDS_BUCKETS", "STALL_BUCKETS"]

log = logging.getLogger(__name__)

# Histogram buckets, seconds: a snapshot's put (call to commit) runs from milliseconds (a
# small model, deduplicated) to minutes (a large one to object storage); its stall (the
# training step blocked: the staging copy of an asynchronous put) is usually far shorter.
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
STALL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def _rank() -> int | None:
    """This process's rank in torch.distributed's default group; None outside one."""
    dist = sys.modules.get("torch.distributed")  # never imported here: a job with a group has imported it
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return dist.get_rank()


def _local_rank() -> int | None:
    """This process's rank on its host: LOCAL_RANK (torchrun's); None when not set."""
    raw = os.environ.get("LOCAL_RANK")
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def _info(event):
    """A CommitEvent's SnapshotInfo, or the SnapshotInfo itself."""
    info = getattr(event, "info", None)
    return info if info is not None else event


class _Hook:
    """What both hooks share: a failure is logged once as a warning, never raised."""

    def __init__(self, what: str, every_rank: bool = False):
        if not isinstance(every_rank, bool):
            raise InvalidArgument(f"every_rank must be a bool, got {type(every_rank).__name__}")
        self._what = what
        self.every_rank = every_rank
        self._lock = threading.Lock()  # the hooks run on the publisher's and the uploader's threads
        self._warned = False

    def _here(self) -> bool:
        """Whether this process reports: one report per snapshot of the job (rank 0's),
        whichever ranks run the hook; every process with every_rank=True."""
        return self.every_rank or (_rank() or 0) == 0

    def _failed(self, e: BaseException, doing: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("%s: %s failed: %s: %s (snapshots and training go on; further failures are logged at "
                        "DEBUG)", self._what, doing, type(e).__name__, e)
        else:
            log.debug("%s: %s failed: %s: %s", self._what, doing, type(e).__name__, e)

    def __call__(self, event) -> None:
        if not self._here():
            return
        info = _info(event)
        try:
            with self._lock:
                self._committed(info)
        except Exception as e:  # noqa: BLE001 - metrics must never stop training
            self._failed(e, f"reporting the snapshot of step {getattr(info, 'step', None)}")

    def on_durable(self, event) -> None:
        """A DurableEvent (Store.on_durable): the snapshot's durable lag."""
        if not self._here():
            return
        try:
            with self._lock:
                self._durable(event)
        except Exception as e:  # noqa: BLE001 - metrics must never stop the uploads
            self._failed(e, f"reporting the durable lag of step {getattr(event, 'step', None)}")

    def _committed(self, info) -> None:  # pragma: no cover - each hook's own
        raise NotImplementedError

    def _durable(self, event) -> None:  # pragma: no cover - each hook's own
        raise NotImplementedError


class TensorBoardMetrics(_Hook):
    """Scalars through a SummaryWriter-like `writer` (add_scalar(tag, value, global_step)),
    each tag `prefix` + name, at the snapshot's step (a snapshot without a step: the
    count of snapshots reported so far). The writer stays the caller's (flush, close).
    Under torch.distributed only rank 0's hook writes (every_rank=True: each rank's, to
    a writer of its own)."""

    def __init__(self, writer, prefix: str = "tsck/", *, every_rank: bool = False):
        if not callable(getattr(writer, "add_scalar", None)):
            raise InvalidArgument(f"TensorBoardMetrics takes a writer with add_scalar(tag, value, global_step) "
                                  f"(torch.utils.tensorboard.SummaryWriter), got {type(writer).__name__}")
        if not isinstance(prefix, str):
            raise InvalidArgument(f"prefix must be a str, got {type(prefix).__name__}")
        super().__init__("TensorBoardMetrics", every_rank)
        self.writer = writer
        self.prefix = prefix
        self._n = 0

    def _step(self, step) -> int:
        return step if isinstance(step, int) and not isinstance(step, bool) else self._n

    def _committed(self, info) -> None:
        self._n += 1
        step = self._step(info.step)
        add, p = self.writer.add_scalar, self.prefix
        if info.seconds is not None:
            add(p + "snapshot_seconds", float(info.seconds), step)
        if info.stall is not None:
            add(p + "stall_seconds", float(info.stall), step)
        add(p + "bytes", int(info.bytes_total), step)
        add(p + "new_bytes", int(info.bytes_new), step)

    def _durable(self, event) -> None:
        self.writer.add_scalar(self.prefix + "durable_lag_seconds", float(event.lag), self._step(event.step))


def _prometheus():
    try:
        import prometheus_client
    except ImportError as e:
        raise ImportError("tensorstore_ck.metrics' Prometheus metrics need prometheus_client: "
                          "pip install 'tensorstore_ck[prometheus]'") from e
    return prometheus_client


class PrometheusMetrics(_Hook):
    """Prometheus metrics of the snapshots reported to it, in `registry` (None:
    prometheus_client's default registry, the one start_http_server() serves), labelled
    with the snapshot's job and ref. `namespace` prefixes every name ("tsck"). Make one
    per registry: a second in the same registry is refused by prometheus_client (its
    names are taken). Under torch.distributed only rank 0's hook counts (every_rank=True:
    each rank's, in its own process's registry: a per-rank exporter's)."""

    def __init__(self, registry=None, *, namespace: str = "tsck", seconds_buckets=SECONDS_BUCKETS,
                 stall_buckets=STALL_BUCKETS, every_rank: bool = False):
        super().__init__("PrometheusMetrics", every_rank)
        pc = _prometheus()
        self.registry = pc.REGISTRY if registry is None else registry
        kw = dict(labelnames=("job", "ref"), namespace=namespace, registry=self.registry)
        self.seconds = pc.Histogram("snapshot_seconds", "Seconds from put_snapshot's call to the commit",
                                    buckets=seconds_buckets, **kw)
        self.stall = pc.Histogram("snapshot_stall_seconds", "Seconds the training step was blocked by a snapshot",
                                  buckets=stall_buckets, **kw)
        self.bytes = pc.Counter("snapshot_bytes", "Bytes of the committed snapshots (uncompressed)", unit="bytes",
                                **kw)
        self.new_bytes = pc.Counter("snapshot_new_bytes", "Bytes the committed snapshots added to the store "
                                    "(uncompressed; the rest deduplicated)", unit="bytes", **kw)
        self.snapshots = pc.Counter("snapshots", "Committed snapshots", **kw)
        self.last_time = pc.Gauge("last_snapshot_timestamp_seconds", "Commit time of the newest snapshot "
                                  "(Unix time)", **kw)
        self.last_step = pc.Gauge("last_snapshot_step", "Training step of the newest snapshot", **kw)
        self.durable_lag = pc.Gauge("durable_lag_seconds", "Seconds from the newest durable snapshot's commit in the "
                                    "local tier to its remote ref's move", **kw)

    def _committed(self, info) -> None:
        lab = (str(info.job), str(info.ref))
        if info.seconds is not None:
            self.seconds.labels(*lab).observe(float(info.seconds))
        if info.stall is not None:
            self.stall.labels(*lab).observe(float(info.stall))
        self.bytes.labels(*lab).inc(int(info.bytes_total))
        self.new_bytes.labels(*lab).inc(int(info.bytes_new))
        self.snapshots.labels(*lab).inc()
        self.last_time.labels(*lab).set(float(info.time))
        if info.step is not None:
            self.last_step.labels(*lab).set(int(info.step))

    def _durable(self, event) -> None:
        self.durable_lag.labels(str(event.job), str(event.ref)).set(float(event.lag))


class MetricsServer:
    """The HTTP exporter start_http_server() started: `port` (the one bound, also when 0
    was asked for), `addr`; close() stops it. serving False: this process left it to
    another of its host (local rank 0); port is None then and close() does nothing."""

    def __init__(self, httpd, thread, addr: str):
        self._httpd, self._thread = httpd, thread
        self.addr = addr
        self.serving = httpd is not None
        self.port: int | None = httpd.server_port if httpd is not None else None

    def close(self) -> None:
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_http_server(port: int, addr: str = "127.0.0.1", registry=None, *, every_rank: bool = False
                      ) -> MetricsServer:
    """Serve `registry` (None: the default one) at http://addr:port/metrics on a daemon
    thread (prometheus_client.start_http_server) -> a MetricsServer. port=0 binds a free
    port (MetricsServer.port says which). addr: "127.0.0.1" (the default) keeps it to
    this host; "0.0.0.0" lets a Prometheus server on another host scrape it.

    One exporter per host: where LOCAL_RANK is set (torchrun) only local rank 0 serves,
    else under torch.distributed only rank 0; the others get a MetricsServer with
    serving False, so the same call on every rank does not fail on the port one of them
    took. every_rank=True serves in every process (give each its own port)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgument(f"port must be an int in 0..65535, got {port!r}")
    if not isinstance(addr, str) or not addr:
        raise InvalidArgument(f"addr must be a host address (str), got {addr!r}")
    if not isinstance(every_rank, bool):
        raise InvalidArgument(f"every_rank must be a bool, got {type(every_rank).__name__}")
    pc = _prometheus()
    local = _local_rank()
    mine = local if local is not None else (_rank() or 0)
    if not every_rank and mine != 0:
        log.debug("metrics exporter: %s %d leaves port %d to rank 0 of its %s", "local rank" if local is not None
                  else "rank", mine, port, "host" if local is not None else "job")
        return MetricsServer(None, None, addr)
    httpd, thread = pc.start_http_server(port, addr=addr, registry=pc.REGISTRY if registry is None else registry)
    return MetricsServer(httpd, thread, addr)
