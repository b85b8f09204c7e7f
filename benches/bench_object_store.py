#!/usr/bin/env python
"""Many ranks writing one snapshot to an object store that limits request rates as S3
does, the count of objects a 5 TB snapshot makes per object layout, and the projection
to 1,024 ranks x 5 TB.

S3 serves at least 3,500 PUT/COPY/POST/DELETE and 5,500 GET/HEAD requests per second per
partitioned prefix; a new prefix is one partition, and S3 splits it only after minutes of
sustained load, answering 503 SlowDown meanwhile. Past a few hundred thousand objects per
snapshot, the request rate, not the bandwidth, decides how long a snapshot takes.

Part 1, the layouts (counted with the writer's own code, the chunker and plan.pack_leaves;
nothing written): the state of
one rank of a 1,024-rank FSDP2 job training a Llama-3-405B-shaped model with AdamW in
fp32 (parameters, exp_avg, exp_avg_sq, each tensor sharded on dim 0 across the ranks:
4.86 TB in all, 4.75 GB per rank, 3,411 tensors per rank); the objects one snapshot
makes with one object per block at block sizes 4-256 MiB, and with the small tensors
(one block or less) packed into blocks of 16, 64 (open_store's default on object stores) or
256 MiB; and the bytes a one-row edit of the embedding's 8 MiB shard rewrites under each.

Part 2, measured: --ranks W threads of this process, each a rank with its own Store
object and S3 client (the LMDB ref table opened once and shared: LMDB forbids opening an
environment twice in a process), each putting its own state (--blocks B split among
them: B/W tensors of --kib KiB each, one block apiece, distinct content; compression "none" to keep the CPU
for the requests) to its own ref, all starting together. The requests go through
tests/sim/s3proxy.py's ThrottleProxy to a real radosgw (started here; or --endpoint).
Five runs per repeat, in this order:
  open       no limit: what radosgw, the proxy and the clients reach on these 2 cores
  limited    S3's rates divided by --scale, one partition, no split (a new prefix)
  split      the same, the partitions doubling after --split-after s of throttling (to 8)
  open, packed / limited, packed   the first two with pack_size --pack-kib (the tensors of a
             rank packed --pack-kib / --kib to an object, as a 5 TB job's are into 64 MiB)
Per run: seconds from start to the last rank's put returning; requests by kind, forwarded
and refused; the refused share per second of the run (the back-off converges when it
falls and stays low); the write rate achieved over the limit (efficiency e).

Part 3, the projection: T = max(N_put / (e_w x 3,500 x P), N_head / (e_r x 5,500 x P),
B / (W x b)) for N_put objects written and N_head existence checks per snapshot (the
measured requests per object, times part 1's object counts), P partitions, W = 1,024
ranks, b the bandwidth per rank and B = 4.86 TB; the e are part 2's measured
efficiencies. N_put includes each rank's manifest nodes (part 2's PUTs per rank beyond
its blocks).

    .venv/bin/python benches/bench_object_store.py --ranks 64 256 --repeats 2 \
        | tee benches/results/object_store.txt
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import uuid

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import bench_core as core  # noqa: E402
import bench_s3  # noqa: E402
from tests.sim.s3proxy import RateLimits, ThrottleProxy  # noqa: E402

tsck = core.import_tsck()
from tensorstore_ck.format import chunker  # noqa: E402

MiB = 1 << 20
GB = 1e9
S3_WRITE, S3_READ = 3500.0, 5500.0


# ------------------------------------------------------------------ part 1: the layouts
def llama405b_rank(world: int = 1024) -> list[tuple[tuple[int, ...], int]]:
    """(shape, itemsize) of every tensor one FSDP2 rank holds: each parameter sharded on
    dim 0 over `world` ranks (the first ranks one row more where it does not divide),
    in fp32, with AdamW's two moments of the same shape."""
    d, ffn, layers, vocab, kv = 16384, 53248, 126, 128256, 8 * 128
    per_layer = [(d, d), (kv, d), (kv, d), (d, d), (ffn, d), (d, ffn), (ffn, d), (d,), (d,)]
    params = [(vocab, d)] + per_layer * layers + [(d,), (vocab, d)]
    out = []
    for shape in params:
        rows = math.ceil(shape[0] / world)
        out += [((rows,) + shape[1:], 4)] * 3
    return out


