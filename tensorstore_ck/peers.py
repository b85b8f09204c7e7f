"""Collective snapshots through local tiers: each rank's tier, the remote store behind.

Under torch.distributed with `open_store(remote, local=NODE_DIR)` on every rank:

    every rank   writes its own blocks and sub-tree to its own local tier (the collective
                 protocol of dist.py, unchanged; each rank under its own tier's gc fence)
    rank 0       writes the top nodes and the commit to its tier and moves its local ref
                 (the local publication), then hands the commit and the top nodes to the
                 others (one c10d key): every rank's tier can then read its own region of
                 the snapshot, and says what the snapshot is, without the remote
    every rank   queues its upload: rank 0 the snapshot, the others their part

    the uploader of a rank other than 0 (upload_part): its sub-tree's blocks, then its
                 nodes, skipping what the remote has: then the snapshot is durable for
                 that rank (its part is remote)
    the uploader of rank 0 (upload_world): reads the remote gc fence, then walks the
                 snapshot: what its tier holds (its sub-tree, the top, the commit) is sent
                 as by a single-process upload; every object it lacks (the other ranks'
                 sub-trees) must be found in the remote after that fence read (a node is
                 read from there, checked against its address; a block is asked with a
                 HEAD); what is not there yet is waited for with backoff, bounded, while
                 the other ranks upload; then the fenced move of the remote ref to the
                 same root (Publisher.move_to), whose re-validation asks for every
                 object again under the new fence

The remote ref therefore never names an object missing remotely: every object was
either sent and synced by rank 0 or seen present in the remote by rank 0 itself after
it read the fence its move is conditional on (docs/design/tiers.md, "Collective puts").
"""

from __future__ import annotations

import dataclasses
import logging
import time

import msgpack

from .errors import IntegrityError, TsckError, UnreadableObject
from .format.frame import HEADER_SIZE
from .format.manifest import MAX_NODE_BYTES
from .walk import walk_commit, walk_tree

__all__ = ["CollectiveTier", "upload_part", "upload_world", "PART_WAIT"]

log = logging.getLogger(__name__)

# How long rank 0's uploader waits, without progress, for the other ranks' parts of a
# collective snapshot, seconds.
PART_WAIT = 900.0
_PAUSE = (0.1, 5.0)  # first and longest pause between two looks, seconds


