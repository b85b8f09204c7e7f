#!/usr/bin/env python
"""Restart time, end to end: from each rank's process start to its first resumed training
step, split into phases, at several world sizes and from four places; projected to 1,024
ranks x 5 GB per rank.

Every rank is a fresh `python` process (as torchrun starts them: MASTER_ADDR/MASTER_PORT,
RANK, WORLD_SIZE in its environment), so its imports are measured. Each rank notes
time.time() at the top of this script, before any import, and reads its process's start
from /proc/self/stat (starttime, in clock ticks since boot, + /proc/stat btime), and then:

  interp    process start -> the script's first line (the interpreter's own start)
  imports   import torch, then import tensorstore_ck (reported apart: torch, tsck)
  arrive    the wait for the last rank to reach the c10d Store (rank 0 hosts it, as
            torchrun's agent does): the spread of the ranks' imports
  rdzv      dist.init_process_group("gloo", store=that Store), every rank started at once
  model     the job's own objects: its tensors (zeros), model, optimizer, data loader
  open      open_store(...) and CheckpointManager(...)
  wait      a barrier: the wait for the slowest rank to be ready
  resolve   mgr.latest_step(): the newest trusted snapshot of the ref (each rank reads its own
            catalog: its tier's, or the store's ref table; no message to another rank)
  read      mgr.restore_latest() until the first load_state_dict is called (rank 0's
            targets handed to every rank, the collective checkout's resolution, the
            rank's reads, the agreement on them)
  load      the state's load_state_dict (copy into the model's tensors, made before)
  seek      the data loader's load_state_dict and its first batch (ResumableDataLoader)
  step      one training step on that batch

Places (--modes):
  disk      open_store(DIR): one store on this machine's disk
  tier      open_store(s3://..., local=DIR/node<r>, replicas=1), every tier intact
  tierpf    tier, with store.prefetch(ref) called right after the imports (the store opened
            there, before the rendezvous and the model): the rank's part read into the page
            cache while the job joins the group and builds its objects (read/prefetch.py)
  peer      the same, rank 1's tier deleted: its part comes from its peer's replica
  memory    the same with the tiers in host memory (open_store(memory=DIR on /dev/shm)): rank
            1's lost, its part from its peer's memory
  s3        open_store(s3://...) alone (a moto server started here)
Before each restart every file of the stores and tiers on disk has its page-cache pages
dropped (posix_fadvise DONTNEED), so reads come from the disk. In the tier mode each rank
then reads the files of its own tier again, evicted the same way, with plain reads (the
disk's speed for the same bytes in the same run) and reports both rates.

Each snapshot is the rank's own --mb-per-rank MB of fp32 (different on every rank, as a
shard), taken by a CheckpointManager in a collective put.

The projection (report()) fits what grows with the world size W from the runs at the first
state size, --mb-per-rank: keep it small (64 KB), so that the read phase there is the
restore's coordination, not W ranks sharing one disk and 2 cores for its bytes; the read
rate comes from the two sizes at the fewest ranks.

    .venv/bin/python benches/bench_restart.py --ranks 2 4 8 --modes tier,peer,s3 --mb-per-rank 0.0625 \\
        --big-mb 256 --big-repeats 3 | tee benches/results/restart_peer.txt
"""

from __future__ import annotations

import time

T_TOP = time.time()  # before any import: the script's first line

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
REF = "bench/main"
GB = 1e9
PHASES = ("interp", "torch", "tsck", "arrive", "rdzv", "model", "open", "wait", "resolve", "read", "load", "seek", "step")


