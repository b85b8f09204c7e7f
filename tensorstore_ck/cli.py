"""`tsck`: the command line. Exit codes: 0 ok, 1 problems found or the environment
failed (StorageError: a full disk, an unreachable server), 2 user error.

Every command takes --json, which writes strict JSON (NaN/inf as null, bytes as
"hex:<hex>"; see _jsonable). A user mistake (bad arguments, unknown target,
a path that is not a store) prints one line, "tsck: error: ...", and exits 2;
a StorageError prints its one line and exits 1 (retrying may work once it is fixed).
Long work (gc, fsck) shows a progress bar on stderr when it is a terminal.
Sizes shown (text, progress bars, log lines, messages) are in decimal SI units,
1 kB = 1000 B, 1 MB = 1e6 B, 1 GB = 1e9 B (units.py); --json gives exact bytes.

Remote stores: `--refs` (or $TSCK_REFS) names the shared ref table, e.g.
postgresql://host/db; `-o KEY=VALUE` (repeatable) or $TSCK_STORAGE_OPTIONS (a
JSON object) pass fsspec storage options. Credentials belong in the backend's
own environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ...), not on a command
line that `ps` shows; nothing here ever prints an option's value.

$TSCK_STORE is the default STORE of every command (with_env_store): when it is set and
the first positional is not a URL (scheme://...) or an existing path, the store is
$TSCK_STORE and the positionals keep their meaning (`tsck log jobA/main -n 5`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import re
import sys

from .assets import holds_snapshots
from .errors import InvalidArgument, NotAStore, StorageError, TsckError, storage_error
from .info import SnapshotInfo
from .opener import open_store
from .units import human_bytes

__all__ = ["main"]


class _Usage(Exception):
    pass


class _HelpFormatter(argparse.HelpFormatter):
    """Every command and its help on one line (argparse would wrap the longer names)."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=20, width=110)

    def add_argument(self, action):
        super().add_argument(action)
        self._action_max_length = max(self._action_max_length, 18)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise _Usage(message)


def _human(n) -> str:
    return human_bytes(n)


def _when(t: float) -> str:
    try:
        return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    except (OverflowError, OSError, ValueError):  # outside the platform's time_t / datetime range
        return f"t={t!r} (out of range)"


def _jsonable(obj, depth: int = 0):
    """A value that json.dumps writes as strict JSON (RFC 8259, what jq accepts): a
    non-finite float (a diverged run's NaN loss) becomes null, bytes (found in a stored
    commit's meta) a string "hex:<hex digits>", a key that is not a str its str() (bytes
    keys: "hex:..." too). Stored values nest at most 33 levels (decode_commit checks)."""
    t = type(obj)
    if t is float:
        return obj if math.isfinite(obj) else None
    if t in (bytes, bytearray):
        return "hex:" + bytes(obj).hex()
    if depth > 64:
        return "..."
    if isinstance(obj, dict):
        return {_jsonable_key(k): _jsonable(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(x, depth + 1) for x in obj]
    if obj is None or t in (bool, int, str):
        return obj
    if isinstance(obj, float):
        return _jsonable(float(obj), depth)
    return str(obj)


def _jsonable_key(k):
    if type(k) is str:
        return k
    if type(k) in (bytes, bytearray):
        return "hex:" + bytes(k).hex()
    if type(k) is float and not math.isfinite(k):
        return str(k)
    return k if type(k) in (int, float, bool) or k is None else str(k)


def _dumps(obj, **kw) -> str:
    return json.dumps(_jsonable(obj), allow_nan=False, **kw)


def _metrics_text(m: dict) -> str:
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.items())


def _line(info: SnapshotInfo) -> str:
    m = _metrics_text(info.metrics)
    tier = "" if info.durable else "local-only  "  # in a local tier, not yet uploaded
    return (f"{info.root[:16]}  step {info.step if info.step is not None else '-':>8}  {_when(info.time)}  "
            f"{_human(info.bytes_total):>10} ({_human(info.bytes_new)} new)  {tier}{m}").rstrip()


def _out(args, obj, text: str) -> None:
    if args.json:
        print(_dumps(obj, indent=2, sort_keys=False))
    else:
        print(text)


def _holds_snapshots(store) -> bool:
    try:
        return holds_snapshots(store.core.storage)
    except OSError as e:
        raise storage_error(e, f"listing the commits of {store.url}") from e


def cmd_refs(store, args):
    bad_refs: dict = {}
    bad_tags: dict = {}
    bad_pins: dict = {}
    refs = store.refs(errors=bad_refs)
    tags = store.tags(errors=bad_tags)
    pins = store.pins(errors=bad_pins)
    obj = {"refs": {k: v.to_json() for k, v in refs.items()}, "tags": {k: v.to_json() for k, v in tags.items()},
           "pins": {k: v.to_json() for k, v in pins.items()}}
    lines = [f"{name:<32} {_line(info)}" for name, info in refs.items()]
    lines += [f"tag {name:<28} {_line(info)}" for name, info in tags.items()]
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
        _out(args, {**obj, "problem": problem}, f"(no refs)\nPROBLEM: {problem}")
        return 1
    _out(args, obj, "\n".join(lines) if lines else "(no refs)")
    return 1 if bad_refs or bad_tags or bad_pins else 0


def _pin_lines(pins: dict) -> list[str]:
    """`tsck refs`: a pinned snapshot is kept until unpinned, so it is listed with the refs
    and tags that keep snapshots (by its ref and step: a pin has no name of its own)."""
    return [f"pin {f'{i.ref}@{i.step}' if i.step is not None else i.ref:<28} {_line(i)}" for i in pins.values()]


def _pinned(store) -> set[str]:
    """The pinned roots (hex), to mark them in `log` and `show`."""
    return {r.hex() for r in store.reftable.pins()}


def cmd_log(store, args):
    from .errors import RefNotFound
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
    _out(args, [{**i.to_json(), "pinned": i.root in pinned} for i in infos],
         "\n".join(_line(i) + ("  [pinned]" if i.root in pinned else "") for i in infos) or "(empty)")
    for r, e in bad.items():  # one odd snapshot is one line; the others are listed (exit 1)
        print(f"tsck: unreadable snapshot {r[:16]} in the history of {args.ref}: {e}", file=sys.stderr)
    return 1 if bad else 0


