"""The RefTable interface, and its logic written once over a small
transactional key-value layer that LMDB and the in-memory twin both provide.

Sub-tables (each a sorted key-value space):

    refs      name                    -> root (32 bytes)
    reflog    name \\0 seq (u64 BE)    -> msgpack {t, old, new, msg}
    catalog   root                    -> msgpack row (job, ref, step, time, metrics, sizes, ...)
    tags      name                    -> root
    pins      root                    -> b""
    retention job                     -> msgpack Retention record
    gc        b"state"                -> msgpack {epoch, phase, owner, lease, clock, expires, proc, ...}
    meta      key                     -> value (the reflog sequence counter, steps_seq, the store id,
                                         `rebuild`: a recover that has not finished)
    steps     name \0 step \0 seq      -> root (REF@STEP's index; step in decimal, seq as in reflog)

A local tier's table (open_store(local=)) also keeps, in `meta`, its upload queue,
durable and evicted marks and collective parts: the tier's own table type,
TierTable (refs/tiertable.py lists its rows), over this table's transactions.

The reflog and the steps index (REF@STEP) are refs/history.py's part of RefTable;
the gc state (lock, lease, phases, holds, fences, prune queue, rebuild mark) is
refs/gcstate.py's. RefTable inherits
the two; this module holds the refs, catalog, tags, pins and retention rules, and
what a backend implements. Who uses which of its calls is declared in roles.py.

Record codecs are in format/records.py. Every conditional operation reads and
writes inside one write transaction, so the check and the update cannot be
separated by another writer.
"""

from __future__ import annotations

import os
import weakref
from abc import ABC, abstractmethod
from functools import cached_property
from typing import Callable

from ..errors import FormatError, InvalidArgument, NotAStore, ReadOnlyStore, RefConflict, RefNotFound
from ..format.records import decode_catalog, decode_record, decode_reflog, encode_record
from .gcstate import PRUNE_KEY, REBUILD_KEY, GcStateMachine, check_fence, check_kept, drop_hold
from .history import RefHistory, ReflogEntry, append_reflog, key_name, split_reflog_key
from .tiertable import PART0_KEY, TierTable, drop_row, note_spared, protected_roots
from .txn import Txn

__all__ = ["RefTable", "ReflogEntry", "Txn", "track_for_fork"]


_LOCATION = b"location:"

_LIVE: "weakref.WeakSet[RefTable]" = weakref.WeakSet()


def track_for_fork(table: "RefTable") -> None:
    """Keep `table` usable across os.fork() while it lives: a handle opened before a
    fork holds the parent's LMDB environment or database sessions (reusing either in
    the child is forbidden or corrupting) and locks that threads which do not exist
    in the child may hold. Before a fork, table._before_fork() (LMDB: wait for the
    transaction in flight, so none is half-done in the child); after it,
    table._after_fork_parent() in the parent and table._after_fork() in the child,
    which runs there with one thread before fork() returns; backends reopen lazily."""
    _LIVE.add(table)


def _each(method: str):
    def hook() -> None:
        for table in list(_LIVE):
            getattr(table, method)()
    return hook


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_each("_before_fork"), after_in_parent=_each("_after_fork_parent"),
                        after_in_child=_each("_after_fork"))


def _wrong_store(cur: bytes, store_id: str) -> NotAStore:
    return NotAStore(f"this ref table belongs to store {cur.decode(errors='replace')!r}, not to "
                     f"{store_id!r}: wrong --refs / $TSCK_REFS?")


def _hex(b: bytes | None) -> str | None:
    return b.hex() if b is not None else None


def _check_tag_free(t, name: str, key: bytes) -> None:
    """RefConflict if `name` is a tag or a ref already, or a deleted ref's (a tag's name
    is new or nothing)."""
    cur = t.get("tags", key)
    if cur is not None:
        raise RefConflict(name, None, _hex(cur), what="tag")
    ref = t.get("refs", key)
    if ref is not None:
        raise RefConflict(name, None, _hex(ref), what="tag (a ref has this name)")
    gone = deleted_root(t, key)
    if gone is not None:
        # A tag by that name would make the job's next put to the ref fail (a ref is
        # never created over a tag), and it is not how a deleted ref comes back.
        raise RefConflict(name, None, _hex(gone), what="tag (a deleted ref has this name)",
                          hint=f"bring the ref back with `tsck undelete STORE {name}` (Store.undelete), or "
                               "choose another tag name")


