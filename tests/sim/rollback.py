"""Rollbacks and collective restores in the harness: the worker's side (the calls, the
damage planted for a collective restore and its repair) and their checks (R1, R2).

A rollback (worker op "rollback", journal index ROLL_I + i, drawn before op i from a
stream of its own, so the worker's other draws stay as they were): a real
CheckpointManager's restore(step) of an older kept snapshot of a ref (its log, newest
first), which reads it back (compared bit for bit with its spec) and moves the ref back
to it (restoring.py: a fenced compare-and-swap, in the reflog). The worker's next put
goes on that ref (the new branch); in some of them (rollback_kill) the worker SIGKILLs
itself as the rollback returns, before the branch's first snapshot, and the fault
profile's kill points (ref-table writes) land inside the move too.

A collective restore (worker op "crestore", index CREST_I + i, after collective put i
returned a root; a stream of its own): in most of them one block of one rank's own rows
of that snapshot is bit-flipped in the store first (the original kept in
journal/damage-*.json); both ranks then run restore_latest() of a real
CheckpointManager on the ref (together.py); then the block is put back. A worker killed
meanwhile leaves the damage to the driver (left_damage), before any check. Concurrent
fscks that name the block in that window are not damage (planted_windows).

  R1  a rollback that returned leaves its ref on the restored snapshot, or on what may
      have moved it since (a put of the ref, another rollback, whose outcome may come
      after the rollback began; a delete_ref), never back on a snapshot nothing since
      explains (the abandoned run's tip); not judged across a lost ref table (recover
      rebuilds refs from storage, where a rollback leaves no commit).
  R2  every rank of a collective restore gets the same outcome: the same snapshot read
      (step and content), each rank's rows bit-exact against its spec, or the same error
      type on every rank.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import signal
import warnings

import torch

import tensorstore_ck as tsck

from . import content

ROLL_I = 4_000_000   # journal index of a rollback drawn before op i
CREST_I = 5_000_000  # journal index of a collective restore after collective put i
ROLL_MESSAGE = "rolled back to step"  # the start of restoring.py's reflog message


def job_of(ref: str) -> str:
    return ref.split("/", 1)[0]


class SimState:
    """TrainState's protocol (state_dict(), step, checkout_targets(), load_checked_out())
    over a harness state: what a CheckpointManager restores into. into: the tree a
    checkout fills (None: the whole snapshot, as stored)."""

    def __init__(self, into: dict | None = None):
        self.step = None
        self.sd = None
        self._into = into

    def state_dict(self):
        raise tsck.errors.InvalidArgument("the harness's managers only restore")

    def checkout_targets(self):
        return self._into

    def load_checked_out(self, sd) -> None:
        self.sd = sd
        self.step = sd["step"]


def _manager(s, ref: str, state: SimState, group=None):
    kw = {} if group is None else {"group": group}
    return tsck.CheckpointManager(s, job=job_of(ref), ref=ref, state=state, async_=False, prune=False,
                                  store_size_every=None, **kw)


# -- the worker's side ---------------------------------------------------------------------
def maybe_rollback(w, s, i: int) -> None:
    """Before op i of worker `w`, with probability cfg["rollback_p"]: a rollback (above)."""
    cfg = w.cfg
    if not cfg.get("rollback_p"):
        return
    rng = random.Random(f"{cfg['seed']}-{w.wid}-{i}-roll")
    if rng.random() >= cfg["rollback_p"]:
        return
    ref = rng.choice(cfg["refs"])
    try:
        hist = s.log(ref)
    except tsck.TsckError:
        return
    # restore(step) takes the newest snapshot at a step: one step, one candidate
    steps = [h.step for h in hist if isinstance(h.step, int)]
    older = [h for h in hist[1:] if isinstance(h.step, int) and steps.count(h.step) == 1
             and (h.meta or {}).get("sim")]
    if not older:
        return
    h = older[int(len(older) * rng.random() ** 2)]  # the recent ones more often
    args = {"ref": ref, "step": h.step, "root": h.root, "from": hist[0].root}

    def call():
        st = SimState()
        got = _manager(s, ref, st, group=False).restore(h.step)
        spec = h.meta["sim"]
        from .check import ranks_union
        diff = content.differences(st.sd, ranks_union(spec) if "c" in spec else content.state(spec))
        out = {"root": h.root, "restored": got}
        if diff:
            out.update(result="mismatch", diff=diff[:5])
        return out
    out = w._journaled(ROLL_I + i, "rollback", args, call)
    if out["result"] not in ("ok", "mismatch"):
        return
    if rng.random() < cfg.get("rollback_kill", 0.0):  # before the new branch's first snapshot
        w.j.write(kill="after-rollback", op="rollback", key=f"{ref} back on step {h.step}, no snapshot since")
        os.kill(os.getpid(), signal.SIGKILL)
    w.branch = ref  # the worker's next put goes on (Worker.op_put)


def _own_block(spec: dict, rank: int, world: int) -> bytes:
    """The address of rank `rank`'s rows of "own" in a collective put of `spec`: one block
    (its bytes are below the block size), written and read by that rank alone."""
    import blake3
    piece, _a = content.own_piece(spec, rank, world)
    return blake3.blake3(piece.contiguous().view(torch.uint8).numpy().tobytes()).digest()


def _damage_path(w, i: int) -> str:
    return os.path.join(os.path.dirname(w.cfg["journal"]), f"damage-{w.wid}-{i}.json")


def _flip(storage, rec: dict) -> bool:
    """Flip one byte in the middle of the stored block rec["key"] (its original bytes go
    into rec first, written to rec["path"] before the flip, so a kill leaves the repair to
    the driver). False when the block is not stored (a gc took the snapshot)."""
    try:
        data = storage.get(rec["key"])
    except (tsck.TsckError, OSError):
        return False
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0x10
    rec.update(orig=data.hex(), bad=hashlib.blake2b(bytes(bad)).hexdigest())
    with open(rec["path"], "w") as f:
        json.dump(rec, f)
        f.flush()
        os.fsync(f.fileno())
    storage.delete(rec["key"])
    storage.put_if_absent(rec["key"], [bytes(bad)])
    return True


def repair(storage, rec: dict) -> str:
    """Put the original bytes back where the flipped ones still are -> what was done."""
    try:
        now = storage.get(rec["key"])
    except (tsck.TsckError, OSError, FileNotFoundError):
        now = None
    if now is not None and hashlib.blake2b(now).hexdigest() != rec["bad"]:
        how = "whole"  # (never flipped: killed before; or a writer stored it again)
    else:
        # Missing: killed between the flip's delete and put, or a gc took it (an orphan
        # put back is gc's to remove, never damage).
        if now is not None:
            storage.delete(rec["key"])
        storage.put_if_absent(rec["key"], [bytes.fromhex(rec["orig"])])
        how = "repaired" if now is not None else "put back"
    os.replace(rec["path"], rec["path"] + ".done")
    return how


def _record(path: str) -> dict:
    with open(path) as f:
        return dict(json.load(f), path=path)


def left_damage(run_dir: str) -> list[dict]:
    """The damage a killed worker left in place (each record with its "path")."""
    return [_record(p) for p in sorted(glob.glob(os.path.join(run_dir, "journal", "damage-*.json")))]


def maybe_crestore(w, s, i: int, args: dict, out: dict) -> None:
    """After collective put i returned a root, with probability cfg["crestore_p"]: a
    collective restore (above), the put's snapshot damaged first in most of them."""
    cfg = w.cfg
    if not cfg.get("crestore_p") or not out.get("root") or args.get("skipped_by") or cfg.get("rank_tiers"):
        return
    rng = random.Random(f"{cfg['seed']}-{w.wid}-{i}-crestore")
    if rng.random() >= cfg["crestore_p"]:
        return
    world = len(w.ranks)
    rank = rng.randrange(world) if rng.random() < 0.75 else None
    # The snapshot damaged: the ref's head, what restore_latest() reads first, where it is
    # a collective one (another worker may have moved the ref since); else this put's.
    spec, root = args["spec"], out["root"]
    try:
        from .check import _spec_of
        head = s.reftable.get_or_none(args["ref"])
        sp = _spec_of(s, head) if head is not None else None
        if sp and sp.get("c") == world:
            spec, root = sp, head.hex()
    except tsck.TsckError:
        pass
    a = {"ref": args["ref"], "root": root, "damaged_rank": rank}
    if rank is not None:
        d = _own_block(spec, rank, world)
        a.update(digest=d.hex(), key=s.assets.object_key("blocks", d), note=f"{spec['w']}:{spec['o']}")
    storage = getattr(s.storage, "inner", s.storage)  # (not the fault injector: the damage is planted)

    def call():
        rec = None if rank is None else {"key": a["key"], "path": _damage_path(w, i)}
        res = {"planted": False}
        try:
            res["planted"] = rec is not None and _flip(storage, rec)
            line = json.dumps({"restore": True, "ref": args["ref"]}) + "\n"
            for p in w.ranks:
                p.stdin.write(line)
                p.stdin.flush()
            res["ranks"] = ranks = [w._rank_line(p, 150.0) for p in w.ranks]
        finally:  # (the damage never outlives the call: a flip cut short is put back too)
            if rec is not None and os.path.exists(rec["path"]):
                res["repair"] = repair(storage, _record(rec["path"]))
        if any(r.get("raw") for r in ranks):
            res.update(raw=True, trace="; ".join(f"rank {k}: {r.get('trace', '')}" for k, r in enumerate(ranks)))
        return res
    w._journaled(CREST_I + i, "crestore", a, call)