def _with_tier_log(store, args, infos: list, bad: dict) -> list:
    """The ref's history in the store at STORE and in its local tier at --local: the
    tier's snapshots not uploaded yet (local-only) with the store's, newest first."""
    from .errors import RefNotFound
    tier = _open_tier(store, args)
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
        f"time      {_when(i.time)}", f"parent    {i.parent or '-'}",
        f"metrics   {_dumps(i.metrics)}", f"meta      {_dumps(i.meta)}",
        f"bytes     {_human(i.bytes_total)} in {i.blocks_total} blocks; "
        f"{_human(i.bytes_new)} in {i.blocks_new} blocks were new",
    ] + _watch_lines(i, pinned := i.root in _pinned(store)))
    _out(args, {**i.to_json(), "pinned": pinned}, text)
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


def cmd_du(store, args):
    d = store.du()
    lines = [
        f"store        {d['store']}",
        f"snapshots    {d['snapshots']}",
        f"logical      {_human(d['logical_bytes'])}  (what the kept snapshots hold)",
        _ratio("dedup", d["dedup_ratio"], f"logical / the distinct content they use, {_human(d['distinct_bytes'])}"),
        _ratio("compression", d["compression_ratio"], f"those blocks / their stored bytes, "
                                                      f"{_human(d['used_block_bytes'])}"),
        f"physical     {_human(d['physical_bytes'])}  ({d['blocks']} blocks, {d['nodes']} nodes, "
        f"{d['commits']} commits: everything stored)",
        f"orphans      {_human(d['orphans']['bytes'])}  ({d['orphans']['objects']} stored objects no kept snapshot "
        "uses, in physical: the next gc removes them, unless a put in flight uses them)",
    ]
    # Per job: what its snapshots reference (holds) and, of that, what no other job's does
    # (alone: what deleting the job would free). Not who wrote a block first: a block
    # shared by two jobs is freed only once both are gone.
    for job, j in sorted(d["jobs"].items(), key=lambda x: (-x[1]["only_bytes"], x[0])):
        lines.append(f"  job {job:<20} {j['snapshots']:>5} snapshots  logical {_human(j['logical_bytes']):>10}"
                     f"  holds {_human(j['held_bytes']):>10}  alone {_human(j['only_bytes']):>10}"
                     f"  latest step {j['latest_step']}")
    if d["jobs"]:
        lines.append("  (holds: stored bytes of the blocks its snapshots use; alone: of those, the ones no other "
                     "job uses: what deleting the job and a gc would free, tags and pins aside)")
    if d.get("unreadable"):
        lines.append(f"  {len(d['unreadable'])} snapshot(s) could not be read whole (tsck fsck names them); "
                     "the numbers leave out what they hold beyond the part read")
    lines += _temp_lines(d.get("temp_files"))
    if args.plot:
        d["plot"] = _du_plot(store, args, lines)
    if args.local:
        from .usage import tier_usage
        with _open_tier(store, args) as tier:
            t = tier_usage(tier.core)
        d["local"] = t
        lines.append(f"local tier {t['local']}: {_human(t['bytes'])}")
        for key, what in (("pending", "queued for upload"), ("local_only", "local-only (not uploaded)"),
                          ("durable", "cached copies of durable snapshots"),
                          ("unreferenced", "reached by no snapshot (a put in flight, or a local gc's)")):
            c = t[key]
            n = f"{c['snapshots']:>5} snapshots" if key != "unreferenced" else " " * 15
            lines.append(f"  {key:<13}{n}  {_human(c['bytes']):>10}  {what}")
        lines.append(f"  evicted      {t['evicted']['snapshots']:>5} snapshots  (local copies dropped by the budget; "
                     "read from the remote)")
        if t["unreadable"]:
            lines.append(f"  {len(t['unreadable'])} local snapshot(s) could not be read whole (tsck fsck --local "
                         "names them)")
    _out(args, d, "\n".join(lines))
    return 0


def _ratio(name: str, r, what: str) -> str:
    return f"{name:<12} {'-' if r is None else f'{r:.2f}x'}  ({what})"


def _open_tier(store, args):
    """The local tier at args.local, opened as a store of its own (no uploader: du and
    fsck look, they send nothing), refused unless it is a tier of `store`."""
    if not os.path.isdir(args.local):
        raise NotAStore(f"no local tier at {args.local} (no such directory)")
    tier = open_store(args.local, create=False, read_only=True if args.read_only else None)
    want, got = store.config.get("id"), tier.config.get("id")
    if want != got:
        tier.close()
        raise NotAStore(f"{args.local} is not a local tier of {store.url} (it belongs to store {got!r}, "
                        f"not {want!r})")
    return tier


def _du_plot(store, args, lines) -> dict:
    from .plot import plot_usage, require_matplotlib
    from .usage import usage
    require_matplotlib()  # missing: say so before walking the store
    u = usage(store.core)
    path = plot_usage(u, args.plot)
    p = u["physical"]
    if p["gcs"]:
        lines.append(f"plot: {p['gcs']} gc/prune run(s) on record reclaimed {_human(p['reclaimed'][-1])} of blocks")
    lines.append(f"plot written to {path}")
    return {"file": path, **u}


def _temp_lines(t: dict, *, dry_run: bool = False) -> list[str]:
    """tmp/'s leftover temp files (Assets.temp_report): how many, their bytes, and when gc
    sweeps them. None at all: no line."""
    if not t or not t.get("files"):
        return []
    kinds = ", ".join(f"{t[k]} {what}" for k, what in (("partial", ".partial (writes cut short)"),
                                                        ("pending", ".pending (objects waiting to be named)"))
                      if t[k])
    head = (f"tmp/: {t['files']} temp file(s), {_human(t['bytes'])} ({kinds}): writes in flight, or left by a "
            "save that died (killed)")
    rule = f"gc removes one once it is older than the gc's lease ({t['lease']:g} s"
    rule += f" + --grace {t['grace']:g} s" if t["grace"] else ""
    rule += (f"; a .pending file {t['pending_grace']:g} s more)" if t["pending"] else ")")
    if dry_run:
        now = [f"this gc would remove {t['sweepable']} ({_human(t['sweepable_bytes'])})"]
    else:
        now = [f"{t['sweepable']} ({_human(t['sweepable_bytes'])}) are old enough for the next gc"]
    if t["next_due"] is not None:
        rest = t["files"] - t["sweepable"]
        now.append(f"the other {rest} become old enough at {_when(t['next_due'])}"
                   + (f" (the last at {_when(t['all_due'])})" if rest > 1 else ""))
    return [head, f"  {rule}: {'; '.join(now)}"]


def _bar(args) -> bool:
    return not args.json and sys.stderr.isatty()