def blocks_of(shapes, block_size: int, inline: int = chunker.DEFAULT_INLINE_THRESHOLD) -> tuple[int, int]:
    """(blocks, bytes in blocks) of a rank's tensors as the chunker cuts them."""
    n = b = 0
    for shape, item in shapes:
        nbytes = math.prod(shape) * item
        if nbytes <= inline:
            continue
        lay = chunker.plan_blocks(nbytes, item, shape, block_size, inline)
        n += lay.nblocks
        b += nbytes
    return n, b


def layouts(world: int) -> tuple[list[dict], list, int]:
    """(a row per layout, a rank's tensors, the snapshot's bytes)."""
    shapes = llama405b_rank(world)
    total = sum(math.prod(s) * i for s, i in shapes) * world
    edit = (126, 16384)  # a one-row edit of the embedding's shard (8.06 MiB): what it rewrites
    rows = []
    lay4 = chunker.plan_blocks(math.prod(edit) * 4, 4, edit, 4 * MiB, chunker.DEFAULT_INLINE_THRESHOLD)
    for bs in (4, 16, 64, 256):
        n, in_blocks = blocks_of(shapes, bs * MiB)  # (the bytes in blocks: the same at every size)
        lay = chunker.plan_blocks(math.prod(edit) * 4, 4, edit, bs * MiB, chunker.DEFAULT_INLINE_THRESHOLD)
        rows.append(dict(layout=f"one object per block, {bs} MiB blocks", per_rank=n, total=n * world,
                         edit=lay.block_size))
    for pack in (16, 64, 256):
        per_rank = packed_objects(shapes, 4 * MiB, pack * MiB)
        # a one-row edit rewrites the pack the edited block is in (the embedding's shard is
        # two blocks, not packed: its block), or a small tensor's whole pack
        rows.append(dict(layout=f"4 MiB blocks, small tensors in {pack} MiB packs (built)", per_rank=per_rank,
                         total=per_rank * world, edit=lay4.block_size, edit_small=pack * MiB, packed=True))
    return rows, shapes, total


def packed_objects(shapes, block_size: int, pack_size: int) -> int:
    """Objects one rank's snapshot makes with packs, counted by the writer's own code: each
    tensor cut by the chunker, then plan.pack_leaves (what a put with pack_size does)."""
    from tensorstore_ck.write.plan import Leaf, pack_leaves
    leaves = []
    for shape, item in shapes:
        nbytes = math.prod(shape) * item
        lay = chunker.plan_blocks(nbytes, item, shape, block_size, chunker.DEFAULT_INLINE_THRESHOLD)
        if lay.block_size:
            leaves.append(Leaf("T", {}, None, item, [(a, b) for _, a, b in chunker.block_ranges(lay)]))
    return sum(len(leaf.ranges) for leaf in pack_leaves(leaves, pack_size))


# ------------------------------------------------------------------ part 2: measured
def rank_state(rank: int, tensors: int, kib: int) -> dict:
    g = torch.Generator().manual_seed(1000 + rank)
    return {f"p{i}": torch.randn(kib * 256, generator=g) for i in range(tensors)}


