"""Reading and writing quantities with units: bytes, bytes per second, counts like ``300e9``.

Bytes: ``80GiB``, ``80GB`` (10^9), ``512MiB``, or a plain number of bytes.
Rates: ``300GB/s`` (bytes), ``200gbps`` / ``200Gb/s`` (bits), or a plain number of bytes/s.
Counts: ``300e9``, ``300B``, ``1.5M``, ``4096``.
"""
from __future__ import annotations

import re

from shardwise.planner.errors import PlanError

_BYTE_UNITS = {
    "": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_COUNT_UNITS = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z/]*)\s*$"


def _split(text: str, field: str, what: str) -> tuple[float, str]:
    """Split ``'80GiB'`` into ``(80.0, 'GiB')``; reject anything that is not number + unit."""
    match = re.fullmatch(_NUMBER, str(text))
    if match is None:
        raise PlanError(field, text, f"is not {what}", f"write {what}, e.g. {_EXAMPLES[what]}")
    return float(match.group(1)), match.group(2)


_EXAMPLES = {"a size": "80GiB", "a rate": "300GB/s or 200gbps", "a count": "300e9 or 300B"}


def parse_bytes(text: str, field: str) -> int:
    """``'80GiB'`` -> 85899345920; ``'40GB'`` -> 40000000000."""
    value, unit = _split(text, field, "a size")
    scale = _BYTE_UNITS.get(unit.lower())
    if scale is None or value <= 0:
        raise PlanError(field, text, "is not a positive size", "write e.g. 80GiB, 40GB or 1e9")
    return int(value * scale)


_RATE_UNITS = {  # bytes per second per unit; bit units divide by 8
    "": 1, "b/s": 1, "kb/s": 1e3, "mb/s": 1e6, "gb/s": 1e9, "tb/s": 1e12,
    "kib/s": 2**10, "mib/s": 2**20, "gib/s": 2**30,
    "mbps": 1e6 / 8, "gbps": 1e9 / 8, "tbps": 1e12 / 8,
}


def parse_rate(text: str, field: str) -> float:
    """Bytes per second from ``'300GB/s'`` (bytes), ``'200gbps'`` (bits), ``'25e9'`` (bytes/s)."""
    value, unit = _split(text, field, "a rate")
    scale = _RATE_UNITS.get(unit.lower())
    if scale is None or value <= 0:
        raise PlanError(field, text, "is not a positive rate",
                        "write bytes per second as 300GB/s, or bits per second as 200gbps")
    return value * scale


def parse_count(text: str, field: str) -> float:
    """``'300e9'`` or ``'300B'`` -> 3e11 (B = billion here, not bytes)."""
    value, unit = _split(text, field, "a count")
    scale = _COUNT_UNITS.get(unit.lower())
    if scale is None or value <= 0:
        raise PlanError(field, text, "is not a positive count", "write e.g. 300e9, 300B or 1.5M")
    return value * scale


def fmt_bytes(n: float) -> str:
    """Binary units, three significant figures: ``fmt_bytes(2**31) == '2.00 GiB'``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}" if n / scale >= 100 else f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_seconds(s: float) -> str:
    """Seconds in the largest sensible unit: ``'825 years'``, ``'33.5 days'``, ``'4.2 h'``,
    ``'12.3 s'``, ``'850 ms'``."""
    if s >= 2 * 365.25 * 86400:
        return f"{s / (365.25 * 86400):.3g} years"
    if s >= 2 * 86400:
        return f"{s / 86400:.1f} days"
    if s >= 2 * 3600:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.3g} ms"


def fmt_count(n: float) -> str:
    """Large counts the way papers write them: ``fmt_count(3e11) == '300B'``, ``'1.5M'``."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n:.4g}"
