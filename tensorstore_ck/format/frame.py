"""The object frame: a fixed 16-byte header, then the (maybe compressed) payload.

    offset size  field
    0      4     magic b"TSKO"
    4      1     frame version (1)
    5      1     codec: 0 raw, 1 lz4 block, 2 byte-shuffle then lz4 block, 3 float planes
    6      1     itemsize for the shuffle and float codecs (1 otherwise)
    7      1     kind: 0 block, 1 manifest node, 2 commit
    8      8     raw_len, little-endian u64: length of the uncompressed payload

The address of an object is the BLAKE3-256 of its *raw* payload, so the codec
never changes the address. Codes here are permanent once released.

Codec 3 (float planes, itemsize 2, 4 or 8; docs/FORMAT.md has the byte layout):
the top 16 bits of each element are rotated left by one bit, which puts the 8
bits after the sign (the whole exponent of bf16/fp32) in one byte; that byte
plane (E), the byte plane below it (F), the remaining low bytes (T, in element
order) and the tail bytes (R) are stored one after another, each zstd-coded or
raw. Trained weights' exponents take 2-3 bits of the 8; mantissas do not shrink.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import threading

import lz4.block
import numpy as np
import pyzstd

from ..errors import FormatError

__all__ = [
    "MAGIC", "FRAME_VERSION", "HEADER_SIZE", "CODEC_RAW", "CODEC_LZ4", "CODEC_SHUFFLE_LZ4",
    "CODEC_FLOAT", "FLOAT_ITEMSIZES",
    "KIND_BLOCK", "KIND_NODE", "KIND_COMMIT", "Header", "encode_header", "decode_header",
    "encode_payload", "decode_payload", "is_raw_block",
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
CODEC_FLOAT = 3
_CODECS = (CODEC_RAW, CODEC_LZ4, CODEC_SHUFFLE_LZ4, CODEC_FLOAT)
FLOAT_ITEMSIZES = (2, 4, 8)

KIND_BLOCK = 0
KIND_NODE = 1
KIND_COMMIT = 2
_KINDS = (KIND_BLOCK, KIND_NODE, KIND_COMMIT)

# lz4's block format cannot describe more than this; also a sanity cap on any one object.
MAX_RAW_LEN = 2**31 - 1

# Compress only if the sample shrinks to this fraction or less: on float weights lz4
# saves ~0% and costs CPU (see docs/design/codecs.md, "Compression").
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
    if codec == CODEC_FLOAT:
        if itemsize not in FLOAT_ITEMSIZES:
            raise FormatError(f"bad itemsize {itemsize} for the float codec")
    elif itemsize == 0 or (codec != CODEC_SHUFFLE_LZ4 and itemsize != 1):
        raise FormatError(f"bad itemsize {itemsize} for codec {codec}")
    if raw_len > MAX_RAW_LEN:
        raise FormatError(f"declared object size {raw_len} exceeds the cap {MAX_RAW_LEN}")
    return Header(codec, itemsize, kind, raw_len)


def is_raw_block(head) -> bool:
    """Whether `head` (a frame's first HEADER_SIZE bytes or more) is a sound header of a
    block stored raw: its payload is the block's bytes, whose BLAKE3 is its address."""
    try:
        hdr = decode_header(memoryview(head)[:HEADER_SIZE])
    except FormatError:
        return False
    return hdr.kind == KIND_BLOCK and hdr.codec == CODEC_RAW


def _shuffle(raw, itemsize: int) -> bytes:
    a = np.frombuffer(raw, dtype=np.uint8)
    n = len(a) - len(a) % itemsize
    body = a[:n].reshape(-1, itemsize).T.tobytes()
    return body + a[n:].tobytes()


def _unshuffle_into(data, itemsize: int, res: np.ndarray) -> None:
    a = np.frombuffer(data, dtype=np.uint8)
    n = len(res) - len(res) % itemsize
    res[:n].reshape(-1, itemsize)[...] = a[:n].reshape(itemsize, -1).T
    res[n:] = a[n:]


# -- codec 3: float planes ---------------------------------------------------------
# Payload: u8 variant (0), u8 plane count (4), then per plane E, F, T, R a u8 plane
# codec (0 raw, 1 one zstd frame) and a u32 LE stored length; then the planes' bytes.
_FSUB = struct.Struct("<BB")
_FPLANE = struct.Struct("<BI")
_FLOAT_VARIANT = 0
_NPLANES = 4
FLOAT_SUBHEADER = _FSUB.size + _NPLANES * _FPLANE.size
_PLANE_RAW = 0
_PLANE_ZSTD = 1
# A plane is zstd-coded when its sample shrinks to this or less; mantissa planes do
# not, and storing them raw costs nothing.
_PLANE_WORTH = 0.97

# zstd's fast strategy with a high targetLength barely looks for matches (the
# exponent bytes of weights have few), and literal compression forced on keeps the
# Huffman coding that does the work: 3x faster than level 1 and a little smaller
# (benches/bench_codecs.py). 1002 is ZSTD_c_literalCompressionMode, an experimental
# parameter: a libzstd without it gets level 1 (any zstd decoder reads both).
_ZSTD_FAST = {pyzstd.CParameter.strategy: 1, pyzstd.CParameter.targetLength: 64,
              pyzstd.CParameter.windowLog: 17, pyzstd.CParameter.hashLog: 10,
              pyzstd.CParameter.minMatch: 7, pyzstd.CParameter.checksumFlag: 0, 1002: 1}
_ZSTD_PLAIN = {pyzstd.CParameter.compressionLevel: 1, pyzstd.CParameter.checksumFlag: 0}
_tls = threading.local()
# Elements are little-endian whatever the host (views only; numpy swaps if it must).
_U2 = np.dtype("<u2")
_U4 = np.dtype("<u4")


def _zstd():
    c = getattr(_tls, "zc", None)
    if c is None:
        try:
            c = pyzstd.ZstdCompressor(_ZSTD_FAST)
        except (ValueError, TypeError, pyzstd.ZstdError):
            c = pyzstd.ZstdCompressor(_ZSTD_PLAIN)
        _tls.zc = c
    return c


def _planes(mv, k: int) -> list:
    """Split raw bytes of k-byte floats into the planes E, F, T, R (numpy arrays;
    R a view, the others fresh). With top = the element's top 16 bits,
    E = bits 14..7 of top and F = bits 6..0 of top then its sign (bit 15): the
    bytes of top rotated left by one, computed by shifts and casts (whole-array
    numpy ops: twice as fast here as rotating and picking bytes by stride)."""
    a = np.frombuffer(mv, dtype=np.uint8)
    n = len(a) // k
    w = a[:n * k].view(_U2)
    if k == 2:
        top, t = w, a[:0]
    elif k == 4:  # whole-word shifts and casts: 2.5x faster than u16 picks with a stride
        w32 = a[:n * k].view(_U4)
        top = np.right_shift(w32, 16).astype(np.uint16)
        t = w32.astype(_U2).view(np.uint8)
    else:
        top = w[k // 2 - 1::k // 2]
        t = np.ascontiguousarray(w.reshape(n, k // 2)[:, :k // 2 - 1]).reshape(-1).view(np.uint8)
    tmp = np.right_shift(top, 7)
    e = tmp.astype(np.uint8)
    rot = np.left_shift(top, 1)
    rot |= np.right_shift(top, 15, out=tmp)
    f = rot.astype(np.uint8)
    return [e, f, t, a[n * k:]]


def _float_probe(sample, k: int) -> tuple[int, list[bool]]:
    """(coded size of the sample, per plane: whether zstd shrinks it)."""
    zc = _zstd()
    size, use = FLOAT_SUBHEADER, []
    for i, p in enumerate(_planes(sample, k)):
        if i < 3 and p.nbytes:
            c = len(zc.compress(p, zc.FLUSH_FRAME))
            if c <= _PLANE_WORTH * p.nbytes:
                size += c
                use.append(True)
                continue
        size += p.nbytes
        use.append(False)
    return size, use


def float_itemsize_for(raw) -> int:
    """The element size (2, 4 or 8, dividing the length) under which the float codec codes
    a 64 KiB sample of `raw` smallest; 0 when none divides it. For a block coded again from
    a frame that does not record its element size (lz4, raw)."""
    mv = memoryview(raw).cast("B")
    sample = mv[:_SAMPLE]
    ks = [k for k in FLOAT_ITEMSIZES if mv.nbytes % k == 0 and mv.nbytes >= 4 * k]
    return min(ks, key=lambda k: _float_probe(sample[:len(sample) - len(sample) % k], k)[0]) if ks else 0


def _float_encode(mv, k: int, use: list[bool]) -> list:
    """The float payload as buffers: the sub-header, then each plane coded or raw."""
    zc = _zstd()
    entries, bufs = [], []
    for i, p in enumerate(_planes(mv, k)):
        if i < 3 and use[i] and p.nbytes:  # R (under k bytes) is raw by the format
            c = zc.compress(p, zc.FLUSH_FRAME)
            if len(c) < p.nbytes:
                entries.append((_PLANE_ZSTD, len(c)))
                bufs.append(c)
                continue
        entries.append((_PLANE_RAW, p.nbytes))
        bufs.append(memoryview(p))
    sub = _FSUB.pack(_FLOAT_VARIANT, _NPLANES) + b"".join(_FPLANE.pack(c, n) for c, n in entries)
    return [sub] + bufs


# Decoding holds only slices of the planes, never a whole one: the memory a float
# block costs beyond its output buffer is bounded whatever its size (docs/FORMAT.md).
_SLICE = 1 << 20        # elements rebuilt at a time
_ZSTD_IN = 1 << 17      # compressed bytes fed to a plane's decoder at a time
# The writer's frames use windows of at most 2^19 bytes (windowLog 17, or 19 for
# zstd level 1 where libzstd lacks the fast parameters; a plane smaller than its
# window declares its own size). A frame asking for more is not one of ours: refused
# before its window is allocated (zstd's default limit is 2^27, 128 MiB per plane).
ZSTD_WINDOW_LOG_MAX = 20


class _Plane:
    """One stored plane, read front to back in slices: a raw plane is sliced in place,
    a zstd plane is decoded as a stream that must hold exactly `expect` bytes."""

    def __init__(self, i: int, codec: int, data, expect: int):
        self.i, self.data, self.expect, self.pos, self.got = i, data, expect, 0, 0
        self.d = None
        if codec == _PLANE_ZSTD:
            try:
                info = pyzstd.get_frame_info(data)
            except pyzstd.ZstdError as e:
                raise FormatError(f"float plane is not a zstd frame: {e}") from None
            if info.decompressed_size != expect:  # checked before the decoder allocates anything
                raise FormatError(f"zstd plane declares {info.decompressed_size} bytes, expected {expect}")
            self.d = pyzstd.ZstdDecompressor(option={pyzstd.DParameter.windowLogMax: ZSTD_WINDOW_LOG_MAX})

    def _feed(self, max_length: int) -> bytes:
        chunk = b""
        if self.d.needs_input:
            chunk = self.data[self.pos:self.pos + _ZSTD_IN]
            self.pos += len(chunk)
        try:
            return self.d.decompress(chunk, max_length=max_length)
        except pyzstd.ZstdError as e:
            raise FormatError(f"zstd plane does not decode: {e}") from None

    def read(self, n: int) -> np.ndarray:
        """The plane's next n bytes."""
        if self.d is None:
            out = np.frombuffer(self.data[self.pos:self.pos + n], dtype=np.uint8)
            self.pos += n
            return out
        parts, got = [], 0
        while got < n:
            more = self._feed(n - got)
            if not more and self.d.needs_input and self.pos >= len(self.data):
                raise FormatError(f"zstd plane decodes to {self.got + got} bytes (of {self.expect})")
            parts.append(more)
            got += len(more)
        self.got += n
        return np.frombuffer(parts[0] if len(parts) == 1 else b"".join(parts), dtype=np.uint8)

    def finish(self) -> None:
        """The frame ends exactly here: no more bytes, no second frame, nothing after it."""
        if self.d is None:
            return
        while not self.d.eof:
            before = self.pos
            if self._feed(1):
                raise FormatError(f"zstd plane decodes to more than {self.expect} bytes")
            if not self.d.eof and self.pos == before and self.pos >= len(self.data):
                raise FormatError(f"zstd plane decodes to {self.got} bytes (of {self.expect}) and is cut short")
        if self.d.unused_data or self.pos < len(self.data):
            raise FormatError(f"zstd plane decodes to {self.expect} bytes and has trailing bytes")


def _float_decode(data, k: int, raw_len: int, out):
    mv = memoryview(data).cast("B")
    if len(mv) < FLOAT_SUBHEADER:
        raise FormatError(f"float payload of {len(mv)} bytes is shorter than its sub-header")
    variant, nplanes = _FSUB.unpack_from(mv, 0)
    if variant != _FLOAT_VARIANT or nplanes != _NPLANES:
        raise FormatError(f"unknown float payload variant {variant} with {nplanes} planes")
    n = raw_len // k
    want = (n, n, n * (k - 2), raw_len - n * k)
    pos, planes = FLOAT_SUBHEADER, []
    for i in range(_NPLANES):
        codec, size = _FPLANE.unpack_from(mv, _FSUB.size + i * _FPLANE.size)
        if codec not in (_PLANE_RAW, _PLANE_ZSTD) or (codec == _PLANE_RAW and size != want[i]) \
                or (codec == _PLANE_ZSTD and (i == 3 or size >= want[i])):
            raise FormatError(f"float plane {i}: codec {codec} with {size} bytes for {want[i]} raw bytes")
        if pos + size > len(mv):
            raise FormatError(f"float plane {i} runs past the payload ({pos + size} > {len(mv)})")
        planes.append((codec, mv[pos:pos + size]))
        pos += size
    if pos != len(mv):
        raise FormatError(f"float payload holds {len(mv) - pos} bytes after its planes")
    pe, pf, pt = (_Plane(i, c, b, want[i]) for i, (c, b) in enumerate(planes[:3]))
    res = np.empty(raw_len, dtype=np.uint8) if out is None else np.frombuffer(memoryview(out).cast("B"), np.uint8)
    if res.nbytes != raw_len:
        raise FormatError(f"output buffer holds {res.nbytes} bytes, the object {raw_len}")
    # E and F are the bytes of `top` rotated left by one: lay them down as those bytes,
    # then rotate back right in place (1.4-1.8x faster here than building top from
    # u16 shifts of each plane; the zstd plane's decoding is the rest). A slice at a
    # time, straight into the output: the planes are never whole in memory.
    m0 = min(n, _SLICE)
    scratch = np.empty(m0, dtype=_U2) if k > 2 else None
    tmp = np.empty(m0, dtype=_U2)
    for i0 in range(0, n, _SLICE):
        m = min(_SLICE, n - i0)
        w = res[i0 * k:(i0 + m) * k].view(_U2)
        top = w if k == 2 else scratch[:m]
        tb = top.view(np.uint8).reshape(m, 2)
        tb[:, 1] = pe.read(m)
        tb[:, 0] = pf.read(m)
        np.left_shift(top, 15, out=tmp[:m])
        np.right_shift(top, 1, out=top)
        top |= tmp[:m]
        if k > 2:
            wk = w.reshape(m, k // 2)
            wk[:, k // 2 - 1] = top
            wk[:, :k // 2 - 1] = pt.read(m * (k - 2)).view(_U2).reshape(m, k // 2 - 1)
    for p in (pe, pf, pt):
        p.finish()
    res[n * k:] = np.frombuffer(planes[3][1], dtype=np.uint8)
    return out if out is not None else res


def encode_payload(raw, kind: int, *, compress: bool = True, shuffle_itemsize: int = 0,
                   float_itemsize: int = 0) -> list:
    """Frame `raw` (any bytes-like) -> list of buffers to write in order.

    Returns buffers rather than one joined bytes so a raw block is written
    straight from the caller's memory without a copy. compress=False: raw.
    Otherwise a 64 KiB sample picks the codec: float_itemsize 2/4/8 tries the
    float codec against lz4, shuffle_itemsize > 1 byte-shuffles before lz4 (codec 2,
    which no store writes: the tests, fuzz targets and benches make such frames);
    whatever wins is kept if it shrinks the block to 90% or less.
    """
    mv = memoryview(raw).cast("B")
    raw_len = mv.nbytes
    if raw_len > MAX_RAW_LEN:
        raise FormatError(f"object of {raw_len} bytes exceeds the cap {MAX_RAW_LEN}")
    if compress and raw_len >= 64:
        sample = mv[:_SAMPLE]
        if float_itemsize in FLOAT_ITEMSIZES and raw_len >= 4 * float_itemsize:
            fsize, use = _float_probe(sample, float_itemsize)
            if fsize <= _WORTH * len(sample) and fsize < len(lz4.block.compress(sample, store_size=False)):
                bufs = _float_encode(mv, float_itemsize, use)
                size = sum(memoryview(b).nbytes for b in bufs)
                # The decoder's bound on expansion (255x, as lz4's); beyond it lz4 will do.
                if size <= _WORTH * raw_len and raw_len <= 255 * size:
                    return [encode_header(CODEC_FLOAT, float_itemsize, kind, raw_len)] + bufs
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
    # lz4 cannot expand more than 255x, and the float codec's writer holds to the
    # same bound; a tiny payload claiming a huge size is hostile.
    if hdr.raw_len > 255 * len(data) + 16:
        raise FormatError(f"compressed object of {len(data)} bytes claims {hdr.raw_len} raw bytes")
    if hdr.codec == CODEC_FLOAT:
        return _float_decode(data, hdr.itemsize, hdr.raw_len, out)
    try:
        raw = lz4.block.decompress(data, uncompressed_size=hdr.raw_len)
    except Exception as e:  # lz4.block.LZ4BlockError and friends
        raise FormatError(f"lz4 payload does not decode: {e}") from None
    if len(raw) != hdr.raw_len:
        raise FormatError(f"payload decodes to {len(raw)} bytes, header says {hdr.raw_len}")
    if hdr.codec == CODEC_SHUFFLE_LZ4:  # unshuffled straight into the output: no third copy
        res = np.empty(hdr.raw_len, dtype=np.uint8) if out is None else \
            np.frombuffer(memoryview(out).cast("B"), np.uint8)
        _unshuffle_into(raw, hdr.itemsize, res)
        return out if out is not None else res
    if out is not None:
        memoryview(out).cast("B")[:] = raw
        return out
    return raw
