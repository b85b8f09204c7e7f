"""Shared reads (docs/design/collective.md, "A restore reads each byte once"): in a
collective checkout, an object several ranks read is fetched from storage once, by the
rank that owns its address, and sent to the others over a TCP side channel; every copy
is checked against its address by the rank that uses it.

Who reads what: block d is owned by rank hash(d) % W. After rank 0 named the snapshot,
each rank tells each owner the blocks of its reads it owns ("N"), the ranks wait until
every rank has (one counter in the c10d Store), and each then asks its owners which of
its blocks another rank reads too ("Q"). Those it gets from their owner ("G": the owner
reads the stored object once, keeps it until every rank that named it has asked, and
sends it as stored); the rest (a sharded piece only this rank holds) it reads from
storage itself, as without sharing. Anything that goes wrong on the side channel (a
peer unreachable, a copy that fails its check) is read from storage instead: sharing
saves requests, it never decides what is read.

Cost: per rank, one connection per owner it reads from and 32 bytes per block sent
twice; in the c10d Store, one address and two counters per rank. A TCP channel, not the
process group: a checkout never runs a collective (channel.py, "Failure").
"""

from __future__ import annotations

import hashlib
import logging
import socket
import threading
from collections import OrderedDict

from ..core.assets import Assets
from ..errors import TsckError
from ..format.frame import HEADER_SIZE
from ..util.net import close_all, job_secret, listen_on, prove, recv_exact, serve
from .channel import Channel

__all__ = ["Sharing", "SharedRead", "owner_of", "SHARE_TIMEOUT", "CACHE_BYTES"]

log = logging.getLogger(__name__)

SHARE_TIMEOUT = 60.0       # seconds a side-channel connection may stay silent
CACHE_BYTES = 1 << 30      # stored bytes an owner keeps for ranks that have yet to ask
_NONE = (1 << 64) - 1      # "not here": the owner could not read it (the asker reads storage)
_MAX_LIST = 1 << 22        # digests in one N or Q request (a rank's blocks of one checkout)
_KEPT_CALLS = 4            # checkouts whose need counts an owner remembers

# Requests (op 1 byte, the checkout's id 16 bytes, then):
#   N  n (4 bytes), n digests   these are mine to read: count them     -> 1 byte
#   Q  n (4 bytes), n digests   which of these does another rank read? -> n bytes (1: yes)
#   G  digest, raw length (8)   the stored object                      -> 8-byte length (all ones:
#                                                                         none) + the bytes as stored


def owner_of(d: bytes, world: int) -> int:
    """The rank that reads block `d` from storage for every rank that reads it."""
    return int.from_bytes(d[8:16], "little") % world


class _Entry:
    __slots__ = ("ready", "data", "served")

    def __init__(self):
        self.ready = threading.Event()
        self.data = None
        self.served = 0


