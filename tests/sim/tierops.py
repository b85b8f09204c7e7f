"""Two tier protocols in the harness: removals and answers through a local tier, and
outages of the remote that come and go while the writer keeps putting. The worker's
side (the calls, journaled) and their checks (T20-T22; I7 judges the remote table).

Removals through a tier (worker op delete_ref, forget, untag, undelete, answer; journal
index TIER_I + i, drawn before op i of a tier writer from a stream of its own, so the
worker's other draws stay as they were): each call goes through the tiered store, which
acts in both tables (its own and the remote's) or refuses with nothing changed; the
worker journals what each table held of the name before and after the call. An answer
resolves, checks out, resolves again and shows a ref through the tier, and journals the
roots each named, the one whose content checkout returned, and the reflog entries both
tables gained meanwhile (the roots the ref may have held during the call).

  T20 a removal through a tier that returned ok is in effect in the tier's table (a
      deleted ref is absent unless a put through that tier or an undelete may have come
      since; a forgotten snapshot has no row unless a pin or tag of it may have; an
      untagged tag is gone), as I7 judges the remote table; an undelete that returned ok
      left the ref in both tables unless a removal of it may have come since; a refused
      delete_ref, untag or undelete changed neither table (what each held of the name,
      before and after the call, unless another call on that name overlapped it).
  T21 every call that names a snapshot through a tier answers as checkout does: resolve
      and show of a ref name the root whose content checkout of that ref returned, or,
      where the ref moved during the calls (entries its reflogs gained), one of the
      roots it held; none says "no ref" where checkout restores one.

Outages (cfg["outage"], a tier writer drawn by the driver from a stream of its own; op
"outage", journal index OUT_I): before op `at`, the remote storage refuses every request
(faults.py `down`), with the uploader's pause shortened (RETRY_PAUSE), for at least
PAST_ATTEMPTS failed upload attempts (more than any fixed count of tries allowed), or
until the uploader stops, or OUTAGE_CAP seconds; then it comes back, while the writer
keeps putting. After its operations the writer waits for its uploads (op "durable",
OUT_I + 1, with a deadline) and, with a budget, puts once more (OUT_I + 2).

  T22 after an outage that outlasted PAST_ATTEMPTS attempts, the writer's
      wait_durable(deadline) said True with each of its refs' tier tips marked durable
      (and, for a ref only its job writes, the remote ref on the tier's tip): the
      uploads resumed; the writer was told while it lasted (a SnapshotWarning "durability
      lags" or store.durability_lag() lagging); no put through the tier failed with a
      StorageError during it; and the put after it was not refused with TierFull.
"""

from __future__ import annotations

import os
import random
import threading
import time
import warnings

import tensorstore_ck as tsck

from . import content

TIER_I = 6_000_000  # journal index of a removal or answer through a tier drawn before op i
OUT_I = 7_000_000   # an outage (OUT_I), the wait after it (OUT_I + 1), the put after it (OUT_I + 2)
PAST_ATTEMPTS = 12  # failed upload attempts an outage lasts for at least
OUTAGE_CAP = 40.0   # seconds an outage lasts at most, whatever the uploader does
RESUME_WAIT = 30.0  # wait_durable's deadline once the remote is back
PAUSES = [(0.05, 0.1), (0.05, 0.2), (0.1, 0.2)]  # the uploader's (first, longest) pause in an outage
# The removals' and answers' mix.
TIER_OP_WEIGHTS = {"delete_ref": 2.0, "forget": 2.0, "untag": 1.0, "undelete": 1.5, "answer": 2.5}


def _err(e: BaseException) -> dict:
    from .worker import _err as err  # (worker.py imports this module)
    return err(e)


def _tier_name(w) -> str:
    return os.path.basename(w.cfg["tier"])