def cmd_tag(store, args):
    i = store.tag(args.name, args.target)
    _out(args, {"tag": args.name, **i.to_json()}, f"tag {args.name} -> {i.root}")
    return 0


def cmd_pin(store, args):
    root = store.pin(args.target) if args.cmd == "pin" else store.unpin(args.target)
    _out(args, {args.cmd: root}, f"{args.cmd}ned {root}")
    return 0


def cmd_delete_ref(store, args):
    d = store.delete_ref(args.ref, expected=args.expected, dry_run=args.dry_run)
    if args.dry_run:
        lines = [f"would delete ref {d['ref']} (at {d['root']}); {d['snapshots_dropped']} snapshot(s) of its "
                 "history would no longer be kept, and the next gc would reclaim what only they hold:"]
        lines += [f"  {r}" for r in d["dropped"]]
        lines.append("nothing was changed (--dry-run)")
        _out(args, d, "\n".join(lines))
        return 0
    _out(args, d, f"deleted ref {d['ref']} (was {d['root']}); {d['snapshots_dropped']} snapshot(s) of its "
                  "history are no longer kept: the next gc reclaims what only they held (until then, "
                  f"`tsck undelete {args.store} {d['ref']}` brings the ref back on {d['root'][:16]})")
    return 0


def cmd_undelete(store, args):
    i = store.undelete(args.ref, to=args.to)
    _out(args, {"undelete": args.ref, **i.to_json()},
         f"ref {args.ref} is back on {i.root} (step {i.step if i.step is not None else '-'})")
    return 0


def cmd_init(args, refs, storage_options) -> int:
    """`tsck init STORE`: an empty store (open_store(create=True)), refused where one is."""
    from .opener import CREATE_HINT
    if args.read_only:
        raise InvalidArgument("init makes a store: --read-only cannot go with it")
    try:
        with open_store(args.store, refs=refs, storage_options=storage_options, create=False) as store:
            raise InvalidArgument(f"there is a store at {store.url} already: nothing was changed")
    except NotAStore as e:
        if CREATE_HINT not in str(e):  # not an empty location: a file, a non-empty folder, a lost table
            raise
    with open_store(args.store, refs=refs, storage_options=storage_options, create=True) as store:
        _out(args, {"init": store.url, "id": store.config.get("id")}, f"created an empty store at {store.url}")
    return 0


def cmd_untag(store, args):
    root = store.untag(args.name)
    _out(args, {"untag": args.name, "root": root}, f"untagged {args.name} (was {root})")
    return 0


def cmd_forget(store, args):
    i = store.forget(args.target, dry_run=args.dry_run)
    if args.dry_run:
        _out(args, {"would_forget": i.to_json(), "dry_run": True},
             f"would forget {i.root} ({i.ref} step {i.step}); the next gc would reclaim what only it holds\n"
             "nothing was changed (--dry-run)")
        return 0
    _out(args, {"forgot": i.to_json()}, f"forgot {i.root} ({i.ref} step {i.step}); the next gc reclaims what "
                                        f"only it held (until then, `tsck pin {args.store} {i.root}` brings it "
                                        f"back into the history of {i.ref}; `tsck unpin` after it leaves it to "
                                        "retention again)")
    return 0


