"""Where a store is and what it is: URLs, the store marker (`tsck.json`), its storage
stack and its ref table, and open_store()'s options as the store's Settings. Shared by
open_store (opener.py) and the local tier's opening (tier/opening.py)."""

from __future__ import annotations

import json
import os
import threading

from ..errors import FormatError, InvalidArgument, NotAStore
from ..format import chunker
from ..refs import LmdbRefTable, MemoryRefTable, RefTable
from ..storage import BlockStore, FsspecBlockStore, S3BlockStore
from .assets import MAX_MARKER_BYTES, STORE_MARKER, read_marker
from .core import DEFAULT_LEASE, DEFAULT_WORKERS, Settings

__all__ = ["STORE_VERSION", "forget_memory_refs", "split_url", "lmdb_path", "unwritable", "open_refs", "read_config", "marker_bytes",
           "parse_config", "layout", "COMPRESSION", "codecs_for", "check_options", "settings_for",
           "remote_storage", "wrapped"]

STORE_VERSION = 1
MIN_STORE_VERSION = 1
MAX_STORE_VERSION = 1
_MEMORY_REFS: dict[str, MemoryRefTable] = {}
_MEMORY_LOCK = threading.Lock()


def _known_protocol(proto: str) -> bool:
    """Whether fsspec knows `proto`: by import path (s3, gcs, ...) or registered at run
    time (fsspec.register_implementation), which available_protocols() does not list."""
    import fsspec
    if not proto:  # fsspec reads "" as its default, the local disk: "://x" is a typo
        return False
    from fsspec.registry import known_implementations, registry
    if proto in known_implementations or proto in registry:  # no import: s3fs alone takes 0.5 s
        return True
    try:
        fsspec.get_filesystem_class(proto)
    except ValueError:  # "Protocol not known"
        return False
    except ImportError:  # known, its package is missing: opening it says which
        return True
    return True


def split_url(url: str) -> tuple[str, str]:
    if not isinstance(url, (str, os.PathLike)):
        raise InvalidArgument(f"store location must be a str or path, got {type(url).__name__}")
    url = os.fspath(url)
    if "://" in url:
        proto, rest = url.split("://", 1)
        if not _known_protocol(proto):  # a typo (htps://) is named as such, first
            raise InvalidArgument(f"unknown URL scheme {proto + '://'!r} in {url!r}: use a local path, s3://, gs://, "
                                  "or another fsspec protocol")
        return proto, rest
    return "file", url


def lmdb_path(refs, proto: str, root: str) -> str | None:
    """The local LMDB directory the ref table would be opened from, if it is one."""
    if refs is None:
        return os.path.join(root, "refs.lmdb") if proto == "file" else None
    if not isinstance(refs, str) or refs.startswith(("memory://", "postgresql://", "postgres://", "host=")) \
            or " dbname=" in refs:
        return None
    return refs[len("lmdb://"):] if refs.startswith("lmdb://") else refs


def unwritable(paths) -> str | None:
    """Why this process cannot write where the store's files are (a read-only mount,
    permissions), or None: open_store(read_only=None) then opens it read-only."""
    for p in paths:
        if p is None or not os.path.exists(p):
            continue
        try:
            if os.statvfs(p).f_flag & os.ST_RDONLY:
                return f"{p} is on a read-only filesystem"
        except (OSError, AttributeError):
            pass
        if not os.access(p, os.W_OK):
            return f"{p} is not writable by this process"
    return None


def open_refs(refs, proto: str, root: str, create: bool, store_id: str = "default",
               read_only: bool = False, backoff=None) -> RefTable:
    if isinstance(refs, RefTable):
        return refs
    if refs is None:
        if proto == "file":
            return LmdbRefTable(os.path.join(root, "refs.lmdb"), create=create, read_only=read_only)
        if proto == "memory":
            refs = f"memory://{root}"
        else:
            raise InvalidArgument(f"a {proto}:// store needs a shared ref table: pass refs='postgresql://...' "
                              "or refs='/local/path/refs.lmdb' for a single host")
    if not isinstance(refs, str):
        raise InvalidArgument(f"refs must be a str or RefTable, got {type(refs).__name__}")
    if refs.startswith("memory://"):
        with _MEMORY_LOCK:
            return _MEMORY_REFS.setdefault(refs, MemoryRefTable())
    if refs.startswith(("postgresql://", "postgres://")) or refs.startswith("host=") or " dbname=" in refs:
        from ..refs.postgres import PostgresRefTable
        return PostgresRefTable(refs, namespace=store_id, read_only=read_only,
                                **({} if backoff is None else {"backoff": backoff}))
    return LmdbRefTable(lmdb_path(refs, proto, root), create=create, read_only=read_only)


