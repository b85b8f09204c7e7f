#!/usr/bin/env python
"""Core benchmark: tensorstore_ck vs torch.save/torch.load and torch.distributed.checkpoint.

Builds a GPT-style fp32 model, takes one real AdamW step (so exp_avg / exp_avg_sq are
populated), and measures on one disk, in one run:

* full write: ``store.put_snapshot`` into a fresh store vs ``torch.save`` vs ``dcp.save``
  (FileSystemWriter, thread_count=2) vs the physical reference, raw writes of the same
  bytes (one file per tensor, 2 threads, each file fsync'd); every timed region ends with
  ``os.sync()``; ``--compression float`` gives put_snapshot the float codec;
* read with the page cache evicted: ``store.checkout`` (new tensors and ``into=``)
  vs ``torch.load`` vs ``dcp.load`` into a preallocated state dict;
* an incremental ``put_snapshot`` (same store, same ref) after ~10% of the tensors changed;
* peak extra RSS of each operation (VmHWM reset through /proc/self/clear_refs).

Disk speed on the reference machine varies several-fold between runs, so the numbers that
matter are the tsck/peer ratios, computed per repeat and then summarised by their median.
1 GB = 1e9 bytes.

Run ``python benches/bench_core.py --help``; see benches/README.md.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import math
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

GB = 1e9
MiB = 2**20
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_tsck():
    """tensorstore_ck as installed, else from this checkout."""
    try:
        import tensorstore_ck
    except ImportError:
        sys.path.insert(0, REPO)
        import tensorstore_ck
    return tensorstore_ck
REF = "bench/main"

# --------------------------------------------------------------------------------------
# model and state
# --------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, ctx: int, d: int, n_layer: int, n_head: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.h = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)  # untied: a separate big tensor

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        return self.lm_head(self.ln_f(x))


def gpt_layout(target_bytes: float, d: int, vocab: int = 50304, ctx: int = 1024) -> int:
    """Number of blocks so that params * 12 bytes (fp32 weights + 2 AdamW moments) ~ target."""
    fixed = 2 * vocab * d + ctx * d + 2 * d
    per_block = 12 * d * d + 13 * d
    return max(1, round((target_bytes / 12 - fixed) / per_block))


def build_state(target_bytes: float, d: int, seed: int = 0, vocab: int = 50304, ctx: int = 1024,
                n_layer: int | None = None, log=print):
    """Return (state, model, optimizer). state = {"model", "optim", "step"} after one real AdamW step
    (forward/backward on a tiny batch, plus dense gradient noise so no moment is left all-zero)."""
    torch.manual_seed(seed)
    if n_layer is None:
        n_layer = gpt_layout(target_bytes, d, vocab, ctx)
    t0 = time.perf_counter()
    model = GPT(vocab, ctx, d, n_layer, n_head=max(1, d // 64))
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    idx = torch.randint(0, vocab, (2, 32))
    logits = model(idx[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, vocab), idx[:, 1:].reshape(-1))
    loss.backward()
    # A tiny batch touches only a few dozen embedding rows, which would leave most of the
    # embedding/lm_head moments exactly zero (compressible and dedupable: unlike real training
    # state). Add dense gradient noise so every moment is populated, as after many batches.
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.grad.add_(torch.randn(p.shape, generator=g) * 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    del logits, loss
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}
    log(f"# model: GPT d={d} n_layer={n_layer} vocab={vocab} ctx={ctx}: {n_params/1e6:.1f}M params, "
        f"built + 1 AdamW step in {time.perf_counter()-t0:.1f}s")
    return state, model, opt


def iter_tensors(x, path=""):
    if isinstance(x, torch.Tensor):
        yield path, x
    elif isinstance(x, dict):
        for k, v in x.items():
            yield from iter_tensors(v, f"{path}[{k!r}]")
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            yield from iter_tensors(v, f"{path}[{i}]")


def state_nbytes(state) -> int:
    return sum(t.numel() * t.element_size() for _, t in iter_tensors(state))


def alloc_like(x):
    """A structurally identical tree with fresh, touched (zeroed) tensors."""
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x)
    if isinstance(x, dict):
        return {k: alloc_like(v) for k, v in x.items()}
    if isinstance(x, list):
        return [alloc_like(v) for v in x]
    if isinstance(x, tuple):
        return tuple(alloc_like(v) for v in x)
    return x


def compare_states(a, b) -> list[str]:
    """Paths whose tensors differ (bitwise) or whose structure differs; [] when identical."""
    bad = []
    ta, tb = dict(iter_tensors(a)), dict(iter_tensors(b))
    if ta.keys() != tb.keys():
        bad.append(f"tensor paths differ: only-left={sorted(ta.keys()-tb.keys())[:5]} "
                   f"only-right={sorted(tb.keys()-ta.keys())[:5]}")
    for p in ta.keys() & tb.keys():
        x, y = ta[p], tb[p]
        if x.dtype != y.dtype or x.shape != y.shape:
            bad.append(f"{p}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
        elif x.numel() and not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            bad.append(f"{p}: bytes differ")
    return bad


def pick_tensors(state, fraction: float, seed: int = 0, min_bytes: int = 0):
    """~fraction of the state's tensors (of those with more than min_bytes) by count, stratified
    by size (every 1/fraction-th tensor in size order, from a seeded offset) so the changed bytes
    are also roughly that fraction."""
    ts = [t for _, t in iter_tensors(state) if t.nbytes > min_bytes]
    order = sorted(range(len(ts)), key=lambda i: (ts[i].nbytes, i))
    step = max(1, round(1 / fraction))
    off = random.Random(seed).randrange(step)
    return [ts[i] for i in sorted(order[off::step])]


# --------------------------------------------------------------------------------------
# measurement helpers
# --------------------------------------------------------------------------------------

_libc = None
try:
    _libc = ctypes.CDLL("libc.so.6")
except OSError:  # pragma: no cover
    pass


def trim_memory() -> None:
    gc.collect()
    if _libc is not None:
        with contextlib.suppress(Exception):
            _libc.malloc_trim(0)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class PeakRSS:
    """Peak RSS above the RSS at entry, in bytes (.extra).

    Uses the kernel high-water mark (VmHWM) after resetting it with
    ``echo 5 > /proc/self/clear_refs``; falls back to sampling VmRSS every 5 ms.
    RSS includes file pages mapped into the process (mmap readers pay for those too).
    """

    _clear_ok: bool | None = None

    def __enter__(self):
        trim_memory()
        self.base = _status_kb("VmRSS")
        if PeakRSS._clear_ok is not False:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                PeakRSS._clear_ok = True
            except OSError:
                PeakRSS._clear_ok = False
        self._stop = threading.Event()
        self._peak = self.base
        self._thread = None
        if not PeakRSS._clear_ok:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.005):
            self._peak = max(self._peak, _status_kb("VmRSS"))

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            peak = max(self._peak, _status_kb("VmRSS"))
        else:
            peak = _status_kb("VmHWM")
        self.extra = max(0, peak - self.base) * 1024
        return False


_drop_ok: bool | None = None


def evict(*paths: str) -> str:
    """Flush dirty pages and evict the page cache (drop_caches as root, else fadvise per file)."""
    global _drop_ok
    os.sync()
    if _drop_ok is not False:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1")
            _drop_ok = True
            return "drop_caches"
        except OSError:
            _drop_ok = False
    for p in paths:
        files = [p] if os.path.isfile(p) else [os.path.join(r, n) for r, _, ns in os.walk(p) for n in ns]
        for fn in files:
            try:
                fd = os.open(fn, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "fadvise"


def fill_cache(path: str, gb: float) -> None:
    """Read `gb` GB (one file, made once) through the page cache, so the next write has
    to take its pages from a full cache, as on a training host."""
    n = int(gb * 1e9)
    if not os.path.exists(path) or os.path.getsize(path) != n:
        chunk = os.urandom(16 << 20)
        with open(path, "wb") as f:
            left = n
            while left:
                f.write(chunk[: min(left, len(chunk))])
                left -= min(left, len(chunk))
        os.sync()
    buf = bytearray(16 << 20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


def du_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, ns in os.walk(path) for n in ns)


@dataclass
class Timed:
    seconds: float
    returned: float  # seconds until the call returned (before the trailing os.sync)
    extra_rss: int
    result: object = None
    disk: dict | None = None  # the disk's counters over the interval (watch_disk)
    cpu: dict | None = None   # CPU seconds of this process, the machine's jiffies (cpu_counters)


class DiskCounters:
    """The block device under a path, from /proc/diskstats: what a timed write made it do
    (bytes written, milliseconds busy, cache flushes, discards). OSError where it cannot
    be found (not Linux, a filesystem with no block device)."""

    def __init__(self, path: str):
        st = os.stat(path)
        link = f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        self.name = os.path.basename(os.path.realpath(link))
        if self.read() is None:
            raise OSError(f"{self.name} is not in /proc/diskstats")

    def read(self) -> dict | None:
        with open("/proc/diskstats") as f:
            for line in f:
                v = line.split()
                if v[2] == self.name:
                    n = list(map(int, v[3:]))
                    return dict(wbytes=n[6] * 512, busy_ms=n[9], discards=n[11] if len(n) > 11 else 0,
                                flushes=n[15] if len(n) > 15 else 0)
        return None


_DISK: DiskCounters | None = None


def watch_disk(path: str) -> str:
    """Count the disk under `path` in every timed() from now on -> its name (or why not)."""
    global _DISK
    try:
        _DISK = DiskCounters(path)
        return _DISK.name
    except OSError as e:
        _DISK = None
        return f"not counted ({e})"


def cpu_counters() -> dict:
    """This process's CPU seconds (every thread) and the machine's jiffies from /proc/stat:
    all of them and those stolen by the hypervisor (another VM ran on our core)."""
    t = os.times()
    out = {"proc_s": t.user + t.system}
    try:
        with open("/proc/stat") as f:
            v = list(map(int, f.readline().split()[1:]))
        out.update(all_j=sum(v[:8]), steal_j=v[7] if len(v) > 7 else 0, idle_j=v[3] + v[4])
    except (OSError, ValueError, IndexError):
        pass
    return out


def disk_note(tm: "Timed") -> str:
    """A timed write's profile: the disk's side (bytes written, busy share of the time, its
    speed while busy, flushes, discards) and the CPU's (this process's CPU seconds, the
    machine's idle and stolen shares)."""
    d, c = tm.disk, tm.cpu
    out = ""
    if c:
        out += f"; CPU {c['proc_s']:.2f} s"
        if c.get("all_j"):
            out += f", machine idle {c['idle_j'] / c['all_j']:.0%}, stolen {c['steal_j'] / c['all_j']:.0%}"
    if d:
        busy = d["busy_ms"] / 1000
        out += (f"; disk wrote {d['wbytes'] / GB:.2f} GB, busy {busy / tm.seconds:.0%} of the time "
                f"({d['wbytes'] / GB / busy if busy else 0:.2f} GB/s while busy), {d['flushes']} flushes, "
                f"{d['discards']} discards")
    return out


