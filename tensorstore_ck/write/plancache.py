"""The plan of an unchanged layout, kept across snapshots (a Store's PlanCache).

A training job snapshots the same tree of the same tensors again and again; only their
values (and a few plain values: the step) change. Planning it whole (plan.py) costs tens
of microseconds a tensor (validation by the readers' decoder, the node layout's encoded
sizes), which at thousands of tensors is many times the copy an asynchronous put stalls
for. A PlanCache keeps what the planner decided for a layout: the tree flattened (every
container's type and length, every dict key, every value's type), each tensor's dtype,
shape, device, layout and requires_grad, and each tensor's planned form. A state whose
flattened tree and tensor attributes equal a kept layout's, and whose plain values have
the encoded sizes they had, is planned from it: the same manifest, node layout and
refusals as a whole plan (a plain value that changed is validated again). Anything else
is planned whole, and its layout kept in place of the oldest.
"""

from __future__ import annotations

import operator
import os
import threading
import warnings
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import msgpack
import torch

from ..errors import UnsupportedType
from ..format.tree import MAX_DEPTH, Pending
from .plan import Pack, Plan, copied, stored_int, Leaf, contiguous
from .unchanged import MIN_BYTES, live_bytes

__all__ = ["PlanCache"]

_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_PLAIN_TYPES = frozenset((type(None), bool, int, float, str, bytes))
_ALIGN = 64  # staging offsets: a typed view of the buffer needs its dtype's alignment


def _flatten(state):
    """state -> (keys, tensors, plains), or None when it holds anything but dicts,
    OrderedDicts, lists, tuples, str/int keys, plain values and plain tensors (the full
    planner then plans it, and refuses what it must)."""
    keys: list = []
    tensors: list = []
    plains: list = []
    key, tensor, plain = keys.append, tensors.append, plains.append

    def walk(obj, t, depth) -> bool:
        # A container: its length; a dict's keys, all of them first; then each value: its
        # type, and a container's own walk (an encoding read back one way only: build()).
        if depth > MAX_DEPTH:
            return False
        key(len(obj))
        if t is dict or t is OrderedDict:
            for k in obj:
                if type(k) is not str and type(k) is not int:
                    return False
            keys.extend(obj)
            obj = obj.values()
        for v in obj:
            tv = type(v)
            key(tv)
            if tv is torch.Tensor or tv is torch.nn.Parameter:
                tensor(v)
            elif tv in _PLAIN_TYPES:
                plain(v)
            elif not (tv in _CONTAINERS and walk(v, tv, depth + 1)):
                return False
        return True

    t = type(state)
    key(t)
    if t in _CONTAINERS:
        ok = walk(state, t, 1)
    elif t in _TENSOR_TYPES:
        ok = tensor(state) or True
    else:
        ok = t in _PLAIN_TYPES and (plain(state) or True)
    return (keys, tensors, plains) if ok else None


_CONTAINERS = {dict: "d", OrderedDict: "o", list: "l", tuple: "t"}


def _plain_size(v) -> int:
    return len(msgpack.packb(stored_int(v, ()) if type(v) is int else v, use_bin_type=True))


_viewable: dict = {}


def _stageable(dtype) -> bool:
    """Whether torch copies this dtype into a typed view of a staging buffer, from a strided
    source too (torch has no copy kernel for the sub-byte and quantized dtypes)."""
    ok = _viewable.get(dtype)
    if ok is None:
        try:
            a, b = (torch.zeros(_ALIGN, dtype=torch.uint8).view(dtype) for _ in range(2))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # complex32: "experimental"
                _copy_all([a], [b])
                a.view(2, -1)[:, :1].contiguous()
            ok = True
        except Exception:  # noqa: BLE001 - NotImplementedError, RuntimeError: not ours to stage
            ok = False
        _viewable[dtype] = ok
    return ok


