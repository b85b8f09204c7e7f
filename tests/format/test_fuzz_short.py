"""A short, deterministic run of every fuzz target (fuzz/), without atheris.

Each target's TestOneInput gets its seed corpus (fuzz/corpus/<target>/, built
from real snapshots by fuzz/make_corpus.py) and MUTATIONS inputs derived from
it with random.Random(<target>) (byte flips, interesting bytes, truncation,
insertion, deletion, duplication, splicing). The contract per input:
TestOneInput returns (the code under test returned a valid value or raised
a TsckError subclass; the target asserts the rest), within TIME_LIMIT seconds
(_common.deadline), without growing the process' peak RSS by more than RSS_CAP.

Below the short runs: one regression test per problem the fuzzers found, with
the exact input and the behaviour the contract expects. They fail until the
package is fixed (see fuzz/README.md, "Findings").
"""
from __future__ import annotations

import importlib
import os
import random
import resource
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

FUZZ = Path(__file__).resolve().parents[2] / "fuzz"
sys.path.insert(0, str(FUZZ))

import _common  # noqa: E402
from _util import soak  # noqa: E402

import tensorstore_ck as tsck  # noqa: E402
from tensorstore_ck.format.manifest import encode_node  # noqa: E402

MSGPACK_PREFIX = {"fuzz_manifest": 0, "fuzz_refrecords": 1, "fuzz_tree": 0}  # targets whose inputs are msgpack (after N bytes)
TARGETS = {  # module -> corpus folder
    "fuzz_frame": "frame",
    "fuzz_manifest": "manifest",
    "fuzz_refrecords": "refrecords",
    "fuzz_names": "names",
    "fuzz_state_encoder": "state_encoder",
    "fuzz_tree": "tree",
}
MUTATIONS = soak(150)      # per target (TSCK_SOAK=N: N times as many, by hand; the fuzzers proper: fuzz/)
TIME_LIMIT = 5.0          # CPU-seconds per input (fuzz/_common.deadline)
RSS_CAP = 256 << 20       # bytes of peak-RSS growth per input
QUICK_SHARE = 1 / 3        # of the mutations, run without the slow marker
BUDGET = 20.0             # seconds per target; a run past it stops early (hangs cost TIME_LIMIT each)
INTERESTING = [0x00, 0x01, 0x7F, 0x80, 0xFF, 0xC0, 0xC1, 0xC4, 0xCF, 0xD3, 0xDC, 0xDD, 0xDE, 0xDF,
               0x90, 0x91, 0x80, 0x81, 0xA0, 0xA1]


def _maxrss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def mutate(rng: random.Random, data: bytes, pool: list[bytes], msgpack_prefix: int | None = None) -> bytes:
    if msgpack_prefix is not None and rng.randrange(2):  # half structure-aware, where inputs are msgpack
        out = _common.mutate_msgpack(data[msgpack_prefix:], rng)
        if out is not None:
            return data[:msgpack_prefix] + out
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(8)
        if op == 0 and b:            # flip a bit
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        elif op == 1 and b:          # an interesting byte (msgpack type codes, extremes)
            b[rng.randrange(len(b))] = rng.choice(INTERESTING)
        elif op == 2 and b:          # truncate
            del b[rng.randrange(len(b)):]
        elif op == 3:                # insert random bytes
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op == 4 and b:          # delete a range
            i = rng.randrange(len(b))
            del b[i:i + rng.randint(1, 16)]
        elif op == 5 and b:          # duplicate a range
            i = rng.randrange(len(b))
            b[i:i] = b[i:i + rng.randint(1, 32)]
        elif op == 6 and pool:       # splice with another seed
            other = rng.choice(pool)
            i, j = rng.randrange(len(b) + 1), rng.randrange(len(other) + 1)
            b = b[:i] + other[j:]
        elif op == 7 and len(b) >= 8:  # an extreme 8-byte integer
            i = rng.randrange(len(b) - 7)
            b[i:i + 8] = rng.choice([b"\xff" * 8, b"\x7f" + b"\xff" * 7, b"\x80" + b"\0" * 7, b"\0" * 8])
    return bytes(b)


pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")


def run_input(fn, data: bytes) -> str | None:
    """None, or what went wrong with this input."""
    before = _maxrss()
    c0 = time.process_time()  # CPU, not wall, time: a loaded machine slows an input, it does not make it hang
    try:
        with _common.deadline(TIME_LIMIT, "input"):
            fn(data)
    except Exception as e:  # noqa: BLE001 - any escape is a finding
        tb = traceback.extract_tb(e.__traceback__)
        inner = next((f for f in reversed(tb) if "tensorstore_ck" in f.filename), tb[-1] if tb else None)
        where = f" at {Path(inner.filename).name}:{inner.lineno} ({inner.name})" if inner else ""
        return f"{type(e).__name__}{where}: {str(e)[:200]}"
    grew = _maxrss() - before
    if grew > RSS_CAP:
        return f"peak RSS grew by {grew >> 20} MiB"
    if time.process_time() - c0 > TIME_LIMIT:
        return f"took {time.process_time() - c0:.1f} CPU-s"
    return None


@pytest.mark.parametrize("target, part", [
    p for t in sorted(TARGETS) for p in (pytest.param(t, 0, id=t),
                                         pytest.param(t, 1, id=f"{t}-rest", marks=pytest.mark.slow))])
def test_short_fuzz(target, part):
    """Part 0: the seeds and the first QUICK_SHARE of the mutations (the quick suite's);
    part 1, slow: the rest of the same stream (the full suite runs both)."""
    mod = importlib.import_module(target)
    files = _common.corpus_files(TARGETS[target])
    assert files, f"no seeds in fuzz/corpus/{TARGETS[target]} (run fuzz/make_corpus.py)"
    seeds = [p.read_bytes() for p in files]
    rng = random.Random(target)  # str seeds are hashed deterministically
    mutations = [(f"mutation {i}", mutate(rng, rng.choice(seeds), seeds, MSGPACK_PREFIX.get(target)))
                 for i in range(MUTATIONS)]
    cut = round(MUTATIONS * QUICK_SHARE)
    inputs = [(f"seed {p.name}", d) for p, d in zip(files, seeds)] + mutations[:cut] if part == 0 else mutations[cut:]
    failures, seen = [], set()
    t0 = time.monotonic()
    for label, data in inputs:
        if time.monotonic() - t0 > BUDGET:
            break
        err = run_input(mod.TestOneInput, data)
        if err is not None:
            sig = err.split(": ", 1)[0]  # exception type and where: one report per distinct problem
            if sig not in seen:
                seen.add(sig)
                failures.append((label, data, err))
    if failures:
        keep = Path(tempfile.mkdtemp(prefix=f"tsck-{target}-crashes-"))
        lines = []
        for i, (label, data, err) in enumerate(failures):
            (keep / f"crash-{i}").write_bytes(data)
            lines.append(f"  {label}: {err}\n    input ({len(data)} bytes): {data[:160]!r}")
        pytest.fail(f"{target}: {len(failures)} contract violation(s) (inputs saved in {keep}; replay with "
                    f"`python fuzz/{target}.py {keep}/crash-0`):\n" + "\n".join(lines), pytrace=False)


def test_the_deadline_stops_a_loop_and_a_wait_that_do_not_end():
    """deadline() turns a body that keeps working into Hang once it used its CPU budget,
    and one that waits forever once WALL_FACTOR times that passed."""
    t0 = time.monotonic()
    with pytest.raises(_common.Hang):
        with _common.deadline(0.2, "loop"):
            while True:
                pass
    with pytest.raises(_common.Hang):
        with _common.deadline(0.1, "wait"):
            threading.Event().wait()
    assert time.monotonic() - t0 >= 0.1 * _common.WALL_FACTOR