def rank_restore(s, cmd: dict, rank: int, world: int) -> dict:
    """In a rank (ranks.py): restore_latest() of a CheckpointManager on cmd["ref"], into
    this rank's rows of "own" (its step and note as stored) -> what it got: the step, the
    note of the snapshot read, whether its rows are its spec's; or the error."""
    from .worker import _err
    piece, a = content.own_piece(content.make_spec("x", 0, 0, 0), rank, world)
    st = SimState({"own": tsck.Sharded(torch.zeros_like(piece), (content.OWN_LEN,), (a,)), "step": None,
                   "note": None})
    mgr = _manager(s, cmd["ref"], st)
    try:
        with warnings.catch_warnings(record=True) as ws:
            warnings.simplefilter("always")
            step = mgr.restore_latest()
    except Exception as e:  # noqa: BLE001 - every rank's outcome is journaled and judged (R2)
        return _err(e)
    out = {"restored": step, "fell_back": sum(1 for x in ws if "falls back" in str(x.message))}
    if st.sd is None:
        return out
    out["note"] = st.sd["note"]
    spec = next((sp for _r, row in s.reftable.catalog_iter()
                 if (sp := (row.get("meta") or {}).get("sim")) and f"{sp['w']}:{sp['o']}" == st.sd["note"]), None)
    if spec is not None and "c" in spec:
        want, _ = content.own_piece(spec, rank, world)
        out["rows_ok"] = bool(torch.equal(st.sd["own"].local.view(torch.int32), want.view(torch.int32)))
    return out


