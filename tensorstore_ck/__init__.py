"""tensorstore_ck: a content-addressed snapshot store for the state of ML training jobs.

Layers, top to bottom (nothing calls upward):

    store.py      Store facade, open_store(): publication order, targets, log
    state.py      state tree <-> manifest values; parallel block jobs
    assets.py     typed, verified object I/O (blocks, nodes, commits); owns the keys
    format/       bytes <-> objects (frame header, codecs, msgpack nodes); no I/O
    storage/      BlockStore backends (local with fsync, any fsspec URL)
    refs/         RefTable backends (LMDB, in-memory): CAS, reflog, catalog, tags, pins
    chunker.py    tensor bytes -> element-aligned blocks
    retention.py  per-job rules -> snapshots to keep
    gc.py         expire, mark, sweep (safe with concurrent writers)
    fsck.py       verify kept snapshots; recover.py rebuilds the ref table from storage
    walk.py       the Merkle DAG without tensor data (gc, fsck, diff)
    train.py      TrainState, CheckpointManager, ResumableDataLoader (exact resume)
    staging.py    reused host buffers for asynchronous snapshots
"""

from . import errors
from .errors import (AmbiguousTarget, CheckoutMismatch, Fenced, FormatError, GcBusy, IntegrityError, InvalidArgument,
                     InvalidName, NotAStore, RefConflict, RefNotFound, SnapshotAborted, StorageError, TsckError,
                     UnsupportedType)
from .retention import Retention
from .shard import Replicated, Sharded
from .info import SnapshotInfo
from .opener import open_store
from .store import Store
from .loader import ResumableDataLoader
from .train import CheckpointManager, TrainState

__version__ = "0.1.0"

__all__ = [
    "open_store", "Store", "SnapshotInfo", "Retention", "TrainState", "CheckpointManager",
    "ResumableDataLoader", "Sharded", "Replicated", "errors", "TsckError", "RefConflict", "RefNotFound",
    "IntegrityError", "FormatError", "UnsupportedType", "InvalidArgument", "InvalidName", "NotAStore",
    "CheckoutMismatch", "AmbiguousTarget", "SnapshotAborted", "StorageError", "Fenced", "GcBusy", "__version__",
]
