"""Typed object I/O: blocks, manifest nodes, commits and tag objects, verified on read.

The only module that knows storage keys: nothing above it builds or parses
one; nothing below it knows what a manifest is. Keys are ``blocks/ab/<hex>``,
``nodes/ab/<hex>``, ``commits/ab/<hex>`` (<hex>: the BLAKE3-256 of the raw
payload, ab: its first two digits) and ``tags/<hex of the tag name>``. A
listed name that is not exactly such a key is a *stray*: reported, never
parsed further, never deleted.

Every read is bounded before it starts: a block by the length its manifest
declares, a node or commit by the size its header declares (at most
manifest.MAX_NODE_BYTES), the store marker by MAX_MARKER_BYTES, a tag object by
records.MAX_TAG_OBJECT. An object that is there but cannot be read (EIO; on
local disks anything but a regular file under its name) is an UnreadableObject
naming it.

Damaged objects are moved aside, never deleted, to
``quarantine/<kind>/<hex>.<UTC time>-<random>``: out of the object namespace
(nothing lists, reads or deletes them as objects), so the next put of that
content writes it again under its address and heals every snapshot that uses it.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from typing import Iterator

import blake3
import numpy as np

from ..errors import FormatError, IntegrityError, SnapshotAborted, TsckError, UnreadableObject, unreadable
from ..format import frame
from ..format.manifest import MAX_NODE_BYTES
from ..format.records import MAX_TAG_OBJECT, decode_tag, encode_tag
from ..format.tree import MAX_BLOCK_SIZE
from ..storage.base import BlockStore
from .partindex import PartIndex
from .presence import Presence
from .roles import WrittenListener

__all__ = ["Assets", "PutResult", "Listed", "KINDS", "STORE_MARKER", "MAX_MARKER_BYTES", "read_marker", "create_marker",
           "holds_snapshots", "CODEC_MODES", "block_key", "node_key", "commit_key", "tag_key", "KIND_PREFIX",
           "QUARANTINE_PREFIX", "Aside"]

KINDS = ("commits", "nodes", "blocks")  # gc's deletion order: a kill leaves no commit without its tree
_OBJECT_KEY = re.compile(r"(commits|nodes|blocks)/([0-9a-f]{2})/(\2[0-9a-f]{62})\Z")
_TAG_KEY = re.compile(r"tags/((?:[0-9a-f]{2})+)\Z")
QUARANTINE_PREFIX = "quarantine/"
_ASIDE_KEY = re.compile(r"quarantine/(commits|nodes|blocks)/([0-9a-f]{64})\.[0-9TZ]+-[0-9a-f]+\Z")

KIND_PREFIX = {frame.KIND_BLOCK: "blocks", frame.KIND_NODE: "nodes", frame.KIND_COMMIT: "commits"}
# An object kind's name -> its frame kind byte (docs/FORMAT.md).
FRAME_KIND = {"block": frame.KIND_BLOCK, "node": frame.KIND_NODE, "commit": frame.KIND_COMMIT}


def _key(prefix: str, d: bytes) -> str:
    h = d.hex()
    return f"{prefix}/{h[:2]}/{h}"


def block_key(d: bytes) -> str:
    return _key("blocks", d)


def node_key(d: bytes) -> str:
    return _key("nodes", d)


def commit_key(d: bytes) -> str:
    return _key("commits", d)


def aside_key(kind: str, d: bytes) -> str:
    """A fresh quarantine name for object `d` of `kind`: the time says when it was moved,
    the random part keeps two moves of one address (damaged twice) apart."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{QUARANTINE_PREFIX}{kind}/{d.hex()}.{stamp}-{uuid.uuid4().hex[:12]}"


def tag_key(name: str) -> str:
    # hex: a tag name never becomes a path (and "a" and "a/b" cannot collide as file and folder)
    return "tags/" + name.encode("utf-8").hex()


STORE_MARKER = "tsck.json"  # the store's config object (opener.py reads and creates it)
MAX_MARKER_BYTES = 65536     # a marker is a few hundred bytes; a longer one is not ours
# The most any one stored object may hold: a frame header and the largest block or node.
_MAX_OBJECT = frame.HEADER_SIZE + max(MAX_NODE_BYTES, MAX_BLOCK_SIZE)


def read_marker(storage: BlockStore) -> bytes | None:
    """The marker's bytes (at most MAX_MARKER_BYTES + 1: longer is not a marker), None if absent."""
    try:
        return storage.get(STORE_MARKER, MAX_MARKER_BYTES + 1)
    except FileNotFoundError:
        return None


def create_marker(storage: BlockStore, data: bytes) -> bool:
    """Exclusive create, durable on return: concurrent creators agree on one marker."""
    created = storage.put_if_absent(STORE_MARKER, [data])
    storage.sync()
    return created


def holds_snapshots(storage: BlockStore) -> bool:
    """Whether any commit object is stored (a store that was only half created holds none)."""
    return next(iter(storage.list("commits/")), None) is not None


@dataclass(frozen=True, slots=True)
class Listed:
    """One stored object of a kind, as listed."""
    kind: str
    digest: bytes
    size: int
    mtime: float


@dataclass(frozen=True, slots=True)
class Aside:
    """One object kept under quarantine/ (kind and digest None for a name not made here)."""
    key: str
    kind: str | None
    digest: bytes | None
    size: int
    mtime: float