def forget_memory_refs(url: str) -> None:
    """Drop the in-process ref table of the memory:// store at `url` (a test's or a
    fuzzer's store, thrown away with its storage)."""
    with _MEMORY_LOCK:
        _MEMORY_REFS.pop(url, None)


def read_config(storage: BlockStore) -> dict | None:
    data = read_marker(storage)
    return None if data is None else parse_config(data, storage.url)


def marker_bytes(cfg: dict) -> bytes:
    """A store marker's fields as written (the store's, a tier's copy, the ref table's record)."""
    return json.dumps(cfg, indent=1).encode() + b"\n"


def parse_config(data: bytes, where: str) -> dict:
    """A store marker's bytes (untrusted) -> its fields, checked."""
    try:
        if len(data) > MAX_MARKER_BYTES:
            raise ValueError("too large")
        cfg = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise NotAStore(f"{where}/{STORE_MARKER} is not a tensorstore_ck store marker") from None
    if not isinstance(cfg, dict) or cfg.get("format") != "tensorstore_ck":
        raise NotAStore(f"{where} is not a tensorstore_ck store")
    for k in ("block_size", "inline_threshold"):
        if k in cfg and (not isinstance(cfg[k], int) or isinstance(cfg[k], bool) or not 0 <= cfg[k] < 2**40):
            raise FormatError(f"{where}/{STORE_MARKER}: {k} is not a valid size")
    v = cfg.get("version")
    if not isinstance(v, int) or not MIN_STORE_VERSION <= v <= MAX_STORE_VERSION:
        raise FormatError(f"store format version {v!r} is not readable by this build "
                          f"(reads {MIN_STORE_VERSION}..{MAX_STORE_VERSION})")
    return cfg


def layout(block_size, inline_threshold, config: dict | None = None, *, where: str = "") -> tuple[int, int]:
    """The block size and inline threshold a Store writes with: the arguments, else the
    store marker's, else the defaults (the inline threshold is never above the block
    size unless asked for). open_store calls it before writing anything, so a bad
    argument never leaves a half-made store; a marker whose values do not fit (written
    by hand, or by a build with other limits) is a FormatError that says how to go on."""
    for name, v in (("block_size", block_size), ("inline_threshold", inline_threshold)):
        if v is not None and (type(v) is not int or v < 0):
            raise InvalidArgument(f"{name} must be a non-negative int, got {v!r}")
    cfg = config or {}
    bs = block_size if block_size is not None else cfg.get("block_size", chunker.DEFAULT_BLOCK_SIZE)
    if inline_threshold is not None:
        it = inline_threshold
    else:
        it = cfg.get("inline_threshold", min(chunker.DEFAULT_INLINE_THRESHOLD, bs))
    problem = None
    if not chunker.MIN_BLOCK_SIZE <= bs <= chunker.MAX_BLOCK_SIZE:
        problem = f"block_size must be within {chunker.MIN_BLOCK_SIZE}..{chunker.MAX_BLOCK_SIZE}, got {bs}"
    elif not 0 <= it <= bs:
        problem = f"inline_threshold must be within 0..block_size ({bs}), got {it}"
    if problem is None:
        return int(bs), int(it)
    if (block_size is None and "block_size" in cfg) or (inline_threshold is None and "inline_threshold" in cfg):
        raise FormatError(f"{where or 'the store marker'} holds a layout this build cannot write with: {problem}; "
                          "open the store with block_size=/inline_threshold= arguments that fit, or correct those "
                          "fields of the marker (they only decide how new snapshots are cut; stored ones read "
                          "either way)")
    raise InvalidArgument(problem)


COMPRESSION = ("auto", "float", "lz4", "none")