def timed(fn, *, sync: bool = True) -> Timed:
    """Run fn with the clock and the peak-RSS meter on; the clock stops after os.sync().
    With watch_disk() on, the disk's counters over the same interval go in .disk; the
    process's CPU seconds and the machine's idle and stolen jiffies go in .cpu."""
    os.sync()
    d0 = _DISK.read() if _DISK else None
    c0 = cpu_counters()
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        res = fn()
        t1 = time.perf_counter()
        if sync:
            os.sync()
        t2 = time.perf_counter()
    d1 = _DISK.read() if _DISK else None
    c1 = cpu_counters()
    disk = {k: d1[k] - d0[k] for k in d0} if d0 and d1 else None
    return Timed(t2 - t0, t1 - t0, mem.extra, res, disk, {k: c1[k] - c0[k] for k in c0 if k in c1})


def summ(xs):
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt_s(s, fmt="{:.2f}", unit=""):
    if s is None:
        return "n/a"
    if s["n"] == 1:
        return fmt.format(s["median"]) + unit
    return f"{fmt.format(s['median'])}{unit} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


def quiet_dcp():
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


# --------------------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=float, default=2.75,
                    help="target state size in GB (weights + AdamW moments), default 2.75")
    ap.add_argument("--params", type=float, default=None,
                    help="target parameter count in millions (overrides --scale; state = 12 bytes/param)")
    ap.add_argument("--small", action="store_true", help="~0.2 GB smoke run (d_model=256, vocab 8192)")
    ap.add_argument("--d-model", type=int, default=None, help="width (default 1024, 256 with --small)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /work)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    ap.add_argument("--block-size", type=int, default=None, help="tsck block_size in bytes (default: the store's)")
    ap.add_argument("--workers", type=int, default=None, help="tsck workers (default: the store's)")
    ap.add_argument("--no-verify", action="store_true", help="open the store with verify=False")
    ap.add_argument("--bf16", action="store_true", help="the state's float tensors in bfloat16 (a bf16 state)")
    ap.add_argument("--compression", choices=["auto", "float", "lz4", "none"], default=None,
                    help="open_store(compression=...) (default: the store's, auto)")
    ap.add_argument("--changed", type=float, default=0.10, help="fraction of tensors changed before the 2nd put")
    ap.add_argument("--skip-peers", action="store_true", help="only tsck")
    ap.add_argument("--write-cache", choices=["as-is", "dropped", "populated"], default="as-is",
                    help="the page cache before each write: as left by the run (default), dropped "
                         "(drop_caches), or populated (a --fill-gb file read through it first, as a "
                         "training host that reads its data through the cache keeps it full)")
    ap.add_argument("--fill-gb", type=float, default=12.0, help="bytes read through the cache for populated")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--profile", default=None, metavar="FILE",
                    help="after the run, cProfile one put_snapshot and one checkout into FILE (.txt)")
    args = ap.parse_args(argv)

    quiet_dcp()
    tsck = import_tsck()
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    def log(*a):
        print(*a, flush=True)

    if args.small:
        target, d, vocab = 0.2 * GB, args.d_model or 256, 8192
    else:
        target, d, vocab = args.scale * GB, args.d_model or 1024, 50304
    if args.params is not None:
        target = args.params * 1e6 * 12
    state, model, opt = build_state(target, d, vocab=vocab, log=log)
    if args.bf16:
        def to_bf16(x):
            if isinstance(x, torch.Tensor):
                return x.to(torch.bfloat16) if x.is_floating_point() and x.dim() > 0 else x
            if isinstance(x, dict):
                return {k: to_bf16(v) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return type(x)(to_bf16(v) for v in x)
            return x
        state = to_bf16(state)
    nbytes = state_nbytes(state)
    tensors = [t for _, t in iter_tensors(state)]
    zeros = sum(int((t == 0).sum()) * t.element_size() for t in tensors)
    log(f"# state: {nbytes/GB:.3f} GB in {len(tensors)} tensors "
        f"({sum(1 for t in tensors if t.nbytes < 16384)} below 16 KiB); {100*zeros/nbytes:.2f}% of bytes "
        f"are zero elements")

    store_opts = {}
    if args.block_size:
        store_opts["block_size"] = args.block_size
    if args.workers:
        store_opts["workers"] = args.workers
    if args.no_verify:
        store_opts["verify"] = False
    if args.compression:
        store_opts["compression"] = args.compression

    base = args.dir or tempfile.mkdtemp(prefix="tsck-bench-", dir="/work")
    os.makedirs(base, exist_ok=True)
    p_store, p_torch, p_dcp, p_raw = (os.path.join(base, n) for n in ("tsck_store", "torch.pt", "dcp_ckpt", "raw"))
    log(f"# scratch dir: {base}; disk counted: {watch_disk(base)}")

    changed = pick_tensors(state, args.changed, seed=1)
    changed_bytes = sum(t.nbytes for t in changed)
    log(f"# incremental: {len(changed)} of {len(tensors)} tensors change "
        f"({changed_bytes/GB:.3f} GB = {100*changed_bytes/nbytes:.1f}% of bytes)")

    prealloc = alloc_like(state)  # for checkout(into=) and dcp.load, touched once, reused
    trim_memory()

    R: dict[str, list] = {k: [] for k in (
        "tsck_put", "tsck_put_returned", "torch_save", "dcp_save", "raw_save",
        "tsck_checkout", "tsck_checkout_into", "torch_load", "dcp_load",
        "tsck_put_incr", "tsck_put_incr_returned", "incr_bytes_new", "incr_blocks_new",
        "mem_tsck_put", "mem_torch_save", "mem_dcp_save", "mem_raw_save", "mem_tsck_checkout",
        "mem_tsck_checkout_into", "mem_torch_load", "mem_dcp_load", "mem_tsck_put_incr",
        "disk_tsck", "disk_torch", "disk_dcp", "put_bytes_total", "put_bytes_new")}
    problems: list[str] = []
    evict_mode = None

    def put_full():
        with tsck.open_store(p_store, **store_opts) as s:
            pass  # creation outside the clock
        s = tsck.open_store(p_store, **store_opts)
        try:
            return timed(lambda: s.put_snapshot(state, ref=REF, step=1))
        finally:
            s.close()

    def save_torch():
        return timed(lambda: torch.save(state, p_torch))

    def save_dcp():
        return timed(lambda: dcp.save(state, storage_writer=FileSystemWriter(p_dcp, thread_count=2)))

    def write_raw():
        """The physical reference: the state's bytes, one file per tensor, written by 2
        threads (as dcp.save's thread_count=2), each file fsync'd."""
        from concurrent.futures import ThreadPoolExecutor
        os.makedirs(p_raw, exist_ok=True)

        def one(i_t):
            i, t = i_t
            fd = os.open(os.path.join(p_raw, str(i)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                mv = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                while mv:
                    mv = mv[os.write(fd, mv):]
                os.fsync(fd)
            finally:
                os.close(fd)

        def run():
            with ThreadPoolExecutor(2) as ex:
                list(ex.map(one, enumerate(t for _, t in iter_tensors(state) if isinstance(t, torch.Tensor))))
        return timed(run)

    p_fill = os.path.join(base, "fill.bin")

    def before_write():
        if args.write_cache == "dropped":
            evict(base)
        elif args.write_cache == "populated":
            fill_cache(p_fill, args.fill_gb)

    try:
        for rep in range(args.repeats):
            log(f"## repeat {rep+1}/{args.repeats}")
            for p in (p_store, p_torch, p_dcp, p_raw):
                rm(p)
            # ---- writes (order rotated each repeat so drift in disk speed is spread)
            writers = [("tsck", put_full), ("raw", write_raw)] + (
                [] if args.skip_peers else [("torch", save_torch), ("dcp", save_dcp)])
            k = rep % len(writers)
            for name, fn in writers[k:] + writers[:k]:
                before_write()
                tm = fn()
                if name == "tsck":
                    info = tm.result
                    R["tsck_put"].append(tm.seconds)
                    R["tsck_put_returned"].append(tm.returned)
                    R["mem_tsck_put"].append(tm.extra_rss)
                    R["put_bytes_total"].append(info.bytes_total)
                    R["put_bytes_new"].append(info.bytes_new)
                    R["disk_tsck"].append(du_bytes(p_store))
                    log(f"  tsck put_snapshot: {tm.seconds:.2f}s (returned {tm.returned:.2f}s) "
                        f"{nbytes/GB/tm.seconds:.3f} GB/s, +RSS {tm.extra_rss/1e6:.0f} MB, "
                        f"bytes_total {info.bytes_total/GB:.3f} GB bytes_new {info.bytes_new/GB:.3f} GB, "
                        f"blocks {info.blocks_new}/{info.blocks_total}{disk_note(tm)}")
                else:
                    R[f"{name}_save"].append(tm.seconds)
                    R[f"mem_{name}_save"].append(tm.extra_rss)
                    if name != "raw":
                        R[f"disk_{name}"].append(du_bytes(p_torch if name == "torch" else p_dcp))
                    else:
                        rm(p_raw)
                    log(f"  {name}.save: {tm.seconds:.2f}s (returned {tm.returned:.2f}s) "
                        f"{nbytes/GB/tm.seconds:.3f} GB/s, +RSS {tm.extra_rss/1e6:.0f} MB{disk_note(tm)}")
                trim_memory()

            # ---- reads, page cache evicted before each
            def rd_tsck(into):
                s = tsck.open_store(p_store, create=False, **store_opts)
                try:
                    evict_m = evict(p_store)
                    tm = timed(lambda: s.checkout(REF, into=into), sync=False)
                finally:
                    s.close()
                return tm, evict_m

            tm, evict_mode = rd_tsck(None)
            R["tsck_checkout"].append(tm.seconds)
            R["mem_tsck_checkout"].append(tm.extra_rss)
            log(f"  tsck checkout (new tensors): {tm.seconds:.2f}s {nbytes/GB/tm.seconds:.3f} GB/s, "
                f"+RSS {tm.extra_rss/1e6:.0f} MB [{evict_mode}]")
            if rep == 0:
                bad = compare_states(state, tm.result)
                if bad or tm.result["step"] != state["step"]:
                    problems.append(f"checkout != state: {bad[:5]}")
                    log(f"  !! checkout differs from the state: {bad[:5]}")
            tm = None
            trim_memory()

            tm, _ = rd_tsck(prealloc)
            R["tsck_checkout_into"].append(tm.seconds)
            R["mem_tsck_checkout_into"].append(tm.extra_rss)
            log(f"  tsck checkout into=: {tm.seconds:.2f}s {nbytes/GB/tm.seconds:.3f} GB/s, "
                f"+RSS {tm.extra_rss/1e6:.0f} MB")
            if rep == 0:
                if tm.result is not prealloc:
                    problems.append("checkout(into=x) did not return x")
                bad = compare_states(state, prealloc)
                if bad:
                    problems.append(f"checkout(into=) != state: {bad[:5]}")
                    log(f"  !! checkout(into=) differs from the state: {bad[:5]}")
            tm = None

            if not args.skip_peers:
                evict(p_torch)
                tm = timed(lambda: torch.load(p_torch, weights_only=True), sync=False)
                R["torch_load"].append(tm.seconds)
                R["mem_torch_load"].append(tm.extra_rss)
                log(f"  torch.load: {tm.seconds:.2f}s {nbytes/GB/tm.seconds:.3f} GB/s, +RSS {tm.extra_rss/1e6:.0f} MB")
                tm = None
                trim_memory()

                evict(p_dcp)
                tm = timed(lambda: dcp.load(prealloc, storage_reader=FileSystemReader(p_dcp)), sync=False)
                R["dcp_load"].append(tm.seconds)
                R["mem_dcp_load"].append(tm.extra_rss)
                log(f"  dcp.load (in place): {tm.seconds:.2f}s {nbytes/GB/tm.seconds:.3f} GB/s, "
                    f"+RSS {tm.extra_rss/1e6:.0f} MB")
                tm = None
                trim_memory()

            # ---- incremental put: ~10% of the tensors changed, same store, same ref
            with torch.no_grad():
                for t in changed:
                    if t.dtype.is_floating_point:
                        t.add_(1e-3)
                    else:
                        t.add_(1)
            s = tsck.open_store(p_store, create=False, **store_opts)
            try:
                tm = timed(lambda: s.put_snapshot(state, ref=REF, step=2))
            finally:
                s.close()
            info = tm.result
            R["tsck_put_incr"].append(tm.seconds)
            R["tsck_put_incr_returned"].append(tm.returned)
            R["incr_bytes_new"].append(info.bytes_new)
            R["incr_blocks_new"].append(info.blocks_new)
            R["mem_tsck_put_incr"].append(tm.extra_rss)
            log(f"  tsck put_snapshot after {100*args.changed:.0f}% of tensors changed: {tm.seconds:.2f}s "
                f"(returned {tm.returned:.2f}s), bytes_new {info.bytes_new/GB:.3f} GB "
                f"(changed tensors: {changed_bytes/GB:.3f} GB), blocks_new {info.blocks_new}, "
                f"+RSS {tm.extra_rss/1e6:.0f} MB")
            if info.bytes_new < changed_bytes * 0.5 or info.bytes_new > nbytes * 0.9:
                problems.append(f"incremental bytes_new {info.bytes_new} vs changed {changed_bytes}")
            trim_memory()
    finally:
        if not args.keep:
            if args.dir is None:
                shutil.rmtree(base, ignore_errors=True)
            else:
                for p in (p_store, p_torch, p_dcp, p_raw):
                    rm(p)

    # ---- summarise
    n = len(R["tsck_put"])
    gbps = {k: [nbytes / GB / s for s in R[k]] for k in (
        "tsck_put", "torch_save", "dcp_save", "raw_save", "tsck_checkout", "tsck_checkout_into", "torch_load", "dcp_load")}

    def ratio(a, b, inv=False):
        xa, xb = gbps.get(a, R.get(a)), gbps.get(b, R.get(b))
        if not xa or not xb or len(xa) != len(xb):
            return []
        return [(y / x if inv else x / y) for x, y in zip(xa, xb)]

    def mem_ratio(a, b):
        return [x / y for x, y in zip(R[a], R[b]) if y > max(0.05 * nbytes, 50e6)]

    ratios = {
        "put_vs_torch_save": ratio("tsck_put", "torch_save"),
        "put_vs_raw_write": ratio("tsck_put", "raw_save"),
        "put_vs_dcp_save": ratio("tsck_put", "dcp_save"),
        "checkout_vs_torch_load": ratio("tsck_checkout", "torch_load"),
        "checkout_vs_dcp_load": ratio("tsck_checkout", "dcp_load"),
        "checkout_into_vs_torch_load": ratio("tsck_checkout_into", "torch_load"),
        "checkout_into_vs_dcp_load": ratio("tsck_checkout_into", "dcp_load"),
        # incremental put time as a fraction of a full write (lower is better)
        "incr_time_vs_full_put": [a / b for a, b in zip(R["tsck_put_incr"], R["tsck_put"])],
        "incr_time_vs_torch_save": ([a / b for a, b in zip(R["tsck_put_incr"], R["torch_save"])]
                                    if R["torch_save"] else []),
        # memory: tsck peak extra RSS / peer's (lower is better); skipped where the peer's is
        # below 5% of the state or 50 MB (the ratio of two noise-level numbers means nothing)
        "mem_put_vs_torch_save": mem_ratio("mem_tsck_put", "mem_torch_save"),
        "mem_put_vs_dcp_save": mem_ratio("mem_tsck_put", "mem_dcp_save"),
        "mem_checkout_vs_torch_load": mem_ratio("mem_tsck_checkout", "mem_torch_load"),
        "mem_checkout_into_vs_dcp_load": mem_ratio("mem_tsck_checkout_into", "mem_dcp_load"),
    }
    S = {k: summ(v) for k, v in gbps.items()}
    M = {k: summ([x / 1e6 for x in R[k]]) for k in R if k.startswith("mem_")}
    Q = {k: summ(v) for k, v in ratios.items()}

    tsck_ver = getattr(tsck, "__version__", "?")
    hdr = (f"State: GPT-style {'bf16' if args.bf16 else 'fp32'} model + AdamW moments, {nbytes/GB:.2f} GB in {len(tensors)} tensors; "
           f"{n} repeat(s); page cache evicted before reads ({evict_mode}); every write timed through os.sync(), "
           f"the page cache before each write: {args.write_cache}"
           f"{f' ({args.fill_gb:g} GB read through it)' if args.write_cache == 'populated' else ''}. "
           f"tensorstore_ck {tsck_ver}, torch {torch.__version__}, {os.cpu_count()} cores. 1 GB = 1e9 B. "
           f"Cells: median (min–max).")
    lines = [hdr, "",
             "| write | GB/s | peak extra RSS (MB) | tsck ÷ this, speed | tsck ÷ this, memory |",
             "|---|---|---|---|---|",
             f"| **tsck put_snapshot** (fresh store, compression={store_opts.get('compression', 'auto')}) | "
             f"{fmt_s(S['tsck_put'])} | {fmt_s(M['mem_tsck_put'], '{:.0f}')} | — | — |",
             f"| raw writes of the same bytes (file per tensor, 2 threads, fsync) | {fmt_s(S['raw_save'])} | "
             f"{fmt_s(M['mem_raw_save'], '{:.0f}')} | {fmt_s(Q['put_vs_raw_write'], unit='x')} | — |"]
    if not args.skip_peers:
        lines += [
            f"| torch.save + os.sync | {fmt_s(S['torch_save'])} | {fmt_s(M['mem_torch_save'], '{:.0f}')} | "
            f"{fmt_s(Q['put_vs_torch_save'], unit='x')} | {fmt_s(Q['mem_put_vs_torch_save'], unit='x')} |",
            f"| dcp.save (FileSystemWriter, thread_count=2) | {fmt_s(S['dcp_save'])} | {fmt_s(M['mem_dcp_save'], '{:.0f}')} | "
            f"{fmt_s(Q['put_vs_dcp_save'], unit='x')} | {fmt_s(Q['mem_put_vs_dcp_save'], unit='x')} |"]
    lines += ["",
              "| read (page cache evicted) | GB/s | peak extra RSS (MB) | tsck checkout ÷ this | tsck checkout into= ÷ this |",
              "|---|---|---|---|---|",
              f"| **tsck checkout** (new tensors) | {fmt_s(S['tsck_checkout'])} | {fmt_s(M['mem_tsck_checkout'], '{:.0f}')} | — | — |",
              f"| **tsck checkout into=** (preallocated) | {fmt_s(S['tsck_checkout_into'])} | "
              f"{fmt_s(M['mem_tsck_checkout_into'], '{:.0f}')} | — | — |"]
    if not args.skip_peers:
        lines += [
            f"| torch.load | {fmt_s(S['torch_load'])} | {fmt_s(M['mem_torch_load'], '{:.0f}')} | "
            f"{fmt_s(Q['checkout_vs_torch_load'], unit='x')} | {fmt_s(Q['checkout_into_vs_torch_load'], unit='x')} |",
            f"| dcp.load (into preallocated) | {fmt_s(S['dcp_load'])} | {fmt_s(M['mem_dcp_load'], '{:.0f}')} | "
            f"{fmt_s(Q['checkout_vs_dcp_load'], unit='x')} | {fmt_s(Q['checkout_into_vs_dcp_load'], unit='x')} |"]
    if not args.skip_peers:
        lines += ["", f"Peak extra RSS, tsck ÷ peer: checkout ÷ torch.load {fmt_s(Q['mem_checkout_vs_torch_load'], unit='x')}, "
                      f"checkout into= ÷ dcp.load {fmt_s(Q['mem_checkout_into_vs_dcp_load'], unit='x')}."]
    incr_s = summ(R["tsck_put_incr"])
    bn = summ([b / GB for b in R["incr_bytes_new"]])
    lines += ["",
              f"| incremental put ({len(changed)}/{len(tensors)} tensors = {100*changed_bytes/nbytes:.1f}% of bytes changed) | value |",
              "|---|---|",
              f"| time, through os.sync (s) | {fmt_s(incr_s)} |",
              f"| bytes_new (GB) | {fmt_s(bn, '{:.3f}')} (changed tensors: {changed_bytes/GB:.3f}) |",
              f"| time ÷ full tsck put | {fmt_s(Q['incr_time_vs_full_put'])} |"]
    if not args.skip_peers:
        lines.append(f"| time ÷ torch.save (which rewrites everything) | {fmt_s(Q['incr_time_vs_torch_save'])} |")
    lines.append(f"| peak extra RSS (MB) | {fmt_s(M['mem_tsck_put_incr'], '{:.0f}')} |")
    disk = {k: summ([x / GB for x in R[k]]) for k in ("disk_tsck", "disk_torch", "disk_dcp")}
    lines += ["", f"On disk after one full write (GB): tsck {fmt_s(disk['disk_tsck'], '{:.3f}')}, "
                  f"torch.save {fmt_s(disk['disk_torch'], '{:.3f}')}, dcp {fmt_s(disk['disk_dcp'], '{:.3f}')}. "
                  f"tsck put_snapshot returned after {fmt_s(summ(R['tsck_put_returned']))} s "
                  f"of {fmt_s(summ(R['tsck_put']))} s (the rest is the trailing os.sync). "
                  f"Memory ratios are left out (n/a) where the peer's peak is below 5% of the state or 50 MB."]
    table = "\n".join(lines)
    log("\n" + table + "\n")
    if problems:
        log("PROBLEMS:\n  " + "\n  ".join(problems))

    if args.json_out:
        out = {
            "bench": "bench_core", "time": time.time(), "argv": sys.argv,
            "env": {"torch": torch.__version__, "tensorstore_ck": tsck_ver, "python": platform.python_version(),
                    "cpus": os.cpu_count(), "evict": evict_mode, "dir": base},
            "state": {"bytes": nbytes, "tensors": len(tensors), "changed_tensors": len(changed),
                      "changed_bytes": changed_bytes, "d_model": d},
            "store_opts": store_opts, "repeats": n, "raw_seconds_or_bytes": R,
            "gbps": {k: {"per_repeat": v, **(S[k] or {})} for k, v in gbps.items()},
            "peak_extra_rss_mb": M, "ratios": {k: {"per_repeat": v, **(Q[k] or {})} for k, v in ratios.items()},
            "markdown": table, "problems": problems,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json_out)), exist_ok=True)
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
        log(f"# wrote {args.json_out}")

    if args.profile:
        profile_ops(tsck, state, store_opts, args.profile, args.dir, log)
    return 1 if problems else 0


def profile_ops(tsck, state, store_opts, out_path, base_dir, log):
    """cProfile one full put_snapshot and one checkout (main thread only; workers show as waits)."""
    import cProfile
    import io
    import pstats
    d = tempfile.mkdtemp(prefix="tsck-prof-", dir=base_dir or "/work")
    buf = io.StringIO()
    try:
        s = tsck.open_store(os.path.join(d, "s"), **store_opts)
        for label, fn in (("put_snapshot", lambda: s.put_snapshot(state, ref=REF, step=1)),
                          ("checkout", lambda: s.checkout(REF))):
            if label == "checkout":
                evict(d)
            pr = cProfile.Profile()
            t0 = time.perf_counter()
            pr.enable()
            fn()
            pr.disable()
            buf.write(f"==== {label}: {time.perf_counter()-t0:.2f}s\n")
            pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(30)
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(20)
        s.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    with open(out_path, "w") as f:
        f.write(buf.getvalue())
    log(f"# profile written to {out_path}")


if __name__ == "__main__":
    sys.exit(main())
