"""Unchanged tensors are neither copied nor hashed (write/unchanged.py; docs/design/unchanged.md),
and no write to one is ever missed.

Each write path a training program has is tried on a watched tensor between two puts: the
second snapshot must hold the new bytes (checked by checkout), so a path the kernel's
watch missed fails here. Where nothing was written, the tensor's addresses must be reused
(the process's counters), so a watch that proves nothing fails too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.write.unchanged import MIN_BYTES, Unchanged

from _backends import OBJECT_PREFIXES

MiB = 1 << 20
N = 3 * MiB // 2  # float32s in a base tensor

pytestmark = pytest.mark.skipif(Unchanged.get() is None, reason="this kernel cannot watch writes (userfaultfd "
                                "asynchronous write-protection and PAGEMAP_SCAN: Linux 6.7+); every tensor is hashed")


def _counts():
    u = Unchanged.get()
    return u.reused, u.hashed


def _page_aligned(t: torch.Tensor) -> torch.Tensor:
    """t's values in memory of its own pages (a tensor that shares its first or last page
    with other memory is proven unchanged by a blocking put only while those pages are
    not written: a blocking put keeps no copy of what it hashed to tell a neighbour's
    write from its own)."""
    page = os.sysconf("SC_PAGE_SIZE")
    raw = torch.empty(t.nbytes + page, dtype=torch.uint8)
    at = (-raw.data_ptr()) % page
    out = raw[at:at + t.nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def _state(seed: int = 0, aligned: bool = False) -> dict:
    g = torch.Generator().manual_seed(seed)
    # 6 MiB each, frozen: two blocks, so not packed where a store packs one-block tensors (S3)
    base = {f"w{i}": torch.randn(N, generator=g) for i in range(3)}
    if aligned:
        base = {k: _page_aligned(v) for k, v in base.items()}
    return {"base": base, "lora": torch.randn(4096, generator=g), "step": 0}


def _same(a, b) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            _same(a[k], b[k])
        elif isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def _readv_into(t: torch.Tensor, at: int, data: bytes) -> None:
    r, w = os.pipe()
    try:
        os.write(w, data)
        os.readv(r, [memoryview(t.numpy()).cast("B")[at:at + len(data)]])  # the kernel writes the page
    finally:
        os.close(r)
        os.close(w)


def _thread(t: torch.Tensor) -> None:
    th = threading.Thread(target=lambda: t.__setitem__(12345, 9.5))
    th.start()
    th.join()


def _dlpack(t: torch.Tensor) -> None:
    np.from_dlpack(t)[777] = 3.25


def _no_grad(t: torch.Tensor) -> None:
    p = torch.nn.Parameter(t, requires_grad=True)  # the same memory, as an optimizer holds it
    with torch.no_grad():
        p[2048].mul_(-2.0)


WRITES = {
    "in-place op": lambda t: t[100:200].add_(1.0),
    ".data": lambda t: t.data.__setitem__(N - 1, 7.0),
    "numpy view": lambda t: t.numpy().__setitem__(500_000, -1.0),
    "dlpack": _dlpack,
    "torch.no_grad": _no_grad,
    "another thread": _thread,
    "a syscall (readv)": lambda t: _readv_into(t, 4 * 1000, b"\x01\x02\x03\x04"),
    "a copy_ into a slice": lambda t: t[MiB // 2:MiB // 2 + 10].copy_(torch.arange(10.0)),
}


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "async"])
@pytest.mark.parametrize("how", list(WRITES))
def test_every_write_path_to_a_watched_tensor_is_seen(tmp_path, how, blocking):
    state = _state(aligned=blocking)
    with tsck.open_store(tmp_path / "s") as store:
        for step in range(3):  # the second and third puts reuse the base
            state["step"] = step
            store.put_snapshot(state, ref="j/main", step=step, blocking=blocking)
            store.wait()
        reused, _ = _counts()
        state["step"] = 3
        store.put_snapshot(state, ref="j/main", step=3, blocking=blocking)
        store.wait()
        assert _counts()[0] == reused + 3, "nothing was written: every base tensor's addresses are reused"
        WRITES[how](state["base"]["w1"])
        state["step"] = 4
        store.put_snapshot(state, ref="j/main", step=4, blocking=blocking)
        store.wait()
        assert _counts()[0] == reused + 3 + 2, "the two tensors not written are reused, the written one is not"
        _same(store.checkout("j/main"), state)
        _same(store.checkout("j/main@3"), {**_state(), "step": 3})


def test_a_tensor_replaced_by_another_at_the_same_size_is_read_again(tmp_path):
    """A state whose tensor is a new one each time (another storage, maybe at the address
    the old one was freed from) is never taken for the old one."""
    with tsck.open_store(tmp_path / "s") as store:
        for step in range(4):
            state = {"w": torch.full((MiB,), float(step))}
            store.put_snapshot(state, ref="j/main", step=step)
            del state
        for step in range(4):
            assert torch.equal(store.checkout(f"j/main@{step}")["w"], torch.full((MiB,), float(step)))
        p = torch.nn.Parameter(torch.zeros(MiB))
        store.put_snapshot({"p": p}, ref="p/main", step=0)
        store.put_snapshot({"p": p}, ref="p/main", step=1)
        p.data = torch.ones(MiB)  # the parameter now holds another storage
        store.put_snapshot({"p": p}, ref="p/main", step=2)
        assert torch.equal(store.checkout("p/main")["p"], torch.ones(MiB))


def test_tensors_the_watch_cannot_vouch_for_are_hashed_every_time(tmp_path):
    """Shared memory (another process writes it with its own page tables), pinned memory
    (a device writes it by DMA) where torch has one, a file mapping, a tensor below
    MIN_BYTES, a non-contiguous one: never reused, and a change through another process
    is stored."""
    shared = torch.zeros(MiB).share_memory_()
    f = tmp_path / "mapped.bin"
    f.write_bytes(np.zeros(MiB, dtype=np.float32).tobytes())
    mapped = torch.from_file(str(f), shared=False, size=MiB, dtype=torch.float32)
    small = torch.zeros(MIN_BYTES // 4 - 1)
    strided = torch.zeros(2 * MiB)[::2]
    state = {"shared": shared, "mapped": mapped, "small": small, "strided": strided}
    with tsck.open_store(tmp_path / "s") as store:
        for step in range(3):
            store.put_snapshot(state, ref="j/main", step=step)
        reused, hashed = _counts()
        store.put_snapshot(state, ref="j/main", step=3)
        assert _counts()[0] == reused, "none of them is proven unchanged"
        # Another process writes the shared tensor (its file descriptor passed by torch's pickling).
        code = ("import sys, torch, torch.multiprocessing as mp\n"
                "t = torch.load(sys.argv[1], weights_only=False)\n"
                "t[5] = 11.0\n")
        torch.save(shared, tmp_path / "shared.pt")
        subprocess.run([sys.executable, "-c", code, str(tmp_path / "shared.pt")], check=True)
        shared[6] = 12.0  # (and here, for a machine where the child got a copy)
        f_bytes = bytearray(f.read_bytes())
        store.put_snapshot(state, ref="j/main", step=4)
        _same(store.checkout("j/main"), state)
        assert bytes(f_bytes) == f.read_bytes()


def test_a_block_lost_from_storage_is_written_again_from_the_unchanged_tensor(tmp_path):
    """The addresses are reused, but their blocks are looked for: a store that lacks them
    (another store, or blocks a gc removed) gets them from the tensor, checked against
    the address."""
    state = _state(3, aligned=True)
    with tsck.open_store(tmp_path / "a") as a, tsck.open_store(tmp_path / "b") as b:
        for step in range(3):
            a.put_snapshot(state, ref="j/main", step=step)
        reused, _ = _counts()
        info = b.put_snapshot(state, ref="j/main", step=0)  # the same process: the watch vouches
        assert _counts()[0] == reused + 3
        assert info.bytes_new >= 3 * 6 * MiB  # written to b from the tensors
        _same(b.checkout("j/main"), state)
        blocks = [p for p in (tmp_path / "b" / "blocks").rglob("*") if p.is_file()]
        assert blocks
        for p in blocks:
            p.unlink()
    with tsck.open_store(tmp_path / "b") as b:
        info = b.put_snapshot(state, ref="j/main", step=1)
        assert info.bytes_new >= 3 * 6 * MiB
        _same(b.checkout("j/main"), state)


def test_watch_writes_false_hashes_every_tensor(tmp_path):
    state = _state()
    with tsck.open_store(tmp_path / "s", watch_writes=False) as store:
        for step in range(3):
            store.put_snapshot(state, ref="j/main", step=step)
        reused, hashed = _counts()
        store.put_snapshot(state, ref="j/main", step=3)
        assert _counts() == (reused, hashed)


def _object_bytes(backend) -> int:
    return sum(backend.objects(OBJECT_PREFIXES).values()) if hasattr(backend, "objects") else 0


def test_a_frozen_base_costs_only_its_adapters_on_every_backend(backend):
    """Local disk, S3 with its packs, PostgreSQL refs: the base is reused (no copy, no
    hash), the new bytes are the adapter's, and every snapshot checks out exact."""
    state = _state(5, aligned=True)
    with backend.open() as store:
        for step in range(2):
            state["step"] = step
            store.put_snapshot(state, ref="ft/main", step=step)
        for step in range(2, 5):
            reused, hashed = _counts()
            state["lora"].add_(1.0)
            state["step"] = step
            info = store.put_snapshot(state, ref="ft/main", step=step, blocking=step % 2 == 0)
            if step % 2:
                info = info.result()
            assert _counts()[0] == reused + 3, "the three base tensors are proven unchanged"
            assert info.bytes_new < 1 * MiB  # the adapter and a few nodes
            got = store.checkout("ft/main")
            _same(got, state)


