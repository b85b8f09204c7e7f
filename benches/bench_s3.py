#!/usr/bin/env python
"""S3 benchmark: put_snapshot/checkout on s3:// vs on file:// vs DCP's FsspecWriter/Reader
to the same S3 server, in one run, with the S3 requests each snapshot costs.

The server: --endpoint (or $TEST_S3_ENDPOINT with $TEST_S3_KEY/$TEST_S3_SECRET); without
one, the script starts Ceph's radosgw with .ci/start-rgw.sh (memstore OSD, 2 GiB: keep
--scale small) and stops it at the end.

Per repeat, on a GPT-style state (bench_core.build_state, one real AdamW step):
* file://  put_snapshot into a fresh local store (through os.sync), checkout (page cache evicted);
* s3://    put_snapshot into a fresh prefix, a second put after ~10% of the tensors changed,
           checkout (new tensors) and checkout(into=) a preallocated tree;
* DCP      dcp.save(FsspecWriter(s3://..., thread_count=T)) and dcp.load(FsspecReader) into
           the same preallocated tree, T = the store's I/O worker count by default.
Requests are counted by operation name inside this process (every botocore call s3fs
makes, ours and DCP's alike, goes through aiobotocore's AioBaseClient._make_api_call).
Each repeat deletes what it wrote. Ratios are per repeat, then median (min-max).

    .venv/bin/python benches/bench_s3.py --repeats 3 | tee benches/results/s3.txt
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_core as core  # noqa: E402

tsck = core.import_tsck()
GB = 1e9
REF = "bench/main"


# ------------------------------------------------------------------ request counting
class Requests:
    """Counts every S3 API call made in this process, by operation name."""

    def __init__(self):
        import aiobotocore.client as c
        self.counts = collections.Counter()
        self._lock = threading.Lock()
        orig = c.AioBaseClient._make_api_call
        outer = self

        async def counting(client, operation_name, api_params):
            with outer._lock:
                outer.counts[operation_name] += 1
            return await orig(client, operation_name, api_params)

        c.AioBaseClient._make_api_call = counting

    def take(self) -> collections.Counter:
        with self._lock:
            out, self.counts = self.counts, collections.Counter()
        return out


def fmt_counts(c: collections.Counter) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])) or "none"


# ------------------------------------------------------------------ server
def start_rgw():
    d = tempfile.mkdtemp(prefix="tsck-bench-rgw-")
    r = subprocess.run(["bash", os.path.join(core.REPO, ".ci", "start-rgw.sh"), d],
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        sys.exit(f"could not start radosgw (pass --endpoint): {r.stderr[-2000:]}")
    env = {}
    for word in open(os.path.join(d, "env")).read().split():
        if "=" in word:
            k, v = word.split("=", 1)
            env[k] = v
    return d, env


def add_server_args(ap, bucket: str) -> None:
    """--endpoint, --key, --secret (from $TEST_S3_* by default) and --bucket: the S3
    server connect() uses (none: a radosgw started here)."""
    ap.add_argument("--endpoint", default=os.environ.get("TEST_S3_ENDPOINT"))
    ap.add_argument("--key", default=os.environ.get("TEST_S3_KEY", "testkey"))
    ap.add_argument("--secret", default=os.environ.get("TEST_S3_SECRET", "testsecret"))
    ap.add_argument("--bucket", default=bucket)


def connect(a):
    """The S3 server of a bench run: a.endpoint (with a.key, a.secret), else a radosgw
    started here (a.endpoint and the keys set from it); a.bucket made if absent.
    -> (the radosgw directory to stop, or None; storage_options; an s3fs filesystem)."""
    import s3fs
    rgw_dir = None
    if not a.endpoint:
        rgw_dir, env = start_rgw()
        a.endpoint, a.key, a.secret = env["TEST_S3_ENDPOINT"], env["TEST_S3_KEY"], env["TEST_S3_SECRET"]
    opts = {"endpoint_url": a.endpoint, "key": a.key, "secret": a.secret}
    fs = s3fs.S3FileSystem(**opts, skip_instance_cache=True, use_listings_cache=False)
    try:
        fs.mkdir(a.bucket)
    except (FileExistsError, OSError):
        pass
    return rgw_dir, opts, fs


def stop_rgw(rgw_dir) -> None:
    if rgw_dir:
        subprocess.run(["bash", os.path.join(core.REPO, ".ci", "stop-rgw.sh"), rgw_dir], capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.25, help="state size in GB (default 0.25)")
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=8192, help="small enough that --scale stays in memstore's 2 GiB")
    ap.add_argument("--repeats", type=int, default=3)
    add_server_args(ap, "tsck-bench")
    ap.add_argument("--workers", type=int, default=None, help="store I/O workers (default: the store's)")
    ap.add_argument("--dcp-threads", type=int, default=None, help="FsspecWriter thread_count (default: workers)")
    ap.add_argument("--dir", default="/work", help="parent folder for the file:// store")
    a = ap.parse_args()

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    core.quiet_dcp()

    rgw_dir, opts, fs = connect(a)
    reqs = Requests()

    state, _model, _opt = core.build_state(a.scale * GB, a.d_model, vocab=a.vocab)
    nbytes = core.state_nbytes(state)
    ntensors = sum(1 for _ in core.iter_tensors(state))
    print(f"# {platform.node()} {os.cpu_count()} cores, torch {torch.__version__}, S3 at {a.endpoint}"
          f"{' (radosgw started by this script)' if rgw_dir else ''}")
    print(f"# state: {nbytes / GB:.3f} GB in {ntensors} tensors; repeats {a.repeats}")

    rows = collections.defaultdict(list)
    counts = {}
    try:
        for rep in range(a.repeats):
            run = uuid.uuid4().hex[:8]
            # --- file://
            local = tempfile.mkdtemp(prefix="tsck-bench-s3-", dir=a.dir)
            try:
                st = tsck.open_store(os.path.join(local, "s"), workers=a.workers)
                workers = st.workers
                t = core.timed(lambda: st.put_snapshot(state, ref=REF, step=1))
                rows["file put"].append(nbytes / t.seconds / GB)
                core.evict(local)
                t = core.timed(lambda: st.checkout(REF), sync=False)
                rows["file checkout"].append(nbytes / t.seconds / GB)
                st.close()
            finally:
                shutil.rmtree(local, ignore_errors=True)

            # --- s3://
            url = f"s3://{a.bucket}/{run}/tsck"
            refs_dir = tempfile.mkdtemp(prefix="tsck-bench-refs-")
            try:
                st = tsck.open_store(url, refs=os.path.join(refs_dir, "refs.lmdb"), storage_options=opts,
                                     workers=a.workers)
                reqs.take()
                t = core.timed(lambda: st.put_snapshot(state, ref=REF, step=1), sync=False)
                counts["s3 put (first)"] = reqs.take()
                rows["s3 put"].append(nbytes / t.seconds / GB)
                g = torch.Generator().manual_seed(rep)
                with torch.no_grad():  # ~10% of the tensors by count, as bench_core does
                    for x in core.pick_tensors(state, 0.10, seed=rep):
                        x.add_(torch.randn(x.shape, generator=g).to(x.dtype) * 1e-3)
                t2 = core.timed(lambda: st.put_snapshot(state, ref=REF, step=2), sync=False)
                counts["s3 put (10% changed)"] = reqs.take()
                rows["s3 put 10% changed, s"].append(t2.seconds)
                rows["s3 put 10% changed, bytes_new/GB"].append(t2.result.bytes_new / GB)
                t = core.timed(lambda: st.checkout(REF), sync=False)
                counts["s3 checkout"] = reqs.take()
                rows["s3 checkout"].append(nbytes / t.seconds / GB)
                if rep == 0:
                    assert not core.compare_states(state, t.result), "s3 checkout is not bit-identical"
                target = core.alloc_like(state)
                t = core.timed(lambda: st.checkout(REF, into=target), sync=False)
                reqs.take()
                rows["s3 checkout into="].append(nbytes / t.seconds / GB)
                st.close()
            finally:
                shutil.rmtree(refs_dir, ignore_errors=True)

            # --- DCP to the same server
            dcp_url = f"s3://{a.bucket}/{run}/dcp"
            threads = a.dcp_threads or workers
            reqs.take()
            t = core.timed(lambda: dcp.save(state, storage_writer=FsspecWriter(
                dcp_url, thread_count=threads, sync_files=False, **opts)), sync=False)
            counts["dcp save"] = reqs.take()
            rows["dcp save"].append(nbytes / t.seconds / GB)
            target = core.alloc_like(state)
            t = core.timed(lambda: dcp.load(target, storage_reader=FsspecReader(dcp_url, **opts)), sync=False)
            counts["dcp load"] = reqs.take()
            rows["dcp load"].append(nbytes / t.seconds / GB)
            if rep == 0:
                assert not core.compare_states(state, target), "dcp load is not bit-identical"

            for num, den in (("s3 put", "file put"), ("s3 put", "dcp save"), ("s3 checkout", "file checkout"),
                             ("s3 checkout", "dcp load"), ("s3 checkout into=", "dcp load")):
                rows[f"{num} / {den}"].append(rows[num][-1] / rows[den][-1])  # this repeat's ratio
            fs.rm(f"{a.bucket}/{run}", recursive=True)
            reqs.take()
            print(f"# repeat {rep + 1}: s3 put {rows['s3 put'][-1]:.3f} GB/s, file put {rows['file put'][-1]:.3f}, "
                  f"dcp save {rows['dcp save'][-1]:.3f}; s3 checkout {rows['s3 checkout'][-1]:.3f}, "
                  f"file checkout {rows['file checkout'][-1]:.3f}, dcp load {rows['dcp load'][-1]:.3f}",
                  flush=True)
    finally:
        stop_rgw(rgw_dir)

    print()
    print(f"| measure ({a.repeats} repeats, workers {workers}, DCP thread_count {threads}) | median (min–max) |")
    print("|---|---|")
    for name, xs in rows.items():
        unit = "" if ("/" in name or name.endswith(", s")) else " GB/s"
        print(f"| {name} | {core.fmt_s(core.summ(xs), '{:.3f}', unit)} |")
    print()
    print("| S3 requests (last repeat) | total | by operation |")
    print("|---|---|---|")
    for name, c in counts.items():
        print(f"| {name} | {sum(c.values())} | {fmt_counts(c)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
