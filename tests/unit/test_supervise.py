"""The restart policy's backoff, and a supervisor giving up on an instance that never
starts (real `pdxfer serve` processes that exit on a bad flag)."""

from __future__ import annotations

import time

import pytest

from transfer.serving.launch.supervise import RestartPolicy, State, Supervisor
from transfer.serving.role import ServeRole


def test_backoff_doubles_per_death_in_a_row_up_to_its_cap():
    policy = RestartPolicy(first_backoff_s=1.0, max_backoff_s=30.0)
    assert [policy.backoff_s(n) for n in (1, 2, 3, 4, 5, 6, 9)] == [1, 2, 4, 8, 16, 30, 30]


def test_a_negative_restart_budget_is_refused():
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)


@pytest.mark.slow
def test_an_instance_that_keeps_dying_is_restarted_then_given_up(tmp_path):
    said: list[str] = []
    policy = RestartPolicy(max_restarts=2, first_backoff_s=0.0)
    supervisor = Supervisor(tmp_path, {}, policy, said.append)
    instance = supervisor.start(ServeRole.DECODE, "decode-0", ["--model", "no-such-model"])
    deadline = time.monotonic() + 120
    try:
        with pytest.raises(RuntimeError, match="every decode instance was given up"):
            while time.monotonic() < deadline:
                supervisor.check(time.monotonic())
                time.sleep(0.05)
    finally:
        supervisor.stop()
    assert instance.state is State.GIVEN_UP and instance.restarts == 2
    registry = supervisor.metrics.registry
    assert registry.get_sample_value("pdxfer_up_restarts_total", {"role": "decode"}) == 2
    assert registry.get_sample_value("pdxfer_up_restarts_total", {"role": "prefill"}) == 0
    assert sum("before it was ready" in line for line in said) == 3
    assert (tmp_path / "decode-0" / "restart-2" / "decode.log").read_text()  # its own log
