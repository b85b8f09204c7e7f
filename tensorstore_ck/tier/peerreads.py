"""A collective checkout's reads from the peers holding its replicas (docs/design/tiers.md,
"Peer replicas"): FromPeers, a source of the tier's reader chain between the tier and the
remote, asking the holders the snapshot's placement chose; its plan fetches every block the
tier lacks in batches on the block stream before the reads run.
"""

from __future__ import annotations

import threading
from itertools import islice

from ..errors import IntegrityError, TsckError
from ..format.frame import HEADER_SIZE, decode_header
from .reads import NotHere, ReadChain, Source
from .replicas import FETCH_BYTES, FETCH_DEPTH, Peers, decoded_frame
from .stream import ReusedBuffers

__all__ = ["FromPeers", "peer_reads"]


class FromPeers(Source):
    """The peers holding this rank's replicas, as a source of a reader chain (reads.py)
    between the local tier and the remote: an object the tier lacks is fetched from a
    holder (checked against its address), used, and kept in the tier; one no holder has
    is the next source's (NotHere)."""

    name, where = "peer", "peer replicas"

    def __init__(self, peers: Peers, local):
        self.peers, self.local = peers, local  # local: the tier's Assets, where fetched copies are kept
        self.nodes: list | None = None  # each rank's node when the snapshot read was put (learn)

    def learn(self, commit: dict) -> None:
        """The snapshot being read (its decoded commit): its holders are the ones its
        placement chose then (the node of each rank, in its meta: Peers.commit_meta), which
        the job's nodes now (a lost node's ranks on new machines) would not give. Stored
        bytes: anything but a well-formed record leaves the job's placement now."""
        rec = (commit.get("meta") or {}).get("nodes") if isinstance(commit.get("meta"), dict) else None
        try:
            names, of = rec["names"], rec["of"]
            if (isinstance(names, list) and all(isinstance(n, str) for n in names) and isinstance(of, list)
                    and all(type(i) is int and 0 <= i < len(names) for i in of)):
                self.nodes = [names[i] for i in of]
        except (TypeError, KeyError):
            pass

    def _holders(self) -> list[int]:
        return self.peers.read_holders(self.nodes)

    def read_block_into(self, d, out, *, verify, snapshot, path, bounce, fence):
        import numpy as np
        got = self.peers.fetch_checked("block", d, self._holders())
        if got is None:
            raise NotHere(d)
        data, raw = got
        mv = memoryview(out).cast("B")
        if len(raw) != mv.nbytes:
            key = self.local.object_key("blocks", d)
            raise IntegrityError(f"object holds {len(raw)} bytes, expected {mv.nbytes}", key=key,
                                 snapshot=snapshot, path=path)
        # The bytes the check just hashed go to the caller: no write, read back and hash
        # again through the tier (a restore's CPU is what bounds it on a small host).
        np.copyto(np.frombuffer(mv, dtype=np.uint8), np.frombuffer(raw, dtype=np.uint8))
        self.peers.keep(self.local.object_key("blocks", d), data)

    # A node or commit a peer gave is kept in the tier and read back from there.
    def get_node(self, d, *, verify, snapshot, path, fence):
        if not self.peers.fetch("node", d, self._holders()):
            raise NotHere(d)
        return self.local.get_node(d, verify=verify, snapshot=snapshot, path=path, fence=fence)

    def get_commit(self, d, *, verify):
        # Every tier of a part holds its snapshot's commit. Read before the commit's record
        # of the nodes is (learn), so asked of this rank's holders now, then of any rank: a
        # rank on a node new to the job may have only new nodes among its holders.
        near, p = self._holders(), self.peers
        others = [r for r in ((p.rank + i) % p.world for i in range(1, p.world or 0)) if r not in near]
        if not (p.fetch("commit", d, near) or p.fetch("commit", d, others)):
            raise NotHere(d)
        return self.local.get_commit(d, verify=verify)

    def lacking(self, digests, pool, *, snapshot, path, fence):
        at_peers = self.peers.present("block", digests, self._holders())
        return [d for d in digests if d not in at_peers]

    def plan(self, jobs: list, base, tally=None):
        """A checkout's reads planned (Reader's plan): the blocks its tier lacks, and the
        packs of the packed tensors it lacks, are fetched from the holders in batches
        (Peers.fetch_stream), checked, and copied into their destinations now (a pack's
        parts each checked against its leaf's content hash first); -> the reader that
        runs the rest through `base` (the chain), the jobs already filled passed over."""
        from ..read.readjobs import PackPart
        digests = list(dict.fromkeys(job[0] for job in jobs))
        if not digests:
            return base
        lacked = [d for d, here in zip(digests, map(self.local.block_exists, digests)) if not here]
        if not lacked:
            return base
        by_digest: dict = {}
        parts: dict = {}  # pack digest -> its parts' jobs' destinations (PackPart)
        bounce: set = set()  # ids of the destinations that are the caller's memory (read/read.py)
        for d, out, _p, b in jobs:
            if type(out) is PackPart:
                parts.setdefault(d, []).append(out)
            else:
                by_digest.setdefault(d, []).append(out)
                if b:
                    bounce.add(id(out))
        filled: set = set()
        per = max(1, FETCH_BYTES // max(self.peers.core.settings.block_size, 1))
        with self.peers.keeping_after():
            fetched = self._fill([lacked[i:i + per] for i in range(0, len(lacked), per)], by_digest, parts, bounce,
                                 filled, tally)
            self.peers.keep_from_holders(fetched, self._holders())
        return base if not filled else _Filled(base, filled)

    def _fill(self, requests: list, by_digest: dict, parts: dict, bounce: set, filled: set, tally) -> list:
        """Fetch `requests` from the holders, each block used up by its check: checked and
        copied into its destinations (a pack's parts each checked against its leaf's hash
        first), noting (digest, id of the destination) in `filled` -> the digests fetched
        (no frame of them held: kept by fetching them again, Peers.keep_from_holders)."""
        import numpy as np
        from ..core.assets import Assets
        from ..core.partindex import part_matches
        # Nothing of a batch is used after its check, so each fetching thread receives
        # every batch into one buffer it reuses (alloc: its pages faulted in once, not per
        # batch). A block bound for fresh memory goes straight into it (place: no buffer,
        # no copy) or is decoded into it, and is checked there; one bound for the caller's
        # memory (bounce) is checked first and only then copied (read/read.py's promise).
        direct = {d: memoryview(outs[0]).cast("B") for d, outs in by_digest.items()
                  if d not in parts and not any(id(o) in bounce for o in outs)}
        alloc = ReusedBuffers()

        def place(d, n):
            out = direct.get(d)
            return None if out is None or n != HEADER_SIZE + out.nbytes else [memoryview(bytearray(HEADER_SIZE)), out]

        def check(d, mv) -> list:
            """Block d's bytes checked and copied where they go -> the destinations filled."""
            into = direct.get(d)
            if type(mv) is list:  # (placed: in `into` already)
                err, raw = Assets.block_in_place(d, *mv)
                if err is not None:
                    raise err
            else:
                try:
                    if into is not None and decode_header(mv[:HEADER_SIZE]).raw_len != into.nbytes:
                        into = None  # (a length the manifest does not give it: the chain reports it)
                except TsckError:
                    into = None  # (decoded_frame names what is wrong with it)
                _frame, raw = decoded_frame(d, mv, into)
            src = np.frombuffer(memoryview(raw).cast("B"), dtype=np.uint8)
            done = []
            for part in parts.get(d, ()):
                end = part.off + part.dst.nbytes
                if part.glen != src.nbytes or end > src.nbytes or (
                        part.h is not None and not part_matches(src, part.off, part.dst.nbytes, part.h)):
                    continue  # (the chain reads it, and names what is wrong)
                np.copyto(part.dst, src[part.off:end])
                done.append(part)
            outs = by_digest.get(d, ())
            if any(memoryview(o).cast("B").nbytes != src.nbytes for o in outs):
                return done  # (a length the manifest does not give it: the chain reports it)
            for i, o in enumerate(outs):
                if i or into is None:  # (into is outs[0]'s memory)
                    np.copyto(np.frombuffer(memoryview(o).cast("B"), dtype=np.uint8), src)
                done.append(o)
            return done
        fetched: list = []
        for got in self._fetched(requests, check, place, alloc):
            for d, done in got.items():
                filled.update((d, id(o)) for o in done)
                if tally is not None:
                    for _o in done:
                        tally.add(self.name, "block", d)
                fetched.append(d)
        return fetched

    def _fetched(self, requests: list, check, place, alloc):
        """Peers.fetch_stream of each request, in order, FETCH_DEPTH of them in flight (a
        holder reads its disk for one while it sends another): each fetching thread holds
        one batch buffer (alloc), the blocks used up by their checks."""
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor
        holders = self._holders()
        if len(requests) == 1:
            yield self.peers.fetch_stream(requests[0], holders, check, place, alloc)
            return
        todo = iter(requests)
        with ThreadPoolExecutor(FETCH_DEPTH, thread_name_prefix="tsck-peer-fetch") as pool:
            flight = deque(pool.submit(self.peers.fetch_stream, r, holders, check, place, alloc)
                           for r in islice(todo, FETCH_DEPTH))
            try:
                while flight:
                    got = flight.popleft().result()
                    nxt = next(todo, None)
                    if nxt is not None:
                        flight.append(pool.submit(self.peers.fetch_stream, nxt, holders, check, place, alloc))
                    yield got
            finally:
                for f in flight:
                    f.cancel()


class _Filled:
    """An ObjectReader: `base`, except for the reads a plan already filled (digest, id of
    the destination), which it passes over once; a pack's filled parts are jobs run_reads
    leaves out (filled_job)."""

    def __init__(self, base, filled: set):
        self.base, self.filled = base, filled
        self._lock = threading.Lock()

    def filled_job(self, d: bytes, part) -> bool:
        """Whether the part of pack `d` a job reads into (a PackPart) was filled."""
        with self._lock:
            return (d, id(part)) in self.filled

    def read_block_into(self, d: bytes, out, **kw) -> None:
        with self._lock:
            if (d, id(out)) in self.filled:
                self.filled.discard((d, id(out)))
                return
        self.base.read_block_into(d, out, **kw)

    def get_node(self, d: bytes, **kw) -> bytes:
        return self.base.get_node(d, **kw)

    def get_commit(self, d: bytes, **kw) -> bytes:
        return self.base.get_commit(d, **kw)

    def require_blocks(self, digests, pool, **kw) -> None:
        self.base.require_blocks(digests, pool, **kw)

    def node_error(self, d: bytes, msg: str, **kw) -> Exception:
        return self.base.node_error(d, msg, **kw)


def peer_reads(reads: ReadChain, peers: Peers) -> ReadChain:
    """`reads` (the tier, the remote behind) with the peers asked between the two."""
    return reads.with_source(1, FromPeers(peers, reads.sources[0].assets))
