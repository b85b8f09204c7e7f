"""open_store(): a URL -> a Store, with its storage stack and ref table.

    path | file://   LocalBlockStore (fsync, atomic link), LMDB ref table beside the data
    memory://        FsspecBlockStore, an in-process ref table of the same name
    s3://            S3BlockStore under RetryingStore; a shared ref table is required
    other fsspec     FsspecBlockStore under RetryingStore; likewise
                     (refs="postgresql://..." or a local LMDB path for one host)

The store's marker, ``tsck.json``, holds its format version, id and block
layout; it is created exclusively, so concurrent creators agree on one.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import warnings
import threading
import time
import uuid

from . import chunker
from .assets import MAX_MARKER_BYTES, STORE_MARKER, create_marker, holds_snapshots, read_marker
from .core import DEFAULT_LEASE, DEFAULT_WORKERS, Core, Settings
from .errors import FormatError, InvalidArgument, NotAStore, StorageError, TsckError, storage_error
from .refs import LmdbRefTable, MemoryRefTable, RefTable
from .refs.postgres import LOCATIONS_NS
from .storage import BlockStore, FsspecBlockStore, LocalBlockStore, S3BlockStore
from .store import Store

__all__ = ["open_store", "STORE_MARKER"]

log = logging.getLogger(__name__)

STORE_VERSION = 1
MIN_STORE_VERSION = 1
MAX_STORE_VERSION = 1
_MEMORY_REFS: dict[str, MemoryRefTable] = {}
_MEMORY_LOCK = threading.Lock()


def _known_protocol(proto: str) -> bool:
    """Whether fsspec knows `proto`: by import path (s3, gcs, ...) or registered at run
    time (fsspec.register_implementation), which available_protocols() does not list."""
    import fsspec
    if not proto:  # fsspec reads "" as its default, the local disk: "://x" is a typo
        return False
    from fsspec.registry import known_implementations, registry
    if proto in known_implementations or proto in registry:  # no import: s3fs alone takes 0.5 s
        return True
    try:
        fsspec.get_filesystem_class(proto)
    except ValueError:  # "Protocol not known"
        return False
    except ImportError:  # known, its package is missing: opening it says which
        return True
    return True


def _split_url(url: str) -> tuple[str, str]:
    if not isinstance(url, (str, os.PathLike)):
        raise InvalidArgument(f"store location must be a str or path, got {type(url).__name__}")
    url = os.fspath(url)
    if "://" in url:
        proto, rest = url.split("://", 1)
        if not _known_protocol(proto):  # a typo (htps://) is named as such, first
            raise InvalidArgument(f"unknown URL scheme {proto + '://'!r} in {url!r}: use a local path, s3://, gs://, "
                                  "or another fsspec protocol")
        return proto, rest
    return "file", url


def _lmdb_path(refs, proto: str, root: str) -> str | None:
    """The local LMDB directory the ref table would be opened from, if it is one."""
    if refs is None:
        return os.path.join(root, "refs.lmdb") if proto == "file" else None
    if not isinstance(refs, str) or refs.startswith(("memory://", "postgresql://", "postgres://", "host=")) \
            or " dbname=" in refs:
        return None
    return refs[len("lmdb://"):] if refs.startswith("lmdb://") else refs


def _unwritable(paths) -> str | None:
    """Why this process cannot write where the store's files are (a read-only mount,
    permissions), or None: open_store(read_only=None) then opens it read-only."""
    for p in paths:
        if p is None or not os.path.exists(p):
            continue
        try:
            if os.statvfs(p).f_flag & os.ST_RDONLY:
                return f"{p} is on a read-only filesystem"
        except (OSError, AttributeError):
            pass
        if not os.access(p, os.W_OK):
            return f"{p} is not writable by this process"
    return None


def _open_refs(refs, proto: str, root: str, create: bool, store_id: str = "default",
               read_only: bool = False, backoff=None) -> RefTable:
    if isinstance(refs, RefTable):
        return refs
    if refs is None:
        if proto == "file":
            return LmdbRefTable(os.path.join(root, "refs.lmdb"), create=create, read_only=read_only)
        if proto == "memory":
            refs = f"memory://{root}"
        else:
            raise InvalidArgument(f"a {proto}:// store needs a shared ref table: pass refs='postgresql://...' "
                              "or refs='/local/path/refs.lmdb' for a single host")
    if not isinstance(refs, str):
        raise InvalidArgument(f"refs must be a str or RefTable, got {type(refs).__name__}")
    if refs.startswith("memory://"):
        with _MEMORY_LOCK:
            return _MEMORY_REFS.setdefault(refs, MemoryRefTable())
    if refs.startswith(("postgresql://", "postgres://")) or refs.startswith("host=") or " dbname=" in refs:
        from .refs.postgres import PostgresRefTable
        return PostgresRefTable(refs, namespace=store_id, read_only=read_only,
                                **({} if backoff is None else {"backoff": backoff}))
    return LmdbRefTable(_lmdb_path(refs, proto, root), create=create, read_only=read_only)


def _read_config(storage: BlockStore) -> dict | None:
    data = read_marker(storage)
    return None if data is None else _parse_config(data, storage.url)


def _marker_bytes(cfg: dict) -> bytes:
    """A store marker's fields as written (the store's, a tier's copy, the ref table's record)."""
    return json.dumps(cfg, indent=1).encode() + b"\n"


def _parse_config(data: bytes, where: str) -> dict:
    """A store marker's bytes (untrusted) -> its fields, checked."""
    try:
        if len(data) > MAX_MARKER_BYTES:
            raise ValueError("too large")
        cfg = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise NotAStore(f"{where}/{STORE_MARKER} is not a tensorstore_ck store marker") from None
    if not isinstance(cfg, dict) or cfg.get("format") != "tensorstore_ck":
        raise NotAStore(f"{where} is not a tensorstore_ck store")
    for k in ("block_size", "inline_threshold"):
        if k in cfg and (not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or not 0 <= cfg[k] < 2**40):
            raise FormatError(f"{where}/{STORE_MARKER}: {k} is not a valid size")
    v = cfg.get("version")
    if not isinstance(v, int) or not MIN_STORE_VERSION <= v <= MAX_STORE_VERSION:
        raise FormatError(f"store format version {v!r} is not readable by this build "
                          f"(reads {MIN_STORE_VERSION}..{MAX_STORE_VERSION})")
    return cfg


