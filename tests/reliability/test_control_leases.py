"""Leases on a real server: out-of-order deadlines (bug 10) and a decode instance that dies holding a ticket."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

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

ROOT = Path(__file__).resolve().parents[2]
COMPAT = make_compat(geometry="tiny/tp1", dtypes="bf16", block_size=1, layout_version=1)
IDENTITY = HandshakeReply("p0", COMPAT, compat_hash(COMPAT))


class ManualClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


class Owner:
    """on_free for a store: records each free and wakes waiters."""

    def __init__(self):
        self.freed: dict[str, list[FreeReason]] = {}
        self._cond = threading.Condition()

    def __call__(self, ticket, reason):
        with self._cond:
            self.freed.setdefault(ticket.request_id, []).append(reason)
            self._cond.notify_all()

    def wait_freed(self, request_ids: set[str], timeout: float = 15.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: request_ids <= self.freed.keys(), timeout):
                raise AssertionError(
                    f"not freed within {timeout}s: {sorted(request_ids - self.freed.keys())}"
                )


def test_reaper_expires_out_of_order_deadlines_over_grpc():
    clock, owner, metrics = ManualClock(), Owner(), WorkerMetrics()
    store = TicketStore(
        ControlConfig(16, 16, 1, 1, lease_s=10.0),
        owner,
        clock=clock,
        metrics=metrics,
        max_wait_s=0.02,
    )
    server = serve("127.0.0.1:0", store=store, identity=IDENTITY)
    store.start()
    try:
        with TransferClient(server.address, timeout_s=10) as client:
            for slot, (request_id, lease) in enumerate(
                [("A", 50), ("B", 5), ("C", 20), ("D", 1), ("E", 3)]
            ):
                store.publish(request_id, [slot], slot, 1, 1, lease_s=lease)
            assert (
                client.acquire("E", "decode-0").lease_deadline == 10.0
            )  # acquire renews to now + 10
            clock.now = 6.0
            owner.wait_freed({"B", "D"})
            assert set(owner.freed) == {"B", "D"} and {"A", "C", "E"} == {
                r for r in "ACE" if store.get(r)
            }
            assert client.heartbeat("E", "decode-0") == 16.0
            clock.now = 12.0
            store.reap()  # E's entry at 10 is stale; it must not be reaped
            assert store.get("E") is not None
            clock.now = 17.0
            owner.wait_freed({"E"})
            assert store.get("C") is not None
            with pytest.raises(ControlError) as info:
                client.heartbeat("E", "decode-0")
            assert info.value.code == "NOT_FOUND" and "expired" in info.value.details
            clock.now = 60.0
            owner.wait_freed({"A", "C"})
    finally:
        server.stop(0)
        store.stop()
    assert owner.freed == {r: [FreeReason.EXPIRED] for r in "ABCDE"} and len(store) == 0
    assert b"pdxfer_leases_expired_total 5.0" in metrics.render()


CRASHING_DECODE = """
import sys, time
from transfer.control.client import TransferClient
client = TransferClient(sys.argv[1], timeout_s=10)
client.wait_ready()
print("ready", flush=True)
request_id = sys.stdin.readline().strip()
client.acquire(request_id, "decode-doomed")
print("acquired", flush=True)
while True:
    client.heartbeat(request_id, "decode-doomed")
    print("beat", flush=True)
    time.sleep(0.05)
"""


@pytest.mark.slow
def test_decode_crash_does_not_leak_prefill_memory():
    owner = Owner()
    free_blocks = set(range(8))

    def on_free(ticket, reason):
        free_blocks.update(ticket.block_ids)
        owner(ticket, reason)

    store = TicketStore(ControlConfig(8, 2, 4, 2, lease_s=3.0), on_free, max_wait_s=0.05)
    server = serve("127.0.0.1:0", store=store, identity=IDENTITY)
    store.start()
    decode = subprocess.Popen(
        [sys.executable, "-c", CRASHING_DECODE, server.address],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert _read_line(decode) == "ready"
        free_blocks -= {2, 5}
        store.publish("victim", [2, 5], 1, 7, 3)
        decode.stdin.write("victim\n")
        decode.stdin.flush()
        assert _read_line(decode) == "acquired"
        assert [_read_line(decode) for _ in range(3)] == ["beat"] * 3
        assert store.holder("victim") == "decode-doomed"
        decode.kill()  # SIGKILL: no release, no abort, no goodbye
        decode.wait(10)
        owner.wait_freed({"victim"})
    finally:
        if decode.poll() is None:
            decode.kill()
            decode.wait(10)
        server.stop(0)
        store.stop()
    assert (
        owner.freed == {"victim": [FreeReason.EXPIRED]}
        and free_blocks == set(range(8))
        and len(store) == 0
    )


def _read_line(process: subprocess.Popen, timeout: float = 30.0) -> str:
    lines: list[str] = []
    reader = threading.Thread(
        target=lambda: lines.append(process.stdout.readline().strip()), daemon=True
    )
    reader.start()
    reader.join(timeout)
    if not lines:
        raise AssertionError(
            f"subprocess said nothing within {timeout}s (exit code {process.poll()})"
        )
    return lines[0]
