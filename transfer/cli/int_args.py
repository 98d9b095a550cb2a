"""Integer flags of the benchmark commands, checked with errors that name the flag."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from transfer.errors import InvalidInput


def positive_ints(text: str, flag: str, example: str) -> list[int]:
    """ "1,4,16" -> [1, 4, 16]; InvalidInput naming `flag` unless every value is >= 1."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise InvalidInput(f"{flag}: expected integers like {example}, got {text!r}") from None
    if not values or min(values) < 1:
        raise InvalidInput(f"{flag}: every value must be >= 1, got {text!r}")
    return values


def require_positive(args: argparse.Namespace, names: Iterable[str]) -> None:
    """InvalidInput naming the first flag among `names` (attribute names) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            raise InvalidInput(
                f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
            )
