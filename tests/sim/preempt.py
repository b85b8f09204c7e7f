"""Preemptions in the harness: a SIGTERM at a seeded moment of a worker's collective
snapshots, taken through a real CheckpointManager on each rank, and its check (P1).

A preemption (a collective put i turned into a run of N steps, drawn from a stream of its
own with probability cfg["preempt_p"]; its steps journaled as puts i .. i + N - 1, each
marked in_preempt, and the run as op "preempt", index PRE_I + i): both ranks make an
asynchronous CheckpointManager (every_steps=EVERY, so the even steps' snapshots are in
flight while the ranks go on; the profile's delays and injected failures stay on) and call
step() at each step in turn. One rank, or both, sends itself SIGTERM (os.kill of its own
pid) at a seeded moment of the run:

  before    just before its step() of step j (any j);
  inflight  as its step() of an even step j returns the snapshot's future (a snapshot
            staged and in flight; whether it had ended is reported);
  between   once step j's snapshot (if any) has ended, before the next step();
  thread    from a thread started as step j's step() is called, after a seeded 0-50 ms:
            anywhere in that call (rank 0's decision, the staging) or after it.

The signalled step j is never the last, except before it, so a step() always follows the
signal: the run ends at the step where the manager acts on it (every rank agrees there, in
its all-reduce of rank 0's decision), which saves that step blocking and raises Preempted
(or, on_preempt="return", returns and sets manager.preempted; seeded). Each rank installs a
SIGTERM handler of its own first, which the manager's chains to: a signal never ends the
process (the watchdog defers to that handler, and ends a process only when its final save
is still writing PAST_GRACE after PRE_GRACE, which no save here comes near: that is
tests/train/test_preempt*.py's), and a thread's signal that comes after the manager put
its handler back is harmless. Each rank reports what it was
told (Preempted's step, durable, why, the step it came at), every step's outcome (root or
error, or no snapshot), and how its manager closed.

  P1  every rank of a preemption is told of it, at the same step, with the same outcome:
      the same step saved (and the same root) or no step saved on any rank; a step saved
      is on the ref (its reflog names the root, unless a delete_ref of the ref may have
      dropped it) and a checkout of it by one process (the worker's Store, right after)
      equals the ranks' states at that step (rebuilt from its spec). What was published is
      judged as any put is (I1, I3, I9: the run's steps are journaled puts), so a snapshot
      the signal cut short must not be left published in part.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
import warnings

import tensorstore_ck as tsck

from . import content
from .rollback import _raw, _Staging, _WithSpec, job_of

PRE_I = 9_000_000  # journal index of a preemption of collective put i (its run of steps)
EVERY = 2          # the managers' every_steps: the even steps' snapshots are taken (in flight)
PRE_GRACE = 30.0   # preempt_grace=: the final snapshot's deadline (below the ranks' gloo timeout, 60 s)
PRE_DEADLINE = 45.0  # the interval snapshots' timeout=
WHEN = ("before", "inflight", "between", "thread")


# -- the worker's side ---------------------------------------------------------------------
def preempt_drawn(w, i: int, cmd: dict) -> int:
    """How many steps collective put i of worker `w` becomes (0: none; module docstring):
    with probability cfg["preempt_p"], from a stream of its own; never through the ranks'
    tiers (a put there is published in rank 0's tier, its remote outcome unknown)."""
    cfg = w.cfg
    if not cfg.get("preempt_p") or cmd.get("kill0") or cfg.get("rank_tiers"):
        return 0
    rng = random.Random(f"{cfg['seed']}-{w.wid}-{i}-preempt")
    if rng.random() >= cfg["preempt_p"]:
        return 0
    n = min(rng.randint(3, 5), cfg["ops"] - i)
    return n if n >= 2 else 0


def preempt_run(w, s, i: int, n: int, args: dict):
    """Put i and the n - 1 puts after it as one preemption's run of steps (module
    docstring), through each rank's manager (rank_preempt, one line) -> put i's call. It
    journals every step's put before the ranks start (a worker killed meanwhile leaves
    them of unknown outcome), op "preempt" (PRE_I + i: what each rank was told, and the
    worker's own read of the step saved) and each step's outcome."""
    rng = random.Random(f"{w.cfg['seed']}-{w.wid}-{i}-preempt-how")
    who = rng.choice([[0], [1], [0, 1]])
    when = rng.choice(WHEN)
    # the signalled step: any before its step(); else one a step() follows (inflight: an even one)
    base = w.cfg["step_base"] + i
    if when == "before":
        at = rng.randrange(n)
    elif when == "inflight":
        at = rng.choice([j for j in range(n - 1) if (base + j) % EVERY == 0] or [0])
    else:
        at = rng.randrange(n - 1)
    pre = {"who": who, "when": when, "at": at, "n": n, "on_preempt": rng.choice(["raise", "return"]),
           "delays": [round(rng.uniform(0.0, 0.05), 4) for _ in range(len(w.ranks))],
           "every": EVERY, "grace": PRE_GRACE, "deadline": PRE_DEADLINE}
    specs = [args["spec"]] + [dict(content.make_spec(w.wid, i + j, args["spec"]["v"], base + j, None),
                                   c=len(w.ranks)) for j in range(1, n)]
    args.pop("expected", None)  # (a manager's put names no expected root)
    args.update(blocking=False, in_preempt=i)
    more = [{"ref": args["ref"], "step": base + j, "spec": specs[j], "blocking": False,
             "collective": len(w.ranks), "in_preempt": i} for j in range(1, n)]
    cmd = {"preempt": dict(pre, ref=args["ref"], specs=specs)}
    w._taken.update(range(i + 1, i + n))

    def call():
        w.j.write(i=PRE_I + i, op="preempt", args=dict(pre, ref=args["ref"], step=base, put=i), start=time.time())
        for j, a in enumerate(more, 1):
            w.j.write(i=i + j, op="put", args=a, start=time.time())
        line = json.dumps(cmd) + "\n"
        for p in w.ranks:
            p.stdin.write(line)
            p.stdin.flush()
        ranks = [w._rank_line(p, 150.0) for p in w.ranks]
        res = dict(_raw(ranks), result="ok", ranks=ranks)
        told = [r.get("preempted") for r in ranks]
        steps = [r.get("steps") or [] for r in ranks]
        if told[0] and told[0].get("step") is not None and steps[0]:
            res["saved"] = _read_saved(s, args["ref"], specs, told[0]["step"], steps[0])
        w.j.write(i=PRE_I + i, end=time.time(), **res)
        outs = [_step_outcome([st[j] if j < len(st) else {"unreached": True} for st in steps]) for j in range(n)]
        for j in range(1, n):
            if "root" in outs[j]:
                w.puts.append({"ref": args["ref"], "step": base + j, "root": outs[j]["root"], "own": [w.wid, i + j]})
            w.j.write(i=i + j, end=time.time(), **outs[j])
        return outs[0]
    return call


def _read_saved(s, ref: str, specs: list, step: int, calls: list) -> dict:
    """The worker's own view of the step a preemption saved: whether the ref's reflog names
    its root, and a whole checkout of it against the union of the ranks' states."""
    from .check import ranks_union
    j = next((k for k, sp in enumerate(specs) if sp["s"] == step), None)
    root = calls[j].get("root") if j is not None and j < len(calls) else None
    if root is None:
        return {"read": "no root reported for the step saved"}
    out = {"root": root}
    try:
        out["on_ref"] = any(e.new.hex() == root for e in s.reftable.reflog(ref))
        diff = content.differences(s.checkout(root), ranks_union(specs[j]))
        out["read"] = "ok" if not diff else "mismatch"
        if diff:
            out["diff"] = diff[:5]
    except tsck.TsckError as e:  # (a gc beside it may take it once other puts move the ref)
        out["read"] = f"{type(e).__name__}: {str(e)[:300]}"
    return out


def _step_outcome(calls: list) -> dict:
    """One step's journaled put from every rank's report: the root where every rank has
    the same; else the error rank 0 heard; NoSnapshot where no rank took one (not a
    trigger step, or not reached). "mismatch" where the ranks heard different outcomes."""
    heard = ["ok" if c.get("root") else "none" if c.get("none") or c.get("unreached") else
             (c.get("error") or "?").split(":", 1)[0] for c in calls]
    out: dict = {"ranks": heard}
    c = calls[0]
    if c.get("root"):
        out.update(result="ok", root=c["root"])
    elif c.get("none") or c.get("unreached"):
        out.update(result="NoSnapshot", error="no snapshot at this step" + (" (not reached)" if c.get("unreached")
                                                                          else ""))
    else:
        typ, _, msg = (c.get("error") or "OutcomeUnknown: not ended when its rank reported").partition(": ")
        out.update(result=typ, error=msg[:400])
    if len(set(heard)) > 1 or len({x.get("root") for x in calls}) > 1:
        out["mismatch"] = [f"ranks heard differently: {[x.get('root') or x.get('error') or heard[k] for k, x in enumerate(calls)]}"]
    return out


# -- the ranks' side -------------------------------------------------------------------------
def rank_preempt(s, cmd: dict, rank: int, world: int) -> dict:
    """In a rank (ranks.py): a preemption's run of steps (module docstring) -> {"preempted":
    {"step", "durable", "why", "at"} or None, "steps": [each step's outcome], "sent":
    where this rank signalled itself, "signals": how many its own handler saw, "closed"}."""
    from .worker import _err
    c = cmd["preempt"]
    seen: list = []
    prev = signal.signal(signal.SIGTERM, lambda *_a: seen.append(time.time()))
    stop = threading.Event()
    sender: list = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the manager warns of what it reports: judged by P1)
            return _preempt_calls(c, s, rank, world, seen, stop, sender)
    except Exception as e:  # noqa: BLE001 - a raw error here is journaled and judged (I4)
        return _err(e)
    finally:
        stop.set()
        for t in sender:
            t.join()
        signal.signal(signal.SIGTERM, prev)


