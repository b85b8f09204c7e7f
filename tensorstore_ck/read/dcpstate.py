"""A snapshot written through dcp.save (TsckWriter) read back as the state that was
saved (read_dcp: readpath.read_state sends every checkout of one here), so switching
from the DCP API to the native one never strands a checkpoint (dcp/native.py does the
other direction); and the one rule for DCP's bytes items (load_bytes_item).

The DCP layout (dcp/layout.py composes it; format/dcp.py holds its constants and how it is
recognized, for this module and `tsck ls` alike):

    {"format": "dcp", "version": 1,
     "tensors":  {fqn: G leaf}, "bytes": {fqn: bytes | 1-D uint8 T leaf},
     "metadata": {..., "planner_data": {fqn: path}, ...}}

An fqn is DCP's flattened key: the path's keys joined by "." (dict keys as str, list
items by index), so `paths=` selects in it exactly as in a native snapshot. Each value
goes back to its path (planner_data; the fqn itself when DCP did not flatten) the way
DCP's unflatten does: dict keys come back as str, lists are rebuilt by index. Bytes
items are what DCP torch.save'd (non-tensor values); they are loaded with
weights_only=True unless allow_pickle=True (load_bytes_item: the one rule, which
TsckReader and TsckWriter apply too).
"""

from __future__ import annotations

import io
import pickle
import re

import torch

from ..errors import CheckoutMismatch, FormatError, UnsupportedType
from ..format import tree
from ..format.dcp import check_version, fqn_paths
from ..util.paths import is_stateful
from .read import MISSING, Reader

__all__ = ["read_dcp", "load_bytes_item"]


def _flatten_into(into: dict, loads: list) -> dict:
    """{fqn: (container, key)} of the caller's tree as DCP flattens a state_dict; a Stateful
    is replaced by its state_dict() (loaded back later, as dcp.load does)."""
    out: dict = {}

    def terminal(v) -> bool:
        if isinstance(v, dict) or is_stateful(v):
            return False
        if not isinstance(v, list):
            return True
        return all(not isinstance(x, torch.Tensor) and (not isinstance(x, (dict, list)) or terminal(x))
                   and not is_stateful(x) for x in v)

    def walk(container, key, path):
        v = container[key]
        if is_stateful(v):
            sd = v.state_dict()
            if not isinstance(sd, dict):
                raise CheckoutMismatch(f"{type(v).__name__}.state_dict() returned {type(sd).__name__}, not a dict")
            loads.append((v, sd, path))
            for k in sd:
                walk(sd, k, path + (str(k),))
        elif isinstance(v, dict):
            for k in v:
                walk(v, k, path + (str(k),))
        elif not terminal(v):
            for i in range(len(v)):
                walk(v, i, path + (i,))
        else:
            out[".".join(map(str, path))] = (container, key)

    for k in into:
        walk(into, k, (str(k),))
    return out


def _set_element(root: dict, path: tuple, value) -> None:
    """DCP's set_element: dicts for str keys, lists (padded with None) for int ones."""
    cur = root
    for i, k in enumerate(path):
        last = i == len(path) - 1
        nxt = None if last else ([] if type(path[i + 1]) is int else {})
        if type(k) is int:
            if not isinstance(cur, list):
                raise FormatError(f"DCP path {path!r:.120} indexes a non-list")
            cur.extend([None] * (k + 1 - len(cur)))
            if last:
                cur[k] = value
            elif cur[k] is None:
                cur[k] = nxt
            cur = cur[k]
        else:
            if not isinstance(cur, dict):
                raise FormatError(f"DCP path {path!r:.120} keys a non-dict")
            if last:
                cur[k] = value
            else:
                cur = cur.setdefault(k, nxt)