def deleted_root(t: Txn, key: bytes) -> bytes | None:
    """The root ref `key` pointed at when it was deleted, if its reflog's last move or
    removal is a removal (delete_ref); None otherwise (alive, moved since, never made)."""
    last = None
    for _k, v in t.items("reflog", key + b"\0"):
        rec = decode_reflog(v, "?")
        if rec[4] in ("move", "delete"):
            last = rec
    return last[2] if last is not None and last[4] == "delete" else None


class RefTable(RefHistory, GcStateMachine, ABC):
    """name -> root with compare-and-swap; reflog; catalog; tags; pins; retention rules;
    the gc state. The logic is written once, here and in the parts it inherits
    (RefHistory: refs/history.py; GcStateMachine: refs/gcstate.py); a backend implements
    only the small
    protocol below: run fn(txn) in one read or one write transaction (a Txn of four
    calls), and close. LMDB, PostgreSQL and the in-memory twin do exactly that."""

    @abstractmethod
    def _read(self, fn: Callable[[Txn], object]): ...
    @abstractmethod
    def _write(self, fn: Callable[[Txn], object]): ...

    # Opened read-only: every write transaction is refused (ReadOnlyStore) before it
    # starts; a backend that can also has the server or the file refuse them.
    read_only: bool = False

    def _refuse_write(self, where: str) -> None:
        if self.read_only:
            raise ReadOnlyStore(f"the ref table at {where} is opened read-only: nothing was written")

    def close(self) -> None:
        pass

    @cached_property
    def tier_rows(self) -> TierTable:
        """A local tier's own rows kept in this table (refs/tiertable.py): its upload
        queue, marks, parts and intents share this table's transactions with the catalog
        rows they describe. A table no tier uses has none, and answers empty."""
        return TierTable(self._read, self._write)

    # The marker of the store a tiered open found at a remote location (meta
    # `location:`): a new local tier is made from it without asking the remote (opener).
    # These live in the remote's table, whichever backend it is; a table serving several
    # stores (PostgreSQL) keeps them apart from every store's.
    def location_get(self, location: str) -> bytes | None:
        return self._read(lambda t: t.get("meta", _LOCATION + location.encode()))

    def location_put(self, location: str, marker: bytes) -> None:
        self._write(lambda t: t.put("meta", _LOCATION + location.encode(), bytes(marker)))

    def _before_fork(self) -> None:
        """Before os.fork() (see track_for_fork)."""

    def _after_fork_parent(self) -> None:
        """In the parent, after os.fork()."""

    def _after_fork(self) -> None:
        """In a forked child: drop what belongs to the parent."""

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
                if not new and _empty(t) and t.get("meta", REBUILD_KEY) is None:
                    # An empty table met for a store made before it: a lost (or emptied)
                    # table recreated, which lacks every snapshot until a recover finishes.
                    t.put("meta", REBUILD_KEY, encode_record({"owner": None, "started": t.wall()}))
            elif cur != want:
                raise _wrong_store(cur, store_id)
            if new:
                t.put("meta", b"born_with_store", b"1")

        if self.read_only:  # check only: a table that records no store is taken as it is
            cur = self._read(lambda t: t.get("meta", b"store_id"))
            if cur is not None and cur != want:
                raise _wrong_store(cur, store_id)
            return
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
                         catalog_row: dict | None = None, fence: int | None = None,
                         hold: str | None = None, part0: bytes | None = None, superseded=()) -> None:
        """Point `name` at `new` if it now points at `expected` (None: absent), appending
        to the reflog and storing `catalog_row` for `new` in the same transaction;
        RefConflict(expected, actual) otherwise. fence: the gc epoch the writer saw before it decided which objects exist
        (None: unfenced). The move is refused with Fenced if a deletion phase
        started since, or is running. hold: the writer's gc_hold, released by the move.
        part0: rank 0's tier, its own sub-tree of the collective snapshot `new`, marked in
        the same transaction (meta `part0:` root; unmarked, the tip would be walked whole).
        superseded: the earlier encodings of the same put (commits its lost races left): a
        catalog row a recover gave one meanwhile goes in the same transaction (recorded as a
        forget in the reflog), unless a ref, tag or pin keeps it, so the put is never two
        snapshots."""
        key = name.encode()

        def txn(t: Txn):
            check_fence(t, fence)
            if hold is not None:
                drop_hold(t, hold)
            actual = t.get("refs", key)
            if actual != expected:
                raise RefConflict(name, _hex(expected), _hex(actual))
            if actual is None and t.get("tags", key) is not None:
                raise RefConflict(name, None, _hex(t.get("tags", key)), what="ref (a tag has this name)")
            t.put("refs", key, new)
            if catalog_row is not None:
                t.put("catalog", new, encode_record(catalog_row))
                if part0 is not None:
                    t.put("meta", PART0_KEY + new, part0)
            append_reflog(t, key, expected, new, message, "move", catalog_row)
            stale = [r for r in superseded if r != new and t.get("catalog", r) is not None]
            if stale:
                kept = protected_roots(t)
                for r in stale:
                    if r not in kept:
                        drop_row(t, r)
                        append_reflog(t, key, r, r, f"an earlier encoding of the put that published {new.hex()[:16]}",
                                      "forget", None)

        self._write(txn)

    def delete_ref(self, name: str, expected: bytes | None = None, *, message: str = "deleted",
                   dry_run: bool = False, dropped: list | None = None) -> tuple[bytes, int]:
        """Remove ref `name` (RefConflict if `expected` is given and it points elsewhere;
        RefNotFound if there is no such ref), recording the removal in its reflog. In the
        same transaction the catalog rows of its history go, except those something else
        keeps (another ref's tip or history, a tag, a pin), so gc reclaims their objects.
        -> (the root it pointed at, catalog rows dropped; `dropped`, when given, gets their
        roots). Needs no gc fence: it only shrinks what is kept, and a gc that already
        marked keeps more, never less. dry_run: the same answer from a read transaction;
        nothing changes."""
        key = name.encode()

        def txn(t: Txn):
            actual = t.get("refs", key)
            if actual is None:
                raise RefNotFound(f"no ref named {name!r}")
            if expected is not None and actual != expected:
                raise RefConflict(name, _hex(expected), _hex(actual))
            # What else keeps a snapshot: the other refs' tips, tags, pins (and, below, histories).
            others = {v for k, v in t.items("refs") if k != key} | {v for _, v in t.items("tags")} \
                | {k for k, _ in t.items("pins")}
            mine = set()
            live = {k for k, _ in t.items("refs")} - {key}
            for k, v in t.items("reflog"):
                name_key, _seq = split_reflog_key(k)
                if name_key == key or name_key in live:  # a deleted ref's history keeps nothing
                    rec = decode_reflog(v, "?")
                    if rec[4] == "move":
                        (mine if name_key == key else others).add(rec[2])
            for root, raw in t.items("catalog"):  # rows of its commits its reflog lost (recover)
                try:
                    if decode_catalog(raw).get("ref") == name:
                        mine.add(root)
                except FormatError:
                    pass  # an odd row is fsck's business, not a reason to refuse the delete
            drop = [root for root in sorted((mine | {actual}) - others) if t.get("catalog", root) is not None]
            if dropped is not None:
                dropped[:] = drop
            if dry_run:
                return actual, len(drop)
            t.delete("refs", key)
            for k, _root in list(t.items("steps", key + b"\0")):  # REF@STEP names the ref no more
                t.delete("steps", k)
            for root in drop:
                drop_row(t, root)
            append_reflog(t, key, actual, actual, message, "delete", None)
            return actual, len(drop)

        return self._read(txn) if dry_run else self._write(txn)

    def deleted_ref_root(self, name: str) -> bytes | None:
        """The root ref `name` pointed at when delete_ref removed it; None unless the
        ref's last move or removal is that removal."""
        return self._read(lambda t: deleted_root(t, name.encode()))

    def undelete(self, name: str, root: bytes, row: dict, *, fence: int, message: str = "undeleted") -> None:
        """Create ref `name` again, on `root`, with `root`'s catalog row `row` when it has
        none, recorded as a move in its reflog: only while the ref is still deleted (its
        reflog ends with the removal; RefConflict if it exists again, or a tag took the
        name) and the gc epoch is still `fence` and even (Fenced otherwise), as
        tag_adopt: the caller found the snapshot whole under that epoch."""
        key = name.encode()

        def txn(t: Txn):
            check_fence(t, fence)
            cur = t.get("refs", key)
            if cur is not None:
                raise RefConflict(name, None, _hex(cur), hint="it exists again: undelete brings back a deleted "
                                                            "ref only (a put moves a live one)")
            tag = t.get("tags", key)
            if tag is not None:
                raise RefConflict(name, None, _hex(tag), what="ref (a tag has this name)")
            if deleted_root(t, key) is None:
                raise RefNotFound(f"ref {name!r} is not a deleted ref (its reflog does not end with its removal)")
            if t.get("catalog", root) is None:
                t.put("catalog", root, encode_record(row))
            t.put("refs", key, root)
            append_reflog(t, key, None, root, message, "move", None)

        self._write(txn)

    def forget(self, root: bytes, ref: str, *, message: str = "forgotten", dry_run: bool = False) -> None:
        """Drop the catalog row of snapshot `root` (of ref `ref`'s history), so gc reclaims
        what only it holds; recorded in `ref`'s reflog. Refused (InvalidArgument, naming
        what keeps it) while it is a ref's tip, a tag's target or pinned; RefNotFound if
        it has no catalog row. dry_run: the same checks in a read transaction; nothing changes."""
        key = ref.encode()

        def txn(t: Txn):
            if t.get("catalog", root) is None:
                raise RefNotFound(f"no kept snapshot {root.hex()[:16]}")
            why = [f"the tip of ref {key_name(k, 'ref')!r}" for k, v in t.items("refs") if v == root]
            why += [f"the target of tag {key_name(k, 'tag')!r}" for k, v in t.items("tags") if v == root]
            why += ["pinned"] if t.get("pins", root) is not None else []
            if why:
                raise InvalidArgument(f"snapshot {root.hex()[:16]} is {', '.join(why)}: move or delete the ref, "
                                      "untag or unpin it first")
            if dry_run:
                return
            drop_row(t, root)
            append_reflog(t, key, root, root, message, "forget", None)

        self._read(txn) if dry_run else self._write(txn)

    def list(self, prefix=""):
        return self._read(lambda t: [(key_name(k, "ref"), v) for k, v in t.items("refs", prefix.encode())])


    def catalog_get(self, root, *, checked: bool = True):
        """The catalog row of `root`, None if it has none; FormatError naming the root if
        the row is malformed. checked=False: any map the row holds, unchecked (gc reads
        the tree of a kept snapshot from it: keeping more is always safe)."""
        data = self._read(lambda t: t.get("catalog", root))
        if data is None:
            return None
        try:
            if not checked:
                return decode_record(data, "catalog")
            return decode_catalog(data)
        except FormatError as e:
            raise FormatError(f"catalog row of snapshot {root.hex()[:16]}: {e}") from None

    def catalog_has(self, root) -> bool:
        return self._read(lambda t: t.get("catalog", root)) is not None

    def catalog_which(self, roots) -> set[bytes]:
        """Which of `roots` have a catalog row (one transaction)."""
        roots = list(roots)
        return self._read(lambda t: {r for r in roots if t.get("catalog", r) is not None})

    def catalog_put(self, root: bytes, row: dict) -> None:
        self._write(lambda t: t.put("catalog", root, encode_record(row)))

    def catalog_iter(self, bad: list | None = None):
        """(root, row) of every catalog row. A malformed row raises FormatError naming its
        root, unless `bad` is given: then (root, error) goes there and the walk goes on
        (one odd row must not stop gc, fsck or du for every snapshot)."""
        rows = self._read(lambda t: list(t.items("catalog")))
        for k, v in rows:
            try:
                row = decode_catalog(v)
            except FormatError as e:
                err = FormatError(f"catalog row of snapshot {k.hex()[:16]}: {e}")
                if bad is None:
                    raise err from None
                bad.append((k, err))
                continue
            yield k, row

    def catalog_roots(self) -> set[bytes]:
        """Every root the catalog lists, its row unread (what gc must keep, even a row it
        cannot decode)."""
        return self._read(lambda t: {k for k, _ in t.items("catalog")})

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
            check_fence(t, fence)
            check_kept(t, root, fence)
            _check_tag_free(t, name, key)
            t.put("tags", key, root)

        self._write(txn)

    def tag_adopt(self, name: str, root: bytes, row: dict, *, fence: int) -> bool:
        """Tag `root`, a snapshot that may be kept no more (its ref deleted, it forgotten)
        but whose objects the caller found all present under the gc epoch `fence`: the
        tag and, if it has none, its catalog row `row` go in together, only while the
        epoch is still `fence` and even (Fenced otherwise): no deletion phase ran since
        the caller looked, and every later one re-marks what tags and the catalog keep.
        RefConflict as for tag_create. -> whether the catalog row was added."""
        key = name.encode()

        def txn(t):
            check_fence(t, fence)
            _check_tag_free(t, name, key)
            added = t.get("catalog", root) is None
            if added:
                t.put("catalog", root, encode_record(row))
            t.put("tags", key, root)
            return added

        return self._write(txn)

    def pin_adopt(self, root: bytes, row: dict, *, fence: int) -> bool:
        """Pin `root`, as tag_adopt tags it: the pin and, if it has none, its catalog row
        go in together, only while the gc epoch is still `fence` and even (Fenced
        otherwise). -> whether the catalog row was added."""
        def txn(t):
            check_fence(t, fence)
            added = t.get("catalog", root) is None
            if added:
                t.put("catalog", root, encode_record(row))
            t.put("pins", root, b"")
            return added

        return self._write(txn)

    def tags(self):
        return self._read(lambda t: [(key_name(k, "tag"), v) for k, v in t.items("tags")])

    def tag_delete(self, name: str) -> bytes:
        """Remove tag `name` (RefNotFound if there is none); its target."""
        key = name.encode()

        def txn(t):
            root = t.get("tags", key)
            if root is None:
                raise RefNotFound(f"no tag named {name!r}")
            t.delete("tags", key)
            return root

        return self._write(txn)

    def pin(self, root: bytes, *, fence: int | None = None) -> None:
        """fence: as for compare_and_swap (and, as for tag_create, RefNotFound if `root`
        is no longer kept)."""
        def txn(t):
            check_fence(t, fence)
            check_kept(t, root, fence)
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
        return {key_name(k, "retention"): decode_record(v, "retention") for k, v in rows}

    def catalog_expire(self, roots: list[bytes], *, rules: dict | None = None,
                       served: dict[str, bytes] | None = None) -> list[bytes]:
        """Drop the catalog rows of `roots` that are, at that moment, no ref's tip,
        no tag's target and not pinned. Returns the roots dropped. rules: the retention
        rules the roots were chosen by; if they changed since (set_retention raced the
        gc), nothing is dropped: the next gc decides by the new rules. served: the
        prune requests (prune_requests()) whose jobs' rules chose `roots`; each is
        removed in the same transaction unless it was queued again since it was read."""
        def txn(t):
            if rules is not None and {key_name(k, "retention"): decode_record(v, "retention")
                                      for k, v in t.items("retention")} != rules:
                return []
            protected = protected_roots(t)
            gone = []
            for r in roots:
                if r not in protected and t.get("catalog", r) is not None:
                    drop_row(t, r)
                    gone.append(r)
            note_spared(t, set(roots) & protected)
            for job, raw in (served or {}).items():
                key = PRUNE_KEY + job.encode()
                if t.get("gc", key) == raw:
                    t.delete("gc", key)
            return gone
        return self._write(txn)


    def catalog_put_if_absent(self, root, row):
        def txn(t):
            if t.get("catalog", root) is not None:
                return False
            t.put("catalog", root, encode_record(row))
            return True
        return self._write(txn)

    def wall_now(self) -> float:
        """The table's calendar clock (what commit times are stamped with)."""
        return self._read(lambda t: t.wall())


def _empty(t: Txn) -> bool:
    return not any(True for table in ("catalog", "refs", "tags", "reflog") for _ in t.items(table))

