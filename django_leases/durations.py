"""How a duration is written for an operator: one ladder of units for the admin, the
advisor and ``lease_report``, so that the same length never reads two ways."""

from __future__ import annotations

# (unit, seconds in it, the length below which it is the unit: twice the next one)
_UNITS = (("s", 1, 120), ("min", 60, 120 * 60), ("h", 3600, 48 * 3600), ("d", 86400, None))


def duration_text(seconds: float, *, precise: bool = False) -> str:
    """``seconds`` (its magnitude) in the largest unit it fills twice over: s, min, h, d.

    Whole units, rounded down, for an age or what is left of a lease (42 s, 3 min, 5 h,
    2 d); ``precise`` keeps a measured duration's digits (0.25 s, 4.5 s, 12 s, 16.5 min,
    2.0 h), which the advisor compares."""
    s = abs(seconds)
    unit, size = next((u, n) for u, n, below in _UNITS if below is None or s < below)
    value = s / size
    if not precise:
        return f"{int(value)} {unit}"
    if unit != "s":
        return f"{value:.1f} {unit}"
    if value < 1:
        return f"{value:.2g} {unit}"
    return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
