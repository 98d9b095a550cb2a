"""Byte sizes for humans: parse `80GiB` / `256MiB` / `1e9`, and print them back."""

from __future__ import annotations

import re

from transfer.errors import InvalidInput

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_size(text: str, field: str = "size") -> int:
    """`80GiB` -> 85899345920. Raises InvalidInput naming `field` on bad input."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise InvalidInput(f"{field}: cannot parse {text!r} (examples: 80GiB, 512MiB, 1e9)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise InvalidInput(f"{field}: must be positive, got {text!r}")
    return value


def format_bytes(n: float) -> str:
    """1048576 -> '1.00 MiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
