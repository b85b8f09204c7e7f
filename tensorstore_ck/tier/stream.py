"""Blocks streamed between peers (docs/design/memtier.md, "The channel"): many blocks in
flight on one connection of the job's TCP side channel (util/net.py: a server on the
address the ranks announce, every connection proving the job's secret first), packed in
large messages with no round trip per block, each block checked against its BLAKE3
address by the process that receives it before anything keeps or returns it.

    push(addr, secret, blocks)      send [(digest, bytes)] to a peer's StreamServer: it
                                    keeps them all, or none (-> how many it kept)
    fetch(addr, secret, digests)    the blocks a peer holds in memory, checked (-> a list
                                    in the asked order, None where the peer lacks one)
    StreamServer                    the peer's side: lookup(digest) answers fetches,
                                    accept(blocks) takes a checked push whole

Wire, after the proof: a request's first byte is its op.
    P  then batches, then an empty batch   -> status (1: kept, 0: refused), count (8),
                                              reason's length (2), reason (utf-8)
    G  n (4), n digests                    -> batches naming the asked digests in order,
                                              then an empty batch
    g  as G                                 -> as G, sent by a thread at nice LOW_NICE (a
                                              copy to keep, not a restore waiting for it)
A batch: n (4), payload bytes (8), n x (digest 32, length 8), then the n blocks back to
back. A fetched block the server lacks has length MISSING and no bytes. Every count and
length is bounded before a buffer is made (MAX_BATCH_BLOCKS, max_block), so a peer's
header cannot make this process allocate what it likes.

Cost: a sender writes each batch with one sendmsg over the blocks' own buffers (no copy
to batch them), or a block from its file with sendfile (a server's lookup may answer a
FileBlock: no copy through the process), looking blocks up READ_AHEAD ahead of the one
it sends; a receiver reads each batch's payload with recv_into into one buffer (a
caller's `into` or `alloc`'s, or one per batch), or a block where the caller's `place`
puts it (a restore's destination), and hashes it on a worker thread while the socket
reads the next batch (`overlap`: BLAKE3 releases the GIL), at most VERIFY_DEPTH batches
behind. Nothing is hashed twice: a server sends what it holds as it holds it (what it
keeps was checked on arrival, and the receiver checks again anyway: peers are untrusted).

Errors: bytes that are not their address's, a length past a bound or not what was
announced, an answer naming blocks that were not asked: IntegrityError or FormatError,
and nothing of that transfer is kept or returned. A peer that closes, dies or stays
silent for `timeout` seconds: StorageError naming the peer and how far the transfer got.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
from collections import deque
from concurrent.futures import CancelledError, ThreadPoolExecutor

import blake3

from ..errors import FormatError, IntegrityError, StorageError, TsckError
from ..util.net import job_secret, listen_on, peer_name, prove, recv_exact, recv_into, serve

__all__ = ["push", "fetch", "raw_block", "StreamServer", "FileBlock", "ReusedBuffers", "BATCH_BYTES", "MAX_BATCH_BLOCKS", "MAX_BLOCK",
           "STREAM_TIMEOUT",
           "VERIFY_DEPTH"]

log = logging.getLogger(__name__)

BATCH_BYTES = 16 << 20      # payload a sender packs into one batch (a larger block goes alone)
MAX_BATCH_BLOCKS = 1024     # blocks in one batch (one sendmsg's buffers stay under IOV_MAX)
MAX_BLOCK = 64 << 20        # the largest block a receiver takes unless told another bound
MAX_FETCH = 1 << 22         # digests in one fetch request
STREAM_TIMEOUT = 60.0       # seconds a peer may stay silent mid-transfer
VERIFY_DEPTH = 2            # batches read ahead of the hashing
READ_AHEAD = 4              # a server's lookups running ahead of the block it sends
LOW_NICE = 10               # a low-priority fetch's sending thread's nice value (Linux: per thread)
MISSING = (1 << 64) - 1     # a fetched block's length when the server lacks it
_SOCK_BUF = 4 << 20         # the sockets' kernel buffers: a batch in flight while the next is packed
_IOV = 1024                 # buffers one sendmsg takes (Linux's IOV_MAX)
_DIGEST = 32
_ENTRY = _DIGEST + 8


# -- batches -----------------------------------------------------------------------------

def _batches(blocks, batch_bytes: int):
    """[(digest, buffer)] -> runs of consecutive blocks of at most batch_bytes payload
    (a larger block alone) and at most MAX_BATCH_BLOCKS blocks."""
    run, size = [], 0
    for d, mv in blocks:
        n = 0 if mv is None else mv.nbytes
        if run and (size + n > batch_bytes or len(run) >= MAX_BATCH_BLOCKS):
            yield run
            run, size = [], 0
        run.append((d, mv))
        size += n
    if run:
        yield run


class FileBlock:
    """A block a server sends from its file (a lookup's answer): the kernel copies it to
    the socket (sendfile), so it passes through no buffer of the process, and a disk's
    pages are read into the page cache only. `f`: a binary file open for reading, at
    least `nbytes` long; closed once sent."""

    __slots__ = ("f", "nbytes")

    def __init__(self, f, nbytes: int):
        self.f, self.nbytes = f, nbytes

    def send(self, sock) -> None:
        if sock.sendfile(self.f, 0, self.nbytes) != self.nbytes:
            raise OSError(f"a block's file ended before its {self.nbytes} bytes were sent")

    def close(self) -> None:
        self.f.close()


def _send_batch(sock, run) -> None:
    """One batch: its header and table, then each block from its own buffer (sendmsg),
    or from its file (FileBlock)."""
    table = bytearray()
    total = 0
    for d, mv in run:
        n = MISSING if mv is None else mv.nbytes
        table += d + n.to_bytes(8, "big")
        total += 0 if mv is None else n
    bufs = [memoryview(len(run).to_bytes(4, "big") + total.to_bytes(8, "big") + bytes(table))]
    for _d, mv in run:
        if isinstance(mv, FileBlock):
            _send_all(sock, bufs)
            bufs = []
            mv.send(sock)
        elif mv is not None and mv.nbytes:
            bufs.append(mv)
    _send_all(sock, bufs)


def _send_end(sock) -> None:
    sock.sendall(bytes(12))


def _send_all(sock, bufs: list) -> None:
    """Every byte of `bufs` (memoryviews of bytes), in few sendmsg calls (a partial send
    goes on from where it stopped)."""
    i = 0
    while i < len(bufs):
        sent = sock.sendmsg(bufs[i:i + _IOV])
        while sent and i < len(bufs):
            n = bufs[i].nbytes
            if sent >= n:
                sent -= n
                i += 1
            else:
                bufs[i] = bufs[i][sent:]
                sent = 0


def _read_table(sock, max_block: int, *, allow_missing: bool):
    """A batch's header and table -> [(digest, length or None)], its payload bytes; [] at
    the end marker. Bounds every count and length first (FormatError)."""
    head = recv_exact(sock, 12)
    n, total = int.from_bytes(head[:4], "big"), int.from_bytes(head[4:], "big")
    if n == 0:
        if total:
            raise FormatError(f"a peer's end of stream announced {total} bytes")
        return [], 0
    if n > MAX_BATCH_BLOCKS:
        raise FormatError(f"a peer announced a batch of {n} blocks (at most {MAX_BATCH_BLOCKS})")
    raw = recv_exact(sock, n * _ENTRY)
    entries, s = [], 0
    for i in range(0, len(raw), _ENTRY):
        d, length = bytes(raw[i:i + _DIGEST]), int.from_bytes(raw[i + _DIGEST:i + _ENTRY], "big")
        if length == MISSING and allow_missing:
            entries.append((d, None))
            continue
        if length > max_block:
            raise FormatError(f"a peer announced {length} bytes for block {d.hex()[:16]}, more than a block "
                              f"may take ({max_block})")
        entries.append((d, length))
        s += length
    if s != total:
        raise FormatError(f"a peer's batch announced {total} bytes of payload, its blocks {s}")
    return entries, total


def raw_block(d: bytes, mv):
    """The default check: the bytes are the block itself, whose BLAKE3 is its address ->
    the bytes; IntegrityError if they are not."""
    got = blake3.blake3(mv).digest()
    if got != d:
        raise IntegrityError(f"a peer's copy of block {d.hex()[:16]} ({mv.nbytes} bytes) does not match its "
                             "address", expected=d.hex(), got=got.hex())
    return mv


def _check(items, check=raw_block) -> list:
    """The blocks of one batch, each checked against its address -> [(digest, what
    check(digest, its bytes) gave, or None)]; IntegrityError on the first that is not
    its address's."""
    return [(d, None if mv is None else check(d, mv)) for d, mv in items]


def _lay(entries, places, buf) -> tuple[list, list]:
    """Where a batch's payload lands: each block in the buffers its place gave (a list),
    the others back to back in `buf` -> ([(digest, its memoryview in `buf`, its place's
    list, or None: missing)], the views to receive into in the wire's order, neighbours in
    `buf` as one)."""
    items, views, at, start = [], [], 0, 0
    for (d, n), p in zip(entries, places):
        if n is None:
            items.append((d, None))
        elif p is None:
            items.append((d, buf[at:at + n]))
            at += n
        else:
            if sum(v.nbytes for v in p) != n:
                raise ValueError(f"a place for block {d.hex()[:16]} is not its {n} bytes")
            if at > start:
                views.append(buf[start:at])
            views += p
            start = at
            items.append((d, p))
    if at > start:
        views.append(buf[start:at])
    return items, views


class _Receiver:
    """Reads batches from a socket and checks them, the hashing of one batch overlapped
    with the reading of the next (on a worker thread, at most VERIFY_DEPTH behind) or
    inline (overlap=False). Payload lands where `place` puts a block, else in `into`
    (consecutive, when given) or in one fresh buffer per batch."""

    def __init__(self, sock, max_block: int, *, overlap: bool, into=None, alloc=None, allow_missing: bool = False,
                 check=raw_block, place=None):
        self.sock, self.max_block, self.allow_missing, self.alloc = sock, max_block, allow_missing, alloc
        self.check, self.place = check, place
        self.into = None if into is None else memoryview(into).cast("B")
        self.at = 0
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="tsck-stream-check") if overlap else None
        self.blocks = 0
        self.ended = False  # the end marker was read (a failed check may surface after it)

    def run(self, expect=None) -> list:
        """Every batch up to the end marker -> [(digest, memoryview or None)], checked.
        expect: the digests the batches must name, in order (a fetch's)."""
        out, pending = [], deque()
        try:
            while True:
                entries, total = _read_table(self.sock, self.max_block, allow_missing=self.allow_missing)
                if not entries:
                    self.ended = True
                    break
                if expect is not None:
                    want = expect[self.blocks:self.blocks + len(entries)]
                    if [d for d, _n in entries] != want:
                        raise FormatError("a peer's answer names blocks that were not asked for, or not in "
                                          "the order asked")
                places = [None if n is None or self.place is None else self.place(d, n) for d, n in entries]
                placed = sum(n for (_d, n), p in zip(entries, places) if p is not None)
                items, views = _lay(entries, places, self._buffer(total - placed))
                for v in views:
                    recv_into(self.sock, v)
                self.blocks += len(entries)
                if self.pool is None:
                    out += _check(items, self.check)
                    continue
                pending.append(self.pool.submit(_check, items, self.check))
                while len(pending) > VERIFY_DEPTH or (pending and pending[0].done()):
                    out += pending.popleft().result()
            while pending:
                out += pending.popleft().result()
            return out
        finally:
            for f in pending:
                f.cancel()
            if self.pool is not None:
                self.pool.shutdown(wait=True)

    def _buffer(self, n: int):
        if self.into is None:
            # (bytearray, zeroed: a numpy buffer this large asks for huge pages, whose
            # compaction stalled fresh batches to under half bytearray's rate here)
            return memoryview(bytearray(n) if self.alloc is None else self.alloc(n)).cast("B")[:n]
        if self.at + n > self.into.nbytes:
            raise FormatError(f"a peer sent more bytes than the {self.into.nbytes} the caller made room for")
        mv = self.into[self.at:self.at + n]
        self.at += n
        return mv


