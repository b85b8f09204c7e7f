"""What a store holds, described: `tsck ls` and `tsck diff` (the values of a snapshot's
tree, and which of them differ between two snapshots, read from manifest nodes only:
never a block, never torch, so listing a snapshot starts as fast as `tsck refs`), and
`tsck log`, `tsck refs`, `tsck tags` (snapshots as SnapshotInfo, one odd one reported
apart from the others)."""

from __future__ import annotations

import io
import pickle
import zipfile
from dataclasses import dataclass

import numpy as np

from ..core.core import Core
from ..core.walk import PackedPart, iter_leaves, read_node
from ..errors import FormatError, IntegrityError, InvalidArgument, RefNotFound, TsckError, storage_error
from ..format import tree
from ..format.dcp import DCP_FORMAT, check_version, fqn_paths, is_dcp_top
from ..format.dtypes import DTYPE_ITEMSIZES
from ..format.manifest import decode_commit
from ..format.world import rank_top, rank_tops
from ..info import SnapshotInfo, row_to_info
from ..util.ids import Digest
from ..util.paths import FULL, SKIP, Selection, dotted, key_str, parts_from_formatted
from .readjobs import PackCache, PackPart, run_reads
from .world_view import Merged, Union, deref_merged

__all__ = ["Entry", "list_tree", "diff", "history", "describe", "dcp_saved_paths", "as_saved", "saved_findings",
           "MAX_ENTRIES"]

MAX_ENTRIES = 1 << 22  # values one listing visits (a DAG of 40 nodes can name 2^40 paths)


@dataclass(frozen=True, slots=True)
class Entry:
    """One value of a snapshot's tree: a tensor, array, sharded tensor, a plain value or an
    empty container. nbytes: the bytes of its data (tensors: elements x itemsize)."""
    path: str
    kind: str             # tensor | array | sharded | numpy | None | bool | int | float | str | bytes
    #                       | pickled | dict | list | tuple (the last three only when empty)
    dtype: str | None = None
    shape: tuple | None = None
    nbytes: int = 0
    value: object = None  # plain values (bytes: None, only their size is shown)
    blocks: int = 0       # blocks of a tensor's data (0: inline in its node)

    def to_json(self) -> dict:
        d = {"path": self.path, "kind": self.kind, "dtype": self.dtype,
             "shape": list(self.shape) if self.shape is not None else None, "bytes": self.nbytes,
             "blocks": self.blocks}
        if self.kind in ("None", "bool", "int", "float", "str", "numpy"):
            d["value"] = self.value
        return d


def _entry(p: str, item) -> Entry:
    t = type(item)
    if t is tree.Tensor:
        return Entry(p, "tensor", item.dt, item.shape, item.nbytes, blocks=len(item.blocks))
    if t is tree.Array:
        d = item.dtype
        dt = str(d) if d.fields is not None else d.name if d.isnative or d.byteorder == "|" else d.str
        return Entry(p, "array", dt, item.shape, item.nbytes, blocks=len(item.blocks))
    if t is tree.Global:
        n = DTYPE_ITEMSIZES[item.dt]
        for s in item.shape:
            n *= s
        return Entry(p, "sharded", item.dt, item.shape, n, blocks=sum(len(c.blocks) for c in item.chunks))
    if t is tree.Container:
        return Entry(p, {"d": "dict", "o": "dict", "l": "list", "t": "tuple"}[item.kind])
    if t is tree.NpScalar:
        try:
            v = np.frombuffer(item.raw, dtype=item.dtype)[0].item() if item.dtype.kind not in "SUV" else None
        except Exception:  # noqa: BLE001 - numpy's failures on odd dtypes vary
            v = None
        return Entry(p, "numpy", item.dtype.name, (), len(item.raw), v)
    if t is tree.Pickled:
        return Entry(p, "pickled", nbytes=len(item.data))
    if t is bytes:
        return Entry(p, "bytes", nbytes=len(item))
    if t is str:
        return Entry(p, "str", nbytes=len(item.encode("utf-8", "surrogatepass")), value=item)
    if item is None:
        return Entry(p, "None")
    return Entry(p, t.__name__, value=item)  # bool, int, float


