"""The history of a ref table: the reflog, the steps index (REF@STEP) and gc's
compaction of both, as the part of RefTable (refs/base.py) that reads and writes them.

Every move of a ref appends one reflog record ({t, old, new, msg, op}) under name \\0
seq, seq one counter for the whole table, so the records order publications across
refs (publication_order: keep_last's order, recover's "which snapshot came last").
A move also indexes its snapshot's step (steps: name \\0 step \\0 seq -> root) in the
same transaction; meta `steps_seq` says up to which sequence number the index covers
every move, so a table written (even partly) without the index gets it rebuilt once,
on the first REF@STEP lookup. gc compacts the reflog and the index to what is kept.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import FormatError
from ..format.records import decode_catalog, decode_record, decode_reflog, encode_reflog
from .txn import Txn

__all__ = ["RefHistory", "ReflogEntry", "REFLOG_TAIL", "RECOVERED",
           # what RefTable's own transactions share (refs/base.py)
           "append_reflog", "key_name", "split_reflog_key"]

_SEQ = struct.Struct(">Q")
REFLOG_TAIL = 10          # moves of each ref that gc's compaction always leaves, kept or not
_STEPS_MARK = b"steps_seq"  # meta: the reflog sequence number up to which `steps` covers every move
_INCOMPLETE = object()
RECOVERED = "recovered from storage"  # the reflog message of recover's ref moves


@dataclass(frozen=True, slots=True)
class ReflogEntry:
    name: str
    time: float
    old: bytes | None
    new: bytes
    message: str
    op: str = "move"   # "delete": the ref was removed; "forget": the snapshot `new` was dropped


class RefHistory:
    """The reflog and steps-index half of RefTable (a mixin over its _read/_write)."""

    def removed(self) -> tuple[dict[str, float], set[bytes]]:
        """What users removed that storage may still hold (recover must not bring it
        back): {ref: time of its removal} for refs whose last record is a removal and
        that do not exist, and the roots forgotten."""
        def txn(t):
            last: dict[bytes, tuple] = {}
            forgotten = set()
            for k, v in t.items("reflog"):
                name_key, _seq = split_reflog_key(k)
                rec = decode_reflog(v, "?")
                last[name_key] = rec
                if rec[4] == "forget":
                    forgotten.add(rec[2])
            refs = {key_name(k, "ref"): rec[0] for k, rec in last.items()
                    if rec[4] == "delete" and t.get("refs", k) is None}
            return refs, forgotten
        return self._read(txn)

    def publication_order(self) -> dict[bytes, int]:
        """root -> the sequence number of the latest ref move that published it (one
        counter for the whole table, so it orders snapshots across refs)."""
        return {root: seq for root, (seq, _rec) in self.publication_record().items()}

    def publication_record(self) -> dict[bytes, tuple[int, bool]]:
        """root -> (the sequence number of the latest ref move to it, whether that move was
        recover's). A recover's moves replay a lost history in the order recover rebuilt
        for each ref, whenever recover runs: their numbers order one ref's snapshots, not
        snapshots of different refs, nor a recovered snapshot against a writer's."""
        def txn(t):
            out: dict = {}
            for k, v in t.items("reflog"):
                if len(k) < _SEQ.size + 1:
                    raise FormatError("malformed reflog key")
                seq = _SEQ.unpack(k[-_SEQ.size:])[0]
                _t, _old, new, msg, op = decode_reflog(v, "?")
                if op == "move" and seq > out.get(new, (-1, False))[0]:
                    out[new] = (seq, msg == RECOVERED)
            return out
        return self._read(txn)

    def history(self, name: str) -> list[tuple[bytes, dict | FormatError]] | None:
        """The snapshots `name` has pointed at that still have a catalog row, newest first,
        each once, read in one transaction: (root, row), or (root, FormatError) for a row
        that does not decode. None if `name` has neither a reflog nor a ref."""
        key = name.encode()

        def txn(t):
            entries = list(t.items("reflog", key + b"\0"))
            if t.get("refs", key) is None:
                ops = [decode_reflog(v, name)[4] for _k, v in entries]
                last_delete = max((i for i, op in enumerate(ops) if op == "delete"), default=-1)
                if "move" not in ops[last_delete + 1:]:  # never made, or deleted (a forget after counts not)
                    return None
            seen, out = set(), []
            for _k, v in reversed(entries):
                _t, _old, new, _msg, op = decode_reflog(v, name)
                if op == "delete":
                    break  # what came before belongs to the removed ref, not to this one
                if op != "move" or new in seen:
                    continue
                seen.add(new)
                raw = t.get("catalog", new)
                if raw is None:
                    continue
                try:
                    out.append((new, decode_catalog(raw)))
                except FormatError as e:
                    out.append((new, FormatError(f"catalog row of snapshot {new.hex()[:16]}: {e}")))
            return out

        return self._read(txn)

    def step_root(self, name: str, step: int, *, besides: bytes | None = None) -> bytes | None:
        """The newest snapshot of `name`'s history at `step` that still has a catalog row
        (REF@STEP), from the steps index: a few reads, whatever the history's length.
        besides: a root not to count (a snapshot just published: was there another?).
        A table whose index does not cover every move (steps_seq behind the reflog's
        sequence) gets it rebuilt first, once."""
        prefix = _step_prefix(name.encode(), step)

        def look(t):
            if not _steps_complete(t):
                return _INCOMPLETE
            best = None
            for _k, root in t.items("steps", prefix):  # ascending seq: the last one kept wins
                if root != besides and t.get("catalog", root) is not None:
                    best = root
            return best

        found = self._read(look)
        if found is _INCOMPLETE:
            try:
                self._write(_rebuild_steps)
            except Exception:  # noqa: BLE001 - a table we cannot write (read-only): search the history
                for root, row in self.history(name) or []:
                    if root != besides and isinstance(row, dict) and row.get("step") == step:
                        return root
                return None
            found = self._read(look)
        return found

    def compact_history(self, tail: int = REFLOG_TAIL, batch: int = 1 << 16) -> int:
        """gc's compaction of the reflog: drop the moves to snapshots that are no longer
        kept (no catalog row, no ref tip, tag or pin), except each ref's `tail` latest
        moves (a short audit trail; recover also reads the last one). The moves to kept
        snapshots stay with their sequence numbers, so publication_order() (keep_last)
        is unchanged for them; steps-index entries of snapshots without a catalog row
        go too. Runs in transactions of at most `batch` deletions (each re-reads what is
        kept); returns the number of records removed."""
        removed = 0
        while True:
            n = self._write(lambda t: _compact_some(t, tail, batch))
            removed += n
            if n < batch:
                return removed

    def reflog(self, name: str) -> list[ReflogEntry]:
        """Every move of `name`, oldest first."""
        key = name.encode() + b"\0"

        def txn(t):
            out = []
            for _k, v in t.items("reflog", key):
                out.append(ReflogEntry(name, *decode_reflog(v, name)))
            return out

        return self._read(txn)


def key_name(k: bytes, what: str) -> str:
    try:
        return k.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{what} key is not UTF-8: {k[:40]!r}") from None


def append_reflog(t: Txn, key: bytes, old: bytes | None, new: bytes, message: str, op: str,
                   catalog_row: dict | None) -> None:
    seq_raw = t.get("meta", b"reflog_seq")
    if seq_raw is not None and len(seq_raw) != _SEQ.size:
        raise FormatError("malformed reflog sequence record")
    seq = _SEQ.unpack(seq_raw)[0] + 1 if seq_raw else 1
    t.put("meta", b"reflog_seq", _SEQ.pack(seq))
    t.put("reflog", key + b"\0" + _SEQ.pack(seq), encode_reflog(old, new, message, t.wall(), op))
    if op == "move":
        _index_step(t, key, new, seq, catalog_row)
    if seq_raw is None or t.get("meta", _STEPS_MARK) == _SEQ.pack(seq - 1):
        t.put("meta", _STEPS_MARK, _SEQ.pack(seq))  # the index still covers every move


def _step_prefix(name_key: bytes, step: int) -> bytes:
    return name_key + b"\0" + str(int(step)).encode() + b"\0"


def _row_step(t: Txn, new: bytes, catalog_row: dict | None) -> int | None:
    """The step of snapshot `new` (from the row being written, else its stored row);
    None if unknown. Never raises: the index is a cache, a move must not fail for it."""
    row = catalog_row
    if row is None:
        raw = t.get("catalog", new)
        if raw is None:
            return None
        try:
            row = decode_record(raw, "catalog")
        except FormatError:
            return None
    step = row.get("step") if isinstance(row, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _index_step(t: Txn, name_key: bytes, new: bytes, seq: int, catalog_row: dict | None) -> None:
    step = _row_step(t, new, catalog_row)
    if step is not None:
        t.put("steps", _step_prefix(name_key, step) + _SEQ.pack(seq), new)


def _seq_of(raw: bytes | None, what: str) -> int:
    if raw is None:
        return 0
    if len(raw) != _SEQ.size:
        raise FormatError(f"malformed {what} record")
    return _SEQ.unpack(raw)[0]


def _steps_complete(t: Txn) -> bool:
    seq = _seq_of(t.get("meta", b"reflog_seq"), "reflog sequence")
    return seq == 0 or t.get("meta", _STEPS_MARK) == _SEQ.pack(seq)


def split_reflog_key(k: bytes) -> tuple[bytes, int]:
    if len(k) < _SEQ.size + 2 or k[-_SEQ.size - 1] != 0:
        raise FormatError("malformed reflog key")
    return k[:-_SEQ.size - 1], _SEQ.unpack(k[-_SEQ.size:])[0]


def _rebuild_steps(t: Txn) -> None:
    """Index every move of the reflog (a table whose index does not cover every move:
    steps_seq behind the reflog's sequence)."""
    for k, v in t.items("reflog"):
        name_key, seq = split_reflog_key(k)
        rec = decode_reflog(v, "?")
        if rec[4] == "move":
            _index_step(t, name_key, rec[2], seq, None)
    t.put("meta", _STEPS_MARK, _SEQ.pack(_seq_of(t.get("meta", b"reflog_seq"), "reflog sequence")))


def _compact_some(t: Txn, tail: int, batch: int) -> int:
    catalog = {k for k, _ in t.items("catalog")}
    kept = catalog | {v for _, v in t.items("refs")} | {v for _, v in t.items("tags")} \
        | {k for k, _ in t.items("pins")}
    by_name: dict[bytes, list] = {}
    for k, v in t.items("reflog"):
        name_key, _seq = split_reflog_key(k)
        rec = decode_reflog(v, "?")
        by_name.setdefault(name_key, []).append((k, rec[2], rec[4]))
    # Removals stay: they are the audit trail of what users deleted, and recover reads them.
    doomed = [("reflog", k) for moves in by_name.values() for k, new, op in moves[:max(0, len(moves) - tail)]
              if new not in kept and op == "move"]
    doomed += [("steps", k) for k, root in t.items("steps") if root not in catalog]
    for table, k in doomed[:batch]:
        t.delete(table, k)
    return min(len(doomed), batch)
