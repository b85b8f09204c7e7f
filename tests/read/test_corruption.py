"""Corruption of stored objects is always detected on checkout (verify on).

A pristine multi-block snapshot is built once; every test copies the store
(shutil.copytree), damages exactly one object file in the copy (flipped byte in
the payload or header, truncation, deletion) and checks out from a freshly
opened store. Every damaged block must raise IntegrityError naming the snapshot
root and the tensor path; damaged manifest nodes and commits must raise
IntegrityError or FormatError. Where a header flip hits a field the reader may
legitimately ignore, the only other accepted outcome is a bit-exact state:
wrong bytes are never returned.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from _util import recode_blocks, same_bits

import tensorstore_ck as tsck

BLOCK = 64 * 1024
INLINE = 512
REF = "jobA/main"
HEX64 = re.compile(r"^[0-9a-f]{64}$")

# header bytes: magic 0..3 | version 4 | codec 5 | itemsize 6 | kind 7 | raw_len 8..15
MUST_FAIL_HEADER = (0, 3, 4, 5)  # magic, version, codec: a reader cannot get right bytes past these
LENIENT_HEADER = (6, 7, 8, 9, 15)  # itemsize, kind, raw_len: error, or bit-exact result


def make_state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "model": {
            # random float32: 256 KiB, 4 blocks, incompressible
            "layers.0.weight": torch.randn(256, 256, generator=g),
            # smooth float32: 160000 B, 3 blocks (last one short), very compressible
            "layers.0.bias": torch.arange(40000, dtype=torch.float32) * 0.5 + 3.0,
            # bf16: 128 KiB, 2 blocks
            "layers.1.weight": torch.randn(128, 512, generator=g).to(torch.bfloat16),
            # int64 small values: 240000 B, 4 blocks, compressible
            "emb": torch.randint(0, 1000, (300, 100), generator=g, dtype=torch.int64),
        },
        "opt": {"state": {0: {"exp_avg": torch.randn(100, 300, generator=g, dtype=torch.float64)}}},
        "small": torch.arange(10),  # inlined into its node
        # big containers of small values: manifest nodes of their own in most layouts
        "buffers": {f"running_mean.{i}": torch.arange(16, dtype=torch.float32) + i for i in range(40)},
        "sched": {"lr_history": [1e-3 * 0.99**i for i in range(700)], "name": "cosine"},
        "step": 7,
        "name": "run-1",
    }


# (path string as in IntegrityError.path, key that must appear in the error, getter)
TENSORS = [
    ("['model']['layers.0.weight']", "layers.0.weight", lambda s: s["model"]["layers.0.weight"]),
    ("['model']['layers.0.bias']", "layers.0.bias", lambda s: s["model"]["layers.0.bias"]),
    ("['model']['layers.1.weight']", "layers.1.weight", lambda s: s["model"]["layers.1.weight"]),
    ("['model']['emb']", "emb", lambda s: s["model"]["emb"]),
    ("['opt']['state'][0]['exp_avg']", "exp_avg", lambda s: s["opt"]["state"][0]["exp_avg"]),
]


def object_files(d: Path) -> dict[str, Path]:
    if not d.exists():
        return {}
    return {p.name: p for p in sorted(d.rglob("*")) if p.is_file() and HEX64.match(p.name)}


def open_copy(path: Path):
    return tsck.open_store(path, block_size=BLOCK, inline_threshold=INLINE, create=False)


class Pristine:
    def __init__(self, root: Path, snap: str, state: dict, block_owner: dict[str, tuple[str, str]]):
        self.root = root
        self.snap = snap
        self.state = state
        self.block_owner = block_owner  # block address -> (path string, key)
        self.blocks = object_files(root / "blocks")
        self.nodes = object_files(root / "nodes")
        self.commits = object_files(root / "commits")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Pristine:
    base = tmp_path_factory.mktemp("corruption")
    state = make_state()
    root = base / "store"
    with tsck.open_store(root, block_size=BLOCK, inline_threshold=INLINE) as s:
        info = s.put_snapshot(state, ref=REF, step=7, metrics={"loss": 1.5})
        assert s.checkout(REF, verify=True) is not None

    # Which tensor owns which block: store each tensor alone in a scratch store
    # with the same settings; blocks are content-addressed, so the addresses match.
    owner: dict[str, tuple[str, str]] = {}
    for i, (pstr, key, get) in enumerate(TENSORS):
        sroot = base / f"scratch{i}"
        with tsck.open_store(sroot, block_size=BLOCK, inline_threshold=INLINE) as s:
            s.put_snapshot({"x": get(state)}, ref="scratch")
        addrs = object_files(sroot / "blocks")
        assert addrs, key
        for a in addrs:
            assert a not in owner, "test setup: two tensors share a block"
            owner[a] = (pstr, key)
    p = Pristine(root, info.root, state, owner)
    assert set(p.blocks) == set(owner), "blocks in the store are exactly the tensors' blocks"
    assert len(p.blocks) >= 15
    assert p.nodes and len(p.commits) == 1
    assert list(p.commits) == [info.root]
    return p


class Case:
    """A private copy (shutil.copytree) of the pristine store.

    Each damage is undone by restore() so one copy serves a whole loop; every
    checkout opens the copy afresh, and the test ends by checking that the copy
    is byte-identical to the pristine store again (nothing was "repaired").
    """

    n = 0

    def __init__(self, pristine: Pristine, tmp_path: Path):
        Case.n += 1
        self.p = pristine
        self.root = tmp_path / f"case{Case.n}"
        shutil.copytree(pristine.root, self.root)
        self._saved: dict[Path, bytes] = {}

    def file(self, orig: Path) -> Path:
        return self.root / orig.relative_to(self.p.root)

    def _save(self, orig: Path) -> Path:
        f = self.file(orig)
        self._saved.setdefault(f, orig.read_bytes())
        return f

    def flip(self, orig: Path, offset: int, mask: int = 0x01) -> None:
        f = self._save(orig)
        data = bytearray(f.read_bytes())
        data[offset] ^= mask
        f.write_bytes(bytes(data))

    def truncate(self, orig: Path, length: int) -> None:
        f = self._save(orig)
        f.write_bytes(f.read_bytes()[:length])

    def delete(self, orig: Path) -> None:
        self._save(orig).unlink()

    def write(self, orig: Path, data: bytes) -> None:
        self._save(orig).write_bytes(data)

    def checkout(self, target: str = REF, **kw):
        with open_copy(self.root) as s:
            return s.checkout(target, **kw)

    def restore(self) -> None:
        for f, data in self._saved.items():
            f.write_bytes(data)
        self._saved.clear()

    def assert_pristine(self) -> None:
        self.restore()
        for d in ("blocks", "nodes", "commits"):
            mine = object_files(self.root / d)
            orig = object_files(self.p.root / d)
            assert set(mine) == set(orig), d
            for k, f in orig.items():
                assert mine[k].read_bytes() == f.read_bytes(), (d, k)
        assert same_bits(self.checkout(REF), self.p.state)


def expect_block_error(case: Case, addr: str, what: str, target: str = REF) -> None:
    pstr, key = case.p.block_owner[addr]
    with pytest.raises(tsck.IntegrityError) as ei:
        case.checkout(target)
    e = ei.value
    assert isinstance(e, tsck.TsckError)
    assert str(e.snapshot) == case.p.snap, (what, e.snapshot)
    assert e.path == pstr, (what, e.path)
    assert key in str(e), (what, str(e))
    assert isinstance(e.kind, str) and e.kind


def expect_error_or_exact(case: Case, errors: tuple, what: str, target: str = REF):
    """The checkout must fail with one of `errors` or give back exactly the original."""
    try:
        got = case.checkout(target)
    except errors as e:
        return e
    except Exception as e:  # pragma: no cover - reported as a failure with context
        pytest.fail(f"{what}: unexpected {type(e).__name__}: {e}")
    assert same_bits(got, case.p.state), f"{what}: checkout returned WRONG bytes silently"
    return None


def payload_offsets(size: int) -> list[int]:
    assert size > 16
    return sorted({16, 16 + (size - 16) // 2, size - 1})


# ---------------------------------------------------------------- blocks


def test_pristine_checks_out(pristine, tmp_path):
    c = Case(pristine, tmp_path)
    assert same_bits(c.checkout(REF), pristine.state)
    assert same_bits(c.checkout(pristine.snap), pristine.state)
    c.assert_pristine()


def test_flipped_byte_in_every_block_payload(pristine, tmp_path):
    c = Case(pristine, tmp_path)
    for addr, f in pristine.blocks.items():
        for off in payload_offsets(f.stat().st_size):
            c.flip(f, off)
            expect_block_error(c, addr, f"block {addr[:8]} payload byte {off}")
            c.restore()
    c.assert_pristine()


def test_flipped_byte_in_every_block_header(pristine, tmp_path):
    c = Case(pristine, tmp_path)
    blocks = list(pristine.blocks.items())
    for n, (addr, f) in enumerate(blocks):
        positions = range(16) if n == 0 else (0, 4, 5, 8, 15)
        for pos in positions:
            c.flip(f, pos)
            what = f"block {addr[:8]} header byte {pos}"
            target = REF if pos % 2 else pristine.snap
            if pos in MUST_FAIL_HEADER or pos in (1, 2):
                expect_block_error(c, addr, what, target)
            else:
                e = expect_error_or_exact(c, (tsck.IntegrityError,), what, target)
                if e is not None:
                    expect_block_error(c, addr, what, target)
            c.restore()
    c.assert_pristine()


def test_high_bit_flips_in_block_header(pristine, tmp_path):
    c = Case(pristine, tmp_path)
    # a different flip pattern: 0x80 in version/codec/itemsize/raw_len top byte
    addr, f = next(iter(pristine.blocks.items()))
    for pos in (4, 5, 6, 15):
        c.flip(f, pos, 0x80)
        if pos in (4, 5):
            expect_block_error(c, addr, f"header byte {pos} ^0x80")
        elif expect_error_or_exact(c, (tsck.IntegrityError,), f"header byte {pos} ^0x80") is not None:
            expect_block_error(c, addr, f"header byte {pos} ^0x80")
        c.restore()
    c.assert_pristine()


def test_deleted_block(pristine, tmp_path):
    c = Case(pristine, tmp_path)
    targets = [REF, pristine.snap, f"{REF}@7", pristine.snap[:12]]
    for n, (addr, f) in enumerate(pristine.blocks.items()):
        c.delete(f)
        expect_block_error(c, addr, f"deleted block {addr[:8]}", targets[n % len(targets)])
        c.restore()
    c.assert_pristine()


def truncations(c: "Case", objects: dict, short: int):
    """Each of OBJECTS (address -> file) cut to nothing, SHORT bytes, its header's 16, half
    and all but its last byte in turn: yields (address, length) while it is cut."""
    for addr, f in objects.items():
        size = f.stat().st_size
        for length in (0, short, 16, size // 2, size - 1):
            c.truncate(f, length)
            yield addr, length
            c.restore()


def test_truncated_block(pristine, tmp_path):
    c = Case(pristine, tmp_path)
    for addr, length in truncations(c, pristine.blocks, 10):
        expect_block_error(c, addr, f"block {addr[:8]} truncated to {length}")
    c.assert_pristine()


def test_garbage_appended_to_block(pristine, tmp_path):
    addr, f = next(iter(pristine.blocks.items()))
    c = Case(pristine, tmp_path)
    c.write(f, f.read_bytes() + b"\x00" * 100)
    expect_error_or_exact(c, (tsck.IntegrityError,), "block with trailing garbage")
    c.assert_pristine()


def test_block_swapped_for_another_valid_block(pristine, tmp_path):
    # a well-formed object under the wrong address: only the hash can tell
    (a1, f1), (a2, f2) = list(pristine.blocks.items())[:2]
    c = Case(pristine, tmp_path)
    c.write(f1, f2.read_bytes())
    expect_block_error(c, a1, "block replaced by another valid block")
    c.assert_pristine()


def test_shuffle_codec_block_corruption(tmp_path):
    """Blocks in the byte-shuffle codec (2), where the header's itemsize matters. No store
    writes it now, but stores hold such blocks and reads check them: this test recodes a
    store's blocks to it (recode_blocks: the addresses stay) and corrupts those."""
    root = tmp_path / "sh"
    t = torch.arange(100_000, dtype=torch.float32) * 0.001  # 400000 B, shuffles well
    with tsck.open_store(root, block_size=BLOCK, inline_threshold=INLINE, compression="lz4") as s:
        snap = s.put_snapshot({"w": t}, ref=REF).root
    shuffled = recode_blocks(root, shuffle_itemsize=4)
    blocks = object_files(root / "blocks")
    assert blocks
    assert shuffled and all(f.read_bytes()[5] == 2 for f in shuffled), "no block in codec 2"
    pristine = Pristine(root, snap, {"w": t}, {a: ("['w']", "w") for a in blocks})
    c = Case(pristine, tmp_path)
    for f in shuffled[:3]:
        size = f.stat().st_size
        for off, mask in [(6, 0x01), (6, 0x02), (5, 0x03), (8, 0x01)] + [(o, 0x10) for o in payload_offsets(size)]:
            c.flip(f, off, mask)
            expect_block_error(c, f.name, f"shuffled block byte {off} ^{mask:#x}")
            c.restore()
    c.assert_pristine()


