"""The invariants, checked on a quiescent store against the operation journals.

Each check returns a list of violations (strings naming the invariant, the object and
the journal events involved); the driver's docstring is the spec. Everything here
reads the store through the public API (and the ref table's plain listings), and
rebuilds expected content from the spec each snapshot carries in meta["sim"].
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field

import torch

import tensorstore_ck as tsck
from tensorstore_ck.format import frame
from tensorstore_ck.format.manifest import decode_commit
from tensorstore_ck.util.ids import Digest
from tensorstore_ck.refs.history import RECOVERED

from . import content, rollback


# -- the journals ------------------------------------------------------------------------
# Calls a tier writer makes in its tier, which reach the remote store only through its uploader
# (a removal through a tier, untag too, acts in both tables or refuses: judged as any call).
TIER_OPS = ("put", "tag", "pin", "unpin")


@dataclass
class Op:
    w: str
    i: int
    op: str
    args: dict
    start: float
    end: float | None = None       # None: no result journaled (killed: outcome unknown)
    result: str | None = None      # "ok", an error type, "mismatch"
    out: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.result == "ok" and not self.local_only

    @property
    def local_only(self) -> bool:
        """A put through a local tier that returned: published in the tier, and in the
        remote store (what the other checks judge) only if and when its uploader gets
        there. To them its outcome is unknown: it may take effect, even much later. So
        are a tier writer's tags, pins and their removals (made in the remote by the
        uploader, or best effort)."""
        return self.result == "ok" and self.op in TIER_OPS and bool(self.args.get("tier"))

    @property
    def unknown(self) -> bool:
        # killed, or the call itself said so (a lost answer: it may still take effect later)
        return self.end is None or self.result == "OutcomeUnknown" or self.local_only

    @property
    def failed(self) -> bool:
        """The call said it failed: its effect must not exist (I9). A tier writer's tag or
        pin that failed is the tier's business (check_tiers)."""
        return not self.unknown and self.result not in ("ok", "mismatch") and \
            not (self.op in TIER_OPS and self.op != "put" and self.args.get("tier"))

    def brief(self) -> str:
        res = "UNKNOWN (killed)" if self.end is None else self.result
        if self.local_only:
            res = f"ok (local tier {self.args['tier']})"
        extra = {k: v for k, v in self.out.items() if k in ("root", "error", "findings", "diff", "expired")}
        return f"[{self.w}#{self.i} {self.op} {json.dumps(self.args, sort_keys=True)} t={self.start:.3f}" \
               f"..{'?' if self.end is None else f'{self.end:.3f}'} -> {res} {json.dumps(extra)[:600]}]"


def load_ops(run_dir: str) -> list[Op]:
    ops: dict[tuple, Op] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, "journal", "*.jsonl"))):
        with open(path) as f:
            for line in f:
                if not line.endswith("\n"):
                    continue  # a line cut by the kill: the event did not happen
                rec = json.loads(line)
                if "start" in rec:
                    ops[(rec["w"], rec["i"])] = Op(rec["w"], rec["i"], rec["op"], rec.get("args") or {},
                                                  rec["start"])
                elif "end" in rec:
                    o = ops[(rec["w"], rec["i"])]
                    o.end, o.result = rec["end"], rec["result"]
                    o.out = {k: v for k, v in rec.items() if k not in ("w", "i", "end", "result")}
    return sorted(ops.values(), key=lambda o: o.start)


def job_of(ref: str) -> str:
    return ref.split("/", 1)[0]


# -- what the store holds now --------------------------------------------------------------
def snapshot_of_table(store) -> dict:
    """Refs, tags, pins, catalog rows and reflog lengths: what a recover may change."""
    rt = store.reftable
    return {
        "refs": {n: r.hex() for n, r in rt.list()},
        "tags": {n: r.hex() for n, r in rt.tags()},
        "pins": sorted(r.hex() for r in rt.pins()),
        "catalog": sorted(r.hex() for r, _ in rt.catalog_iter()),
        "reflog": {n: [(e.old.hex() if e.old else None, e.new.hex()) for e in rt.reflog(n)] for n, _ in rt.list()},
    }


def _spec_of(store, root: bytes):
    row = store.reftable.catalog_get(root)
    if row is not None:
        return (row.get("meta") or {}).get("sim")
    return (store.publisher.info(root).meta or {}).get("sim")


def ranks_union(spec: dict) -> dict:
    """What one process must read back from a collective put of `spec`: the union of its
    ranks' states (content.rank_state), built here from those states: a sharded tensor
    whole from its pieces, whichever ranks hold them ("stage": none on rank 0); a
    Replicated tensor; any other value rank 0's, else the lowest rank's that holds it
    (docs/design/reading.md, "One process's view of a collective snapshot")."""
    world = int(spec["c"])
    out: dict = {}
    for r in range(world):
        for k, v in content.rank_state(spec, r, world).items():
            if isinstance(v, tsck.Sharded):
                t = out.setdefault(k, torch.zeros(v.global_shape, dtype=v.local.dtype))
                t[tuple(slice(o, o + n) for o, n in zip(v.offsets, v.local.shape))] = v.local
            else:
                out.setdefault(k, v.tensor if isinstance(v, tsck.Replicated) else v)
    return out


def verify_root(store, root: bytes, target: str | None = None) -> str | None:
    """None if the snapshot checks out bit-exact against its spec, else why not. A
    collective put's snapshot, read by this one process, against the union of its ranks'
    states."""
    try:
        spec = _spec_of(store, root)
        got = store.checkout(target or root.hex())
    except tsck.TsckError as e:
        return f"{type(e).__name__}: {str(e)[:300]}"
    if spec is None:
        return "no sim spec in its meta"
    if "c" in spec:
        diff = content.differences(got, ranks_union(spec))
        return None if not diff else "one process's view differs from the union of the ranks' states: " + \
            "; ".join(diff[:3])
    diff = content.differences(got, content.state(spec))
    return None if not diff else "content differs: " + "; ".join(diff[:3])