class CollectiveTier:
    """What a collective put through local tiers does besides the protocol of dist.py,
    built by the Store for one call (dist.py calls it, and knows nothing of tiers)."""

    def __init__(self, core, uploader, peers: "Peers | None" = None):
        self.core, self.uploader, self.peers = core, uploader, peers

    def top_blob(self, root: bytes, top_payloads: list) -> bytes:
        """Rank 0, after its local publication: the commit and the top nodes, for the
        others, and the snapshots of the job that rank 0's tier keeps (its catalog rows:
        what its retention has left), which the others' tiers follow."""
        job = (self.core.refs.catalog_get(root, checked=False) or {}).get("job")
        kept = [r for r, row in self.core.refs.catalog_iter(bad=[]) if row.get("job") == job]
        return msgpack.packb([self.core.assets.get_commit(root), list(top_payloads), kept])

    def intend(self, part: bytes, args) -> None:
        """A rank other than 0, its part written and synced, before it says "done": the
        intent to upload `part` (RefTable.intent_put), kept until the snapshot's row
        (adopt) or its abort (abandon) is here. A rank killed between the two leaves it,
        and its next open uploads the part: rank 0 may have published the snapshot."""
        self.core.refs.intent_put(part, {"ref": args.ref, "step": args.step, "job": args.job})

    def abandon(self, part: bytes) -> None:
        """The snapshot was aborted: its part is nobody's to upload (a gc of the tier
        reclaims what nothing else holds)."""
        try:
            self.core.refs.intent_drop(part)
        except Exception as e:  # noqa: BLE001 - the abort is the outcome to raise; a part left queued is harmless
            log.warning("local tier: the intent to upload part %s of an aborted snapshot was not dropped (%s: %s); "
                        "the next open uploads it", part.hex()[:16], type(e).__name__, e)

    def adopt(self, root: bytes, blob: bytes, part: bytes) -> None:
        """A rank other than 0: store rank 0's commit and top nodes in this rank's tier.
        Each is stored under the address of its own bytes, and the commit must be `root`:
        nothing rank 0 sends can stand for another object. Then the tier follows rank 0's:
        the snapshots of the job rank 0 no longer keeps are dropped here, in the background
        (Uploader.follow), once their parts are uploaded."""
        body, payloads, *rest = msgpack.unpackb(blob)
        kept = rest[0] if rest else None
        assets = self.core.assets
        for p in payloads:
            assets.put_node(p)
        got = assets.put_commit(body).digest
        if got != root:
            raise IntegrityError(f"rank 0 sent a commit object that is not snapshot {root.hex()[:16]} "
                                 f"(its bytes hash to {got.hex()[:16]})", reason="corrupt")
        assets.sync()
        # A catalog row (no ref) with this rank's part: this tier keeps the snapshot. gc,
        # fsck and the budget walk it through the part and what else is here (the other
        # ranks' sub-trees are in their tiers: walk.walk_commit(part=)).
        from .format.manifest import decode_commit
        c = decode_commit(body)
        self.core.refs.catalog_put_part(root, {k: c.get(k) for k in (
            "job", "ref", "step", "time", "metrics", "meta", "parent", "tree")} | dict(c.get("stats") or {}), part)
        if isinstance(kept, list) and all(isinstance(r, bytes) and len(r) == 32 for r in kept):
            self.uploader.follow(c.get("job"), set(kept) | {root})

    def published(self, info, tree: bytes, rank0: bool):
        """Every rank once the snapshot is published locally: queue its upload (rank 0: the
        snapshot; another rank: its part, the sub-tree `tree`); with replicas, send the
        part to the peers in the background."""
        root = bytes.fromhex(info.root)  # (rank 0's part is marked with its move, the others' by adopt)
        self.uploader.enqueue(root, info.ref, info.step, part=None if rank0 else tree)
        if self.peers is not None:
            self.peers.replicate(root, tree)
        return dataclasses.replace(info, durable=False)


class _Pending(TsckError):
    """Objects of the snapshot that the remote does not hold yet (another rank uploads them)."""


def _pause(up, pause: float) -> None:
    with up._cond:
        if not up._stop:
            up._cond.wait(pause)
    if up._stop:
        raise TsckError("the uploader was stopped while it waited for the other ranks")


def _part_objects(up, tree: bytes, snapshot: str) -> dict:
    """This rank's objects under its sub-tree `tree`, by kind, each once. A Replicated
    tensor's blocks are split among the ranks (each writes those it owns) and every
    rank's nodes name them all: the blocks this tier lacks are the others' to send. Rank
    0 moves the ref only once it saw each one in the remote."""
    local = up.local.assets
    objs: dict = {"block": [], "node": [], "commit": []}
    seen: set[bytes] = set()
    for o in walk_tree(local, tree, snapshot=snapshot, verify=True):
        if o.digest not in seen:
            seen.add(o.digest)
            objs[o.kind].append(o.digest)
    here = list(up.remote.pool.map(local.block_exists, objs["block"]))
    objs["block"] = [d for d, h in zip(objs["block"], here) if h]
    return objs


def upload_part(up, seq: int, entry: dict) -> None:
    """A rank other than 0: send this rank's part of a collective snapshot (blocks, then
    nodes, skipping what the remote has); then it is durable *for this rank*. It does not
    wait for rank 0's remote move: rank 0 may never make it (its retention expired the
    snapshot before its upload, or it took a newer one first), and this rank's later
    parts, queued behind, are what rank 0 waits for then."""
    root, tree, local, remote = entry["root"], entry["part"], up.local, up.remote
    if entry.get("orphan"):
        return _upload_orphan(up, seq, entry)
    if not remote.refs.catalog_has(root):
        fence = up.publisher.fence()  # before the remote is asked about any object
        try:
            objs = _part_objects(up, tree, root.hex())
        except IntegrityError:
            # As for a whole snapshot: a gc of this tier may have expired the row (its
            # retention) and deleted the part meanwhile; otherwise the tier is damaged.
            if local.refs.catalog_get(root, checked=False) is None:
                up._expired(seq, root)
                return
            raise
        up._send(objs, fence)
    local.refs.upload_done(seq, root)
    with up._cond:
        up._cond.notify_all()
    log.info("local tier: this rank's part of snapshot %s of ref %s is in %s", root.hex()[:16],
             entry.get("ref"), remote.url)


