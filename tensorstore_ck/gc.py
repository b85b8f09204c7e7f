"""Garbage collection: expire what retention drops, mark, sweep. Safe while writers write.

The protocol (docs/ARCHITECTURE.md, "GC and concurrent writers", has the argument):

1. begin    take the store's gc lock in the ref table (phase "marking", heartbeat).
2. expire   drop the catalog rows retention no longer keeps (never a ref tip, tag or pin;
            re-checked inside the ref-table transaction).
3. mark     walk every kept commit's Merkle DAG; remember every reachable object.
4. list     list storage; anything unreachable (and written before gc began) is a candidate.
5. freeze   bump the deletion epoch to odd (phase "deleting"): from here on a writer's
            ref move fenced on an older epoch is refused; it re-validates the objects
            it references (re-uploading any that are gone) and retries.
6. re-mark  walk the commits published since step 3: they may reuse candidates.
7. sweep    delete candidates not re-marked: commits, then nodes, then blocks.
8. finish   bump the epoch to even (phase "idle").

Memory stays bounded: reachable objects are kept as the first 8 bytes of their
address in a compact array (8 bytes each, sorted once; a prefix collision can
only keep an unreachable object, never delete a reachable one), and candidates
are spooled to a temporary file, not held in memory.
"""

from __future__ import annotations

import array
import os
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

import numpy as np

from .errors import FormatError, IntegrityError, TsckError
from .retention import Retention, SnapRow, select_kept
from .walk import walk_commit, walk_tree

__all__ = ["GCReport", "run_gc", "DEFAULT_STALE_AFTER"]

DEFAULT_STALE_AFTER = 120.0  # seconds without a heartbeat before a gc counts as dead
KINDS = ("commits", "nodes", "blocks")  # deletion order: a kill leaves no commit without its tree


@dataclass
class GCReport:
    dry_run: bool
    expired: list = field(default_factory=list)      # root hex of snapshots retention dropped
    kept_snapshots: int = 0
    reachable_objects: int = 0
    candidates: int = 0
    rescued: int = 0                                  # candidates re-marked (reused meanwhile)
    deleted_objects: int = 0
    deleted_bytes: int = 0
    deleted_by_kind: dict = field(default_factory=dict)
    temp_files_removed: int = 0
    would_delete: list = field(default_factory=list)  # dry run: keys (capped at 10000)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def _key8(hexname: str) -> int:
    return int(hexname[:16], 16)


class _Marked:
    """Reachable objects as sorted 8-byte prefixes of their addresses."""

    def __init__(self):
        self._buf = {k: array.array("Q") for k in KINDS}
        self._sorted: dict[str, np.ndarray] = {}

    def add(self, kind: str, d: bytes) -> None:
        self._buf[kind].append(int.from_bytes(d[:8], "big"))

    def freeze(self) -> None:
        for k, a in self._buf.items():
            self._sorted[k] = np.unique(np.frombuffer(a, dtype=np.uint64)) if len(a) else \
                np.empty(0, dtype=np.uint64)
        self._buf = {k: array.array("Q") for k in KINDS}

    def __len__(self):
        return sum(len(v) for v in self._sorted.values())

    def contains(self, kind: str, keys: np.ndarray) -> np.ndarray:
        s = self._sorted[kind]
        if not len(s):
            return np.zeros(len(keys), dtype=bool)
        i = np.searchsorted(s, keys).clip(0, len(s) - 1)
        return s[i] == keys


def iter_unreachable(store, marked: _Marked, kind: str, *, before: float | None = None, bar=None):
    """Stream the stored objects of `kind` that `marked` does not reach, checked in
    batches so memory stays bounded however many objects the store holds."""
    batch: list = []

    def flush():
        keys = np.array([_key8(o.key.rsplit("/", 1)[-1]) for o in batch], dtype=np.uint64)
        out = [o for o, live in zip(batch, marked.contains(kind, keys)) if not live]
        batch.clear()
        return out

    for o in store.storage.list(kind + "/"):
        if bar is not None:
            bar.update(1)
        if len(o.key.rsplit("/", 1)[-1]) != 64 or (before is not None and o.mtime > before):
            continue
        batch.append(o)
        if len(batch) >= 65536:
            yield from flush()
    if batch:
        yield from flush()


