"""Fuzz target: ref and tag names and target strings (format/names.py:
validate_name, validate_component, parse_target; Store.resolve and every
public call that takes a name or a target).

Input: the string, UTF-8 (invalid bytes become lone surrogates, which are not
valid UTF-8 and must be refused). The tokens {root}, {r8} and {r12} expand to
a real snapshot's root hash, and its first 8 and 12 hex digits, so seeds can
name snapshots by hash prefix (seeds: fuzz/corpus/names/).

Contract:
- validate_name accepts only '/'-separated components of [A-Za-z0-9._-]
  (none empty, '.' or '..'), at most 255 UTF-8 bytes, and a tag's storage key
  is tags/<lowercase hex> (nothing else); anything else raises InvalidName.
- parse_target -> ("name", s, None) or ("step", REF, STEP) with REF a valid
  name and REF@STEP giving back the string; InvalidName otherwise.
- resolve / show / log / checkout / pin / tag / put_snapshot / set_retention /
  refs(prefix) on a real store return or raise a TsckError subclass; a resolved
  target is a 64-hex root the store knows; no call creates a storage key
  outside blocks/ nodes/ commits/ tags/<hex> tmp/ tsck.json.
- A put_snapshot that is refused writes at most a commit or two (no retry storm).
(tests/core/test_security.py runs hostile names against a local store's folder.)
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
from _common import ContractViolation  # noqa: E402

with _common.instrument(__name__ == "__main__"):
    import tensorstore_ck as tsck
    from tensorstore_ck.errors import InvalidName, TsckError
    from tensorstore_ck.core.assets import tag_key
    from tensorstore_ck.format.names import MAX_NAME_BYTES, parse_target, validate_component, validate_name

_STATE: dict = {}
_COMPONENT = re.compile(r"[A-Za-z0-9._-]+")
_KEY = re.compile(r"(tsck\.json|(blocks|nodes|commits)/[0-9a-f]{2}/[0-9a-f]{64}|tags/[0-9a-f]+|tmp/[^/]+)")
DEADLINE = 5.0


def _store():
    if "store" not in _STATE:
        store, info = _common.build_real_store()
        _STATE["store"], _STATE["info"] = store, info
        _STATE["objects"] = {o.key: store.storage.get(o.key) for o in store.storage.list("")}
        _STATE["root"] = info["snapshots"][0].root
    return _STATE["store"]


def _text(data: bytes) -> str:
    try:
        s = data.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        s = data.decode("utf-8", "surrogateescape")
    root = _STATE["root"]
    return s.replace("{root}", root).replace("{r8}", root[:8]).replace("{r12}", root[:12])


def _check_valid_name(s: str) -> None:
    if not isinstance(s, str) or not s:
        raise ContractViolation(f"validate_name accepted {s!r}")
    if len(s.encode("utf-8")) > MAX_NAME_BYTES:
        raise ContractViolation(f"validate_name accepted a {len(s.encode())}-byte name")
    for c in s.split("/"):
        if not _COMPONENT.fullmatch(c) or c in (".", ".."):
            raise ContractViolation(f"validate_name accepted {s!r} (component {c!r})")
    key = tag_key(s)
    if not re.fullmatch(r"tags/[0-9a-f]+", key) or bytes.fromhex(key[5:]).decode() != s:
        raise ContractViolation(f"tag {s!r} would be stored at {key!r}")


def _pure(s: str) -> bool:
    """The pure validators; returns whether s is a valid ref name."""
    try:
        validate_name(s)
        ok = True
    except InvalidName:
        ok = False
    if ok:
        _check_valid_name(s)
    try:
        c = validate_component(s)
        if "/" in c or not _COMPONENT.fullmatch(c) or c in (".", ".."):
            raise ContractViolation(f"validate_component accepted {s!r}")
    except InvalidName:
        pass
    try:
        kind, text, step = parse_target(s)
    except InvalidName:
        kind = None
    if kind == "name":
        if text != s or step is not None or not ok:
            raise ContractViolation(f"parse_target({s!r}) -> {(kind, text, step)!r}")
    elif kind == "step":
        _check_valid_name(text)
        ref, _, digits = s.rpartition("@")
        if ref != text or type(step) is not int or int(digits) != step:
            raise ContractViolation(f"parse_target({s!r}) -> {(kind, text, step)!r}")
    elif kind is not None:
        raise ContractViolation(f"parse_target returned kind {kind!r}")
    return ok


_attempt = _common.attempt


def _check_keys(store) -> None:
    for o in store.storage.list(""):
        if not _KEY.fullmatch(o.key):
            raise ContractViolation(f"a storage key outside the layout: {o.key!r}")


def _store_calls(store, s: str) -> None:
    known = {i.root for i in _STATE["info"]["snapshots"]}
    root = _attempt(store.resolve, s)
    if root is not None:
        if not re.fullmatch(r"[0-9a-f]{64}", root):
            raise ContractViolation(f"resolve({s!r}) -> {root!r}")
        if root not in known and store.reftable.catalog_get(bytes.fromhex(root)) is None:
            raise ContractViolation(f"resolve({s!r}) -> {root}, a snapshot the store does not hold")
        state = _attempt(store.checkout, s)
        if state is not None:
            _common.check_state_types(state)
    _attempt(store.show, s)
    _attempt(store.log, s)
    _attempt(store.refs, s)
    _attempt(store.pin, s)
    _attempt(store.unpin, s)
    before = sum(1 for _ in store.storage.list("commits/"))
    try:
        info = store.put_snapshot({"n": 1}, ref=s, step=1)
    except TsckError:
        info = None
        extra = sum(1 for _ in store.storage.list("commits/")) - before
        if extra > 2:
            raise ContractViolation(f"a refused put_snapshot on ref {s!r} wrote {extra} commit objects "
                                    "(retried the compare-and-swap)") from None
    if info is not None:
        _check_valid_name(s)
        if info.job != s.split("/", 1)[0] or store.resolve(s) != info.root:
            raise ContractViolation(f"put_snapshot on ref {s!r} -> job {info.job!r}, root {info.root}")
    info = _attempt(store.tag, s, "jobA/main")
    if info is not None:
        _check_valid_name(s)
        if tag_key(s) not in {o.key for o in store.storage.list("tags/")}:
            raise ContractViolation(f"tag {s!r} has no storage object")
        try:
            store.tag(s, "jobB/main")
        except tsck.RefConflict:
            pass
        else:
            raise ContractViolation(f"tag {s!r} was moved: tags are immutable")
    _attempt(store.set_retention, s, tsck.Retention(keep_last=1))
    _check_keys(store)


def TestOneInput(data: bytes) -> None:
    store = _store()
    s = _text(bytes(data))
    _pure(s)
    rt = store.reftable
    saved = {t: dict(v) for t, v in rt._data.items()}
    try:
        with _common.deadline(DEADLINE, "names input"):
            _store_calls(store, s)
    finally:
        rt._data = {t: dict(v) for t, v in saved.items()}
        want = _STATE["objects"]
        for o in list(store.storage.list("")):
            if o.key not in want:
                store.storage.delete(o.key)


if __name__ == "__main__":
    _common.atheris_main(TestOneInput, ["-max_len=512"])
