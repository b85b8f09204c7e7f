"""open_store checks every option before it writes anything: one plausible
argument (block_size=4096) that wrote tsck.json and then raised would leave a store no
later open could get past, from Python or the CLI."""
from __future__ import annotations

import json
import os

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

import tensorstore_ck as tsck

from _util import assert_same, rand_tensor, run_cli



def test_a_small_block_size_makes_a_store_that_opens_again(tmp_path):
    path = tmp_path / "s"
    state = {"w": rand_tensor(torch.float32, (64, 256), seed=1), "b": torch.arange(10)}
    with tsck.open_store(path, block_size=4096) as s:
        assert (s.block_size, s.inline_threshold) == (4096, 4096)  # the threshold follows the block size
        s.put_snapshot(state, ref="j/main", step=1)
    with tsck.open_store(path, create=False) as s:  # no arguments: the marker's layout
        assert (s.block_size, s.inline_threshold) == (4096, 4096)
        assert_same(s.checkout("j/main"), state)
    r = run_cli("refs", path)
    assert r.returncode == 0 and "j/main" in r.stdout, r.stderr


BAD = [
    dict(block_size=0), dict(block_size=3), dict(block_size=-1), dict(block_size="4096"),
    dict(block_size=2 ** 40), dict(block_size=4.5), dict(block_size=True),
    dict(inline_threshold=-1), dict(block_size=4096, inline_threshold=8192), dict(inline_threshold="1"),
    dict(workers=0), dict(workers="2"), dict(gc_lease=0), dict(gc_lease=-5), dict(gc_lease=True),
    dict(max_inflight=0), dict(max_inflight=1.5), dict(when_busy="drop"),
    dict(pack_size=-1), dict(pack_size=(256 << 20) + 1), dict(pack_size=1.5), dict(pack_size=True), dict(pack_size="64"),
    dict(shared_reads="yes"), dict(shared_reads=1), dict(watch_writes=None), dict(watch_writes="off"),
]


@pytest.mark.parametrize("kw", BAD, ids=[",".join(f"{k}={v!r}" for k, v in kw.items()) for kw in BAD])
def test_a_bad_option_writes_nothing(tmp_path, kw):
    path = tmp_path / "new"
    with pytest.raises(tsck.InvalidArgument):
        tsck.open_store(path, **kw)
    assert not path.exists()  # not even the directory
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(tsck.InvalidArgument):
        tsck.open_store(empty, **kw)
    assert os.listdir(empty) == []


@pytest.mark.parametrize("kw", [dict(compress=False), dict(shuffle=True), dict(gc_stale_after=1.0)],
                         ids=lambda kw: next(iter(kw)))
def test_a_keyword_open_store_does_not_take_is_a_type_error(tmp_path, kw):
    """compression= and gc_lease= are the spellings; any other keyword is Python's own
    TypeError naming it, and nothing is written."""
    path = tmp_path / "new"
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{next(iter(kw))}'"):
        tsck.open_store(path, **kw)
    assert not path.exists()