@dataclass(frozen=True, slots=True)
class PutResult:
    digest: bytes
    new: bool
    raw_len: int
    counted: bool = True  # False: only hashed here (another rank owns the block)
    stored: int = 0       # bytes this call wrote to storage (the frame), 0 when not new


# Codec choices of a writer (Assets(codecs=...)); see frame.encode_payload. Codec 2 (byte
# shuffle then lz4) is read, never written: "float" codes floats better.
CODEC_MODES = ("none", "lz4", "float")


# A worker thread keeps its scratch buffer between blocks up to this size (a few
# workers x the 4 MiB default block); a bigger block gets a buffer of its own.
SCRATCH_KEEP = 64 << 20
FRAME_KEEP = (64 << 20) + 4096  # an upload thread keeps a buffer of a default pack's frame


class Assets:
    def __init__(self, storage: BlockStore, *, codecs: str = "lz4", epoch_now=None):
        """codecs: what blocks may be written with: "none" (raw), "lz4", "float" (the
        float codec or lz4, whichever a probe finds smaller); each only where it shrinks
        the block (open_store translates its compression= into one). Reading never
        depends on it. epoch_now: a callable returning the ref table's current gc
        deletion epoch (None: no ref table)."""
        if codecs not in CODEC_MODES:
            raise ValueError(f"codecs must be one of {CODEC_MODES}, got {codecs!r}")
        self.storage = storage
        self.codecs = codecs
        self._local = threading.local()
        self.presence = Presence(KIND_PREFIX)
        # The observer of new writes (on_written), None until one registers.
        self._written: WrittenListener | None = None
        # The current gc deletion epoch (read from the ref table), for readers that consult
        # `presence`; None: no ref table, the record is never used to read.
        self.epoch_now = epoch_now
        # The parts of packs stored here, by the BLAKE3 of their bytes: a packed tensor whose
        # bytes one holds names that part instead of being written again (packparts.py).
        self.parts = PartIndex()

    def on_written(self, listener: WrittenListener) -> None:
        """Observe writes: listener(kind, digest, bufs, itemsize) for each block and node written new
        from now on, as it is written (roles.WrittenListener; commits are not told). One
        listener, a later call replaces it: a local tier's uploader (Uploader.tee), which
        sends them from memory. An observer registered after construction, not a
        constructor argument, because the uploader is built over the Core whose Assets it
        observes. It must not block or raise: it runs inside the writer's put."""
        self._written = listener

    def _scratch(self, n: int) -> np.ndarray:
        """This thread's private buffer of n bytes. A thread runs one block job at a
        time and a job is done with the buffer when it returns, so one per thread
        serves both reads and writes: memory stays at (workers x block size)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < n:
            buf = np.empty(n, dtype=np.uint8)
            if n <= SCRATCH_KEEP:
                self._local.buf = buf
        return buf[:n]

    # -- writing -------------------------------------------------------------
    def _put(self, kind: int, raw, itemsize: int = 1, d: bytes | None = None, private: bool = True,
             fence: int | None = None) -> PutResult:
        mv = memoryview(raw).cast("B")
        if not private:
            # Memory someone else may change while we work (a tensor a training thread
            # updates during a blocking put): copy it once, then hash, frame and write
            # only the copy, so what lands under an address is exactly what was hashed.
            buf = self._scratch(mv.nbytes)
            np.copyto(buf, np.frombuffer(mv, dtype=np.uint8))  # releases the GIL
            mv = memoryview(buf)
            got = blake3.blake3(mv).digest()
            if d is not None and got != d:
                raise SnapshotAborted(f"the bytes of a block changed after they were hashed (now {got.hex()[:16]}, "
                                      f"hashed {d.hex()[:16]}): the state was modified during the snapshot; "
                                      "nothing was published, take it again")
            d = got
        elif d is None:
            d = blake3.blake3(mv).digest()
        # fence: the gc epoch the caller read before this put looked at storage; with it,
        # an object seen under that epoch is reused without a request (Presence).
        if self.presence.known(kind, d, fence):
            return PutResult(d, False, mv.nbytes)
        key = _key(KIND_PREFIX[kind], d)
        # Ask first (HEAD) unless a snapshot under this epoch already told us what exists
        # and the storage charges a request per question: then a miss is most likely new,
        # and the conditional PUT is the question and the write in one request.
        ask = self.storage.local or not self.presence.warm(fence)
        if ask:
            size = self.storage.size_of(key)
            if size is not None:
                if self._reusable(key, kind, size, mv.nbytes):
                    self.presence.add(kind, d, fence)
                    return PutResult(d, False, mv.nbytes)
                # Damaged (truncated, oversized, a bad header): dedup would reuse it forever.
                # Keep its bytes aside and store the ones this writer holds, under the same
                # address, which heals every snapshot that references it.
                self.move_aside(key)
        c = self.codecs
        bufs = frame.encode_payload(mv, kind, compress=c != "none",
                                    float_itemsize=itemsize if c == "float" else 0)
        new = self.storage.put_addressed(key, bufs)
        if new and kind != frame.KIND_COMMIT and self._written is not None:
            self._written(kind, d, bufs, itemsize)
        if not new and not ask:
            # It was there after all: judge it by its size, as the HEAD would have.
            size = self.storage.size_of(key)
            if size is None or not self._reusable(key, kind, size, mv.nbytes):
                if size is not None:
                    self.move_aside(key)
                new = self.storage.put_addressed(key, bufs)
        self.presence.add(kind, d, fence)
        return PutResult(d, new, mv.nbytes, stored=sum(memoryview(b).nbytes for b in bufs) if new else 0)

    def _reusable(self, key: str, kind: int, size: int, raw_len: int) -> bool:
        """Whether an object found stored under `key` can be what a frame of `raw_len` raw
        bytes looks like, judged by its size (free: the stat or HEAD that found it) and,
        on local disks, by its 16-byte header. A healthy frame is exactly HEADER_SIZE +
        raw_len bytes when raw, and shorter when compressed (the writer stores raw
        whenever lz4 does not shrink a block to 90%), never longer. A size below that
        is a compressed frame or a truncated raw one: only the header tells, and on
        object stores reading it would cost a request per reused block, so there the
        object is trusted (fsck --repair finds a damaged one)."""
        full = frame.HEADER_SIZE + raw_len
        if size == full:
            return True
        if size < frame.HEADER_SIZE or size > full:
            return False
        if not self.storage.local:
            return True
        try:
            with self.storage.open_read(key) as f:
                hdr = frame.decode_header(f.read(frame.HEADER_SIZE))
        except FileNotFoundError:
            return False  # gone meanwhile (a gc): write it
        except FormatError:
            return False
        return hdr.kind == kind and hdr.raw_len == raw_len and hdr.codec != frame.CODEC_RAW

    def put_block(self, raw, itemsize: int = 1, digest: bytes | None = None, *, private: bool = False,
                  fence: int | None = None) -> PutResult:
        """Hash, maybe compress, and store one block (thread-safe; blake3, lz4 and
        the copy drop the GIL). The object stored under an address always holds
        exactly the bytes that hash to it:

        private=False (the default): `raw` may change while this runs (a caller's
        tensor), so it is copied into this thread's scratch buffer first and only
        the copy is hashed and written; a concurrent change gives a block of the
        bytes as copied under their own address. A known `digest` is checked
        against the copy (SnapshotAborted if the bytes changed since).
        private=True: nobody writes `raw` until this returns (a staged or copied
        plan); it is hashed (unless `digest` is given) and written in place.
        fence: the gc epoch read before this snapshot looked at storage (Presence)."""
        return self._put(frame.KIND_BLOCK, raw, itemsize, digest, private, fence)

    def put_known(self, raw, itemsize: int, d: bytes, fence: int | None = None) -> PutResult:
        """A block whose address is known without hashing (a tensor proven unchanged since
        its bytes were hashed: write/unchanged.py): looked for in storage, and written from
        `raw` only where it is missing; then `raw` is hashed and must match `d`
        (SnapshotAborted if the bytes changed since). raw None: nothing to write it from
        (SnapshotAborted where it is missing)."""
        n = memoryview(raw).nbytes if raw is not None else 0
        if self.presence.known(frame.KIND_BLOCK, d, fence):
            return PutResult(d, False, n)
        key = _key(KIND_PREFIX[frame.KIND_BLOCK], d)
        size = self.storage.size_of(key)
        if size is not None and (raw is None or self._reusable(key, frame.KIND_BLOCK, size, n)):
            self.presence.add(frame.KIND_BLOCK, d, fence)
            return PutResult(d, False, n)
        if raw is None:
            raise SnapshotAborted(f"block {d.hex()[:16]} of an unchanged tensor is no longer stored and its bytes "
                                  "are no longer held; nothing was published, take the snapshot again")
        return self._put(frame.KIND_BLOCK, raw, itemsize, d, False, fence)

    @staticmethod
    def hash_block(raw) -> PutResult:
        """Only the address: for a replicated block another rank writes."""
        mv = memoryview(raw).cast("B")
        return PutResult(blake3.blake3(mv).digest(), False, mv.nbytes, counted=False)

    def put_node(self, payload: bytes, fence: int | None = None, d: bytes | None = None) -> PutResult:
        """d: the payload's address when the caller hashed it already (node_address)."""
        return self._put(frame.KIND_NODE, payload, d=d, fence=fence)

    @staticmethod
    def node_address(payload: bytes) -> bytes:
        return blake3.blake3(payload).digest()

    def put_commit(self, payload: bytes) -> PutResult:
        return self._put(frame.KIND_COMMIT, payload)

    def sync(self) -> None:
        try:
            self.storage.sync()
        except BaseException:
            # What this Store recorded as written may never have been named (a local
            # disk names its writes here): ask storage again from now on.
            self.presence.forget()
            raise

    # -- copying between stores (a local tier's uploads) ---------------------------
    def stored_frame(self, kind: str, d: bytes, written: tuple[int, int | None] | None = None) -> bytes:
        """The stored bytes of object `d` of `kind` ("block", "node", "commit"), checked
        (frame, length, BLAKE3) before they go anywhere: a damaged local copy is an
        IntegrityError here, never a remote object.

        written: (length, CRC32) of the frame this process encoded for `d` and wrote here
        (tier.uploader.Uploader.tee, taken from the bytes as they were written). Bytes that match
        both are that frame, which was encoded from the bytes hashed to `d`: one read and a
        CRC32 instead of a decode and a BLAKE3 (a block kept raw needs no decode: its BLAKE3,
        the cheaper of the two). Any mismatch is judged whole, as without."""
        key = _key(kind + "s", d)
        if written is not None:
            try:
                data = self._read_reused(key, written[0] + 1)
            except FileNotFoundError:
                data = None
            if data is not None and len(data) == written[0]:
                if frame.is_raw_block(data):
                    # Kept raw (a tier on a fast disk): BLAKE3 checks it whole against its
                    # address for less than a CRC32 costs (here 3.6 against 2.1 GB/s).
                    if check_frame(kind + "s", d, data, key) is None:
                        return data
                elif written[1] is not None and zlib.crc32(data) == written[1]:
                    return data
        err, data = self.verify_stored(key)
        if err is not None:
            raise err
        return data

    def open_stored(self, kind: str, d: bytes):
        """The stored bytes of object `d` of `kind` ("block", "node", "commit") as a file
        object, unchecked: for a prefetch that only warms a local disk's page cache
        (read/prefetch.py); every reader of the bytes checks them. FileNotFoundError when
        absent."""
        return self.storage.open_read(_key(kind + "s", d))

    def _read_reused(self, key: str, n: int) -> memoryview:
        """Up to n bytes of object `key` into this thread's frame buffer, reused while it is
        at most FRAME_KEEP: a fresh buffer of a pack's size is fresh pages (glibc maps
        anything past 32 MiB anew), a page fault per 4 KiB read. The view is good until this
        thread reads again (an upload's object is written before its thread reads the next)."""
        if not self.storage.local:  # (a tier's objects are on a local disk: what is reused)
            return memoryview(self.storage.get(key, n))
        buf = getattr(self._local, "frame", None)
        if buf is None or len(buf) < n:
            buf = bytearray(n)
            if n <= FRAME_KEEP:
                self._local.frame = buf
        mv = memoryview(buf)
        got = 0
        with self.storage.open_read(key, n) as f:
            while got < n:
                k = f.readinto(mv[got:n])
                if not k:
                    break
                got += k
        return mv[:got]

    def framed_here(self, kind: str, data, itemsize: int = 0) -> list:
        """`data`, a sound frame of object `kind` that another store keeps (a local tier's,
        checked), as this store's writer frames such bytes -> buffers to store. A block
        kept in lz4 or raw (what a local disk wants) is coded with the float codec where
        this store's blocks are (what a network wants); the address is of the bytes, not
        of their coding. Anything else goes as it is: no decode. itemsize: the element
        size of the tensor naming the block (walk.Obj.itemsize), as a put codes by it;
        0 (unknown): the size that codes a sample smallest, found by probing each (4x the
        probes)."""
        if kind != "block" or self.codecs != "float":
            return [data]
        hdr = frame.decode_header(data[:frame.HEADER_SIZE])
        if hdr.codec not in (frame.CODEC_RAW, frame.CODEC_LZ4):
            return [data]
        if hdr.codec == frame.CODEC_LZ4 and itemsize and itemsize not in frame.FLOAT_ITEMSIZES:
            return [data]  # no float codec for these elements: lz4 would code them as the local writer did
        raw = frame.decode_payload(hdr, memoryview(data)[frame.HEADER_SIZE:])
        return frame.encode_payload(raw, frame.KIND_BLOCK, float_itemsize=itemsize or frame.float_itemsize_for(raw))

    def put_frame(self, kind: str, d: bytes, data: bytes, fence: int | None, itemsize: int = 0) -> bool:
        """Store `data`, the stored frame of object `d` of `kind` as this process just
        encoded it (from memory, not read back from a disk; framed_here first), unless
        this store is known to hold `d` under `fence`. Conditional: an object already stored
        is left as it is and not recorded present (its health is for a later put or
        copy_from to judge). -> whether it was written."""
        fk = FRAME_KIND[kind]
        if self.presence.known(fk, d, fence):
            return False
        new = self.storage.put_addressed(_key(kind + "s", d), self.framed_here(kind, data, itemsize))
        if new:
            self.presence.add(fk, d, fence)
        return new

    def copy_from(self, src: "Assets", kind: str, d: bytes, fence: int | None,
                  written: tuple[int, int | None] | None = None, itemsize: int = 0) -> bool:
        """Store object `d` of `kind` as `src` stores it (same address; the same bytes but
        for a block framed_here codes for this store; src.stored_frame checks it first)
        unless this store has it:
        known present under `fence` (Presence), found by a HEAD, or (a warm record on an
        object store, or an object src's process wrote new: `written`, see stored_frame)
        refused by the conditional PUT. What is found is judged by its size as a put
        judges it (src's 16-byte header gives the raw length, so a found object costs no
        read of its bytes). -> whether it was written."""
        fk = FRAME_KIND[kind]
        if self.presence.known(fk, d, fence):
            return False
        key = _key(kind + "s", d)
        # As _put: once a snapshot under this epoch told us what exists, a miss is most
        # likely new, and on an object store the conditional PUT is the question and the
        # write in one request. So is an object that was new where it comes from.
        ask = self.storage.local or (written is None and not self.presence.warm(fence))
        if ask and self._found(src, kind, key, d):
            self.presence.add(fk, d, fence)
            return False
        bufs = self.framed_here(kind, src.stored_frame(kind, d, written), itemsize)
        new = self.storage.put_addressed(key, bufs)
        if not new and not ask and not self._found(src, kind, key, d):
            new = self.storage.put_addressed(key, bufs)  # it was damaged: moved aside, stored again
        self.presence.add(fk, d, fence)
        return new

    def _found(self, src: "Assets", kind: str, key: str, d: bytes) -> bool:
        """Whether this store holds `key` in a shape a put would reuse (a damaged one is
        moved aside: False)."""
        size = self.storage.size_of(key)
        if size is None:
            return False
        if self._reusable(key, FRAME_KIND[kind], size, src.stored_raw_len(kind, d)):
            return True
        self.move_aside(key)
        return False

    def stored_raw_len(self, kind: str, d: bytes) -> int:
        """The raw length object `d`'s stored header declares (its first 16 bytes)."""
        key = _key(kind + "s", d)
        try:
            with self.storage.open_read(key, frame.HEADER_SIZE) as f:
                return frame.decode_header(f.read(frame.HEADER_SIZE)).raw_len
        except FileNotFoundError:
            raise IntegrityError("missing object", key=key, reason="missing") from None
        except FormatError as e:
            raise IntegrityError(f"corrupt object header: {e}", key=key) from None

    # -- reading -------------------------------------------------------------
    def _open(self, key: str, ctx: dict, expect_len: int | None):
        # No more than a healthy frame can hold, plus one byte to see an oversized one:
        # object stores fetch only that (one ranged GET).
        bound = frame.HEADER_SIZE + (MAX_NODE_BYTES if expect_len is None else expect_len) + 1
        try:
            return self.storage.open_read(key, bound)
        except FileNotFoundError:
            raise IntegrityError("missing object", key=key, reason="missing", **ctx) from None
        except TsckError:
            raise
        except OSError as e:
            raise unreadable(e, key, **ctx) from e

    def _read_frame(self, key: str, kind: int, expect_len: int | None, out, ctx: dict):
        try:
            return self._read_frame_of(key, kind, expect_len, out, ctx)
        except TsckError:
            raise
        except OSError as e:  # an I/O error mid-read (EIO): the object is there, unreadable
            raise unreadable(e, key, **ctx) from e

    def _read_frame_of(self, key: str, kind: int, expect_len: int | None, out, ctx: dict):
        f = self._open(key, ctx, expect_len)
        with f:
            head = f.read(frame.HEADER_SIZE)
            try:
                hdr = frame.decode_header(head)
            except FormatError as e:
                raise IntegrityError(f"corrupt object header: {e}", key=key, **ctx) from None
            if hdr.kind != kind:
                raise IntegrityError(f"object is of kind {hdr.kind}, expected {kind}", key=key, **ctx)
            if expect_len is not None and hdr.raw_len != expect_len:
                raise IntegrityError(f"object holds {hdr.raw_len} bytes, expected {expect_len}",
                                     key=key, **ctx)
            if kind != frame.KIND_BLOCK and hdr.raw_len > MAX_NODE_BYTES:
                raise IntegrityError(f"object declares {hdr.raw_len} bytes, more than a node or commit may "
                                     f"hold ({MAX_NODE_BYTES})", key=key, **ctx)
            if hdr.codec == frame.CODEC_RAW and out is None:
                body = f.read(hdr.raw_len + 1)
                if len(body) != hdr.raw_len:
                    raise IntegrityError("truncated or oversized object", key=key, reason="truncated", **ctx)
                return body
            if hdr.codec == frame.CODEC_RAW and out is not None:
                mv = memoryview(out).cast("B")
                got = 0
                while got < hdr.raw_len:
                    n = f.readinto(mv[got:])
                    if not n:
                        break
                    got += n
                if got != hdr.raw_len or f.read(1):
                    raise IntegrityError("truncated or oversized object", key=key, reason="truncated", **ctx)
                return out
            # A writer compresses only what shrinks (to 90% or less): a compressed payload
            # is never longer than its raw length, so that bounds the read.
            body = f.read(hdr.raw_len + 1)
            if len(body) > hdr.raw_len:
                raise IntegrityError("compressed payload longer than its raw length", key=key, **ctx)
        try:
            return frame.decode_payload(hdr, body, out)
        except FormatError as e:
            raise IntegrityError(f"corrupt object payload: {e}", key=key, **ctx) from None

    def check_quick(self, kind: int, d: bytes, expect_len: int | None):
        """Presence and size from the header and the object's length, without
        reading the payload. Returns None, an IntegrityError or an UnreadableObject."""
        key = _key(KIND_PREFIX[kind], d)
        try:
            with self._open(key, {}, expect_len) as f:
                try:
                    hdr = frame.decode_header(f.read(frame.HEADER_SIZE))
                except FormatError as e:
                    return IntegrityError(f"corrupt object header: {e}", key=key)
                size = f.seek(0, 2)
        except (IntegrityError, UnreadableObject) as e:
            return e
        except OSError as e:
            return unreadable(e, key)
        if hdr.kind != kind:
            return IntegrityError(f"object is of kind {hdr.kind}, expected {kind}", key=key)
        if expect_len is not None and hdr.raw_len != expect_len:
            return IntegrityError(f"object holds {hdr.raw_len} bytes, expected {expect_len}", key=key)
        if hdr.codec == frame.CODEC_RAW and size != frame.HEADER_SIZE + hdr.raw_len:
            return IntegrityError(f"object is {size} bytes, its header says {frame.HEADER_SIZE + hdr.raw_len}",
                                  key=key, reason="truncated")
        return None

    @staticmethod
    def _check(d: bytes, data, key: str, ctx: dict) -> None:
        got = blake3.blake3(data).digest()
        if got != d:
            raise IntegrityError("content does not match its address", key=key,
                                 expected=d.hex(), got=got.hex(), **ctx)

    def read_block_into(self, d: bytes, out, *, verify: bool = True, snapshot=None, path=None,
                        bounce: bool = False, fence: int | None = None) -> None:
        """Read block `d` into the writable buffer `out` (exactly its length).

        bounce=True (`out` is the caller's memory): with verify on, the block is read
        and verified in this thread's scratch buffer and only then copied into
        `out`, so `out` receives the block's verified bytes or is not touched at
        all. Without it, the bytes are read straight into `out` and verified there
        (for fresh memory that a failed checkout throws away). fence: the gc epoch read
        before this checkout began; the block, read, is recorded present under it."""
        try:
            self._read_block_into(d, out, verify, snapshot, path, bounce)
        except IntegrityError:
            self.presence.discard(frame.KIND_BLOCK, d)  # missing or damaged: a put asks storage again
            raise
        self.presence.add(frame.KIND_BLOCK, d, fence)

    def _read_block_into(self, d: bytes, out, verify: bool, snapshot, path, bounce: bool) -> None:
        ctx = {"snapshot": snapshot, "path": path}
        key = block_key(d)
        mv = memoryview(out).cast("B")
        if bounce and verify:
            buf = self._scratch(mv.nbytes)
            self._read_frame(key, frame.KIND_BLOCK, mv.nbytes, buf, ctx)
            self._check(d, buf, key, ctx)
            np.copyto(np.frombuffer(mv, dtype=np.uint8), buf)  # releases the GIL
            return
        self._read_frame(key, frame.KIND_BLOCK, mv.nbytes, mv, ctx)
        if verify:
            self._check(d, mv, key, ctx)

    def get_node(self, d: bytes, *, verify: bool = True, snapshot=None, path=None, fence: int | None = None) -> bytes:
        ctx = {"snapshot": snapshot, "path": path}
        key = node_key(d)
        try:
            data = self._read_frame(key, frame.KIND_NODE, None, None, ctx)
            if verify:
                self._check(d, data, key, ctx)
        except IntegrityError:
            self.presence.discard(frame.KIND_NODE, d)
            raise
        self.presence.add(frame.KIND_NODE, d, fence)
        return bytes(data)

    def get_commit(self, d: bytes, *, verify: bool = True) -> bytes:
        ctx = {"snapshot": d.hex(), "path": None}
        key = commit_key(d)
        data = self._read_frame(key, frame.KIND_COMMIT, None, None, ctx)
        if verify:
            self._check(d, data, key, ctx)
        return bytes(data)

    @staticmethod
    def node_error(d: bytes, msg: str, *, snapshot=None, path=None) -> IntegrityError:
        """The error for a node that was read and verified but does not decode."""
        return IntegrityError(msg, snapshot=snapshot, path=path, key=node_key(d))

    def require_block(self, d: bytes, *, snapshot=None, path=None) -> None:
        """IntegrityError unless block `d` is present (one HEAD / stat)."""
        key = block_key(d)
        if not self.storage.exists(key):
            raise IntegrityError("missing object", key=key, reason="missing", snapshot=snapshot, path=path)

    def require_blocks(self, digests, pool, *, snapshot=None, path=None, fence: int | None = None) -> None:
        """require_block for each of `digests` (in `pool`), except those this Store saw
        present under the gc epoch `fence` (default: the current one), if it is still
        current (Presence): they are there unless a deletion phase began since, and then
        the read that follows finds them missing anyway."""
        todo = list(digests)
        if self.presence.warm_for_reading():
            epoch = fence if fence is not None else self.fence_now()
            todo = [d for d in todo if not self.presence.known(frame.KIND_BLOCK, d, epoch)]
        list(pool.map(lambda d: self.require_block(d, snapshot=snapshot, path=path), todo))

    def fence_now(self) -> int | None:
        """The current gc deletion epoch, None when it cannot be read (no ref table, or
        it is away: then nothing is taken from the record)."""
        if self.epoch_now is None:
            return None
        try:
            return self.epoch_now()
        except TsckError:
            return None

    def has_block(self, d: bytes, raw_len: int, fence: int | None) -> bool:
        """Whether block `d` of `raw_len` raw bytes is stored whole (as far as its size and,
        on a local disk, its header tell), to be named without being written: known present
        under `fence` (Presence), else one HEAD / stat."""
        if self.presence.known(frame.KIND_BLOCK, d, fence):
            return True
        key = block_key(d)
        size = self.storage.size_of(key)
        if size is None or not self._reusable(key, frame.KIND_BLOCK, size, raw_len):
            return False
        self.presence.add(frame.KIND_BLOCK, d, fence)
        return True

    def block_exists(self, d: bytes) -> bool:
        return self.storage.exists(_key(KIND_PREFIX[frame.KIND_BLOCK], d))

    def has_commit(self, d: bytes) -> bool:
        return self.storage.exists(commit_key(d))

    # -- damaged objects: verify, move aside, list ------------------------------------
    def verify_stored(self, key: str, at: str | None = None) -> tuple[IntegrityError | None, bytes | None]:
        """Read the object of well-formed key `key` (from `at`, default `key` itself: a
        copy moved aside is checked against the address it was stored under) and check
        its frame and BLAKE3 against the address. -> (None, the stored bytes) when
        healthy, else (the IntegrityError, None). OSError (an unreadable object) passes."""
        m = _OBJECT_KEY.match(key)
        if m is None:
            raise ValueError(f"not an object key: {key!r}")
        kind, d = m.group(1), bytes.fromhex(m.group(3))
        where = at or key
        try:
            data = self.storage.get(where, _MAX_OBJECT + 1)
        except FileNotFoundError:
            return IntegrityError("missing object", key=where, reason="missing"), None
        err = check_frame(kind, d, data, where)
        return (err, None) if err is not None else (None, data)

    @staticmethod
    def object_frame_error(kind: str, d: bytes, data: bytes) -> IntegrityError | None:
        """Whether `data` is a whole, healthy stored object of `kind` ("block", "node",
        "commit") with address `d` (bytes from elsewhere: a peer's copy). -> the error or None."""
        return check_frame(kind + "s", d, data, _key(kind + "s", d))

    @staticmethod
    def object_from_frame(kind: str, d: bytes, data: bytes, out=None):
        """object_frame_error, and the object's bytes it decoded -> (error, None) or (None, bytes).
        out: decode into that buffer (of the object's length), checked there."""
        return frame_payload(kind + "s", d, data, _key(kind + "s", d), out)

    @staticmethod
    def block_in_place(d: bytes, head, body):
        """object_from_frame for a block's frame received in two parts, its header `head`
        and the rest already in the block's destination `body` -> (error, None) or (None,
        body): a block stored raw is checked where it is (no copy); a coded one is decoded
        from a copy into `body`."""
        where = _key("blocks", d)
        if frame.is_raw_block(head) and frame.decode_header(head).raw_len == memoryview(body).nbytes:
            got = blake3.blake3(body).digest()
            if got != d:
                return IntegrityError("content does not match its address", key=where, expected=d.hex(),
                                      got=got.hex()), None
            return None, body
        return frame_payload("blocks", d, bytes(head) + bytes(body), where, body)

    def move_aside(self, key: str, *, deadline=None) -> str | None:
        """Move the object `key` to a fresh quarantine name -> that name, or None if
        `key` was absent. Nothing under quarantine/ is ever read as an object or deleted
        by gc; an operator inspects or removes it. deadline: as for delete_objects (no
        removal from `key` starts after it)."""
        m = _OBJECT_KEY.match(key)
        if m is None:
            raise ValueError(f"not an object key: {key!r}")
        dest = aside_key(m.group(1), bytes.fromhex(m.group(3)))
        if self.storage.move(key, dest, deadline=deadline) or self.storage.exists(dest):  # a retried move reports False
            return dest
        return None

    def restore(self, key: str, data: bytes, aside: str) -> None:
        """Put healthy bytes that were moved aside back under `key` (unless a writer
        stored them there meanwhile) and drop the now redundant copy."""
        self.storage.put_if_absent(key, [data])
        self.storage.delete(aside)

    def list_aside(self) -> Iterator[Aside]:
        """Everything under quarantine/, as listed (names this module did not make too)."""
        for o in self.storage.list(QUARANTINE_PREFIX):
            m = _ASIDE_KEY.match(o.key)
            yield Aside(o.key, m and m.group(1), m and bytes.fromhex(m.group(2)), o.size, o.mtime)

    # -- listing, deleting, tags: what gc, fsck, recover and du need ------------
    def list_objects(self, kind: str, strays: list | None = None) -> Iterator[Listed]:
        """Every stored object of `kind` ("commits", "nodes", "blocks"), streamed. A name
        that is not a well-formed key of that kind is never trusted: its key goes to
        `strays` (when given) and nothing else happens to it."""
        if kind not in KINDS:
            raise ValueError(f"unknown object kind {kind!r}")
        for o in self.storage.list(kind + "/"):
            m = _OBJECT_KEY.match(o.key)
            if m is None or m.group(1) != kind:
                if strays is not None:
                    strays.append(o.key)
                continue
            yield Listed(kind, bytes.fromhex(m.group(3)), o.size, o.mtime)

    def lost_to_others(self, blocks, nodes) -> tuple[set, set]:
        """Of the digests of blocks and nodes this writer wrote and synced, those another
        writer named in the store first (BlockStore.take_lost; each told once)."""
        lost = self.storage.take_lost([block_key(d) for d in blocks] + [node_key(d) for d in nodes])
        if not lost:
            return set(), set()
        return {d for d in blocks if block_key(d) in lost}, {d for d in nodes if node_key(d) in lost}

    @staticmethod
    def object_key(kind: str, d: bytes) -> str:
        """The key of an object, for reports and messages only."""
        return _key(kind, d)

    @staticmethod
    def kind_of_key(key: str | None) -> str | None:
        """"commits", "nodes" or "blocks" for a well-formed object key (an error's .key)."""
        m = _OBJECT_KEY.match(key or "")
        return m.group(1) if m else None

    def delete_objects(self, kind: str, digests, *, deadline=None) -> None:
        """Delete objects of one kind (absent ones are fine): one batched request per
        up to 1000 keys on object stores; none starts after `deadline` (storage.base)."""
        self.storage.delete_many([_key(kind, d) for d in digests], deadline=deadline)

    def object_stats(self) -> dict[str, tuple[int, int]]:
        """kind -> (objects, bytes) as stored, strays included."""
        out = {}
        for kind in KINDS:
            n = b = 0
            for o in self.storage.list(kind + "/"):
                n += 1
                b += o.size
            out[kind] = (n, b)
        return out

    def sweep_temp(self, before: float) -> int:
        """Remove temp files of writes that died (modified before `before`; a whole
        object waiting to be named, PENDING_GRACE seconds before that: its writer, if
        alive, names it at its next sync)."""
        n = 0
        st = self.storage
        for o in st.temp_files():
            if o.mtime + self._temp_wait(o) < before:
                self.storage.delete(o.key)
                n += 1
        return n

    def _temp_wait(self, o) -> float:
        """How much longer than a gc's lease a temp file is left alone (sweep_temp)."""
        st = self.storage
        return st.PENDING_GRACE if o.key.endswith(st.PENDING_SUFFIX) else 0.0

    def temp_report(self, *, lease: float, grace: float = 0.0, now: float | None = None) -> dict:
        """The temp files under tmp/ (writes in flight, or left by a writer that died: a
        save killed -9 leaves its .partial files) and when a gc with this lease and grace
        sweeps each (sweep_temp's rule: once the storage's clock is past mtime + lease +
        grace, PENDING_GRACE more for a .pending file). Nothing is removed here.
        now: the storage's clock, if known (gc --dry-run reads it); None: this host's.
        -> {files, bytes, partial, pending, lease, grace, now, sweepable, sweepable_bytes,
            next_due (the first time a gc sweeps one not yet due), all_due}"""
        st = self.storage
        now = time.time() if now is None else now
        out = {"files": 0, "bytes": 0, "partial": 0, "pending": 0, "lease": lease, "grace": grace,
               "pending_grace": st.PENDING_GRACE, "now": now,
               "sweepable": 0, "sweepable_bytes": 0, "next_due": None, "all_due": None}
        for o in st.temp_files():
            due = o.mtime + lease + grace + self._temp_wait(o)
            out["files"] += 1
            out["bytes"] += o.size
            out["pending" if o.key.endswith(st.PENDING_SUFFIX) else "partial"] += 1
            if due < now:
                out["sweepable"] += 1
                out["sweepable_bytes"] += o.size
            elif out["next_due"] is None or due < out["next_due"]:
                out["next_due"] = due
            out["all_due"] = due if out["all_due"] is None else max(out["all_due"], due)
        return out

    def put_tag(self, name: str, root: bytes, time: float) -> bytes | None:
        """Create the tag object of `name` exclusively (it is the tag's single source of
        truth across hosts). None if this call created it, else the root the existing
        object names (None there too if it is unreadable: the caller decides)."""
        key = tag_key(name)
        if self.storage.put_if_absent(key, [encode_tag(name, root, time)]):
            return None
        try:
            return decode_tag(self.storage.get(key, MAX_TAG_OBJECT + 1))[1]
        except (FormatError, OSError):  # gone, undecodable or unreadable: not this tag
            return b""

    def delete_tag(self, name: str) -> None:
        """Remove a tag object whose tag was never created (its snapshot went away)."""
        self.storage.delete(tag_key(name))

    def tag_object(self, name: str) -> bytes | None:
        """The stored bytes of `name`'s tag object (None if there is none), for
        restore_tag: an untag whose ref-table half failed puts them back."""
        try:
            return self.storage.get(tag_key(name))
        except FileNotFoundError:
            return None

    def restore_tag(self, name: str, data: bytes) -> None:
        self.storage.put_if_absent(tag_key(name), [data])

    def tags(self) -> Iterator[tuple[str, object]]:
        """(key, (name, root, time)) for every stored tag object, or (key, FormatError)
        for one that does not decode or whose key does not match its name, (key,
        UnreadableObject) for one that cannot be read."""
        for o in self.storage.list("tags/"):
            if _TAG_KEY.match(o.key) is None:
                yield o.key, FormatError("not a tag object key")
                continue
            try:
                rec = decode_tag(self.storage.get(o.key, MAX_TAG_OBJECT + 1))
            except FileNotFoundError:
                continue  # removed meanwhile
            except FormatError as e:
                yield o.key, e
                continue
            except OSError as e:
                yield o.key, unreadable(e, o.key)
                continue
            if tag_key(rec[0]) != o.key:
                yield o.key, FormatError(f"tag object names {rec[0]!r}, its key another name")
                continue
            yield o.key, rec