class Sharing:
    """One Store's side of shared reads: a server that reads the objects this rank owns
    once per checkout and sends them to whoever asks (started at the first shared
    checkout, on the address the ranks reach each other at), and the connections this
    rank asks its owners on. Counters (tests, benchmarks): `fetched` objects this rank's
    server read from storage, `served` copies it sent, `got` copies this rank got from
    owners, `bad` copies that failed their check (read from storage instead)."""

    def __init__(self, storage):
        self.storage = storage
        self._lock = threading.Lock()
        self._sock = None
        self.addr: str | None = None
        self._needs: OrderedDict = OrderedDict()  # call id -> {digest: ranks that named it}
        self._cache: dict = {}                    # (call id, digest) -> _Entry
        self._cached = 0
        self._idle: dict = {}                     # address -> idle connections
        self._secret: bytes | None = None         # the job's (util/net.py): asked of every connection
        self.refused = 0                          # connections that did not prove they are the job's
        self.fetched = self.served = self.got = self.bad = 0

    # -- the server ----------------------------------------------------------------------
    def listen(self, kv) -> str:
        """Start the server (once) -> "host:port" for the other ranks."""
        with self._lock:
            if self._sock is None:
                self._secret = job_secret(kv)
                sock, self.addr = listen_on(kv)
                self._sock = sock
                serve(sock, self._secret, self._answer, name="tsck-share", timeout=SHARE_TIMEOUT,
                      on_stranger=self._stranger)
            return self.addr

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
            idle, self._idle = self._idle, {}
            self._cache.clear()
            self._cached = 0
        close_all(sock, idle)

    def _stranger(self, who: str) -> None:
        with self._lock:
            self.refused += 1
        log.warning("shared reads: refused a connection from %s: it did not prove it is of this job", who)

    def _answer(self, conn) -> None:
        try:
            while True:
                try:
                    head = bytes(recv_exact(conn, 17))
                except ConnectionError:
                    return
                op, call = head[:1], head[1:]
                if op in (b"N", b"Q"):
                    n = int.from_bytes(recv_exact(conn, 4), "big")
                    if n > _MAX_LIST:
                        return
                    raw = bytes(recv_exact(conn, 32 * n))
                    digests = [raw[i:i + 32] for i in range(0, len(raw), 32)]
                    conn.sendall(self.need(call, digests) if op == b"N" else self.shared(call, digests))
                elif op == b"G":
                    body = bytes(recv_exact(conn, 40))
                    data = self.get(call, body[:32], int.from_bytes(body[32:], "big"))
                    if data is None:
                        conn.sendall(_NONE.to_bytes(8, "big"))
                    else:  # (in two sends: the object is not copied behind its length)
                        conn.sendall(len(data).to_bytes(8, "big"))
                        conn.sendall(data)
                else:
                    return
        except (OSError, TsckError) as e:
            log.debug("shared reads: a connection ended: %s", e)

    def need(self, call: bytes, digests: list) -> bytes:
        """Count one rank's reads of the blocks this rank owns (N)."""
        with self._lock:
            counts = self._needs.get(call)
            if counts is None:
                counts = self._needs[call] = {}
                while len(self._needs) > _KEPT_CALLS:
                    old, _ = self._needs.popitem(last=False)
                    for key in [k for k in self._cache if k[0] == old]:
                        self._drop(key)
            for d in digests:
                counts[d] = counts.get(d, 0) + 1
        return b"\x01"

    def shared(self, call: bytes, digests: list) -> bytes:
        """Which of `digests` more than one rank reads (Q), once every rank has counted."""
        with self._lock:
            counts = self._needs.get(call, {})
            return bytes(1 if counts.get(d, 0) > 1 else 0 for d in digests)

    def get(self, call: bytes, d: bytes, raw_len: int) -> bytes | None:
        """The stored object of block `d` (at most a frame of raw_len bytes), read from
        storage once for every rank that named it in this call (G): the first to ask reads
        it, the others wait for that read; it is forgotten once each has had it. Sent as
        stored, unchecked here: the asker checks it against its address before any use."""
        key = (call, d)
        with self._lock:
            e = self._cache.get(key)
            mine = e is None
            if mine:
                e = self._cache[key] = _Entry()
        if mine:
            try:
                data = self.storage.get(Assets.object_key("blocks", d), HEADER_SIZE + raw_len + 1)
                with self._lock:
                    self.fetched += 1
            except (FileNotFoundError, OSError, TsckError) as err:
                log.debug("shared reads: block %s could not be read for a peer: %s", d.hex()[:16], err)
                data = None
            e.data = data
            with self._lock:
                self._cached += len(data) if data is not None else 0
            e.ready.set()
        elif not e.ready.wait(SHARE_TIMEOUT):
            return None
        data = e.data
        with self._lock:
            e.served += 1
            self.served += data is not None
            want = self._needs.get(call, {}).get(d, 1)
            if self._cache.get(key) is e and (e.served >= want or data is None or self._cached > CACHE_BYTES):
                self._drop(key)  # everyone had it (or it cannot be kept: a later ask reads it again)
        return data

    def _drop(self, key) -> None:
        e = self._cache.pop(key)
        if e.data is not None:
            self._cached -= len(e.data)

    # -- the client ----------------------------------------------------------------------
    def ask(self, addr: str, request: bytes, answer_len=None):
        """Send one request to the server at `addr` -> its answer: `answer_len` bytes, or
        for a G (answer_len None) the object's bytes or None. OSError when the peer fails."""
        conn = None
        with self._lock:
            idle = self._idle.get(addr)
            if idle:
                conn = idle.pop()
        reused = conn is not None
        while True:
            if conn is None:
                host, port = addr.rsplit(":", 1)
                conn = socket.create_connection((host, int(port)), timeout=SHARE_TIMEOUT)
                try:
                    prove(conn, self._secret)
                except OSError:
                    conn.close()
                    raise
            try:
                conn.sendall(request)
                if answer_len is not None:
                    out = bytes(recv_exact(conn, answer_len))
                else:
                    n = int.from_bytes(recv_exact(conn, 8), "big")
                    limit = int.from_bytes(request[-8:], "big") + HEADER_SIZE
                    if n != _NONE and n > limit:
                        raise OSError(f"it announced {n} bytes for an object of at most {limit}")
                    out = None if n == _NONE else recv_exact(conn, n)
                break
            except OSError:
                conn.close()
                conn = None
                if reused:  # an idle connection the server has closed since (its timeout)
                    reused = False
                    continue
                raise
        with self._lock:
            if self._sock is not None:
                self._idle.setdefault(addr, []).append(conn)
                conn = None
        if conn is not None:
            conn.close()
        return out


