"""One engine step as one rank command: the step's commands run in order on every rank,
and each answers for itself, so one request's failure fails only its own command.

The engine is the only sender on its rank pipe, so steps run in the order it sends them: a
slot released in one step is free before a transfer of a later step (or a later command of
the same step) reuses it. A step that `overtakes` runs before the steps still waiting at the
ranks; the engine sends one only when nothing it touches was touched or freed by a step not
yet answered (`DecodeEngine`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from transfer.errors import PdxferError
from transfer.serving.ranks.rank_protocol import (
    RankCommand,
    RankFailure,
    command_error,
    same_on_every_rank,
)
from transfer.serving.ranks.ranks import Pending

logger = logging.getLogger(__name__)

# What a command's handler gets: the per-rank answers in rank order, or the exception.
Answer = list[Any] | BaseException
Handler = Callable[[Answer], None]


@dataclass(frozen=True)
class EngineStep(RankCommand[tuple]):
    """Run `commands` in order; answers one result (or `RankFailure`) per command."""

    commands: tuple[RankCommand, ...]
    overtakes: bool = False

    def apply(self, worker: Any) -> tuple:
        rank = getattr(getattr(worker, "spec", None), "rank", 0)
        results: list[Any] = []
        for command in self.commands:
            try:
                results.append(command.apply(worker))
            except Exception as exc:  # the command's own failure, answered as a rank's would be
                if not isinstance(exc, ValueError):
                    logger.exception("%s failed", type(command).__name__)
                results.append(RankFailure.of(rank, exc))
        return tuple(results)


def split_answers(commands: tuple[RankCommand, ...], per_rank: list[tuple]) -> list[Answer]:
    """The EngineStep's per-rank answers, one `Answer` per command."""
    answers: list[Answer] = []
    for i, command in enumerate(commands):
        results = [rank_results[i] for rank_results in per_rank]
        failures = [r for r in results if isinstance(r, RankFailure)]
        answers.append(command_error(type(command).__name__, failures) if failures else results)
    return answers


def agreed(answer: Answer, what: str) -> Any:
    """A batch command's answer as one result (the ranks broadcast rank 0's picks), or
    the error: the command's own, or PdxferError when the ranks disagree."""
    if isinstance(answer, BaseException):
        return answer
    try:
        return same_on_every_rank(answer, what)
    except PdxferError as exc:
        return exc


@dataclass
class StepPlan:
    """The commands of the next step and who handles each answer."""

    index: int
    commands: list[RankCommand] = field(default_factory=list)
    handlers: list[Handler] = field(default_factory=list)
    decode_batch: int = 0  # requests in its decode batch
    overtakes: bool = False  # runs before the steps still waiting at the ranks
    sent_at: float = 0.0  # time.perf_counter() when it went to the ranks
    answered_at: float = 0.0  # time.perf_counter() when its answer was back

    def add(self, command: RankCommand, handler: Handler | None = None) -> None:
        self.commands.append(command)
        self.handlers.append(handler or _ignore)

    def __bool__(self) -> bool:
        return bool(self.commands)


@dataclass
class SentStep:
    plan: StepPlan
    pending: Pending

    def answer(self, timeout_s: float) -> None:
        """Wait for the step's answer and run each command's handler."""
        self.handle(self.wait(timeout_s))

    def wait(self, timeout_s: float) -> list[Answer]:
        """Wait for the step's answer: one `Answer` per command (any thread)."""
        commands = tuple(self.plan.commands)
        try:
            answers: list[Answer] = split_answers(commands, self.pending.result(timeout_s))
        except Exception as exc:  # the group failed: every command did
            answers = [exc] * len(commands)
        self.plan.answered_at = time.perf_counter()
        return answers

    def handle(self, answers: list[Answer]) -> None:
        """Run each command's handler on its answer (the engine thread)."""
        for handler, answer in zip(self.plan.handlers, answers, strict=True):
            try:
                handler(answer)
            except Exception:  # a bug in one handler must not stop the others
                logger.exception("engine: handling an answer failed")


def _ignore(answer: Answer) -> None:
    if isinstance(answer, BaseException):
        logger.warning("engine: %s", answer)
