"""A local tier's own table (TierTable): the upload queue, the durable and evicted marks,
a rank's parts of collective snapshots and the intents before them, and the remote
locations a tiered open verified. It is a type of its own, not part of RefTable: only a
tier's code (tier/) and what walks a tier's snapshots (gc, fsck, usage) use it, through
`RefTable.tier_rows`, and its conformance suite is tensorstore_ck.testing.tiertable.

Its rows live in its ref table's `meta`, in that table's transactions (a tier's catalog
row and its marks change together), so a table of any age opens as a tier's and no other
reader sees them:

    upload:   seq (u64 BE) -> msgpack {root, ref, step[, part, hold, started, spared, orphan]}
    upload_seq               -> the queue's last sequence number
    durable:  root           -> b"", or when (f64 BE: the table's clock) the uploader moved
                                the remote ref to it (the remote store has the snapshot)
    evicted:  root           -> b""    (the byte budget dropped its local copies)
    part:     root           -> sub-tree (a rank other than 0 of a collective snapshot)
    part0:    root           -> sub-tree (rank 0's own part, set by compare_and_swap(part0=))
    intent:   part           -> msgpack {ref, step, job}
    verified: location       -> store id

A catalog row that goes takes its tier marks with it (drop_row), and no expiry drops a
snapshot whose upload has started (protected_roots): RefTable's own expiries use both.
"""

from __future__ import annotations

import math
import struct
from typing import Callable

from ..errors import FormatError
from ..format.records import decode_catalog, decode_record, encode_record
from .gcstate import note_dropped
from .txn import Txn

__all__ = ["TierTable",
           # what RefTable's own transactions share (refs/base.py)
           "PART0_KEY", "drop_row", "protected_roots", "note_spared"]