class ReusedBuffers:
    """An alloc= for a receiver that checks each batch before it reads the next
    (overlap=False) and whose check keeps nothing of it: one buffer per thread, grown to
    the largest batch and given again (its pages faulted in once); gone with this object."""

    def __init__(self):
        self._mine = threading.local()

    def __call__(self, n: int):
        buf = getattr(self._mine, "buf", None)
        if buf is None or len(buf) < n:
            buf = self._mine.buf = bytearray(n)
        return buf


# -- the client ----------------------------------------------------------------------------

def _connect(addr: str, secret: bytes, timeout: float):
    host, port = addr.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=timeout)
    try:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
        prove(conn, secret)
    except OSError:
        conn.close()
        raise
    return conn


def _views(blocks) -> list:
    out = []
    for d, data in blocks:
        if len(d) != _DIGEST:
            raise FormatError(f"a block's address is {_DIGEST} bytes, got {len(d)}")
        out.append((bytes(d), memoryview(data).cast("B")))
    return out


def push(addr: str, secret: bytes, blocks, *, timeout: float = STREAM_TIMEOUT,
         batch_bytes: int = BATCH_BYTES) -> int:
    """Send [(digest, bytes-like)] to the StreamServer at `addr` ("host:port"), proving
    the job's `secret` -> the number of blocks it kept (all of them). IntegrityError or
    FormatError when it refused the push (a block not its address's, past its bounds;
    it kept none), StorageError when it cannot be reached or fails mid-way."""
    views = _views(blocks)
    sent = 0
    try:
        with _connect(addr, secret, timeout) as conn:
            conn.sendall(b"P")
            for run in _batches(views, batch_bytes):
                _send_batch(conn, run)
                sent += len(run)
            _send_end(conn)
            head = recv_exact(conn, 11)
            ok, count = head[0], int.from_bytes(head[1:9], "big")
            reason = bytes(recv_exact(conn, int.from_bytes(head[9:], "big"))).decode("utf-8", "replace")
    except OSError as e:
        raise StorageError(f"pushing {len(views)} block(s) to the peer at {addr} failed after {sent} were sent: "
                           f"{e}") from None
    if ok != 1:
        raise IntegrityError(f"the peer at {addr} refused the push of {len(views)} block(s) and kept none: "
                             f"{reason}")
    if count != len(views):
        raise StorageError(f"the peer at {addr} kept {count} of the {len(views)} block(s) pushed")
    return count