class SharedRead:
    """One collective checkout's shared reads (made on every rank when rank 0 said the
    checkout shares): plan(jobs, base) agrees with the other ranks on the blocks of this
    rank's reads and gives the reader that gets the shared ones from their owners, the rest
    from `base`; finish() makes this rank's part of the agreement if plan never ran (a tree
    of inline values only)."""

    def __init__(self, sharing: Sharing, ch: Channel):
        self.sharing, self.ch = sharing, ch
        self.call = hashlib.blake2b(ch.pfx.encode(), digest_size=16).digest()
        self._done = False
        self.routed: dict = {}  # digest -> owner rank, for the blocks read through owners

    def keys(self) -> list[str]:
        """The checkout's shared keys this adds (channel.py's cleanup deletes them)."""
        return ["share_n", "share_all", "shreg_n", "shreg_all"]

    def finish(self) -> None:
        if not self._done:
            self.plan([], None)

    def abandon(self) -> None:
        """This rank's read failed: let the others' agreement go on without it (its
        barriers passed with nothing to count; its server still answers)."""
        if self._done:
            return
        self._done = True
        try:
            self.ch.arrive("share", self.sharing.listen(self.ch.kv).encode(), self.ch.world)
            self.ch.arrive("shreg", b"", self.ch.world)
        except Exception as e:  # noqa: BLE001 - the read's own failure is the one to raise
            log.debug("shared reads: this rank's part of the agreement could not be posted: %s", e)

    def plan(self, jobs: list, base):
        """jobs: the reader's (digest, destination, path, bounce) reads; base: its ObjectReader
        -> the ObjectReader to run them through."""
        self._done = True
        ch, world = self.ch, self.ch.world
        ch.arrive("share", self.sharing.listen(ch.kv).encode(), world)
        ch.wait_for(["share_all"], "post their side channel", "share")
        by_owner: dict = {}
        for d in dict.fromkeys(job[0] for job in jobs):  # (a pack's parts: one read of the pack)
            by_owner.setdefault(owner_of(d, world), []).append(d)
        addrs = dict(zip(sorted(by_owner), ch.get_many([f"share/{o}" for o in sorted(by_owner)])))
        dead: set = set()
        for o, ds in by_owner.items():
            try:
                self._list(addrs[o], b"N", ds, 1)
            except OSError as e:
                log.warning("shared reads: rank %d cannot be reached (%s); this rank reads its blocks itself", o, e)
                dead.add(o)
        ch.arrive("shreg", b"", world)
        ch.wait_for(["shreg_all"], "count their reads", "shreg")
        for o, ds in by_owner.items():
            if o in dead:
                continue
            try:
                answer = self._list(addrs[o], b"Q", ds, len(ds))
            except OSError as e:
                log.warning("shared reads: rank %d cannot be reached (%s); this rank reads its blocks itself", o, e)
                continue
            self.routed.update((d, o) for d, a in zip(ds, answer) if a == 1)
        if not self.routed:
            return base
        return _Routed(self, base, {o: addrs[o] for o in set(self.routed.values())})

    def _list(self, addr: bytes, op: bytes, digests: list, answer_len: int) -> bytes:
        req = op + self.call + len(digests).to_bytes(4, "big") + b"".join(digests)
        return self.sharing.ask(addr.decode(), req, answer_len)


