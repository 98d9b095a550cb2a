"""Batched, chunked prefill on a prefill instance.

Each step takes waiting prompts in arrival order and runs up to `max_num_batched_tokens`
of their tokens as one `PrefillBatch` rank command: whole prompts, and a chunk of the
first prompt that does not fit (the rest of it leads the next step). So no rank command
runs longer than one step's budget, however long the prompt, and a request whose caller
went away stops at the next chunk.

With a prefix cache, a prompt may start after a cached prefix (its checkpoint is restored
into the slot in the first chunk's command), and a chunk ends at each of the prompt's
checkpoint positions, whose state the same command copies into a checkpoint slot.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transfer.cache.prefix_cache import PrefixCache
from transfer.control.types import GREEDY, SamplingParams
from transfer.errors import Cancelled, Closed, InvalidInput, PdxferError, WrongState
from transfer.serving.engine.checkpoints import SCAN_CHUNK_ALIGN
from transfer.serving.ranks.commands import PrefillBatch, PrefillChunk, TokenPick
from transfer.serving.ranks.rank_protocol import same_on_every_rank
from transfer.serving.ranks.ranks import RankGroup

logger = logging.getLogger(__name__)


@dataclass(eq=False)  # compared by identity: `prompt in queue`
class _Prompt:
    request_id: str
    prompt_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    slot: int
    sampling: SamplingParams
    is_cancelled: Callable[[], bool]
    done: int = 0  # prompt tokens already in the cache
    restore_from: int = -1  # the checkpoint slot to start from (until the first chunk ran)
    stops: dict[int, bytes] = field(default_factory=dict)  # checkpoint position -> block hash
    stream_key: int = 0  # publish progress for a layer-wise stream under this key
    copy_block: int = -1  # the cached block whose rows the hit ends in (until the first chunk)
    result: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)

    def take(self, budget: int, first: bool) -> int:
        """Tokens of the next chunk: at most `budget`, ending at the next checkpoint. A chunk
        that stops short of the prompt's end stops at a multiple of SCAN_CHUNK_ALIGN, where
        the chunked scans and attention tiles restart exactly as an unchunked pass would
        (bit for bit); unless that leaves nothing and the chunk is the step's `first`."""
        end = min(len(self.prompt_ids), self.done + budget)
        stops = [p for p in self.stops if self.done < p < end]
        end = min(stops) if stops else end
        aligned = end - end % SCAN_CHUNK_ALIGN
        if end < len(self.prompt_ids) and end != aligned:
            end = aligned if aligned > self.done or not first else end
        return end - self.done


