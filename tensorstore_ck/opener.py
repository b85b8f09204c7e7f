"""open_store(): a URL -> a Store, with its storage stack and ref table.

    path | file://   LocalBlockStore (fsync, atomic link), LMDB ref table beside the data
    memory://        FsspecBlockStore, an in-process ref table of the same name
    s3://            S3BlockStore under RetryingStore; a shared ref table is required
    other fsspec     FsspecBlockStore under RetryingStore; likewise
                     (refs="postgresql://..." or a local LMDB path for one host)

The store's marker, ``tsck.json``, holds its format version, id and block
layout; it is created exclusively, so concurrent creators agree on one.

open_store's options come in groups, each checked by a helper of its own before
anything is written (a bad one never leaves a marker behind that no later open
could get past): what is stored (_Stored), where the refs live (_Refs), the local
tier (_Tier), the network's limits (_Network), and the lease of the gcs it runs.
"""

from __future__ import annotations

import datetime
import functools
import logging
import os
import time
import uuid
from dataclasses import dataclass

from .core.assets import STORE_MARKER, create_marker, holds_snapshots
from .core.core import Core, Settings
from .core.locate import (STORE_VERSION, check_options, layout, lmdb_path, marker_bytes, open_refs, read_config,
                          remote_storage, settings_for, split_url, unwritable, wrapped)
from .errors import InvalidArgument, NotAStore, StorageError, TsckError, storage_error
from .refs import RefTable
from .storage import BlockStore, LocalBlockStore
from .store import Store
from .tier.local import LocalTier
from .tier.opening import (LAZY_PROTOCOLS, lazy_tiered, record_location, refuse_lost_table, remote_location,
                           tiered)
from .write.saver import Saver, SaverRecipe

__all__ = ["open_store", "STORE_MARKER", "CREATE_HINT"]

# The end of NotAStore's message for a location that holds nothing: the CLI puts its
# own way (`tsck init STORE`) in its place.
CREATE_HINT = "pass create=True to make a new store"