def list_tree(core: Core, root: Digest | str, path: str | None = None, *,
              limit: int = MAX_ENTRIES, raw: bool = False) -> tuple[str, list]:
    """(root hex, [Entry]) of the values of the snapshot `root` (a Digest or its hex:
    Store.resolve(target) names it), in state order; with `path`, only
    that value or the values under it (nodes elsewhere are not read). Reads the commit
    and the manifest nodes it needs, never a block. A multi-rank snapshot lists rank 0's
    tree: every rank's tree merged, as a single process's checkout returns it
    (world_view.py: sharded tensors at their global shape with every rank's pieces,
    whichever ranks hold them; rank-local values rank 0's, else the lowest rank's that
    holds them; CheckoutMismatch naming a path one tree cannot show). A snapshot
    written through dcp.save lists the state that was saved, at the paths checkout(paths=) takes (raw=True: its stored layout, tensors.* and DCP's
    metadata). InvalidArgument when nothing is at `path`; FormatError past `limit` values."""
    root = root if isinstance(root, Digest) else Digest.parse(root)
    try:
        return root.hex(), list(_entries(core, root, path, limit, raw))
    except OSError as e:
        raise storage_error(e, f"reading snapshot {root.hex()[:16]} of {core.url}") from e


def _entries(core: Core, root: Digest, path: str | None, limit: int, raw: bool = False):
    assets, verify, snap = core.assets, core.settings.verify, root.hex()
    top = decode_commit(assets.get_commit(root, verify=verify))["tree"]
    sel = None if path is None else Selection([path])
    decoded: dict = {}
    sizes: dict = {}  # (node, depth, selection state) -> (values visited, entries listed) under it

    def node(d, parts, depth, world=False):
        key = (d, depth, world)
        if key not in decoded:
            decoded[key] = read_node(assets, d, parts, depth, snapshot=snap, verify=verify, world=world)
        return decoded[key]

    def items(v, parts, depth, state):
        """(path, depth, item, its selection state) of the values of one node's value."""
        for p, dp, item in tree.visit(v, parts, depth, plain=True):
            st = state
            for k in p[len(parts):]:
                if st is FULL or st is SKIP:
                    break
                st = sel.step(st, k)
            yield p, dp, item, st

    def key(item, dp, st):
        # a Merged (rank trees merged) is one object per distinct node tuple, kept by the Union
        return item.digest if type(item) is tree.Ref else ("m", id(item)), dp, None if st is FULL else id(st)

    def sub(item, p, dp):
        return item.value if type(item) is Merged else node(item.digest, p, dp)

    def measure(v, parts, depth, state) -> tuple[int, int]:
        # What the listing below will visit, over distinct nodes: a DAG of 40 nodes can
        # name 2^40 paths, and is refused here before one is listed.
        seen = found = 0
        for p, dp, item, st in items(v, parts, depth, state):
            seen += 1
            if type(item) is tree.Ref or type(item) is Merged:
                if st is not SKIP:
                    k = key(item, dp, st)
                    if k not in sizes:
                        sizes[k] = measure(sub(item, p, dp), p, dp, st)
                    seen, found = seen + sizes[k][0], found + sizes[k][1]
            elif st is FULL:
                found += 1
            if seen > limit:
                raise FormatError(f"snapshot {snap[:16]} names more than {limit} values (nodes shared at many "
                                  "paths); give a PATH to list a part of it")
        return seen, found

    def values(v, parts, depth, state):
        for p, dp, item, st in items(v, parts, depth, state):
            if type(item) is tree.Ref or type(item) is Merged:
                if st is not SKIP and sizes[key(item, dp, st)][1]:
                    yield from values(sub(item, p, dp), p, dp, st)
            elif st is FULL:
                yield _entry(dotted(p), item)

    v = node(top, (), 0, world=True)
    state = FULL if sel is None else sel.root
    if type(v) is tree.World:
        v = deref_merged(_one_view(v, node, sel, state, snap, limit))
    if not raw and is_dcp_top(v):
        yield from _dcp_entries(v, node, sel, path, limit, snap, core.url)
        return
    if measure(v, (), 0, state)[1] == 0 and path is not None:
        raise InvalidArgument(f"snapshot {snap[:16]} in {core.url} holds nothing at {path!r} (paths are "
                              "dotted: model.layers.0.weight; `tsck ls` lists them)")
    yield from values(v, (), 0, state)