def test_the_options_in_groups_keep_their_names(tmp_path):
    """Every option is a keyword of its own, whatever its group: all of them at once open
    a store (the signature is keyword-compatible for each surviving name)."""
    import inspect
    names = [p.name for p in inspect.signature(tsck.open_store).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert names == ["create", "block_size", "inline_threshold", "compression", "verify", "pack_size", "refs",
                     "create_refs",
                     "read_only", "local", "local_budget", "replicas", "early_upload", "memory", "durable_every",
                     "write_bandwidth",
                     "write_concurrency", "workers", "max_inflight", "retry_budget", "when_busy", "saver",
                     "saver_nice", "host_memory", "storage_options", "wrap_storage", "gc_lease", "shared_reads",
                     "watch_writes"]
    with tsck.open_store(tmp_path / "s", create=True, block_size=4096, inline_threshold=64, compression="lz4",
                         verify=True, pack_size=1 << 20, refs=None, create_refs=False, read_only=False, local=tmp_path / "tier",
                         local_budget=1 << 30, replicas=0, early_upload=False, memory=None, durable_every=1,
                         write_bandwidth=1e9,
                         write_concurrency=4, workers=2, max_inflight=2, retry_budget=1.0, when_busy="wait",
                         saver="thread", saver_nice=10, host_memory=1 << 30, storage_options=None,
                         wrap_storage=lambda s: s, gc_lease=30.0, shared_reads=False, watch_writes=True) as s:
        s.put_snapshot({"x": torch.ones(3)}, ref="j/main")
        assert (s.block_size, s.inline_threshold, s.codecs, s.pack_size) == (4096, 64, "lz4", 1 << 20)
        assert s.wait_durable(timeout=60)
        assert_same(s.checkout("j/main"), {"x": torch.ones(3)})


def test_a_bad_option_on_an_existing_store_changes_nothing(tmp_path):
    path = tmp_path / "s"
    with tsck.open_store(path) as s:
        s.put_snapshot({"x": torch.ones(3)}, ref="j/main")
    before = sorted((str(p.relative_to(path)), p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()
                    and "refs.lmdb" not in str(p))
    marker = (path / "tsck.json").read_bytes()
    for kw in BAD:
        with pytest.raises(tsck.InvalidArgument):
            tsck.open_store(path, **kw)
    assert (path / "tsck.json").read_bytes() == marker
    after = sorted((str(p.relative_to(path)), p.stat().st_mtime_ns) for p in path.rglob("*") if p.is_file()
                   and "refs.lmdb" not in str(p))
    assert after == before


def test_a_marker_whose_layout_does_not_fit_says_how_to_go_on(tmp_path):
    path = tmp_path / "s"
    state = {"x": rand_tensor(torch.float32, (100,), seed=2)}
    with tsck.open_store(path, block_size=4096) as s:
        s.put_snapshot(state, ref="j/main")
    cfg = json.loads((path / "tsck.json").read_text())
    cfg["inline_threshold"] = 1 << 20  # over its block size (an older build, or a hand edit)
    (path / "tsck.json").write_text(json.dumps(cfg))
    with pytest.raises(tsck.FormatError, match=r"tsck\.json.*inline_threshold.*block_size=/inline_threshold="):
        tsck.open_store(path, create=False)
    r = run_cli("refs", path)
    assert r.returncode == 2 and "block_size=/inline_threshold=" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    with tsck.open_store(path, create=False, inline_threshold=1024) as s:  # arguments that fit: it opens
        assert_same(s.checkout("j/main"), state)
        s.put_snapshot(state, ref="j/main", step=2)


class _AppFileSystem(LocalFileSystem):
    """An application's own fsspec filesystem, known to fsspec only by
    register_implementation (not by import path): a local disk that makes folders."""
    protocol = ("tsckappfs",)

    def __init__(self, **kwargs):
        super().__init__(auto_mkdir=True, **kwargs)


def test_a_protocol_registered_at_run_time_opens_a_store(tmp_path):
    fsspec.register_implementation("tsckappfs", _AppFileSystem, clobber=True)
    # available_protocols() lists only protocols known by import path: not the opener's test.
    assert "tsckappfs" not in fsspec.available_protocols()
    state = {"w": rand_tensor(torch.float32, (64, 256), seed=3), "b": torch.arange(10)}
    url, refs = f"tsckappfs://{tmp_path}/store", str(tmp_path / "refs.lmdb")
    with tsck.open_store(url, refs=refs) as s:
        s.put_snapshot(state, ref="j/main", step=1)
    assert (tmp_path / "store" / "tsck.json").is_file()  # written through the registered filesystem
    with tsck.open_store(url, refs=refs, create=False) as s:
        assert_same(s.checkout("j/main"), state)
        assert s.fsck().ok


@pytest.mark.parametrize("scheme", ["tsckno", ""])
def test_an_unknown_scheme_is_named_before_anything_is_written(tmp_path, scheme):
    with pytest.raises(tsck.InvalidArgument, match=f"unknown URL scheme '{scheme}://'"):
        tsck.open_store(f"{scheme}://{tmp_path}/store", refs=str(tmp_path / "refs.lmdb"))
    assert os.listdir(tmp_path) == []


def _open_at_once(path: str, barrier, out) -> None:
    try:
        barrier.wait(30)
        with tsck.open_store(path) as s:
            out.put(("ok", s.reftable.rebuild_unfinished()))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put(("error", f"{type(e).__name__}: {e}"))


def test_ranks_opening_a_new_store_at_once_leave_no_rebuild_mark(tmp_path):
    """Every rank of a job calls open_store(path) on a new path at the same moment. One
    creates the marker and the ref table; another opened that table before the creator
    bound it, took it for a lost table recreated empty and marked it "rebuild", so every
    prune and gc of the store was refused until a `tsck recover`. Real processes, started
    together by a barrier, over many fresh paths (the window is small)."""
    import multiprocessing as mp
    ctx = mp.get_context("fork")
    marked = []
    for i in range(12):
        path = str(tmp_path / f"s{i}")
        barrier, out = ctx.Barrier(3), ctx.Queue()
        procs = [ctx.Process(target=_open_at_once, args=(path, barrier, out)) for _ in range(3)]
        for p in procs:
            p.start()
        got = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(60)
        assert all(kind == "ok" for kind, _ in got), got
        with tsck.open_store(path, create=False) as s:
            if s.reftable.rebuild_unfinished() is not None:
                marked.append(i)
                continue
            s.put_snapshot({"x": torch.arange(4)}, ref="j/main", step=1)
            s.set_retention("j", tsck.Retention(keep_last=1))
            s.prune("j")  # refused (RebuildUnfinished) on a marked table
    assert marked == [], f"fresh stores {marked} of 12 were marked as lost ref tables"
