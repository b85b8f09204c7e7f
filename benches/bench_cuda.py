#!/usr/bin/env python
"""CUDA benchmark: snapshots of a state that lives on the GPU, against peers in the same run.

Needs a CUDA device (exits 2 without one, unless ``--device cpu`` for a dry run of the
script itself). State: a GPT-style fp32 model + AdamW moments built by bench_core, moved
to the device. Each figure is a median of ``--repeats`` alternating runs:

1. Stall of ``put_snapshot(blocking=False)``: the time until the caller may change its
   tensors (device tensors copied to a pinned host staging buffer), against the floor of
   any asynchronous saver: one non_blocking copy of every tensor into preallocated pinned
   host memory, synchronised.
2. A blocking put + os.sync into an empty store (every byte new) against ``torch.save`` of
   the same device state + fsync.
3. ``checkout(into=live device state)`` against ``torch.load(map_location=device)`` +
   ``copy_`` into the live state; and ``checkout(map_location=device)`` (new tensors).

Every restore is compared bit for bit with the state that was saved.
Run ``python benches/bench_cuda.py --help``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_core import GB, build_state, import_tsck, iter_tensors, state_nbytes  # noqa: E402

REF = "bench/cuda"


def log(*a):
    print(*a, flush=True)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def same(a, b):
    ta, tb = [t for _, t in iter_tensors(a)], [t for _, t in iter_tensors(b)]
    return len(ta) == len(tb) and all(
        x.dtype == y.dtype and x.shape == y.shape and x.device == y.device and torch.equal(x, y)
        for x, y in zip(ta, tb))


def fsync_file(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=2.0, help="state size in GB (default 2)")
    ap.add_argument("--d-model", type=int, default=1024, help="model width (default 1024)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--many", type=int, default=0,
                    help="a state of this many fp32 tensors of 4-64 KiB instead of the model (e.g. 10000)")
    ap.add_argument("--saver", choices=("thread", "process"), default="thread",
                    help="the asynchronous put's saver (open_store(saver=)): threads of this process "
                         "(default) or a saver process fed through page-locked shared memory")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu for a dry run")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: nothing measured")
        return 2
    tsck = import_tsck()
    root = tempfile.mkdtemp(prefix="tsck-cuda-", dir=args.dir)
    try:
        return run(tsck, dev, root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run(tsck, dev, root, args):
    if args.many:  # an FSDP rank's count of tensors: params + 2 Adam moments of 4-64 KiB each
        from bench_train import many_tensors_state
        state = _to(many_tensors_state(args.many), dev)
    else:
        cpu_state, _model, _opt = build_state(args.scale * GB, args.d_model, log=log)
        state = _to(cpu_state, dev)
        del cpu_state, _model, _opt
    tensors = [t for _, t in iter_tensors(state)]
    nbytes = state_nbytes(state)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    log(f"device {name}; torch {torch.__version__}; state {nbytes / GB:.2f} GB in {len(tensors)} tensors; "
        f"saver {args.saver}; {os.cpu_count()} CPUs; scratch {root}")
    R = {k: [] for k in ("stall", "floor", "commit", "put", "save", "into", "load", "mapped")}
    pinned = [torch.empty(t.shape, dtype=t.dtype, pin_memory=dev.type == "cuda") for t in tensors]
    store = tsck.open_store(os.path.join(root, "store"), saver=args.saver)
    try:
        for i in range(args.repeats):
            with torch.no_grad():
                for t in tensors[i % 7::7]:
                    t.add_(1)  # ~1/7 of the tensors change before each round
            sync(dev)
            # 1. stall against the pinned-copy floor (the order alternates)
            for first in ((0, 1) if i % 2 == 0 else (1, 0)):
                if first == 0:
                    t0 = time.perf_counter()
                    fut = store.put_snapshot(state, ref=REF, step=10 * i, blocking=False)
                    R["stall"].append(time.perf_counter() - t0)
                    fut.result()
                    R["commit"].append(time.perf_counter() - t0)
                else:
                    t0 = time.perf_counter()
                    for dst, src in zip(pinned, tensors):
                        dst.copy_(src, non_blocking=True)
                    sync(dev)
                    R["floor"].append(time.perf_counter() - t0)
            got = store.checkout(REF, map_location=dev)
            assert same(got, state), "asynchronous put: the checkout differs from the state"
            del got
            os.sync()
            # 2. blocking put + sync against torch.save + fsync
            for first in ((0, 1) if i % 2 == 0 else (1, 0)):
                if first == 0:
                    fresh = tsck.open_store(os.path.join(root, f"fresh{i}"))  # every byte new, as torch.save's
                    t0 = time.perf_counter()
                    fresh.put_snapshot(state, ref=REF, step=10 * i + 1)
                    os.sync()
                    R["put"].append(time.perf_counter() - t0)
                    fresh.close()
                    shutil.rmtree(os.path.join(root, f"fresh{i}"))
                else:
                    p = os.path.join(root, f"save{i}.pt")
                    t0 = time.perf_counter()
                    torch.save(state, p)
                    fsync_file(p)
                    R["save"].append(time.perf_counter() - t0)
            # 3. restores (page cache warm for both)
            live = _clone(state)
            for first in ((0, 1, 2) if i % 2 == 0 else (1, 2, 0)):
                if first == 0:
                    with torch.no_grad():
                        for _, t in iter_tensors(live):
                            t.zero_()
                    sync(dev)
                    t0 = time.perf_counter()
                    store.checkout(REF, into=live)
                    sync(dev)
                    R["into"].append(time.perf_counter() - t0)
                    assert same(live, state), "checkout(into=) differs from the state"
                elif first == 1:
                    t0 = time.perf_counter()
                    loaded = torch.load(p, map_location=dev, weights_only=False)
                    with torch.no_grad():
                        for (_, dst), (_, src) in zip(iter_tensors(live), iter_tensors(loaded)):
                            dst.copy_(src)
                    sync(dev)
                    R["load"].append(time.perf_counter() - t0)
                    del loaded
                else:
                    t0 = time.perf_counter()
                    got = store.checkout(REF, map_location=dev)
                    sync(dev)
                    R["mapped"].append(time.perf_counter() - t0)
                    assert same(got, state), "checkout(map_location=) differs from the state"
                    del got
            del live
            os.remove(p)
            log(f"  round {i + 1}: stall {R['stall'][-1]:.3f}s vs pinned copy {R['floor'][-1]:.3f}s; "
                f"put+sync {R['put'][-1]:.2f}s vs torch.save+fsync {R['save'][-1]:.2f}s; "
                f"checkout(into) {R['into'][-1]:.2f}s, checkout(map_location) {R['mapped'][-1]:.2f}s "
                f"vs torch.load+copy {R['load'][-1]:.2f}s")
    finally:
        store.close()
    med = {k: statistics.median(v) for k, v in R.items() if v}
    gbps = lambda s: nbytes / GB / s  # noqa: E731
    log(f"\nmedians of {args.repeats} ({nbytes / GB:.2f} GB on {name}):")
    log(f"  async stall          {med['stall']:.3f}s  = {med['stall'] / med['floor']:.2f}x the pinned copy "
        f"({med['floor']:.3f}s, {gbps(med['floor']):.1f} GB/s); committed after {med['commit']:.2f}s")
    log(f"  blocking put + sync  {med['put']:.2f}s  = {med['put'] / med['save']:.2f}x torch.save+fsync "
        f"({med['save']:.2f}s)")
    log(f"  checkout(into=)      {med['into']:.2f}s  = {med['into'] / med['load']:.2f}x torch.load+copy "
        f"({med['load']:.2f}s)")
    log(f"  checkout(map_loc.)   {med['mapped']:.2f}s  = {med['mapped'] / med['load']:.2f}x torch.load+copy")
    log("  every restore bit-identical to the saved state")
    return 0


def _to(obj, dev):
    if torch.is_tensor(obj):
        return obj.to(dev)
    if isinstance(obj, dict):
        return {k: _to(v, dev) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, dev) for v in obj)
    return obj


def _clone(obj):
    if torch.is_tensor(obj):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


if __name__ == "__main__":
    sys.exit(main())