def brief_restore(o) -> str:
    """What a collective restore came to, for the round line: planted (one rank's part
    damaged) or not; each rank's step (fell back: an older one) or error; killed."""
    if o.end is None:
        return "killed"
    ranks = o.out.get("ranks") or []
    got = "/".join(r.get("result") or ("fellback" if r.get("fell_back") else "newest") for r in ranks) or o.result
    return f"{'planted' if o.out.get('planted') else 'whole'}:{got}"


def brief_rollbacks(ops: list, ids) -> str:
    """Rollbacks by outcome, then collective restores (brief_restore) by what they came to."""
    rolls: dict = {}
    crest: dict = {}
    for o in ops:
        if o.w in ids and o.op == "rollback":
            k = "killed" if o.end is None else str(o.result)
            rolls[k] = rolls.get(k, 0) + 1
        if o.w in ids and o.op == "crestore":
            k = brief_restore(o)
            crest[k] = crest.get(k, 0) + 1
    return (f"rollbacks={','.join(f'{k}x{v}' for k, v in sorted(rolls.items())) or 0}",
            f"crestores={','.join(f'{k}x{v}' for k, v in sorted(crest.items())) or 0}")


# -- the checks ------------------------------------------------------------------------------
def _may_follow(o, start: float) -> bool:
    return o.unknown or (o.end is not None and o.end > start and o.result in ("ok", "mismatch"))