def _proc_start() -> float:
    """This process's start, wall clock: /proc/self/stat starttime (ticks since boot) + btime."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # field 22 of stat(5); fields[0] is field 3
    with open("/proc/stat") as f:
        btime = next(int(ln.split()[1]) for ln in f if ln.startswith("btime"))
    return btime + start_ticks / os.sysconf("SC_CLK_TCK")


def _evict(path: str) -> int:
    """Drop the page-cache pages of every file under path -> bytes of those files."""
    n = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            p = os.path.join(root, name)
            try:
                fd = os.open(p, os.O_RDONLY)
            except OSError:
                continue
            try:
                n += os.fstat(fd).st_size
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return n


def _plain_read(path: str) -> tuple[int, float]:
    """Read every file under path once (1 MiB reads) -> (bytes, seconds)."""
    t0, n = time.perf_counter(), 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb", buffering=0) as f:
                while True:
                    b = f.read(1 << 20)
                    if not b:
                        break
                    n += len(b)
    return n, time.perf_counter() - t0


# ----------------------------------------------------------------- one rank (a fresh process)

def rank_main(cfg: dict) -> None:
    marks = {"proc": _proc_start(), "top": T_TOP}
    cpu = {}  # this process's CPU seconds (every thread's: time.process_time) at some marks
    import torch
    marks["torch"] = time.time()
    import tensorstore_ck as tsck
    marks["tsck"] = time.time()
    import torch.distributed as dist
    from datetime import timedelta
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    kw = dict(refs=cfg["refs"], storage_options=cfg["opts"]) if cfg["url"].startswith("s3://") else {}
    if cfg["tiers"]:
        kw.update({"memory" if cfg.get("memory") else "local": os.path.join(cfg["tiers"], f"node{rank}")}, replicas=1)
    store = pf = None
    if cfg.get("prefetch") and cfg["phase"] == "restart":  # first thing: the store opened, the reads begun
        store = tsck.open_store(cfg["url"], **kw)
        pf = store.prefetch(REF)
    marks["early"] = time.time()
    # The c10d Store as torchrun's agent hosts it (here rank 0's), reached first: every rank
    # waits for the last to arrive, so the rendezvous that follows is timed from one start
    # (what grows with W), apart from the spread of the ranks' imports (arrive).
    c10d = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                         timeout=timedelta(seconds=600), wait_for_workers=False)
    if c10d.add("arrived", 1) == world:
        c10d.set("go", "1")
    c10d.wait(["go"])
    marks["arrive"], cpu["arrive"] = time.time(), time.process_time()
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", c10d), rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    marks["rdzv"], cpu["rdzv"] = time.time(), time.process_time()
    n_t = cfg.get("tensors", 4)
    numel = int(cfg["mb"] * 1e6 / 4 / n_t)
    g = torch.Generator().manual_seed(1000 + rank)
    params = [torch.randn(numel, generator=g) if cfg["phase"] == "save" else torch.zeros(numel)
              for _ in range(n_t)]
    head = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.01)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))
    loader = tsck.ResumableDataLoader(data, batch_size=8, shuffle=True, seed=0)
    marks["model"] = time.time()
    if store is None:
        store = tsck.open_store(cfg["url"], **kw)
    timing = {}

    class Timed:
        """A Stateful whose load_state_dict notes when it was entered and left."""

        def __init__(self, name, sd, load):
            self.name, self.sd, self.load = name, sd, load

        def state_dict(self):
            return self.sd()

        def load_state_dict(self, sd):
            timing.setdefault(self.name + "_in", time.time())
            timing.setdefault(self.name + "_in_cpu", time.process_time())
            self.load(sd)
            timing[self.name + "_out"] = time.time()

    def load_params(sd):
        for i, p in enumerate(params):
            p.copy_(sd[f"p{i}"])

    state = {"params": Timed("params", lambda: {f"p{i}": p for i, p in enumerate(params)}, load_params),
             "head": head, "opt": opt, "loader": Timed("loader", loader.state_dict, loader.load_state_dict)}
    mgr = tsck.CheckpointManager(store, job="bench", state=state, async_=False)
    marks["open"] = time.time()
    res = {"rank": rank}
    if cfg["phase"] == "save":
        it = iter(loader)
        for _ in range(3):
            next(it)
        mgr.step(7, force=True)
        mgr.close()
        if cfg["tiers"]:
            assert store.wait_durable(timeout=1800), "the upload did not finish"
    else:
        dist.barrier()  # every rank ready: what follows is not a wait for the slowest rank's imports
        marks["ready"], cpu["ready"] = time.time(), time.process_time()
        latest = mgr.latest_step()
        marks["resolve"], cpu["resolve"] = time.time(), time.process_time()
        step = mgr.restore_latest()
        marks["restored"] = time.time()
        assert step == 7, (step, latest)  # (latest_step() answers on rank 0; the other ranks learn it in the restore)
        x, y = next(iter(loader))
        marks["seek"] = time.time()
        opt.zero_grad()
        torch.nn.functional.mse_loss(head(x), y).backward()
        opt.step()
        marks["step"] = time.time()
        g = torch.Generator().manual_seed(1000 + rank)  # (checked after the step: not a phase of the restart)
        res["same"] = all(torch.equal(p, torch.randn(numel, generator=g)) for p in params)
        res["bytes"] = sum(p.numel() * 4 for p in params)
        ph = {"interp": marks["top"] - marks["proc"], "torch": marks["torch"] - marks["top"],
              "tsck": marks["tsck"] - marks["torch"], "arrive": marks["arrive"] - marks["early"],
              "rdzv": marks["rdzv"] - marks["arrive"], "model": marks["model"] - marks["rdzv"],
              "open": (marks["early"] - marks["tsck"]) + (marks["open"] - marks["model"]),
              "wait": marks["ready"] - marks["open"],
              "resolve": marks["resolve"] - marks["ready"]}
        first_in = min(timing["params_in"], timing["loader_in"])
        ph["read"] = first_in - marks["resolve"]
        first_cpu = min(timing["params_in_cpu"], timing["loader_in_cpu"])
        res["cpu"] = {"rdzv": cpu["rdzv"] - cpu["arrive"], "resolve": cpu["resolve"] - cpu["ready"],
                      "read": first_cpu - cpu["resolve"]}
        ph["load"] = timing["params_out"] - timing["params_in"]
        ph["seek"] = (timing["loader_out"] - timing["loader_in"]) + (marks["seek"] - marks["restored"])
        ph["step"] = marks["step"] - marks["seek"]
        ph["total"] = marks["step"] - marks["proc"]
        res["phases"] = ph
        res["read_gbps"] = res["bytes"] / ph["read"] / GB
        if pf is not None:  # whether the prefetch had ended before the restore began; its own rate
            done = pf.wait(0)
            pf.wait()
            res["prefetched"] = {"bytes": pf.bytes, "done_before": done, "seconds": pf.seconds, "error": pf.error}
        if cfg["plain"]:
            mine = os.path.join(cfg["tiers"], f"node{rank}")
            dist.barrier()
            _evict(mine)
            dist.barrier()
            n, s = _plain_read(mine)
            res["plain_bytes"], res["plain_gbps"] = n, n / s / GB
    dist.barrier()
    store.close()
    dist.destroy_process_group()
    with open(os.path.join(cfg["out"], f"{cfg['phase']}-{rank}.json"), "w") as f:
        json.dump(res, f)


# ----------------------------------------------------------------- the launcher

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, cfg: dict) -> list[dict]:
    """world fresh processes of this script, torchrun's env:// rendezvous -> their reports."""
    path = os.path.join(cfg["out"], f"cfg-{cfg['phase']}.json")
    with open(path, "w") as f:
        json.dump(cfg, f)
    port = _free_port()
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), TSCK_PEER_HOST="127.0.0.1", TORCH_CPP_LOG_LEVEL="ERROR",
                   PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank-main", path], env=env))
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise SystemExit(f"{cfg['phase']} at {world} ranks: exit codes {codes}")
    return [json.load(open(os.path.join(cfg["out"], f"{cfg['phase']}-{r}.json"))) for r in range(world)]


