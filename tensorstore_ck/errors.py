"""The tensorstore_ck error tree.

    TsckError                    base of everything this package raises on purpose
    ├── RefConflict              a compare-and-swap lost: carries .expected and .actual
    ├── RefNotFound (KeyError)   no such ref, tag, REF@STEP or root
    ├── IntegrityError           a missing or corrupt object: .snapshot, .path, .expected, .got
    ├── FormatError              stored bytes that cannot be decoded or are hostile
    ├── UnsupportedType (TypeError)  a value in the state we cannot store: .path
    ├── InvalidArgument (ValueError) a bad argument to a call (an option, a step, metrics)
    │   └── InvalidName              a bad ref/tag name or target string
    ├── NotAStore                the location exists but holds no tensorstore_ck store
    ├── CheckoutMismatch (ValueError) checkout(into=...) does not fit the snapshot
    │   └── DeviceUnavailable        a tensor saved on (or mapped to) a device this process lacks
    ├── AmbiguousTarget (LookupError) a root-hash prefix that matches several snapshots
    ├── SnapshotAborted          a collective snapshot was abandoned; nothing published
    ├── StorageError (OSError)   the storage backend failed (full disk, network); nothing published
    │   ├── UnreadableObject     one stored object cannot be read (EIO, a folder or FIFO in its place): .key
    │   ├── OutcomeUnknown       a ref-table write whose answer was lost: it may have happened (.root, .ref)
    │   └── TierFull             a put refused: a local tier's budget is held by what must stay local
    ├── Fenced                   a ref move refused: a gc deletion phase overlapped the writer
    ├── GcBusy                   another gc holds the store
    ├── RebuildUnfinished        gc/prune refused: a `tsck recover` has not finished rebuilding the ref table
    ├── StoreClosed              a Store (or its ref table) used after close()
    └── ReadOnlyStore            a write to a store opened read-only (explicitly, or on a
                                 read-only filesystem)

Every class has a stable ``kind`` code used by ``--json`` output; codes are
append-only and never renamed.
"""

from __future__ import annotations

__all__ = [
    "TsckError",
    "RefConflict",
    "RefNotFound",
    "IntegrityError",
    "FormatError",
    "UnsupportedType",
    "InvalidArgument",
    "InvalidName",
    "NotAStore",
    "CheckoutMismatch",
    "DeviceUnavailable",
    "SnapshotAborted",
    "AmbiguousTarget",
    "StorageError",
    "Fenced",
    "GcBusy",
]


class TsckError(Exception):
    kind = "error"

    def __str__(self) -> str:  # KeyError's repr-quoting of the message is unhelpful
        return str(self.args[0]) if self.args else self.__class__.__name__


class RefConflict(TsckError):
    kind = "ref_conflict"

    def __init__(self, name: str, expected: str | None, actual: str | None, what: str = "ref", hint: str = ""):
        self.name = name
        self.expected = expected
        self.actual = actual
        self.what = what
        self.hint = hint  # what to do instead, appended to the message
        kind, _, clash = what.partition(" (")  # e.g. "tag (a ref has this name)"
        if clash:
            text = f"{kind} {name!r} cannot be created: {clash.rstrip(')')} (on {actual})"
        elif expected is None and actual is not None:
            text = f"{what} {name!r} already exists (on {actual})"
            if kind == "tag":
                text += "; tags are immutable: choose another name, or remove it first (untag)"
        elif expected is not None and actual is None:
            text = f"{what} {name!r} does not exist (expected it on {expected})"
        else:
            text = f"{what} {name!r} moved: expected it on {expected}, it is on {actual}"
        if hint:
            text += f"; {hint}"
        elif clash.startswith("a ref has"):  # refs and tags share one namespace
            text += "; a tag never takes a ref's name: choose another tag name"
        elif clash.startswith("a tag has"):
            text += (f"; choose another ref name, or remove the tag first (`tsck untag STORE {name}`) if "
                     "it was made in the ref's place")
        super().__init__(text)

    def __reduce__(self):  # crosses process boundaries (DCP sends errors between ranks)
        return (type(self), (self.name, self.expected, self.actual, self.what, self.hint))


class RefNotFound(TsckError, KeyError):
    kind = "ref_not_found"


class IntegrityError(TsckError):
    kind = "integrity"

    def __init__(self, message: str, *, snapshot: str | None = None, path: str | None = None,
                 key: str | None = None, expected: str | None = None, got: str | None = None,
                 reason: str = "corrupt", replaced=None, partial=None):
        self.reason = reason  # "missing" | "truncated" | "corrupt"
        self.message = message
        self.snapshot = snapshot
        self.path = path
        self.key = key
        self.expected = expected
        self.got = got
        # checkout(into=) only: the paths whose values were wholly / partly replaced by
        # verified snapshot bytes before the failure (None: not a checkout into=).
        self.replaced = None if replaced is None else list(replaced)
        self.partial = None if replaced is None else list(partial or ())
        where = []
        if snapshot:
            where.append(f"snapshot {snapshot[:16]}")
        if path:
            where.append(f"at {path}")
        if key:
            where.append(f"object {key}")
        text = f"{message} ({', '.join(where)})" if where else message
        if self.replaced is not None:
            text += "; " + into_summary(self.replaced, self.partial)
        super().__init__(text)

    def __reduce__(self):
        return (_rebuild_integrity, (self.message, self.snapshot, self.path, self.key, self.expected, self.got,
                                     self.reason, self.replaced, self.partial))