# -- removals and answers through a tier ------------------------------------------------
def maybe_tier_op(w, s, i: int) -> None:
    """Before op i of tier writer `w`, with probability cfg["tier_remove_p"]: a removal, an
    undelete or an answer through its tiered store (above)."""
    cfg = w.cfg
    if not cfg.get("tier_remove_p") or not cfg.get("tier"):
        return
    rng = random.Random(f"{cfg['seed']}-{w.wid}-{i}-tierop")
    if rng.random() >= cfg["tier_remove_p"]:
        return
    op = rng.choices(sorted(TIER_OP_WEIGHTS), [TIER_OP_WEIGHTS[k] for k in sorted(TIER_OP_WEIGHTS)])[0]
    try:
        args, call = globals()[f"_{op}"](w, s, rng)
    except tsck.TsckError:  # choosing the arguments read a table that is away now
        return
    args.update(tier=_tier_name(w), through=True)
    if cfg.get("rot"):
        args["rot"] = True  # (a checkout may fall back past a block damaged on the tier's disk)
    w._journaled(TIER_I + i, op, args, call)


def _has(table, kind: str, name) -> bool | None:
    try:
        if kind == "ref":
            return table.get_or_none(name) is not None
        if kind == "tag":
            return table.tag_get(name) is not None
        return table.catalog_get(bytes.fromhex(name)) is not None
    except (tsck.TsckError, OSError):  # (a remote table behind the network faults)
        return None


def _held(s, kind: str, name) -> dict:
    """What each table holds of `name` now: {"tier": bool, "remote": bool} (None: unknown)."""
    return {"tier": _has(s.reftable, kind, name), "remote": _has(s.remote_core.refs, kind, name)}


def _around(s, kind: str, name, fn) -> dict:
    """fn() -> its journal fields, with what both tables held of `name` before and after."""
    before = _held(s, kind, name)
    try:
        out = fn() or {}
    except Exception as e:  # noqa: BLE001 - journaled and judged (T20, I4)
        out = _err(e)
    return dict(out, before=before, after=_held(s, kind, name))


def _delete_ref(w, s, rng):
    ref = rng.choice(w.cfg["refs"])
    args = {"ref": ref}
    if rng.random() < 0.3:  # conditional on what the one resolution names now
        try:
            args["expected"] = s.resolve(ref)[:rng.choice([8, 16, 64])]
        except tsck.RefNotFound:
            args["expected"] = None

    def call():
        d = s.delete_ref(ref, expected=args.get("expected"))
        return {"root": d["root"], "dropped": d["snapshots_dropped"]}
    return args, lambda: _around(s, "ref", ref, call)


def _forget(w, s, rng):
    """An older snapshot of one of the writer's refs, by its full root or REF@STEP (the tip
    too at times: refused)."""
    ref = rng.choice(w.cfg["refs"])
    try:
        hist = s.log(ref)
    except tsck.RefNotFound:
        hist = []
    if not hist:
        target = ref
        root = None
    else:
        h = hist[0] if len(hist) == 1 or rng.random() < 0.15 else rng.choice(hist[1:])
        target, root = (h.root if rng.random() < 0.5 or h.step is None else f"{ref}@{h.step}"), h.root

    def call():
        return {"root": s.forget(target).root}
    if root is None:
        return {"target": target}, call
    return {"target": target, "named": root}, lambda: _around(s, "row", root, call)


def _untag(w, s, rng):
    tags = sorted(n for n, _ in s.reftable.tags())
    name = rng.choice(tags) if tags and rng.random() < 0.85 else f"t-{w.wid}-none"
    return {"name": name}, lambda: _around(s, "tag", name, lambda: {"root": s.untag(name)})


def _undelete(w, s, rng):
    """A ref of the writer's that a delete removed (in either table), else any of its refs."""
    refs = w.cfg["refs"]
    gone = []
    for ref in refs:
        for table in (s.reftable, s.remote_core.refs):
            try:
                if table.deleted_ref_root(ref) is not None and table.get_or_none(ref) is None:
                    gone.append(ref)
                    break
            except (tsck.TsckError, OSError):
                pass
    ref = rng.choice(gone) if gone and rng.random() < 0.9 else rng.choice(refs)
    return {"ref": ref}, lambda: _around(s, "ref", ref, lambda: {"root": s.undelete(ref).root})


def _reflogs(s, ref: str) -> set:
    out = set()
    for k, table in (("tier", s.reftable), ("remote", s.remote_core.refs)):
        try:
            out |= {(k, e.time, e.op, e.new.hex()) for e in table.reflog(ref)}
        except (tsck.TsckError, OSError):
            pass
    return out


