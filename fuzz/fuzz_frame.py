"""Fuzz target: the object frame (tensorstore_ck/format/frame.py) and the
verified object reads built on it (Assets: blocks, nodes, commits).

Input: the bytes of one stored object file (16-byte header + payload), as
found under blocks/, nodes/ and commits/ of a store (seeds: fuzz/corpus/frame/).

Contract, for every input:
1. decode_header + decode_payload return a Header whose fields are in range
   and exactly raw_len bytes (also when decoding into a caller's buffer), or
   raise FormatError; never more than 255 * len(payload) + 16 bytes.
2. The same bytes planted in a memory:// store at the address of their decoded
   payload read back through Assets (block with its expected length, node or
   commit, verify on and off) as exactly the decoded bytes; a wrong kind or
   length, or bytes that do not decode, raise IntegrityError. Assets and the
   frame decoder never disagree on whether an object decodes.
3. encode_payload(x) decodes back to x for every codec option (the float codec
   included: seeds float-* hold float-codec frames, fuzz/make_corpus.py).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
from _common import ContractViolation  # noqa: E402

with _common.instrument(__name__ == "__main__"):
    import blake3
    from tensorstore_ck.core.assets import KIND_PREFIX, Assets
    from tensorstore_ck.errors import FormatError, IntegrityError, TsckError
    from tensorstore_ck.format import frame
    from tensorstore_ck.storage import FsspecBlockStore

_STORAGE = None


def _storage():
    global _STORAGE
    if _STORAGE is None:
        _STORAGE = FsspecBlockStore("memory://tsck-fuzz-frame")
    return _STORAGE


def _decode(data: bytes):
    """-> (header, raw) or (None, FormatError)."""
    try:
        hdr = frame.decode_header(data)
    except FormatError as e:
        return None, e
    if hdr.codec not in (frame.CODEC_RAW, frame.CODEC_LZ4, frame.CODEC_SHUFFLE_LZ4, frame.CODEC_FLOAT) \
            or hdr.kind not in (frame.KIND_BLOCK, frame.KIND_NODE, frame.KIND_COMMIT) \
            or not 1 <= hdr.itemsize <= 255 or not 0 <= hdr.raw_len <= frame.MAX_RAW_LEN \
            or (hdr.codec == frame.CODEC_FLOAT and hdr.itemsize not in frame.FLOAT_ITEMSIZES) \
            or (hdr.codec in (frame.CODEC_RAW, frame.CODEC_LZ4) and hdr.itemsize != 1):
        raise ContractViolation(f"decode_header accepted an out-of-range header {hdr}")
    if frame.encode_header(hdr.codec, hdr.itemsize, hdr.kind, hdr.raw_len) != bytes(data[:frame.HEADER_SIZE]):
        raise ContractViolation("decode_header accepted a non-canonical header")
    payload = data[frame.HEADER_SIZE:]
    try:
        raw = frame.decode_payload(hdr, payload)
    except FormatError as e:
        return hdr, e
    if len(raw) != hdr.raw_len:
        raise ContractViolation(f"decode_payload returned {len(raw)} bytes, header says {hdr.raw_len}")
    if hdr.codec != frame.CODEC_RAW and hdr.raw_len > 255 * len(payload) + 16:
        raise ContractViolation("decode_payload inflated past lz4's bound")
    out = bytearray(hdr.raw_len)
    got = frame.decode_payload(hdr, payload, out)
    if got is not out or bytes(out) != bytes(raw):
        raise ContractViolation("decode_payload into a buffer differs from decode_payload")
    return hdr, bytes(raw)


def _check_assets(data: bytes, hdr, raw) -> None:
    storage = _storage()
    assets = Assets(storage)
    ok = not isinstance(raw, FormatError)
    d = blake3.blake3(raw).digest() if ok else blake3.blake3(data).digest()
    kinds = (hdr.kind,) if hdr is not None else (frame.KIND_BLOCK,)
    for kind in sorted(set(kinds) | {frame.KIND_BLOCK}):
        key = f"{KIND_PREFIX[kind]}/{d.hex()[:2]}/{d.hex()}"
        storage.put_if_absent(key, [data])
        try:
            for verify in (False, True):
                expect_len = hdr.raw_len if hdr is not None and hdr.raw_len <= 1 << 22 else len(data)
                try:
                    if kind == frame.KIND_BLOCK:
                        buf = bytearray(expect_len)
                        assets.read_block_into(d, buf, verify=verify)
                        got = bytes(buf)
                    elif kind == frame.KIND_NODE:
                        got = assets.get_node(d, verify=verify)
                    else:
                        got = assets.get_commit(d, verify=verify)
                except IntegrityError as e:
                    if ok and hdr.kind == kind and (kind != frame.KIND_BLOCK or expect_len == hdr.raw_len):
                        raise ContractViolation(f"Assets refused an object the frame decoder accepts: {e}") from None
                    continue
                if not ok or hdr.kind != kind:
                    raise ContractViolation("Assets returned an object the frame decoder refuses "
                                            f"(or of another kind): {raw if not ok else hdr}")
                if got != raw:
                    raise ContractViolation("Assets returned other bytes than the frame decoder")
            q = assets.check_quick(kind, d, hdr.raw_len if hdr is not None else None)
            if ok and hdr.kind == kind and q is not None:
                raise ContractViolation(f"check_quick flags a decodable object: {q}")
            if q is not None and not isinstance(q, IntegrityError):
                raise ContractViolation(f"check_quick returned {q!r}")
        finally:
            storage.delete(key)


def _check_roundtrip(data: bytes) -> None:
    if not data:
        return
    opt = data[0]
    kind = opt % 3
    compress = bool(opt & 4)
    shuffle = (0, 1, 2, 3, 4, 8, 16, 255)[(opt >> 3) % 8]
    floats = (0, 2, 4, 8)[opt >> 6]
    bufs = frame.encode_payload(data, kind, compress=compress, shuffle_itemsize=shuffle, float_itemsize=floats)
    blob = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
    hdr = frame.decode_header(blob)
    if hdr.kind != kind or hdr.raw_len != len(data):
        raise ContractViolation(f"encode_payload wrote header {hdr} for {len(data)} bytes of kind {kind}")
    if bytes(frame.decode_payload(hdr, blob[frame.HEADER_SIZE:])) != data:
        raise ContractViolation(f"encode/decode round trip differs (codec {hdr.codec}, itemsize {hdr.itemsize})")


def TestOneInput(data: bytes) -> None:
    data = bytes(data)
    hdr, raw = _decode(data)
    try:
        _check_assets(data, hdr, raw)
    except TsckError:
        pass
    _check_roundtrip(data)


if __name__ == "__main__":
    _common.atheris_main(TestOneInput, ["-max_len=65536"])
