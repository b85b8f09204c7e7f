"""The RefTable interface, and its logic written once over a small
transactional key-value layer that LMDB and the in-memory twin both provide.

Sub-tables (each a sorted key-value space):

    refs      name                    -> root (32 bytes)
    reflog    name \\0 seq (u64 BE)    -> msgpack {t, old, new, msg}
    catalog   root                    -> msgpack row (job, ref, step, time, metrics, sizes, ...)
    tags      name                    -> root
    pins      root                    -> b""
    retention job                     -> msgpack Retention record
    gc        b"state"                -> msgpack {epoch, phase, owner, lease, clock, expires, ...}
    meta      key                     -> value (the reflog sequence counter, steps_seq, the store id,
                                         `rebuild`: a recover that has not finished)
    steps     name \0 step \0 seq      -> root (REF@STEP's index; step in decimal, seq as in reflog)

The steps index is written by compare_and_swap in the move's own transaction;
meta `steps_seq` says up to which reflog sequence number it covers every move,
so a table written (even partly) by code from before the index gets it rebuilt
once, on the first REF@STEP lookup. gc compacts the reflog and the index to
what is kept (compact_history).

Record codecs are in format/records.py. Every conditional operation reads and
writes inside one write transaction, so the check and the update cannot be
separated by another writer.
"""

from __future__ import annotations

import os
import socket
import struct
import time
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Iterator

from ..errors import (Fenced, FormatError, GcBusy, InvalidArgument, NotAStore, ReadOnlyStore, RebuildUnfinished,
                      RefConflict, RefNotFound, TsckError)
from ..format.records import (decode_catalog, decode_gc_state, decode_record, decode_reflog, encode_record,
                              encode_reflog)

__all__ = ["RefTable", "ReflogEntry", "Txn", "track_for_fork"]


TABLES = ("refs", "reflog", "catalog", "tags", "pins", "retention", "gc", "meta", "steps")
_SEQ = struct.Struct(">Q")
REFLOG_TAIL = 10          # moves of each ref that gc's compaction always leaves, kept or not
_STEPS_MARK = b"steps_seq"  # meta: the reflog sequence number up to which `steps` covers every move
_REBUILD = b"rebuild"       # meta: a recover began and none has finished since ({owner, started})
_INCOMPLETE = object()
_PRUNE_KEY = b"prune:"      # gc: a queued prune request of job <name> ({at, id})
RECOVERED = "recovered from storage"  # the reflog message of recover's ref moves


@dataclass(frozen=True, slots=True)
class ReflogEntry:
    name: str
    time: float
    old: bytes | None
    new: bytes
    message: str
    op: str = "move"   # "delete": the ref was removed; "forget": the snapshot `new` was dropped


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

    def clock(self) -> tuple[str, float]:
        """The ref table's lease clock, read inside the transaction: (clock id, seconds).
        Two readings compare only under one id. Every party that judges a gc's lease
        reads this clock, never its own: an embedded table's is its host's boot clock
        (one per boot; never steps), PostgreSQL's is the server's."""
        return host_clock()

    def wall(self) -> float:
        """The ref table's calendar clock (seconds since the epoch): commit times, and
        so retention's ages, are read from it."""
        return time.time()


def _boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or None
    except OSError:
        return None


_BOOT = _boot_id()


