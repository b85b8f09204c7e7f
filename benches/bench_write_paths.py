"""Where a local put's time goes: the same bytes written by several strategies.

Writes N blocks of --block-mib MiB (random bytes, so nothing compresses) into a
fresh directory with --workers threads, each strategy timed through its own
durability point, under two page-cache conditions:

  dropped    caches dropped (echo 3 > /proc/sys/vm/drop_caches) before each write
  populated  the page cache left full: a --fill-gb file is read through it first,
             as a training host reading its data keeps it full

Strategies (each leaves every block durable and named when its timer stops):

  stream       one file, written in order, os.fsync once (torch.save + sync's shape)
  per_object   temp file, write, fsync, link to the final name, unlink (one object
               at a time: the put's path with an fsync per block)
  batch_syncfs temp files written without fsync; syncfs(2) once; then link + unlink
               each and fsync the directories (durable before it is named)
  batch_kick   batch_syncfs, each file's writeback started as it is written
               (sync_file_range WRITE: the disk works while the CPU hashes the next)
  kick_fdsync  writeback started per file as written, then every file fdatasync'ed
               from 8 threads, links, directories (LocalBlockStore's path)
  batch_fdsync temp files written without fsync; every one fdatasync'ed by the
               workers at the end; then link + unlink, directories fsynced
  no_sync      temp, link, unlink, nothing synced until one os.sync() at the end
               (what the page cache alone costs: a floor, not a safe write)

Needs root for drop_caches (the dropped condition is skipped without it).

    python benches/bench_write_paths.py --gb 1.4 --repeats 3
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

_libc = ctypes.CDLL(None, use_errno=True)


_sfr = getattr(_libc, "sync_file_range", None)
if _sfr is not None:
    _sfr.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
SYNC_FILE_RANGE_WRITE = 2


def syncfs(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _libc.syncfs(fd) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def write_all(fd: int, mv: memoryview) -> None:
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def key_path(root: str, i: int) -> tuple[str, str]:
    name = f"{i:064x}"
    d = os.path.join(root, "blocks", name[:2])
    return d, os.path.join(d, name)


def prepare(root: str, n: int) -> None:
    os.makedirs(os.path.join(root, "tmp"), exist_ok=True)
    for i in range(n):
        os.makedirs(key_path(root, i)[0], exist_ok=True)
    os.sync()


def s_stream(root, blocks, workers):
    path = os.path.join(root, "stream.bin")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for b in blocks:
            write_all(fd, memoryview(b))
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(root)


def _write_tmp(root, b, sync, kick=False):
    tmp = os.path.join(root, "tmp", f"{uuid.uuid4().hex}.partial")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, memoryview(b))
        if sync:
            os.fsync(fd)
        if kick:  # start its writeback now, without waiting for it
            _sfr(fd, 0, 0, SYNC_FILE_RANGE_WRITE)
    finally:
        os.close(fd)
    return tmp


def _name(root, i, tmp):
    d, final = key_path(root, i)
    os.link(tmp, final)
    os.unlink(tmp)
    return d


def _dirs_sync(root, dirs):
    for d in sorted(dirs, key=len, reverse=True):
        fsync_dir(d)
    fsync_dir(os.path.join(root, "tmp"))


def s_per_object(root, blocks, workers):
    def one(i):
        return _name(root, i, _write_tmp(root, blocks[i], True))
    with ThreadPoolExecutor(workers) as ex:
        dirs = set(ex.map(one, range(len(blocks))))
    _dirs_sync(root, dirs)


def s_batch_syncfs(root, blocks, workers):
    with ThreadPoolExecutor(workers) as ex:
        tmps = list(ex.map(lambda i: _write_tmp(root, blocks[i], False), range(len(blocks))))
    syncfs(root)
    dirs = {_name(root, i, t) for i, t in enumerate(tmps)}
    _dirs_sync(root, dirs)


def s_batch_kick(root, blocks, workers):
    with ThreadPoolExecutor(workers) as ex:
        tmps = list(ex.map(lambda i: _write_tmp(root, blocks[i], False, kick=True), range(len(blocks))))
    syncfs(root)
    dirs = {_name(root, i, t) for i, t in enumerate(tmps)}
    _dirs_sync(root, dirs)


def _fdatasync_all(tmps, threads=8):
    def one(t):
        fd = os.open(t, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, tmps))


def s_kick_fdsync(root, blocks, workers):
    """What LocalBlockStore does: writeback started per file, fdatasync of each from 8
    threads at the end (only this writer's files), then links."""
    with ThreadPoolExecutor(workers) as ex:
        tmps = list(ex.map(lambda i: _write_tmp(root, blocks[i], False, kick=True), range(len(blocks))))
    _fdatasync_all(tmps)
    dirs = {_name(root, i, t) for i, t in enumerate(tmps)}
    _dirs_sync(root, dirs)


def s_batch_fdsync(root, blocks, workers):
    with ThreadPoolExecutor(workers) as ex:
        tmps = list(ex.map(lambda i: _write_tmp(root, blocks[i], False), range(len(blocks))))

        def sync_one(t):
            fd = os.open(t, os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        list(ex.map(sync_one, tmps))
    dirs = {_name(root, i, t) for i, t in enumerate(tmps)}
    _dirs_sync(root, dirs)


def s_no_sync(root, blocks, workers):
    def one(i):
        return _name(root, i, _write_tmp(root, blocks[i], False))
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(one, range(len(blocks))))
    os.sync()


STRATEGIES = {"stream": s_stream, "per_object": s_per_object, "batch_syncfs": s_batch_syncfs,
              "batch_kick": s_batch_kick, "kick_fdsync": s_kick_fdsync,
              "batch_fdsync": s_batch_fdsync, "no_sync": s_no_sync}


def fill_cache(path: str, gb: float) -> None:
    """Read a file of `gb` GB through the page cache (create it once)."""
    n = int(gb * 1e9)
    if not os.path.exists(path) or os.path.getsize(path) != n:
        chunk = os.urandom(16 << 20)
        with open(path, "wb") as f:
            left = n
            while left:
                k = min(left, len(chunk))
                f.write(chunk[:k])
                left -= k
        os.sync()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(16 << 20)
        while f.readinto(buf):
            pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gb", type=float, default=1.4)
    ap.add_argument("--block-mib", type=float, default=4.0)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fill-gb", type=float, default=12.0, help="bytes read through the cache for 'populated'")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temp dir under /work)")
    ap.add_argument("--strategies", nargs="*", default=list(STRATEGIES))
    ap.add_argument("--conditions", nargs="*", default=["dropped", "populated"])
    args = ap.parse_args()

    base = args.dir or tempfile.mkdtemp(prefix="tsck-wpaths-", dir="/work" if os.path.isdir("/work") else None)
    bsize = int(args.block_mib * (1 << 20))
    n = max(1, int(args.gb * 1e9) // bsize)
    rng = os.urandom
    print(f"# {n} blocks x {bsize} B = {n * bsize / 1e9:.2f} GB, {args.workers} workers, dir {base}")
    blocks = [rng(bsize) for _ in range(n)]
    fill = os.path.join(base, "fill.bin")
    results: dict[tuple[str, str], list[float]] = {}
    try:
        for rep in range(args.repeats):
            for cond in args.conditions:
                for name in args.strategies:
                    root = os.path.join(base, f"run-{name}")
                    shutil.rmtree(root, ignore_errors=True)
                    prepare(root, n)
                    if cond == "dropped":
                        if not drop_caches():
                            print("# cannot drop caches (not root): 'dropped' skipped")
                            continue
                    else:
                        fill_cache(fill, args.fill_gb)
                    t0 = time.perf_counter()
                    STRATEGIES[name](root, blocks, args.workers)
                    dt = time.perf_counter() - t0
                    gbps = n * bsize / 1e9 / dt
                    results.setdefault((cond, name), []).append(gbps)
                    print(f"  repeat {rep + 1} {cond:9s} {name:13s} {dt:6.2f} s {gbps:5.2f} GB/s", flush=True)
                    shutil.rmtree(root, ignore_errors=True)
                    os.sync()
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    print(f"\n| condition | strategy | GB/s median (min-max) | ÷ stream |")
    print("|---|---|---|---|")
    for cond in args.conditions:
        ref = results.get((cond, "stream"))
        for name in args.strategies:
            v = results.get((cond, name))
            if not v:
                continue
            ratio = f"{statistics.median(v) / statistics.median(ref):.2f}x" if ref else "n/a"
            print(f"| {cond} | {name} | {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f}) | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