def _seconds(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {v!r}") from None
    if not 0 < x < 1e7:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {v}")
    return x


def _count(low: int):
    """An argparse type: an int from `low` to the largest a retention rule holds."""
    from .retention import MAX_COUNT

    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an int: {v!r}") from None
        if not low <= n <= MAX_COUNT:
            raise argparse.ArgumentTypeError(f"must be an int from {low} to {MAX_COUNT} (2**64-1), got {v}")
        return n
    return parse


def _seconds0(v: str) -> float:
    return 0.0 if v.strip() in ("0", "0.0") else _seconds(v)


def cmd_gc(store, args):
    r = store.gc(dry_run=args.dry_run, progress=_bar(args), lease=args.lease, grace=args.grace)
    verb = "would delete" if r.dry_run else "deleted"
    lines = [f"expired {len(r.expired)} snapshots; kept {r.kept_snapshots}",
             f"{verb} {r.deleted_objects} objects, {_human(r.deleted_bytes)} "
             f"({', '.join(f'{v} {k}' for k, v in sorted(r.deleted_by_kind.items())) or 'nothing'})"]
    if r.rescued:
        lines.append(f"{r.rescued} candidates were reused by writers meanwhile and kept")
    if r.dry_run:
        lines = _retention_table(store, r.snapshots) + [
            f"would expire {len(r.expired)} snapshot(s); keep {r.kept_snapshots}",
            f"would delete {r.deleted_objects} objects, {_human(r.deleted_bytes)} "
            f"({', '.join(f'{v} {k}' for k, v in sorted(r.deleted_by_kind.items())) or 'nothing'}); "
            "--json lists their keys"] + _temp_lines(r.temp_files, dry_run=True)
    _out(args, r.to_json(), "\n".join(lines))
    return 0


def _retention_table(store, snapshots: list) -> list[str]:
    """Like restic's forget: per job with rules, each snapshot, keep or remove, and the
    rule that decided; a job without rules is one line (it keeps everything)."""
    rules = store.retention()
    lines = []
    by_job: dict = {}
    for d in snapshots:
        by_job.setdefault(d["job"], []).append(d)
    for job in sorted(by_job):
        rows = by_job[job]
        if job not in rules:
            lines.append(f"job {job}: no retention rule, keeps all {len(rows)} snapshot(s)")
            continue
        kept = sum(d["keep"] for d in rows)
        lines.append(f"job {job}: {_rule_text(rules[job])}: keep {kept} of {len(rows)}")
        lines.append(f"  {'ref':<24} {'step':>8}  {'time':<20}  {'action':<6}  {'why':<32}  metrics")
        for d in rows:
            step = d["step"] if d["step"] is not None else "-"
            lines.append(f"  {str(d['ref']):<24} {step:>8}  {_when(d['time']):<20}  "
                         f"{'keep' if d['keep'] else 'remove':<6}  {', '.join(d['why']):<32}  "
                         f"{_metrics_text(d['metrics'])}".rstrip())
    return lines


def _rule_text(rule) -> str:
    parts = []
    if rule.keep_last is not None:
        parts.append(f"keep last {rule.keep_last}")
    if rule.keep_best is not None:
        parts.append(f"keep best {rule.keep_best} by {rule.metric} ({rule.mode})")
    if rule.keep_every_steps is not None:
        parts.append(f"keep one per {rule.keep_every_steps} steps")
    if rule.max_age_days is not None:
        parts.append(f"keep what is younger than {rule.max_age_days:g} days")
    return ", ".join(parts)


def cmd_retention(store, args):
    from .retention import Retention
    given = {k: getattr(args, k) for k in ("keep_last", "keep_best", "metric", "keep_every_steps", "max_age_days")
             if getattr(args, k) is not None}
    if args.mode is not None:
        given["mode"] = args.mode
    if args.job is None:
        if given or args.clear:
            raise InvalidArgument("setting a rule needs a JOB")
        rules = store.retention()
        _out(args, {job: r.to_dict() for job, r in rules.items()},
             "\n".join(f"{job}: {_rule_text(r)}" for job, r in sorted(rules.items())) or "(no retention rules)")
        return 0
    if args.clear and given:
        raise InvalidArgument("--clear takes no other rule option")
    if args.keep_best is not None and args.metric is None:
        raise InvalidArgument(f"--keep-best {args.keep_best} needs --metric M: the name of a metric the snapshots "
                              "record (put_snapshot(metrics={'val_loss': ...}); `tsck log STORE REF` shows them); "
                              "the lowest is best, --mode max for the highest")
    if not args.clear and not {k: v for k, v in given.items() if k not in ("metric", "mode")} \
            and (args.metric is not None or args.mode is not None):
        raise InvalidArgument("--metric and --mode go with --keep-best K; give a rule: --keep-last N, --keep-best K "
                              "--metric M, --keep-every-steps S or --max-age-days D (or --clear)")
    if args.clear:
        store.set_retention(args.job, None)
    elif given:
        store.set_retention(args.job, Retention(**given))
    rule = store.retention().get(args.job)
    _out(args, {"job": args.job, "retention": None if rule is None else rule.to_dict()},
         f"{args.job}: {_rule_text(rule) if rule else 'no retention rule (keeps everything)'}")
    return 0


def cmd_fsck(store, args):
    r = _dotted_findings(store.fsck(full=not args.quick, progress=_bar(args), repair=args.repair, raw=args.raw))
    if args.local:
        return _fsck_tiers(store, args, r)
    lines = _fsck_lines(r)
    _out(args, r.to_json(), "\n".join(lines))
    # Exit 1 whenever problems were found, repaired or not: what was moved is still
    # missing from its snapshots until a put stores that content again.
    return 0 if r.ok else 1


def _fsck_tiers(store, args, r):
    """fsck STORE --local PATH: the remote store (above), then the local tier as a store
    of its own; every finding says its tier. Across the tiers: a snapshot the tier marks
    durable and evicted must be in the remote catalog (it has no other copy)."""
    from .fsck import Finding
    with _open_tier(store, args) as tier:
        lr = _dotted_findings(tier.fsck(full=not args.quick, progress=_bar(args), repair=args.repair,
                                        raw=args.raw))
        trefs = tier.reftable
        evicted = trefs.evicted()
        marked = trefs.durable(trefs.catalog_roots() | evicted)
        lost = sorted(root for root in marked if not store.reftable.catalog_has(root))
        queued = len(trefs.upload_pending())
    # Evicted and gone remotely: the tier lists a snapshot no tier can read (a problem).
    # Whole locally and gone remotely (the remote's retention expired it): a note.
    only_here = [root for root in lost if root not in evicted]
    for root in lost:
        if root in evicted:
            lr.findings.append(Finding("not_remote", root.hex(), [], None, None,
                                       "marked durable and evicted in the local tier, but not in the remote "
                                       "catalog: no copy is left"))
    lines = [f"[remote] {x}" for x in _fsck_lines(r)]
    lines += [f"[local]  {x}" for x in _fsck_lines(lr)]
    if only_here:
        lines.append(f"note: {len(only_here)} durable snapshot(s) of the local tier are no longer in the remote "
                     f"catalog (expired or forgotten there); the local copy is the only one: "
                     f"{', '.join(r.hex()[:16] for r in only_here[:5])}")
    lines.append(f"local tier {args.local}: {lr.evicted} snapshot(s) evicted by its budget (in the remote, not "
                 f"checked here); {queued} queued for upload")
    ok = r.ok and lr.ok
    lines.append("ok: both tiers" if ok else
                 f"PROBLEMS: {len(r.findings)} in the remote store, {len(lr.findings)} in the local tier")
    _out(args, {**r.to_json(), "ok": ok, "local": {**lr.to_json(), "queued": queued,
                                                   "only_local": [x.hex() for x in only_here]}}, "\n".join(lines))
    return 0 if ok else 1


def _dotted_findings(r):
    """The report with each finding's tensor path dotted as `tsck ls` writes it (model.layers.0.w)."""
    import dataclasses
    from .paths import dotted_from_formatted
    r.findings = [dataclasses.replace(f, path=dotted_from_formatted(f.path)) if f.path else f for f in r.findings]
    return r


def _fsck_lines(r) -> list[str]:
    lines = [str(f) for f in r.findings]
    lines += [f"moved aside: {m['key']} -> {m['aside']} ({m['problem']})" for m in r.moved]
    lines += [f"not moved: {x['key']}: {x['why']}" for x in r.left]
    lines += _temp_lines(r.temp_files)
    lines.append(f"{'ok' if r.ok else 'PROBLEMS'}: {r.snapshots_checked} snapshots, {r.objects_checked} objects, "
                 f"{_human(r.bytes_checked)} {'re-hashed' if r.full else 'sized'}; {len(r.findings)} problems; "
                 f"{r.orphans} orphans ({_human(r.orphan_bytes)}, gc removes them)")
    if r.gc_ran:
        lines.append(f"note: a gc ran during this fsck; {r.dropped_after_gc} finding(s) of snapshots it removed "
                     "meanwhile were left out")
    if r.moved:
        lines.append(f"repair: {len(r.moved)} damaged object(s) moved aside; the snapshots above stay unreadable "
                     "until their content is put again (same address: that heals them), then fsck is clean")
    if r.quarantined:
        lines.append(f"note: {r.quarantined} object(s) ({_human(r.quarantined_bytes)}) kept aside under "
                     "quarantine/ (never read, never deleted by gc: inspect, then remove them by hand)")
    return lines


def cmd_recover(store, args):
    r = store.recover(progress=_bar(args))
    lines = [f"{r.commits_found} commits found, {r.catalog_rows_added} catalog rows added"]
    lines += [f"  ref {k} -> {v}" for k, v in r.refs_restored.items()]
    lines += [f"  tag {k} -> {v}" for k, v in r.tags_restored.items()]
    lines += [f"  unreadable: {u}" for u in r.unreadable]
    # (what a user removed is only counted; a commit left out as incomplete is named, with why)
    from .recover import REMOVED_BY_USER
    removed = sum(v == REMOVED_BY_USER for v in r.skipped.values())
    lines += [f"  not adopted: {k[:16]}: {v}" for k, v in r.skipped.items() if v != REMOVED_BY_USER]
    if removed:
        lines.append(f"  {removed} commit(s) removed by a user (forget, delete-ref) not brought back")
    _out(args, r.to_json(), "\n".join(lines))
    return 0


def cmd_diff(store, args):
    d = _dotted_diff(store.diff(args.a, args.b, raw=args.raw), args.path)
    lines = [f"a {d['a'][:16]}  b {d['b'][:16]}"]
    lines += [f"+ {p}" for p in d["added"]] + [f"- {p}" for p in d["removed"]]
    lines += [f"~ {c['path']}: {c['blocks_differ']}/{c['blocks']} blocks differ"
              + (f" ({c['a']} -> {c['b']})" if c["a"] != c["b"] else "") for c in d["changed"]]
    lines.append(f"{len(d['changed'])} changed, {len(d['added'])} added, {len(d['removed'])} removed"
                 + (f", {d['unchanged']} unchanged" if d["unchanged"] is not None else f" under {d['path']}"))
    _out(args, d, "\n".join(lines))
    if args.exit_code:  # git diff --exit-code: 1 when the snapshots differ, 0 when they are the same
        return 1 if d["changed"] or d["added"] or d["removed"] else 0
    return 0


def _dotted_diff(d: dict, path: str | None) -> dict:
    """Store.diff's answer with its paths dotted as `tsck ls` writes them (model.layers.0.w),
    only those at or under `path` when one is given (as `tsck ls STORE TARGET PATH`)."""
    from .paths import dotted_from_formatted, under
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


def _shape(shape) -> str:
    return "[" + ", ".join(map(str, shape)) + "]" if shape is not None else ""


def cmd_ls(store, args):
    from .listing import list_tree
    root, entries = list_tree(store.core, store.resolve(args.target), args.path, raw=args.raw)
    tensors = [e for e in entries if e.kind in ("tensor", "array", "sharded")]
    total = sum(e.nbytes for e in tensors)
    obj = {"root": root, "path": args.path, "entries": [e.to_json() for e in entries],
           "tensors": len(tensors), "tensor_bytes": total}
    width = min(60, max((len(e.path) for e in entries), default=4))
    lines = []
    for e in entries:
        if e.kind in ("tensor", "array", "sharded"):
            what = f"{e.dtype:<10} {_shape(e.shape):<20} {_human(e.nbytes):>10}"
            if e.kind != "tensor":
                what += f"  ({e.kind})"
        elif e.kind in ("str", "int", "float", "bool", "None", "numpy"):
            v = repr(e.value) if e.kind == "str" else _dumps(e.value) if e.value is not None else e.kind
            what = f"{(e.dtype or e.kind):<10} {v[:60] + ('...' if len(v) > 60 else '')}"
        elif e.kind in ("dict", "list", "tuple"):
            what = f"{e.kind:<10} (empty)"
        else:
            what = f"{e.kind:<10} {_human(e.nbytes)}"
        lines.append(f"{e.path or '(top)':<{width}}  {what}".rstrip())
    lines.append(f"{len(tensors)} tensors, {_human(total)}; {len(entries) - len(tensors)} other values "
                 f"(snapshot {root[:16]})")
    _out(args, obj, "\n".join(lines))
    return 0


def cmd_checkout(store, args):
    from .export import export_file
    r = export_file(store, args.target, args.dest, fmt=args.format, path=args.path, force=args.force,
                    progress=_bar(args))
    if r["format"] == "hf-folder":
        cfg = "with config.json" if r["config"] else "no config.json: the snapshot carries none"
        _out(args, r, f"wrote the model folder {r['dest']} ({r['tensors']} tensors in {', '.join(r['files'])}; "
                      f"{cfg}; {_human(r['bytes'])}) from {r['root'][:16]}")
        return 0
    what = f"{r['tensors']} tensors, {r['metadata']} metadata entries" if r["format"] == "safetensors" else \
        "torch.save of a Lightning checkpoint" if r["format"] == "lightning" else "torch.save"
    hint = ""
    if r["format"] == "safetensors" and r["path"] is None and r["metadata"] > 1:
        import shlex  # a whole training state (step, RNG, ... as metadata): not what load_state_dict takes
        hint = (f"\n(the whole snapshot, names from its top; the model's weights alone, as its load_state_dict "
                f"takes them: tsck export-weights {shlex.quote(args.store)} {shlex.quote(args.target)} "
                f"FILE.safetensors [--dtype bf16])")
    _out(args, r, f"wrote {r['dest']} ({r['format']}: {what}; {_human(r['bytes'])}) from {r['root'][:16]}{hint}")
    return 0


def cmd_export_weights(store, args):
    from .export import export_weights
    r = export_weights(store, args.target, args.dest, subtree=args.path, dtype=args.dtype,
                       strip_prefix=args.strip_prefix, force=args.force, progress=_bar(args))
    names = [f"{r['subtree']}." if r["subtree"] else None, *r["stripped"]]
    parts = [f"{r['tensors']} tensors", *([f"{r['cast']} cast to {r['dtype']}"] if r["dtype"] else []),
             f"names without {', '.join(repr(n) for n in names if n)}" if any(names) else "names as stored"]
    text = f"wrote {r['dest']} (safetensors: {'; '.join(parts)}; {_human(r['bytes'])}) from {r['root'][:16]}"
    if r["skipped"]:
        more = f" and {len(r['skipped']) - 8} more" if len(r["skipped"]) > 8 else ""
        text += f"\nleft out {len(r['skipped'])} values that are not tensors: {', '.join(r['skipped'][:8])}{more}"
    _out(args, r, text)
    return 0


def cmd_import(store, args):
    from .importing import import_files
    i = import_files(store, args.ref, args.files, step=args.step, job=args.job, progress=_bar(args))
    _out(args, i.to_json(), f"imported {len(args.files)} input(s) as {i.ref} -> {i.root}\n"
                            f"{_human(i.bytes_total)} in {i.blocks_total} blocks; {_human(i.bytes_new)} in "
                            f"{i.blocks_new} blocks were new")
    return 0


def _remote_options(args) -> tuple[str | None, dict | None]:
    refs = args.refs or os.environ.get("TSCK_REFS") or None
    opts: dict = {}
    env = os.environ.get("TSCK_STORAGE_OPTIONS")
    if env:
        try:
            opts = json.loads(env)
        except ValueError:
            raise _Usage("$TSCK_STORAGE_OPTIONS is not valid JSON") from None
        if not isinstance(opts, dict):
            raise _Usage("$TSCK_STORAGE_OPTIONS must be a JSON object")
    for item in args.storage_option:
        key, eq, value = item.partition("=")
        if not eq or not key:  # never echo it: a mistyped option may be a secret
            raise _Usage("-o wants KEY=VALUE, got an argument " + ("with an empty KEY" if eq else "without '='"))
        try:
            opts[key] = json.loads(value)
        except ValueError:
            opts[key] = value
    return refs, (opts or None)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    p = _Parser(prog="tsck", description="tensorstore_ck: content-addressed snapshots of training state",
                formatter_class=_HelpFormatter,
                epilog="`tsck COMMAND --help` for one command. A name that begins with '-' goes after `--`: "
                       "tsck log STORE -- -rf. $TSCK_STORE is the default STORE: it is used when the first "
                       "positional is not a URL (scheme://) or an existing path. Exit codes: 0 ok, 1 problems "
                       "found or a failure of the environment (a full disk, a server away), 2 a user error. "
                       "Sizes are decimal SI units: 1 kB = 1000 B, 1 MB = 1e6 B, 1 GB = 1e9 B (--json: bytes).")
    p.add_argument("--version", action="version", version=f"tsck (tensorstore_ck) {__version__}")
    _add_log_options(p, top=True)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", parser_class=_Parser, title="commands")

    def add(name, fn, help, *pos):
        s = sub.add_parser(name, help=help)
        s.add_argument("store", help="store path or URL (may be left out when $TSCK_STORE names it)")
        for a in pos:
            s.add_argument(a)
        s.add_argument("--json", action="store_true", help="machine-readable output")
        s.add_argument("--refs", default=None, metavar="REFS",
                       help="ref table for a remote store (postgresql://..., a local LMDB path); "
                            "default $TSCK_REFS")
        s.add_argument("--read-only", action="store_true",
                       help="open the store read-only: write nothing (also automatic when its files are "
                            "not writable, e.g. a read-only mount)")
        s.add_argument("-o", "--storage-option", action="append", default=[], metavar="KEY=VALUE",
                       help="fsspec storage option (VALUE parsed as JSON when it is JSON); "
                            "adds to $TSCK_STORAGE_OPTIONS")
        _add_log_options(s, top=False)
        s.set_defaults(fn=fn)
        return s

    add("init", cmd_init, "create an empty store (with --refs: its ref table there)")
    add("refs", cmd_refs, "list refs and tags")
    lg = add("log", cmd_log, "snapshots of a ref, newest first", "ref")
    lg.add_argument("-n", "--max-count", type=_count(1), default=None, metavar="N", help="only the newest N")
    lg.add_argument("--local", default=None, metavar="PATH",
                    help="also the snapshots of this store's local tier at PATH not uploaded yet (local-only), "
                         "and a ref that is only there")
    add("show", cmd_show, "one snapshot", "target")
    du = add("du", cmd_du, "logical vs physical bytes, per job")
    du.add_argument("--local", default=None, metavar="PATH",
                    help="also the bytes of this store's local tier at PATH: queued for upload, local-only, "
                         "cached durable copies, unreferenced")
    du.add_argument("--plot", default=None, metavar="FILE.png",
                    help="also draw the store's size over time (what gc reclaimed included) and what deleting "
                         "each job would free (needs matplotlib: the [plot] extra)")
    df = add("diff", cmd_diff, "which tensors and how many blocks differ", "a", "b")
    df.add_argument("path", nargs="?", default=None,
                    help="only the tensors at this dotted path and under it (model.layers.0), as in ls")
    df.add_argument("--exit-code", action="store_true",
                    help="as git diff: exit 1 when the snapshots differ, 0 when they hold the same tensors")
    df.add_argument("--raw", action="store_true",
                    help="paths in the stored layout, as `ls --raw` (a dcp.save snapshot: tensors.*), not in the "
                         "state that was saved")
    t = add("tag", cmd_tag, "create an immutable tag (or bring a removed snapshot back)", "name")
    t.add_argument("target", help="a ref, tag, REF@STEP or root; the full root of a snapshot removed by delete-ref "
                                  "or forget brings it back while gc has not reclaimed it (checked whole first; a "
                                  "deleted ref comes back with undelete)")
    add("pin", cmd_pin, "keep a snapshot until unpinned", "target")
    add("unpin", cmd_pin, "release a pin", "target")
    d = add("delete-ref", cmd_delete_ref, "remove a ref; gc then reclaims what only its history held", "ref")
    d.add_argument("--expected", default=None, metavar="ROOT",
                   help="delete only if the ref still points at this root (hex, 8 digits or more)")
    d.add_argument("--dry-run", action="store_true",
                   help="say what would be deleted and which snapshots would no longer be kept; change nothing")
    u = add("undelete", cmd_undelete, "bring back a ref removed by delete-ref (from its reflog)", "ref")
    u.add_argument("--to", default=None, metavar="ROOT",
                   help="on this snapshot instead of the one it had when deleted (a target, or the full root of a "
                        "removed snapshot)")
    add("untag", cmd_untag, "remove a tag", "name")
    fo = add("forget", cmd_forget, "drop one snapshot (REF@STEP or root; not a tip, tag or pin)", "target")
    fo.add_argument("--dry-run", action="store_true", help="say what would be forgotten; change nothing")
    r = add("retention", cmd_retention, "show, set (replacing them) or clear a job's retention rules")
    r.add_argument("job", nargs="?", default=None, help="the job (none: list every job's rules)")
    r.add_argument("--keep-last", type=_count(0), default=None, metavar="N", help="the N newest snapshots")
    r.add_argument("--keep-best", type=_count(0), default=None, metavar="K", help="the K best by --metric")
    r.add_argument("--metric", default=None, metavar="M", help="the metric of --keep-best")
    r.add_argument("--mode", choices=("min", "max"), default=None, help="best is min (default) or max")
    r.add_argument("--keep-every-steps", type=_count(1), default=None, metavar="S", help="one snapshot per S steps")
    r.add_argument("--max-age-days", type=float, default=None, metavar="D", help="every snapshot younger than D days")
    r.add_argument("--clear", action="store_true", help="remove the job's rules (it keeps everything)")
    g = add("gc", cmd_gc, "apply retention, then delete unreferenced objects")
    g.add_argument("--dry-run", action="store_true",
                   help="per snapshot: keep or remove and the rule that decided; then the objects and bytes "
                        "that would go (their keys with --json); change nothing")
    g.add_argument("--lease", type=_seconds, default=None, metavar="SECONDS",
                   help="how long this gc holds the store between two renewals (default 120); writers "
                        "judge it on the ref table's clock, never on their own")
    g.add_argument("--grace", type=_seconds0, default=0.0, metavar="SECONDS",
                   help="leave objects younger than this for a later gc, so snapshots in flight keep "
                        "their new objects (default 0)")
    f = add("fsck", cmd_fsck, "verify every kept snapshot (exit 1 on problems)")
    f.add_argument("--quick", action="store_true", help="presence and sizes only, no re-hashing")
    f.add_argument("--raw", action="store_true",
                   help="paths in the stored layout, as `ls --raw` (a dcp.save snapshot: tensors.*), not in the "
                        "state that was saved")
    f.add_argument("--local", default=None, metavar="PATH",
                   help="also check this store's local tier at PATH (opened by itself: nothing is uploaded); "
                        "each problem names its tier")
    f.add_argument("--repair", action="store_true",
                   help="move damaged objects aside (quarantine/, never deleted) so that the next put of "
                        "their content stores them again and heals every snapshot using them")
    add("recover", cmd_recover, "rebuild the catalog, refs and tags from storage")
    ls = add("ls", cmd_ls, "a snapshot's tree: paths, dtypes, shapes, sizes", "target")
    ls.add_argument("path", nargs="?", default=None, help="only the value at this dotted path and those under it")
    ls.add_argument("--raw", action="store_true",
                    help="the stored layout, not the state that was saved (a dcp.save snapshot: its tensors.*, "
                         "bytes.* and DCP's metadata)")
    co = add("checkout", cmd_checkout, "write a snapshot as a file or a Hugging Face model folder", "target", "dest")
    co.add_argument("--format", choices=("safetensors", "torch", "lightning"), default=None,
                    help="default: by DEST's suffix (.safetensors; .pt, .pth, .bin; .ckpt: lightning, a .ckpt "
                         "that torch.load and Net.load_from_checkpoint read, TARGET may be the pointer file "
                         "TsckCheckpointIO left); a DEST that is a directory, or ends with /, gets a "
                         "save_pretrained folder (model.safetensors, config.json)")
    co.add_argument("--path", default=None, help="only the value at this dotted path (model.layers.0)")
    co.add_argument("--force", action="store_true", help="replace DEST if it exists")
    ew = add("export-weights", cmd_export_weights, "the model's weights alone as one .safetensors file that "
             "load_state_dict takes", "target", "dest")
    ew.add_argument("--path", default=None, metavar="SUBTREE",
                    help="the model's state_dict in the snapshot (default: 'model', as TrainState and the Hugging "
                         "Face callback store it, else a Lightning checkpoint's 'state_dict'; '' for the whole "
                         "snapshot); the names lose it")
    ew.add_argument("--dtype", default=None, metavar="DTYPE",
                    help="cast floating tensors to it: bf16, fp16, fp32 (or a torch name: bfloat16, ...)")
    ew.add_argument("--strip-prefix", action="append", default=None, metavar="PREFIX",
                    help="a prefix the names lose (repeatable); default: DDP's 'module.' and torch.compile's "
                         "'_orig_mod.' when every name has one; '' strips none")
    ew.add_argument("--force", action="store_true", help="replace DEST if it exists")
    im = add("import", cmd_import, "torch, safetensors or Hugging Face files as a snapshot", "ref")
    im.add_argument("files", nargs="+", metavar="FILE", help="a file, or a Hugging Face model folder")
    im.add_argument("--step", type=int, default=None, help="the snapshot's step")
    im.add_argument("--job", default=None, help="the snapshot's job (default: the ref's first component)")
    return p


_LEVELS = ("debug", "info", "warning", "error")


def _level(v: str) -> str:
    if v.lower() not in _LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(_LEVELS)}, got {v!r}")
    return v.lower()