def _answer(w, s, rng):
    """resolve, checkout, resolve, show of one ref through the tier: which root's content
    checkout returned, and what each call named."""
    ref = rng.choice(w.cfg["refs"])

    def named(fn):
        try:
            return fn()
        except tsck.RefNotFound:
            return "none"

    def call():
        from .check import ranks_union
        logs = _reflogs(s, ref)
        first = named(lambda: s.resolve(ref))
        got = named(lambda: s.checkout(ref))
        second = named(lambda: s.resolve(ref))
        shown = named(lambda: s.show(ref).root)
        moved = sorted(e[3] for e in _reflogs(s, ref) - logs)  # roots the ref took meanwhile, in either table
        out = {"roots": [first, second, shown], "moved": moved}
        if isinstance(got, str):
            out["read"] = "none"
            return out
        read = None
        for root in dict.fromkeys([first, second, shown, *moved]):
            if root == "none":
                continue
            spec = (s.show(root).meta or {}).get("sim")
            if spec and not content.differences(got, ranks_union(spec) if "c" in spec else content.state(spec)):
                read = root
                break
        out["read"] = read or "other"
        return out
    return {"ref": ref}, call


# -- outages that come and go -------------------------------------------------------------
class Outage:
    """cfg["outage"] {"at", "pause"}: the remote away for a stretch while the writer puts."""

    def __init__(self, w, s):
        self.w, self.s, self.cfg = w, s, w.cfg["outage"]
        self.thread: threading.Thread | None = None
        self.ending = threading.Event()  # the writer's operations are over
        self.told: list[str] = []
        self.failed = 0

    def maybe_start(self, i: int) -> None:
        if self.thread is None and i >= self.cfg["at"]:
            self.start()

    def start(self) -> None:
        from tensorstore_ck.tier import uploader as up_mod
        pause = tuple(self.cfg["pause"])
        up_mod.RETRY_PAUSE = pause
        if hasattr(up_mod, "_BACKOFF"):  # an uploader that names its pauses so: the same short ones
            up_mod._BACKOFF = pause
        warnings.simplefilter("always", tsck.SnapshotWarning)  # each outage's word, not the first only
        shown = warnings.showwarning

        def tap(message, category, *a, **k):
            if issubclass(category, tsck.SnapshotWarning) and "durability lags" in str(message):
                self.told.append(str(message)[:300])
            return shown(message, category, *a, **k)
        warnings.showwarning = tap
        up = self.s._tier.uploader
        base = up._failures
        self.w.j.write(i=OUT_I, op="outage", args={"tier": _tier_name(self.w), "pause": list(pause)},
                       start=time.time())
        self.w.faults.down = True
        self.thread = threading.Thread(target=self._watch, args=(up, base), daemon=True, name="sim-outage")
        self.thread.start()

    def _watch(self, up, base: int) -> None:
        """Ends the outage at an event of the uploader's: PAST_ATTEMPTS failures, or its stop."""
        cap = time.monotonic() + OUTAGE_CAP
        while up._failures - base < PAST_ATTEMPTS and up.error is None and time.monotonic() < cap:
            if self.ending.is_set() and not up.queued():  # nothing left to fail: no outage to wait out
                break
            time.sleep(0.02)
        self.failed = up._failures - base
        try:
            lag = self.s.durability_lag()
            lagging, said = bool(lag.lagging), str(lag)[:300]
        except Exception as e:  # noqa: BLE001 - a store that cannot say how far the remote lags
            lagging, said = False, f"{type(e).__name__}: {e}"[:300]
        stopped = up.error
        self.w.faults.down = False
        self.w.j.write(i=OUT_I, end=time.time(), result="ok", attempts=self.failed, lagging=lagging, lag=said,
                       told=list(self.told[:2]), stopped=None if stopped is None else type(stopped).__name__)

    def finish(self, s) -> None:
        """After the writer's operations: the outage over (waited for), its uploads waited
        for with a deadline (op durable), then one more put where the tier has a budget."""
        if self.thread is None:
            return  # (the writer's time ran out before it began)
        self.ending.set()
        self.thread.join(OUTAGE_CAP + 5)
        if self.thread.is_alive():
            return  # (the watch is stuck: the writer is killed as stuck, the outage unjudged)
        tier = _tier_name(self.w)

        def wait():
            done = s.wait_durable(timeout=RESUME_WAIT)
            out = {"durable": done, "roots": []}
            if done:
                tips = {}
                for ref in self.w.cfg["refs"]:
                    tip = s.reftable.get_or_none(ref)
                    if tip is not None:
                        remote = s.remote_core.refs.get_or_none(ref)
                        tips[ref] = [tip.hex(), None if remote is None else remote.hex()]
                marked = s.reftable.tier_rows.durable(bytes.fromhex(t) for t, _ in tips.values())
                out.update(tips=tips, unmarked=[t for t, _ in tips.values() if bytes.fromhex(t) not in marked])
            return out
        out = self.w._journaled(OUT_I + 1, "durable", {"tier": tier, "timeout": RESUME_WAIT, "after_outage": True},
                                wait)
        self.w._upload_stopped |= out["result"] != "ok"
        if self.w.cfg.get("budget") and out["result"] == "ok":
            args, call = self.w.op_put(s, OUT_I + 2)  # (its spec's op number: no other put's)
            args["after_outage"] = True
            self.w._journaled(OUT_I + 2, "put", args, call)


