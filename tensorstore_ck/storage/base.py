"""The BlockStore interface: immutable objects under one root.

Implementations may assume a key is never rewritten with different bytes
(keys are content addresses). Call order for a writer:

    put_if_absent(key, bufs)   ... any number, from any thread
    put_addressed(key, bufs)   (blocks, nodes, commits: the name is the content's hash)
    sync()                     every put before it is durable once it returns
    (only then may anything that references those keys be published)

A missing object is always reported as FileNotFoundError, whatever the
backend calls it; the layer above turns that into IntegrityError.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import BinaryIO, Callable, ClassVar, Iterator, Sequence

__all__ = ["BlockStore", "ObjectInfo", "DeadlinePassed", "Deadline", "check_deadline", "paged_list"]

# A deletion deadline: a callable giving the time.monotonic() value after which no
# delete request may start (a gc's lease, less the request timeout and a margin).
Deadline = Callable[[], float]


class DeadlinePassed(Exception):
    """A delete request was not started: the caller's deadline had passed. Not an
    OSError: nothing failed, the caller renews its lease and goes on (or stops)."""


def check_deadline(deadline: Deadline | None) -> None:
    if deadline is not None and time.monotonic() >= deadline():
        raise DeadlinePassed()


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    key: str
    size: int
    mtime: float


class BlockStore(ABC):
    supports_deletes: ClassVar[bool] = True
    # In-flight writes of backends that write a temp file and then link it (local disk):
    # they live under this prefix and are never objects.
    TEMP_PREFIX: ClassVar[str] = "tmp/"
    # A temp file holding a whole object that waits for the next sync() to be named
    # (put_addressed on local disks). A live writer names it within seconds; gc leaves
    # it PENDING_GRACE seconds longer than a partial one before it removes it.
    PENDING_SUFFIX: ClassVar[str] = ".pending"
    PENDING_GRACE: ClassVar[float] = 600.0
    # Objects are files on this host: a stat or a read of a few bytes costs no request
    # (Assets reads a reused object's header only where this holds).
    local: ClassVar[bool] = False
    # The longest one request may run before the client gives up on it (its timeouts):
    # a gc starts a delete only while its lease outlasts this. Local calls are
    # synchronous: once one returns, it is done.
    request_timeout: float = 1.0
    # list() comes in pages of keys in key order, one request each (object stores): a
    # caller holds one page at a time, and a retry of a page resumes after the last key
    # it got (RetryingStore). False: list() is one call (a local walk, fsspec's find).
    pages: ClassVar[bool] = False
    url: str

    @abstractmethod
    def get(self, key: str, max_bytes: int | None = None) -> bytes:
        """The whole object, or with `max_bytes` at most its first max_bytes bytes (a
        ranged read where the backend has one): a caller that accepts N bytes asks for
        N + 1 and knows an oversized object by its length without reading all of it.
        FileNotFoundError if absent; an OSError naming it if it cannot be read (local
        disks: anything but a regular file in its place)."""

    @abstractmethod
    def open_read(self, key: str, max_bytes: int | None = None) -> BinaryIO:
        """A readable binary file object (supports read and readinto). max_bytes: the
        caller reads no more than this (object stores fetch only that much, in one
        ranged GET; a local file is read as far as the caller reads)."""

    @abstractmethod
    def put_if_absent(self, key: str, bufs: Sequence) -> bool:
        """Store the concatenation of `bufs` under `key` unless it exists.

        Returns True if this call created the object. The object is never
        visible half-written; its bytes are durable before this returns, its
        name once sync() returns."""

    def put_addressed(self, key: str, bufs: Sequence) -> bool:
        """put_if_absent for an object whose key is the hash of its bytes, so that two
        writers of one key always write the same bytes. A backend may make it visible
        to other Store objects only at the next sync() (and then durable first, named
        second: never visible half-written, never named before its bytes are durable);
        this object's own reads and listings see it at once. True if this call wrote it (two racing
        writers may both say so). Not for anything whose creation must be exclusive
        (tags, markers): put_if_absent is."""
        return self.put_if_absent(key, bufs)

    def take_lost(self, keys: Sequence[str]) -> set[str]:
        """Of `keys`, those put_addressed said this object wrote but another writer named
        first (a backend that names its writes at sync() learns it then): call after the
        sync. Each is told once. A backend whose put_addressed is exclusive (one conditional
        write) loses none."""
        return set()

    @abstractmethod
    def exists(self, key: str) -> bool: ...

    @abstractmethod
    def size_of(self, key: str) -> int | None:
        """The stored size of `key` in bytes, None if absent: what exists() costs (one
        stat, one HEAD), with the size that answer carries anyway."""

    @abstractmethod
    def move(self, key: str, new_key: str, *, deadline: Deadline | None = None) -> bool:
        """Put the object `key` under `new_key` and remove it from `key`. False if `key`
        is absent. `new_key` must be a fresh name nothing else writes (the caller makes
        it unique). Never loses the bytes: local disks rename (atomic); object stores
        copy, then delete the original, so a crash in between leaves both names.
        deadline: the removal from `key` does not start after it (DeadlinePassed; the
        object then stays under `key`, and maybe under `new_key` too)."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key`; absent is not an error."""

    def delete_many(self, keys: Sequence[str], *, deadline: Deadline | None = None) -> None:
        """Remove every key (absent ones are not an error). Object stores override
        this with one batched request per up to 1000 keys. deadline: no request starts
        after it (DeadlinePassed; what was deleted stays deleted, the rest stays)."""
        for key in keys:
            check_deadline(deadline)
            self.delete(key)

    @abstractmethod
    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object whose key starts with `prefix` (a folder, ending in '/')."""

    def list_page(self, prefix: str, start_after: str | None = None) -> tuple[list[ObjectInfo], str | None]:
        """One page of list(prefix), where `pages` holds: objects whose keys sort after
        `start_after` (from the first when None), in key order, and the key to resume
        after (None: the listing is complete). One request: a retry repeats it as is."""
        raise NotImplementedError(f"{type(self).__name__} does not list in pages")

    def sync(self) -> None:
        """Make every completed put durable (directory entries included)."""

    def clock_now(self) -> float:
        """The storage's own clock (the one its objects' mtimes come from), read by
        writing a tiny probe object and looking at its mtime. Object ages must be
        measured on it: a gc host whose clock is off would otherwise take in-flight
        objects for old ones, or old ones for new."""
        import uuid
        key = f"{self.TEMP_PREFIX}clock-{uuid.uuid4().hex}/probe"
        self.put_if_absent(key, [b"clock probe"])
        try:
            found = [o.mtime for o in self.list(key.rsplit("/", 1)[0] + "/")]
        finally:
            self.delete(key)
        if not found or not found[0] > 0:
            raise OSError(f"{self.url}: the storage reports no modification time for a probe object")
        return found[0]

    def temp_files(self) -> Iterator[ObjectInfo]:
        """Leftover temp files of writes in flight (or of writers that died): partial
        writes (.partial) and whole objects waiting to be named (PENDING_SUFFIX)."""
        return (o for o in self.list(self.TEMP_PREFIX) if o.key.endswith((".partial", self.PENDING_SUFFIX)))

    def is_empty(self) -> bool:
        """True if nothing but temp files is stored (a creator killed mid-write leaves one)."""
        return next((o for o in self.list("") if not o.key.startswith(self.TEMP_PREFIX)), None) is None

    def close(self) -> None:
        pass


def paged_list(list_page: Callable[[str, str | None], tuple[list[ObjectInfo], str | None]],
               prefix: str) -> Iterator[ObjectInfo]:
    """list(prefix) as a stream of list_page(prefix, start_after) pages: one page held at
    a time, each asked for only once the one before has been consumed."""
    after = None
    while True:
        page, after = list_page(prefix, after)
        yield from page
        if after is None:
            return