log = logging.getLogger(__name__)


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
def open_store(url, *, create: bool = True,
               # what is stored
               block_size: int | None = None, inline_threshold: int | None = None, compression: str = "auto",
               verify: bool = True, pack_size: int | None = None,
               # where the refs live
               refs=None, create_refs: bool = False, read_only: bool | None = None,
               # the local tier
               local=None, local_budget: int | None = None, replicas: int = 0, early_upload: bool | None = None,
               memory=None, durable_every: int | datetime.timedelta = 1,
               # the network's limits
               write_bandwidth: float | None = None, write_concurrency: int | None = None,
               workers: int | None = None, max_inflight: int = 2, retry_budget: float | None = None,
               when_busy: str = "wait", saver: str = "thread", saver_nice: int = 10,
               host_memory: int | str | None = "auto",
               storage_options: dict | None = None, wrap_storage=None,
               # gc
               gc_lease: float | None = None,
               # reads
               shared_reads: bool | None = None,
               # writes
               watch_writes: bool = True) -> Store:
    """Open (or create, if `create` and the location is empty) a store.

    url: a local path, file://, memory:// or any fsspec URL (s3://bucket/prefix).
    create: make a new store where the location holds nothing (False: NotAStore there).

    What is stored:
    block_size, inline_threshold: how a new store cuts tensors into blocks, and below which
    size a tensor is kept inline in its node (a store's marker fixes them; given for an
    existing store, they decide how new snapshots are cut).
    compression: how new blocks are written: "auto" (default: "float" on object stores,
    "lz4" on a local disk or memory://; docs/design/codecs.md, "Compression"), "float"
    (the float codec where it pays, lz4 where that pays, raw otherwise), "lz4", "none".
    Any store reads every codec; an object's address never depends on it.
    verify: check every object read against its address (default True).
    pack_size: new snapshots' small tensors (one block or less, not replicated; under
    inline_threshold only those that would be a node of their own) are packed,
    in state order, into blocks of up to this many bytes, so that a rank's thousands of
    small tensors are tens of objects, not thousands (an object store's request rate, not
    its bandwidth, bounds a large job's snapshot: docs/design/scaling.md, "Packs"). None
    (default): 64 MiB on object stores and with local=, 0 (never) on a local disk or
    memory:// ($TSCK_PACK_SIZE overrides that default). Any store reads packed snapshots.

    Where the refs live:
    refs: None (LMDB beside local data; in-process table for memory://), a path
    or lmdb:// URL, postgresql://..., memory://name, or a RefTable.
    create_refs: make the ref table where none is (what `tsck recover` passes to rebuild
    a lost one). Otherwise a ref table is created only with a new store. It is bound to
    its store: it records the store's id and refuses to serve another store (NotAStore).
    read_only: True opens an existing store for reading only: checkout, log, refs, show,
    du, diff, fsck and gc(dry_run=True) work; every write raises ReadOnlyStore before
    anything is written, nothing is created, and a PostgreSQL ref table is used in
    READ ONLY transactions. None (default): read-only exactly when the files of a local
    store (its folder, its LMDB ref table) are on a read-only filesystem or not
    writable by this process. False: writable, whatever the files say.

    The local tier:
    local: a directory on a fast local disk (NVMe) for a local tier in front of the store
    at `url` (docs/design/tiers.md): put_snapshot publishes there (a local disk and an LMDB
    ref table under it, made on first use, with the store's id and layout) and returns;
    a background uploader sends each snapshot's missing objects to `url` and moves its
    ref there (SnapshotInfo.durable, Store.wait_durable()). wrap_storage= wraps the
    remote store's storage. An s3:// remote is opened on first use (an upload, a read
    the tier cannot serve) once the tier has found its store at that URL and endpoint:
    a restore from the tier makes no request to S3, and a server that is down at open
    fails that first use instead (docs/design/tiers.md, "Opening the remote on first use").
    local_budget: bytes the local tier's objects may take (default: no limit; a memory
    tier, half its tmpfs shared by the node's ranks: tier.memory.default_budget). After a
    snapshot becomes durable, and at open, the local copies of durable snapshots are
    evicted, the older first, each ref's newest durable tip last (their reads go to the
    remote store); never what a queued upload or a local-only snapshot needs. A put
    starts writing only once the tier fits the budget (so it ends at most its own new
    bytes over): it evicts durable copies, then waits for queued uploads (a warning;
    at most tier.uploader.BUDGET_WAIT seconds), then raises TierFull before writing anything,
    at once where waiting cannot help (docs/design/tiers.md, "Budget").
    replicas: with local=, under torch.distributed: after each collective put, every rank
    copies the objects of its part into the local tiers of the next `replicas` ranks
    (r+1 .. r+replicas mod W), and a collective checkout fetches what its tier lacks from
    them, by address, before it reads the remote store (docs/design/tiers.md, "Peer
    replicas"). Set per store, not per put: the ranks must agree, and a CheckpointManager
    needs no new argument.
    memory: the local tier in host memory instead of on a disk: True (a directory of this
    store and rank under /dev/shm) or a directory on a tmpfs; a tier like local='s in
    all else, whose bytes outlive the worker and die with the node (docs/design/memtier.md).
    With replicas=k each rank's part has k copies on ranks of other nodes; a snapshot
    the schedule keeps out of the remote (durable_every) is published once they are sent.
    durable_every: with a tier (local= or memory=), the remote store gets the first
    snapshot of each ref this process puts, then every N-th (an int), or, given a
    datetime.timedelta, the first put once that long passed since the ref's last uploaded
    one (rank 0's clock decides for a collective snapshot); the others stay in the tiers
    (their commit's meta marks them `tier_only`), each until a newer snapshot of its ref
    is published there. Default 1: every snapshot is uploaded.
    early_upload: with local=, send each new block to the remote store from memory while
    the put writes it (docs/design/tiers.md, "The early upload"): the snapshot is durable
    sooner, and the sends take CPU from the put. None (the default): on when the host has
    8 cores or more (tier.uploader.EARLY_UPLOAD_CORES), where the sends find cores to spare.

    The network's limits:
    write_bandwidth, write_concurrency: bytes per second, and requests at once, that the
    store's writes may take (storage/wrappers.py; default: no limit).
    workers: threads that hash, code and write blocks (default: core.DEFAULT_WORKERS).
    max_inflight, when_busy: asynchronous puts queued at once, and what a put past them
    does: "wait" for a slot or "skip" the snapshot.
    saver: where an asynchronous put's blocks are hashed, coded and written: "thread"
    (default: threads of this process) or "process" (a saver process fed through shared
    memory, off this process's GIL; docs/design/saver.md). The staging, the manifest, the
    commit and the collective protocol stay here. With a local tier (local=), the saver
    runs the uploads to the remote instead (the tier's puts write its disk on threads;
    there is no early upload). "process" needs a store on a local folder or an object
    store (not memory://), and a wrap_storage the saver can apply too: one pickle can
    carry to a new process (a function of an importable module, or a functools.partial
    of one with picklable arguments; not one of the script run as __main__, nor a lambda).
    saver_nice: the saver process's niceness, 0-19 (default 10): the training loop wins
    the cores and the saver takes what they leave, so a snapshot may take longer where
    the loop keeps every core busy; 0 shares them equally.
    host_memory: the bytes an asynchronous put's staging may hold in host memory, every
    snapshot in flight together (its staging buffers, which with saver="process" are the
    saver's shared memory too; docs/design/saver.md, "Host memory"). A put whose buffer
    would pass it waits for earlier ones to finish (or with when_busy="skip" is skipped).
    A state larger than it is staged in waves: part copied, written, the next part
    copied into the same buffer, all before put_snapshot returns (the stall grows with the
    state, the memory does not: at most the bound, or one block where a block is larger);
    an asynchronous collective put refuses such a state (InvalidArgument, on every rank).
    "auto" (default): a quarter of the memory this process may use (MemTotal, or its
    cgroup's limit where lower) divided by $LOCAL_WORLD_SIZE (the ranks on this node,
    torchrun sets it): staging.default_host_memory(). An int >= 1: that many bytes. None:
    no bound. Store.staging reports what is held.
    retry_budget: seconds a failed request to remote storage or to a PostgreSQL ref table
    is retried for (connection lost or refused, timeouts, 5xx, throttling), from its
    first failure, with capped exponential backoff and jitter (retry.py). None (the
    default): $TSCK_RETRY_BUDGET, else 60, which rides out a PostgreSQL failover or a
    spell of S3 throttling; 0 retries nothing. What retrying cannot cure (refused
    credentials, a missing database, a 4xx other than throttling) fails at once.
    storage_options: passed to fsspec (s3fs: endpoint_url, key, secret, ...).
    wrap_storage: a callable given the store's storage and returning the storage to use
    (a wrapper: fault injection in the tests, a gate); with saver="process" the saver
    process wraps the storage it writes with it too.

    gc_lease: seconds a gc run through this Store (store.gc()) holds the store between
    two renewals (default 120); others judge it on the ref table's clock.

    shared_reads: in a collective checkout (torch.distributed), a block several ranks read
    (DDP's replicated weights, HSDP's replicas, a base model every rank holds) is read from
    storage once, by one rank, and sent to the others over a TCP side channel, each copy
    checked against its address (docs/design/collective.md, "A restore reads each byte
    once"). None (the default): on for an object store, off for a local disk or memory://
    (reads there are no requests); rank 0's store decides for every rank. Not with a local
    tier (each rank reads its own tier first).

    watch_writes: True (the default): a host tensor of 1 MiB or more that the kernel proves
    unchanged since this process stored it (no page of it written: userfaultfd
    write-protection, Linux 6.7+) is neither copied nor hashed again; its blocks are only
    looked for (docs/design/unchanged.md). A frozen base costs nothing
    per snapshot. False: every tensor is copied and hashed at every snapshot (for memory
    that a device or a NIC writes by DMA without the memory being pinned through torch)."""
    stored = _Stored.checked(block_size, inline_threshold, compression, verify, pack_size)
    network = _Network.checked(write_bandwidth, write_concurrency, workers, max_inflight, retry_budget, when_busy,
                               storage_options, wrap_storage, saver, saver_nice, host_memory)
    refs_at = _Refs.checked(refs, create_refs, read_only)
    tier = _Tier.checked(url, local, local_budget, replicas, early_upload, refs_at, memory, durable_every)
    if saver == "process":
        _check_saver(url)
    gc_lease = _checked_gc_lease(gc_lease)
    if shared_reads is not None and not isinstance(shared_reads, bool):
        raise InvalidArgument(f"shared_reads must be True, False or None (the default: on for an object store), "
                              f"got {shared_reads!r}")
    if shared_reads and local is not None:
        raise InvalidArgument("shared_reads=True is for a store without a local tier (local=): through a tier "
                              "each rank reads its own tier first, its peers' replicas, then the remote")
    if not isinstance(watch_writes, bool):
        raise InvalidArgument(f"watch_writes must be True or False, got {watch_writes!r}")
    store = _open(url, create, stored, refs_at, tier, network, gc_lease, shared_reads)
    store.watch_writes = watch_writes
    return store


