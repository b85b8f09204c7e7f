"""Sizes as people read them: one system everywhere a size is shown (CLI text, progress
bars, log lines, messages). Decimal SI units: 1 kB = 1000 B, 1 MB = 1e6 B, 1 GB = 1e9 B,
1 TB = 1e12 B, 1 PB = 1e15 B (the benches' GB too). Exact counts stay in bytes
(--json, SnapshotInfo, reports)."""

from __future__ import annotations

__all__ = ["UNITS", "human_bytes", "unit_for"]

UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def unit_for(n: float) -> tuple[float, str]:
    """The unit a size of `n` bytes is shown in -> (bytes per unit, name)."""
    n = abs(n)
    for i, unit in enumerate(UNITS):
        if n < 1000 ** (i + 1) or unit == UNITS[-1]:
            return 1000 ** i, unit
    return 1, "B"  # pragma: no cover


def human_bytes(n) -> str:
    """12 B, 1.50 kB, 3.20 MB, ... ("-" for None)."""
    if n is None:
        return "-"
    scale, unit = unit_for(n)
    if unit == "B":
        return f"{n:.0f} B"
    # 999.996 kB rounds to "1000.00 kB": shown as the next unit instead
    if round(abs(n) / scale, 2) >= 1000 and unit != UNITS[-1]:
        scale, unit = scale * 1000, UNITS[UNITS.index(unit) + 1]
    return f"{n / scale:.2f} {unit}"
