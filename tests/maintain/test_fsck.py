"""fsck finds exactly the planted faults, with snapshot, names, tensor path and key.

Runs on every backend (tests/_backends.py: file, s3, pg). Each test builds its own
pristine store on the `backend` fixture: jobA/main (4 snapshots), jobA/exp (2),
jobB/main (3); a tag on one jobA snapshot and a pin on one jobB snapshot. A
tensor (2 blocks) is shared by all 9 snapshots (under different paths in the two
jobs) and a manifest subtree (['buffers']) by all jobA snapshots. The store is
built per test, not copied from a shared one: refs, tags, pins and the catalog
live in the ref table (LMDB, or PostgreSQL namespaced by the store id), which a
byte copy of the objects would not reproduce faithfully. Faults are planted in
the stored objects through the Backend (fsspec, not tensorstore_ck). The expected
findings are computed from an independent walk of the stored objects
(tests/_lifecycle_util.StoreWalker): which snapshots reach the damaged object,
and at which path.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from _util import assert_same, rand_tensor, run_clis
from _lifecycle_util import HEADER, StoreWalker, header_of, key_of, sizes

import tensorstore_ck as tsck
from tensorstore_ck.util.paths import dotted_from_formatted

BLOCK = 4096
INLINE = 256
BASE_T = rand_tensor(torch.float32, (8, 256), seed=1)  # 8 KiB: 2 blocks, in every snapshot
BUF = {f"bn.{k}.running_mean": torch.full((8,), float(k)) for k in range(100)}  # own node, shared
PROBLEMS = {"missing", "truncated", "corrupt", "undecodable", "dangling_ref"}


def state_a(seed: int, step: int) -> dict:
    return {"model": {"base": BASE_T, "w": rand_tensor(torch.float32, (4, 256), seed=seed)},
            "buffers": BUF, "step": step}


def state_b(seed: int, step: int) -> dict:
    return {"backbone": BASE_T, "head": rand_tensor(torch.float32, (4, 256), seed=seed), "step": step}


class Pristine:
    pass


class Fetched:
    """Every stored object of a backend, read once through it (concurrently: one s3 GET costs
    tens of ms) so that StoreWalker / header_of read the store's bytes without a request each."""

    def __init__(self, backend):
        keys = sorted(backend.objects())
        with ThreadPoolExecutor(8) as ex:
            self.data = dict(zip(keys, ex.map(backend.read, keys)))

    def read(self, key: str) -> bytes:
        return self.data[key]


@pytest.fixture
def pristine(backend) -> Pristine:
    p = Pristine()
    p.b = backend
    p.snaps = {}    # label -> (root hex, state)
    with backend.open(block_size=BLOCK, inline_threshold=INLINE) as s:
        for i in range(4):
            st = state_a(10 + i, 100 * (i + 1))
            p.snaps[f"A{100 * (i + 1)}"] = (s.put_snapshot(st, ref="jobA/main", step=100 * (i + 1)).root, st)
        for k in range(2):
            st = state_a(50 + k, 250 + 10 * k)
            p.snaps[f"X{250 + 10 * k}"] = (s.put_snapshot(st, ref="jobA/exp", step=250 + 10 * k).root, st)
        for k in range(3):
            st = state_b(70 + k, 10 * k)
            p.snaps[f"B{10 * k}"] = (s.put_snapshot(st, ref="jobB/main", step=10 * k).root, st)
        s.tag("golden", "jobA/main@200")
        s.pin("jobB/main@0")
    p.root = {label: r for label, (r, _st) in p.snaps.items()}
    p.names = {r: [] for r in p.root.values()}
    for label, name in (("A400", "ref:jobA/main"), ("X260", "ref:jobA/exp"), ("B20", "ref:jobB/main"),
                        ("A200", "tag:golden"), ("B0", "pin")):
        p.names[p.root[label]].append(name)
    stored = Fetched(backend)
    walker = StoreWalker(stored)
    p.walks = {r: walker.walk(r) for r in p.root.values()}

    def block_of(label, path, i=0):
        ks = [k for k, pp in p.walks[p.root[label]].blocks if pp == path]
        return ks[i]

    p.base_blocks = [block_of("A100", "['model']['base']", 0), block_of("A100", "['model']['base']", 1)]
    assert p.base_blocks == [block_of("B0", "['backbone']", 0), block_of("B0", "['backbone']", 1)]
    p.w_a200 = block_of("A200", "['model']['w']")
    p.w_a100 = block_of("A100", "['model']['w']")
    p.head_b20 = block_of("B20", "['head']")
    for k in p.base_blocks + [p.w_a200, p.w_a100, p.head_b20]:
        assert header_of(stored, k)[0] == 0, "fault tests want raw (uncompressed) blocks"
    p.top_a300 = key_of("nodes", p.walks[p.root["A300"]].commit["tree"].hex())
    buf_nodes = {k for label in p.root if label[0] in "AX"
                 for k, pp in p.walks[p.root[label]].nodes if pp == "['buffers']"}
    assert len(buf_nodes) == 1, "['buffers'] should be one node shared by every jobA snapshot"
    p.buf_node = buf_nodes.pop()
    assert not any(k == p.buf_node for label in ("B0", "B10", "B20") for k, _ in p.walks[p.root[label]].nodes)
    return p


