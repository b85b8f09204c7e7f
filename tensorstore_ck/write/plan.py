"""State -> plan: every value of a state tree validated and every tensor cut into
block jobs before anything is written. The publisher (publish.py) runs the block
jobs, lays the nodes out and commits; nothing here writes.

Validation uses the manifest grammar's own decoder (format/tree.py) on every
planned leaf, so put_snapshot refuses exactly what checkout would refuse.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from dataclasses import dataclass, field

import msgpack
import numpy as np
import torch

from ..errors import UnsupportedType
from ..format import chunker
from ..format import tree
from ..format.dtypes import QUANT_NAMES, QUANT_REPR, np_dtype_out, torch_dtype_name
from ..format.tree import INT_MAX, INT_MIN, MAX_BIGINT_BYTES, MAX_DEPTH, NodeWriter, Pending, format_path
from ..util.paths import is_stateful
from .shard import Replicated, Sharded, from_dtensor, is_dtensor

__all__ = ["Planner", "Plan", "Pack", "contiguous", "pack_leaves"]

_PLACEHOLDER = b"\0" * tree.DIGEST_SIZE


def _quant_params(t: torch.Tensor):
    if t.dtype not in QUANT_REPR:
        return None
    scheme = t.qscheme()
    name = torch_dtype_name(t.dtype)
    if scheme == torch.per_tensor_affine:
        return name, {"s": "pt", "scale": float(t.q_scale()), "zp": int(t.q_zero_point())}
    if scheme == torch.per_channel_affine:
        return name, {"s": "pc", "scales": t.q_per_channel_scales().tolist(),
                      "zps": t.q_per_channel_zero_points().tolist(), "axis": int(t.q_per_channel_axis())}
    return None


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """t with conjugation and negation resolved, C-contiguous: the bytes a block holds
    (a copy only where one of those is needed)."""
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def copied(src: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether t, the host bytes planned for the caller's tensor src, is a copy (device -> host,
    int_repr, conj/neg, non-contiguous): then it is ours alone."""
    return src.is_quantized or src.device.type != "cpu" \
        or t.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()


def _check_utf8(s: str, path) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UnsupportedType(f"string is not valid UTF-8 ({e.reason} at index {e.start})",
                              format_path(path)) from None


