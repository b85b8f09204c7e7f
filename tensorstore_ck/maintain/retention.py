"""Per-job retention rules -> the set of snapshots to keep. Pure; no I/O.

Each rule keeps some snapshots; a snapshot is kept if *any* rule keeps it
(the union). Tags, pins and the tip of every ref are kept by gc whatever the
rules say; a job with no rules keeps everything.

- keep_last=N: the N newest snapshots of the job, in publication order
  (newest_first_order: the reflog's sequence, and by (time, step) what recover
  brought back).
- keep_best=K, metric=M, mode="min"|"max": the K snapshots with the best value
  of metric M; snapshots without M (or with NaN) are not candidates; ties go
  to the newer snapshot.
- keep_every_steps=S: milestones: for every window [k*S, (k+1)*S) of steps,
  the snapshot with the smallest step in it (the oldest on a tie), so a job
  whose steps do not land exactly on multiples of S still keeps one per window.
- max_age_days=D: every snapshot at most D days old (by commit time).
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import asdict, dataclass
from typing import Iterable

from ..errors import InvalidArgument

__all__ = ["Retention", "SnapRow", "select_kept", "explain_kept", "newest_first_order", "MAX_COUNT"]

MAX_COUNT = 2**64 - 1  # a count in a rule: the rules are msgpack records, whose ints end there


@dataclass(frozen=True)
class Retention:
    keep_last: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"
    keep_every_steps: int | None = None
    max_age_days: float | None = None

    def __post_init__(self):
        for name in ("keep_last", "keep_best", "keep_every_steps"):
            v = getattr(self, name)
            low = 1 if name == "keep_every_steps" else 0
            if v is not None and (type(v) is not int or not low <= v <= MAX_COUNT):
                raise InvalidArgument(f"Retention.{name} must be an int from {low} to {MAX_COUNT} (2**64-1, the "
                                      f"largest the ref table stores), got {v!r}")
        if self.mode not in ("min", "max"):
            raise InvalidArgument(f"Retention.mode must be 'min' or 'max', got {self.mode!r}")
        if self.keep_best and not (isinstance(self.metric, str) and self.metric):
            raise InvalidArgument("Retention.keep_best needs metric=<name>")
        if self.max_age_days is not None and (type(self.max_age_days) not in (int, float)
                                              or not self.max_age_days >= 0):
            raise InvalidArgument(f"Retention.max_age_days must be a number >= 0, got {self.max_age_days!r}")
        if all(getattr(self, k) is None for k in ("keep_last", "keep_best", "keep_every_steps", "max_age_days")):
            # An empty rule set would keep nothing but the ref tips: almost surely a mistake.
            raise InvalidArgument("Retention() sets no rule; give at least one (keep_last=0 keeps only "
                              "ref tips, tags and pins) or set_retention(job, None) to keep everything")

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, d: dict) -> "Retention":
        fields = {"keep_last", "keep_best", "metric", "mode", "keep_every_steps", "max_age_days"}
        if not isinstance(d, dict) or not set(d) <= fields:
            raise InvalidArgument(f"not a retention record: {d!r}")
        return cls(**d)


@dataclass(frozen=True)
class SnapRow:
    root: bytes
    step: int | None
    time: float
    metrics: dict
    seq: int | None = None  # order of publication (the ref table's reflog), if known
    ref: str | None = None  # the ref it was published on
    recovered: bool = False  # seq is recover's replay of a lost history, not a publication


def _age(r: SnapRow) -> tuple:
    return (r.time, r.step if r.step is not None else -math.inf)


def newest_first_order(rows: list[SnapRow]) -> list[SnapRow]:
    """The job's snapshots newest first, the order keep_last counts (and keep_best's ties).

    "Last" is publication order, not the wall clock: a clock stepped back (NTP, a restored
    VM, writers on several hosts) must not make the newest snapshots look oldest. So rows
    a writer published (a sequence number of the ref table's reflog) go by that number.
    The others have no such order: rows recover moved a ref through (recovered, numbered
    ref by ref, in whatever run of recover reached them) and rows without a number (recover
    added them to a ref a writer had moved meanwhile; rows of tables older than the
    reflog's numbers). Their order is what they say: along one ref, recover's numbers
    (the ref's parent chain); across refs, by (time, step). Each goes just above the
    newest published row older than it (and above what comes before it in that order),
    so a published row never outranks a newer one without a publication number, and
    published rows keep their order among themselves."""
    published = sorted((r for r in rows if r.seq is not None and not r.recovered), key=lambda r: r.seq)
    lists: dict = {}
    for r in rows:
        if r.seq is None or r.recovered:
            lists.setdefault((r.ref or "", r.seq is None), []).append(r)
    for (_ref, no_seq), lst in lists.items():
        lst.sort(key=(lambda r: (_age(r), r.root)) if no_seq else (lambda r: r.seq))
    # Merge the lists by age, each kept in its own order (heapq.merge takes the oldest head).
    others = list(heapq.merge(*(lists[k] for k in sorted(lists)), key=_age))
    by_age = sorted(range(len(published)), key=lambda i: _age(published[i]))
    ages = [_age(published[i]) for i in by_age]
    newest_below, m = [], -1  # newest_below[k]: the highest rank among the k+1 oldest published rows
    for i in by_age:
        m = max(m, i)
        newest_below.append(m)
    keyed = [((i, 0, 0), r) for i, r in enumerate(published)]
    slot = -1
    for j, r in enumerate(others):
        k = bisect.bisect_left(ages, _age(r))  # published rows strictly older than r
        slot = max(slot, newest_below[k - 1] if k else -1)
        keyed.append(((slot, 1, j), r))
    keyed.sort(key=lambda kr: kr[0], reverse=True)
    return [r for _k, r in keyed]


def select_kept(rows: Iterable[SnapRow], rule: Retention | None, now: float) -> set[bytes]:
    return set(explain_kept(rows, rule, now))


def explain_kept(rows: Iterable[SnapRow], rule: Retention | None, now: float) -> dict[bytes, list[str]]:
    """root -> the rules that keep it (`gc --dry-run` prints them), for the kept ones only."""
    rows = list(rows)
    if rule is None:
        return {r.root: ["no retention rule"] for r in rows}
    why: dict[bytes, list[str]] = {}

    def keep(rule_name: str, roots) -> None:
        for root in roots:
            why.setdefault(root, []).append(rule_name)

    newest_first = newest_first_order(rows)
    if rule.keep_last:
        keep(f"last {rule.keep_last}", (r.root for r in newest_first[: rule.keep_last]))
    if rule.keep_best:
        cands = []
        for r in newest_first:
            v = r.metrics.get(rule.metric)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v):
                cands.append(r)
        sign = 1 if rule.mode == "min" else -1
        # sorted() is stable and cands is newest first, so ties go to the newer snapshot.
        cands.sort(key=lambda r: sign * r.metrics[rule.metric])
        keep(f"best {rule.keep_best} by {rule.metric} ({rule.mode})",
             (r.root for r in cands[: rule.keep_best]))
    if rule.keep_every_steps:
        first: dict[int, SnapRow] = {}
        for r in sorted(rows, key=lambda r: (r.step if r.step is not None else 0, r.time)):
            if r.step is None:
                continue
            first.setdefault(r.step // rule.keep_every_steps, r)
        keep(f"one per {rule.keep_every_steps} steps", (r.root for r in first.values()))
    if rule.max_age_days is not None:
        cutoff = now - rule.max_age_days * 86400.0
        keep(f"younger than {rule.max_age_days:g} days", (r.root for r in rows if r.time >= cutoff))
    return why
