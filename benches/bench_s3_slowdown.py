#!/usr/bin/env python
"""A put under a sustained share of 503 SlowDown answers, against the same put unthrottled,
in one run: its time, the requests it sent and how many of them the server refused.

Between the store and the S3 server stands tests/sim/s3proxy.py's ThrottleProxy, which
answers a seeded share of every request (HEAD, PUT, GET, LIST) with S3's own 503 SlowDown
for as long as the put runs (a prefix shared with other busy clients); the rest reach the
server. Each case is a fresh store (its own client, so its own rate limiter) and a fresh
prefix, putting N small tensors unpacked (an object each: N PUTs when nothing is refused).
A case that has not finished in --limit seconds is reported as such.

The server: --endpoint (or $TEST_S3_ENDPOINT with $TEST_S3_KEY/$TEST_S3_SECRET); without
one, the tests' moto server is started in this process.

    .venv/bin/python benches/bench_s3_slowdown.py --objects 300 --shares 0,0.5,0.7
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

import torch  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402
from tests.sim.s3proxy import ThrottleProxy  # noqa: E402


def server(a):
    if a.endpoint:
        return None, {"endpoint_url": a.endpoint, "key": a.key, "secret": a.secret}
    import logging
    from conftest import _ensure_bucket, _serial_moto_server
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    srv = _serial_moto_server()
    srv.start()
    host, port = srv.get_host_and_port()
    return srv, _ensure_bucket({"endpoint_url": f"http://{host}:{port}", "key": "testing", "secret": "testing"})


def one(a, opts, share: float, seed: int) -> dict:
    proxy = ThrottleProxy(opts["endpoint_url"])
    st = {f"t{i}": torch.full((a.numel,), float(seed * 100_000 + i)) for i in range(a.objects)}
    url = f"s3://{a.bucket}/slowdown-{uuid.uuid4().hex}"
    with tempfile.TemporaryDirectory() as d:
        store = tsck.open_store(url, refs=os.path.join(d, "refs.lmdb"),
                                storage_options={**opts, "endpoint_url": proxy.url}, pack_size=0,
                                block_size=max(64 << 10, a.numel * 4), workers=a.workers)
        try:
            proxy.reset_counts()
            if share > 0:
                proxy.throttle(share=share, seed=seed)
            t0 = time.monotonic()
            fut = store.put_snapshot(st, ref="bench/main", step=1, blocking=False)
            try:
                fut.result(timeout=a.limit)
                outcome = "done"
            except TimeoutError:
                outcome = f"not done in {a.limit:g} s"
            except tsck.TsckError as e:
                outcome = f"failed: {type(e).__name__}: {str(e)[:160]}"
            seconds = time.monotonic() - t0
            proxy.throttle(0)
            out = {"share": share, "seconds": seconds, "outcome": outcome, "refused": proxy.refused,
                   "forwarded": sum(proxy.forwarded_by.values()), "puts": proxy.forwarded_by["PUT"]}
            if outcome.startswith("not done"):
                store.close(timeout=0)
            return out
        finally:
            store.close()
            proxy.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--objects", type=int, default=300)
    ap.add_argument("--numel", type=int, default=16 << 10, help="float32 elements per tensor (64 KiB)")
    ap.add_argument("--shares", default="0,0.5,0.7")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--limit", type=float, default=600.0, help="seconds a case may take")
    ap.add_argument("--endpoint", default=os.environ.get("TEST_S3_ENDPOINT"))
    ap.add_argument("--key", default=os.environ.get("TEST_S3_KEY", "testing"))
    ap.add_argument("--secret", default=os.environ.get("TEST_S3_SECRET", "testing"))
    ap.add_argument("--bucket", default="tsck-tests")
    a = ap.parse_args()
    shares = [float(x) for x in a.shares.split(",")]
    srv, opts = server(a)
    print(f"{a.objects} objects of {a.numel * 4 // 1024} KiB, {a.workers} workers, "
          f"{'moto' if srv else a.endpoint}; each share's put against the unthrottled one of its repeat")
    print(f"{'share':>6} {'seconds':>8} {'x unthrottled':>13} {'requests':>9} {'refused':>8} {'PUTs':>6}  outcome")
    try:
        for r in range(a.repeats):
            base = None
            for share in shares:
                o = one(a, opts, share, seed=r * 10 + int(share * 100))
                base = o["seconds"] if share == 0 else base
                ratio = f"{o['seconds'] / base:.1f}x" if base else "-"
                print(f"{share:>6.2f} {o['seconds']:>8.2f} {ratio:>13} {o['refused'] + o['forwarded']:>9} "
                      f"{o['refused']:>8} {o['puts']:>6}  {o['outcome']}", flush=True)
    finally:
        if srv is not None:
            srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
