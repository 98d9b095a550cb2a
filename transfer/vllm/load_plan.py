"""One decode rank's reads for one vLLM request: pdxfer's packer, once per vLLM cache group.

vLLM gives every cache group its own block ids (a hybrid model's attention group pages
tokens; each mamba group holds its running state in one block). The packer plans one
request with one block list and one state slot, so each group is planned on its own,
limited to its layers, and the ranges are joined per prefill rank.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from transfer.cache.explicit_layout import ExplicitLayout
from transfer.errors import InvalidInput
from transfer.packer import StagingPolicy, TransferRequest, plan_transfer
from transfer.vllm.stage_tail import TailReads, tail_reads


@dataclass(frozen=True)
class CacheGroup:
    """One vLLM transfer group: its model layer indices and whether it pages tokens."""

    layers: frozenset[int]
    is_attention: bool


@dataclass(frozen=True)
class LoadReads:
    """Per prefill rank, `(src, dst, nbytes)` int64 arrays in virtual offsets."""

    per_source: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]
    kv_bytes: int
    state_bytes: int
    tail: TailReads | None = None  # the staged partial block, landing-relative

    @property
    def nbytes(self) -> int:
        tail = self.tail.nbytes if self.tail else 0
        return tail + sum(int(c[2].sum()) for c in self.per_source.values())

    @property
    def descriptors(self) -> int:
        tail = sum(len(c[2]) for c in self.tail.per_source.values()) if self.tail else 0
        return tail + sum(len(c[2]) for c in self.per_source.values())


def _blocks(ids: Sequence[int], block_size: int, num_tokens: int, field: str) -> tuple[int, ...]:
    need = math.ceil(num_tokens / block_size)
    if len(ids) < need:
        raise InvalidInput(
            f"{field}: {len(ids)} blocks for {num_tokens} tokens of {block_size} per block"
        )
    return tuple(ids[:need])


def plan_load(
    groups: Sequence[CacheGroup],
    prefill: Sequence[ExplicitLayout],
    decode: Sequence[ExplicitLayout],
    decode_rank: int,
    src_block_ids: Sequence[Sequence[int]],
    dst_block_ids: Sequence[Sequence[int]],
    num_tokens: int,
    staged_offsets: Sequence[int] = (),
) -> LoadReads:
    """The reads of `decode_rank` for the KV blocks holding `num_tokens` tokens (whole
    blocks: see below) and every linear layer's state without its page padding (a mamba
    group's last block id is its state block). With `staged_offsets` (per prefill rank, its
    stage slot holding the partial last block's tokens, `stage_tail`), the full blocks
    cross whole and the last one's tokens from the slots. Raises InvalidInput naming what
    does not fit."""
    for field, ids in (("ticket block_ids", src_block_ids), ("decode block_ids", dst_block_ids)):
        if len(ids) != len(groups):
            raise InvalidInput(f"{field}: {len(ids)} groups, this model has {len(groups)}")
    p0, d0 = prefill[0], decode[0]
    if p0.block_size != d0.block_size:
        raise InvalidInput(
            f"block_size: prefill pages {p0.block_size} tokens, decode {d0.block_size}; "
            "attention blocks cross whole, so both servers must page alike"
        )
    kv_src = kv_dst = None
    slot_src = slot_dst = None
    for i, (group, src, dst) in enumerate(zip(groups, src_block_ids, dst_block_ids, strict=True)):
        if group.is_attention and kv_src is None:
            kv_src = _blocks(src, p0.block_size, num_tokens, f"ticket block_ids[{i}]")
            kv_dst = _blocks(dst, d0.block_size, num_tokens, f"decode block_ids[{i}]")
        if not group.is_attention and slot_src is None:
            if not src or not dst:
                raise InvalidInput(f"block_ids[{i}]: a state group without its state block")
            slot_src, slot_dst = (src[-1],), (dst[-1],)
    # The packer wants both a block list and a slot; a group's plan reads only its layers,
    # so the other group's ids stand in where this group has none.
    filler_src = kv_src or tuple(range(p0.blocks_for(num_tokens)))
    filler_dst = kv_dst or tuple(range(d0.blocks_for(num_tokens)))
    partial = num_tokens % p0.block_size
    tail = None
    if staged_offsets and partial:
        if sum(g.is_attention for g in groups) != 1:
            raise InvalidInput("ticket staged_offsets: only one attention group may be staged")
        assert kv_dst is not None
        tail = tail_reads(prefill, decode[decode_rank], staged_offsets, kv_dst[-1], partial)
    parts: dict[int, list] = defaultdict(list)
    kv_bytes = state_bytes = 0
    for i, (group, src, dst) in enumerate(zip(groups, src_block_ids, dst_block_ids, strict=True)):
        tokens = num_tokens
        if group.is_attention:
            s_blocks = _blocks(src, p0.block_size, num_tokens, f"ticket block_ids[{i}]")
            d_blocks = _blocks(dst, d0.block_size, num_tokens, f"decode block_ids[{i}]")
            if tail is not None:  # the last block's tokens come from the stage slots
                s_blocks, d_blocks = s_blocks[:-1], d_blocks[:-1]
                if not s_blocks:
                    continue
            s_slots, d_slots = slot_src or (0,), slot_dst or (0,)
            # vLLM's CPU attention keeps a block's K dim-major ([head_dim][block_size]) and
            # its V token-major: a token's K is not one run. The blocks cross whole (every
            # byte of the request's blocks, never a token of another request).
            tokens = len(s_blocks) * p0.block_size
        else:
            if not src or not dst:
                raise InvalidInput(f"block_ids[{i}]: a state group without its state block")
            s_blocks, d_blocks = filler_src, filler_dst
            s_slots, d_slots = (src[-1],), (dst[-1],)
        request = TransferRequest(tokens, s_blocks, s_slots, d_blocks, d_slots)
        plans = plan_transfer(
            prefill, decode, request, StagingPolicy(enabled=False), layers=group.layers
        )
        plan = plans[decode_rank]
        kv_bytes += plan.kv_bytes
        state_bytes += plan.state_bytes
        for source in plan.sources:
            if len(source.wire):
                parts[source.prefill_rank].append(source.wire.arrays())
    per_source = {
        rank: tuple(np.concatenate(c) for c in zip(*chunks, strict=True))
        for rank, chunks in sorted(parts.items())
    }
    if tail is not None:
        kv_bytes += tail.nbytes
    return LoadReads(per_source, kv_bytes, state_bytes, tail)