# -- the checks ------------------------------------------------------------------------------
def check_readable(store) -> list[str]:
    """I1: every ref tip, tag, pin and catalog row checks out bit-exact."""
    rt, bad = store.reftable, []
    seen: dict[bytes, str | None] = {}

    def one(root: bytes, what: str, target: str | None = None):
        key = root if target is None else (root, target)
        if key not in seen:
            seen[key] = verify_root(store, root, target)
        if seen[key] is not None:
            bad.append(f"I1 {what} -> {root.hex()[:16]}: {seen[key]}")

    for name, root in rt.list():
        one(root, f"ref {name}", name)
    for name, root in rt.tags():
        one(root, f"tag {name}", name)
    for root in sorted(rt.pins()):
        one(root, "pin")
    for root, _row in rt.catalog_iter():
        one(root, "catalog row")
    return bad


def check_fsck(store, label: str) -> list[str]:
    """I2: fsck (full) of the quiescent store is clean."""
    rep = store.fsck(full=True)
    return [f"I2 fsck ({label}): {f}" for f in rep.findings[:20]]


def _min_keep(ops: list[Op], job: str) -> int | None:
    """The smallest keep_last any set_retention of `job` asked for (whatever its outcome)."""
    keeps = [o.args.get("keep_last") for o in ops if o.op == "retention" and o.args.get("job") == job]
    keeps = [k for k in keeps if k is not None]
    return min(keeps) if keeps else None


