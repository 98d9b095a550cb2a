"""Which prompt tokens a prefill step runs: the chunk plan of batched, chunked prefill.

Each step takes the running prompts in arrival order and runs up to `max_num_batched_tokens`
of their tokens: whole prompts, and a chunk of the first prompt that does not fit (the rest
of it leads the next step). So no step runs longer than one step's budget, however long the
prompt. With a prefix cache a chunk also ends at each of the prompt's checkpoint positions,
whose state the same step copies into a checkpoint slot.
"""

from __future__ import annotations

from collections.abc import Sequence

from transfer.errors import InvalidInput
from transfer.serving.engine.checkpoints import SCAN_CHUNK_ALIGN
from transfer.serving.engine.request import Prompt
from transfer.serving.ranks.commands import PrefillChunk


def check_budget(max_num_batched_tokens: int) -> int:
    if (
        isinstance(max_num_batched_tokens, bool)
        or not isinstance(max_num_batched_tokens, int)
        or max_num_batched_tokens < 1
    ):
        raise InvalidInput(
            f"max_num_batched_tokens: must be an int >= 1, got {max_num_batched_tokens!r}"
        )
    return max_num_batched_tokens


def chunk_len(prompt: Prompt, budget: int, first: bool) -> int:
    """Tokens of the prompt's next chunk: at most `budget`, ending at the next checkpoint.
    A chunk that stops short of the prompt's end stops at a multiple of SCAN_CHUNK_ALIGN,
    where the chunked scans and attention tiles restart exactly as an unchunked pass would
    (bit for bit); unless that leaves nothing and the chunk is the step's `first`."""
    total = prompt.num_tokens
    end = min(total, prompt.done + budget)
    stops = [p for p in prompt.stops if prompt.done < p < end]
    end = min(stops) if stops else end
    aligned = end - end % SCAN_CHUNK_ALIGN
    if end < total and end != aligned:
        end = aligned if aligned > prompt.done or not first else end
    return end - prompt.done


def plan_batch(running: Sequence[Prompt], budget: int) -> list[tuple[Prompt, int]]:
    """(prompt, tokens this step) in arrival order, within `budget`. A prompt marked
    `alone` (its last batch failed its checks) runs in a step of its own, so the next
    failure names exactly one prompt."""
    batch: list[tuple[Prompt, int]] = []
    for prompt in running:
        if prompt.alone and batch:
            break
        take = chunk_len(prompt, budget, first=not batch)
        if take <= 0:
            break
        batch.append((prompt, take))
        budget -= take
        if prompt.alone:
            break
    return batch


def chunk_of(prompt: Prompt, take: int, checkpoint_to: int) -> PrefillChunk:
    """The rank command's part for the prompt's next `take` tokens."""
    start, end = prompt.done, prompt.done + take
    return PrefillChunk(
        prompt.prompt_ids[start:end], start, prompt.blocks, prompt.slot, prompt.prefill.sampling,
        prompt.restore_from, checkpoint_to, prompt.stream_key, end == prompt.num_tokens,
        prompt.copy_block,
    )  # fmt: skip
