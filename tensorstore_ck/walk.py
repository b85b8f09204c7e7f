"""Walk a snapshot's Merkle DAG without loading tensor data (gc mark, fsck, diff).

Yields the objects under a commit with the state path that reaches them.
Nodes are read (and verified) because they hold the addresses; blocks are
only named, with the byte length the manifest expects of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

from .assets import Assets
from .errors import FormatError, IntegrityError
from .format.manifest import MAX_DEPTH, decode_commit, decode_node
from .chunker import MAX_BLOCK_SIZE
from .state import format_path

__all__ = ["Obj", "walk_commit", "walk_tree", "iter_leaves"]


@dataclass(frozen=True, slots=True)
class Obj:
    kind: str            # "commit" | "node" | "block"
    digest: bytes
    path: str            # where in the state it sits ("" for the commit and top node)
    nbytes: int | None = None  # blocks: the length the manifest expects


def _leaf_blocks(body, path) -> Iterator[tuple[int, bytes, int]]:
    if not isinstance(body, dict):
        raise FormatError(f"tensor leaf is not a map at {format_path(path)}")
    if "x" in body:
        return
    n, bs, blocks = body.get("n"), body.get("bs"), body.get("b")
    if not (isinstance(n, int) and not isinstance(n, bool) and n >= 0 and isinstance(bs, int)
            and 0 < bs <= MAX_BLOCK_SIZE and isinstance(blocks, list) and len(blocks) == math.ceil(n / bs)):
        raise FormatError(f"bad block layout at {format_path(path)}")
    for i, d in enumerate(blocks):
        if not isinstance(d, bytes) or len(d) != 32:
            raise FormatError(f"bad block address at {format_path(path)}")
        yield i, d, min(n, (i + 1) * bs) - i * bs


def walk_tree(assets: Assets, tree: bytes, *, snapshot: str, verify: bool = True,
              skip_nodes: set | None = None) -> Iterator[Obj]:
    """Every node and block under `tree`, depth first. Nodes in `skip_nodes`
    (already walked elsewhere) are neither yielded nor descended; new nodes are
    added to it."""
    stack = [(tree, ())]
    while stack:
        d, path = stack.pop()
        if skip_nodes is not None:
            if d in skip_nodes:
                continue
            skip_nodes.add(d)
        yield Obj("node", d, format_path(path))
        data = assets.get_node(d, verify=verify, snapshot=snapshot, path=format_path(path))
        try:
            value = decode_node(data)
        except FormatError as e:
            raise IntegrityError(f"undecodable manifest node: {e}", snapshot=snapshot,
                                 path=format_path(path), key=f"nodes/{d.hex()[:2]}/{d.hex()}") from None
        todo = [(value, path, 0)]
        while todo:
            v, p, depth = todo.pop()
            if depth > MAX_DEPTH:
                raise FormatError(f"manifest nested deeper than {MAX_DEPTH} at {format_path(p)}")
            if not isinstance(v, dict) or len(v) != 1:
                continue
            (tag, body), = v.items()
            if tag == "r":
                if not isinstance(body, bytes) or len(body) != 32:
                    raise FormatError(f"bad node reference at {format_path(p)}")
                stack.append((body, p))
            elif tag in ("d", "o"):
                if not isinstance(body, list):
                    raise FormatError(f"bad dict at {format_path(p)}")
                for pair in reversed(body):
                    if isinstance(pair, list) and len(pair) == 2:
                        k = pair[0] if isinstance(pair[0], (str, int)) else "?"
                        todo.append((pair[1], p + (k,), depth + 1))
            elif tag in ("l", "t"):
                if not isinstance(body, list):
                    raise FormatError(f"bad sequence at {format_path(p)}")
                for i in range(len(body) - 1, -1, -1):
                    todo.append((body[i], p + (i,), depth + 1))
            elif tag in ("T", "A"):
                for _i, bd, nb in _leaf_blocks(body, p):
                    yield Obj("block", bd, format_path(p), nb)
            elif tag == "G":
                chunks = body.get("chunks") if isinstance(body, dict) else None
                if not isinstance(chunks, list):
                    raise FormatError(f"bad sharded tensor at {format_path(p)}")
                for c in chunks:
                    for _i, bd, nb in _leaf_blocks(c, p):
                        yield Obj("block", bd, format_path(p), nb)
            elif tag == "W":
                ranks = body.get("ranks") if isinstance(body, dict) else None
                if not isinstance(ranks, list) or not all(isinstance(d, bytes) and len(d) == 32 for d in ranks):
                    raise FormatError("bad multi-rank snapshot")
                for d in reversed(ranks):
                    stack.append((d, p))


def walk_commit(assets: Assets, root: bytes, *, verify: bool = True, skip_nodes: set | None = None
                ) -> Iterator[Obj]:
    """The commit object itself, then everything under its tree."""
    yield Obj("commit", root, "")
    c = decode_commit(assets.get_commit(root, verify=verify))
    yield from walk_tree(assets, c["tree"], snapshot=root.hex(), verify=verify, skip_nodes=skip_nodes)


def iter_leaves(assets: Assets, root: bytes, *, verify: bool = True) -> dict[str, tuple[str, list]]:
    """path -> (dtype/shape summary, [block digests]) for every tensor/array of a snapshot (diff)."""
    c = decode_commit(assets.get_commit(root, verify=verify))
    out: dict[str, tuple[str, list]] = {}

    def visit(v, p, depth):
        if depth > MAX_DEPTH or not isinstance(v, dict) or len(v) != 1:
            return
        (tag, body), = v.items()
        if tag == "r" and isinstance(body, bytes) and len(body) == 32:
            visit(decode_node(assets.get_node(body, verify=verify, snapshot=root.hex())), p, depth + 1)
        elif tag in ("d", "o") and isinstance(body, list):
            for pair in body:
                if isinstance(pair, list) and len(pair) == 2:
                    visit(pair[1], p + (pair[0] if isinstance(pair[0], (str, int)) else "?",), depth + 1)
        elif tag in ("l", "t") and isinstance(body, list):
            for i, x in enumerate(body):
                visit(x, p + (i,), depth + 1)
        elif tag in ("T", "A") and isinstance(body, dict):
            desc = f"{body.get('dt')} {body.get('sh')}"
            if "x" in body:
                if not isinstance(body["x"], bytes):
                    raise FormatError(f"bad inline tensor at {format_path(p)}")
                out[format_path(p)] = (desc, [body["x"]])
            else:
                out[format_path(p)] = (desc, [d for _i, d, _n in _leaf_blocks(body, p)])
        elif tag == "G" and isinstance(body, dict) and isinstance(body.get("chunks"), list):
            key = format_path(p)
            desc, blocks = out.get(key, (f"{body.get('dt')} {body.get('sh')} sharded", []))
            for c in sorted(body["chunks"], key=lambda c: str(c.get("off")) if isinstance(c, dict) else ""):
                if not isinstance(c, dict) or ("x" in c and not isinstance(c["x"], bytes)):
                    raise FormatError(f"bad chunk at {format_path(p)}")
                blocks = blocks + ([c["x"]] if "x" in c else [d for _i, d, _n in _leaf_blocks(c, p)])
            out[key] = (desc, blocks)
        elif tag == "W" and isinstance(body, dict) and isinstance(body.get("ranks"), list):
            if depth or not all(isinstance(d, bytes) and len(d) == 32 for d in body["ranks"]):
                raise FormatError("bad multi-rank snapshot")
            for d in body["ranks"]:  # every rank's tree; sharded tensors gather their chunks by path
                visit(decode_node(assets.get_node(d, verify=verify, snapshot=root.hex())), p, depth + 1)

    visit(decode_node(assets.get_node(c["tree"], verify=verify, snapshot=root.hex())), (), 0)
    return out