# ------------------------------------------------------------------ helpers (faults go through the Backend)
def flip(p: Pristine, key, offset=HEADER.size + 100):
    before = p.b.read(key)
    p.b.flip_byte(key, offset)
    after = p.b.read(key)
    assert len(after) == len(before) and after != before


def truncate(p: Pristine, key):
    _codec, raw_len = header_of(p.b, key)
    p.b.truncate(key, HEADER.size + raw_len // 2)
    assert p.b.size(key) == HEADER.size + raw_len // 2


def delete(p: Pristine, key):
    p.b.delete(key)
    assert not p.b.exists(key)


def as_set(findings) -> set:
    out = set()
    for f in findings:
        if not isinstance(f, dict):
            f = {"problem": f.problem, "snapshot": f.snapshot, "names": f.names, "path": f.path, "key": f.key}
        out.add((f["problem"], f["snapshot"], tuple(sorted(f["names"])), f["path"], f["key"]))
    return out


def block_faults(p: Pristine, problem, key, skip=()) -> set:
    """One finding per (snapshot, path) that references block `key`."""
    out = set()
    for r, w in p.walks.items():
        if r in skip:
            continue
        for k, path in w.blocks:
            if k == key:
                out.add((problem, r, tuple(sorted(p.names[r])), path, key))
    return out


def node_faults(p: Pristine, key) -> set:
    out = set()
    for r, w in p.walks.items():
        for k, path in w.nodes:
            if k == key:
                out.add(("missing", r, tuple(sorted(p.names[r])), path, key))
    return out


def fsck_both(p: Pristine):
    with p.b.open(create=False) as s:
        return s.fsck(full=True), s.fsck(full=False)


def assert_exact(rep, want: set):
    got = as_set(rep.findings)
    assert got == want, f"unexpected: {got - want}\nmissed: {want - got}"
    assert len(rep.findings) == len(want), "duplicate findings"
    assert rep.ok is (not want)


def assert_both_exact(p: Pristine, want: set):
    """A full and a quick fsck both find exactly WANT."""
    full, quick = fsck_both(p)
    assert_exact(full, want)
    assert_exact(quick, want)


# ------------------------------------------------------------------ clean
def test_clean_store(pristine):
    p = pristine
    full, quick = fsck_both(p)
    for rep in (full, quick):
        assert rep.ok and rep.findings == []
        assert rep.snapshots_checked == 9
        assert rep.orphans == 0 and rep.orphan_bytes == 0
        assert rep.objects_checked > 0 and rep.bytes_checked > 0
        assert rep.to_json()["ok"] is True
    assert full.full is True and quick.full is False

    # the CLI reaches the same store (s3 / PostgreSQL through TSCK_STORAGE_OPTIONS / TSCK_REFS)
    text, js, qjs = run_clis(("fsck", p.b), ("fsck", p.b, "--json"), ("fsck", p.b, "--quick", "--json"))
    assert text.returncode == 0, text.stdout + text.stderr
    assert js.returncode == 0 and qjs.returncode == 0, js.stderr + qjs.stderr
    j, q = json.loads(js.stdout), json.loads(qjs.stdout)
    assert j["ok"] is True and j["findings"] == [] and j["full"] is True and j["snapshots_checked"] == 9
    assert q["ok"] is True and q["findings"] == [] and q["full"] is False


# ------------------------------------------------------------------ single faults
@pytest.mark.parametrize("which", ["unique", "shared"])
def test_flipped_block_byte(pristine, which):
    p = pristine
    key = p.w_a200 if which == "unique" else p.base_blocks[0]
    flip(p, key)
    want = block_faults(p, "corrupt", key)
    assert len(want) == (1 if which == "unique" else 9)
    if which == "unique":
        assert want == {("corrupt", p.root["A200"], ("tag:golden",), "['model']['w']", key)}
    full, quick = fsck_both(p)
    assert_exact(full, want)
    # quick does not re-hash: it may miss the flip, but must not invent anything
    assert as_set(quick.findings) <= want
    # and checkout refuses the damaged snapshot
    with p.b.open(create=False) as s:
        with pytest.raises(tsck.IntegrityError):
            s.checkout(p.root["A200"])


@pytest.mark.parametrize("which", ["unique", "shared"])
def test_truncated_block(pristine, which):
    p = pristine
    key = p.head_b20 if which == "unique" else p.base_blocks[1]
    truncate(p, key)
    want = block_faults(p, "truncated", key)
    if which == "unique":
        assert want == {("truncated", p.root["B20"], ("ref:jobB/main",), "['head']", key)}
    else:
        assert len(want) == 9
    assert_both_exact(p, want)


@pytest.mark.parametrize("which", ["unique", "shared"])
def test_deleted_block(pristine, which):
    p = pristine
    key = p.w_a100 if which == "unique" else p.base_blocks[1]
    delete(p, key)
    want = block_faults(p, "missing", key)
    if which == "unique":
        assert want == {("missing", p.root["A100"], (), "['model']['w']", key)}
    else:
        assert len(want) == 9
        assert {w[3] for w in want} == {"['model']['base']", "['backbone']"}
    assert_both_exact(p, want)


@pytest.mark.parametrize("which", ["top", "shared_subtree"])
def test_deleted_manifest_node(pristine, which):
    p = pristine
    key = p.top_a300 if which == "top" else p.buf_node
    delete(p, key)
    want = node_faults(p, key)
    if which == "top":
        assert want == {("missing", p.root["A300"], (), None, key)}
    else:
        assert len(want) == 6 and {w[3] for w in want} == {"['buffers']"}
    assert_both_exact(p, want)


@pytest.mark.parametrize("which", ["ref_tip", "history"])
def test_missing_commit(pristine, which):
    p = pristine
    root = p.root["X260"] if which == "ref_tip" else p.root["A300"]
    key = key_of("commits", root)
    delete(p, key)
    full, quick = fsck_both(p)
    if which == "ref_tip":
        want = {("dangling_ref", root, ("ref:jobA/exp",), None, key)}
    else:
        want = {("missing", root, (), None, key)}
    assert_exact(full, want)
    assert_exact(quick, want)


# ------------------------------------------------------------------ several at once + CLI
def test_several_faults_and_cli(pristine):
    p = pristine
    tip_x = p.root["X260"]
    flip(p, p.w_a100)                                     # corrupt, A100, ['model']['w']
    truncate(p, p.head_b20)                               # truncated, B20, ['head']
    delete(p, p.top_a300)                                 # A300 unreadable from the top
    delete(p, key_of("commits", tip_x))                   # jobA/exp points at nothing
    delete(p, p.base_blocks[0])                           # missing in every other snapshot
    blind = {p.root["A300"], tip_x}                       # nothing below them can be reached
    want = (block_faults(p, "corrupt", p.w_a100)
            | block_faults(p, "truncated", p.head_b20)
            | node_faults(p, p.top_a300)
            | {("dangling_ref", tip_x, ("ref:jobA/exp",), None, key_of("commits", tip_x))}
            | block_faults(p, "missing", p.base_blocks[0], skip=blind))
    assert len(want) == 1 + 1 + 1 + 1 + 7
    full, quick = fsck_both(p)
    assert_exact(full, want)
    corrupt = {w for w in want if w[0] == "corrupt"}
    assert want - corrupt <= as_set(quick.findings) <= want

    # `tsck fsck STORE` on this backend's store (its refs / storage options via the environment)
    text, js = run_clis(("fsck", p.b), ("fsck", p.b, "--json"))
    assert text.returncode == 1, text.stdout + text.stderr
    out = text.stdout
    for f in full.findings:
        assert f.key in out and f.problem in out and f.snapshot[:16] in out
    assert len([ln for ln in out.splitlines() if ln.split(":")[0] in PROBLEMS]) == len(want)
    assert js.returncode == 1, js.stderr
    j = json.loads(js.stdout)
    assert j["ok"] is False and j["snapshots_checked"] == 9
    # the CLI writes tensor paths dotted, as `tsck ls` does (the API keeps ['model']['w'])
    dotted = {(w[0], w[1], w[2], dotted_from_formatted(w[3]) if w[3] else w[3], w[4]) for w in want}
    assert as_set(j["findings"]) == dotted and len(j["findings"]) == len(want)


# ------------------------------------------------------------------ orphans
def test_orphans_are_counted_not_findings(pristine):
    p = pristine
    with p.b.open(create=False) as s:
        b = s.assets.put_block(b"a leftover block nobody references " * 10)
        n = s.assets.put_node(b"not even a valid node, but nobody reaches it")
        assert b.new and n.new
        s.assets.sync()  # named (a local disk names a put's objects at sync)
        keys = [key_of("blocks", b.digest.hex()), key_of("nodes", n.digest.hex())]
        assert all(p.b.exists(k) for k in keys)
        for rep in (s.fsck(full=True), s.fsck(full=False)):
            assert rep.ok and rep.findings == []
            assert rep.orphans == 2
            assert rep.orphan_bytes == sizes(p.b, keys)
        # everything else still checks out
        for label, (root, st) in p.snaps.items():
            assert_same(st, s.checkout(root))