def _one_view(w: tree.World, node, sel, state, snap: str, limit: int):
    """Every rank's tree of a collective snapshot merged (world_view.Union), as one
    process's checkout merges them; only what the selection keeps is read."""
    def deref(v, parts, depth):
        while type(v) is tree.Ref:
            v = node(v.digest, parts, depth)
        return v

    tops = rank_tops(w, lambda d: node(d, (), 0))
    u = Union(deref, None if sel is None else sel.step, snapshot=snap, budget=limit)
    return u.merge([(r, tree.Ref(d)) for r, d in enumerate(tops)], (), 0, state)


def _dcp_entries(v, node, sel, path, limit: int, snap: str, url: str):
    """The values of a dcp.save snapshot (top `v`) at the paths of the state that was
    saved, in its order, as dcpstate.read_dcp gives them back: each fqn at the path DCP
    flattened it from (planner_data); a tensor at its global shape; a bytes item (what
    DCP torch.save'd) as its plain value when it is one (read without torch), else
    "pickled" with its size. Only the nodes of the top's sections are read."""
    d = dict(v.items)
    check_version(d["version"])
    paths = fqn_paths(_plain(d["metadata"], node, ("metadata",), limit, snap), snap)

    def section(name):
        s = d[name]
        if type(s) is tree.Ref:
            s = node(s.digest, (name,), 1)
        if type(s) is not tree.Container or s.kind != "d" or not all(type(k) is str for k, _ in s.items):
            raise FormatError(f"DCP snapshot {snap[:16]}: its {name} are not a map of str keys")
        return dict(s.items)

    tensors, byts = section("tensors"), section("bytes")
    stored = [f for f in paths if f in tensors or f in byts]
    stored += [f for f in list(tensors) + list(byts) if f not in paths]
    n = 0
    for f in stored:
        p = dotted(paths.get(f, (f,)))
        if sel is not None and not sel.covers(p):
            continue
        if f in tensors:
            item = tensors[f]
            if type(item) is tree.Ref:
                item = node(item.digest, ("tensors", f), 2)
            e = _entry(p, item)
            got = [Entry(p, "tensor" if e.kind == "sharded" else e.kind, e.dtype, e.shape, e.nbytes,
                         blocks=e.blocks)]
        else:
            got = _bytes_entries(p, byts[f], node, f)
        n += len(got)
        if n > limit:
            raise FormatError(f"snapshot {snap[:16]} names more than {limit} values; give a PATH to list a part of it")
        yield from got
    if n == 0 and path is not None:
        raise InvalidArgument(f"snapshot {snap[:16]} in {url} holds nothing at {path!r} (paths are dotted: "
                              "model.layers.0.weight; `tsck ls` lists them)")


def _plain(v, node, parts, limit: int, snap: str):
    """A manifest value of plain values (DCP's metadata) -> python, its nodes read."""
    count = 0

    def conv(x, p):
        nonlocal count
        count += 1
        if count > limit:
            raise FormatError(f"DCP snapshot {snap[:16]}: its metadata holds more than {limit} values")
        if type(x) is tree.Ref:
            x = node(x.digest, p, len(p))
        if type(x) is tree.Container:
            if x.kind in ("d", "o"):
                return {k: conv(y, p + (k,)) for k, y in x.items}
            out = [conv(y, p + (i,)) for i, y in enumerate(x.items)]
            return tuple(out) if x.kind == "t" else out
        return x

    return conv(v, parts)


_SAVED_MAX = 1 << 20  # the pickle of a bytes item read for ls (DCP stores larger ones in blocks)


