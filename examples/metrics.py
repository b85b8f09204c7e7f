"""Snapshot metrics where trainers and operators look: TensorBoard and Prometheus.

    pip install 'tensorstore_ck[prometheus]' tensorboard
    python examples/metrics.py [DIR]        # a few seconds; DIR: a temporary folder if left out
    tensorboard --logdir DIR/runs           # the tsck/ scalars, beside the loss

A tiny model trains for 40 steps with a CheckpointManager snapshotting every 5 steps
into a store with a local tier (DIR/nvme in front of DIR/remote, as a node's NVMe in
front of object storage). Two on_commit hooks report each committed snapshot:
TensorBoardMetrics writes its checkpoint time, stall, bytes and new bytes (and, once
the uploader made it durable, the durable lag) as scalars at the snapshot's step;
PrometheusMetrics counts them for an exporter on 127.0.0.1, which this script
scrapes at the end and prints, as a Prometheus server would see it.
"""

from __future__ import annotations

import os
import sys
import tempfile
import urllib.request

import torch
from torch.utils.tensorboard import SummaryWriter

import tensorstore_ck as tsck
from tensorstore_ck.metrics import PrometheusMetrics, TensorBoardMetrics, start_http_server


def main(root: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    writer = SummaryWriter(os.path.join(root, "runs", "tiny"))
    prom = PrometheusMetrics()  # the default registry, what the exporter serves
    server = start_http_server(0, addr="127.0.0.1")  # port 0: a free one (server.port); an operator picks one
    with tsck.open_store(os.path.join(root, "remote"), local=os.path.join(root, "nvme")) as store:
        mgr = tsck.CheckpointManager(store, job="tiny", state=tsck.TrainState(model=model, optimizer=opt),
                                     every_steps=5, retention=tsck.Retention(keep_last=3),
                                     on_commit=[TensorBoardMetrics(writer), prom])
        for step in range(1, 41):
            x = torch.randn(64, 32)
            loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            writer.add_scalar("train/loss", loss.item(), step)
            mgr.step(step)
        mgr.close()
        store.wait_durable(timeout=120)  # the last uploads: their durable lag reaches both hooks
    writer.close()

    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as r:
        text = r.read().decode()
    server.close()
    print(f"Prometheus, scraped from 127.0.0.1:{server.port}/metrics:")
    for line in text.splitlines():
        if line.startswith("tsck_") and "_bucket{" not in line and "_created{" not in line:
            print("  " + line)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(os.path.join(root, "runs", "tiny"))
    acc.Reload()
    print(f"TensorBoard scalars in {os.path.join(root, 'runs')} (tensorboard --logdir {os.path.join(root, 'runs')}):")
    for tag in sorted(acc.Tags()["scalars"]):
        if tag.startswith("tsck/"):
            last = acc.Scalars(tag)[-1]
            print(f"  {tag:26s} {len(acc.Scalars(tag))} points, at step {last.step}: {last.value:.6g}")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1])
    else:
        with tempfile.TemporaryDirectory() as d:
            main(d)
