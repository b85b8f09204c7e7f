"""The read side: a manifest tree -> a state, blocks read in parallel.

Every node is decoded by the manifest grammar (format/tree.py), which checks
every field; this module only materialises typed values: allocates each
tensor once, schedules one read per block straight into its memory, and
bounds what a hostile manifest can make it allocate. A Reader reads one
snapshot; its sharded tensors and the merge of a multi-rank snapshot's rank
trees are read_world.py's (the WorldReading it inherits), and where a fresh
tensor is placed (map_location) is placement.py's.

The caller's memory (checkout(into=), DCP's load targets) only ever receives
verified bytes: a block bound for it is read and verified in a per-thread
scratch buffer first ("bounce" jobs), and everything else checkout(into=)
changes in the caller's tree (inline tensors, staged copies, container
items) is applied only once every block has been read and verified. Fresh
tensors are read into directly: a failed checkout never hands them out.
"""

from __future__ import annotations

import math
import os
import pickle
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..core.roles import ObjectReader
from ..errors import CheckoutMismatch, FormatError, IntegrityError, UnsupportedType, into_summary
from ..format import tree
from ..format.dtypes import QUANT_BY_NAME, code_units
from ..format.manifest import decode_node
from ..format.tree import format_path
from ..util.paths import FULL, SKIP, Selection, is_stateful
from ..write.shard import Sharded, from_dtensor, is_dtensor
from .placement import Placement, check_map_location
from .read_world import Gathered, WorldReading
from .readjobs import PackCache, part_job, run_reads
from .world_view import VALUE_COST, Merged

__all__ = ["Reader", "default_max_bytes", "MISSING"]

# A fresh tensor bigger than this is allocated only once all its blocks are known
# to exist (one HEAD / stat per distinct block; smaller ones are not worth it).
PRESENCE_CHECK_ABOVE = 64 << 20

MISSING = _MISSING = object()  # checkout without into=
_SKIPPED = object()  # a value the selection (paths=) leaves out



def default_max_bytes() -> int:
    """The host's RAM + swap: the most a checkout into fresh memory can hold."""
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("SwapTotal:"):
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return total



