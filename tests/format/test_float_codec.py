"""The float codec (frame codec 3) and open_store(compression=...).

Round trips are bit-exact for every float width and any length; hostile frames
raise FormatError (IntegrityError through a store) before anything big is
allocated; the option picks what is written, never what can be read, and never
an address."""
from __future__ import annotations

import os
import struct

import numpy as np
import pyzstd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch

import tensorstore_ck as tsck
from tensorstore_ck.errors import FormatError
from tensorstore_ck.format import frame

from _util import assert_same, recode_blocks

FLOATS = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
SUB = frame.FLOAT_SUBHEADER


def weights(n, dt, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(dt)


def raw_of(t) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def float_frame(raw: bytes, k: int, use=(True, True, True, False)) -> bytes:
    """A codec-3 frame of `raw`, whatever the probe would pick."""
    bufs = frame._float_encode(memoryview(raw), k, list(use))
    body = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
    return frame.encode_header(frame.CODEC_FLOAT, k, frame.KIND_BLOCK, len(raw)) + body


def decode(blob: bytes, out=None):
    hdr = frame.decode_header(blob[:frame.HEADER_SIZE])
    return frame.decode_payload(hdr, memoryview(blob)[frame.HEADER_SIZE:], out)


def special(dt) -> bytes:
    """Every awkward bit pattern of the width: NaNs with payloads and both signs,
    +-0, +-inf, the smallest and largest subnormals and normals, and random bits."""
    k = torch.empty((), dtype=dt).element_size()
    ut = {2: np.uint16, 4: np.uint32, 8: np.uint64}[k]
    bits = 8 * k
    ebits = {torch.bfloat16: 8, torch.float16: 5, torch.float32: 8, torch.float64: 11}[dt]
    mbits = bits - 1 - ebits
    sign, expo, mant = 1 << (bits - 1), ((1 << ebits) - 1) << mbits, (1 << mbits) - 1
    pats = [0, sign, expo, sign | expo, expo | 1, expo | mant, sign | expo | (1 << (mbits - 1)) | 5,
            1, mant, sign | 1, sign | mant, 1 << mbits, (expo - (1 << mbits)) | mant]
    rng = np.random.default_rng(bits)
    rand = rng.integers(0, 256, 4096 * k, dtype=np.uint8).view(ut)
    return np.concatenate([np.array(pats, dtype=ut)] * 7 + [rand]).tobytes()


@pytest.mark.parametrize("dt", FLOATS, ids=str)
@pytest.mark.parametrize("n,tail", [(0, 0), (1, 0), (3, 1), (100, 0), (1001, 3), (70_000, 0), (4097, 1)])
def test_round_trip_is_bit_exact(dt, n, tail):
    k = torch.empty((), dtype=dt).element_size()
    raw = raw_of(weights(n, dt, seed=n)) + bytes(range(7, 7 + tail % k))
    for use in ((True, True, True, False), (False, False, False, False), (True, False, False, False)):
        blob = float_frame(raw, k, use)
        assert blob[5] == frame.CODEC_FLOAT and blob[6] == k
        assert bytes(decode(blob)) == raw
        out = bytearray(len(raw))
        assert decode(blob, out) is out and bytes(out) == raw
    # through the probe: whatever encode_payload picks decodes back
    blob = b"".join(bytes(memoryview(b).cast("B")) for b in
                    frame.encode_payload(raw, frame.KIND_BLOCK, float_itemsize=k))
    assert bytes(decode(blob)) == raw


@pytest.mark.parametrize("dt", FLOATS, ids=str)
def test_special_values_are_bit_exact(dt):
    k = torch.empty((), dtype=dt).element_size()
    raw = special(dt)
    for cut in (0, 1, k - 1):
        r = raw[:len(raw) - cut]
        assert bytes(decode(float_frame(r, k))) == r
        assert bytes(decode(float_frame(r, k, (False,) * 4))) == r


@pytest.mark.parametrize("dt,k,target", [(torch.bfloat16, 2, 1.40), (torch.float32, 4, 1.15)], ids=["bf16", "fp32"])
def test_the_probe_picks_the_float_codec_for_weights(dt, k, target):
    raw = raw_of(weights(1 << 20, dt))
    bufs = frame.encode_payload(raw, frame.KIND_BLOCK, float_itemsize=k)
    blob = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
    assert blob[5] == frame.CODEC_FLOAT
    assert len(raw) / len(blob) >= target
    assert bytes(decode(blob)) == raw


def test_other_data_gets_lz4_or_raw():
    zeros = bytes(1 << 20)  # lz4 holds more than the float codec's 255x bound
    b = frame.encode_payload(zeros, frame.KIND_BLOCK, float_itemsize=4)
    assert bytes(b[0])[5] == frame.CODEC_LZ4
    noise = np.random.default_rng(1).integers(0, 256, 1 << 18, dtype=np.uint8).tobytes()
    b = frame.encode_payload(noise, frame.KIND_BLOCK, float_itemsize=4)
    assert bytes(b[0])[5] == frame.CODEC_RAW
    tiny = raw_of(weights(3, torch.float32))  # under 64 bytes: never coded
    assert bytes(frame.encode_payload(tiny, frame.KIND_BLOCK, float_itemsize=4)[0])[5] == frame.CODEC_RAW


# -- hostile frames ---------------------------------------------------------------------

def _parts(blob: bytes):
    """(header, list of (codec, plane bytes))."""
    body = blob[frame.HEADER_SIZE:]
    planes, pos = [], SUB
    for i in range(4):
        c, n = struct.unpack_from("<BI", body, 2 + 5 * i)
        planes.append([c, body[pos:pos + n]])
        pos += n
    return blob[:frame.HEADER_SIZE], planes


def _join(hdr: bytes, planes, *, variant=0, count=4, sizes=None, extra=b"") -> bytes:
    sizes = sizes or [len(p) for _, p in planes]
    sub = struct.pack("<BB", variant, count) + b"".join(struct.pack("<BI", c, s) for (c, _), s in zip(planes, sizes))
    return hdr + sub + b"".join(p for _, p in planes) + extra


def _hostile():
    raw = raw_of(weights(4096, torch.float32)) + b"\x09"
    blob = float_frame(raw, 4)
    hdr, planes = _parts(blob)
    assert planes[0][0] == 1 and planes[2][0] == 0  # exponents zstd-coded, mantissa raw
    e = planes[0][1]
    n = 4096
    bad = {
        "truncated": blob[:-1],
        "truncated plane": blob[:frame.HEADER_SIZE + SUB + 10],
        "short sub-header": blob[:frame.HEADER_SIZE + SUB - 1],
        "extra bytes": blob + b"\0",
        "variant": _join(hdr, planes, variant=1),
        "plane count": _join(hdr, planes, count=3),
        "plane sizes lie": _join(hdr, planes, sizes=[len(e) - 1, n + 1, 3 * n - 1, 1]),
        "raw plane too short": _join(hdr, [planes[0], [0, planes[1][1][:-1]], planes[2], planes[3]]),
        "plane codec 2": _join(hdr, [[2, e]] + planes[1:]),
        "zstd tail plane": _join(hdr, planes[:3] + [[1, planes[3][1]]]),
        "zstd plane larger than raw": _join(hdr, [[1, e + bytes(n)]] + planes[1:]),
        "not zstd": _join(hdr, [[1, b"\0" * len(e)]] + planes[1:]),
        "zstd of another size": _join(hdr, [[1, pyzstd.compress(bytes(n - 1))]] + planes[1:]),
        "zstd without size": _join(hdr, [[1, _no_size(bytes(n))]] + planes[1:]),
        "zstd bomb": _join(hdr, [[1, e[:4] + b"\xff" * 4 + e[8:]]] + planes[1:]),
        "zstd cut": _join(hdr, [[1, e[:-3]]] + planes[1:]),
        "zstd then more": _join(hdr, [[1, pyzstd.compress(bytes(n - 8)) + pyzstd.compress(bytes(8))]] + planes[1:]),
        "zstd flipped": _join(hdr, [[1, e[:len(e) // 2] + bytes([e[len(e) // 2] ^ 0x55]) + e[len(e) // 2 + 1:]]]
                              + planes[1:]),
        "claims 2 GiB": frame.encode_header(frame.CODEC_FLOAT, 4, frame.KIND_BLOCK, 2**31 - 1) + blob[16:],
    }
    return raw, blob, bad


def _no_size(data: bytes) -> bytes:
    c = pyzstd.ZstdCompressor({pyzstd.CParameter.contentSizeFlag: 0})
    return c.compress(data) + c.flush()


def test_hostile_float_frames_raise_format_error():
    raw, blob, bad = _hostile()
    assert bytes(decode(blob)) == raw
    for name, b in bad.items():
        if name == "zstd flipped":
            # zstd frames carry no checksum here (the BLAKE3 address is the check):
            # a flipped byte decodes to other bytes or fails; never more than raw_len
            try:
                got = decode(b)
            except FormatError:
                continue
            assert len(got) == len(raw)
            continue
        with pytest.raises(FormatError):
            decode(b)
        with pytest.raises(FormatError):
            decode(b, bytearray(len(raw)))


def test_a_bad_itemsize_for_the_float_codec_is_refused():
    blob = bytearray(float_frame(raw_of(weights(64, torch.float32)), 4))
    for k in (0, 1, 3, 16):
        blob[6] = k
        with pytest.raises(FormatError):
            frame.decode_header(bytes(blob))


def test_a_zstd_bomb_is_refused_before_it_is_inflated():
    """A plane declaring far more than the header lets it is refused by its frame
    header, before zstd allocates (here: 1 GiB of zeros in a tiny frame)."""
    raw = raw_of(weights(4096, torch.float32))
    hdr, planes = _parts(float_frame(raw, 4))
    bomb = pyzstd.compress(bytes(1 << 26))
    assert len(bomb) < 4096
    with pytest.raises(FormatError, match="declares"):
        decode(_join(hdr, [[1, bomb]] + planes[1:]))


def test_hostile_float_blocks_in_a_store_raise_integrity_error(tmp_path):
    t = weights(1 << 16, torch.float32)
    with tsck.open_store(tmp_path / "s", compression="float") as s:
        s.put_snapshot({"w": t}, ref="j/main")
        blocks = [p for p in (tmp_path / "s" / "blocks").rglob("*") if p.is_file()]
        floats = [p for p in blocks if p.read_bytes()[5] == frame.CODEC_FLOAT]
        assert floats
        _, _, bad = _hostile()
        orig = floats[0].read_bytes()
        hdr, planes = _parts(orig)
        for cut in (orig[:-1], orig + b"\0", _join(hdr, planes, sizes=[len(planes[0][1]) + 1] +
                                                  [len(p) for _, p in planes[1:-1]] + [0])):
            floats[0].write_bytes(cut)
            with pytest.raises(tsck.IntegrityError):
                s.checkout("j/main")
        floats[0].write_bytes(orig)
        assert_same(s.checkout("j/main"), {"w": t})


# -- the store option -----------------------------------------------------------------

def _codecs(path) -> set:
    return {p.read_bytes()[5] for p in (path / "blocks").rglob("*") if p.is_file()}


def _state():
    return {"w32": weights(1 << 18, torch.float32, 1), "w16": weights(1 << 18, torch.bfloat16, 2),
            "h": weights(1 << 16, torch.float16, 3), "d": weights(1 << 16, torch.float64, 4),
            "ids": torch.arange(100_000), "z": torch.zeros(1 << 16)}


@pytest.mark.parametrize("compression,expect", [("none", {0}), ("lz4", {0, 1}), ("float", {1, 3}),
                                                ("auto", {0, 1})])
def test_compression_option_picks_the_codecs(tmp_path, compression, expect):
    state = _state()
    with tsck.open_store(tmp_path / "s", compression=compression) as s:
        s.put_snapshot(state, ref="j/main")
        assert _codecs(tmp_path / "s") == expect
        assert_same(s.checkout("j/main"), state)


def test_every_store_reads_every_codec_and_addresses_do_not_change(tmp_path):
    state = _state()
    for c in ("none", "lz4", "float"):
        with tsck.open_store(tmp_path / c, compression=c) as s:
            s.put_snapshot(state, ref="j/main")
    # block names are the BLAKE3 of the raw bytes (commits differ: time, store id)
    names = {c: sorted(p.name for p in (tmp_path / c / "blocks").rglob("*") if p.is_file())
             for c in ("none", "lz4", "float")}
    assert names["none"] == names["lz4"] == names["float"]
    # a store written with one option, opened with another: reads all, dedups all
    with tsck.open_store(tmp_path / "float", compression="none", create=False) as s:
        assert_same(s.checkout("j/main"), state)
        assert s.put_snapshot(state, ref="j/again").blocks_new == 0
    with tsck.open_store(tmp_path / "none", compression="float", create=False) as s:
        assert s.put_snapshot(state, ref="j/again").blocks_new == 0
    assert _codecs(tmp_path / "none") == {0}


def test_verification_catches_a_changed_float_block(tmp_path):
    """A float frame that decodes to other bytes (a flipped mantissa byte in a raw
    plane) is caught by the BLAKE3 check, as for every codec."""
    state = {"w": weights(1 << 16, torch.float32)}
    with tsck.open_store(tmp_path / "s", compression="float") as s:
        s.put_snapshot(state, ref="j/main")
        p = next(p for p in (tmp_path / "s" / "blocks").rglob("*") if p.is_file() and p.read_bytes()[5] == 3)
        b = bytearray(p.read_bytes())
        b[-5] ^= 0x10  # in the raw mantissa plane T
        p.write_bytes(bytes(b))
        with pytest.raises(tsck.IntegrityError):
            s.checkout("j/main")


@pytest.mark.parametrize("kw", [dict(compression="zstd"), dict(compression=None), dict(compression="FLOAT"),
                                dict(compression=1)])
def test_bad_compression_options_write_nothing(tmp_path, kw):
    path = tmp_path / "new"
    with pytest.raises(tsck.InvalidArgument):
        tsck.open_store(path, **kw)
    assert not path.exists()


def test_codec_2_blocks_are_read(tmp_path):
    """No store writes the byte-shuffle codec (2) now; a store that holds its blocks reads
    them, verified, whatever its compression= (recode_blocks makes such a store)."""
    t = torch.arange(100_000, dtype=torch.float32) * 0.001
    with tsck.open_store(tmp_path / "s", compression="lz4") as s:
        s.put_snapshot({"t": t}, ref="j/main")
    assert recode_blocks(tmp_path / "s", shuffle_itemsize=4)
    assert frame.CODEC_SHUFFLE_LZ4 in _codecs(tmp_path / "s")
    for compression in ("float", "none"):
        with tsck.open_store(tmp_path / "s", create=False, compression=compression) as s:
            assert_same(s.checkout("j/main"), {"t": t})
            assert s.fsck().ok


def test_auto_is_lz4_on_local_disk_and_memory(tmp_path):
    with tsck.open_store(tmp_path / "s") as s:
        assert s.codecs == "lz4"
    with tsck.open_store("memory://tsck-auto-codec") as s:
        assert s.codecs == "lz4"


@pytest.mark.slow
def test_auto_is_float_on_s3(s3_server, s3_url):
    state = {"w": weights(1 << 18, torch.bfloat16)}
    with tsck.open_store(s3_url, storage_options=s3_server, refs="memory://tsck-auto-s3") as s:
        assert s.codecs == "float"
        s.put_snapshot(state, ref="j/main")
        assert_same(s.checkout("j/main"), state)


@settings(max_examples=150, deadline=None)
@given(data=st.binary(min_size=0, max_size=3000), k=st.sampled_from(frame.FLOAT_ITEMSIZES),
       use=st.lists(st.booleans(), min_size=4, max_size=4))
def test_any_bytes_round_trip(data, k, use):
    """Lossless for any bytes, not only floats (the probe may pick it for integers)."""
    assert bytes(decode(float_frame(data, k, use))) == data


# ---------------------------------------------------------------- memory of a hostile block
_DECODE_RSS = """
import sys
from tensorstore_ck.format import frame

def hwm():  # this process's peak RSS (per address space: unlike ru_maxrss, not the parent's)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024

blob = open(sys.argv[1], "rb").read()
hdr = frame.decode_header(blob[:frame.HEADER_SIZE])
out = bytearray(hdr.raw_len) if sys.argv[2] == "into" else None
if out is not None:
    out[::4096] = b"\\1" * len(out[::4096])  # touch every page: the output counts before the decode
before = hwm()
res = frame.decode_payload(hdr, memoryview(blob)[frame.HEADER_SIZE:], out)
after = hwm()
assert memoryview(res).nbytes == hdr.raw_len and not any(memoryview(res).cast("B")[-4096:])
print(after - before)
"""


def _hostile_float_block(raw_len: int) -> bytes:
    """A block of zeros as the float codec stores it, its T plane padded with enough
    incompressible bytes that it stays within the 255x expansion every reader allows:
    one byte of store per 255 bytes of memory."""
    k, n = 4, raw_len // 4
    e = f = np.zeros(n, dtype=np.uint8)
    t = np.zeros(2 * n, dtype=np.uint8)
    t[:raw_len // 250] = np.random.default_rng(0).integers(0, 256, raw_len // 250, dtype=np.uint8)
    zc = pyzstd.ZstdCompressor(frame._ZSTD_FAST)
    planes = [zc.compress(p, zc.FLUSH_FRAME) for p in (e, f, t)]
    sub = struct.pack("<BB", 0, 4) + b"".join(struct.pack("<BI", 1, len(p)) for p in planes) \
        + struct.pack("<BI", 0, 0)
    payload = sub + b"".join(planes)
    assert raw_len <= 255 * len(payload) + 16
    return frame.encode_header(frame.CODEC_FLOAT, k, frame.KIND_BLOCK, raw_len) + payload


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["into", "fresh"])
def test_a_hostile_float_block_costs_its_output_and_a_few_mib(tmp_path, mode):
    """docs/FORMAT.md's bound: decoding a float block holds its output buffer plus at most
    32 MiB (slices of the planes and the zstd windows), whatever its size. The planes
    were decoded whole: 3x the block per worker (four 256 MiB blocks of a 4.8 MB store
    took 2.7 GB to fsck). Peak RSS of a process that decodes one, measured."""
    import _zygote as zygote
    import sys
    from pathlib import Path

    if not os.path.exists("/proc/self/status"):
        pytest.skip("peak RSS is read from /proc/self/status (Linux)")
    raw_len = 128 << 20
    blob = tmp_path / "block"
    blob.write_bytes(_hostile_float_block(raw_len))
    assert blob.stat().st_size < raw_len // 200
    repo = Path(__file__).resolve().parents[2]
    r = zygote.run([sys.executable, "-c", _DECODE_RSS, str(blob), mode], capture_output=True, text=True,
                   timeout=300, env={**os.environ, "PYTHONPATH": str(repo)}, cwd=str(repo), fresh=True)
    assert r.returncode == 0, r.stderr
    grew = int(r.stdout.split()[-1])
    bound = (32 << 20) + (raw_len if mode == "fresh" else 0)
    assert grew <= bound, f"decoding took {grew >> 20} MiB above the output, bound {bound >> 20} MiB"


def test_a_zstd_plane_asking_for_a_large_window_is_refused():
    """A plane's decoder may take a window of at most 2^20 bytes (the writer's are at
    most 2^19); a frame declaring a 4 MiB single-segment window is refused, not given it."""
    n = 4 << 20
    e = np.random.default_rng(0).integers(0, 4, n, dtype=np.uint8)
    big = pyzstd.compress(e, {pyzstd.CParameter.windowLog: 23, pyzstd.CParameter.compressionLevel: 3})
    zc = pyzstd.ZstdCompressor(frame._ZSTD_FAST)
    zeros = [zc.compress(np.zeros(m, np.uint8), zc.FLUSH_FRAME) for m in (n, 2 * n)]
    planes = [big] + zeros
    payload = struct.pack("<BB", 0, 4) + b"".join(struct.pack("<BI", 1, len(p)) for p in planes) \
        + struct.pack("<BI", 0, 0) + b"".join(planes)
    with pytest.raises(FormatError, match="too much memory"):
        frame.decode_payload(frame.Header(frame.CODEC_FLOAT, 4, frame.KIND_BLOCK, 4 * n), payload)
    # the same plane as the writer codes it decodes
    ok = [zc.compress(e, zc.FLUSH_FRAME)] + zeros
    payload = struct.pack("<BB", 0, 4) + b"".join(struct.pack("<BI", 1, len(p)) for p in ok) \
        + struct.pack("<BI", 0, 0) + b"".join(ok)
    out = frame.decode_payload(frame.Header(frame.CODEC_FLOAT, 4, frame.KIND_BLOCK, 4 * n), payload)
    assert np.frombuffer(out, np.uint8).reshape(n, 4)[:, 3].tolist()[:5] == (e >> 1).tolist()[:5]


_FSCK_RSS = """
import sys
import tensorstore_ck as tsck

def hwm():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024

with tsck.open_store(sys.argv[1]) as s:
    before = hwm()
    rep = s.fsck()
    after = hwm()
assert rep.ok, rep.findings
print(after - before)
"""


@pytest.mark.slow
def test_fsck_of_a_hostile_float_block_holds_one_block(tmp_path):
    """A 0.5 MB block that decodes to 128 MiB: fsck verifies it holding the block once
    (and the 32 MiB of FORMAT.md's bound), where it held it three times."""
    import _zygote as zygote
    import sys
    from pathlib import Path

    import blake3

    from tensorstore_ck.core.assets import block_key
    from tensorstore_ck.format.manifest import encode_node

    if not os.path.exists("/proc/self/status"):
        pytest.skip("peak RSS is read from /proc/self/status (Linux)")
    raw_len = 128 << 20
    blob = _hostile_float_block(raw_len)
    path = tmp_path / "s"
    with tsck.open_store(path) as s:
        d = blake3.blake3(frame.decode_payload(frame.decode_header(blob[:16]), memoryview(blob)[16:])).digest()
        (path / block_key(d)).parent.mkdir(parents=True, exist_ok=True)
        (path / block_key(d)).write_bytes(blob)
        leaf = {"T": {"dt": "float32", "sh": [raw_len // 4], "n": raw_len, "bs": raw_len, "b": [d]}}
        top = s.assets.put_node(encode_node({"d": [["w", leaf]]})).digest
        s.assets.sync()
        stats = {"bytes_total": raw_len, "bytes_new": 0, "blocks_total": 1, "blocks_new": 0}
        s.commit_tree(top, ref="h/x", job="h", step=1, metrics={}, meta={}, stats=stats)
    repo = Path(__file__).resolve().parents[2]
    r = zygote.run([sys.executable, "-c", _FSCK_RSS, str(path)], capture_output=True, text=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(repo)}, cwd=str(repo), fresh=True)
    assert r.returncode == 0, r.stderr
    grew = int(r.stdout.split()[-1])
    assert grew <= raw_len + (48 << 20), f"fsck took {grew >> 20} MiB for a {raw_len >> 20} MiB block"


@pytest.mark.slow
def test_an_object_declaring_more_than_its_kind_holds_is_not_decoded(tmp_path):
    """fsck --repair re-verifies a damaged object on its own (no manifest says its size):
    a 1 MB lz4 block declaring 256 MiB + 4 KiB, more than any block holds, is corrupt
    from its header, not inflated (a frame may declare up to 2 GiB)."""
    import blake3
    import lz4.block

    from tensorstore_ck.core.assets import block_key
    from tensorstore_ck.format.tree import MAX_BLOCK_SIZE

    raw = bytes(MAX_BLOCK_SIZE + 4096)
    d = blake3.blake3(raw).digest()
    blob = frame.encode_header(frame.CODEC_LZ4, 1, frame.KIND_BLOCK, len(raw)) + \
        lz4.block.compress(raw, store_size=False)
    del raw
    with tsck.open_store(tmp_path / "s") as s:
        (tmp_path / "s" / block_key(d)).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "s" / block_key(d)).write_bytes(blob)
        err, data = s.assets.verify_stored(block_key(d))
        assert data is None and err is not None and "more than its kind may hold" in str(err), err
