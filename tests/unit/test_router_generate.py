"""Router.generate's retry rule and outcome counter, with its attempts injected.

`generate` drives `agenerate` on the router's own event loop, so these run both."""

from __future__ import annotations

import asyncio

import pytest

from transfer.control.errors import ControlError
from transfer.control.types import GenerateRequest, TokenEvent
from transfer.serving.openai.router import Router

REQUEST = GenerateRequest("r1", (1, 2, 3), 4)


@pytest.fixture
def router():
    # Nothing listens on these addresses: every call below goes through the injected attempt.
    router = Router(["127.0.0.1:1"], ["127.0.0.1:2"])
    yield router
    router.close()


def _events(count: int) -> list[TokenEvent]:
    return [TokenEvent("r1", 10 + i, i, finished=i == count - 1) for i in range(count)]


def _inject(router: Router, monkeypatch, attempts: list) -> list[int]:
    """Each call of `_attempt` takes the next item: an exception raised before any token,
    or a list of events. Returns the list of call numbers made."""
    calls: list[int] = []

    async def attempt(request):
        calls.append(len(calls))
        outcome = attempts[len(calls) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        if isinstance(outcome, list):
            for event in outcome:
                yield event
        else:
            async for event in outcome:
                yield event

    monkeypatch.setattr(router, "_attempt", attempt)
    return calls


def _count(router: Router, status: str) -> float:
    value = router.metrics.registry.get_sample_value(
        "pdxfer_router_requests_total", {"status": status}
    )
    return value or 0.0


def test_decode_failing_before_its_first_token_is_retried_once(router, monkeypatch):
    calls = _inject(router, monkeypatch, [ControlError("UNAVAILABLE", "gone"), _events(3)])
    tokens = [event.token for event in router.generate(REQUEST)]
    assert tokens == [10, 11, 12]
    assert len(calls) == 2
    assert router.metrics.registry.get_sample_value("pdxfer_router_decode_retries_total") == 1
    assert _count(router, "ok") == 1 and _count(router, "failed") == 0


def test_a_code_a_retry_would_share_is_not_retried(router, monkeypatch):
    calls = _inject(router, monkeypatch, [ControlError("INVALID_ARGUMENT", "bad"), _events(1)])
    with pytest.raises(ControlError, match="INVALID_ARGUMENT"):
        list(router.generate(REQUEST))
    assert len(calls) == 1
    assert _count(router, "failed") == 1


def test_the_last_attempt_failing_is_raised(router, monkeypatch):
    gone = ControlError("UNAVAILABLE", "gone")
    calls = _inject(router, monkeypatch, [gone, ControlError("ABORTED", "again")])
    with pytest.raises(ControlError, match="ABORTED"):
        list(router.generate(REQUEST))
    assert len(calls) == 2
    assert _count(router, "failed") == 1


def test_a_failure_after_the_first_token_is_not_retried(router, monkeypatch):
    async def broken():
        yield _events(2)[0]
        raise ControlError("UNAVAILABLE", "decode died")

    calls = _inject(router, monkeypatch, [broken(), _events(2)])
    stream = router.generate(REQUEST)
    assert next(stream).token == 10
    with pytest.raises(ControlError, match="decode died"):
        next(stream)
    assert len(calls) == 1
    assert _count(router, "failed") == 1


def test_a_caller_that_stops_reading_counts_as_ok(router, monkeypatch):
    # A stop string or EOS found by the front end closes the stream early: nothing failed.
    _inject(router, monkeypatch, [_events(4)])
    stream = router.generate(REQUEST)
    assert next(stream).token == 10
    stream.close()
    assert _count(router, "ok") == 1 and _count(router, "failed") == 0


def test_a_refusal_before_the_first_token_is_raised_at_once_not_retried(router, monkeypatch):
    # The HTTP front end answers 429 before a stream starts only if the refusal comes
    # out of the first read, not after a retry has started the request elsewhere.
    calls = _inject(router, monkeypatch, [ControlError("RESOURCE_EXHAUSTED", "full"), _events(1)])
    stream = router.generate(REQUEST)
    with pytest.raises(ControlError, match="RESOURCE_EXHAUSTED"):
        next(stream)
    assert len(calls) == 1
    assert _count(router, "failed") == 1


def test_a_caller_cancelled_while_waiting_counts_as_ok(router, monkeypatch):
    # A gRPC caller that hangs up cancels the handler's task mid-stream.
    async def stalled():
        yield _events(2)[0]
        await asyncio.Event().wait()

    _inject(router, monkeypatch, [stalled()])

    async def read_one_then_cancel():
        stream = router.agenerate(REQUEST)
        first = await anext(stream)
        reader = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        await stream.aclose()
        return first.token

    assert asyncio.run(read_one_then_cancel()) == 10
    assert _count(router, "ok") == 1 and _count(router, "failed") == 0
