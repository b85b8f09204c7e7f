"""tensorstore_ck: a content-addressed snapshot store for the state of ML training jobs.

Layers, top to bottom (nothing imports upward; checked by tests/test_layers.py):

    cli.py, __main__.py   `tsck`: --json, exit codes 0 / 1 / 2
    hf.py                 Hugging Face Trainer callback and resume, model folders (imports
                          transformers: the [hf] extra; nothing here imports it)
    dcp/                  torch.distributed.checkpoint StorageWriter/Reader (metadata, layout,
                          writer, reader, handle)
    train.py, loader.py   TrainState, CheckpointManager; ResumableDataLoader (exact resume)
    lightning.py          PyTorch Lightning CheckpointIO (the [lightning] extra; never imported here)
    opener.py             open_store(): URL -> storage stack + ref table + Core + Store; the
                          options, checked and translated into Settings in one place
    store.py              Store facade: put_snapshot, checkout, targets, log, lifecycle calls;
                          it hands the layers below its Core, never itself
    asyncput.py           put_snapshot(blocking=False): staging, slots, the background publisher
    lifecycle.py          tags, pins, forget, delete_ref: fenced against gc, rolled back on failure
    dist.py               collective put/checkout under torch.distributed (a CollectiveJob)
    gc.py, fsck.py,       expire, mark, sweep (safe with concurrent writers); verify kept
    recover.py            snapshots; rebuild the ref table from storage
    publish.py            the one publisher: blocks -> nodes -> commit -> fenced CAS -> retry
    reach.py, usage.py    what the kept snapshots reach (gc's mark); `tsck du` and its plot's numbers
    listing.py            `tsck ls`, `tsck diff`: values from the nodes (no blocks, no torch)
    plan.py, read.py,     state -> plan (validated before any write); nodes -> state (read_box:
    walk.py               sharded regions); the DAG without tensor data (gc, fsck, diff)
    core.py               Core: storage, assets, ref table, I/O pool and settings of one store,
                          what the layers below the facade are given
    assets.py             typed, verified object I/O; the only module that knows keys
    validate.py, info.py, snapshot arguments; SnapshotInfo; retention rules; Sharded/Replicated;
    retention.py, shard.py, reused host buffers for async snapshots
    staging.py
    storage/, refs/       BlockStore backends (local, fsspec, wrappers); RefTable (LMDB,
                          PostgreSQL, in-memory)
    chunker.py, ids.py    tensor bytes -> element-aligned blocks; digests and hex prefixes
    format/               bytes <-> objects, no I/O: frame, manifest envelopes, tree (the
                          manifest grammar), dtypes
    errors.py             the TsckError tree
"""

import logging as _logging

from . import errors
from .errors import (AmbiguousTarget, CheckoutMismatch, DeviceUnavailable, Fenced, FormatError, GcBusy,
                     IntegrityError, InvalidArgument, InvalidName, NotAStore, OutcomeUnknown, ReadOnlyStore,
                     RebuildUnfinished, RefConflict, RefNotFound, SnapshotAborted, StorageError, StoreClosed,
                     TsckError, UnreadableObject, UnsupportedType)
from .retention import Retention
from .shard import Replicated, Sharded
from .info import SnapshotInfo
from .opener import open_store
from .store import Store

__version__ = "0.1.0"

# The training helpers import torch (as do put_snapshot and checkout, when first called);
# loaded when first named, so `import tensorstore_ck` and the `tsck` commands that only
# read refs and manifests (refs, log, fsck, gc) start without torch.
_LAZY = {"ResumableDataLoader": "loader", "TrainState": "train", "CheckpointManager": "train"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))

# The library logs retries, reconnects, gc phases, fences waited out and recover's
# decisions to the "tensorstore_ck" logger (child loggers per module); it prints
# nothing unless the application configures logging.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

__all__ = [
    "open_store", "Store", "SnapshotInfo", "Retention", "TrainState", "CheckpointManager",
    "ResumableDataLoader", "Sharded", "Replicated", "errors", "TsckError", "RefConflict", "RefNotFound",
    "IntegrityError", "FormatError", "UnsupportedType", "InvalidArgument", "InvalidName", "NotAStore",
    "CheckoutMismatch", "DeviceUnavailable", "AmbiguousTarget", "SnapshotAborted", "StorageError", "Fenced", "GcBusy", "StoreClosed",
    "ReadOnlyStore", "RebuildUnfinished", "UnreadableObject", "OutcomeUnknown", "__version__",
]
