"""Snapshots and refs: refs, log, show, ls, diff; tag, untag, pin, unpin, delete-ref,
undelete, forget."""

from __future__ import annotations

import sys

from ..core.assets import holds_snapshots
from ..errors import storage_error
from ..info import SnapshotInfo
from .common import dumps, human, snapshot_line, open_tier, emit, when_text

__all__ = ["cmd_refs", "cmd_log", "cmd_show", "cmd_tag", "cmd_pin", "cmd_delete_ref", "cmd_undelete", "cmd_untag",
           "cmd_forget", "cmd_ls", "cmd_diff"]


def cmd_refs(store, args):
    bad_refs: dict = {}
    bad_tags: dict = {}
    bad_pins: dict = {}
    refs = store.refs(errors=bad_refs)
    tags = store.tags(errors=bad_tags)
    pins = store.pins(errors=bad_pins)
    obj = {"refs": {k: v.to_json() for k, v in refs.items()}, "tags": {k: v.to_json() for k, v in tags.items()},
           "pins": {k: v.to_json() for k, v in pins.items()}}
    lines = [f"{name:<32} {snapshot_line(info)}" for name, info in refs.items()]
    lines += [f"tag {name:<28} {snapshot_line(info)}" for name, info in tags.items()]
    lines += _pin_lines(pins)
    if bad_refs or bad_tags or bad_pins:  # one odd snapshot is one line; the others are listed (exit 1)
        obj["unreadable"] = {**{k: str(e) for k, e in bad_refs.items()},
                             **{f"tag:{k}": str(e) for k, e in bad_tags.items()},
                             **{f"pin:{k}": str(e) for k, e in bad_pins.items()}}
        lines += [f"{name:<32} unreadable: {e}" for name, e in obj["unreadable"].items()]
    if not lines and _holds_snapshots(store):
        # An empty ref table over a store that holds commits is a lost table, not an empty store.
        problem = (f"the ref table knows no ref or tag, but {store.url} holds snapshots: it was lost or "
                   f"replaced; rebuild it from storage with `tsck recover {args.store}` (same --refs)")
        emit(args, {**obj, "problem": problem}, f"(no refs)\nPROBLEM: {problem}")
        return 1
    emit(args, obj, "\n".join(lines) if lines else "(no refs)")
    return 1 if bad_refs or bad_tags or bad_pins else 0


def _holds_snapshots(store) -> bool:
    try:
        return holds_snapshots(store.core.storage)
    except OSError as e:
        raise storage_error(e, f"listing the commits of {store.url}") from e


def _pin_lines(pins: dict) -> list[str]:
    """`tsck refs`: a pinned snapshot is kept until unpinned, so it is listed with the refs
    and tags that keep snapshots (by its ref and step: a pin has no name of its own)."""
    return [f"pin {f'{i.ref}@{i.step}' if i.step is not None else i.ref:<28} {snapshot_line(i)}" for i in pins.values()]


def _pinned(store) -> set[str]:
    """The pinned roots (hex), to mark them in `log` and `show`."""
    return {r.hex() for r in store.reftable.pins()}


def cmd_log(store, args):
    from ..errors import RefNotFound
    bad: dict = {}
    try:
        infos = store.log(args.ref, errors=bad)
    except RefNotFound as e:
        if not args.local:
            raise RefNotFound(f"{e}{_unknown_ref_hint(store, args)}") from None
        infos = []  # the ref may be local-only: not uploaded yet
    if args.local:
        infos = _with_tier_log(store, args, infos, bad)
    if args.max_count is not None:  # git log -n: the newest N
        infos = infos[:args.max_count]
    pinned = _pinned(store)
    emit(args, [{**i.to_json(), "pinned": i.root in pinned} for i in infos],
         "\n".join(snapshot_line(i) + ("  [pinned]" if i.root in pinned else "") for i in infos) or "(empty)")
    for r, e in bad.items():  # one odd snapshot is one line; the others are listed (exit 1)
        print(f"tsck: unreadable snapshot {r[:16]} in the history of {args.ref}: {e}", file=sys.stderr)
    return 1 if bad else 0


