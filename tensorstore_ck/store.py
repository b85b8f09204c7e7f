"""The Store facade and open_store().

    Store ──> Planner/Reader (state.py) ──> Assets (assets.py) ──> BlockStore (storage/)
      └────> RefTable (refs/)

Publication order, always: blocks -> manifest nodes -> commit object ->
storage sync -> compare-and-swap of the ref (with reflog and catalog row in
the same ref-table transaction). A crash anywhere before the CAS leaves only
unreferenced objects behind.
"""

from __future__ import annotations

import functools
import json
import numbers
import os
import random
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from . import chunker
from .assets import Assets
from .dist import AUTO as _AUTO_GROUP
from .dist import collective_checkout, collective_put, is_collective
from .errors import (AmbiguousTarget, FormatError, InvalidName, NotAStore, RefConflict, RefNotFound,
                     SnapshotAborted, StorageError, TsckError)
from .format.manifest import decode_commit, encode_commit
from .ids import is_hex_prefix, parse_hex
from .refs import LmdbRefTable, MemoryRefTable, RefTable
from .recover import decode_tag, encode_tag, tag_key
from .refs.base import Fenced
from .retention import Retention
from .refs.names import parse_target, validate_component, validate_name
from .staging import StagingPool
from .state import Planner, Reader, build_tree, run_block_jobs
from .storage import BlockStore, FsspecBlockStore, LocalBlockStore

__all__ = ["open_store", "Store", "SnapshotInfo"]

STORE_MARKER = "tsck.json"
MAX_TAG_BYTES = 120
STORE_VERSION = 1
MIN_STORE_VERSION = 1
MAX_STORE_VERSION = 1
_UNSET = object()
_MEMORY_REFS: dict[str, MemoryRefTable] = {}
_MEMORY_LOCK = threading.Lock()


@dataclass(frozen=True)
class SnapshotInfo:
    root: str
    ref: str
    job: str
    step: int | None
    time: float
    metrics: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    parent: str | None = None
    bytes_total: int = 0
    bytes_new: int = 0
    blocks_total: int = 0
    blocks_new: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def _row_to_info(root: bytes, row: dict) -> SnapshotInfo:
    parent = row.get("parent")
    return SnapshotInfo(
        root=root.hex(), ref=str(row.get("ref", "")), job=str(row.get("job", "")), step=row.get("step"),
        time=float(row.get("time", 0.0)), metrics=dict(row.get("metrics") or {}),
        meta=dict(row.get("meta") or {}), parent=parent.hex() if isinstance(parent, bytes) else None,
        bytes_total=int(row.get("bytes_total", 0)), bytes_new=int(row.get("bytes_new", 0)),
        blocks_total=int(row.get("blocks_total", 0)), blocks_new=int(row.get("blocks_new", 0)))


