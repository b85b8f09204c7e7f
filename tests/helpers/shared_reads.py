"""Collective checkouts whose ranks read each shared block once, on real gloo ranks
(tests/collective/test_shared_reads.py and benches/bench_restore.py).

    python shared_reads.py SCENARIO OUTDIR SPEC_JSON

SPEC_JSON: {"url", "opts" (storage options), "refs" (the LMDB ref table's path), "world",
"mb" (the model's MB), "block" (block size; default 256 KiB), "shared" (open_store's shared_reads), "liar" (a rank whose store
sends damaged copies to the others, or null)}.
  put   every rank puts a DDP-like state: the same "model" on every rank (seeded), and a
        tensor of its own ("mine"); one collective snapshot
  read  every rank checks the snapshot out (collective), saves what it read to
        OUTDIR/read_rank<r>.pt, reports its side channel's counters and its seconds
  killed  every rank checks out with shared reads; rank spec["killed"] is SIGKILLed when it
        first reads a block for a peer (spec "killed_at": "send", the default), or as it
        first tells an owner its blocks, before the ranks' agreement ("register"); the
        others save what they read or the error they got
  stranger  both side channels up on 127.0.0.2 (shared reads; a tier's peer replicas);
        rank 1 knocks at rank 0's servers as a stranger (docs/design/collective.md)
The ranks are forked by dist_worker.launch (the c10d TCPStore hosted by the launcher).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import dist_worker as dw  # noqa: E402
from tensorstore_ck.storage.wrappers import WrappedStore  # noqa: E402
from dist_worker import launcher_main  # noqa: E402
from _util import same_bits  # noqa: E402

BLOCK = 1 << 18


def state(rank: int, mb: float) -> dict:
    g = torch.Generator()
    g.manual_seed(7)
    n = max(1, int(mb * (1 << 20)) // (4 * 8))
    model = {f"layer{i}.w": torch.randn(n, generator=g) for i in range(8)}
    model["bias"] = torch.randn(100, generator=g)  # inline: no block
    return {"model": model, "mine": torch.full((BLOCK // 4 + 10,), float(rank)), "step": 3}


class Liar(WrappedStore):
    """A storage whose whole-object gets of blocks (what a rank's side channel sends its
    peers) come back with one byte changed; its own reads (open_read) are the true bytes."""

    def get(self, key, max_bytes=None):
        data = bytearray(self.inner.get(key, max_bytes))
        if key.startswith("blocks/") and len(data) > 64:
            data[-1] ^= 0xFF
        return bytes(data)


class Killed(WrappedStore):
    """A storage whose first whole-object get of a block (what a rank's side channel reads
    to send its peers, once they asked for it) SIGKILLs the rank: it dies while owners
    are sending, its server's connections cut mid-checkout."""

    def get(self, key, max_bytes=None):
        if key.startswith("blocks/"):
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner.get(key, max_bytes)


def _open(spec, rank, **kw):
    import tensorstore_ck as tsck
    wrap = Liar if spec.get("liar") == rank else Killed if spec.get("killed") == rank else None
    return tsck.open_store(spec["url"], refs=spec["refs"], storage_options=spec["opts"],
                           block_size=spec.get("block", BLOCK),
                           create=True, create_refs=True, wrap_storage=wrap, **kw)


def put_case(rank, world, out, res, arg):
    spec = json.loads(arg)
    with _open(spec, rank) as store:
        info = store.put_snapshot(state(rank, spec["mb"]), ref="j/main", job="j", step=3)
        res["root"] = info.root


def read_case(rank, world, out, res, arg):
    import torch.distributed as dist
    spec = json.loads(arg)
    with _open(spec, rank, shared_reads=spec["shared"]) as store:
        dist.barrier()
        t0 = time.monotonic()
        got = store.checkout("j/main")
        res["seconds"] = time.monotonic() - t0
        torch.save(got, os.path.join(out, f"read_rank{rank}.pt"))
        sh = store._sharing
        res["sharing"] = None if sh is None else {"fetched": sh.fetched, "served": sh.served, "got": sh.got,
                                                  "bad": sh.bad}
        dist.barrier()  # (a rank's server answers its peers until every rank has read)


def killed_case(rank, world, out, res, arg):
    """Every rank checks out with shared reads; rank spec["killed"] is SIGKILLed by its
    storage (Killed) when it first reads a block for a peer. Each other rank reports what
    it read (OUTDIR/killed_rank<r>.pt), or the TsckError it failed with, its seconds and the
    side channel's warnings; no barrier after (the dead rank would never come)."""
    import logging

    import tensorstore_ck as tsck
    spec = json.loads(arg)
    said: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda rec: said.append(rec.getMessage())
    logging.getLogger("tensorstore_ck.collective.shared").addHandler(handler)
    if spec.get("killed_at") == "register" and rank == spec["killed"]:
        import signal

        from tensorstore_ck.collective import shared
        real = shared.SharedRead._list

        def dies(self, addr, op, digests, answer_len):
            if op == b"N":  # (its first registration: the others have begun theirs, or will)
                os.kill(os.getpid(), signal.SIGKILL)
            return real(self, addr, op, digests, answer_len)
        shared.SharedRead._list = dies
    with _open(spec, rank, shared_reads=True) as store:
        t0 = time.monotonic()
        try:
            got = store.checkout("j/main", timeout=spec["timeout"])
            torch.save(got, os.path.join(out, f"killed_rank{rank}.pt"))
            res["failed"] = None
        except tsck.TsckError as e:
            res["failed"] = f"{type(e).__name__}: {e}"
        res["seconds"] = time.monotonic() - t0
        sh = store._sharing
        res["sharing"] = {"fetched": sh.fetched, "served": sh.served, "got": sh.got, "bad": sh.bad}
    res["warnings"] = said  # the side channel's failures this rank read around


