"""The connector's scheduler half with real vLLM objects: a prefill PdxferConnector and a
decode one, each in role SCHEDULER, talking over pdxfer's real gRPC control plane.

No model runs: the tests play vLLM's scheduler (requests finish, blocks get allocated, workers
report loads finished) and check the bookkeeping each hook must do.
"""

from __future__ import annotations

import copy
import json
import socket
import time

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from transfer.control.peer_client import PeerClient  # noqa: E402
from transfer.errors import InvalidInput  # noqa: E402
from transfer.tiny_presets import TINY_QWEN3_NEXT  # noqa: E402
from transfer.vllm import PdxferConnector  # noqa: E402
from transfer.vllm.config import compat_fields  # noqa: E402
from transfer.vllm.metadata import RankHandshake, StepMetadata  # noqa: E402
from transfer.vllm.scheduler_pulls import PullPhase  # noqa: E402
from transfer.vllm.ticket import Ticket  # noqa: E402

BLOCK = 16  # tokens per attention block in these tests
PROMPT = 100
WAIT_S = 20.0


@pytest.fixture(scope="module")
def base_config(tmp_path_factory) -> VllmConfig:
    """A real VllmConfig of a tiny bf16 Qwen3-Next (3 GDN layers, 1 attention layer)."""
    model_dir = tmp_path_factory.mktemp("tiny-qwen3-next")
    hf = dict(TINY_QWEN3_NEXT)
    hf.update(
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_hidden_layers=4,
        head_dim=128,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        dtype="bfloat16",
    )
    (model_dir / "config.json").write_text(json.dumps(hf))
    model = ModelConfig(
        model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024
    )
    return VllmConfig(model_config=model)


def make_config(base: VllmConfig, engine_id: str, **extra) -> VllmConfig:
    config = copy.copy(base)
    config.kv_transfer_config = KVTransferConfig(
        kv_connector="PdxferConnector",
        kv_connector_module_path="transfer.vllm",
        kv_role="kv_both",
        engine_id=engine_id,
        kv_connector_extra_config=extra,
    )
    return config