def _utf8(s: str, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidName(f"{what}: string {s!r} is not valid UTF-8") from None


def _check_plain(obj, what: str, depth: int = 0) -> None:
    """metrics/meta hold JSON-like values only: they are shown by the CLI and kept in the catalog."""
    if depth > 32:
        raise InvalidName(f"{what} nested too deeply")
    if obj is None or type(obj) in (bool, int, float, str):
        if type(obj) is int and not -(2**63) <= obj < 2**64:
            raise InvalidName(f"{what}: int {obj} is out of the 64-bit range")
        if type(obj) is str:
            _utf8(obj, what)
        return
    if type(obj) is list:
        for x in obj:
            _check_plain(x, what, depth + 1)
        return
    if type(obj) is dict:
        for k, v in obj.items():
            if type(k) is not str:
                raise InvalidName(f"{what}: keys must be str, got {type(k).__name__}")
            _utf8(k, what)
            _check_plain(v, what, depth + 1)
        return
    raise InvalidName(f"{what}: values must be None, bool, int, float, str, list or dict, "
                      f"got {type(obj).__name__}")


COMMIT_ATTEMPTS = 1000  # ref moves tried before a put gives up (each lost one is a real race)


def _storage_errors(fn):
    """A backend failure (full disk, network, permissions) reaches the caller as
    StorageError, one of our types, with the backend's error chained."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TsckError:
            raise
        except OSError as e:
            raise _storage_error(e, f"storage failed: {_describe(e)}") from e
    return wrapper


def _storage_error(e: OSError, msg: str) -> StorageError:
    # OSError(None, msg) would print "[Errno None] msg"
    return StorageError(e.errno, msg) if e.errno is not None else StorageError(msg)


def _describe(e: OSError) -> str:
    """'PermissionError: ...' even when the backend gave no message (s3fs's str() is 'None')."""
    msg = e.strerror or str(e)
    name = type(e).__name__
    return name if msg in ("", "None") else f"{name}: {msg}"


class Store:
    """A content-addressed snapshot store. Thread-safe; use one per process."""

    def __init__(self, storage: BlockStore, refs: RefTable, *, config: dict, workers: int | None = None,
                 verify: bool = True, compress: bool = True, shuffle: bool = False,
                 block_size: int | None = None, inline_threshold: int | None = None,
                 gc_stale_after: float | None = None, max_inflight: int = 2, when_busy: str = "wait"):
        from .gc import DEFAULT_STALE_AFTER
        self.gc_stale_after = float(gc_stale_after if gc_stale_after is not None else DEFAULT_STALE_AFTER)
        self.storage = storage
        self.reftable = refs
        self.config = config
        self.verify = verify
        self.block_size = int(block_size or config.get("block_size") or chunker.DEFAULT_BLOCK_SIZE)
        self.inline_threshold = int(inline_threshold if inline_threshold is not None
                                    else config.get("inline_threshold", chunker.DEFAULT_INLINE_THRESHOLD))
        if not chunker.MIN_BLOCK_SIZE <= self.block_size <= chunker.MAX_BLOCK_SIZE:
            raise InvalidName(f"block_size must be within {chunker.MIN_BLOCK_SIZE}..{chunker.MAX_BLOCK_SIZE}")
        if not 0 <= self.inline_threshold <= self.block_size:
            raise InvalidName("inline_threshold must be within 0..block_size")
        self.assets = Assets(storage, compress=compress, shuffle=shuffle)
        self.workers = workers or min(8, 2 * (os.cpu_count() or 2))
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="tsck-io")
        # One background publisher: asynchronous snapshots commit in the order they were taken.
        self._bg = ThreadPoolExecutor(1, thread_name_prefix="tsck-bg")
        if type(max_inflight) is not int or max_inflight < 1:
            raise InvalidName(f"max_inflight must be an int >= 1, got {max_inflight!r}")
        if when_busy not in ("wait", "skip"):
            raise InvalidName(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
        self.max_inflight = max_inflight
        self.when_busy = when_busy
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._staging = StagingPool(max_inflight)
        self._inflight: list[Future] = []
        self._bg_lock = threading.Lock()
        self._bg_error: BaseException | None = None
        self.skipped = 0  # asynchronous snapshots dropped by when_busy="skip"
        self._dist_seq: dict = {}  # per (group, op) call counter: the collective's key prefix
        self._closed = False

    # -- lifecycle -------------------------------------------------------------
    def close(self) -> None:
        """Finish every asynchronous snapshot in flight, then release everything."""
        if self._closed:
            return
        self._closed = True
        self._bg.shutdown(wait=True)
        self._staging.clear()
        self._pool.shutdown(wait=True)
        self.reftable.close()
        self.storage.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def url(self) -> str:
        return self.storage.url

    # -- writing ---------------------------------------------------------------
    @_storage_errors
    def put_snapshot(self, state, ref: str, *, step: int | None = None, metrics: dict | None = None,
                     meta: dict | None = None, job: str | None = None, expected=_UNSET,
                     blocking: bool = True, allow_pickle: bool = False, when_busy: str | None = None,
                     group=_AUTO_GROUP, timeout: float = 300.0):
        """Snapshot `state` and move `ref` to it.

        expected: unset moves the ref whatever it points at (retrying if another
        writer moves it meanwhile, so both snapshots stay in its history);
        a root hex makes the move conditional on the ref pointing there; None
        requires the ref not to exist. RefConflict otherwise.

        blocking=False returns a Future once the state is staged (copied into a
        reused host buffer), so the caller may mutate it at once; hashing,
        compression and IO run in the background, and snapshots commit in the
        order they were taken. At most `max_inflight` are staged or running:
        when_busy="wait" (default) blocks for a free slot, "skip" returns None
        and counts it in `store.skipped`. A background failure is raised by its
        future and again by the next put_snapshot call.

        A blocking put first waits for the asynchronous ones in flight, so the
        ref never moves back to an older snapshot."""
        def prepare():
            self.raise_pending_error()
            validate_name(ref)
            j = validate_component(job if job is not None else ref.split("/", 1)[0], "job name")
            if step is not None and (type(step) is not int or not -(2**63) <= step < 2**63):
                raise InvalidName(f"step must be an int, got {step!r}")
            m = {}
            for k, v in dict(metrics or {}).items():
                if type(k) is not str or isinstance(v, bool) or not isinstance(v, numbers.Real):
                    raise InvalidName(f"metrics must map str to numbers, got {k!r}: {v!r}")
                _utf8(k, "metrics")
                # numpy scalars and other numbers are stored as plain int/float
                m[k] = int(v) if isinstance(v, numbers.Integral) else float(v)
            _check_plain(m, "metrics")
            mt = dict(meta or {})
            _check_plain(mt, "meta")
            e: bytes | None | object = _UNSET
            if expected is not _UNSET:
                e = None if expected is None else parse_hex(expected)
            if when_busy is not None and when_busy not in ("wait", "skip"):
                raise InvalidName(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
            return j, m, mt, e

        if is_collective(group):
            def prepare_collective():
                if not blocking:
                    raise InvalidName("collective snapshots are blocking (use dcp.async_save with TsckWriter "
                                      "for an asynchronous distributed save)")
                out = prepare()
                self.wait()
                return out
            # Every rank enters the collective before checking its arguments, so a bad
            # argument on one rank aborts this snapshot everywhere instead of leaving
            # that rank one collective behind the others.
            return collective_put(self, state, ref=ref, step=step, prepare=prepare_collective, group=group,
                                  timeout=timeout, allow_pickle=allow_pickle)
        job, metrics, meta, exp = prepare()
        planner = Planner(block_size=self.block_size, inline_threshold=self.inline_threshold,
                          allow_pickle=allow_pickle, defer_device=not blocking)
        plan = planner.plan(state)  # validates the whole tree before anything is written
        args = (plan, ref, job, step, metrics, meta, exp)
        if blocking:
            self.wait()
            return self._publish(*args)
        if not self._slots.acquire(blocking=(when_busy or self.when_busy) == "wait"):
            self.skipped += 1
            return None
        try:
            buf = self._staging.take(plan.staged_bytes)
            plan.stage(buf)
        except BaseException:
            self._slots.release()
            raise
        with self._bg_lock:
            fut = self._bg.submit(self._publish_staged, buf, *args)
            self._inflight.append(fut)
        return fut

    def _publish_staged(self, buf, *args) -> SnapshotInfo:
        try:
            return self._publish(*args)
        except BaseException as e:
            self._bg_error = e
            raise
        finally:
            self._staging.give(buf)
            self._slots.release()

    def raise_pending_error(self) -> None:
        """Raise (once) the failure of an asynchronous snapshot, if one failed."""
        err, self._bg_error = self._bg_error, None
        if err is not None:
            raise err

    def wait(self) -> None:
        """Block until every asynchronous snapshot in flight has committed or failed.
        Failures are not raised here (they are on their futures and the next put)."""
        with self._bg_lock:
            futs, self._inflight = self._inflight, []
        for f in futs:
            try:
                f.result()
            except BaseException:
                pass

    @_storage_errors
    def _publish(self, plan, ref, job, step, metrics, meta, exp) -> SnapshotInfo:
        # The gc deletion epoch is read before any object is found present: if a
        # deletion phase starts or runs before the ref moves, the move is refused
        # (Fenced) and everything this snapshot references is re-validated.
        fence = self.gc_fence()
        run_block_jobs(plan, self.assets, self._pool)
        tree, stats, nodes = build_tree(plan, self.assets)
        st = {"bytes_total": stats.bytes_total, "bytes_new": stats.bytes_new,
              "blocks_total": stats.blocks_total, "blocks_new": stats.blocks_new}
        return self.commit_tree(tree, ref=ref, job=job, step=step, metrics=metrics, meta=meta, stats=st,
                                expected=exp, fence=fence,
                                revalidate=lambda body: self._revalidate(plan, nodes, body))

    def gc_fence(self) -> int:
        """The gc deletion epoch; read it before looking at storage, pass it to commit_tree."""
        return self.reftable.gc_state()["epoch"]

    def commit_tree(self, tree: bytes, *, ref: str, job: str, step, metrics: dict, meta: dict, stats: dict,
                    expected=_UNSET, fence: int | None = None, revalidate=None) -> SnapshotInfo:
        """Publish a manifest tree whose objects are all written: commit object,
        storage sync, then the fenced compare-and-swap of the ref. `revalidate(body)`
        must make every object the snapshot references exist again and return a
        new fence; without it a fenced move raises SnapshotAborted."""
        exp = expected
        races = fenced = 0
        for _attempt in range(COMMIT_ATTEMPTS):
            parent = self.reftable.get_or_none(ref) if exp is _UNSET else exp
            now = time.time()
            body = encode_commit(job=job, ref=ref, step=step, time=now, metrics=metrics, meta=meta,
                                 parent=parent, tree=tree, stats=stats)
            root = self.assets.put_commit(body).digest
            self.assets.sync()  # everything the commit references is durable before the ref moves
            row = {"job": job, "ref": ref, "step": step, "time": now, "metrics": metrics, "meta": meta,
                   "parent": parent, "tree": tree, **stats}
            try:
                self.reftable.compare_and_swap(ref, parent, root, message=f"snapshot step {step}",
                                               catalog_row=row, fence=fence)
            except Fenced:
                if revalidate is None:
                    raise SnapshotAborted("a gc deletion phase overlapped this snapshot; nothing was "
                                          "published, take it again") from None
                fenced += 1
                fence = revalidate(body)
                continue
            except RefConflict as e:
                if exp is not _UNSET or e.what != "ref":  # conditional, or the name is a tag's
                    raise
                # Another writer moved the ref: chain onto its snapshot and retry, after a
                # short jittered pause so that writers hammering one ref do not livelock.
                races += 1
                time.sleep(random.uniform(0, min(0.05, 0.0005 * 2 ** min(races, 10))))
                continue
            return _row_to_info(root, row)
        raise SnapshotAborted(f"gave up publishing to {ref!r} after {COMMIT_ATTEMPTS} attempts: {races} lost "
                              f"races with other writers moving it, {fenced} overlapping gc deletion phases; "
                              "nothing was published, take the snapshot again")

    def wait_gc_idle(self) -> int:
        """Wait until no gc deletion phase is running (closing a dead gc's phase once
        its heartbeat is older than gc_stale_after); the even epoch, as a new fence."""
        while True:
            st = self.reftable.gc_state()
            if st["epoch"] % 2 == 0:
                return st["epoch"]
            now = time.time()
            if now - float(st.get("heartbeat", 0.0)) >= self.gc_stale_after:
                self.reftable.gc_abort_stale(now=now, stale_after=self.gc_stale_after)
            else:
                time.sleep(0.05)

    def _revalidate(self, plan, nodes: list, commit_body: bytes) -> int:
        """Wait out a gc deletion phase, then make sure every object this snapshot
        references exists (writing again what gc removed). Returns the new fence."""
        fence = self.wait_gc_idle()
        futs = [self._pool.submit(self.assets.put_block, leaf.raw[a:b], leaf.itemsize, r.digest)
                for leaf in plan.leaves for (a, b), r in zip(leaf.ranges, leaf.results)]
        for f in futs:
            f.result()
        for payload in nodes:
            self.assets.put_node(payload)
        self.assets.put_commit(commit_body)
        self.assets.sync()
        return fence

    # -- lifecycle: retention, gc, fsck ----------------------------------------
    def set_retention(self, job: str, retention: "Retention | None") -> None:
        """Set (or with None, clear) the retention rules of `job`; kept in the ref
        table so an offline `tsck gc` applies each job's own rules."""
        validate_component(job, "job name")
        if retention is not None and not isinstance(retention, Retention):
            raise InvalidName(f"retention must be a tsck.Retention, got {type(retention).__name__}")
        self.reftable.retention_set(job, None if retention is None else retention.to_dict())

    def retention(self) -> dict[str, Retention]:
        return {job: Retention.from_dict(r) for job, r in self.reftable.retention_all().items()}

    @_storage_errors
    def gc(self, *, dry_run: bool = False, progress: bool = False):
        """Apply retention, then mark and sweep. Safe while other processes write."""
        from .gc import run_gc
        return run_gc(self, dry_run=dry_run, progress=progress, stale_after=self.gc_stale_after)

    @_storage_errors
    def fsck(self, *, full: bool = True, progress: bool = False):
        """Check every kept snapshot and every ref/tag/pin; full=True re-hashes every byte."""
        from .fsck import run_fsck
        return run_fsck(self, full=full, progress=progress)

    # -- reading ---------------------------------------------------------------
    @_storage_errors
    def resolve(self, target: str) -> str:
        """A target (ref, tag, REF@STEP, root hex or unique prefix >= 8) -> root hex."""
        kind, text, step = parse_target(target)
        if kind == "step":
            for info in self.log(text):
                if info.step == step:
                    return info.root
            raise RefNotFound(f"ref {text!r} has no kept snapshot at step {step}")
        r = self.reftable.get_or_none(text)
        if r is not None:
            return r.hex()
        r = self.reftable.tag_get(text)
        if r is not None:
            return r.hex()
        if is_hex_prefix(text):
            even = text[: len(text) // 2 * 2]
            found = [x for x in self.reftable.catalog_prefix(bytes.fromhex(even)) if x.hex().startswith(text)]
            if len(found) == 1:
                return found[0].hex()
            if len(found) > 1:
                raise AmbiguousTarget(f"root prefix {text!r} matches {len(found)} snapshots; give more digits")
        raise RefNotFound(f"no ref, tag or snapshot named {target!r}")

    def _info(self, root: bytes) -> SnapshotInfo:
        row = self.reftable.catalog_get(root)
        if row is None:
            c = decode_commit(self.assets.get_commit(root, verify=self.verify))
            row = {**c, **c["stats"]}
        return _row_to_info(root, row)

    @_storage_errors
    def show(self, target: str) -> SnapshotInfo:
        return self._info(bytes.fromhex(self.resolve(target)))

    @_storage_errors
    def checkout(self, target: str, *, into=None, verify: bool | None = None, allow_pickle: bool = False,
                 group=_AUTO_GROUP, timeout: float = 300.0, max_bytes: int | None = None):
        """The state of a snapshot, verified against its root hash (unless verify=False).

        into=: an existing tree whose tensors/arrays/lists/dicts are updated in
        place (dtype and shape must match: CheckoutMismatch); it is returned.
        max_bytes: the most fresh memory the snapshot's manifest may make this call
        allocate (default: the host's RAM + swap); beyond it, FormatError."""
        verify = self.verify if verify is None else verify
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool)
                                      or max_bytes < 0):
            raise InvalidName(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        if is_collective(group):
            return collective_checkout(self, target, into=into, verify=verify, allow_pickle=allow_pickle,
                                       group=group, timeout=timeout)
        root_hex = self.resolve(target)
        root = bytes.fromhex(root_hex)
        c = decode_commit(self.assets.get_commit(root, verify=verify))
        reader = Reader(self.assets, self._pool, snapshot=root_hex, verify=verify, allow_pickle=allow_pickle,
                        max_bytes=max_bytes)
        if into is None:
            return reader.read(c["tree"])
        return reader.read(c["tree"], into)

    @_storage_errors
    def log(self, ref: str) -> list[SnapshotInfo]:
        """Snapshots `ref` has pointed at that still exist, newest first."""
        validate_name(ref)
        entries = self.reftable.reflog(ref)
        if not entries and self.reftable.get_or_none(ref) is None:
            raise RefNotFound(f"no ref named {ref!r}")
        seen, out = set(), []
        for e in reversed(entries):
            if e.new in seen:
                continue
            seen.add(e.new)
            row = self.reftable.catalog_get(e.new)
            if row is not None:
                out.append(_row_to_info(e.new, row))
        return out

    @_storage_errors
    def refs(self, prefix: str = "") -> dict[str, SnapshotInfo]:
        if not isinstance(prefix, str):
            raise InvalidName(f"prefix must be a str, got {type(prefix).__name__}")
        _utf8(prefix, "ref prefix")
        return {name: self._info(root) for name, root in self.reftable.list(prefix)}

    @_storage_errors
    def tags(self) -> dict[str, SnapshotInfo]:
        return {name: self._info(root) for name, root in self.reftable.tags()}

    @_storage_errors
    def tag(self, name: str, target: str) -> SnapshotInfo:
        """Create an immutable tag; RefConflict if the name is taken.

        The tag is also written to storage (``tags/<hex>``), so `recover` can
        rebuild it; that object is created exclusively, so it is the tag's
        single source of truth across hosts."""
        validate_name(name, "tag name")
        if len(name.encode()) > MAX_TAG_BYTES:  # stored as tags/<hex>: one file name of 2x the bytes
            raise InvalidName(f"tag name is longer than {MAX_TAG_BYTES} bytes")
        root = bytes.fromhex(self.resolve(target))
        if self.reftable.get_or_none(name) is not None:
            raise RefConflict(name, None, self.reftable.get_or_none(name).hex(), what="tag (a ref has this name)")
        cur = self.reftable.tag_get(name)
        if cur is not None:
            raise RefConflict(name, None, cur.hex(), what="tag")
        key = tag_key(name)
        if not self.storage.put_if_absent(key, [encode_tag(name, root, time.time())]):
            try:
                _n, stored, _t = decode_tag(self.storage.get(key))
            except (FormatError, FileNotFoundError):
                stored = None
            if stored != root:  # another tag by this name exists in storage
                raise RefConflict(name, None, stored.hex() if stored else None, what="tag")
        self.storage.sync()
        self.reftable.tag_create(name, root)
        return self._info(root)

    @_storage_errors
    def recover(self):
        """Rebuild catalog, refs (at their newest commits), reflog and tags from storage."""
        from .recover import run_recover
        return run_recover(self)

    @_storage_errors
    def diff(self, a: str, b: str) -> dict:
        """Which tensors differ between two targets, and in how many blocks."""
        from .walk import iter_leaves
        ra, rb = self.resolve(a), self.resolve(b)
        la = iter_leaves(self.assets, bytes.fromhex(ra), verify=self.verify)
        lb = iter_leaves(self.assets, bytes.fromhex(rb), verify=self.verify)
        out = {"a": ra, "b": rb, "added": [], "removed": [], "changed": [], "unchanged": 0}
        for p in la.keys() - lb.keys():
            out["removed"].append(p)
        for p in lb.keys() - la.keys():
            out["added"].append(p)
        for p in la.keys() & lb.keys():
            (da, ba), (db, bb) = la[p], lb[p]
            if da == db and ba == bb:
                out["unchanged"] += 1
                continue
            differ = sum(1 for x, y in zip(ba, bb) if x != y) + abs(len(ba) - len(bb))
            out["changed"].append({"path": p, "a": da, "b": db, "blocks_differ": differ,
                                   "blocks": max(len(ba), len(bb))})
        for k in ("added", "removed"):
            out[k].sort()
        out["changed"].sort(key=lambda x: x["path"])
        return out

    @_storage_errors
    def pin(self, target: str) -> str:
        root = self.resolve(target)
        self.reftable.pin(bytes.fromhex(root))
        return root

    @_storage_errors
    def unpin(self, target: str) -> str:
        root = self.resolve(target)
        self.reftable.unpin(bytes.fromhex(root))
        return root

    @_storage_errors
    def du(self) -> dict:
        """Logical bytes (what the kept snapshots hold) vs physical (what storage holds)."""
        jobs: dict[str, dict] = {}
        logical = 0
        for root, row in self.reftable.catalog_iter():
            info = _row_to_info(root, row)
            j = jobs.setdefault(info.job, {"snapshots": 0, "logical_bytes": 0, "new_bytes": 0,
                                           "latest_step": None, "latest_time": 0.0})
            j["snapshots"] += 1
            j["logical_bytes"] += info.bytes_total
            j["new_bytes"] += info.bytes_new
            if info.time >= j["latest_time"]:
                j["latest_time"], j["latest_step"] = info.time, info.step
            logical += info.bytes_total
        phys = {"blocks": [0, 0], "nodes": [0, 0], "commits": [0, 0]}
        for kind in phys:
            for o in self.storage.list(kind + "/"):
                phys[kind][0] += 1
                phys[kind][1] += o.size
        physical = sum(v[1] for v in phys.values())
        return {
            "store": self.url, "snapshots": sum(j["snapshots"] for j in jobs.values()),
            "logical_bytes": logical, "physical_bytes": physical,
            "block_bytes": phys["blocks"][1], "blocks": phys["blocks"][0],
            "nodes": phys["nodes"][0], "commits": phys["commits"][0],
            "dedup_ratio": (logical / phys["blocks"][1]) if phys["blocks"][1] else None,
            "jobs": jobs,
        }


# -- opening ---------------------------------------------------------------------------

def _split_url(url: str) -> tuple[str, str]:
    if not isinstance(url, (str, os.PathLike)):
        raise InvalidName(f"store location must be a str or path, got {type(url).__name__}")
    url = os.fspath(url)
    if "://" in url:
        proto, rest = url.split("://", 1)
        return proto, rest
    return "file", url


def _open_refs(refs, proto: str, root: str, create: bool, store_id: str = "default") -> RefTable:
    if isinstance(refs, RefTable):
        return refs
    if refs is None:
        if proto == "file":
            return LmdbRefTable(os.path.join(root, "refs.lmdb"), create=create)
        if proto == "memory":
            refs = f"memory://{root}"
        else:
            raise InvalidName(f"a {proto}:// store needs a shared ref table: pass refs='postgresql://...' "
                              "or refs='/local/path/refs.lmdb' for a single host")
    if not isinstance(refs, str):
        raise InvalidName(f"refs must be a str or RefTable, got {type(refs).__name__}")
    if refs.startswith("memory://"):
        with _MEMORY_LOCK:
            return _MEMORY_REFS.setdefault(refs, MemoryRefTable())
    if refs.startswith(("postgresql://", "postgres://")) or refs.startswith("host=") or " dbname=" in refs:
        from .refs.postgres import PostgresRefTable
        return PostgresRefTable(refs, namespace=store_id)
    path = refs[len("lmdb://"):] if refs.startswith("lmdb://") else refs
    return LmdbRefTable(path, create=create)


def _read_config(storage: BlockStore) -> dict | None:
    try:
        data = storage.get(STORE_MARKER)
    except FileNotFoundError:
        return None
    try:
        if len(data) > 65536:
            raise ValueError("too large")
        cfg = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise NotAStore(f"{storage.url}/{STORE_MARKER} is not a tensorstore_ck store marker") from None
    if not isinstance(cfg, dict) or cfg.get("format") != "tensorstore_ck":
        raise NotAStore(f"{storage.url} is not a tensorstore_ck store")
    for k in ("block_size", "inline_threshold"):
        if k in cfg and (not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or not 0 <= cfg[k] < 2**40):
            raise FormatError(f"{storage.url}/{STORE_MARKER}: {k} is not a valid size")
    v = cfg.get("version")
    if not isinstance(v, int) or not MIN_STORE_VERSION <= v <= MAX_STORE_VERSION:
        raise FormatError(f"store format version {v!r} is not readable by this build "
                          f"(reads {MIN_STORE_VERSION}..{MAX_STORE_VERSION})")
    return cfg


def _open_errors(fn):
    """open_store's backend failures (unreachable server, refused credentials, full
    disk) reach the caller as StorageError naming the store."""
    @functools.wraps(fn)
    def wrapper(url, *args, **kwargs):
        try:
            return fn(url, *args, **kwargs)
        except TsckError:
            raise
        except OSError as e:
            raise _storage_error(e, f"cannot open the store at {url}: {_describe(e)}") from e
    return wrapper


@_open_errors
def open_store(url, *, refs=None, storage_options: dict | None = None, create: bool = True,
               block_size: int | None = None, inline_threshold: int | None = None,
               workers: int | None = None, verify: bool = True, compress: bool = True,
               shuffle: bool = False, gc_stale_after: float | None = None, max_inflight: int = 2,
               when_busy: str = "wait", wrap_storage=None, write_bandwidth: float | None = None,
               write_concurrency: int | None = None) -> Store:
    """Open (or create, if `create` and the location is empty) a store.

    url: a local path, file://, memory:// or any fsspec URL (s3://bucket/prefix).
    refs: None (LMDB beside local data; in-process table for memory://), a path
    or lmdb:// URL, postgresql://..., memory://name, or a RefTable.
    storage_options: passed to fsspec (s3fs: endpoint_url, key, secret, ...)."""
    proto, rest = _split_url(url)
    if refs is None and proto not in ("file", "memory"):  # say so before writing anything there
        _open_refs(refs, proto, rest, create=False)
    if proto == "file":
        root = os.path.abspath(rest)
        if os.path.exists(root) and not os.path.isdir(root):
            raise NotAStore(f"{root} is a file, not a store")
        if not os.path.isdir(root):
            if not create:
                raise NotAStore(f"no store at {root}")
            try:
                os.makedirs(root, exist_ok=True)  # several processes may create one store at once
            except OSError as e:
                raise NotAStore(f"cannot create a store at {root}: {e.strerror}") from None
        storage: BlockStore = LocalBlockStore(root)
        rest = root
    else:
        try:
            storage = FsspecBlockStore(f"{proto}://{rest}", storage_options)
        except (ImportError, ValueError, TypeError) as e:
            raise NotAStore(f"cannot open {proto}:// storage: {type(e).__name__}: {e}") from None
        if proto != "memory":
            from .storage.wrappers import RetryingStore
            storage = RetryingStore(storage)  # transient network errors are retried, not surfaced
    cfg = _read_config(storage)
    if cfg is None:
        # tmp/ holds only in-flight writes (a creator killed while writing the marker
        # leaves one there); it does not make a folder "not empty".
        existing = next((o for o in storage.list("") if not o.key.startswith("tmp/")), None)
        if existing is not None:
            cfg = _read_config(storage)  # another process may have just created the store
            if cfg is None:
                raise NotAStore(f"{storage.url} is not empty and holds no {STORE_MARKER}: not a store")
    if cfg is None:
        if not create:
            raise NotAStore(f"no store at {storage.url}")
        cfg = {"format": "tensorstore_ck", "version": STORE_VERSION, "created": time.time(),
               "id": uuid.uuid4().hex,  # names this store in a shared ref table (PostgreSQL)
               "block_size": int(block_size or chunker.DEFAULT_BLOCK_SIZE),
               "inline_threshold": int(inline_threshold if inline_threshold is not None
                                       else chunker.DEFAULT_INLINE_THRESHOLD)}
        # Exclusive create: if another process won the race, its marker is the one we read.
        storage.put_if_absent(STORE_MARKER, [json.dumps(cfg, indent=1).encode() + b"\n"])
        storage.sync()
        cfg = _read_config(storage) or cfg
    reftable = _open_refs(refs, proto, rest, create=True, store_id=str(cfg.get("id") or storage.url))
    if write_bandwidth is not None or write_concurrency is not None:
        from .storage.wrappers import ThrottledStore
        try:
            storage = ThrottledStore(storage, bytes_per_second=write_bandwidth, max_concurrent=write_concurrency)
        except ValueError as e:
            raise InvalidName(str(e)) from None
    if wrap_storage is not None:  # cross-cutting behaviour (fault injection, limits) as a wrapper
        storage = wrap_storage(storage)
    return Store(storage, reftable, config=cfg, workers=workers, verify=verify, compress=compress,
                 shuffle=shuffle, block_size=block_size, inline_threshold=inline_threshold,
                 gc_stale_after=gc_stale_after, max_inflight=max_inflight, when_busy=when_busy)