def start_moto():
    port = _free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    import urllib.request
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    return proc, {"endpoint_url": f"http://127.0.0.1:{port}", "key": "x", "secret": "x"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank-main", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--modes", default="disk,tier,peer,s3")
    ap.add_argument("--mb-per-rank", type=float, default=64.0)
    ap.add_argument("--big-mb", type=float, default=None,
                    help="also each place at the fewest ranks with this many MB per rank (the read and load rates)")
    ap.add_argument("--big-repeats", type=int, default=3,
                    help="the --big-mb runs, each place this many times (the read rate: their median)")
    ap.add_argument("--tensors", type=int, default=4,
                    help="the state's tensors per rank (64 at 256 MB: 4 MB each, packed with a tier's default pack "
                         "size, as a sharded state's small tensors are)")
    ap.add_argument("--dir", default=None, help="where stores and tiers go (default: a temporary folder)")
    ap.add_argument("--json-out", default=None, help="also every rank's figures, as JSON, in this file")
    ap.add_argument("--s3-endpoint", default=None,
                    help="an S3 server already running (e.g. radosgw from .ci/start-rgw.sh: $TEST_S3_ENDPOINT, "
                         "keys from $TEST_S3_KEY and $TEST_S3_SECRET) instead of a moto server started here")
    a = ap.parse_args()
    if a.rank_main:
        rank_main(json.load(open(a.rank_main)))
        return 0
    modes = [m for m in a.modes.split(",") if m]
    if set(modes) - {"disk", "tier", "tierpf", "peer", "memory", "s3"}:
        ap.error("--modes: disk, tier, tierpf, peer, memory, s3")
    import torch
    scratch = tempfile.mkdtemp(prefix="tsck-bench-restart-", dir=a.dir)
    shm = tempfile.mkdtemp(prefix="tsck-bench-restart-", dir="/dev/shm") if "memory" in modes else None
    moto, opts = (None, None)
    if set(modes) & {"tier", "tierpf", "peer", "memory", "s3"}:
        if a.s3_endpoint:
            opts = {"endpoint_url": a.s3_endpoint, "key": os.environ.get("TEST_S3_KEY", "x"),
                    "secret": os.environ.get("TEST_S3_SECRET", "x")}
        else:
            moto, opts = start_moto()
        import s3fs
        s3fs.S3FileSystem(**opts).mkdir("bench-restart")
    print(f"# {os.cpu_count()} cores, torch {torch.__version__}, python {sys.version.split()[0]}; "
          f"{a.mb_per_rank:g} MB fp32 per rank ({a.tensors} tensors, different on every rank); S3: "
          f"{'the server at' if a.s3_endpoint else 'moto server'} {opts['endpoint_url'] if opts else '-'}; "
          f"stores under {scratch}")
    print(f"# uptime before: {os.popen('uptime').read().strip()}")
    rows = []
    try:
        runs = [(w, a.mb_per_rank, 0) for w in a.ranks]
        runs += [(min(a.ranks), a.big_mb, i) for i in range(a.big_repeats)] if a.big_mb else []
        for world, mb, rep in runs:
            for mode in modes:
                d = os.path.join(scratch, f"{mode}-{world}-{mb:g}-{rep}")
                os.makedirs(d)
                url = os.path.join(d, "store") if mode == "disk" else f"s3://bench-restart/{mode}-{world}-{int(mb)}-{rep}"
                cfg = {"url": url, "opts": opts, "refs": os.path.join(d, "refs.lmdb"), "mb": mb, "tensors": a.tensors,
                       "tiers": os.path.join(d, "tiers") if mode in ("tier", "tierpf", "peer") else None,
                       "out": d, "plain": False, "prefetch": mode == "tierpf", "memory": mode == "memory"}
                if mode == "memory":  # the tiers in host memory (a tmpfs), as open_store(memory=) keeps them
                    cfg["tiers"] = os.path.join(shm, f"{mode}-{world}-{mb:g}-{rep}")
                launch(world, dict(cfg, phase="save"))
                if mode in ("peer", "memory"):
                    shutil.rmtree(os.path.join(cfg["tiers"], "node1"))
                _evict(d)
                got = launch(world, dict(cfg, phase="restart", plain=mode == "tier"))
                assert all(r["same"] for r in got), f"{mode} at {world}: a rank restored other bytes"
                rows.append((mode, world, got))
                line = "  ".join(f"{p} {max(r['phases'][p] for r in got):.2f}" for p in PHASES)
                extra = ""
                if mode == "tier":
                    extra = (f"  | read {statistics.median(r['read_gbps'] for r in got):.2f} GB/s vs plain read "
                             f"{statistics.median(r['plain_gbps'] for r in got):.2f} GB/s (medians over ranks)")
                print(f"# {mode:<5} {world} ranks x {mb:g} MB, slowest rank per phase (s): {line}  total "
                      f"{max(r['phases']['total'] for r in got):.2f}{extra}", flush=True)
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait()
        shutil.rmtree(scratch, ignore_errors=True)
        if shm:
            shutil.rmtree(shm, ignore_errors=True)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump(rows, f)
    report(rows, a.mb_per_rank)
    print(f"# uptime after: {os.popen('uptime').read().strip()}")
    return 0