def layout(block_size, inline_threshold, config: dict | None = None, *, where: str = "") -> tuple[int, int]:
    """The block size and inline threshold a Store writes with: the arguments, else the
    store marker's, else the defaults (the inline threshold is never above the block
    size unless asked for). open_store calls it before writing anything, so a bad
    argument never leaves a half-made store; a marker whose values do not fit (written
    by hand, or by a build with other limits) is a FormatError that says how to go on."""
    for name, v in (("block_size", block_size), ("inline_threshold", inline_threshold)):
        if v is not None and (type(v) is not int or v < 0):
            raise InvalidArgument(f"{name} must be a non-negative int, got {v!r}")
    cfg = config or {}
    bs = block_size if block_size is not None else cfg.get("block_size", chunker.DEFAULT_BLOCK_SIZE)
    if inline_threshold is not None:
        it = inline_threshold
    else:
        it = cfg.get("inline_threshold", min(chunker.DEFAULT_INLINE_THRESHOLD, bs))
    problem = None
    if not chunker.MIN_BLOCK_SIZE <= bs <= chunker.MAX_BLOCK_SIZE:
        problem = f"block_size must be within {chunker.MIN_BLOCK_SIZE}..{chunker.MAX_BLOCK_SIZE}, got {bs}"
    elif not 0 <= it <= bs:
        problem = f"inline_threshold must be within 0..block_size ({bs}), got {it}"
    if problem is None:
        return int(bs), int(it)
    if (block_size is None and "block_size" in cfg) or (inline_threshold is None and "inline_threshold" in cfg):
        raise FormatError(f"{where or 'the store marker'} holds a layout this build cannot write with: {problem}; "
                          "open the store with block_size=/inline_threshold= arguments that fit, or correct those "
                          "fields of the marker (they only decide how new snapshots are cut; stored ones read "
                          "either way)")
    raise InvalidArgument(problem)


COMPRESSION = ("auto", "float", "lz4", "none")


def codecs_for(compression: str, storage: BlockStore, *, compress: bool = True, shuffle: bool = False) -> str:
    """The codecs a writer uses (Assets(codecs=)) for open_store(compression=...).

    "auto" is the measured best for the backend (docs/design/codecs.md, "Compression"):
    the float codec where the bytes cross a network (object stores: fewer bytes is
    time and money saved), lz4 where they do not (a local disk, memory://), where
    coding floats costs more CPU time than the disk saves. The flags map in too:
    compress=False is "none", shuffle=True the byte-shuffle codec (deprecated).
    The options are checked first (check_options)."""
    if not compress:
        return "none"
    if shuffle:
        return "shuffle"
    if compression == "auto":
        return "lz4" if storage.local or storage.url.startswith("memory://") else "float"
    return compression


