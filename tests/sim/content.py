"""What the harness's writers put, regenerated from a small spec.

Every snapshot a worker puts is `state(spec)` for a spec like
{"w": "r3w1", "o": 7, "v": 2, "s": 30107}; the spec also goes into the
snapshot's meta (meta["sim"]), so the checker can rebuild the exact state of any
catalog row, ref tip, tag or pin, including those of puts whose outcome the
journal does not know (their worker was killed), and compare bit for bit.

Content is chosen to exercise dedup and gc's windows:
  base  one frozen tensor shared by every snapshot of every worker (stored once); float64
  var   one of VARIANTS tensors: a variant last used by snapshots that retention
        expired is a gc candidate that the next writer may reuse meanwhile
  own   unique to (worker, op), or again the one of an earlier op of that worker
  step, note  plain values (inlined in the manifest)
  stage half the collective puts (staged(spec)): a tensor sharded over ranks 1.. only, a
        pipeline stage rank 0 holds no piece of (one process must still read it back)
  grow  some asynchronous puts (spec["g"]): a tensor of a size drawn per call, so the
        staged states change size between calls
  small  a packing writer's puts (spec["p"]): two small tensors in one pack
  layout  some puts (spec["l"]) change the tree's layout under the same keys: ids as
        int32, own as a matrix, one more key; a writer's Store plans most puts
        from the layout it kept (plancache.py), so a kept plan used for a changed layout
        shows as a snapshot that is not state(spec)
  frozen  a writer's puts without a tier (spec["f"]: its version): one tensor of 1 MiB the
        worker keeps across its puts, as a fine-tune keeps its base, and changes now and
        then through a seeded write path (Worker.op_put: an in-place op, .data, a numpy
        view, DLPack, another thread, readv into it): the kernel's watch proves it
        unchanged between changes (write/unchanged.py), and a change it missed shows as a
        snapshot that is not state(spec)
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np
import torch

BLOCK_SIZE = 16384        # the harness store's block layout (set at creation)
INLINE_THRESHOLD = 1024
VARIANTS = 5
OWN_LEN = 6000          # own: 24000 B, 2 blocks (cut into row ranges by a collective put)
STAGE_SHAPE = (48, 160)  # stage: 30720 B, 2 blocks


def _seed(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little")


def _floats(n: int, *parts) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(_seed(*parts)).standard_normal(n, dtype=np.float32))


@functools.lru_cache(maxsize=None)
def _base() -> torch.Tensor:
    # 64 KiB, 4 blocks of float64s that float32 holds exactly: coded by 8 as a put codes
    # them, though a probe of the bytes alone would pick 4 (check.py's T19).
    return _floats(8192, "base").double()


@functools.lru_cache(maxsize=None)
def _variant(v: int) -> torch.Tensor:
    return _floats(8192, "variant", v).reshape(64, 128)  # 32 KiB: 2 blocks


FROZEN_LEN = 1 << 18  # frozen: 1 MiB of float32s, what write/unchanged.py watches at least


@functools.lru_cache(maxsize=4)
def _frozen_base() -> torch.Tensor:
    return _floats(FROZEN_LEN, "frozen")


def frozen_at(version: int) -> int:
    """Where change `version` writes its value (float(version)) into the frozen tensor."""
    return (version * 7919) % FROZEN_LEN


def frozen(version: int) -> torch.Tensor:
    """The frozen tensor after its changes 1..version."""
    t = _frozen_base().clone()
    for k in range(1, version + 1):
        t[frozen_at(k)] = float(k)
    return t


def make_spec(worker: str, op: int, variant: int, step: int, own: list | None = None) -> dict:
    """own: [worker, op] of an earlier put whose "own" tensor to put again (a restarted job
    re-saving a state saved before: blocks of an expired snapshot, gc candidates, return)."""
    spec = {"w": worker, "o": int(op), "v": int(variant), "s": int(step)}
    if own is not None and list(own) != [worker, op]:
        spec["u"] = [str(own[0]), int(own[1])]
    return spec


def _own(spec: dict) -> tuple:
    return tuple(spec["u"]) if "u" in spec else (spec["w"], spec["o"])


def staged(spec: dict) -> bool:
    """Whether a collective put of `spec` also puts "stage", sharded over ranks 1.. only:
    those of an even op index (the round's first, which every worker with ranks makes, and
    about half the others), decided by the spec: no draw from a worker's seeded stream."""
    return "c" in spec and int(spec["o"]) % 2 == 0