# -- the option groups, each checked on its own --------------------------------------------

def _saver_can_wrap(wrap_storage) -> None:
    """A saver process applies wrap_storage to the storage it opens (SaverRecipe): it must
    reach the process by pickle, by reference to a module the process can import."""
    import pickle
    try:
        data = pickle.dumps(wrap_storage)
    except Exception as e:  # noqa: BLE001 - any pickling failure says the same
        raise InvalidArgument(f"saver='process' with wrap_storage={wrap_storage!r}: the saver process cannot be "
                              f"given it ({type(e).__name__}: {e}); use a function of an importable module (or a "
                              "functools.partial of one), or saver='thread'") from None
    if b"__main__" in data:
        raise InvalidArgument(f"saver='process' with wrap_storage={wrap_storage!r}: it is defined in the script run "
                              "as __main__, which the saver process cannot import; move it to a module, or use "
                              "saver='thread'")


@dataclass(frozen=True)
class _Stored:
    """What is stored: the block layout of a new store and the codecs new blocks get."""
    block_size: int | None
    inline_threshold: int | None
    compression: str
    verify: bool
    new_layout: tuple[int, int]  # (block_size, inline_threshold) a store made now gets
    pack_size: int | None = None

    @classmethod
    def checked(cls, block_size, inline_threshold, compression, verify, pack_size=None) -> "_Stored":
        new_layout = layout(block_size, inline_threshold)
        check_options(compression=compression, pack_size=pack_size)
        return cls(block_size, inline_threshold, compression, verify, new_layout, pack_size)