def codecs_for(compression: str, storage: BlockStore) -> str:
    """The codecs a writer uses (Assets(codecs=)) for open_store(compression=...).

    "auto" is the measured best for the backend (docs/design/codecs.md, "Compression"):
    the float codec where the bytes cross a network (object stores: fewer bytes is
    time and money saved), lz4 where they do not (a local disk, memory://), where
    coding floats costs more CPU time than the disk saves. The option is checked
    first (check_options)."""
    if compression == "auto":
        return "lz4" if storage.local or storage.url.startswith("memory://") else "float"
    return compression


def check_options(*, workers=None, gc_lease=None, max_inflight=2, when_busy="wait", compression="auto",
                  saver="thread", saver_nice=0, pack_size=None) -> None:
    """A Store's other options, checked before open_store writes anything."""
    if pack_size is not None and (type(pack_size) is not int or not 0 <= pack_size <= chunker.MAX_BLOCK_SIZE):
        raise InvalidArgument(f"pack_size must be None or an int within 0..{chunker.MAX_BLOCK_SIZE} bytes, "
                              f"got {pack_size!r}")
    if compression not in COMPRESSION:
        raise InvalidArgument(f"compression must be one of {', '.join(map(repr, COMPRESSION))}, got {compression!r}")
    if workers is not None and (type(workers) is not int or not 1 <= workers <= 1024):
        raise InvalidArgument(f"workers must be an int within 1..1024, got {workers!r}")
    if gc_lease is not None and not (isinstance(gc_lease, (int, float)) and not isinstance(gc_lease, bool)
                                     and 0 < gc_lease < 1e7):
        raise InvalidArgument(f"gc_lease must be a positive number of seconds, got {gc_lease!r}")
    if type(max_inflight) is not int or max_inflight < 1:
        raise InvalidArgument(f"max_inflight must be an int >= 1, got {max_inflight!r}")
    if when_busy not in ("wait", "skip"):
        raise InvalidArgument(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
    if saver not in ("thread", "process"):
        raise InvalidArgument(f"saver must be 'thread' or 'process', got {saver!r}")
    if type(saver_nice) is not int or not 0 <= saver_nice <= 19:
        raise InvalidArgument(f"saver_nice must be an int within 0..19, got {saver_nice!r}")


def settings_for(storage: BlockStore, cfg: dict, *, workers, verify, compression, block_size, inline_threshold,
                 gc_lease, read_only, pack_size=None) -> tuple[Settings, str]:
    """open_store()'s options (checked by check_options) as the store's Settings and the
    codecs its writers use: the one place they are read."""
    bs, it = layout(block_size, inline_threshold, cfg, where=f"{storage.url}/{STORE_MARKER}")
    return Settings(verify=verify, workers=workers or DEFAULT_WORKERS,
                    gc_lease=float(gc_lease if gc_lease is not None else DEFAULT_LEASE), block_size=bs,
                    inline_threshold=it, read_only=read_only, pack_size=pack_size), codecs_for(compression, storage)


def remote_storage(proto: str, rest: str, storage_options: dict | None, backoff) -> BlockStore:
    """The storage of a store at an fsspec URL, its transient network errors retried."""
    try:
        cls = S3BlockStore if proto in ("s3", "s3a") else FsspecBlockStore
        storage = cls(f"{proto}://{rest}", storage_options)
    except (ImportError, ValueError, TypeError) as e:
        raise NotAStore(f"cannot open {proto}:// storage: {type(e).__name__}: {e}") from None
    if proto != "memory":
        from ..storage.wrappers import RetryingStore
        storage = RetryingStore(storage, backoff=backoff)  # transient network errors are retried, not surfaced
    return storage


def wrapped(storage: BlockStore, write_bandwidth, write_concurrency, wrap_storage) -> BlockStore:
    """open_store's throttles and caller's wrapper, around storage whose marker was read."""
    if write_bandwidth is not None or write_concurrency is not None:
        from ..storage.wrappers import ThrottledStore
        try:
            storage = ThrottledStore(storage, bytes_per_second=write_bandwidth, max_concurrent=write_concurrency)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
    if wrap_storage is not None:  # cross-cutting behaviour (fault injection, limits) as a wrapper
        storage = wrap_storage(storage)
    return storage
