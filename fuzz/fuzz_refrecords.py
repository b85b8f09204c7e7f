"""Fuzz target: ref-table records (format/records.py decode_record and every reader
of a record), stored tag objects (format/records.py decode_tag) and the store marker.

Input: one byte naming what the rest is, then the record's bytes:

    0 reflog entry of jobA/main        7 a pins key (a root)
    1 catalog row of jobA/main's tip   8 meta/reflog_seq value
    2 gc/state                         9 a refs key (ref name bytes) -> a real root
    3 retention row of job jobA       10 a tags key (tag name bytes) -> a real root
    4 refs value of jobA/dev          11 a stored tag object (tags/<hex of name>)
    5 tags value of golden            12 the store marker tsck.json
    6 retention key (job name bytes)

Seeds (fuzz/corpus/refrecords/) are the records of a real LMDB ref table, the
real tag objects and marker, each with its selector byte in front.

The record is planted into the real store (memory ref table, the same logic
as LMDB's) and the store is used through its public API: log, REF@STEP,
refs, tags, show, du, retention, put_snapshot, checkout, gc (dry run and
real), fsck, tag, recover. Each call returns or raises a TsckError
subclass, and finishes within DEADLINE seconds (a hostile gc state must not
make a writer spin forever). Ref table and storage are restored after each
input.
"""

from __future__ import annotations

import os
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
from _common import ContractViolation  # noqa: E402

with _common.instrument(__name__ == "__main__"):
    import struct

    import tensorstore_ck as tsck
    from tensorstore_ck.errors import TsckError
    from tensorstore_ck.core.assets import tag_key
    from tensorstore_ck.format.records import decode_record, decode_tag
    from tensorstore_ck.format.names import validate_name
    from tensorstore_ck.storage import FsspecBlockStore

DEADLINE = 3.0
TABLES = ["reflog", "catalog", "gc", "retention", "refs", "tags", "retention-key", "pins-key", "meta",
          "refs-key", "tags-key", "tag-object", "marker"]
_STATE: dict = {}


def _store():
    if "store" not in _STATE:
        store, info = _common.build_real_store()
        _STATE["store"], _STATE["info"] = store, info
        _STATE["objects"] = {o.key: store.storage.get(o.key) for o in store.storage.list("")}
    return _STATE["store"]


_attempt = _common.attempt


def _restore_storage(store) -> None:
    want = _STATE["objects"]
    have = {o.key for o in store.storage.list("")}
    for key in have - set(want):
        store.storage.delete(key)
    for key, data in want.items():
        if key not in have:
            store.storage.put_if_absent(key, [data])


def _plant(store, which: str, rec: bytes) -> None:
    t = store.reftable._data
    tip = t["refs"][b"jobA/main"]
    if which == "reflog":
        seq = max(struct.unpack(">Q", k[-8:])[0] for k in t["reflog"]) + 1
        t["reflog"][b"jobA/main\0" + struct.pack(">Q", seq)] = rec
    elif which == "catalog":
        t["catalog"][tip] = rec
    elif which == "gc":
        t["gc"][b"state"] = rec
    elif which == "retention":
        t["retention"][b"jobA"] = rec
    elif which == "refs":
        t["refs"][b"jobA/dev"] = rec
    elif which == "tags":
        t["tags"][b"golden"] = rec
    elif which == "retention-key":
        t["retention"][rec] = t["retention"][b"jobA"]
    elif which == "pins-key":
        t["pins"][rec] = b""
    elif which == "meta":
        t["meta"][b"reflog_seq"] = rec
    elif which == "refs-key":
        t["refs"][rec] = tip
    elif which == "tags-key":
        t["tags"][rec] = tip


def _check_tag_object(rec: bytes) -> None:
    try:
        name, root, when = decode_tag(rec)
    except TsckError:
        return
    validate_name(name, "tag name")
    if not (isinstance(root, bytes) and len(root) == 32 and isinstance(when, float)):
        raise ContractViolation(f"decode_tag returned {(name, root, when)!r}")


def _use_store(store, which: str, rec: bytes) -> None:
    if which == "tag-object":
        _check_tag_object(rec)
        store.storage.put_if_absent(tag_key("fresh"), [rec])
        _attempt(store.tag, "fresh", "jobA/main")
        store.reftable._data["tags"].pop(b"golden", None)
        rep = _attempt(store.recover)
        if rep is not None:
            for name in rep.tags_restored:
                validate_name(name, "tag name")
        _attempt(store.tags)
        return
    try:
        decode_record(rec, which)
    except TsckError:
        pass
    _attempt(store.log, "jobA/main")
    _attempt(store.resolve, "jobA/main@10")
    _attempt(store.refs)
    _attempt(store.tags)
    _attempt(store.show, "jobA/dev")
    _attempt(store.du)
    _attempt(store.retention)
    _attempt(store.checkout, "golden")
    _attempt(store.fsck, full=False)
    _attempt(store.gc, dry_run=True)
    _attempt(store.put_snapshot, {"x": 1}, ref="jobA/main", step=30)
    _attempt(store.put_snapshot, {"y": 2}, ref="jobC/new", step=1, expected=None)
    _attempt(store.pin, "jobA/main")
    _attempt(store.gc)
    _attempt(store.fsck, full=True)
    _attempt(store.log, "jobA/main")


def _use_marker(rec: bytes) -> None:
    url = f"memory://tsck-fuzz-marker-{uuid.uuid4().hex}"
    storage = FsspecBlockStore(url)
    storage.put_if_absent("tsck.json", [rec])
    try:
        store = tsck.open_store(url, create=False)
    except TsckError:
        store = None
    else:
        try:
            _attempt(store.put_snapshot, {"x": 1}, ref="a/b")
            _attempt(store.checkout, "a/b")
        finally:
            _common.drop_memory_store(store)
    if store is None:
        try:
            storage.fs.rm(storage.root, recursive=True)
        except FileNotFoundError:
            pass


def TestOneInput(data: bytes) -> None:
    data = bytes(data)
    if not data:
        return
    which, rec = TABLES[data[0] % len(TABLES)], data[1:]
    if which == "marker":
        with _common.deadline(DEADLINE, "store marker input"):
            _use_marker(rec)
        return
    store = _store()
    rt = store.reftable
    saved = {t: dict(v) for t, v in rt._data.items()}
    try:
        _plant(store, which, rec)
        with _common.deadline(DEADLINE, f"{which} record input"):
            _use_store(store, which, rec)
    finally:
        rt._data = {t: dict(v) for t, v in saved.items()}
        store._bg_error = None
        _restore_storage(store)


def seed(which: str, rec: bytes) -> bytes:
    """The input that plants `rec` as `which` (make_corpus.py and the tests use it)."""
    return bytes([TABLES.index(which)]) + rec


if __name__ == "__main__":
    _common.atheris_main(TestOneInput, default_args=["-max_len=4096"],
                         custom_mutator=_common.msgpack_custom_mutator(1))
