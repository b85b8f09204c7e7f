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
from typing import Generic, TypeVar

from ..errors import AmbiguousTarget, RefNotFound
from ..format.names import parse_target
from ..refs import RefTable
from ..storage import BlockStore
from ..util.ids import MIN_PREFIX, Digest, is_hex_prefix
from .assets import Assets

__all__ = ["Core", "Settings", "DEFAULT_WORKERS", "DEFAULT_LEASE"]

DEFAULT_WORKERS = min(8, 2 * (os.cpu_count() or 2))
POOL_PREFIX = "tsck-io"  # the names of the I/O pool's threads
DEFAULT_LEASE = 120.0  # seconds a gc holds the store between two renewals (gc.py; open_store(gc_lease=))


@dataclass(frozen=True)
class Settings:
    """A store's settings, translated once from open_store()'s options (opener.py)."""
    verify: bool = True              # check every block read against its digest
    workers: int = DEFAULT_WORKERS   # I/O threads
    gc_lease: float = DEFAULT_LEASE  # seconds a gc this store runs holds it between renewals
    block_size: int = 0              # bytes per block of new snapshots (0: not a writer's concern)
    inline_threshold: int = 0        # tensors up to this size live in their manifest node
    pack_size: int | None = None     # small tensors packed into blocks of up to this (0: never;
                                     # None: the backend's default, Store.pack_size)
    read_only: str | None = None     # why the store is read-only, or None


# The part of the ref table a Core's user plays against (a role of core/roles.py): a
# function names it in its signature, Core[GcTable], and finds core.refs so typed.
R = TypeVar("R", covariant=True)


@dataclass(eq=False)
class Core(Generic[R]):
    """Storage, typed objects, the ref table, the I/O pool and the settings of one store.

    `pool` is replaced in a forked child (the parent's workers are not there); hold the
    Core, not its pool."""
    storage: BlockStore
    assets: Assets
    refs: R
    pool: ThreadPoolExecutor
    settings: Settings = field(default_factory=Settings)

    @classmethod
    def build(cls, storage: BlockStore, refs: RefTable, *, codecs: str = "lz4",
              settings: Settings | None = None) -> "Core[RefTable]":
        """A core over storage and refs: Assets whose presence record reads the ref
        table's gc epoch, and a pool of settings.workers threads (the caller shuts it down)."""
        settings = settings or Settings()
        assets = Assets(storage, codecs=codecs, epoch_now=lambda: refs.gc_state()["epoch"])
        pool = ThreadPoolExecutor(settings.workers, thread_name_prefix=POOL_PREFIX)
        return cls(storage, assets, refs, pool, settings)

    @property
    def url(self) -> str:
        return self.storage.url

    def after_fork(self) -> None:
        """In the child of os.fork(): only the forking thread exists there, so the pool's
        workers are the parent's (a new pool), as are the presence record's lock and the
        locks or clients of the storage backends and wrappers (their own _after_fork)."""
        self.pool = ThreadPoolExecutor(self.settings.workers, thread_name_prefix=POOL_PREFIX)
        self.assets.presence.after_fork()
        s = self.storage
        while s is not None:
            hook = getattr(s, "_after_fork", None)
            if hook is not None:
                hook()
            s = getattr(s, "inner", None)

    def resolve(self, target: str) -> Digest:
        """A target (ref, tag, REF@STEP, root hex or unique prefix >= MIN_PREFIX) -> its root.
        Here, not in the facade, so a collective checkout's rank 0 resolves as Store does."""
        kind, text, step = parse_target(target)
        refs = self.refs
        if kind == "step":
            found = refs.step_root(text, step)  # an index: cost independent of the history
            if found is not None:
                return Digest(found)
            if refs.history(text) is None:
                raise RefNotFound(f"no ref named {text!r}")
            raise RefNotFound(f"ref {text!r} has no kept snapshot at step {step}")
        r = refs.get_or_none(text)
        if r is None:
            r = refs.tag_get(text)
        if r is not None:
            return Digest(r)
        if is_hex_prefix(text):
            even = text[: len(text) // 2 * 2]
            found = [x for x in refs.catalog_prefix(bytes.fromhex(even)) if x.hex().startswith(text)]
            if len(found) == 1:
                return Digest(found[0])
            if len(found) > 1:
                raise AmbiguousTarget(f"root prefix {text!r} matches {len(found)} snapshots; give more digits")
        if text and len(text) < MIN_PREFIX and all(c in "0123456789abcdef" for c in text):
            raise RefNotFound(f"no ref or tag named {target!r}, and a root prefix needs at least {MIN_PREFIX} hex "
                              "digits (see `tsck log` for roots)")
        raise RefNotFound(f"no ref, tag or snapshot named {target!r}")