def check_options(*, workers=None, gc_lease=None, max_inflight=2, when_busy="wait", compression="auto",
                  compress=True, shuffle=False) -> None:
    """A Store's other options, checked before open_store writes anything."""
    if compression not in COMPRESSION:
        raise InvalidArgument(f"compression must be one of {', '.join(map(repr, COMPRESSION))}, got {compression!r}")
    if not compress and compression not in ("auto", "none"):
        raise InvalidArgument(f"compress=False contradicts compression={compression!r}")
    if shuffle and compression not in ("auto", "lz4"):
        raise InvalidArgument(f"shuffle=True contradicts compression={compression!r}")
    if workers is not None and (type(workers) is not int or not 1 <= workers <= 1024):
        raise InvalidArgument(f"workers must be an int within 1..1024, got {workers!r}")
    if gc_lease is not None and not (isinstance(gc_lease, (int, float)) and not isinstance(gc_lease, bool)
                                     and 0 < gc_lease < 1e7):
        raise InvalidArgument(f"gc_lease must be a positive number of seconds, got {gc_lease!r}")
    if type(max_inflight) is not int or max_inflight < 1:
        raise InvalidArgument(f"max_inflight must be an int >= 1, got {max_inflight!r}")
    if when_busy not in ("wait", "skip"):
        raise InvalidArgument(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")


def _settings(storage: BlockStore, cfg: dict, *, workers, verify, compression, compress, shuffle, block_size,
              inline_threshold, gc_lease, read_only) -> tuple[Settings, str]:
    """open_store()'s options (checked by check_options) as the store's Settings and the
    codecs its writers use: the one place they, the deprecated flags among them, are read."""
    bs, it = layout(block_size, inline_threshold, cfg, where=f"{storage.url}/{STORE_MARKER}")
    return Settings(verify=verify, workers=workers or DEFAULT_WORKERS,
                    gc_lease=float(gc_lease if gc_lease is not None else DEFAULT_LEASE), block_size=bs,
                    inline_threshold=it, read_only=read_only), codecs_for(compression, storage, compress=compress,
                                                                         shuffle=shuffle)


def _open_errors(fn):
    """open_store's backend failures (unreachable server, refused credentials, full
    disk) reach the caller as StorageError naming the store."""
    @functools.wraps(fn)
    def wrapper(url, *args, **kwargs):
        try:
            return fn(url, *args, **kwargs)
        except StorageError as e:
            if type(e) is not StorageError or str(e).startswith("cannot open"):
                raise
            # (a request that spent its retry budget, as RetryingStore words it): named as
            # a failure to open, like any other
            text = f"cannot open the store at {url}: {e.strerror or e}"
            raise (StorageError(e.errno, text) if e.errno is not None else StorageError(text)) from e
        except TsckError:
            raise
        except OSError as e:
            raise storage_error(e, f"cannot open the store at {url}") from e
    return wrapper


@_open_errors
def open_store(url, *, refs=None, storage_options: dict | None = None, create: bool = True,
               block_size: int | None = None, inline_threshold: int | None = None,
               workers: int | None = None, verify: bool = True, compression: str = "auto",
               compress: bool = True, shuffle: bool = False, gc_lease: float | None = None, max_inflight: int = 2,
               when_busy: str = "wait", wrap_storage=None, write_bandwidth: float | None = None,
               write_concurrency: int | None = None, create_refs: bool = False,
               gc_stale_after: float | None = None, read_only: bool | None = None, local=None,
               local_budget: int | None = None, replicas: int = 0, early_upload: bool | None = None,
               retry_budget: float | None = None) -> Store:
    """Open (or create, if `create` and the location is empty) a store.

    A ref table is created only with a new store, or with create_refs=True (what
    `tsck recover` passes to rebuild a lost one). It is bound to its store: it
    records the store's id and refuses to serve another store (NotAStore).

    url: a local path, file://, memory:// or any fsspec URL (s3://bucket/prefix).
    refs: None (LMDB beside local data; in-process table for memory://), a path
    or lmdb:// URL, postgresql://..., memory://name, or a RefTable.
    storage_options: passed to fsspec (s3fs: endpoint_url, key, secret, ...).
    compression: how new blocks are written: "auto" (default: "float" on object stores,
    "lz4" on a local disk or memory://; docs/design/codecs.md, "Compression"), "float"
    (the float codec where it pays, lz4 where that pays, raw otherwise), "lz4", "none".
    Any store reads every codec; an object's address never depends on it.
    compress=False: another spelling of compression="none". shuffle=True (deprecated):
    byte shuffle then lz4, the codec "float" supersedes.
    gc_lease: seconds a gc run through this Store (store.gc()) holds the store between
    two renewals (default 120); others judge it on the ref table's clock.
    gc_stale_after: another name of gc_lease (deprecated; it does not decide when another
    process's gc counts as dead: that gc's own declared lease does).
    read_only: True opens an existing store for reading only: checkout, log, refs, show,
    du, diff, fsck and gc(dry_run=True) work; every write raises ReadOnlyStore before
    anything is written, nothing is created, and a PostgreSQL ref table is used in
    READ ONLY transactions. None (default): read-only exactly when the files of a local
    store (its folder, its LMDB ref table) are on a read-only filesystem or not
    writable by this process. False: writable, whatever the files say.
    local: a directory on a fast local disk (NVMe) for a local tier in front of the store
    at `url` (docs/design/tiers.md): put_snapshot publishes there (a local disk and an LMDB
    ref table under it, made on first use, with the store's id and layout) and returns;
    a background uploader sends each snapshot's missing objects to `url` and moves its
    ref there (SnapshotInfo.durable, Store.wait_durable()). wrap_storage= wraps the
    remote store's storage. An s3:// remote is opened on first use (an upload, a read
    the tier cannot serve) once the tier has found its store at that URL and endpoint:
    a restore from the tier makes no request to S3, and a server that is down at open
    fails that first use instead (docs/design/tiers.md, "Opening the remote on first use").
    local_budget: bytes the local tier's objects may take (default: no limit). After a
    snapshot becomes durable, and at open, the local copies of durable snapshots are
    evicted, the older first, each ref's newest durable tip last (their reads go to the
    remote store); never what a queued upload or a local-only snapshot needs. A put
    starts writing only once the tier fits the budget (so it ends at most its own new
    bytes over): it evicts durable copies, then waits for queued uploads (a warning;
    at most upload.BUDGET_WAIT seconds), then raises TierFull before writing anything,
    at once where waiting cannot help (docs/design/tiers.md, "Budget").
    replicas: with local=, under torch.distributed: after each collective put, every rank
    copies the objects of its part into the local tiers of the next `replicas` ranks
    (r+1 .. r+replicas mod W), and a collective checkout fetches what its tier lacks from
    them, by address, before it reads the remote store (docs/design/tiers.md, "Peer
    replicas"). Set per store, not per put: the ranks must agree, and a CheckpointManager
    needs no new argument.
    early_upload: with local=, send each new block to the remote store from memory while
    the put writes it (docs/design/tiers.md, "The early upload"): the snapshot is durable
    sooner, and the sends take CPU from the put. None (the default): on when the host has
    8 cores or more (upload.EARLY_UPLOAD_CORES), where the sends find cores to spare.
    retry_budget: seconds a failed request to remote storage or to a PostgreSQL ref table
    is retried for (connection lost or refused, timeouts, 5xx, throttling), from its
    first failure, with capped exponential backoff and jitter (retry.py). None (the
    default): $TSCK_RETRY_BUDGET, else 60, which rides out a PostgreSQL failover or a
    spell of S3 throttling; 0 retries nothing. What retrying cannot cure (refused
    credentials, a missing database, a 4xx other than throttling) fails at once."""
    if gc_stale_after is not None:
        warnings.warn("open_store(gc_stale_after=) is deprecated: use gc_lease= (the lease of the gcs this "
                      "Store runs; another party's gc is judged by its own lease)", DeprecationWarning,
                      stacklevel=3)
        gc_lease = gc_stale_after if gc_lease is None else gc_lease
    # Every argument is checked before anything is written: a bad one never leaves a
    # marker behind that no later open could get past.
    new_layout = layout(block_size, inline_threshold)
    if shuffle:
        warnings.warn("open_store(shuffle=True) is deprecated: compression='float' codes floats better",
                      DeprecationWarning, stacklevel=3)
    check_options(workers=workers, gc_lease=gc_lease, max_inflight=max_inflight, when_busy=when_busy,
                  compression=compression, compress=compress, shuffle=shuffle)
    from .retry import backoff_for
    backoff = backoff_for(retry_budget)
    if read_only is not None and not isinstance(read_only, bool):
        raise InvalidArgument(f"read_only must be True, False or None, got {read_only!r}")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise InvalidArgument(f"replicas must be an int >= 0, got {replicas!r}")
    if replicas and local is None:
        raise InvalidArgument("replicas= copies into the local tiers of other ranks: it needs local=")
    if local is not None:
        if not isinstance(local, (str, os.PathLike)) or not os.fspath(local):
            raise InvalidArgument(f"local must be a directory path, got {local!r}")
        if read_only:
            raise InvalidArgument("a local tier is for writing: open the store read-only without local=")
        read_only = False
    if early_upload is not None:
        if not isinstance(early_upload, bool):
            raise InvalidArgument(f"early_upload must be True, False or None, got {early_upload!r}")
        if early_upload and local is None:
            raise InvalidArgument("early_upload= sends a local tier's blocks early: it needs local=")
    if local_budget is not None:
        if local is None:
            raise InvalidArgument("local_budget= is the byte budget of a local tier: it needs local=")
        if isinstance(local_budget, bool) or not isinstance(local_budget, int) or local_budget < 1:
            raise InvalidArgument(f"local_budget must be a number of bytes (an int >= 1), got {local_budget!r}")
    proto, rest = _split_url(url)
    if local is not None and proto == "file" and os.path.realpath(rest) == os.path.realpath(os.fspath(local)):
        raise InvalidArgument(f"local tier {os.fspath(local)!r} is the store itself: give it a directory of its own")
    if refs is None and proto not in ("file", "memory"):  # say so before writing anything there
        _open_refs(refs, proto, rest, create=False)
    if local is not None and proto in LAZY_PROTOCOLS and not create_refs:
        store = _lazy_tiered(os.fspath(local), proto, rest, refs, storage_options, backoff,
                             lambda: _remote_storage(proto, rest, storage_options, backoff),
                             lambda s: _wrapped(s, write_bandwidth, write_concurrency, wrap_storage),
                             dict(workers=workers, verify=verify, compression=compression, compress=compress,
                                  shuffle=shuffle, block_size=block_size, inline_threshold=inline_threshold,
                                  gc_lease=gc_lease, read_only=None),
                             (max_inflight, when_busy, local_budget, replicas, early_upload))
        if store is not None:
            return store
    why_ro = "read_only=True was asked for" if read_only else ""
    if proto == "file":
        root = os.path.abspath(rest)
        if os.path.exists(root) and not os.path.isdir(root):
            raise NotAStore(f"{root} is a file, not a store")
        if read_only is None:
            lmdb_dir = _lmdb_path(refs, proto, root)
            why_ro = _unwritable([root] + ([lmdb_dir, os.path.join(lmdb_dir, "data.mdb"),
                                            os.path.join(lmdb_dir, "lock.mdb")] if lmdb_dir else []))
            read_only = why_ro is not None
        if not os.path.isdir(root):
            if read_only:
                raise NotAStore(f"no store at {root} (no such directory; opened read-only: nothing is created)")
            if not create:
                raise NotAStore(f"no store at {root} (no such directory; check the path, or pass create=True "
                                "to make a new store)")
            try:
                os.makedirs(root, exist_ok=True)  # several processes may create one store at once
            except OSError as e:
                raise NotAStore(f"cannot create a store at {root}: {e.strerror}") from None
        storage: BlockStore = LocalBlockStore(root)
        rest = root
    else:
        storage = _remote_storage(proto, rest, storage_options, backoff)
    read_only = bool(read_only)
    if read_only:  # nothing below creates anything; a write that slips through is refused here
        from .storage.wrappers import ReadOnlyStorage
        create = create_refs = False
        storage = ReadOnlyStorage(storage)
    cfg = _read_config(storage)
    if cfg is None:
        # Temp files of in-flight writes (a creator killed while writing the marker
        # leaves one) do not make a folder "not empty".
        if not storage.is_empty():
            cfg = _read_config(storage)  # another process may have just created the store
            if cfg is None:
                raise NotAStore(f"{storage.url} is not empty and holds no {STORE_MARKER}: not a store")
    created = False
    if cfg is None:
        if not create:
            if read_only:
                raise NotAStore(f"no store at {storage.url} (nothing there; opened read-only: nothing is created)")
            raise NotAStore(f"no store at {storage.url} (nothing there; check the path, or pass create=True "
                            "to make a new store)")
        cfg = {"format": "tensorstore_ck", "version": STORE_VERSION, "created": time.time(),
               "id": uuid.uuid4().hex,  # names this store in a shared ref table (PostgreSQL)
               "block_size": new_layout[0], "inline_threshold": new_layout[1]}
        # Exclusive create: if another process won the race, its marker is the one we read.
        created = create_marker(storage, _marker_bytes(cfg))
        cfg = _read_config(storage) or cfg
    store_id = str(cfg.get("id") or storage.url)
    # A missing ref table next to an existing store is never silently created empty:
    # an empty table makes gc think nothing is kept (recover rebuilds it).
    fresh = created
    try:
        reftable = _open_refs(refs, proto, rest, create=created or create_refs, store_id=store_id,
                              read_only=read_only, backoff=backoff)
    except NotAStore as e:
        if not str(e).startswith("no ref table") or read_only:
            raise
        if holds_snapshots(storage):
            raise NotAStore(f"{e}: the store at {storage.url} exists but its ref table does not; if it was "
                            f"lost, run `tsck recover {url}` to rebuild it from storage (check --refs / "
                            "$TSCK_REFS first)") from None
        # A creator killed between the marker and the table: no snapshot is stored, so
        # there is nothing to lose; the table is made as it would have been with the store.
        fresh = True
        reftable = _open_refs(refs, proto, rest, create=True, store_id=store_id, backoff=backoff)
    try:
        if not fresh and not read_only and reftable.bound_store() is None and not holds_snapshots(storage):
            # An unbound table while the store holds no snapshot: another process is creating
            # the store right now (every rank of a job opens it at once) and has not bound its
            # new table yet, or a creator died before binding it. It lacks nothing: not a lost
            # table, so no rebuild mark (which would refuse every prune until a recover).
            fresh = True
        reftable.bind_store(store_id, new=fresh)
    except BaseException:
        if not isinstance(refs, RefTable):
            reftable.close()
        raise
    storage = _wrapped(storage, write_bandwidth, write_concurrency, wrap_storage)
    try:
        settings, codecs = _settings(storage, cfg, workers=workers, verify=verify, compression=compression,
                                     compress=compress, shuffle=shuffle, block_size=block_size,
                                     inline_threshold=inline_threshold, gc_lease=gc_lease,
                                     read_only=why_ro if read_only else None)
        core = Core.build(storage, reftable, codecs=codecs, settings=settings)
        if local is None:
            return Store(core, config=cfg, max_inflight=max_inflight, when_busy=when_busy)
        try:
            location = _location(proto, rest, storage_options)
            store = _tiered(os.fspath(local), core, cfg, store_id, codecs, settings, max_inflight, when_busy,
                            local_budget, replicas, early_upload, location=location)
            if location is not None:
                _record_location(reftable, location, cfg)
            return store
        except BaseException:
            core.pool.shutdown(wait=False)
            raise
    except BaseException:
        if not isinstance(refs, RefTable):  # a table we opened, not the caller's
            reftable.close()
        raise


# Remote protocols whose storage a tiered open leaves unopened until first use (an S3
# client and its first request cost about 0.8 s in a fresh process). Their location is
# the URL and the endpoint: what the tier records as verified (below).
LAZY_PROTOCOLS = ("s3", "s3a")
# A local tier's table records, per remote location (_location), the store id whose
# marker an open found there (RefTable.verified_put, meta `verified:`): a later open of the
# tier in front of the same location may then leave the remote storage unopened (_lazy_tiered).


def _remote_storage(proto: str, rest: str, storage_options: dict | None, backoff) -> BlockStore:
    """The storage of a store at an fsspec URL, its transient network errors retried."""
    try:
        cls = S3BlockStore if proto in ("s3", "s3a") else FsspecBlockStore
        storage = cls(f"{proto}://{rest}", storage_options)
    except (ImportError, ValueError, TypeError) as e:
        raise NotAStore(f"cannot open {proto}:// storage: {type(e).__name__}: {e}") from None
    if proto != "memory":
        from .storage.wrappers import RetryingStore
        storage = RetryingStore(storage, backoff=backoff)  # transient network errors are retried, not surfaced
    return storage


def _wrapped(storage: BlockStore, write_bandwidth, write_concurrency, wrap_storage) -> BlockStore:
    """open_store's throttles and caller's wrapper, around storage whose marker was read."""
    if write_bandwidth is not None or write_concurrency is not None:
        from .storage.wrappers import ThrottledStore
        try:
            storage = ThrottledStore(storage, bytes_per_second=write_bandwidth, max_concurrent=write_concurrency)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
    if wrap_storage is not None:  # cross-cutting behaviour (fault injection, limits) as a wrapper
        storage = wrap_storage(storage)
    return storage


def _location(proto: str, rest: str, storage_options: dict | None) -> str | None:
    """Where a remote store is, as a tier records it verified: the URL and the endpoint
    it is reached at (an s3:// URL names a bucket of whichever server the endpoint is).
    None for a protocol whose storage opens eagerly."""
    if proto not in LAZY_PROTOCOLS:
        return None
    opts = storage_options or {}
    endpoint = (opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "")
    return json.dumps(["s3://" + rest.strip("/"), str(endpoint).rstrip("/")])


def _verified(lrefs: LmdbRefTable, location: str) -> str | None:
    return lrefs.verified_get(location)


class LazyStorage(BlockStore):
    """A remote store's storage, opened on first use: the client is built and the store's
    marker read and checked against the local tier's (_check_tier: NotAStore) before any
    call passes. The throttles and wrap_storage= are put around it at open, as around
    an eager open's storage: a call through them reaches the storage once it is checked.
    A failed open (the server away) is raised to that use, as the eager open raises it
    (StorageError naming the store), and tried again at the next use."""

    local = False  # an object store: every call is a request

    def __init__(self, url: str, make, tier_root: str, tier_cfg: dict, on_checked=None):
        """make() -> the storage (its retries included); on_checked() once its marker is
        found to be the tier's store's."""
        self.url = url
        self._make, self._root, self._cfg, self._on_checked = make, tier_root, tier_cfg, on_checked
        self._storage: BlockStore | None = None
        self._lock = threading.Lock()

    @property
    def opened(self) -> bool:
        return self._storage is not None

    def _open(self) -> BlockStore:
        s = self._storage
        if s is not None:
            return s
        with self._lock:
            if self._storage is None:
                try:
                    inner = self._make()
                except TsckError:
                    raise
                except OSError as e:
                    raise storage_error(e, f"cannot open the store at {self.url}") from e
                try:
                    cfg = _read_config(inner)
                    if cfg is None:
                        raise NotAStore(f"local tier {self._root} belongs to store {self._cfg.get('id')!r}, and "
                                        f"{self.url} holds no store: give each store its own local directory")
                    _check_tier(self._root, self._cfg, cfg, str(cfg.get("id") or self.url), self.url)
                    self._storage = inner
                    if self._on_checked is not None:
                        self._on_checked()
                except OSError as e:
                    inner.close()
                    raise storage_error(e, f"cannot open the store at {self.url}") from e
                except BaseException:
                    inner.close()
                    raise
                log.debug("opened the remote store at %s (its first use)", self.url)
            return self._storage

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # a thread of the parent may have held it
        s = self._storage
        while s is not None:
            hook = getattr(s, "_after_fork", None)
            if hook is not None:
                hook()
            s = getattr(s, "inner", None)

    def __getattr__(self, name):  # a backend's own attributes (fs, root, ...): an open
        if name.startswith("_") or name == "inner":  # Core.after_fork walks `inner`: no open there
            raise AttributeError(name)
        return getattr(self._open(), name)

    def get(self, key, max_bytes=None):
        return self._open().get(key, max_bytes)

    def open_read(self, key, max_bytes=None):
        return self._open().open_read(key, max_bytes)

    def put_if_absent(self, key, bufs):
        return self._open().put_if_absent(key, bufs)

    def put_addressed(self, key, bufs):
        return self._open().put_addressed(key, bufs)

    def exists(self, key):
        return self._open().exists(key)

    def size_of(self, key):
        return self._open().size_of(key)

    def move(self, key, new_key, *, deadline=None):
        return self._open().move(key, new_key, deadline=deadline)

    def delete(self, key):
        return self._open().delete(key)

    def delete_many(self, keys, *, deadline=None):
        return self._open().delete_many(keys, deadline=deadline)

    @property
    def request_timeout(self) -> float:
        return self._open().request_timeout

    @property
    def pages(self):
        return self._open().pages

    @property
    def supports_deletes(self):
        return self._open().supports_deletes

    def list(self, prefix):
        return self._open().list(prefix)

    def list_page(self, prefix, start_after=None):
        return self._open().list_page(prefix, start_after)

    def sync(self):
        return self._open().sync()

    def clock_now(self):
        return self._open().clock_now()

    def temp_files(self):
        return self._open().temp_files()

    def is_empty(self):
        return self._open().is_empty()

    def close(self):
        if self._storage is not None:  # never opened: nothing to release (and no request made)
            self._storage.close()


def _recorded(reftable: RefTable, location: str) -> dict | None:
    """The marker of the store a tiered open found at `location`, as the ref table records
    it (RefTable.location_get), checked as a marker is; None where it records none or one
    that does not read."""
    data = reftable.location_get(location)
    if data is None:
        return None
    try:
        cfg = _parse_config(data, f"the ref table's record of {location}")
    except TsckError:
        return None
    return cfg if isinstance(cfg.get("id"), str) else None


def _record_location(reftable: RefTable, location: str, cfg: dict) -> None:
    """An eager tiered open read the store's marker at `location`: the ref table keeps it,
    for a new tier to be made from (best effort: without it that tier opens eagerly)."""
    data = _marker_bytes(cfg)
    try:
        if reftable.location_get(location) != data:
            reftable.location_put(location, data)
    except Exception as e:  # noqa: BLE001 - a missing record costs the next new tier an eager open
        log.info("the ref table could not record the store found at %s (%s)", location, e)


def _new_tier(root: str, cfg: dict) -> LmdbRefTable | None:
    """Make a local tier at `root` (absent or an empty directory) from the store marker
    `cfg` -> its table, bound to the store; None where it could not be made as asked (the
    eager open then says why)."""
    try:
        os.makedirs(root, exist_ok=True)
        lstorage = LocalBlockStore(root)
        create_marker(lstorage, _marker_bytes(cfg))
        lcfg = _read_config(lstorage)
    except (OSError, TsckError):
        return None
    if lcfg is None or lcfg.get("id") != cfg["id"] or _layout_of(lcfg) != _layout_of(cfg):
        return None  # another process made it meanwhile, otherwise
    refs_dir = os.path.join(root, "refs.lmdb")
    fresh = not os.path.isdir(refs_dir)
    lrefs = LmdbRefTable(refs_dir, create=True)
    try:
        lrefs.bind_store(cfg["id"], new=fresh)
    except BaseException:
        lrefs.close()
        raise
    return lrefs


def _listing(path: str) -> list[str] | None:
    """What a directory holds; None where it cannot be listed (the eager open says why)."""
    try:
        return os.listdir(path)
    except OSError:
        return None


def _layout_of(cfg: dict) -> tuple:
    return cfg.get("block_size"), cfg.get("inline_threshold")


def _lazy_tiered(local: str, proto: str, rest: str, refs, storage_options, backoff, make_storage, wrap,
                 options: dict, store_args: tuple) -> Store | None:
    """open_store(remote, local=PATH) without opening the remote storage: a Store whose
    remote Core has a LazyStorage, or None where the eager open must run. Taken when
    the remote ref table is bound to the tier's store, and an open found that store at
    this location before: this tier (RefTable.verified_get), or any tiered open, as the
    remote ref table records (RefTable.location_get). A tier that is absent or empty (the
    node's disk lost, a new node) is made from the ref table's record. These are the
    checks an eager open makes without the remote marker; the marker itself is checked at
    the remote storage's first use (LazyStorage), before anything else is read from it or
    sent to it. Any other case (a tier never seen with this store, a table not bound yet,
    a lost table to report) is the eager open's, with its messages."""
    location = _location(proto, rest, storage_options)
    root = os.path.abspath(local)
    refs_dir = os.path.join(root, "refs.lmdb")
    if location is None:
        return None
    if os.path.isfile(os.path.join(root, STORE_MARKER)) and os.path.isdir(refs_dir):
        lcfg = _read_config(LocalBlockStore(root))
        if lcfg is None or not isinstance(lcfg.get("id"), str):
            return None
        new = False
    elif not os.path.exists(root) or (os.path.isdir(root) and _listing(root) == []):
        lcfg, new = None, True
    else:
        return None
    ours = not isinstance(refs, RefTable)
    lrefs = reftable = core = None
    try:
        try:
            # (a table serving several stores is opened for one: the new tier's id comes first)
            reftable = _open_refs(refs, proto, rest, create=False, store_id=lcfg["id"] if lcfg else LOCATIONS_NS,
                                  backoff=backoff)
        except NotAStore:  # no ref table there: the eager open says what to do
            return None
        recorded = _recorded(reftable, location)
        if new:
            if recorded is None:
                return None
            lcfg = recorded
            if ours and getattr(reftable, "namespace", None) == LOCATIONS_NS:
                reftable.close()
                reftable = None
                reftable = _open_refs(refs, proto, rest, create=False, store_id=lcfg["id"], backoff=backoff)
        store_id = lcfg["id"]
        bound = reftable.bound_store()
        if bound is not None and bound != store_id:  # the remote's table serves another store
            if new:
                return None
            raise NotAStore(f"local tier {root} belongs to store {store_id!r}, not to {bound!r} "
                            f"({proto}://{rest}): give each store its own local directory")
        if bound is None:
            return None  # a table not bound yet: the eager open decides what it is
        if new:
            lrefs = _new_tier(root, lcfg)
            if lrefs is None:
                return None
        else:
            lrefs = LmdbRefTable(refs_dir, create=False)
            if lrefs.bound_store() != store_id:
                return None
            seen = _verified(lrefs, location) == store_id or (
                recorded is not None and recorded["id"] == store_id and _layout_of(recorded) == _layout_of(lcfg))
            if not seen:  # a location where no open found this store: the eager open reads its marker
                return None

        def verified(lrefs=lrefs, location=location, store_id=store_id) -> None:
            try:
                if _verified(lrefs, location) != store_id:
                    lrefs.verified_put(location, store_id)
            except Exception as e:  # noqa: BLE001 - unrecorded, the next open of the tier reads the marker
                log.debug("the tier could not record its store's location (%s)", e)
        storage = wrap(LazyStorage(f"{proto}://{rest}", make_storage, root, lcfg, on_checked=verified))
        settings, codecs = _settings(storage, lcfg, **options)
        core = Core.build(storage, reftable, codecs=codecs, settings=settings)
    finally:
        if core is None:  # not taken (None returned) or failed: what was opened here is closed
            if lrefs is not None:
                lrefs.close()
            if reftable is not None and ours:
                reftable.close()
    max_inflight, when_busy, budget, replicas, early_upload = store_args
    try:
        return _tiered(root, core, lcfg, store_id, codecs, settings, max_inflight, when_busy, budget, replicas,
                       early_upload, lrefs=lrefs)
    except BaseException:
        core.pool.shutdown(wait=False)
        if ours:
            reftable.close()
        raise


def _tiered(path: str, remote: Core, cfg: dict, store_id: str, codecs: str, settings: Settings,
            max_inflight: int, when_busy: str, budget: int | None = None, replicas: int = 0,
            early_upload: bool | None = None, *, location: str | None = None,
            lrefs: LmdbRefTable | None = None) -> Store:
    """A Store over a local tier at `path` in front of `remote`: the tier's marker is a copy
    of the remote's (same id, same block layout: a block cut here is the block the remote
    would hold), its LMDB ref table is bound to the same store id, and its blocks use the
    remote's codecs (they travel as stored). `cfg` is the remote's marker, read here
    (eager: `location` names where, recorded in the tier as verified), or the tier's own
    when the remote opens on first use (_lazy_tiered: `lrefs` is the tier's table, open)."""
    root = os.path.abspath(path)
    if lrefs is not None:  # the lazy open: the tier's marker was read and checked there
        try:
            lcore = Core.build(LocalBlockStore(root), lrefs, codecs=codecs, settings=settings)
        except BaseException:
            lrefs.close()
            raise
        return _tier_store(lcore, remote, cfg, max_inflight, when_busy, budget, replicas, early_upload)
    if os.path.exists(root) and not os.path.isdir(root):
        raise NotAStore(f"local tier {root} is a file, not a directory")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise NotAStore(f"cannot create a local tier at {root}: {e.strerror}") from None
    lstorage = LocalBlockStore(root)
    lcfg = _read_config(lstorage)
    if lcfg is None:
        if not lstorage.is_empty():
            lcfg = _read_config(lstorage)
            if lcfg is None:
                raise NotAStore(f"local tier {root} is not empty and holds no {STORE_MARKER}: not a local tier")
        else:
            create_marker(lstorage, _marker_bytes(cfg))
            lcfg = _read_config(lstorage) or cfg
    _check_tier(root, lcfg, cfg, store_id, remote.url)
    refs_dir = os.path.join(root, "refs.lmdb")
    fresh = not os.path.isdir(refs_dir)
    lrefs = LmdbRefTable(refs_dir, create=True)
    try:
        lrefs.bind_store(store_id, new=fresh)
        if location is not None and _verified(lrefs, location) != store_id:
            lrefs.verified_put(location, store_id)
        lcore = Core.build(lstorage, lrefs, codecs=codecs, settings=settings)
    except BaseException:
        lrefs.close()
        raise
    return _tier_store(lcore, remote, cfg, max_inflight, when_busy, budget, replicas, early_upload)


def _tier_store(lcore: Core, remote: Core, cfg: dict, max_inflight: int, when_busy: str, budget, replicas: int,
                early_upload) -> Store:
    from .upload import Uploader, early_default
    return Store(lcore, config=cfg, max_inflight=max_inflight, when_busy=when_busy,
                 uploader=Uploader(lcore, remote, budget, early=early_default() if early_upload is None else early_upload),
                 replicas=replicas)


def _check_tier(root: str, lcfg: dict, cfg: dict, store_id: str, url: str) -> None:
    """The tier at `root` (marker `lcfg`) must be a tier of the store whose marker is `cfg`:
    the same id (NotAStore: a directory of another store), the same block layout (a block
    cut in the tier is the block the store would hold)."""
    if str(lcfg.get("id")) != store_id:
        raise NotAStore(f"local tier {root} belongs to store {lcfg.get('id')!r}, not to {store_id!r} "
                        f"({url}): give each store its own local directory")
    mine = (lcfg.get("block_size"), lcfg.get("inline_threshold"))
    theirs = (cfg.get("block_size"), cfg.get("inline_threshold"))
    if mine != theirs:
        raise NotAStore(f"local tier {root} cuts blocks as block_size={mine[0]}, inline_threshold={mine[1]}, the "
                        f"store at {url} as block_size={theirs[0]}, inline_threshold={theirs[1]}: its marker "
                        f"({STORE_MARKER}) must be a copy of the store's; correct it, or give the tier a new "
                        "directory")