def check_history(store, ops: list[Op], barriers: list[float]) -> list[str]:
    """I3: what calls claimed happened did happen (and stayed, unless a later event may
    have undone it legitimately). barriers: times the ref table was deleted (recover)."""
    rt, bad = store.reftable, []
    catalog = {r.hex(): row for r, row in rt.catalog_iter()}
    refs = {n: r.hex() for n, r in rt.list()}
    tags = {n: r.hex() for n, r in rt.tags()}
    pins = {r.hex() for r in rt.pins()}
    puts = [o for o in ops if o.op == "put" and (o.ok or o.unknown)]
    ok_by_root = {o.out["root"]: o for o in puts if o.ok}

    # Each successful put: its snapshot exists with the content it was given, unless
    # retention may have dropped it (keep_last=N of its job, and at least N other puts
    # of the job may have been published after it: they returned after it began, or
    # their outcome is unknown, or they failed and a recover since may have adopted the
    # commit they left in storage, as I9 allows).
    recovers = [o for o in ops if o.op in ("recover", "delete_refs")]
    adoptable = [o for o in ops if o.op == "put" and o.failed
                 and any(r.unknown or r.end > o.start for r in recovers)]
    # A rollback's move publishes its snapshot again: keep_last ranks it newest (gc.md).
    adoptable += [o for o in ops if rollback.moved_back(o)]
    for o in puts:
        if not o.ok:
            continue
        root, job = o.out["root"], job_of(o.args["ref"])
        row = catalog.get(root)
        if row is not None:
            if (row.get("meta") or {}).get("sim") != o.args["spec"]:
                bad.append(f"I3 catalog row of {root[:16]} holds another spec than its put: {o.brief()}")
            continue
        k = _min_keep(ops, job)
        later = sum(1 for p in puts + adoptable if p is not o and job_of(p.args["ref"]) == job
                    and (p.unknown or p.end > o.start))
        protected = root in refs.values() or root in tags.values() or root in pins
        if protected:
            bad.append(f"I3 {root[:16]} is a ref tip/tag/pin but has no catalog row: {o.brief()}")
        elif _deleted_after(ops, o.args["ref"], o.start) or _forgotten(ops, o):
            continue  # a user removed it by name
        elif k is None or later < k:
            bad.append(f"I3 put returned ok but its snapshot is gone (no catalog row; job {job} keep_last "
                       f"min {k}, {later} puts of the job possibly published after it): {o.brief()}")

    # One put, one snapshot: a put that lost races for its ref re-encoded its commit and
    # removes the ones the table refused; where one stays (the clean-up failed, the writer
    # was killed after its move) recover adopts only one encoding of the put; a recover
    # beside the put that adopted a refused one leaves the put to publish that one as it is,
    # or loses the row in the put's move, or at its own end (docs/design/publication.md).
    # So after any recover a put, returned or killed, is one snapshot.
    judged = {json.dumps(o.args["spec"], sort_keys=True): o for o in puts}
    held: dict = {}  # spec -> the catalog's roots holding it
    for root, row in catalog.items():
        held.setdefault(json.dumps((row.get("meta") or {}).get("sim"), sort_keys=True), []).append(root)
    for spec, roots in held.items():
        o = judged.get(spec)
        if o is None:
            continue
        other = [r for r in roots if r != o.out.get("root")] if o.ok else roots[1:]
        if other:
            bad.append(f"I3 one put, two snapshots: {other[0][:16]} holds the spec of a put that "
                       f"{'returned ' + o.out['root'][:16] if o.ok else 'was killed or unanswered'}, "
                       f"as does {(o.out['root'] if o.ok else roots[0])[:16]}: {o.brief()}")

    # Ref tips never go back: no successful put on the ref began after the tip's put returned,
    # unless a journaled rollback to the tip may have moved it back since (R1 judges those).
    for name, tip in refs.items():
        q = ok_by_root.get(tip)
        if q is None:
            continue
        newer = [p for p in puts if p.ok and p.args["ref"] == name and p.start > q.end
                 and not rollback.rolled_back_to(ops, name, tip, p.start)
                 # ...unless a user deleted the ref after it and then the table was lost: recover
                 # brings the ref back at the newest commit gc had not reclaimed yet
                 and not any(d.op == "delete_ref" and d.args["ref"] == name and _may_follow(d, p.start)
                             and any(b > d.start for b in barriers) for d in ops)]
        if newer:
            bad.append(f"I3 ref {name} is on {tip[:16]} but a later put returned ok: {newer[-1].brief()} "
                       f"(tip's put {q.brief()})")
    for o in puts:
        if o.ok and o.args["ref"] not in refs and not _deleted_after(ops, o.args["ref"], o.start):
            bad.append(f"I3 ref {o.args['ref']} is gone after a successful put: {o.brief()}")

    # Tags are immutable: every successful tag exists, on its root; a tag whose every call
    # failed with RefNotFound ("nothing was created") does not.
    tag_ops: dict[str, list[Op]] = {}
    for o in ops:
        if o.op == "tag":
            tag_ops.setdefault(o.args["name"], []).append(o)
    for name, lst in tag_ops.items():
        okd = [o for o in lst if o.ok]
        untagged = any(u.op == "untag" and u.args["name"] == name and (u.ok or u.unknown) for u in ops)
        for o in okd:
            if tags.get(name) != o.out["root"] and not (untagged and name not in tags):
                bad.append(f"I3 tag {name} returned ok on {o.out['root'][:16]} but the table has "
                           f"{tags.get(name)}: {o.brief()}")
        if name in tags and lst and all(o.result == "RefNotFound" for o in lst):
            bad.append(f"I3 tag {name} exists on {tags[name][:16]} although tag() said RefNotFound "
                       f"(nothing created): {lst[-1].brief()}")

    # Pins: a successful pin holds until an unpin of that root (or any unpin whose target
    # is unknown) may have run after it, or the ref table was rebuilt (pins are lost).
    unpins = [o for o in ops if o.op == "unpin" and (o.ok or o.unknown)]
    for o in ops:
        if o.op != "pin" or not o.ok:
            continue
        root = o.out["root"]
        if any(b > o.start for b in barriers):
            continue
        undone = False
        for u in unpins:
            if not u.unknown and u.end < o.start:
                continue
            target = u.out.get("root") or u.args.get("target")
            if target == root or (u.unknown and len(str(target)) != 64):
                undone = True
        if not undone and root not in pins:
            bad.append(f"I3 pin of {root[:16]} returned ok and was never unpinned, but it is not pinned: "
                       f"{o.brief()}")

    # Calls judged on their own: fsck beside everything else reports no damage; a read
    # returns exactly what was put; nothing raises a raw (non-TsckError) exception.
    planted = rollback.planted_windows(ops)
    for o in ops:
        # An object the injector made unreadable (EIO) is rightly an "unreadable" finding:
        # that is the environment, not damage; nor is a block damaged on purpose meanwhile.
        damage = [f for f in o.out.get("findings") or [] if not (f.startswith("unreadable:") and "sim: injected" in f)
                  and not rollback.planted(f, o, planted)]
        if o.op == "fsck" and o.ok and damage:
            bad.append(f"I4 fsck beside the others reported damage: {o.brief()}")
        # U1: objects the injector made unreadable (faults.py `unreadable`: EIO, EACCES,
        # EISDIR, never cured by asking again) are findings of fsck, at once; gc stops
        # naming one (UnreadableObject) or goes on without reading it. Neither fails on
        # one otherwise (a retry budget spent on it, a raw error).
        armed = o.args.get("unreadable") or {}
        if armed and not o.ok and not o.unknown and o.result != "UnreadableObject" \
                and any(k in o.out.get("error", "") for k in armed):
            bad.append(f"U1 {o.op} failed on an unreadable object instead of reporting it: {o.brief()}")
        if o.result == "mismatch":
            bad.append(f"I4 read returned other bytes than were put: {o.brief()}")
        if o.out.get("mismatch") and o.result != "mismatch":  # a collective put's ranks read their rows back
            bad.append(f"I4 a rank's checkout of its own rows returned other bytes: {o.brief()} {o.out['mismatch']}")
        if o.out.get("raw"):
            bad.append(f"I4 raw exception: {o.brief()} {o.out.get('trace', '')[-800:]}")
        # A writer never makes a malformed manifest: a put without a tier (nothing damaged
        # on a tier's disk under it) that fails with FormatError wrote one (a saver's
        # addresses cut short, a block list out of step with its tensor).
        if o.op == "put" and o.result == "FormatError" and not o.args.get("tier"):
            bad.append(f"I4 a put failed on a manifest it made: {o.brief()} {o.out.get('error', '')[-400:]}")
        if o.op == "recover" and not o.ok and not o.unknown:
            bad.append(f"I5 recover failed: {o.brief()}")
        # Liveness: a fenced put takes a gc hold, so no deletion phase opens before its move;
        # a second fence means a hold ran out (30 s) or was ignored. Two is slack for the former.
        if o.op == "put" and o.ok and (o.out.get("fenced") or 0) > 2:
            bad.append(f"I8 a put was fenced {o.out['fenced']} times (a writer starved by gc): {o.brief()}")
    return bad


def check_failures(store, ops: list[Op]) -> list[str]:
    """I9, the converse of I3: no call reported failure for something that happened. A put
    that raised (not OutcomeUnknown, not killed) has no snapshot in the catalog or at a
    ref tip; a tag that raised does not exist; a pin of a root that raised is not there
    unless another pin of it may have made it. A recover after the call may adopt what a
    failed call left in storage (the clean-up that deletes it can fail too): not judged."""
    rt, bad = store.reftable, []
    recovers = [o for o in ops if o.op in ("recover", "delete_refs")]

    def judged(o: Op) -> bool:
        return o.failed and not any(r.unknown or r.end > o.start for r in recovers)

    failed_puts = {(o.args["spec"]["w"], o.args["spec"]["o"]): o for o in ops if o.op == "put" and judged(o)}
    if failed_puts:
        roots = {r for r, _ in rt.catalog_iter()} | {r for _, r in rt.list()}
        for root in roots:
            try:
                spec = _spec_of(store, root) or {}
            except tsck.TsckError:
                continue  # I1 reports an unreadable one
            o = failed_puts.get((spec.get("w"), spec.get("o")))
            if o is not None:
                bad.append(f"I9 put said {o.result} but its snapshot {root.hex()[:16]} is published: {o.brief()}")
    tags = {n: r.hex() for n, r in rt.tags()}
    for o in ops:
        if o.op == "tag" and judged(o) and o.args["name"] in tags:
            bad.append(f"I9 tag said {o.result} but {o.args['name']} exists on {tags[o.args['name']][:16]}: "
                       f"{o.brief()}")
    pins = {r.hex() for r in rt.pins()}
    pin_ops = [o for o in ops if o.op == "pin"]
    for o in pin_ops:
        t = o.args["target"]
        if judged(o) and t in pins and not any(
                p is not o and not p.failed and (p.out.get("root") == t or p.args["target"] == t
                                                 or len(p.args["target"]) != 64) for p in pin_ops):
            bad.append(f"I9 pin said {o.result} but {t[:16]} is pinned: {o.brief()}")
    return bad