def moved_back(o) -> bool:
    """A rollback whose move may have happened (returned, or of unknown outcome)."""
    return o.op == "rollback" and (o.unknown or o.result in ("ok", "mismatch"))


def rolled_back_to(ops: list, ref: str, root: str, start: float) -> bool:
    """Whether a journaled rollback of `ref` to `root` may have moved it after `start`."""
    return any(moved_back(r) and r.args["ref"] == ref and r.args["root"] == root and _may_follow(r, start)
               for r in ops)


def check_rollbacks(store, ops: list, barriers: list[float]) -> list[str]:
    """R1 (the module's docstring)."""
    from .check import _spec_of
    bad = []
    refs = {n: r.hex() for n, r in store.reftable.list()}
    for o in ops:
        if o.op != "rollback" or o.end is None or o.result not in ("ok", "mismatch"):
            continue
        if any(b > o.start for b in barriers):
            continue
        name, want = o.args["ref"], o.args["root"]
        cur = refs.get(name)
        if cur == want:
            continue
        if cur is None:
            if not any(d.op == "delete_ref" and d.args["ref"] == name and _may_follow(d, o.start) for d in ops):
                bad.append(f"R1 ref {name} is gone after a rollback to {want[:16]} and no delete_ref since: "
                           f"{o.brief()}")
            continue
        try:
            spec = _spec_of(store, bytes.fromhex(cur)) or {}
        except tsck.TsckError:
            spec = {}  # (I1 reports an unreadable tip)
        by_put = any(p.op == "put" and p.args.get("ref") == name and (p.ok or p.unknown)
                     and (p.args["spec"]["w"], p.args["spec"]["o"]) == (spec.get("w"), spec.get("o"))
                     and (p.unknown or p.end > o.start) for p in ops)
        if by_put or rolled_back_to([r for r in ops if r is not o], name, cur, o.start):
            continue
        what = "the abandoned run's tip" if cur == o.args.get("from") else "a snapshot nothing since explains"
        bad.append(f"R1 ref {name} was rolled back to {want[:16]} (step {o.args['step']}) and is on {cur[:16]}, "
                   f"{what} (spec {spec}): {o.brief()}")
    return bad


def check_restores(ops: list) -> list[str]:
    """R2 (the module's docstring)."""
    bad = []
    for o in ops:
        if o.op != "crestore" or o.end is None or not o.out.get("ranks"):
            continue
        ranks = o.out["ranks"]
        said = [(r.get("result", "ok"),) + ((r.get("restored"), r.get("note")) if "result" not in r else ())
                for r in ranks]
        if len(set(said)) > 1:
            bad.append(f"R2 the ranks of a collective restore got different outcomes: "
                       f"{'; '.join(f'rank {k}: {r}' for k, r in enumerate(ranks))[:900]}: {o.brief()}")
        for k, r in enumerate(ranks):
            if "result" not in r and r.get("rows_ok") is False:
                bad.append(f"R2 rank {k} restored {r.get('note')} (step {r.get('restored')}) but its rows of own "
                           f"are not its spec's: {o.brief()}")
    return bad


def planted_windows(ops: list) -> list[tuple[str, float, float]]:
    """(digest hex, from, until) of the blocks damaged on purpose for a collective restore:
    until the worker's repair, or the driver's (left_damage) where the worker was killed."""
    driver = [o for o in ops if o.op == "repair"]
    out = []
    for o in ops:
        if o.op != "crestore" or not o.args.get("digest"):
            continue
        until = o.end if o.end is not None else next(
            (d.end or float("inf") for d in driver if o.args["key"] in d.args.get("keys", ()) and d.start > o.start),
            float("inf"))
        out.append((o.args["digest"], o.start, until))
    return out


def planted(finding: str, o, windows: list) -> bool:
    """Whether an fsck finding of op `o` names a block damaged on purpose while it ran."""
    return any(d in finding and o.start < until and (o.end is None or o.end > since) for d, since, until in windows)
