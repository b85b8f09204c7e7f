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

A stage failure (a collective put i turned into a pair, drawn from a stream of its own
with probability cfg["stagefail_p"]; journaled as put i and put i + 1, the second marked
after_stagefail): both ranks make a real asynchronous CheckpointManager (every_steps=1,
timeout=STAGE_DEADLINE) and call step() at op i's step, where one rank's state_dict()
raises (a data loader that cannot report its position, STAGE_ERROR), then at op i + 1's
step, where every rank's state reads. A healthy rank waits for its snapshot of op i to end
before its next step(); the failing rank's next step() meets it in the manager's broadcast
of rank 0's decision, so it makes no later put that could end the first one (as out of
step) meanwhile: only the abort its failed staging sends can. Each rank reports its first
call once it ended or STAGE_BOUND passed; the worker journals those reports at once (op
"stagefail", index SFAIL_I + i), before a rank that waits out the deadline gets it killed
as stuck.

  R3  a snapshot one rank could not stage is lost on every rank at once: no rank gets a
      root, every other rank's snapshot ends in SnapshotAborted naming that rank's error,
      within STAGE_BOUND of the later rank's call (the deadline is STAGE_DEADLINE: an end
      there is a rank that waited for a call the failing one skipped); the next snapshot
      (op i + 1) commits the same root on every rank and each manager closes clean,
      counting the one failure, unless an injected storage fault failed it.
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
SFAIL_I = 8_000_000  # journal index of a stage failure's first calls (collective put i)
ROLL_MESSAGE = "rolled back to step"  # the start of restoring.py's reflog message
STAGE_DEADLINE = 45.0  # a stage failure's manager timeout= (below the ranks' gloo timeout, 60 s)
# R3: the others' snapshot of a stage failure ends within this of the later rank's call. It
# takes milliseconds; and a worker is killed as stuck 8 s past its round, so a rank that waits
# for the deadline must have said so before then (a call made as the round ends, + 5 s).
STAGE_BOUND = 5.0
STAGE_ERROR = "sim: rank {rank}'s loader cannot report its position at step {step}"


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


def stagefail_drawn(w, i: int, cmd: dict) -> bool:
    """Whether collective put i of worker `w` becomes a stage failure (module docstring):
    with probability cfg["stagefail_p"], from a stream of its own; never through the ranks'
    tiers (a put there is published in rank 0's tier, its remote outcome unknown)."""
    cfg = w.cfg
    if not cfg.get("stagefail_p") or cmd.get("kill0") or cfg.get("rank_tiers") or i + 1 >= cfg["ops"]:
        return False
    return random.Random(f"{cfg['seed']}-{w.wid}-{i}-stagefail").random() < cfg["stagefail_p"]


