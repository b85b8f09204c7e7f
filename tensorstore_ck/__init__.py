"""tensorstore_ck: a content-addressed snapshot store for the state of ML training jobs.

Where a put's state goes. Store.put_snapshot (store.py) checks its arguments
(validate.py), then the Planner (plan.py) validates the whole state and cuts every
tensor into block jobs (chunker.py) before anything is written; the Publisher
(publish.py) writes blocks -> manifest nodes (format/tree.py) -> commit, syncs, and
moves the ref by a fenced compare-and-swap in the ref table (refs/); every object goes
through Assets (assets.py: keys, frames, BLAKE3) into a BlockStore (storage/).
blocking=False stages the state first and publishes in the background (asyncput.py,
staging.py; with saver="process" a saver process writes its blocks, saver.py); under
torch.distributed the put is collective (dist.py). With a local tier (open_store(local=),
tier/) the Store's own store is the tier: the put publishes there,
LocalTier.published (tier/local.py) queues the snapshot, and tier/uploader.py copies
its objects to the remote store and moves the remote ref.

Where a checkout's target comes from. Store.checkout resolves the target in the ref
table through Core.resolve (core.py: a ref, a tag, REF@STEP, a root or its prefix); with
a tier, LocalTier.roots resolves it in both tiers and takes the newer (tier/reads.py).
The commit and its nodes are read through Assets (with a tier, tier/reads.py's
ReadThrough: the tier's copy, the remote's where one is missing or fails its check; a
collective checkout asks peer replicas first, tier/replicas.py), and the Reader
(read.py, entered through readpath.py's read_state) turns nodes into tensors, verifying
every block (a dcp.save snapshot through dcpstate.py; sharded regions read_world.py; devices placement.py).

Every module, by layer, top to bottom, each on one line. Nothing imports upward
(pyproject.toml's import-linter contracts: tests/test_layers.py); tests/test_docs.py
checks that every module is named here exactly once (a name in the first column; a
package's modules indented under it). A module over ~600 lines says which one job it does.

    __main__.py           `python -m tensorstore_ck`: the CLI's main()
    testing/              the contract suites, for a backend of one's own (imports pytest; nothing
                          here imports it)
      _common.py          threads started together, keys shaped like the store's
      blockstore.py       BlockStoreTests: the BlockStore contract (storage/base.py)
      reftable_rows.py    the RefTable contract's rows: refs, reflog, steps, catalog, tags, pins, retention
      reftable.py         RefTableTests: those, removals, gc state, rebuild mark, concurrency, persistence
    cli/                  `tsck`: --json, exit codes 0 / 1 / 2; main() opens the store, runs
                          the command and turns its errors into one line and an exit code
      parser.py           every command's arguments, $TSCK_STORE, the hints for a misread one
      snapshots.py        refs, log, show, ls, diff; tag, untag, pin, unpin, delete-ref, undelete, forget
      maintenance.py      init, du, gc, retention, fsck, recover
      interchange.py      checkout (a file or a model folder), export-weights, import
      common.py           what the groups share: sizes and times as shown, strict JSON, a local tier
    hf.py                 Hugging Face Trainer integration, one job over ~600 lines: the callback
                          that snapshots each save, resume_checkpoint (a snapshot back as the
                          checkpoint-N folder the Trainer resumes from), and from_pretrained
                          folders in and out (over hf_folder.py, importing.py). Imports transformers: the
                          [hf] extra; nothing else here imports it
    lightning.py          PyTorch Lightning CheckpointIO (the [lightning] extra; never imported here)
    metrics.py            on_commit hooks: snapshot times, stall, bytes and the durable lag as
                          TensorBoard scalars (any SummaryWriter) and Prometheus metrics (the
                          [prometheus] extra: prometheus_client, imported only when used)
    dcp/                  torch.distributed.checkpoint StorageWriter/Reader (dcp.save, dcp.load)
      metadata.py         DCP Metadata <-> plain values (no pickle)
      layout.py           the tree of a DCP snapshot, composed by the writer, read by the reader
      writer.py           TsckWriter: one snapshot per dcp.save
      reader.py           TsckReader: a StorageReader over one snapshot
      native.py           a put_snapshot snapshot seen by dcp.load
      handle.py           reopening a store in another process (async_save's PROCESS checkpointer)
    train/                TrainState (exact resume: the state and every RNG stream) and
                          CheckpointManager (when to snapshot; collective under torch.distributed)
      state.py            TrainState: the objects' state and every RNG stream, captured and put back
      manager.py          CheckpointManager: when to snapshot, and the snapshots taken
      watch.py            its on_commit and on_durable hooks, CommitEvent, the store's size measured
      outcomes.py         its failures, warned and counted; CloseReport
      collective.py       under torch.distributed: rank 0 decides, collective snapshots
      together.py         collective restores: every rank the same step, or the same error
      restoring.py        restore_latest, restore(step), the steps kept, a rollback recorded
    export.py             a snapshot out as one safetensors / torch.save file (`tsck checkout`);
                          the model's weights alone (export_weights, `tsck export-weights`)
    importing.py          torch.save, safetensors files and model folders in (`tsck import`)
    plot.py               `tsck du --plot`: the store's usage as a picture
    hf_folder.py          the Hugging Face model folder (save_pretrained's layout, meta "hf")
                          and the safetensors view of a state
    opener.py             open_store(): its options checked by group, then URL -> storage stack +
                          ref table + Core + Store
    locate.py             where a store is: URLs, the marker, its storage and ref table, the
                          options translated into Settings in one place (open_store and the tier)
    pruner.py             a training job's retention applied while it trains, in the background
                          (CheckpointManager's and the Hugging Face callback's)
    store.py              Store facade: put_snapshot, checkout, targets, log, lifecycle calls;
                          it hands the layers below its Core, never itself (one job over
                          ~600 lines: every public call, each handed to the room that does it)
    asyncput.py           put_snapshot(blocking=False): staging, slots, the background publisher
    saver.py              the saver process: an asynchronous put's blocks written off this
                          process's GIL (open_store(saver="process")), and its own loop
    lifecycle.py          tags, pins, forget, delete_ref: fenced against gc, rolled back on failure
    dist/                 collective put/checkout under torch.distributed (a CollectiveJob):
      put.py              the collective put, round by round (PutCall.run)
      checkout.py         the collective checkout, given resolve and read as roles
      job.py              CollectiveJob: what a call is given by the Store that makes it
      channel.py          a call's keys in the c10d Store: waits, aborts, claims, acks, the
                          out-of-step checks, rank 0's heartbeat; StoreGroup
      layout.py           rank 0's check that the ranks' pieces tile; the layouts it keeps
      naming.py           the names of calls (CollectiveContext, CALLS), the same on every rank
    gc.py, fsck.py,       expire, mark, sweep (safe with concurrent writers); verify kept
    recover.py            snapshots; rebuild the ref table from storage (gc.py one job over
                          ~600 lines: a gc or prune from its lock to its report)
    tier/                 a local tier in front of a remote store (open_store(local=)):
      local.py            LocalTier, what a Store over a tier holds (the one object it calls)
      opening.py          the tier's Core and Store made; the remote opened on first use
      uploader.py         queued local snapshots -> the remote store: objects it lacks as
                          stored, then the fenced move of its ref; the budget's back-pressure
                          (one job over ~600 lines: a queued snapshot until it is durable)
      holds.py            one catalog: the tier's tags and pins made in the remote table
      collective.py       collective puts through tiers: each rank's part, rank 0's move
      replicas.py         peer replicas over a TCP side channel
      budget.py           the tier's bytes, and evicting durable copies to fit
      outage.py           outages: which upload failures are waited out, how far the remote lags
      reads.py            reads through the tier with the remote behind; the newer tier
    publish.py            the whole write path, one job over ~600 lines: block jobs -> nodes ->
                          commit -> fenced CAS -> retry (the refused commits removed), and
                          the stats of what was written
    reach.py              which stored objects the kept snapshots reach (gc's mark, fsck's orphans)
    plancache.py          the layouts a Store's puts planned lately: a state of the same layout
                          planned from one, staged in one copy call (thousands of tensors)
    packparts.py          packs that keep dedup: a packed tensor a stored pack holds names that
                          part; new packs form from the rest; packs under half named abandoned
    usage.py              `tsck du` and its plot: the store's bytes per job and over time
    readpath.py           the read path's front door: every checkout enters through read_state
    dcpstate.py           a dcp.save snapshot read by checkout as the state that was saved
    listing.py            `tsck ls`, `tsck diff`, `tsck log/refs`: snapshots described from their
                          nodes and catalog rows (no blocks, no torch)
    read.py               nodes -> state: the Reader of one snapshot (one job, ~600 lines)
    walk.py               the DAG without tensor data (gc, fsck, diff)
    plan.py               state -> plan: every value validated and cut into block jobs before
                          any write; nothing in it writes
    core.py               Core: storage, assets, ref table, I/O pool and settings of one store,
                          what the layers below the facade are given
    read_world.py         sharded tensors and multi-rank snapshots read (read_box: a chunk's
                          region; a rank's view merged from the rank trees and chunk index)
    placement.py          map_location: where a checkout's fresh tensors go, unknown devices refused
    assets.py             typed, verified object I/O; the only module that knows keys (one
                          job over ~600 lines: every object kind in and out, verified)
    validate.py           snapshot arguments, checked once for every writer
    retention.py          retention rules and the snapshots they keep
    shard.py              Sharded / Replicated: a rank's piece of a global tensor
    world_view.py         one process's view of a collective snapshot: the ranks' trees merged
    readjobs.py           block reads run in parallel; a pack read once for all its parts wanted
    staging.py            reused host buffers for async snapshots
    loader.py             ResumableDataLoader: the data order, resumed exactly
    info.py               SnapshotInfo, DurableEvent
    ckpt_pointer.py       the pointer file at a Lightning checkpoint path (no Lightning needed)
    storage/              BlockStore backends: immutable objects under one root
      base.py             the BlockStore interface
      local.py            a local filesystem (atomic, durable writes)
      fsspec.py           any fsspec filesystem (memory://, gs://, az://, ...)
      s3.py               S3: its request model and error classes (through s3fs)
      aimd.py             the S3 client's send rate under throttling (AIMD; cuts that do not help pause)
      wrappers.py         read-only, retrying, throttled and fault-injecting wrappers
    refs/                 RefTable: ref name -> root, with reflog, catalog, tags and pins
      base.py             the interface and its logic over a small transactional key-value layer
      history.py          the reflog and REF@STEP's index
      gcstate.py          the gc lock, lease, phases, holds, fences and the prune queue
      tierstate.py        a local tier's rows: upload queue, durable/evicted marks, parts
      txn.py              the transactions its parts run in; the tables; the host clock
      lmdb.py             the embedded table (LMDB, beside local data)
      memory.py           the in-memory twin (memory:// stores, tests)
      postgres.py         PostgreSQL, for many hosts sharing one store
    chunker.py            tensor bytes -> element-aligned blocks
    presence.py           the presence record: objects a Store saw present, per gc epoch
    partindex.py          packed parts a Store may name again: content hash -> a stored pack's part
    roles.py              the roles layers play for one another (Protocols): object reader, ref-table parts
    retry.py              the one backoff policy for transient backend failures
    localfile.py          files outside the store's objects, whole or not at all; only
                          regular files are read
    progress.py           progress bars on stderr
    units.py              sizes as shown to people: decimal SI (kB, MB, GB), one system
    paths.py              dotted paths inside a state ("model.layers.0.weight")
    format/               bytes <-> objects, no I/O
      frame.py            the object frame: header, then the (maybe compressed) payload
      manifest.py         manifest node and commit envelopes
      tree.py             the manifest grammar: every value a node holds
      world.py            the top of a multi-rank snapshot: rank tree and chunk index
      dcp.py              the top of a dcp.save snapshot: recognized, its planner_data read
      dtypes.py           stored dtype names <-> torch and numpy dtypes
      names.py            ref/tag names and target strings
      records.py          ref-table records and stored tag objects
    ids.py                BLAKE3-256 digests, their hex form and prefixes
    errors.py             the TsckError tree
"""