class _Routed:
    """An ObjectReader: the blocks several ranks read from their owners (each copy checked
    against its address), everything else from `base`."""

    def __init__(self, share: SharedRead, base, addrs: dict):
        self.share, self.base, self.addrs = share, base, addrs
        self._failed: set = set()

    def read_block_into(self, d: bytes, out, *, verify: bool = True, snapshot=None, path=None,
                        bounce: bool = False, fence: int | None = None) -> None:
        o = self.share.routed.get(d)
        if o is not None and o not in self._failed and self._from_owner(o, d, out, bounce):
            return
        self.base.read_block_into(d, out, verify=verify, snapshot=snapshot, path=path, bounce=bounce, fence=fence)

    def _from_owner(self, o: int, d: bytes, out, bounce: bool) -> bool:
        """Block d from its owner o into `out`, checked -> whether it is there. bounce (`out`
        is the caller's memory): decoded and checked in a buffer of its own first; else in
        `out` itself (fresh memory, which a failed check leaves to the read from storage)."""
        import numpy as np
        sharing, mv = self.share.sharing, memoryview(out).cast("B")
        try:
            if o == self.share.ch.rank:
                data = sharing.get(self.share.call, d, mv.nbytes)
            else:
                req = b"G" + self.share.call + d + mv.nbytes.to_bytes(8, "big")
                data = sharing.ask(self.addrs[o].decode(), req)
        except OSError as e:
            log.warning("shared reads: rank %d failed to send block %s (%s); this rank reads what it owns itself",
                        o, d.hex()[:16], e)
            self._failed.add(o)
            return False
        if data is None:
            return False
        into = np.empty(mv.nbytes, dtype=np.uint8) if bounce else mv
        err, _raw = Assets.object_from_frame("block", d, data, into)
        if err is not None:
            with sharing._lock:
                sharing.bad += 1
            log.warning("shared reads: rank %d's copy of block %s does not match its address; reading it from "
                        "storage", o, d.hex()[:16])
            return False
        if bounce:
            np.copyto(np.frombuffer(mv, dtype=np.uint8), into)
        with sharing._lock:
            sharing.got += o != self.share.ch.rank
        return True

    def get_node(self, d: bytes, *, verify: bool = True, snapshot=None, path=None, fence: int | None = None) -> bytes:
        return self.base.get_node(d, verify=verify, snapshot=snapshot, path=path, fence=fence)

    def get_commit(self, d: bytes, *, verify: bool = True) -> bytes:
        return self.base.get_commit(d, verify=verify)

    def require_blocks(self, digests, pool, *, snapshot=None, path=None, fence: int | None = None) -> None:
        self.base.require_blocks(digests, pool, snapshot=snapshot, path=path, fence=fence)

    def node_error(self, d: bytes, msg: str, *, snapshot=None, path=None) -> Exception:
        return self.base.node_error(d, msg, snapshot=snapshot, path=path)
