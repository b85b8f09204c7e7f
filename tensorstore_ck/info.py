"""SnapshotInfo: what a caller learns about one snapshot (put, log, show, refs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["SnapshotInfo", "row_to_info"]


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
    # Bytes the new blocks take in storage (framed, compressed); None for a snapshot
    # committed before this was recorded.
    stored_new: int | None = None
    # False while the snapshot is only in a local tier (open_store(local=)), True once
    # the remote ref moved to it; a store without a tier publishes durably.
    durable: bool = True

    def to_json(self) -> dict:
        return asdict(self)


def row_to_info(root: bytes, row: dict) -> SnapshotInfo:
    """A catalog row (or a decoded commit merged with its stats) -> SnapshotInfo."""
    parent = row.get("parent")
    return SnapshotInfo(
        root=root.hex(), ref=str(row.get("ref", "")), job=str(row.get("job", "")), step=row.get("step"),
        time=float(row.get("time", 0.0)), metrics=dict(row.get("metrics") or {}),
        meta=dict(row.get("meta") or {}), parent=parent.hex() if isinstance(parent, bytes) else None,
        bytes_total=int(row.get("bytes_total", 0)), bytes_new=int(row.get("bytes_new", 0)),
        blocks_total=int(row.get("blocks_total", 0)), blocks_new=int(row.get("blocks_new", 0)),
        stored_new=int(row["stored_new"]) if row.get("stored_new") is not None else None)
