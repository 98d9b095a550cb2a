"""Layer-wise streaming's readiness words: what a prefill rank publishes, per state slot, in
the progress area of its registered arena, and what a decode rank makes of a copy.

A prefill rank's entry for a slot is four little-endian int64 words:

    progress  key << 41 | chunk_end << 9 | groups_done << 1 | picked
    floor     key << 41 | tokens whose KV every group has final
    token     key << 41 | the first token
    logprob   key << 41 | the first token's logprob (float32 bits)

Groups are the cache-bearing layers grouped by `LayoutOptions.layer_group`, in layer order
(`stream_groups`). After each group of a step the rank rewrites `progress` (groups done of
the chunk that ends at `chunk_end`). After the step that ends the prompt it writes `token`
and `logprob`, then `progress` with `picked`. Each word is one aligned 8-byte store, and
each makes only true claims, so any mix of old and new words a reader sees is safe: it may
only see less than there is. The key (the ticket's `stream_key`) tells this request's words
from an earlier occupant's; the token words are written once per request, so a keyed one
is the request's first token.
Torch-free: the decode control process reads these.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from transfer.cache.head_units import layer_group_of
from transfer.cache.layout import Layout
from transfer.errors import InvalidInput
from transfer.geometry import ModelGeometry


class TransferMode(StrEnum):
    """When decode reads a request: WHOLE once prefill finished it; LAYERWISE each group of
    layers of each chunk as prefill finishes it (docs/streaming.md)."""

    WHOLE = "whole"
    LAYERWISE = "layerwise"


TRANSFER_MODES = tuple(TransferMode)
# Layers per streaming group: 12 groups of Qwen3-Next's 48 layers cost 36 descriptors for
# a 4k-token request, and 1.5-7.3 ms stayed exposed at 4k-64k tokens on loopback in
# `bench transfer --layerwise` (docs/benchmarks.md).
DEFAULT_STREAM_LAYERS = 4
PROGRESS, FLOOR, TOKEN, LOGPROB = range(4)  # an entry's words, in order
WORDS = 4
ENTRY_BYTES = 8 * WORDS
MAX_SOURCES = 8  # a decode slot's entry holds a copy per prefill rank
SLOT_BYTES = ENTRY_BYTES * MAX_SOURCES
KEY_BITS = 22
MAX_TOKENS = (1 << 32) - 1
MAX_GROUPS = (1 << 8) - 1
_KEY_SHIFT, _TOKEN_SHIFT, _GROUP_SHIFT = 41, 9, 1


def progress_area_bytes(num_slots: int) -> int:
    return num_slots * SLOT_BYTES


def entry_offset(layout: Layout, slot: int, source: int = 0) -> int:
    """Arena offset of `slot`'s entry (a decode rank keeps prefill rank `source`'s copy at
    `source`)."""
    if not 0 <= slot < layout.num_slots or not 0 <= source < MAX_SOURCES:
        raise InvalidInput(f"slot {slot} / source {source}: outside the progress area")
    if layout.progress_bytes < progress_area_bytes(layout.num_slots):
        raise InvalidInput("layout: no progress area (an instance built for layer-wise streaming)")
    return layout.progress_offset + slot * SLOT_BYTES + source * ENTRY_BYTES


def next_key(previous: int) -> int:
    """The key after `previous`: never 0 (a zeroed arena), never `previous`."""
    return previous % ((1 << KEY_BITS) - 1) + 1


def stream_groups(geometry: ModelGeometry, layer_group: int) -> tuple[tuple[int, ...], ...]:
    """The cache-bearing layers of each streaming group, in the order prefill finishes
    them (0: one group). Groups without such a layer are left out."""
    groups: dict[int, list[int]] = {}
    for layer in sorted(spec.index for spec in geometry.layers):
        groups.setdefault(layer_group_of(layer, layer_group), []).append(layer)
    if len(groups) > MAX_GROUPS:
        raise InvalidInput(
            f"stream_layers: {len(groups)} groups, at most {MAX_GROUPS}; use larger groups"
        )
    return tuple(tuple(members) for _, members in sorted(groups.items()))


def progress_word(key: int, chunk_end: int, groups_done: int, picked: bool) -> int:
    if not 0 <= chunk_end <= MAX_TOKENS or not 0 <= groups_done <= MAX_GROUPS:
        raise InvalidInput(f"progress: chunk_end {chunk_end} or groups {groups_done} too large")
    return key << _KEY_SHIFT | chunk_end << _TOKEN_SHIFT | groups_done << _GROUP_SHIFT | picked


def floor_word(key: int, tokens: int) -> int:
    return key << _KEY_SHIFT | tokens


def token_words(key: int, token: int, logprob: float) -> tuple[int, int]:
    if not 0 <= token <= MAX_TOKENS:
        raise InvalidInput(f"token: {token} outside [0, {MAX_TOKENS}]")
    bits = struct.unpack("<I", struct.pack("<f", logprob))[0]
    return key << _KEY_SHIFT | token, key << _KEY_SHIFT | bits


@dataclass(frozen=True)
class Progress:
    """One prefill rank's published progress on one request."""

    chunk_end: int = 0  # the chunk being (or last) computed ends here
    groups_done: int = 0  # groups finished for that chunk
    picked: bool = False  # the step that ends the prompt has picked its first token
    floor: int = 0  # every group's KV is final below this token
    first: tuple[int, float] | None = None  # (token, logprob) once both words are in

    def final_tokens(self, group: int) -> int:
        """Tokens of `group`'s KV that are final."""
        return max(self.floor, self.chunk_end if group < self.groups_done else 0)

    def finished(self, num_tokens: int) -> bool:
        return self.chunk_end == num_tokens and self.picked


def read_entry(words: Sequence[int], key: int) -> Progress:
    """The progress `words` (an entry's four words) claim for the request with `key`;
    nothing when they belong to another."""
    progress, floor, token, logprob = (int(words[i]) for i in (PROGRESS, FLOOR, TOKEN, LOGPROB))
    if progress >> _KEY_SHIFT != key:
        return Progress()
    first = None
    if token >> _KEY_SHIFT == key and logprob >> _KEY_SHIFT == key:
        bits = struct.pack("<I", logprob & MAX_TOKENS)
        first = (token & MAX_TOKENS, struct.unpack("<f", bits)[0])
    return Progress(
        chunk_end=progress >> _TOKEN_SHIFT & MAX_TOKENS,
        groups_done=progress >> _GROUP_SHIFT & MAX_GROUPS,
        picked=bool(progress & 1),
        floor=floor & MAX_TOKENS if floor >> _KEY_SHIFT == key else 0,
        first=first,
    )


def least(
    progresses: Sequence[Progress], num_groups: int, num_tokens: int
) -> tuple[tuple[int, ...], int]:
    """(per group, the tokens of its KV final on every prefill rank; how many groups, from
    the first, have their state final on every rank)."""
    finals = tuple(min(p.final_tokens(g) for p in progresses) for g in range(num_groups))
    states = min(p.groups_done if p.chunk_end == num_tokens else 0 for p in progresses)
    return finals, states