class TierTable:
    """The upload queue, durable and evicted marks, collective parts and intents, and
    verified locations of a local tier, over one ref table's read and write transactions
    (RefTable.tier_rows makes it)."""

    def __init__(self, read: Callable[[Callable[[Txn], object]], object],
                 write: Callable[[Callable[[Txn], object]], object]):
        self._read, self._write = read, write
        # Tier-only snapshots this process saw committed (one process's put returned; a
        # collective one's copies agreed): gc.retention_plan lets them stand in for older
        # ones at once. Not stored: a new process waits for the next snapshot after them.
        self.committed: set[bytes] = set()

    # -- a rank's part of collective snapshots in its local tier (tier/collective.py) -----
    def catalog_put_part(self, root: bytes, row: dict, part: bytes) -> None:
        """The catalog row of collective snapshot `root` in the tier of a rank other than
        0, with the rank's sub-tree `part` (meta `part:` root): the tier holds that part,
        the commit and the top nodes, and of the other ranks' sub-trees only the replicas
        it keeps. gc, fsck and the budget walk such a snapshot through what is here
        (walk.walk_commit(part=)). A row already there is kept as it is."""
        def txn(t: Txn):
            if t.get("catalog", root) is None:
                t.put("catalog", root, encode_record(row))
            t.put("meta", _PART + root, part)
            t.delete("meta", _INTENT + part)  # the row names the part now (intent_put)
        self._write(txn)

    def intent_put(self, part: bytes, rec: dict) -> None:
        """A rank other than 0, before it tells rank 0 that its part of a collective
        snapshot is written (meta `intent:` part -> {ref, step, job}): should the rank
        die before the snapshot's row reaches this tier (catalog_put_part clears the
        intent) or its abort does (intent_drop), the next open queues the part's upload
        (intents_queue): rank 0 may have published the snapshot and waits for that part."""
        self._write(lambda t: t.put("meta", _INTENT + part, encode_record(rec)))

    def intent_drop(self, part: bytes) -> None:
        self._write(lambda t: t.delete("meta", _INTENT + part))

    def intents(self) -> dict[bytes, dict]:
        return self._read(lambda t: {k[len(_INTENT):]: decode_record(v, "part intent")
                                     for k, v in t.items("meta", _INTENT)})

    def intents_queue(self) -> list[bytes]:
        """Each part intent becomes an upload queue entry {root: part, part, orphan: True}
        (its snapshot's root is not known here), in one transaction -> the parts queued."""
        def txn(t: Txn):
            got = [(k[len(_INTENT):], v) for k, v in t.items("meta", _INTENT)]
            if not got:
                return []
            raw = t.get("meta", _UPLOAD_SEQ)
            seq = _SEQ.unpack(raw)[0] if raw is not None else 0
            for part, v in got:
                rec = decode_record(v, "part intent")
                seq += 1
                t.put("meta", _UPLOAD + _SEQ.pack(seq), encode_record(
                    {"root": part, "ref": rec.get("ref"), "step": rec.get("step"), "part": part, "orphan": True}))
                t.delete("meta", _INTENT + part)
            t.put("meta", _UPLOAD_SEQ, _SEQ.pack(seq))
            return [p for p, _ in got]
        return self._write(txn)

    def verified_get(self, location: str) -> str | None:
        """A local tier: the store id an open found at remote `location` (meta `verified:`)."""
        v = self._read(lambda t: t.get("meta", _VERIFIED + location.encode()))
        return None if v is None else v.decode(errors="replace")

    def verified_put(self, location: str, store_id: str) -> None:
        self._write(lambda t: t.put("meta", _VERIFIED + location.encode(), store_id.encode()))

    def parts(self, rank0: bool = True) -> dict[bytes, bytes]:
        """root -> this rank's sub-tree, for the collective snapshots of catalog_put_part
        and (rank0) the move of rank 0's tier (compare_and_swap(part0=))."""
        def read(t):
            out = {k[len(_PART):]: v for k, v in t.items("meta", _PART)}
            if rank0:
                out.update({k[len(PART0_KEY):]: v for k, v in t.items("meta", PART0_KEY)})
            return out
        return self._read(read)

    def parts_expire(self, roots) -> list[bytes]:
        """Drop the rows of `roots` that are, in the transaction, parts (catalog_put_part)
        not queued for upload, and no ref's tip, tag's target or pin -> those dropped.
        What rank 0's tier no longer keeps goes from the other ranks' tiers so (tier/collective.py)."""
        roots = list(roots)

        def txn(t: Txn):
            queued = {decode_record(v, "upload queue entry").get("root") for _, v in t.items("meta", _UPLOAD)}
            protected = protected_roots(t)
            gone = [r for r in roots if r not in queued and r not in protected
                    and t.get("meta", _PART + r) is not None and t.get("catalog", r) is not None]
            for r in gone:
                drop_row(t, r)
                t.delete("meta", _DURABLE + r)
            return gone
        return self._write(txn)

    # -- a local tier's upload queue (tier.py) -------------------------------------------
    def upload_enqueue(self, root: bytes, ref: str, step, part: bytes | None = None, hold: bool = False) -> int:
        """Queue `root` (published locally on `ref`) for upload -> its sequence number.
        A root queued already keeps its place. part: a rank's sub-tree of a collective
        snapshot (what that rank uploads of it), kept in the entry as "part". hold: the
        snapshot is sent for the tags and pins that name it, into the remote catalog
        without moving the remote ref (an older snapshot than the remote tip: tiers.md,
        "One catalog"); kept in the entry as "hold"."""
        def txn(t: Txn):
            for k, v in t.items("meta", _UPLOAD):
                if decode_record(v, "upload queue entry").get("root") == root:
                    return _SEQ.unpack(k[len(_UPLOAD):])[0]
            if not hold:
                t.delete("meta", _EVICTED + root)  # published again here: its objects are local again
            raw = t.get("meta", _UPLOAD_SEQ)
            seq = (_SEQ.unpack(raw)[0] if raw is not None else 0) + 1
            t.put("meta", _UPLOAD_SEQ, _SEQ.pack(seq))
            rec = {"root": root, "ref": ref, "step": step}
            if part is not None:
                rec["part"] = part
            if hold:
                rec["hold"] = True
            t.put("meta", _UPLOAD + _SEQ.pack(seq), encode_record(rec))
            return seq
        return self._write(txn)

    def upload_pending(self) -> list[tuple[int, dict]]:
        """The queue, oldest first: (seq, {root, ref, step})."""
        return self._read(lambda t: [(_SEQ.unpack(k[len(_UPLOAD):])[0], decode_record(v, "upload queue entry"))
                                     for k, v in t.items("meta", _UPLOAD)])

    def upload_begin(self, seq: int) -> bool:
        """The uploader starts sending entry `seq`: mark it "started", so that from now
        on no prune, gc or eviction of this table expires its snapshot (protected_roots) until
        upload_done or upload_drop removes the entry -> False if the entry is gone."""
        def txn(t: Txn):
            key = _UPLOAD + _SEQ.pack(seq)
            raw = t.get("meta", key)
            if raw is None:
                return False
            rec = decode_record(raw, "upload queue entry")
            if not rec.get("started"):
                rec["started"] = True
                t.put("meta", key, encode_record(rec))
            return True
        return self._write(txn)

    def uploading(self) -> set[bytes]:
        """The roots of the queue entries whose upload has started (upload_begin)."""
        return self._read(_uploading)

    def upload_last_seq(self) -> int:
        raw = self._read(lambda t: t.get("meta", _UPLOAD_SEQ))
        return _SEQ.unpack(raw)[0] if raw is not None else 0

    def upload_done(self, seq: int, root: bytes, at: float | None = None) -> None:
        """The remote ref moved to `root`: mark it durable and drop entry `seq`, at once;
        `at` (this table's clock) is when, what durable_times() reads (tsck goodput)."""
        def txn(t: Txn):
            t.put("meta", _DURABLE + root, b"" if at is None else _AT.pack(at))
            t.delete("meta", _UPLOAD + _SEQ.pack(seq))
        self._write(txn)

    def durable_mark(self, roots) -> list[bytes]:
        """Mark `roots` durable without an upload (the remote catalog lists them: a table
        rebuilt by recover has lost its marks) -> those marked: only a root with a catalog
        row and not queued, checked in the transaction."""
        roots = list(roots)

        def txn(t: Txn):
            queued = {decode_record(v, "upload queue entry").get("root") for _, v in t.items("meta", _UPLOAD)}
            done = [r for r in roots if r not in queued and t.get("catalog", r) is not None]
            for r in done:
                t.put("meta", _DURABLE + r, b"")
            return done
        return self._write(txn)

    def upload_drop(self, seq: int) -> None:
        """Drop entry `seq` from the queue without marking anything durable (its snapshot
        left the local catalog before it was sent: expired by retention)."""
        self._write(lambda t: t.delete("meta", _UPLOAD + _SEQ.pack(seq)))

    def durable(self, roots) -> set[bytes]:
        """Which of `roots` are marked durable (one transaction)."""
        roots = list(roots)
        return self._read(lambda t: {r for r in roots if t.get("meta", _DURABLE + r) is not None})

    def durable_times(self, roots) -> dict[bytes, float | None]:
        """root -> when it became durable (upload_done's `at`), for those of `roots` marked
        durable; None where the mark has no time (marked by durable_mark, or unreadable)."""
        roots = list(roots)

        def txn(t: Txn):
            out = {}
            for r in roots:
                raw = t.get("meta", _DURABLE + r)
                if raw is not None:
                    at = _AT.unpack(raw)[0] if len(raw) == _AT.size else None
                    out[r] = at if at is not None and math.isfinite(at) and at >= 0 else None
            return out
        return self._read(txn)

    def evict_mark(self, roots) -> list[bytes]:
        """Mark `roots` evicted (a local tier's budget: their local copies may go, the
        remote store has them) -> those marked: only a root marked durable and not
        queued, checked in the transaction. An evicted root keeps nothing alive in a gc
        of this table (reach.kept_roots), so it must be one the remote store holds."""
        roots = list(roots)

        def txn(t: Txn):
            queued = {decode_record(v, "upload queue entry").get("root") for _, v in t.items("meta", _UPLOAD)}
            done = [r for r in roots if r not in queued and t.get("meta", _DURABLE + r) is not None]
            for r in done:
                t.put("meta", _EVICTED + r, b"")
            return done
        return self._write(txn)

    def evicted(self) -> set[bytes]:
        """The roots whose local copies a tier's budget dropped (evict_mark)."""
        return self._read(lambda t: {k[len(_EVICTED):] for k, _ in t.items("meta", _EVICTED)})


