"""recover: rebuild the ref table's catalog, refs, reflog and tags from storage.

The ref table is an index over what storage already says: every commit names
its job and ref, and every tag is also written to storage as ``tags/<hex of
name>`` (JSON {name, root, time}). After the LMDB file is lost, each ref is
restored at its newest commit (by commit time, then step) with a reflog that
lists its commits oldest first, so ``log`` and ``REF@STEP`` work again.
Refs and tags that still exist are left as they are. Retention rules and pins
live only in the ref table and must be set again.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .errors import FormatError, IntegrityError, RefConflict
from .format.manifest import decode_commit
from .format.names import validate_name

__all__ = ["RecoverReport", "run_recover"]


@dataclass
class RecoverReport:
    commits_found: int = 0
    catalog_rows_added: int = 0
    refs_restored: dict = field(default_factory=dict)   # name -> root hex
    tags_restored: dict = field(default_factory=dict)
    unreadable: list = field(default_factory=list)      # keys of commits/tags that did not verify

    def to_json(self) -> dict:
        return asdict(self)


def run_recover(store) -> RecoverReport:
    rep = RecoverReport()
    rt = store.reftable
    by_ref: dict[str, list[tuple[float, int, bytes, dict]]] = {}
    strays: list = []
    for o in store.assets.list_objects("commits", strays):
        root = o.digest
        try:
            c = decode_commit(store.assets.get_commit(root, verify=True))
            validate_name(c["ref"])
        except (ValueError, IntegrityError, FormatError) as e:
            rep.unreadable.append(f"{store.assets.object_key('commits', root)}: {e}")
            continue
        rep.commits_found += 1
        st = c.get("stats") or {}
        row = {"job": c["job"], "ref": c["ref"], "step": c["step"], "time": c["time"],
               "metrics": c["metrics"], "meta": c.get("meta") or {}, "parent": c.get("parent"),
               "tree": c["tree"], **{k: int(st.get(k, 0)) for k in
                                     ("bytes_total", "bytes_new", "blocks_total", "blocks_new")}}
        if rt.catalog_put_if_absent(root, row):
            rep.catalog_rows_added += 1
        step = c["step"] if isinstance(c["step"], int) else -1
        by_ref.setdefault(c["ref"], []).append((float(c["time"]), step, root, row))
    for ref, items in sorted(by_ref.items()):
        if rt.get_or_none(ref) is not None:
            continue
        items.sort(key=lambda x: (x[0], x[1]))
        prev = None
        try:
            for _t, _s, root, row in items:
                rt.compare_and_swap(ref, prev, root, message="recovered from storage", catalog_row=row)
                prev = root
        except RefConflict:  # a writer moved it meanwhile: its view wins
            continue
        rep.refs_restored[ref] = prev.hex()
    rep.unreadable += [f"{key}: not an object key" for key in strays]
    for key, rec in store.assets.tags():
        if isinstance(rec, Exception):
            rep.unreadable.append(f"{key}: {rec}")
            continue
        name, root, _t = rec
        if rt.tag_get(name) is None and store.assets.has_commit(root):
            try:
                rt.tag_create(name, root)
                rep.tags_restored[name] = root.hex()
            except RefConflict:
                pass
    return rep
