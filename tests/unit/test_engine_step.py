"""EngineStep: a step's commands run in order in one round trip to real rank processes, and
a failing command fails only itself."""

from __future__ import annotations

import pytest

from tests.support.rank_fakes import HoldUntil, Refuse, Sleep, Spec, Tick
from transfer.errors import InvalidInput
from transfer.serving.engine.step import EngineStep, SentStep, StepPlan
from transfer.serving.ranks.ranks import RankGroup

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def group():
    ranks = RankGroup([Spec()], "tests.support.rank_fakes:build", label="engine-step")
    yield ranks
    ranks.close()


def test_each_command_answers_for_itself_in_order(group):
    plan = StepPlan(0)
    answers: list = []
    for command in (Sleep(0.0), Refuse("slot 3 is broken"), Sleep(0.01)):
        plan.add(command, answers.append)
    SentStep(plan, group.submit(EngineStep(tuple(plan.commands)))).answer(TIMEOUT_S)
    assert answers[0] == [0.0] and answers[2] == [0.01]
    assert isinstance(answers[1], InvalidInput) and "slot 3 is broken" in str(answers[1])
    assert group.alive  # a failed command is its own, never the group's


def test_a_step_that_overtakes_runs_beside_the_command_running(group, tmp_path):
    """In a group of one rank, a step that overtakes runs at once, while the loop still
    runs the command before it, ahead of the in-order steps waiting; every answer still
    reaches its own step."""
    gate = tmp_path / "go"
    holding = group.submit(HoldUntil(str(gate)))
    in_order = [group.submit(EngineStep((Tick(),))) for _ in range(2)]
    overtaking = group.submit(EngineStep((Tick(),), overtakes=True))
    try:
        assert overtaking.result(TIMEOUT_S) == [(0,)]  # the hold has not returned yet
    finally:
        gate.touch()
    holding.result(TIMEOUT_S)
    assert [p.result(TIMEOUT_S) for p in in_order] == [[(1,)], [(2,)]]