def run_once(scratch: str, opts, bucket: str, ranks: int, tensors: int, kib: int, proxy: ThrottleProxy,
             limits: RateLimits | None, workers: int, pack_size: int = 0) -> dict:
    url = f"s3://{bucket}/obj-{uuid.uuid4().hex[:8]}"
    popts = {**opts, "endpoint_url": proxy.url}
    refs = os.path.join(scratch, url.rsplit("/", 1)[1] + ".lmdb")
    first = tsck.open_store(url, refs=refs, storage_options=opts, compression="none")  # made without the proxy
    states = [rank_state(r, tensors, kib) for r in range(ranks)]
    stores = [tsck.open_store(url, refs=first.reftable, storage_options=popts, compression="none", workers=workers,
                              pack_size=pack_size)
              for _ in range(ranks)]
    proxy.reset_counts()
    proxy.limit(limits)
    go = threading.Barrier(ranks + 1)
    ends, errors = [0.0] * ranks, []

    def rank(r):
        go.wait()
        try:
            stores[r].put_snapshot(states[r], ref=f"r{r}/main", job=f"r{r}", step=1)
        except Exception as e:  # noqa: BLE001 -- reported below, the run is void
            errors.append(f"rank {r}: {type(e).__name__}: {e}")
        ends[r] = time.monotonic()

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(ranks)]
    for t in ts:
        t.start()
    go.wait()
    t0 = time.monotonic()
    for t in ts:
        t.join()
    wall = max(ends) - t0
    splits = proxy.splits
    proxy.limit(None)
    arrivals = list(proxy.arrivals)
    fwd, ref = dict(proxy.forwarded_by), dict(proxy.refused_by)
    # every rank's snapshot whole: read back one rank's, compare (all of them would take long)
    for r in sorted({0, ranks - 1}):
        got = first.checkout(f"r{r}/main")
        assert all(torch.equal(got[k], v) for k, v in states[r].items()), f"rank {r} read back differs"
    for s in stores:
        s.close()
    first.close()
    per_s = {}
    for t, _kind, refused in arrivals:
        sec = int(t - t0)
        a, b = per_s.get(sec, (0, 0))
        per_s[sec] = (a + 1, b + refused)
    return dict(wall=wall, fwd=fwd, ref=ref, per_s=[per_s.get(s, (0, 0)) for s in range(int(wall) + 1)],
                errors=errors, splits=[(round(t - t0, 1), n) for t, n in splits])