def host_clock() -> tuple[str, float]:
    """This host's monotonic clock across processes: CLOCK_BOOTTIME, named by the boot
    (a lease from an earlier boot is over, whatever its numbers say); elsewhere the wall
    clock, named by the host."""
    if _BOOT is not None and hasattr(time, "CLOCK_BOOTTIME"):
        return "boot:" + _BOOT, time.clock_gettime(time.CLOCK_BOOTTIME)
    return "wall:" + socket.gethostname(), time.time()


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

    # Opened read-only: every write transaction is refused (ReadOnlyStore) before it
    # starts; a backend that can also has the server or the file refuse them.
    read_only: bool = False

    def _refuse_write(self, where: str) -> None:
        if self.read_only:
            raise ReadOnlyStore(f"the ref table at {where} is opened read-only: nothing was written")

    def close(self) -> None:
        pass

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
                if not new and _empty(t) and t.get("meta", _REBUILD) is None:
                    # An empty table met for a store made before it: a lost (or emptied)
                    # table recreated, which lacks every snapshot until a recover finishes.
                    t.put("meta", _REBUILD, encode_record({"owner": None, "started": t.wall()}))
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
                         hold: str | None = None) -> None:
        """Point `name` at `new` if it now points at `expected` (None: absent), appending
        to the reflog and storing `catalog_row` for `new` in the same transaction;
        RefConflict(expected, actual) otherwise. fence: the gc epoch the writer saw before it decided which objects exist
        (None: unfenced). The move is refused with Fenced if a deletion phase
        started since, or is running. hold: the writer's gc_hold, released by the move."""
        key = name.encode()

        def txn(t: Txn):
            _check_fence(t, fence)
            if hold is not None:
                _drop_hold(t, hold)
            actual = t.get("refs", key)
            if actual != expected:
                raise RefConflict(name, _hex(expected), _hex(actual))
            if actual is None and t.get("tags", key) is not None:
                raise RefConflict(name, None, _hex(t.get("tags", key)), what="ref (a tag has this name)")
            t.put("refs", key, new)
            if catalog_row is not None:
                t.put("catalog", new, encode_record(catalog_row))
            _append_reflog(t, key, expected, new, message, "move", catalog_row)

        self._write(txn)

    def delete_ref(self, name: str, expected: bytes | None = None, *, message: str = "deleted") -> tuple[bytes, int]:
        """Remove ref `name` (RefConflict if `expected` is given and it points elsewhere;
        RefNotFound if there is no such ref), recording the removal in its reflog. In the
        same transaction the catalog rows of its history go, except those something else
        keeps (another ref's tip or history, a tag, a pin), so gc reclaims their objects.
        -> (the root it pointed at, catalog rows dropped). Needs no gc fence: it only
        shrinks what is kept, and a gc that already marked keeps more, never less."""
        key = name.encode()

        def txn(t: Txn):
            actual = t.get("refs", key)
            if actual is None:
                raise RefNotFound(f"no ref named {name!r}")
            if expected is not None and actual != expected:
                raise RefConflict(name, _hex(expected), _hex(actual))
            t.delete("refs", key)
            mine, others = set(), _protected(t)  # without this ref's tip
            live = {k for k, _ in t.items("refs")}
            for k, v in t.items("reflog"):
                name_key, _seq = _split_reflog_key(k)
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
            for k, _root in list(t.items("steps", key + b"\0")):  # REF@STEP names the ref no more
                t.delete("steps", k)
            dropped = 0
            for root in (mine | {actual}) - others:
                if t.get("catalog", root) is not None:
                    t.delete("catalog", root)
                    dropped += 1
            _append_reflog(t, key, actual, actual, message, "delete", None)
            return actual, dropped

        return self._write(txn)

    def forget(self, root: bytes, ref: str, *, message: str = "forgotten") -> None:
        """Drop the catalog row of snapshot `root` (of ref `ref`'s history), so gc reclaims
        what only it holds; recorded in `ref`'s reflog. Refused (InvalidArgument, naming
        what keeps it) while it is a ref's tip, a tag's target or pinned; RefNotFound if
        it has no catalog row."""
        key = ref.encode()

        def txn(t: Txn):
            if t.get("catalog", root) is None:
                raise RefNotFound(f"no kept snapshot {root.hex()[:16]}")
            why = [f"the tip of ref {_name(k, 'ref')!r}" for k, v in t.items("refs") if v == root]
            why += [f"the target of tag {_name(k, 'tag')!r}" for k, v in t.items("tags") if v == root]
            why += ["pinned"] if t.get("pins", root) is not None else []
            if why:
                raise InvalidArgument(f"snapshot {root.hex()[:16]} is {', '.join(why)}: move or delete the ref, "
                                      "untag or unpin it first")
            t.delete("catalog", root)
            _append_reflog(t, key, root, root, message, "forget", None)

        self._write(txn)

    def removed(self) -> tuple[dict[str, float], set[bytes]]:
        """What users removed that storage may still hold (recover must not bring it
        back): {ref: time of its removal} for refs whose last record is a removal and
        that do not exist, and the roots forgotten."""
        def txn(t):
            last: dict[bytes, tuple] = {}
            forgotten = set()
            for k, v in t.items("reflog"):
                name_key, _seq = _split_reflog_key(k)
                rec = decode_reflog(v, "?")
                last[name_key] = rec
                if rec[4] == "forget":
                    forgotten.add(rec[2])
            refs = {_name(k, "ref"): rec[0] for k, rec in last.items()
                    if rec[4] == "delete" and t.get("refs", k) is None}
            return refs, forgotten
        return self._read(txn)

    def list(self, prefix=""):
        return self._read(lambda t: [(_name(k, "ref"), v) for k, v in t.items("refs", prefix.encode())])

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

    def step_root(self, name: str, step: int) -> bytes | None:
        """The newest snapshot of `name`'s history at `step` that still has a catalog row
        (REF@STEP), from the steps index: a few reads, whatever the history's length.
        A table whose index does not cover every move (written before the index existed,
        or by such code since) gets it rebuilt first, once."""
        prefix = _step_prefix(name.encode(), step)

        def look(t):
            if not _steps_complete(t):
                return _INCOMPLETE
            best = None
            for _k, root in t.items("steps", prefix):  # ascending seq: the last one kept wins
                if t.get("catalog", root) is not None:
                    best = root
            return best

        found = self._read(look)
        if found is _INCOMPLETE:
            try:
                self._write(_rebuild_steps)
            except Exception:  # noqa: BLE001 - a table we cannot write (read-only): search the history
                for root, row in self.history(name) or []:
                    if isinstance(row, dict) and row.get("step") == step:
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

    def catalog_expire(self, roots: list[bytes], *, rules: dict | None = None,
                       served: dict[str, bytes] | None = None) -> list[bytes]:
        """Drop the catalog rows of `roots` that are, at that moment, no ref's tip,
        no tag's target and not pinned. Returns the roots dropped. rules: the retention
        rules the roots were chosen by; if they changed since (set_retention raced the
        gc), nothing is dropped: the next gc decides by the new rules. served: the
        prune requests (prune_requests()) whose jobs' rules chose `roots`; each is
        removed in the same transaction unless it was queued again since it was read."""
        def txn(t):
            if rules is not None and {_name(k, "retention"): decode_record(v, "retention")
                                      for k, v in t.items("retention")} != rules:
                return []
            protected = _protected(t)
            gone = []
            for r in roots:
                if r not in protected and t.get("catalog", r) is not None:
                    t.delete("catalog", r)
                    gone.append(r)
            for job, raw in (served or {}).items():
                key = _PRUNE_KEY + job.encode()
                if t.get("gc", key) == raw:
                    t.delete("gc", key)
            return gone
        return self._write(txn)

    # The queue of prunes that found the store busy (docs/ARCHITECTURE.md, "Many jobs
    # on one store"). A job whose prune cannot take the gc lock queues a request; the
    # prune or gc that holds the lock applies the rules of every queued job along with
    # its own and removes the requests it served in its expiry transaction. A request
    # read before the catalog is read covers every snapshot committed before it was
    # queued, which is what the job asked for.
    def prune_request(self, job: str) -> bytes:
        """Queue a prune of `job` (replacing one already queued) -> its token, for prune_pending."""
        token = os.urandom(8)

        def txn(t):
            t.put("gc", _PRUNE_KEY + job.encode(), encode_record({"at": t.wall(), "id": token}))
        self._write(txn)
        return token

    def prune_requests(self) -> dict[str, bytes]:
        """The queued prune requests: job -> the stored request (compared, never trusted, by
        catalog_expire). A key that is not UTF-8 is no job: left alone."""
        def txn(t):
            out = {}
            for k, v in t.items("gc", _PRUNE_KEY):
                try:
                    out[k[len(_PRUNE_KEY):].decode("utf-8")] = v
                except UnicodeDecodeError:
                    continue
            return out
        return self._read(txn)

    def prune_pending(self, job: str, token: bytes) -> bool:
        """Is the request `token` of `job` still queued (not yet served by a prune or gc)?"""
        def txn(t):
            raw = t.get("gc", _PRUNE_KEY + job.encode())
            if raw is None:
                return False
            try:
                rec = decode_record(raw, "prune request")
            except FormatError:
                return True  # unreadable: not known to be served
            return rec.get("id") == token if isinstance(rec, dict) else True
        return self._read(txn)

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

    def gc_state(self) -> dict:
        """The gc state, with `lease_left`: seconds the current gc's lease still runs on
        the table's clock (0.0 once it ran out; None when no gc holds the store)."""
        def txn(t):
            st = _gc_state(t)
            st["lease_left"] = None if st["phase"] == "idle" and st["epoch"] % 2 == 0 else _lease_left(t, st, None)
            return st
        return self._read(txn)

    # gc state machine: idle -> marking -> deleting -> idle. The epoch is odd exactly while
    # a deletion phase may be running (docs/ARCHITECTURE.md, "GC and concurrent writers").
    # A gc holds the store under a lease it declares (seconds) and renews; whether it ran
    # out is judged on the table's clock only, so no party's own clock or setting can
    # declare a live gc dead. `now` (a reading of the table's clock) is for tests.
    def gc_abandoned(self, owner: str) -> None:
        """A gc of this process that stopped and could not record its end (the table's
        disk was full, its server away): released at this handle's next chance
        (release_abandoned_gc) instead of holding the store until its lease runs out."""
        self.__dict__.setdefault("_abandoned_gcs", set()).add(owner)

    def release_abandoned_gc(self) -> None:
        """End the gcs of this process that gc_abandoned() recorded, if the table takes
        writes again; one that another party closed or took over is forgotten."""
        owners = self.__dict__.get("_abandoned_gcs")
        for owner in list(owners or ()):
            try:
                self.gc_finish(owner)
            except GcBusy:
                pass  # no longer ours: closed as stale, or another gc holds the store
            except TsckError:
                continue  # still failing: try again next time
            owners.discard(owner)

    def gc_begin(self, owner: str, *, lease: float, now: float | None = None, rebuilding_ok: bool = False,
                 what: str = "gc") -> dict:
        """Take the gc lock. RebuildUnfinished while a recover has not finished (the
        table may not list every snapshot: nothing may be deleted by reachability),
        unless rebuilding_ok (fsck --repair, which deletes nothing a snapshot reaches)."""
        if not (isinstance(lease, (int, float)) and 0 < lease < 1e7):
            raise ValueError(f"gc lease must be a positive number of seconds, got {lease!r}")
        self.release_abandoned_gc()

        def txn(t):
            if not rebuilding_ok:
                _refuse_if_rebuilding(t, what)
            st = _gc_state(t)
            if st["phase"] != "idle" or st["epoch"] % 2:
                left = _lease_left(t, st, now)
                if left > 0:
                    raise GcBusy(f"another gc ({st.get('owner')}) is {st['phase']}; its lease runs "
                                 f"{left:.1f}s more")
                if st["epoch"] % 2:  # a dead gc's deletion phase is over: close it
                    st["epoch"] += 1
            clock, tnow = _clock(t, now)
            st.update(phase="marking", owner=owner, lease=float(lease), clock=clock, expires=tnow + lease,
                      heartbeat=t.wall(), started=t.wall())
            t.put("gc", b"state", encode_record(st))
            return st
        return self._write(txn)

    # A rebuild in progress (docs/ARCHITECTURE.md, "recover under gc"). recover's first
    # transaction sets the mark, its last one clears it; while it is set no gc lock is
    # given for deleting, and the mark is set only while no live gc holds the lock (a
    # dead one's lock is closed, so it can never renew and go on). Both checks run
    # inside the transaction that acts, so a gc and a recover cannot overlap.
    def rebuild_begin(self, owner: str, *, now: float | None = None) -> dict | None:
        """Mark the table as being rebuilt by `owner` (recover), before anything is
        adopted. GcBusy while a gc (or prune, or fsck --repair) holds a live lease.
        -> the mark an earlier recover left unfinished, or None."""
        def txn(t):
            st = _gc_state(t)
            if st["phase"] != "idle" or st["epoch"] % 2:
                left = _lease_left(t, st, now)
                if left > 0:
                    raise GcBusy(f"a gc ({st.get('owner')}) is {st['phase']}; its lease runs {left:.1f}s more")
                # Its lease ran out: it deletes no more (it never deletes past its lease);
                # closing the lock makes its next renewal fail, so it cannot go on.
                if st["epoch"] % 2:
                    st["epoch"] += 1
                st.update(phase="idle", owner=None, aborted=t.wall())
                for k in ("clock", "expires"):
                    st.pop(k, None)
                t.put("gc", b"state", encode_record(st))
            prev = _rebuild_mark(t)
            t.put("meta", _REBUILD, encode_record({"owner": owner, "started": t.wall()}))
            return prev
        return self._write(txn)

    def rebuild_finish(self) -> None:
        """A recover finished: every complete commit in storage has its catalog row, so
        the table is complete again and gc may delete by it."""
        self._write(lambda t: t.delete("meta", _REBUILD))

    def rebuild_unfinished(self) -> dict | None:
        """The mark of a recover that began and has not finished ({owner, started}), or
        None (a table without it, including every table older code wrote, is complete)."""
        return self._read(_rebuild_mark)

    def _gc_owned(self, owner, now, phases, fn):
        def txn(t):
            st = _gc_state(t)
            if st.get("owner") != owner or st["phase"] not in phases:
                raise GcBusy(f"this gc lost the store's gc lock (state {st['phase']} held by {st.get('owner')})")
            # Renewing after the lease ran out is safe: nobody closed it (the owner and
            # phase are unchanged, and closing one is a write this transaction would see).
            clock, tnow = _clock(t, now)
            st.update(clock=clock, expires=tnow + float(st.get("lease", DEFAULT_LEASE)), heartbeat=t.wall())
            fn(st, clock, tnow)
            t.put("gc", b"state", encode_record(st))
            return st
        return self._write(txn)

    def gc_heartbeat(self, owner, *, now: float | None = None):
        """Renew the lease of `owner` (GcBusy if it lost the lock)."""
        return self._gc_owned(owner, now, ("marking", "deleting"), lambda st, clock, tnow: None)

    def gc_freeze(self, owner, *, now: float | None = None):
        """Open the deletion phase (epoch odd), unless a writer holds the store while it
        re-validates (gc_hold): then nothing changes but the lease's renewal, and the
        returned state says for how long at most (`held`, seconds) the gc should wait."""
        held = 0.0

        def fn(st, clock, tnow):
            nonlocal held
            held = 0.0  # a transaction the table retries runs fn again
            live = _live_holds(st, clock, tnow)
            if live:
                st["holds"] = live  # the expired ones go
                held = max(e for _c, e in live.values()) - tnow
                return
            st.pop("holds", None)
            st["phase"] = "deleting"
            st["epoch"] += 1  # odd: writers that commit from now on re-validate first
        st = dict(self._gc_owned(owner, now, ("marking",), fn))
        st["held"] = held
        return st

    # Liveness for writers (docs/ARCHITECTURE.md, "Writers are not starved"). A writer
    # whose move was fenced takes a hold in the transaction that finds the epoch even;
    # while a hold lives no deletion phase opens, so its re-validation and move go
    # through. Holds expire on the table's clock; the safety of the fence never depends
    # on them.
    def gc_hold(self, holder: str, *, seconds: float | None = None, now: float | None = None) -> int | None:
        """Take or renew `holder`'s hold for `seconds` (default HOLD_SECONDS) -> the epoch,
        the writer's new fence, if it is even; None while a deletion phase runs. The hold
        is recorded either way: one taken during a phase keeps the gc's next phase (a gc
        deletes in several) from opening until the writer has moved, so a writer that
        polls the epoch cannot miss the short gap between two phases."""
        seconds = HOLD_SECONDS if seconds is None else float(seconds)

        def txn(t):
            st = _gc_state(t)
            clock, tnow = _clock(t, now)
            live = _live_holds(st, clock, tnow)
            live[holder] = [clock, tnow + seconds]
            st["holds"] = live
            t.put("gc", b"state", encode_record(st))
            return None if st["epoch"] % 2 else st["epoch"]
        return self._write(txn)

    def gc_unhold(self, holder: str) -> None:
        """Release `holder`'s hold (a move with hold= releases it too)."""
        def txn(t):
            _drop_hold(t, holder)
        self._write(txn)

    def gc_thaw(self, owner, *, now: float | None = None):
        """Close `owner`'s deletion phase (epoch even) and keep the lock (phase "marking"):
        a gc deletes in several short phases, so a writer it fences waits for one
        phase, never for the whole sweep. The next gc_freeze opens the next phase."""
        def fn(st, _clock, _tnow):
            if st["epoch"] % 2:
                st["epoch"] += 1
            st["phase"] = "marking"
        return self._gc_owned(owner, now, ("deleting",), fn)

    def gc_finish(self, owner, *, now: float | None = None, **fields):
        def fn(st, _clock, _tnow):
            if st["epoch"] % 2:
                st["epoch"] += 1
            st.update(fields, phase="idle", owner=None)
            for k in ("clock", "expires"):
                st.pop(k, None)
        return self._gc_owned(owner, now, ("marking", "deleting"), fn)

    def gc_abort_stale(self, *, now: float | None = None):
        """Close a deletion phase whose gc's lease ran out (on the table's clock): a gc
        never deletes past its lease, so its epoch can be closed."""
        def txn(t):
            st = _gc_state(t)
            # Any odd epoch whose lease ran out is closed, whatever its phase says.
            if st["epoch"] % 2 and _lease_left(t, st, now) <= 0:
                st["epoch"] += 1
                st.update(phase="idle", owner=None, aborted=t.wall())
                for k in ("clock", "expires"):
                    st.pop(k, None)
                t.put("gc", b"state", encode_record(st))
            st["lease_left"] = None if st["epoch"] % 2 == 0 else _lease_left(t, st, now)
            return st
        return self._write(txn)


