"""A direct READ starts from the ticket the router passed, while its Acquire is still out
(docs/workers.md, "Acquire and the READ"): the transfer runs before the Acquire answers, the
request moves on only once it has, and a ticket freed and published again under the same id
is never decoded from. A prefill and a decode instance in this process with serve's
defaults (prefix cache and staging on; this prompt's READ is direct)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.worker_sides import Side, one_thread, prompt, running_pair  # noqa: F401
from transfer.control.errors import TicketStateError
from transfer.control.types import DecodeRequest, PrefillRequest
from transfer.model.reference import reference_generate
from transfer.presets import get_preset
from transfer.serving.ranks.commands import TransferPoll, TransferState

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-next"
MAX_TOKENS = 4
WAIT_S = 30.0


@pytest.fixture(scope="module")
def pair():
    with running_pair(MODEL, "early", tp=1, max_seqs=2) as sides:
        yield sides


def assert_idle(prefill: Side, decode: Side) -> None:
    assert prefill.worker.settle(), "prefill frees still running after 30 s"
    assert len(prefill.worker.store) == 0
    for side in (prefill, decode):
        pools = side.instance.pools
        assert side.instance.free_kv_blocks == pools.blocks.num_total
        assert pools.slots.num_free == pools.slots.num_total


def transfer_state(decode: Side, request_id: str) -> TransferState | None:
    try:
        (status,) = decode.instance.ranks.call(TransferPoll(request_id))
    except Exception:  # noqa: BLE001 - no transfer under that id (yet)
        return None
    return status.state


def test_the_read_finishes_before_the_acquire_answers_and_counts_only_after(pair, monkeypatch):
    prefill, decode = pair
    ids = prompt(71)
    store = prefill.worker.store
    acquire, gate, asked = store.acquire, threading.Event(), threading.Event()

    def held_acquire(request_id: str, holder: str):
        asked.set()
        assert gate.wait(WAIT_S), "the test never let the Acquire through"
        return acquire(request_id, holder)

    monkeypatch.setattr(store, "acquire", held_acquire)
    ticket = prefill.worker.prefill(PrefillRequest("early", tuple(ids), MAX_TOKENS))
    tokens: list[int] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            tokens.extend(e.token for e in decode.worker.decode(DecodeRequest(ticket, MAX_TOKENS)))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            failure.append(exc)

    consumer = threading.Thread(target=run, daemon=True)
    consumer.start()
    try:
        assert asked.wait(WAIT_S)
        deadline = time.monotonic() + WAIT_S
        while transfer_state(decode, "early") is not TransferState.DONE:
            assert time.monotonic() < deadline, transfer_state(decode, "early")
            time.sleep(0.002)
        # Every READ landed, the Acquire is still held: no token may have left.
        assert tokens == [] and failure == []
        assert len(store) == 1
    finally:
        gate.set()
    consumer.join(WAIT_S)
    assert not consumer.is_alive() and failure == []
    assert tokens == reference_generate(get_preset(MODEL), ids, MAX_TOKENS)
    assert_idle(prefill, decode)


def test_a_ticket_freed_and_published_again_is_never_decoded_from_its_old_copy(pair):
    """The router's copy names a cache prefill has freed; the same request id was published
    again (a retry) before the Acquire. The Acquire returns the new publish, whose blocks
    the READs did not come from: the request fails, and the new ticket, held by decode now,
    is aborted."""
    prefill, decode = pair
    ids = tuple(prompt(72))
    store = prefill.worker.store
    old = prefill.worker.prefill(PrefillRequest("again", ids, MAX_TOKENS))
    store.abort("again", "test: the first attempt is dropped")
    new = prefill.worker.prefill(PrefillRequest("again", ids, MAX_TOKENS))
    assert new.abort_key != old.abort_key
    with pytest.raises(TicketStateError, match="published again"):
        list(decode.worker.decode(DecodeRequest(old, MAX_TOKENS)))
    assert_idle(prefill, decode)