import logging as _logging

from . import errors
from .errors import (AmbiguousTarget, CheckoutMismatch, DeviceUnavailable, Fenced, FormatError, GcBusy,
                     IntegrityError, InvalidArgument, InvalidName, NotAStore, OutcomeUnknown, ReadOnlyStore,
                     OutOfStep, RebuildUnfinished, RefConflict, RefNotFound, SnapshotAborted, SnapshotsFailed,
                     SnapshotWarning, StorageError, StoreClosed, TierFull, TsckError, UnreadableObject, UnsupportedType)
from .retention import Retention
from .shard import Replicated, Sharded
from .info import DurableEvent, SnapshotInfo
from .opener import open_store
from .store import Store

__version__ = "0.1.0"

# The training helpers import torch (as do put_snapshot and checkout, when first called);
# loaded when first named, so `import tensorstore_ck` and the `tsck` commands that only
# read refs and manifests (refs, log, fsck, gc) start without torch.
_LAZY = {"ResumableDataLoader": "loader", "TrainState": "train", "CheckpointManager": "train",
         "CommitEvent": "train", "CloseReport": "train", "export_weights": "export"}


def __getattr__(name: str):
    if name == "metrics":  # tsck.metrics: TensorBoard and Prometheus hooks (torch-free, loaded when named)
        import importlib
        return importlib.import_module(".metrics", __name__)
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | {"metrics"})

# The library logs retries, reconnects, gc phases, fences waited out and recover's
# decisions to the "tensorstore_ck" logger (child loggers per module); it prints
# nothing unless the application configures logging.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = [
    "open_store", "Store", "SnapshotInfo", "DurableEvent", "Retention", "TrainState", "CheckpointManager", "CommitEvent",
    "ResumableDataLoader", "Sharded", "Replicated", "errors", "TsckError", "RefConflict", "RefNotFound",
    "IntegrityError", "FormatError", "UnsupportedType", "InvalidArgument", "InvalidName", "NotAStore",
    "CheckoutMismatch", "DeviceUnavailable", "AmbiguousTarget", "SnapshotAborted", "StorageError", "Fenced", "GcBusy", "StoreClosed",
    "ReadOnlyStore", "RebuildUnfinished", "UnreadableObject", "OutcomeUnknown", "OutOfStep", "SnapshotsFailed", "TierFull",
    "SnapshotWarning", "CloseReport", "export_weights", "__version__",
]
