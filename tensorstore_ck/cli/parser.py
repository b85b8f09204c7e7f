"""`tsck`'s arguments: the parser of every command, $TSCK_STORE as the default STORE,
the storage options, and the hints for an argument misread."""

from __future__ import annotations

import argparse
import json
import os

from .goodput import cmd_goodput
from .interchange import cmd_checkout, cmd_export_weights, cmd_import
from .maintenance import cmd_du, cmd_fsck, cmd_gc, cmd_init, cmd_recover, cmd_retention
from .snapshots import (cmd_delete_ref, cmd_diff, cmd_forget, cmd_log, cmd_ls, cmd_pin, cmd_refs, cmd_show, cmd_tag,
                        cmd_undelete, cmd_untag)

__all__ = ["build_parser", "with_env_store"]


class Usage(Exception):
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
        raise Usage(message)


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
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

    def add(name, fn, help, *pos, store_nargs=None):
        s = sub.add_parser(name, help=help)
        s.add_argument("store", nargs=store_nargs,
                       help="store path or URL (may be left out when $TSCK_STORE names it)")
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
    gp = add("goodput", cmd_goodput, "expected goodput of a run, and the snapshot interval that maximises it",
             store_nargs="?")
    gp.add_argument("ref", nargs="?", help="the ref whose recorded snapshots give the stall, the time to durable "
                                           "and the interval (medians of the newest 100)")
    for opt, what in (("--stall", "seconds each snapshot blocks training"),
                      ("--durable", "seconds from a snapshot's start to durable (default: recorded, or the stall)"),
                      ("--interval", "seconds from one snapshot's start to the next"),
                      ("--restart", "seconds from a failed job's process start to its first resumed step"),
                      ("--mtbf", "mean time between the job's failures")):
        gp.add_argument(opt, default=None, metavar="DURATION", required=opt in ("--restart", "--mtbf"),
                        help=f"{what}; seconds, or a number with s, m, h or d (e.g. 7.9h)")
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
    from ..maintain.retention import MAX_COUNT

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
    # (a type, not choices=: dash_hint reads a top-level action's choices as the commands)
    p.add_argument("--log-format", type=_log_format, metavar="FORMAT", help="log lines as text (default) or json: one JSON "
                   "object a line (time, level, logger, message and the event's fields)",
                   **({"default": None} if top else d))


def remote_options(args) -> tuple[str | None, dict | None]:
    refs = args.refs or os.environ.get("TSCK_REFS") or None
    opts: dict = {}
    env = os.environ.get("TSCK_STORAGE_OPTIONS")
    if env:
        try:
            opts = json.loads(env)
        except ValueError:
            raise Usage("$TSCK_STORAGE_OPTIONS is not valid JSON") from None
        if not isinstance(opts, dict):
            raise Usage("$TSCK_STORAGE_OPTIONS must be a JSON object")
    for item in args.storage_option:
        key, eq, value = item.partition("=")
        if not eq or not key:  # never echo it: a mistyped option may be a secret
            raise Usage("-o wants KEY=VALUE, got an argument " + ("with an empty KEY" if eq else "without '='"))
        try:
            opts[key] = json.loads(value)
        except ValueError:
            opts[key] = value
    return refs, (opts or None)


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


def dash_hint(parser, argv) -> str:
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


_RESTIC_FORGET = ("--keep-", "--prune")


def forget_hint(parser, argv) -> str | None:
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
