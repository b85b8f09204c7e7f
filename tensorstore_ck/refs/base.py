"""The RefTable interface, and its logic written once over a small
transactional key-value layer that LMDB and the in-memory twin both provide.

Sub-tables (each a sorted key-value space):

    refs      name                    -> root (32 bytes)
    reflog    name \\0 seq (u64 BE)    -> msgpack {t, old, new, msg}
    catalog   root                    -> msgpack row (job, ref, step, time, metrics, sizes, ...)
    tags      name                    -> root
    pins      root                    -> b""
    retention job                     -> msgpack Retention record
    gc        b"state"                -> msgpack {epoch, phase, owner, heartbeat, ...}
    meta      key                     -> value (the reflog sequence counter)

Record codecs are in format/records.py. Every conditional operation reads and
writes inside one write transaction, so the check and the update cannot be
separated by another writer.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterator

from ..errors import Fenced, FormatError, GcBusy, NotAStore, RefConflict, RefNotFound
from ..format.records import (decode_catalog, decode_gc_state, decode_record, decode_reflog, encode_record,
                              encode_reflog)

__all__ = ["RefTable", "ReflogEntry", "Txn"]


TABLES = ("refs", "reflog", "catalog", "tags", "pins", "retention", "gc", "meta")
_SEQ = struct.Struct(">Q")


@dataclass(frozen=True, slots=True)
class ReflogEntry:
    name: str
    time: float
    old: bytes | None
    new: bytes
    message: str


class Txn(ABC):
    @abstractmethod
    def get(self, table: str, key: bytes) -> bytes | None: ...
    @abstractmethod
    def put(self, table: str, key: bytes, value: bytes) -> None: ...
    @abstractmethod
    def delete(self, table: str, key: bytes) -> None: ...
    @abstractmethod
    def items(self, table: str, prefix: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """Sorted by key."""


def _hex(b: bytes | None) -> str | None:
    return b.hex() if b is not None else None


def _name(k: bytes, what: str) -> str:
    try:
        return k.decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{what} key is not UTF-8: {k[:40]!r}") from None


class RefTable(ABC):
    """name -> root with compare-and-swap; reflog; catalog; tags; pins; retention rules;
    the gc state. The logic is written once, here; a backend implements only the small
    protocol below: run fn(txn) in one read or one write transaction (a Txn of four
    calls), and close. LMDB, PostgreSQL and the in-memory twin do exactly that."""

    @abstractmethod
    def _read(self, fn: Callable[[Txn], object]): ...
    @abstractmethod
    def _write(self, fn: Callable[[Txn], object]): ...

    def close(self) -> None:
        pass

    def bind_store(self, store_id: str, *, new: bool = False) -> None:
        """Record the id of the store this table serves, or refuse (NotAStore) if it
        already serves another: a ref table of store A used for store B would make gc
        delete everything B holds. new: the table was made with its store (not rebuilt
        by recover, not an empty namespace met later): only such an empty table may be
        trusted by gc to mean "nothing is kept"."""
        want = store_id.encode()

        def txn(t: Txn):
            cur = t.get("meta", b"store_id")
            if cur is None:
                t.put("meta", b"store_id", want)
            elif cur != want:
                raise NotAStore(f"this ref table belongs to store {cur.decode(errors='replace')!r}, not to "
                                f"{store_id!r}: wrong --refs / $TSCK_REFS?")
            if new:
                t.put("meta", b"born_with_store", b"1")

        if new or self._read(lambda t: t.get("meta", b"store_id")) != want:
            self._write(txn)

    def born_with_store(self) -> bool:
        return self._read(lambda t: t.get("meta", b"born_with_store")) is not None

    def bound_store(self) -> str | None:
        v = self._read(lambda t: t.get("meta", b"store_id"))
        return None if v is None else v.decode(errors="replace")

    # -- refs -------------------------------------------------------------------------
    def get(self, name: str) -> bytes:
        root = self.get_or_none(name)
        if root is None:
            raise RefNotFound(f"no ref named {name!r}")
        return root

    def get_or_none(self, name: str) -> bytes | None:
        return self._read(lambda t: t.get("refs", name.encode()))

    def compare_and_swap(self, name: str, expected: bytes | None, new: bytes, *, message: str,
                         catalog_row: dict | None = None, fence: int | None = None) -> None:
        """Point `name` at `new` if it now points at `expected` (None: absent), appending
        to the reflog and storing `catalog_row` for `new` in the same transaction;
        RefConflict(expected, actual) otherwise. fence: the gc epoch the writer saw before it decided which objects exist
        (None: unfenced). The move is refused with Fenced if a deletion phase
        started since, or is running."""
        key = name.encode()

        def txn(t: Txn):
            _check_fence(t, fence)
            actual = t.get("refs", key)
            if actual != expected:
                raise RefConflict(name, _hex(expected), _hex(actual))
            if actual is None and t.get("tags", key) is not None:
                raise RefConflict(name, None, _hex(t.get("tags", key)), what="ref (a tag has this name)")
            t.put("refs", key, new)
            seq_raw = t.get("meta", b"reflog_seq")
            if seq_raw is not None and len(seq_raw) != _SEQ.size:
                raise FormatError("malformed reflog sequence record")
            seq = _SEQ.unpack(seq_raw)[0] + 1 if seq_raw else 1
            t.put("meta", b"reflog_seq", _SEQ.pack(seq))
            t.put("reflog", key + b"\0" + _SEQ.pack(seq), encode_reflog(expected, new, message))
            if catalog_row is not None:
                t.put("catalog", new, encode_record(catalog_row))

        self._write(txn)

    def list(self, prefix=""):
        return self._read(lambda t: [(_name(k, "ref"), v) for k, v in t.items("refs", prefix.encode())])

    def publication_order(self) -> dict[bytes, int]:
        """root -> the sequence number of the latest ref move that published it (one
        counter for the whole table, so it orders snapshots across refs)."""
        def txn(t):
            out = {}
            for k, v in t.items("reflog"):
                if len(k) < _SEQ.size + 1:
                    raise FormatError("malformed reflog key")
                seq = _SEQ.unpack(k[-_SEQ.size:])[0]
                _t, _old, new, _msg = decode_reflog(v, "?")
                if seq > out.get(new, -1):
                    out[new] = seq
            return out
        return self._read(txn)

    def reflog(self, name: str) -> list[ReflogEntry]:
        """Every move of `name`, oldest first."""
        key = name.encode() + b"\0"

        def txn(t):
            out = []
            for _k, v in t.items("reflog", key):
                out.append(ReflogEntry(name, *decode_reflog(v, name)))
            return out

        return self._read(txn)

    def catalog_get(self, root):
        data = self._read(lambda t: t.get("catalog", root))
        return None if data is None else decode_catalog(data)

    def catalog_put(self, root: bytes, row: dict) -> None:
        self._write(lambda t: t.put("catalog", root, encode_record(row)))

    def catalog_iter(self):
        rows = self._read(lambda t: list(t.items("catalog")))
        for k, v in rows:
            yield k, decode_catalog(v)

    def catalog_prefix(self, prefix):
        return self._read(lambda t: [k for k, _ in t.items("catalog", prefix)])

    def tag_get(self, name):
        return self._read(lambda t: t.get("tags", name.encode()))

    def tag_create(self, name: str, root: bytes, *, fence: int | None = None) -> None:
        """Tags are immutable: RefConflict if `name` exists as a tag or a ref. fence: as for
        compare_and_swap (Fenced if a gc deletion phase started since, or is running); with
        a fence, RefNotFound if `root` is no longer kept (a gc's expiry dropped its catalog
        row after the caller resolved it: the epoch moves only when deletion starts)."""
        key = name.encode()

        def txn(t):
            _check_fence(t, fence)
            _check_kept(t, root, fence)
            cur = t.get("tags", key)
            if cur is not None:
                raise RefConflict(name, None, _hex(cur), what="tag")
            ref = t.get("refs", key)
            if ref is not None:
                raise RefConflict(name, None, _hex(ref), what="tag (a ref has this name)")
            t.put("tags", key, root)

        self._write(txn)

    def tags(self):
        return self._read(lambda t: [(_name(k, "tag"), v) for k, v in t.items("tags")])

    def pin(self, root: bytes, *, fence: int | None = None) -> None:
        """fence: as for compare_and_swap (and, as for tag_create, RefNotFound if `root`
        is no longer kept)."""
        def txn(t):
            _check_fence(t, fence)
            _check_kept(t, root, fence)
            t.put("pins", root, b"")
        self._write(txn)

    def unpin(self, root):
        self._write(lambda t: t.delete("pins", root))

    def pins(self):
        return self._read(lambda t: {k for k, _ in t.items("pins")})

    def retention_set(self, job, rule):
        if rule is None:
            self._write(lambda t: t.delete("retention", job.encode()))
        else:
            self._write(lambda t: t.put("retention", job.encode(), encode_record(rule)))

    def retention_all(self):
        rows = self._read(lambda t: list(t.items("retention")))
        return {_name(k, "retention"): decode_record(v, "retention") for k, v in rows}

    def catalog_expire(self, roots: list[bytes], *, rules: dict | None = None) -> list[bytes]:
        """Drop the catalog rows of `roots` that are, at that moment, no ref's tip,
        no tag's target and not pinned. Returns the roots dropped. rules: the retention
        rules the roots were chosen by; if they changed since (set_retention raced the
        gc), nothing is dropped: the next gc decides by the new rules."""
        def txn(t):
            if rules is not None and {_name(k, "retention"): decode_record(v, "retention")
                                      for k, v in t.items("retention")} != rules:
                return []
            protected = {v for _, v in t.items("refs")} | {v for _, v in t.items("tags")} \
                | {k for k, _ in t.items("pins")}
            gone = []
            for r in roots:
                if r not in protected and t.get("catalog", r) is not None:
                    t.delete("catalog", r)
                    gone.append(r)
            return gone
        return self._write(txn)

    def catalog_put_if_absent(self, root, row):
        def txn(t):
            if t.get("catalog", root) is not None:
                return False
            t.put("catalog", root, encode_record(row))
            return True
        return self._write(txn)

    def gc_state(self):
        return self._read(_gc_state)

    # gc state machine: idle -> marking -> deleting -> idle. The epoch is odd exactly while
    # a deletion phase may be running (docs/ARCHITECTURE.md, "GC and concurrent writers").
    def gc_begin(self, owner: str, *, now: float, stale_after: float) -> dict:
        def txn(t):
            st = _gc_state(t)
            if st["phase"] != "idle":
                age = now - float(st.get("heartbeat", 0.0))
                if age < stale_after:
                    raise GcBusy(f"another gc ({st.get('owner')}) is {st['phase']}; heartbeat {age:.1f}s ago")
                if st["epoch"] % 2:  # a dead gc's deletion phase is over: close it
                    st["epoch"] += 1
            st.update(phase="marking", owner=owner, heartbeat=now, started=now)
            t.put("gc", b"state", encode_record(st))
            return st
        return self._write(txn)

    def _gc_owned(self, owner, now, phases, fn):
        def txn(t):
            st = _gc_state(t)
            if st.get("owner") != owner or st["phase"] not in phases:
                raise GcBusy(f"this gc lost the store's gc lock (state {st['phase']} held by {st.get('owner')})")
            st["heartbeat"] = now
            fn(st)
            t.put("gc", b"state", encode_record(st))
            return st
        return self._write(txn)

    def gc_heartbeat(self, owner, *, now):
        return self._gc_owned(owner, now, ("marking", "deleting"), lambda st: None)

    def gc_freeze(self, owner, *, now):
        def fn(st):
            st["phase"] = "deleting"
            st["epoch"] += 1  # odd: writers that commit from now on re-validate first
        return self._gc_owned(owner, now, ("marking",), fn)

    def gc_finish(self, owner, *, now, **fields):
        def fn(st):
            if st["epoch"] % 2:
                st["epoch"] += 1
            st.update(fields, phase="idle", owner=None)
        return self._gc_owned(owner, now, ("marking", "deleting"), fn)

    def gc_abort_stale(self, *, now, stale_after):
        """Writers call this when a deletion phase's owner stopped beating: a dead gc
        deletes nothing more, so its epoch can be closed."""
        def txn(t):
            st = _gc_state(t)
            # Any odd epoch whose owner stopped beating is closed, whatever its phase says.
            if st["epoch"] % 2 and now - float(st.get("heartbeat", 0.0)) >= stale_after:
                st["epoch"] += 1
                st.update(phase="idle", owner=None, aborted=now)
                t.put("gc", b"state", encode_record(st))
            return st
        return self._write(txn)


def _check_fence(t: Txn, fence: int | None) -> None:
    if fence is not None:
        epoch = _gc_state(t).get("epoch", 0)
        if epoch != fence or epoch % 2:
            raise Fenced(f"gc deletion epoch moved from {fence} to {epoch}")


def _check_kept(t: Txn, root: bytes, fence: int | None) -> None:
    """A fenced tag or pin names a snapshot that is kept now: it has a catalog row or is a
    ref's tip. Checked in the transaction that inserts the row, so a gc's expiry either
    saw the tag or pin (and kept the snapshot) or happened before it (and this refuses)."""
    if fence is None or t.get("catalog", root) is not None:
        return
    if any(v == root for _k, v in t.items("refs")):
        return
    raise RefNotFound(f"snapshot {root.hex()[:16]} is no longer kept (retention dropped it meanwhile)")


def _gc_state(t: Txn) -> dict:
    return decode_gc_state(t.get("gc", b"state"))