def _rebuild_integrity(message, snapshot, path, key, expected, got, reason, replaced=None, partial=None):
    return IntegrityError(message, snapshot=snapshot, path=path, key=key, expected=expected, got=got, reason=reason,
                          replaced=replaced, partial=partial)


def _some(paths, limit: int = 10) -> str:
    shown = ", ".join(paths[:limit])
    return shown + (f" and {len(paths) - limit} more" if len(paths) > limit else "")


def into_summary(replaced, partial) -> str:
    """What a failed checkout(into=) left in the caller's tree, in words."""
    if not replaced and not partial:
        return "checkout(into=) stopped before writing anything: the into= tree is untouched"
    parts = ["checkout(into=) stopped; it wrote only verified snapshot bytes"]
    if replaced:
        parts.append(f"{len(replaced)} value(s) fully replaced by the snapshot's: {_some(replaced)}")
    if partial:
        parts.append(f"{len(partial)} partly replaced (some blocks the snapshot's, the rest their old "
                     f"values): {_some(partial)}")
    parts.append("every other value in the into= tree is untouched")
    return "; ".join(parts)


class FormatError(TsckError):
    kind = "format"


class UnsupportedType(TsckError, TypeError):
    kind = "unsupported_type"

    def __init__(self, message: str, path: str = ""):
        self.path = path
        self.message = message
        super().__init__(f"{message} at state{path}" if path else message)

    def __reduce__(self):
        return (type(self), (self.message, self.path))


class InvalidArgument(TsckError, ValueError):
    """A bad argument: an option out of range, a step that is not an int, metrics that
    are not numbers. Raised before anything is written."""
    kind = "invalid_argument"


class InvalidName(InvalidArgument):
    kind = "invalid_name"


class NotAStore(TsckError):
    kind = "not_a_store"


class CheckoutMismatch(TsckError, ValueError):
    kind = "checkout_mismatch"


class DeviceUnavailable(CheckoutMismatch):
    """checkout found a tensor saved on a device this process lacks (and no map_location
    saying where it goes). Raised before anything is read."""
    kind = "device_unavailable"


class SnapshotAborted(TsckError):
    kind = "snapshot_aborted"


class SaverDied(SnapshotAborted):
    """The saver process (open_store(saver="process")) died while it wrote a snapshot's
    blocks: that snapshot published nothing; the next one starts a new saver."""
    kind = "saver_died"


__all__.append("SaverDied")


class AmbiguousTarget(TsckError, LookupError):
    kind = "ambiguous_target"


__all__.append("AmbiguousTarget")


class StorageError(TsckError, OSError):
    kind = "storage"
    __str__ = OSError.__str__


__all__.append("StorageError")


class UnreadableObject(StorageError):
    """A stored object that is there but cannot be read: an I/O error on it (EIO), or
    something other than a regular file in its place (a folder, a FIFO, a device),
    which is never opened for reading. .errno is the backend's; .key names the object.
    fsck reports it (`unreadable`) and checks the rest; gc stops before deleting."""
    kind = "unreadable"
    reason = "unreadable"  # fsck's problem name, as IntegrityError.reason
    key = snapshot = path = None
    detail = None  # the backend's error, in its words


__all__.append("UnreadableObject")


class OutcomeUnknown(StorageError):
    """A ref-table write was sent (its COMMIT reached the network) and no answer came
    back, and the table could not be asked afterwards: it may have happened. Nothing
    the write references was deleted. For a put, .root is the snapshot it published or
    not and .ref the ref it moved or not: look (`tsck log REF`, store.log(ref),
    store.resolve(ref)) before taking the snapshot again, or a retry may publish it twice."""
    kind = "outcome_unknown"
    root: bytes | None = None
    ref: str | None = None

    def __init__(self, *args, root: bytes | None = None, ref: str | None = None):
        super().__init__(*args)
        self.root, self.ref = root, ref

    def __reduce__(self):  # crosses process boundaries like the other errors
        return (_rebuild_outcome_unknown, (self.args, self.root, self.ref))


def _rebuild_outcome_unknown(args, root, ref):
    return OutcomeUnknown(*args, root=root, ref=ref)


__all__.append("OutcomeUnknown")