def _probe(addr: str, request: bytes, secret: bytes | None = None) -> dict:
    """A stranger's connection to a side channel's server at `addr`: it sends `request`
    (after answering the challenge with `secret`, when given) -> what came back."""
    import socket

    from tensorstore_ck.util.net import prove
    host, port = addr.rsplit(":", 1)
    got = b""
    with socket.create_connection((host, int(port)), timeout=30) as c:
        if secret is not None:
            prove(c, secret)
            sent = b""
        else:
            sent = c.recv(16)  # the challenge, left unanswered
        c.sendall(request)
        c.settimeout(30)
        while True:
            try:
                chunk = c.recv(65536)
            except ConnectionResetError:  # hung up with our request unread: a reset, not an end
                break
            if not chunk:
                break  # the server hung up
            got += chunk
    return {"challenge": len(sent), "answer": len(got)}


def _listening(pid: int, port: int) -> set:
    """The local addresses of the listening TCP sockets of process `pid` on `port`
    (/proc/net/tcp and tcp6: "0.0.0.0" or "::" is every interface)."""
    import ipaddress
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table, size in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/net/{table}") as f:
            next(f)
            for line in f:
                cols = line.split()
                host, hport = cols[1].split(":")
                if cols[3] != "0A" or int(hport, 16) != port or cols[9] not in inodes:  # 0A: LISTEN
                    continue
                raw = bytes.fromhex(host)
                # (the kernel prints each 32-bit word in host order: little-endian here)
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                out.add(str(ipaddress.ip_address(raw)))
    return out


def stranger_case(rank, world, out, res, arg):
    """The side channels' servers up (shared reads; peer replicas of a tier, and their block
    stream), listening on 127.0.0.2; rank 1 knocks at rank 0's as a stranger (without the
    secret, with a wrong one) and reads from the kernel which addresses they listen on
    (none but the announced one)."""
    import torch.distributed as dist

    import tensorstore_ck as tsck
    os.environ["TSCK_PEER_HOST"] = "127.0.0.2"
    spec = json.loads(arg)
    kv = dist.distributed_c10d._get_default_store()
    with _open(spec, rank, shared_reads=True) as store, \
            tsck.open_store(os.path.join(out, "remote"), local=os.path.join(out, f"tier{rank}"), replicas=1) as t:
        got = store.checkout("j/main")
        res["read"] = same_bits(got, state(rank, spec["mb"]))
        t.put_snapshot({"x": torch.arange(70000, dtype=torch.float32)}, ref="t/main", step=1)
        t._tier.peers.wait()
        if rank == 0:
            kv.set("test/share0", store._sharing.addr)
            kv.set("test/pid0", str(os.getpid()))
        dist.barrier()
        if rank == 1:
            key = t._tier.peers._key  # (the store's own part of the key: its remote's URL, hashed)
            share0, peer0 = kv.get("test/share0").decode(), kv.get(f"tsck/peer/{key}0").decode()
            stream0 = kv.get(f"tsck/peerstream/{key}0").decode()
            digest = bytes(range(32))
            g_share = b"G" + bytes(16) + digest + (1 << 20).to_bytes(8, "big")
            frame = bytes(100)
            p_peer = b"P" + b"b" + digest + len(frame).to_bytes(8, "big") + frame
            g_peer = b"G" + b"b" + digest + bytes(8)
            wrong = b"0" * 64
            res["probes"] = {
                "share-read": _probe(share0, g_share), "share-read-wrong": _probe(share0, g_share, wrong),
                "peer-write": _probe(peer0, p_peer), "peer-write-wrong": _probe(peer0, p_peer, wrong),
                "peer-read": _probe(peer0, g_peer),
                # the replicas' block stream (a restore's batched reads): a fetch of one block
                "stream-read": _probe(stream0, b"G" + (1).to_bytes(4, "big") + digest),
                "stream-read-wrong": _probe(stream0, b"G" + (1).to_bytes(4, "big") + digest, wrong)}
            # Which addresses rank 0's servers listen on, as the kernel has them (a connect to
            # 127.0.0.1 at the same port could reach another process's server there).
            pid0 = int(kv.get("test/pid0"))
            res["listening"] = {name: sorted(_listening(pid0, int(addr.rsplit(":", 1)[1])))
                                for name, addr in (("share", share0), ("peer", peer0), ("stream", stream0))}
            res["hosts"] = [share0.rsplit(":", 1)[0], peer0.rsplit(":", 1)[0], stream0.rsplit(":", 1)[0]]
        dist.barrier()
        res["refused"] = store._sharing.refused
        res["strangers"] = t._tier.peers.strangers
        res["peer_stored"] = t.assets.block_exists(bytes(range(32)))


def scenarios(scenario: str, out: str, argv: list) -> list | None:
    spec = json.loads(argv[3])
    body = {"put": put_case, "read": read_case, "stranger": stranger_case, "killed": killed_case}.get(scenario)
    if body is None:
        return None
    return [dw.launch(scenario, spec["world"], body, out, argv[3], limit=240.0)]


if __name__ == "__main__":
    launcher_main(scenarios)
