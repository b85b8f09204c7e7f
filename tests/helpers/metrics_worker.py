"""One rank of the README's metrics lines under torchrun, for tests/train/test_metrics.py.

    torchrun --standalone --nproc_per_node 2 metrics_worker.py OUT PORT

Every rank runs the same script, as torchrun runs a training script: start_http_server(PORT)
with the README's arguments, a TensorBoardMetrics on a SummaryWriter of OUT/tb and a
PrometheusMetrics as on_commit hooks of a CheckpointManager (gloo, three snapshots).
Then the rank whose exporter serves scrapes it over HTTP on 127.0.0.1 and tries it on
127.0.0.2 (loopback too, but not the address it was asked to bind). Each rank writes
OUT/rank<r>.json with what it saw; the test judges.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

import torch
import torch.distributed as dist


def main(out: str, port: int) -> None:
    import tensorstore_ck as tsck
    from tensorstore_ck.metrics import PrometheusMetrics, TensorBoardMetrics, start_http_server
    from torch.utils.tensorboard import SummaryWriter

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    res: dict = {"rank": rank, "local_rank": os.environ.get("LOCAL_RANK")}
    path = os.path.join(out, f"rank{rank}.json")
    try:
        server = start_http_server(port)  # the README's line, on every rank
    except OSError as e:
        res["start_error"] = f"{type(e).__name__}: {e}"
        with open(path, "w") as f:
            json.dump(res, f)
        raise
    res.update(serving=server.serving, addr=server.addr, port=server.port)
    writer = SummaryWriter(os.path.join(out, "tb"))
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    with tsck.open_store(os.path.join(out, "store")) as store:
        mgr = tsck.CheckpointManager(store, job="run", state=tsck.TrainState(model=model), every_steps=1,
                                     async_=False, timeout=60,
                                     on_commit=[TensorBoardMetrics(writer), PrometheusMetrics()])
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(1.0)
            mgr.step(step)
        mgr.close()
        res["steps"] = [i.step for i in store.log("run/main")]
    writer.close()
    dist.barrier()  # every rank's hooks have run
    if server.serving:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=30) as r:
            res["scrape"] = r.read().decode()
        try:
            with urllib.request.urlopen(f"http://127.0.0.2:{server.port}/metrics", timeout=30) as r:
                res["other_address"] = f"served {r.status}"
        except (urllib.error.URLError, OSError) as e:
            res["other_address"] = f"refused: {e}"
    dist.barrier()  # no rank's exporter goes before the scrape
    server.close()
    with open(path, "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