class Reader(WorldReading):
    """Decode a manifest tree back into a state, reading blocks in parallel.

    Stored bytes are untrusted: the grammar checks every field before use, and
    nothing from a manifest is executed (pickle only if allowed)."""

    def __init__(self, assets: ObjectReader, pool: ThreadPoolExecutor, *, snapshot: str, verify: bool = True,
                 allow_pickle: bool = False, max_bytes: int | None = None, rank: int | None = 0, progress=None,
                 paths=None, map_location=None, fence: int | None = None, parts_seen: list | None = None,
                 plan=None):
        self._opts = dict(verify=verify, allow_pickle=allow_pickle, max_bytes=max_bytes, rank=rank,
                          progress=progress, fence=fence, parts_seen=parts_seen)
        # parts_seen: where to note (h, pack, offset, pack length, length) of each packed part
        # read with its content hash, checked against it (a later put of this Store names it)
        self.parts_seen = parts_seen if verify else None
        # fence: the gc epoch read before this checkout began (Store.checkout): what it
        # reads is recorded present under it, and a big tensor's blocks seen under it are
        # not asked again (presence.py)
        self.fence = fence
        # plan: (jobs, this reader's ObjectReader) -> the ObjectReader to run them through,
        # asked once, for the reads of the tree it materializes (a collective checkout's shared reads)
        self._plan = plan
        # paths: only the sub-trees these dotted paths name are read (nodes and blocks)
        self.select = None if paths is None else Selection(paths)
        self.map_location = check_map_location(map_location)
        self._place = Placement(self.map_location, snapshot)
        self.progress = progress  # progress(bytes) per block read (a terminal's bar)
        # rank: whose tree of a multi-rank snapshot this reads (a collective checkout);
        # None: one process's view, every rank's tree merged (world_view.py)
        self.one = rank is None
        self.rank = 0 if rank is None else rank
        self.assets = assets
        self.pool = pool
        self.snapshot = snapshot
        self.verify = verify
        self.allow_pickle = allow_pickle
        # What a manifest may make us allocate: by default the host's memory (RAM +
        # swap), since a checkout into fresh CPU memory cannot hold more anyway.
        self.max_bytes = default_max_bytes() if max_bytes is None else int(max_bytes)
        self._allocated = 0
        self._jobs: list[tuple[bytes, object, str, bool]] = []
        self._after: list = []     # run once every block is read and verified
        self._packs = PackCache()  # the packs read last (reads of one leaf at a time reuse them)
        self._assign: list = []    # (container, key, value) of the caller's tree, set then too
        self._staged: set = set()  # paths of the caller's tensors that also get an after-copy
        self._loads: list = []     # (Stateful, state dict, path): load_state_dict once all is in place
        # Decoded nodes by (address, depth, world): each is fetched and decoded once per
        # checkout, however many paths name it. _sizes: (values, tensor bytes) under a node.
        self._decoded: dict = {}
        self._sizes: dict = {}
        self._keymaps: dict = {}   # id(decoded dict container) -> (it, {key: value}): rank-tree lookups
        self._unions: dict = {}    # extend -> the world_view.Union merging this snapshot's rank trees
        self._whole: dict = {}     # id -> a sharded tensor merged from every rank's pieces
        self._multi: tree.World | None = None  # the multi-rank snapshot being read (any version)
        self._views: dict = {}     # (preferred rank, extend, selection state) -> its merged rank trees
        self._ix_prefixes: dict = {}  # id(chunk index) -> (it, format_paths at and above its tensors)
        self._world: tree.World | None = None  # a version-2 multi-rank snapshot being read
        self._buckets: dict = {}   # bucket number -> {format_path: [(rank, offsets, shape)]}
        self._rank_tops: dict = {}  # rank -> its tree's address (version 2)

    def read(self, top: bytes, into=_MISSING):
        """The state under the top node `top` (into=: update that tree in place)."""
        return self.materialize(self.top(top), (), into)

    def top(self, top: bytes):
        """The decoded value of the top node `top`."""
        return self._node(top, (), 0, world=True)

    def deref(self, v, path):
        """A value with its node references followed (nodes read once per checkout)."""
        return self._deref(v, path, len(path))

    def plain(self) -> "Reader":
        """A reader of the same snapshot without selection nor device mapping (metadata)."""
        return Reader(self.assets, self.pool, snapshot=self.snapshot, **self._opts)

    def flat(self, container: tree.Container, path, into=_MISSING) -> dict:
        """A dict container's values by key, every key read (into=: a dict of the caller's
        tensors to fill in place by key; the other keys come back fresh)."""
        r = Reader(self.assets, self.pool, snapshot=self.snapshot, map_location=self.map_location, **self._opts)
        return r.materialize(container, path, into, ext=True)

    def materialize(self, value, path=(), into=_MISSING, *, ext: bool = False):
        """A decoded manifest value (tree.decode_value's result) -> python values.

        Before anything is allocated, the whole tree is measured over distinct nodes:
        every path counts (a node named at two paths is two sub-trees of the result), and
        a tree whose values * VALUE_COST or whose fresh tensor bytes pass max_bytes is
        refused (FormatError) at once, whatever the number of paths.

        With into=, a failure leaves each value in the tree either untouched, fully
        replaced or (the few whose blocks were being copied) partly replaced, by
        verified snapshot bytes only; an IntegrityError says which paths are which."""
        sel = FULL if self.select is None else self.select.at(path)
        values, nbytes = self._measure(value, path, len(path), sel, _MISSING if ext else into)
        if values * VALUE_COST > self.max_bytes or (into is _MISSING and nbytes > self.max_bytes):
            raise self._fmt(f"the snapshot's tree holds {values} values and {nbytes} tensor bytes at its paths, "
                            f"more than max_bytes={self.max_bytes} allows ({VALUE_COST} bytes per value; "
                            "checkout(..., max_bytes=N) raises the cap)", path)
        if values > tree.MAX_VALUES:  # what no writer makes, whatever max_bytes allows
            raise self._fmt(f"the snapshot's tree holds {values} values at its paths, more than the format's "
                            f"{tree.MAX_VALUES} (nodes shared at many paths)", path)
        if self.select is not None:
            self.select.check_matched(self.snapshot)
        written: dict = {}
        reading = False
        try:
            out = self._value(value, path, len(path), into, sel, ext)
            if out is _SKIPPED:
                out = {}
            reading = True
            self._run_jobs(written, planned=True)
        except BaseException as e:
            self._jobs, self._after, self._assign, self._loads = [], [], [], []
            if into is _MISSING or not (reading or isinstance(e, IntegrityError)):
                raise  # e.g. CheckoutMismatch while walking the tree: nothing was written
            raise self._into_failure(e, written) from None
        after, self._after = self._after, []
        assign, self._assign = self._assign, []
        self._staged = set()
        for fn in after:
            fn()
        for container, key, v in assign:
            container[key] = v
        loads, self._loads = self._loads, []
        for obj, sd, p in loads:
            try:
                obj.load_state_dict(sd)
            except Exception as e:  # noqa: BLE001 - each Stateful fails in its own way
                raise CheckoutMismatch(f"{type(obj).__name__}.load_state_dict at {format_path(p) or 'top'} "
                                       f"refused snapshot {self.snapshot[:16]}'s state: "
                                       f"{type(e).__name__}: {e}") from e
        return out

    def _into_failure(self, e: BaseException, written: dict) -> BaseException:
        """The error of a checkout(into=) that failed, saying what it changed."""
        replaced, partial = [], []
        for p, (done, total) in written.items():
            if done == total and p not in self._staged:
                replaced.append(p)
            elif done:
                partial.append(p)
        self._staged = set()
        if isinstance(e, IntegrityError):
            new = IntegrityError(e.message, snapshot=e.snapshot, path=e.path, key=e.key, expected=e.expected,
                                 got=e.got, reason=e.reason, replaced=sorted(replaced), partial=sorted(partial))
            return new.with_traceback(e.__traceback__)
        if hasattr(e, "add_note"):  # python >= 3.11
            e.add_note(into_summary(sorted(replaced), sorted(partial)))
        return e

    def _fmt(self, msg, path):
        return FormatError(f"{msg} at {format_path(path) or 'top'} of snapshot {self.snapshot[:16]}")

    def _measure(self, v, path, depth, sel=FULL, into=_MISSING) -> tuple[int, int]:
        """(values, tensor bytes) of the sub-tree `v` summed over every path, each node
        measured once per depth (memoised), so a DAG bomb costs its nodes, not its paths.
        Only what the selection and a plain into= dict keep is measured (and read)."""
        t = type(v)
        if t is Merged:  # rank trees merged (world_view.py): measured once, as a node is
            if into is not _MISSING:
                return self._measure(v.value, path, depth, sel, into)
            key = ("m", id(v), depth, None if sel is FULL else id(sel))
            hit = self._sizes.get(key)
            if hit is None:
                hit = self._sizes[key] = self._measure(v.value, path, depth, sel)
            return hit
        if t is tree.Ref:
            if into is not _MISSING:  # the caller's tree bounds this walk
                return self._measure(self._node(v.digest, path, depth), path, depth, sel, into)
            # A selection state is a node of the paths' trie (kept alive by the Selection),
            # so a node under the same part of the selection is measured once too.
            key = (v.digest, depth, None if sel is FULL else id(sel))
            hit = self._sizes.get(key)
            if hit is None:
                hit = self._sizes[key] = self._measure(self._node(v.digest, path, depth), path, depth, sel)
            return hit
        if t is tree.Container:
            values, nbytes = 1, 0
            sub = into if isinstance(into, (dict, list)) and not is_stateful(into) else None
            for k, x, csel in self._items(v, path, sel):
                if isinstance(sub, dict) and k not in sub:
                    continue
                cinto = sub.get(k, _MISSING) if isinstance(sub, dict) else (
                    sub[k] if isinstance(sub, list) and type(k) is int and k < len(sub) else _MISSING)
                a, b = self._measure(x, path + (k,), depth + 1, csel, cinto)
                values, nbytes = values + a, nbytes + b
            return values, nbytes
        if t is tree.World:  # one rank's view: the largest rank tree bounds it
            if self.one and into is _MISSING:  # every rank's tree merged: that tree
                return self._measure(self._merge_world(v, path, depth, sel, lazy=False), path, depth, sel)
            if v.index is not None or v.ranks is None:  # with a chunk index the view is this rank's tree
                me = self.rank if self.rank < v.world else 0
                return self._measure(tree.Ref(self._rank_top(v, me, path, depth)), path, depth, sel, into)
            return max((self._measure(tree.Ref(d), path, depth, sel, into) for d in v.ranks), default=(1, 0))
        if sel is not FULL:
            return 0, 0  # a leaf above what the selection names: left out
        if t in (tree.Tensor, tree.Array):
            return 1, v.nbytes
        if t is tree.Global or t is Gathered:
            return 1, math.prod(v.shape) * v.dtype.itemsize
        return 1, 0

    def _items(self, v: tree.Container, path, sel):
        """(key, value, its selection state) of a container's items the selection keeps."""
        pairs = v.items if v.kind in ("d", "o") else enumerate(v.items)
        if sel is FULL:
            for k, x in pairs:
                yield k, x, FULL
            return
        for k, x in pairs:
            csel = self.select.step(sel, k)
            if csel is not SKIP:
                yield k, x, csel

    def _node(self, d, path, depth, world: bool = False):
        key = (d, depth, world)
        hit = self._decoded.get(key)
        if hit is None:
            hit = self._decoded[key] = self._read_node(d, path, depth, world)
        return hit

    def _read_node(self, d, path, depth, world: bool):
        data = self.assets.get_node(d, verify=self.verify, snapshot=self.snapshot, path=format_path(path),
                                    fence=self.fence)
        try:
            raw = decode_node(data)
        except FormatError as e:
            raise self._fmt(str(e), path) from None
        try:
            return tree.decode_node_value(raw, path, depth, world=world)
        except FormatError as e:
            raise FormatError(f"{e} of snapshot {self.snapshot[:16]}") from None

    def _run_jobs(self, written: dict | None = None, planned: bool = False):
        jobs, self._jobs = self._jobs, []
        assets = self.assets
        if planned and self._plan is not None:
            plan, self._plan = self._plan, None
            assets = plan(jobs, assets)
        run_reads(assets, self.pool, jobs, snapshot=self.snapshot, verify=self.verify, written=written,
                  progress=self.progress, fence=self.fence, packs=self._packs)

    def _set(self, container, key, v, given: bool) -> None:
        """container[key] = v; in the caller's tree only once every read has succeeded."""
        if not given:
            container[key] = v
        elif (container.get(key, _MISSING) if isinstance(container, dict) else container[key]) is not v:
            self._assign.append((container, key, v))

    def _value(self, v, path, depth, into=_MISSING, sel=FULL, ext=False):
        """The python value of `v`. sel: the selection state here (paths=); ext: `into` is a
        Stateful's state_dict(), which gets every key of the snapshot, not only its own."""
        if into is not _MISSING and is_stateful(into):
            return self._stateful(v, path, depth, into, sel)
        if into is not _MISSING and is_dtensor(into):
            # Its local shard is filled as a Sharded target: the region its placements
            # cover on this rank, only that region's blocks read; the DTensor stays in the tree.
            piece = from_dtensor(into, format_path(path))
            out = self._value(v, path, depth, piece, sel, ext)
            return into if out is piece else out
        t = type(v)
        if t is tree.Ref:
            # A node stands in for a value at the same level of the state tree.
            return self._value(self._node(v.digest, path, depth), path, depth, into, sel, ext)
        if t is Merged:
            return self._value(v.value, path, depth, into, sel, ext)
        if t is tree.World:
            # One process's view without into=: every rank's tree merged (world_view.py);
            # else this rank's tree (rank 0's for one process), into= naming what it lacks.
            view = self._merge_world(v, path, depth, sel, lazy=not (self.one and into is _MISSING))
            return self._value(view, path, depth, into, sel, ext)
        if t is tree.Container:
            if v.kind in ("d", "o"):
                return self._dict(v, path, depth, into, sel, ext)
            return self._seq(v, path, depth, into, sel, ext)
        if sel is not FULL:
            return _SKIPPED  # a leaf above what the selection names
        if v is None or isinstance(v, (bool, int, float, str, bytes)):
            return v
        if t is tree.Tensor:
            return self._tensor(v, path, into)
        if t is tree.Global or t is Gathered:
            return self._global(v, path, into)
        if t is tree.Array:
            return self._array(v, path, into)
        if t is tree.NpScalar:
            return self._scalar(v, path)
        if t is tree.Pickled:
            if not self.allow_pickle:
                raise UnsupportedType("snapshot holds a pickled object; pass allow_pickle=True to "
                                      "checkout to load it (only for snapshots you trust)", format_path(path))
            try:
                return pickle.loads(v.data)
            except Exception as e:
                raise self._fmt(f"pickled object does not load: {e}", path) from None
        raise self._fmt(f"unexpected manifest value {t.__name__}", path)  # pragma: no cover

    def _stateful(self, v, path, depth, obj, sel):
        """A DCP Stateful target: its state_dict() is filled (tensors in place, the keys it
        lacks added), then handed to its load_state_dict() once every read succeeded."""
        if isinstance(obj, torch.optim.Optimizer):
            self._sharded_optim_state(obj, self._deref(v, path, depth), path, depth)
        try:
            sd = obj.state_dict()
        except Exception as e:  # noqa: BLE001
            raise CheckoutMismatch(f"{type(obj).__name__}.state_dict() at {format_path(path) or 'top'} failed: "
                                   f"{type(e).__name__}: {e}") from e
        if not isinstance(sd, dict):
            raise CheckoutMismatch(f"{type(obj).__name__}.state_dict() at {format_path(path) or 'top'} returned "
                                   f"{type(sd).__name__}, not a dict")
        node = self._deref(v, path, depth)
        if type(node) is tree.Container and node.kind in ("d", "o"):
            # Its own keys must be the snapshot's (below them, keys it lacks are added: a fresh
            # optimizer's per-parameter state): load_state_dict would refuse the rest only
            # after the tensors it shares with the object were overwritten.
            extra = [k for k, _ in node.items if k not in sd and (sel is FULL or self.select.step(sel, k) is not SKIP)]
            if extra:
                raise CheckoutMismatch(f"the snapshot has {', '.join(repr(k) for k in extra[:5])}"
                                       f"{f' (and {len(extra) - 5} more)' if len(extra) > 5 else ''} under "
                                       f"{format_path(path) or 'its top'}, which {type(obj).__name__}.state_dict() "
                                       "does not have")
        out = self._value(node, path, depth, sd, sel, ext=True)
        if out is not _SKIPPED:
            self._loads.append((obj, out, path))
        return obj

    def _sharded_optim_state(self, optim, node, path, depth) -> None:
        """A fresh optimizer over DTensor parameters (FSDP2) has no state: the snapshot's
        would be added as whole plain tensors, which its next step() cannot mix with its
        DTensor gradients. So its state is created first, as DCP's get_optimizer_state_dict
        does (one step with zero gradients at lr 0): its state_dict() then holds DTensors,
        filled in place from the blocks of the local shards only. Only when the snapshot
        holds optimizer state to fill them with."""
        if optim.state or not any(is_dtensor(p) for g in optim.param_groups for p in g["params"]):
            return
        if type(node) is not tree.Container or node.kind not in ("d", "o"):
            return
        state = self._deref(dict(node.items).get("state"), path + ("state",), depth + 1)
        if type(state) is not tree.Container or not state.items:
            return
        from torch.distributed.checkpoint.state_dict import _init_optim_state
        try:
            _init_optim_state(optim)
        except Exception as e:  # noqa: BLE001 - the optimizer's own step
            raise CheckoutMismatch(f"{type(optim).__name__} at {format_path(path) or 'top'}: creating its state "
                                   f"for the snapshot's failed: {type(e).__name__}: {e}") from e

    def _dict(self, v, path, depth, into, sel, ext):
        given = isinstance(into, dict)
        target = into if given else (dict() if v.kind == "d" else OrderedDict())
        if given:
            # Every key the caller's tree names must be in the snapshot (nothing is read otherwise).
            have = {k for k, _ in v.items}
            lacks = [k for k in into if k not in have
                     and (sel is FULL or self.select.step(sel, k) is not SKIP)]
            if lacks and self._multi is not None:
                # A read of a multi-rank snapshot in another layout: a path this rank's tree
                # lacks (a pipeline stage the saved rank did not hold) from the ranks that hold it.
                v = self._borrow(v, path, depth, lacks, sel)
                have = {k for k, _ in v.items}
                lacks = [k for k in lacks if k not in have]
            if lacks:
                raise CheckoutMismatch(f"the snapshot has no {', '.join(repr(k) for k in lacks[:5])}"
                                       f"{f' (and {len(lacks) - 5} more)' if len(lacks) > 5 else ''} under "
                                       f"{format_path(path) or 'its top'}, which the into= tree has")
        for k, x, csel in self._items(v, path, sel):
            if given and not ext and k not in into:
                continue  # into= names what to read: the rest is neither read nor added
            out = self._value(x, path + (k,), depth + 1, into.get(k, _MISSING) if given else _MISSING, csel, ext)
            if out is not _SKIPPED:
                self._set(target, k, out, given)
        return target

    def _seq(self, v, path, depth, into, sel, ext):
        if v.kind == "l" and type(into) is list:
            if len(into) != len(v.items):
                raise CheckoutMismatch(f"list at {format_path(path)} has {len(into)} items, "
                                       f"snapshot has {len(v.items)}")
            for i, x, csel in self._items(v, path, sel):
                out = self._value(x, path + (i,), depth + 1, into[i], csel, ext)
                if out is not _SKIPPED:
                    self._set(into, i, out, True)
            return into
        sub = into if type(into) is tuple and len(into) == len(v.items) else None
        if sel is not FULL:
            # Part of a sequence: its selected items by index (no index shifts).
            out = {}
            for i, x, csel in self._items(v, path, sel):
                item = self._value(x, path + (i,), depth + 1, sub[i] if sub else _MISSING, csel, ext)
                if item is not _SKIPPED:
                    out[i] = item
            return out
        items = [self._value(x, path + (i,), depth + 1, sub[i] if sub else _MISSING, FULL, ext)
                 for i, x in enumerate(v.items)]
        return items if v.kind == "l" else tuple(items)

    def _cap(self, n, path):
        if n > self.max_bytes:
            raise self._fmt(f"tensor of {n} bytes exceeds max_bytes={self.max_bytes} "
                            "(checkout(..., max_bytes=N) raises the cap)", path)

    def _reserve(self, leaf: tree.Leaf, path):
        """Called before allocating a leaf's fresh bytes: the checkout's total stays under
        max_bytes, and a big tensor's blocks must exist before its memory is taken
        (a few hundred hostile manifest bytes must not cost gigabytes)."""
        self._allocated += leaf.nbytes
        if self._allocated > self.max_bytes:
            raise self._fmt(f"the snapshot's tensors need more than max_bytes={self.max_bytes} "
                            "(checkout(..., max_bytes=N) raises the cap)", path)
        if leaf.inline is not None or leaf.nbytes <= PRESENCE_CHECK_ABOVE:
            return
        self.assets.require_blocks(dict.fromkeys(leaf.blocks), self.pool, snapshot=self.snapshot,
                                   path=format_path(path), fence=self.fence)

    def _fill(self, flat_u8, leaf: tree.Leaf, path, caller: bool = False):
        """Schedule the reads that fill `flat_u8` (a writable uint8 buffer of the leaf's
        bytes). caller: it is the caller's memory (bounce reads; inline bytes later)."""
        if leaf.inline is not None:
            src = np.frombuffer(leaf.inline, dtype=np.uint8)
            if caller:
                self._after.append(lambda: np.copyto(flat_u8, src))
            else:
                flat_u8[:] = src
            return
        p = format_path(path)
        if leaf.part is not None:
            self._jobs.append((leaf.blocks[0], part_job(leaf, flat_u8), p, caller))
            if self.parts_seen is not None and leaf.content is not None:
                self.parts_seen.append((leaf.content, leaf.blocks[0], leaf.part[0], leaf.part[1], flat_u8.nbytes))
            return
        for _i, d, a, b in leaf.block_spans():
            self._jobs.append((d, flat_u8[a:b], p, caller))

    def _fill_now(self, flat_u8, leaf, path):
        pending, self._jobs = self._jobs, []
        try:
            self._fill(flat_u8, leaf, path)
            self._run_jobs()
        finally:
            self._jobs = pending

    def _deref(self, v, path, depth):
        while True:
            if type(v) is tree.Ref:
                v = self._node(v.digest, path, depth)
            elif type(v) is Merged:
                v = v.value
            else:
                return v

    # -- dense leaves ------------------------------------------------------------
    def _tensor(self, leaf: tree.Tensor, path, into):
        self._cap(leaf.nbytes, path)
        if isinstance(into, Sharded) and leaf.quant is None:
            # A whole tensor (a one-process snapshot) into a piece: its region, as from a
            # sharded tensor saved as one chunk.
            whole = tree.Chunk(leaf.shape, leaf.nbytes, leaf.inline, leaf.block_size, leaf.blocks, leaf.part,
                               leaf.content, offsets=(0,) * len(leaf.shape))
            return self._global(tree.Global(leaf.dt, tuple(leaf.shape), [whole]), path, into)
        if leaf.quant is not None:
            return self._quantized(leaf, path, into)
        dtype, sh = leaf.dtype, list(leaf.shape)
        if isinstance(into, torch.Tensor):
            if into.dtype != dtype or list(into.shape) != sh:
                raise CheckoutMismatch(f"tensor at {format_path(path)} is {into.dtype} {list(into.shape)}, "
                                       f"snapshot has {dtype} {sh}")
            caller = into.device.type == "cpu" and into.is_contiguous() and not into.is_conj() and not into.is_neg()
            if caller:
                dst = into.detach()  # blocks bounce into it (verified first)
            else:
                dst = torch.empty(sh, dtype=dtype)
                self._after.append(lambda: _copy_into(into, dst))
            if leaf.nbytes:
                self._fill(dst.reshape(-1).view(torch.uint8).numpy(), leaf, path, caller=caller)
            return into
        place = self._place.where(leaf.device, path)  # before anything is allocated or read
        self._reserve(leaf, path)
        try:
            t = torch.empty(sh, dtype=dtype)
            flat = t.reshape(-1).view(torch.uint8).numpy() if leaf.nbytes else None
        except Exception as e:
            raise self._fmt(f"cannot allocate tensor of {leaf.dt} {sh}: {e}", path) from None
        if leaf.nbytes:
            # A tensor bound for another place is filled now, so it can be moved before it
            # is placed in the tree.
            (self._fill_now if place is not None else self._fill)(flat, leaf, path)
        if place is not None:
            t = self._place.move(t, place, path)
        rg = leaf.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex)  # only those can
        if leaf.param:
            return torch.nn.Parameter(t, requires_grad=rg)
        if rg:
            t.requires_grad_(True)
        return t

    def _quantized(self, leaf: tree.Tensor, path, into):
        _qt, repr_dtype = QUANT_BY_NAME[leaf.dt]
        q, sh = leaf.quant, list(leaf.shape)
        if into is not _MISSING and isinstance(into, (torch.Tensor, Sharded)):
            raise CheckoutMismatch(f"checkout(into=) cannot fill the quantized tensor at {format_path(path)}")
        self._reserve(leaf, path)
        try:
            rep = torch.empty(sh, dtype=repr_dtype)
        except Exception as e:
            raise self._fmt(f"cannot allocate quantized tensor {sh}: {type(e).__name__}", path) from None
        if leaf.nbytes:
            self._fill_now(rep.reshape(-1).view(torch.uint8).numpy(), leaf, path)
        try:
            if q["s"] == "pt":
                return torch._make_per_tensor_quantized_tensor(rep, q["scale"], q["zp"])
            return torch._make_per_channel_quantized_tensor(
                rep, torch.tensor(q["scales"], dtype=torch.float64), torch.tensor(q["zps"], dtype=torch.int64),
                q["axis"])
        except Exception as e:
            raise self._fmt(f"cannot rebuild quantized tensor: {e}", path) from None

    def _array(self, leaf: tree.Array, path, into):
        self._cap(leaf.nbytes, path)
        dtype, sh = leaf.dtype, list(leaf.shape)
        order = "F" if leaf.fortran else "C"
        if isinstance(into, np.ndarray) and into.dtype == dtype and list(into.shape) == sh \
                and into.flags.writeable:
            dst = np.empty(sh, dtype=dtype, order=order)
            if leaf.nbytes:
                self._fill((dst.T if leaf.fortran else dst).reshape(-1).view(np.uint8), leaf, path)
            self._after.append(lambda: np.copyto(into, dst))
            return into
        if isinstance(into, np.ndarray):
            raise CheckoutMismatch(f"array at {format_path(path)} is {into.dtype} {list(into.shape)}, "
                                   f"snapshot has {dtype} {sh}")
        self._reserve(leaf, path)
        try:
            a = np.empty(sh, dtype=dtype, order=order)
        except Exception as e:
            raise self._fmt(f"cannot allocate array of {dtype} {sh}: {type(e).__name__}", path) from None
        if leaf.nbytes:
            self._fill((a.T if leaf.fortran else a).reshape(-1).view(np.uint8), leaf, path)
        return a

    def _scalar(self, s: tree.NpScalar, path):
        d, raw = s.dtype, s.raw
        try:
            if d.kind == "S":  # frombuffer's scalar would drop trailing NULs (and shrink the dtype)
                return np.bytes_(raw)
            if d.kind == "U":  # the same for str_: decode the UTF-32 code units ourselves
                # chr, unlike the utf-32 codec, takes surrogates
                return np.str_("".join(map(chr, code_units(raw, d))))
            return np.frombuffer(raw, dtype=d)[0]
        except Exception as e:  # noqa: BLE001 - numpy's failures on odd dtypes vary
            raise self._fmt(f"numpy scalar does not decode: {type(e).__name__}", path) from None


def _copy_into(into: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        into.copy_(src)
