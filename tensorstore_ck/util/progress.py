"""Progress bars on stderr for long work (gc, fsck, recover, put and checkout from the
CLI): asked for only when stderr is a terminal. Bytes where bytes are known, so one
big snapshot moves the bar as its blocks are done."""

from __future__ import annotations

__all__ = ["progress_bar"]


def progress_bar(enabled: bool, desc: str, total=None, unit: str = "obj"):
    """A progress bar on stderr (the CLI asks for one only on a terminal); unit "B"
    counts bytes, so one big snapshot moves the bar as its blocks are done, shown in
    decimal SI units as every size is (units.py: kB, MB, GB; 1 MB = 1e6 B)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return None
    if unit == "B":
        return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, leave=False,
                    dynamic_ncols=True, bar_format="{l_bar}{bar}| {n_fmt}B/{total_fmt}B "
                                                   "[{elapsed}<{remaining}, {rate_fmt}{postfix}]")
    return tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True)