class _PlainUnpickler(pickle.Unpickler):
    """Plain values only: every global and persistent id is refused, so nothing runs."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"global {module}.{name}")

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("persistent id")


def _saved_plain(raw: bytes):
    """(True, value) of a torch.save'd value that is plain data (None, bool, int, float,
    str, bytes, and lists, tuples and dicts of them), read without torch; (False, None)
    for anything else (a tensor, an object: checkout loads those with torch's
    weights_only loader, or refuses them)."""
    try:
        with zipfile.ZipFile(io.BytesIO(raw)) as z:
            infos = [i for i in z.infolist() if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
            if len(infos) != 1 or infos[0].compress_type != zipfile.ZIP_STORED or infos[0].file_size > _SAVED_MAX:
                return False, None
            data = z.read(infos[0])
        value = _PlainUnpickler(io.BytesIO(data)).load()
    except Exception:  # noqa: BLE001 - stored bytes are untrusted: anything odd is "pickled"
        return False, None
    budget = [10_000]

    def plain(x, depth) -> bool:
        budget[0] -= 1
        if budget[0] < 0 or depth > 32:
            return False
        if x is None or type(x) in (bool, int, float, str, bytes):
            return True
        if type(x) in (list, tuple):
            return all(plain(y, depth + 1) for y in x)
        if type(x) is dict:
            return all(type(k) in (str, int) and plain(y, depth + 1) for k, y in x.items())
        return False

    return (True, value) if plain(value, 0) else (False, None)


def _bytes_entries(p: str, item, node, fqn: str) -> list:
    """The entries of one DCP bytes item at path `p`: its plain value's, as a native
    snapshot of the same value lists them; else one "pickled" entry."""
    if type(item) is tree.Ref:
        item = node(item.digest, ("bytes", fqn), 2)
    if type(item) is not bytes:  # a large item, in blocks: ls reads none
        return [Entry(p, "pickled", nbytes=getattr(item, "nbytes", 0), blocks=len(getattr(item, "blocks", ())))]
    ok, value = _saved_plain(item)
    if not ok:
        return [Entry(p, "pickled", nbytes=len(item))]
    out = []
    stack = [(value, p)]
    while stack:
        x, q = stack.pop()
        if type(x) in (list, tuple, dict) and x:
            kids = list(x.items()) if type(x) is dict else list(enumerate(x))
            stack.extend((y, f"{q}.{key_str(k)}") for k, y in reversed(kids))
        elif type(x) in (list, tuple, dict):
            out.append(Entry(q, {list: "list", tuple: "tuple", dict: "dict"}[type(x)]))
        else:
            out.append(_entry(q, x))
    return out


def dcp_saved_paths(core: Core, root: Digest, *, limit: int = MAX_ENTRIES) -> dict | None:
    """For a snapshot written through dcp.save: {fqn: the path in the state as saved that
    DCP flattened it from} ({} without planner_data: each fqn is its own path), what
    `tsck ls` shows it at; None for any other snapshot. Reads the commit, and for one
    whose commit says it was written by TsckWriter (meta "format": "dcp") the top node
    and DCP's metadata; never a block."""
    assets, verify, snap = core.assets, core.settings.verify, root.hex()
    c = decode_commit(assets.get_commit(root, verify=verify))
    if c.get("meta", {}).get("format") != DCP_FORMAT:
        return None  # (no node read for the snapshots of put_snapshot)
    top = c["tree"]

    def node(d, parts, depth, world=False):
        return read_node(assets, d, parts, depth, snapshot=snap, verify=verify, world=world)

    v = node(top, (), 0, world=True)
    if type(v) is tree.World:
        v = node(rank_top(v, 0, lambda d: node(d, (), 0)), (), 0)
    if not is_dcp_top(v):
        return None
    d = dict(v.items)
    check_version(d["version"])
    return fqn_paths(_plain(d["metadata"], node, ("metadata",), limit, snap), snap)


def as_saved(parts: tuple, paths: dict) -> tuple:
    """A path in a DCP snapshot's stored layout -> the path in the state as saved (as
    `tsck ls` shows it): tensors.FQN -> FQN's path (what is under it kept), bytes.FQN and
    anything under it (the blocks of a large one) -> FQN's path; anything else (DCP's
    metadata) as it is."""
    if len(parts) >= 2 and parts[0] in ("tensors", "bytes") and type(parts[1]) is str:
        base = paths.get(parts[1], (parts[1],))
        return base if parts[0] == "bytes" else base + tuple(parts[2:])
    return parts


def _saved_formatted(p: str, paths: dict) -> str:
    parts = parts_from_formatted(p)
    return p if parts is None else tree.format_path(as_saved(parts, paths))