def _log_format(v: str) -> str:
    if v not in ("text", "json"):
        raise argparse.ArgumentTypeError(f"must be text or json, got {v!r}")
    return v


def _add_log_options(p, *, top: bool) -> None:
    """-v, --log-level, --log-format: before the command (`tsck -v gc STORE`) or after it
    (`tsck gc STORE -v`); after it they are only set when given (SUPPRESS), so they never
    undo what was given before the command."""
    d = {} if top else {"default": argparse.SUPPRESS}
    p.add_argument("-v", "--verbose", action="count", help="log what the store does on stderr: -v INFO "
                   "(each committed snapshot and restore, and what needs you), -vv DEBUG (gc and prune phases, "
                   "fence waits, uploads)", **({"default": 0} if top else d))
    p.add_argument("--log-level", type=_level, metavar="LEVEL", help=f"log at LEVEL ({', '.join(_LEVELS)})",
                   **({"default": None} if top else d))
    # (a type, not choices=: _dash_hint reads a top-level action's choices as the commands)
    p.add_argument("--log-format", type=_log_format, metavar="FORMAT", help="log lines as text (default) or json: one JSON "
                   "object a line (time, level, logger, message and the event's fields)",
                   **({"default": None} if top else d))


class _JsonLogFormatter:
    """One JSON object per log record: what a log shipper indexes. A record with a `tsck`
    attribute (a committed, skipped or failed snapshot) carries its fields too."""

    def format(self, record) -> str:
        import datetime
        obj = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        fields = getattr(record, "tsck", None)
        if isinstance(fields, dict):
            obj.update({k: v for k, v in fields.items() if k not in obj})
        if record.exc_info:
            import logging
            obj["exception"] = logging.Formatter().formatException(record.exc_info)
        return _dumps(obj)


