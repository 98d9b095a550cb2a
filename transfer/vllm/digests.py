"""`verify`: digests of exactly the bytes a request's cache is, per head unit, on both sides.

A request's cache on one rank is, per unit (one head of one KV tensor, or one head/group of
one state tensor, named `(layer, tensor, segment, unit)` as in `head_units`):
- vLLM's CPU attention (K|V per head run, `stage_tail`): the head's run of every full block,
  and of the partial last block only its first tokens (what the staged tail carries; the
  rest of that block is the last prompt token, which decode recomputes, and stale bytes);
- a token-major latent (MLA): the rows of the request's tokens;
- a state unit: its elements and steps in the state block, without the page padding, in the
  order its layout keeps contiguous (both sides share that order: it is in the compat hash).

A unit's bytes are the same whichever TP size holds it, so prefill rank `p` digests the
units it holds, and decode rank `d` checks the units it holds against the prefill ranks'
tables, whatever the TP pair (at 2 -> 1 decode's units come from two tables). None of it
reads a transfer plan: a planning bug cannot hide behind its own arithmetic.

A table: `TABLE_HEADER` bytes (a magic and the request's tag, so a slot that was never
written or holds another request fails), then one little-endian uint64 per unit, in
`digest_units(layout)` order.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from transfer.cache.explicit_layout import ExplicitLayout
from transfer.cache.head_units import KVUnit, StateUnit
from transfer.errors import InvalidInput
from transfer.vllm.load_plan import CacheGroup
from transfer.vllm.region_copies import RegionCopies
from transfer.vllm.stage_tail import head_token_ranges, k_units

UnitKey = tuple[int, str, int, int]  # (layer, tensor, segment, unit)
MAGIC = 0x7064786665727631  # "pdxferv1"
TABLE_HEADER = 16
DIGEST_BYTES = 8
# Digest tables per prefill rank: verified finished prefills waiting for decode at once
# (a table is small: 8 bytes per head unit); one that finds none goes unverified.
DIGEST_SLOTS = 256


def _key(unit: KVUnit | StateUnit) -> UnitKey:
    return (unit.layer, unit.tensor, unit.segment, unit.unit)


def _kv_units(layout: ExplicitLayout) -> tuple[KVUnit, ...]:
    """K units stand for their head's whole K|V run; a token-major layout digests each."""
    return k_units(layout) or layout.kv


def digest_units(layout: ExplicitLayout) -> tuple[UnitKey, ...]:
    """The units a rank digests, in table order."""
    return tuple(_key(u) for u in (*_kv_units(layout), *layout.state))


def table_bytes(layout: ExplicitLayout) -> int:
    """Bytes of one rank's digest table."""
    return TABLE_HEADER + DIGEST_BYTES * len(digest_units(layout))


