"""What every command group shares: sizes and times as shown, strict JSON (--json), one
snapshot as one line, and a store's local tier opened beside it (--local)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import sys

from ..errors import NotAStore
from ..info import SnapshotInfo
from ..opener import open_store
from ..util.units import human_bytes

__all__: list[str] = []  # the command groups' shared helpers; none is public


def human(n) -> str:
    return human_bytes(n)


def when_text(t: float) -> str:
    try:
        return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    except (OverflowError, OSError, ValueError):  # outside the platform's time_t / datetime range
        return f"t={t!r} (out of range)"


def _jsonable(obj, depth: int = 0):
    """A value that json.dumps writes as strict JSON (RFC 8259, what jq accepts): a
    non-finite float (a diverged run's NaN loss) becomes null, bytes (found in a stored
    commit's meta) a string "hex:<hex digits>", a key that is not a str its str() (bytes
    keys: "hex:..." too). Stored values nest at most 33 levels (decode_commit checks)."""
    t = type(obj)
    if t is float:
        return obj if math.isfinite(obj) else None
    if t in (bytes, bytearray):
        return "hex:" + bytes(obj).hex()
    if depth > 64:
        return "..."
    if isinstance(obj, dict):
        return {_jsonable_key(k): _jsonable(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(x, depth + 1) for x in obj]
    if obj is None or t in (bool, int, str):
        return obj
    if isinstance(obj, float):
        return _jsonable(float(obj), depth)
    return str(obj)


def _jsonable_key(k):
    if type(k) is str:
        return k
    if type(k) in (bytes, bytearray):
        return "hex:" + bytes(k).hex()
    if type(k) is float and not math.isfinite(k):
        return str(k)
    return k if type(k) in (int, float, bool) or k is None else str(k)


def dumps(obj, **kw) -> str:
    return json.dumps(_jsonable(obj), allow_nan=False, **kw)


def metrics_text(m: dict) -> str:
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


def snapshot_line(info: SnapshotInfo) -> str:
    m = metrics_text(info.metrics)
    tier = "" if info.durable else "local-only  "  # in a local tier, not yet uploaded
    return (f"{info.root[:16]}  step {info.step if info.step is not None else '-':>8}  {when_text(info.time)}  "
            f"{human(info.bytes_total):>10} ({human(info.bytes_new)} new)  {tier}{m}").rstrip()


def emit(args, obj, text: str) -> None:
    if args.json:
        print(dumps(obj, indent=2, sort_keys=False))
    else:
        print(text)


def wants_bar(args) -> bool:
    return not args.json and sys.stderr.isatty()


def open_tier(store, args):
    """The local tier at args.local, opened as a store of its own (no uploader: du and
    fsck look, they send nothing), refused unless it is a tier of `store`."""
    if not os.path.isdir(args.local):
        raise NotAStore(f"no local tier at {args.local} (no such directory)")
    tier = open_store(args.local, create=False, read_only=True if args.read_only else None)
    want, got = store.config.get("id"), tier.config.get("id")
    if want != got:
        tier.close()
        raise NotAStore(f"{args.local} is not a local tier of {store.url} (it belongs to store {got!r}, "
                        f"not {want!r})")
    return tier
