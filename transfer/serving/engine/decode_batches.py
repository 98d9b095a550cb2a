"""The decode batch of a decode engine's step: which requests it steps (a step that starts
a transfer holds it back, at most one step in a row), the `DecodeStep` each sends, and what
the batch's answer does: each pick goes to its request's consumer, and the last one ends
the request. Engine thread only.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from transfer.control.types import TokenEvent
from transfer.errors import PdxferError
from transfer.serving.engine.request import Request
from transfer.serving.engine.step import Answer, StepPlan
from transfer.serving.ranks.commands import DecodeBatch, DecodeStep
from transfer.serving.ranks.rank_protocol import same_on_every_rank

if TYPE_CHECKING:
    from transfer.serving.engine.decode_engine import DecodeEngine


class DecodeBatches:
    """Adds a step's decode batch to its plan and hands the batch's picks out."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine
        self.held_back = 0  # steps that held the decode batch back for a transfer start
        self._held_back = False  # the last step's plan held it back
        self._last_answer_at = 0.0

    def add(self, plan: StepPlan, starts: bool) -> None:
        """Add the decode batch to `plan`: one step of each request that wants one, up to
        `max_num_seqs`, unless `starts` (the plan starts a transfer) holds it back."""
        engine = self.engine
        batch = [r for r in engine.active if r.wants_step and not engine.is_finishing(r)]
        batch = batch[: engine.max_num_seqs]
        hold_back = bool(batch) and starts and not self._held_back
        self._held_back = hold_back
        if hold_back:  # the start's answer (most are DONE) need not wait for a decode step
            self.held_back += 1
            return
        if not batch:
            return
        steps = tuple(next_step(r) for r in batch)
        for request in batch:
            request.scheduled += 1
        plan.add(DecodeBatch(steps), lambda a, b=batch, p=plan: self.on_picks(b, a, p))
        plan.decode_batch = len(batch)

    def on_picks(self, batch: list[Request], answer: Answer, plan: StepPlan) -> None:
        engine = self.engine
        now, sent_at = plan.answered_at or time.perf_counter(), plan.sent_at
        if isinstance(answer, BaseException):
            for request in batch:
                if not engine.is_finishing(request):
                    engine.finish(request, answer)
            return
        try:
            picks = same_on_every_rank(answer, "decode step")
        except PdxferError as exc:
            for request in batch:
                engine.finish(request, exc)
            return
        if engine.metrics is not None:  # the step ran from when it was sent or the last answer
            began = max(self._last_answer_at, sent_at)
            engine.metrics.record_decode_step(len(batch), max(0.0, now - began))
        self._last_answer_at = now
        for request, pick in zip(batch, picks, strict=True):
            request.delivered += 1
            request.last_token = pick.token
            if engine.is_finishing(request) or request.cancelled:
                continue
            index = request.delivered
            last = index == request.last_index
            engine.emit(request, TokenEvent(request.request_id, pick.token, index,
                                            finished=last, logprob=pick.logprob))  # fmt: skip
            if last:
                engine.finish(request, None)


def next_step(request: Request) -> DecodeStep:
    """Its next decode step: the last pick's token, or None for the ranks to feed what they
    picked in its step still out (pipelined decode)."""
    k = request.scheduled
    token = request.last_token if k == request.delivered else None
    ticket = request.ticket
    return DecodeStep(token, ticket.num_tokens + k, request.blocks, request.slot,
                      request.decode.sampling, 1 + k)  # fmt: skip
