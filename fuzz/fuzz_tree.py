"""Fuzz target: the manifest grammar (tensorstore_ck/format/tree.py) and the DCP
reader's decoders (dcp/layout.py DcpTree, dcp/metadata.py decode_metadata,
dcp/reader.py TsckReader) that read through it.

Input: the msgpack bytes of one raw node VALUE (what manifest.decode_node
returns; seeds: fuzz/corpus/tree/, the values of every node of the real
snapshots and of a real DCP snapshot). Bytes that are not msgpack are skipped.

Contract, for a raw value V:
a. tree.decode_value(V, world=True), decode_value(V) and decode_node_value(V,
   world=True) return a typed value (None/bool/int/float/str/bytes, Container,
   Ref, Tensor, Array, Global, NpScalar, Pickled, World) or raise FormatError,
   consistently with each other; tree.visit over a result never raises and
   yields (path, depth, Ref | World | leaf).
   tree.check_leaf (the writers' check of a leaf) refuses V with UnsupportedType
   exactly when decode_value(V) refuses it, and passes every leaf (T, A, G, S, P)
   inside a V that decodes, at the leaf's path.
b. what the writer writes, the readers read: if V decodes, NodeWriter().check(V)
   passes or raises UnsupportedType; if it passes, NodeWriter().write(V, put)
   into a dict, every written payload decodes (manifest.decode_node +
   tree.decode_node_value, children at their Ref's path and depth, the top with
   world=True), and putting the written children back gives V again.
c. the DCP reader: V is planted in a real in-memory store as the "tensors",
   the "bytes" and (separately) the "metadata" section of a real DCP snapshot's
   top node (written once per process by dcp.save + TsckWriter), both as a node
   of its own and inline in the top node (the input bytes spliced in as given,
   so values deeper than msgpack's packer allows reach the store too), and
   published (store.commit_tree);
   then DcpTree, decode_metadata(metadata_plain), chunks(fqn) / bytes_item(fqn)
   for every entry, TsckReader.read_metadata (and its byte reads), and
   store.checkout each return or raise a TsckError subclass. The ref table is
   reset and the planted objects removed after each input.
"""

from __future__ import annotations

import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402
from _common import ContractViolation  # noqa: E402

with _common.instrument(__name__ == "__main__"):
    import blake3
    import msgpack
    from tensorstore_ck.core.assets import commit_key, node_key
    from tensorstore_ck.dcp.layout import DcpTree
    from tensorstore_ck.dcp.metadata import decode_metadata
    from tensorstore_ck.dcp.reader import TsckReader
    from tensorstore_ck.errors import FormatError, StepReusedWarning, UnsupportedType
    from tensorstore_ck.format import tree
    from tensorstore_ck.format.manifest import decode_commit, decode_node, encode_node

_STATE: dict = {}
STATS = {"bytes_total": 0, "bytes_new": 0, "blocks_total": 0, "blocks_new": 0}
DEADLINE = 10.0
SECTIONS = ("tensors", "bytes", "metadata")
DCP_REF = "dcp/main"
_TYPED = (type(None), bool, int, float, str, bytes, tree.Container, tree.Ref, tree.Tensor, tree.Array,
          tree.Global, tree.NpScalar, tree.Pickled, tree.World)
_VISITED = (tree.Ref, tree.World, tree.Tensor, tree.Array, tree.Global)
_LEAVES = (tree.Tensor, tree.Array, tree.Global, tree.NpScalar, tree.Pickled)


def dcp_state() -> dict:
    """The state dict of the DCP template snapshot: tensors of several dtypes and
    shapes (a multi-block one, an empty one, a 0-d one) and DCP's byte items."""
    import torch
    g = torch.Generator().manual_seed(99)
    return {
        "model": {"w": torch.randn(64, 32, generator=g), "b": torch.zeros(32),
                  "bf16": torch.randn(16, generator=g).to(torch.bfloat16)},
        "extra": {"step": 7, "name": "dcp-run", "lrs": [0.1, 0.01], "flags": {"ema": True, "none": None},
                  "ids": torch.arange(40, dtype=torch.int64), "empty": torch.empty(0, 3),
                  "scalar": torch.tensor(2.5, dtype=torch.float64), "blob": b"\x01" * 5000},
    }


def write_dcp_snapshot(store, ref: str = DCP_REF):
    """A real DCP snapshot (single process) on `ref`; returns its SnapshotInfo."""
    import torch.distributed.checkpoint as dcp

    from tensorstore_ck.dcp import TsckWriter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        w = TsckWriter(store, ref=ref, step=1)
        dcp.save(dcp_state(), storage_writer=w)
    return store.log(ref)[0]


def _store():
    if "store" not in _STATE:
        store, info = _common.build_real_store()
        snap = write_dcp_snapshot(store)
        c = decode_commit(store.assets.get_commit(bytes.fromhex(snap.root)))
        top = decode_node(store.assets.get_node(c["tree"]))
        _STATE.update(store=store, info=info, dcp_top=top)
    return _STATE["store"]


