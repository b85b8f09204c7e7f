"""What the store's bytes are, per job and over time: the numbers behind `tsck du` and
`tsck du --plot`.

    summary(core) -> Store.du(): logical bytes (the catalog rows) vs physical (one count
                     of the stored objects per kind), the three figures below, per job
                     the totals, latest step, held_bytes and only_bytes (below), and
                     tmp/'s leftover temp files
    usage(core)   -> {"store", "logical_bytes", "block_bytes", "jobs": {job: {...}},
                      "physical" (the store over time: physical_over_time), "unreadable"}

Per job, over its kept snapshots in commit order (catalog rows: nothing is read for it):

    times, steps     commit time and step of each snapshot
    logical          the bytes its snapshots hold, summed up to each one
    written          the bytes its commits added to storage, summed up to each one: each
                     commit's stats.stored_new (framed and compressed, recorded when it was
                     committed); a commit made before that was recorded counts its
                     uncompressed bytes_new instead and the job's `estimated` says how many

and from one walk of every kept snapshot's manifest (nodes are read, blocks never):

    held_bytes       the stored bytes of the blocks its snapshots reference
    only_bytes       of those, the blocks no other job's snapshot references: what deleting
                     the job (its refs, then gc) would free, tags and pins aside

Block sizes are the stored ones (one listing of blocks/). Nodes and commits are a small
fraction and are left out of held_bytes and only_bytes.

What separates logical from physical, as three figures that never mix (summary):

    dedup_ratio        logical_bytes (the kept snapshots' bytes_total) / distinct_bytes,
                       the logical bytes of the distinct content they use: each block
                       they reference once (its raw length), plus the tensor bytes
                       inlined in each manifest node they reference once. 1.00x: no
                       content repeats; 2.00x: two DDP ranks' copies of one model.
    compression_ratio  the logical bytes of those distinct blocks (the ones stored) /
                       the bytes they take in storage (framed, maybe compressed).
    orphans            stored objects (blocks, nodes, commits) no kept snapshot uses:
                       what the next gc removes (or a put still in flight wrote), counted
                       in physical_bytes and in neither ratio.
"""

from __future__ import annotations

from ..core.core import Core
from ..core.roles import CatalogReader
from ..core.walk import walk_commit
from ..errors import FormatError, IntegrityError, storage_error
from ..info import row_to_info

__all__ = ["summary", "usage", "tier_usage"]

_SHARED = -1


def _kept(core: Core, bad: list) -> list:
    """SnapshotInfo of every catalog row; a row that does not decode goes to `bad`
    as (root, error) (tsck fsck names it)."""
    return [row_to_info(root, row) for root, row in core.refs.catalog_iter(bad=bad)]


def summary(core: Core, *, lease: float | None = None) -> dict:
    """Logical bytes (what the kept snapshots hold) vs physical (what storage holds), and
    the temp files under tmp/ (a killed save's .partial files; when a gc with `lease`
    sweeps them: Assets.temp_report). Three separate figures (module docstring):
    dedup_ratio, compression_ratio and the orphans awaiting gc."""
    jobs: dict[str, dict] = {}
    bad: list = []
    rows = _kept(core, bad)
    for info in rows:
        j = jobs.setdefault(info.job, {"snapshots": 0, "logical_bytes": 0, "new_bytes": 0,
                                       "latest_step": None, "latest_time": 0.0, "held_bytes": 0, "only_bytes": 0,
                                       "blocks": 0, "only_blocks": 0})
        j["snapshots"] += 1
        j["logical_bytes"] += info.bytes_total
        j["new_bytes"] += info.bytes_new
        if info.time >= j["latest_time"]:
            j["latest_time"], j["latest_step"] = info.time, info.step
    logical = sum(i.bytes_total for i in rows)
    try:
        stored = {kind: {o.digest: o.size for o in core.assets.list_objects(kind)}
                  for kind in ("blocks", "nodes", "commits")}
    except OSError as e:
        raise storage_error(e, f"listing the objects of {core.url}") from e
    used = _Used()
    unreadable = _holdings(core, rows, jobs, stored["blocks"], used)
    used.commits.update(bytes.fromhex(i.root) for i in rows)
    distinct = sum(used.blocks.values()) + sum(used.inline.values())
    here = [(n, stored["blocks"][d]) for d, n in used.blocks.items() if d in stored["blocks"]]
    orphans = {kind: [sz for d, sz in stored[kind].items() if d not in mine]
               for kind, mine in (("blocks", used.blocks), ("nodes", used.nodes), ("commits", used.commits))}
    return {
        "store": core.url, "snapshots": len(rows),
        "logical_bytes": logical, "physical_bytes": sum(sum(v.values()) for v in stored.values()),
        "block_bytes": sum(stored["blocks"].values()), "blocks": len(stored["blocks"]),
        "nodes": len(stored["nodes"]), "commits": len(stored["commits"]),
        "malformed_rows": [r.hex() for r, _e in bad],  # catalog rows left out (tsck fsck names them)
        "distinct_bytes": distinct,
        "dedup_ratio": (logical / distinct) if distinct else None,
        "used_block_bytes": sum(sz for _n, sz in here),
        "compression_ratio": (sum(n for n, _sz in here) / sum(sz for _n, sz in here)) if here else None,
        "orphans": {"objects": sum(len(v) for v in orphans.values()), "bytes": sum(sum(v) for v in orphans.values()),
                    **{kind: len(v) for kind, v in orphans.items()}},
        "jobs": jobs,
        "unreadable": unreadable,
        "temp_files": _temp(core, lease),
    }


