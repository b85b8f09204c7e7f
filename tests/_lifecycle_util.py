"""Helpers for the lifecycle tests (retention/gc, fsck, recover).

Everything here is written independently of tensorstore_ck's internals:

- `StoreWalker` reads object files straight from disk (16-byte frame header,
  then msgpack; lz4 block codec for compressed ones), verifies each object's
  BLAKE3 against its file name, and follows a commit's "tree" and every "r"
  reference to collect the keys of all nodes and blocks a snapshot reaches,
  with the state path of every block (format per docs/FORMAT.md).
- `model_kept` is a plain model of the retention rules, written from their
  definitions in docs/design/gc.md and the README (not from tensorstore_ck/maintain/retention.py).
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field

import blake3
import lz4.block
import msgpack

HEADER = struct.Struct("<4sBBBBQ")
KIND_DIRS = {0: "blocks", 1: "nodes", 2: "commits"}


def key_of(kind_dir: str, hexd: str) -> str:
    return f"{kind_dir}/{hexd[:2]}/{hexd}"


def fmt_path(parts) -> str:
    """The path format of IntegrityError.path (docs/design/reading.md): ['model']['w'], ['opt']['state'][3]."""
    return "".join(f"[{p!r}]" for p in parts)


# ---------------------------------------------------------------- raw object reading
def _raw(where, key: str) -> bytes:
    """Bytes of one stored object: `where` is a local store path or a tests/_backends.Backend."""
    if hasattr(where, "read"):
        return where.read(key)
    with open(os.path.join(str(where), key), "rb") as f:
        return f.read()


def read_object(store_path, kind_dir: str, hexd: str, *, verify: bool = True) -> bytes:
    """The raw (decoded) payload of one object, checked against its address."""
    path = key_of(kind_dir, hexd)
    data = _raw(store_path, path)
    magic, version, codec, itemsize, kind, raw_len = HEADER.unpack_from(data, 0)
    assert magic == b"TSKO" and version == 1, f"{path}: bad frame header"
    assert KIND_DIRS[kind] == kind_dir, f"{path}: kind {kind} stored under {kind_dir}/"
    payload = data[HEADER.size:]
    if codec == 0:
        raw = payload
    elif codec == 1:
        raw = lz4.block.decompress(payload, uncompressed_size=raw_len)
    else:
        raise AssertionError(f"{path}: codec {codec} not expected in these tests")
    assert len(raw) == raw_len, f"{path}: payload is {len(raw)} bytes, header says {raw_len}"
    if verify:
        assert blake3.blake3(raw).hexdigest() == hexd, f"{path}: content does not match its address"
    return raw


def header_of(store_path, key: str) -> tuple[int, int]:
    """(codec, raw_len) of an object file."""
    _m, _v, codec, _i, _k, raw_len = HEADER.unpack(_raw(store_path, key)[:HEADER.size])
    return codec, raw_len


def unpack(raw: bytes):
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


@dataclass
class SnapWalk:
    root: str
    commit: dict
    keys: set = field(default_factory=set)       # every object key the snapshot reaches (incl. its commit)
    blocks: list = field(default_factory=list)   # (block key, state path) per occurrence
    nodes: list = field(default_factory=list)    # (node key, state path) per occurrence


class StoreWalker:
    """Walk snapshots by reading the store's objects directly (a path or a Backend)."""

    def __init__(self, store_path):
        self.path = store_path if hasattr(store_path, "read") else str(store_path)
        self._nodes: dict[str, object] = {}

    def commit(self, root_hex: str) -> dict:
        c = unpack(read_object(self.path, "commits", root_hex))
        assert c["k"] == "commit" and c["v"] == 1
        return c

    def _node_value(self, hexd: str):
        if hexd not in self._nodes:
            n = unpack(read_object(self.path, "nodes", hexd))
            assert isinstance(n, dict) and n.get("v") == 1 and "x" in n, f"node {hexd}: not a node"
            self._nodes[hexd] = n["x"]
        return self._nodes[hexd]

    def walk(self, root_hex: str) -> SnapWalk:
        c = self.commit(root_hex)
        w = SnapWalk(root_hex, c)
        w.keys.add(key_of("commits", root_hex))
        self._walk_node(c["tree"].hex(), (), w)
        return w

    def _walk_node(self, hexd: str, path, w: SnapWalk) -> None:
        k = key_of("nodes", hexd)
        w.keys.add(k)
        w.nodes.append((k, fmt_path(path) or None))
        self._walk_value(self._node_value(hexd), path, w)

    def _walk_value(self, v, path, w: SnapWalk) -> None:
        if not (isinstance(v, dict) and len(v) == 1):
            return  # a plain value
        (tag, body), = v.items()
        if tag == "r":
            assert isinstance(body, bytes) and len(body) == 32
            self._walk_node(body.hex(), path, w)
        elif tag in ("d", "o"):
            for kk, vv in body:
                if isinstance(kk, dict):  # big int key
                    kk = int.from_bytes(kk["i"], "big", signed=True)
                self._walk_value(vv, path + (kk,), w)
        elif tag in ("l", "t"):
            for i, vv in enumerate(body):
                self._walk_value(vv, path + (i,), w)
        elif tag in ("T", "A"):
            if "b" in body:
                n, bs, blocks = body["n"], body["bs"], body["b"]
                assert len(blocks) == math.ceil(n / bs)
                for d in blocks:
                    bk = key_of("blocks", d.hex())
                    w.keys.add(bk)
                    w.blocks.append((bk, fmt_path(path)))
        # "i", "S", "P": no references

    def reachable(self, roots) -> set[str]:
        out: set[str] = set()
        for r in roots:
            out |= self.walk(r).keys
        return out


