"""Fuzz target: manifest nodes and commits (tensorstore_ck/format/manifest.py)
and everything that interprets them: the Reader that allocates tensors
(read.py, decoding through format/tree.py), the DAG walk of gc and fsck
(walk.py), diff's leaf listing, show, log, refs, du and recover.

Input: one raw (uncompressed) object payload: a manifest node or a commit, as
found after the frame header under nodes/ and commits/ (seeds:
fuzz/corpus/manifest/). The same bytes are tried as both.

A real store (fuzz/_common.build_real_store: the snapshots make_corpus.py
copies the seeds from, rebuilt in memory) holds every block and child node a
seed references. For each input:
- decode_node / decode_commit: a value (commit fields type-checked) or FormatError;
- as a node: planted at its BLAKE3 address and published as the tree of a
  commit on ref fuzz/x; then checkout (new objects, and into= a real state),
  diff against jobA/main, fsck(full=True), gc(dry_run=True), log, du;
- as a commit: planted at its address with ref fuzz/c on it (no catalog row),
  then refs, show, checkout, fsck, gc(dry_run=True), recover, log, du.
Each call returns or raises a TsckError subclass; a checked-out state holds
only the types a snapshot can hold (nothing unpickled: allow_pickle is never
set here, so a fuzzer-made pickle is never loaded). The ref table is reset and
the planted objects removed after each input.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
from _common import ContractViolation  # noqa: E402

with _common.instrument(__name__ == "__main__"):
    import blake3
    from tensorstore_ck.core.assets import commit_key, node_key
    from tensorstore_ck.errors import TsckError
    from tensorstore_ck.format.manifest import _COMMIT_FIELDS, decode_commit, decode_node

_STATE: dict = {}
STATS = {"bytes_total": 0, "bytes_new": 0, "blocks_total": 0, "blocks_new": 0}
DEADLINE = 10.0


def _store():
    if "store" not in _STATE:
        _STATE["store"], _STATE["info"] = _common.build_real_store()
    return _STATE["store"]


def _check_commit_fields(c) -> None:
    if not isinstance(c, dict) or not set(c) <= _COMMIT_FIELDS or c.get("k") != "commit":
        raise ContractViolation(f"decode_commit returned {type(c).__name__} with fields {sorted(map(str, c))}")
    if not isinstance(c["job"], str) or not isinstance(c["ref"], str):
        raise ContractViolation("decode_commit returned a non-str job/ref")
    if not (isinstance(c["tree"], bytes) and len(c["tree"]) == 32):
        raise ContractViolation("decode_commit returned a bad tree digest")
    if c.get("parent") is not None and not (isinstance(c["parent"], bytes) and len(c["parent"]) == 32):
        raise ContractViolation("decode_commit returned a bad parent digest")
    if not isinstance(c.get("metrics"), dict) or not isinstance(c.get("stats"), dict):
        raise ContractViolation("decode_commit returned non-map metrics/stats")


_attempt = _common.attempt


def _as_node(store, data: bytes, planted: list) -> None:
    d = blake3.blake3(data).digest()
    if not store.storage.exists(node_key(d)):
        planted.append(node_key(d))
    store.assets.put_node(data)
    info = store.commit_tree(d, ref="fuzz/x", job="fuzz", step=1, metrics={}, meta={}, stats=dict(STATS))
    planted.append(commit_key(bytes.fromhex(info.root)))
    state = _attempt(store.checkout, "fuzz/x")
    if state is not None:
        _common.check_state_types(state)
    template = store.checkout("jobA/main")
    _attempt(store.checkout, "fuzz/x", into=template)
    _attempt(store.diff, "fuzz/x", "jobA/main")
    rep = _attempt(store.fsck, full=True)
    if rep is not None and not isinstance(rep.findings, list):
        raise ContractViolation("fsck report without a findings list")
    _attempt(store.gc, dry_run=True)
    _attempt(store.log, "fuzz/x")
    _attempt(store.du)


def _as_commit(store, data: bytes, planted: list) -> None:
    d = blake3.blake3(data).digest()
    if not store.storage.exists(commit_key(d)):
        planted.append(commit_key(d))
    store.assets.put_commit(data)
    store.reftable.compare_and_swap("fuzz/c", store.reftable.get_or_none("fuzz/c"), d, message="fuzz")
    _attempt(store.refs)
    _attempt(store.show, "fuzz/c")
    state = _attempt(store.checkout, "fuzz/c")
    if state is not None:
        _common.check_state_types(state)
    _attempt(store.fsck, full=True)
    _attempt(store.gc, dry_run=True)
    rep = _attempt(store.recover)
    if rep is not None:
        for ref in list(rep.refs_restored):
            _attempt(store.log, ref)
    _attempt(store.log, "fuzz/c")
    _attempt(store.du)
    _attempt(store.refs)


def TestOneInput(data: bytes) -> None:
    data = bytes(data)
    store = _store()
    as_node = as_commit = True
    try:
        decode_node(data)
    except TsckError:
        as_node = False
    try:
        c = decode_commit(data)
    except TsckError:
        as_commit = False
    else:
        _check_commit_fields(c)
    rt = store.reftable
    saved = {t: dict(v) for t, v in rt._data.items()}
    planted: list = []
    try:
        with _common.deadline(DEADLINE, "manifest input"):
            # Undecodable bytes go through the node path too: the reader must refuse them.
            if as_node or not as_commit:
                _attempt(_as_node, store, data, planted)
            if as_commit:
                _attempt(_as_commit, store, data, planted)
    finally:
        rt._data = {t: dict(v) for t, v in saved.items()}
        for key in planted:
            store.storage.delete(key)


if __name__ == "__main__":
    _common.atheris_main(TestOneInput, default_args=["-max_len=65536"],
                         custom_mutator=_common.msgpack_custom_mutator(0))