def _progress(enabled: bool, desc: str, total=None):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total, desc=desc, unit="obj", leave=False, dynamic_ncols=True)


def plan_expiry(store, now: float) -> list[bytes]:
    """Roots that retention no longer keeps (before protection by refs/tags/pins)."""
    rules = {job: Retention.from_dict(r) for job, r in store.reftable.retention_all().items()}
    by_job: dict[str, list[SnapRow]] = {}
    for root, row in store.reftable.catalog_iter():
        by_job.setdefault(str(row.get("job", "")), []).append(
            SnapRow(root, row.get("step"), float(row.get("time", 0.0)), dict(row.get("metrics") or {})))
    protected = {r for _, r in store.reftable.list()} | {r for _, r in store.reftable.tags()} \
        | store.reftable.pins()
    out = []
    for job, rows in by_job.items():
        rule = rules.get(job)
        if rule is None:
            continue
        kept = select_kept(rows, rule, now) | protected
        out.extend(r.root for r in rows if r.root not in kept)
    return out


def _kept_roots(store, exclude: set | None = None) -> set[bytes]:
    roots = {r for r, _ in store.reftable.catalog_iter()}
    if exclude:
        roots -= exclude
    roots |= {r for _, r in store.reftable.list()} | {r for _, r in store.reftable.tags()} | store.reftable.pins()
    return roots


def _mark(store, roots, marked: _Marked, visited: set, bar=None) -> int:
    """Mark everything reachable from `roots`. An unreadable node aborts gc (its
    children are unknown, so nothing could be deleted safely); a missing commit
    object is marked through its catalog row's tree instead."""
    n = 0
    for root in sorted(roots):
        if store.assets.has_commit(root):
            objs = walk_commit(store.assets, root, verify=True, skip_nodes=visited)
        else:
            row = store.reftable.catalog_get(root) or {}
            tree = row.get("tree")
            if not isinstance(tree, bytes) or len(tree) != 32:
                continue  # nothing known to keep for it; fsck reports the dangling name
            objs = walk_tree(store.assets, tree, snapshot=root.hex(), verify=True, skip_nodes=visited)
        try:
            for obj in objs:
                marked.add(obj.kind + "s", obj.digest)
                n += 1
                if bar is not None:
                    bar.update(1)
        except (IntegrityError, FormatError) as e:
            raise TsckError(f"gc stopped before deleting anything: kept snapshot {root.hex()[:16]} "
                            f"is damaged ({e}); run `tsck fsck`") from None
    return n


