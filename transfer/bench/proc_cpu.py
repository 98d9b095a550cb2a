"""CPU time of a process and everything it started, from /proc (Linux): what a serving
process costs per generated token, its rank processes included, and what the process
costs alone (its engine, gRPC and transfer control, without the model's forward)."""

from __future__ import annotations

import os
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime (seconds) of `pid` and its live descendants; 0.0 off Linux. A child
    that exited meanwhile drops out, so read before and after a span that starts none."""
    stats = _stats()
    children: dict[int, list[int]] = {}
    for child, (parent, _) in stats.items():
        children.setdefault(parent, []).append(child)
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        if current in stats:
            total += stats[current][1]
        todo.extend(children.get(current, ()))
    return total


def process_cpu_seconds(pid: int) -> float:
    """utime + stime (seconds) of `pid` alone, its children left out; 0.0 when it is gone
    or off Linux."""
    found = _stat(Path("/proc") / str(pid))
    return found[1] if found is not None else 0.0


def _stats() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds) of every process readable in /proc."""
    found = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit() and (stat := _stat(entry)) is not None:
            found[int(entry.name)] = stat
    return found


def _stat(entry: Path) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of the process at /proc/`entry`; None when unreadable."""
    try:
        # fields after the command name, which may hold spaces: state ppid ... utime stime
        fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS_PER_S