@dataclass(frozen=True)
class _Refs:
    """Where the refs live: the ref table's location, whether it may be made, read-only."""
    refs: object
    create_refs: bool
    read_only: bool | None

    @classmethod
    def checked(cls, refs, create_refs, read_only) -> "_Refs":
        if read_only is not None and not isinstance(read_only, bool):
            raise InvalidArgument(f"read_only must be True, False or None, got {read_only!r}")
        return cls(refs, create_refs, read_only)


@dataclass(frozen=True)
class _NoTier:
    """No local tier (no local=): the store is opened as it is asked for. What differs
    with a tier is asked of this object or of _Tier, never whether there is one."""

    def read_only(self, read_only: bool | None) -> bool | None:
        return read_only

    def backoff(self, backoff):
        return backoff

    def lazily(self, proto: str, create_refs: bool, open_lazily) -> Store | None:
        return None

    def store(self, plain, tiered_) -> Store:
        return plain()


@dataclass(frozen=True)
class _Tier:
    """The local tier in front of the store: its directory and what it does."""
    local: str
    budget: int | None
    replicas: int
    early_upload: bool | None
    durable_every: int | datetime.timedelta = 1
    memory: bool = False

    def read_only(self, read_only: bool | None) -> bool:
        return False  # a tier is for writing (a read-only open with local= is refused)

    def backoff(self, backoff):
        # The remote's retries end when the store closes (Uploader.close): a close with
        # the remote away must not wait out the retry budget.
        return backoff.stoppable()

    def lazily(self, proto: str, create_refs: bool, open_lazily) -> Store | None:
        """An object store behind a tier is opened at its first use (tier/opening.py's
        lazy_tiered), unless the open makes its ref table -> the Store, or None to open
        it now."""
        return open_lazily(self) if proto in LAZY_PROTOCOLS and not create_refs else None

    def store(self, plain, tiered_) -> Store:
        return tiered_(self)

    @classmethod
    def checked(cls, url, local, local_budget, replicas, early_upload, refs_at: _Refs, memory=None,
                durable_every=1) -> "_Tier | _NoTier":
        """_NoTier without local= or memory= (then each tier option is refused, naming local=)."""
        if isinstance(durable_every, datetime.timedelta):
            if durable_every.total_seconds() <= 0:
                raise InvalidArgument(f"durable_every as a time must be more than none, got {durable_every!r}")
        elif isinstance(durable_every, bool) or not isinstance(durable_every, int) or durable_every < 1:
            raise InvalidArgument(f"durable_every must be an int >= 1 (every N-th snapshot) or a datetime.timedelta "
                                  f"(the first snapshot once that long passed), got {durable_every!r}")
        if memory is not None and memory is not False:
            if local is not None:
                raise InvalidArgument("local= and memory= each name the store's tier: give one of them")
            from .tier.memory import default_budget, memory_dir
            local = memory_dir(memory, url)
            if local_budget is None:
                local_budget = default_budget(local)
        if (isinstance(durable_every, datetime.timedelta) or durable_every > 1) and local is None:
            raise InvalidArgument("durable_every= keeps snapshots in a tier between uploads: it needs local= or "
                                  "memory=")
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
            raise InvalidArgument(f"replicas must be an int >= 0, got {replicas!r}")
        if replicas and local is None:
            raise InvalidArgument("replicas= copies into the local tiers of other ranks: it needs local=")
        if local is not None:
            if not isinstance(local, (str, os.PathLike)) or not os.fspath(local):
                raise InvalidArgument(f"local must be a directory path, got {local!r}")
            if refs_at.read_only:
                raise InvalidArgument("a local tier is for writing: open the store read-only without local=")
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
        if local is None:
            return _NoTier()
        local = os.fspath(local)
        proto, rest = split_url(url)
        if proto == "file" and os.path.realpath(rest) == os.path.realpath(local):
            raise InvalidArgument(f"local tier {local!r} is the store itself: give it a directory of its own")
        refuse_lost_table(os.path.abspath(local))  # before the remote is opened: whatever the network does
        return cls(local, local_budget, replicas, early_upload, durable_every, memory not in (None, False))