def _setup_logging(args):
    """Log records of the tensorstore_ck loggers on stderr when asked (-v, --log-level,
    --log-format) -> a function that undoes it (main() may run again in one process).
    Not asked: nothing changes (warnings reach stderr through Python's last resort)."""
    import logging
    verbose, level, fmt = args.verbose or 0, args.log_level, args.log_format
    if not verbose and level is None and fmt is None:
        return lambda: None
    if level is None:
        level = "debug" if verbose >= 2 else "info" if verbose == 1 else "warning"
    lg = logging.getLogger("tensorstore_ck")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLogFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    old_level, old_propagate = lg.level, lg.propagate
    lg.addHandler(handler)
    lg.setLevel(getattr(logging, level.upper()))
    lg.propagate = False  # (once, not again through a handler the root logger may have)

    def undo():
        lg.removeHandler(handler)
        lg.setLevel(old_level)
        lg.propagate = old_propagate
    return undo


def _dash_hint(parser, argv) -> str:
    """A name that begins with '-' reads as an option: say how to pass it."""
    known = {o for a in parser._actions for o in a.option_strings}
    for a in parser._actions:
        for sub in (getattr(a, "choices", None) or {}).values():
            known |= {o for x in sub._actions for o in x.option_strings}
    argv = list(argv)
    head = argv[:argv.index("--")] if "--" in argv else argv
    odd = [x for x in head if x.startswith("-") and x.split("=")[0] not in known and x != "-"
           and not x[1:].replace(".", "", 1).isdigit()]  # a negative number is a value, not a name
    return f" ({odd[0]!r} was read as an option; a name that begins with '-' goes after `--`: " \
           f"tsck log STORE -- {odd[0]})" if odd else ""