DEFAULT_LEASE = 120.0  # a state written without a lease (older code): its heartbeat's age on the wall clock

# -- the steps index and the compaction of the reflog ---------------------------------


def _protected(t: Txn) -> set[bytes]:
    return {v for _, v in t.items("refs")} | {v for _, v in t.items("tags")} | {k for k, _ in t.items("pins")}


def _append_reflog(t: Txn, key: bytes, old: bytes | None, new: bytes, message: str, op: str,
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


def _split_reflog_key(k: bytes) -> tuple[bytes, int]:
    if len(k) < _SEQ.size + 2 or k[-_SEQ.size - 1] != 0:
        raise FormatError("malformed reflog key")
    return k[:-_SEQ.size - 1], _SEQ.unpack(k[-_SEQ.size:])[0]


def _rebuild_steps(t: Txn) -> None:
    """Index every move of the reflog (a table from before the index, or one that
    older code wrote to since)."""
    for k, v in t.items("reflog"):
        name_key, seq = _split_reflog_key(k)
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
        name_key, _seq = _split_reflog_key(k)
        rec = decode_reflog(v, "?")
        by_name.setdefault(name_key, []).append((k, rec[2], rec[4]))
    # Removals stay: they are the audit trail of what users deleted, and recover reads them.
    doomed = [("reflog", k) for moves in by_name.values() for k, new, op in moves[:max(0, len(moves) - tail)]
              if new not in kept and op == "move"]
    doomed += [("steps", k) for k, root in t.items("steps") if root not in catalog]
    for table, k in doomed[:batch]:
        t.delete(table, k)
    return min(len(doomed), batch)


def _clock(t: Txn, now: float | None) -> tuple[str, float]:
    clock, tnow = t.clock()
    return clock, (tnow if now is None else now)


def _lease_left(t: Txn, st: dict, now: float | None) -> float:
    if "expires" not in st:  # written by a gc of an older version: wall-clock heartbeat
        return max(0.0, float(st.get("heartbeat", 0.0)) + DEFAULT_LEASE - (t.wall() if now is None else now))
    clock, tnow = _clock(t, now)
    if st.get("clock") != clock:
        return 0.0  # another boot of the table's host: that gc is gone
    return max(0.0, float(st["expires"]) - tnow)


HOLD_SECONDS = 30.0  # a writer's hold, renewed every HOLD_SECONDS / 4 while it re-validates


def _live_holds(st: dict, clock: str, tnow: float) -> dict:
    """The writers' holds that have not run out on the table's clock (one of another boot has)."""
    return {h: [c, e] for h, (c, e) in (st.get("holds") or {}).items() if c == clock and e > tnow}


def _drop_hold(t: Txn, holder: str) -> None:
    st = _gc_state(t)
    holds = st.get("holds") or {}
    if holder in holds:
        del holds[holder]
        t.put("gc", b"state", encode_record(st))


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


def _empty(t: Txn) -> bool:
    return not any(True for table in ("catalog", "refs", "tags", "reflog") for _ in t.items(table))


def _rebuild_mark(t: Txn) -> dict | None:
    raw = t.get("meta", _REBUILD)
    if raw is None:
        return None
    try:
        mark = decode_record(raw, "rebuild mark")
    except FormatError:
        return {"owner": "?", "started": None}  # unreadable: still a rebuild nobody finished
    owner = mark.get("owner")
    return {"owner": None if owner is None else str(owner), "started": mark.get("started")}


def rebuild_message(mark: dict, what: str = "gc") -> str:
    started = mark.get("started")
    when = (time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started))
            if isinstance(started, (int, float)) and not isinstance(started, bool) and 0 <= started < 1e11 else "?")
    if mark.get("owner") is None:
        return (f"{what} refused: this ref table was found empty ({when}) for a store made before it (a lost or "
                f"emptied table, or the wrong --refs / $TSCK_REFS?) and no `tsck recover` has finished on it "
                f"since; it may not list every snapshot. Run `tsck recover` first, then {what}; nothing was "
                f"deleted")
    return (f"{what} refused: the ref table is being rebuilt from storage by `tsck recover` (begun {when} by "
            f"{mark.get('owner', '?')}), or that recover stopped before it finished; until a recover finishes, "
            f"the table may not list every snapshot, so nothing may be deleted by it. Run `tsck recover` "
            f"again (or let the running one finish), then {what}; nothing was deleted")


def _refuse_if_rebuilding(t: Txn, what: str = "gc") -> None:
    mark = _rebuild_mark(t)
    if mark is not None:
        raise RebuildUnfinished(rebuild_message(mark, what))


def _gc_state(t: Txn) -> dict:
    return decode_gc_state(t.get("gc", b"state"))
