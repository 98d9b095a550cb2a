"""`make_transport(name, agent_name, **options)`: one door to every backend."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from transfer.dataplane.transport import Transport
from transfer.errors import InvalidInput

BACKENDS = ("nixl", "ucx", "local")
DEFAULT_BACKEND = "nixl"

# backend -> (module, class, the package it needs, how to install that package)
_SPECS = {
    "nixl": ("transfer.dataplane.nixl", "NixlTransport", "nixl", "pip install nixl"),
    "ucx": ("transfer.dataplane.ucx", "UcxTransport", "ucxx", "pip install 'pdxfer[ucx]'"),
    "local": ("transfer.dataplane.local", "LocalTransport", None, None),
}


def _load(backend: str) -> type:
    """The backend's class; ImportError saying what to install if its package is missing."""
    module_name, class_name, package, install = _SPECS[backend]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = exc.name or ""
        if package is None or not (missing == package or missing.startswith(package + ".")):
            raise
        raise ImportError(
            f"transport backend {backend!r} needs the {package!r} package ({exc}); "
            f"install it with: {install}"
        ) from exc
    return getattr(module, class_name)


def make_transport(name: str, agent_name: str, **options: Any) -> Transport:
    """Build a transport. `name` is one of BACKENDS; `options` go to the backend:
    nixl: granule, num_threads; ucx: tls, net_devices; local: none."""
    if name not in _SPECS:
        raise InvalidInput(
            f"backend: unknown transport {name!r} (choose from {', '.join(BACKENDS)})"
        )
    cls = _load(name)
    known = [p for p in inspect.signature(cls).parameters if p != "agent_name"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise InvalidInput(
            f"options: {', '.join(unknown)} not understood by backend {name!r} "
            f"(it takes: {', '.join(known) or 'no options'})"
        )
    return cls(agent_name, **options)
