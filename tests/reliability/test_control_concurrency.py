"""1,000 tickets published and freed concurrently through a real loopback server: nothing leaks, nothing frees twice."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from transfer.control import (
    ControlConfig,
    ControlError,
    FreeReason,
    HandshakeReply,
    TicketStore,
    WorkerMetrics,
    compat_hash,
    make_compat,
)
from transfer.control.client import TransferClient
from transfer.control.server import serve

NUM_TICKETS = 1000
CONFIG = ControlConfig(
    num_kv_blocks=384, num_state_slots=128, block_size=4, max_blocks_per_request=3, lease_s=30.0
)
COMPAT = make_compat(geometry="tiny/tp1", dtypes="bf16", block_size=4, layout_version=1)


class FreeList:
    """The owner's pool of ids (the real pools live in transfer/cache). Blocks until ids are free."""

    def __init__(self, total: int):
        self.total = total
        self._free = list(range(total))
        self._cond = threading.Condition()

    def take(self, n: int, timeout: float = 60.0) -> list[int]:
        with self._cond:
            if not self._cond.wait_for(lambda: len(self._free) >= n, timeout):
                raise AssertionError("pool exhausted: ids leaked")
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def give(self, ids) -> None:
        with self._cond:
            if set(ids) & set(self._free):
                raise AssertionError(f"double free of {sorted(set(ids) & set(self._free))}")
            self._free.extend(ids)
            self._cond.notify_all()

    def free_count(self) -> int:
        with self._cond:
            return len(self._free)

    def ids(self) -> list[int]:
        with self._cond:
            return sorted(self._free)


@pytest.mark.slow
def test_thousand_tickets_concurrently():
    blocks, slots = FreeList(CONFIG.num_kv_blocks), FreeList(CONFIG.num_state_slots)
    freed: list[tuple[str, FreeReason]] = []
    freed_lock = threading.Lock()

    def on_free(ticket, reason):
        with freed_lock:  # recorded first, so a second free shows even if give() then raises
            freed.append((ticket.request_id, reason))
        blocks.give(ticket.block_ids)
        slots.give([ticket.slot_id])

    metrics = WorkerMetrics()
    metrics.track_pools(
        kv_blocks_free=blocks.free_count,
        kv_blocks_total=lambda: blocks.total,
        state_slots_free=slots.free_count,
        state_slots_total=lambda: slots.total,
    )
    store = TicketStore(CONFIG, on_free, instance_id="p0", metrics=metrics, max_wait_s=0.05)
    server = serve(
        "127.0.0.1:0",
        store=store,
        identity=HandshakeReply("p0", COMPAT, compat_hash(COMPAT)),
        max_workers=16,
    )
    store.start()
    client = TransferClient(server.address, timeout_s=30)

    def lifecycle(i: int) -> None:
        request_id, holder = f"req-{i}", f"decode-{i % 4}"
        num_tokens = 1 + i % 12
        ticket = store.publish(
            request_id,
            blocks.take(-(-num_tokens // CONFIG.block_size)),
            slots.take(1)[0],
            num_tokens,
            first_token=i,
            lease_s=0.05 if i % 10 == 1 else None,
        )
        kind = i % 10
        if kind == 0:  # the router drops it before any decode instance shows up
            client.abort(request_id, ticket.abort_key, "dropped")
        elif kind == 1:  # nobody comes: the lease frees it
            pass
        elif kind == 2:  # release and abort race; exactly one may win
            client.acquire(request_id, holder)
            outcomes = []
            race = [
                threading.Thread(
                    target=_try, args=(outcomes, client.abort, request_id, ticket.abort_key)
                ),
                threading.Thread(
                    target=_try,
                    args=(
                        outcomes,
                        client.release,
                        request_id,
                        holder,
                        ticket.block_ids,
                        ticket.slot_id,
                    ),
                ),
            ]
            for t in race:
                t.start()
            for t in race:
                t.join(30)
            assert sorted(outcomes) == ["NOT_FOUND", "ok"], outcomes
        else:
            got = client.acquire(request_id, holder)
            assert got.block_ids == ticket.block_ids and got.first_token == i
            client.heartbeat(request_id, holder)
            client.release(request_id, holder, got.block_ids, got.slot_id)

    try:
        client.wait_ready()
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(lifecycle, range(NUM_TICKETS)))  # re-raises the first failure
        end = time.monotonic() + 30.0
        while len(store) and time.monotonic() < end:  # the expiring tenth waits for the reaper
            time.sleep(0.02)
    finally:
        client.close()
        server.stop(0)
        store.stop()

    assert len(store) == 0, "tickets left behind"
    counts = Counter(request_id for request_id, _ in freed)
    assert counts == Counter({f"req-{i}": 1 for i in range(NUM_TICKETS)}), (
        "on_free must run exactly once per ticket"
    )
    reasons = dict(freed)
    for i in range(NUM_TICKETS):
        expected = {
            0: {FreeReason.ABORTED},
            1: {FreeReason.EXPIRED},
            2: {FreeReason.ABORTED, FreeReason.RELEASED},
        }
        assert reasons[f"req-{i}"] in expected.get(i % 10, {FreeReason.RELEASED})
    assert blocks.ids() == list(range(CONFIG.num_kv_blocks)) and slots.ids() == list(
        range(CONFIG.num_state_slots)
    )
    scraped = {
        s.name: s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    assert (
        scraped["pdxfer_kv_blocks_free"]
        == scraped["pdxfer_kv_blocks_total"]
        == CONFIG.num_kv_blocks
    )
    assert (
        scraped["pdxfer_state_slots_free"]
        == scraped["pdxfer_state_slots_total"]
        == CONFIG.num_state_slots
    )
    assert scraped["pdxfer_tickets_active"] == 0
    assert scraped["pdxfer_leases_expired_total"] == NUM_TICKETS // 10


def _try(outcomes: list[str], call, *args) -> None:
    try:
        call(*args)
        outcomes.append("ok")
    except ControlError as err:
        outcomes.append(err.code)