def state(spec: dict) -> dict:
    """The state for `spec`, freshly allocated (callers may mutate it): for a collective
    put, what one process reads back (the union of the ranks' states)."""
    st = {
        "base": _base().clone(),
        "var": _variant(int(spec["v"])).clone(),
        "own": _floats(OWN_LEN, "own", *_own(spec)),  # 24000 B: 2 blocks
        "ids": torch.arange(int(spec["o"]), int(spec["o"]) + 700, dtype=torch.int64),  # 5600 B: 1 block
        "step": int(spec["s"]),
        "note": f"{spec['w']}:{spec['o']}",
    }
    lay = int(spec.get("l", 0))  # (Worker.op_put's draw; never for a collective put)
    if lay == 1:
        st["ids"] = st["ids"].to(torch.int32)
    elif lay == 2:
        st["own"] = st["own"].reshape(60, 100)
    elif lay == 3:
        st["note2"] = st["note"]  # (a key added: a read of paths= may name any of the others)
    if spec.get("p"):  # a packing writer's put (Worker.op_put): small tensors a pack holds together,
        # one shared by the snapshots of a variant (a pack reused, a gc candidate), one its own
        st["small"] = [_floats(1500, "small", int(spec["v"])), _floats(1100, "small", *_own(spec))]
    if "g" in spec:  # an asynchronous put's extra tensor of a size drawn per call (Worker.op_put)
        st["grow"] = _floats(int(spec["g"]), "grow", spec["w"], spec["o"])
    if "f" in spec:
        st["frozen"] = frozen(int(spec["f"]))
    if staged(spec):
        st["stage"] = _floats(STAGE_SHAPE[0] * STAGE_SHAPE[1], "stage", spec["w"], spec["o"]).reshape(STAGE_SHAPE)
    return st


def stored_bytes(spec: dict) -> int:
    """An upper bound of what a put of `spec` stores new in an empty tier: its tensors'
    bytes (stored uncompressed at worst), plus frames, nodes and the commit (SLACK)."""
    return sum(v.numel() * v.element_size() for v in state(spec).values() if isinstance(v, torch.Tensor)) + SLACK


SLACK = 16384


def rank_state(spec: dict, rank: int, world: int) -> dict:
    """Rank `rank`'s part of a collective put of `spec` (spec["c"] == world): base and var
    replicated (each block written by one rank), own cut into row ranges (one sub-tree
    per rank, found through the chunk index), the rest the same on every rank. A whole
    checkout of the snapshot is exactly state(spec)."""
    import tensorstore_ck as tsck
    st = state(spec)
    a, b = OWN_LEN * rank // world, OWN_LEN * (rank + 1) // world
    st["base"] = tsck.Replicated(st["base"])
    st["var"] = tsck.Replicated(st["var"])
    st["own"] = tsck.Sharded(st["own"][a:b].clone(), (OWN_LEN,), (a,))
    if "stage" in st:  # rows over ranks 1..world-1; rank 0 holds none (not even the key)
        whole = st.pop("stage")
        if rank:
            n = STAGE_SHAPE[0]
            a, b = n * (rank - 1) // (world - 1), n * rank // (world - 1)
            st["stage"] = tsck.Sharded(whole[a:b].clone(), STAGE_SHAPE, (a, 0))
    return st


def own_piece(spec: dict, rank: int, world: int) -> tuple[torch.Tensor, int]:
    """(rank's rows of own, their offset)."""
    a, b = OWN_LEN * rank // world, OWN_LEN * (rank + 1) // world
    return state(spec)["own"][a:b], a


def differences(got, want, path: str = "") -> list[str]:
    """Where `got` differs from `want` (types, dtypes, shapes, bits); [] if identical."""
    if type(got) is not type(want):
        return [f"{path or '/'}: type {type(got).__name__} != {type(want).__name__}"]
    if isinstance(want, dict):
        if list(got) != list(want):
            return [f"{path or '/'}: keys {list(got)} != {list(want)}"]
        out = []
        for k in want:
            out += differences(got[k], want[k], f"{path}/{k}")
        return out
    if isinstance(want, list):
        if len(got) != len(want):
            return [f"{path or '/'}: {len(got)} items != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{path}/{i}")]
    if isinstance(want, torch.Tensor):
        if got.dtype != want.dtype or got.shape != want.shape:
            return [f"{path}: {got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"]
        def raw(t):
            return t.contiguous().view(torch.uint8).numpy().tobytes()
        if raw(got) != raw(want):
            return [f"{path}: bytes differ"]
        return []
    return [] if got == want else [f"{path}: {got!r} != {want!r}"]
