"""Dotted paths inside a state, as `tsck ls`, `checkout(paths=)` and safetensors names write them.

A path is the keys from the top joined by "." ("model.layers.0.weight"), list and
tuple items by their index. A key that holds dots (a flat state_dict's) is kept whole,
so a flat state_dict and the same tree stored nested name their values alike, and
"model.layers.0" selects in either: a path selects every value whose dotted path is
it or starts with it and a dot.
"""

from __future__ import annotations

from ..errors import InvalidArgument

__all__ = ["key_str", "dotted", "dotted_from_formatted", "parts_from_formatted", "under", "toward", "Selection", "FULL", "SKIP", "is_stateful"]

MAX_PATHS = 1 << 16
MAX_PATH_LEN = 1 << 16


def key_str(k) -> str:
    if type(k) is int and k.bit_length() > 64:
        return f"<int of {k.bit_length()} bits>"  # str() of a huge int is slow or refused
    return str(k)


def dotted(parts) -> str:
    """A path inside the state, as ls, checkout --path and safetensors names write it."""
    return ".".join(map(key_str, parts))


def under(p: str, path: str | None) -> bool:
    """`p` is `path` or below it (None: everything)."""
    return path is None or p == path or p.startswith(path + ".")


def toward(p: str, path: str | None) -> bool:
    """A node at `p` can hold values under `path` (it is above or under it)."""
    return path is None or p == "" or under(p, path) or path.startswith(p + ".")


FULL = None    # Selection.step: everything under this child is selected
SKIP = False   # Selection.step: nothing under this child is
_END = object()  # in a trie node: the requested path that ends there


class Selection:
    """The sub-trees `paths` name. Walking down, each position is FULL (all of it is
    selected), SKIP (none of it), or a node of the requested paths' trie (something
    below it is).

    The paths are split at their dots into one trie, built once: a step costs the
    components of its key, whatever the number of paths, so a walk costs keys + paths
    (comparing each key with every path cost keys x paths: 14,000 keys all named took
    100x a full checkout). Splitting is exact for keys holding dots too: `p` is `s` or
    starts with `s` and a dot exactly when `s`'s components begin `p`'s."""

    def __init__(self, paths):
        if isinstance(paths, (str, bytes)) or not hasattr(paths, "__iter__"):
            raise InvalidArgument(f"paths must be a list of dotted paths (e.g. ['model', 'optim.state.3']), "
                                  f"got {type(paths).__name__}")
        out = []
        for p in paths:
            if type(p) is not str or not p or len(p) > MAX_PATH_LEN or p.startswith(".") or p.endswith("."):
                raise InvalidArgument(f"a path is a non-empty dotted string like 'model.layers.0.weight', "
                                      f"got {p!r:.80}")
            out.append(p)
            if len(out) > MAX_PATHS:
                raise InvalidArgument(f"more than {MAX_PATHS} paths")
        if not out:
            raise InvalidArgument("paths is empty: pass at least one path, or paths=None for everything")
        self.paths = tuple(dict.fromkeys(out))
        self.matched: set[str] = set()
        self.root: dict = {}
        for s in self.paths:
            node = self.root
            for c in s.split("."):
                node = node.setdefault(c, {})
            node[_END] = s

    def at(self, parts):
        """The state of the position `parts` (keys from the top; () is the top)."""
        state = self.root
        for k in parts:
            state = self.step(state, k)
            if state is FULL or state is SKIP:
                break
        return state

    def step(self, here, key):
        """The state of the child `key` of a position in state `here` (a trie node)."""
        return self._walk(here, key_str(key).split("."), True)

    def _walk(self, node, comps, record: bool):
        for i, c in enumerate(comps):
            node = node.get(c)
            if node is None:
                return SKIP
            end = node.get(_END)
            if end is not None:
                if record:
                    self.matched.add(end)
                    for c2 in comps[i + 1:]:  # requested paths below it that this key also reaches
                        node = node.get(c2)
                        if node is None:
                            break
                        if _END in node:
                            self.matched.add(node[_END])
                return FULL
        return node

    def covers(self, p: str, *, record: bool = True) -> bool:
        """The value at dotted path `p` is selected (is at or under one of the paths)."""
        return self._walk(self.root, p.split("."), record) is FULL

    def unmatched(self) -> list[str]:
        return [s for s in self.paths if s not in self.matched]

    def check_matched(self, snapshot: str) -> None:
        """InvalidArgument naming the paths that matched nothing in `snapshot` (a root hex)."""
        missing = self.unmatched()
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise InvalidArgument(f"snapshot {snapshot[:16]} holds nothing at {', '.join(map(repr, missing[:5]))}"
                                  f"{more} (paths are dotted: model.layers.0.weight; `tsck ls` lists them)")


def is_stateful(obj) -> bool:
    """DCP's Stateful protocol (nn.Module, optimizers, LR schedulers, app state objects):
    saved as obj.state_dict(), loaded with obj.load_state_dict(). Containers are not."""
    return (not isinstance(obj, (dict, list, tuple, str, bytes)) and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None)))


def dotted_from_formatted(p: str) -> str:
    """A path as format/tree.format_path writes it in messages and reports (['model'][0]['w'])
    -> dotted as `tsck ls` writes it (model.0.w). A path that is not a chain of str or int
    subscripts (a huge int's placeholder) comes back as it was."""
    parts = parts_from_formatted(p)
    return p if parts is None else dotted(parts)


def parts_from_formatted(p: str) -> tuple | None:
    """The keys of a path as format/tree.format_path writes it (['model'][0]['w'] ->
    ('model', 0, 'w')); None when it is not a chain of str or int subscripts."""
    import ast
    if not p.startswith("["):
        return None
    try:
        node = ast.parse("x" + p, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    parts = []
    while isinstance(node, ast.Subscript):
        k = node.slice
        if isinstance(k, ast.UnaryOp) and isinstance(k.op, ast.USub) and isinstance(k.operand, ast.Constant) \
                and type(k.operand.value) is int:
            k = ast.Constant(-k.operand.value)  # a negative int key
        if not (isinstance(k, ast.Constant) and type(k.value) in (str, int)):
            return None
        parts.append(k.value)
        node = node.value
    if not (isinstance(node, ast.Name) and node.id == "x"):
        return None
    return tuple(reversed(parts))
