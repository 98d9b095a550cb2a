"""The worker's half of `verify` (`digests` says what is digested and why).

Prefill, after the forward: each rank digests the units it holds of every request the step
finished and writes the table into that request's digest slot (registered memory, so decode
reads it with the cache). Decode: each rank reads every prefill rank's table of the request
into its landing buffer with the load, and once everything landed (staged pieces copied into
place) digests the units it holds where they landed. A unit that differs fails the load.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np
import torch

from transfer.cache.explicit_layout import ExplicitLayout
from transfer.errors import InvalidInput
from transfer.vllm.digests import (
    RequestCache,
    compute,
    decode_table,
    encode_table,
    mismatches,
    request_tag,
    table_bytes,
    unit_ranges,
)
from transfer.vllm.load_plan import CacheGroup
from transfer.vllm.metadata import DigestSpec, LoadSpec
from transfer.vllm.region_copies import RegionCopies

logger = logging.getLogger(__name__)

# Tests only: decode flips one landed byte of every load of this many tokens before checking
# it, so a test can watch verify fail a load (vLLM then recomputes the prompt).
CORRUPT_TOKENS_ENV = "PDXFER_VLLM_TEST_CORRUPT_TOKENS"


def digest_slot_bytes(layout: ExplicitLayout) -> int:
    """One digest slot of the rank: its table, 64-byte aligned."""
    return -(-table_bytes(layout) // 64) * 64


class RankVerifier:
    """One rank's digests; `layout` is the rank's own."""

    def __init__(
        self, groups: Sequence[CacheGroup], layout: ExplicitLayout, copies: RegionCopies
    ) -> None:
        self.groups = tuple(groups)
        self.layout = layout
        self.copies = copies
        corrupt = os.environ.get(CORRUPT_TOKENS_ENV, "").strip()
        self._corrupt_tokens = int(corrupt) if corrupt else 0

    def _cache(self, block_ids: Sequence[Sequence[int]], num_tokens: int) -> RequestCache:
        return RequestCache.of(self.groups, block_ids, self.layout.block_size, num_tokens)

    def write_table(self, spec: DigestSpec, slot: torch.Tensor) -> None:
        """Prefill: the request's table into `slot` (uint8, this rank's digest slot)."""
        digests = compute(self.copies, self.layout, self._cache(spec.block_ids, spec.num_tokens))
        table = encode_table(request_tag(spec.request_id, spec.num_tokens), digests)
        slot[: len(table)].copy_(torch.from_numpy(table))
        if slot.is_cuda:
            torch.cuda.synchronize(slot.device)

    def check(
        self, load: LoadSpec, prefill: Sequence[ExplicitLayout], tables: Sequence[np.ndarray]
    ) -> list[str]:
        """Decode, once the load landed: what differs from the prefill ranks' `tables` (as
        landed, one per prefill rank); [] when every unit of this rank is bit-exact."""
        tag = request_tag(load.ticket.request_id, load.num_tokens)
        try:
            expected = [
                decode_table(t, layout, tag) for t, layout in zip(tables, prefill, strict=True)
            ]
        except InvalidInput as exc:
            return [str(exc)]
        cache = self._cache(load.block_ids, load.num_tokens)
        if load.num_tokens == self._corrupt_tokens:
            self._flip_first_byte(cache)
        return mismatches(self.layout, compute(self.copies, self.layout, cache), expected)

    def _flip_first_byte(self, cache: RequestCache) -> None:
        offsets, _ = unit_ranges(self.layout, cache)[0]
        byte = self.copies.view(int(offsets[0]), 1)
        byte.bitwise_xor_(0x01)
        logger.warning("pdxfer verify: %s set, one landed byte flipped", CORRUPT_TOKENS_ENV)
