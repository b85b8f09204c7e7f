"""Dotted paths inside a state, as `tsck ls`, `checkout(paths=)` and safetensors names write them.

A path is the keys from the top joined by "." ("model.layers.0.weight"), list and
tuple items by their index. A key that holds dots (a flat state_dict's) is kept whole,
so a flat state_dict and the same tree stored nested name their values alike, and
"model.layers.0" selects in either: a path selects every value whose dotted path is
it or starts with it and a dot.
"""

from __future__ import annotations

from .errors import InvalidArgument

__all__ = ["key_str", "dotted", "under", "toward", "Selection", "FULL", "SKIP", "is_stateful"]

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


class Selection:
    """The sub-trees `paths` name. Walking down, each position is FULL (all of it is
    selected), SKIP (none of it), or its dotted path (something below it is)."""

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

    def step(self, here: str, key):
        """The state of the child `key` of the position `here` (a dotted path, "" at the top)."""
        k = key_str(key)
        p = f"{here}.{k}" if here else k
        hit = False
        for s in self.paths:
            if p == s or p.startswith(s + "."):
                self.matched.add(s)
                return FULL
            hit = hit or s.startswith(p + ".")
        return p if hit else SKIP

    def covers(self, p: str, *, record: bool = True) -> bool:
        """The value at dotted path `p` is selected (is at or under one of the paths)."""
        for s in self.paths:
            if p == s or p.startswith(s + "."):
                if record:
                    self.matched.add(s)
                return True
        return False

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