def fmt_kinds(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "none"


def timeline(per_s) -> str:
    return " ".join(f"{b / a:.0%}" if a else "-" for a, b in per_s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[64])
    ap.add_argument("--blocks", type=int, default=1024,
                    help="blocks in all, split among the ranks (one 64 KiB tensor each): every world size sends "
                         "the same requests, and only the ranks sharing the rate differ")
    ap.add_argument("--kib", type=int, default=64, help="KiB per tensor")
    ap.add_argument("--scale", type=float, default=100.0,
                    help="S3's rates divided by this (default 100: 35 writes/s, about half what the open run reaches here)")
    ap.add_argument("--split-after", type=float, default=1.0, help="seconds of throttling before a split (split run)")
    ap.add_argument("--workers", type=int, default=4, help="I/O workers per rank's store")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--world", type=int, default=1024, help="the projection's ranks")
    ap.add_argument("--rank-gbps", type=float, default=1.5, help="the projection's bandwidth per rank, GB/s")
    bench_s3.add_server_args(ap, "tsck-objbench")
    ap.add_argument("--layouts-only", action="store_true", help="part 1 alone (no server)")
    ap.add_argument("--pack-kib", type=int, default=1024,
                    help="the packed runs' pack_size in KiB (1024: 16 of the 64 KiB tensors a pack)")
    a = ap.parse_args()

    print(f"# bench_object_store: {platform.node()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}, loadavg {os.getloadavg()[0]:.1f}")
    rows, shapes, total = layouts(a.world)
    print(f"\n## Part 1: objects per snapshot, {a.world} ranks, Llama-3-405B-shaped FSDP2 + AdamW fp32: "
          f"{total / 1e12:.2f} TB, {total / a.world / GB:.2f} GB and {len(shapes)} tensors per rank\n")
    print("| layout | objects per rank | objects per snapshot | PUT time at 1 partition (3,500/s) "
          "| a one-row edit rewrites |")
    print("|---|---|---|---|---|")
    for r in rows:
        small = f"; of a small tensor: its pack, {r['edit_small'] / MiB:.0f} MiB at most" if r.get("packed") else ""
        print(f"| {r['layout']} | {r['per_rank']:,} | {r['total']:,} | {r['total'] / S3_WRITE:,.0f} s "
              f"| {r['edit'] / MiB:.2f} MiB{small} |")
    if a.layouts_only:
        return 0

    rgw_dir, opts, _fs = bench_s3.connect(a)
    print(f"\n## Part 2: measured, S3 at {a.endpoint}{' (radosgw started here)' if rgw_dir else ''}, "
          f"rates / {a.scale:g}: {S3_WRITE / a.scale:g} writes/s, {S3_READ / a.scale:g} reads/s per partition; "
          f"{a.blocks} blocks of {a.kib} KiB split among the ranks, {a.workers} I/O workers per rank\n")
    proxy = ThrottleProxy(a.endpoint)
    scratch = tempfile.mkdtemp(prefix="tsck-objbench-")
    effs = {}
    per_obj = {}
    try:
        run_once(scratch, opts, a.bucket, 8, 2, a.kib, proxy, None, a.workers)  # warm up: connections, radosgw
        for world in a.ranks:
            for rep in range(a.repeats):
                limited = RateLimits(S3_WRITE / a.scale, S3_READ / a.scale)
                for name, lim, pack in (
                        ("open", None, 0),
                        ("limited", limited, 0),
                        ("split", RateLimits(S3_WRITE / a.scale, S3_READ / a.scale, split_after=a.split_after,
                                             max_partitions=8), 0),
                        ("open, packed", None, a.pack_kib << 10),
                        ("limited, packed", limited, a.pack_kib << 10)):
                    tensors = max(1, a.blocks // world)
                    res = run_once(scratch, opts, a.bucket, world, tensors, a.kib, proxy, lim, a.workers, pack)
                    fwd, ref = res["fwd"], res["ref"]
                    writes = sum(v for k, v in fwd.items() if k in ("PUT", "POST", "DELETE"))
                    reads = sum(v for k, v in fwd.items() if k not in ("PUT", "POST", "DELETE"))
                    objs = world * (tensors if not pack else math.ceil(tensors * a.kib / a.pack_kib))
                    line = (f"W={world} rep {rep + 1} {name:15s}: {res['wall']:.1f} s; forwarded {fmt_kinds(fwd)}; "
                            f"refused {fmt_kinds(ref)}; writes/s {writes / res['wall']:.0f}, reads/s "
                            f"{reads / res['wall']:.0f}; {objs} block objects")
                    if name == "limited" and not res["errors"]:
                        e_w = writes / res["wall"] / lim.write_rate
                        effs.setdefault(world, []).append(e_w)
                        line += f"; e_w {e_w:.2f}"
                    if name.startswith("open"):
                        key = "packed" if pack else "blocks"
                        per_obj.setdefault(key + ":head", []).append(fwd.get("HEAD", 0) / max(1, fwd.get("PUT", 0)))
                        per_obj.setdefault(key + ":nodes", []).append((fwd.get("PUT", 0) - objs) / world)
                    print(line)
                    print(f"    refused share per second: {timeline(res['per_s'])}")
                    if res["splits"]:
                        print(f"    splits (s, partitions): {res['splits']}")
                    for err in res["errors"][:5]:
                        print(f"    ERROR {err}")
                    sys.stdout.flush()
    finally:
        proxy.close()
        bench_s3.stop_rgw(rgw_dir)
        shutil.rmtree(scratch, ignore_errors=True)

    print("\n## Part 3: projection to "
          f"{a.world} ranks x {total / 1e12:.2f} TB, P = 1 partition (a new prefix), b = {a.rank_gbps} GB/s per rank\n")
    e = min(sorted(v)[len(v) // 2] for v in effs.values()) if effs else float("nan")

    def med(k):
        v = sorted(per_obj[k])
        return v[len(v) // 2]
    print(f"measured: e_w {e:.2f} (the limited runs' write rate over the limit: the lowest world's median); "
          f"per rank {med('blocks:nodes'):.1f} PUTs besides its blocks (its manifest nodes; packed: "
          f"{med('packed:nodes'):.1f}); {med('blocks:head'):.2f} HEADs per object written (packed: "
          f"{med('packed:head'):.2f}; a new process asks whether each object is there before sending it)\n")
    bw = total / (a.world * a.rank_gbps * GB)
    print("| layout | PUTs | HEADs | T_put | T_head | T_bytes | T (max) | ≤ 300 s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        key = "packed" if r.get("packed") else "blocks"
        puts = r["total"] + med(key + ":nodes") * a.world
        heads = puts * med(key + ":head")
        tp, th = puts / (e * S3_WRITE), heads / (e * S3_READ)
        t = max(tp, th, bw)
        print(f"| {r['layout']} | {puts:,.0f} | {heads:,.0f} | {tp:,.0f} s | {th:,.0f} s | {bw:.1f} s | "
              f"{t:,.0f} s | {'yes' if t <= 300 else 'no'} |")
    print(f"\nbandwidth per rank for 300 s: {total / a.world / 300 / 1e6:.1f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
