"""`tsck du --plot FILE.png`: a picture of the store from usage.usage()'s numbers.

Left: the store over time (usage.physical_over_time): its physical size (stored block
bytes, solid), what was written in all (dashed: physical plus what gc reclaimed, the
shaded band) and the logical bytes the kept snapshots hold (dotted: the gap down to
the physical line is what dedup and compression save). Legends sit below the axes,
clear of the data. Right: per job, the stored bytes of the blocks it references,
split into those only it references (what deleting it would free) and those it shares.
matplotlib is an optional extra (`pip install 'tensorstore_ck[plot]'`).
"""

from __future__ import annotations

import datetime as _dt
import os

from ..errors import InvalidArgument, TsckError, storage_error
from ..util.localfile import write_atomic
from ..util.units import human_bytes, unit_for

__all__ = ["plot_usage", "left_panel", "require_matplotlib", "FORMATS"]

FORMATS = (".png", ".svg", ".pdf")
MAX_BARS = 25   # jobs in the bar chart (the most freed if deleted)


def _units(n: float) -> tuple[float, str]:
    return unit_for(n)


_human = human_bytes


def require_matplotlib():
    """(pyplot, matplotlib.dates); InvalidArgument saying how to install them if missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed, none opened
        import matplotlib.dates
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidArgument("tsck du --plot needs matplotlib: pip install 'tensorstore_ck[plot]'") from None
    return plt, matplotlib.dates


def left_panel(u: dict) -> dict:
    """What the left panel draws, all from usage()["physical"] (usage.physical_over_time):
    times, stored (the physical line), written (stored + reclaimed, the dashed line; the
    band between them is what gc reclaimed), logical, gcs."""
    p = u.get("physical") or {}
    return {k: list(p.get(k, [])) for k in ("times", "stored", "written", "reclaimed", "logical")} | \
        {"gcs": p.get("gcs", 0)}


def plot_usage(u: dict, dest, *, force: bool = True) -> str:
    """Draw usage(store)'s numbers into `dest` (.png, .svg or .pdf), written whole or not
    at all (a temporary file beside it, then renamed). -> the absolute path."""
    dest = os.path.abspath(os.fspath(dest))
    ext = os.path.splitext(dest)[1].lower()
    if ext not in FORMATS:
        raise InvalidArgument(f"--plot writes {', '.join(FORMATS)} files, not {os.path.basename(dest)!r}")
    if not os.path.isdir(os.path.dirname(dest)):
        raise InvalidArgument(f"cannot write {dest}: no directory {os.path.dirname(dest)}")
    plt, mdates = require_matplotlib()
    jobs = u["jobs"]
    names = sorted(jobs, key=lambda j: (-jobs[j]["only_bytes"], -jobs[j]["held_bytes"], j))[:MAX_BARS]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, max(5.5, 0.45 * len(names) + 3.0)),
                                 gridspec_kw={"width_ratios": [3, 2]})
    drawn = left_panel(u)
    top = max(drawn["written"] + drawn["logical"] + [1])
    scale, unit = _units(top)
    if drawn["times"]:
        t = [_dt.datetime.fromtimestamp(x, _dt.timezone.utc) for x in drawn["times"]]
        ax.step(t, [v / scale for v in drawn["logical"]], where="post", color="#1f77b4", linestyle=":",
                label="logical: what the kept snapshots hold")
        ax.step(t, [v / scale for v in drawn["written"]], where="post", color="#7f7f7f", linestyle="--",
                label="written in all (stored + reclaimed)")
        runs = f"{drawn['gcs']} run{'' if drawn['gcs'] == 1 else 's'} on record"
        ax.fill_between(t, [v / scale for v in drawn["stored"]], [v / scale for v in drawn["written"]],
                        step="post", color="#2ca02c", alpha=0.25, label=f"reclaimed by gc ({runs})")
        ax.step(t, [v / scale for v in drawn["stored"]], where="post", color="#d62728", marker="o", markersize=3,
                label="physical: the store's stored block bytes")
    ax.set_title("the store's size over time")
    ax.set_ylabel(unit)
    ax.set_xlabel("commit or gc time (UTC)")
    ax.grid(True, alpha=0.3)
    loc = mdates.AutoDateLocator(tz=_dt.timezone.utc)
    ax.xaxis.set_major_locator(loc)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(loc, tz=_dt.timezone.utc))
    ax.set_ylim(bottom=0)
    if drawn["times"]:  # below the axes: never over the data
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)

    hscale, hunit = _units(max([j["held_bytes"] for j in jobs.values()] + [1]))
    ys = range(len(names))
    only = [jobs[j]["only_bytes"] / hscale for j in names]
    shared = [(jobs[j]["held_bytes"] - jobs[j]["only_bytes"]) / hscale for j in names]
    bx.barh(ys, only, color="#d62728", label="only this job: freed if deleted")
    bx.barh(ys, shared, left=only, color="#7f7f7f", label="shared with other jobs")
    for y, job in zip(ys, names):
        bx.text(only[y] + shared[y], y, f"  frees {_human(jobs[job]['only_bytes'])}", va="center",
                fontsize="small")
    bx.set_yticks(list(ys), names)
    bx.invert_yaxis()
    bx.set_xlabel(f"stored block bytes ({hunit})")
    more = f" ({len(names)} of {len(jobs)} jobs)" if len(jobs) > len(names) else ""
    bx.set_title(f"what deleting each job would free{more}")
    bx.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1, frameon=False)
    bx.margins(x=0.35)
    ratio = u["logical_bytes"] / u["block_bytes"] if u["block_bytes"] else 0
    fig.suptitle(f"{u['store']}: {_human(u['logical_bytes'])} logical in {_human(u['block_bytes'])} of blocks"
                 + (f" (dedup {ratio:.2f}x)" if ratio else ""))
    fig.tight_layout()
    try:
        write_atomic(dest, lambda tmp: fig.savefig(tmp, format=ext[1:], dpi=110), force=force)
    except TsckError:
        raise
    except OSError as e:
        raise storage_error(e, f"writing {dest}") from e
    finally:
        plt.close(fig)
    return dest
