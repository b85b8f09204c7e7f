"""The arguments of a snapshot (ref, job, step, metrics, meta, expected, resumed_from), checked once
for every writer: Store.put_snapshot, the collective put and the DCP writer."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..errors import InvalidArgument
from ..format.names import validate_component, validate_new_name
from ..util.ids import parse_hex

# The commit meta key a tier marks a snapshot with when its schedule (open_store(durable_every=))
# kept it out of the remote store (tier/memory.py); no caller's meta may hold it.
TIER_ONLY = "tier_only"


def tier_only(meta) -> bool:
    """Whether a commit's (or catalog row's) meta marks a tier-only snapshot. Stored bytes:
    anything but a true bool is not the mark."""
    return isinstance(meta, dict) and meta.get(TIER_ONLY) is True

__all__ = ["UNSET", "SnapshotArgs", "check_snapshot_args", "check_plain", "check_step", "TIER_ONLY", "tier_only"]

class _Unset:
    """expected= not given: the ref moves wherever it points. A singleton that stays
    one through pickling (a DCP writer travels to another process)."""
    _it = None

    def __new__(cls):
        if cls._it is None:
            cls._it = super().__new__(cls)
        return cls._it

    def __reduce__(self):
        return (_Unset, ())

    def __repr__(self) -> str:
        return "UNSET"


UNSET = _Unset()


@dataclass(frozen=True)
class SnapshotArgs:
    ref: str
    job: str
    step: int | None
    metrics: dict
    meta: dict
    expected: object  # UNSET, None (the ref must not exist) or the 32-byte root it must point at
    # The step of the ref's snapshot the writer resumed from (CheckpointManager after a
    # restore): kept snapshots of the ref at later steps belong to a run it abandoned, so
    # taking one of their steps again is expected (no StepReusedWarning). None: not said.
    resumed_from: int | None = None


def check_utf8(s: str, what: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what}: string {s!r} is not valid UTF-8") from None


def check_plain(obj, what: str, depth: int = 0) -> None:
    """metrics/meta hold JSON-like values only: they are shown by the CLI and kept in the catalog."""
    if depth > 32:
        raise InvalidArgument(f"{what} nested too deeply")
    if obj is None or type(obj) in (bool, int, float, str):
        if type(obj) is int and not -(2**63) <= obj < 2**64:
            raise InvalidArgument(f"{what}: int {obj} is out of the 64-bit range")
        if type(obj) is str:
            check_utf8(obj, what)
        return
    if type(obj) is list:
        for x in obj:
            check_plain(x, what, depth + 1)
        return
    if type(obj) is dict:
        for k, v in obj.items():
            if type(k) is not str:
                raise InvalidArgument(f"{what}: keys must be str, got {type(k).__name__}")
            check_utf8(k, what)
            check_plain(v, what, depth + 1)
        return
    raise InvalidArgument(f"{what}: values must be None, bool, int, float, str, list or dict, "
                      f"got {type(obj).__name__}")


def check_step(step) -> int | None:
    if step is not None and (type(step) is not int or not -(2**63) <= step < 2**63):
        raise InvalidArgument(f"step must be an int, got {step!r}")
    return step


def check_snapshot_args(ref, *, job=None, step=None, metrics=None, meta=None, expected=UNSET,
                        resumed_from=None) -> SnapshotArgs:
    validate_new_name(ref)
    j = validate_new_name(validate_component(job if job is not None else ref.split("/", 1)[0], "job name"),
                          "job name")
    check_step(step)
    if resumed_from is not None and (type(resumed_from) is not int or not -(2**63) <= resumed_from < 2**63):
        raise InvalidArgument(f"resumed_from must be the int step of a snapshot of the ref, got {resumed_from!r}")
    m = {}
    for k, v in dict(metrics or {}).items():
        if type(k) is not str or isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise InvalidArgument(f"metrics must map str to numbers, got {k!r}: {v!r}")
        check_utf8(k, "metrics")
        # numpy scalars and other numbers are stored as plain int/float
        m[k] = int(v) if isinstance(v, numbers.Integral) else float(v)
    check_plain(m, "metrics")
    mt = dict(meta or {})
    check_plain(mt, "meta")
    if TIER_ONLY in mt:  # (the tier's own mark: whether the remote gets the snapshot)
        raise InvalidArgument(f"meta key {TIER_ONLY!r} is the store's own (a snapshot a tier's durable_every kept out "
                              "of the remote store): name yours otherwise")
    e = UNSET
    if expected is not UNSET:
        e = None if expected is None else parse_hex(expected)
    return SnapshotArgs(ref, j, step, m, mt, e, resumed_from)
