"""The one-process view of a collective snapshot: its ranks' trees merged into one.

A collective snapshot holds one tree per rank (format/world.py). A process that reads
it alone (store.checkout without a process group, with or without paths= or into=;
`tsck ls`; `tsck checkout` to a file; TsckReader's DCP metadata) sees one tree, the
union of the ranks' trees:

- a sharded tensor (a non-replicated GLOBAL) is whole at its path, with every rank's
  pieces, whichever ranks hold it (a pipeline stage no piece of which is on rank 0);
- any other value (rank-local: a tensor, a scalar, a string; a Replicated tensor, the
  same on every rank) is the preferred rank's: rank 0's when rank 0 holds the path,
  else that of the lowest rank that does; a rank-local tensor is the preferred rank's
  only where every rank that holds the path holds a tensor of one dtype and shape
  there (data-parallel copies, per-rank RNG states);
- dicts are merged key by key (the preferred rank's keys in its order, then the keys
  only later ranks hold, in rank order), lists and tuples item by item (as long as
  the longest);
- what one tree cannot show is refused, naming the path and the ranks: a path that
  is a sharded tensor on one rank and another kind of value on another, or a container
  of another kind holding one (CheckoutMismatch); in the one-process view (extend),
  a path where ranks hold rank-local tensors of other dtypes or shapes, or a tensor on
  one rank and another value on another (pipeline stages that name their own modules
  alike: any one rank's value would drop the others'; CheckoutMismatch); ranks that
  disagree on a sharded tensor's dtype or shape (FormatError: no collective put writes
  that).

A collective checkout gives each rank its own tree instead (read_world.py): the same
merge with extend=False keeps the preferred rank's keys only, and into= targets that
name a path the rank's own tree lacks are merged from the ranks that hold it.

Pure: nodes are read through a callback; no torch (`tsck ls` imports none).
"""

from __future__ import annotations

from typing import Callable

from ..errors import CheckoutMismatch, FormatError
from ..format import tree
from ..format.tree import format_path
from ..util.paths import FULL, SKIP

# What one value of the state (a container, a scalar, a leaf) is charged against
# max_bytes before a checkout materialises anything: roughly a small Python object and
# the reference to it. A manifest may name one node at many paths (identical sub-trees
# are stored once), and each path is materialised; a DAG of 40 nodes can name 2^40.
VALUE_COST = 64

__all__ = ["Merged", "Union", "deref_merged"]