class PrefillBatcher:
    """Runs the prompts of `run` callers as batched, chunked steps on `ranks`."""

    def __init__(
        self, ranks: RankGroup, max_num_batched_tokens: int, prefix: PrefixCache | None = None
    ) -> None:
        if (
            isinstance(max_num_batched_tokens, bool)
            or not isinstance(max_num_batched_tokens, int)
            or max_num_batched_tokens < 1
        ):
            raise InvalidInput(
                f"max_num_batched_tokens: must be an int >= 1, got {max_num_batched_tokens!r}"
            )
        self.ranks = ranks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefix = prefix
        self._queue: list[_Prompt] = []  # arrival order; the head may be part-done
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="prefill-batcher", daemon=True)
        self._thread.start()

    def run(
        self,
        request_id: str,
        prompt_ids: tuple[int, ...],
        block_ids: tuple[int, ...],
        slot: int,
        sampling: SamplingParams = GREEDY,
        is_cancelled: Callable[[], bool] = lambda: False,
        *,
        cached_tokens: int = 0,
        restore_from: int = -1,
        checkpoints: dict[int, bytes] | None = None,
        stream_key: int = 0,
        copy_block: int = -1,
    ) -> TokenPick:
        """Prefill the prompt into `block_ids`/`slot` (a FREE slot); the first generated
        token. Raises `Cancelled` once `is_cancelled()` is seen true between chunks; the
        slot is then part-filled and its owner releases it. A prefix hit passes its
        `cached_tokens` (already in the first blocks) and the checkpoint slot holding the
        state after them; when those tokens end inside a block, `copy_block` is the cached
        block whose rows the first chunk copies into the prompt's own; `checkpoints` maps token positions to the hash of the block each
        ends, whose state is saved there when the prefix cache has room. A `stream_key`
        makes the ranks publish the prompt's progress as its layers finish."""
        if not prompt_ids:
            raise InvalidInput("prompt_ids: must not be empty")
        if not 0 <= cached_tokens < len(prompt_ids) or (cached_tokens > 0) != (restore_from >= 0):
            raise InvalidInput(
                f"cached_tokens: {cached_tokens} must be below the prompt's {len(prompt_ids)} "
                "tokens, and come with a checkpoint slot to restore"
            )
        if copy_block >= 0 and not cached_tokens:
            raise InvalidInput("copy_block: only a prefix hit copies a cached block")
        prompt = _Prompt(request_id, tuple(prompt_ids), tuple(block_ids), slot, sampling,
                         is_cancelled, cached_tokens, restore_from,
                         dict(checkpoints or {}) if self.prefix is not None else {},
                         stream_key=stream_key, copy_block=copy_block)  # fmt: skip
        with self._cond:
            if self._closed:
                raise Closed("prefill batcher: the instance is shutting down")
            self._queue.append(prompt)
            self._cond.notify_all()
        outcome = prompt.result.get()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    @property
    def num_running(self) -> int:
        """Prompts admitted to the batcher and not finished: each runs in the next steps."""
        with self._cond:
            return len(self._queue)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._queue:
                    self._cond.wait()
                if self._closed:
                    for prompt in self._queue:
                        prompt.result.put(Closed("prefill batcher: the instance is shutting down"))
                    self._queue.clear()
                    return
                for prompt in [p for p in self._queue if p.is_cancelled()]:
                    self._queue.remove(prompt)
                    prompt.result.put(Cancelled(f"request {prompt.request_id!r}: cancelled"))
                batch = self._plan()
            if not batch:
                continue
            try:
                self._step(batch)
            except Exception as exc:  # noqa: BLE001 - a bug must not hang every caller
                logger.exception("prefill batcher: step failed")
                for prompt, _ in batch:
                    self._finish(prompt, exc)

    def _plan(self) -> list[tuple[_Prompt, int]]:
        """(prompt, tokens this step) in arrival order, within the token budget."""
        budget, batch = self.max_num_batched_tokens, []
        for prompt in self._queue:
            take = prompt.take(budget, first=not batch)
            if take <= 0:
                break
            batch.append((prompt, take))
            budget -= take
        return batch

    def _step(self, batch: list[tuple[_Prompt, int]]) -> None:
        saves = [self._reserve(p, n) for p, n in batch]
        chunks = tuple(
            PrefillChunk(p.prompt_ids[p.done : p.done + n], p.done, p.block_ids, p.slot,
                         p.sampling, p.restore_from, -1 if save is None else save[1],
                         p.stream_key, p.done + n == len(p.prompt_ids), p.copy_block)
            for (p, n), save in zip(batch, saves, strict=True)
        )  # fmt: skip
        begin = time.perf_counter()
        try:
            picks = same_on_every_rank(self.ranks.call(PrefillBatch(chunks)), "prefill step")
        except BaseException as exc:
            for save in filter(None, saves):
                self.prefix.cancel_checkpoint(save[1])
            if not isinstance(exc, PdxferError):
                raise
            # A batch that failed its checks (bad input, wrong slot state) changed nothing
            # but the restored slots, which a rerun restores again: run each part alone to
            # find whose it is. Any other failure may have left states half-advanced, so
            # every part of the batch fails.
            if len(batch) == 1 or not isinstance(exc, (InvalidInput, WrongState)):
                for prompt, _ in batch:
                    self._finish(prompt, exc)
                return
            logger.warning("prefill batch of %d failed (%s); running each alone", len(batch), exc)
            for part in batch:
                self._step([part])
            return
        for save in filter(None, saves):
            self.prefix.commit_checkpoint(*save)
        logger.debug(
            "prefill step: %d prompts, %d tokens, %.1f ms",
            len(batch), sum(n for _, n in batch), (time.perf_counter() - begin) * 1e3,
        )  # fmt: skip
        for (prompt, n), pick in zip(batch, picks, strict=True):
            prompt.done += n
            prompt.restore_from = prompt.copy_block = -1
            if prompt.done == len(prompt.prompt_ids):
                self._finish(prompt, pick)

    def _reserve(self, prompt: _Prompt, n: int) -> tuple[bytes, int] | None:
        """(block hash, checkpoint slot) when this chunk ends at a checkpoint position and
        the prefix cache has a slot for it."""
        block_hash = prompt.stops.get(prompt.done + n)
        if block_hash is None:
            return None
        slot = self.prefix.reserve_checkpoint(block_hash)
        return None if slot is None else (block_hash, slot)

    def _finish(self, prompt: _Prompt, outcome: TokenPick | BaseException) -> None:
        with self._cond:
            if prompt in self._queue:
                self._queue.remove(prompt)
        prompt.result.put(outcome)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(30)
