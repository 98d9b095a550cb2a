"""One lock per object: a method decorator for classes whose state `self._lock` guards."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


def locked(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run `method` holding `self._lock` (an RLock where locked methods call each other)."""

    @functools.wraps(method)
    def run_locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return run_locked
