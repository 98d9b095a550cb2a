"""Prefill's scheduler half orders the partial last block staged in the step that computes
the prompt's last tokens, publishes the slot in the ticket and frees it with the ticket."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from vllm.v1.request import RequestStatus  # noqa: E402

from tests.vllm.test_vllm_scheduler import (  # noqa: E402, F401 (base_config: a fixture)
    BLOCK,
    PROMPT,
    base_config,
    kv_cache_config,
    make_config,
    request,
)
from transfer.vllm import PdxferConnector  # noqa: E402
from transfer.vllm.metadata import DigestSpec, RankHandshake, StageSpec  # noqa: E402
from transfer.vllm.stage_tail import STAGE_SLOTS  # noqa: E402
from transfer.vllm.ticket import Ticket  # noqa: E402

STAGE_START, SLOT_BYTES = 1 << 20, 4096
STATE = [[0, 21], [0, 22], [0, 23]]  # null padding, then each GDN group's state block


@pytest.fixture
def prefill(base_config):  # noqa: F811
    connector = PdxferConnector(
        make_config(base_config, "prefill-stage"), KVConnectorRole.SCHEDULER, kv_cache_config()
    )
    connector.set_xfer_handshake_metadata(
        {0: RankHandshake(0, 1, {"regions": []}, b"md0", STAGE_START, SLOT_BYTES)}
    )
    yield connector
    connector.shutdown()


def _first_chunk(req, attention: list[int], tokens: int) -> SchedulerOutput:
    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs = [NewRequestData.from_request(req, (attention, *STATE))]
    output.num_scheduled_tokens = {req.request_id: tokens}
    return output


def _next_chunk(req, new_attention: list[int], tokens: int) -> SchedulerOutput:
    output = SchedulerOutput.make_empty()
    cached = CachedRequestData.make_empty()
    cached.req_ids = [req.request_id]
    cached.new_block_ids = [(new_attention, [], [], [])]
    cached.num_computed_tokens = [req.num_computed_tokens]
    cached.num_output_tokens = [0]
    output.scheduled_cached_reqs = cached
    output.num_scheduled_tokens = {req.request_id: tokens}
    return output


def _finish(connector, req, attention: list[int]) -> dict | None:
    req.num_computed_tokens = req.num_prompt_tokens
    req.append_output_token_ids(7)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    _, params = connector.request_finished_all_groups(req, (attention, *STATE))
    return params


def test_the_last_chunk_stages_the_partial_block_and_the_ticket_names_the_slot(prefill):
    req = request("r1", {"do_remote_decode": True})
    prefill.on_new_request(req)  # 99 tokens: 6 full blocks of 16, 3 in block 16
    attention = list(range(10, 17))
    assert prefill.build_connector_meta(_first_chunk(req, attention[:4], 64)).stages == []
    req.num_computed_tokens = 64
    meta = prefill.build_connector_meta(_next_chunk(req, attention[4:], PROMPT - 1 - 64))
    assert meta.stages == [StageSpec("r1", 16, (PROMPT - 1) % BLOCK, 0)]
    ticket = Ticket.from_params(_finish(prefill, req, attention))
    assert ticket.staged_offsets == (STAGE_START,)
    # Slot 0 is held by the published ticket: the next prefill gets slot 1.
    other = request("r2", {"do_remote_decode": True})
    prefill.on_new_request(other)
    meta = prefill.build_connector_meta(_first_chunk(other, [40 + i for i in range(7)], 99))
    assert meta.stages == [StageSpec("r2", 46, 3, 1)]
    assert Ticket.from_params(_finish(prefill, other, list(range(40, 47)))).staged_offsets == (
        STAGE_START + SLOT_BYTES,
    )


def test_an_aborted_prefill_frees_its_slot_and_full_blocks_stage_nothing(prefill):
    req = request("r1", {"do_remote_decode": True})
    prefill.on_new_request(req)
    assert prefill.build_connector_meta(_first_chunk(req, list(range(10, 17)), 99)).stages
    req.status = RequestStatus.FINISHED_ABORTED
    assert prefill.request_finished_all_groups(req, (list(range(10, 17)), *STATE)) == (False, None)
    for i in range(STAGE_SLOTS + 1):  # every slot free again, then none
        again = request(f"a{i}", {"do_remote_decode": True})
        prefill.on_new_request(again)
        stages = prefill.build_connector_meta(_first_chunk(again, list(range(10, 17)), 99)).stages
        assert len(stages) == (1 if i < STAGE_SLOTS else 0)
    unstaged = _finish(prefill, again, list(range(10, 17)))
    assert Ticket.from_params(unstaged).staged_offsets == ()  # its last block crosses whole
    exact = request("e1", {"do_remote_decode": True})
    exact.prompt_token_ids[:] = exact.prompt_token_ids[: 2 * BLOCK + 1]
    exact._all_token_ids[:] = exact._all_token_ids[: 2 * BLOCK + 1]
    exact.num_prompt_tokens = 2 * BLOCK + 1
    prefill.on_new_request(exact)  # 32 tokens: two full blocks
    assert prefill.build_connector_meta(_first_chunk(exact, [50, 51], 2 * BLOCK)).stages == []


def test_a_ticket_freed_as_soon_as_it_is_published_frees_its_stage_slot(prefill):
    """The slot is held before the ticket goes live: a free that comes in between (decode's
    release, an abort) must find it, or the slot leaks and after STAGE_SLOTS of them nothing
    is staged."""
    store = prefill._scheduler.prefill.store
    publish = store.publish

    def publish_then_abort(request_id, *args, **kwargs):
        published = publish(request_id, *args, **kwargs)
        store.abort(request_id, "freed before request_finished returned")
        return published

    store.publish = publish_then_abort
    for i in range(STAGE_SLOTS + 1):
        req = request(f"q{i}", {"do_remote_decode": True})
        prefill.on_new_request(req)
        meta = prefill.build_connector_meta(_first_chunk(req, list(range(10, 17)), 99))
        assert meta.stages == [StageSpec(f"q{i}", 16, 3, 0)]  # slot 0 came back every time
        assert Ticket.from_params(_finish(prefill, req, list(range(10, 17)))).staged_offsets


DIGEST_START, DIGEST_SLOT_BYTES = 1 << 24, 512


@pytest.fixture
def verifying_prefill(base_config):  # noqa: F811
    connector = PdxferConnector(
        make_config(base_config, "prefill-verify", verify=True),
        KVConnectorRole.SCHEDULER,
        kv_cache_config(),
    )
    handshake = RankHandshake(
        0, 1, {"regions": []}, b"md0", STAGE_START, SLOT_BYTES, DIGEST_START, DIGEST_SLOT_BYTES
    )
    connector.set_xfer_handshake_metadata({0: handshake})
    yield connector
    connector.shutdown()


def test_verify_digests_the_last_chunk_and_the_ticket_names_the_table(verifying_prefill):
    prefill = verifying_prefill
    req = request("v1", {"do_remote_decode": True})
    prefill.on_new_request(req)
    attention = list(range(10, 17))
    assert prefill.build_connector_meta(_first_chunk(req, attention[:4], 64)).digests == []
    req.num_computed_tokens = 64
    meta = prefill.build_connector_meta(_next_chunk(req, attention[4:], PROMPT - 1 - 64))
    clipped = (tuple(attention), (21,), (22,), (23,))
    assert meta.digests == [DigestSpec("v1", clipped, PROMPT - 1, 0)]
    ticket = Ticket.from_params(_finish(prefill, req, attention))
    assert ticket.digest_offsets == (DIGEST_START,)
    # Slot 0 is held until decode releases the ticket; then it is the next one's again.
    other = request("v2", {"do_remote_decode": True})
    prefill.on_new_request(other)
    assert prefill.build_connector_meta(_first_chunk(other, attention, 99)).digests[0].slot == 1
    prefill._sched().prefill.store.abort("v1", "test")  # decode gone: freed
    third = request("v3", {"do_remote_decode": True})
    prefill.on_new_request(third)
    assert prefill.build_connector_meta(_first_chunk(third, attention, 99)).digests[0].slot == 0


def test_verify_off_digests_nothing(prefill):
    req = request("n1", {"do_remote_decode": True})
    prefill.on_new_request(req)
    assert prefill.build_connector_meta(_first_chunk(req, list(range(10, 17)), 99)).digests == []
    assert Ticket.from_params(_finish(prefill, req, list(range(10, 17)))).digest_offsets == ()