# ----------------------------------------------------------------- nodes

NODE_ERRORS = (tsck.IntegrityError, tsck.FormatError)


def check_node_error(e, what: str, snap: str) -> None:
    assert isinstance(e, NODE_ERRORS), (what, type(e))
    if isinstance(e, tsck.IntegrityError):
        assert str(e.snapshot) == snap, (what, e.snapshot)


def test_flipped_byte_in_every_node(pristine, tmp_path):
    c = Case(pristine, tmp_path)
    for addr, f in pristine.nodes.items():
        size = f.stat().st_size
        for off in payload_offsets(size) + list(MUST_FAIL_HEADER):
            c.flip(f, off)
            what = f"node {addr[:8]} byte {off}"
            with pytest.raises(NODE_ERRORS) as ei:
                c.checkout(REF)
            check_node_error(ei.value, what, pristine.snap)
            c.restore()
        for off in LENIENT_HEADER:
            c.flip(f, off)
            what = f"node {addr[:8]} header byte {off}"
            e = expect_error_or_exact(c, NODE_ERRORS, what)
            if e is not None:
                check_node_error(e, what, pristine.snap)
            c.restore()
    c.assert_pristine()


def test_every_byte_of_one_node_payload(pristine, tmp_path):
    # the smallest node is exhaustively damaged, one byte at a time (msgpack
    # type tags, lengths, inline tensor bytes, child addresses, ...)
    addr, f = min(pristine.nodes.items(), key=lambda kv: kv[1].stat().st_size)
    size = f.stat().st_size
    offsets = range(16, size) if size <= 400 else random.Random(0).sample(range(16, size), 384)
    c = Case(pristine, tmp_path)
    for off in offsets:
        c.flip(f, off, 0xFF)
        with pytest.raises(NODE_ERRORS) as ei:
            c.checkout(REF)
        check_node_error(ei.value, f"node {addr[:8]} byte {off}", pristine.snap)
        c.restore()
    c.assert_pristine()