def stagefail_pair(w, i: int, args: dict):
    """Put i, whose state one rank cannot read, and put i + 1 (module docstring), through
    each rank's manager (ranks.py: rank_stagefail, two lines) -> put i's call. It journals
    op "stagefail" (SFAIL_I + i: what each rank's first step() came to, as soon as every
    rank said, so that a worker killed as stuck while a rank waits out the deadline leaves
    R3 its evidence) and put i + 1."""
    import time
    bad = random.Random(f"{w.cfg['seed']}-{w.wid}-{i}-stagefail-rank").randrange(len(w.ranks))
    step2 = w.cfg["step_base"] + i + 1
    spec2 = dict(content.make_spec(w.wid, i + 1, args["spec"]["v"], step2, None), c=len(w.ranks))
    args.pop("expected", None)  # (a manager's put names no expected root)
    sf = {"rank": bad, "deadline": STAGE_DEADLINE, "bound": STAGE_BOUND}
    args.update(blocking=False, stagefail=sf)
    args2 = {"ref": args["ref"], "step": step2, "spec": spec2, "blocking": False, "collective": len(w.ranks),
             "after_stagefail": i}
    cmd = {"stagefail": dict(sf, ref=args["ref"], specs=[args["spec"], spec2])}
    w._taken.add(i + 1)

    def call():
        w.j.write(i=SFAIL_I + i, op="stagefail", args=dict(sf, ref=args["ref"], step=args["step"], put=i),
                  start=time.time())
        line = json.dumps(cmd) + "\n"
        for p in w.ranks:
            p.stdin.write(line)
            p.stdin.flush()
        firsts = [w._rank_line(p, 150.0) for p in w.ranks]
        w.j.write(i=SFAIL_I + i, end=time.time(), result="ok", ranks=firsts, **_raw(firsts))
        w.j.write(i=i + 1, op="put", args=args2, start=time.time())
        seconds = [w._rank_line(p, 150.0) for p in w.ranks]
        out2 = _stage_outcome([o.get("second") or {} for o in seconds])
        out2.update(_raw(seconds), stagefail=seconds)
        if "root" in out2:
            w.puts.append({"ref": args["ref"], "step": step2, "root": out2["root"], "own": [w.wid, i + 1]})
        w.j.write(i=i + 1, end=time.time(), **out2)
        # Put i as the others heard it (the failing rank's own error is its state's).
        return _stage_outcome([o.get("first") or {} for o in firsts], heard_from=1 if bad == 0 else 0)
    return call


def _raw(outs: list) -> dict:
    """A rank's own code that raised (ranks.py printed _err), for I4."""
    raw = [(k, o) for k, o in enumerate(outs) if o.get("raw")]
    return {"raw": True, "trace": "; ".join(f"rank {k}: {o.get('trace', '')}" for k, o in raw)} if raw else {}


def _stage_outcome(calls: list, heard_from: int = 0) -> dict:
    """A put's journaled outcome from each rank's report of its step() call: the root, or
    the error type and text, as rank `heard_from` heard it; "ranks": what each heard."""
    out = {"ranks": [c.get("root") and "ok" or (c.get("error") or "?").split(":", 1)[0] for c in calls]}
    c = calls[heard_from]
    if c.get("root"):
        out.update(result="ok", root=c["root"])
        if len({x.get("root") for x in calls}) > 1:
            out["mismatch"] = [f"ranks' roots differ: {[x.get('root') for x in calls]}"]
    else:  # (no error: the rank's call had not ended when it reported, its outcome unknown here)
        typ, _, msg = (c.get("error") or "OutcomeUnknown: not ended when its rank reported").partition(": ")
        out.update(result=typ, error=msg[:400])
    return out


class _Staging:
    """TrainState's protocol (state_dict(), step) for a stage failure's manager: this rank's
    part of the put of the step's spec; on the failing rank, at the first step, it raises."""

    def __init__(self, specs: list, rank: int, world: int, bad: int):
        self.step = None
        self.specs, self.rank, self.world, self.bad = {sp["s"]: sp for sp in specs}, rank, world, bad
        self.fail_at = specs[0]["s"]

    def state_dict(self):
        if self.rank == self.bad and self.step == self.fail_at:
            raise RuntimeError(STAGE_ERROR.format(rank=self.rank, step=self.step))
        return content.rank_state(self.specs[self.step], self.rank, self.world)


class _WithSpec:
    """A rank's Store as a stage failure's manager sees it: each put_snapshot carries its
    step's spec in meta["sim"] (what every check reads a snapshot back against; a manager's
    own meta says only its triggers); all else is the Store itself."""

    def __init__(self, s, specs: list):
        self._s, self._specs = s, {sp["s"]: sp for sp in specs}

    def put_snapshot(self, state, **kw):
        kw["meta"] = dict(kw.get("meta") or {}, sim=self._specs[kw["step"]])
        return self._s.put_snapshot(state, **kw)

    def __getattr__(self, name):
        return getattr(self._s, name)


