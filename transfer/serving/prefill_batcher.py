"""Batched, chunked prefill on a prefill instance.

Each step takes waiting prompts in arrival order and runs up to `max_num_batched_tokens`
of their tokens as one `PrefillBatch` rank command: whole prompts, and a chunk of the
first prompt that does not fit (the rest of it leads the next step). So no rank command
runs longer than one step's budget, however long the prompt, and a request whose caller
went away stops at the next chunk.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from transfer.control.types import GREEDY, SamplingParams
from transfer.errors import Cancelled, Closed, InvalidInput, PdxferError, WrongState
from transfer.serving.commands import PrefillBatch, PrefillChunk, TokenPick
from transfer.serving.rank_protocol import same_on_every_rank
from transfer.serving.ranks import RankGroup

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
    result: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)


class PrefillBatcher:
    """Runs the prompts of `run` callers as batched, chunked steps on `ranks`."""

    def __init__(self, ranks: RankGroup, max_num_batched_tokens: int) -> None:
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
    ) -> TokenPick:
        """Prefill the prompt into `block_ids`/`slot` (a FREE slot); the first generated
        token. Raises `Cancelled` once `is_cancelled()` is seen true between chunks; the
        slot is then part-filled and its owner releases it."""
        if not prompt_ids:
            raise InvalidInput("prompt_ids: must not be empty")
        prompt = _Prompt(request_id, tuple(prompt_ids), tuple(block_ids), slot, sampling,
                         is_cancelled)  # fmt: skip
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
    def num_waiting(self) -> int:
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
            take = min(len(prompt.prompt_ids) - prompt.done, budget)
            if take <= 0:
                break
            batch.append((prompt, take))
            budget -= take
        return batch

    def _step(self, batch: list[tuple[_Prompt, int]]) -> None:
        chunks = tuple(
            PrefillChunk(p.prompt_ids[p.done : p.done + n], p.done, p.block_ids, p.slot, p.sampling)
            for p, n in batch
        )
        begin = time.perf_counter()
        try:
            picks = same_on_every_rank(self.ranks.call(PrefillBatch(chunks)), "prefill step")
        except PdxferError as exc:
            # A batch that failed its checks (bad input, wrong slot state) changed nothing:
            # run each part alone to find whose it is. Any other failure may have left
            # states half-advanced, so every part of the batch fails.
            if len(batch) == 1 or not isinstance(exc, (InvalidInput, WrongState)):
                for prompt, _ in batch:
                    self._finish(prompt, exc)
                return
            logger.warning("prefill batch of %d failed (%s); running each alone", len(batch), exc)
            for part in batch:
                self._step([part])
            return
        logger.debug(
            "prefill step: %d prompts, %d tokens, %.1f ms",
            len(batch), sum(n for _, n in batch), (time.perf_counter() - begin) * 1e3,
        )  # fmt: skip
        for (prompt, n), pick in zip(batch, picks, strict=True):
            prompt.done += n
            if prompt.done == len(prompt.prompt_ids):
                self._finish(prompt, pick)

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
