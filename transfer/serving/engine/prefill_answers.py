"""What a prefill step's answer does to its prompts: each chunk that ran moves its prompt
on, and a prompt leaves the engine by publishing its ticket once its last chunk ran, or
by failing; either way its cache goes back through the cache manager's `release` (a
published ticket's once the ticket store frees it). Engine thread only.

A failed batch fails only the prompts it must: one that failed its checks (bad input, a
slot in the wrong state) changed nothing but restored slots, which a rerun restores again,
so each of its prompts runs its next chunk alone and only the culprit fails. Any other
failure may have left states half-advanced (or the rank group is gone): all of it fails.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

from transfer.control.errors import ControlError
from transfer.control.types import Ticket
from transfer.errors import Cancelled, InvalidInput, PdxferError, WrongState
from transfer.serving.engine.request import PrefillPhase, Prompt
from transfer.serving.engine.step import Answer, agreed
from transfer.serving.ranks.commands import TokenPick

if TYPE_CHECKING:
    from transfer.serving.engine.prefill_engine import PrefillEngine

logger = logging.getLogger(__name__)


class PrefillAnswers:
    """Moves prompts on by their steps' answers; publishes or ends them."""

    def __init__(self, engine: PrefillEngine) -> None:
        self.engine = engine

    def on_picks(self, batch: list[tuple[Prompt, int]], saves: list, answer: Answer) -> None:
        """The prefill batch's answer; `saves`: each chunk's (unit hash, checkpoint slot)
        or None."""
        prefix = self.engine.instance.prefix
        answer = agreed(answer, "prefill step")
        if isinstance(answer, BaseException):
            for save in filter(None, saves):
                prefix.cancel_checkpoint(save[1])
            if len(batch) > 1 and isinstance(answer, (InvalidInput, WrongState)):
                logger.warning("prefill batch of %d failed (%s); running each alone",
                               len(batch), answer)  # fmt: skip
                for prompt, _ in batch:
                    prompt.alone = True
                return
            for prompt, _ in batch:
                self.fail(prompt, answer)
            return
        for save in filter(None, saves):
            prefix.commit_checkpoint(*save)
        for (prompt, n), pick in zip(batch, answer, strict=True):
            prompt.done += n
            prompt.alone = False
            if prompt.restore_from >= 0 or prompt.copy_block >= 0:
                prompt.restore_from = prompt.copy_block = -1
                self.engine.cache.let_go(prompt)  # the first chunk copied what the hit pinned
            if prompt.done == prompt.num_tokens:
                self.prefilled(prompt, pick)

    def prefilled(self, prompt: Prompt, pick: TokenPick) -> None:
        """Its last chunk ran: the prefix cache takes its blocks; then its ticket is
        published (with --dump-dir once its snapshot, later in the same step, is answered)."""
        engine = self.engine
        engine.running.remove(prompt)
        prefix = engine.instance.prefix
        engine.cache.let_go(prompt)
        if prefix is not None:
            prefix.insert_prompt(prompt.unit_hashes, prompt.blocks,
                                 prompt.cached_tokens // prefix.unit)  # fmt: skip
            if engine.metrics is not None:
                engine.metrics.record_prefix(prefix.counts())
        prompt.first = pick
        if not engine.instance.config.dump_dir:
            self.publish(prompt)

    def on_snapshot(self, prompt: Prompt, answer: Answer) -> None:
        if prompt.first is None or prompt.phase is not PrefillPhase.PREFILLING:
            return  # its last chunk failed (or it ended): nothing to publish
        if isinstance(answer, BaseException):
            self.fail(prompt, answer)
        else:
            self.publish(prompt)

    def publish(self, prompt: Prompt) -> None:
        try:
            self.engine.tickets.publish(prompt)
        except PdxferError as exc:
            self.fail(prompt, exc)

    def publish_early(self, prompt: Prompt) -> None:
        """Layer-wise streaming: the ticket now, the prompt in the next steps. A failed
        prefill aborts the ticket, so its decode's next heartbeat fails."""
        try:
            self.engine.tickets.publish_early(prompt)
        except PdxferError as exc:
            self.fail(prompt, exc)

    def ticket_freed(self, ticket: Ticket) -> None:
        prompt = self.engine.holding.get(ticket.request_id)
        mine = None if prompt is None else prompt.ticket
        if mine is None or not mine.same_publish(ticket):  # released already
            logger.debug("freed ticket %r holds no cache here", ticket.request_id)
            return
        self.release(prompt)

    def fail(self, prompt: Prompt, error: BaseException) -> None:
        """End `prompt` with `error`: a published (streamed) one by aborting its ticket,
        whose free gives the cache back; any other by telling its caller and releasing."""
        engine = self.engine
        # While it holds its id, a live ticket under the id is its own.
        if engine.tickets.is_live(prompt):
            if not isinstance(error, Cancelled):
                logger.warning("streamed prefill of %r failed: %s", prompt.request_id, error)
            self.stop(prompt)
            with contextlib.suppress(ControlError, PdxferError):
                engine.store.abort(prompt.request_id, f"prefill failed: {error}")
            return
        if prompt.ticket is None:
            prompt.out.put(error)
        self.release(prompt)

    def stop(self, prompt: Prompt) -> None:
        """Take `prompt` off the engine's queued and running lines."""
        for line in (self.engine.queued, self.engine.running):
            if prompt in line:
                line.remove(prompt)

    def release(self, prompt: Prompt) -> None:
        engine = self.engine
        self.stop(prompt)
        if engine.holding.get(prompt.request_id) is prompt:
            del engine.holding[prompt.request_id]
        engine.cache.release(prompt)