_attempt = _common.attempt


# ---------------------------------------------------------------- a. the decoder
def _decode(fn, raw, **kw):
    try:
        v = fn(raw, **kw)
    except FormatError:
        return None, False
    if not isinstance(v, _TYPED):
        raise ContractViolation(f"{fn.__name__} returned a {type(v).__name__}")
    return v, True


def _visit_all(v) -> list:
    out = []
    for item in tree.visit(v):
        if not (isinstance(item, tuple) and len(item) == 3 and isinstance(item[0], tuple)
                and type(item[1]) is int and isinstance(item[2], _VISITED)):
            raise ContractViolation(f"visit yielded {item!r:.100}")
        out.append(item)
    return out


def check_decoders(raw):
    """-> the typed value (world=True), or None when the grammar refuses raw."""
    top, ok_w = _decode(tree.decode_value, raw, world=True)
    plain, ok = _decode(tree.decode_value, raw)
    nodev, ok_n = _decode(tree.decode_node_value, raw, world=True)
    if ok and not ok_w:
        raise ContractViolation("decode_value accepts without world what it refuses with world=True")
    if ok_w and not ok and not isinstance(top, tree.World):
        raise ContractViolation("world=True changes the verdict on a value that is not multi-rank")
    if ok_n != (ok_w and not isinstance(top, tree.Ref)):
        raise ContractViolation(f"decode_node_value {'accepts' if ok_n else 'refuses'} a value that "
                                f"decode_value {'accepts' if ok_w else 'refuses'} ({type(top).__name__})")
    for v, good in ((top, ok_w), (plain, ok), (nodev, ok_n)):
        if good:
            _visit_all(v)
    check_leaves(raw, ok, top if ok_w else None)
    return top if ok_w else None


def _check_leaf(raw, path) -> bool:
    try:
        tree.check_leaf(raw, path)
    except UnsupportedType:
        return False
    return True


def check_leaves(raw, ok: bool, top) -> None:
    """The writers' check_leaf is the readers' decoder: check_leaf(V) passes exactly when
    decode_value(V) does, and every leaf inside a value that decodes passes it at its path."""
    if _check_leaf(raw, ()) != ok:
        raise ContractViolation(f"check_leaf {'refuses' if ok else 'accepts'} a value that decode_value "
                                f"{'accepts' if ok else 'refuses'}")
    if top is None:
        return
    todo = [(raw, top, ())]
    while todo:
        r, v, path = todo.pop()
        if isinstance(v, tree.Container):
            body = next(iter(r.values()))
            if v.kind in ("d", "o"):
                todo.extend((pair[1], x, path + (k,)) for pair, (k, x) in zip(body, v.items))
            else:
                todo.extend((x_raw, x, path + (i,)) for i, (x_raw, x) in enumerate(zip(body, v.items)))
        elif isinstance(v, _LEAVES) and not _check_leaf(r, path):
            raise ContractViolation(f"check_leaf refuses a {type(v).__name__} leaf that decodes, at "
                                    f"{tree.format_path(path)}")


# ---------------------------------------------------------------- b. writer -> readers
def _ref_digests(v) -> set:
    return {x.digest for _p, _d, x in tree.visit(v) if isinstance(x, tree.Ref)}


def _reassemble(v, written: dict, own: set):
    """Replace every {"r": d} that the writer made (d in written, not in own) by its node's value.
    Iterative: a value 200 containers deep is 600 Python levels."""
    out = [None]
    todo = [(v, out, 0)]
    while todo:
        x, parent, key = todo.pop()
        while isinstance(x, dict) and len(x) == 1 and "r" in x and isinstance(x["r"], bytes) \
                and x["r"] in written and x["r"] not in own:
            x = decode_node(written[x["r"]])
        if isinstance(x, dict):
            parent[key] = y = dict.fromkeys(x)  # keys in order: msgpack packs dicts in insertion order
            todo.extend((x[k], y, k) for k in x)
        elif isinstance(x, list):
            parent[key] = y = [None] * len(x)
            todo.extend((e, y, i) for i, e in enumerate(x))
        else:
            parent[key] = x
    return out[0]