def _with_tier_log(store, args, infos: list, bad: dict) -> list:
    """The ref's history in the store at STORE and in its local tier at --local: the
    tier's snapshots not uploaded yet (local-only) with the store's, newest first."""
    from ..errors import RefNotFound
    tier = open_tier(store, args)
    try:
        try:
            local = tier.log(args.ref, errors=bad)
        except RefNotFound:
            local = []
    finally:
        tier.close()
    if not infos and not local:
        raise RefNotFound(f"no ref named {args.ref!r} in {store.url} nor in its local tier {args.local}"
                          f"{_unknown_ref_hint(store, args)}")
    seen = {i.root for i in infos}
    extra = [i for i in local if i.root not in seen and not i.durable]
    if not infos:
        print(f"tsck: ref {args.ref!r} is local-only: its {len(extra)} snapshot(s) are in the local tier "
              f"{args.local}, not uploaded to {store.url} yet", file=sys.stderr)
    return sorted(infos + extra, key=lambda i: (i.time, i.step if i.step is not None else -1), reverse=True)


def _unknown_ref_hint(store, args) -> str:
    """What a name `tsck log` found no ref by is: a tag, a deleted ref, or a typo of one."""
    import difflib
    name = args.ref.partition("@")[0]
    if store.reftable.tag_get(name) is not None:
        return (f": {name!r} is a tag, which names one snapshot: `tsck show {args.store} {name}` shows it "
                "(`tsck log` lists a ref's history)")
    if store.reftable.deleted_ref_root(name) is not None:
        return f": it was deleted; `tsck undelete {args.store} {name}` brings it back"
    names = [n for n, _root in store.reftable.list()]
    close = difflib.get_close_matches(name, names, n=3)
    maybe = f"; did you mean {' or '.join(close)}?" if close else ""
    tier = "" if getattr(args, "local", None) else (
        f"; a ref published through a local tier reaches this store once uploaded: `tsck log {args.store} "
        f"{name} --local TIER_PATH` shows its local-only snapshots")
    return f"{maybe} (`tsck refs {args.store}` lists the refs){tier}"


def cmd_show(store, args):
    i = store.show(args.target)
    text = "\n".join([
        f"root      {i.root}", f"ref       {i.ref}", f"job       {i.job}", f"step      {i.step}",
        f"time      {when_text(i.time)}", f"parent    {i.parent or '-'}",
        f"metrics   {dumps(i.metrics)}", f"meta      {dumps(i.meta)}",
        f"bytes     {human(i.bytes_total)} in {i.blocks_total} blocks; "
        f"{human(i.bytes_new)} in {i.blocks_new} blocks were new",
    ] + _watch_lines(i, pinned := i.root in _pinned(store)))
    emit(args, {**i.to_json(), "pinned": pinned}, text)
    return 0


def _watch_lines(i: SnapshotInfo, pinned: bool) -> list[str]:
    """`tsck show`: how long the put took and how long it stalled its caller (when the
    commit recorded it), and whether a pin keeps the snapshot."""
    lines = []
    if i.seconds is not None:
        lines.append(f"took      {i.seconds:.3f}s" + (f" (the caller was blocked {i.stall:.3f}s)"
                                                      if i.stall is not None else ""))
    lines.append(f"pinned    {'yes (kept until `tsck unpin`)' if pinned else 'no'}")
    return lines


def cmd_tag(store, args):
    i = store.tag(args.name, args.target)
    emit(args, {"tag": args.name, **i.to_json()}, f"tag {args.name} -> {i.root}")
    return 0


def cmd_pin(store, args):
    root = store.pin(args.target) if args.cmd == "pin" else store.unpin(args.target)
    emit(args, {args.cmd: root}, f"{args.cmd}ned {root}")
    return 0


def cmd_delete_ref(store, args):
    d = store.delete_ref(args.ref, expected=args.expected, dry_run=args.dry_run)
    if args.dry_run:
        lines = [f"would delete ref {d['ref']} (at {d['root']}); {d['snapshots_dropped']} snapshot(s) of its "
                 "history would no longer be kept, and the next gc would reclaim what only they hold:"]
        lines += [f"  {r}" for r in d["dropped"]]
        lines.append("nothing was changed (--dry-run)")
        emit(args, d, "\n".join(lines))
        return 0
    emit(args, d, f"deleted ref {d['ref']} (was {d['root']}); {d['snapshots_dropped']} snapshot(s) of its "
                  "history are no longer kept: the next gc reclaims what only they held (until then, "
                  f"`tsck undelete {args.store} {d['ref']}` brings the ref back on {d['root'][:16]})")
    return 0


def cmd_undelete(store, args):
    i = store.undelete(args.ref, to=args.to)
    emit(args, {"undelete": args.ref, **i.to_json()},
         f"ref {args.ref} is back on {i.root} (step {i.step if i.step is not None else '-'})")
    return 0


