"""Blocks streamed between peers (tier/stream.py), between real processes: a peer
(tests/helpers/stream_peer.py) serves blocks; this process fetches and pushes. A round trip
of many blocks arrives whole and checked, the server reading ahead of what it sends; a
peer that lies (a flipped byte, a length one too long, a length no block can take, a
stream cut short) is refused with the project's
errors and nothing it sent is returned or kept; a peer killed mid-transfer is an error
at once, not a hang (the kill is the event: the timeouts here are only a backstop); a
connection without the job's secret, or to an address the peer never announced, is
refused and gets nothing."""

from __future__ import annotations

import random
import socket
import subprocess
import sys
import time

import blake3
import pytest

import _zygote as zygote
from _util import HELPERS, child_env, kill_and_close, line_from
from tensorstore_ck.errors import FormatError, IntegrityError, StorageError
from tensorstore_ck.tier import stream

pytestmark = pytest.mark.slow

SECRET = bytes(range(32))
N, SIZE = 300, 70_000  # 21 MB: two batches and a half, blocks of an odd size


def _blocks(n=N, size=SIZE, seed=1):
    rng = random.Random(seed)  # (the helper's blocks: the same seed)
    return [rng.randbytes(size) for _ in range(n)]


@pytest.fixture
def peer():
    started = []

    def start(mode, n=N, size=SIZE):
        p = zygote.Popen([sys.executable, str(HELPERS / "stream_peer.py"), mode, SECRET.hex(), str(n), str(size)],
                         env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
        started.append(p)
        p.addr = line_from(p, "ADDR ", 60).split()[1]
        return p
    yield start
    for p in started:
        if p.poll() is None:
            p.stdin.close()
            kill_and_close(p)


def _stats(p) -> dict:
    p.stdin.write("stats\n")
    p.stdin.flush()
    kept, refused, strangers, held = map(int, line_from(p, "STATS ", 30).split()[1:])
    return {"kept": kept, "refused": refused, "strangers": strangers, "held": held}


def test_many_blocks_fetched_and_pushed_round_trip_checked(peer):
    p = peer("honest")
    data = _blocks()
    ds = [blake3.blake3(b).digest() for b in data]
    absent = blake3.blake3(b"not there").digest()
    got = stream.fetch(p.addr, SECRET, ds + [absent], max_block=SIZE, timeout=30)
    assert [bytes(g) for g in got[:-1]] == data and got[-1] is None
    dest = bytearray(N * SIZE)  # into= the caller's memory: the blocks back to back
    got = stream.fetch(p.addr, SECRET, ds, max_block=SIZE, into=dest, overlap=False, timeout=30)
    assert bytes(dest) == b"".join(data) and [bytes(g) for g in got] == data
    mine = _blocks(40, SIZE, seed=2)
    assert stream.push(p.addr, SECRET, [(blake3.blake3(b).digest(), b) for b in mine], timeout=30) == 40
    back = stream.fetch(p.addr, SECRET, [blake3.blake3(b).digest() for b in mine], max_block=SIZE, timeout=30)
    assert [bytes(g) for g in back] == mine
    tiny = _blocks(2500, 100, seed=4)  # full batches of MAX_BATCH_BLOCKS blocks, past one sendmsg's buffers
    assert stream.push(p.addr, SECRET, [(blake3.blake3(b).digest(), b) for b in tiny], timeout=30) == 2500
    back = stream.fetch(p.addr, SECRET, [blake3.blake3(b).digest() for b in tiny], max_block=SIZE, timeout=30)
    assert [bytes(g) for g in back] == tiny
    assert _stats(p) == {"kept": 2540, "refused": 0, "strangers": 0, "held": 2540}


def test_a_server_reads_ahead_of_the_block_it_sends_within_its_bound(peer):
    # Its lookups stand for a disk's reads: a server that looked one block up only after
    # sending the one before left the disk idle while it sent (and the socket while it read).
    p = peer("ahead")
    data = _blocks()
    got = stream.fetch(p.addr, SECRET, [blake3.blake3(b).digest() for b in data], max_block=SIZE, timeout=60)
    assert [bytes(g) for g in got] == data
    most, waited_out, _open = _lookups(p)
    assert waited_out == 0, "a lookup ran alone: the next block was not read while one was"
    assert 2 <= most <= stream.READ_AHEAD, most  # (what a fetch holds beyond its batch is bounded)


def _lookups(p) -> tuple:
    p.stdin.write("lookups\n")
    p.stdin.flush()
    return tuple(map(int, line_from(p, "LOOKUPS ", 30).split()[1:]))


def test_blocks_sent_from_their_files_arrive_whole_and_every_file_is_closed(peer):
    p = peer("files")
    data = _blocks()
    ds = [blake3.blake3(b).digest() for b in data]
    absent = blake3.blake3(b"not there").digest()
    got = stream.fetch(p.addr, SECRET, ds[:5] + [absent] + ds[5:], max_block=SIZE, timeout=30)
    assert [bytes(g) for g in got[:5] + got[6:]] == data and got[5] is None
    assert _lookups(p)[2] == 0
    # A fetch its asker cuts short: the files the server had looked up ahead are closed too.
    sock = stream._connect(p.addr, SECRET, 30)
    sock.sendall(b"G" + len(ds).to_bytes(4, "big") + b"".join(ds))
    sock.recv(1 << 16)  # (the first batch has begun)
    sock.close()
    deadline = time.monotonic() + 60  # (a backstop: the server's failed send is the event)
    while _lookups(p)[2] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _lookups(p)[2] == 0, "a file looked up for a fetch cut short stayed open"


@pytest.mark.parametrize("mode", ["flip", "longer"])
@pytest.mark.parametrize("overlap", [True, False])
def test_a_peer_that_sends_wrong_bytes_or_a_wrong_length_is_refused(peer, mode, overlap):
    p = peer(mode)
    ds = [blake3.blake3(b).digest() for b in _blocks()]
    with pytest.raises(IntegrityError, match=f"block {ds[1].hex()[:16]}.* does not match its address"):
        stream.fetch(p.addr, SECRET, ds, max_block=SIZE + 1, overlap=overlap, timeout=30)
    with pytest.raises(FormatError if mode == "longer" else IntegrityError):
        stream.fetch(p.addr, SECRET, ds[1:2], max_block=SIZE, overlap=overlap, timeout=30)


def test_a_length_no_block_can_take_is_refused_before_any_buffer(peer):
    p = peer("huge")
    with pytest.raises(FormatError, match="more than a block may take"):
        stream.fetch(p.addr, SECRET, [blake3.blake3(b"x").digest()], max_block=SIZE, timeout=30)


def test_a_stream_cut_short_is_a_storage_error(peer):
    p = peer("truncate")
    ds = [blake3.blake3(b).digest() for b in _blocks()]
    with pytest.raises(StorageError, match="failed after 0 arrived.*closed"):
        stream.fetch(p.addr, SECRET, ds[:2], max_block=SIZE, timeout=30)


def test_a_peer_killed_mid_transfer_is_an_error_at_once(peer):
    from _util import in_thread
    p = peer("die")
    ds = [blake3.blake3(b).digest() for b in _blocks()]
    thread, out = in_thread(lambda: stream.fetch(p.addr, SECRET, ds[:4], max_block=SIZE, timeout=120))
    line_from(p, "MID", 60)  # one block sent whole, half of the next
    p.stdin.close()
    kill_and_close(p)
    thread.join(60)  # (a backstop: the kill ends the connection at once)
    assert not thread.is_alive(), "the fetch hung after its peer died"
    err = out["error"]
    assert isinstance(err, StorageError) and "failed after 1 arrived" in str(err), err


def test_a_push_with_a_wrong_block_is_refused_whole(peer):
    p = peer("honest")
    mine = _blocks(60, SIZE, seed=3)
    items = [(blake3.blake3(b).digest(), b) for b in mine]
    items[45] = (items[45][0], mine[44])  # one block's bytes under another's address
    with pytest.raises(IntegrityError, match="refused the push of 60 block.*kept none"):
        stream.push(p.addr, SECRET, items, timeout=30)
    items[45] = (items[45][0], mine[45] + b"\0")  # a byte too many: past the peer's bound, so
    with pytest.raises(StorageError, match="pushing 60"):  # it closes (the stream cannot be followed)
        stream.push(p.addr, SECRET, items, timeout=30)
    items[45] = (items[45][0], mine[45][:-1])  # a byte too few
    with pytest.raises(IntegrityError, match="kept none"):
        stream.push(p.addr, SECRET, items, timeout=30)
    assert _stats(p) == {"kept": 0, "refused": 3, "strangers": 0, "held": 0}


def test_a_push_announcing_a_length_past_the_bound_is_cut_off(peer):
    p = peer("honest")
    conn = socket.create_connection(tuple_addr(p.addr), timeout=30)
    from tensorstore_ck.util.net import prove
    prove(conn, SECRET)
    d = blake3.blake3(b"x").digest()
    conn.sendall(b"P" + (1).to_bytes(4, "big") + (1 << 40).to_bytes(8, "big") + d + (1 << 40).to_bytes(8, "big"))
    assert conn.recv(1) == b""  # closed, no buffer of 2**40 bytes made
    conn.close()
    assert _stats(p) == {"kept": 0, "refused": 1, "strangers": 0, "held": 0}


def tuple_addr(addr: str):
    host, port = addr.rsplit(":", 1)
    return host, int(port)


def test_a_stranger_is_refused_and_an_unannounced_address_answers_nothing(peer):
    p = peer("honest")
    data = _blocks()
    ds = [blake3.blake3(b).digest() for b in data]
    other = bytes(32)
    with pytest.raises(StorageError, match="fetching"):
        stream.fetch(p.addr, other, ds[:3], max_block=SIZE, timeout=30)
    with pytest.raises(StorageError, match="pushing"):
        stream.push(p.addr, other, [(ds[0], data[0])], timeout=30)
    assert _stats(p) == {"kept": 0, "refused": 0, "strangers": 2, "held": 0}
    port = p.addr.rsplit(":", 1)[1]
    with pytest.raises(StorageError):  # the peer listens on 127.0.0.1 only
        stream.fetch(f"127.0.0.2:{port}", SECRET, ds[:1], max_block=SIZE, timeout=30)
