"""Fragment a pool the way a long-running server does, so benchmarks and tests can place a
request in the holes (`pdxfer bench transfer --hole-blocks`, the packer's property tests)."""

from __future__ import annotations

import random

from transfer.cache.pools import BlockPool, SlotPool
from transfer.errors import InvalidInput


def fragment(
    pool: BlockPool | SlotPool,
    rng: random.Random,
    fill: float = 0.7,
    keep: float = 0.5,
    max_request_blocks: int = 8,
) -> list[list[int]]:
    """Fill the pool to ~`fill` with random requests, then free all but ~`keep` of them.

    Later allocations land in the holes, as in a long-running server. Returns the
    allocations still held (free them to restore the pool)."""
    if not 0.0 <= fill <= 1.0 or not 0.0 <= keep <= 1.0:
        raise InvalidInput(f"fill and keep must be in [0, 1], got {fill}, {keep}")
    held: list[list[int]] = []
    target = pool.num_total * (1.0 - fill)
    while pool.num_free > target:
        if isinstance(pool, BlockPool):
            held.append(pool.allocate(rng.randint(1, min(max_request_blocks, pool.num_free))))
        elif pool.can_allocate():
            held.append(pool.allocate())
        else:
            break
    kept = []
    for ids in held:
        if rng.random() < keep:
            kept.append(ids)
        else:
            pool.free(ids)
    return kept