def fetch(addr: str, secret: bytes, digests, *, max_block: int = MAX_BLOCK, into=None, overlap: bool = True,
          timeout: float = STREAM_TIMEOUT, check=raw_block, place=None, alloc=None, low: bool = False) -> list:
    """The blocks `digests` from the StreamServer at `addr`, each checked against its
    address -> a list in the order asked: a memoryview of the block's bytes, or None
    where the peer lacks it. into: a writable buffer the blocks land in, back to back
    (the caller's memory: nothing else is allocated for them); else one buffer per batch.
    place(digest, length) -> None, or writable memoryviews of `length` bytes in all that
    the block's bytes are received into, in turn (a restore's destination: no buffer
    between the socket and it, nor pages faulted in for one); check then gets that list.
    alloc(n) -> a writable buffer of n bytes or more for a batch's other blocks: with
    overlap=False each batch is checked before the next is read, so it may give one
    buffer again and again when check keeps nothing of it. low: the server sends at a low
    priority (op g: background work, e.g. a copy to keep, yields its cores to the job).
    check(digest, memoryview) -> what the list holds for the block, or IntegrityError:
    the default takes the bytes as the block itself; a peer sending stored frames is
    checked by decoding them (tier/replicas.py). After a failure the places hold what
    arrived, unchecked: not the blocks.
    IntegrityError or FormatError when the peer lies (wrong bytes, a length past
    max_block or past `into`, blocks not asked): nothing is returned then. StorageError
    when it cannot be reached, closes or stays silent for `timeout` seconds."""
    want = [bytes(d) for d in digests]
    if len(want) > MAX_FETCH:
        raise FormatError(f"a fetch asks at most {MAX_FETCH} blocks, not {len(want)}")
    if any(len(d) != _DIGEST for d in want):
        raise FormatError(f"a block's address is {_DIGEST} bytes")
    rx = None
    try:
        with _connect(addr, secret, timeout) as conn:
            conn.sendall((b"g" if low else b"G") + len(want).to_bytes(4, "big") + b"".join(want))
            rx = _Receiver(conn, max_block, overlap=overlap, into=into, alloc=alloc, allow_missing=True, check=check,
                           place=place)
            got = rx.run(expect=want)
    except OSError as e:
        done = 0 if rx is None else rx.blocks
        raise StorageError(f"fetching {len(want)} block(s) from the peer at {addr} failed after {done} arrived: "
                           f"{e}") from None
    if len(got) != len(want):
        raise FormatError(f"the peer at {addr} answered {len(got)} of the {len(want)} block(s) asked")
    return [mv for _d, mv in got]


