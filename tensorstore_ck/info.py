"""SnapshotInfo: what a caller learns about one snapshot (put, log, show, refs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["SnapshotInfo", "DurableEvent", "row_to_info"]


@dataclass(frozen=True)
class SnapshotInfo:
    """One snapshot, as its commit recorded it. The byte counts (the one place they are
    defined; the committed log line, `tsck log`, `tsck show` and `tsck du` use them):

    bytes_total  logical bytes the snapshot holds: its tensors' bytes, in blocks or
                 inlined in its manifest nodes; under torch.distributed each rank's part
                 counts (a Replicated tensor once).
    bytes_new    logical bytes of what the snapshot added to the store, each object once
                 per store however many ranks wrote it: the raw bytes of the blocks it
                 stored first, plus the tensor bytes inlined in the manifest nodes it
                 stored first (a new node stores its inlined tensors again, unchanged
                 ones beside it included). A snapshot identical to one already stored
                 adds 0; one whose only change is a small inlined tensor adds the bytes
                 inlined in the node that holds it. Node structure and the commit object
                 are left out (a few hundred bytes per snapshot). Under
                 torch.distributed an object is new for the one writer that named it in
                 the store (a replicated block's owner rank; of ranks writing the same
                 bytes at once, the first to name them); through local tiers, in each
                 rank's tier (docs/design/collective.md, "What is new is counted once").
    blocks_total / blocks_new  the blocks those count.
    stored_new   what its new blocks take in storage (framed, compressed): the bytes
                 `tsck du`'s physical line grew by; bytes_new / stored_new is what
                 compression saved on them.
    """
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
    # None for a snapshot committed before stored_new was recorded.
    stored_new: int | None = None
    # False while the snapshot is only in a local tier (open_store(local=)), True once
    # the remote ref moved to it; a store without a tier publishes durably.
    durable: bool = True
    # Seconds from put_snapshot's call to the commit object, and of those the seconds
    # its caller was blocked (the stall: all of it for a blocking put, the staging for
    # an asynchronous one; rank 0's call for a collective one; a DCP save's, TsckWriter);
    # None where not recorded (an older commit). Stored in the commit's stats as put_us / stall_us.
    seconds: float | None = None
    stall: float | None = None

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DurableEvent:
    """What Store.on_durable(fn) hands fn once a snapshot published in a local tier is
    durable: in the remote store, its remote ref moved to it (open_store(local=))."""
    root: str
    ref: str
    job: str
    step: int | None
    committed: float  # the commit's time (SnapshotInfo.time: the local table's clock)
    time: float       # when it was marked durable, by the same clock
    lag: float        # time - committed (>= 0): how long the snapshot was in the local tier alone


def row_to_info(root: bytes, row: dict) -> SnapshotInfo:
    """A catalog row (or a decoded commit merged with its stats) -> SnapshotInfo."""
    parent = row.get("parent")
    return SnapshotInfo(
        root=root.hex(), ref=str(row.get("ref", "")), job=str(row.get("job", "")), step=row.get("step"),
        time=float(row.get("time", 0.0)), metrics=dict(row.get("metrics") or {}),
        meta=dict(row.get("meta") or {}), parent=parent.hex() if isinstance(parent, bytes) else None,
        bytes_total=int(row.get("bytes_total", 0)), bytes_new=int(row.get("bytes_new", 0)),
        blocks_total=int(row.get("blocks_total", 0)), blocks_new=int(row.get("blocks_new", 0)),
        stored_new=int(row["stored_new"]) if row.get("stored_new") is not None else None,
        seconds=_seconds(row.get("put_us")), stall=_seconds(row.get("stall_us")))


def _seconds(us) -> float | None:
    """A duration stored in microseconds (a count, checked by the readers) -> seconds."""
    return us / 1e6 if isinstance(us, int) and not isinstance(us, bool) and us >= 0 else None
