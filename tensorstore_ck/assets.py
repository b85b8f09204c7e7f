"""Typed object I/O: blocks, manifest nodes and commits, verified on read.

Nothing above this module builds a storage key; nothing below it knows what
a manifest is. Keys are ``blocks/ab/<hex>``, ``nodes/ab/<hex>``,
``commits/ab/<hex>``, where <hex> is the BLAKE3-256 of the raw payload.
"""

from __future__ import annotations

from dataclasses import dataclass

import blake3

from .errors import FormatError, IntegrityError
from .format import frame
from .storage.base import BlockStore

__all__ = ["Assets", "PutResult", "block_key", "node_key", "commit_key", "KIND_PREFIX"]

KIND_PREFIX = {frame.KIND_BLOCK: "blocks", frame.KIND_NODE: "nodes", frame.KIND_COMMIT: "commits"}


def _key(prefix: str, d: bytes) -> str:
    h = d.hex()
    return f"{prefix}/{h[:2]}/{h}"


def block_key(d: bytes) -> str:
    return _key("blocks", d)


def node_key(d: bytes) -> str:
    return _key("nodes", d)


def commit_key(d: bytes) -> str:
    return _key("commits", d)


@dataclass(frozen=True, slots=True)
class PutResult:
    digest: bytes
    new: bool
    raw_len: int
    counted: bool = True  # False: only hashed here (another rank owns the block)


class Assets:
    def __init__(self, storage: BlockStore, *, compress: bool = True, shuffle: bool = False):
        self.storage = storage
        self.compress = compress
        self.shuffle = shuffle

    # -- writing -------------------------------------------------------------
    def _put(self, kind: int, raw, itemsize: int = 1, d: bytes | None = None) -> PutResult:
        mv = memoryview(raw).cast("B")
        if d is None:
            d = blake3.blake3(mv).digest()
        key = _key(KIND_PREFIX[kind], d)
        if self.storage.exists(key):
            return PutResult(d, False, mv.nbytes)
        bufs = frame.encode_payload(mv, kind, compress=self.compress,
                                    shuffle_itemsize=itemsize if self.shuffle else 0)
        new = self.storage.put_if_absent(key, bufs)
        return PutResult(d, new, mv.nbytes)

    def put_block(self, raw, itemsize: int = 1, digest: bytes | None = None) -> PutResult:
        """Hash (unless `digest` is known), maybe compress, and store one block
        (thread-safe; blake3 and lz4 drop the GIL)."""
        return self._put(frame.KIND_BLOCK, raw, itemsize, digest)

    @staticmethod
    def hash_block(raw) -> PutResult:
        """Only the address: for a replicated block another rank writes."""
        mv = memoryview(raw).cast("B")
        return PutResult(blake3.blake3(mv).digest(), False, mv.nbytes, counted=False)

    def put_node(self, payload: bytes) -> PutResult:
        return self._put(frame.KIND_NODE, payload)

    def put_commit(self, payload: bytes) -> PutResult:
        return self._put(frame.KIND_COMMIT, payload)

    def sync(self) -> None:
        self.storage.sync()

    # -- reading -------------------------------------------------------------
    def _read_frame(self, key: str, kind: int, expect_len: int | None, out, ctx: dict):
        try:
            f = self.storage.open_read(key)
        except FileNotFoundError:
            raise IntegrityError("missing object", key=key, reason="missing", **ctx) from None
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
            body = f.read(frame.MAX_RAW_LEN + 1)
        try:
            return frame.decode_payload(hdr, body, out)
        except FormatError as e:
            raise IntegrityError(f"corrupt object payload: {e}", key=key, **ctx) from None

    def check_quick(self, kind: int, d: bytes, expect_len: int | None):
        """Presence and size from the header and the object's length, without
        reading the payload. Returns None or an IntegrityError."""
        key = _key(KIND_PREFIX[kind], d)
        try:
            f = self.storage.open_read(key)
        except FileNotFoundError:
            return IntegrityError("missing object", key=key, reason="missing")
        with f:
            try:
                hdr = frame.decode_header(f.read(frame.HEADER_SIZE))
            except FormatError as e:
                return IntegrityError(f"corrupt object header: {e}", key=key)
            size = f.seek(0, 2)
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

    def read_block_into(self, d: bytes, out, *, verify: bool = True, snapshot=None, path=None) -> None:
        """Read block `d` into the writable buffer `out` (exactly its length)."""
        ctx = {"snapshot": snapshot, "path": path}
        key = block_key(d)
        mv = memoryview(out).cast("B")
        self._read_frame(key, frame.KIND_BLOCK, mv.nbytes, mv, ctx)
        if verify:
            self._check(d, mv, key, ctx)

    def get_node(self, d: bytes, *, verify: bool = True, snapshot=None, path=None) -> bytes:
        ctx = {"snapshot": snapshot, "path": path}
        key = node_key(d)
        data = self._read_frame(key, frame.KIND_NODE, None, None, ctx)
        if verify:
            self._check(d, data, key, ctx)
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

    def block_exists(self, d: bytes) -> bool:
        return self.storage.exists(_key(KIND_PREFIX[frame.KIND_BLOCK], d))

    def has_commit(self, d: bytes) -> bool:
        return self.storage.exists(commit_key(d))
