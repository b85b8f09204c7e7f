"""The store's upkeep: init, du, gc, retention, fsck, recover."""

from __future__ import annotations

from ..errors import InvalidArgument, NotAStore
from ..opener import open_store
from .common import wants_bar, human, metrics_text, open_tier, emit, when_text

__all__ = ["cmd_init", "cmd_du", "cmd_gc", "cmd_retention", "cmd_fsck", "cmd_recover"]


def cmd_init(args, refs, storage_options) -> int:
    """`tsck init STORE`: an empty store (open_store(create=True)), refused where one is."""
    from ..opener import CREATE_HINT
    if args.read_only:
        raise InvalidArgument("init makes a store: --read-only cannot go with it")
    try:
        with open_store(args.store, refs=refs, storage_options=storage_options, create=False) as store:
            raise InvalidArgument(f"there is a store at {store.url} already: nothing was changed")
    except NotAStore as e:
        if CREATE_HINT not in str(e):  # not an empty location: a file, a non-empty folder, a lost table
            raise
    with open_store(args.store, refs=refs, storage_options=storage_options, create=True) as store:
        emit(args, {"init": store.url, "id": store.config.get("id")}, f"created an empty store at {store.url}")
    return 0


def cmd_du(store, args):
    d = store.du()
    lines = [
        f"store        {d['store']}",
        f"snapshots    {d['snapshots']}",
        f"logical      {human(d['logical_bytes'])}  (what the kept snapshots hold)",
        _ratio("dedup", d["dedup_ratio"], f"logical / the distinct content they use, {human(d['distinct_bytes'])}"),
        _ratio("compression", d["compression_ratio"], f"those blocks / their stored bytes, "
                                                      f"{human(d['used_block_bytes'])}"),
        f"physical     {human(d['physical_bytes'])}  ({d['blocks']} blocks, {d['nodes']} nodes, "
        f"{d['commits']} commits: everything stored)",
        f"orphans      {human(d['orphans']['bytes'])}  ({d['orphans']['objects']} stored objects no kept snapshot "
        "uses, in physical: the next gc removes them, unless a put in flight uses them)",
    ]
    # Per job: what its snapshots reference (holds) and, of that, what no other job's does
    # (alone: what deleting the job would free). Not who wrote a block first: a block
    # shared by two jobs is freed only once both are gone.
    for job, j in sorted(d["jobs"].items(), key=lambda x: (-x[1]["only_bytes"], x[0])):
        lines.append(f"  job {job:<20} {j['snapshots']:>5} snapshots  logical {human(j['logical_bytes']):>10}"
                     f"  holds {human(j['held_bytes']):>10}  alone {human(j['only_bytes']):>10}"
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
        from ..maintain.usage import tier_usage
        with open_tier(store, args) as tier:
            t = tier_usage(tier.core)
        d["local"] = t
        lines.append(f"local tier {t['local']}: {human(t['bytes'])}")
        for key, what in (("pending", "queued for upload"), ("local_only", "local-only (not uploaded)"),
                          ("durable", "cached copies of durable snapshots"),
                          ("unreferenced", "reached by no snapshot (a put in flight, or a local gc's)")):
            c = t[key]
            n = f"{c['snapshots']:>5} snapshots" if key != "unreferenced" else " " * 15
            lines.append(f"  {key:<13}{n}  {human(c['bytes']):>10}  {what}")
        lines.append(f"  evicted      {t['evicted']['snapshots']:>5} snapshots  (local copies dropped by the budget; "
                     "read from the remote)")
        if t["unreadable"]:
            lines.append(f"  {len(t['unreadable'])} local snapshot(s) could not be read whole (tsck fsck --local "
                         "names them)")
    emit(args, d, "\n".join(lines))
    return 0


def _ratio(name: str, r, what: str) -> str:
    return f"{name:<12} {'-' if r is None else f'{r:.2f}x'}  ({what})"


def _du_plot(store, args, lines) -> dict:
    from ..interchange.plot import plot_usage, require_matplotlib
    from ..maintain.usage import usage
    require_matplotlib()  # missing: say so before walking the store
    u = usage(store.core)
    path = plot_usage(u, args.plot)
    p = u["physical"]
    if p["gcs"]:
        lines.append(f"plot: {p['gcs']} gc/prune run(s) on record reclaimed {human(p['reclaimed'][-1])} of blocks")
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
    head = (f"tmp/: {t['files']} temp file(s), {human(t['bytes'])} ({kinds}): writes in flight, or left by a "
            "save that died (killed)")
    rule = f"gc removes one once it is older than the gc's lease ({t['lease']:g} s"
    rule += f" + --grace {t['grace']:g} s" if t["grace"] else ""
    rule += (f"; a .pending file {t['pending_grace']:g} s more)" if t["pending"] else ")")
    if dry_run:
        now = [f"this gc would remove {t['sweepable']} ({human(t['sweepable_bytes'])})"]
    else:
        now = [f"{t['sweepable']} ({human(t['sweepable_bytes'])}) are old enough for the next gc"]
    if t["next_due"] is not None:
        rest = t["files"] - t["sweepable"]
        now.append(f"the other {rest} become old enough at {when_text(t['next_due'])}"
                   + (f" (the last at {when_text(t['all_due'])})" if rest > 1 else ""))
    return [head, f"  {rule}: {'; '.join(now)}"]


def cmd_gc(store, args):
    r = store.gc(dry_run=args.dry_run, progress=wants_bar(args), lease=args.lease, grace=args.grace)
    verb = "would delete" if r.dry_run else "deleted"
    lines = [f"expired {len(r.expired)} snapshots; kept {r.kept_snapshots}",
             f"{verb} {r.deleted_objects} objects, {human(r.deleted_bytes)} "
             f"({', '.join(f'{v} {k}' for k, v in sorted(r.deleted_by_kind.items())) or 'nothing'})"]
    if r.rescued:
        lines.append(f"{r.rescued} candidates were reused by writers meanwhile and kept")
    if r.dry_run:
        lines = _retention_table(store, r.snapshots) + [
            f"would expire {len(r.expired)} snapshot(s); keep {r.kept_snapshots}",
            f"would delete {r.deleted_objects} objects, {human(r.deleted_bytes)} "
            f"({', '.join(f'{v} {k}' for k, v in sorted(r.deleted_by_kind.items())) or 'nothing'}); "
            "--json lists their keys"] + _temp_lines(r.temp_files, dry_run=True)
    emit(args, r.to_json(), "\n".join(lines))
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
            lines.append(f"  {str(d['ref']):<24} {step:>8}  {when_text(d['time']):<20}  "
                         f"{'keep' if d['keep'] else 'remove':<6}  {', '.join(d['why']):<32}  "
                         f"{metrics_text(d['metrics'])}".rstrip())
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
    from ..maintain.retention import Retention
    given = {k: getattr(args, k) for k in ("keep_last", "keep_best", "metric", "keep_every_steps", "max_age_days")
             if getattr(args, k) is not None}
    if args.mode is not None:
        given["mode"] = args.mode
    if args.job is None:
        if given or args.clear:
            raise InvalidArgument("setting a rule needs a JOB")
        rules = store.retention()
        emit(args, {job: r.to_dict() for job, r in rules.items()},
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
    emit(args, {"job": args.job, "retention": None if rule is None else rule.to_dict()},
         f"{args.job}: {_rule_text(rule) if rule else 'no retention rule (keeps everything)'}")
    return 0


def cmd_fsck(store, args):
    r = _dotted_findings(store.fsck(full=not args.quick, progress=wants_bar(args), repair=args.repair, raw=args.raw))
    if args.local:
        return _fsck_tiers(store, args, r)
    lines = _fsck_lines(r)
    emit(args, r.to_json(), "\n".join(lines))
    # Exit 1 whenever problems were found, repaired or not: what was moved is still
    # missing from its snapshots until a put stores that content again.
    return 0 if r.ok else 1


def _fsck_tiers(store, args, r):
    """fsck STORE --local PATH: the remote store (above), then the local tier as a store
    of its own; every finding says its tier. Across the tiers: a snapshot the tier marks
    durable and evicted must be in the remote catalog (it has no other copy)."""
    from ..maintain.fsck import Finding
    with open_tier(store, args) as tier:
        lr = _dotted_findings(tier.fsck(full=not args.quick, progress=wants_bar(args), repair=args.repair,
                                        raw=args.raw))
        trefs = tier.reftable
        evicted = trefs.tier_rows.evicted()
        marked = trefs.tier_rows.durable(trefs.catalog_roots() | evicted)
        lost = sorted(root for root in marked if not store.reftable.catalog_has(root))
        queued = len(trefs.tier_rows.upload_pending())
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
    emit(args, {**r.to_json(), "ok": ok, "local": {**lr.to_json(), "queued": queued,
                                                   "only_local": [x.hex() for x in only_here]}}, "\n".join(lines))
    return 0 if ok else 1


def _dotted_findings(r):
    """The report with each finding's tensor path dotted as `tsck ls` writes it (model.layers.0.w)."""
    import dataclasses
    from ..util.paths import dotted_from_formatted
    r.findings = [dataclasses.replace(f, path=dotted_from_formatted(f.path)) if f.path else f for f in r.findings]
    return r


def _fsck_lines(r) -> list[str]:
    lines = [str(f) for f in r.findings]
    lines += [f"moved aside: {m['key']} -> {m['aside']} ({m['problem']})" for m in r.moved]
    lines += [f"not moved: {x['key']}: {x['why']}" for x in r.left]
    lines += _temp_lines(r.temp_files)
    lines.append(f"{'ok' if r.ok else 'PROBLEMS'}: {r.snapshots_checked} snapshots, {r.objects_checked} objects, "
                 f"{human(r.bytes_checked)} {'re-hashed' if r.full else 'sized'}; {len(r.findings)} problems; "
                 f"{r.orphans} orphans ({human(r.orphan_bytes)}, gc removes them)")
    if r.gc_ran:
        lines.append(f"note: a gc ran during this fsck; {r.dropped_after_gc} finding(s) of snapshots it removed "
                     "meanwhile were left out")
    if r.moved:
        lines.append(f"repair: {len(r.moved)} damaged object(s) moved aside; the snapshots above stay unreadable "
                     "until their content is put again (same address: that heals them), then fsck is clean")
    if r.quarantined:
        lines.append(f"note: {r.quarantined} object(s) ({human(r.quarantined_bytes)}) kept aside under "
                     "quarantine/ (never read, never deleted by gc: inspect, then remove them by hand)")
    return lines


def cmd_recover(store, args):
    r = store.recover(progress=wants_bar(args))
    lines = [f"{r.commits_found} commits found, {r.catalog_rows_added} catalog rows added"]
    lines += [f"  ref {k} -> {v}" for k, v in r.refs_restored.items()]
    lines += [f"  tag {k} -> {v}" for k, v in r.tags_restored.items()]
    lines += [f"  unreadable: {u}" for u in r.unreadable]
    # (what a user removed is only counted; a commit left out as incomplete is named, with why)
    from ..maintain.recover import REMOVED_BY_USER
    removed = sum(v == REMOVED_BY_USER for v in r.skipped.values())
    lines += [f"  not adopted: {k[:16]}: {v}" for k, v in r.skipped.items() if v != REMOVED_BY_USER]
    if removed:
        lines.append(f"  {removed} commit(s) removed by a user (forget, delete-ref) not brought back")
    emit(args, r.to_json(), "\n".join(lines))
    return 0