def test_the_deadline_counts_work_not_the_time_others_take():
    """A body that is slow without working (a process waiting for the cores: here, asleep)
    is no hang: 1.5 s of wall time under a budget of 1 CPU-second passes."""
    with _common.deadline(1.0, "sleeper"):
        time.sleep(1.5)


def test_mutations_are_deterministic():
    seeds = _common.corpus("manifest")
    a = [mutate(random.Random("x"), s, seeds) for s in seeds]
    b = [mutate(random.Random("x"), s, seeds) for s in seeds]
    assert a == b


# =========================================================================== regressions
# Every input below was found by the targets above or by atheris runs of them
# (fuzz/README.md lists them). Each asserts the contract: the target returns
# (a valid value or a TsckError), never another exception or a hang.

def _target(name):
    return importlib.import_module(name).TestOneInput


def _node(value) -> bytes:
    return encode_node(value)


MANIFEST_REGRESSIONS = {
    # Reader._scalar: np.frombuffer with a zero-size dtype -> ValueError
    "scalar_zero_itemsize_S0": _node({"S": ["|S0", b""]}),
    "scalar_zero_itemsize_U0": _node({"S": ["<U0", b""]}),
    # Reader._scalar: '<U1' bytes past U+10FFFF -> SystemError from numpy
    "scalar_bad_code_point": _node({"S": ["<U1", b"\xff\xff\xff\xff"]}),
    # Reader._array: np.empty of a shape whose product overflows (n == 0) -> ValueError
    "array_shape_overflow": _node({"A": {"dt": "<f4", "sh": [2**47, 2**47, 0], "n": 0, "x": b""}}),
    # Reader._tensor: nn.Parameter(int tensor, requires_grad=True) -> RuntimeError
    "int_parameter_requires_grad": _node({"T": {"dt": "int64", "sh": [], "n": 8, "x": b"\0" * 8,
                                                "p": True, "rg": True}}),
    # Reader._quantized: torch.empty of an overflowing shape, unguarded -> RuntimeError
    "quantized_shape_overflow": _node({"T": {"dt": "qint8", "sh": [2**47, 2**47, 0], "n": 0, "x": b"",
                                             "q": {"s": "pt", "scale": 1.0, "zp": 0}}}),
    # Reader._global: no cap on a sharded tensor's global shape: torch.empty(4 TiB) -> RuntimeError
    "global_shape_4TiB": _node({"G": {"dt": "float32", "sh": [2**40], "chunks": []}}),
    "global_shape_overflow": _node({"G": {"dt": "float32", "sh": [2**47, 2**47], "chunks": []}}),
    "global_quint4x2": _node({"G": {"dt": "quint4x2", "sh": [4], "chunks": []}}),
    # walk.iter_leaves (diff): bytes(body["x"]) of an int -> MemoryError (bytes(2**40))
    "diff_inline_int": _node({"d": [["a", {"T": {"dt": "float32", "sh": [1], "n": 4, "x": 1 << 40}}]]}),
    # walk.iter_leaves (diff): multi-rank addresses unchecked -> AttributeError (list.hex) in assets._key
    "diff_world_rank_not_bytes": _node({"W": {"ranks": [[b"\1" * 32]], "world": 1}}),
    # fsck.check_block: bytearray(n) of the manifest's block length before any check -> MemoryError
    "fsck_block_len_1TiB": _node({"T": {"dt": "float32", "sh": [1], "n": 2**40, "bs": 2**40,
                                        "b": [b"\1" * 32]}}),
    # decode_commit leaves stats/meta unchecked: Store._info (refs/show of a ref without catalog
    # row) and recover do int(stats[...]) / dict(meta) -> ValueError / TypeError
    "commit_stats_str": msgpack.packb({"v": 1, "k": "commit", "job": "j", "ref": "j/x", "step": 1, "time": 1.0,
                                       "metrics": {}, "meta": {}, "parent": None, "tree": b"\1" * 32,
                                       "stats": {"bytes_total": "x"}}, use_bin_type=True),
    # decode_commit accepts a commit without "step"; run_recover reads c["step"] -> KeyError
    # (found by an atheris run of fuzz_manifest)
    "commit_without_step": msgpack.packb({"v": 1, "k": "commit", "job": "j", "ref": "j/x", "time": 1.0,
                                          "metrics": {}, "meta": {}, "parent": None, "tree": b"\1" * 32,
                                          "stats": {}}, use_bin_type=True),
    "commit_meta_int": msgpack.packb({"v": 1, "k": "commit", "job": "j", "ref": "j/x", "step": 1, "time": 1.0,
                                      "metrics": {}, "meta": 5, "parent": None, "tree": b"\1" * 32,
                                      "stats": {}}, use_bin_type=True),
}


