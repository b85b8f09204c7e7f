"""Peer replicas (open_store(remote, local=DIR, replicas=k), docs/design/tiers.md, "Peer
replicas"): after each collective put through tiers every rank sends its part to the
tiers of k holders on other nodes (tier/placement.py; the next k ranks on one host),
over a TCP side channel; a collective checkout fetches what its tier lacks from the
holders its snapshot's placement chose (each copy checked against its address), in
batches on the block stream, before it reads the remote.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

from ..core.walk import walk_tree
from ..errors import IntegrityError, TsckError
from ..format.chunker import DEFAULT_PACK_SIZE
from ..format.frame import HEADER_SIZE
from ..format.manifest import MAX_NODE_BYTES
from ..util.net import close_all, job_secret, listen_on, prove, recv_exact as _recv, recv_into, serve
from .keeper import Keeper, keep_copy
from .stream import FileBlock, ReusedBuffers, StreamServer, fetch as stream_fetch

__all__ = ["Peers", "PEER_TIMEOUT", "FETCH_BYTES", "FETCH_DEPTH", "decoded_frame"]

log = logging.getLogger(__name__)

# -- peer replicas ---------------------------------------------------------------------
#
# A TCP side channel, not the process group: an asynchronous collective put runs on the
# store's background publisher while training runs its own collectives (DDP's all-reduce)
# on the same group from the main thread, and gloo matches a group's operations by their
# order, so sends from two threads would pair with the wrong receives; a group of our own
# (new_group) must be made by every rank at one point of the program, which open_store is
# not. Point-to-point connections have no order to keep: a rank's server answers whoever
# asks, whenever. The addresses go through the c10d Store (key tsck/peer/<store>/<rank>,
# <store> the remote's URL hashed: two stores with replicas in one job keep theirs apart).
#
# Requests: op (1 byte) kind (1 byte: b, n, c) address (32 bytes) length (8 bytes) data.
#   H  has it?            -> 1 byte (1 yes, 0 no)
#   G  get it             -> 8-byte length (all ones: not here) + the bytes as stored (the asker checks them)
#   P  store this copy    -> 1 byte (1 stored, 0 refused: it is not the object of that address)
#   S  sync what was put  -> 1 byte

_KINDS = {b"b": "block", b"n": "node", b"c": "commit"}
_CODES = {v: k for k, v in _KINDS.items()}
_NONE = (1 << 64) - 1
PEER_TIMEOUT = 60.0  # seconds a connection to a peer may stay silent, and a rank waits for a peer's address


def _limit(core, kind: str) -> int:
    """The most bytes a stored object of `kind` can take: what a peer may send or be
    asked to receive (a length past it is refused before any buffer is made). A block is
    at most the larger of the block size and the pack size (small tensors packed into one
    block: a tier's default is an object store's, DEFAULT_PACK_SIZE), framed (a frame is
    kept compressed only when smaller than its raw bytes)."""
    if kind != "block":
        return HEADER_SIZE + MAX_NODE_BYTES
    st = core.settings
    pack = DEFAULT_PACK_SIZE if st.pack_size is None else st.pack_size
    return HEADER_SIZE + max(st.block_size, pack, 1 << 20)


class Peers:
    """This rank's side of the peer replicas: a server that answers for its tier's objects
    by address and stores the replicas other ranks send (each checked against its address
    first), and a client that sends this rank's part to the next `k` ranks and fetches
    what its tier lacks from them. Counters (tests): `fetched` objects got from peers,
    `sent` replicas sent, `refused` copies refused for not matching their address, `bad`
    fetched copies not used for the same reason."""

    def __init__(self, core, k: int, ident: str = ""):
        """ident: what tells this store's side channel from another's in the job's c10d
        Store (the remote's URL, hashed: every rank's Store of it has the same), so two
        stores with replicas in one process each send copies to their own tiers."""
        import threading
        from concurrent.futures import ThreadPoolExecutor
        self.core, self.k = core, k
        self._key = f"{ident}/" if ident else ""
        self._sock = None
        self._lock = threading.Lock()
        self._addrs: dict[int, tuple[str, int]] = {}
        self._dead: set[int] = set()
        self._pending: list = []
        self._send = ThreadPoolExecutor(1, thread_name_prefix="tsck-replicas")
        # The connection the sender is using, and whether close() cut the sends: a close
        # past its deadline shuts the connection, so a holder that stopped answering (its
        # process stopped, its host gone) does not hold the close for PEER_TIMEOUT per request.
        self._live = None
        self._cut = False
        self.rank = self.world = None
        self.kv = None
        self._nodes: list[str] | None = None  # each rank's node name (nodes())
        self._told_one_node = False
        self.fetched = self.sent = self.refused = self.bad = 0
        self.strangers = 0  # connections refused for not proving they are of the job (util/net.py)
        self._secret: bytes | None = None
        self._idle: dict[int, list] = {}  # peer -> connections between two requests (fetch_checked)
        self._keeper = Keeper(core.storage)
        self._rx: bytearray | None = None  # the copies' receive buffer, between connections (_rx_buffer)
        self._stream = None  # the StreamServer a restore's batched fetches ask (stream.py)
        self.streamed = self.stream_fetches = 0  # blocks got by batched fetches, and the fetches
        self.blocks_alone = 0  # blocks got one request each (fetch_checked): what the batches missed
        self._stream_dead: set[int] = set()  # holders whose block stream failed (not asked again)

    # -- set-up --------------------------------------------------------------------------
    def join(self) -> bool:
        """Listen (once) and post this rank's address; the world is torch.distributed's
        (False, and no replicas for the call, without it: a StoreGroup of threads)."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store
        if not (dist.is_available() and dist.is_initialized()):
            return False
        with self._lock:
            if self._sock is not None:
                return True
            self.kv = _get_default_store()
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
            from .placement import this_node
            self.kv.set(f"tsck/node/{self.rank}", this_node().encode())
            self.kv.set(f"tsck/peer/{self._key}{self.rank}", self._listen().encode())
            return True

    def _listen(self) -> str:
        """Start the server, on the address the ranks reach this one at -> "host:port"."""
        self._secret = job_secret(self.kv)
        sock, addr = listen_on(self.kv, 64)
        self._sock = sock
        serve(sock, self._secret, self._answer, name="tsck-peer", timeout=PEER_TIMEOUT, on_stranger=self._stranger)
        # A restore's blocks in batches (stream.py), many in flight on one connection: as
        # stored, looked up as they are sent; the asker checks each against its address.
        self._stream = StreamServer(lookup=self._stored_block, max_block=_limit(self.core, "block"),
                                    timeout=PEER_TIMEOUT, on_stranger=self._stranger)
        self.kv.set(f"tsck/peerstream/{self._key}{self.rank}", self._stream.listen(self.kv).encode())
        return addr

    def _stored_block(self, d: bytes):
        """A block of this tier as the block stream sends it: from its file (FileBlock),
        its pages asked of the disk now (the server looks blocks up ahead of the one it
        sends); None if this tier lacks it, or holds more bytes than a block can take."""
        import io
        import os
        from ..core.assets import Assets
        limit = _limit(self.core, "block")
        try:
            f = self.core.storage.open_read(Assets.object_key("blocks", d), limit + 1)
        except (FileNotFoundError, OSError, TsckError):
            return None
        try:
            n = os.fstat(f.fileno()).st_size
        except (io.UnsupportedOperation, AttributeError):  # (no file of this host's behind it)
            with f:
                data = f.read(limit + 1)
            return data if len(data) <= limit else None
        if n > limit:
            f.close()
            return None
        try:
            os.posix_fadvise(f.fileno(), 0, n, os.POSIX_FADV_WILLNEED)
        except OSError:  # (a read-ahead the file system does not take: sendfile reads it then)
            pass
        return FileBlock(f, n)

    def nodes(self) -> list[str]:
        """Each rank's node name (placement.this_node(), posted by every rank as it joins),
        gathered once."""
        import datetime
        if self._nodes is None:
            keys = [f"tsck/node/{r}" for r in range(self.world)]
            self.kv.wait(keys, datetime.timedelta(seconds=PEER_TIMEOUT))
            self._nodes = [v.decode() for v in self.kv.multi_get(keys)]
        return self._nodes

    def holders(self, nodes: list | None = None) -> list[int]:
        """The ranks that hold this rank's replicas, placed by node (placement.holders: k
        other nodes, never this rank's own) given each rank's node name (`nodes`: a
        snapshot's, as its commit recorded them; None: the job's now). With fewer than k+1
        nodes (one host), the ranks r+1 .. r+k (mod W): copies a lost node takes with it."""
        from .placement import holders as by_node, next_ranks
        if nodes is None and self.kv is not None:  # (no c10d Store: a Peers made by hand, in tests)
            nodes = self.nodes()
        nodes = nodes or []
        if len(nodes) == self.world and len(set(nodes)) > self.k:
            return by_node(nodes, self.k)[self.rank]
        if not self._told_one_node and len(set(nodes)) > 1:
            self._told_one_node = True
            log.warning("peer replicas: replicas=%d needs %d nodes to keep a copy of each part off its own node; the "
                        "job's ranks are on %d: copies go to the next ranks, some on the same node", self.k,
                        self.k + 1, len(set(nodes)))
        return next_ranks(self.world, self.k)[self.rank]

    def read_holders(self, nodes: list | None) -> list[int]:
        """The ranks to ask for what this rank reads of a snapshot whose commit recorded
        each rank's node (`nodes`; None: no record, the job's placement now): the tiers now
        of the ranks that held those parts then, by node and place on it
        (placement.read_from), so a restart with new machines, renumbered or fewer or more
        nodes still finds them."""
        from .placement import read_from
        if nodes is None or self.kv is None:
            return self.holders(nodes)
        return read_from(nodes, self.nodes(), self.rank, self.k)

    def commit_meta(self) -> dict:
        """What a collective snapshot's commit records of its replicas' placement (rank 0,
        put.py's meta_extra): each rank's node, as the names and each rank's index into
        them, so a restore on new machines asks the ranks that hold its copies."""
        nodes = self.nodes()
        names = sorted(set(nodes))
        at = {n: i for i, n in enumerate(names)}
        return {"nodes": {"names": names, "of": [at[n] for n in nodes]}}

    def close(self, deadline: float | None = None) -> None:
        """Finish sending the replicas until `deadline` (time.monotonic(); None: no bound),
        then stop: a send still running then is cut (its holder lacks those copies and
        reads them from the remote store, as after any failed send)."""
        import socket
        import time
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            self._cut = True
            live = self._live
            running = any(not f.done() for f in self._pending)
        if live is not None:
            try:
                live.shutdown(socket.SHUT_RDWR)  # its blocked send or receive returns now
            except OSError:
                pass
        if running:
            log.warning("peer replicas: close's timeout passed while this rank's part was being sent to its peers; "
                        "the sends were cut (the remote store has the part once uploaded)")
        # (A connect in progress ends within PEER_TIMEOUT by itself: not waited for under a deadline.)
        self._send.shutdown(wait=deadline is None or not running, cancel_futures=True)
        self._keeper.close()
        with self._lock:
            idle, self._idle = self._idle, {}
            sock, self._sock = self._sock, None
            stream, self._stream = self._stream, None
        if stream is not None:
            stream.close()
        close_all(sock, idle)

    # -- the server ----------------------------------------------------------------------
    def _stranger(self, who: str) -> None:
        with self._lock:
            self.strangers += 1
        log.warning("peer replicas: refused a connection from %s: it did not prove it is of this job", who)

    def _answer(self, conn) -> None:
        from ..core.assets import Assets
        assets, storage = self.core.assets, self.core.storage
        import socket
        buf = None  # this connection's receive buffer (_rx_buffer)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # (one answer at a time: as _connect)
            while True:
                try:
                    head = bytes(_recv(conn, 42))
                except ConnectionError:
                    return
                op, kind, d, n = head[:1], _KINDS.get(head[1:2]), head[2:34], int.from_bytes(head[34:], "big")
                if kind is None:
                    return
                key = Assets.object_key(kind + "s", d)
                if op == b"H":
                    conn.sendall(b"\x01" if storage.exists(key) else b"\x00")
                elif op == b"G":
                    # Sent as stored, unchecked here: the asker checks every copy against its
                    # address before any use (a damaged one sends it to the next holder), so
                    # a second pass here would only double the CPU of a restore.
                    try:
                        data = storage.get(key, _limit(self.core, kind) + 1)
                    except (FileNotFoundError, OSError):
                        data = None
                    conn.sendall(_NONE.to_bytes(8, "big") if data is None else len(data).to_bytes(8, "big") + data)
                elif op == b"P":
                    if n > _limit(self.core, kind):
                        log.warning("peer replicas: a peer offered %d bytes for %s %s, more than such an object "
                                    "can take; connection closed", n, kind, d.hex()[:16])
                        return
                    if buf is None or len(buf) < n:
                        buf = self._rx_buffer(n, kind)
                    data = memoryview(buf)[:n]
                    recv_into(conn, data)
                    if Assets.object_frame_error(kind, d, data) is not None:
                        with self._lock:
                            self.refused += 1
                        log.warning("peer replicas: a copy of %s %s sent by a peer does not match its address; "
                                    "refused", kind, d.hex()[:16])
                        conn.sendall(b"\x00")
                    else:
                        storage.put_addressed(key, [data])
                        conn.sendall(b"\x01")
                elif op == b"S":
                    assets.sync()
                    conn.sendall(b"\x01")
                else:
                    return
        except (OSError, TsckError) as e:
            log.debug("peer replicas: a connection ended: %s", e)
        finally:
            if buf is not None:
                with self._lock:
                    if self._rx is None or len(self._rx) < len(buf):
                        self._rx = buf

    def _rx_buffer(self, n: int, kind: str):
        """A receive buffer of at least n bytes for a connection's copy of a `kind`: the one
        the last copy left (a fresh buffer of a pack's size is a page fault per 4 KiB, more
        than the copy's own time here), else a new one, for a block of a block's largest
        size (grown once). One is kept between copies: this process's memory beyond its
        tier is one block's."""
        with self._lock:
            buf, self._rx = self._rx, None
        if buf is None or len(buf) < n:
            buf = bytearray(max(n, _limit(self.core, "block")) if kind == "block" else n)
        return buf

    # -- the client ----------------------------------------------------------------------
    def _connect(self, peer: int):
        import socket
        if peer in self._dead:
            return None
        try:
            if peer not in self._addrs:
                key = f"tsck/peer/{self._key}{peer}"
                import datetime
                self.kv.wait([key], datetime.timedelta(seconds=PEER_TIMEOUT))
                host, port = self.kv.get(key).decode().rsplit(":", 1)
                self._addrs[peer] = (host, int(port))
            conn = socket.create_connection(self._addrs[peer], timeout=PEER_TIMEOUT)
            try:
                # Requests and answers go one at a time: a request's last segment waiting
                # for the previous one's ACK (Nagle's rule, against a delayed ACK) cost
                # about 40 ms per copied object.
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                prove(conn, self._secret)
            except OSError:
                conn.close()
                raise
            return conn
        except Exception as e:  # noqa: BLE001 - a peer away is a peer we do without
            log.warning("peer replicas: rank %d cannot be reached (%s); going on without it", peer, e)
            self._dead.add(peer)
            return None

    @staticmethod
    def _ask(conn, op: bytes, kind: str, d: bytes, data: bytes = b""):
        conn.sendall(op + _CODES[kind] + d + len(data).to_bytes(8, "big") + data)

    def replicate(self, root: bytes, tree: bytes):
        """In the background: send the objects of this rank's part (sub-tree `tree` of
        snapshot `root`) that its tier holds to each holder that lacks them. -> a future:
        True once every holder took the whole part, False when one did not (or none was
        there to take it)."""
        fut = self._send.submit(self._replicate, root, tree)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [fut]
        return fut

    def wait(self, timeout: float | None = None) -> None:
        from concurrent.futures import wait
        with self._lock:
            pending = list(self._pending)
        wait(pending, timeout)

    def _path(self, root: bytes) -> list:
        """The rank-tree nodes above this rank's tree in snapshot `root`, as its tier holds
        them (adopted from rank 0: CollectiveTier.adopt); [] if they cannot be read here."""
        from ..format import tree as treefmt
        from ..format.manifest import commit_tree, decode_node
        from ..format.world import rank_path
        assets = self.core.assets

        def read(d, world=False):
            return treefmt.decode_node_value(decode_node(assets.get_node(d)), world=world)
        try:
            w = read(commit_tree(assets.get_commit(root)), world=True)
            if not isinstance(w, treefmt.World) or w.ranks is not None or not 0 <= self.rank < w.world:
                return []
            return rank_path(w, self.rank, read)
        except TsckError as e:  # (the holder reads it from the remote then)
            log.debug("peer replicas: snapshot %s: this rank's path down the rank tree not read: %s",
                      root.hex()[:16], e)
            return []

    def _replicate(self, root: bytes, tree: bytes) -> None:
        assets = self.core.assets
        objs, seen = [], set()
        for o in walk_tree(assets, tree, snapshot=root.hex(), verify=True):
            if o.digest not in seen:
                seen.add(o.digest)
                objs.append((o.kind, o.digest))
        # (a Replicated tensor's blocks written by another rank are not in this tier: theirs to send)
        objs = [(k, d) for k, d in objs if k != "block" or assets.block_exists(d)]
        # This rank's path down the rank tree too: a holder in another group of 16 ranks
        # got another path from rank 0 (collective.put.rank_paths), and this rank, its tier lost,
        # reads the path from its holders before its part.
        objs += [("node", d) for d in self._path(root) if d not in seen]
        holders, whole = self.holders(), 0
        for peer in holders:
            conn = self._connect(peer)
            if conn is None:
                continue
            with self._lock:
                if self._cut:
                    conn.close()
                    return False
                self._live = conn
            try:
                with conn:
                    n = self._send_part(conn, peer, objs)
                with self._lock:
                    self.sent += n
                whole += 1
                log.debug("peer replicas: snapshot %s: %d object(s) of this rank's part sent to rank %d",
                          root.hex()[:16], n, peer)
            except (OSError, TsckError) as e:
                log.warning("peer replicas: snapshot %s: sending this rank's part to rank %d failed (%s); the "
                            "remote store stays its copy", root.hex()[:16], peer, e)
            finally:
                with self._lock:
                    self._live = None
        return bool(holders) and whole == len(holders)

    def _send_part(self, conn, peer: int, objs: list) -> int:
        """Send `peer` the objects of `objs` it lacks, each asked about and then sent on
        its own, the holder's answer read before the next (sending them all before reading
        the answers left an unreachable node in a holder's tier in about 1 run of 3 of
        test_every_ranks_tier_follows_rank_0s_retention, not understood yet) -> how many
        were sent. TsckError when the holder refused one (after the rest was sent)."""
        n, refused = 0, []
        for kind, d in objs:
            if self._cut:
                raise TsckError("the store is closing")
            self._ask(conn, b"H", kind, d)
            if _recv(conn, 1) == b"\x01":
                continue
            self._send_copy(conn, kind, d)
            if _recv(conn, 1) != b"\x01":
                refused.append(f"{kind} {d.hex()[:16]}")  # (the rest still goes: the holder keeps what is sound)
                continue
            n += 1
        self._ask(conn, b"S", "block", bytes(32))
        _recv(conn, 1)
        if refused:
            raise TsckError(f"rank {peer} refused the copy of {', '.join(refused[:3])}"
                            + (f" and {len(refused) - 3} more" if len(refused) > 3 else ""))
        return n

    def _send_copy(self, conn, kind: str, d: bytes) -> None:
        """One P request: object `d` as this tier stores it, unchecked here (the holder
        checks it against its address before keeping it, and refuses a damaged one), sent
        from its file by the kernel (sendfile: no copy through this process)."""
        import io
        import os
        from ..core.assets import Assets
        limit = _limit(self.core, kind)
        with self.core.storage.open_read(Assets.object_key(kind + "s", d), limit + 1) as f:
            try:
                n = os.fstat(f.fileno()).st_size
            except (io.UnsupportedOperation, AttributeError):  # (no file of this host's behind it)
                self._ask(conn, b"P", kind, d, f.read(limit + 1))
                return
            if n > limit:
                raise TsckError(f"{kind} {d.hex()[:16]} in this tier is {n} bytes, more than such an object "
                                "can take")
            conn.sendall(b"P" + _CODES[kind] + d + n.to_bytes(8, "big"))
            if conn.sendfile(f, 0, n) != n:
                raise OSError(f"{kind} {d.hex()[:16]} ended before its {n} bytes were sent")

    def fetch(self, kind: str, d: bytes, holders: list | None = None) -> bool:
        """Get object `d` from a holder into this rank's tier, checked against its address
        first -> whether one had it."""
        from ..core.assets import Assets
        got = self.fetch_checked(kind, d, holders)
        if got is None:
            return False
        kept = keep_copy(self.core.storage, Assets.object_key(kind + "s", d), got[0])
        if kept:
            self._keeper.wrote()
        return kept

    def present(self, kind: str, digests, holders: list | None = None) -> set:
        """The `digests` some holder says it stores (one connection per holder, the
        questions sent in a row, then the answers read): what a checkout may count on
        fetching. A holder that lies is caught by the fetch's check, which then goes on
        to the next holder or the remote."""
        todo, have = list(digests), set()
        for peer in self.holders() if holders is None else holders:
            if not todo:
                break
            conn = self._connect(peer)
            if conn is None:
                continue
            try:
                with conn:
                    conn.sendall(b"".join(b"H" + _CODES[kind] + d + bytes(8) for d in todo))
                    answers = _recv(conn, len(todo))
            except OSError as e:
                log.warning("peer replicas: asking rank %d what it holds failed (%s)", peer, e)
                continue
            have.update(d for d, a in zip(todo, answers) if a == 1)
            todo = [d for d, a in zip(todo, answers) if a != 1]
        return have

    def _checkout_conn(self, peer: int):
        """A connection to `peer` -> (it, whether it is a reused one): an idle one (a
        checkout's fetches reuse them), else a new one."""
        with self._lock:
            idle = self._idle.get(peer)
            if idle:
                return idle.pop(), True
        return self._connect(peer), False

    def _checkin_conn(self, peer: int, conn) -> None:
        with self._lock:
            if self._sock is not None:  # (not closed meanwhile)
                self._idle.setdefault(peer, []).append(conn)
                return
        conn.close()

    def fetch_checked(self, kind: str, d: bytes, holders: list | None = None):
        """Object `d` from a holder, checked against its address -> (its stored frame, its
        bytes as decoded by the check), or None when no holder has a good copy."""
        from ..core.assets import Assets
        for peer in self.holders() if holders is None else holders:
            conn, reused = self._checkout_conn(peer)
            while conn is not None:
                try:
                    self._ask(conn, b"G", kind, d)
                    n = int.from_bytes(_recv(conn, 8), "big")
                    if n != _NONE and n > _limit(self.core, kind):
                        raise OSError(f"it announced {n} bytes, more than such an object can take")
                    data = None if n == _NONE else _recv(conn, n)
                    break
                except OSError as e:
                    conn.close()
                    if reused:  # an idle connection the holder has closed since (its timeout): a new one
                        conn, reused = self._connect(peer), False
                        continue
                    conn = None
                    log.warning("peer replicas: fetching %s %s from rank %d failed (%s)", kind, d.hex()[:16], peer,
                                e)
            if conn is None:
                continue
            self._checkin_conn(peer, conn)  # (the exchange is complete: the connection can serve the next)
            if data is None:
                continue
            err, raw = Assets.object_from_frame(kind, d, data)
            if err is not None:
                with self._lock:
                    self.bad += 1
                log.warning("peer replicas: rank %d's copy of %s %s does not match its address; not used", peer,
                            kind, d.hex()[:16])
                continue
            with self._lock:
                self.fetched += 1
                self.blocks_alone += kind == "block"
            return data, raw
        return None


    def keep(self, key: str, frame) -> None:
        """Keep a copy fetched from a holder (checked) in this rank's tier, in the
        background (keeper.py): a cache for the next restore."""
        self._keeper.keep(key, frame)

    @contextmanager
    def keeping_after(self):
        """While in it, the copies to keep wait (a restore's batched fetches: the disk and
        the cores are the restore's); they are written once it ends."""
        self._keeper.pause()
        try:
            yield
        finally:
            self._keeper.resume()

    def keep_from_holders(self, digests: list, holders: list) -> None:
        """Keep copies of the blocks `digests` a restore fetched and used up (no frame of
        them held): the keeper fetches them again from `holders` once the checkout is done,
        and writes them to this rank's tier (a cache, as keep's)."""
        if digests:
            per = max(1, FETCH_BYTES // max(self.core.settings.block_size, 1))
            self._keeper.refetch(digests, lambda ds, take: self._fetch_again(holders, ds, take), per)

    def _fetch_again(self, holders: list, digests: list, take) -> None:
        """The blocks `digests` from the first of `holders` whose stream answers (on the
        keeper's thread: an address the restore lacked is waited for there, not on its
        path), each frame checked and given to take(digest, frame) as it arrives (in one
        buffer reused: nothing of it is held), sent by the holder at a low priority;
        counted nowhere (no restore's)."""
        alloc = ReusedBuffers()

        def check(d, mv):
            take(d, decoded_frame(d, mv)[0])
            return True
        for peer in holders:
            with self._lock:
                dead = peer in self._stream_dead
            addr = None if dead else self._stream_addr(peer)
            if addr is None:
                continue
            try:
                stream_fetch(addr, self._secret, digests, max_block=_limit(self.core, "block"), timeout=PEER_TIMEOUT,
                             check=check, alloc=alloc, overlap=False, low=True)
                return
            except TsckError as e:
                log.debug("peer replicas: fetching %d block(s) again from rank %d to keep them failed (%s)",
                          len(digests), peer, e)
                if not isinstance(e, IntegrityError):
                    with self._lock:
                        self._stream_dead.add(peer)  # (unreachable or cut off: not asked again)

    def fetch_stream(self, digests: list, holders: list | None = None, check=None, place=None, alloc=None) -> dict:
        """The blocks `digests` from their holders, in batches of many blocks on one
        connection per holder and request (stream.py), each checked against its address
        (decoded from the frame a holder stores) -> digest -> (stored frame, its bytes)
        for those some holder gave whole (or what check gave). Fetched in requests of
        about FETCH_BYTES, so a restore holds at most one request's blocks (one batch's
        with alloc, the blocks used up by check); a holder that lies
        (bytes not their address's, lengths past a block's) loses that request to the
        next holder, one that fails is not asked again. check(d, frame): decoded_frame's;
        place: stream.fetch's (a block received in its destination: check gets the list);
        alloc: stream.fetch's, with each batch checked before the next is read (overlap
        off), so that alloc may give one buffer again and again."""
        got: dict = {}
        per = max(1, FETCH_BYTES // max(self.core.settings.block_size, 1))
        todo = list(dict.fromkeys(digests))
        holders = self.holders() if holders is None else holders
        frame = check or decoded_frame
        for peer in holders:
            if not todo:
                break
            addr = None if peer in self._stream_dead else self._stream_addr(peer)
            if addr is None:
                continue
            left = []
            for i in range(0, len(todo), per):
                ask = todo[i:i + per]
                try:
                    answer = stream_fetch(addr, self._secret, ask, max_block=_limit(self.core, "block"),
                                          timeout=PEER_TIMEOUT, check=frame, place=place, alloc=alloc,
                                          overlap=alloc is None)
                except TsckError as e:
                    with self._lock:
                        self.bad += isinstance(e, IntegrityError)
                    log.warning("peer replicas: rank %d's answer for %d block(s) was not used (%s); asking the "
                                "next holder", peer, len(ask), e)
                    if isinstance(e, IntegrityError):
                        left += ask
                        continue
                    left += todo[i:]
                    with self._lock:
                        self._stream_dead.add(peer)  # (unreachable or cut off: not asked again)
                    break
                with self._lock:
                    self.stream_fetches += 1
                for d, one in zip(ask, answer):
                    if one is None:
                        left.append(d)
                    else:
                        got[d] = one
            todo = left
        with self._lock:
            self.streamed += len(got)
            self.fetched += len(got)
        return got

    def _stream_addr(self, peer: int) -> str | None:
        import datetime
        key = f"tsck/peerstream/{self._key}{peer}"
        try:
            self.kv.wait([key], datetime.timedelta(seconds=PEER_TIMEOUT))
            return self.kv.get(key).decode()
        except Exception as e:  # noqa: BLE001 - a peer away is a peer we do without
            log.warning("peer replicas: rank %d's block stream cannot be found (%s); going on without it", peer, e)
            return None


def decoded_frame(d: bytes, mv, out=None):
    """A block's stored frame checked by decoding it (into `out` when given) -> (the
    frame, the block's bytes); IntegrityError if it is not the block of address `d`."""
    from ..core.assets import Assets
    err, raw = Assets.object_from_frame("block", d, mv, out)
    if err is not None:
        raise err
    return mv, raw


FETCH_BYTES = 64 << 20   # a restore's batched fetch from a holder asks about this many bytes at once
FETCH_DEPTH = 2          # a restore's batched fetches in flight