def _preempt_calls(c: dict, s, rank: int, world: int, seen: list, stop, sender: list) -> dict:
    from concurrent import futures

    from .rollback import _outcome
    specs, mine, when, at = c["specs"], rank in c["who"], c["when"], c["at"]
    mgr = tsck.CheckpointManager(_WithSpec(s, specs), job=job_of(c["ref"]), ref=c["ref"],
                                 state=_Staging(specs, rank, world, -1), every_steps=c["every"], async_=True,
                                 prune=False, store_size_every=None, timeout=c["deadline"],
                                 preempt_grace=c["grace"], on_preempt=c["on_preempt"])
    out: dict = {"preempted": None, "steps": [], "sent": None}
    fired = threading.Event()

    def kill(how: str, j: int, **kw) -> None:
        out["sent"] = dict(kw, how=how, step=specs[j]["s"])
        os.kill(os.getpid(), signal.SIGTERM)

    def later(j: int) -> None:
        if not stop.wait(c["delays"][rank]):
            kill("thread", j, delay=c["delays"][rank])
        fired.set()
    pending = []
    for j, spec in enumerate(specs):
        st = spec["s"]
        if mine and when == "before" and j == at:
            kill("before", j)
        if sender and j == len(specs) - 1:
            fired.wait()  # (the thread's signal is sent before the last step(): one follows it)
        if mine and when == "thread" and j == at:
            t = threading.Thread(target=later, args=(j,), daemon=True)
            sender.append(t)
            t.start()
        call: dict = {"step": st}
        out["steps"].append(call)
        try:
            res = mgr.step(st)
        except tsck.Preempted as e:
            pre = e
            res = mgr.last if e.step == st else None
        else:
            pre = mgr.preempted
        if pre is not None:
            out["preempted"] = {"step": pre.step, "durable": pre.durable, "why": pre.why[:300], "at": st}
            if pre.step == st and res is not None:
                call["root"] = res.root
            else:
                errs = mgr.snapshot_errors
                call["error"] = f"{type(errs[-1]).__name__}: {errs[-1]}"[:400] if errs else \
                    f"PreemptFailed: {pre.why[:300]}"
            break
        if res is None and st % c["every"]:
            call["none"] = True
        else:
            pending.append((call, res))
        if mine and when == "inflight" and j == at:
            kill("inflight", j, in_flight=res is not None and hasattr(res, "done") and not res.done())
        if mine and when == "between" and j == at:
            if res is not None and hasattr(res, "add_done_callback"):
                futures.wait([res], timeout=c["deadline"] + 15)
            kill("between", j)
    mgr_wait = [r for _c, r in pending if r is not None and hasattr(r, "add_done_callback")]
    futures.wait(mgr_wait, timeout=c["deadline"] + 15)
    for call, res in pending:
        _outcome(call, res, mgr)
        if "root" not in call and "error" not in call:
            call["error"] = "OutcomeUnknown: not ended when its rank reported"
    try:
        mgr.close()
        out["closed"] = "ok"
    except tsck.TsckError as e:
        out["closed"] = f"{type(e).__name__}: {str(e)[:300]}"
    out["signals"] = len(seen)
    return out