class _Used:
    """What the kept snapshots use, from _holdings' walk: block address -> logical bytes,
    the nodes (address -> tensor bytes inlined in it), the commits."""

    def __init__(self):
        self.blocks: dict[bytes, int] = {}
        self.inline: dict[bytes, int] = {}
        self.commits: set[bytes] = set()

    @property
    def nodes(self):
        return self.inline


def _temp(core: Core, lease: float | None) -> dict:
    from ..core.core import DEFAULT_LEASE
    try:
        return core.assets.temp_report(lease=DEFAULT_LEASE if lease is None else lease)
    except OSError as e:
        raise storage_error(e, f"listing the temp files of {core.url}") from e


def usage(core: Core) -> dict:
    """The numbers per job over time (the module docstring), for `tsck du --plot`."""
    bad: list = []
    rows = _kept(core, bad)
    rows.sort(key=lambda i: (i.time, i.step if i.step is not None else -1, i.root))
    names = sorted({i.job for i in rows})
    jobs: dict[str, dict] = {j: {"snapshots": 0, "times": [], "steps": [], "logical": [], "written": [],
                                 "estimated": 0, "held_bytes": 0, "only_bytes": 0, "blocks": 0,
                                 "only_blocks": 0} for j in names}
    for i in rows:
        j = jobs[i.job]
        j["snapshots"] += 1
        j["times"].append(i.time)
        j["steps"].append(i.step)
        j["logical"].append((j["logical"][-1] if j["logical"] else 0) + i.bytes_total)
        if i.stored_new is None:
            j["estimated"] += 1
        new = i.stored_new if i.stored_new is not None else i.bytes_new
        j["written"].append((j["written"][-1] if j["written"] else 0) + new)

    try:
        sizes = {o.digest: o.size for o in core.assets.list_objects("blocks")}
    except OSError as e:
        raise storage_error(e, f"listing the blocks of {core.url}") from e
    unreadable = _holdings(core, rows, jobs, sizes)
    return {"store": core.url, "logical_bytes": sum(i.bytes_total for i in rows),
            "block_bytes": sum(sizes.values()), "blocks": len(sizes), "jobs": jobs,
            "physical": physical_over_time(rows, sum(sizes.values()), core.refs.reclaimed(),
                                           core.refs.dropped()),
            "malformed_rows": [r.hex() for r, _e in bad], "unreadable": unreadable}


def _holdings(core: Core, rows: list, jobs: dict, sizes: dict | None = None,
              used: _Used | None = None) -> dict[str, str]:
    """Per job (rows: its kept snapshots), from one walk of their manifests (nodes are
    read, blocks never): held_bytes / blocks, the stored bytes of the blocks they
    reference, and only_bytes / only_blocks, of those the blocks no other job's snapshot
    references (what deleting the job would free). Added into jobs[job]; `used` gets
    what the walk met (_Used); -> the snapshots that could not be read whole (root hex
    -> error; fsck names them)."""
    inline = used.inline if used is not None else None
    names = sorted({i.job for i in rows})
    index = {j: n for n, j in enumerate(names)}
    # Which job references each block: its index, or _SHARED once a second job does.
    owner: dict[bytes, int] = {}
    unreadable: dict[str, str] = {}
    parts = core.refs.tier_rows.parts()
    try:
        if sizes is None:
            sizes = {o.digest: o.size for o in core.assets.list_objects("blocks")}
        for job in names:
            n, j = index[job], jobs[job]
            seen: set = set()   # nodes walked for this job: a shared sub-tree once per job
            mine: set = set()   # blocks this job references (only while its walk runs)
            for i in rows:
                if i.job != job:
                    continue
                try:
                    for o in walk_commit(core.assets, bytes.fromhex(i.root), verify=core.settings.verify,
                                         skip_nodes=seen, part=parts.get(bytes.fromhex(i.root)), inline=inline):
                        if o.kind != "block" or o.digest in mine:
                            continue
                        mine.add(o.digest)
                        if used is not None:
                            used.blocks[o.digest] = o.nbytes or 0
                        size = sizes.get(o.digest)
                        if size is None:
                            continue  # missing (fsck reports it): it takes no space
                        j["held_bytes"] += size
                        j["blocks"] += 1
                        was = owner.setdefault(o.digest, n)
                        if was != n:
                            owner[o.digest] = _SHARED
                except (IntegrityError, FormatError) as e:
                    unreadable[i.root] = str(e)  # fsck names it; the numbers leave its rest out
    except OSError as e:
        raise storage_error(e, f"reading the snapshots of {core.url}") from e
    for d, n in owner.items():
        if n != _SHARED:
            j = jobs[names[n]]
            j["only_bytes"] += sizes[d]
            j["only_blocks"] += 1
    return unreadable