def check_writer(raw, typed) -> None:
    try:
        tree.NodeWriter().check(raw)
    except UnsupportedType:
        return
    written: dict = {}

    def put(payload: bytes) -> bytes:
        d = blake3.blake3(payload).digest()
        written[d] = payload
        return d

    try:
        top = tree.NodeWriter().write(raw, put)
    except UnsupportedType as e:
        raise ContractViolation(f"NodeWriter.write refused what NodeWriter.check accepted: {e}") from None
    if top not in written:
        raise ContractViolation("NodeWriter.write returned the digest of no payload it wrote")
    own = _ref_digests(typed)
    reached = set()
    todo = [(top, (), 0)]
    while todo:
        d, path, depth = todo.pop()
        if d in reached:
            continue
        reached.add(d)
        try:
            v = tree.decode_node_value(decode_node(written[d]), path, depth, world=d == top)
        except FormatError as e:
            raise ContractViolation(f"a node the writer wrote does not decode: {e}") from None
        for p, dep, item in _visit_all(v):
            if isinstance(item, tree.Ref) and item.digest in written and item.digest not in own:
                todo.append((item.digest, p, dep))
    unread = [d.hex()[:12] for d in written if d not in reached]
    if unread:
        raise ContractViolation(f"the writer wrote nodes its top does not reach: {unread}")
    back = _reassemble(decode_node(written[top]), written, own)
    if msgpack.packb(back, use_bin_type=True) != msgpack.packb(raw, use_bin_type=True):
        raise ContractViolation("the nodes the writer wrote do not put the value back together")


# ---------------------------------------------------------------- c. the DCP reader
def _with_section(top_raw, section: str, value):
    items = [[k, value if k == section else v] for k, v in top_raw["d"]]
    return {"d": items}


def _read_dcp(store, ref: str) -> None:
    root = store.resolve(ref)
    t = _attempt(DcpTree, store.assets, store.pool, root, True)
    if t is not None:
        _attempt(decode_metadata, t.metadata_plain)
        for fqn in list(t.tensors):
            r = _attempt(t.chunks, fqn)
            if r is not None and not (isinstance(r, tuple) and len(r) == 3 and isinstance(r[2], dict)):
                raise ContractViolation(f"DcpTree.chunks returned {r!r:.100}")
        for fqn in list(t.bytes):
            r = _attempt(t.bytes_item, fqn)
            if r is not None:
                raw, leaf = r
                if not ((isinstance(raw, bytes) and leaf is None) or (raw is None and type(leaf) is tree.Tensor)):
                    raise ContractViolation(f"DcpTree.bytes_item returned {r!r:.100}")
    reader = _attempt(TsckReader, store, ref)
    if reader is not None and _attempt(reader.read_metadata) is not None:
        for fqn in list(reader._m.bytes):  # DcpTree or NativeTree (a put_snapshot tree)
            b = _attempt(reader._read_bytes, reader._m, fqn)
            if b is not None and not isinstance(b, bytes):
                raise ContractViolation(f"TsckReader read {type(b).__name__} for a bytes item")
    state = _attempt(store.checkout, ref)
    if state is not None:
        _common.check_state_types(state)


_MARK = b"\xa5fuzz-tree-mark\x5a" * 2  # 32 bytes no planted top holds


def _splice(value_with_mark, data: bytes) -> bytes:
    """encode_node(value) with the marker's encoding replaced by the input's bytes: the
    input reaches the store exactly as given, however deep (msgpack's packer stops at 1024
    levels; a node file deeper than that is for the readers to refuse)."""
    payload = encode_node(value_with_mark)
    enc = msgpack.packb(_MARK, use_bin_type=True)
    assert payload.count(enc) == 1
    return payload.replace(enc, data)


def check_dcp(store, data: bytes, planted: list) -> None:
    top_raw = _STATE["dcp_top"]
    payload = _splice(_MARK, data)
    d = blake3.blake3(payload).digest()
    if not store.storage.exists(node_key(d)):
        planted.append(node_key(d))
    store.assets.put_node(payload)
    for section in SECTIONS:
        for value in ({"r": d}, None):  # a node of its own (as the writer lays it out), and inline
            top = encode_node(_with_section(top_raw, section, value)) if value is not None \
                else _splice(_with_section(top_raw, section, _MARK), data)
            td = blake3.blake3(top).digest()
            if not store.storage.exists(node_key(td)):
                planted.append(node_key(td))
            store.assets.put_node(top)
            with warnings.catch_warnings():  # every input is committed at step 1 on purpose
                warnings.simplefilter("ignore", StepReusedWarning)
                info = store.commit_tree(td, ref="fuzz/dcp", job="fuzz", step=1, metrics={}, meta={"format": "dcp"},
                                         stats=dict(STATS))
            planted.append(commit_key(bytes.fromhex(info.root)))
            _read_dcp(store, "fuzz/dcp")


def TestOneInput(data: bytes) -> None:
    data = bytes(data)
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=False, use_list=True)
    except Exception:  # not msgpack: nothing to feed the grammar
        return
    typed = check_decoders(raw)
    if typed is not None:
        check_writer(raw, typed)
    store = _store()
    rt = store.reftable
    saved = {t: dict(v) for t, v in rt._data.items()}
    planted: list = []
    try:
        with _common.deadline(DEADLINE, "tree input"):
            _attempt(check_dcp, store, data, planted)
    finally:
        rt._data = {t: dict(v) for t, v in saved.items()}
        for key in planted:
            store.storage.delete(key)


if __name__ == "__main__":
    _common.atheris_main(TestOneInput, default_args=["-max_len=65536"],
                         custom_mutator=_common.msgpack_custom_mutator(0))
