"""torch.distributed.checkpoint (DCP) storage for tensorstore_ck.

    import torch.distributed.checkpoint as dcp
    from tensorstore_ck.dcp import TsckWriter, TsckReader

    dcp.save(sd, storage_writer=TsckWriter(store, ref="jobA/main", step=100))
    dcp.load(sd, storage_reader=TsckReader(store, "jobA/main"))
    dcp.async_save(sd, storage_writer=TsckWriter(store, ref="jobA/main", step=200)).result()

DCP keeps doing the planning (flattening, deduplication of replicated items,
resharding on load); this module only stores what DCP asks it to store, as
one ordinary snapshot:

* every rank writes the blocks of its own chunks (hashed, deduplicated,
  written in parallel on the store's pool); only digests travel to the
  coordinator, inside ``WriteResult.storage_data``;
* the coordinator's ``finish`` composes one manifest tree and publishes it
  through the store's Publisher (one commit, one ref move, fenced against gc;
  if a gc deletion phase overlaps, it waits it out and checks that every block
  still exists, else raises ``SnapshotAborted`` and publishes nothing).

The tree is a plain state tree, so ``store.checkout(ref)`` works on it too::

    {"format": "dcp", "version": 1,
     "tensors":  {fqn: G leaf (global dtype and shape, every chunk of every rank)},
     "bytes":    {fqn: bytes  (DCP's torch.save'd non-tensor values; values over
                        1 MiB are stored as blocks: a 1-D uint8 tensor leaf)},
     "metadata": {"version", "state_dict_metadata", "planner_data", "storage_data",
                  "storage_meta"}}

``metadata`` is DCP's ``Metadata`` encoded field by field (dtypes, layouts and
memory formats by name, sizes as lists, tuples kept as tuples), never pickled;
``TsckReader.read_metadata`` rebuilds it exactly. Large containers are split
into child nodes (``{"r": digest}``), so an unchanged tensor's entry is shared
between snapshots, and a rank reading a few tensors reads only their nodes.

Loading reads, for each ``ReadItem``, only the blocks of the stored chunk that
intersect the requested rows, verifies them against their addresses, and
copies the requested box into ``planner.resolve_tensor(item)``.

Non-tensor values are what torch's weights_only loader takes, on both sides,
as with put_snapshot and checkout: anything else needs ``allow_pickle=True`` on
TsckWriter to store and on TsckReader to load (DCP's planner would otherwise
unpickle stored bytes with ``weights_only=False``).

Known limits: ``use_collectives=False`` under a process group of more than one
rank is refused (every rank would publish its own snapshot); quantized and
non-strided tensors are refused (``UnsupportedType``); a writer is picklable
(for ``AsyncCheckpointerType.PROCESS``) only when its store is a local folder
with its ref table beside it, and it then reopens the store in the other process.

Modules: metadata.py (Metadata <-> plain values), layout.py (the snapshot tree:
composing it and reading it back through the manifest grammar), writer.py
(TsckWriter), reader.py (TsckReader), handle.py (reopening a store in another
process).

Its modules:

    metadata.py       DCP Metadata <-> plain values (no pickle)
    layout.py         the tree of a DCP snapshot, composed by the writer, read by the reader
    writer.py         TsckWriter: one snapshot per dcp.save
    reader.py         TsckReader: a StorageReader over one snapshot
    native.py         a put_snapshot snapshot seen by dcp.load
    handle.py         reopening a store in another process (async_save's PROCESS checkpointer)
"""

from .layout import DCP_FORMAT, DCP_LAYOUT_VERSION
from .metadata import decode_metadata, encode_metadata
from .reader import TsckReader
from .writer import TsckStorageData, TsckWriter

__all__ = ["TsckWriter", "TsckReader", "TsckStorageData", "DCP_FORMAT", "DCP_LAYOUT_VERSION",
           "encode_metadata", "decode_metadata"]
