"""What every process pdxfer starts does about its parent: die with it, and (a serve
process) announce where it listens with one READY line on stdout, which the launcher
(`launch.procs`) waits for: `PDXFER-READY {"role": ..., "address": "host:port", ...}`."""

from __future__ import annotations

import json
import os
import signal

READY_PREFIX = "PDXFER-READY "


def ready_line(role: str, address: str, metrics_port: int, http_port: int | None = None) -> str:
    """The line a started `serve` prints; `http_port`: the port its HTTP front bound, when it
    has one (asked for as 0, it is known only here)."""
    info = {"role": role, "address": address, "metrics_port": metrics_port, "pid": os.getpid()}
    if http_port is not None:
        info["http_port"] = http_port
    return READY_PREFIX + json.dumps(info, sort_keys=True)


def die_with_parent(parent_pid: int | None = None) -> None:
    """SIGTERM this process when its parent exits (Linux prctl PR_SET_PDEATHSIG). With
    `parent_pid`, exit at once if that parent is already gone (it died before the prctl)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except (OSError, AttributeError):
        pass
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)