def _verb(parser, argv) -> tuple[int | None, "argparse.ArgumentParser | None"]:
    """(index, sub-parser) of the command in argv: its first argument that is neither an
    option nor the value of one (`tsck --log-level info refs`)."""
    takes_value = {o for a in parser._actions if a.option_strings and a.nargs != 0 for o in a.option_strings}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            return None, None
        if a.startswith("-") and a != "-":
            i += 2 if a in takes_value else 1
            continue
        for act in parser._actions:
            if isinstance(act.choices, dict) and a in act.choices:
                return i, act.choices[a]
        return None, None
    return None, None


def _names_store(x: str) -> bool:
    """A positional that names a store: a URL (scheme://...) or a path that exists here."""
    return "://" in x or os.path.exists(x)


def with_env_store(parser, argv: list) -> list:
    """$TSCK_STORE as the default STORE: when it is set and the command's first positional
    does not name a store (a URL, or a path that exists), the store is $TSCK_STORE and every
    positional keeps its meaning: `tsck log jobA/main` = `tsck log $TSCK_STORE jobA/main`.
    A first positional that is a URL or an existing path is the store, as without it."""
    env = os.environ.get("TSCK_STORE")
    i, sub = _verb(parser, argv)
    if not env or sub is None:
        return argv
    takes_value = {o for a in sub._actions if a.option_strings and a.nargs != 0 for o in a.option_strings}
    k, first = i + 1, None
    while k < len(argv):
        a = argv[k]
        if a == "--":
            first = argv[k + 1] if k + 1 < len(argv) else None
            break
        if a.startswith("-") and a != "-":
            k += 2 if a in takes_value else 1  # an option, and its value when it takes one
            continue
        first = a
        break
    if first is not None and _names_store(first):
        return argv
    return argv[:i + 1] + [env] + argv[i + 1:]


