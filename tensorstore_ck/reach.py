"""Reachability: which stored objects the kept snapshots reach (gc's mark, fsck's orphans).

Memory stays bounded on stores with millions of objects: reachable objects are
kept as the first 8 bytes of their address in a packed array (8 bytes each,
sorted once, looked up with a binary search; a prefix collision can only *keep*
an unreachable object, never delete a reachable one), and listings are checked
in batches of 64 Ki objects.
"""

from __future__ import annotations

import array
from typing import Iterator

import numpy as np

from .assets import KINDS, Listed
from .errors import FormatError, IntegrityError, TsckError, UnreadableObject
from .format.manifest import commit_tree
from .walk import walk_tree

__all__ = ["KINDS", "Marked", "kept_roots", "holders", "mark", "iter_unreachable"]


def _key8(d: bytes) -> int:
    return int.from_bytes(d[:8], "big")


class Marked:
    """Reachable objects as sorted 8-byte prefixes of their addresses."""

    def __init__(self):
        self._buf = {k: array.array("Q") for k in KINDS}
        self._sorted: dict[str, np.ndarray] = {}

    def add(self, kind: str, d: bytes) -> None:
        self._buf[kind].append(_key8(d))

    def freeze(self) -> None:
        for k, a in self._buf.items():
            self._sorted[k] = np.unique(np.frombuffer(a, dtype=np.uint64)) if len(a) else \
                np.empty(0, dtype=np.uint64)
        self._buf = {k: array.array("Q") for k in KINDS}

    def __len__(self):
        return sum(len(v) for v in self._sorted.values())

    def contains(self, kind: str, digests) -> np.ndarray:
        keys = np.array([_key8(d) for d in digests], dtype=np.uint64)
        s = self._sorted[kind]
        if not len(s):
            return np.zeros(len(keys), dtype=bool)
        i = np.searchsorted(s, keys).clip(0, len(s) - 1)
        return s[i] == keys


def kept_roots(store, exclude: set | None = None) -> set[bytes]:
    """Every catalog row (less `exclude`), ref tip, tag target and pin."""
    rt = store.reftable
    roots = rt.catalog_roots()  # a row that does not decode still keeps its snapshot
    if exclude:
        roots -= exclude
    return roots | {r for _, r in rt.list()} | {r for _, r in rt.tags()} | rt.pins()


def holders(store) -> dict[bytes, list[tuple[str, str]]]:
    """root -> what holds it whatever retention says: ("ref", name) for a ref's tip,
    ("tag", name), ("pin", "")."""
    out: dict[bytes, list[tuple[str, str]]] = {}
    for name, root in store.reftable.list():
        out.setdefault(root, []).append(("ref", name))
    for name, root in store.reftable.tags():
        out.setdefault(root, []).append(("tag", name))
    for root in store.reftable.pins():
        out.setdefault(root, []).append(("pin", ""))
    return out


def mark(store, roots, marked: Marked, visited: set, bar=None) -> int:
    """Mark everything reachable from `roots`. A damaged or unreadable node or commit
    aborts (its children are unknown, so nothing could be deleted safely); a missing
    commit object is marked through its catalog row's tree instead."""
    n = 0
    for root in sorted(roots):
        try:
            if store.assets.has_commit(root):
                # A commit a reader refuses for a field other than its tree (a NaN time,
                # brought in by an older recover) still keeps what its tree holds.
                tree = commit_tree(store.assets.get_commit(root, verify=True))
                marked.add("commits", root)
                n += 1
            else:
                row = store.reftable.catalog_get(root, checked=False) or {}
                tree = row.get("tree")
                if not isinstance(tree, bytes) or len(tree) != 32:
                    continue  # nothing known to keep for it; fsck reports the dangling name
            objs = walk_tree(store.assets, tree, snapshot=root.hex(), verify=True, skip_nodes=visited)
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


def iter_unreachable(store, marked: Marked, kind: str, *, before: float | None = None, bar=None,
                     strays: list | None = None) -> Iterator[Listed]:
    """Stream the stored objects of `kind` that `marked` does not reach (written before
    `before`, when given), in batches so memory stays bounded. Malformed names go to
    `strays`, never into the result."""
    batch: list[Listed] = []

    def flush():
        out = [o for o, live in zip(batch, marked.contains(kind, [o.digest for o in batch])) if not live]
        batch.clear()
        return out

    for o in store.assets.list_objects(kind, strays):
        if bar is not None:
            bar.update(1)
        if before is not None and o.mtime > before:
            continue
        batch.append(o)
        if len(batch) >= 65536:
            yield from flush()
    if batch:
        yield from flush()
