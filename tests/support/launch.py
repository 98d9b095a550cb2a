"""Running `pdxfer launch` as a child process, and checking that none of its processes survive."""

from __future__ import annotations

import os
import time
from pathlib import Path

from transfer.serving.launch.procs import LAUNCH_ID_ENV

ROOT = Path(__file__).resolve().parents[2]
# The CLI as a terminal's foreground job runs it, so that a test's SIGINT is its Ctrl-C. A
# test run started as a background job of a non-interactive shell (`make test &`, some CI
# runners) passes SIGINT down ignored, and Python then never raises KeyboardInterrupt; so
# the child puts Python's own SIGINT handler back first.
MAIN = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from transfer.cli import main; sys.exit(main())"
)


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


def signal_report(pid: int) -> str:
    """Why a process might not act on a signal, from /proc: its pending, blocked, ignored
    and caught masks, and each thread's name, state and kernel wait."""
    base = Path("/proc") / str(pid)
    try:
        status = (base / "status").read_text().splitlines()
    except OSError as exc:
        return f"pid {pid}: {exc}"
    lines = [
        line
        for line in status
        if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt"))
    ]
    for task in sorted((base / "task").iterdir(), key=lambda t: int(t.name)):
        try:
            stat = (task / "stat").read_text()
            wchan = (task / "wchan").read_text()
        except OSError:
            continue
        name, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
        lines.append(f"thread {task.name} {name!r} {state} {wchan}")
    return "\n".join(lines)


def assert_no_leftovers(launch_id: str, wait_s: float = 10.0) -> None:
    deadline = time.monotonic() + wait_s
    while (left := processes_with_env(LAUNCH_ID_ENV, launch_id)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes of the launch run survived it: {left}"