# -- the server ----------------------------------------------------------------------------

class StreamServer:
    """A peer's side of the streams: answers fetches from lookup(digest) -> a bytes-like,
    a FileBlock, or None (sent as held: the asker checks), and hands a push, every block checked, to
    accept([(digest, memoryview)]) whole (a push with one bad block is refused and none
    of it accepted; accept raising a TsckError refuses it too, with that reason).
    alloc(nbytes) -> a writable buffer of at least nbytes: where a push's batches land
    (the tier's own memory; default: a new buffer per batch, whose pages the socket
    faults in). Counters (tests, benchmarks): `kept` blocks accepted, `served` blocks sent,
    `refused` pushes refused, `strangers` connections that did not prove the secret."""

    def __init__(self, *, lookup=None, accept=None, alloc=None, max_block: int = MAX_BLOCK, overlap: bool = True,
                 timeout: float = STREAM_TIMEOUT, batch_bytes: int = BATCH_BYTES, on_stranger=None):
        self.lookup, self.accept, self.alloc = lookup, accept, alloc
        self.on_stranger = on_stranger  # also told of each stranger, by name (an owner's own count and log)
        self.max_block, self.overlap, self.timeout, self.batch_bytes = max_block, overlap, timeout, batch_bytes
        self._lock = threading.Lock()
        self._sock = None
        self._readers = None  # the lookups' threads (_looked_up), made on the first fetch
        self.addr: str | None = None
        self.kept = self.served = self.refused = self.strangers = 0

    def listen(self, kv) -> str:
        """Start serving (once), on the address the ranks reach this process at, for the
        job whose c10d Store is `kv` -> "host:port" to announce."""
        with self._lock:
            if self._sock is None:
                secret = job_secret(kv)
                self._sock, self.addr = listen_on(kv)
                serve(self._sock, secret, self._answer, name="tsck-stream", timeout=self.timeout,
                      on_stranger=self._stranger)
            return self.addr

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
            readers, self._readers = self._readers, None
        if sock is not None:
            sock.close()
        if readers is not None:
            readers.shutdown(wait=False, cancel_futures=True)

    def _stranger(self, who: str) -> None:
        with self._lock:
            self.strangers += 1
        if self.on_stranger is not None:
            self.on_stranger(who)
            return
        log.warning("block streams: refused a connection from %s: it did not prove it is of this job", who)

    def _answer(self, conn) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
            op = bytes(recv_exact(conn, 1))
            if op == b"P":
                self._take(conn)
            elif op in (b"G", b"g"):
                if op == b"g":  # (this connection's own thread, gone once it is answered)
                    try:
                        me = threading.get_native_id()
                        os.setpriority(os.PRIO_PROCESS, me, max(os.getpriority(os.PRIO_PROCESS, me), LOW_NICE))
                    except (AttributeError, OSError):
                        pass
                self._give(conn)
        except (OSError, TsckError) as e:
            log.debug("block streams: a connection ended: %s", e)

    def _take(self, conn) -> None:
        rx = _Receiver(conn, self.max_block, overlap=self.overlap, alloc=self.alloc)
        try:
            blocks = rx.run()
        except FormatError as e:  # a header past its bounds: the stream cannot be followed; closed
            self._refuse(conn, e)
            return
        except IntegrityError as e:  # (raised between two batches: the rest can be read past)
            self._refuse(conn, e)
            if not rx.ended:
                self._drain(conn)
            _reply(conn, 0, 0, str(e))
            return
        try:
            if self.accept is None:
                raise FormatError("this peer takes no pushes")
            self.accept(blocks)
        except TsckError as e:
            self._refuse(conn, e)
            _reply(conn, 0, 0, str(e))
            return
        with self._lock:
            self.kept += len(blocks)
        _reply(conn, 1, len(blocks), "")

    def _refuse(self, conn, e: Exception) -> None:
        with self._lock:
            self.refused += 1
        log.warning("block streams: a push from %s refused, none of it kept: %s", peer_name(conn), e)

    def _drain(self, conn) -> None:
        """Read (unchecked, unkept) what a refused push still sends, to its end marker, so
        that its sender reads the refusal."""
        buf = memoryview(bytearray(1 << 20))
        while True:
            entries, total = _read_table(conn, self.max_block, allow_missing=False)
            if not entries:
                return
            while total:
                k = conn.recv_into(buf[:min(total, buf.nbytes)])
                if not k:
                    raise ConnectionError("the peer closed the connection")
                total -= k

    def _give(self, conn) -> None:
        n = int.from_bytes(recv_exact(conn, 4), "big")
        if n > MAX_FETCH:
            raise FormatError(f"a fetch of {n} blocks (at most {MAX_FETCH})")
        raw = recv_exact(conn, n * _DIGEST)
        served = 0

        files: list = []  # the FileBlocks looked up: each closed once sent, or when the fetch ends

        def views():
            nonlocal served
            for d, data in self._looked_up([bytes(raw[i:i + _DIGEST]) for i in range(0, len(raw), _DIGEST)]):
                served += data is not None
                if isinstance(data, FileBlock):
                    files.append(data)
                yield d, data if data is None or isinstance(data, FileBlock) else memoryview(data).cast("B")
        try:
            for run in _batches(views(), self.batch_bytes):
                _send_batch(conn, run)
                _close_files(mv for _d, mv in run)
            _send_end(conn)
        finally:
            _close_files(files)
        with self._lock:
            self.served += served

    def _looked_up(self, digests: list):
        """(digest, lookup(digest)) in order, READ_AHEAD lookups running ahead of the one
        yielded: a server whose lookup reads a disk reads the next blocks while a batch is
        sent (a disk read one block at a time, then a send, left each idle half the time),
        and holds one batch of a fetch plus READ_AHEAD blocks, not the whole of it."""
        if self.lookup is None:
            yield from ((d, None) for d in digests)
            return
        with self._lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="tsck-stream-read")
            pool = self._readers
        def ask(d):
            try:
                return d, pool.submit(self.lookup, d)
            except RuntimeError as e:  # (the pool shut down: close() ran meanwhile)
                raise OSError(f"this block stream's server is closing ({e})") from None
        todo = iter(digests)
        flight = deque(ask(d) for d in itertools.islice(todo, READ_AHEAD))
        try:
            while flight:
                d, f = flight.popleft()
                nxt = next(todo, None)
                if nxt is not None:
                    flight.append(ask(nxt))
                try:
                    got = f.result()
                except CancelledError:
                    raise OSError("this block stream's server is closing") from None
                yield d, got
        finally:  # (a fetch cut short: what was not begun is not looked up, what was is let go)
            for _d, f in flight:
                if not f.cancel():
                    f.add_done_callback(lambda f: f.exception() is None and _close_files([f.result()]))


def _close_files(blocks) -> None:
    for b in blocks:
        if isinstance(b, FileBlock):
            b.close()


def _reply(conn, ok: int, count: int, reason: str) -> None:
    why = reason.encode()[:4096]
    conn.sendall(bytes([ok]) + count.to_bytes(8, "big") + len(why).to_bytes(2, "big") + why)