_UPLOAD = b"upload:"
_UPLOAD_SEQ = b"upload_seq"
_DURABLE = b"durable:"
_EVICTED = b"evicted:"
_PART = b"part:"
_VERIFIED = b"verified:"
PART0_KEY = b"part0:"
_INTENT = b"intent:"
_SEQ = struct.Struct(">Q")
_AT = struct.Struct(">d")


def drop_row(t: Txn, root: bytes) -> None:
    """A catalog row and the local tier's marks that go with it; what its commit had
    stored, and when, stays on record for `tsck du --plot` (gcstate.note_dropped)."""
    raw = t.get("catalog", root)
    if raw is not None:
        try:
            note_dropped(t, root, decode_catalog(raw))
        except FormatError:
            pass  # a malformed row: fsck's business; the picture counts it in its start
    t.delete("catalog", root)
    t.delete("meta", _EVICTED + root)
    t.delete("meta", _PART + root)
    t.delete("meta", PART0_KEY + root)


def protected_roots(t: Txn) -> set[bytes]:
    return ({v for _, v in t.items("refs")} | {v for _, v in t.items("tags")} | {k for k, _ in t.items("pins")}
            | _uploading(t))


def note_spared(t: Txn, roots: set) -> None:
    # An expiry left these roots because their upload had started: say so in their queue
    # entries ("spared"), so that the uploader prunes once the upload is done (the rules
    # keep them no more; Uploader._prune_here).
    if not roots:
        return
    for k, v in t.items("meta", _UPLOAD):
        rec = decode_record(v, "upload queue entry")
        if rec.get("started") and rec.get("root") in roots and not rec.get("spared"):
            rec["spared"] = True
            t.put("meta", k, encode_record(rec))


def _uploading(t: Txn) -> set[bytes]:
    # A local tier's snapshots being uploaded (upload_begin): expiring one mid-upload
    # would throw its sends away, and under retention that outruns the uploads would
    # leave the remote with no snapshot at all.
    out = set()
    for _, v in t.items("meta", _UPLOAD):
        rec = decode_record(v, "upload queue entry")
        if rec.get("started") and isinstance(rec.get("root"), bytes):
            out.add(rec["root"])
    return out
