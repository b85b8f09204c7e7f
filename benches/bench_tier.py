#!/usr/bin/env python
"""The local tier against its alternatives, one run, one S3 server: how long a put
holds training, how long until the snapshot is durable, how long a restore takes.

The server: --endpoint (or $TEST_S3_ENDPOINT with $TEST_S3_KEY/$TEST_S3_SECRET); without
one the script starts Ceph's radosgw with .ci/start-rgw.sh (memstore OSD) and stops it at
the end. The local tier and the file:// store are on --dir (this machine's disk).

Per repeat, on a GPT-style state (bench_core.build_state, one real AdamW step), each
writer into a fresh store:
* file://      put_snapshot into a local store (returns when its blocks are synced);
* s3://        a direct put_snapshot (refs in a local LMDB);
* tier         open_store(s3://..., local=DIR): the time put_snapshot takes before it
               returns (training continues), and the time from its start until
               wait_durable() returns (the remote ref moved to the same root);
* tier+saver   (--with-saver) the same with saver="process" (--saver-nice): the uploads run
               in a saver process (warm: started by an untimed small snapshot first), so the
               writer's CPU until durable leaves out the upload's work.
Then three restores of the tier's latest snapshot, each a fresh open_store + checkout
with the page cache dropped first (drop_caches; radosgw's memstore is not page cache):
* local        after a process restart, the tier intact;
* remote       after the tier was lost (an empty local= path): every object read from S3
               through the tier's read-through;
* s3 direct    open_store(s3://...) without a tier, for reference;
* file://      the file:// store's checkout, for reference (its codec is lz4, the
               tier's is the remote's: the float codec on S3 by default).
With --peer (when the build has peer replicas) a restore from a peer's tier is added.
For the direct S3 put and the tier until durable, the CPU seconds the writer and the S3
server spent and the share of the machine's CPU left idle: what bounds either where the
server shares the cores. The direct put and the tier's take turns: the direct one first in
odd repeats, the tier's in even ones. Ratios are per repeat, then median (min-max).

    .venv/bin/python benches/bench_tier.py --scale 0.5 --repeats 3 --early-upload on|off | tee -a benches/results/tier.txt
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_core as core  # noqa: E402
import bench_s3  # noqa: E402

tsck = core.import_tsck()
GB = 1e9
REF = "bench/main"


class ServerCPU:
    """CPU seconds used by the S3 server's processes (radosgw, its OSD and monitor), read
    from /proc: on this machine they share the cores with the writer, so what they burn
    while a put runs is time the put does not get."""

    def __init__(self, run_dir: str | None):
        self.pids = []
        if run_dir:
            d = os.path.join(run_dir, "run")
            for n in os.listdir(d) if os.path.isdir(d) else ():
                if n.endswith(".pid"):
                    self.pids.append(int(open(os.path.join(d, n)).read().split()[0]))

    def renice(self, value: int) -> None:
        """Every thread of the server's processes (Linux: a nice value is per thread;
        threads made later inherit their maker's)."""
        if not self.pids:
            raise SystemExit("--server-nice: no server processes known (the server was not started by this script)")
        for pid in self.pids:
            for tid in os.listdir(f"/proc/{pid}/task"):
                os.setpriority(os.PRIO_PROCESS, int(tid), value)

    def seconds(self) -> float:
        tick, total = os.sysconf("SC_CLK_TCK"), 0
        for pid in self.pids:
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime + stime
            except (OSError, IndexError, ValueError):
                pass
        return total / tick


def idle_since(c0: dict) -> float:
    """The share of the machine's CPU time left idle since c0 (core.cpu_counters()), in %."""
    c1 = core.cpu_counters()
    return 100.0 * (c1.get("idle_j", 0) - c0.get("idle_j", 0)) / max(1, c1.get("all_j", 0) - c0.get("all_j", 0))