def physical_over_time(rows: list, block_bytes: int, reclaimed: list, dropped: dict | None = None) -> dict:
    """The store's stored block bytes over time, reclaimed space included (`tsck du --plot`'s
    left panel), from what is on record: every commit added its stored_new (its
    uncompressed bytes_new when older than that record) at its time, the kept ones (rows)
    and those whose rows were dropped since (`dropped`, RefTable.dropped: a prune, gc's
    retention, delete-ref, forget; their blocks stay stored until a gc removes them), and
    each recorded gc or prune (RefTable.reclaimed) took its block bytes away at its time.
    The line ends at `block_bytes`, what storage holds now, and is written backwards from
    there, so what is on no record (gcs older than the record, commits dropped before the
    store kept that record) is the `start`, where the line begins: 0 for a store whose
    whole history is on record. -> {"times", "stored", "reclaimed" (summed up to each
    time), "written" (stored + reclaimed: every byte put, none taken back), "logical"
    (what the kept snapshots committed up to each time hold), "start", "gcs" (recorded
    runs drawn), "dropped" (commits drawn that are no longer kept)}"""
    events = [(i.time, i.stored_new if i.stored_new is not None else i.bytes_new, i.bytes_total) for i in rows]
    kept = {i.root for i in rows}
    expired = [(at, n, 0) for root, (at, n, _est) in (dropped or {}).items() if root.hex() not in kept]
    gcs = [(float(at), -int(blocks), 0) for at, blocks, _all in reclaimed if blocks]
    events = sorted(events + expired + gcs, key=lambda e: (e[0], e[1] < 0))  # a gc at the time of a commit: after it
    start = block_bytes - sum(d for _t, d, _l in events)
    out = {"times": [], "stored": [], "reclaimed": [], "written": [], "logical": [], "start": start,
           "gcs": len(gcs), "dropped": len(expired)}
    level, gone, logical = start, 0, 0
    for t, d, lb in events:
        level += d
        gone += -d if d < 0 else 0
        logical += lb
        out["times"].append(t)
        out["stored"].append(level)
        out["reclaimed"].append(gone)
        out["written"].append(level + gone)
        out["logical"].append(logical)
    return out


def tier_usage(core: Core[CatalogReader]) -> dict:
    """A local tier's bytes by what they are for (`tsck du STORE --local PATH`): every
    stored object (blocks, nodes, commits, as stored) goes to the first of

        pending      reached by a snapshot queued for upload
        local_only   reached by a snapshot not durable and not queued (skipped by the
                     backlog rule, or left by a put that was never queued)
        durable      reached by a durable snapshot: a cached copy of what the remote holds
        unreferenced reached by none (a put in flight, or garbage a local gc removes)

    and `evicted` counts the durable snapshots whose local copies the budget dropped."""
    refs = core.refs
    evicted, parts = refs.tier_rows.evicted(), refs.tier_rows.parts()
    queued = {e["root"] for _, e in refs.tier_rows.upload_pending()}
    roots = (refs.catalog_roots() | {r for _, r in refs.list()} | {r for _, r in refs.tags()} | refs.pins()) - evicted
    durable = refs.tier_rows.durable(roots)
    cls = {r: ("pending" if r in queued else "durable" if r in durable else "local_only") for r in roots}
    rank = {"pending": 0, "local_only": 1, "durable": 2}
    owner: dict[tuple, str] = {}
    unreadable: dict[str, str] = {}
    try:
        sizes = {(kind, o.digest): o.size for kind in ("commits", "nodes", "blocks")
                 for o in core.assets.list_objects(kind)}
        for root in sorted(roots, key=lambda r: rank[cls[r]]):  # a shared object counts for the first class
            c = cls[root]
            try:
                for o in walk_commit(core.assets, root, verify=False, part=parts.get(root)):
                    owner.setdefault((o.kind + "s", o.digest), c)
            except (IntegrityError, FormatError) as e:
                unreadable[root.hex()] = str(e)  # fsck names it
    except OSError as e:
        raise storage_error(e, f"reading the snapshots of the local tier {core.url}") from e
    out = {k: {"snapshots": 0, "bytes": 0, "objects": 0} for k in ("pending", "local_only", "durable", "unreferenced")}
    for c in cls.values():
        out[c]["snapshots"] += 1
    for k, size in sizes.items():
        c = out[owner.get(k, "unreferenced")]
        c["bytes"] += size
        c["objects"] += 1
    return {"local": core.url, "bytes": sum(sizes.values()), **out, "evicted": {"snapshots": len(evicted)},
            "unreadable": unreadable}