def _upload_orphan(up, seq: int, entry: dict) -> None:
    """A part this rank wrote and said "done" for, and then died before the snapshot's
    row reached its tier (RefTable.intents_queue): the snapshot's root is unknown here,
    but rank 0 may have published it and waits for this part in the remote. Send what
    the remote lacks of it (conditional writes, as any part); nothing is marked durable
    here (this tier keeps no row of the snapshot). Its objects gone from the tier (a gc
    took them after the grace period) or damaged: nothing to send, the entry goes."""
    tree = entry["part"]
    fence = up.publisher.fence()
    try:
        objs = _part_objects(up, tree, f"(part {tree.hex()[:16]})")
    except (IntegrityError, UnreadableObject) as e:
        log.warning("local tier: this rank's part %s of a collective snapshot (ref %s, step %s), written before a "
                    "restart, is not whole here (%s): not uploaded", tree.hex()[:16], entry.get("ref"),
                    entry.get("step"), e)
        up.local.refs.upload_drop(seq)
        return
    up._send(objs, fence)
    up.local.refs.upload_drop(seq)
    up.orphans += 1
    with up._cond:
        up._cond.notify_all()
    log.info("local tier: this rank's part %s of a collective snapshot (ref %s, step %s), written before a restart, "
             "is in %s", tree.hex()[:16], entry.get("ref"), entry.get("step"), up.remote.url)


class _Nearest:
    """The local tier's Assets for rank 0's walk of a collective snapshot: a node the
    tier lacks (another rank's) is read from the remote store, checked there, and
    recorded; missing there too, the walk stops with _Pending. A node the tier holds
    damaged is the tier's fault, as in a single-process upload (IntegrityError)."""

    def __init__(self, local, remote):
        self.local, self.remote = local, remote
        self.theirs: list[tuple[str, bytes]] = []

    def __getattr__(self, name):
        return getattr(self.local, name)

    def get_node(self, d: bytes, *, verify: bool = True, snapshot=None, path=None, fence=None) -> bytes:
        try:
            return self.local.get_node(d, verify=verify, snapshot=snapshot, path=path, fence=fence)
        except (IntegrityError, UnreadableObject) as e:
            if getattr(e, "reason", None) != "missing":
                raise
        try:
            data = self.remote.get_node(d, verify=verify, snapshot=snapshot, path=path)
        except (IntegrityError, UnreadableObject) as e:
            if getattr(e, "reason", None) != "missing":
                raise
            raise _Pending(f"node {d.hex()[:16]} at {path or '(top)'}") from None
        self.theirs.append(("node", d))
        return data


def _survey(up, root: bytes, fence: int):
    """-> (this tier's objects of the snapshot, by kind; the others' objects, each seen in
    the remote after `fence` was read). _Pending when some are not there yet."""
    local, remote = up.local.assets, up.remote.assets
    nearest = _Nearest(local, remote)
    mine: dict = {"block": [], "node": [], "commit": []}
    seen: set[bytes] = set()
    blocks, nodes = [], []
    for o in walk_commit(nearest, root, verify=True):
        if o.digest in seen:
            continue
        seen.add(o.digest)
        (blocks if o.kind == "block" else nodes if o.kind == "node" else mine[o.kind]).append(o.digest)
    remote_nodes = {d for _, d in nearest.theirs}  # (known once the walk is over: a node is named before it is read)
    mine["node"] = [d for d in nodes if d not in remote_nodes]
    here = list(up.remote.pool.map(local.block_exists, blocks))
    mine["block"] = [d for d, h in zip(blocks, here) if h]
    theirs = [d for d, h in zip(blocks, here) if not h]
    missing = [d for d, ok in zip(theirs, up.remote.pool.map(remote.block_exists, theirs)) if not ok]
    if missing:
        raise _Pending(f"{len(missing)} block(s), e.g. {missing[0].hex()[:16]}")
    return mine, nearest.theirs + [("block", d) for d in theirs]