def test_deleted_node(pristine, tmp_path):
    c = Case(pristine, tmp_path)
    for addr, f in pristine.nodes.items():
        c.delete(f)
        with pytest.raises(tsck.IntegrityError) as ei:
            c.checkout(REF)
        assert str(ei.value.snapshot) == pristine.snap
        c.restore()
    c.assert_pristine()


def test_truncated_node(pristine, tmp_path):
    c = Case(pristine, tmp_path)
    for addr, length in truncations(c, pristine.nodes, 8):
        with pytest.raises(NODE_ERRORS) as ei:
            c.checkout(REF)
        check_node_error(ei.value, f"node {addr[:8]} truncated to {length}", pristine.snap)
    c.assert_pristine()


# ---------------------------------------------------------------- commit


def test_corrupt_commit_object(pristine, tmp_path):
    c = Case(pristine, tmp_path)
    (addr, f), = pristine.commits.items()
    size = f.stat().st_size
    for target in (REF, pristine.snap):
        for off in payload_offsets(size) + list(MUST_FAIL_HEADER):
            c.flip(f, off)
            with pytest.raises(NODE_ERRORS):
                c.checkout(target)
            c.restore()
        for off in LENIENT_HEADER:
            c.flip(f, off)
            expect_error_or_exact(c, NODE_ERRORS, f"commit header byte {off}", target)
            c.restore()
        for length in (0, 10, 16, size // 2, size - 1):
            c.truncate(f, length)
            with pytest.raises(NODE_ERRORS):
                c.checkout(target)
            c.restore()
    c.assert_pristine()


def test_every_byte_of_commit_payload(pristine, tmp_path):
    (addr, f), = pristine.commits.items()
    size = f.stat().st_size
    c = Case(pristine, tmp_path)
    for off in range(16, size):
        c.flip(f, off, 0x20)
        with pytest.raises(NODE_ERRORS):
            c.checkout(REF)
        c.restore()
    c.assert_pristine()


def test_deleted_commit(pristine, tmp_path):
    (addr, f), = pristine.commits.items()
    c = Case(pristine, tmp_path)
    c.delete(f)
    with pytest.raises(NODE_ERRORS):
        c.checkout(REF)
    c.assert_pristine()


# ------------------------------------------------------ random damage sweep


def test_random_bit_flips_anywhere_are_never_silent(pristine, tmp_path):
    c = Case(pristine, tmp_path)
    files = [f for d in (pristine.blocks, pristine.nodes, pristine.commits) for f in d.values()]
    rng = random.Random(12345)
    for i in range(60):
        f = rng.choice(files)
        size = f.stat().st_size
        off = rng.randrange(size)
        mask = 1 << rng.randrange(8)
        c.flip(f, off, mask)
        what = f"{f.relative_to(pristine.root)} byte {off} ^{mask:#x}"
        e = expect_error_or_exact(c, (tsck.IntegrityError, tsck.FormatError), what)
        if e is None:
            # only header fields a reader may ignore can be flipped harmlessly
            assert off in range(6, 16), f"{what}: corruption went undetected"
        elif f.parent.parent.name == "blocks":
            assert isinstance(e, tsck.IntegrityError), (what, type(e))
            assert str(e.snapshot) == pristine.snap
            assert e.path == pristine.block_owner[f.name][0]
        c.restore()
    c.assert_pristine()