def kv_cache_config(num_blocks: int = 128) -> KVCacheConfig:
    """vLLM's grouping for 3 GDN + 1 attention layers: one group per layer, one page size."""
    attention = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=128, dtype=torch.bfloat16
    )
    gdn = MambaSpec(
        block_size=BLOCK,
        shapes=((3, 1536), (8, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
    )
    groups = [KVCacheGroupSpec(["model.layers.3.self_attn.attn"], attention)]
    groups += [KVCacheGroupSpec([f"model.layers.{i}.linear_attn"], gdn) for i in range(3)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


@pytest.fixture
def connectors(base_config):
    """A started prefill connector and a decode connector (scheduler role)."""
    made = []

    def make(engine_id: str, **extra) -> PdxferConnector:
        connector = PdxferConnector(
            make_config(base_config, engine_id, **extra),
            KVConnectorRole.SCHEDULER,
            kv_cache_config(),
        )
        connector.set_xfer_handshake_metadata({0: RankHandshake(0, 1, {"regions": []}, b"md0")})
        made.append(connector)
        return connector

    yield make
    for connector in made:
        connector.shutdown()


def request(request_id: str, params: dict | None, max_tokens: int = 8) -> Request:
    extra = None if params is None else {"kv_transfer_params": params}
    return Request(
        request_id,
        list(range(PROMPT)),
        SamplingParams(max_tokens=max_tokens, extra_args=extra),
        None,
    )


def step(connector: PdxferConnector) -> StepMetadata:
    meta = connector.build_connector_meta(SchedulerOutput.make_empty())
    assert isinstance(meta, StepMetadata)
    return meta


def finish_prefill(prefill: PdxferConnector, request_id: str) -> dict:
    """Run a prefill request through the prefill connector: returns its kv_transfer_params."""
    req = request(request_id, {"do_remote_decode": True})
    prefill.on_new_request(req)
    assert req.num_prompt_tokens == PROMPT - 1 and req.max_tokens == 1  # decode recomputes the last
    req.num_computed_tokens = req.num_prompt_tokens
    req.append_output_token_ids(7)
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    attention = list(range(10, 17))  # cdiv(99, 16) = 7 blocks
    state = [[0] * 6 + [21 + g] for g in range(3)]  # null padding, then the state block
    delay, params = prefill.request_finished_all_groups(req, (attention, *state))
    assert delay is True
    return json.loads(json.dumps(params))  # as a proxy forwards it


def wait_for(poll, what: str):
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        value = poll()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"{what}: not within {WAIT_S}s")


def released_ids(prefill: PdxferConnector) -> list[str]:
    return step(prefill).released


def test_prefill_publishes_a_ticket_and_holds_the_blocks(connectors):
    prefill = connectors("prefill-0")
    params = finish_prefill(prefill, "r1")
    ticket = Ticket.from_params(params)
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert ticket.request_id == "r1" and ticket.num_tokens == PROMPT - 1 and ticket.tp_size == 1
    assert ticket.block_ids == (tuple(range(10, 17)), (21,), (22,), (23,))
    assert ticket.control_address.startswith("127.0.0.1:")
    assert not ticket.control_address.endswith(":0")  # the bound port is advertised
    assert prefill.has_pending_block_frees() and step(prefill).released == []


def test_decode_acquires_loads_and_releases(connectors):
    prefill, decode = connectors("prefill-0"), connectors("decode-0")
    params = finish_prefill(prefill, "r1")
    req = request("d1", params)
    decode.on_new_request(req)
    matched = wait_for(
        lambda: decode.get_num_new_matched_tokens(req, 0)[0], "decode acquires the ticket"
    )
    assert decode.get_num_new_matched_tokens(req, 0) == (PROMPT - 1, True)
    assert matched == PROMPT - 1
    blocks = KVCacheBlocks(
        (
            [KVCacheBlock(b) for b in range(30, 38)],  # 8 blocks: 99 tokens + the last one
            *([KVCacheBlock(0), KVCacheBlock(40 + g)] for g in range(3)),
        )
    )
    decode.update_state_after_alloc(req, blocks, PROMPT - 1)
    (load,) = step(decode).loads
    assert load.request_id == "d1" and load.num_tokens == PROMPT - 1
    assert load.ticket == Ticket.from_params(params)
    assert load.block_ids == (tuple(range(30, 37)), (40,), (41,), (42,))
    assert step(decode).loads == []  # each load is ordered once
    assert released_ids(prefill) == []  # held while the workers read

    decode.update_connector_output(KVConnectorOutput(finished_recving={"d1"}))
    assert wait_for(lambda: released_ids(prefill), "prefill frees after release") == ["r1"]
    wait_for(
        lambda: step(decode) is not None and decode._scheduler.decode.phase("d1") is None,
        "decode forgets the pull",
    )
    assert not prefill.has_pending_block_frees()
    assert decode.get_kv_connector_stats() is None  # nothing failed, nothing expired


@pytest.mark.parametrize("when", ["acquiring", "acquired"])
def test_decode_aborted_before_its_transfer_frees_prefill(connectors, when):
    prefill, decode = connectors("prefill-0"), connectors("decode-0")
    params = finish_prefill(prefill, "r2")
    req = request("d2", params)
    decode.on_new_request(req)
    if when == "acquired":
        wait_for(lambda: decode.get_num_new_matched_tokens(req, 0)[0], "acquired")
    req.status = RequestStatus.FINISHED_ABORTED
    assert decode.request_finished_all_groups(req, ([], [], [], [])) == (False, None)
    # Nothing else runs on decode: the connector alone must keep vLLM stepping.
    assert decode.has_pending_push_work()
    assert wait_for(lambda: released_ids(prefill) or (step(decode) and None), "freed") == ["r2"]
    wait_for(lambda: step(decode) and not decode.has_pending_push_work(), "nothing in flight")


def test_lease_lapse_frees_prefill_and_is_counted(connectors):
    prefill = connectors("prefill-0", lease_s=0.2)
    finish_prefill(prefill, "r3")
    assert wait_for(lambda: released_ids(prefill), "lease lapses") == ["r3"]
    stats = prefill.get_kv_connector_stats()
    assert stats.data["num_expired_leases"] == [1]
    assert stats.reduce()["Num expired leases"] == 1


def test_unreachable_prefill_falls_back_to_local_compute(connectors):
    decode = connectors("decode-0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ticket = Ticket(f"127.0.0.1:{port}", "gone", ((1,), (2,), (3,), (4,)), PROMPT - 1, 1, "x")
    req = request("d4", ticket.to_params())
    decode.on_new_request(req)
    wait_for(lambda: decode.get_num_new_matched_tokens(req, 0) == (0, False), "acquire fails")
    assert decode._scheduler.decode.phase("d4") is PullPhase.LOCAL
    assert decode.get_kv_connector_stats().data["num_failed_transfers"] == [1]


def test_aborted_prefill_is_not_published(connectors):
    prefill = connectors("prefill-0")
    req = request("r5", {"do_remote_decode": True})
    prefill.on_new_request(req)
    req.status = RequestStatus.FINISHED_ABORTED
    assert prefill.request_finished_all_groups(req, ([10], [], [], [])) == (False, None)
    assert not prefill.has_pending_block_frees()


def test_a_request_without_params_is_left_alone(connectors):
    connector = connectors("both-0")
    req = request("plain", None)
    connector.on_new_request(req)
    assert req.num_prompt_tokens == PROMPT
    assert connector.get_num_new_matched_tokens(req, 0) == (0, False)
    req.status = RequestStatus.FINISHED_STOPPED
    assert connector.request_finished_all_groups(req, ([1], [2], [3], [4])) == (False, None)


def test_compat_covers_block_size_dtypes_and_layout(base_config, monkeypatch):
    config = make_config(base_config, "x")
    fields = compat_fields(config, kv_cache_config())
    assert fields == compat_fields(config, kv_cache_config(num_blocks=7))  # pool size: no
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    assert compat_fields(config, kv_cache_config())["vllm_layout"] != fields["vllm_layout"]
    monkeypatch.delenv("VLLM_SSM_CONV_STATE_LAYOUT")
    other = kv_cache_config()
    other.kv_cache_groups[0] = KVCacheGroupSpec(
        other.kv_cache_groups[0].layer_names,
        FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=128, dtype=torch.float16),
    )
    changed = compat_fields(config, other)
    assert changed["dtypes"] != fields["dtypes"] and changed["groups"] != fields["groups"]


def test_decode_renews_the_lease_it_holds(connectors):
    prefill, decode = connectors("prefill-0"), connectors("decode-0", lease_s=0.3)
    params = finish_prefill(prefill, "r6")
    req = request("d6", params)
    decode.on_new_request(req)
    wait_for(lambda: decode.get_num_new_matched_tokens(req, 0)[0], "acquired")
    store = prefill._scheduler.prefill.store
    acquired_deadline = store.get("r6").lease_deadline
    # No blocks yet, and no engine step at all (one step can outlast a lease): the held
    # lease is still renewed, by the peer client's own timer.
    wait_for(
        lambda: store.get("r6").lease_deadline > acquired_deadline, "a heartbeat renews the lease"
    )
    assert store.holder("r6") == "decode-0"


def ordered_load(prefill: PdxferConnector, decode: PdxferConnector, tag: str) -> None:
    """Publish on prefill, acquire on decode, and order the load (as vLLM would)."""
    req = request(f"d{tag}", finish_prefill(prefill, f"r{tag}"))
    decode.on_new_request(req)
    wait_for(lambda: decode.get_num_new_matched_tokens(req, 0)[0], "acquired")
    blocks = KVCacheBlocks(
        ([KVCacheBlock(b) for b in range(50, 58)], *([KVCacheBlock(60 + g)] for g in range(3)))
    )
    decode.update_state_after_alloc(req, blocks, PROMPT - 1)
    assert len(step(decode).loads) == 1


@pytest.mark.parametrize("prefill_alive", [True, False])
def test_failed_load_still_releases_and_is_not_counted_twice(connectors, prefill_alive):
    prefill, decode = connectors("prefill-0"), connectors("decode-0")
    ordered_load(prefill, decode, "7")
    if not prefill_alive:
        prefill.shutdown()
    decode.update_connector_output(
        KVConnectorOutput(finished_recving={"d7"}, failed_recving={"d7"})
    )
    wait_for(lambda: step(decode) and decode._scheduler.decode.phase("d7") is None, "released")
    if prefill_alive:
        assert released_ids(prefill) == ["r7"]
    assert decode.get_kv_connector_stats() is None  # the workers count a failed load


def test_release_refused_after_a_good_load_is_counted(connectors):
    prefill, decode = connectors("prefill-0"), connectors("decode-0")
    ordered_load(prefill, decode, "8")
    prefill.shutdown()  # prefill gone before Release: what was read cannot be vouched for
    decode.update_connector_output(KVConnectorOutput(finished_recving={"d8"}))
    wait_for(lambda: step(decode) and decode._scheduler.decode.phase("d8") is None, "released")
    assert decode.get_kv_connector_stats().data["num_failed_transfers"] == [1]


def test_auth_token_guards_the_control_plane(connectors, tmp_path):
    token = tmp_path / "token"
    token.write_text("pd-secret\n")
    prefill = connectors("prefill-0", auth_token_file=str(token))
    with_token = connectors("decode-0", auth_token_file=str(token))
    without = connectors("decode-1")
    params = finish_prefill(prefill, "r9")
    stranger = request("d9-stranger", params)
    without.on_new_request(stranger)
    wait_for(lambda: without.get_num_new_matched_tokens(stranger, 0) == (0, False), "refused")
    assert prefill._scheduler.prefill.store.holder("r9") == ""  # nothing changed
    friend = request("d9", params)
    with_token.on_new_request(friend)
    assert wait_for(lambda: with_token.get_num_new_matched_tokens(friend, 0)[0], "acquired") == (
        PROMPT - 1
    )


def test_handshake_lists_every_tp_rank_in_order(base_config):
    config = make_config(base_config, "prefill-tp2")
    config.parallel_config = copy.copy(config.parallel_config)
    config.parallel_config.tensor_parallel_size = 2
    connector = PdxferConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        with pytest.raises(InvalidInput, match=r"expected TP ranks 0\.\.1, got \[1\]"):
            connector.set_xfer_handshake_metadata({1: RankHandshake(1, 2, {}, b"md1")})
        connector.set_xfer_handshake_metadata(
            {r: RankHandshake(r, 2, {"rank": r}, f"md{r}".encode()) for r in (1, 0)}
        )
        address = connector._scheduler.prefill.address
        with PeerClient("decode-x") as peers:
            peers.handshake(address, "decode-x", connector._scheduler.compat)
            assert peers.wait(WAIT_S)
            (event,) = peers.drain()
        assert event.result.rank_metadata == (b"md0", b"md1")
        assert [json.loads(raw) for raw in event.result.rank_layouts] == [{"rank": 0}, {"rank": 1}]
    finally:
        connector.shutdown()


def test_decode_request_finished_before_vllm_showed_it_still_frees_prefill(connectors):
    prefill, decode = connectors("prefill-0"), connectors("decode-0")
    req = request("d10", finish_prefill(prefill, "r10"))
    req.status = RequestStatus.FINISHED_ABORTED  # no on_new_request, no scheduling
    assert decode.request_finished_all_groups(req, ([], [], [], [])) == (False, None)
    assert wait_for(lambda: released_ids(prefill) or (step(decode) and None), "freed") == ["r10"]


def test_a_ticket_covering_the_whole_prompt_is_computed_locally_and_released(connectors):
    """A ticket that cannot serve the request (it covers the whole prompt, or more) is not
    read, but prefill still frees its blocks at once, not at lease expiry."""
    prefill, decode = connectors("prefill-0"), connectors("decode-0")
    params = finish_prefill(prefill, "r13")  # covers PROMPT - 1 tokens
    extra = {"kv_transfer_params": params}
    short = Request("d13", list(range(PROMPT // 2)), SamplingParams(extra_args=extra), None)
    decode.on_new_request(short)
    assert decode.get_num_new_matched_tokens(short, 0) == (0, False)  # at once: no waiting
    assert wait_for(lambda: released_ids(prefill) or (step(decode) and None), "freed") == ["r13"]
    assert step(decode).loads == []
    decode.request_finished_all_groups(short, ([], [], [], []))
    assert wait_for(lambda: step(decode) and decode._scheduler.decode.idle(), "forgotten")


def test_frozen_prefill_costs_decode_control_timeout_s_then_local_compute(connectors):
    """A prefill that accepts connections but never answers (SIGSTOPped, say): Acquire gives
    up after the configured control_timeout_s, not the 10 s default, and decode computes."""
    decode = connectors("decode-0", control_timeout_s=0.5)
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen()  # the kernel accepts; nothing ever reads or answers
        address = f"127.0.0.1:{frozen.getsockname()[1]}"
        ticket = Ticket(address, "frozen", ((1,), (2,), (3,), (4,)), PROMPT - 1, 1, "x")
        req = request("d11", ticket.to_params())
        decode.on_new_request(req)
        started = time.monotonic()
        deadline = started + 5.0  # well under the 10 s default
        while decode.get_num_new_matched_tokens(req, 0) != (0, False):
            assert time.monotonic() < deadline, "Acquire outlived control_timeout_s"
            time.sleep(0.05)
    assert decode._scheduler.decode.phase("d11") is PullPhase.LOCAL
    assert decode.get_kv_connector_stats().data["num_failed_transfers"] == [1]


@pytest.mark.parametrize("forged", ["block_ids", "num_tokens", "groups"])
def test_ticket_that_differs_from_prefills_is_not_read(connectors, forged):
    """A forged or stale ticket (its blocks or token count differ from what prefill's store
    holds for that request) orders no load: decode releases, computes locally, counts it."""
    prefill, decode = connectors("prefill-0"), connectors("decode-0")
    params = finish_prefill(prefill, "r12")
    body = params["pdxfer"]
    if forged == "block_ids":
        body["block_ids"][0] = [b + 40 for b in body["block_ids"][0]]  # another request's
    elif forged == "num_tokens":
        body["num_tokens"] -= BLOCK
    else:
        body["block_ids"] = body["block_ids"][:1]
    req = request("d12", params)
    decode.on_new_request(req)
    # (None, False) while acquiring; then no tokens from prefill: vLLM computes the prompt.
    wait_for(lambda: decode.get_num_new_matched_tokens(req, 0) == (0, False), "acquire ends")
    assert step(decode).loads == []
    assert wait_for(lambda: released_ids(prefill), "prefill frees after release") == ["r12"]
    wait_for(lambda: step(decode) and decode._scheduler.decode.phase("d12") is None, "forgotten")
    assert decode.get_kv_connector_stats().data["num_failed_transfers"] == [1]


def test_an_empty_step_while_prefill_only_holds_tickets_pauses(connectors, monkeypatch):
    """vLLM steps a prefill engine without pause while it holds a finished request's blocks;
    the connector makes such an empty step wait (IDLE_HOLD_PAUSE_S), and no other step."""
    from transfer.vllm import scheduler

    pauses: list[float] = []
    monkeypatch.setattr(scheduler.time, "sleep", pauses.append)
    prefill = connectors("prefill-0")
    step(prefill)
    assert pauses == []  # holds nothing
    finish_prefill(prefill, "r1")
    busy = copy.copy(SchedulerOutput.make_empty())
    busy.total_num_scheduled_tokens = 5
    prefill.build_connector_meta(busy)
    assert pauses == []  # computes something
    step(prefill)
    assert pauses == [scheduler.IDLE_HOLD_PAUSE_S]
