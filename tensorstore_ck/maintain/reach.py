"""Reachability: which stored objects the kept snapshots reach (gc's mark, fsck's orphans).

Memory stays bounded on stores with millions of objects, and grows with the
objects reached, not with the references to them: reachable objects are kept as
the first 8 bytes of their address in a packed array (8 bytes each, sorted,
looked up with a binary search; a prefix collision can only *keep* an unreachable
object, never delete a reachable one), nodes already walked as their full
addresses in packed sorted arrays (NodeSet: exact, since a node wrongly taken as
walked would leave its subtree unmarked), and listings are checked in batches of
64 Ki objects.
"""

from __future__ import annotations

import array
import sys
from typing import Iterator

import numpy as np

from ..core.assets import KINDS, Listed
from ..core.core import Core
from ..core.roles import CatalogReader
from ..core.walk import walk_parted
from ..errors import FormatError, IntegrityError, TsckError, UnreadableObject
from ..format.manifest import commit_tree

__all__ = ["KINDS", "Marked", "NodeSet", "kept_roots", "holders", "mark", "iter_unreachable"]


def _key8(d: bytes) -> int:
    return int.from_bytes(d[:8], "big")


class Marked:
    """Reachable objects as sorted, distinct 8-byte prefixes of their addresses.

    add() appends to a buffer; when the buffer reaches half the sorted set (or
    MERGE_MIN), it is sorted and the prefixes not yet held are merged in. A walk
    meets a block once per node that names it, and a snapshot that changed one
    tensor of a node names every other block of that node again: merging as it goes
    keeps memory at ~8 bytes per distinct object (plus the buffer, at most half
    that), where one buffer sorted at the end would hold every reference. contains()
    needs freeze() first."""

    MERGE_MIN = 1 << 20  # prefixes buffered before the first merge (8 MiB per kind)

    def __init__(self):
        self._buf = {k: array.array("Q") for k in KINDS}
        # per kind: a sorted array with room to grow (_set[k][:_n[k]] is the set)
        self._set = {k: np.empty(0, dtype=np.uint64) for k in KINDS}
        self._n = dict.fromkeys(KINDS, 0)
        self._frozen = False

    def add(self, kind: str, d: bytes) -> None:
        b = self._buf[kind]
        b.append(_key8(d))
        if len(b) >= self.MERGE_MIN and len(b) >= self._n[kind] // 2:
            self._merge(kind)

    def _merge(self, kind: str) -> None:
        a = self._buf[kind]
        self._buf[kind] = array.array("Q")
        if not len(a):
            return
        v = np.frombuffer(a, dtype=np.uint64)  # sorted in place: the buffer's own memory
        v.sort()
        new = np.empty(len(v), dtype=bool)
        new[0] = True
        np.not_equal(v[1:], v[:-1], out=new[1:])
        n = self._n[kind]
        if n:
            held = self._set[kind][:n]
            for i in range(0, len(v), self.MERGE_MIN):  # index arrays in slices: bounded
                part = v[i:i + self.MERGE_MIN]
                j = np.searchsorted(held, part).clip(0, n - 1)
                new[i:i + self.MERGE_MIN] &= held[j] != part
            del held
        add = v[new]
        del v, a, new
        m = n + len(add)
        arr = self._set[kind]
        if m > len(arr):
            # realloc grows the one array (mremap: no second copy of it); no view of it
            # is alive here, and contains() takes its views only once frozen
            arr.resize(max(m, len(arr) + len(arr) // 4), refcheck=False)
        arr[n:m] = add
        del add
        arr[:m].sort(kind="stable")  # two sorted runs: timsort merges them in one pass
        self._n[kind] = m

    def freeze(self) -> None:
        """Merge what is buffered; the set is fixed from here on (more add()s need
        another freeze before contains() sees them)."""
        for k in KINDS:
            self._merge(k)
            arr = self._set[k]
            if len(arr) != self._n[k]:
                arr.resize(self._n[k], refcheck=False)  # the room to grow is given back
        self._frozen = True

    def __len__(self):
        return sum(self._n.values())

    @property
    def nbytes(self) -> int:
        """Bytes this set holds now (its arrays with their room to grow, and the buffers)."""
        return sum(a.nbytes for a in self._set.values()) + sum(b.itemsize * b.buffer_info()[1]
                                                               for b in self._buf.values())

    def contains(self, kind: str, digests) -> np.ndarray:
        if not self._frozen:
            raise RuntimeError("Marked.contains() before freeze()")
        keys = np.array([_key8(d) for d in digests], dtype=np.uint64)
        s = self._set[kind][:self._n[kind]]
        if not len(s):
            return np.zeros(len(keys), dtype=bool)
        i = np.searchsorted(s, keys).clip(0, len(s) - 1)
        return s[i] == keys


class NodeSet:
    """Node addresses already walked (mark's skip set): an exact set of 32-byte digests.

    Exact, not prefixes: a node wrongly taken as walked is skipped with everything
    under it, which would leave its blocks unmarked and deletable. The digests are
    packed in one sorted array (32 bytes each) and the latest additions in a small
    Python set, merged in once it reaches an eighth of the array (or MERGE_MIN): ~32
    bytes per node plus at most ~15 for the recent ones, where a set of bytes takes
    ~120. `base`: a NodeSet (or set) whose members count as walked too, left as it is;
    additions go to this one only (a walk that must not change what the base holds)."""

    MERGE_MIN = 1 << 14

    def __init__(self, base=None):
        self._base = base
        self._recent: set[bytes] = set()
        self._arr = np.empty(0, dtype="S32")

    def __contains__(self, d: bytes) -> bool:
        if d in self._recent:
            return True
        a = self._arr
        if len(a):
            i = int(np.searchsorted(a, d))
            # compared as raw bytes: an S32 item drops trailing NULs
            if i < len(a) and a[i:i + 1].tobytes() == d:
                return True
        return self._base is not None and d in self._base

    def add(self, d: bytes) -> None:
        if len(d) != 32:
            raise ValueError("a node address is 32 bytes")
        if d in self:
            return
        self._recent.add(d)
        if len(self._recent) >= max(self.MERGE_MIN, len(self._arr) // 8):
            new = np.array(sorted(self._recent), dtype="S32")
            self._recent = set()
            merged = np.concatenate((self._arr, new))
            self._arr = new = None
            merged.sort(kind="stable")  # two sorted runs: one merge pass
            self._arr = merged

    def update(self, ds) -> None:
        for d in ds:
            self.add(d)

    def __len__(self) -> int:
        return len(self._arr) + len(self._recent)

    @property
    def nbytes(self) -> int:
        """Bytes held: the packed array, and the recent ones (a set of bytes objects)."""
        return self._arr.nbytes + (sys.getsizeof(self._recent) + len(self._recent) * sys.getsizeof(b"x" * 32)
                                   if self._recent else 0)


def kept_roots(core: Core[CatalogReader], exclude: set | None = None) -> set[bytes]:
    """Every catalog row (less `exclude`), ref tip, tag target and pin, less the
    snapshots a local tier evicted (TierTable.evict_mark: durable in the remote store,
    their local copies dropped on purpose)."""
    rt = core.refs
    roots = rt.catalog_roots()  # a row that does not decode still keeps its snapshot
    if exclude:
        roots -= exclude
    return (roots | {r for _, r in rt.list()} | {r for _, r in rt.tags()} | rt.pins()) - rt.tier_rows.evicted()


def undeletable(core: Core) -> set[bytes]:
    """The roots undelete would bring deleted refs back on (each deleted ref's tip at its
    removal) whose commits storage still holds: a job's prune keeps what they reach, so
    delete-ref's promise holds until the next gc, which reclaims them."""
    names, _forgotten = core.refs.removed()
    roots = (core.refs.deleted_ref_root(name) for name in sorted(names))
    return {r for r in roots if r is not None and core.assets.has_commit(r)}


def holders(core: Core) -> dict[bytes, list[tuple[str, str]]]:
    """root -> what holds it whatever retention says: ("ref", name) for a ref's tip,
    ("tag", name), ("pin", ""), ("upload", "") for a local tier's snapshot whose upload
    has started (TierTable.upload_begin)."""
    out: dict[bytes, list[tuple[str, str]]] = {}
    for root in core.refs.tier_rows.uploading():
        out.setdefault(root, []).append(("upload", ""))
    for name, root in core.refs.list():
        out.setdefault(root, []).append(("ref", name))
    for name, root in core.refs.tags():
        out.setdefault(root, []).append(("tag", name))
    for root in core.refs.pins():
        out.setdefault(root, []).append(("pin", ""))
    return out


def mark(core: Core, roots, marked: Marked, visited: NodeSet | set, bar=None) -> int:
    """Mark everything reachable from `roots`. A damaged or unreadable node or commit
    aborts (its children are unknown, so nothing could be deleted safely); a missing
    commit object is marked through its catalog row's tree instead."""
    n = 0
    parts = core.refs.tier_rows.parts()  # a rank's tier: its part of each collective snapshot, the rest elsewhere
    for root in sorted(roots):
        try:
            if core.assets.has_commit(root):
                # A commit a reader refuses for a field other than its tree (a NaN time,
                # brought in by an older recover) still keeps what its tree holds.
                tree = commit_tree(core.assets.get_commit(root, verify=True))
                marked.add("commits", root)
                n += 1
            else:
                row = core.refs.catalog_get(root, checked=False) or {}
                tree = row.get("tree")
                if not isinstance(tree, bytes) or len(tree) != 32:
                    continue  # nothing known to keep for it; fsck reports the dangling name
            objs = walk_parted(core.assets, tree, parts.get(root), snapshot=root.hex(), verify=True,
                               skip_nodes=visited)
            for obj in objs:
                marked.add(obj.kind + "s", obj.digest)
                n += 1
                if bar is not None:
                    bar.update(1)
        except UnreadableObject as e:  # still a StorageError, errno kept: it may be only for now
            text = (f"gc stopped before deleting anything: kept snapshot {root.hex()[:16]}: "
                    f"{e.strerror or e}; run `tsck fsck`")
            err = UnreadableObject(e.errno, text) if e.errno is not None else UnreadableObject(text)
            err.key, err.snapshot, err.path, err.detail = e.key, e.snapshot, e.path, e.detail
            raise err from e
        except (IntegrityError, FormatError) as e:
            raise TsckError(f"gc stopped before deleting anything: kept snapshot {root.hex()[:16]} "
                            f"is damaged ({e}); run `tsck fsck`") from None
    return n


def iter_unreachable(core: Core, marked: Marked, kind: str, *, before: float | None = None, bar=None,
                     strays: list | None = None) -> Iterator[Listed]:
    """Stream the stored objects of `kind` that `marked` does not reach (written before
    `before`, when given), in batches so memory stays bounded. Malformed names go to
    `strays`, never into the result."""
    batch: list[Listed] = []

    def flush():
        out = [o for o, live in zip(batch, marked.contains(kind, [o.digest for o in batch])) if not live]
        batch.clear()
        return out

    for o in core.assets.list_objects(kind, strays):
        if bar is not None:
            bar.update(1)
        if before is not None and o.mtime > before:
            continue
        batch.append(o)
        if len(batch) >= 65536:
            yield from flush()
    if batch:
        yield from flush()
