"""What a tiered store's own puts wrote is uploaded without asking the remote first and
without a second decode: the uploader keeps, for each block and node its process wrote
new in the tier, the frame's length and CRC32 taken from the bytes as they were written
(upload.Uploader.tee). Its upload checks the tier's copy against them (one read, one
CRC32, or for a block kept raw its BLAKE3, not a decode and a BLAKE3) and sends it as
the conditional PUT alone; a copy that changed since is judged whole, as any other
(docs/design/tiers.md, "What this process wrote").

Against a real S3 server (moto, or radosgw via TEST_S3_ENDPOINT): its HEADs and PUTs are
counted by a WrappedStore around the real S3 store."""

from __future__ import annotations

import collections
import threading

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.format import frame
from tensorstore_ck.storage.wrappers import WrappedStore

from _util import tier_state

BS = 16 * 1024
DEADLINE = 120.0

pytestmark = pytest.mark.slow  # a real S3 server


class Asked(WrappedStore):
    """Counts the questions (HEADs) and the writes that reach the remote, by key prefix."""

    def __init__(self, inner):
        super().__init__(inner)
        self.asked: list[str] = []
        self.written: list[str] = []
        self._lock = threading.Lock()

    def size_of(self, key):
        with self._lock:
            self.asked.append(key)
        return self.inner.size_of(key)

    def exists(self, key):
        with self._lock:
            self.asked.append(key)
        return self.inner.exists(key)

    def put_addressed(self, key, bufs):
        new = self.inner.put_addressed(key, bufs)
        if new:
            with self._lock:
                self.written.append(key)
        return new


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(x.equal(y) for x, y in ((a[k], b[k]) for k in a))


def _open(s3_url, s3_server, tmp_path, local: str, wrapped: list, **kw) -> tsck.Store:
    return tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server, block_size=BS,
                           inline_threshold=256, local=str(tmp_path / local), early_upload=False,
                           wrap_storage=lambda s: wrapped.append(Asked(s)) or wrapped[-1], **kw)


def _objects(tier) -> dict[str, set[str]]:
    return {kind: {p.name for p in (tier / kind).rglob("*") if p.is_file()} for kind in ("blocks", "nodes")}


def test_an_upload_sends_what_its_process_wrote_without_asking_first(s3_url, s3_server, tmp_path):
    """A fresh process's first upload (a cold presence record, which asks the remote about
    every object before it writes) sends the blocks and nodes its put wrote with no HEAD,
    each checked by its recorded CRC32; the remote then holds a whole snapshot. A second
    snapshot that changes one tensor again asks nothing about what it wrote new."""
    wrapped: list[Asked] = []
    store = _open(s3_url, s3_server, tmp_path, "nvme", wrapped)
    state = tier_state(1, step=True)
    store.put_snapshot(state, "job/main", step=1)
    assert store.wait_durable(timeout=DEADLINE)
    remote, up = wrapped[0], store._tier.uploader
    wrote = _objects(tmp_path / "nvme")
    n = len(wrote["blocks"]) + len(wrote["nodes"])
    assert len(wrote["blocks"]) == 5 and n > 5
    assert not [k for k in remote.asked if k.startswith(("blocks/", "nodes/"))], remote.asked
    assert up.sent_written == n and not up._written
    assert sorted(k.rsplit("/", 1)[1] for k in remote.written if k.startswith("blocks/")) == sorted(wrote["blocks"])

    state["b"] = state["b"] + 1
    asked = len(remote.asked)
    info = store.put_snapshot(state, "job/main", step=2)
    assert store.wait_durable(timeout=DEADLINE)
    assert not [k for k in remote.asked[asked:] if k.startswith(("blocks/", "nodes/"))]
    store.close()
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server) as direct:
        assert direct.resolve("job/main") == info.root
        assert direct.fsck().ok
        assert _equal(direct.checkout("job/main"), state)


