"""A rank command that outlives its timeout kills the group only when a rank stops beating
(issue: a long prefill must not be mistaken for a dead group)."""

from __future__ import annotations

import contextlib
import os
import signal

import pytest

from tests.support.rank_fakes import Sleep, Spec
from transfer.serving.ranks.rank_protocol import RankGroupDead
from transfer.serving.ranks.ranks import RankGroup

pytestmark = pytest.mark.slow


def test_a_slow_command_keeps_the_group_and_a_frozen_rank_ends_it():
    group = RankGroup([Spec()], "tests.support.rank_fakes:build", label="beats")
    pid = group.procs[0].pid
    try:
        assert group.call(Sleep(3.0), timeout_s=1.0) == [3.0]  # slow, still beating
        assert group.alive
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(RankGroupDead, match="no answer to Sleep"):
            group.call(Sleep(0.0), timeout_s=1.0)
        assert not group.alive
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        group.close()
    assert group.join(10)
