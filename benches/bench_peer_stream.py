#!/usr/bin/env python
"""The copy between peers (tier/stream.py) against a plain socket copy of the same bytes,
between two processes of this machine over loopback TCP, in one run.

A server process holds --mb MB of random blocks (--block KiB each) in memory; this
process is the client. Per block size, each way is run --repeats times, alternating:
  plain        one sendall of the bytes from the server, recv_into a preallocated buffer
               here: no framing, no hashing (the bound a stream is measured against)
  fetch        stream.fetch of every block, into a preallocated buffer (into=), each block
               checked (BLAKE3) on a worker thread while the socket reads the next batch
  fetch-inline the same, the hashing inline (overlap=False)
  fetch-fresh  overlap, no into=: one fresh buffer per batch (its pages faulted in)
  push         stream.push of every block to the server, which receives them into
               pre-touched buffers (alloc=) and checks each (overlap) before it answers;
               the bytes are dropped after (no copy kept)
  hash         BLAKE3 of every block in this process, one thread, no socket: the check's
               own cost
GB/s is bytes / wall seconds (the best of the repeats and their median); ratio is a
way's median over plain's median. cpu is this process's user+system seconds per GB
(the receiver's, except for push). The machine's cores are named in the header: on a
shared 2-core machine the sender, the receiver and the checking thread share them.

    .venv/bin/python benches/bench_peer_stream.py --mb 512 --repeats 5 | tee benches/results/peer_stream.txt
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time

import blake3
import numpy as np

SECRET = b"bench-peer-stream-secret-32bytes"


class _Kv:
    """The c10d Store's one call the stream server makes (job_secret's compare_set)."""

    def compare_set(self, key, expected, desired):
        return SECRET


def _data(mb: int, block: int, seed: int = 7) -> list:
    raw = np.random.default_rng(seed).integers(0, 256, size=mb * 1_000_000 // block * block, dtype=np.uint8)
    mv = memoryview(raw).cast("B")
    return [mv[i:i + block] for i in range(0, mv.nbytes, block)]


def _server(mb: int, block: int, conn) -> None:
    os.environ["TSCK_PEER_HOST"] = "127.0.0.1"
    from tensorstore_ck.tier import stream
    blocks = _data(mb, block)
    table = {blake3.blake3(b).digest(): b for b in blocks}
    whole = blocks[0].obj  # the contiguous array the blocks are views of
    # A push lands in a ring of pre-touched buffers, as in a tier's arena kept between
    # snapshots (the bench drops what it got; pushes run one at a time).
    ring = [np.ones(max(stream.BATCH_BYTES, block), dtype=np.uint8) for _ in range(stream.VERIFY_DEPTH + 2)]
    turn = [0]

    def alloc(n):
        turn[0] += 1
        return ring[turn[0] % len(ring)]
    srv = stream.StreamServer(lookup=table.get, accept=lambda got: None, alloc=alloc)
    addr = srv.listen(_Kv())
    plain = socket.socket()
    plain.bind(("127.0.0.1", 0))
    plain.listen(8)

    def plain_loop():
        while True:
            try:
                c, _ = plain.accept()
            except OSError:
                return
            with c:
                n = int.from_bytes(c.recv(8), "big")
                c.sendall(memoryview(whole)[:n])
    import threading
    threading.Thread(target=plain_loop, daemon=True).start()
    conn.send((addr, plain.getsockname()[1], list(table)))
    conn.recv()  # the client is done
    srv.close()
    plain.close()


def _plain(port: int, buf) -> None:
    mv = memoryview(buf).cast("B")
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(mv.nbytes.to_bytes(8, "big"))
        got = 0
        while got < mv.nbytes:
            k = c.recv_into(mv[got:])
            if not k:
                raise ConnectionError("closed")
            got += k


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=512)
    ap.add_argument("--block", type=int, nargs="+", default=[4096, 64], help="block sizes in KiB")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    os.environ["TSCK_PEER_HOST"] = "127.0.0.1"
    from tensorstore_ck.tier import stream

    print(f"# bench_peer_stream: {args.mb} MB per transfer, loopback TCP between two processes; "
          f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at the start")
    print(f"# python {sys.version.split()[0]}, blake3 {blake3.__version__}, batch {stream.BATCH_BYTES >> 20} MiB, "
          f"verify depth {stream.VERIFY_DEPTH}")
    ctx = mp.get_context("spawn")
    for kib in args.block:
        block = kib << 10
        here, there = ctx.Pipe()
        proc = ctx.Process(target=_server, args=(args.mb, block, there), daemon=True)
        proc.start()
        addr, port, digests = here.recv()
        local = _data(args.mb, block)
        nbytes = sum(b.nbytes for b in local)
        dest = np.empty(nbytes, dtype=np.uint8)
        dest[:] = 1  # pages faulted in once, as an arena kept for the tier would be
        pushed = list(zip(digests, local))

        ways = {
            "plain": lambda: _plain(port, dest),
            "fetch": lambda: stream.fetch(addr, SECRET, digests, max_block=block, into=dest),
            "fetch-inline": lambda: stream.fetch(addr, SECRET, digests, max_block=block, into=dest,
                                                 overlap=False),
            "fetch-fresh": lambda: stream.fetch(addr, SECRET, digests, max_block=block),
            "push": lambda: stream.push(addr, SECRET, pushed),
            "hash": lambda: [blake3.blake3(b).digest() for b in local],
        }
        times = {w: [] for w in ways}
        cpus = {w: [] for w in ways}
        for _ in range(args.repeats):
            for w, fn in ways.items():
                c0, t0 = _cpu(), time.perf_counter()
                got = fn()
                dt = time.perf_counter() - t0
                cpus[w].append(_cpu() - c0)
                times[w].append(dt)
                del got
        if bytes(dest[:block]) != bytes(local[0]) or bytes(dest[-block:]) != bytes(local[-1]):
            raise SystemExit("the fetched bytes are not the server's")
        print(f"\n## {kib} KiB blocks: {len(local)} blocks, {nbytes / 1e9:.3f} GB per transfer, "
              f"{args.repeats} repeats")
        print(f"{'way':<14}{'best GB/s':>11}{'median GB/s':>13}{'ratio':>8}{'cpu s/GB':>10}")
        base = statistics.median(times["plain"])
        for w in ways:
            med = statistics.median(times[w])
            print(f"{w:<14}{nbytes / min(times[w]) / 1e9:>11.2f}{nbytes / med / 1e9:>13.2f}"
                  f"{base / med:>8.2f}{statistics.median(cpus[w]) / (nbytes / 1e9):>10.2f}")
        here.send(None)
        proc.join(30)
    print(f"\n# load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
