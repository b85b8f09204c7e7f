"""`tsck goodput`: the expected goodput of a run from its measured quantities, and the
snapshot interval that maximises it (the model: tensorstore_ck/goodput.py,
docs/guide/goodput.md). The stall, the time to durable and the interval are read from a
ref's recorded snapshots when a STORE and REF are given, or taken as options."""

from __future__ import annotations

import statistics

from ..errors import InvalidArgument
from ..goodput import goodput, parse_seconds
from ..refs.history import RECOVERED
from .common import emit

__all__: list[str] = []  # a command of the CLI (parser.py registers it); nothing public

# The newest snapshots of the ref that the figures are the medians of.
RECORDED = 100


def recorded(store, ref: str, n: int = RECORDED) -> dict:
    """Medians over the ref's newest n snapshots: stall (SnapshotInfo.stall), durable (its
    put's call to durable: durable_seconds), interval (between consecutive commits); how
    many snapshots they came from, and how many of those are not durable yet."""
    infos = store.log(ref)[:n]
    stalls = [i.stall for i in infos if i.stall is not None]
    tier = any(not i.durable for i in infos) or store.reftable.tier_rows.upload_last_seq() > 0
    secs = durable_seconds(store, ref, infos, tier)
    times = sorted(i.time for i in infos)
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    if not stalls:
        raise InvalidArgument(f"the snapshots of {ref} record no stall (committed before it was recorded, or "
                              "none): give --stall")
    return {"stall": statistics.median(stalls), "durable": statistics.median(secs) if secs else None,
            "interval": statistics.median(gaps) if gaps else None, "snapshots": len(infos),
            "durables": len(secs), "not_durable": sum(1 for i in infos if not i.durable), "tier": tier}


def durable_seconds(store, ref: str, infos: list, tier: bool) -> list[float]:
    """Each snapshot's put call to durable, where known: to when the ref moved to it in
    the remote store. A local tier opened by itself knows that from its uploads' durable
    marks (a snapshot only in the tier is not durable, and is left out). Any other store
    knows it from its reflog: the ref's first move to the snapshot is its commit, or in a
    tier's remote store its upload; the commit's own put time (SnapshotInfo.seconds) is
    the local commit there, which is why it is not the answer. `tier`: `store` is a local
    tier opened by itself."""
    refs = store.reftable
    known = [i for i in infos if i.seconds is not None]
    if tier:
        at = refs.tier_rows.durable_times(bytes.fromhex(i.root) for i in known)
    else:
        at = {}
        for e in refs.reflog(ref):
            if e.op == "move" and e.message != RECOVERED:  # recover's moves are made when it runs
                at.setdefault(e.new, e.time)
    out = []
    for i in known:
        t = at.get(bytes.fromhex(i.root))
        if t is not None:
            # (two tables' clocks in a tier's remote store: never before its own commit)
            out.append(max(i.seconds, t - (i.time - i.seconds)))
    return out


def cmd_goodput(store, args):
    got = {}
    if store is not None:
        if args.ref is None:
            raise InvalidArgument("tsck goodput STORE REF: name the ref whose snapshots give the stall and interval "
                                  "(or leave out STORE and give --stall)")
        got = recorded(store, args.ref)
    elif args.stall is None:
        raise InvalidArgument("tsck goodput needs the stall per snapshot: --stall SECONDS, or STORE REF to read it "
                              "from a job's recorded snapshots")
    src = {k: f"median of {got['snapshots']} snapshots of {args.ref}" for k in ("stall", "interval")
           if got.get(k) is not None}
    if got.get("durable") is not None:
        src["durable"] = f"median of {got['durables']} durable snapshots of {args.ref}" + (
            f" ({got['not_durable']} only in the local tier)" if got["not_durable"] else "")
    elif got.get("tier") and args.durable is None:
        raise InvalidArgument(f"none of the {got['snapshots']} snapshots of {args.ref} is durable with a known "
                              "time (only in the local tier, or uploaded before it was recorded): give --durable")
    q = {}
    for k in ("stall", "durable", "interval", "restart", "mtbf"):
        v = getattr(args, k)
        if v is not None:
            q[k], src[k] = parse_seconds(v, f"--{k}"), "given"
        elif got.get(k) is not None:
            q[k] = got[k]
    if "durable" in q and "stall" in q and q["durable"] < q["stall"]:
        q["durable"] = q["stall"]  # (recorded: the stall of a blocking put is its whole call, rounded apart)
    g = goodput(stall=q["stall"], restart=q["restart"], mtbf=q["mtbf"], durable=q.get("durable"),
                interval=q.get("interval"))
    rows = [("stall per snapshot", g.stall, src.get("stall", "")),
            ("snapshot to durable", g.durable, src.get("durable", "the stall (blocking)")),
            ("restart", g.restart, src.get("restart", "")), ("MTBF", g.mtbf, src.get("mtbf", ""))]
    lines = [f"{name:<22}{_dur(v):>10}  {how}" for name, v, how in rows]
    if g.interval is not None:
        lines.append(f"{'interval':<22}{_dur(g.interval):>10}  {src.get('interval', '')}")
        lines.append(f"{'goodput':<22}{100 * g.goodput:>9.2f}%  loss per failure {_dur(g.loss_per_failure)}")
    how = ("continuous: a snapshot as soon as the previous is durable (continuous=True)" if g.best_is_continuous
           else "sqrt(2 stall (MTBF - restart - durable)) (Young/Daly)")
    lines.append(f"{'best interval':<22}{_dur(g.best_interval):>10}  {how}")
    lines.append(f"{'best goodput':<22}{100 * g.best_goodput:>9.2f}%")
    emit(args, {**g.to_json(), "sources": src}, "\n".join(lines))
    return 0


def _dur(s: float) -> str:
    if s >= 7200:
        return f"{s / 3600:.2f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.3g} s"
