"""A peer that closes, hangs or dies: transfers fail by their deadline, with a reason, and
the survivor keeps working."""

import itertools
import time

import numpy as np
import pytest
import torch

from tests.support.dataplane import PeerProcess, expect_pattern, fill
from transfer.dataplane import Op, RangeBatch, make_transport, wait

pytestmark = pytest.mark.slow

SEED = 5
ARENA = 16 << 20
SLACK_S = 3.0  # poll interval, a loaded machine
BACKENDS = ["nixl", "ucx"]
_names = itertools.count()


def _connect(backend, **options):
    n = next(_names)
    env = {"UCX_TLS": options["tls"]} if "tls" in options else {}
    peer = PeerProcess(backend, f"victim-{backend}-{n}", ARENA, [(0, ARENA)], SEED, options, env)
    transport = make_transport(backend, f"survivor-{backend}-{n}", **options)
    arena = torch.zeros(ARENA, dtype=torch.uint8)
    transport.register(arena)
    transport.add_peer(peer.metadata)
    warm = RangeBatch.single(0, 0, 1 << 20)
    assert wait(transport, transport.post(Op.READ, peer.name, warm, deadline_s=30)).done
    return transport, peer, arena


def _ends_in_time(transport, peer, op, nbytes, deadline_s):
    start = time.monotonic()
    handle = transport.post(op, peer.name, RangeBatch.single(0, 0, nbytes), deadline_s=deadline_s)
    status = wait(transport, handle)
    elapsed = time.monotonic() - start
    transport.release(handle)
    assert elapsed < deadline_s + SLACK_S, f"ended after {elapsed:.1f} s: {status}"
    return status


def _fails_in_time(transport, peer, op, nbytes, deadline_s):
    status = _ends_in_time(transport, peer, op, nbytes, deadline_s)
    assert status.failed and status.reason, status
    return status


def _still_healthy(transport, arena):
    """The survivor can still move bytes with a fresh peer, then close cleanly."""
    fresh = make_transport(transport.backend, f"fresh-{next(_names)}")
    fresh_arena = torch.empty(1 << 20, dtype=torch.uint8)
    fill(fresh_arena, SEED, [(0, 1 << 20)])
    transport.add_peer(fresh.register(fresh_arena))
    batch = RangeBatch.single(4096, 100, 300_000)
    assert wait(transport, transport.post(Op.READ, fresh.name, batch, deadline_s=30)).done
    expect_pattern(arena, batch, SEED)
    transport.close()
    fresh.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_then_killed_peer(backend):
    transport, peer, arena = _connect(backend)
    try:
        peer.call("close_transport")  # alive, but its arena is no longer registered
        status = _ends_in_time(transport, peer, Op.READ, 1 << 20, deadline_s=3.0)
        # ucx: nobody serves the request. NIXL over CMA may still read the mapped pages
        # until the peer's disconnect reaches this agent; either way nothing hangs.
        assert status.failed or backend == "nixl", status
        peer.kill()
        for op in (Op.READ, Op.WRITE):
            _fails_in_time(transport, peer, op, 4 << 20, deadline_s=3.0)
        transport.remove_peer(peer.name)
        _still_healthy(transport, arena)
    finally:
        transport.close()
        peer.stop()


def _settles(transport, handle, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = transport.poll(handle)
        if status.settled:
            return status
        time.sleep(0.01)
    raise AssertionError(f"transfer did not settle within {timeout_s} s: {status}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_hung_then_killed_mid_transfer(backend):
    """Over TCP a transfer needs the peer's progress, so a stopped peer leaves it in flight.
    (Within one host NIXL's default CMA path copies inside `post`: nothing stays in flight.)"""
    transport, peer, arena = _connect(backend, tls="tcp")
    try:
        peer.pause()
        start = time.monotonic()
        hung = transport.post(Op.READ, peer.name, RangeBatch.single(0, 0, 8 << 20), deadline_s=1.5)
        status = wait(transport, hung)
        assert status.failed and "deadline" in status.reason
        assert time.monotonic() - start < 1.5 + SLACK_S
        assert not status.settled  # the READ is still posted: its bytes could land

        start = time.monotonic()
        handle = transport.post(
            Op.WRITE, peer.name, RangeBatch.single(0, 0, 8 << 20), deadline_s=4.0
        )
        time.sleep(0.3)
        assert transport.poll(handle).pending
        peer.kill()
        status = wait(transport, handle)
        assert status.failed and status.reason
        assert time.monotonic() - start < 4.0 + SLACK_S
        assert _settles(transport, hung).failed  # a dead peer moves nothing any more
        transport.release(hung)
        transport.release(handle)
        _still_healthy(transport, arena)
    finally:
        transport.close()
        peer.stop()


@pytest.mark.parametrize("backend", BACKENDS)
def test_late_bytes_land_before_settled(backend):
    """A READ past its deadline stays unsettled until the resumed peer's bytes have landed."""
    transport, peer, arena = _connect(backend, tls="tcp")
    try:
        peer.pause()
        batch = RangeBatch.single(2 << 20, 0, 4 << 20)
        handle = transport.post(Op.READ, peer.name, batch, deadline_s=0.5)
        status = wait(transport, handle)
        assert status.failed and not status.settled
        peer.resume()
        assert _settles(transport, handle).failed
        expect_pattern(arena, batch, SEED)  # the late bytes landed, and before `settled`
        transport.release(handle)
    finally:
        transport.close()
        peer.stop()


def test_released_ucx_read_never_lands():
    """ucx cancels a released READ whose data has not started: a resumed peer's bytes do
    not land. (NIXL cannot cancel a one-sided READ in flight; see the test above.)"""
    transport, peer, arena = _connect("ucx", tls="tcp")
    try:
        peer.pause()
        handle = transport.post(
            Op.READ, peer.name, RangeBatch.single(2 << 20, 0, 4 << 20), deadline_s=30
        )
        assert transport.poll(handle).pending
        transport.release(handle)
        peer.resume()
        time.sleep(1.0)
        assert not arena[2 << 20 : 6 << 20].any()
        assert np.count_nonzero(arena[: 1 << 20].numpy()) > 0  # the warm-up READ did land
    finally:
        transport.close()
        peer.stop()
