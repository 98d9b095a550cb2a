"""NIXL's Python package, worked around: the exceptions its bindings raise, and the two agent
settings it takes only through a global (the progress thread's delay) or the environment
(UCX's transport list)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from nixl import _api as nixl_api
from nixl import _bindings

# What NIXL's bindings raise when a call fails (a peer gone, a handle still busy, ...);
# anything else is a bug here and propagates.
NIXL_ERRORS = (
    _bindings.nixlBackendError,
    _bindings.nixlCancelledError,
    _bindings.nixlInvalidParamError,
    _bindings.nixlMismatchError,
    _bindings.nixlNotAllowedError,
    _bindings.nixlNotFoundError,
    _bindings.nixlNotPostedError,
    _bindings.nixlNotSupportedError,
    _bindings.nixlRemoteDisconnectError,
    _bindings.nixlRepostActiveError,
    _bindings.nixlUnknownError,
)


@contextlib.contextmanager
def progress_delay(delay_us: int) -> Iterator[None]:
    """NIXL's Python agent hard-codes a progress-thread delay of 0: the thread spins and
    takes a whole core per process even when idle (measured: 3.0 CPU-s in 3 s idle; 0.06
    at 100 us). Agents built inside this block get `delay_us` instead."""
    original = nixl_api.nixlBind.nixlAgentConfig

    class _Config(original):
        def __setattr__(self, name: str, value: Any) -> None:
            super().__setattr__(name, delay_us if name == "pthrDelay" else value)

    nixl_api.nixlBind.nixlAgentConfig = _Config
    try:
        yield
    finally:
        nixl_api.nixlBind.nixlAgentConfig = original


@contextlib.contextmanager
def ucx_tls(tls: str | None) -> Iterator[None]:
    """UCX_TLS set to `tls` (unless None) inside the block: NIXL passes UCX no transport list."""
    if tls is None:
        yield
        return
    saved = os.environ.get("UCX_TLS")
    os.environ["UCX_TLS"] = tls
    try:
        yield
    finally:
        if saved is None:
            del os.environ["UCX_TLS"]
        else:
            os.environ["UCX_TLS"] = saved


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def try_release(handle: Any) -> bool:
    try:
        handle.release()
        return True
    except NIXL_ERRORS:
        return False


def quietly(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except NIXL_ERRORS:
        logging.getLogger(__name__).debug("ignored error during close", exc_info=True)