class TierFull(StorageError):
    """A put into a local tier with a byte budget (open_store(local=, local_budget=))
    refused before it wrote anything: the tier holds more than its budget and what holds
    it must stay local (snapshots waiting for their upload, local-only snapshots), and
    waiting for the uploader did not free enough (tier.uploader.BUDGET_WAIT) or could not (nothing
    queued, the uploader stopped). errno ENOSPC: a full disk, by the operator's choice,
    which no retry of the put cures at once. .budget and .held are bytes; .usage is the
    tier's bytes by what they are for (usage.tier_usage)."""
    kind = "tier_full"
    budget: int | None = None
    held: int | None = None
    usage: dict | None = None


__all__.append("TierFull")


class Fenced(TsckError):
    """A gc deletion phase started or is running since the writer's fence was taken:
    objects the writer found present may be gone. The writer re-validates and retries."""
    kind = "fenced"


class GcBusy(TsckError):
    """Another gc holds the store (its heartbeat is fresh)."""
    kind = "gc_busy"


class RebuildUnfinished(TsckError):
    """A gc or prune refused to delete: the ref table is being rebuilt from storage
    (`tsck recover` is running, or one stopped before it finished), so it may not list
    every snapshot yet. Nothing was deleted; a recover that finishes lifts it."""
    kind = "rebuild_unfinished"


__all__.append("RebuildUnfinished")


class StoreClosed(TsckError):
    """A Store, or the ref table under it, was used after close()."""
    kind = "store_closed"


__all__.append("StoreClosed")


class ReadOnlyStore(TsckError):
    """A write (put, tag, pin, gc, recover, ...) to a store opened read-only: with
    open_store(read_only=True) / `tsck --read-only`, or opened so because its files are
    not writable (a read-only mount). Raised before anything is written."""
    kind = "read_only"


__all__.append("ReadOnlyStore")


class SnapshotsFailed(TsckError):
    """CheckpointManager.close(): the newest snapshot the manager attempted was not
    committed (training ended on a failed snapshot: resuming would repeat the steps since
    the newest committed one). `report` holds the counts and steps (a CloseReport)."""
    kind = "snapshots_failed"

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


__all__.append("SnapshotsFailed")


class OutOfStep(SnapshotAborted):
    """A collective call that the ranks did not make alike: one rank skipped a put, or
    made another call (a checkout, another step) in its place. Nothing was published; the
    group realigns by itself (docs/design/collective.md, "Call identity")."""
    kind = "out_of_step"


__all__.append("OutOfStep")


class SnapshotWarning(UserWarning):
    """A snapshot that could not be taken while training goes on (CheckpointManager):
    shown by default, once per kind of failure, with the count so far."""


__all__.append("SnapshotWarning")


def free_bytes(path: str) -> int | None:
    """Bytes an unprivileged writer may still use on the filesystem holding `path` (or
    its nearest existing parent); None where that cannot be known."""
    import os
    p = os.path.abspath(path)
    while p and not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    try:
        st = os.statvfs(p)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def no_space(what: str, path: str, *, needed: str | None = None, cause: str = "",
             outcome: str = "nothing was written") -> StorageError:
    """A full filesystem (ENOSPC, EDQUOT) as StorageError: what was being written, where,
    how much it needed (as far as known) and how much is free, so an operator knows
    which disk to clean and by how much."""
    import errno
    free = free_bytes(path)
    facts = [f"it needed {needed}"] if needed else []
    facts += [f"{free} bytes free there"] if free is not None else []
    text = f"no space left on the filesystem of {path} {what}"
    text += f" ({'; '.join(facts)})" if facts else ""
    text += f": {outcome}; free space there and retry"
    return StorageError(errno.ENOSPC, f"{text} [{cause}]" if cause else text)


def unreadable(e: OSError, key: str, *, snapshot: str | None = None, path: str | None = None) -> UnreadableObject:
    """The OSError of reading object `key` as UnreadableObject naming it (errno kept)."""
    where = ([f"snapshot {snapshot[:16]}"] if snapshot else []) + ([f"at {path}"] if path else [])
    ctx = f" ({', '.join(where)})" if where else ""
    detail = f"{type(e).__name__}: {e.strerror or e}"
    text = f"cannot read object {key}{ctx}: {detail}"
    err = UnreadableObject(e.errno, text) if e.errno is not None else UnreadableObject(text)
    err.key, err.snapshot, err.path, err.detail = key, snapshot, path, detail
    return err


def storage_error(e: OSError, what: str) -> StorageError:
    """A backend's OSError as our StorageError: "<what>: PermissionError: ...", errno kept."""
    msg = e.strerror or str(e)
    name = type(e).__name__
    text = f"{what}: {name if msg in ('', 'None') else f'{name}: {msg}'}"  # s3fs's str() can be 'None'
    # OSError(None, msg) would print "[Errno None] msg"
    return StorageError(e.errno, text) if e.errno is not None else StorageError(text)


class StepReusedWarning(UserWarning):
    """A snapshot was published at a step its ref already has (a script re-run from the
    start, a DCP save with the same step): both are kept, and REF@STEP names the newer.
    A warning, not an error: a re-run may be on purpose. Silence it with
    warnings.filterwarnings("ignore", category=tsck.errors.StepReusedWarning)."""


__all__.append("StepReusedWarning")