@dataclass(frozen=True)
class _Network:
    """The network's limits: bandwidth, requests and threads, queued puts, retries, and
    the storage's options and wrapper."""
    write_bandwidth: float | None
    write_concurrency: int | None
    workers: int | None
    max_inflight: int
    backoff: object  # retry.Backoff of retry_budget
    when_busy: str
    storage_options: dict | None
    wrap_storage: object
    saver: str
    saver_nice: int
    host_memory: int | None = None  # bytes the staging of asynchronous puts may hold (None: no bound)

    @classmethod
    def checked(cls, write_bandwidth, write_concurrency, workers, max_inflight, retry_budget, when_busy,
                storage_options, wrap_storage, saver, saver_nice, host_memory="auto") -> "_Network":
        check_options(workers=workers, max_inflight=max_inflight, when_busy=when_busy, saver=saver,
                      saver_nice=saver_nice)
        if saver == "process" and wrap_storage is not None:
            _saver_can_wrap(wrap_storage)
        from .util.retry import backoff_for
        return cls(write_bandwidth, write_concurrency, workers, max_inflight, backoff_for(retry_budget), when_busy,
                   storage_options, wrap_storage, saver, saver_nice, _checked_host_memory(host_memory))

    def saver_for(self, proto: str, rest: str, settings: Settings, codecs: str,
                  src: str | None = None) -> Saver | None:
        """The saver process that writes to this storage (None: saver="thread"), started at
        its first job; src: the local tier whose uploads it runs."""
        if self.saver != "process":
            return None
        return Saver(SaverRecipe(proto, rest, self.storage_options, self.backoff.budget, self.write_bandwidth,
                                 self.write_concurrency, codecs, settings.workers, self.saver_nice, src,
                                 self.wrap_storage))

    def wrapped(self, storage: BlockStore) -> BlockStore:
        return wrapped(storage, self.write_bandwidth, self.write_concurrency, self.wrap_storage)


