"""The bounded waiting queue in front of an instance's pools (docs/workers.md)."""

from __future__ import annotations

import threading
import time

import pytest

from transfer.cache.pools import CachePools
from transfer.control.errors import status_code_name
from transfer.errors import CapacityError, DeadlineExceeded, InvalidInput
from transfer.serving.engine.admission import Admission


def test_a_request_that_can_never_fit_is_bad_input_naming_the_limit():
    admission = Admission(CachePools(16, num_blocks=4, num_slots=2), max_queue=1)
    with pytest.raises(InvalidInput, match="need 5 KV blocks of 16; this instance has 4") as info:
        admission.allocate("huge", 65)
    assert status_code_name(info.value) == "INVALID_ARGUMENT"
    assert admission.pools.slots.num_free == 2


def test_overload_waits_in_a_bounded_queue_then_is_refused():
    pools = CachePools(16, num_blocks=4, num_slots=1)
    admission = Admission(pools, max_queue=1, wait_s=30.0)
    admission.allocate("a", 16)  # the only slot
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(admission.allocate("b", 16)))
    waiter.start()
    deadline = time.monotonic() + 10
    while admission.waiting != 1:
        assert time.monotonic() < deadline, "b never queued"
        time.sleep(0.01)
    with pytest.raises(CapacityError, match="--max-queue 1") as full:
        admission.allocate("c", 16)
    assert status_code_name(full.value) == "RESOURCE_EXHAUSTED"
    pools.free("a")
    admission.freed()
    waiter.join(10)
    assert [c.request_id for c in got] == ["b"] and admission.waiting == 0


def test_a_queued_request_gives_up_at_its_wait():
    pools = CachePools(16, num_blocks=4, num_slots=1)
    admission = Admission(pools, max_queue=4)
    admission.allocate("a", 16)
    with pytest.raises(DeadlineExceeded, match="no room within 0.2s"):
        admission.allocate("b", 16, wait_s=0.2)
    assert admission.waiting == 0 and pools.slots.num_free == 0