# -- the checks -------------------------------------------------------------------------
REMOVALS = ("delete_ref", "forget", "untag", "undelete")


def _overlaps(o, other) -> bool:
    return other.start < (o.end if o.end is not None else float("inf")) and (other.end is None
                                                                           or other.end > o.start)


def _name_of(o) -> tuple[str, str]:
    return ("tag", o.args["name"]) if o.op == "untag" else ("ref", o.args.get("ref"))


def _refusal_explained(ops: list, o, kind: str, name: str, side: str, appeared: bool) -> bool:
    """Whether another call explains a change of `name` in table `side` during the refused
    call `o`: a removal of it overlapping `o` (it went; or, for a delete_ref through a tier,
    a call that moved the remote's ref meanwhile, which refused it after the tier's went),
    or a call that makes it that may have taken effect after `o` began (it came: a put's
    upload lands when it lands)."""
    from .check import _may_follow
    for p in ops:
        if p is o:
            continue
        if kind == "ref" and p.args.get("ref") == name:
            if not appeared and p.op == "delete_ref" and _overlaps(o, p):
                return True
            # A delete_ref through a tier removes the tier's ref first; when another call
            # moved the remote's meanwhile it refuses (RefConflict: "the local tier's ref
            # was deleted, the remote's is left", tier/holds.py delete_ref_both).
            if (not appeared and o.op == "delete_ref" and side == "tier"
                    and p.op in ("put", "rollback", "undelete") and _overlaps(o, p)):
                return True
            if appeared and p.op in ("put", "undelete", "rollback") and _may_follow(p, o.start):
                return True
        if kind == "tag" and p.args.get("name") == name:
            if not appeared and p.op == "untag" and _overlaps(o, p):
                return True
            if appeared and p.op == "tag" and _may_follow(p, o.start):
                return True
    return False