def _may_follow(o: Op, start: float) -> bool:
    """o (ok or killed) may have taken effect after `start`."""
    return (o.ok or o.unknown) and (o.unknown or o.end > start)


def _deleted_after(ops: list[Op], ref: str, start: float) -> bool:
    return any(d.op == "delete_ref" and d.args["ref"] == ref and _may_follow(d, start) for d in ops)


def _forgotten(ops: list[Op], put: Op) -> bool:
    root, names = put.out["root"], {put.out["root"], f"{put.args['ref']}@{put.args.get('step')}"}
    return any(f.op == "forget" and (f.out.get("root") == root or (f.unknown and f.args["target"] in names))
               and _may_follow(f, put.start) for f in ops)


def _kept_again(ops: list[Op], forget: Op) -> bool:
    """A pin or tag of the forgotten root that may have come after the forget: what brings a
    forgotten snapshot back (README, "Removed the wrong ref?"), so its row may return."""
    root = forget.out["root"]
    return any(p.op in ("pin", "tag") and not p.failed and isinstance(p.args.get("target"), str)
               and len(p.args["target"]) >= 8 and root.startswith(p.args["target"])
               and _may_follow(p, forget.start) for p in ops)


def _sent_before(put: Op, delete: Op) -> bool:
    """A put through the tier a delete_ref went through, returned before the delete began:
    the delete removed the ref's snapshots from that tier's queue (an upload in flight is
    waited for), so its upload cannot bring the remote ref back after it."""
    tier = delete.args.get("tier")
    return bool(tier) and put.local_only and put.args.get("tier") == tier and put.end < delete.start


def check_removed(store, ops: list[Op], barriers: list[float]) -> list[str]:
    """I7: what users removed by name stays removed: a deleted ref is absent unless a put
    on it (not one through the tier the delete went through that returned before it) or an
    undelete may have run since (or the ref table was lost and rebuilt since: its record
    went with it); a forgotten snapshot has no catalog row (same exception, and unless a
    pin or tag of its root may have come since: how it is brought back); an untagged
    tag never comes back, not even through recover (its storage object went first)."""
    rt, bad = store.reftable, []
    refs = {n: r.hex() for n, r in rt.list()}
    tags = {n for n, _ in rt.tags()}
    for o in ops:
        if not o.ok or any(b > o.start for b in barriers):
            continue
        if o.op == "delete_ref" and o.args["ref"] in refs:
            again = [p for p in ops if p.args.get("ref") == o.args["ref"] and (
                (p.op == "put" and _may_follow(p, o.start) and not _sent_before(p, o))
                or (p.op == "undelete" and _may_follow(p, o.start)))]
            if not again:
                bad.append(f"I7 ref {o.args['ref']} was deleted and no put on it ran since, but it is on "
                           f"{refs[o.args['ref']][:16]}: {o.brief()}")
        elif o.op == "forget" and rt.catalog_get(bytes.fromhex(o.out["root"])) is not None \
                and not _kept_again(ops, o):
            bad.append(f"I7 snapshot {o.out['root'][:16]} was forgotten but has a catalog row again: {o.brief()}")
    for o in ops:
        if o.op == "untag" and o.ok and o.args["name"] in tags:
            bad.append(f"I7 tag {o.args['name']} was removed but exists again: {o.brief()}")
    return bad


def newest_complete_commits(store) -> dict[str, tuple]:
    """ref -> (time, step, root hex) of its newest commit in storage that checks out."""
    by_ref: dict[str, list] = {}
    for o in store.assets.list_objects("commits"):
        try:
            c = decode_commit(store.assets.get_commit(o.digest, verify=True))
        except tsck.TsckError:
            continue
        step = c["step"] if isinstance(c["step"], int) else -1
        by_ref.setdefault(c["ref"], []).append((float(c["time"]), step, o.digest))
    out = {}
    for ref, items in by_ref.items():
        for t, s, d in sorted(items, reverse=True, key=lambda x: (x[0], x[1])):
            try:
                _read_commit(store, d)
            except tsck.TsckError:
                continue
            out[ref] = (t, s, d.hex())
            break
    return out


def _read_commit(store, d: Digest) -> None:
    from tensorstore_ck.read.read import MISSING, Reader
    c = decode_commit(store.assets.get_commit(d, verify=True))
    Reader(store.assets, store.pool, snapshot=d.hex(), verify=True).read(c["tree"], MISSING)


def check_recovered(store) -> list[str]:
    """I6: after recover (the ref table rebuilt, no writer running) every ref is at the
    newest commit of its history in storage whose tree is whole."""
    bad = []
    refs = {n: r.hex() for n, r in store.reftable.list()}
    for ref, (t, s, root) in sorted(newest_complete_commits(store).items()):
        if refs.get(ref) != root:
            bad.append(f"I6 after recover ref {ref} is on {str(refs.get(ref))[:16]}, not on its newest whole "
                       f"commit {root[:16]} (time {t:.3f}, step {s})")
    return bad