def own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def restore(open_fn, cache_dirs, state, check: bool):
    """Seconds for a fresh open + checkout of REF, the page cache dropped first."""
    core.evict(*cache_dirs)
    t0 = time.perf_counter()
    st = open_fn()
    try:
        got = st.checkout(REF)
        dt = time.perf_counter() - t0
    finally:
        st.close()
    if check:
        assert not core.compare_states(state, got), "restore is not bit-identical"
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=0.25, help="state size in GB (default 0.25)")
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=8192, help="small enough that --scale stays in memstore")
    ap.add_argument("--repeats", type=int, default=3)
    bench_s3.add_server_args(ap, "tsck-bench-tier")
    ap.add_argument("--dir", default="/work", help="parent folder for the local tier and the file:// store")
    ap.add_argument("--compression", default="auto",
                    help="open_store(compression=) of the direct S3 store and of the tier (whose blocks travel as "
                         "stored); the file:// store keeps its default (lz4)")
    ap.add_argument("--early-upload", choices=("auto", "on", "off"), default="auto",
                    help="open_store(early_upload=) of the tier: auto (None: on with 8 cores or more), on, off")
    ap.add_argument("--server-nice", type=int, default=0,
                    help="renice the S3 server's processes (every thread) to this value: a server that yields "
                         "the cores to the writer, standing for one on another host (default 0: as started)")
    ap.add_argument("--with-saver", action="store_true",
                    help="also a tier whose uploads run in a saver process (open_store(saver='process')): its put's "
                         "return, its time to durable and the writer's CPU until then, against the tier on threads")
    ap.add_argument("--saver-nice", type=int, default=10, help="open_store(saver_nice=) with --with-saver (default 10)")
    a = ap.parse_args()
    early = {"auto": None, "on": True, "off": False}[a.early_upload]
    from tensorstore_ck.tier import uploader as _up
    early_now = _up.early_default() if early is None else early

    rgw_dir, opts, fs = bench_s3.connect(a)

    server = ServerCPU(rgw_dir or os.environ.get("TSCK_BENCH_RGW_DIR"))
    if a.server_nice:
        server.renice(a.server_nice)
    state, _model, _opt = core.build_state(a.scale * GB, a.d_model, vocab=a.vocab)
    nbytes = core.state_nbytes(state)
    ntensors = sum(1 for _ in core.iter_tensors(state))
    print(f"# {platform.node()} {os.cpu_count()} cores, torch {torch.__version__}, S3 at {a.endpoint}"
          f"{' (radosgw started by this script)' if rgw_dir else ''}; local disk under {a.dir}")
    print(f"# state: {nbytes / GB:.3f} GB in {ntensors} tensors; repeats {a.repeats}; compression {a.compression} "
          f"(S3 and tier); early upload {a.early_upload} ({'on' if early_now else 'off'}, "
          f"{_up.TEE_BYTES >> 20} MiB in flight at most); S3 server nice {a.server_nice}")

    rows = collections.defaultdict(list)
    try:
        for rep in range(a.repeats):
            run = uuid.uuid4().hex[:8]
            scratch = tempfile.mkdtemp(prefix="tsck-bench-tier-", dir=a.dir)
            try:
                # --- file://
                st = tsck.open_store(os.path.join(scratch, "file"))
                c0 = own_cpu()
                t = core.timed(lambda: st.put_snapshot(state, ref=REF, step=1), sync=False)
                rows["file put, s"].append(t.seconds)
                rows["file put: writer CPU, s"].append(own_cpu() - c0)
                st.close()

                # --- direct s3://
                direct = f"s3://{a.bucket}/{run}/direct"
                direct_refs = os.path.join(scratch, "direct-refs.lmdb")

                # --- tier: return, then durable
                remote = f"s3://{a.bucket}/{run}/tier"
                refs = os.path.join(scratch, "tier-refs.lmdb")
                tier = os.path.join(scratch, "tier")

                def open_tier(path=tier):
                    return tsck.open_store(remote, refs=refs, storage_options=opts, local=path, compression=a.compression,
                                   early_upload=early)

                def direct_put():
                    st = tsck.open_store(direct, refs=direct_refs, storage_options=opts, compression=a.compression)
                    os.sync()
                    c0, s0, m0 = own_cpu(), server.seconds(), core.cpu_counters()
                    t = core.timed(lambda: st.put_snapshot(state, ref=REF, step=1), sync=False)
                    rows["s3 put, s"].append(t.seconds)
                    rows["s3 put: machine idle, %"].append(idle_since(m0))
                    rows["s3 put: writer CPU, s"].append(own_cpu() - c0)
                    rows["s3 put: S3 server CPU, s"].append(server.seconds() - s0)
                    st.close()

                def tier_put():
                    st = open_tier()
                    os.sync()
                    c0, s0, m0 = own_cpu(), server.seconds(), core.cpu_counters()
                    t0 = time.perf_counter()
                    info = st.put_snapshot(state, ref=REF, step=1)
                    t_ret = time.perf_counter() - t0
                    rows["tier put returns: writer CPU, s"].append(own_cpu() - c0)
                    rows["tier put returns: S3 server CPU, s"].append(server.seconds() - s0)
                    assert not info.durable
                    assert st.wait_durable(timeout=600), "the upload did not finish"
                    t_dur = time.perf_counter() - t0
                    rows["tier put durable: writer CPU, s"].append(own_cpu() - c0)
                    rows["tier put durable: S3 server CPU, s"].append(server.seconds() - s0)
                    rows["tier put durable: machine idle, %"].append(idle_since(m0))
                    st.close()
                    rows["tier put returns, s"].append(t_ret)
                    rows["tier put durable, s"].append(t_dur)
                    if a.with_saver:  # the same, the uploads run by a saver process (its CPU is not the writer's)
                        path = os.path.join(scratch, "tier-saver")
                        st = tsck.open_store(f"{remote}-saver", refs=os.path.join(scratch, "tier-saver-refs.lmdb"),
                                             storage_options=opts, local=path, compression=a.compression,
                                             saver="process", saver_nice=a.saver_nice)
                        # Warm, as a job's saver is after its first snapshot: started (~1 s of imports) by a
                        # small snapshot's upload, untimed.
                        st.put_snapshot({"warm": torch.arange(10)}, ref="bench/warm", step=0)
                        assert st.wait_durable(timeout=600)
                        os.sync()
                        c0 = own_cpu()
                        t0 = time.perf_counter()
                        st.put_snapshot(state, ref=REF, step=1)
                        rows["tier+saver put returns, s"].append(time.perf_counter() - t0)
                        assert st.wait_durable(timeout=600), "the upload did not finish"
                        rows["tier+saver put durable, s"].append(time.perf_counter() - t0)
                        rows["tier+saver put durable: writer CPU, s"].append(own_cpu() - c0)
                        st.close()
                        shutil.rmtree(path, ignore_errors=True)

                # Alternating which goes first: the second writes to a server already holding the
                # first one's 0.5 GB (memstore), and neither should get the emptier server each time.
                for put in ((direct_put, tier_put) if rep % 2 == 0 else (tier_put, direct_put)):
                    put()

                # --- restores of the latest snapshot
                check = rep == 0
                rows["restore file:// (reference), s"].append(
                    restore(lambda: tsck.open_store(os.path.join(scratch, "file")), [scratch], state, check))
                rows["restore local (restart), s"].append(restore(open_tier, [scratch], state, check))
                lost = os.path.join(scratch, "tier-lost")
                rows["restore remote (tier lost), s"].append(
                    restore(lambda: open_tier(lost), [scratch], state, check))
                rows["restore s3 direct, s"].append(restore(
                    lambda: tsck.open_store(direct, refs=direct_refs, storage_options=opts), [scratch], state, check))

                r = {k: v[-1] for k, v in rows.items()}
                rows["tier returns / file put"].append(r["tier put returns, s"] / r["file put, s"])
                rows["tier durable / s3 put"].append(r["tier put durable, s"] / r["s3 put, s"])
                if a.with_saver:
                    rows["tier+saver returns / file put"].append(r["tier+saver put returns, s"] / r["file put, s"])
                    rows["tier+saver durable / s3 put"].append(r["tier+saver put durable, s"] / r["s3 put, s"])
                rows["restore: remote / local (speedup)"].append(
                    r["restore remote (tier lost), s"] / r["restore local (restart), s"])
                rows["restore: s3 direct / local (speedup)"].append(
                    r["restore s3 direct, s"] / r["restore local (restart), s"])
                print(f"# repeat {rep + 1} ({'direct' if rep % 2 == 0 else 'tier'} first): file put {r['file put, s']:.2f} s, s3 put {r['s3 put, s']:.2f} s, "
                      f"tier returns {r['tier put returns, s']:.2f} s, durable {r['tier put durable, s']:.2f} s; "
                      f"restore local {r['restore local (restart), s']:.2f} s, "
                      f"remote {r['restore remote (tier lost), s']:.2f} s, "
                      f"s3 direct {r['restore s3 direct, s']:.2f} s", flush=True)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
                try:
                    fs.rm(f"{a.bucket}/{run}", recursive=True)
                except (FileNotFoundError, OSError):
                    pass
    finally:
        bench_s3.stop_rgw(rgw_dir)

    print()
    print(f"| measure ({a.repeats} repeats, {nbytes / GB:.3f} GB) | median (min–max) |")
    print("|---|---|")
    for name, xs in rows.items():
        unit = " s" if name.endswith(", s") else "%" if name.endswith(", %") else "x"
        print(f"| {name.removesuffix(', s').removesuffix(', %')} | "
              f"{core.fmt_s(core.summ(xs), '{:.1f}' if unit == '%' else '{:.2f}', unit)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