@dataclass(eq=False)
class _Layout:
    """One kept layout (PlanCache)."""
    keys: list
    sig: list             # per tensor: _SIG (dtype, shape, device, layout, requires_grad)
    plains: list          # the plain values as last planned, and their encoded sizes
    plain_sizes: list
    forms: list           # per tensor: (tag, meta without addresses or bytes, itemsize, ranges, packed size, path);
                          # ranges None: inline
    offsets: list         # per tensor: where its bytes go in a staging buffer
    staged_bytes: int
    inline_bytes: int
    cpu: list             # the tensors on the host (copied in one call), by index
    packs: list           # per Pack: (where it starts in the buffer, item size, bytes); a form's
                          # last field (pack number, offset in it) or None
    watchable: list       # the host tensors of MIN_BYTES or more with blocks of their own, by index
                          # (unchanged.py may prove them unchanged)

    def views(self, buf: torch.Tensor) -> list:
        """Each tensor's typed view of `buf` where a plan from this layout stages it: made
        once a buffer and layout (kept with the buffer), and ahead of time by the whole
        plan's background publisher (Plan.kept), so the first put from the layout does not
        make 10,000 views on the training thread. One as_strided call a tensor, on the
        buffer viewed once per dtype (every offset is a multiple of its item size)."""
        got = getattr(buf, "_tsck_views", None)
        if got is not None and got[0] is self:
            return got[1]
        typed: dict = {}
        n = buf.numel()
        out = []
        for off, (dtype, shape, *_) in zip(self.offsets, self.sig):
            tv = typed.get(dtype)
            if tv is None:
                isz = dtype.itemsize
                tv = typed[dtype] = (buf[:n - n % isz].view(dtype), isz)
            stride, k = [], 1
            for d in reversed(shape):
                stride.append(k)
                k *= max(d, 1)  # (torch's contiguous strides: a 0-length dim counts as 1)
            out.append(tv[0].as_strided(shape, stride[::-1], off // tv[1]))
        buf._tsck_views = (self, out)
        return out


_SIG = operator.attrgetter("dtype", "shape", "device", "layout", "requires_grad")  # one C call a tensor


class PlanCache:
    """The layouts a Store's puts planned last (a few: a job may alternate between states).
    Shared by the store's threads: a layout, once kept, is never changed."""

    def __init__(self, size: int = 4):
        self.size = size
        self._layouts: list[_Layout] = []
        self.hits = 0
        self.misses = 0

    def find(self, state, *, staged: bool, unchanged=None):
        """-> (a plan of `state` from a kept layout or None, what keep() takes when the
        planner plans it whole: None when its layout cannot be kept). unchanged: the
        process's unchanged.Unchanged, or None."""
        flat = _flatten(state)
        if flat is None:
            return None, None
        lay = self.match(*flat)
        return (None if lay is None else _CachedPlan(lay, flat[1], flat[2], staged=staged, unchanged=unchanged)), flat

    def match(self, keys, tensors, plains) -> _Layout | None:
        sig = None
        for lay in list(self._layouts):
            if keys != lay.keys:  # (a list of another length differs at once)
                continue
            if sig is None:
                sig = list(map(_SIG, tensors))
            if sig == lay.sig and self._same_plains(lay, plains):
                self.hits += 1
                return lay
        self.misses += 1
        return None

    @staticmethod
    def _same_plains(lay: _Layout, plains) -> bool:
        if plains == lay.plains:
            return True
        for v, old, size in zip(plains, lay.plains, lay.plain_sizes):
            if v is old or v == old:
                continue
            if type(v) is str:
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return False  # the full planner says why
            try:
                if _plain_size(v) != size:
                    return False  # the node layout may change: checked whole
            except UnsupportedType:
                return False
        return True

    def keep(self, flat, forms) -> _Layout | None:
        """Keep the layout the planner just planned whole (flat: find()'s; forms: each
        tensor's planned form, a Leaf or an inline value, in state order) -> the layout
        (None: not kept). Not kept: quantized tensors (their parameters
        change) and dtypes torch cannot copy into a staging buffer."""
        keys, tensors, plains = flat
        if len(forms) != len(tensors):  # pragma: no cover - the planner plans each tensor once
            return None
        kept, offsets, off, inline = [], [], 0, 0
        packs: dict = {}  # id(Pack) -> (its number, where it starts in the buffer): staged whole
        for t, f in zip(tensors, forms):
            if t.is_quantized or not _stageable(t.dtype):
                return None
            if isinstance(f, Leaf) and f.pack is not None:
                at = packs.get(id(f.pack))
                if at is None:
                    at = packs[id(f.pack)] = (len(packs), off, f.pack.itemsize, f.pack.nbytes)
                    off += -(-f.pack.nbytes // _ALIGN) * _ALIGN
                kept.append((f.tag, f.meta, f.itemsize, f.ranges, f.packed_size, f.path, (at[0], f.pack_off)))
                offsets.append(at[1] + f.pack_off)  # (a multiple of its item size: typed views hold)
                continue
            if isinstance(f, Leaf):
                kept.append((f.tag, f.meta, f.itemsize, f.ranges, f.packed_size, f.path, None))
                n = f.nbytes
            else:
                (tag, meta), = f.items()
                size = len(msgpack.packb(f, use_bin_type=True))
                kept.append((tag, {k: v for k, v in meta.items() if k != "x"}, t.element_size(), None, size, "", None))
                n = meta["n"]
                inline += n
            offsets.append(off)
            off += -(-n // _ALIGN) * _ALIGN
        cpu = [i for i, t in enumerate(tensors) if t.device.type == "cpu"]
        lay = _Layout(keys, list(map(_SIG, tensors)), list(plains), [_plain_size(v) for v in plains],
                      kept, offsets, off, inline, cpu,
                      [(start, itemsize, n) for _k, start, itemsize, n in packs.values()],
                      [i for i in cpu if kept[i][3] is not None and kept[i][6] is None
                       and kept[i][3][-1][1] >= MIN_BYTES])
        self._layouts = [lay] + [x for x in self._layouts if x.keys != keys][:self.size - 1]
        return lay


class _Inline(Pending):
    """A tensor small enough to live in its node, planned from a kept layout: its bytes are
    read when the node is written (from the staging buffer, or the caller's tensor in a
    blocking put)."""

    def __init__(self, tag, meta, raw, packed_size):
        self.tag, self.meta, self.raw, self.packed_size = tag, meta, raw, packed_size

    def manifest_value(self, final: bool):
        return {self.tag: {**self.meta, "x": self.raw.tobytes()}}


class _CachedPlan(Plan):
    """A plan from a kept layout: staging copies the tensors into views of the buffer kept
    with the layout (one call for the host tensors); the leaves and the manifest value are
    made when first asked for, by the publisher (for an asynchronous put: in the background)."""

    from_cache = True  # (a waved put plans its state whole instead: Store._put_in_waves)
    __repr__ = object.__repr__  # not the dataclass's: it would make the leaves to print them
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __init__(self, lay: _Layout, tensors, plains, staged: bool, unchanged=None):
        self._lay, self._tensors, self._plains, self._staged = lay, tensors, plains, staged
        self._leaves = self._value = None
        self._buf = None
        self.inline_bytes = lay.inline_bytes
        self.pieces, self.replicas = [], []
        self.reused, self.pack_size = [], 0
        self._known: dict = {}  # tensor index -> its blocks' addresses (proven unchanged)
        self._live: dict = {}   # tensor index -> its own bytes (a known one's)
        self._bind: dict = {}   # tensor index -> where its results are recorded once hashed
        if unchanged is not None:
            for i in lay.watchable:
                got = unchanged.claim(tensors[i], lay.forms[i][3])
                if type(got) is list:
                    self._known[i], self._live[i] = got, live_bytes(tensors[i])
                elif got is not None:
                    self._bind[i] = got

    @property
    def staged_bytes(self) -> int:
        return self._lay.staged_bytes

    def stage(self, buf: torch.Tensor) -> None:
        lay = self._lay
        dst, src = lay.views(buf), self._tensors
        with torch.no_grad():
            if len(lay.cpu) == len(src) and not self._known and not self._bind:
                _copy_all(dst, src)
            else:
                cpu = [i for i in lay.cpu if i not in self._known] if self._known else lay.cpu
                _copy_all([dst[i] for i in cpu], [src[i] for i in cpu])
                for i, bind in self._bind.items():  # what is hashed: the shared edges kept from it
                    bind.staged(dst[i].reshape(-1).view(torch.uint8).numpy())
                if len(lay.cpu) == len(src):
                    return self._hold(buf)
                on_host = set(lay.cpu)
                dev = [i for i in range(len(src)) if i not in on_host]
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())  # see the tensors' final values
                with torch.cuda.stream(stream):  # into pinned memory: asynchronous copies, one call
                    _copy_some([dst[i] for i in dev], [src[i] for i in dev], non_blocking=True)
                stream.synchronize()
        self._hold(buf)

    def _hold(self, buf: torch.Tensor) -> None:
        self._buf = buf
        self._tensors = None  # the caller's tensors are not read again

    @property
    def leaves(self) -> list:
        if self._leaves is None:
            self._make()
        return self._leaves

    @leaves.setter
    def leaves(self, leaves: list) -> None:  # what is to be written (packparts.reuse_parts)
        if self._leaves is None:
            self._make()
        self._leaves = leaves

    @property
    def value(self):
        if self._leaves is None:  # (a state may be None itself: made is told by the leaves)
            self._make()
        return self._value

    def _bytes(self, i, n):
        live = self._live.get(i)
        if live is not None:
            return live, False
        if self._buf is not None:
            off = self._lay.offsets[i]
            return self._np[off:off + n], True
        t = self._tensors[i].detach()
        t = contiguous(t.cpu() if t.device.type != "cpu" else t)
        return t.reshape(-1).view(torch.uint8).numpy(), copied(self._tensors[i], t)

    def _make(self) -> None:
        if self._staged and self._buf is None:
            raise RuntimeError("a staged plan's leaves were asked for before it was staged")  # pragma: no cover
        self._np = self._buf.numpy() if self._buf is not None else None
        pending, leaves = [], []
        packs: list = [None] * len(self._lay.packs)
        for i, (tag, meta, itemsize, ranges, size, path, in_pack) in enumerate(self._lay.forms):
            if ranges is None:
                raw, _ = self._bytes(i, meta["n"])
                p = _Inline(tag, meta, raw, size)
            else:
                raw, private = self._bytes(i, ranges[-1][1])
                p = Leaf(tag, meta, raw, itemsize, ranges, path=path, private=private)
                p.packed_size = size
                if i in self._known:
                    p.known = self._known[i]
                elif i in self._bind:
                    self._bind[i](p.results)
                if in_pack is None:
                    leaves.append(p)
                else:
                    k, p.pack_off = in_pack
                    if packs[k] is None:  # staged: the pack is its span of the buffer
                        start, isz, n = self._lay.packs[k]
                        packs[k] = Pack(None, {}, None if self._np is None else self._np[start:start + n], isz,
                                        [(0, n)], private=self._np is not None)
                        leaves.append(packs[k])
                    p.pack = packs[k]
                    p.pack.members.append(p)
            pending.append(p)
        nxt, leaf, plain = iter(self._lay.keys).__next__, iter(pending).__next__, iter(self._plains).__next__

        def build():
            t = nxt()
            if t in _CONTAINERS:
                n = nxt()
                if t is dict or t is OrderedDict:
                    ks = [nxt() for _ in range(n)]
                    return {_CONTAINERS[t]: [[stored_int(k, ()) if type(k) is int else k, build()] for k in ks]}
                return {_CONTAINERS[t]: [build() for _ in range(n)]}
            if t is torch.Tensor or t is torch.nn.Parameter:
                return leaf()
            v = plain()
            return stored_int(v, ()) if t is int else v
        self._value = build()
        self._leaves = leaves
        self._tensors = self._plains = None
        self._live = self._bind = None


_COPY_BATCH = 512  # tensors per helper thread at least: below it the hand-off costs more than it saves
_copiers: ThreadPoolExecutor | None = None  # made at first use; again in a forked child (its threads are gone)
_copiers_lock = threading.Lock()


def _forget_copiers() -> None:
    global _copiers
    _copiers = None


os.register_at_fork(after_in_child=_forget_copiers)


def _copy_some(dst: list, src: list, non_blocking: bool = False) -> None:
    if not src:
        return  # (torch refuses an empty list)
    if hasattr(torch, "_foreach_copy_"):
        torch._foreach_copy_(dst, src, non_blocking=non_blocking)  # a C++ loop: no Python per tensor
    else:  # pragma: no cover - torch without it
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=non_blocking)


def _copy_all(dst: list, src: list) -> None:
    """dst[i].copy_(src[i]) for every i, in slices on as many threads as torch's own ops
    use (a copy of many small tensors runs each on one thread; the caller waits for all)."""
    global _copiers
    k = max(1, min(torch.get_num_threads(), 8, len(src) // _COPY_BATCH))
    if k == 1:
        _copy_some(dst, src)
        return
    with _copiers_lock:  # (two stores' puts may stage at once)
        if _copiers is None:
            _copiers = ThreadPoolExecutor(7, thread_name_prefix="tsck-stage")
    cut = [len(src) * i // k for i in range(k + 1)]
    futs = [_copiers.submit(_copy_some, dst[a:b], src[a:b]) for a, b in zip(cut[1:-1], cut[2:])]
    try:
        _copy_some(dst[:cut[1]], src[:cut[1]])
    finally:
        for f in futs:
            f.result()