# -- writers with a local tier ------------------------------------------------------------
def _dropped_legitimately(ops: list[Op], put: Op, root: str) -> bool:
    """Whether the remote catalog may have lost `root` (of `put`) by a user's doing:
    retention of its job (keep_last=N and >= N other puts of the job possibly published
    after it began), its ref deleted, or the snapshot forgotten, after the put began."""
    job = job_of(put.args["ref"])
    k = _min_keep(ops, job)
    puts = [p for p in ops if p.op == "put" and (p.ok or p.unknown)]
    later = sum(1 for p in puts + [r for r in ops if rollback.moved_back(r)]
                if p is not put and job_of(p.args["ref"]) == job and (p.unknown or p.end > put.start))
    names = {root, f"{put.args['ref']}@{put.args.get('step')}"}
    forgotten = any(f.op == "forget" and (f.out.get("root") == root or (f.unknown and f.args["target"] in names))
                    and _may_follow(f, put.start) for f in ops)
    return (k is not None and later >= k) or _deleted_after(ops, put.args["ref"], put.start) or forgotten


def kept_over_tiers(tier, remote, job: str) -> set[str]:
    """The roots of `job` (hex) that must be held in one tier or the other: the tier's
    tags, pins and ref tips, and what the job's rules keep over the union of both tiers'
    catalogs (a row the tier holds counts in its publication order, one only the remote
    holds by its time; where the two tables' rules differ, a snapshot both keep). A job
    without rules keeps every row."""
    from tensorstore_ck.maintain.retention import Retention, SnapRow, explain_kept
    lt, rt = tier.reftable, remote.reftable
    rows: dict[bytes, SnapRow] = {}

    def snap(root, row, seq=None, recovered=False):
        return SnapRow(root, row.get("step"), float(row.get("time", 0.0)), dict(row.get("metrics") or {}), seq,
                       str(row.get("ref", "")), recovered)
    for root, row in rt.catalog_iter():
        if row.get("job") == job:
            rows[root] = snap(root, row)
    order = lt.publication_record()
    for root, row in lt.catalog_iter():
        if row.get("job") == job:
            rows[root] = snap(root, row, *order.get(root, (None, False)))
    kept = set(rows)
    for rec in (lt.retention_all().get(job), rt.retention_all().get(job)):
        if rec is not None:
            kept &= set(explain_kept(list(rows.values()), Retention.from_dict(rec), lt.wall_now()))
    return {r.hex() for r in kept | (set(_tier_holds(tier)) & set(rows))}


def _tier_holds(tier) -> dict[bytes, str]:
    """root -> what holds it in the tier whatever the rules say (a tag, a pin, a ref tip)."""
    lt, out = tier.reftable, {}
    for name, r in lt.tags():
        out.setdefault(r, f"tag {name}")
    for r in lt.pins():
        out.setdefault(r, "pinned")
    for name, r in lt.list():
        out.setdefault(r, f"tip of {name}")
    return out


def _tier_jobs(ops: list[Op], tname: str) -> set[str]:
    """The jobs of tier `tname`'s catalog writers (their retention calls name them)."""
    return {o.args["job"] for o in ops if o.op == "retention" and o.args.get("tier") == tname}


def _held_somewhere(tier, store, lcat: dict, evicted: set, root: str, cache: dict) -> str | None:
    """None if `root` checks out bit-exact from the tier (its row there, its copy not
    evicted) or from the remote store (its row there), else why not."""
    def verified(where: str, holder) -> str | None:  # verify_root's answer, once per holder and root
        if (where, root) not in cache:
            cache[(where, root)] = verify_root(holder, bytes.fromhex(root))
        return cache[(where, root)]

    why = []
    if root in lcat and root not in evicted:
        if (bad := verified("t", tier)) is None:
            return None
        why.append(f"tier: {bad}")
    else:
        why.append("tier: " + ("evicted" if root in lcat else "no catalog row"))
    if store.reftable.catalog_get(bytes.fromhex(root)) is not None:
        if (bad := verified("r", store)) is None:
            return None
        why.append(f"remote: {bad}")
    else:
        why.append("remote: no catalog row")
    return "; ".join(why)


# T16: a close's bound is its timeout plus the uploader's stop grace and the release of the
# remote (its pool, table, storage): seconds on a machine shared with the round's workers.
DOWN_MARGIN = 15.0


