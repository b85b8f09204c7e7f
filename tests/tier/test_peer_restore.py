"""A restore's batched fetches from a holder (tier/peerreads.py's FromPeers.plan over the
block stream, tier/stream.py): a real holder serving its tier on a real socket, a rank
whose tier lacks the blocks asking it. What the caller's memory may receive, the memory
the fetches hold, and the copies kept afterwards (docs/design/memtier.md, "The restore's
memory")."""

from __future__ import annotations

import datetime
import tracemalloc

import numpy as np
import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.core.walk import walk_commit
from tensorstore_ck.format.frame import HEADER_SIZE, decode_header
from tensorstore_ck.tier.peerreads import FromPeers
from tensorstore_ck.tier.replicas import Peers
from tensorstore_ck.tier.stream import BATCH_BYTES
from tensorstore_ck.util.net import job_secret

MIB = 1 << 20


@pytest.fixture
def side(monkeypatch):
    """A real c10d Store (the job's secret and the stream's address live there), the side
    channels on 127.0.0.1, two ranks on one host: rank 1 holds rank 0's copies."""
    import torch.distributed as dist
    monkeypatch.setenv("TSCK_PEER_HOST", "127.0.0.1")
    kv = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    for r in range(2):
        kv.set(f"tsck/node/{r}", b"host")
    return kv


def _pair(holder_core, asker_core, kv):
    """(holder, asker): rank 1 serving its tier, rank 0 asking it."""
    holder = Peers(holder_core, 1)
    holder.kv, holder.rank, holder.world = kv, 1, 2
    holder._listen()
    asker = Peers(asker_core, 1)
    asker.kv, asker.rank, asker.world = kv, 0, 2
    asker._secret = job_secret(kv)
    return holder, asker


