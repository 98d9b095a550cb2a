"""bench serve's CPU figures count a process's children (a serving process's TP ranks)."""

from __future__ import annotations

import os
import subprocess
import sys

from transfer.bench.proc_cpu import tree_cpu_seconds

BURN = """
import sys, time
while time.process_time() < 0.3:
    pass
print("burnt", flush=True)
sys.stdin.read()
"""


def test_a_child_s_cpu_time_counts_towards_its_parent_s_tree():
    alone = tree_cpu_seconds(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "burnt"
        assert tree_cpu_seconds(child.pid) >= 0.25  # /proc counts in clock ticks
        assert tree_cpu_seconds(os.getpid()) - alone >= 0.25  # /proc counts in clock ticks
    finally:
        child.communicate("", timeout=30)