def check_tiers(store, tiers: dict[str, str], ops: list[Op]) -> tuple[list[str], dict]:
    """T1-T9, the local tiers against the remote store (`store`, quiescent, no tier open):

      T1  every remote ref tip names no object missing remotely (its commit, every node
          and block walked and found);
      T2  a snapshot a tier marked durable is in the remote catalog (unless a user's
          retention, delete_ref or forget may have dropped it there since);
      T3  every tier passes its own fsck, but for the blocks a writer damaged on its
          tier's disk (worker op "rot"), which its fsck must name;
      T4  one root in every tier: a remote catalog row or ref tip whose spec a tier's put
          published is that tier's root (the put's own, if it returned), on the same ref,
          and its row holds the same spec;
      T5  every snapshot in a tier's catalog, and every tier ref tip, checks out of the
          tier bit-exact against its spec (or fails naming a block damaged there);
      T6  wait_durable() that said True left the newest earlier put of each of the
          caller's refs marked durable (older ones may be skipped by the backlog rule);
      T7  no uploader stopped on damage (IntegrityError at close()) but the damage done
          to its tier's disk, and no close() raised a raw exception;
      T8  an uploader never moves a remote ref back to a tier snapshot the ref had left
          (one already named by an earlier entry of the ref's reflog: an upload resumed
          after its move must not move the ref again);
      T9  a rank's tier keeps no intent to upload its part of a collective put whose
          outcome that rank heard (published: the row replaced it; aborted: dropped);
          only a rank killed before hearing it, or told OutcomeUnknown, leaves one,
          which its next open sends;
      T10 a block damaged on a tier's disk never reaches the remote damaged: if the
          remote holds it, its copy there is whole (it left from memory, or before);
      T11 nothing a catalog writer's job keeps is lost in both tiers: every tag and pin
          such a writer made (journaled ok) and nobody removed since, and every snapshot
          its job's rules keep over the union of the tier's and the remote's catalogs
          (kept_over_tiers), checks out bit-exact from the tier (not evicted) or from the
          remote (listed there); a pin is excused by a later loss of either ref table
          (pins live only there), damage done to the tier's disk by a lost copy;
      T12 what a job keeps becomes durable within the backlog bound: after a catalog
          writer's close() returned, every snapshot its tier kept before the close and
          the job still keeps over both tiers is in the remote catalog (worker op "kept");
      T13 a tier's stored bytes, sampled as each put of a writer with a budget returns,
          stay within the budget plus one snapshot per process sharing the tier (a put
          waits for room, else raises TierFull); so do each rank's tier's as a collective
          put through the ranks' tiers returns on that rank;
      T14 no IntegrityError from a tier writer's put, wait_durable() or close(), and no
          uploader stopped on one (looked at as the writer ends, op "uploader"), where no
          worker damaged that tier's disk (op rot): a snapshot that left the tier on
          purpose, or that another process sharing it made durable, is no damage;
      T16 a close(timeout=) with the remote storage down (a writer's end "down") ends
          within its timeout plus DOWN_MARGIN and, where two or more
          snapshots were queued, no other process shared the tier and its uploader had
          not stopped on a failure (which close or wait_durable raises) (at most the one
          upload in flight can finish, its objects sent before the remote went), says
          with a SnapshotWarning that what was not uploaded stays queued;
      T17 a rank's tier follows rank 0's: once its uploads and cleanups are done, it
          holds no part of a snapshot the last word it heard from rank 0 left out (judged
          by the rank before it closes: tests/sim/ranks.py);
      T18 a put through a tier after its writer's remote went down (op remote_down: the
          storage refusing, the PostgreSQL table away) fails with no StorageError but
          TierFull: the tier's puts never wait on the remote;
      T19 every float-coded block a remote ref tip names is coded by the element size of
          the tensor naming it, as a direct put codes it: an upload that coded it by
          another (a probe of the bytes alone; the harness's base tensor holds float64s
          that float32 holds exactly, which such a probe codes by 4) stored other bytes.
    -> (violations, {"puts": snapshots in the tiers, "durable": of those, marked durable,
       "budget_over": samples past T13's bound})."""
    from tensorstore_ck.core.walk import walk_commit
    rt, bad = store.reftable, []
    stats = {"puts": 0, "durable": 0, "budget_over": 0}
    rotted: dict[str, dict[str, str]] = {}  # tier -> {digest: key} of the blocks a writer damaged there
    for o in ops:
        if o.op == "rot" and o.ok and o.out.get("key"):
            rotted.setdefault(o.args["tier"], {})[o.out["key"].rsplit("/", 1)[-1]] = o.out["key"]

    def damaged(tname: str, text: str) -> bool:
        return any(h in text for h in rotted.get(tname, ()))
    for tname, keys in sorted(rotted.items()):  # T10
        for h, key in sorted(keys.items()):
            if store.assets.storage.size_of(key) is not None:
                err, _ = store.assets.verify_stored(key)
                if err is not None:
                    bad.append(f"T10 block {h[:16]}, damaged in tier {tname}, reached the remote damaged: {err}")
    catalog = {r.hex(): row for r, row in rt.catalog_iter()}
    refs = {n: r.hex() for n, r in rt.list()}
    coded: set[bytes] = set()  # blocks T19 looked at (the base tensor's are under every tip)
    for name, root in sorted(refs.items()):  # T1
        try:
            for o in walk_commit(store.assets, bytes.fromhex(root), verify=True):
                if o.kind == "block" and not store.assets.block_exists(o.digest):
                    bad.append(f"T1 remote ref {name} -> {root[:16]} names block {o.digest.hex()[:16]}, "
                               "missing remotely")
                elif o.kind == "block" and o.itemsize in frame.FLOAT_ITEMSIZES and o.digest not in coded:  # T19
                    coded.add(o.digest)
                    with store.assets.storage.open_read(store.assets.object_key("blocks", o.digest),
                                                        frame.HEADER_SIZE) as f:
                        hdr = frame.decode_header(f.read(frame.HEADER_SIZE))
                    if hdr.codec == frame.CODEC_FLOAT and hdr.itemsize != o.itemsize:
                        bad.append(f"T19 remote block {o.digest.hex()[:16]} of {o.path} (ref {name}) is float-coded "
                                   f"by {hdr.itemsize}, its tensor's elements are {o.itemsize} bytes")
        except tsck.TsckError as e:
            bad.append(f"T1 remote ref {name} -> {root[:16]}: {type(e).__name__}: {str(e)[:300]}")
    def through(put: Op, tname: str) -> bool:
        return put.args.get("tier") == tname or tname in put.args.get("rank_tiers", ())
    tier_puts: dict[tuple, Op] = {}
    down_at = {o.w: o.start for o in ops if o.op == "remote_down"}
    for o in ops:
        if o.op == "put" and o.args.get("tier") and o.w in down_at and o.start > down_at[o.w] \
                and o.result in ("StorageError", "OutcomeUnknown", "UnreadableObject"):  # T18
            bad.append(f"T18 a put through tier {o.args['tier']} after its remote went down failed with "
                       f"{o.result}: {o.brief()}")
        if o.op == "put" and o.args.get("tier"):
            tier_puts[(o.args["spec"]["w"], o.args["spec"]["o"])] = o
        if o.op == "durable" and o.ok and o.out.get("unmarked"):
            bad.append(f"T6 wait_durable said True but these earlier puts are not marked durable: "
                       f"{[r[:16] for r in o.out['unmarked']]}: {o.brief()}")
        if o.op == "close" and o.result == "IntegrityError" and damaged(o.args.get("tier", ""), o.out.get("error", "")):
            continue  # its uploader found the damage done to its disk, and stopped there
        if o.op == "close" and (o.result == "IntegrityError" or o.out.get("raw")):
            bad.append(f"T7 close() of a tiered store raised {o.result}: {o.brief()} {o.out.get('trace', '')[-800:]}")
        if o.op in ("put", "durable", "close") and o.result == "IntegrityError" and o.args.get("tier") \
                and o.args["tier"] not in rotted:  # T14
            bad.append(f"T14 {o.op} of a writer through tier {o.args['tier']}, whose disk no worker damaged, "
                       f"raised IntegrityError: {o.brief()}")
        if o.op == "uploader" and o.ok and o.out.get("stopped") == "IntegrityError" \
                and o.args["tier"] not in rotted:  # T14, however the writer ends (a kill too)
            bad.append(f"T14 the uploader of a writer through tier {o.args['tier']}, whose disk no worker damaged, "
                       f"stopped on IntegrityError: {o.out.get('error')}")
        if o.op == "close" and o.args.get("down"):  # T16
            took = o.out.get("took")
            if took is None or took > o.args["timeout"] + DOWN_MARGIN:  # (what it raised: T7, T14)
                bad.append(f"T16 close(timeout={o.args['timeout']}) with the remote down took {took}s, past "
                           f"its bound {o.args['timeout'] + DOWN_MARGIN}s: {o.brief()}")
            elif o.out.get("queued_before", 0) >= 2 and o.args.get("sharing", 1) == 1 \
                    and not o.out.get("stopped") and not o.out.get("stays_queued"):
                bad.append(f"T16 close() with the remote down left {o.out['queued_before']} snapshot(s) queued "
                           f"and said nothing of it: {o.brief()}")
        # (a tier's pin that a lost remote table took with it is made there again at the
        # tier's next open (Uploader._republish_holds), not by a writer already open:
        # until then the remote's retention may expire its snapshot there, so T12 does
        # not judge a pin after such a loss; T11 does: the tier keeps its copy)
        lost_pins = set(o.out.get("pinned") or ()) if any(b.op == "delete_refs" and b.start < o.start for b in ops) \
            else set()
        if o.op == "kept" and o.result == "ok" and set(o.out.get("not_remote") or ()) - lost_pins \
                and o.args["tier"] not in rotted:  # T12
            bad.append(f"T12 after close() returned, snapshots tier {o.args['tier']} kept (job {o.args['job']}) and "
                       f"the job still keeps are not in the remote catalog: "
                       f"{[r[:16] for r in o.out['not_remote']]}: {o.brief()}")
        if o.op == "put" and o.result == "ok" and o.args.get("rank_budget") and o.out.get("rank_tier_bytes"):
            bound = o.args["rank_budget"] + content.stored_bytes(o.args["spec"])  # (a rank's part: at most the whole)
            for tname, held in zip(o.args["rank_tiers"], o.out["rank_tier_bytes"]):
                if held is not None and held > bound:  # T13, a rank's tier
                    stats["budget_over"] += 1
                    bad.append(f"T13 rank tier {tname} held {held} B as its collective put returned, past its "
                               f"budget {o.args['rank_budget']} B plus a snapshot ({bound} B): {o.brief()}")
        if o.op == "put" and o.result == "ok" and o.args.get("budget") and o.out.get("tier_bytes") is not None:
            bound = o.args["budget"] + o.args.get("sharing", 1) * content.stored_bytes(o.args["spec"])
            if o.out["tier_bytes"] > bound:  # T13
                stats["budget_over"] += 1
                bad.append(f"T13 tier {o.args['tier']} held {o.out['tier_bytes']} B as a put returned, past its "
                           f"budget {o.args['budget']} B plus {o.args.get('sharing', 1)} snapshot(s) "
                           f"({bound} B): {o.brief()}")
    remote_by_spec: dict[tuple, list] = {}
    for root, row in catalog.items():
        sp = (row.get("meta") or {}).get("sim") or {}
        remote_by_spec.setdefault((sp.get("w"), sp.get("o")), []).append(root)
    for tname, path in sorted(tiers.items()):
        try:  # T17, judged by the rank itself as it closed (tests/sim/ranks.py)
            with open(path.rstrip("/") + "-follow.json") as f:
                bad += [b for line in f for b in json.loads(line)]
        except FileNotFoundError:
            pass
        try:
            t = tsck.open_store(path, create=False)  # the tier as a store of its own: no uploader
        except tsck.TsckError as e:
            bad.append(f"T3 tier {tname} does not open as a store: {type(e).__name__}: {e}")
            continue
        with t:
            rep = t.fsck(full=True)
            bad += [f"T3 tier {tname} fsck: {f}" for f in rep.findings[:20] if not damaged(tname, str(f))]
            lcat = {r.hex(): row for r, row in t.reftable.catalog_iter()}
            marked = {r.hex() for r in t.reftable.tier_rows.durable(bytes.fromhex(r) for r in lcat)}
            evicted = {r.hex() for r in t.reftable.tier_rows.evicted()}  # (the budget's: read through the remote)
            stats["puts"] += len(lcat)
            stats["durable"] += len(marked)
            # A collective snapshot is whole in no single tier (each holds its rank's part):
            # T3's fsck checks the part, T1 and the checks of puts the remote copy.
            parts = {r.hex() for r in t.reftable.tier_rows.parts()}
            for root in sorted(set(lcat) - parts - evicted):  # T5
                why = verify_root(t, bytes.fromhex(root))
                if why is not None and not damaged(tname, why):
                    bad.append(f"T5 tier {tname} snapshot {root[:16]}: {why}")
            for name, root in t.reftable.list():
                if root.hex() in parts or root.hex() in evicted:
                    continue
                why = verify_root(t, root, name)
                if why is not None and not damaged(tname, why):
                    bad.append(f"T5 tier {tname} ref {name} -> {root.hex()[:16]}: {why}")
            for root, lrow in sorted(lcat.items()):
                spec = (lrow.get("meta") or {}).get("sim") or {}
                put = tier_puts.get((spec.get("w"), spec.get("o")))
                if put is None or not through(put, tname):
                    bad.append(f"T4 tier {tname} holds snapshot {root[:16]} of spec {spec} that no put through "
                               "it journaled")
                    continue
                if put.local_only and put.out.get("root") != root:
                    bad.append(f"T4 tier {tname} holds {root[:16]} for a put that returned "
                               f"{put.out.get('root', '')[:16]}: {put.brief()}")
                row = catalog.get(root)
                if row is None:
                    # (a rank's part marked durable means that part is remote, not the snapshot)
                    if root in marked and root not in parts and not _dropped_legitimately(ops, put, root):  # T2
                        bad.append(f"T2 tier {tname} marked {root[:16]} durable but the remote catalog lacks it "
                                   f"(no retention, delete_ref or forget explains it): {put.brief()}")
                    continue
                if (row.get("meta") or {}).get("sim") != spec or row.get("ref") != lrow.get("ref"):
                    bad.append(f"T4 remote row of {root[:16]} differs from tier {tname}'s (spec/ref "
                               f"{(row.get('meta') or {}).get('sim')} {row.get('ref')} vs {spec} {lrow.get('ref')})")
            # T4: whatever the remote holds of this tier's puts is the tier's own root
            local_by_spec: dict[tuple, set] = {}
            for root, lrow in lcat.items():
                sp = (lrow.get("meta") or {}).get("sim") or {}
                local_by_spec.setdefault((sp.get("w"), sp.get("o")), set()).add(root)
            for key, put in tier_puts.items():
                # (a rank's tier keeps what rank 0's tier keeps: its own prune drops rows)
                if put.args.get("tier") != tname or put.args.get("rank_tiers"):
                    continue
                # The put's own root if it returned; else the tier's row of its spec, unless a
                # prune of the tier (or a lost table) took that row: then nothing says.
                own = {put.out["root"]} if put.local_only else local_by_spec.get(key, set())
                if not own and (_tier_jobs(ops, tname) or any(o.op == "tier_lost" for o in ops)):
                    continue
                for root in remote_by_spec.get(key, []):
                    if root not in own:
                        bad.append(f"T4 the remote catalog has {root[:16]} for a put through tier {tname}, which "
                                   f"never published that root: {put.brief()}")
            bad += _check_kept(store, t, tname, ops, lcat, evicted, damaged)  # T11
            for part, rec in sorted(t.reftable.tier_rows.intents().items()):  # T9
                def told(o: Op) -> str | None:  # what this tier's rank was told (None: killed first)
                    ranks = o.out.get("ranks") or []
                    k = list(o.args["rank_tiers"]).index(tname)
                    return None if o.end is None else ranks[k] if k < len(ranks) else o.result
                heard = [o for o in ops if o.op == "put" and tname in o.args.get("rank_tiers", ())[1:]
                         and (o.args.get("ref"), o.args.get("step")) == (rec.get("ref"), rec.get("step"))
                         and told(o) in ("ok", "SnapshotAborted") and "mismatch" not in o.out]
                if heard:
                    bad.append(f"T9 tier {tname} keeps the intent to upload part {part.hex()[:16]} of a collective "
                               f"put whose outcome its rank heard: {heard[0].brief()}")
            for name in sorted(refs):  # T8
                seen: set[str] = set()
                for e in rt.reflog(name):
                    new = e.new.hex()
                    if e.op == "move" and new in lcat and new in seen and e.message != RECOVERED \
                            and not (e.message.startswith(rollback.ROLL_MESSAGE) and any(
                                rollback.moved_back(r) and (r.args["ref"], r.args["root"]) == (name, new)
                                for r in ops)):  # (a rollback's move back, journaled)
                        bad.append(f"T8 remote ref {name} moved back to {new[:16]} (tier {tname}'s), a snapshot it "
                                   f"had left: reflog entry at {e.time:.3f} '{e.message}'")
                    seen.add(new)
            for name, root in refs.items():
                if root in lcat and lcat[root].get("ref") != name:
                    bad.append(f"T4 remote ref {name} names {root[:16]}, tier {tname}'s snapshot of ref "
                               f"{lcat[root].get('ref')}")
    return bad, stats


