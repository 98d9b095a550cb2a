"""Picking a token from logits: greedy, or temperature + top-p with a seeded generator.

The generator of token `index` is seeded from (seed, index) alone, so the tokens of a
request form one reproducible stream whichever process samples each of them (prefill
picks index 0, decode the rest).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class Sampler:
    """How tokens are picked: temperature 0 is greedy (argmax); otherwise softmax of
    logits / temperature, cut to the smallest set whose probability reaches `top_p`."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed <= _MASK64:
            raise ValueError(f"seed: must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampler()


@dataclass(frozen=True)
class Pick:
    """A chosen token and its log-probability under the model (before temperature/top-p)."""

    token: int
    logprob: float


def stream_seed(seed: int, index: int) -> int:
    """A 63-bit generator seed for token `index` of the stream `seed` (splitmix64)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def choose(logits: torch.Tensor, sampler: Sampler, index: int) -> int:
    """The token `sampler` picks from `logits` [vocab] for token `index` of the stream."""
    if sampler.greedy:
        return int(logits.argmax().item())
    probs = torch.softmax(logits.detach().float().cpu() / sampler.temperature, dim=-1)
    if sampler.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        kept = sorted_probs.masked_fill(before >= sampler.top_p, 0.0)
    else:
        kept, order = probs, None
    generator = torch.Generator().manual_seed(stream_seed(sampler.seed, index))
    at = int(torch.multinomial(kept, 1, generator=generator).item())
    return int(order[at].item()) if order is not None else at


def choose_rows(
    logits: torch.Tensor, samplers: Sequence[Sampler], indices: Sequence[int]
) -> list[int]:
    """`choose` for each row of logits [B, vocab]; the greedy rows in one argmax (a row's
    argmax is the same alone or among others)."""
    greedy = logits.argmax(-1).tolist() if any(s.greedy for s in samplers) else None
    return [
        greedy[i] if sampler.greedy else choose(row, sampler, index)
        for i, (row, sampler, index) in enumerate(zip(logits, samplers, indices, strict=True))
    ]


def logprobs_of(logits: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """fp32 [B]: `logprob_of` each row of logits [B, vocab] and its token, in one pass (a
    row's log softmax has the same bits alone or among others)."""
    picked = torch.tensor(tokens, dtype=torch.long, device=logits.device)[:, None]
    return torch.log_softmax(logits.detach().float(), dim=-1).gather(1, picked)[:, 0]


def logprob_of(logits: torch.Tensor, token: int) -> float:
    """log softmax(logits)[token], in fp32."""
    return float(torch.log_softmax(logits.detach().float(), dim=-1)[token].item())
