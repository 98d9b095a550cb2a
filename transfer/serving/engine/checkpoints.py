"""Where a prompt's state checkpoints go: the prefix cache's policy.

A checkpoint is the S&Conv of every linear layer after exactly `p` prompt tokens. The
chunked scans cut a sequence into chunks counted from its first token, and a chunk's
arithmetic depends only on its tokens and the state entering it. So a prompt stopped at a
multiple of the scan chunk and continued from the saved state runs the same operations on
the same values as one that never stopped: a prefix hit gives the bits of a fresh prefill.
Positions are therefore multiples of `PREFIX_UNIT`, the scan chunk, whatever the KV block
size: a hit that ends inside a block copies that block's rows (copy on write).

Memory against recompute: each checkpoint slot costs one request's state. Checkpoints at
prompt ends only (the default) serve multi-turn chat, where turn N+1 extends turn N; an
interval also serves prompts that share a long document but diverge inside it, and bounds
the recompute of a hit that ends between checkpoints to one interval, at one slot per
interval of every long prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_STATE_CHECKPOINTS = 16  # serve --state-checkpoints
SCAN_CHUNK_ALIGN = 64  # the largest scan chunk (Triton's); the CPU path's 32 divides it
# The prefill prefix cache's hashing and match unit, and the checkpoint spacing: a prompt
# sharing T tokens with a cached one reuses PREFIX_UNIT * floor(T / PREFIX_UNIT) of them.
PREFIX_UNIT = SCAN_CHUNK_ALIGN


def checkpoint_positions(num_tokens: int, cached_tokens: int, interval: int = 0) -> list[int]:
    """Where a prompt of `num_tokens` whose first `cached_tokens` are a prefix hit saves
    its state: the last multiple of `PREFIX_UNIT` in the prompt and, with an `interval` (a
    multiple of it), every multiple of the interval; only positions after the hit."""
    last = num_tokens // PREFIX_UNIT * PREFIX_UNIT
    positions = set(range(interval, last + 1, interval)) if interval else set()
    if last:
        positions.add(last)
    return sorted(p for p in positions if p > cached_tokens)


def checkpoint_stops(unit_hashes: Sequence[bytes], positions: Sequence[int]) -> dict[int, bytes]:
    """Each position -> the hash of the `PREFIX_UNIT`-token unit it ends."""
    return {p: unit_hashes[p // PREFIX_UNIT - 1] for p in positions}
