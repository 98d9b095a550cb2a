"""Running `pdxfer launch` as a child process, and checking that none of its processes survive."""

from __future__ import annotations

import os
import time
from pathlib import Path

from transfer.serving.launch.procs import LAUNCH_ID_ENV

ROOT = Path(__file__).resolve().parents[2]
MAIN = "import sys; from transfer.cli import main; sys.exit(main())"


def processes_with_env(key: str, value: str) -> list[int]:
    """Pids (Linux /proc) whose environment holds `key=value`: leftovers of a launch run."""
    needle = f"{key}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def assert_no_leftovers(launch_id: str, wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + wait_s
    while (left := processes_with_env(LAUNCH_ID_ENV, launch_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of the launch run survived it: {left}"