def _blocks(store, n_mib: int, seed: int = 0) -> list[tuple[bytes, bytes]]:
    """A snapshot of n_mib MiB of random floats (stored raw: they do not compress) ->
    [(digest, the block's bytes)]."""
    g = torch.Generator().manual_seed(seed)
    store.put_snapshot({"x": torch.randn(n_mib * MIB // 4, generator=g)}, "r")
    out = []
    for o in walk_commit(store.assets, bytes.fromhex(store.resolve("r"))):
        if o.kind == "block":
            frame = store.assets.stored_frame("block", o.digest)
            assert decode_header(frame[:HEADER_SIZE]).codec == 0  # (raw: the case placed into destinations)
            out.append((o.digest, bytes(frame[HEADER_SIZE:])))
    return out


def test_a_restore_from_a_peer_holds_one_batch_per_fetching_thread_and_keeps_the_copies_after(tmp_path, side):
    """96 MiB fetched from the holder into the caller's memory (bounce) and into fresh
    memory: every destination gets its block, bit for bit; the fetches hold at most one
    batch buffer per fetching thread (traced: under 2.5 batches, where keeping every
    fetched frame for the tier held all 96 MiB); and once the checkout is done the copies
    are fetched again and kept in the rank's tier, durable at close."""
    with tsck.open_store(str(tmp_path / "b"), block_size=MIB) as b, \
            tsck.open_store(str(tmp_path / "a"), block_size=MIB) as a:
        blocks = _blocks(b, 96)
        holder, asker = _pair(b.core, a.core, side)
        try:
            outs = [np.zeros(len(raw), dtype=np.uint8) for _d, raw in blocks]
            jobs = [(d, out, "x", i % 2 == 0) for i, ((d, _r), out) in enumerate(zip(blocks, outs))]
            reads = FromPeers(asker, a.assets)
            tracemalloc.start()
            try:
                with asker.keeping_after():  # (as a checkout: the copies are kept once it is done)
                    filled = reads.plan(jobs, a.assets)
                    _cur, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
            assert peak < 2.5 * BATCH_BYTES, f"the restore's fetches held {peak / MIB:.0f} MiB"
            assert all(np.array_equal(out, np.frombuffer(raw, np.uint8)) for out, (_d, raw) in zip(outs, blocks))
            assert all(filled.filled_job(d, out) for d, out, _p, _b in jobs)
            assert asker.streamed == len(blocks) and asker.blocks_alone == 0
            asker.close()  # (the copies are fetched again and kept: done by here)
        finally:
            holder.close()
        assert all(a.assets.block_exists(d) for d, _raw in blocks)
        assert asker.streamed == len(blocks)  # (the keeper's fetches count as no restore's)


def test_the_callers_memory_never_holds_a_liars_bytes(tmp_path, side):
    """The holder's copies of two blocks are damaged (its disk, or a liar), one bound for
    the caller's memory (bounce), one for fresh memory (received straight into it). The
    holder's answer to that request is refused whole and nothing of it is filled (the
    chain reads it elsewhere); each destination of the caller's memory holds its old bytes
    or its block's, never another byte. The other request is filled, bit for bit."""
    from tensorstore_ck.core.assets import Assets
    # (the asking tier's block size makes a request of 4 blocks: FETCH_BYTES / 16 MiB)
    with tsck.open_store(str(tmp_path / "b"), block_size=MIB) as b, \
            tsck.open_store(str(tmp_path / "a"), block_size=16 * MIB) as a:
        blocks = _blocks(b, 8, seed=1)
        for i in (2, 3):
            key = tmp_path / "b" / Assets.object_key("blocks", blocks[i][0])
            frame = bytearray(key.read_bytes())
            frame[-1] ^= 0xFF
            key.chmod(0o644)
            key.write_bytes(bytes(frame))
        holder, asker = _pair(b.core, a.core, side)
        try:
            outs = [np.full(len(raw), 0xAB, dtype=np.uint8) for _d, raw in blocks]
            jobs = [(d, out, "x", i % 2 == 0) for i, ((d, _r), out) in enumerate(zip(blocks, outs))]
            filled = FromPeers(asker, a.assets).plan(jobs, a.assets)
            assert (outs[2] == 0xAB).all(), "the caller's memory holds bytes that are not its block's"
            for i in (0, 2):
                assert (outs[i] == 0xAB).all() or np.array_equal(outs[i], np.frombuffer(blocks[i][1], np.uint8)), i
            assert not any(filled.filled_job(d, out) for (d, _r), out in zip(blocks[:4], outs[:4]))
            for i in range(4, 8):
                assert np.array_equal(outs[i], np.frombuffer(blocks[i][1], np.uint8)), i
                assert filled.filled_job(blocks[i][0], outs[i]), i
            assert asker.bad == 1 and asker.streamed == 4
        finally:
            asker.close()
            holder.close()


def test_a_fetch_to_keep_is_sent_at_a_low_priority_and_a_restores_at_the_servers(tmp_path, side):
    """The keeper's fetch (stream.fetch(low=True), op g) is sent by a server thread at
    nice LOW_NICE or more, so a holder's second sending of a part yields its cores to the
    job; a restore's fetch (op G) is sent at the server's own priority."""
    import os
    import threading

    import blake3

    from tensorstore_ck.tier.stream import LOW_NICE, FileBlock, StreamServer, fetch

    nice: list = []

    class Noted(FileBlock):
        def send(self, sock):
            nice.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            super().send(sock)

    data = os.urandom(1 << 16)
    d = blake3.blake3(data).digest()
    (tmp_path / "block").write_bytes(data)
    server = StreamServer(lookup=lambda x: Noted(open(tmp_path / "block", "rb"), len(data)) if x == d else None)
    try:
        addr = server.listen(side)
        own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert bytes(fetch(addr, job_secret(side), [d])[0]) == data
        assert bytes(fetch(addr, job_secret(side), [d], low=True)[0]) == data
        assert nice == [own, max(own, LOW_NICE)], nice
    finally:
        server.close()


def test_a_block_with_a_place_is_received_into_it_and_checked_there(side):
    """stream.fetch(place=): a block whose place names buffers is received into them (no
    buffer between: the check gets that list, and its bytes are the block's there); one
    without a place lands in the batch's buffer; a place of the wrong length is the
    caller's error."""
    import os

    import blake3

    from tensorstore_ck.tier.stream import StreamServer, fetch, raw_block

    data = [os.urandom(1000 + i) for i in range(3)]
    ds = [blake3.blake3(b).digest() for b in data]
    server = StreamServer(lookup=dict(zip(ds, data)).get)
    try:
        addr, secret = server.listen(side), job_secret(side)
        head, body = bytearray(10), bytearray(len(data[1]) - 10)
        got = []

        def check(d, mv):
            got.append(type(mv) is list)
            if type(mv) is list:
                return raw_block(d, memoryview(bytes(mv[0]) + bytes(mv[1])))
            return raw_block(d, mv)
        out = fetch(addr, secret, ds, check=check,
                    place=lambda d, n: [memoryview(head), memoryview(body)] if d == ds[1] else None)
        assert [bytes(b) for b in out] == data and got == [False, True, False]
        assert bytes(head) + bytes(body) == data[1]
        with pytest.raises(ValueError):
            fetch(addr, secret, ds, place=lambda d, n: [memoryview(bytearray(n + 1))])
    finally:
        server.close()
