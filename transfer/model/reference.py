"""Colocated references for `--verify`: the same model at TP=1 in this process."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from transfer.cache.views import torch_dtype
from transfer.geometry import ModelGeometry
from transfer.model.caches import LocalCaches
from transfer.model.distributed import TPGroup
from transfer.model.layers.common import Step
from transfer.model.loader import RankModel, load_model, model_for_geometry
from transfer.model.runner import RankEngine, blocks_needed
from transfer.sizing import CacheDtypes

REFERENCE_BLOCK_SIZE = 16


def reference_generate(
    geometry: ModelGeometry,
    prompt_ids: Sequence[int],
    max_tokens: int,
    seed: int = 0,
    device: torch.device | str = "cpu",
    *,
    source: str | None = None,
    dtypes: CacheDtypes | None = None,
) -> list[int]:
    """The `max_tokens` greedy tokens (first token included) that a TP=1 engine with its
    own small caches generates for `prompt_ids`: what P/D disaggregation must reproduce.

    `source` (a checkpoint directory or preset name) picks the weights, default the preset
    of `geometry`; `dtypes` are the cache element sizes the workers store (default fp32).
    """
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    num_blocks = blocks_needed(len(prompt_ids) + max_tokens, REFERENCE_BLOCK_SIZE)
    dtypes = dtypes or CacheDtypes(kv=4, ssm=4, conv=4)
    caches = LocalCaches(
        geometry,
        num_blocks=num_blocks,
        block_size=REFERENCE_BLOCK_SIZE,
        num_slots=1,
        dtype=torch_dtype(dtypes.kv),
        ssm_dtype=torch_dtype(dtypes.ssm),
        device=device,
    )
    model = reference_model(geometry, seed, str(device), source)
    engine = RankEngine(geometry, caches, model.tp, seed, device, model=model)
    blocks = list(range(num_blocks))
    first = engine.prefill(prompt_ids, blocks, slot=0)
    return [first] + engine.decode(first, len(prompt_ids), blocks, 0, max_tokens - 1)


@functools.lru_cache(maxsize=4)
def reference_model(
    geometry: ModelGeometry, seed: int = 0, device: str = "cpu", source: str | None = None
) -> RankModel:
    """The TP=1 model, built once per (geometry, seed, device, source): it holds weights only."""
    if source is not None:
        return load_model(source, TPGroup.single(), device, seed=seed)
    return model_for_geometry(geometry, TPGroup.single(), seed, device)


def full_sequence_logits(model: RankModel, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [T, vocab] of every position, recomputed from scratch with no cache at all."""
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)
    positions = torch.arange(len(ids), device=model.device)
    step = Step(True, positions, positions.new_empty(0), slot=-1, caches=None)
    return model.forward(ids, step, all_logits=True)
