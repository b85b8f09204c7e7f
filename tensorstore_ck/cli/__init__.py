"""`tsck`: the command line. Exit codes: 0 ok, 1 problems found or the environment
failed (StorageError: a full disk, an unreachable server), 2 user error.

Every command takes --json, which writes strict JSON (NaN/inf as null, bytes as
"hex:<hex>"; see common._jsonable). A user mistake (bad arguments, unknown target,
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

$TSCK_STORE is the default STORE of every command (parser.with_env_store): when it is set and
the first positional is not a URL (scheme://...) or an existing path, the store is
$TSCK_STORE and the positionals keep their meaning (`tsck log jobA/main -n 5`).

The commands by group, one module each: snapshots.py (refs, log, show, ls, diff, tag,
untag, pin, unpin, delete-ref, undelete, forget), maintenance.py (init, du, gc,
retention, fsck, recover), interchange.py (checkout, export-weights, import), goodput.py
(goodput); parser.py
reads the arguments, common.py holds the output every group shares, and main() here
opens the store, runs the command and maps errors to exit codes.

Its modules:

    parser.py         every command's arguments, $TSCK_STORE, the hints for a misread one
    snapshots.py      refs, log, show, ls, diff; tag, untag, pin, unpin, delete-ref, undelete, forget
    maintenance.py    init, du, gc, retention, fsck, recover
    interchange.py    checkout (a file or a model folder), export-weights, import
    goodput.py        goodput: the expected goodput of a run, and its best snapshot interval
    common.py         what the groups share: sizes and times as shown, strict JSON, a local tier
"""

from __future__ import annotations

import os
import re
import sys

from ..errors import StorageError, TsckError
from ..opener import open_store
from .common import dumps, human  # noqa: F401 - re-exported: sizes as the CLI shows them
from .goodput import cmd_goodput
from .maintenance import cmd_init, cmd_recover
from .parser import Usage, forget_hint, dash_hint, remote_options, build_parser, with_env_store

__all__ = ["main", "build_parser"]


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
        return dumps(obj)


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


def _cli_words(e: TsckError, args) -> str:
    """An error's message, with the API's advice (open_store(create=True)) in the CLI's words."""
    from ..opener import CREATE_HINT
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
    except Usage as e:
        hint = forget_hint(parser, argv)
        if hint is not None:
            print(f"tsck: error: {hint}", file=sys.stderr)
            return 2
        given = argv != given_argv  # $TSCK_STORE was put in as the store
        note = f" (the store is $TSCK_STORE, {os.environ['TSCK_STORE']}: the first argument is not a URL or an " \
               "existing path)" if given else ""
        print(f"tsck: error: {e}{dash_hint(parser, argv)}{note}", file=sys.stderr)
        return 2
    if args.cmd is None:  # bare `tsck`: what it can do, not a complaint about a missing argument
        parser.print_help(sys.stderr)
        return 2
    try:
        refs, storage_options = remote_options(args)
    except Usage as e:
        print(f"tsck: error: {e}", file=sys.stderr)
        return 2
    undo_logging = _setup_logging(args)
    try:
        if args.fn is cmd_init:
            return cmd_init(args, refs, storage_options)
        if args.fn is cmd_goodput and args.store is None:  # every figure given as an option: no store
            return cmd_goodput(None, args)
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