def _confirm(up, theirs: list) -> None:
    """Every object of `theirs` is in the remote now (asked of storage: a HEAD each)."""
    remote = up.remote.assets

    def there(kd) -> bool:
        kind, d = kd
        return up.remote.storage.exists(remote.object_key(kind + "s", d))
    missing = [kd for kd, ok in zip(theirs, up.remote.pool.map(there, theirs)) if not ok]
    if missing:
        raise _Pending(f"{len(missing)} object(s) of the other ranks, e.g. {missing[0][0]} {missing[0][1].hex()[:16]}")


class _Skipped(Exception):
    """The snapshot waited for was dropped from the queue meanwhile (the backlog rule)."""


def _until_present(up, root: bytes, look, give_up=None):
    """look() until it stops raising _Pending (another rank's upload is still under way):
    with backoff, for up to PART_WAIT seconds without progress (the count of what is
    missing going down). give_up() -> True between tries: stop waiting (_Skipped)."""
    since, pause, best = time.monotonic(), _PAUSE[0], None
    while True:
        try:
            return look()
        except _Pending as e:
            if give_up is not None and give_up():
                raise _Skipped() from None
            if str(e) != best:  # progress: what is missing changed
                best, since = str(e), time.monotonic()
            if time.monotonic() - since > PART_WAIT:
                raise TsckError(f"snapshot {root.hex()[:16]}: the other ranks' parts are not in the remote store "
                                f"after {PART_WAIT:g}s ({e} missing)") from None
            log.debug("snapshot %s: waiting for the other ranks' uploads (%s missing)", root.hex()[:16], e)
            _pause(up, pause)
            pause = min(_PAUSE[1], pause * 2)


def upload_world(up, seq: int, entry: dict, row: dict) -> None:
    """Rank 0: make a collective snapshot durable once every rank's part is in the remote."""
    root, local = entry["root"], up.local
    fence = up.publisher.fence()  # before the remote is asked about any object

    def look():
        if local.refs.catalog_get(root) is None:  # (a node of its own deleted looks like another rank's)
            raise IntegrityError(f"snapshot {root.hex()[:16]} left the local catalog", reason="missing")
        return _survey(up, root, fence)

    def superseded() -> bool:
        # A part that never comes (its rank was killed after the snapshot was published
        # and before it queued its part) must not hold the queue for PART_WAIT: once a
        # newer snapshot of the ref is queued, the backlog rule drops this one.
        return up._superseded(seq, entry, local.refs.upload_pending())
    try:
        mine, theirs = _until_present(up, root, look, give_up=superseded)
        up._send(mine, fence)
    except _Skipped:
        return
    except IntegrityError:
        # Missing or damaged here: the snapshot may have left the tier on purpose
        # meanwhile; else the tier is damaged (Uploader._gone_meanwhile).
        if up._gone_meanwhile(seq, root):
            return
        raise

    def revalidate(new_fence: int) -> None:
        # A gc deletion phase ran: everything again, under the new fence (what it removed
        # of the others' parts is waited for, bounded: its owners sent it once).
        _until_present(up, root, lambda: _confirm(up, theirs))
        up._send(mine, new_fence)

    try:
        info = up.publisher.move_to(root, row, fence=fence, revalidate=revalidate)
    except IntegrityError:
        if up._gone_meanwhile(seq, root):
            return
        raise
    up._publish_holds(root)
    local.refs.upload_done(seq, root)
    with up._cond:
        up._cond.notify_all()
    log.info("local tier: collective snapshot %s of ref %s durable at %s", info.root[:16], info.ref,
             up.remote.url)
    up._remote_retention(row)