@pytest.mark.parametrize("name", sorted(MANIFEST_REGRESSIONS))
def test_regression_manifest(name):
    assert run_input(_target("fuzz_manifest"), MANIFEST_REGRESSIONS[name]) is None


def test_regression_manifest_world_merge():
    """Reader._merge on a multi-rank snapshot whose rank tree has a dict entry that
    is not a pair: b[i][1] on an int -> TypeError."""
    store = importlib.import_module("fuzz_manifest")._store()
    child = store.assets.put_node(_node({"d": [5]})).digest
    data = _node({"W": {"ranks": [child], "world": 1}})
    assert run_input(_target("fuzz_manifest"), data) is None


def _rec(which, value) -> bytes:
    return importlib.import_module("fuzz_refrecords").seed(which, value)


REFRECORD_REGRESSIONS = {
    # RefTable.reflog: float(e["t"]) / e["new"] unchecked -> ValueError / KeyError (log, REF@STEP)
    "reflog_time_str": _rec("reflog", msgpack.packb({"t": "x", "new": b"\0" * 32})),
    "reflog_no_new": _rec("reflog", msgpack.packb({"t": 1.0})),
    # store._row_to_info: float(row["time"]), dict(row["metrics"]) -> ValueError / TypeError
    "catalog_time_str": _rec("catalog", msgpack.packb({"time": "x"})),
    "catalog_metrics_list": _rec("catalog", msgpack.packb({"metrics": [1]})),
    # int(inf) -> OverflowError (found by an atheris run of fuzz_refrecords)
    "catalog_bytes_inf": _rec("catalog", msgpack.packb({"bytes_total": float("inf")})),
    # gc state: odd epoch with phase idle -> a writer waits forever (revalidate loop)
    "gc_odd_epoch_idle_hang": _rec("gc", msgpack.packb({"epoch": 1, "phase": "idle"})),
    # gc state: epoch not an int -> TypeError ("x" % 2); heartbeat not a number -> ValueError
    "gc_epoch_str": _rec("gc", msgpack.packb({"epoch": "x"})),
    # gc state: epoch nil -> writers take fence None (an unfenced CAS) and gc dies in gc_freeze /
    # gc_finish (None + 1) -> TypeError (found by an atheris run of fuzz_refrecords)
    "gc_epoch_nil": _rec("gc", msgpack.packb({"epoch": None, "phase": "idle"})),
    "gc_heartbeat_str": _rec("gc", msgpack.packb({"heartbeat": "x", "phase": "marking"})),
    # meta/reflog_seq not 8 bytes -> struct.error in compare_and_swap
    "meta_seq_short": _rec("meta", b"\0\0\0"),
    # keys that are not UTF-8: k.decode() in list() / tags() / retention_all() -> UnicodeDecodeError
    "refs_key_not_utf8": _rec("refs-key", b"\xff"),
    "tags_key_not_utf8": _rec("tags-key", b"\xff"),
    "retention_key_not_utf8": _rec("retention-key", b"\xff"),
    # recover.decode_tag: json nesting -> RecursionError; a huge int time -> OverflowError
    "tag_object_deep_json": _rec("tag-object", b"[" * 100_000),
    "tag_object_huge_time": _rec("tag-object", b'{"name": "x", "root": "' + b"00" * 32 + b'", "time": 1'
                                 + b"0" * 400 + b"}"),
    # store marker: json nesting -> RecursionError; block_size "x" -> ValueError in Store()
    "marker_deep_json": _rec("marker", b"[" * 100_000),
    "marker_block_size_str": _rec("marker", b'{"format": "tensorstore_ck", "version": 1, "block_size": "x"}'),
}


