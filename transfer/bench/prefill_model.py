"""A modelled prefill for layer-wise streaming benchmarks: when each layer's cache is final.

A prompt of `tokens` takes `tokens / tokens_per_s` seconds (the modelled GPU's prefill
speed for that length), spread over the layers in proportion to their FLOPs, in layer
order. Per layer, with hidden size h and N tokens (the usual estimates; MoE and MLP widths
are not in the geometry, so every layer gets the same dense share):

- dense projections and MLP: 24 h^2 N;
- softmax attention (GQA, MLA): 2 h N^2 more (QK^T and PV over the causal half);
- linear attention: 4 N H K V more (the recurrent update and readout of its heads).

The last layer finishes at the end of the prefill. Only the shares matter, so the
constants' errors cancel where they are common; the attention term makes long prompts
back-loaded onto attention layers, which is what stretches the gaps between groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from transfer.cache.head_units import layer_group_of
from transfer.errors import InvalidInput
from transfer.geometry import ModelGeometry


def layer_flops(geometry: ModelGeometry, tokens: int, start: int = 0) -> dict[int, float]:
    """Modelled FLOPs of each cache-bearing layer (layer index ->) for prompt tokens
    `[start, tokens)`, the earlier ones already cached (one chunk of a chunked prefill)."""
    h, n = geometry.hidden_size, float(tokens - start)
    flops = {}
    for layer in geometry.layers:
        cost = 24.0 * h * h * n
        if layer.kind.is_linear:
            state = sum(t.rank_channels(1) * t.steps for t in layer.cache_tensors())
            cost += 4.0 * n * state
        else:  # token t attends to t earlier ones: 4 h t FLOPs, summed over the chunk
            cost += 2.0 * h * (float(tokens) ** 2 - float(start) ** 2)
        flops[layer.index] = cost
    return flops


@dataclass(frozen=True)
class StreamGroup:
    """One part of a layer-wise stream: the KV of `tokens` (`[start, end)`) of `layers`,
    with their state when `with_state` (the last chunk), final `ready_s` seconds after the
    modelled prefill starts."""

    layers: tuple[int, ...]
    tokens: tuple[int, int]
    with_state: bool
    ready_s: float


def stream_groups(
    geometry: ModelGeometry,
    tokens: int,
    tokens_per_s: float,
    layer_group: int,
    chunk_tokens: int = 0,
    whole_model: ModelGeometry | None = None,
) -> tuple[StreamGroup, ...]:
    """The parts of a layer-wise stream in the order the modelled prefill finishes them:
    chunks of `chunk_tokens` (0: the whole prompt at once) run one after another through
    every layer; each group of `layer_group` model layers (0: one group) is a part per
    chunk. `tokens_per_s` is the speed of `whole_model` (default `geometry`); a benchmark
    that keeps only its leading layers (`ModelGeometry.with_num_layers`) gets those
    layers' share of the time."""
    if not tokens_per_s > 0:
        raise InvalidInput(f"tokens_per_s: must be > 0, got {tokens_per_s!r}")
    if tokens < 1:
        raise InvalidInput(f"tokens: must be >= 1, got {tokens}")
    if chunk_tokens < 0:
        raise InvalidInput(f"chunk_tokens: must be >= 0, got {chunk_tokens}")
    whole_flops = sum(layer_flops(whole_model or geometry, tokens).values())
    seconds_per_flop = tokens / tokens_per_s / whole_flops
    groups: dict[int, list[int]] = {}
    for layer in sorted(layer.index for layer in geometry.layers):
        groups.setdefault(layer_group_of(layer, layer_group), []).append(layer)
    step = chunk_tokens or tokens
    parts, elapsed = [], 0.0
    for start in range(0, tokens, step):
        end = min(tokens, start + step)
        flops = layer_flops(geometry, end, start)
        for _, members in sorted(groups.items()):
            elapsed += sum(flops[i] for i in members) * seconds_per_flop
            parts.append(StreamGroup(tuple(members), (start, end), end == tokens, elapsed))
    return tuple(parts)