def run_gc(store, *, dry_run: bool = False, progress: bool = False,
           stale_after: float = DEFAULT_STALE_AFTER, heartbeat_every: float | None = None) -> GCReport:
    t_start = time.time()
    rep = GCReport(dry_run=dry_run)
    refs = store.reftable
    owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    beat = None
    if not dry_run:
        refs.gc_begin(owner, now=time.time(), stale_after=stale_after)
        # Beat from a thread of its own, several times per stale_after, so that a gc
        # busy in one long call is never taken for dead while it can still delete.
        beat = _Heartbeat(refs, owner, heartbeat_every or max(0.05, min(5.0, stale_after / 4)))
    try:
        t0 = time.time()
        # 2. expire
        doomed = plan_expiry(store, t0)
        if dry_run:
            expired = doomed
        else:
            expired = refs.catalog_expire(doomed)
        rep.expired = [r.hex() for r in expired]
        # 3. mark
        k0 = _kept_roots(store, exclude=set(expired) if dry_run else None)
        rep.kept_snapshots = len(k0)
        marked, visited = _Marked(), set()
        bar = _progress(progress, "gc: mark")
        rep.reachable_objects = _mark(store, k0, marked, visited, bar)
        if bar is not None:
            bar.close()
        marked.freeze()
        # 4. list -> spool of candidates
        spool = tempfile.TemporaryFile(mode="w+", prefix="tsck-gc-")
        bar = _progress(progress, "gc: list")
        for kind in KINDS:
            # Objects written after gc began are a writer's, in flight: never candidates.
            for o in iter_unreachable(store, marked, kind, before=t0, bar=bar):
                spool.write(f"{kind} {o.key} {o.size}\n")
                rep.candidates += 1
            if beat is not None:
                beat.check()
        if bar is not None:
            bar.close()
        spool.seek(0)
        if dry_run:
            for line in spool:
                kind, key, size = line.split()
                rep.deleted_objects += 1
                rep.deleted_bytes += int(size)
                rep.deleted_by_kind[kind] = rep.deleted_by_kind.get(kind, 0) + 1
                if len(rep.would_delete) < 10000:
                    rep.would_delete.append(key)
            rep.seconds = time.time() - t_start
            return rep
        # 5. freeze, 6. re-mark what was published meanwhile
        refs.gc_freeze(owner, now=time.time())
        k1 = _kept_roots(store)
        extra, extra_visited = _Marked(), set(visited)
        _mark(store, k1 - k0, extra, extra_visited)
        extra.freeze()
        # 7. sweep
        bar = _progress(progress, "gc: sweep", total=rep.candidates)
        rep.temp_files_removed = _sweep_temp(store, t0 - stale_after)
        def sweep(batch):
            keys8 = np.array([_key8(key.rsplit("/", 1)[-1]) for _k, key, _s in batch], dtype=np.uint64)
            live = {k: extra.contains(k, keys8) for k in KINDS}
            todo = []
            for j, (kind, key, size) in enumerate(batch):
                if live[kind][j]:
                    rep.rescued += 1
                else:
                    todo.append((kind, key, int(size)))
            # Deletes run in parallel slices (one batched request per slice on object
            # stores); the spool is in commits -> nodes -> blocks order and batches
            # never mix kinds, so a batch finishes before the next kind starts.
            keys = [key for _k, key, _s in todo]
            n = max(1, min(len(keys), store.workers))
            for f in [store._pool.submit(store.storage.delete_many, keys[i::n]) for i in range(n)]:
                f.result()
            for kind, _key, size in todo:
                rep.deleted_objects += 1
                rep.deleted_bytes += size
                rep.deleted_by_kind[kind] = rep.deleted_by_kind.get(kind, 0) + 1
            if bar is not None:
                bar.update(len(batch))

        batch: list = []
        for line in spool:
            item = line.split()
            if batch and (len(batch) >= 512 or batch[-1][0] != item[0]):
                sweep(batch)
                batch = []
                beat.check()  # raises if another gc took the lock over: stop deleting
            batch.append(item)
        if batch:
            sweep(batch)
        if bar is not None:
            bar.close()
        store.storage.sync()
        rep.seconds = time.time() - t_start
        beat.stop()
        refs.gc_finish(owner, now=time.time(), last_gc={"at": time.time(), "deleted": rep.deleted_objects})
        return rep
    except BaseException:
        if beat is not None:
            beat.stop()
            try:
                refs.gc_finish(owner, now=time.time())
            except TsckError:
                pass
        raise


class _Heartbeat:
    """Renews the gc lock every `every` seconds until stopped; check() raises in the
    gc's own thread once the lock was lost (another gc took a stale one over)."""

    def __init__(self, refs, owner: str, every: float):
        self.refs, self.owner, self.every = refs, owner, every
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tsck-gc-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.refs.gc_heartbeat(self.owner, now=time.time())
            except BaseException as e:  # noqa: BLE001 - handed to the gc thread by check()
                self.error = e
                return

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _sweep_temp(store, before: float) -> int:
    """Remove local temp files of writers that died (older than the stale limit)."""
    n = 0
    for o in store.storage.list("tmp/"):
        if o.key.endswith(".partial") and o.mtime < before:
            store.storage.delete(o.key)
            n += 1
    return n

