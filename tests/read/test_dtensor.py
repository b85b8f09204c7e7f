"""Checkout into DTensors and Sharded targets, across world sizes and meshes.

The multi-rank scenarios run in tests/helpers/dtensor_worker.py (real gloo ranks
forked by dist_worker.launch, CPU DTensors on a DeviceMesh("cpu", ...), FSDP2's
fully_shard); the ranks record what they got (local shards, offsets, the whole
tensor gathered by DTensor.full_tensor() over gloo, block keys read) and this
file judges against data and block layouts computed here.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path

import blake3
import pytest
import torch

from _util import load_helper, rank_results, run_worker_scenario, same_bits

import tensorstore_ck as tsck

HERE = Path(__file__).resolve().parents[1]
REPO = HERE.parent
WORKER = HERE / "helpers" / "dtensor_worker.py"


dtw = load_helper(WORKER, sibling_imports=True)  # it imports dist_worker, its launcher


def run_scenario(tmp_path: Path, scenario: str, *args, limit: float = 400.0) -> Path:
    return run_worker_scenario(WORKER, tmp_path, scenario, *args, limit=limit)


def results(out: Path, phase: str, world: int) -> list[dict]:
    return rank_results(out, phase, world)


def dumped(out: Path, phase: str, rank: int) -> dict:
    return torch.load(out / f"{phase}_rank{rank}.pt", weights_only=False)


def piece(g: torch.Tensor, splits) -> tuple[torch.Tensor, list]:
    """DTensor's documented layout, computed independently: Shard(d) over n ranks gives rank
    i torch.chunk(n, d)[i] (ceil-sized pieces; ranks past the last piece hold an empty one).
    splits: [(dim, n, i)] applied in mesh-dim order. Returns the piece and its offsets."""
    off = [0] * g.dim()
    for d, n, i in splits:
        size = -(-g.shape[d] // n)
        a = min(i * size, g.shape[d])
        b = min(a + size, g.shape[d])
        g = g.narrow(d, a, b - a)
        off[d] += a
    return g, off


def tbytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def block_keys(t: torch.Tensor) -> tuple[list[str], int]:
    """A stored piece's block keys: blocks are cut at whole rows when a row fits in a
    block, and named by blake3 of their bytes. Returns (keys, block size)."""
    raw = tbytes(t)
    if len(raw) <= dtw.INLINE:
        return [], 0
    row = t.dtype.itemsize * math.prod(t.shape[1:])
    unit = row if row <= dtw.BLOCK else t.dtype.itemsize
    bs = (dtw.BLOCK // unit) * unit
    hs = [blake3.blake3(raw[i:i + bs]).hexdigest() for i in range(0, len(raw), bs)]
    return [f"blocks/{h[:2]}/{h}" for h in hs], bs


def check_load(out, phase, world, names, splits_of):
    """Every rank's local shard is its piece of the global tensor and full_tensor() the
    global tensor, bit for bit; the DTensors stayed in the into= tree."""
    for r, d in enumerate(results(out, phase, world)):
        got = dumped(out, phase, r)
        assert d["same_object"], "checkout(into=...) must return the into tree"
        for n in names:
            g = dtw.global_tensor(n)
            want, off = piece(g, splits_of(r))
            assert d["types"][n] == "DTensor", (phase, r, n)
            assert d["offsets"][n] == off, (phase, r, n)
            assert same_bits(want, got["local"][n]), f"{phase} rank {r}: {n}'s local shard differs"
            assert same_bits(g, got["full"][n]), f"{phase} rank {r}: {n}'s full tensor differs"


@pytest.fixture(scope="module")
def reshard(tmp_path_factory) -> Path:
    """One run of the reshard scenario (saves and nine checkouts: ~1 min) for the tests below."""
    return run_scenario(tmp_path_factory.mktemp("dtensor"), "reshard")


@pytest.mark.slow
def test_dtensors_saved_at_4_check_out_at_2_and_on_2d_meshes_bit_exact(reshard):
    out = reshard
    names = list(dtw.TENSORS)
    saved = results(out, "save", 4)
    assert len({d["root"] for d in saved}) == 1
    assert len({d["root"] for d in results(out, "save2d", 4)}) == 1

    # The put stored each DTensor as its global tensor in pieces (or once, replicated).
    with tsck.open_store(out / "store", create=False) as s:
        full = s.checkout(dtw.REF, group=False)
        for n in names:
            assert type(full[n]) is torch.Tensor and same_bits(dtw.global_tensor(n), full[n]), n
        full2d = s.checkout(dtw.REF2D, group=False)
        for n in ("w", "c", "tiny"):
            assert same_bits(dtw.global_tensor(n), full2d[n]), n
        assert s.fsck().ok

    check_load(out, "load2_S0", 2, names, lambda r: [(0, 2, r)])
    check_load(out, "load2_S1", 2, names, lambda r: [(1, 2, r)])
    check_load(out, "load2_R", 2, names, lambda r: [])
    # 2x2 mesh, placements (Shard(1), Shard(0)): rank r sits at mesh coordinates (r // 2, r % 2).
    check_load(out, "load2x2", 4, names, lambda r: [(1, 2, r // 2), (0, 2, r % 2)])
    check_load(out, "from2d", 2, ["w", "c", "tiny"], lambda r: [(0, 2, r)])


@pytest.mark.slow
def test_dtensor_checkout_reads_only_the_blocks_of_its_local_shard(reshard):
    out = reshard
    g = dtw.global_tensor("w")
    saved = [piece(g, [(0, 4, s)]) for s in range(4)]  # Shard(0) at world 4
    all_keys = set()
    for t, _off in saved:
        all_keys |= set(block_keys(t)[0])
    check_load(out, "loadw", 2, ["w"], lambda r: [(0, 2, r)])
    for r, d in enumerate(results(out, "loadw", 2)):
        _t, (lo, _) = piece(g, [(0, 2, r)])
        hi = lo + _t.shape[0]
        need = []
        for t, (a, _) in saved:
            keys, bs = block_keys(t)
            row = t.dtype.itemsize * t.shape[1]
            c, e = max(a, lo), min(a + t.shape[0], hi)
            if c < e:
                need += keys[(c - a) * row // bs: -(-(e - a) * row // bs)]
        reads = collections.Counter(d["reads"])
        assert set(reads) == set(need), (f"rank {r}: read {len(set(reads) - set(need))} blocks it does not need, "
                                         f"missed {len(set(need) - set(reads))}")
        assert max(reads.values()) == 1
        assert len(need) < len(all_keys)  # not vacuous: a part of the tensor's blocks


@pytest.mark.slow
def test_partial_dtensor_is_refused_by_put_and_checkout_on_every_rank(reshard):
    out = reshard
    for d in results(out, "partial", 2):
        assert d["put"][0] == "UnsupportedType" and "state['p']" in d["put"][1], d
        assert d["checkout"][0] == "UnsupportedType" and "state['r']" in d["checkout"][1], d
        assert d["published"] is False
        assert d["target_kept"] is True


@pytest.mark.slow
@pytest.mark.parametrize("bare", [0, 1], ids=["wrappers", "bare"])
def test_fsdp2_model_and_optimizer_saved_at_2_resume_at_3_bit_exact(tmp_path, bare):
    """bare=0: torchtitan's way (Statefuls of get_model_state_dict / get_optimizer_state_dict);
    bare=1: the model and a fresh torch.optim.Adam themselves, as one process would, whose
    state checkout creates as DTensors before filling it (else whole plain tensors: the
    next step() raised "aten.lerp_ got mixed torch.Tensor and DTensor")."""
    out = run_scenario(tmp_path, "fsdp", bare)
    saved = results(out, f"fsdp{bare}_save", 2)
    assert saved[0]["param_types"] == ["DTensor"]  # fully_shard ran: the parameters are DTensors
    want = dumped(out, f"fsdp{bare}_save", 0)
    assert len(want) == 4 + 4 * 3  # 4 parameters; Adam: step, exp_avg, exp_avg_sq of each
    for r, d in enumerate(results(out, f"fsdp{bare}_resume", 3)):
        got = dumped(out, f"fsdp{bare}_resume", r)
        assert sorted(got) == sorted(want)
        for k in want:
            assert same_bits(want[k], got[k]), f"rank {r}: {k} differs after resuming at world 3"
        assert d["step"] == 3
        assert d["local_shapes"]["0.weight"] == [[3, 10], [3, 10], [1, 10]][r]  # 7 rows over 3 ranks
        assert all(math.isfinite(x) for x in d["losses"])  # training goes on from the restored state


def test_whole_tensor_snapshot_into_a_sharded_target_fills_its_region(tmp_path):
    """A one-process snapshot holds a plain tensor; a Sharded target (any rank of any later
    world size) gets its region, in place, reading only those rows' blocks."""
    g = torch.randn(300, 40)
    with tsck.open_store(tmp_path / "s", block_size=4096, inline_threshold=256) as s:
        s.put_snapshot({"t": g}, "a/b", step=1)
        target = tsck.Sharded(torch.zeros(100, 40), (300, 40), (150, 0))
        into = {"t": target}
        got = s.checkout("a/b", into=into)
        assert got is into and got["t"] is target
        assert same_bits(g[150:250], target.local)
        with pytest.raises(tsck.errors.CheckoutMismatch):
            s.checkout("a/b", into={"t": tsck.Sharded(torch.zeros(10, 40), (301, 40), (0, 0))})


def test_quantized_tensor_into_a_sharded_target_is_a_clear_mismatch(tmp_path):
    q = torch.quantize_per_tensor(torch.randn(64, 8), 0.1, 3, torch.qint8)
    with tsck.open_store(tmp_path / "s") as s:
        s.put_snapshot({"q": q}, "a/b", step=1)
        target = tsck.Sharded(torch.zeros(32, 8, dtype=torch.int8), (64, 8), (0, 0))
        with pytest.raises(tsck.errors.CheckoutMismatch, match="quantized"):
            s.checkout("a/b", into={"q": target})
        assert not target.local.any()