def sizes(store_path, keys) -> int:
    if hasattr(store_path, "size"):
        return sum(store_path.size(k) for k in keys)
    return sum(os.path.getsize(os.path.join(str(store_path), k)) for k in keys)


# ---------------------------------------------------------------- retention model
@dataclass(frozen=True)
class Row:
    root: object
    step: int | None
    time: float
    metrics: dict


def _newness(r: Row):
    # "newest (by time, then step)"
    return (r.time, -math.inf if r.step is None else r.step)


def _is_value(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not (isinstance(v, float) and v != v)


def model_kept(rows, rule, now: float) -> set:
    """Roots kept by `rule` (a tsck.Retention, or None = no rules) among `rows`.

    From the retention rules (docs/design/gc.md): the union of
      keep_last N        the N newest by time, then step;
      keep_best K        the K best by metrics[metric] (min/max); rows without the metric
                         or with NaN are not candidates; ties go to the newer;
      keep_every_steps S for each window [k*S, (k+1)*S) of steps, the snapshot with the
                         smallest step in it (the oldest on a tie);
      max_age_days D     everything younger than D days.
    """
    rows = list(rows)
    if rule is None:
        return {r.root for r in rows}
    kept = set()
    if rule.keep_last:
        left = list(rows)
        for _ in range(min(rule.keep_last, len(left))):
            newest = left[0]
            for r in left[1:]:
                if _newness(r) > _newness(newest):
                    newest = r
            kept.add(newest.root)
            left.remove(newest)
    if rule.keep_best:
        left = [r for r in rows if _is_value(r.metrics.get(rule.metric))]
        for _ in range(min(rule.keep_best, len(left))):
            best = left[0]
            for r in left[1:]:
                v, b = r.metrics[rule.metric], best.metrics[rule.metric]
                better = v < b if rule.mode == "min" else v > b
                if better or (v == b and _newness(r) > _newness(best)):
                    best = r
            kept.add(best.root)
            left.remove(best)
    if rule.keep_every_steps:
        s = rule.keep_every_steps
        windows: dict[int, Row] = {}
        for r in rows:
            if r.step is None:
                continue
            k = r.step // s  # floor division: window [k*s, (k+1)*s) holds step
            cur = windows.get(k)
            if cur is None or r.step < cur.step or (r.step == cur.step and r.time < cur.time):
                windows[k] = r
        kept |= {r.root for r in windows.values()}
    if rule.max_age_days is not None:
        kept |= {r.root for r in rows if now - r.time < rule.max_age_days * 86400.0}
    return kept
