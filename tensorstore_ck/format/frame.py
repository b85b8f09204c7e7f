"""The object frame: a fixed 16-byte header, then the (maybe compressed) payload.

    offset size  field
    0      4     magic b"TSKO"
    4      1     frame version (1)
    5      1     codec: 0 raw, 1 lz4 block, 2 byte-shuffle then lz4 block
    6      1     itemsize for the shuffle codec (1 otherwise)
    7      1     kind: 0 block, 1 manifest node, 2 commit
    8      8     raw_len, little-endian u64: length of the uncompressed payload

The address of an object is the BLAKE3-256 of its *raw* payload, so the codec
never changes the address. Codes here are permanent once released.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import lz4.block
import numpy as np

from ..errors import FormatError

__all__ = [
    "MAGIC", "FRAME_VERSION", "HEADER_SIZE", "CODEC_RAW", "CODEC_LZ4", "CODEC_SHUFFLE_LZ4",
    "KIND_BLOCK", "KIND_NODE", "KIND_COMMIT", "Header", "encode_header", "decode_header",
    "encode_payload", "decode_payload",
]

MAGIC = b"TSKO"
FRAME_VERSION = 1
MIN_FRAME_VERSION = 1
MAX_FRAME_VERSION = 1
HEADER_SIZE = 16
_HDR = struct.Struct("<4sBBBBQ")

CODEC_RAW = 0
CODEC_LZ4 = 1
CODEC_SHUFFLE_LZ4 = 2
_CODECS = (CODEC_RAW, CODEC_LZ4, CODEC_SHUFFLE_LZ4)

KIND_BLOCK = 0
KIND_NODE = 1
KIND_COMMIT = 2
_KINDS = (KIND_BLOCK, KIND_NODE, KIND_COMMIT)

# lz4's block format cannot describe more than this; also a sanity cap on any one object.
MAX_RAW_LEN = 2**31 - 1

# Compress only if the sample shrinks to this fraction or less: on float weights lz4
# saves ~0% and costs CPU (see docs/ARCHITECTURE.md, "Compression").
_SAMPLE = 64 * 1024
_WORTH = 0.90


@dataclass(frozen=True, slots=True)
class Header:
    codec: int
    itemsize: int
    kind: int
    raw_len: int


def encode_header(codec: int, itemsize: int, kind: int, raw_len: int) -> bytes:
    return _HDR.pack(MAGIC, FRAME_VERSION, codec, itemsize, kind, raw_len)


def decode_header(buf) -> Header:
    if len(buf) < HEADER_SIZE:
        raise FormatError(f"object shorter than its {HEADER_SIZE}-byte header ({len(buf)} bytes)")
    magic, version, codec, itemsize, kind, raw_len = _HDR.unpack_from(buf, 0)
    if magic != MAGIC:
        raise FormatError(f"bad object magic {magic!r}")
    if not MIN_FRAME_VERSION <= version <= MAX_FRAME_VERSION:
        raise FormatError(
            f"object frame version {version} not readable (this build reads "
            f"{MIN_FRAME_VERSION}..{MAX_FRAME_VERSION})")
    if codec not in _CODECS:
        raise FormatError(f"unknown codec {codec}")
    if kind not in _KINDS:
        raise FormatError(f"unknown object kind {kind}")
    if itemsize == 0 or (codec != CODEC_SHUFFLE_LZ4 and itemsize != 1):
        raise FormatError(f"bad itemsize {itemsize} for codec {codec}")
    if raw_len > MAX_RAW_LEN:
        raise FormatError(f"declared object size {raw_len} exceeds the cap {MAX_RAW_LEN}")
    return Header(codec, itemsize, kind, raw_len)


def _shuffle(raw, itemsize: int) -> bytes:
    a = np.frombuffer(raw, dtype=np.uint8)
    n = len(a) - len(a) % itemsize
    body = a[:n].reshape(-1, itemsize).T.tobytes()
    return body + a[n:].tobytes()


def _unshuffle(data: bytes, itemsize: int, raw_len: int) -> bytes:
    a = np.frombuffer(data, dtype=np.uint8)
    n = raw_len - raw_len % itemsize
    body = a[:n].reshape(itemsize, -1).T.tobytes()
    return body + a[n:].tobytes()


def encode_payload(raw, kind: int, *, compress: bool = True, shuffle_itemsize: int = 0) -> list:
    """Frame `raw` (any bytes-like) -> list of buffers to write in order.

    Returns buffers rather than one joined bytes so a raw block is written
    straight from the caller's memory without a copy.
    """
    mv = memoryview(raw).cast("B")
    raw_len = mv.nbytes
    if raw_len > MAX_RAW_LEN:
        raise FormatError(f"object of {raw_len} bytes exceeds the cap {MAX_RAW_LEN}")
    if compress and raw_len >= 64:
        sample = mv[:_SAMPLE]
        if shuffle_itemsize > 1:
            sample = _shuffle(sample, shuffle_itemsize)
        probe = lz4.block.compress(sample, store_size=False)
        if len(probe) <= _WORTH * len(sample):
            if shuffle_itemsize > 1:
                comp = lz4.block.compress(_shuffle(mv, shuffle_itemsize), store_size=False)
                codec, itemsize = CODEC_SHUFFLE_LZ4, shuffle_itemsize
            else:
                comp = lz4.block.compress(mv, store_size=False)
                codec, itemsize = CODEC_LZ4, 1
            if len(comp) <= _WORTH * raw_len:
                return [encode_header(codec, itemsize, kind, raw_len), comp]
    return [encode_header(CODEC_RAW, 1, kind, raw_len), mv]


def decode_payload(hdr: Header, data, out=None):
    """Undo the codec. `data` is the bytes after the header. Sizes are checked
    against the header before anything is allocated; returns a bytes-like of
    exactly hdr.raw_len bytes (or writes into `out` and returns it)."""
    if hdr.codec == CODEC_RAW:
        if len(data) != hdr.raw_len:
            raise FormatError(f"raw object holds {len(data)} bytes, header says {hdr.raw_len}")
        if out is not None:
            memoryview(out).cast("B")[:] = data
            return out
        return data
    # lz4 cannot expand more than 255x; a tiny payload claiming a huge size is hostile.
    if hdr.raw_len > 255 * len(data) + 16:
        raise FormatError(f"compressed object of {len(data)} bytes claims {hdr.raw_len} raw bytes")
    try:
        raw = lz4.block.decompress(data, uncompressed_size=hdr.raw_len)
    except Exception as e:  # lz4.block.LZ4BlockError and friends
        raise FormatError(f"lz4 payload does not decode: {e}") from None
    if len(raw) != hdr.raw_len:
        raise FormatError(f"payload decodes to {len(raw)} bytes, header says {hdr.raw_len}")
    if hdr.codec == CODEC_SHUFFLE_LZ4:
        raw = _unshuffle(raw, hdr.itemsize, hdr.raw_len)
    if out is not None:
        memoryview(out).cast("B")[:] = raw
        return out
    return raw
