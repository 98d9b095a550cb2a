"""CPU time of a process and everything it started, from /proc (Linux): what a serving
process costs per generated token, its rank processes included."""

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


def _stats() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds) of every process readable in /proc."""
    found = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            # fields after the command name, which may hold spaces: state ppid ... utime stime
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(entry.name)] = (
            int(fields[1]),
            (int(fields[11]) + int(fields[12])) / _TICKS_PER_S,
        )
    return found
