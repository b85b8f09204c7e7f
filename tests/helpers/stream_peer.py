"""A peer for tests/tier/test_stream.py, in a process of its own: serves N seeded blocks
of SIZE bytes on 127.0.0.1 for the job whose secret is SECRET (hex), as MODE says:

    honest    a StreamServer: fetches answered from the blocks, pushes checked and kept
    flip      a StreamServer whose copy of block 1 has one byte flipped
    longer    a StreamServer whose copy of block 1 has one byte more
    files     a StreamServer whose lookup answers each block from a file of its own
              (FileBlock: sent with sendfile)
    ahead     a StreamServer whose lookup of block i waits until that of block i+1 has
              begun (as a disk read that only ends if the next one was issued meanwhile)
    huge      by hand: proves nothing wrong, answers a fetch with a batch announcing a
              block of 2**40 bytes
    truncate  by hand: answers a fetch with one batch cut in the middle, then closes
    die       by hand: sends one batch whole and half the next, prints MID, and waits
              (the test kills it with SIGKILL)

Prints "ADDR host:port" once it serves; then, for each line "stats" on stdin, "STATS
kept refused strangers held" (a StreamServer's counters, the blocks it keeps)."""

from __future__ import annotations

import os
import random
import socket
import sys
import tempfile
import threading

import blake3

from tensorstore_ck.tier.stream import FileBlock, StreamServer
from tensorstore_ck.util.net import proven, recv_exact


class Kv:
    def __init__(self, secret: bytes):
        self.secret = secret

    def compare_set(self, key, expected, desired):
        return self.secret


def blocks(n: int, size: int, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(n)]


def batch(items) -> bytes:
    """One batch on the wire, by hand: n, payload bytes, (digest, length)s, payload."""
    table = b"".join(d + n.to_bytes(8, "big") for d, n, _b in items)
    payload = b"".join(b for _d, _n, b in items)
    return len(items).to_bytes(4, "big") + len(payload).to_bytes(8, "big") + table + payload


def by_hand(mode: str, secret: bytes, data: list[bytes]) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)
    print("ADDR 127.0.0.1:%d" % sock.getsockname()[1], flush=True)
    conn, _ = sock.accept()
    if not proven(conn, secret):
        return
    recv_exact(conn, 1)
    n = int.from_bytes(recv_exact(conn, 4), "big")
    asked = bytes(recv_exact(conn, 32 * n))
    ds = [asked[i:i + 32] for i in range(0, len(asked), 32)]
    if mode == "huge":
        conn.sendall(batch([(ds[0], 1 << 40, b"")]))
    elif mode == "truncate":
        whole = batch([(d, len(b), b) for d, b in zip(ds[:2], data[:2])])
        conn.sendall(whole[:len(whole) // 2])
        conn.close()
    elif mode == "die":
        conn.sendall(batch([(ds[0], len(data[0]), data[0])]))
        half = batch([(ds[1], len(data[1]), data[1])])
        conn.sendall(half[:len(half) // 2])
        print("MID", flush=True)
        threading.Event().wait()


def main() -> None:
    mode, secret, n, size = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    os.environ["TSCK_PEER_HOST"] = "127.0.0.1"
    data = blocks(n, size)
    if mode in ("huge", "truncate", "die"):
        by_hand(mode, secret, data)
        return
    held = {blake3.blake3(b).digest(): b for b in data}
    first = blake3.blake3(data[1]).digest()
    if mode == "flip":
        held[first] = bytes([data[1][0] ^ 1]) + data[1][1:]
    elif mode == "longer":
        held[first] = data[1] + b"\0"
    kept: dict = {}
    index = {blake3.blake3(b).digest(): i for i, b in enumerate(data)}
    began = [threading.Event() for _ in data]
    lock = threading.Lock()
    now = {"running": 0, "most": 0, "waited_out": 0}
    opened: list = []
    if mode == "files":
        where = tempfile.mkdtemp(prefix="tsck-stream-peer-")
        for d, b in held.items():
            with open(os.path.join(where, d.hex()), "wb") as f:
                f.write(b)

    def lookup(d):
        with lock:
            now["running"] += 1
            now["most"] = max(now["most"], now["running"])
        try:
            i = index.get(d)
            if mode == "ahead" and i is not None:
                began[i].set()
                if i + 1 < len(data) and not now["waited_out"] and not began[i + 1].wait(10):
                    now["waited_out"] += 1  # (once: the rest go on, so a serial server fails fast)
            if mode == "files" and d in held:
                f = open(os.path.join(where, d.hex()), "rb")
                opened.append(f)
                return FileBlock(f, len(held[d]))
            return held.get(d, kept.get(d))
        finally:
            with lock:
                now["running"] -= 1
    srv = StreamServer(lookup=lookup,
                       accept=lambda got: kept.update((d, bytes(mv)) for d, mv in got), max_block=size)
    print("ADDR " + srv.listen(Kv(secret)), flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            print(f"STATS {srv.kept} {srv.refused} {srv.strangers} {len(kept)}", flush=True)
        elif line.strip() == "lookups":
            print(f"LOOKUPS {now['most']} {now['waited_out']} {sum(not f.closed for f in opened)}", flush=True)


if __name__ == "__main__":
    main()