def check_frame(kind: str, d: bytes, data: bytes, where: str) -> IntegrityError | None:
    """Frame, kind ("blocks", "nodes", "commits"), caps and BLAKE3 of stored bytes against address `d`."""
    return frame_payload(kind, d, data, where)[0]


def frame_payload(kind: str, d: bytes, data: bytes, where: str, out=None):
    """check_frame, and the payload it decoded -> (None, the object's bytes) when healthy,
    else (the IntegrityError, None): bytes from elsewhere used without a second pass.
    out: a writable buffer the payload is decoded into (and checked there) when it has the
    object's length; what it holds after a failure is not the object."""
    try:
        if len(data) > _MAX_OBJECT:
            raise FormatError(f"longer than any object may be ({_MAX_OBJECT} bytes)")
        hdr = frame.decode_header(data[:frame.HEADER_SIZE])
        if KIND_PREFIX[hdr.kind] != kind:
            raise FormatError(f"object is of kind {hdr.kind}, stored as {kind}")
        cap = MAX_BLOCK_SIZE if hdr.kind == frame.KIND_BLOCK else MAX_NODE_BYTES
        if hdr.raw_len > cap:  # no writer makes one; decoding it could take 2 GiB (FORMAT.md, "Memory")
            raise FormatError(f"object declares {hdr.raw_len} bytes, more than its kind may hold ({cap})")
        if out is not None and memoryview(out).nbytes != hdr.raw_len:
            raise FormatError(f"object holds {hdr.raw_len} bytes, expected {memoryview(out).nbytes}")
        raw = frame.decode_payload(hdr, memoryview(data)[frame.HEADER_SIZE:], out)
    except FormatError as e:
        return IntegrityError(f"corrupt object: {e}", key=where), None
    got = blake3.blake3(raw).digest()
    if got != d:
        return IntegrityError("content does not match its address", key=where, expected=d.hex(),
                              got=got.hex()), None
    return None, raw