# -- peer replicas ---------------------------------------------------------------------
#
# A TCP side channel, not the process group: an asynchronous collective put runs on the
# store's background publisher while training runs its own collectives (DDP's all-reduce)
# on the same group from the main thread, and gloo matches a group's operations by their
# order, so sends from two threads would pair with the wrong receives; a group of our own
# (new_group) must be made by every rank at one point of the program, which open_store is
# not. Point-to-point connections have no order to keep: a rank's server answers whoever
# asks, whenever. The addresses go through the c10d Store (key tsck/peer/<rank>).
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
    asked to receive (a length past it is refused before any buffer is made)."""
    body = max(core.settings.block_size, 1 << 20) if kind == "block" else MAX_NODE_BYTES
    return HEADER_SIZE + body


def _recv(sock, n: int) -> bytearray:
    buf = bytearray(n)  # n is checked against _limit by the callers before this allocation
    mv, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(mv[got:], min(n - got, 1 << 22))
        if not k:
            raise ConnectionError("the peer closed the connection")
        got += k
    return buf


def _local_host(kv) -> str:
    """The address the other ranks reach this one at: TSCK_PEER_HOST, else that of the
    interface that reaches the c10d Store's host (every rank reaches it), else the host name's."""
    import os
    import socket
    host = os.environ.get("TSCK_PEER_HOST")
    if host:
        return host
    store = kv
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    target = getattr(store, "host", None)
    if target:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))  # (no packet is sent: it picks the route)
                return s.getsockname()[0]
        except OSError:
            pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class Peers:
    """This rank's side of the peer replicas: a server that answers for its tier's objects
    by address and stores the replicas other ranks send (each checked against its address
    first), and a client that sends this rank's part to the next `k` ranks and fetches
    what its tier lacks from them. Counters (tests): `fetched` objects got from peers,
    `sent` replicas sent, `refused` copies refused for not matching their address, `bad`
    fetched copies not used for the same reason."""

    def __init__(self, core, k: int):
        import threading
        from concurrent.futures import ThreadPoolExecutor
        self.core, self.k = core, k
        self._sock = None
        self._lock = threading.Lock()
        self._addrs: dict[int, tuple[str, int]] = {}
        self._dead: set[int] = set()
        self._pending: list = []
        self._send = ThreadPoolExecutor(1, thread_name_prefix="tsck-replicas")
        self.rank = self.world = None
        self.kv = None
        self.fetched = self.sent = self.refused = self.bad = 0
        self._idle: dict[int, list] = {}  # peer -> connections between two requests (fetch_checked)
        self._keeper = _Keeper(core.storage)

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
            port = self._listen()
            self.kv.set(f"tsck/peer/{self.rank}", f"{_local_host(self.kv)}:{port}".encode())
            return True

    def _listen(self, host: str = "0.0.0.0") -> int:
        """Start the server -> its port."""
        import socket
        import threading
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(64)
        self._sock = sock
        threading.Thread(target=self._serve, name="tsck-peer-server", daemon=True).start()
        return sock.getsockname()[1]

    def holders(self) -> list[int]:
        """The ranks that hold this rank's replicas: r+1 .. r+k (mod W)."""
        return [(self.rank + i) % self.world for i in range(1, min(self.k, self.world - 1) + 1)]

    def close(self) -> None:
        self.wait()
        self._send.shutdown(wait=True)
        self._keeper.close()
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for c in conns:
                c.close()
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    # -- the server ----------------------------------------------------------------------
    def _serve(self) -> None:
        import threading
        sock = self._sock
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._answer, args=(conn,), name="tsck-peer", daemon=True).start()

    def _answer(self, conn) -> None:
        from .assets import Assets
        assets, storage = self.core.assets, self.core.storage
        conn.settimeout(PEER_TIMEOUT)
        try:
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
                    data = _recv(conn, n)
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
            log.info("peer replicas: a connection ended: %s", e)
        finally:
            conn.close()

    # -- the client ----------------------------------------------------------------------
    def _connect(self, peer: int):
        import socket
        if peer in self._dead:
            return None
        try:
            if peer not in self._addrs:
                key = f"tsck/peer/{peer}"
                import datetime
                self.kv.wait([key], datetime.timedelta(seconds=PEER_TIMEOUT))
                host, port = self.kv.get(key).decode().rsplit(":", 1)
                self._addrs[peer] = (host, int(port))
            return socket.create_connection(self._addrs[peer], timeout=PEER_TIMEOUT)
        except Exception as e:  # noqa: BLE001 - a peer away is a peer we do without
            log.warning("peer replicas: rank %d cannot be reached (%s); going on without it", peer, e)
            self._dead.add(peer)
            return None

    @staticmethod
    def _ask(conn, op: bytes, kind: str, d: bytes, data: bytes = b""):
        conn.sendall(op + _CODES[kind] + d + len(data).to_bytes(8, "big") + data)

    def replicate(self, root: bytes, tree: bytes) -> None:
        """In the background: send the objects of this rank's part (sub-tree `tree` of
        snapshot `root`) that its tier holds to each holder that lacks them."""
        fut = self._send.submit(self._replicate, root, tree)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [fut]

    def wait(self, timeout: float | None = None) -> None:
        from concurrent.futures import wait
        with self._lock:
            pending = list(self._pending)
        wait(pending, timeout)

    def _replicate(self, root: bytes, tree: bytes) -> None:
        assets = self.core.assets
        objs, seen = [], set()
        for o in walk_tree(assets, tree, snapshot=root.hex(), verify=True):
            if o.digest not in seen:
                seen.add(o.digest)
                objs.append((o.kind, o.digest))
        # (a Replicated tensor's blocks written by another rank are not in this tier: theirs to send)
        objs = [(k, d) for k, d in objs if k != "block" or assets.block_exists(d)]
        for peer in self.holders():
            conn = self._connect(peer)
            if conn is None:
                continue
            try:
                with conn:
                    n = 0
                    for kind, d in objs:
                        self._ask(conn, b"H", kind, d)
                        if _recv(conn, 1) == b"\x01":
                            continue
                        self._ask(conn, b"P", kind, d, assets.stored_frame(kind, d))
                        if _recv(conn, 1) != b"\x01":
                            raise TsckError(f"rank {peer} refused the copy of {kind} {d.hex()[:16]}")
                        n += 1
                    self._ask(conn, b"S", "block", bytes(32))
                    _recv(conn, 1)
                with self._lock:
                    self.sent += n
                log.info("peer replicas: snapshot %s: %d object(s) of this rank's part sent to rank %d",
                         root.hex()[:16], n, peer)
            except (OSError, TsckError) as e:
                log.warning("peer replicas: snapshot %s: sending this rank's part to rank %d failed (%s); the "
                            "remote store stays its copy", root.hex()[:16], peer, e)

    def fetch(self, kind: str, d: bytes) -> bool:
        """Get object `d` from a holder into this rank's tier, checked against its address
        first -> whether one had it."""
        from .assets import Assets
        got = self.fetch_checked(kind, d)
        if got is None:
            return False
        kept = _keep(self.core.storage, Assets.object_key(kind + "s", d), got[0])
        if kept:
            self._keeper.wrote()
        return kept

    def present(self, kind: str, digests) -> set:
        """The `digests` some holder says it stores (one connection per holder, the
        questions sent in a row, then the answers read): what a checkout may count on
        fetching. A holder that lies is caught by the fetch's check, which then goes on
        to the next holder or the remote."""
        todo, have = list(digests), set()
        for peer in self.holders():
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

    def fetch_checked(self, kind: str, d: bytes):
        """Object `d` from a holder, checked against its address -> (its stored frame, its
        bytes as decoded by the check), or None when no holder has a good copy."""
        from .assets import Assets
        for peer in self.holders():
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
            return data, raw
        return None