def saved_findings(core: Core, report):
    """An fsck report with the paths of its findings in DCP snapshots as `tsck ls` shows
    them (the state as saved). A snapshot whose DCP metadata cannot be read keeps its
    stored paths (the finding says what is wrong with it)."""
    import dataclasses
    maps: dict = {}

    def paths_of(snap: str):
        if snap not in maps:
            try:
                maps[snap] = dcp_saved_paths(core, Digest.parse(snap))
            except (TsckError, OSError, ValueError):
                maps[snap] = None
        return maps[snap]

    out = []
    for f in report.findings:
        m = paths_of(f.snapshot) if f.path and f.snapshot else None
        out.append(f if m is None else dataclasses.replace(f, path=_saved_formatted(f.path, m)))
    report.findings = out
    return report


def diff(core: Core, ra: Digest, rb: Digest, *, raw: bool = False) -> dict:
    """Which tensors differ between the snapshots `ra` and `rb`, and in how many blocks
    (from their manifests: no block is read, but for a small tensor in a pack whose pack
    differs: its own bytes are read from both and compared). A snapshot written through dcp.save names
    its tensors at their paths in the state as saved, as `tsck ls` does (raw=True: at
    their stored ones, tensors.FQN)."""
    la = iter_leaves(core.assets, ra, verify=core.settings.verify)
    lb = iter_leaves(core.assets, rb, verify=core.settings.verify)
    if not raw:
        la, lb = _as_saved_leaves(core, ra, la), _as_saved_leaves(core, rb, lb)
    out = {"a": ra.hex(), "b": rb.hex(), "added": sorted(lb.keys() - la.keys()),
           "removed": sorted(la.keys() - lb.keys()), "changed": [], "unchanged": 0}
    packs = PackCache()
    for p in sorted(la.keys() & lb.keys()):
        (da, ba), (db, bb) = la[p], lb[p]
        if da == db and ba != bb and len(ba) == len(bb) and any(type(x) is PackedPart for x in ba + bb):
            ba, bb = ([_part_bytes(core, x, root, p, packs) for x in v] for v, root in ((ba, ra), (bb, rb)))
        if da == db and ba == bb:
            out["unchanged"] += 1
            continue
        differ = sum(1 for x, y in zip(ba, bb) if x != y) + abs(len(ba) - len(bb))
        out["changed"].append({"path": p, "a": da, "b": db, "blocks_differ": differ, "blocks": max(len(ba), len(bb))})
    out["changed"].sort(key=lambda x: x["path"])
    return out


def _part_bytes(core: Core, x, root: Digest, path: str, packs: PackCache):
    """A PackedPart's own bytes, read and verified (other entries as they are)."""
    if type(x) is not PackedPart:
        return x
    buf = np.empty(x.n, dtype=np.uint8)
    run_reads(core.assets, core.pool, [(x.digest, PackPart(buf, x.off, x.glen, x.h), path, False)],
              snapshot=root.hex(), verify=core.settings.verify, packs=packs)
    return buf.tobytes()


def _as_saved_leaves(core: Core, root: Digest, leaves: dict) -> dict:
    m = dcp_saved_paths(core, root)
    return leaves if m is None else {_saved_formatted(p, m): v for p, v in leaves.items()}


def history(core: Core, ref: str, errors: dict | None) -> list[SnapshotInfo]:
    """The kept snapshots `ref` has pointed at, newest first (Store.log). A catalog row
    that does not decode raises its FormatError, or with errors={} goes there (root hex
    -> error) and the others are listed."""
    hist = core.refs.history(ref)
    if hist is None:
        raise RefNotFound(f"no ref named {ref!r}")
    out = []
    for root, row in hist:
        if isinstance(row, FormatError):
            if errors is None:
                raise row
            errors[root.hex()] = row
            continue
        out.append(row_to_info(root, row))
    return out


def describe(named, info, errors: dict | None) -> dict[str, SnapshotInfo]:
    """name -> info(root) for each (name, root) (Store.refs and tags; info: the
    publisher's, catalog row or commit). One that cannot be described raises, or with
    errors={} goes there (name -> error) and the others are listed."""
    out = {}
    for name, root in named:
        try:
            out[name] = info(root)
        except (FormatError, IntegrityError) as e:
            if errors is None:
                if isinstance(e, FormatError):
                    raise FormatError(f"{name!r}: {e}") from None
                raise
            errors[name] = e  # one odd snapshot: the others are still listed
    return out
