"""tensorstore_ck: a content-addressed snapshot store for the state of ML training jobs.

Where a put's state goes. Store.put_snapshot (store.py) checks its arguments
(core/validate.py), then the Planner (write/plan.py) validates the whole state and cuts
every tensor into block jobs (format/chunker.py) before anything is written; the
Publisher (write/publish.py) writes blocks -> manifest nodes (format/tree.py) -> commit,
syncs, and moves the ref by a fenced compare-and-swap in the ref table (refs/); every
object goes through Assets (core/assets.py: keys, frames, BLAKE3) into a BlockStore
(storage/). blocking=False stages the state and publishes in the background
(asyncput.py; with saver="process" a saver process writes its blocks, write/saver.py);
under torch.distributed the put is collective (collective/). With a local tier
(open_store(local=), tier/) the put publishes in the tier and tier/uploader.py copies
it to the remote store.

Where a checkout's target comes from. Store.checkout resolves the target through
Core.resolve (core/core.py; with a tier, the newer of the tier's and the remote's:
tier/reads.py), and the Reader (read/read.py, entered through read/readpath.py) turns
nodes into tensors, verifying every block.

The folders and the modules at the top, by layer, top to bottom (pyproject.toml's
import-linter contracts: tests/house/test_layers.py). Each folder's __init__ names its rooms;
tests/house/test_docs.py checks that every module is named once, here or there.

    __main__.py           `python -m tensorstore_ck`: the CLI's main()
    testing/              the contract suites, for a backend of one's own (imports pytest)
    cli/                  `tsck`: the commands, --json, exit codes 0 / 1 / 2
    dcp/                  torch.distributed.checkpoint StorageWriter/Reader (dcp.save, dcp.load)
    hf.py                 Hugging Face Trainer integration (the [hf] extra), one job over
                          ~600 lines: the callback, resume_checkpoint, model folders in and out
    lightning.py          PyTorch Lightning CheckpointIO (the [lightning] extra)
    accelerate.py         accelerate: save_state's objects through a CheckpointManager (the [hf] extra)
    torchtitan.py         torchtitan's CheckpointManager over a store (the [torchtitan] extra)
    metrics.py            on_commit hooks: TensorBoard scalars and Prometheus metrics
    opener.py             open_store(): options checked, URL -> storage stack + ref table + Store
    store.py              the Store facade: every public call, each handed to the room that does
                          it (one job over ~600 lines)
    asyncput.py           put_snapshot(blocking=False): staging, slots, the background publisher
    interchange/          snapshots in and out as files and model folders; the usage plot
    tier/                 a local tier in front of a remote store (open_store(local=))
    train/                TrainState, CheckpointManager, ResumableDataLoader
    collective/           collective put and checkout under torch.distributed
    maintain/             retention, gc, fsck, recover, tags and pins, usage
    read/                 the read path: nodes -> tensors, every block verified
    write/                the write path: plan, publish, packs, staging, the saver process
    core/                 the Core of one store, typed object I/O, the DAG walk, roles
    ckpt_pointer.py       the pointer file at a Lightning checkpoint path (its class is pickled
                          there, so it stays at this path)
    refs/                 RefTable: ref name -> root, with reflog, catalog, tags and pins
    storage/              BlockStore backends: immutable objects under one root
    format/               bytes <-> objects, no I/O
    util/                 small helpers every layer shares
    errors.py             the TsckError tree
    info.py               SnapshotInfo, DurableEvent
    goodput.py            the goodput model: a run's expected goodput, its best snapshot interval
"""

import logging as _logging

from . import errors
from .errors import (AmbiguousTarget, CheckoutMismatch, DeviceUnavailable, Fenced, FormatError, GcBusy,
                     IntegrityError, InvalidArgument, InvalidName, NotAStore, OutcomeUnknown, ReadOnlyStore,
                     OutOfStep, RebuildUnfinished, RefConflict, RefNotFound, SnapshotAborted, SnapshotsFailed,
                     SnapshotWarning, StorageError, StoreClosed, TierFull, TsckError, UnreadableObject, UnsupportedType)
from .info import DurableEvent, SnapshotInfo
from .maintain.retention import Retention
from .opener import open_store
from .store import Store
from .write.shard import Replicated, Sharded

__version__ = "0.1.0"

# The training helpers import torch (as do put_snapshot and checkout, when first called);
# loaded when first named, so `import tensorstore_ck` and the `tsck` commands that only
# read refs and manifests (refs, log, fsck, gc) start without torch.
_LAZY = {"ResumableDataLoader": "train.loader", "TrainState": "train", "CheckpointManager": "train",
         "CommitEvent": "train", "CloseReport": "train", "Preempted": "train", "export_weights": "interchange.export"}


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
    "Preempted", "ResumableDataLoader", "Sharded", "Replicated", "errors", "TsckError", "RefConflict", "RefNotFound",
    "IntegrityError", "FormatError", "UnsupportedType", "InvalidArgument", "InvalidName", "NotAStore",
    "CheckoutMismatch", "DeviceUnavailable", "AmbiguousTarget", "SnapshotAborted", "StorageError", "Fenced", "GcBusy", "StoreClosed",
    "ReadOnlyStore", "RebuildUnfinished", "UnreadableObject", "OutcomeUnknown", "OutOfStep", "SnapshotsFailed", "TierFull",
    "SnapshotWarning", "CloseReport", "export_weights", "__version__",
]