def test_through_a_local_tier_the_base_is_reused_and_reaches_the_remote_once(tmp_path):
    state = _state(7, aligned=True)
    with tsck.open_store(tmp_path / "remote", local=tmp_path / "tier") as store:
        for step in range(4):
            reused, _ = _counts()
            state["lora"].add_(1.0)
            state["step"] = step
            store.put_snapshot(state, ref="ft/main", step=step)
            if step >= 2:
                assert _counts()[0] == reused + 3
        assert store.wait_durable(timeout=120)
    with tsck.open_store(tmp_path / "remote") as remote:
        _same(remote.checkout("ft/main"), state)


def test_a_peft_fine_tune_snapshots_only_its_adapters(tmp_path):
    """A real peft LoRA over a real transformers Llama (its state_dict in peft's order, the
    base's projections 1 MiB each): after the first snapshots, each one reuses every base
    projection, stores the adapters and their optimizer moments new, and checks out exact."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=8, vocab_size=512,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(cfg), peft.LoraConfig(
        r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    watched = [k for k, v in model.state_dict().items() if "lora_" not in k and v.nbytes >= MIN_BYTES]
    assert len(watched) >= 14  # the projections of both layers, the embeddings and the head
    g = torch.Generator().manual_seed(1)
    with tsck.open_store(tmp_path / "s") as store:
        for step in range(5):
            ids = torch.randint(0, 512, (1, 8), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
            reused, _ = _counts()
            info = store.put_snapshot(state, ref="ft/main", step=step, blocking=False).result()
            if step >= 2:
                assert _counts()[0] - reused == len(watched)
                lora = sum(v.nbytes for k, v in state["model"].items() if "lora_" in k)
                assert info.bytes_new < 3 * lora + 256 * 1024  # adapters, two moments, nodes
        got = store.checkout("ft/main")
        _same(got["model"], dict(model.state_dict()))


def test_an_older_plans_addresses_bound_late_never_stand_for_a_newer_walk():
    """Two stores' puts of one tensor: store A plans it (its bytes X), the tensor is written
    (Y), store B plans it and hashes Y; A's background publisher binds X's addresses after
    B's. Whatever the order the binds arrive in, the next claim with no write since B's
    walk must not hand out X's addresses."""
    from tensorstore_ck.core.assets import PutResult
    u = Unchanged.get()
    t = _page_aligned(torch.zeros(N))
    ranges = [(0, t.nbytes)]
    first = u.claim(t, ranges)  # new here: bound once hashed
    assert callable(first)
    first([PutResult(b"w" * 32, True, t.nbytes)])
    bind_a = u.claim(t, ranges)
    assert type(bind_a) is list, "nothing written since: reused"
    t[7] = 1.0  # Y
    bind_a = u.claim(t, ranges)  # store A's claim: written, its bytes hashed later (X: as it stages them)
    assert u.claim(t, ranges) is None  # (written at two puts in a row: one put not watched)
    t[8] = 2.0
    bind_b = u.claim(t, ranges)  # store B's claim, after another write
    assert callable(bind_a) and callable(bind_b)
    bind_b([PutResult(b"y" * 32, True, t.nbytes)])
    bind_a([PutResult(b"x" * 32, True, t.nbytes)])  # A's publisher, late
    assert u.claim(t, ranges) == [b"y" * 32]