def report(rows, mb: float) -> None:
    print()
    print("| place | ranks | MB/rank | " + " | ".join(PHASES) + " | total | read GB/s | plain read GB/s |")
    print("|---|---|---|" + "---|" * (len(PHASES) + 3))
    for mode, world, got in rows:
        ph = [f"{max(r['phases'][p] for r in got):.2f}" for p in PHASES]
        plain = (f"{statistics.median(r['plain_gbps'] for r in got):.2f}" if "plain_gbps" in got[0] else "-")
        print(f"| {mode} | {world} | {got[0]['bytes'] / 1e6:g} | " + " | ".join(ph) +
              f" | {max(r['phases']['total'] for r in got):.2f} | "
              f"{statistics.median(r['read_gbps'] for r in got):.2f} | {plain} |")
    print("\n(each phase: the slowest rank's seconds; read GB/s: the rank's bytes / its read phase, median over "
          "ranks)")
    project(rows, mb)


def project(rows, mb: float, W: int = 1024, B: float = 5e9) -> None:
    """T(W, B) = per-rank constants + B / rates + terms linear in W, fitted per place from
    the world sizes measured (least squares on the slowest rank)."""
    print(f"\n## Projection to {W} ranks x {B / GB:g} GB per rank")
    print("T = interp + torch + tsck + model + open + resolve + seek + step (per rank, constant: measured at the fewest ranks;\n"
          "                                                    resolve is latest_step(), a read of the rank's own catalog)\n"
          "  + B / read_rate + B / load_rate                   (per rank: what scales with its bytes)\n"
          "  + rdzv(W) + restore(W)                            (grow with W: the phase's wall at the fewest ranks W0 + b (W - W0),\n"
          "                                                    b fitted over the ranks measured at the first state size from the\n"
          "                                                    CPU seconds the busiest rank spent in the phase (rank 0 hosts the\n"
          "                                                    c10d Store: its server's work for every rank counts there); the\n"
          "                                                    c10d Store round trips of init_process_group, and the restore's\n"
          "                                                    own: rank 0's targets handed to every rank, the collective\n"
          "                                                    checkout's channel and agreement, the fixed reads)\n"
          "Why CPU seconds for b: W ranks share 2 cores here, so any phase's wall grows about as W / 2 times its CPU even\n"
          "where no rank does more work (latest_step, a read of the rank's own catalog, grew 6 ms a rank); a rank of a\n"
          "real job has its host's cores, and what it waits for on the others is their work, counted in the busiest\n"
          "rank's CPU. The wall-fitted figure is printed beside it (wall b): this machine's contention, an upper bound.")
    by_mode: dict = {}
    for mode, world, got in rows:
        by_mode.setdefault(mode, []).append((world, got))
    notes: list = []
    print("\n| place | constants s | read GB/s | load GB/s | rdzv(W) s | restore(W) s | projected s | wall-fitted s |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, runs in by_mode.items():
        runs.sort(key=lambda wg: (wg[1][0]["bytes"], wg[0]))
        w0, g0 = runs[0]
        const = sum(statistics.median(r["phases"][p] for r in g0) for p in
                    ("interp", "torch", "tsck", "model", "open", "resolve", "seek", "step"))
        # The largest state's runs (--big-repeats of them): every rank of each, and each run's
        # median read time, whose median is what the read rate is fitted from (one run's
        # read on this machine's disk moved by a quarter from one run to the next).
        top = max(g[0]["bytes"] for _, g in runs)
        bigs = [g for w, g in runs if g[0]["bytes"] == top and w == w0] if top > g0[0]["bytes"] else [g0]
        big = [r for g in bigs for r in g]
        load = statistics.median(r["bytes"] / max(r["phases"]["load"], 1e-6) for r in big)
        # The read phase is a part that grows with W (the restore's coordination, fitted
        # below over the world sizes at the first state size, which should be small: its
        # bytes' reads share one disk and 2 cores among W ranks here) and a part per byte,
        # its rate from the two state sizes at the fewest ranks (read(B) = a + B / rate);
        # with one size, all of it counts per byte.
        t_small = statistics.median(r["phases"]["read"] for r in g0)
        t_big = statistics.median(statistics.median(r["phases"]["read"] for r in g) for g in bigs)
        b_small, b_big = g0[0]["bytes"], big[0]["bytes"]
        if b_big > b_small and t_big > t_small:
            read = (b_big - b_small) / (t_big - t_small)
        else:
            read = statistics.median(r["bytes"] / r["phases"]["read"] for r in big)

        same = [(w, g) for w, g in runs if g[0]["bytes"] == g0[0]["bytes"]]

        def slope(xs, ys):
            if len(xs) < 2:
                return 0.0
            mx, my = statistics.mean(xs), statistics.mean(ys)
            return max(0.0, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs))

        def fit(p):
            """-> (the phase's wall at W0 (slowest rank), b from CPU seconds, b from wall)."""
            xs = [w for w, _ in same]
            walls = [max(r["phases"][p] for r in g) for _, g in same]
            cpus = [max(r["cpu"][p] for r in g) for _, g in same]
            return walls[0], slope(xs, cpus), slope(xs, walls)
        ra, rb, rbw = fit("rdzv")
        sa, sb, sbw = fit("read")  # (its first size's bytes are read at each W too: counted in, not taken out)
        rd, rs = ra + rb * (W - w0), sa + sb * (W - w0)
        total = const + B / read + B / load + rd + rs
        walled = const + B / read + B / load + ra + rbw * (W - w0) + sa + sbw * (W - w0)
        if mode == "tierpf":
            # The prefetch reads B at its own rate from the first line after the imports; the
            # restore begins after the rendezvous and the model: whichever ends later, then
            # the restore's reads from memory (the read rate measured here, prefetch done).
            pfr = [r["prefetched"] for r in big if r["prefetched"]["seconds"] > 0 and not r["prefetched"]["error"]]
            pf_rate = statistics.median(x["bytes"] / x["seconds"] for x in pfr) if pfr else read
            model = statistics.median(r["phases"]["model"] for r in g0)
            total = const - model + max(model + rd, B / pf_rate) + B / read + B / load + rs
            walled = total - rd - rs + ra + rbw * (W - w0) + sa + sbw * (W - w0)
            notes.append(f"(tierpf: constants - model + max(model + rdzv(W), B / prefetch rate {pf_rate / GB:.2f} GB/s) "
                  f"+ B / read from memory + B / load + restore(W); prefetch done before the restore on "
                  f"{sum(r['prefetched']['done_before'] for r in big)} of {len(big)} ranks at the largest state)")
        print(f"| {mode} | {const:.2f} | {read / GB:.2f} | {load / GB:.2f} | {rd:.2f} ({ra:.2f} + {rb * 1000:.2f} ms x "
              f"(W - {w0}); wall b {rbw * 1000:.1f} ms) | {rs:.2f} ({sa:.2f} + {sb * 1000:.2f} ms x (W - {w0}); wall b "
              f"{sbw * 1000:.1f} ms) | {total:.1f} | {walled:.1f} |")
    for n in notes:
        print(n)
    print("(constants: medians over the ranks of the fewest; read and load rates: the largest state's medians "
          "over its ranks (read: its rate fitted from the two state sizes at the fewest ranks, the larger's read time the median of its runs), each rank on a share of 2 cores and one disk; rdzv and restore: their b a least-squares "
          "slope of the busiest rank's CPU seconds over the world sizes at the first state size, each from an aligned start; arrive and wait, "
          "the spread of the ranks' imports, are left out: they are not a cost of W but of the slowest host)")


if __name__ == "__main__":
    sys.exit(main())