def request_tag(request_id: str, num_tokens: int) -> int:
    """What a table's header names: the request and its token count."""
    digest = hashlib.blake2b(f"{request_id}:{num_tokens}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class RequestCache:
    """Where one request's cache sits on a rank: attention blocks (holding tokens
    0..num_tokens) and the state block per model layer."""

    blocks: Mapping[int, tuple[int, ...]]
    state_slots: Mapping[int, int]
    num_tokens: int

    @classmethod
    def of(
        cls, groups: Sequence[CacheGroup], block_ids: Sequence[Sequence[int]], block_size: int,
        num_tokens: int,
    ) -> RequestCache:  # fmt: skip
        """From vLLM's per-group block ids (a ticket's or decode's), as `plan_load` reads
        them: an attention group's first blocks, a state group's last block."""
        if len(block_ids) != len(groups):
            raise InvalidInput(f"block_ids: {len(block_ids)} groups, this model has {len(groups)}")
        need = math.ceil(num_tokens / block_size)
        blocks: dict[int, tuple[int, ...]] = {}
        slots: dict[int, int] = {}
        for i, (group, ids) in enumerate(zip(groups, block_ids, strict=True)):
            if group.is_attention:
                if len(ids) < need:
                    raise InvalidInput(f"block_ids[{i}]: {len(ids)} blocks for {num_tokens} tokens")
                blocks.update({layer: tuple(ids[:need]) for layer in group.layers})
            else:
                if not ids:
                    raise InvalidInput(f"block_ids[{i}]: a state group without its state block")
                slots.update({layer: ids[-1] for layer in group.layers})
        return cls(blocks, slots, num_tokens)


def _gqa_ranges(layout: ExplicitLayout, unit: KVUnit, blocks: Sequence[int], tokens: int):
    bs, eb = layout.block_size, layout.dtypes.kv
    run = 2 * unit.nbytes * bs
    partial = tokens % bs
    full = blocks[:-1] if partial else blocks
    offsets = [np.asarray([unit.base + b * unit.block_stride for b in full], dtype=np.int64)]
    nbytes = [np.full(len(full), run, dtype=np.int64)]
    if partial:
        at, n = head_token_ranges(unit, bs, eb, blocks[-1], partial)
        offsets.append(at), nbytes.append(n)
    return np.concatenate(offsets), np.concatenate(nbytes)


def _row_ranges(layout: ExplicitLayout, unit: KVUnit, blocks: Sequence[int], tokens: int):
    t = np.arange(tokens, dtype=np.int64)
    ids = np.asarray(blocks, dtype=np.int64)[t // layout.block_size]
    offsets = unit.base + ids * unit.block_stride + (t % layout.block_size) * unit.token_stride
    return offsets, np.full(tokens, unit.nbytes, dtype=np.int64)


def _state_ranges(unit: StateUnit, slot: int):
    c = np.arange(unit.elems, dtype=np.int64)
    k = np.arange(unit.steps, dtype=np.int64)
    base = unit.base + slot * unit.slot_stride
    if unit.elem_stride <= unit.step_stride:  # channels adjacent (time-major conv, SSM)
        offsets = base + k[:, None] * unit.step_stride + c[None, :] * unit.elem_stride
    else:  # steps adjacent (dim-major conv)
        offsets = base + c[:, None] * unit.elem_stride + k[None, :] * unit.step_stride
    offsets = offsets.reshape(-1)
    return offsets, np.full(len(offsets), unit.elem_bytes, dtype=np.int64)


def _coalesce(offsets: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Adjacent ranges (in order) as one: the bytes, and their order, are unchanged."""
    if len(offsets) < 2:
        return offsets, nbytes
    starts = np.concatenate(([True], offsets[1:] != offsets[:-1] + nbytes[:-1]))
    first = np.flatnonzero(starts)
    return offsets[first], np.add.reduceat(nbytes, first)


def unit_ranges(layout: ExplicitLayout, cache: RequestCache) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per unit of `digest_units(layout)`: (offsets, nbytes) of its bytes, in digest order."""
    gqa = bool(k_units(layout))
    out = []
    for unit in _kv_units(layout):
        blocks = cache.blocks.get(unit.layer)
        if blocks is None:
            raise InvalidInput(f"verify: no attention blocks for layer {unit.layer}")
        ranges = _gqa_ranges if gqa else _row_ranges
        out.append(_coalesce(*ranges(layout, unit, blocks, cache.num_tokens)))
    for unit in layout.state:
        if unit.layer not in cache.state_slots:
            raise InvalidInput(f"verify: no state block for layer {unit.layer}")
        out.append(_coalesce(*_state_ranges(unit, cache.state_slots[unit.layer])))
    return out


def compute(copies: RegionCopies, layout: ExplicitLayout, cache: RequestCache) -> np.ndarray:
    """uint64 [units]: blake2b-64 of each unit's bytes in this rank's memory."""
    ranges = unit_ranges(layout, cache)
    if not ranges:
        return np.empty(0, dtype=np.uint64)
    offsets = np.concatenate([o for o, _ in ranges])
    nbytes = np.concatenate([n for _, n in ranges])
    packed = copies.gather(offsets, nbytes).cpu().numpy()
    sizes = np.fromiter((int(n.sum()) for _, n in ranges), dtype=np.int64, count=len(ranges))
    ends = np.cumsum(sizes)
    digests = np.empty(len(ranges), dtype=np.uint64)
    view = memoryview(packed)
    for i, (start, end) in enumerate(zip((ends - sizes).tolist(), ends.tolist(), strict=True)):
        raw = hashlib.blake2b(view[start:end], digest_size=DIGEST_BYTES).digest()
        digests[i] = int.from_bytes(raw, "little")
    return digests


def encode_table(tag: int, digests: np.ndarray) -> np.ndarray:
    """A table as uint8 [TABLE_HEADER + 8 * units]."""
    header = np.asarray([MAGIC, tag], dtype="<u8")
    return np.concatenate([header, digests.astype("<u8")]).view(np.uint8)


def decode_table(raw: np.ndarray, layout: ExplicitLayout, tag: int) -> dict[UnitKey, int]:
    """A prefill rank's table (uint8, as landed) -> digest per unit; InvalidInput when the
    table was not written for this request."""
    keys = digest_units(layout)
    if len(raw) != TABLE_HEADER + DIGEST_BYTES * len(keys):
        raise InvalidInput(f"verify: digest table of {len(raw)} B for {len(keys)} units")
    words = np.ascontiguousarray(raw).view("<u8")
    if int(words[0]) != MAGIC or int(words[1]) != tag:
        raise InvalidInput("verify: the prefill rank's digest table is not this request's")
    return dict(zip(keys, (int(w) for w in words[2:]), strict=True))


def mismatches(
    layout: ExplicitLayout, digests: np.ndarray, expected: Sequence[Mapping[UnitKey, int]]
) -> list[str]:
    """Units of `layout` whose digest differs from every prefill rank's that holds it
    (replicated heads: any holder), or that no prefill rank holds."""
    problems = []
    for key, digest in zip(digest_units(layout), digests.tolist(), strict=True):
        held = [table[key] for table in expected if key in table]
        if not held:
            problems.append(f"layer {key[0]} {key[1]} unit {key[3]}: no prefill rank holds it")
        elif int(digest) not in held:
            problems.append(f"layer {key[0]} {key[1]} segment {key[2]} unit {key[3]}: differs")
    return problems