def check_tier_ops(tiers: dict[str, str], ops: list, barriers: list[float]) -> list[str]:
    """T20 (the tiers' tables; I7 judges the remote's), T21 and T22, against the journals
    and the tiers (`tiers`: name -> path, no process open on them)."""
    from .check import _may_follow
    bad: list[str] = []
    lost = {}  # tier -> when it lost its table (tsck recover rebuilt its refs from commits since)
    for o in ops:
        if o.op == "tier_lost":
            lost.setdefault(o.args["tier"], []).append(o.start)
    tables: dict[str, dict] = {}
    for tname, path in sorted(tiers.items()):
        if not any(o.args.get("tier") == tname and o.op in REMOVALS for o in ops):
            continue
        try:
            with tsck.open_store(path, create=False) as t:
                rt = t.reftable
                tables[tname] = {"refs": {n for n, _ in rt.list()}, "tags": {n for n, _ in rt.tags()},
                                 "rows": {r.hex() for r, _ in rt.catalog_iter()}}
        except tsck.TsckError:  # (T3 names a tier that does not open)
            continue
    for o in ops:
        tname = o.args.get("tier")
        if o.op not in REMOVALS or not tname or o.end is None:
            continue
        # A refusal changed neither table (T20): what each held of the name, before and after.
        if o.result not in ("ok", "OutcomeUnknown") and "before" in o.out and o.op != "forget":
            kind, name = _name_of(o)
            for side in ("tier", "remote"):
                b, a = o.out["before"].get(side), o.out["after"].get(side)
                if b is not None and a is not None and b != a \
                        and not _refusal_explained(ops, o, kind, name, side, appeared=a):
                    bad.append(f"T20 {o.op} through tier {tname} was refused ({o.result}) but the "
                               f"{'local tier' if side == 'tier' else 'remote'} table "
                               f"{'gained' if a else 'lost'} {kind} {name}: {o.brief()}")
        if o.result != "ok" or tname not in tables or any(t > o.start for t in lost.get(tname, ())):
            continue
        now = tables[tname]
        if o.op == "delete_ref" and o.args["ref"] in now["refs"]:
            ref = o.args["ref"]
            again = [p for p in ops if p.args.get("ref") == ref and p is not o and (
                (p.op == "put" and p.args.get("tier") == tname and not p.failed
                 and (p.end is None or p.end > o.start))
                or (p.op == "undelete" and p.args.get("tier") == tname and _may_follow(p, o.start)))]
            if not again:
                bad.append(f"T20 ref {ref} was deleted through tier {tname} and no put or undelete through it ran "
                           f"since, but the tier's table has it: {o.brief()}")
        if o.op == "forget" and o.out.get("root") in now["rows"]:
            root = o.out["root"]
            if not any(p.op in ("pin", "tag") and p.args.get("tier") == tname and not p.failed
                       and str(p.out.get("root") or p.args.get("target", "")).startswith(root[:16])
                       and _may_follow(p, o.start) for p in ops):
                bad.append(f"T20 snapshot {root[:16]} was forgotten through tier {tname} but the tier's catalog "
                           f"has its row: {o.brief()}")
        if o.op == "untag" and o.args["name"] in now["tags"]:
            bad.append(f"T20 tag {o.args['name']} was removed through tier {tname} but the tier's table has it: "
                       f"{o.brief()}")
        if o.op == "undelete" and (o.out.get("after") or {}).get("tier") and o.args["ref"] not in now["refs"] \
                and not any(p.op == "delete_ref" and p.args.get("ref") == o.args["ref"] and p.args.get("tier") == tname
                            and _may_follow(p, o.start) for p in ops):
            bad.append(f"T20 ref {o.args['ref']}, brought back through tier {tname}, is gone from its table and no "
                       f"delete_ref through it ran since: {o.brief()}")
    bad += _check_answers(ops)
    bad += _check_outages(ops)
    return bad


def check_undeleted(store, ops: list, barriers: list[float]) -> list[str]:
    """T20's remote half of an undelete: a ref brought back through a tier (ok) is in the
    remote table unless a removal of it may have come since, or the table was lost."""
    from .check import _may_follow
    refs = {n for n, _ in store.reftable.list()}
    bad = []
    for o in ops:
        if o.op != "undelete" or o.result != "ok" or not o.args.get("tier") or o.args["ref"] in refs \
                or any(b > o.start for b in barriers):
            continue
        if not any(p.op == "delete_ref" and p.args.get("ref") == o.args["ref"] and _may_follow(p, o.start)
                   for p in ops):
            bad.append(f"T20 ref {o.args['ref']} was brought back through tier {o.args['tier']} and no delete_ref "
                       f"ran since, but the remote table lacks it: {o.brief()}")
    return bad


