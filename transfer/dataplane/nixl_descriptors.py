"""The NIXL backend's descriptor arithmetic, free of NIXL: an arena viewed as a list of
`granule`-byte descriptors, the index arrays that name a batch's granules in those lists,
and the per-range descriptors of a batch the lists do not serve.

Posting through the prepared lists costs per granule, building descriptors costs per range;
measured, they break even at about two granules per range (docs/dataplane.md)."""

from __future__ import annotations

import numpy as np

from transfer.dataplane.ranges import RangeBatch

MAX_PREPPED_DESCRIPTORS = 1 << 18
MIN_GRANULE = 4096
MAX_GRANULES_PER_RANGE = 2


def auto_granule(arena_bytes: int) -> int:
    """The smallest power of two >= 4 KiB that keeps a prepared list within 2^18 entries."""
    granule = MIN_GRANULE
    while arena_bytes // granule > MAX_PREPPED_DESCRIPTORS:
        granule *= 2
    return granule


def is_granule_option(granule: object) -> bool:
    """ "auto", 0 (always build descriptors per transfer) or a power of two >= 4096."""
    if granule == "auto":
        return True
    if not isinstance(granule, int) or isinstance(granule, bool):
        return False
    return granule == 0 or (granule >= MIN_GRANULE and granule & (granule - 1) == 0)


def descriptors(
    base: int, offsets: np.ndarray, nbytes: np.ndarray, device_index: int
) -> np.ndarray:
    """uint64 [N, 3] (address, length, device id), the form NIXL reads without a Python loop."""
    descs = np.empty((len(offsets), 3), dtype=np.uint64)
    descs[:, 0] = offsets.astype(np.uint64) + np.uint64(base)
    descs[:, 1] = nbytes
    descs[:, 2] = device_index
    return descs


def granule_descriptors(base: int, nbytes: int, granule: int, device_index: int) -> np.ndarray:
    """uint64 [nbytes // granule, 3]: the whole granules of the span at `base`, in order."""
    count = nbytes // granule
    offsets = np.arange(count, dtype=np.int64) * granule
    return descriptors(base, offsets, np.full(count, granule, dtype=np.int64), device_index)


def granule_indices(
    offsets: np.ndarray, counts: np.ndarray, total: int, granule: int
) -> np.ndarray:
    """int32 [total]: the granule indices covering each range, ranges in order. `counts[i]`
    is range i's length in granules; `total` their sum."""
    firsts = offsets // granule
    if total == len(counts):
        return firsts.astype(np.int32)
    run_starts = np.cumsum(counts) - counts
    step = np.arange(total, dtype=np.int64) - np.repeat(run_starts, counts)
    return (np.repeat(firsts, counts) + step).astype(np.int32)


def serves_prepped(granule: int, local_bytes: int, remote_bytes: int, ranges: RangeBatch) -> bool:
    """Whether prepared granule lists of a `local_bytes` arena and a `remote_bytes` one serve
    `ranges`: every range is whole granules inside both lists, and few enough granules that
    the index list is the cheaper post."""
    if not granule or remote_bytes < granule or local_bytes < granule:
        return False
    if ranges.total_bytes > MAX_GRANULES_PER_RANGE * granule * len(ranges):
        return False
    if ((ranges.local | ranges.remote | ranges.nbytes) & (granule - 1)).any():
        return False
    local_limit = local_bytes // granule * granule
    remote_limit = remote_bytes // granule * granule
    return bool(
        (ranges.local + ranges.nbytes).max() <= local_limit
        and (ranges.remote + ranges.nbytes).max() <= remote_limit
    )