def cmd_untag(store, args):
    root = store.untag(args.name)
    emit(args, {"untag": args.name, "root": root}, f"untagged {args.name} (was {root})")
    return 0


def cmd_forget(store, args):
    i = store.forget(args.target, dry_run=args.dry_run)
    if args.dry_run:
        emit(args, {"would_forget": i.to_json(), "dry_run": True},
             f"would forget {i.root} ({i.ref} step {i.step}); the next gc would reclaim what only it holds\n"
             "nothing was changed (--dry-run)")
        return 0
    emit(args, {"forgot": i.to_json()}, f"forgot {i.root} ({i.ref} step {i.step}); the next gc reclaims what "
                                        f"only it held (until then, `tsck pin {args.store} {i.root}` brings it "
                                        f"back into the history of {i.ref}; `tsck unpin` after it leaves it to "
                                        "retention again)")
    return 0


def cmd_ls(store, args):
    from ..read.listing import list_tree
    root, entries = list_tree(store.core, store.resolve(args.target), args.path, raw=args.raw)
    tensors = [e for e in entries if e.kind in ("tensor", "array", "sharded")]
    total = sum(e.nbytes for e in tensors)
    obj = {"root": root, "path": args.path, "entries": [e.to_json() for e in entries],
           "tensors": len(tensors), "tensor_bytes": total}
    width = min(60, max((len(e.path) for e in entries), default=4))
    lines = []
    for e in entries:
        if e.kind in ("tensor", "array", "sharded"):
            what = f"{e.dtype:<10} {_shape(e.shape):<20} {human(e.nbytes):>10}"
            if e.kind != "tensor":
                what += f"  ({e.kind})"
        elif e.kind in ("str", "int", "float", "bool", "None", "numpy"):
            v = repr(e.value) if e.kind == "str" else dumps(e.value) if e.value is not None else e.kind
            what = f"{(e.dtype or e.kind):<10} {v[:60] + ('...' if len(v) > 60 else '')}"
        elif e.kind in ("dict", "list", "tuple"):
            what = f"{e.kind:<10} (empty)"
        else:
            what = f"{e.kind:<10} {human(e.nbytes)}"
        lines.append(f"{e.path or '(top)':<{width}}  {what}".rstrip())
    lines.append(f"{len(tensors)} tensors, {human(total)}; {len(entries) - len(tensors)} other values "
                 f"(snapshot {root[:16]})")
    emit(args, obj, "\n".join(lines))
    return 0


def _shape(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]" if shape is not None else ""


def cmd_diff(store, args):
    d = _dotted_diff(store.diff(args.a, args.b, raw=args.raw), args.path)
    lines = [f"a {d['a'][:16]}  b {d['b'][:16]}"]
    lines += [f"+ {p}" for p in d["added"]] + [f"- {p}" for p in d["removed"]]
    lines += [f"~ {c['path']}: {c['blocks_differ']}/{c['blocks']} blocks differ"
              + (f" ({c['a']} -> {c['b']})" if c["a"] != c["b"] else "") for c in d["changed"]]
    lines.append(f"{len(d['changed'])} changed, {len(d['added'])} added, {len(d['removed'])} removed"
                 + (f", {d['unchanged']} unchanged" if d["unchanged"] is not None else f" under {d['path']}"))
    emit(args, d, "\n".join(lines))
    if args.exit_code:  # git diff --exit-code: 1 when the snapshots differ, 0 when they are the same
        return 1 if d["changed"] or d["added"] or d["removed"] else 0
    return 0


def _dotted_diff(d: dict, path: str | None) -> dict:
    """Store.diff's answer with its paths dotted as `tsck ls` writes them (model.layers.0.w),
    only those at or under `path` when one is given (as `tsck ls STORE TARGET PATH`)."""
    from ..util.paths import dotted_from_formatted, under
    out = {**d, "added": [], "removed": [], "changed": []}
    for k in ("added", "removed"):
        out[k] = sorted(p for p in map(dotted_from_formatted, d[k]) if under(p, path))
    out["changed"] = sorted(({**c, "path": dotted_from_formatted(c["path"])} for c in d["changed"]),
                            key=lambda c: c["path"])
    out["changed"] = [c for c in out["changed"] if under(c["path"], path)]
    if path is not None:
        out["path"] = path
        out["unchanged"] = None  # counted over the whole snapshot only
    return out