def rank_stagefail(s, cmd: dict, rank: int, world: int) -> dict:
    """In a rank (ranks.py): a stage failure's two step() calls (module docstring). Prints
    {"first": ...} (the call's time, its end if it ended within the bound, its root or
    error) once the first call ended here or the bound passed; then waits for it to end
    (the deadline and a margin at most) before the second -> {"second": ..., "closed",
    "failed", "errors"}: the manager's failures and how it closed."""
    from .worker import _err
    said = []

    def first(line: dict) -> None:
        said.append(line)
        print(json.dumps(line), flush=True)
    try:
        return _stagefail_calls(cmd["stagefail"], s, rank, world, first)
    except Exception as e:  # noqa: BLE001 - a raw error here is journaled and judged (I4)
        if not said:
            first(_err(e))  # (the worker reads two lines)
        return _err(e)


def _outcome(call: dict, res, mgr) -> None:
    """A step() call's outcome into `call`: its root or error, if it has one yet."""
    from concurrent import futures
    if res is None:  # refused at the call (this rank's state failed): reported, not raised
        errs = mgr.snapshot_errors
        call["error"] = f"{type(errs[-1]).__name__}: {errs[-1]}" if errs else "None: no error reported"
    elif not hasattr(res, "add_done_callback"):
        call["root"] = res.root
    elif res.done():
        err = futures.Future.exception(res, 0)
        if err is None:
            call["root"] = futures.Future.result(res, 0).root
        else:
            call["error"] = f"{type(err).__name__}: {err}"


def _stagefail_calls(c: dict, s, rank: int, world: int, first) -> dict:
    import time
    from concurrent import futures
    specs = c["specs"]
    mgr = tsck.CheckpointManager(_WithSpec(s, specs), job=job_of(c["ref"]), ref=c["ref"],
                                 state=_Staging(specs, rank, world, c["rank"]), every_steps=1, async_=True,
                                 prune=False, store_size_every=None, timeout=c["deadline"])
    out: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the manager warns of the failure it counts: judged by R3)
        for key, spec in zip(("first", "second"), specs):
            call = out[key] = {"called": time.time()}
            res = mgr.step(spec["s"])  # (its broadcast of rank 0's decision: every rank is in it)
            if res is not None and hasattr(res, "add_done_callback"):
                res.add_done_callback(lambda _f, call=call: call.setdefault("ended", time.time()))
                futures.wait([res], timeout=c["bound"] if key == "first" else c["deadline"] + 15)
            if res is None or not hasattr(res, "add_done_callback") or res.done():
                call.setdefault("ended", time.time())  # (a waiter may wake before the callback runs)
            _outcome(call, res, mgr)
            if key == "first":
                first({"first": dict(call)})
                if res is not None and hasattr(res, "add_done_callback"):
                    # Its end before the next step() (which the failing rank is already in):
                    # the deadline and a margin at most.
                    futures.wait([res], timeout=c["deadline"] + 15)
        try:
            mgr.close()
            out["closed"] = "ok"
        except tsck.TsckError as e:
            out["closed"] = f"{type(e).__name__}: {str(e)[:300]}"
    out["failed"], out["errors"] = mgr.failed_snapshots, [f"{type(e).__name__}: {e}"[:400] for e in mgr.snapshot_errors]
    del out["first"]
    return out


def brief_stagefails(ops: list, ids) -> str:
    """Stage failures by what the other rank heard of the lost snapshot, then how the next
    one ended: stagefails=SnapshotAborted/okxN,... (killed: the worker, meanwhile)."""
    puts = {(o.w, o.i): o for o in ops if o.op == "put"}
    got: dict = {}
    for o in ops:
        if o.w in ids and o.op == "stagefail":
            p, n = puts.get((o.w, o.args["put"])), puts.get((o.w, o.args["put"] + 1))
            k = "/".join("killed" if x is None or x.end is None else str(x.result) for x in (p, n))
            got[k] = got.get(k, 0) + 1
    return f"stagefails={','.join(f'{k}x{v}' for k, v in sorted(got.items())) or 0}"