def test_what_a_new_tier_wrote_that_the_remote_has_is_found_not_written_again(s3_url, s3_server, tmp_path):
    """The guess 'new here, so new there' is only a guess: a tier made afresh (its disk
    lost) writes the same blocks again, and its upload's conditional PUTs find them in the
    remote; each is then judged by its size (a HEAD, as dedup does) and skipped, never
    written twice, and the snapshot is durable."""
    wrapped: list[Asked] = []
    state = tier_state(2, step=True)
    with _open(s3_url, s3_server, tmp_path, "nvme", wrapped) as first:
        first.put_snapshot(state, "job/main", step=1)
        assert first.wait_durable(timeout=DEADLINE)
    blocks = {k for k in wrapped[0].written if k.startswith("blocks/")}
    assert len(blocks) == 5
    with _open(s3_url, s3_server, tmp_path, "nvme2", wrapped) as second:
        info = second.put_snapshot(state, "job/main", step=2)
        assert second.wait_durable(timeout=DEADLINE)
        up = second._tier.uploader
        assert up.sent_written >= 5 and up.skipped >= 5
    again = wrapped[1]
    assert not [k for k in again.written if k.startswith("blocks/")], again.written
    assert blocks <= set(again.asked)  # each refused create was judged by a HEAD
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server) as direct:
        assert direct.resolve("job/main") == info.root
        assert direct.fsck().ok
        assert _equal(direct.checkout("job/main"), state)


def _held(store) -> threading.Event:
    """Hold the uploader before its next snapshot until the returned event is set."""
    up, gate = store._tier.uploader, threading.Event()
    orig = up._upload

    def held(seq, entry):
        assert gate.wait(DEADLINE)
        return orig(seq, entry)

    up._upload = held
    return gate


@pytest.mark.parametrize("codec", ["raw", "lz4"])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_tier_copy_damaged_after_it_was_written_is_never_sent(s3_url, s3_server, tmp_path, damage, codec):
    """A block changed in the tier after its put wrote it (one byte flipped, or cut short)
    no longer matches the record (kept lz4: its CRC32; kept raw: its address); judged whole,
    it is damaged: the uploader stops with the IntegrityError naming it, the remote never
    receives it and its ref does not move."""
    wrapped: list[Asked] = []
    store = _open(s3_url, s3_server, tmp_path, "nvme", wrapped)
    gate = _held(store)
    # Random floats stay raw in the tier (lz4 does not shrink them); a repeated pattern is kept lz4.
    state = tier_state(3, step=True) if codec == "raw" else {"w": torch.arange(64 * 256).remainder(7).float().reshape(64, 256)}
    store.put_snapshot(state, "job/main", step=1)
    want = frame.CODEC_RAW if codec == "raw" else frame.CODEC_LZ4
    victim = sorted(p for p in (tmp_path / "nvme" / "blocks").rglob("*") if p.is_file()
                    and frame.decode_header(p.read_bytes()[:frame.HEADER_SIZE]).codec == want)[0]
    data = bytearray(victim.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        del data[-100:]
    victim.write_bytes(bytes(data))
    gate.set()
    with pytest.raises(tsck.IntegrityError) as e:
        store.wait_durable(timeout=DEADLINE)
    assert victim.name in str(e.value)
    assert not [k for k in wrapped[0].written if victim.name in k]
    assert store.remote_core.refs.get_or_none("job/main") is None
    store.close()


def test_a_tier_copy_rewritten_whole_since_is_checked_and_sent(s3_url, s3_server, tmp_path):
    """A block whose tier copy is another healthy frame of the same bytes (here float-coded,
    as a tier of an older build or a read-through from the remote stores it) does not match
    the record either; judged whole it is sound, and it is sent as it is now stored."""
    wrapped: list[Asked] = []
    store = _open(s3_url, s3_server, tmp_path, "nvme", wrapped, compression="float")
    gate = _held(store)
    state = tier_state(4, step=True)
    info = store.put_snapshot(state, "job/main", step=1)
    victim = sorted(p for p in (tmp_path / "nvme" / "blocks").rglob("*") if p.is_file())[0]
    old = victim.read_bytes()
    hdr = frame.decode_header(old[:frame.HEADER_SIZE])
    raw = bytes(frame.decode_payload(hdr, memoryview(old)[frame.HEADER_SIZE:]))
    new = b"".join(bytes(b) for b in frame.encode_payload(raw, frame.KIND_BLOCK, compress=True, float_itemsize=4))
    assert frame.decode_header(new[:frame.HEADER_SIZE]).codec == frame.CODEC_FLOAT != hdr.codec  # another frame
    victim.write_bytes(new)
    gate.set()
    assert store.wait_durable(timeout=DEADLINE)
    store.close()
    key = f"blocks/{victim.parent.name}/{victim.name}"
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server) as direct:
        assert direct.resolve("job/main") == info.root
        assert direct.storage.get(key) == new
        assert direct.fsck().ok
        assert _equal(direct.checkout("job/main"), state)


