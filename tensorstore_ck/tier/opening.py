"""Opening a local tier: open_store(remote, local=PATH) -> the tier's Core and the Store
over it, the remote behind (docs/design/tiers.md, "Two stores, one id" and "Opening the
remote on first use").

The tier is a store of its own (a LocalBlockStore and an LMDB ref table under PATH) whose
marker is a copy of the remote's; for an S3 remote the remote storage is left unopened
until its first use (LazyStorage) when an earlier open found this store at that location.
open_store (opener.py) calls tiered() or lazy_tiered() with `make_store`, which builds
the Store from the tier's Core, the remote Core and the marker.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shlex
import threading

from ..core.assets import STORE_MARKER, create_marker, holds_snapshots
from ..core.core import Core, Settings
from ..core.locate import marker_bytes, open_refs, parse_config, read_config, settings_for
from ..core.roles import TableBinding
from ..errors import NotAStore, ReadOnlyStore, StorageError, TsckError, storage_error
from ..refs import LmdbRefTable, RefTable
from ..refs.postgres import LOCATIONS_NS
from ..storage import BlockStore, LocalBlockStore

__all__ = ["LAZY_PROTOCOLS", "LazyStorage", "remote_location", "record_location", "lazy_tiered", "tiered",
           "refuse_lost_table"]

log = logging.getLogger(__name__)

# Remote protocols whose storage a tiered open leaves unopened until first use (an S3
# client and its first request cost about 0.8 s in a fresh process). Their location is
# the URL and the endpoint: what the tier records as verified (below).
LAZY_PROTOCOLS = ("s3", "s3a")
# A local tier's table records, per remote location (remote_location), the store id whose
# marker an open found there (TierTable.verified_put, meta `verified:`): a later open of the
# tier in front of the same location may then leave the remote storage unopened (lazy_tiered).


def remote_location(proto: str, rest: str, storage_options: dict | None) -> str | None:
    """Where a remote store is, as a tier records it verified: the URL and the endpoint
    it is reached at (an s3:// URL names a bucket of whichever server the endpoint is).
    None for a protocol whose storage opens eagerly."""
    if proto not in LAZY_PROTOCOLS:
        return None
    opts = storage_options or {}
    endpoint = (opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "")
    return json.dumps(["s3://" + rest.strip("/"), str(endpoint).rstrip("/")])


def _verified(lrefs: LmdbRefTable, location: str) -> str | None:
    return lrefs.tier_rows.verified_get(location)


class LazyStorage(BlockStore):
    """A remote store's storage, opened on first use: the client is built and the store's
    marker read and checked against the local tier's (_check_tier: NotAStore) before any
    call passes. The throttles and wrap_storage= are put around it at open, as around
    an eager open's storage: a call through them reaches the storage once it is checked.
    A failed open (the server away) is raised to that use, as the eager open raises it
    (StorageError naming the store), and tried again at the next use."""

    local = False  # an object store: every call is a request

    def __init__(self, url: str, make, tier_root: str, tier_cfg: dict, on_checked=None):
        """make() -> the storage (its retries included); on_checked() once its marker is
        found to be the tier's store's."""
        self.url = url
        self._make, self._root, self._cfg, self._on_checked = make, tier_root, tier_cfg, on_checked
        self._storage: BlockStore | None = None
        self._lock = threading.Lock()

    @property
    def opened(self) -> bool:
        return self._storage is not None

    def _open(self) -> BlockStore:
        s = self._storage
        if s is not None:
            return s
        with self._lock:
            if self._storage is None:
                try:
                    inner = self._make()
                except TsckError:
                    raise
                except OSError as e:
                    raise storage_error(e, f"cannot open the store at {self.url}") from e
                try:
                    cfg = read_config(inner)
                    if cfg is None:
                        raise NotAStore(f"local tier {self._root} belongs to store {self._cfg.get('id')!r}, and "
                                        f"{self.url} holds no store: give each store its own local directory")
                    _check_tier(self._root, self._cfg, cfg, str(cfg.get("id") or self.url), self.url)
                    self._storage = inner
                    if self._on_checked is not None:
                        self._on_checked()
                except OSError as e:
                    inner.close()
                    raise storage_error(e, f"cannot open the store at {self.url}") from e
                except BaseException:
                    inner.close()
                    raise
                log.debug("opened the remote store at %s (its first use)", self.url)
            return self._storage

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # a thread of the parent may have held it
        s = self._storage
        while s is not None:
            hook = getattr(s, "_after_fork", None)
            if hook is not None:
                hook()
            s = getattr(s, "inner", None)

    def get(self, key, max_bytes=None):
        return self._open().get(key, max_bytes)

    def open_read(self, key, max_bytes=None):
        return self._open().open_read(key, max_bytes)

    def put_if_absent(self, key, bufs):
        return self._open().put_if_absent(key, bufs)

    def put_addressed(self, key, bufs):
        return self._open().put_addressed(key, bufs)

    def take_lost(self, keys):
        return self._open().take_lost(keys)

    def exists(self, key):
        return self._open().exists(key)

    def size_of(self, key):
        return self._open().size_of(key)

    def move(self, key, new_key, *, deadline=None):
        return self._open().move(key, new_key, deadline=deadline)

    def delete(self, key):
        return self._open().delete(key)

    def delete_many(self, keys, *, deadline=None):
        return self._open().delete_many(keys, deadline=deadline)

    @property
    def request_timeout(self) -> float:
        return self._open().request_timeout

    @property
    def pages(self):
        return self._open().pages

    @property
    def supports_deletes(self):
        return self._open().supports_deletes

    def list(self, prefix):
        return self._open().list(prefix)

    def list_page(self, prefix, start_after=None):
        return self._open().list_page(prefix, start_after)

    def sync(self):
        return self._open().sync()

    def clock_now(self):
        return self._open().clock_now()

    def temp_files(self):
        return self._open().temp_files()

    def is_empty(self):
        return self._open().is_empty()

    def close(self):
        if self._storage is not None:  # never opened: nothing to release (and no request made)
            self._storage.close()


def _recorded(reftable: TableBinding, location: str) -> dict | None:
    """The marker of the store a tiered open found at `location`, as the ref table records
    it (TableBinding.location_get), checked as a marker is; None where it records none or one
    that does not read."""
    data = reftable.location_get(location)
    if data is None:
        return None
    try:
        cfg = parse_config(data, f"the ref table's record of {location}")
    except TsckError:
        return None
    return cfg if isinstance(cfg.get("id"), str) else None


def record_location(reftable: TableBinding, location: str, cfg: dict) -> None:
    """An eager tiered open read the store's marker at `location`: the ref table keeps it,
    for a new tier to be made from (best effort: without it that tier opens eagerly)."""
    data = marker_bytes(cfg)
    try:
        if reftable.location_get(location) != data:
            reftable.location_put(location, data)
    except Exception as e:  # noqa: BLE001 - a missing record costs the next new tier an eager open
        log.debug("the ref table could not record the store found at %s (%s)", location, e)


def _new_tier(root: str, cfg: dict) -> LmdbRefTable | None:
    """Make a local tier at `root` (absent or an empty directory) from the store marker
    `cfg` -> its table, bound to the store; None where it could not be made as asked (the
    eager open then says why)."""
    try:
        os.makedirs(root, exist_ok=True)
        lstorage = LocalBlockStore(root)
        create_marker(lstorage, marker_bytes(cfg))
        lcfg = read_config(lstorage)
    except (OSError, TsckError):
        return None
    if lcfg is None or lcfg.get("id") != cfg["id"] or _layout_of(lcfg) != _layout_of(cfg):
        return None  # another process made it meanwhile, otherwise
    refs_dir = os.path.join(root, "refs.lmdb")
    fresh = not os.path.isdir(refs_dir)
    lrefs = _tier_table(refs_dir, create=True)
    try:
        lrefs.bind_store(cfg["id"], new=fresh)
    except BaseException:
        lrefs.close()
        raise
    return lrefs


def _tier_read_only(root: str, e: BaseException) -> str:
    return (f"the local tier {root} cannot be written ({getattr(e, 'strerror', None) or e}): every put and upload "
            "writes there; give local= a writable directory, or read the store without local= "
            "(open_store(url, read_only=True), `tsck --read-only`)")


def _tier_table(refs_dir: str, *, create: bool) -> LmdbRefTable:
    """The tier's LMDB table; one on a read-only disk is refused with the advice that fits
    a tier (a tier is never opened read-only: open_store refuses local= with read_only)."""
    try:
        return LmdbRefTable(refs_dir, create=create)
    except NotAStore as e:
        cause = next((c for c in ("Read-only file system", "Permission denied") if c in str(e)), None)
        if cause is not None:  # (the table's own hint, read_only=True, does not fit a tier)
            raise ReadOnlyStore(_tier_read_only(os.path.dirname(refs_dir), cause)) from None
        raise


def _listing(path: str) -> list[str] | None:
    """What a directory holds; None where it cannot be listed (the eager open says why)."""
    try:
        return os.listdir(path)
    except OSError:
        return None


def _layout_of(cfg: dict) -> tuple:
    return cfg.get("block_size"), cfg.get("inline_threshold")


def lazy_tiered(local: str, proto: str, rest: str, refs, storage_options, backoff, make_storage, wrap,
                 options: dict, make_store):
    """open_store(remote, local=PATH) without opening the remote storage: a Store whose
    remote Core has a LazyStorage, or None where the eager open must run. Taken when
    the remote ref table is bound to the tier's store, and an open found that store at
    this location before: this tier (TierTable.verified_get), or any tiered open, as the
    remote ref table records (TableBinding.location_get). A tier that is absent or empty (the
    node's disk lost, a new node) is made from the ref table's record. These are the
    checks an eager open makes without the remote marker; the marker itself is checked at
    the remote storage's first use (LazyStorage), before anything else is read from it or
    sent to it. Any other case (a tier never seen with this store, a table not bound yet,
    a lost table to report) is the eager open's, with its messages."""
    location = remote_location(proto, rest, storage_options)
    root = os.path.abspath(local)
    refs_dir = os.path.join(root, "refs.lmdb")
    if location is None:
        return None
    if os.path.isfile(os.path.join(root, STORE_MARKER)) and _table_file(refs_dir):
        lcfg = read_config(LocalBlockStore(root))
        if lcfg is None or not isinstance(lcfg.get("id"), str):
            return None
        new = False
    elif not os.path.exists(root) or (os.path.isdir(root) and _listing(root) == []):
        lcfg, new = None, True
    else:
        return None
    ours = not isinstance(refs, RefTable)
    lrefs = reftable = core = None
    try:
        try:
            # (a table serving several stores is opened for one: the new tier's id comes first)
            reftable = open_refs(refs, proto, rest, create=False, store_id=lcfg["id"] if lcfg else LOCATIONS_NS,
                                  backoff=backoff)
        except NotAStore:  # no ref table there: the eager open says what to do
            return None
        recorded = _recorded(reftable, location)
        if new:
            if recorded is None:
                return None
            lcfg = recorded
            if ours and getattr(reftable, "namespace", None) == LOCATIONS_NS:
                reftable.close()
                reftable = None
                reftable = open_refs(refs, proto, rest, create=False, store_id=lcfg["id"], backoff=backoff)
        store_id = lcfg["id"]
        bound = reftable.bound_store()
        if bound is not None and bound != store_id:  # the remote's table serves another store
            if new:
                return None
            raise NotAStore(f"local tier {root} belongs to store {store_id!r}, not to {bound!r} "
                            f"({proto}://{rest}): give each store its own local directory")
        if bound is None:
            return None  # a table not bound yet: the eager open decides what it is
        if new:
            lrefs = _new_tier(root, lcfg)
            if lrefs is None:
                return None
        else:
            lrefs = _tier_table(refs_dir, create=False)
            if lrefs.bound_store() != store_id or lrefs.rebuild_unfinished() is not None:
                return None  # (the eager open decides: made afresh, or refused: _refuse_unknowing)
            seen = _verified(lrefs, location) == store_id or (
                recorded is not None and recorded["id"] == store_id and _layout_of(recorded) == _layout_of(lcfg))
            if not seen:  # a location where no open found this store: the eager open reads its marker
                return None

        def verified(lrefs=lrefs, location=location, store_id=store_id) -> None:
            try:
                if _verified(lrefs, location) != store_id:
                    lrefs.tier_rows.verified_put(location, store_id)
            except Exception as e:  # noqa: BLE001 - unrecorded, the next open of the tier reads the marker
                log.debug("the tier could not record its store's location (%s)", e)
        storage = wrap(LazyStorage(f"{proto}://{rest}", make_storage, root, lcfg, on_checked=verified))
        settings, codecs = settings_for(storage, lcfg, **options)
        core = Core.build(storage, reftable, codecs=codecs, settings=settings)
    finally:
        if core is None:  # not taken (None returned) or failed: what was opened here is closed
            if lrefs is not None:
                lrefs.close()
            if reftable is not None and ours:
                reftable.close()
    try:
        return tiered(root, core, lcfg, store_id, codecs, settings, make_store, lrefs=lrefs)
    except BaseException:
        core.pool.shutdown(wait=False)
        if ours:
            reftable.close()
        raise


def tier_codecs(remote: str) -> str:
    """The codecs a local tier writes its blocks with, given its remote's: the float codec's
    CPU on the put's path costs more than a local disk saves (locate.codecs_for), so a
    tier of a float-coded remote writes lz4 and its uploader codes for the network."""
    return "lz4" if remote == "float" else remote


def tiered(path: str, remote: Core, cfg: dict, store_id: str, codecs: str, settings: Settings, make_store, *,
           location: str | None = None, lrefs: LmdbRefTable | None = None):
    """A Store over a local tier at `path` in front of `remote`: the tier's marker is a copy
    of the remote's (same id, same block layout: a block cut here is the block the remote
    would hold), its LMDB ref table is bound to the same store id, and its blocks use what
    a local disk wants (tier_codecs: lz4 where the remote's are the float codec, which the
    uploader codes in the background, Assets.framed_here). `cfg` is the remote's marker, read here
    (eager: `location` names where, recorded in the tier as verified), or the tier's own
    when the remote opens on first use (lazy_tiered: `lrefs` is the tier's table, open)."""
    root = os.path.abspath(path)
    if lrefs is not None:  # the lazy open: the tier's marker was read and checked there
        try:
            lcore = Core.build(LocalBlockStore(root), lrefs, codecs=tier_codecs(codecs), settings=settings)
        except BaseException:
            lrefs.close()
            raise
        return make_store(lcore, remote, cfg)
    if os.path.exists(root) and not os.path.isdir(root):
        raise NotAStore(f"local tier {root} is a file, not a directory")
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise NotAStore(f"cannot create a local tier at {root}: {e.strerror}") from None
    lstorage = LocalBlockStore(root)
    lcfg = read_config(lstorage)
    if lcfg is None:
        if not lstorage.is_empty():
            lcfg = read_config(lstorage)
            if lcfg is None:
                raise NotAStore(f"local tier {root} is not empty and holds no {STORE_MARKER}: not a local tier")
        else:
            try:
                create_marker(lstorage, marker_bytes(cfg))
            except (OSError, StorageError) as e:  # the tier's disk, not the remote: named so
                errno_ = getattr(e, "errno", None)
                if errno_ in (errno.EROFS, errno.EACCES, errno.EPERM):
                    raise ReadOnlyStore(_tier_read_only(root, e)) from None
                raise storage_error(e, f"cannot open the local tier at {root}") from None
            lcfg = read_config(lstorage) or cfg
    _check_tier(root, lcfg, cfg, store_id, remote.url)
    refs_dir = os.path.join(root, "refs.lmdb")
    # No table file (or an empty one) while the tier holds no commit (refuse_lost_table
    # refused the rest): the table is made with the tier, as for a new one.
    fresh = not _table_file(refs_dir)
    lrefs = _tier_table(refs_dir, create=True)
    try:
        if not fresh:
            _refuse_unknowing(root, lrefs)
        lrefs.bind_store(store_id, new=fresh)
        if location is not None and _verified(lrefs, location) != store_id:
            lrefs.tier_rows.verified_put(location, store_id)
        lcore = Core.build(lstorage, lrefs, codecs=tier_codecs(codecs), settings=settings)
    except BaseException:
        lrefs.close()
        raise
    return make_store(lcore, remote, cfg)


def _table_file(refs_dir: str) -> bool:
    """Whether the tier's LMDB table has a data file with something in it (a 0-byte
    data.mdb, as a filesystem crash leaves one, is no table: LMDB would make it afresh)."""
    try:
        return os.path.getsize(os.path.join(refs_dir, "data.mdb")) > 0
    except OSError:
        return False


def _recover_hint(root: str) -> str:
    return (f"run `tsck recover {shlex.quote(root)}` to rebuild it from the tier's objects, then open the store "
            "again (what was not uploaded is uploaded then)")


def refuse_lost_table(root: str) -> None:
    """A tier (its marker) that holds snapshots but no ref table (none, or a data.mdb of
    0 bytes) is refused (NotAStore), nothing created or written, as a plain store in that
    state is: a table made afresh would lack the snapshots not yet uploaded, so a restore
    would go back to the remote's older tip, nothing would upload them, and a gc of the
    tier would delete them. `tsck recover` rebuilds the table from the tier's objects.
    "Holds snapshots" is the plain store's test (a commit stored): blocks and nodes
    without a commit are no snapshot to lose. A table file that opens but knows none of
    the tier's snapshots is refused once opened (_refuse_unknowing)."""
    if not os.path.isfile(os.path.join(root, STORE_MARKER)):
        return
    refs_dir = os.path.join(root, "refs.lmdb")
    if _table_file(refs_dir):
        return
    if holds_snapshots(LocalBlockStore(root)):
        what = ("its table file is empty (data.mdb has 0 bytes)" if os.path.isfile(os.path.join(refs_dir, "data.mdb"))
                else "its ref table does not")
        raise NotAStore(f"no ref table at {refs_dir}: the local tier {root} holds snapshots but {what}; if it was "
                        f"lost, {_recover_hint(root)}")


def _refuse_unknowing(root: str, lrefs: LmdbRefTable) -> None:
    """An existing tier table that cannot know the tier's snapshots, while the tier holds
    some (a commit stored), is refused as a lost one is (NotAStore naming `tsck recover`),
    before it is bound or written: a table that records no store (made afresh: a new
    LMDB file put in its place), or one marked as rebuilding (a lost table that a plain
    open made again empty, or a recover that did not finish). A table made with the tier
    knows every snapshot published in it; a commit it lacks is a put that never
    published, no snapshot to lose."""
    why = None
    if lrefs.bound_store() is None:
        why = "records no store: it was made afresh"
    elif lrefs.rebuild_unfinished() is not None:
        why = "was made again empty, or is being rebuilt by a recover that did not finish"
    if why is None or not holds_snapshots(LocalBlockStore(root)):
        return
    raise NotAStore(f"the ref table at {lrefs.path} knows none of the snapshots the local tier {root} holds (it "
                    f"{why}); if the tier's table was lost, {_recover_hint(root)}")


def _check_tier(root: str, lcfg: dict, cfg: dict, store_id: str, url: str) -> None:
    """The tier at `root` (marker `lcfg`) must be a tier of the store whose marker is `cfg`:
    the same id (NotAStore: a directory of another store), the same block layout (a block
    cut in the tier is the block the store would hold)."""
    if str(lcfg.get("id")) != store_id:
        raise NotAStore(f"local tier {root} belongs to store {lcfg.get('id')!r}, not to {store_id!r} "
                        f"({url}): give each store its own local directory")
    mine = (lcfg.get("block_size"), lcfg.get("inline_threshold"))
    theirs = (cfg.get("block_size"), cfg.get("inline_threshold"))
    if mine != theirs:
        raise NotAStore(f"local tier {root} cuts blocks as block_size={mine[0]}, inline_threshold={mine[1]}, the "
                        f"store at {url} as block_size={theirs[0]}, inline_threshold={theirs[1]}: its marker "
                        f"({STORE_MARKER}) must be a copy of the store's; correct it, or give the tier a new "
                        "directory")
