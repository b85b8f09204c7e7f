"""fsck: check every kept snapshot and every ref, tag and pin; count orphans.

Gathers every finding instead of stopping at the first. A block shared by
several snapshots is read once, and a problem with it is reported once per
snapshot (and tensor path) that references it. Within one snapshot a node named
at several paths is walked once (a DAG of 40 nodes can name 2^40 paths): its
problems name the first path that reaches it. A catalog row that does not
decode is a `malformed_row` finding; the snapshot is still checked from its commit.
An object that is there but cannot be read (an I/O error, a folder or FIFO in its
place) is an `unreadable` finding with its errno, and the walk goes on. A full check
also hashes each part of a pack that a leaf names with a content hash (LEAF `h`): a part
whose bytes do not match is a `bad_part` finding naming the leaf's path (the pack itself
is whole; the leaf that names it lies).

    full (default)  read every object and re-hash every byte
    quick           presence, header and sizes only
    repair          also move every damaged object (its bytes do not match its
                    address: corrupt, truncated, an undecodable frame) aside to
                    quarantine/, so that the next put of that content stores it
                    again under the same address and heals every snapshot using it

Repair holds the store's gc lock for the whole run (a gc cannot delete beside
it) and moves objects only inside a deletion phase (the epoch fence, as gc
deletes): a writer that found a damaged object present and reused it before the
move sees its ref move refused, re-validates (the object is gone now: it writes
it again from the bytes it holds) and retries. docs/design/fsck.md, "fsck
--repair", has the argument.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from ..core.core import Core
from ..core.core import DEFAULT_LEASE
from ..core.partindex import part_matches
from ..core.walk import walk_commit
from ..errors import FormatError, IntegrityError, TsckError, UnreadableObject, storage_error
from ..format import frame
from ..util.progress import progress_bar
from .lease import Lease, holding_gc_lock
from .reach import KINDS, Marked, holders, iter_unreachable, kept_roots

__all__ = ["Finding", "FsckReport", "run_fsck"]


@dataclass
class Finding:
    problem: str            # missing | truncated | corrupt | undecodable | unreadable | dangling_ref | stray
    #                         | malformed_row | bad_part
    snapshot: str | None    # root hex
    names: list             # refs / tags / pins pointing at the snapshot ("ref:x", "tag:y", "pin")
    path: str | None        # tensor path in the state, when known
    key: str | None         # storage key of the bad object
    message: str
    errno: int | None = None  # unreadable: the backend's error number (5 EIO, 21 EISDIR, ...)

    def __str__(self):
        where = []
        if self.snapshot:
            where.append(f"snapshot {self.snapshot[:16]}")
        if self.names:
            where.append(", ".join(self.names))
        if self.path:
            where.append(f"at {self.path}")
        if self.key:
            where.append(self.key)
        return f"{self.problem}: {self.message} ({'; '.join(where)})"


@dataclass
class FsckReport:
    full: bool
    snapshots_checked: int = 0
    objects_checked: int = 0
    bytes_checked: int = 0
    findings: list = field(default_factory=list)
    orphans: int = 0
    orphan_bytes: int = 0
    gc_ran: bool = False          # a gc deletion phase overlapped this fsck
    dropped_after_gc: int = 0     # findings of snapshots that gc removed meanwhile (not damage)
    repair: bool = False
    moved: list = field(default_factory=list)   # {"key", "aside", "problem"}: damaged objects moved aside
    left: list = field(default_factory=list)    # {"key", "why"}: objects found bad but not moved
    evicted: int = 0              # a local tier's snapshots whose local copies its budget dropped (not checked)
    quarantined: int = 0          # objects under quarantine/ after this run (kept; never read, never gc'd)
    quarantined_bytes: int = 0
    # tmp/: temp files of writes in flight or of writers that died (Assets.temp_report:
    # count, bytes, when a gc sweeps them); not problems, and never part of a snapshot
    temp_files: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_json(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def _names(core: Core) -> dict[bytes, list[str]]:
    return {root: [f"{kind}:{name}" if name else kind for kind, name in hs] for root, hs in holders(core).items()}


def _unreadable(e: UnreadableObject, snap: str, names: list, path: str | None) -> Finding:
    code = f"errno {e.errno}: " if e.errno is not None else ""
    return Finding("unreadable", snap, names, path or None, e.key,
                   f"cannot read the object ({code}{e.detail or e.strerror or e})", e.errno)


def run_fsck(core: Core, *, full: bool = True, progress: bool = False, repair: bool = False,
             lease: float = DEFAULT_LEASE) -> FsckReport:
    t0 = time.time()
    rep = FsckReport(full=full, repair=repair)
    if repair:
        # The lock first, so a gc running now fails this at once (GcBusy) instead of after
        # the whole check; held through the check, gc cannot delete beside it either.
        # Repair only moves aside damaged objects of kept snapshots: an unfinished
        # rebuild (fewer kept snapshots known) makes it do less, never delete more.
        with holding_gc_lock(core, lease=lease, role="fsck-repair:", rebuilding_ok=True) as hold:
            _check(core, rep, progress)
            _repair(core, rep, hold)
    else:
        _check(core, rep, progress)
    for a in core.assets.list_aside():
        rep.quarantined += 1
        rep.quarantined_bytes += a.size
    try:
        rep.temp_files = core.assets.temp_report(lease=lease)
    except OSError as e:
        raise storage_error(e, f"listing the temp files of {core.url}") from e
    rep.seconds = time.time() - t0
    return rep


def _block_bytes(core: Core, roots: list) -> int:
    """The bar's total: the bytes of the distinct blocks the check reads, each once however
    many snapshots share it (what _check re-hashes, so the bar ends at 100%). One walk of
    the distinct nodes, unverified (the check verifies them); only when a bar is shown.
    What cannot be walked here is left out: the check reports it."""
    sizes: dict[bytes, int] = {}
    seen: set = set()
    parts = core.refs.tier_rows.parts()
    for root in roots:
        try:
            for obj in walk_commit(core.assets, root, verify=False, skip_nodes=seen, part=parts.get(root)):
                if obj.kind == "block":
                    sizes[obj.digest] = obj.nbytes or 0
        except TsckError:
            continue
    return sum(sizes.values())


def _check(core: Core, rep: FsckReport, progress: bool) -> None:
    full = rep.full
    epoch0 = core.refs.gc_state()["epoch"]
    names = _names(core)
    bad_rows: list = []
    for _ in core.refs.catalog_iter(bad=bad_rows):  # (read for its malformed rows)
        pass
    for root, err in bad_rows:  # the snapshot is still checked below, from its commit
        rep.findings.append(Finding("malformed_row", root.hex(), names.get(root, []), None, None, str(err)))
    evicted = core.refs.tier_rows.evicted()  # a local tier's budget dropped them on purpose: the remote has them
    parts = core.refs.tier_rows.parts()  # a rank's tier: its part of a collective snapshot (walk_commit(part=))
    rep.evicted = len(evicted)
    roots = sorted((core.refs.catalog_roots() | set(names)) - evicted)
    block_status: dict[bytes, IntegrityError | None] = {}
    part_status: dict[tuple, bool] = {}  # (pack, (offset, length, h)) -> its bytes hash to h
    node_status: dict[bytes, IntegrityError | None] = {}
    marked = Marked()
    pool = core.pool
    bar = progress_bar(progress, "fsck", total=_block_bytes(core, roots) or None, unit="B") if progress else None

    def check_block(d: bytes, n: int, parts=()):
        """-> (the block's problem or None, {(d, part): whether its bytes match its h})."""
        if full:
            buf = bytearray(n)
            try:
                core.assets.read_block_into(d, buf, verify=True)
            except (IntegrityError, UnreadableObject) as e:
                return e, {}
            return None, {(d, pt): part_matches(buf, *pt) for pt in parts}
        return core.assets.check_quick(frame.KIND_BLOCK, d, n), {}

    for root in roots:
        rep.snapshots_checked += 1
        snap, nm = root.hex(), names.get(root, [])
        pending: list = []  # (digest, nbytes, path, elsewhere, part) of blocks this snapshot references
        try:
            for obj in walk_commit(core.assets, root, verify=full, part=parts.get(root)):
                marked.add(obj.kind + "s", obj.digest)
                if obj.kind == "block":
                    pending.append((obj.digest, obj.nbytes, obj.path, obj.elsewhere, obj.part))
                elif obj.kind == "node" and obj.digest not in node_status:
                    node_status[obj.digest] = None
                    rep.objects_checked += 1
        except UnreadableObject as e:  # the objects below it are unknown; the other snapshots go on
            rep.findings.append(_unreadable(e, snap, nm, e.path))
        except (IntegrityError, FormatError) as e:
            problem = getattr(e, "reason", "undecodable") if isinstance(e, IntegrityError) else "undecodable"
            if isinstance(e, IntegrityError) and core.assets.kind_of_key(e.key) == "commits" and problem == "missing":
                problem = "dangling_ref" if nm else "missing"
            rep.findings.append(Finding(problem, snap, nm, getattr(e, "path", None) or None,
                                        getattr(e, "key", None), str(e.args[0]) if e.args else str(e)))
        todo, sizes, unhashed = {}, {}, {}  # unhashed: pack -> the parts (with h) not hashed yet
        for d, n, _p, _e, pt in pending:
            sizes[d] = n
            if full and pt is not None and (d, pt) not in part_status:
                unhashed.setdefault(d, set()).add(pt)
        for d, n, _p, _e, _pt in pending:
            if d not in block_status and d not in todo:
                todo[d] = pool.submit(check_block, d, n, unhashed.pop(d, ()))
                rep.bytes_checked += n
        # Packs read for an earlier snapshot that this one names other parts of: read again.
        again = [pool.submit(check_block, d, sizes[d], pts) for d, pts in unhashed.items() if block_status[d] is None]
        for d, f in todo.items():
            block_status[d], got = f.result()
            part_status.update(got)
            rep.objects_checked += 1
            if bar is not None:
                bar.update(sizes[d])
        for f in again:
            part_status.update(f.result()[1])
        if bar is not None:
            bar.set_postfix_str(f"{rep.snapshots_checked}/{len(roots)} snapshots, {rep.objects_checked} objects",
                                refresh=False)
        reported = set()
        for d, n, p, elsewhere, pt in pending:
            err = block_status[d]
            if err is None and pt is not None and part_status.get((d, pt)) is False and (d, p) not in reported:
                reported.add((d, p))
                rep.findings.append(Finding("bad_part", snap, nm, p, core.assets.object_key("blocks", d),
                                            "a packed tensor's bytes do not match its content hash (LEAF h)"))
                continue
            if elsewhere and isinstance(err, IntegrityError) and err.reason == "missing":
                continue  # another rank's block: in its own tier, not this one's to hold
            if err is not None and (d, p) not in reported:
                reported.add((d, p))
                if isinstance(err, UnreadableObject):
                    rep.findings.append(_unreadable(err, snap, nm, p))
                    continue
                rep.findings.append(Finding(err.reason, snap, nm, p, err.key,
                                            str(err.args[0]).split(" (")[0] if err.args else "bad block"))
    if bar is not None:
        bar.close()
    # Orphans: stored objects no kept snapshot reaches. Counted, not errors (gc removes them).
    marked.freeze()
    strays: list = []
    for kind in KINDS:
        for o in iter_unreachable(core, marked, kind, strays=strays):
            rep.orphans += 1
            rep.orphan_bytes += o.size
    for key in strays:  # never parsed, never deleted: an operator looks at them
        rep.findings.append(Finding("stray", None, [], None, key, "a stored name that is no object key"))
    # A gc running beside fsck expires snapshots and then deletes their objects: what fsck
    # saw missing of those is not damage. Report only snapshots still kept now (expiry
    # always precedes deletion, so a snapshot whose objects went is no longer kept).
    epoch1 = core.refs.gc_state()["epoch"]
    rep.gc_ran = epoch1 != epoch0 or bool(epoch1 % 2)
    still = kept_roots(core)
    keep = [f for f in rep.findings if f.snapshot is None or bytes.fromhex(f.snapshot) in still]
    rep.dropped_after_gc = len(rep.findings) - len(keep)
    rep.findings = keep


# What a damaged object's finding is called; "missing" has nothing to move aside.
_DAMAGE = ("corrupt", "truncated", "undecodable")


def _repair(core: Core, rep: FsckReport, hold: Lease) -> None:
    """Move aside every object the check found damaged, inside a deletion phase."""
    assets = core.assets
    problem = {f.key: f.problem for f in rep.findings if f.problem in _DAMAGE and assets.kind_of_key(f.key)}
    todo = []
    for key in sorted(problem):  # again, one by one: only an object that fails verification moves
        try:
            err, _data = assets.verify_stored(key)
        except OSError as e:
            rep.left.append({"key": key, "why": f"unreadable ({e}); left in place"})
            continue
        if err is None:
            # Its bytes match its address: nothing a re-put could change (a node that
            # does not decode was written so; a writer healed it since the check).
            rep.left.append({"key": key, "why": "its bytes match its address; left in place"})
        elif err.reason != "missing":
            todo.append(key)
    if not todo:
        return
    hold.freeze()  # epoch odd: a writer that reused one of these re-validates before its ref moves
    for key in todo:
        hold.check()
        try:  # each removal within the lease, as gc's deletes
            aside = hold.run(assets.move_aside, key)
        except OSError as e:
            rep.left.append({"key": key, "why": f"could not be moved aside ({e}); left in place"})
            continue
        if aside is None:
            continue  # gone meanwhile: nothing to keep
        # Check what was moved, not what was checked: a writer may have replaced a
        # truncated local copy in between. Healthy bytes go back where they were.
        try:
            err2, data = assets.verify_stored(key, at=aside)
        except OSError:  # unreadable where it now is: keep it there
            err2, data = OSError, None
        if err2 is None:
            assets.restore(key, data, aside)
            rep.left.append({"key": key, "why": "healthy again (written anew meanwhile); left in place"})
            continue
        rep.moved.append({"key": key, "aside": aside, "problem": problem[key]})
    core.storage.sync()