@pytest.mark.parametrize("early", [False, True], ids=["upload", "early-upload"])
def test_the_tier_writes_for_its_disk_and_the_remote_gets_the_float_codec(s3_url, s3_server, tmp_path, early):
    """The tier of an object store writes its blocks as a local disk wants them (lz4, or raw
    where lz4 does not shrink them: no float codec on the put's path); what reaches the
    remote is coded as a direct put codes it (the float codec where it shrinks the block),
    by the uploader in the background or the early upload's sends, under the same
    addresses. Both copies decode to the same bytes, the remote snapshot checks out whole
    and fsck finds it sound."""
    store = tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server, block_size=BS,
                            inline_threshold=256, local=str(tmp_path / "nvme"), early_upload=early)
    state = tier_state(7, step=True)
    info = store.put_snapshot(state, "job/main", step=1)
    assert store.wait_durable(timeout=DEADLINE)
    store.close()
    blocks = sorted(p for p in (tmp_path / "nvme" / "blocks").rglob("*") if p.is_file())
    assert len(blocks) == 5
    with tsck.open_store(s3_url, refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server) as direct:
        assert direct.resolve("job/main") == info.root
        for p in blocks:
            here = p.read_bytes()
            there = direct.storage.get(f"blocks/{p.parent.name}/{p.name}")
            h, t = (frame.decode_header(b[:frame.HEADER_SIZE]) for b in (here, there))
            assert h.codec in (frame.CODEC_RAW, frame.CODEC_LZ4) and t.codec == frame.CODEC_FLOAT, (h, t)
            assert t.itemsize == 4 and len(there) < len(here)
            assert bytes(frame.decode_payload(h, memoryview(here)[frame.HEADER_SIZE:])) == \
                bytes(frame.decode_payload(t, memoryview(there)[frame.HEADER_SIZE:]))
        assert direct.fsck().ok
        assert _equal(direct.checkout("job/main"), state)


def _coded_by_dtype_state() -> dict:
    """Tensors whose best-probed element size is not their dtype's: float64 values that
    float32 holds exactly, and small int64s (a probe of each size picks 4 for both), beside
    plain floats and bytes lz4 shrinks."""
    g = torch.Generator().manual_seed(11)
    return {"f64": torch.randn(8192, generator=g).double(), "i64": torch.randint(0, 100, (8192,), generator=g),
            "f32": torch.randn(64, 256, generator=g), "u8": torch.arange(32768).remainder(5).to(torch.uint8)}


@pytest.mark.parametrize("how", ["upload", "early-upload", "saver"])
def test_the_remote_codes_each_block_by_its_tensors_element_size_as_a_direct_put_does(s3_url, s3_server, tmp_path,
                                                                                      how):
    """What the tier uploads is coded by the element size of the tensor that names each
    block (walk.Obj.itemsize: from the manifest, through the saver process too), as a direct
    put codes it by the dtype: every block the remote gets is byte for byte what a direct
    put of the same state stores under that address. Probing each element size instead
    (what a frame alone allows) codes the float64 and int64 blocks by 4."""
    kw = dict(storage_options=s3_server, block_size=BS, inline_threshold=256, pack_size=0)
    state = _coded_by_dtype_state()
    extra = {"upload": {}, "early-upload": {"early_upload": True}, "saver": {"saver": "process"}}[how]
    with tsck.open_store(f"{s3_url}/tier", refs=str(tmp_path / "refs.lmdb"), local=str(tmp_path / "nvme"),
                         **({"early_upload": False} | extra), **kw) as store:
        store.put_snapshot(state, "job/main", step=1)
        assert store.wait_durable(timeout=DEADLINE)
    with tsck.open_store(f"{s3_url}/direct", refs=str(tmp_path / "direct.lmdb"), **kw) as direct:
        direct.put_snapshot(state, "job/main", step=1)  # (another commit: its time differs; the blocks do not)
        with tsck.open_store(f"{s3_url}/tier", refs=str(tmp_path / "refs.lmdb"), storage_options=s3_server) as up:
            keys = list(up.storage.list("blocks/"))
            assert len(keys) == (3 * 65536 + 32768) // BS
            sizes = collections.Counter()
            for o in keys:
                there, want = up.storage.get(o.key), direct.storage.get(o.key)
                assert there == want, o.key
                hdr = frame.decode_header(there[:frame.HEADER_SIZE])
                sizes[(hdr.codec, hdr.itemsize)] += 1
            assert up.fsck().ok and _equal(up.checkout("job/main"), state)
    # Float-coded by 8 (the float64 and int64 tensors), by 4 (the float32 one); lz4 for the bytes.
    assert sizes[(frame.CODEC_FLOAT, 8)] == 8 and sizes[(frame.CODEC_FLOAT, 4)] == 4, sizes
    assert sizes[(frame.CODEC_LZ4, 1)] == 2, sizes