def stored_int(x: int, path):
    """An int as stored: native within 64 bits, else {"i": signed big-endian bytes}."""
    if INT_MIN <= x <= INT_MAX:
        return x
    b = x.to_bytes((x.bit_length() + 8) // 8, "big", signed=True)
    if len(b) > MAX_BIGINT_BYTES:
        raise UnsupportedType(f"int of {x.bit_length()} bits is beyond the stored limit of "
                              f"{MAX_BIGINT_BYTES} bytes", format_path(path))
    return {"i": b}


@dataclass
class Leaf(Pending):
    """A tensor/array whose blocks are still to be written."""
    tag: str                 # "T" or "A"
    meta: dict               # dt, sh, n, bs, and tensor extras
    raw: object              # flat uint8 numpy view of the bytes (keeps them alive); None until
                             # staged for a device tensor
    itemsize: int
    ranges: list             # [(start, stop)]
    results: list = field(default_factory=list)  # PutResult per block, filled by executor.run_block_jobs
    device_src: object = None  # flat uint8 view of a contiguous device tensor (async staging)
    replicated: bool = False   # the same bytes on every rank (a collective put spreads its blocks)
    path: str = ""             # where in the state (spreads replicated blocks over ranks)
    private: bool = False      # raw is ours alone (staged, or a copy the planner made): blocks are
                               # hashed and written in place; else through a per-thread copy
    # Its blocks' addresses, when its tensor is proven unchanged since they were hashed
    # (unchanged.py): not staged nor hashed; raw is the tensor's own bytes, written from
    # (checked against the address) only where storage lost a block.
    known: list | None = None
    watch: object = None  # where a watched tensor's addresses and staged edges are recorded (unchanged.py)

    @property
    def nbytes(self) -> int:
        return self.ranges[-1][1] if self.ranges else 0

    pack: "Pack | None" = None  # the pack holding its bytes (Pack.members), else None
    pack_off: int = 0
    # Set for a pack's member when its blocks are written (packparts.py): the BLAKE3 of its
    # bytes, and, when a pack already stored holds them, (that pack, offset, its length).
    content: bytes | None = None
    reused: tuple | None = None

    def manifest_value(self, final: bool):
        meta = dict(self.meta)
        if not final and self.pack is not None:
            # The widest it can end up (a part of an older pack: any offset and length).
            del meta["bs"]
            n = self.nbytes
            meta["g"] = [_PLACEHOLDER, min(1 << 16, chunker.MAX_BLOCK_SIZE - n), chunker.MAX_BLOCK_SIZE]
            meta["h"] = _PLACEHOLDER
        elif self.reused is not None or self.pack is not None:
            del meta["bs"]
            meta["g"] = list(self.reused) if self.reused is not None else \
                [self.pack.results[0].digest, self.pack_off, self.pack.nbytes]
            if self.content is not None:
                meta["h"] = self.content
        else:
            meta["b"] = [r.digest for r in self.results] if final else [_PLACEHOLDER] * len(self.ranges)
        return meta if self.tag is None else {self.tag: meta}


@dataclass(eq=False)
class Pack(Leaf):
    """One block holding the bytes of many small leaves (`members`, each at its pack_off, in
    order, back to back): on an object store a request costs more than its bytes, and a rank
    of a large job holds thousands of small tensors (docs/design/scaling.md, "Packs"). It
    takes its members' place among a plan's block jobs; its members name it in the manifest.
    raw: None until staged (Plan.stage) or gathered (gather())."""
    members: list = field(default_factory=list)

    def gather(self) -> None:
        """The members' bytes copied together (a put that does not stage)."""
        buf = np.empty(self.nbytes, dtype=np.uint8)
        for m in self.members:
            buf[m.pack_off:m.pack_off + m.nbytes] = m.raw
        self.raw, self.private = buf, True


def claim(unchanged, leaf: Leaf, t: torch.Tensor) -> None:
    """Ask unchanged.py about the tensor a leaf reads in place: its addresses when proven
    unchanged, else (where watched) its results recorded once hashed."""
    got = unchanged.claim(t, leaf.ranges)
    if type(got) is list:
        leaf.known = got
    elif got is not None:
        got(leaf.results)
        leaf.watch = got


def leaf_parts(leaf: Leaf):
    """The leaves whose bytes a block job's leaf holds: a pack's members, else itself."""
    return leaf.members if type(leaf) is Pack else (leaf,)


def pack_leaves(leaves: list, pack_size: int) -> list:
    """leaves with the small ones (one block each, not replicated) packed, in order, into
    Packs of at most pack_size bytes of one item size (the codec codes a block by its item
    size); a pack of one stays a leaf. Deterministic in the leaves' sizes and order, so one
    layout packs the same way every time (the same packs' addresses when nothing changed)."""
    if pack_size <= 0:
        return leaves
    out: list = []
    run: list = []
    size = 0

    def close():
        if len(run) > 1:
            p = Pack(None, {}, None, run[0].itemsize, [(0, size)], members=list(run))
            off = 0
            for m in run:
                m.pack, m.pack_off = p, off
                off += m.nbytes
            out.append(p)
        else:
            out.extend(run)
        run.clear()

    for leaf in leaves:
        if leaf.replicated or not chunker.packable(len(leaf.ranges), leaf.nbytes, pack_size):
            out.append(leaf)
            continue
        if run and chunker.pack_full(size, run[0].itemsize, leaf.nbytes, leaf.itemsize, pack_size):
            close()
            size = 0
        run.append(leaf)
        size += leaf.nbytes
    close()
    return out


@dataclass
class Plan:
    value: object            # the manifest value with Leaf placeholders
    leaves: list
    inline_bytes: int = 0
    # Every piece of a global tensor: (path, dtype name, global shape, offsets, shape, replicated),
    # path as format_path writes it: what a collective put checks across ranks.
    pieces: list = field(default_factory=list)
    replicas: list = field(default_factory=list)  # (path, Leaf or inline chunk meta) of each Replicated
    # Bytes a staging buffer for this state should hold: what a plan from its kept layout
    # stages (plancache.py: the inline tensors too), so the next put reuses the buffer.
    reserve: int = 0
    kept: object = None  # plancache._Layout this whole plan kept (its staging views are made ahead)
    # The staging buffer in shared memory the plan was staged into (staging.SharedBuffer):
    # a saver process writes its blocks (saver.py); None: written on this process's threads.
    shared: object = None
    pack_size: int = 0  # the planner's: packs formed again at write time stay within it
    reused: list = field(default_factory=list)  # the leaves naming a part of a stored pack (packparts.py)
    # The gc fence its blocks were written under before publish(): a plan staged in waves
    # (waves.py), whose bytes are no longer held; None: publish() writes its blocks.
    written: int | None = None

    @property
    def staged_bytes(self) -> int:
        return sum(leaf.nbytes for leaf in self.leaves if leaf.known is None)

    def stage(self, buf: torch.Tensor) -> None:
        """Copy every leaf's bytes into `buf` (a reused uint8 host buffer of at
        least staged_bytes), so the caller may change its tensors as soon as
        this returns while the blocks are written in the background. Device
        tensors go through non_blocking copies on a side stream (into pinned
        memory when the pool pinned it), synchronised before returning."""
        stream = None
        if any(m.device_src is not None for leaf in self.leaves for m in leaf_parts(leaf)):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())  # see the tensors' final values
        off = 0
        for leaf in self.leaves:
            if leaf.known is not None:
                continue  # unchanged: its addresses are known, its bytes stay where they are
            n = leaf.nbytes
            dst = buf[off:off + n]
            for m in leaf_parts(leaf):  # a pack: its members back to back
                part = dst[m.pack_off:m.pack_off + m.nbytes] if m is not leaf else dst
                if m.device_src is not None:
                    with torch.cuda.stream(stream):
                        part.copy_(m.device_src, non_blocking=True)
                    m.device_src = None
                else:
                    part.copy_(torch.from_numpy(m.raw))  # torch's copy runs on several threads
            leaf.raw = dst.numpy()
            leaf.private = True  # nobody else writes the staging buffer
            if leaf.watch is not None:
                leaf.watch.staged(leaf.raw)
            off += n
        if stream is not None:
            stream.synchronize()


