"""Human sizes and rates: "96GiB", "1.5TB", "97,887 MiB", "1229GB/s".

One vocabulary for the whole program, so that a size typed on the command line, written in
a description file or printed in a plan means the same thing everywhere.

Conventions:

* ``KB MB GB TB PB`` are decimal (powers of 1000), as on a disk or a datasheet.
* ``KiB MiB GiB TiB PiB`` are binary (powers of 1024), as a driver or ``free`` reports.
* A bare ``K M G T P`` (no ``B``) is binary, as in ``docker -m 96G``, ``numactl`` and
  ``ulimit``: people who type it mean memory the way their tools count it.
* Letter case does not matter; nobody sizes memory in bits.
* Sizes are printed in GiB (the unit drivers and ``nvidia-smi`` use for memory) and rates in
  decimal GB/s (the unit memory and PCIe bandwidth are quoted in).
"""

from __future__ import annotations

import math
import re

from hybridmoe.backend.errors import UsageError

__all__ = ["UnitError", "parse_bytes", "parse_rate", "fmt_bytes", "fmt_rate"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_MULTIPLIERS = {
    "": 1,
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "kib": KiB,
    "mib": MiB,
    "gib": GiB,
    "tib": TiB,
    "pib": 1024**5,
    "k": KiB,
    "m": MiB,
    "g": GiB,
    "t": TiB,
    "p": 1024**5,
}

# A number with an optional fraction; thousands may be grouped with commas ("97,887") or
# underscores ("1_000"), but "1,5" is refused because it reads as a decimal comma.
_NUMBER = r"(?P<number>(?:\d{1,3}(?:,\d{3})+|\d[\d_]*)(?:\.\d*)?|\.\d+)"
_SIZE_RE = re.compile(rf"^\s*(?P<sign>[-+]?)\s*{_NUMBER}\s*(?P<unit>[a-z]*)\s*$", re.IGNORECASE)
# "/s", "/sec", "ps" ("GBps") mark a rate; they are optional because the context already
# says a rate is meant.
_PER_SECOND_RE = re.compile(r"\s*(?:/\s*s(?:ec(?:ond)?)?|ps)\s*$", re.IGNORECASE)

_UNIT_HELP = "use a number with a unit such as 96GiB, 97887MiB, 1.5TB or 768G"
_RATE_HELP = "use a number with a unit such as 1229GB/s, 1.2TB/s or 400GiB/s"


class UnitError(UsageError, ValueError):
    """A size or rate that cannot be read. Also a ``ValueError`` for generic callers."""


def _parse(text: str, kind: str, hint: str) -> float:
    match = _SIZE_RE.match(text)
    if not match:
        raise UnitError(f"cannot read {kind} {text!r}", hint)
    unit = match["unit"].lower()
    if unit not in _MULTIPLIERS:
        raise UnitError(f"unknown unit {match['unit']!r} in {kind} {text!r}", hint)
    if match["sign"] == "-":
        raise UnitError(f"{kind} {text!r} is negative", hint)
    number = float(match["number"].replace(",", "").replace("_", ""))
    return number * _MULTIPLIERS[unit]


def parse_bytes(value: str | int | float) -> int:
    """Bytes from ``"96GiB"``, ``"1.5TB"``, ``"97,887 MiB"`` or a plain number of bytes.

    Raises ``UnitError`` (a ``UsageError`` and a ``ValueError``) for text that is not a
    size or is negative. Zero is accepted; whether it makes sense is the caller's call.
    """
    if isinstance(value, bool):  # bool is an int; True bytes is never what was meant
        raise UnitError(f"cannot read size {value!r}", _UNIT_HELP)
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise UnitError(f"size {value!r} is not a non-negative number of bytes", _UNIT_HELP)
        return round(value)
    if not isinstance(value, str):
        raise UnitError(f"cannot read size {value!r}", _UNIT_HELP)
    if _PER_SECOND_RE.search(value):
        raise UnitError(f"{value!r} is a rate, not a size", _UNIT_HELP)
    return round(_parse(value, "size", _UNIT_HELP))


def parse_rate(value: str | int | float) -> float:
    """Bytes per second from ``"1229GB/s"``, ``"1.2 TB/s"``, ``"400GiB/s"`` or a plain number."""
    if isinstance(value, bool):
        raise UnitError(f"cannot read rate {value!r}", _RATE_HELP)
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise UnitError(f"rate {value!r} is not a non-negative number of bytes/s", _RATE_HELP)
        return float(value)
    if not isinstance(value, str):
        raise UnitError(f"cannot read rate {value!r}", _RATE_HELP)
    return _parse(_PER_SECOND_RE.sub("", value), "rate", _RATE_HELP)


def fmt_bytes(n: int | float | None) -> str:
    """``"95.6 GiB"``; below 1 GiB the next unit down (``"68.6 KiB"``); None is ``"unknown"``."""
    if n is None:
        return "unknown"
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:,.1f} {unit}"
    return f"{sign}{n:,.0f} B"


def fmt_rate(bytes_per_s: float | None) -> str:
    """``"1,228.8 GB/s"`` (decimal, as bandwidth is quoted); None is ``"unknown"``."""
    if bytes_per_s is None:
        return "unknown"
    # GB/s even for HBM: "1,228.8 GB/s" next to "4,800.0 GB/s" compares at a glance.
    for unit, size in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if abs(bytes_per_s) >= size:
            return f"{bytes_per_s / size:,.1f} {unit}"
    return f"{bytes_per_s:,.0f} B/s"