class _Keeper:
    """Keeps the blocks a checkout fetched from peers in this rank's tier, off the
    checkout's path: a background thread writes them (and makes them durable once it has
    nothing queued), so the restore spends its CPU and disk on the restore. Only a cache
    for the next restore: past KEEP_QUEUED bytes waiting, a copy is not kept; a tier that
    cannot take one costs a warning (_keep)."""

    def __init__(self, storage):
        import threading
        self.storage = storage
        self._queue: list = []
        self._queued = 0
        self._cond = threading.Condition()
        self._thread = None
        self._closed = self._dirty = False

    def keep(self, key: str, data) -> None:
        n = len(data)
        with self._cond:
            if self._closed or self._queued + n > KEEP_QUEUED:
                log.debug("peer replicas: %s fetched from a peer is not kept (%d bytes wait already)", key,
                          self._queued)
                return
            self._queue.append((key, data))
            self._queued += n
            self._start()
            self._cond.notify()

    def wrote(self) -> None:
        """A copy was written into the tier by the caller (a node, read back at once): the
        thread makes it durable with the rest."""
        with self._cond:
            if self._closed:
                return
            self._dirty = True
            self._start()
            self._cond.notify()

    def _start(self) -> None:
        import threading
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tsck-peer-keep", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        import os
        import threading
        try:  # a cache's writes yield the CPU to the restore and the training it serves
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), KEEP_NICE)
        except (AttributeError, OSError):
            pass
        while True:
            with self._cond:
                if not self._queue and self._dirty and not self._closed:
                    self._cond.wait(KEEP_SETTLE)  # more may come: one sync for a checkout's copies
                while not self._queue and not self._closed and not self._dirty:
                    self._cond.wait()
                batch, self._queue, self._queued = self._queue, [], 0
                closed = self._closed
            wrote = False
            for key, data in batch:
                wrote = _keep(self.storage, key, data) or wrote
            with self._cond:
                self._dirty = self._dirty or wrote
                sync = self._dirty and (closed or not self._queue)
                if sync:
                    self._dirty = False
            if sync:  # nothing more came: the copies are named and durable
                try:
                    self.storage.sync()
                except (OSError, TsckError) as e:
                    log.warning("peer replicas: the copies fetched from peers could not be synced in this "
                                "rank's tier (%s)", e)
            if closed:
                with self._cond:
                    if not self._queue and not self._dirty:
                        return

    def close(self) -> None:
        """Write and sync what is queued, then stop."""
        with self._cond:
            thread, self._closed = self._thread, True
            self._cond.notify()
        if thread is not None:
            thread.join()


