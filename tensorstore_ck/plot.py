"""`tsck du --plot FILE.png`: a picture of the store from usage.usage()'s numbers.

Left: per job, over commit time, the logical bytes its kept snapshots hold (solid) and
the bytes its commits wrote to storage (dashed): the gap between them is what dedup
and compression saved. Right: per job, the stored bytes of the blocks it references,
split into those only it references (what deleting it would free) and those it shares.
matplotlib is an optional extra (`pip install 'tensorstore_ck[plot]'`).
"""

from __future__ import annotations

import datetime as _dt
import os

from .errors import InvalidArgument, TsckError, storage_error
from .localfile import write_atomic

__all__ = ["plot_usage", "require_matplotlib", "FORMATS"]

FORMATS = (".png", ".svg", ".pdf")
MAX_LINES = 10  # jobs drawn over time (the largest by logical bytes); a sweep may have hundreds
MAX_BARS = 25   # jobs in the bar chart (the most freed if deleted)


def _units(n: float) -> tuple[float, str]:
    for i, unit in enumerate(("B", "KB", "MB", "GB", "TB", "PB")):
        if n < 1000 ** (i + 1) or unit == "PB":
            return 1000 ** i, unit
    return 1, "B"  # pragma: no cover


def _human(n: float) -> str:
    scale, unit = _units(abs(n))
    return f"{n / scale:.0f} {unit}" if unit == "B" else f"{n / scale:.2f} {unit}"


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
    lined = sorted(jobs, key=lambda j: (-max(jobs[j]["logical"], default=0), j))[:MAX_LINES]
    names = sorted(jobs, key=lambda j: (-jobs[j]["only_bytes"], -jobs[j]["held_bytes"], j))[:MAX_BARS]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, max(5.0, 0.45 * len(names) + 2.5)),
                                 gridspec_kw={"width_ratios": [3, 2]})
    top = max([max(j["logical"], default=0) for j in jobs.values()] + [1])
    scale, unit = _units(top)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, job in enumerate(lined):
        j = jobs[job]
        if not j["times"]:
            continue
        c = colors[n % len(colors)]
        t = [_dt.datetime.fromtimestamp(x, _dt.timezone.utc) for x in j["times"]]
        ax.step(t, [v / scale for v in j["logical"]], where="post", color=c, marker="o", markersize=3,
                label=f"{job} logical")
        est = f" (~{j['estimated']} est.)" if j["estimated"] else ""
        ax.step(t, [v / scale for v in j["written"]], where="post", color=c, linestyle="--", marker="o",
                markersize=4, mfc="white", label=f"{job} physical (written){est}")
        if len(t) == 1:
            ax.plot(t, [j["logical"][0] / scale], "o", color=c)
            ax.plot(t, [j["written"][0] / scale], "o", color=c, mfc="none")
    more = f" ({len(lined)} largest of {len(jobs)} jobs)" if len(jobs) > len(lined) else ""
    ax.set_title(f"logical (solid) vs physical written (dashed), per job{more}")
    ax.set_ylabel(unit)
    ax.set_xlabel("commit time (UTC)")
    ax.grid(True, alpha=0.3)
    loc = mdates.AutoDateLocator(tz=_dt.timezone.utc)
    ax.xaxis.set_major_locator(loc)
    ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(loc, tz=_dt.timezone.utc))
    ax.set_ylim(bottom=0)
    if lined:
        ax.legend(fontsize="small", loc="upper left")

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
    bx.legend(fontsize="small", loc="lower right")
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