def brief_preempts(ops: list, ids) -> str:
    """Preemptions by how the signal came and what the ranks were told: preempts=
    thread:saved x2,before:failed x1 (killed: the worker, meanwhile)."""
    got: dict = {}
    for o in ops:
        if o.w in ids and o.op == "preempt":
            if o.end is None:
                k = "killed"
            else:
                told = [r.get("preempted") for r in o.out.get("ranks", [])]
                k = "untold" if not told or None in told else "saved" if told[0].get("step") is not None else "failed"
            k = f"{o.args['when']}:{k}"
            got[k] = got.get(k, 0) + 1
    return f"preempts={','.join(f'{k}x{v}' for k, v in sorted(got.items())) or 0}"


# -- the check -------------------------------------------------------------------------------
def check_preempts(ops: list) -> list[str]:
    """P1 (the module's docstring)."""
    bad = []
    for o in ops:
        if o.op != "preempt" or o.end is None or o.out.get("raw"):
            continue  # (killed meanwhile: unknown; a rank's own code raised: I4 reports it)
        ranks = o.out.get("ranks") or []
        told = [r.get("preempted") for r in ranks]
        what = f"signal {o.args['when']} step {o.args['step'] + o.args['at']} to rank(s) {o.args['who']}"
        for k, t in enumerate(told):
            if t is None:
                bad.append(f"P1 rank {k} was never told of the preemption ({what}; it sent "
                           f"{ranks[k].get('sent')}, its handler saw {ranks[k].get('signals')}): {o.brief()}")
        if None in told:
            continue
        said = [(t["at"], t["step"]) for t in told]
        roots = [(r.get("steps") or [{}])[-1].get("root") for r in ranks]
        if len(set(said)) > 1 or (told[0]["step"] is not None and len(set(roots)) > 1):
            bad.append(f"P1 the ranks of a preemption were told different outcomes ({what}): "
                       f"{'; '.join(f'rank {k}: at step {a}, saved {s_}, root {r}' for k, ((a, s_), r) in enumerate(zip(said, roots)))}"
                       f": {o.brief()}")
            continue
        if told[0]["step"] is None:
            continue
        saved = o.out.get("saved") or {}
        # (a read that raised is not judged: a gc beside it may take the snapshot once other
        # puts moved the ref, and I1 reads every snapshot still kept after the round)
        if saved.get("read") == "mismatch" or "root" not in saved:
            bad.append(f"P1 the step a preemption saved ({told[0]['step']}) does not read back as the ranks' states "
                       f"at that step: {saved}: {o.brief()}")
        if saved.get("on_ref") is False and not any(
                d.op == "delete_ref" and d.args.get("ref") == o.args["ref"] and (d.unknown or d.end > o.start)
                for d in ops):
            bad.append(f"P1 the step a preemption saved ({told[0]['step']}, {saved.get('root', '')[:16]}) was never "
                       f"on its ref {o.args['ref']} (its reflog): {o.brief()}")
    return bad
