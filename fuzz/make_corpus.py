"""Build the seed corpus of every fuzz target from REAL snapshots.

    .venv/bin/python fuzz/make_corpus.py [--out fuzz/corpus]

Creates a local store (LMDB ref table, file objects) in a temporary folder,
takes the snapshots of _common.build_real_store (a small training job: two
steps of jobA/main sharing most blocks, jobA/dev, a fine-tune on jobB/main, a
pickled value, a sharded tensor, a tag, a pin, a retention rule), runs gc so
the gc state record exists, then copies:

    frame/          every object file as stored (header + payload): blocks, nodes, commits
    manifest/       the raw payloads of every node and commit (and two multi-rank
                    "W" nodes made from the real trees, labelled synth-)
    refrecords/     every record of every LMDB table, the tag objects and the store
                    marker, each behind its one-byte selector (fuzz_refrecords.TABLES)
    names/          the real ref and tag names, REF@STEP targets, root prefixes
                    ({r8}, {r12}, {root}), job names, and a few hostile strings
    state_encoder/  the real states (each top-level entry) as Builder programs
    tree/           the raw node values (msgpack of decode_node's result) of every node
                    of the same snapshots and of a real DCP snapshot (fuzz_tree.
                    write_dcp_snapshot), plus a multi-rank "W" value and three values
                    at the depth edges (MAX_DEPTH, one past it, msgpack's 1024 levels)

`--only tree` rebuilds only that folder (the others keep their files).

File names are <label>-<sha1 of content, 12 hex>. Re-running replaces the
folder's contents (commit times differ per run, so some seeds change).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common  # noqa: E402


def _write(out: str, target: str, label: str, data: bytes) -> None:
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    name = f"{label}-{hashlib.sha1(data).hexdigest()[:12]}"
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(_common.CORPUS_DIR))
    ap.add_argument("--only", choices=["tree", "float"], help="rebuild only this folder (float: the float-* seeds of frame/)")
    args = ap.parse_args(argv)
    if args.only == "tree":
        n = tree_corpus(args.out)
        print(f"tree: {n}")
        return 0
    if args.only == "float":
        print(f"frame float-*: {float_seeds(args.out)}")
        return 0

    import lmdb

    import fuzz_refrecords
    import fuzz_state_encoder
    from tensorstore_ck.format import frame
    from tensorstore_ck.format.manifest import encode_node

    out = args.out
    for t in ("frame", "manifest", "refrecords", "names", "state_encoder"):
        shutil.rmtree(os.path.join(out, t), ignore_errors=True)
    counts: dict[str, int] = {}

    def write(target, label, data):
        _write(out, target, label, data)
        counts[target] = counts.get(target, 0) + 1

    with tempfile.TemporaryDirectory(prefix="tsck-corpus-") as tmp:
        path = os.path.join(tmp, "store")
        store, info = _common.build_real_store(path)
        trees = []
        try:
            store.gc()  # writes the gc state record (and applies jobA's retention)
            # -- objects: frame/ and manifest/
            for kind in ("blocks", "nodes", "commits"):
                for o in sorted(store.storage.list(kind + "/"), key=lambda o: o.key):
                    blob = store.storage.get(o.key)
                    write("frame", kind[:-1], blob)
                    if kind != "blocks":
                        hdr = frame.decode_header(blob)
                        payload = bytes(frame.decode_payload(hdr, blob[frame.HEADER_SIZE:]))
                        write("manifest", kind[:-1], payload)
            for snap in info["snapshots"][:4]:
                from tensorstore_ck.format.manifest import decode_commit
                c = decode_commit(store.assets.get_commit(bytes.fromhex(snap.root)))
                trees.append(c["tree"])
            write("manifest", "synth-world", encode_node({"W": {"ranks": trees[:2], "world": 2}}))
            write("manifest", "synth-world3", encode_node({"W": {"ranks": [trees[0], trees[3], trees[0]],
                                                                 "world": 3}}))
            # -- tag objects and the store marker
            for o in store.storage.list("tags/"):
                write("refrecords", "tag-object", fuzz_refrecords.seed("tag-object", store.storage.get(o.key)))
            write("refrecords", "marker", fuzz_refrecords.seed("marker", store.storage.get("tsck.json")))
        finally:
            store.close()
        counts["frame"] += float_seeds(out)
        # -- LMDB records
        env = lmdb.open(os.path.join(path, "refs.lmdb"), max_dbs=16, readonly=True, lock=False)
        value_tables = {"reflog": "reflog", "catalog": "catalog", "gc": "gc", "retention": "retention",
                        "refs": "refs", "tags": "tags", "meta": "meta"}
        key_tables = {"refs": "refs-key", "tags": "tags-key", "retention": "retention-key", "pins": "pins-key"}
        with env.begin() as txn:
            for table in ("refs", "reflog", "catalog", "tags", "pins", "retention", "gc", "meta"):
                db = env.open_db(table.encode(), txn=txn, create=False)
                for k, v in txn.cursor(db=db):
                    if table in value_tables:
                        write("refrecords", table, fuzz_refrecords.seed(value_tables[table], bytes(v)))
                    if table in key_tables:
                        write("refrecords", key_tables[table], fuzz_refrecords.seed(key_tables[table], bytes(k)))
        env.close()

    # -- names and targets
    names = list(info["refs"]) + list(info["tags"]) + ["jobA", "jobB"]
    names += [f"{s.ref}@{s.step}" for s in info["snapshots"]]
    names += ["{r8}", "{r12}", "{root}", "{r8}0", "jobA/main@-1", "jobA/main@00010", "new/ref.v1_x-y",
              "../x", "a/../../etc/passwd", "a\\b", "%2e%2e/x", "a//b", "/abs", "a@b@1", "jobA/main~1",
              "x" * 255, "x" * 256, "é/ü", "a\x00b", "a\nb", "ＡＢ", "golden/..", "deadbeef", "0" * 64]
    for n in names:
        write("names", "name", n.encode("utf-8", "surrogatepass"))

    # -- state encoder programs
    for i, st in enumerate(_common.real_states()):
        for k, v in st.items():
            write("state_encoder", f"state{i}", fuzz_state_encoder.encode_tree({k: v}))
        for k, v in st.get("model", {}).items():
            write("state_encoder", f"state{i}-model", fuzz_state_encoder.encode_tree({k: v}))
    write("state_encoder", "synth-deep", bytes([0, 16, 7, 100]))
    write("state_encoder", "synth-pickle", bytes([1, 8, 2, 0, 1, 97, 15, 0, 4, 0, 1, 98, 15, 3]))
    counts["tree"] = tree_corpus(out)
    print(" ".join(f"{t}: {n}" for t, n in sorted(counts.items())))
    return 0


def float_seeds(out: str) -> int:
    """frame/float-*: float-codec (codec 3) frames of trained-like weights in each float
    width, with and without tail bytes, with zstd-coded and raw planes. -> count."""
    import numpy as np
    import torch

    from tensorstore_ck.format import frame
    g = torch.Generator().manual_seed(16)
    n = 0
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for count, tail in ((1024, b""), (777, b"\x01\x02\x03")):
            x = (torch.randn(count, generator=g) * 0.02).to(dt)
            raw = x.view(torch.uint8).numpy().tobytes() + tail
            if dt == torch.float32:  # an all-but-exponent plane that shrinks too (zstd-coded T)
                raw = (x.to(torch.bfloat16).to(torch.float32)).view(torch.uint8).numpy().tobytes() + tail
            k = x.element_size()
            bufs = frame.encode_payload(np.frombuffer(raw, np.uint8), frame.KIND_BLOCK, float_itemsize=k)
            blob = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
            assert blob[5] == frame.CODEC_FLOAT, (dt, count)
            _write(out, "frame", f"float-{str(dt)[6:]}", blob)
            n += 1
    return n


def tree_corpus(out: str) -> int:
    """fuzz/corpus/tree/: the raw value of every node of the real snapshots (rebuilt in
    memory, as fuzz_tree does) and of a real DCP snapshot, as msgpack. -> count."""
    import msgpack

    import fuzz_tree
    from tensorstore_ck.format import frame, tree
    from tensorstore_ck.format.manifest import decode_commit, decode_node

    def _nested(n, leaf):
        for _ in range(n):
            leaf = {"d": [["k", leaf]]}
        return leaf

    shutil.rmtree(os.path.join(out, "tree"), ignore_errors=True)
    store, info = _common.build_real_store()
    n = 0
    try:
        def node_values():
            got = {}
            for o in sorted(store.storage.list("nodes/"), key=lambda o: o.key):
                blob = store.storage.get(o.key)
                payload = bytes(frame.decode_payload(frame.decode_header(blob), blob[frame.HEADER_SIZE:]))
                got[o.key] = msgpack.packb(decode_node(payload), use_bin_type=True)
            return got

        real = node_values()
        fuzz_tree.write_dcp_snapshot(store)
        every = node_values()
        trees = [decode_commit(store.assets.get_commit(bytes.fromhex(s.root)))["tree"] for s in info["snapshots"][:2]]
        seeds = [("node", v) for k, v in real.items()] + [("dcp", v) for k, v in every.items() if k not in real]
        # every distinct leaf (T, A, G, S, i, P) inside them as a value of its own: short seeds per kind
        leaves: dict = {}

        def walk(v):
            if isinstance(v, dict):
                if len(v) == 1 and next(iter(v)) in ("T", "A", "G", "S", "i", "P"):
                    (tag, body), = v.items()
                    kind = (tag, str(body.get("dt")), "x" in body, "q" in body, "rep" in body) \
                        if isinstance(body, dict) else (tag, str(body[0]) if isinstance(body, list) else "")
                    leaves.setdefault(kind, msgpack.packb(v, use_bin_type=True))  # one per kind and dtype
                for x in v.values():
                    walk(x)
            elif isinstance(v, list):
                for x in v:
                    walk(x)

        for _label, data in seeds:
            walk(msgpack.unpackb(data, raw=False, strict_map_key=False))
        seeds += [("leaf", b) for b in leaves.values()]
        seeds.append(("synth-world", msgpack.packb({"W": {"ranks": trees, "world": 2}}, use_bin_type=True)))
        # the depth edges: a value at MAX_DEPTH whose leaf the writer splits off, one level
        # past it, and a value at msgpack's own limit (1024 levels; planted, it is deeper)
        seeds.append(("synth-deep200", msgpack.packb(_nested(tree.MAX_DEPTH, b"\1" * 5000), use_bin_type=True)))
        seeds.append(("synth-deep201", msgpack.packb(_nested(tree.MAX_DEPTH + 1, None), use_bin_type=True)))
        seeds.append(("synth-msgpack-limit", b"\x91" * 1023 + b"\xc0"))
        for label, data in seeds:
            _write(out, "tree", label, data)
            n += 1
    finally:
        _common.drop_memory_store(store)
    return n


if __name__ == "__main__":
    sys.exit(main())
