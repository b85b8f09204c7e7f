"""The narrow core of an open store: what the layers below the Store facade are given.

gc, fsck, recover, usage, listing, the collective protocol and the DCP
adapter need a store's storage, its typed object I/O, its ref table, its I/O pool and
a few settings; none of them needs the facade (put_snapshot, checkout, the async
queue). open_store() builds one Core per Store (Store.core) and passes it down, so
each dependency shows in a signature and a lower module can be built and tested
from a Core alone: `Core.build(storage, refs)`.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .assets import Assets
from .refs import RefTable
from .storage import BlockStore

__all__ = ["Core", "Settings", "DEFAULT_WORKERS"]

DEFAULT_WORKERS = min(8, 2 * (os.cpu_count() or 2))


@dataclass(frozen=True)
class Settings:
    """A store's settings, translated once from open_store()'s options (opener.py)."""
    verify: bool = True              # check every block read against its digest
    workers: int = DEFAULT_WORKERS   # I/O threads
    gc_lease: float = 120.0          # seconds a gc this store runs holds it between renewals
    block_size: int = 0              # bytes per block of new snapshots (0: not a writer's concern)
    inline_threshold: int = 0        # tensors up to this size live in their manifest node
    read_only: str | None = None     # why the store is read-only, or None


@dataclass(eq=False)
class Core:
    """Storage, typed objects, the ref table, the I/O pool and the settings of one store.

    `pool` is replaced in a forked child (the parent's workers are not there); hold the
    Core, not its pool."""
    storage: BlockStore
    assets: Assets
    refs: RefTable
    pool: ThreadPoolExecutor
    settings: Settings = field(default_factory=Settings)

    @classmethod
    def build(cls, storage: BlockStore, refs: RefTable, *, codecs: str = "lz4",
              settings: Settings | None = None) -> "Core":
        """A core over storage and refs: Assets whose presence record reads the ref
        table's gc epoch, and a pool of settings.workers threads (the caller shuts it down)."""
        settings = settings or Settings()
        assets = Assets(storage, codecs=codecs, epoch_now=lambda: refs.gc_state()["epoch"])
        pool = ThreadPoolExecutor(settings.workers, thread_name_prefix="tsck-io")
        return cls(storage, assets, refs, pool, settings)

    @property
    def url(self) -> str:
        return self.storage.url