_RESTIC_FORGET = ("--keep-", "--prune")


def _forget_hint(parser, argv) -> str | None:
    """restic's `forget --keep-last N` typed here: point at retention rules and gc."""
    i, sub = _verb(parser, argv)
    if sub is None or argv[i] != "forget" or not any(a.startswith(_RESTIC_FORGET) for a in argv[i + 1:]):
        return None
    opt = next(a for a in argv[i + 1:] if a.startswith(_RESTIC_FORGET))
    rule = opt.split("=")[0]
    n = opt.split("=", 1)[1] if "=" in opt else next(iter(argv[argv.index(opt) + 1:argv.index(opt) + 2]), "N")
    rule = {"--keep-last": f"--keep-last {n}"}.get(rule, "--keep-last N (or --keep-best K --metric M, "
                                                          "--keep-every-steps S, --max-age-days D)")
    return ("`tsck forget` drops one snapshot (STORE REF@STEP or a root); keeping only some snapshots is a "
            f"retention rule per job, applied by gc: `tsck retention STORE JOB {rule}`, then "
            "`tsck gc STORE --dry-run` (what would go, and why) and `tsck gc STORE`")


def _cli_words(e: TsckError, args) -> str:
    """An error's message, with the API's advice (open_store(create=True)) in the CLI's words."""
    from .opener import CREATE_HINT
    same = " (same --refs)" if args.refs or os.environ.get("TSCK_REFS") else ""
    text = str(e).replace(CREATE_HINT, f"run `tsck init {args.store}`{same} to make a new store")
    # The API's messages say `tsck CMD STORE ...`: here the store is known.
    return re.sub(r"`tsck ([a-z-]+) STORE\b", lambda m: f"`tsck {m.group(1)} {args.store}", text)


def main(argv=None) -> int:
    parser = build_parser()
    given_argv = list(sys.argv[1:] if argv is None else argv)
    argv = with_env_store(parser, given_argv)
    try:
        args = parser.parse_args(argv)
    except _Usage as e:
        hint = _forget_hint(parser, argv)
        if hint is not None:
            print(f"tsck: error: {hint}", file=sys.stderr)
            return 2
        given = argv != given_argv  # $TSCK_STORE was put in as the store
        note = f" (the store is $TSCK_STORE, {os.environ['TSCK_STORE']}: the first argument is not a URL or an " \
               "existing path)" if given else ""
        print(f"tsck: error: {e}{_dash_hint(parser, argv)}{note}", file=sys.stderr)
        return 2
    if args.cmd is None:  # bare `tsck`: what it can do, not a complaint about a missing argument
        parser.print_help(sys.stderr)
        return 2
    try:
        refs, storage_options = _remote_options(args)
    except _Usage as e:
        print(f"tsck: error: {e}", file=sys.stderr)
        return 2
    undo_logging = _setup_logging(args)
    try:
        if args.fn is cmd_init:
            return cmd_init(args, refs, storage_options)
        # Only init creates a store; only recover may create a ref table (to rebuild a lost one).
        with open_store(args.store, refs=refs, storage_options=storage_options, create=False,
                        create_refs=args.fn is cmd_recover and not args.read_only,
                        read_only=True if args.read_only else None) as store:
            return args.fn(store, args)
    except TsckError as e:
        print(f"tsck: error: {_cli_words(e, args)}", file=sys.stderr)
        return 1 if isinstance(e, StorageError) else 2
    except KeyboardInterrupt:
        print("tsck: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tsck ... | head`: the reader left; not an error of ours
        sys.stdout = None
        return 0
    finally:
        undo_logging()
