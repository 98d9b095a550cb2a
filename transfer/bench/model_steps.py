"""Wall time of one rank's model steps, in this process, with nothing else running: a
prefill step of B fresh prompts, then decode steps of those B sequences. What a serving
rank's step costs on this host, without the instances, pipes and transports around it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from transfer.model.batch import SequenceStep
from transfer.model.batch_runner import BatchEngine
from transfer.model.caches import LocalCaches
from transfer.model.loader import load_model
from transfer.model.runner import RankEngine
from transfer.serving.ranks.cpu_rank import configure_cpu_rank

BLOCK_SIZE = 16
WARMUP_STEPS = 2  # per measured series: first calls allocate and fill caches


@dataclass(frozen=True)
class StepTiming:
    """`steps` steps of `batch` sequences, `tokens` new tokens each (1 for decode)."""

    phase: str  # "prefill" or "decode"
    batch: int
    tokens: int
    steps: int
    p50_ms: float
    min_ms: float

    @property
    def tokens_per_s(self) -> float:
        return self.batch * self.tokens / (self.p50_ms / 1e3)

    def to_dict(self) -> dict:
        return asdict(self) | {"tokens_per_s": round(self.tokens_per_s, 1)}


def time_model_steps(
    model: str,
    batches: Sequence[int],
    prompt_len: int,
    steps: int,
    *,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[StepTiming]:
    """For each batch size B: `steps` prefill steps of B random prompts of `prompt_len`
    tokens (slots freed after each), then `steps` decode steps continuing the last ones."""
    configure_cpu_rank()
    rank_model = load_model(model, seed=seed)
    geometry = rank_model.geometry
    most = max(batches)
    blocks_each = -(-(prompt_len + WARMUP_STEPS + steps) // BLOCK_SIZE)
    # as `serve` sizes a rank's caches by default: KV and conv in the model's dtype, S in
    # the config's mamba_ssm_dtype if it has one
    caches = LocalCaches(
        geometry, num_blocks=most * blocks_each, block_size=BLOCK_SIZE, num_slots=most,
        dtype=getattr(torch, geometry.dtype),
        ssm_dtype=getattr(torch, geometry.ssm_dtype or geometry.dtype),
    )  # fmt: skip
    engine = RankEngine(geometry, caches, rank_model.tp, seed, model=rank_model)
    runner = BatchEngine(engine)
    tables = [tuple(range(s * blocks_each, (s + 1) * blocks_each)) for s in range(most)]
    generator = torch.Generator().manual_seed(seed)
    vocab = geometry.vocab_size

    def prefill(batch: int) -> tuple[float, list[int]]:
        prompts = torch.randint(0, vocab, (batch, prompt_len), generator=generator).tolist()
        sequences = [SequenceStep(p, s, tables[s]) for s, p in enumerate(prompts)]
        start = time.perf_counter()
        tokens = runner.step(sequences).tokens
        return time.perf_counter() - start, tokens

    def release(batch: int) -> None:
        for slot in range(batch):
            engine.release(slot)

    timings = []
    for batch in batches:
        seconds = []
        for step in range(WARMUP_STEPS + steps):
            elapsed, tokens = prefill(batch)
            seconds.append(elapsed)
            if step < WARMUP_STEPS + steps - 1:
                release(batch)
        timings.append(_timing("prefill", batch, prompt_len, seconds[WARMUP_STEPS:]))
        if progress:
            progress(_line(timings[-1]))
        seconds = []
        for step in range(WARMUP_STEPS + steps):
            sequences = [
                SequenceStep.decode(token, s, tables[s], prompt_len + step)
                for s, token in enumerate(tokens)
            ]
            start = time.perf_counter()
            tokens = runner.step(sequences).tokens
            seconds.append(time.perf_counter() - start)
        release(batch)
        timings.append(_timing("decode", batch, 1, seconds[WARMUP_STEPS:]))
        if progress:
            progress(_line(timings[-1]))
    return timings


def _timing(phase: str, batch: int, tokens: int, seconds: list[float]) -> StepTiming:
    return StepTiming(
        phase, batch, tokens, len(seconds),
        round(statistics.median(seconds) * 1e3, 3), round(min(seconds) * 1e3, 3),
    )  # fmt: skip


def _line(t: StepTiming) -> str:
    if t.phase == "prefill":
        shape = f"{t.batch} x {t.tokens} tokens"
    else:
        shape = f"{t.batch} sequence" + ("s" if t.batch > 1 else "")
    return (
        f"{t.phase:7s} {shape}: p50 {t.p50_ms:.2f} ms, min {t.min_ms:.2f} ms "
        f"({t.tokens_per_s:,.0f} tok/s)"
    )


def format_timings(timings: Sequence[StepTiming]) -> str:
    return "\n".join(_line(t) for t in timings)
