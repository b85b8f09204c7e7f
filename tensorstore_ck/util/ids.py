"""Object identities: BLAKE3-256 digests, their hex form and prefix matching."""

from __future__ import annotations

import re

from ..errors import InvalidName

__all__ = ["DIGEST_SIZE", "Digest", "parse_hex", "is_hex_prefix", "MIN_PREFIX"]

DIGEST_SIZE = 32
MIN_PREFIX = 8
_HEX = re.compile(r"[0-9a-f]+\Z")


def parse_hex(s: str) -> bytes:
    """A full 64-hex-digit root or block id -> its 32 bytes."""
    if not isinstance(s, str) or len(s) != 2 * DIGEST_SIZE or not _HEX.match(s):
        raise InvalidName(f"not a root hash (64 lowercase hex digits): {s!r}")
    return bytes.fromhex(s)


def is_hex_prefix(s: str) -> bool:
    return isinstance(s, str) and MIN_PREFIX <= len(s) <= 2 * DIGEST_SIZE and bool(_HEX.match(s))


class Digest(bytes):
    """A BLAKE3-256 address (a snapshot's root, a node, a block): its 32 bytes, so it
    goes to storage keys, msgpack and the ref table as it is; str() is the full hex.
    Parsed once at the API's edge, never converted back and forth inside."""
    __slots__ = ()

    def __new__(cls, raw: bytes):
        if len(raw) != DIGEST_SIZE:
            raise InvalidName(f"a digest is {DIGEST_SIZE} bytes, got {len(raw)}")
        return super().__new__(cls, raw)

    @classmethod
    def parse(cls, s: str) -> "Digest":
        return cls(parse_hex(s))

    def __str__(self) -> str:
        return self.hex()

    def __repr__(self) -> str:
        return f"Digest({self.hex()[:12]}...)"
