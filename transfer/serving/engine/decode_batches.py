"""The decode batches of a decode engine's step: which requests it steps (a step that starts
a transfer holds them back, at most one step in a row), the `DecodeStep` each sends, and
what each batch's answer does: each pick goes to its request's consumer, and the last one
ends the request. Engine thread only.

A failed batch fails only the requests it must. One that failed its checks ran nothing
(the ranks check every step, and feed every token, before a step writes any cache), so
its requests go back to their last delivered pick and run again, each in a batch of its
own (a `DecodeBatch` command of its own in the next steps, beside everyone else's), so
the next failure names exactly one request: a batch of one that fails ends its request.
Any other failure (`StepFailed`: the step may have advanced the linear-attention states
in place; the ranks disagree; the group is gone) ends every request of the batch: none
may run that step again.

Steps are pipelined: a step sent before the last one's answer names no token for the
requests it continues, so when a batch fails its checks, a later batch already sent with
one of its requests fails its checks too (no pick to feed), and runs nothing. Its other
requests go back to their last delivered pick as well, and its answer is ignored for all.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING

from transfer.control.types import TokenEvent
from transfer.errors import InvalidInput, WrongState
from transfer.serving.engine.request import Request
from transfer.serving.engine.step import Answer, StepPlan, agreed
from transfer.serving.ranks.commands import DecodeBatch, DecodeStep, TokenPick
from transfer.serving.ranks.rank_protocol import RankCommandError

if TYPE_CHECKING:
    from transfer.serving.engine.decode_engine import DecodeEngine

logger = logging.getLogger(__name__)


class SentBatch:
    """One DecodeBatch at the ranks: each request with its `resends` when it was sent."""

    def __init__(self, requests: list[Request]) -> None:
        self.entries = [(r, r.resends) for r in requests]

    def current(self) -> list[Request]:
        """Its requests whose step in it is not void."""
        return [r for r, resends in self.entries if r.resends == resends]


class DecodeBatches:
    """Adds a step's decode batches to its plan and hands their picks out."""

    def __init__(self, engine: DecodeEngine) -> None:
        self.engine = engine
        self.held_back = 0  # steps that held the decode batch back for a transfer start
        self._held_back = False  # the last step's plan held it back
        self._in_flight: list[SentBatch] = []  # sent, not yet answered, in order
        self._last_answer_at = 0.0

    def add(self, plan: StepPlan, starts: bool) -> None:
        """Add the decode batches to `plan`: one step of each request that wants one, up to
        `max_num_seqs`, unless `starts` (the plan starts a transfer) holds them back. The
        requests marked `alone` get a batch each; the others share one."""
        engine = self.engine
        wanting = [r for r in engine.active if r.wants_step and not engine.is_finishing(r)]
        wanting = wanting[: engine.max_num_seqs]
        hold_back = bool(wanting) and starts and not self._held_back
        self._held_back = hold_back
        if hold_back:  # the start's answer (most are DONE) need not wait for a decode step
            self.held_back += 1
            return
        shared = [r for r in wanting if not r.alone]
        batches = ([shared] if shared else []) + [[r] for r in wanting if r.alone]
        for i, batch in enumerate(batches):
            steps = tuple(next_step(r) for r in batch)
            sent = SentBatch(batch)
            for request in batch:
                request.scheduled += 1
            self._in_flight.append(sent)
            plan.add(DecodeBatch(steps), partial(self.on_picks, sent, plan=plan, first=i == 0))
        plan.decode_batch = len(wanting)

    def on_picks(self, sent: SentBatch, answer: Answer, plan: StepPlan, first: bool) -> None:
        """`sent`'s answer; `first`: the step's first decode batch (it records the step)."""
        self._in_flight.remove(sent)
        answer = agreed(answer, "decode step")
        if isinstance(answer, BaseException):
            self._failed(sent, answer)
            return
        now = plan.answered_at or time.perf_counter()
        if first and self.engine.metrics is not None:  # it ran from its sending or the last answer
            began = max(self._last_answer_at, plan.sent_at)
            self.engine.metrics.record_decode_step(plan.decode_batch, max(0.0, now - began))
        self._last_answer_at = now
        for (request, resends), pick in zip(sent.entries, answer, strict=True):
            if request.resends == resends:  # else void: it runs again from its last pick
                self._deliver(request, pick)

    def _deliver(self, request: Request, pick: TokenPick) -> None:
        engine = self.engine
        request.delivered += 1
        request.last_token = pick.token
        request.alone = False
        if engine.is_finishing(request) or request.cancelled:
            return
        index = request.delivered
        last = index == request.last_index
        engine.emit(request, TokenEvent(request.request_id, pick.token, index,
                                        finished=last, logprob=pick.logprob))  # fmt: skip
        if last:
            engine.finish(request, None)

    def _failed(self, sent: SentBatch, error: BaseException) -> None:
        engine = self.engine
        unpicked = {id(r): r.resends for r in sent.current()}
        current = [r for r in sent.current() if not engine.is_finishing(r)]
        # Every rank raised: none made a pick. Failing its checks, none ran anything.
        raised = isinstance(error, RankCommandError)
        raised = raised and len(error.failures) == engine.instance.config.tp
        checked = raised and isinstance(error, (InvalidInput, WrongState))
        if checked and len(sent.entries) > 1:
            if current:
                logger.warning("decode batch of %d failed its checks (%s); stepping each alone",
                               len(sent.entries), error)  # fmt: skip
            run_again(current, alone=True)
        else:  # a lone request's own failure, or one after the step may have written caches
            for request in current:
                engine.finish(request, error)
        if raised:
            self._void_later(unpicked)

    def _void_later(self, unpicked: dict[int, int]) -> None:
        """`unpicked`: id(request) -> its `resends`, for the requests whose steps made no
        pick. A later batch already sent with one of them names no token for it, so it
        fails its checks and runs nothing: its other requests run again too (shared)."""
        for later in self._in_flight:  # in the order sent: one can only doom later ones
            if not any(unpicked.get(id(r)) == resends for r, resends in later.entries):
                continue
            others = [r for r in later.current() if id(r) not in unpicked]
            unpicked.update((id(r), r.resends) for r in others)
            run_again([r for r in others if not self.engine.is_finishing(r)], alone=False)


def run_again(requests: list[Request], alone: bool) -> None:
    """Void the steps of `requests` at the ranks: each runs again from its last delivered
    pick (`alone`: in a batch of its own until a pick comes back)."""
    for request in requests:
        request.scheduled = request.delivered
        request.resends += 1
        request.alone = request.alone or alone


def next_step(request: Request) -> DecodeStep:
    """Its next decode step: the last pick's token, or None for the ranks to feed what they
    picked in its step still out (pipelined decode)."""
    k = request.scheduled
    token = request.last_token if k == request.delivered else None
    ticket = request.ticket
    return DecodeStep(token, ticket.num_tokens + k, request.blocks, request.slot,
                      request.decode.sampling, 1 + k)  # fmt: skip