KEEP_QUEUED = 256 << 20  # bytes of fetched copies that may wait to be kept
KEEP_SETTLE = 0.5  # seconds without a new copy before the kept ones are synced
KEEP_NICE = 10  # the keeping thread's nice value (Linux: per thread)


def _keep(storage, key: str, data) -> bool:
    """Keep a checked copy fetched from a peer in this rank's tier -> whether it is there.
    Only a cache for the next restore: a tier that cannot take it (a full disk) costs a
    warning, never the restore, which has the checked bytes (a node or commit not kept is
    read from the remote)."""
    try:
        storage.put_addressed(key, [data])
        return True
    except (OSError, TsckError) as e:
        log.warning("peer replicas: %s fetched from a peer could not be kept in this rank's tier (%s)", key, e)
        return False


def peer_reads(reads, peers: Peers):
    """A ReadThrough (upload.py) with the peers between the local tier and the remote: an
    object the tier lacks is fetched from a holder (checked against its address), used,
    and kept in the tier; one no peer has is read from the remote as before."""
    import numpy as np
    from .upload import ReadThrough

    class PeerReads(ReadThrough):
        def _have(self, kind: str, d: bytes) -> bool:
            return self.local.storage.exists(self.local.object_key(kind + "s", d))

        def _fill(self, kind: str, d: bytes) -> None:
            if not self._have(kind, d):
                peers.fetch(kind, d)

        def read_block_into(self, d, out, **kw):
            if self._have("block", d):
                return super().read_block_into(d, out, **kw)
            got = peers.fetch_checked("block", d)
            if got is None:
                return super().read_block_into(d, out, **kw)  # the remote's copy, checked there
            data, raw = got
            mv = memoryview(out).cast("B")
            if len(raw) != mv.nbytes:
                key = self.local.object_key("blocks", d)
                raise IntegrityError(f"object holds {len(raw)} bytes, expected {mv.nbytes}", key=key,
                                     snapshot=kw.get("snapshot"), path=kw.get("path"))
            # The bytes the check just hashed go to the caller: no write, read back and hash
            # again through the tier (a restore's CPU is what bounds it on a small host).
            np.copyto(np.frombuffer(mv, dtype=np.uint8), np.frombuffer(raw, dtype=np.uint8))
            peers._keeper.keep(self.local.object_key("blocks", d), data)

        def get_node(self, d, **kw):
            self._fill("node", d)
            return super().get_node(d, **kw)

        def get_commit(self, d, **kw):
            self._fill("commit", d)
            return super().get_commit(d, **kw)

        def require_blocks(self, digests, pool, **kw):
            digests = list(digests)
            here = list(pool.map(lambda d: self._have("block", d), digests))
            lacking = [d for d, h in zip(digests, here) if not h]
            at_peers = peers.present("block", lacking) if lacking else set()
            return super().require_blocks([d for d in digests if d not in at_peers], pool, **kw)

    return PeerReads(reads.local, reads.remote, evicted=reads._evicted)