@pytest.mark.parametrize("name", sorted(REFRECORD_REGRESSIONS))
def test_regression_refrecords(name):
    assert run_input(_target("fuzz_refrecords"), REFRECORD_REGRESSIONS[name]) is None


def test_regression_put_on_tag_name_does_not_retry():
    """put_snapshot on a ref name that is a tag: the CAS refuses ("a tag has this
    name") and commit_tree retries 1000 times, writing 1000 commit objects."""
    with tsck.open_store("memory://regr-tag-name") as store:
        store.put_snapshot({"a": 1}, ref="j/main", step=1)
        store.tag("golden", "j/main")
        before = len(list(store.storage.list("commits/")))
        with pytest.raises(tsck.RefConflict):
            store.put_snapshot({"a": 2}, ref="golden", step=2)
        assert len(list(store.storage.list("commits/"))) - before <= 1


def test_regression_refs_prefix_surrogate():
    """A prefix that is no UTF-8 (a lone surrogate) is InvalidArgument naming it, not the
    UnicodeEncodeError of encoding it unchecked; a valid prefix still lists."""
    with tsck.open_store("memory://regr-prefix") as store:
        store.put_snapshot({"n": 1}, ref="a/main", step=1)
        for prefix in ("\udcff", "a/\udcff"):
            with pytest.raises(tsck.InvalidArgument, match="not valid UTF-8"):
                store.refs(prefix)
        assert list(store.refs("a")) == ["a/main"]


@pytest.mark.parametrize("make,want", [
    # non-contiguous tensors of sub-byte dtypes: t.contiguous() -> NotImplementedError at put
    (lambda: torch.empty((2, 2), dtype=torch.uint5).t(), "refused"),
    (lambda: torch.empty((4,), dtype=torch.int3)[::2], "refused"),
    # a quantized dtype's view of plain bytes (not is_quantized), non-contiguous -> RuntimeError at put
    (lambda: torch.zeros((2, 2), dtype=torch.uint8).view(torch.qint8).t(), "refused"),
    # accepted by put, refused (or crashing) at checkout: a snapshot that cannot be restored
    (lambda: np.str_(""), "refused"),
    (lambda: np.bytes_(b""), "refused"),
    (lambda: np.void(b""), "refused"),
    # trailing NULs: np.bytes_(b"ab\0\0\0") is dtype S5, comes back as np.bytes_(b"ab") of dtype S2
    (lambda: np.bytes_(b"ab\0\0\0"), "exact"),
    (lambda: torch.zeros(4, dtype=torch.uint8).view(torch.quint4x2), "refused"),
    # atheris, 2026-11-22 (input ADUAaW1B): np.str_ with trailing NULs came back as <U2 instead of <U6
    (lambda: np.str_("ab\0\0\0\0"), "exact"),
    # atheris, 2026-11-22: a lone surrogate, which numpy's <U holds and Python's utf-32 codec refuses
    (lambda: np.frombuffer(bytearray(b"\x00\xd8\x00\x00"), dtype="<U1")[0], "exact"),
    # atheris, 2026-11-22: code points beyond U+10FFFF, which numpy lets a str_ scalar hold (now refused at put)
    (lambda: np.frombuffer(bytearray(b"5555" * 3), dtype="<U3")[0], "refused"),
], ids=["uint5_transposed", "int3_strided", "qint8_view_transposed", "np_str_empty", "np_bytes_empty", "np_void_empty", "np_bytes_trailing_nul",
        "quint4x2_view", "np_str_trailing_nul", "np_str_lone_surrogate",
        "np_str_beyond_unicode"])
