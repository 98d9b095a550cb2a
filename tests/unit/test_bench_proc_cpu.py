"""bench serve's CPU figures: a process's tree counts its children (a serving process's TP
ranks); the process alone does not."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from transfer.bench.proc_cpu import process_cpu_seconds, tree_cpu_seconds

BURN = """
import sys, time
while time.process_time() < 0.3:
    pass
print("burnt", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def _burnt_child() -> Iterator[subprocess.Popen]:
    """A child that has used 0.3 s of CPU and waits, alive, until the block ends."""
    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "burnt"
        yield child
    finally:
        child.communicate("", timeout=30)


def test_a_child_s_cpu_time_counts_towards_its_parent_s_tree():
    alone = tree_cpu_seconds(os.getpid())
    with _burnt_child() as child:
        assert tree_cpu_seconds(child.pid) >= 0.25  # /proc counts in clock ticks
        assert tree_cpu_seconds(os.getpid()) - alone >= 0.25


def test_a_process_alone_leaves_its_child_s_cpu_time_out():
    alone = process_cpu_seconds(os.getpid())
    with _burnt_child() as child:
        assert process_cpu_seconds(child.pid) >= 0.25  # the child's own time is its own
        # this process only waited on a pipe meanwhile
        assert process_cpu_seconds(os.getpid()) - alone < 0.2


def test_a_process_that_is_gone_has_no_cpu_time():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    assert process_cpu_seconds(child.pid) == 0.0