def _check_answers(ops: list) -> list[str]:
    """T21: resolve, show and checkout of a ref through a tier name one snapshot."""
    bad = []
    for o in ops:
        if o.op != "answer" or o.result != "ok" or o.args.get("rot"):
            continue
        roots, read, moved = o.out.get("roots") or [], o.out.get("read"), o.out.get("moved") or []
        if moved:  # the ref moved meanwhile: checkout read one of the roots it held (_answer matched it)
            if read == "other":
                bad.append(f"T21 checkout of {o.args['ref']} through tier {o.args['tier']} read none of the roots "
                           f"the ref held during the calls ({roots}, moved to {moved}): {o.brief()}")
            continue
        if any(r != read for r in roots):
            said = ", ".join(f"{c} {r if r == 'none' else r[:16]}" for c, r in zip(("resolve", "resolve again",
                                                                                    "show"), roots))
            bad.append(f"T21 through tier {o.args['tier']}, checkout of {o.args['ref']} read "
                       f"{read if read in ('none', 'other') else read[:16]} while {said} (the ref did not move "
                       f"meanwhile): {o.brief()}")
    return bad


def _check_outages(ops: list) -> list[str]:
    """T22: an outage that came and went is waited out, and the writer told."""
    bad = []
    for o in ops:
        if o.op != "outage" or o.end is None:
            continue
        mine = [p for p in ops if p.w == o.w]
        long = (o.out.get("attempts") or 0) >= PAST_ATTEMPTS or o.out.get("stopped")
        if long and not (o.out.get("told") or o.out.get("lagging")):
            bad.append(f"T22 an outage of tier {o.args['tier']}'s remote lasted {o.out.get('attempts')} failed upload "
                       f"attempt(s) and the writer was not told (no SnapshotWarning 'durability lags', "
                       f"durability_lag(): {o.out.get('lag')}): {o.brief()}")
        for p in mine:
            if p.op == "put" and p.args.get("tier") and p.start >= o.start and p.start < o.end \
                    and p.result in ("StorageError", "OutcomeUnknown"):
                bad.append(f"T22 a put through tier {p.args['tier']} during an outage of its remote failed with "
                           f"{p.result}: {p.brief()}")
            if p.op == "put" and p.args.get("after_outage") and p.result == "TierFull":
                bad.append(f"T22 a put through tier {p.args['tier']} after the outage ended and the uploads were "
                           f"waited for was refused with TierFull: {p.brief()}")
            if p.op == "durable" and p.args.get("after_outage") and p.end is not None:
                if p.result != "ok" or not p.out.get("durable"):
                    bad.append(f"T22 after an outage of {o.out.get('attempts')} failed upload attempt(s) ended, "
                               f"wait_durable({p.args['timeout']}) of tier {p.args['tier']}'s writer gave "
                               f"{p.out.get('durable') if p.result == 'ok' else p.result}: the uploads did not "
                               f"resume: {p.brief()} {p.out.get('error', '')[:300]}")
                    continue
                jobs = {q.args["job"] for q in ops if q.op == "retention" and q.args.get("tier") == p.args["tier"]}
                for ref, (tip, remote) in sorted((p.out.get("tips") or {}).items()):
                    if ref.split("/", 1)[0] in jobs and remote != tip:
                        bad.append(f"T22 after an outage and a wait_durable that said True, the remote ref {ref} is "
                                   f"on {str(remote)[:16]}, not on tier {p.args['tier']}'s tip {tip[:16]}: "
                                   f"{p.brief()}")
    return bad


def brief(ops: list, ids: set) -> str:
    """The round line's part: the calls through the tiers by outcome, and each outage as
    ATTEMPTS/told|silent/resumed|not (the failed upload attempts it lasted)."""
    calls: dict = {}
    outs = []
    for o in ops:
        if o.w not in ids:
            continue
        if o.args.get("through"):
            k = f"{o.op}:{'killed' if o.end is None else o.result}"
            calls[k] = calls.get(k, 0) + 1
        if o.op == "outage":
            after = [p for p in ops if p.w == o.w and p.op == "durable" and p.args.get("after_outage")]
            told = "told" if o.out.get("told") or o.out.get("lagging") else "silent"
            resumed = "?" if not after or after[0].end is None else \
                "resumed" if after[0].result == "ok" and after[0].out.get("durable") else "not"
            outs.append("killed" if o.end is None else f"{o.out.get('attempts')}/{told}/{resumed}")
    return f"tier_calls={','.join(f'{k}x{v}' for k, v in sorted(calls.items())) or 0} " \
           f"outages={','.join(outs) or 0}"
