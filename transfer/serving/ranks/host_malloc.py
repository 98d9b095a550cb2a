"""Keep freed host memory in the process heap instead of handing it back to the kernel.

glibc serves any allocation over its mmap threshold (128 KiB, raised only by frees of
such blocks) with a fresh mmap and unmaps it on free, so every step of a CPU rank that
builds large activations page-faults and zeroes them again: 8-83 thousand minor faults
per prefill step of 8 to 32 prompts of the tiny Qwen3-Next (docs/benchmarks.md,
"Heap-kept activations on CPU ranks"). Raising both thresholds once makes those tensors
reuse heap memory, as a caching allocator would on a GPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt(3) parameters
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's largest accepted value on 64-bit hosts
TRIM_THRESHOLD_BYTES = 256 << 20


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process. False (and nothing
    changed) where the C library is not glibc or refuses a value."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    done = done and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    if not done:
        log.warning("mallopt refused the mmap/trim thresholds; large tensors keep page-faulting")
    return done
