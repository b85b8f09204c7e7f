"""`tsck goodput`: the expected goodput of a run from its measured quantities, and the
snapshot interval that maximises it (the model: tensorstore_ck/goodput.py,
docs/guide/goodput.md). The stall, the time to durable and the interval are read from a
ref's recorded snapshots when a STORE and REF are given, or taken as options."""

from __future__ import annotations

import statistics

from ..errors import InvalidArgument
from ..goodput import goodput, parse_seconds
from .common import emit

__all__: list[str] = []  # a command of the CLI (parser.py registers it); nothing public

# The newest snapshots of the ref that the figures are the medians of.
RECORDED = 100


def recorded(store, ref: str, n: int = RECORDED) -> dict:
    """Medians over the ref's newest n snapshots: stall (SnapshotInfo.stall), durable (its
    put's call to commit, SnapshotInfo.seconds), interval (between consecutive commits);
    and how many snapshots each came from."""
    infos = store.log(ref)[:n]
    stalls = [i.stall for i in infos if i.stall is not None]
    secs = [i.seconds for i in infos if i.seconds is not None]
    times = sorted(i.time for i in infos)
    gaps = [b - a for a, b in zip(times, times[1:]) if b > a]
    if not stalls:
        raise InvalidArgument(f"the snapshots of {ref} record no stall (committed before it was recorded, or "
                              "none): give --stall")
    return {"stall": statistics.median(stalls), "durable": statistics.median(secs) if secs else None,
            "interval": statistics.median(gaps) if gaps else None, "snapshots": len(infos)}


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
    src = {k: f"median of {got['snapshots']} snapshots of {args.ref}" for k in ("stall", "durable", "interval")
           if got.get(k) is not None}
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
