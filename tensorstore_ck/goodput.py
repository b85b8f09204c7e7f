"""Expected goodput of a training run from measured quantities, and the snapshot interval
that maximises it (the model of docs/guide/goodput.md; `tsck goodput` prints it).

The quantities, all in seconds:

    stall     δ  what each snapshot blocks training (SnapshotInfo.stall)
    durable   S  a snapshot's call to durable (SnapshotInfo.seconds for a store without a
                 tier; with a tier, to its upload): the newest snapshot a failure can use
                 is the newest durable one
    interval  c  from one snapshot's start to the next (a cycle: c - δ of training, δ stalled)
    restart   R  a failed job's process start to its first resumed step (benches/bench_restart.py)
    mtbf      M  mean time between the job's failures (its own figure: a cluster's MTTF)

The model (first order in 1/M: failures are rare in a cycle, at most one per cycle):

    useful share of a cycle        (c - δ) / c
    wall time lost per failure     L = R + c/2 + S
        (the work since the state the newest durable snapshot holds: a failure at a uniform
        moment x of the cycle resumes from this cycle's snapshot when x >= S, else from the
        one before, one cycle older: c/2 + S on average, for S <= c; then the restart)
    goodput                        G(c) = (c - δ)/c * (1 - L/M), and 0 where that is below 0

dG/dc = 0 gives c* = sqrt(2 δ (M - R - S)), the interval of training T* = c* - δ: Young's
and Daly's sqrt(2 δ M) - δ when R + S is small beside M. A cycle shorter than S cannot be
run (the next snapshot would start before the previous is durable), so the best interval
is max(c*, S); at S it is the continuous trigger's (CheckpointManager(continuous=True))."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass

from .errors import InvalidArgument

__all__ = ["Goodput", "goodput", "best_interval", "parse_seconds"]


@dataclass(frozen=True)
class Goodput:
    """The model's answer for one run: the quantities it was given and what follows."""
    stall: float
    durable: float
    interval: float | None
    restart: float
    mtbf: float
    goodput: float | None        # G(interval), None without an interval
    loss_per_failure: float | None  # L at that interval
    best_interval: float         # max(c*, S)
    best_goodput: float          # G(best_interval)
    best_is_continuous: bool     # c* <= S: a snapshot as soon as the previous is durable

    def to_json(self) -> dict:
        return asdict(self)


def _seconds(name: str, v, *, positive: bool = False) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0 \
            or (positive and v == 0):
        raise InvalidArgument(f"{name} must be a number of seconds {'> 0' if positive else '>= 0'}, got {v!r}")
    return float(v)


def goodput_at(c: float, *, stall: float, durable: float, restart: float, mtbf: float) -> tuple[float, float]:
    """(G(c), L(c)) of the model (the module's docstring)."""
    loss = restart + c / 2 + durable
    return max(0.0, (c - stall) / c * (1.0 - loss / mtbf)), loss


def best_interval(*, stall: float, durable: float, restart: float, mtbf: float) -> tuple[float, bool]:
    """(max(c*, S), whether S bounds it): c* = sqrt(2 δ (M - R - S)), the cycle maximising G."""
    room = max(0.0, mtbf - restart - durable)
    c = math.sqrt(2.0 * stall * room)
    bound = max(durable, stall)
    return (bound, True) if c <= bound else (c, False)


def goodput(*, stall: float, restart: float, mtbf: float, durable: float | None = None,
            interval: float | None = None) -> Goodput:
    """The model for these quantities (seconds; durable defaults to the stall: a blocking
    snapshot is durable once it returns). interval, when given, must be above the stall."""
    stall = _seconds("stall", stall)
    restart = _seconds("restart", restart)
    mtbf = _seconds("mtbf", mtbf, positive=True)
    durable = stall if durable is None else _seconds("durable", durable)
    if durable < stall:
        raise InvalidArgument(f"durable ({durable:g} s) must be at least the stall ({stall:g} s): a snapshot is "
                              "durable no sooner than it stops blocking")
    g = loss = None
    if interval is not None:
        interval = _seconds("interval", interval, positive=True)
        if interval <= stall:
            raise InvalidArgument(f"interval ({interval:g} s) must be above the stall ({stall:g} s): it is the time "
                                  "from one snapshot's start to the next, its stall included")
        g, loss = goodput_at(interval, stall=stall, durable=durable, restart=restart, mtbf=mtbf)
    best, bounded = best_interval(stall=stall, durable=durable, restart=restart, mtbf=mtbf)
    bg = goodput_at(best, stall=stall, durable=durable, restart=restart, mtbf=mtbf)[0] if best > 0 else \
        max(0.0, 1.0 - (restart + durable) / mtbf)
    return Goodput(stall=stall, durable=durable, interval=interval, restart=restart, mtbf=mtbf, goodput=g,
                   loss_per_failure=loss, best_interval=best, best_goodput=bg, best_is_continuous=bounded)


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_seconds(text: str, name: str) -> float:
    """'90', '90s', '1.5m', '7.9h', '2d' -> seconds; anything else is an InvalidArgument naming `name`."""
    t = str(text).strip().lower()
    unit = _UNITS.get(t[-1:]) if t else None
    try:
        v = float(t[:-1] if unit is not None else t) * (unit or 1.0)
    except ValueError:
        raise InvalidArgument(f"{name} must be a duration: seconds, or a number with s, m, h or d "
                              f"(e.g. 7.9h), got {text!r}") from None
    return _seconds(name, v)
