"""keep_freed_memory: large CPU tensors come from the heap and stay there once freed."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import subprocess
import sys

import pytest

# A fresh interpreter per case: glibc's thresholds are process-wide and only rise.
PROBE = """
import ctypes, ctypes.util, json, sys
import torch
from transfer.serving.ranks.host_malloc import keep_freed_memory

FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
          "uordblks", "fordblks", "keepcost")

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
mapped_before = libc.mallinfo2().hblkhd
x = torch.empty(1 << 20).fill_(1.0)  # 4 MiB of activations
mapped = libc.mallinfo2().hblkhd - mapped_before
del x
print(json.dumps({"kept": kept, "mapped": mapped, "free_in_heap": libc.mallinfo2().fordblks}))
"""

MIB = 1 << 20


def _has_mallinfo2() -> bool:
    name = ctypes.util.find_library("c")
    return name is not None and hasattr(ctypes.CDLL(name), "mallinfo2")


def _probe(mode: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _has_mallinfo2(), reason="needs glibc >= 2.33 (mallinfo2)")
def test_large_tensors_reuse_the_heap_only_after_keep_freed_memory():
    default = _probe("default")
    assert default["mapped"] >= 4 * MIB  # glibc's own threshold: a fresh mapping per tensor
    kept = _probe("keep")
    assert kept["kept"] is True
    assert kept["mapped"] == 0
    assert kept["free_in_heap"] >= 4 * MIB  # freed, not handed back to the kernel