class Merged:
    """A merged sub-tree standing where the ranks' nodes (Refs) stood: one object per
    distinct (nodes, depth, selection state), so a node named at many paths (a DAG) is
    merged, measured and listed once per node, as a Ref is."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def deref_merged(v):
    while type(v) is Merged:
        v = v.value
    return v


def _kind(v) -> tuple:
    if type(v) is tree.Global:
        return ("G", v.dt, tuple(v.shape), v.replicated)
    if type(v) is tree.Container:
        return ("C", "d" if v.kind in ("d", "o") else v.kind)
    return ("V",)


def _what(v) -> str:
    if type(v) is tree.Global:
        return "a replicated tensor" if v.replicated else f"a sharded tensor {v.dt} {list(v.shape)}"
    if type(v) is tree.Container:
        return {"d": "a dict", "o": "a dict", "l": "a list", "t": "a tuple"}[v.kind]
    if type(v) is tree.Tensor:
        return f"a rank-local tensor {v.dt} {list(v.shape)}"
    if type(v) is tree.Array:
        return f"a rank-local numpy array {v.dtype} {list(v.shape)}"
    return f"a rank-local {type(v).__name__}"


def _local_form(v) -> tuple | None:
    """What one tree needs alike on every rank at a rank-local tensor's path (its dtype
    and shape); None for a value that is not a rank-local tensor."""
    if type(v) is tree.Tensor:
        return ("T", v.dt, tuple(v.shape))
    if type(v) is tree.Array:
        return ("A", None if v.dtype is None else v.dtype.str, tuple(v.shape))
    return None


class Union:
    """Merges rank trees (decoded values or Refs) as the module docstring says.

    deref(value, path, depth): the value with node references followed (the reader's
    node cache). step(state, key): the selection state of a child (paths.Selection.step;
    None: no selection). extend: add the keys and items only later ranks hold (False: the
    preferred rank's own keys, each merged over the ranks that hold it). whole: where
    every merged sharded tensor is recorded by id (it holds every rank's pieces).

    budget: the most values merged. Distinct tuples of nodes are merged once, but W
    small DAGs can meet in many distinct tuples (rank r's tree a counter modulo the r-th
    prime: their product), so the work is counted: each tuple merged lies at one path at
    least, so past `budget` the merged tree names more values at its paths than a reader
    takes (the same cap), and it is refused (FormatError) instead of merged."""

    def __init__(self, deref: Callable, step: Callable | None, *, snapshot: str, extend: bool = True,
                 whole: dict | None = None, budget: int = 1 << 28):
        self.deref, self.step, self.snapshot, self.extend = deref, step, snapshot, extend
        self.whole = {} if whole is None else whole
        self.budget, self.work = budget, 0
        self._memo: dict = {}     # (digests, depth, selection state) -> Merged
        self._sharded: dict = {}  # (digest, depth) -> whether a sharded tensor lies under that node

    def merge(self, vals: list, path: tuple, depth: int, sel=FULL):
        """The merged value at `path` of [(rank, value)], the ranks that hold it, the
        preferred first."""
        if all(type(v) is tree.Ref for _r, v in vals):
            seen: dict = {}
            for r, v in vals:  # identical nodes are identical sub-trees: merged once
                seen.setdefault(v.digest, (r, v))
            uniq = list(seen.values())
            key = (tuple(seen), depth, None if sel is FULL else id(sel))
            hit = self._memo.get(key)
            if hit is None:
                hit = self._memo[key] = Merged(self._values(uniq, path, depth, sel))
            return hit
        return self._values(vals, path, depth, sel)

    def _values(self, vals, path, depth, sel):
        vals = [(r, deref_merged(self.deref(v, path, depth))) for r, v in vals]
        self.work += 1 + sum(len(v.items) for _r, v in vals if type(v) is tree.Container)
        if self.work > self.budget:
            raise FormatError(f"the rank trees of snapshot {self.snapshot[:16]} merge into more than {self.budget} "
                              f"values at their paths (nodes shared at many paths), at {format_path(path) or 'top'}")
        r0, v0 = vals[0]
        k0 = _kind(v0)
        same = [(r, v) for r, v in vals if _kind(v) == k0]
        for r, v in vals:
            if _kind(v) != k0 and self.holds_sharded(v, path, depth):
                self._refuse(path, (r0, v0), (r, v))
        if self.extend:
            self._one_local(vals, path)
        if type(v0) is tree.Global:
            if v0.replicated:
                return v0
            chunks, boxes = [], set()
            for _r, v in same:
                for c in v.chunks:
                    box = (tuple(c.offsets), tuple(c.shape))
                    if box not in boxes:  # the same piece on several ranks (replicas): once
                        boxes.add(box)
                        chunks.append(c)
            g = tree.Global(v0.dt, v0.shape, chunks, False)
            self.whole[id(g)] = g
            return g
        if type(v0) is not tree.Container:
            return v0  # rank-local: the preferred rank's
        if v0.kind in ("d", "o"):
            order: list = []
            holders: dict = {}
            for r, v in same:
                for k, x in v.items:
                    got = holders.get(k)
                    if got is None:
                        if r != r0 and not self.extend:
                            continue
                        got = holders[k] = []
                        order.append(k)
                    got.append((r, x))
            return tree.Container(v0.kind, [(k, self._child(holders[k], path, depth, sel, k)) for k in order])
        n = max(len(v.items) for _r, v in same) if self.extend else len(v0.items)
        return tree.Container(v0.kind, [
            self._child([(r, v.items[i]) for r, v in same if i < len(v.items)], path, depth, sel, i)
            for i in range(n)])

    def _child(self, vals, path, depth, sel, k):
        csel = FULL if sel is FULL else self.step(sel, k)
        if csel is SKIP:
            return vals[0][1]  # left out by the selection: not read
        return self.merge(vals, path + (k,), depth + 1, csel)

    def holds_sharded(self, v, path, depth) -> bool:
        """Whether a sharded tensor lies at or under `v` (each node looked at once)."""
        if type(v) is tree.Ref:
            key = (v.digest, depth)
            hit = self._sharded.get(key)
            if hit is None:
                hit = self._sharded[key] = self.holds_sharded(self.deref(v, path, depth), path, depth)
            return hit
        v = deref_merged(v)
        if type(v) is tree.Global:
            return not v.replicated
        if type(v) is tree.Container:
            pairs = v.items if v.kind in ("d", "o") else enumerate(v.items)
            return any(self.holds_sharded(x, path + (k,), depth + 1) for k, x in pairs)
        return False

    def _one_local(self, vals, path) -> None:
        """Refuse a path where ranks hold rank-local tensors one tree cannot show as one:
        other dtypes or shapes, or a tensor beside another kind of value (the preferred
        rank's would silently stand for the others')."""
        forms = [_local_form(v) for _r, v in vals]
        if all(f is None for f in forms):
            return
        (ra, va) = vals[0]
        for (rb, vb), f in zip(vals, forms):
            if f != forms[0]:
                where = format_path(path) or "its top"
                raise CheckoutMismatch(
                    f"snapshot {self.snapshot[:16]} cannot be shown as one tree at {where}: rank {ra} holds "
                    f"{_what(va)} there, rank {rb} {_what(vb)} (each rank's own value, as pipeline stages that "
                    "name their modules alike put them); read it under torch.distributed (each rank its own "
                    "tree), or leave that path out with paths=")

    def _refuse(self, path, a, b):
        (ra, va), (rb, vb) = a, b
        where = format_path(path) or "its top"
        if type(va) is tree.Global and type(vb) is tree.Global:
            raise FormatError(f"the ranks of snapshot {self.snapshot[:16]} disagree on the sharded tensor at "
                              f"{where}: rank {ra} holds {_what(va)}, rank {rb} {_what(vb)}")
        inside = "" if type(vb) is tree.Global else " (with a sharded tensor in it)"
        raise CheckoutMismatch(
            f"snapshot {self.snapshot[:16]} cannot be shown as one tree at {where}: rank {ra} holds "
            f"{_what(va)} there, rank {rb} {_what(vb)}{inside}; "
            "read it under torch.distributed (each rank its own tree), or leave that path out with paths=")
