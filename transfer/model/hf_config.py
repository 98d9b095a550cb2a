"""Typed reads of a checkpoint's config.json fields, under any of their spellings
(transformers renames some fields on save: num_experts_per_tok -> num_experts_per_token)."""

from __future__ import annotations

from typing import Any

from transfer.errors import InvalidInput

_MISSING = object()


def field(config: dict, *names: str, default: Any = _MISSING, kind: type | tuple = object) -> Any:
    """The value of the first of `names` present (and not null) in `config`; `default` when
    none is, else InvalidInput. A value that is not a `kind` raises InvalidInput naming it."""
    for name in names:
        value = config.get(name)
        if value is None:
            continue
        if isinstance(value, bool) and kind in (int, float, (int, float)):
            raise InvalidInput(f"config: field {name!r} must be a number, got {value!r}")
        if not isinstance(value, kind):
            expected = getattr(kind, "__name__", None) or "/".join(k.__name__ for k in kind)
            raise InvalidInput(f"config: field {name!r} must be {expected}, got {value!r}")
        return value
    if default is _MISSING:
        raise InvalidInput(f"config: missing field {' / '.join(repr(n) for n in names)}")
    return default