def _checked_host_memory(host_memory) -> int | None:
    """open_store(host_memory=) -> the bound in bytes (None: no bound)."""
    if isinstance(host_memory, str) and host_memory == "auto":
        from .write.staging import default_host_memory
        return default_host_memory()
    if host_memory is None:
        return None
    if isinstance(host_memory, bool) or not isinstance(host_memory, int) or host_memory < 1:
        raise InvalidArgument(f"host_memory must be a number of bytes (an int >= 1), 'auto' or None (no bound), "
                              f"got {host_memory!r}")
    return host_memory


def _check_saver(url) -> None:
    """What saver="process" cannot serve, refused before anything is opened or made."""
    if split_url(url)[0] == "memory":
        raise InvalidArgument("saver='process' cannot be used with a memory:// store: another process cannot "
                              "see its objects; use saver='thread'")
    if not hasattr(os, "memfd_create"):
        raise InvalidArgument("saver='process' needs Linux (its staging buffers are memfd shared memory); "
                              "use saver='thread'")


def _checked_gc_lease(gc_lease):
    check_options(gc_lease=gc_lease)
    return gc_lease


# -- opening --------------------------------------------------------------------------------

def _open(url, create: bool, stored: _Stored, refs_at: _Refs, tier: _Tier | _NoTier, network: _Network,
          gc_lease, shared_reads: bool | None = None) -> Store:
    """The checked options -> the Store: its storage, marker, ref table and Core."""
    refs, create_refs = refs_at.refs, refs_at.create_refs
    read_only, backoff = tier.read_only(refs_at.read_only), tier.backoff(network.backoff)
    proto, rest = split_url(url)

    def settings(storage, cfg, read_only):
        return settings_for(storage, cfg, workers=network.workers, verify=stored.verify,
                            compression=stored.compression, block_size=stored.block_size,
                            inline_threshold=stored.inline_threshold, gc_lease=gc_lease, read_only=read_only,
                            pack_size=stored.pack_size)

    def tier_store(tier: _Tier):
        def make(lcore: Core, remote: Core, cfg: dict) -> Store:
            """The Store over a local tier's Core, the remote Core behind it (tier/opening.py)."""
            # saver="process": the saver runs the uploads, from the tier to the remote
            saver = network.saver_for(proto, rest, remote.settings, remote.assets.codecs, src=lcore.storage.root)
            return Store(lcore, config=cfg, max_inflight=network.max_inflight, when_busy=network.when_busy,
                         host_memory=network.host_memory,
                         tier=LocalTier(lcore, remote, budget=tier.budget, early=tier.early_upload,
                                        stop=backoff.stop, replicas=tier.replicas, saver=saver,
                                        durable_every=tier.durable_every, memory=tier.memory),
                         saver=saver)
        return make

    def open_lazily(tier: _Tier) -> Store | None:
        return lazy_tiered(tier.local, proto, rest, refs, network.storage_options, backoff,
                           lambda: remote_storage(proto, rest, network.storage_options, backoff),
                           network.wrapped,
                           dict(workers=network.workers, verify=stored.verify, compression=stored.compression,
                                block_size=stored.block_size, inline_threshold=stored.inline_threshold,
                                gc_lease=gc_lease, read_only=None, pack_size=stored.pack_size),
                           tier_store(tier))

    if refs is None and proto not in ("file", "memory"):  # say so before writing anything there
        open_refs(refs, proto, rest, create=False)
    store = tier.lazily(proto, create_refs, open_lazily)
    if store is not None:
        return store
    storage, rest, read_only, why_ro = _storage(proto, rest, refs, read_only, create, network.storage_options,
                                                backoff)
    if read_only:  # nothing below creates anything
        create = create_refs = False
    cfg, created = _marker(storage, create, read_only, stored.new_layout)
    store_id = str(cfg.get("id") or storage.url)
    reftable = _reftable(url, storage, refs, proto, rest, store_id, created=created, create_refs=create_refs,
                         read_only=read_only, backoff=backoff)
    storage = network.wrapped(storage)
    try:
        settings_, codecs = settings(storage, cfg, why_ro if read_only else None)
        core = Core.build(storage, reftable, codecs=codecs, settings=settings_)

        def plain() -> Store:
            return Store(core, config=cfg, max_inflight=network.max_inflight, when_busy=network.when_busy,
                         host_memory=network.host_memory,
                         saver=None if read_only else network.saver_for(proto, rest, settings_, codecs),
                         shared_reads=shared_reads)

        def tiered_(tier: _Tier) -> Store:
            try:
                location = remote_location(proto, rest, network.storage_options)
                store = tiered(tier.local, core, cfg, store_id, codecs, settings_, tier_store(tier),
                               location=location)
                if location is not None:
                    record_location(reftable, location, cfg)
                return store
            except BaseException:
                core.pool.shutdown(wait=False)
                raise
        return tier.store(plain, tiered_)
    except BaseException:
        if not isinstance(refs, RefTable):  # a table we opened, not the caller's
            reftable.close()
        raise