def test_regression_state_roundtrip(make, want):
    """Each value is refused at put with UnsupportedType ("refused"), or round-trips
    exactly ("exact"): which one is pinned, so a refusal cannot stand in for a round trip."""
    value = {"v": make()}
    with tsck.open_store(f"memory://regr-roundtrip-{os.urandom(4).hex()}") as store:  # a store of its own
        if want == "refused":
            with pytest.raises(tsck.UnsupportedType):
                store.put_snapshot(value, ref="r/x", step=1)
            assert store.refs() == {}  # refused before anything was published
        else:
            store.put_snapshot(value, ref="r/x", step=1)
            _common.same(value, store.checkout("r/x"))


def test_regression_reader_tensor_bytes_checked_before_allocating(monkeypatch):
    """A 600-byte manifest leaf that declares a 4 GiB tensor in 16 blocks that do
    not exist: found by fuzz_manifest. Allocating first would take 4 GiB
    (torch.empty) before reading a single block; a big tensor's blocks must exist before
    its memory is taken."""
    requested = []
    real_empty = torch.empty

    def spy(*args, **kw):
        t = real_empty(*args, **kw)
        requested.append(t.numel() * t.element_size())
        return t

    monkeypatch.setattr(torch, "empty", spy)
    bs = 256 << 20
    value = {"T": {"dt": "uint8", "sh": [16 * bs], "n": 16 * bs, "bs": bs,
                   "b": [bytes([i]) * 32 for i in range(1, 17)]}}
    store = importlib.import_module("fuzz_manifest")._store()
    d = store.assets.put_node(_node(value)).digest
    from tensorstore_ck.read.read import Reader
    with pytest.raises(tsck.IntegrityError) as ei:
        Reader(store.assets, store._pool, snapshot=d.hex()).read(d)
    assert ei.value.reason == "missing" and ei.value.key.startswith("blocks/")
    assert max(requested, default=0) < 1 << 30, "allocated GiBs for a tensor none of whose blocks exist"


def test_checkout_max_bytes_caps_what_a_manifest_may_allocate():
    state = {"a": torch.arange(1000, dtype=torch.float64), "b": torch.ones(1000, dtype=torch.float64)}
    with tsck.open_store("memory://max-bytes-cap") as store:
        store.put_snapshot(state, ref="r/x", step=1)
        with pytest.raises(tsck.FormatError, match="max_bytes"):
            store.checkout("r/x", max_bytes=7999)  # one tensor over the cap
        with pytest.raises(tsck.FormatError, match="max_bytes"):
            store.checkout("r/x", max_bytes=12000)  # each fits, both do not
        _common.same(state, store.checkout("r/x", max_bytes=16000))
        _common.same(state, store.checkout("r/x"))  # default: the host's memory
        for bad in (-1, "1e9", 1.5, True):
            with pytest.raises(tsck.InvalidArgument):
                store.checkout("r/x", max_bytes=bad)


