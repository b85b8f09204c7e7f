"""torch.distributed.checkpoint through tensorstore_ck (tensorstore_ck/dcp/).

Single process: DCP runs without a process group (no_dist), which still goes
through every StorageWriter/StorageReader call. The multi-process test
(tests/helpers/dcp_dist.py) saves at 4 gloo ranks with DTensor Shard(0) and
loads at 2 ranks with another sharding.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import sys
from pathlib import Path

import pytest
import torch

import _zygote as zygote
from _util import assert_same, blank_like, load_helper, tensor_bytes
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

import tensorstore_ck as tsck
from tensorstore_ck.dcp import TsckReader, TsckWriter, decode_metadata, encode_metadata
from tensorstore_ck.interchange.hf_folder import select

HERE = Path(__file__).resolve().parents[1]
DIST_HELPER = HERE / "helpers" / "dcp_dist.py"

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


# ---------------------------------------------------------------- fixtures (small_store: conftest.py)


def _model_and_optim(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(seed: int = 0) -> dict:
    """model + optimizer state, nested dicts, non-tensor values, odd tensors."""
    model, opt = _model_and_optim(seed)
    g = torch.Generator().manual_seed(seed + 1)
    big = torch.randn(96, 500, generator=g)  # 192 KB: 12 blocks of 16 KiB (8 rows each)
    return {
        "model": model.state_dict(),
        "optim": opt.state_dict(),
        "extra": {
            "step": 1234 + seed,
            "name": f"run-{seed}",
            "lrs": [0.1, 0.01 * (seed + 1)],
            "flags": {"ema": True, "none": None, "pair": (1, "two")},
            "big": big,
            "bf16": torch.randn(40, 300, generator=g).to(torch.bfloat16),
            "ids": torch.randint(-2**40, 2**40, (1000,), generator=g, dtype=torch.int64),
            "mask": torch.rand(77, generator=g) > 0.5,
            "scalar": torch.tensor(3.25 + seed, dtype=torch.float64),
            "empty": torch.empty(0, 7),
            "transposed": torch.randn(50, 70, generator=g).t(),  # not contiguous
        },
    }


def _unlike(x):
    """A plain value other than X: a bool flipped, a number or a string changed."""
    if isinstance(x, bool):
        return not x
    if isinstance(x, (int, float)):
        return x + 1
    if isinstance(x, str):
        return x + "?"
    return x


def _blank_like(sd):
    """The same structure with zeroed tensors and different plain values."""
    return blank_like(sd, _unlike)


def _save(sd, store, ref="jobA/main", step=100, **kw):
    w = TsckWriter(store, ref=ref, step=step, **kw)
    md = dcp.save(sd, storage_writer=w)
    return w, md


# ---------------------------------------------------------------- round trip
def test_roundtrip_model_optimizer_bit_exact(small_store):
    sd = _state(0)
    want = copy.deepcopy(sd)
    w, md = _save(sd, small_store, metrics={"loss": 0.5}, meta={"note": "dcp test"})
    info = small_store.log("jobA/main")[0]
    assert info == w.info and info.step == 100 and info.job == "jobA"
    assert info.meta == {"note": "dcp test", "format": "dcp"} and info.metrics == {"loss": 0.5}
    assert info.blocks_new == info.blocks_total > 0

    target = _blank_like(sd)
    dcp.load(target, storage_reader=TsckReader(small_store, "jobA/main"))
    assert_same(want, target, loose_types=True)

    # A model and optimizer restored through load_state_dict behave identically.
    model, opt = _model_and_optim(99)
    model.load_state_dict(target["model"])
    opt.load_state_dict(target["optim"])
    ref_model, _ = _model_and_optim(0)
    for (k, a), (_k, b) in zip(ref_model.state_dict().items(), model.state_dict().items()):
        assert tensor_bytes(a) == tensor_bytes(b), k


def test_read_metadata_reconstructs_dcp_metadata_exactly(small_store):
    sd = _state(0)
    _w, md = _save(sd, small_store)
    got = TsckReader(small_store, "jobA/main").read_metadata()
    assert got.storage_meta.load_id is not None  # set on read, like FileSystemReader
    got.storage_meta.load_id = None
    assert got == md
    # every dtype kept by name, tuples in planner_data kept as tuples
    assert got.state_dict_metadata["extra.bf16"].properties.dtype is torch.bfloat16
    assert all(type(p) is tuple for p in got.planner_data.values())
    # the encoding is plain data: no pickle anywhere
    assert decode_metadata(encode_metadata(md)) == md


def test_plain_checkout_returns_the_saved_state(small_store):
    """store.checkout of a dcp.save snapshot gives the state_dict that was saved:
    tensors whole, non-tensor values loaded, dict keys as DCP flattens them (str)."""
    sd = _state(0)
    want = copy.deepcopy(sd)
    _save(sd, small_store)
    snap = small_store.checkout("jobA/main")
    assert set(snap) == {"model", "optim", "extra"}
    e = snap["extra"]
    assert_same(want["extra"]["big"], e["big"], loose_types=True)
    assert_same(want["extra"]["transposed"].contiguous(), e["transposed"], loose_types=True)
    assert_same(want["model"]["0.weight"], snap["model"]["0.weight"], loose_types=True)
    assert_same(want["optim"]["state"][0]["exp_avg"], snap["optim"]["state"]["0"]["exp_avg"], loose_types=True)
    assert e["name"] == "run-0" and e["step"] == 1234 and e["lrs"] == [0.1, 0.01]
    assert e["flags"] == {"ema": True, "none": None, "pair": (1, "two")}
    assert snap["optim"]["param_groups"][0]["lr"] == want["optim"]["param_groups"][0]["lr"]
    # The DCP layout itself is still there for the DCP reader.
    assert TsckReader(small_store, "jobA/main").read_metadata().state_dict_metadata["extra.big"].size == \
        torch.Size([96, 500])


def test_same_state_twice_writes_no_new_blocks(small_store):
    sd = _state(0)
    _save(sd, small_store, step=1)
    _save(sd, small_store, step=2)
    log = small_store.log("jobA/main")
    assert [i.step for i in log] == [2, 1]
    assert log[0].blocks_new == 0 and log[0].bytes_new == 0 and log[0].stored_new == 0
    # the first save stored every block: their bytes on disk, as framed and compressed
    assert log[1].stored_new == small_store.assets.object_stats()["blocks"][1] > 0
    assert log[0].blocks_total == log[1].blocks_total > 0
    assert log[0].parent == log[1].root
    # one changed tensor: only its blocks are new
    sd["extra"]["big"][40] += 1.0  # one row of 8-row blocks
    _save(sd, small_store, step=3)
    assert small_store.log("jobA/main")[0].blocks_new == 1


def test_async_save(small_store):
    sd = _state(0)
    want = copy.deepcopy(sd)
    fut = dcp.async_save(sd, storage_writer=TsckWriter(small_store, ref="jobA/main", step=7))
    fut.result(timeout=60)
    assert small_store.log("jobA/main")[0].step == 7
    target = _blank_like(sd)
    dcp.load(target, storage_reader=TsckReader(small_store, "jobA/main"))
    assert_same(want, target, loose_types=True)
    # a second async save of the same state dedups everything
    dcp.async_save(sd, storage_writer=TsckWriter(small_store, ref="jobA/main", step=8)).result(timeout=60)
    assert small_store.log("jobA/main")[0].blocks_new == 0


def test_load_without_a_template(small_store):
    # DCP's own "load everything" planner (as its format converters use) builds the
    # state dict from read_metadata alone.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    sd = _state(0)
    want = copy.deepcopy(sd)
    _save(sd, small_store)
    got = _load_state_dict_from_keys(storage_reader=TsckReader(small_store, "jobA/main"))
    assert_same(want["extra"], got["extra"], loose_types=True)
    assert_same(want["model"], got["model"], loose_types=True)


def test_checkpoint_id_is_ref_and_step(small_store):
    sd = {"w": torch.arange(10.0), "n": 3}
    w = TsckWriter(small_store, ref="jobA/main")
    dcp.save(sd, checkpoint_id="jobB/exp1@42", storage_writer=w)
    assert small_store.log("jobB/exp1")[0].step == 42 and w.info.ref == "jobB/exp1"
    sd2 = {"w": torch.zeros(10), "n": 0}
    dcp.load(sd2, checkpoint_id="jobB/exp1@42", storage_reader=TsckReader(small_store, "jobB/exp1"))
    assert torch.equal(sd2["w"], torch.arange(10.0)) and sd2["n"] == 3


def test_large_bytes_item_goes_to_blocks(small_store):
    blob = os.urandom(1_500_000)
    sd = {"w": torch.ones(3), "blob": blob}
    _save(sd, small_store, step=1)
    assert small_store.log("jobA/main")[0].blocks_new > 50  # the blob's blocks
    got = {"w": torch.zeros(3), "blob": b""}
    dcp.load(got, storage_reader=TsckReader(small_store, "jobA/main"))
    assert got["blob"] == blob
    assert small_store.checkout("jobA/main")["blob"] == blob  # over 1 MiB: stored as a uint8 tensor leaf
    _save(sd, small_store, step=2)
    assert small_store.log("jobA/main")[0].blocks_new == 0


# ---------------------------------------------------------------- reads touch only what they need
class _Planner:
    """The LoadPlanner calls read_data makes, over plain target tensors."""

    def __init__(self, targets):
        self.targets, self.committed = targets, []

    def resolve_tensor(self, req):
        return self.targets[req.dest_index.fqn]

    def commit_tensor(self, req, tensor):
        self.committed.append(req.dest_index.fqn)

    def load_bytes(self, req, value):
        self.targets[req.dest_index.fqn] = value.read()


def _read(reader, items, targets):
    reader.read_metadata()
    planner = _Planner(targets)
    reader.read_data(LoadPlan(items), planner).wait()
    return planner


def _item(fqn, chunk_off, so, ln, dest="t"):
    return ReadItem(type=LoadItemType.TENSOR, dest_index=MetadataIndex(dest, [0] * len(ln)),
                    dest_offsets=torch.Size([0] * len(ln)), storage_index=MetadataIndex(fqn, chunk_off),
                    storage_offsets=torch.Size(so), lengths=torch.Size(ln))


def test_read_only_intersecting_blocks(small_store, monkeypatch):
    big = torch.randn(96, 500)  # 2000-byte rows, 8 rows per 16 KiB block: 12 blocks
    _save({"big": big}, small_store)
    calls = []
    orig = small_store.assets.read_block_into
    monkeypatch.setattr(small_store.assets, "read_block_into",
                        lambda d, out, **kw: (calls.append(d), orig(d, out, **kw))[1])
    reader = TsckReader(small_store, "jobA/main")

    cases = [
        ((10, 0), (7, 500), 2),      # rows 10..16: blocks 1 and 2
        ((16, 0), (16, 500), 2),     # rows 16..31, block-aligned: read straight into the target
        ((40, 123), (30, 77), 4),    # rows 40..69, some columns: blocks 5..8
        ((95, 499), (1, 1), 1),      # one element
        ((0, 0), (96, 500), 12),     # everything
    ]
    for so, ln, nblocks in cases:
        calls.clear()
        tgt = torch.zeros(ln)
        p = _read(reader, [_item("big", (0, 0), so, ln)], {"t": tgt})
        assert len(calls) == nblocks, (so, ln, len(calls))
        want = big[so[0]:so[0] + ln[0], so[1]:so[1] + ln[1]]
        assert tensor_bytes(tgt) == tensor_bytes(want.contiguous()), (so, ln)
        assert p.committed == ["t"]

    # a non-contiguous target (a view into a bigger tensor) is filled in place
    calls.clear()
    host = torch.zeros(500, 96)
    p = _read(reader, [_item("big", (0, 0), (8, 0), (8, 500))], {"t": host.t()[8:16]})
    assert len(calls) == 1 and torch.equal(host.t()[8:16], big[8:16])


def test_corrupt_block_is_refused(small_store):
    _save({"big": torch.randn(96, 500)}, small_store)
    root = Path(small_store.url[len("file://"):])
    victim = sorted((root / "blocks").rglob("*"))[-1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    os.chmod(victim, 0o644)
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointException) as ei:
        dcp.load({"big": torch.zeros(96, 500)}, storage_reader=TsckReader(small_store, "jobA/main"))
    assert any(isinstance(e[0] if isinstance(e, tuple) else e, tsck.IntegrityError)
               for e in ei.value.failures.values()), ei.value.failures


def test_errors(small_store):
    with pytest.raises(tsck.RefNotFound):
        TsckReader(small_store, "nope/none")
    with pytest.raises(tsck.InvalidName):
        TsckWriter(small_store, ref="bad ref")
    small_store.put_snapshot({"w": torch.ones(2)}, "plain/main")
    got = {"w": torch.zeros(2)}  # a put_snapshot snapshot loads...
    dcp.load(got, storage_reader=TsckReader(small_store, "plain/main"))
    assert torch.equal(got["w"], torch.ones(2))
    with pytest.raises((CheckpointException, RuntimeError), match="Missing key"):  # ...and DCP's own checks stay
        dcp.load({"w": torch.zeros(2), "v": torch.zeros(1)}, storage_reader=TsckReader(small_store, "plain/main"))


# ---------------------------------------------------------------- gc fence
class _StaleFenceWriter(TsckWriter):
    """Pretends a gc deletion phase ran between planning and publishing."""
    drop_block = False

    def prepare_global_plan(self, plans):
        out = super().prepare_global_plan(plans)
        self._fence -= 2
        return out

    def finish(self, metadata, results):
        if self.drop_block:  # what that gc would have deleted (named: write_data synced it)
            d = results[0][0].storage_data.value["b"][0]
            root = Path(self.store.url[len("file://"):])
            (root / "blocks" / d.hex()[:2] / d.hex()).unlink()
        return super().finish(metadata, results)


def test_gc_fence_revalidates_or_aborts(tmp_path):
    with tsck.open_store(tmp_path / "s1", block_size=16384) as s:
        w = _StaleFenceWriter(s, ref="jobA/main", step=1)
        dcp.save({"big": torch.randn(96, 500)}, storage_writer=w)
        assert s.log("jobA/main")[0].step == 1  # every block still there: published
    with tsck.open_store(tmp_path / "s2", block_size=16384) as s:
        w = _StaleFenceWriter(s, ref="jobA/main", step=1)
        w.drop_block = True
        with pytest.raises(CheckpointException, match="gc removed 1 block"):
            dcp.save({"big": torch.randn(96, 500)}, storage_writer=w)
        with pytest.raises(tsck.RefNotFound):
            s.log("jobA/main")


def test_writer_pickles_for_process_executor(small_store):
    w = TsckWriter(small_store, ref="jobA/main", step=5)
    w2 = pickle.loads(pickle.dumps(w))
    assert w2.store is small_store  # same process: the same Store, not a second LMDB handle
    dcp.save({"w": torch.arange(4.0)}, storage_writer=w2)
    assert small_store.log("jobA/main")[0].step == 5


# ---------------------------------------------------------------- several processes
@pytest.mark.slow
def test_multiprocess_save_4_ranks_load_2_ranks_resharded(tmp_path):
    store_dir, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR",
           "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = zygote.run([sys.executable, str(DIST_HELPER), str(store_dir), str(out)], env=env,
                      capture_output=True, text=True, timeout=240)
    reports = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    errors = {k: r.get("error") for k, r in reports.items() if not r.get("ok")}
    assert proc.returncode == 0 and not errors, (proc.stdout[-3000:], proc.stderr[-5000:], errors)
    assert sorted(reports) == ["async-rank0", "async-rank1", "load-rank0", "load-rank1"] + \
        [f"save-rank{r}" for r in range(4)]

    for r in range(2):
        assert reports[f"load-rank{r}"]["mismatches"] == []
    # Blocks read: the embedding by columns needs every row (8 blocks); its moment,
    # re-split at row 15, needs rows 0..14 (4 blocks) and 15..29 (5 blocks) of chunks
    # saved at rows 0/8/16/24 with 4 rows per block. Nothing else spans a block.
    assert [reports[f"load-rank{r}"]["blocks_read"] for r in range(2)] == [12, 13]
    info = reports["save-rank0"]["info"]
    assert info["step"] == 100 and info["metrics"] == {"loss": 1.5} and info["blocks_new"] == 16

    # One snapshot holds every rank's chunks; plain checkout assembles the global tensors.
    helper = load_helper(DIST_HELPER)
    G = helper.make_globals()
    with tsck.open_store(store_dir) as s:
        assert len(s.log("jobA/main")) == 1
        snap = s.checkout("jobA/main")
        for name, fqn in [("emb.weight", "model.emb.weight"), ("lin.weight", "model.lin.weight"),
                          ("lin.bias", "model.lin.bias"), ("norm.scale", "model.norm.scale"),
                          ("emb.exp_avg", "optim.state.emb.weight.exp_avg"),
                          ("lin.exp_avg", "optim.state.lin.weight.exp_avg")]:
            assert_same(G[name], select(snap, fqn)[0], fqn, loose_types=True)
        md = TsckReader(s, "jobA/main").read_metadata()
        assert len(md.state_dict_metadata["model.emb.weight"].chunks) == 4

    # async_save under a process group: thread executor, then process executor; the second
    # snapshot of the same state writes no new block. (The first one, at 2 ranks, cuts
    # the two 30-row tensors at row 15: of its 16 blocks, rows 0-3, 4-7 and 8-11 of each
    # were already stored by the 4-rank snapshot of jobA.)
    log = reports["async-rank0"]["log"]
    assert [i["step"] for i in log] == [2, 1]
    assert [(i["blocks_total"], i["blocks_new"]) for i in log] == [(16, 0), (16, 10)]


def test_overlapping_chunks_in_a_stored_dcp_tree_are_refused(small_store):
    """A DCP tree is untrusted input too: a tensor whose stored chunks overlap (which
    chunk would a read get?) is a FormatError, not a silent pick."""
    from tensorstore_ck.dcp.layout import DcpTree, compose
    from tensorstore_ck.core.validate import check_snapshot_args
    sd = {"w": torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4)}
    _save(sd, small_store, ref="jobA/dcp")
    good = DcpTree(small_store.assets, small_store.pool, small_store.show("jobA/dcp").root, True)
    dt, gs, chunks = good.chunks("w")
    assert gs == (64, 4) and list(chunks) == [(0, 0)]

    def chunk(a, b, off):
        raw = sd["w"][a:b].contiguous().view(torch.uint8).reshape(-1).numpy()
        d = small_store.assets.put_block(raw, 4).digest
        return {"dt": "float32", "sh": [b - a, 4], "off": [off, 0], "n": raw.nbytes, "bs": raw.nbytes, "b": [d]}

    tensors = {"w": {"G": {"dt": "float32", "sh": [64, 4], "chunks": [chunk(0, 48, 0), chunk(0, 16, 32)]}}}
    value = compose(tensors, {}, good.metadata_plain, small_store.planner())
    top, _ = small_store.publisher.write_nodes(value)
    args = check_snapshot_args("jobA/bad", step=1, expected=None)
    info = small_store.publisher.commit(top, args, stats={"bytes_total": 0, "bytes_new": 0, "blocks_total": 0,
                                                          "blocks_new": 0}, fence=small_store.publisher.fence())
    bad = DcpTree(small_store.assets, small_store.pool, info.root, True)
    with pytest.raises(tsck.FormatError, match=r"chunks at \[0, 0\] \(shape \[48, 4\]\) and \[32, 0\]"):
        bad.chunks("w")
    with pytest.raises(CheckpointException, match="overlap"):  # DCP wraps the reader's error
        dcp.load({"w": torch.zeros(64, 4)}, storage_reader=TsckReader(small_store, "jobA/bad"))