_META_ROOM = 1024  # more than an inline tensor's value holds besides its bytes (64 dims of shape at most)


def _inline_size(tag, meta, n: int) -> int:
    """The encoded size of {tag: meta} with its n bytes inline ("x")."""
    return len(msgpack.packb({tag: meta}, use_bin_type=True)) + 2 + (3 if n < 1 << 16 else 5) + n


class Planner:
    def __init__(self, *, block_size: int, inline_threshold: int, allow_pickle: bool = False,
                 defer_device: bool = False, cache=None, pack_size: int = 0, unchanged=None):
        self.block_size = block_size
        self.pack_size = pack_size  # small leaves packed into blocks of up to this (0: never)
        self.inline_threshold = inline_threshold
        self.allow_pickle = allow_pickle
        self.defer_device = defer_device  # leave device tensors for Plan.stage() to copy (it stages)
        self.cache = cache  # plancache.PlanCache: the layouts planned lately, or None
        self.unchanged = unchanged  # unchanged.Unchanged: tensors proven unchanged, or None

    def plan(self, state) -> Plan:
        flat = None
        if self.cache is not None:
            found, flat = self.cache.find(state, staged=self.defer_device, unchanged=self.unchanged)
            if found is not None:
                found.pack_size = self.pack_size
                return found
        self._leaves: list[Leaf] = []
        self._inline = 0
        self._pieces: list = []
        self._replicas: list = []
        self._tensors: list = []  # each top-level tensor's planned form, in state order
        self._in_place: list = []  # (leaf, tensor): leaves whose bytes are their tensor's memory
        value = self._plan(state, (), 0)
        self._leaves = pack_leaves(self._leaves, self.pack_size)
        if self.unchanged is not None:
            for leaf, t in self._in_place:
                if leaf.pack is None:
                    claim(self.unchanged, leaf, t)
        NodeWriter().check(value)  # no node may pass the readers' cap: refused before any write
        plan = Plan(value, self._leaves, self._inline, self._pieces, self._replicas, pack_size=self.pack_size)
        if flat is not None:
            plan.kept = self.cache.keep(flat, self._tensors)
            plan.reserve = 0 if plan.kept is None else plan.kept.staged_bytes
        return plan

    def _unsupported(self, obj, path, why=None):
        if self.allow_pickle and why is None:
            try:
                return {"P": pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)}
            except Exception as e:
                raise UnsupportedType(f"cannot pickle {type(obj).__name__}: {e}", format_path(path)) from None
        raise UnsupportedType(why or f"unsupported type {type(obj).__module__}.{type(obj).__qualname__}",
                              format_path(path))

    def _plan(self, obj, path, depth):
        self._path = path
        if depth > MAX_DEPTH:
            raise UnsupportedType(f"state nested deeper than {MAX_DEPTH} levels", format_path(path))
        t = type(obj)
        if t is str:
            _check_utf8(obj, path)
            return obj
        if obj is None or t is bool or t is bytes or t is float:
            return obj
        if t is int:
            return stored_int(obj, path)
        if t is dict or t is OrderedDict:
            items = []
            for k, v in obj.items():
                if type(k) is str:
                    _check_utf8(k, path + (k,))
                    ek = k
                elif type(k) is int:
                    ek = stored_int(k, path + (k,))
                else:
                    raise UnsupportedType(f"dict key of type {type(k).__name__} (only str and int keys)",
                                          format_path(path))
                items.append([ek, self._plan(v, path + (k,), depth + 1)])
            return {"d" if t is dict else "o": items}
        if t is list or t is tuple:
            return {"l" if t is list else "t": [self._plan(v, path + (i,), depth + 1) for i, v in enumerate(obj)]}
        if t is torch.Tensor or t is torch.nn.Parameter:
            v = self._plan_tensor(obj, path)
            self._tensors.append(v)
            return v
        if t is Sharded:
            return self._plan_global(obj.local, obj.global_shape, obj.offsets, path)
        if t is Replicated:
            tt = obj.tensor
            return self._plan_global(tt, tuple(tt.shape), (0,) * tt.dim(), path, replicated=True)
        if is_dtensor(obj):
            # Its box of the global tensor. Replicated mesh dims give identical pieces, which
            # tile as one; not tsck.Replicated, whose blocks are spread over every rank of the
            # group, while a DTensor's mesh may be a part of it (a pipeline stage).
            sh = from_dtensor(obj, format_path(path))
            return self._plan_global(sh.local, sh.global_shape, sh.offsets, path)
        if t is np.ndarray:
            return self._plan_array(obj, path)
        if isinstance(obj, np.generic):
            if obj.dtype.hasobject:
                return self._unsupported(obj, path)
            if obj.dtype.itemsize == 0:
                return self._unsupported(obj, path, f"numpy scalar of empty dtype {obj.dtype}")
            v = {"S": [np_dtype_out(obj.dtype), obj.tobytes()]}
            tree.check_leaf(v, path)  # e.g. a str_ with code points beyond U+10FFFF, a too deep dtype
            return v
        if is_stateful(obj):  # DCP's Stateful (a module, an optimizer): stored as its state_dict()
            try:
                sd = obj.state_dict()
            except Exception as e:  # noqa: BLE001 - the object's own failure
                raise UnsupportedType(f"{t.__name__}.state_dict() failed: {type(e).__name__}: {e}",
                                      format_path(path)) from e
            if not isinstance(sd, dict):
                raise UnsupportedType(f"{t.__name__}.state_dict() returned {type(sd).__name__}, not a dict",
                                      format_path(path))
            return self._plan(sd, path, depth)
        return self._unsupported(obj, path)

    def _leaf(self, tag, meta, raw, itemsize, shape, device_src=None, private=False):
        n = raw.nbytes if raw is not None else device_src.numel()
        meta["n"] = n
        inline = self.inline_threshold
        if (self.pack_size > 0 and tree.NODE_SPLIT - _META_ROOM < n <= inline
                and _inline_size(tag, meta, n) > tree.NODE_SPLIT):
            # Inline, it would be a node of its own (one object per tensor, what packs are
            # for: 10,000 tensors of 4-16 KiB made 5,000 node objects); packed instead.
            inline = 0
        layout = chunker.plan_blocks(n, itemsize, shape, self.block_size, inline)
        if layout.block_size == 0:
            meta["x"] = raw.tobytes() if raw is not None else device_src.cpu().numpy().tobytes()
            tree.check_leaf({tag: meta}, self._path)
            self._inline += n
            return {tag: meta}
        meta["bs"] = layout.block_size
        leaf = Leaf(tag, meta, raw, itemsize, [(a, b) for _, a, b in chunker.block_ranges(layout)],
                    device_src=device_src, path=format_path(self._path), private=private)
        tree.check_leaf(leaf.manifest_value(final=False), self._path)
        self._leaves.append(leaf)
        return leaf

    def _in_place_leaf(self, form, t: torch.Tensor):
        if (self.unchanged is not None and isinstance(form, Leaf) and not form.private and form.raw is not None
                and form.raw.nbytes >= self.unchanged.min_bytes):
            self._in_place.append((form, t))
        return form

    def _plan_global(self, local, global_shape, offsets, path, replicated: bool = False):
        """A piece of a global tensor: stored as {"G": {dt, sh, chunks: [chunk]}}; ranks'
        chunks of one tensor are merged by path at checkout."""
        if type(local) not in (torch.Tensor, torch.nn.Parameter) or local.is_quantized:
            raise UnsupportedType("a sharded tensor's local piece must be a dense tensor", format_path(path))
        leaf = self._plan_tensor(local, path)
        if isinstance(leaf, Leaf):
            leaf.tag = None  # finished as a bare chunk, not a {"T": ...} value
            chunk = leaf
        else:
            chunk = leaf["T"]
        meta = chunk.meta if isinstance(chunk, Leaf) else chunk
        meta["off"] = list(offsets)
        g = {"dt": meta["dt"], "sh": list(global_shape), "chunks": [chunk]}
        if replicated:
            g["rep"] = True
            if isinstance(chunk, Leaf):
                chunk.replicated = True
        probe = chunk.manifest_value(final=False) if isinstance(chunk, Leaf) else chunk
        tree.check_leaf({"G": {**g, "chunks": [probe]}}, path)
        where = format_path(path)
        self._pieces.append((where, meta["dt"], tuple(global_shape), tuple(offsets), tuple(local.shape), replicated))
        if replicated:
            self._replicas.append((where, chunk))
        return {"G": g}

    def _plan_tensor(self, obj: torch.Tensor, path):
        if obj.layout != torch.strided:
            return self._unsupported(obj, path, f"{obj.layout} tensors are not supported (only dense)")
        quant = None
        src = obj  # the caller's tensor: bytes still in its memory are not ours alone
        if obj.is_quantized:
            quant = _quant_params(obj)
            if quant is None:
                return self._unsupported(obj, path, f"quantized tensors of {obj.dtype} / {obj.qscheme()} "
                                                    "are not supported")
            obj = obj.int_repr()  # the stored bytes; "q" says how to re-quantize
        if obj.device.type == "meta":
            return self._unsupported(obj, path, "meta tensors have no data")
        t = obj.detach()
        on_device = t.device.type != "cpu"
        if on_device and not self.defer_device:
            t = t.cpu()
            on_device = False
        if torch_dtype_name(t.dtype) in QUANT_NAMES and not t.is_quantized:
            return self._unsupported(obj, path, f"a {t.dtype} view of a plain tensor is not a quantized tensor")
        try:
            t = contiguous(t)
        except Exception as e:  # torch has no copy kernel for some dtypes (uint1..7, int1..7)
            return self._unsupported(obj, path, f"a non-contiguous {t.dtype} tensor cannot be copied: "
                                                f"{type(e).__name__}; make it contiguous first")
        try:
            flat = t.reshape(-1).view(torch.uint8)
            raw, device_src = (None, flat) if on_device else (flat.numpy(), None)
        except Exception as e:
            return self._unsupported(obj, path, f"tensor of dtype {t.dtype} cannot be viewed as bytes: {e}")
        private = raw is not None and copied(src, t)
        meta = {"dt": str(t.dtype).removeprefix("torch."), "sh": list(t.shape)}
        if quant is not None:
            meta["dt"], meta["q"] = quant
        if type(obj) is torch.nn.Parameter:
            meta["p"] = True
        if obj.requires_grad:
            meta["rg"] = True
        if obj.device.type != "cpu":
            meta["dev"] = str(obj.device)
        return self._in_place_leaf(self._leaf("T", meta, raw, t.element_size(), tuple(t.shape), device_src, private),
                                   t)

    def _plan_array(self, a: np.ndarray, path):
        if a.dtype.hasobject:
            return self._unsupported(a, path, f"numpy arrays of dtype {a.dtype} are not supported")
        meta = {"dt": np_dtype_out(a.dtype), "sh": list(a.shape)}
        if a.flags.f_contiguous and not a.flags.c_contiguous:
            meta["fo"] = True
            body = a.T  # C-contiguous view of the same memory
        else:
            body = np.ascontiguousarray(a)
        raw = body.reshape(-1).view(np.uint8)
        return self._leaf("A", meta, raw, a.dtype.itemsize, tuple(body.shape),
                          private=not np.may_share_memory(body, a))