def read_dcp(reader: Reader, top: tree.Container, into=MISSING, *, allow_pickle: bool = False):
    """The state a TsckWriter snapshot holds, as dcp.load would give it (into=: filled in place)."""
    snap = reader.snapshot
    d = dict(top.items)
    check_version(d["version"])
    plain = reader.plain()
    md = plain.materialize(d["metadata"], ("metadata",))
    paths = fqn_paths(md, snap)

    def section(name):
        s = reader.deref(d[name], (name,))
        if type(s) is not tree.Container or s.kind != "d" or not all(type(k) is str for k, _ in s.items):
            raise FormatError(f"DCP snapshot {snap[:16]}: its {name} are not a map of str keys")
        return dict(s.items)

    tensors, byts = section("tensors"), section("bytes")
    both = [f for f in tensors if f in byts]
    if both:
        raise FormatError(f"DCP snapshot {snap[:16]}: {both[0]!r:.80} is both a tensor and a bytes item")
    # The saved state's order: DCP's flattening order (planner_data), then anything it lacks.
    stored = [f for f in paths if f in tensors or f in byts]
    stored += [f for f in list(tensors) + list(byts) if f not in paths]

    loads: list = []
    targets = None
    if into is not MISSING:
        if not isinstance(into, dict):
            raise CheckoutMismatch(f"checkout(into=) of DCP snapshot {snap[:16]} takes a dict (a state_dict), "
                                   f"got {type(into).__name__}")
        targets = _flatten_into(into, loads)
    sel = reader.select
    want = []
    for f in stored:
        if targets is not None and f not in targets:
            continue  # into= names what is read
        if sel is not None and not sel.covers(".".join(map(str, paths.get(f, (f,))))):
            continue
        want.append(f)
    if sel is not None:
        sel.check_matched(snap)
    if targets is not None:
        lacks = [f for f in targets if f not in tensors and f not in byts
                 and (sel is None or sel.covers(f, record=False))]
        if lacks:
            raise CheckoutMismatch(f"the DCP snapshot {snap[:16]} has no {', '.join(repr(f) for f in lacks[:5])}"
                                   f"{f' (and {len(lacks) - 5} more)' if len(lacks) > 5 else ''}, "
                                   "which the into= tree has")

        for obj, _sd, p in loads:
            # A Stateful's state is replaced whole by load_state_dict: a part of it left out
            # (a fresh optimizer's state_dict has no per-parameter state) would resume wrong.
            pre = ".".join(map(str, p)) + "."
            left = [f for f in stored if f.startswith(pre) and f not in targets
                    and (sel is None or sel.covers(f, record=False))]
            if left:
                raise CheckoutMismatch(
                    f"the DCP snapshot {snap[:16]} holds {len(left)} values under {pre[:-1]!r} that "
                    f"{type(obj).__name__}.state_dict() does not name (e.g. {left[0]!r}); as with dcp.load, "
                    "its state_dict must already have them (an optimizer: take a step first, or load "
                    "through torch.distributed.checkpoint.state_dict.set_optimizer_state_dict)")

    # Bytes items first (small, nothing of the caller's is touched yet), then every tensor in
    # one batch of reads through the Reader (into= tensors get verified bytes only).
    values = {}
    for f in want:
        if f in byts:
            values[f] = _load_bytes(plain, byts[f], f, snap, allow_pickle)
    tw = [f for f in want if f in tensors]
    flat = tree.Container("d", [(f, tensors[f]) for f in tw])
    tin = MISSING
    if targets is not None:
        tin = {}
        for f in tw:
            c, k = targets[f]
            if isinstance(c[k], torch.Tensor):
                tin[f] = c[k]
    got = reader.flat(flat, ("tensors",), tin)
    values.update(got)

    if targets is None:
        out: dict = {}
        for f in want:
            _set_element(out, paths.get(f, (f,)), values[f])
        return out
    for f in want:
        c, k = targets[f]
        if c[k] is not values[f]:
            c[k] = values[f]
    for obj, sd, p in loads:
        try:
            obj.load_state_dict(sd)
        except Exception as e:  # noqa: BLE001 - each Stateful fails in its own way
            raise CheckoutMismatch(f"{type(obj).__name__}.load_state_dict at {'.'.join(map(str, p))} refused "
                                   f"DCP snapshot {snap[:16]}'s state: {type(e).__name__}: {e}") from e
    return into


def _load_bytes(plain: Reader, v, fqn: str, snap: str, allow_pickle: bool):
    if isinstance(v, tree.Ref):
        v = plain.deref(v, ("bytes", fqn))
    if isinstance(v, bytes):
        raw = v
    elif type(v) is tree.Tensor and v.dt == "uint8" and v.quant is None and len(v.shape) == 1:
        raw = plain.materialize(v, ("bytes", fqn)).numpy().tobytes()
    else:
        raise FormatError(f"DCP snapshot {snap[:16]}: bad bytes item {fqn!r:.80}")
    return load_bytes_item(raw, fqn, allow_pickle=allow_pickle, where=f"DCP snapshot {snap[:16]}",
                           opt_in="checkout")


def load_bytes_item(raw: bytes, fqn: str, *, allow_pickle: bool, where: str, opt_in: str):
    """A DCP bytes item (what DCP torch.save'd) -> its value, with torch's weights_only
    loader unless allow_pickle: stored bytes are untrusted, and a full unpickle runs
    whatever the pickle names. The one rule for checkout, TsckReader (before DCP's
    planner, which unpickles with weights_only=False, sees the item) and TsckWriter
    (before storing one). where: what holds the item; opt_in: who takes allow_pickle."""
    try:
        return torch.load(io.BytesIO(raw), weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        if allow_pickle:
            raise FormatError(f"{where}: bytes item {fqn!r:.80} does not load: {e}") from None
        m = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(e))
        holds = f" (it holds {m.group(1)})" if m else ""
        raise UnsupportedType(f"DCP bytes item {fqn!r:.80}{holds} needs pickle beyond torch's weights_only "
                              f"loader; pass allow_pickle=True to {opt_in} to allow it (only for snapshots "
                              "you trust)") from None
    except Exception as e:  # noqa: BLE001 - torch.load's failures on garbage vary
        raise FormatError(f"{where}: bytes item {fqn!r:.80} does not load: {type(e).__name__}: {e}") from None