def _dcp_bytes_leaf(n: int, bs: int = 256 << 20) -> bytes:
    """fuzz_tree input: a DCP "bytes" section holding one 1-D uint8 leaf of n bytes
    in blocks that do not exist."""
    return msgpack.packb({"d": [["x", {"T": {"dt": "uint8", "sh": [n], "n": n, "bs": bs,
                                             "b": [bytes([1 + i % 250]) * 32 for i in range(-(-n // bs))]}}]]},
                         use_bin_type=True)


@pytest.mark.parametrize("n", [1 << 36, 1 << 40], ids=["64GiB", "1TiB"])
def test_regression_dcp_bytes_item_allocated_before_its_blocks_exist(n):
    """TsckReader._read_bytes (dcp.load of a BYTE_IO item stored as blocks) did
    np.empty(leaf.nbytes) before reading a block: a 9 KB (64 GiB) or 139 KB (1 TiB)
    manifest -> numpy _ArrayMemoryError (found by fuzz_tree). Now the size is capped
    by the host's memory and a big item's blocks must exist first, as in checkout."""
    assert run_input(_target("fuzz_tree"), _dcp_bytes_leaf(n)) is None


def test_dcp_bytes_item_big_leaf_checks_blocks_before_allocating(monkeypatch):
    """A bytes item under the host's memory but over 64 MiB, whose blocks do not
    exist: IntegrityError (missing), and no buffer of its size is taken first."""
    import blake3
    from tensorstore_ck.dcp.reader import TsckReader
    fz = importlib.import_module("fuzz_tree")
    store = fz._store()
    requested = []
    real_empty = np.empty
    monkeypatch.setattr(np, "empty", lambda n, *a, **k: requested.append(n) or real_empty(n, *a, **k))
    payload = encode_node(fz._with_section(fz._STATE["dcp_top"], "bytes",
                                           msgpack.unpackb(_dcp_bytes_leaf(1 << 30), raw=False)))
    d = blake3.blake3(payload).digest()
    saved = {t: dict(v) for t, v in store.reftable._data.items()}
    store.assets.put_node(payload)
    store.commit_tree(d, ref="fuzz/regr-bytes", job="fuzz", step=1, metrics={}, meta={"format": "dcp"},
                      stats=dict(fz.STATS))
    try:
        r = TsckReader(store, "fuzz/regr-bytes")
        r.read_metadata()
        with pytest.raises(tsck.IntegrityError) as ei:
            r._read_bytes(r._m, "x")
        assert ei.value.reason == "missing"
        assert all(not isinstance(x, int) or x < 1 << 30 for x in requested)
    finally:
        store.reftable._data = saved


def _nested(n: int, kind: str, leaf=None):
    v = leaf
    for _ in range(n):
        v = {"d": [["k", v]]} if kind == "d" else {"l": [v]}
    return v


@pytest.mark.parametrize("data", [
    b"\x91" * 1023 + b"\xc0",                    # msgpack's limit: planted inline it is 1028 levels deep
    msgpack.packb(_nested(511, "l"), use_bin_type=True),
    msgpack.packb(_nested(200, "d", {"T": {"dt": "uint8", "sh": [5000], "n": 5000, "x": b"\1" * 5000}}),
                  use_bin_type=True),           # at MAX_DEPTH, the leaf split into a node of its own
], ids=["list1023", "l511", "d200-split-leaf"])
def test_fuzz_tree_deep_values(data):
    """fuzz_tree's own harness handles deep values: msgpack's packer refuses to plant a
    value past 1024 levels in a DCP top node (so the input bytes are spliced in as given,
    and the readers refuse the node), and the writer check's reassembly must not recurse
    past Python's limit."""
    assert run_input(_target("fuzz_tree"), data) is None


def test_fuzz_tree_check_leaf_agreement_is_checked(monkeypatch):
    """The check_leaf contract of fuzz_tree is live: a check_leaf that refused
    a leaf the readers decode would be reported."""
    from tensorstore_ck.errors import UnsupportedType
    from tensorstore_ck.format import tree
    fz = importlib.import_module("fuzz_tree")
    leaf = {"S": ["<i4", b"\1\0\0\0"]}
    fz.check_leaves({"l": [leaf]}, True, tree.decode_value({"l": [leaf]}, world=True))

    def refuse_scalars(raw, path):
        if isinstance(raw, dict) and "S" in raw:
            raise UnsupportedType("no", tree.format_path(path))
    monkeypatch.setattr(tree, "check_leaf", refuse_scalars)
    with pytest.raises(_common.ContractViolation, match="refuses a NpScalar leaf"):
        fz.check_leaves({"l": [leaf]}, True, tree.decode_value({"l": [leaf]}, world=True))