def brief_restore(o) -> str:
    """What a collective restore came to, for the round line: planted (one rank's part
    damaged) or not; each rank's step (fell back: an older one) or error; killed."""
    if o.end is None:
        return "killed"
    ranks = o.out.get("ranks") or []
    got = "/".join(r.get("result") or ("fellback" if r.get("fell_back") else "newest") for r in ranks) or o.result
    return f"{'planted' if o.out.get('planted') else 'whole'}:{got}"


def brief_rollbacks(ops: list, ids) -> str:
    """Rollbacks by outcome, then collective restores (brief_restore) by what they came to
    and stage failures (brief_stagefails)."""
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
            f"crestores={','.join(f'{k}x{v}' for k, v in sorted(crest.items())) or 0} "
            f"{brief_stagefails(ops, ids)}")


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


def _injected(text: str) -> bool:
    return "sim: injected" in text  # (faults.py: a storage failure the profile injected)


def check_stagefails(ops: list) -> list[str]:
    """R3 (the module's docstring): the first calls from op "stagefail", the next snapshot
    from put i + 1 (after_stagefail)."""
    bad = []
    nxt = {(o.w, o.args["after_stagefail"]): o for o in ops if o.op == "put" and "after_stagefail" in o.args}
    for o in ops:
        if o.op != "stagefail" or o.end is None or any("first" not in r for r in o.out.get("ranks", [])):
            continue  # (killed before every rank said; a rank's own code raised: I4 reports it)
        who, step, bound = o.args["rank"], o.args["step"], o.args["bound"]
        said = STAGE_ERROR.format(rank=who, step=step)
        first = [r["first"] for r in o.out["ranks"]]
        later = max(c["called"] for c in first)
        for k, c in enumerate(first):
            err = c.get("error", "")
            if c.get("root"):
                bad.append(f"R3 rank {k} committed {c['root'][:16]} of step {step}, which rank {who} could not "
                           f"stage: {o.brief()}")
            elif k == who:
                if said not in err:
                    bad.append(f"R3 rank {who}, whose state failed, reported {err[:300]!r}: {o.brief()}")
                continue
            elif err and not _injected(err) and not (err.startswith("SnapshotAborted") and said in err):
                bad.append(f"R3 rank {k}'s snapshot of step {step} ended in {err[:300]!r}, not an abort naming "
                           f"rank {who}'s error: {o.brief()}")
            took = None if c.get("ended") is None else c["ended"] - later
            if took is None or took > bound:
                bad.append(f"R3 rank {k}'s snapshot of step {step} had "
                           f"{'not ended ' + format(bound, '.0f') + ' s' if took is None else f'ended {took:.1f} s'}"
                           f" after the later rank's call (bound {bound:.0f} s, deadline {o.args['deadline']:.0f} s): "
                           f"it waits for a call rank {who} did not make: {o.brief()}")
        n = nxt.get((o.w, o.args["put"]))
        if n is None or n.end is None or any("second" not in r for r in n.out.get("stagefail", [])):
            continue  # (killed meanwhile: its outcome unknown)
        second = [r["second"] for r in n.out["stagefail"]]
        if any(_injected(c.get("error", "")) for c in second):
            continue  # (the next snapshot met an injected storage fault: not judged)
        if None in {c.get("root") for c in second} or len({c.get("root") for c in second}) > 1:
            bad.append(f"R3 the snapshot after the one rank {who} could not stage did not commit alike on every "
                       f"rank: {[c.get('root') or c.get('error', '')[:200] for c in second]}: {n.brief()}")
        for k, r in enumerate(n.out["stagefail"]):
            if r.get("closed") != "ok" or r.get("failed") != 1:
                bad.append(f"R3 rank {k}'s manager closed with {r.get('closed')!r}, {r.get('failed')} failed "
                           f"snapshot(s) counted (want ok, 1): {n.brief()}")
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