def _storage(proto: str, rest: str, refs, read_only: bool | None, create: bool, storage_options, backoff):
    """-> (storage, rest, read_only, why_ro): the store's storage (a local folder made
    when it may be), whether it is opened read-only and why (asked for, or files that
    are not writable); read-only storage refuses any write that slips through."""
    why_ro = "read_only=True was asked for" if read_only else ""
    if proto == "file":
        root = os.path.abspath(rest)
        if os.path.exists(root) and not os.path.isdir(root):
            raise NotAStore(f"{root} is a file, not a store")
        if read_only is None:
            lmdb_dir = lmdb_path(refs, proto, root)
            why_ro = unwritable([root] + ([lmdb_dir, os.path.join(lmdb_dir, "data.mdb"),
                                            os.path.join(lmdb_dir, "lock.mdb")] if lmdb_dir else []))
            read_only = why_ro is not None
        if not os.path.isdir(root):
            if read_only:
                raise NotAStore(f"no store at {root} (no such directory; opened read-only: nothing is created)")
            if not create:
                raise NotAStore(f"no store at {root} (no such directory; check the path, or {CREATE_HINT})")
            try:
                os.makedirs(root, exist_ok=True)  # several processes may create one store at once
            except OSError as e:
                raise NotAStore(f"cannot create a store at {root}: {e.strerror}") from None
        storage: BlockStore = LocalBlockStore(root)
        rest = root
    else:
        storage = remote_storage(proto, rest, storage_options, backoff)
    read_only = bool(read_only)
    if read_only:
        from .storage.wrappers import ReadOnlyStorage
        storage = ReadOnlyStorage(storage)
    return storage, rest, read_only, why_ro


def _marker(storage: BlockStore, create: bool, read_only: bool, new_layout: tuple[int, int]) -> tuple[dict, bool]:
    """-> (the store's config, whether this open created the store): the marker read, or
    written exclusively where the location is empty and `create` allows it."""
    cfg = read_config(storage)
    if cfg is None:
        # Temp files of in-flight writes (a creator killed while writing the marker
        # leaves one) do not make a folder "not empty".
        if not storage.is_empty():
            cfg = read_config(storage)  # another process may have just created the store
            if cfg is None:
                raise NotAStore(f"{storage.url} is not empty and holds no {STORE_MARKER}: not a store")
    if cfg is not None:
        return cfg, False
    if not create:
        if read_only:
            raise NotAStore(f"no store at {storage.url} (nothing there; opened read-only: nothing is created)")
        raise NotAStore(f"no store at {storage.url} (nothing there; check the path, or {CREATE_HINT})")
    cfg = {"format": "tensorstore_ck", "version": STORE_VERSION, "created": time.time(),
           "id": uuid.uuid4().hex,  # names this store in a shared ref table (PostgreSQL)
           "block_size": new_layout[0], "inline_threshold": new_layout[1]}
    # Exclusive create: if another process won the race, its marker is the one we read.
    created = create_marker(storage, marker_bytes(cfg))
    return read_config(storage) or cfg, created


def _reftable(url, storage: BlockStore, refs, proto: str, rest: str, store_id: str, *, created: bool,
              create_refs: bool, read_only: bool, backoff) -> RefTable:
    """The store's ref table, opened and bound to its id. A missing ref table next to an
    existing store is never silently created empty: an empty table makes gc think nothing
    is kept (recover rebuilds it)."""
    fresh = created
    try:
        reftable = open_refs(refs, proto, rest, create=created or create_refs, store_id=store_id,
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
        reftable = open_refs(refs, proto, rest, create=True, store_id=store_id, backoff=backoff)
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
    return reftable