def _check_kept(store, t, tname: str, ops: list[Op], lcat: dict, evicted: set, damaged) -> list[str]:
    """T11 for tier `tname` (opened as `t`): its catalog writers' jobs keep nothing that
    neither tier holds."""
    bad: list[str] = []
    cache: dict = {}
    barriers = [o.start for o in ops if o.op == "delete_refs" or (o.op == "tier_lost" and o.args.get("tier") == tname)]
    want: dict[str, str] = {}  # root -> why it must be held
    jobs = sorted(_tier_jobs(ops, tname))
    if jobs:  # (a tier may hold other jobs' snapshots, of writers without a job of their own)
        remote_lost = any(o.op == "delete_refs" for o in ops)  # (its pins went with it: see T12)
        want.update({r.hex(): f"{why} in the tier" for r, why in _tier_holds(t).items()
                     if (lcat.get(r.hex()) or {}).get("job") in jobs and not (remote_lost and why == "pinned")})
    for job in jobs:
        for root in kept_over_tiers(t, store, job):
            want.setdefault(root, f"job {job}'s rules keep it")
    for o in ops:
        if o.result != "ok" or o.args.get("tier") != tname or not o.out.get("root"):
            continue
        if o.op == "tag" and not any(u.op == "untag" and u.args.get("name") == o.args["name"] and _may_follow(u, o.start)
                                     for u in ops):
            want.setdefault(o.out["root"], f"tag {o.args['name']}")
        if o.op == "pin" and not any(b > o.start for b in barriers) and not any(
                u.op == "unpin" and _may_follow(u, o.start)
                and (u.out.get("root") or u.args.get("target")) in (o.out["root"], o.args["target"]) for u in ops):
            want.setdefault(o.out["root"], "pinned")
    for root, why in sorted(want.items()):
        lost = _held_somewhere(t, store, lcat, evicted, root, cache)
        if lost is not None and not damaged(tname, lost):
            bad.append(f"T11 tier {tname}: snapshot {root[:16]} ({why}) is held in neither tier: {lost}")
    return bad
