"""Decode's scheduler half handshakes with each prefill instance (never a worker): once per
control address, through the PeerClient, over real gRPC, between real PdxferConnectors in role
SCHEDULER. A Pull waits for both its Acquire and its prefill's Handshake; a failed handshake
is a counted local recompute; the workers get the reply with the first load that needs it."""

from __future__ import annotations

import json
import pickle
import socket

import pytest

pytest.importorskip("vllm")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from tests.vllm import test_vllm_scheduler as pair  # noqa: E402
from tests.vllm.test_vllm_scheduler import (  # noqa: E402
    PROMPT,
    finish_prefill,
    released_ids,
    request,
    step,
    wait_for,
)
from transfer.vllm import PdxferConnector  # noqa: E402
from transfer.vllm.metadata import PrefillPeer, StepMetadata  # noqa: E402
from transfer.vllm.scheduler_peers import HANDSHAKE_TRIES  # noqa: E402
from transfer.vllm.scheduler_pulls import PullPhase  # noqa: E402
from transfer.vllm.ticket import Ticket  # noqa: E402

# The scheduler tests' fixtures: a real prefill and decode PdxferConnector over real gRPC.
base_config = pair.base_config
connectors = pair.connectors


def count_handshakes(connector: PdxferConnector, monkeypatch) -> list[str]:
    """The addresses `connector`'s scheduler half sends Handshake to (the real call runs)."""
    peers = connector._scheduler.peers
    sent: list[str] = []
    real = peers.handshake

    def handshake(address, *args, **kwargs):
        sent.append(address)
        real(address, *args, **kwargs)

    monkeypatch.setattr(peers, "handshake", handshake)
    return sent


def acquire_and_load(decode: PdxferConnector, params: dict, request_id: str) -> StepMetadata:
    """Admit a decode request, wait until it may load, allocate its blocks: the step's
    metadata, pickled and unpickled as vLLM sends it to the workers."""
    req = request(request_id, params)
    decode.on_new_request(req)
    wait_for(lambda: decode.get_num_new_matched_tokens(req, 0)[0], f"{request_id} may load")
    blocks = KVCacheBlocks(
        ([KVCacheBlock(b) for b in range(50, 58)], *([KVCacheBlock(60 + g)] for g in range(3)))
    )
    decode.update_state_after_alloc(req, blocks, PROMPT - 1)
    meta = pickle.loads(pickle.dumps(step(decode)))
    assert [load.request_id for load in meta.loads] == [request_id]
    return meta


def test_handshake_once_per_address_and_the_workers_get_its_reply(connectors, monkeypatch):
    prefill, decode = connectors("prefill-0"), connectors("decode-0")
    sent = count_handshakes(decode, monkeypatch)
    address = prefill._scheduler.prefill.address
    first = acquire_and_load(decode, finish_prefill(prefill, "r1"), "d1")
    # The workers learn the prefill with its first load: each rank's layout and metadata,
    # as prefill's workers registered them (`connectors` registers one rank).
    assert first.peers == {address: PrefillPeer("prefill-0", (b'{"regions": []}',), (b"md0",))}
    assert json.loads(first.peers[address].layouts[0]) == {"regions": []}
    second = acquire_and_load(decode, finish_prefill(prefill, "r2"), "d2")
    assert second.peers == {}  # told once
    assert sent == [address]  # handshaken once
    assert decode.get_kv_connector_stats() is None


def test_failed_handshake_is_a_counted_local_recompute(connectors, monkeypatch):
    """An incompatible prefill (another conv-state layout): decode reads nothing, computes
    the prompt, counts the failure once, and releases the ticket so prefill frees at once.
    The next ticket naming the address handshakes again."""
    prefill = connectors("prefill-0")
    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")  # decode's compat differs
    decode = connectors("decode-0")
    sent = count_handshakes(decode, monkeypatch)
    for n, tag in enumerate(("3", "4"), start=1):
        req = request(f"d{tag}", finish_prefill(prefill, f"r{tag}"))
        decode.on_new_request(req)
        wait_for(lambda r=req: decode.get_num_new_matched_tokens(r, 0) == (0, False), "refused")
        assert decode._scheduler.decode.phase(req.request_id) is not PullPhase.ACQUIRED
        assert wait_for(lambda: released_ids(prefill), "prefill frees") == [f"r{tag}"]
        wait_for(
            lambda r=req: (
                step(decode) is not None and decode._scheduler.decode.phase(r.request_id) is None
            ),
            "decode forgets the pull",
        )
        assert step(decode).loads == []
        assert decode.get_kv_connector_stats().data["num_failed_transfers"] == [1]
        assert len(sent) == n  # a failed handshake is not remembered


def test_request_finished_while_its_handshake_is_pending_frees_prefill(connectors, monkeypatch):
    """Acquired, but the handshake has not answered (held back here) when vLLM finishes the
    request: the ticket is released at once, and the late answer changes nothing."""
    prefill, decode = connectors("prefill-0"), connectors("decode-0")
    peers = decode._scheduler.peers
    held_back: list[tuple] = []
    monkeypatch.setattr(peers, "handshake", lambda *args, **kwargs: held_back.append(args))
    req = request("d5", finish_prefill(prefill, "r5"))
    decode.on_new_request(req)
    sides = decode._scheduler.decode
    wait_for(lambda: (sides.poll() or True) and sides._pulls.get("d5").held is not None, "acquired")
    assert decode.get_num_new_matched_tokens(req, 0) == (None, False)  # still waiting
    req.status = RequestStatus.FINISHED_ABORTED
    assert decode.request_finished_all_groups(req, ([], [], [], [])) == (False, None)
    assert wait_for(lambda: released_ids(prefill) or (step(decode) and None), "freed") == ["r5"]
    monkeypatch.undo()
    (address, *rest) = held_back[0]
    peers.handshake(address, *rest)  # the answer arrives after all
    wait_for(lambda: step(decode) is not None and sides.idle(), "forgotten")
    assert decode.get_kv_connector_stats() is None  # an abort is not a failure


def test_unanswered_handshake_is_sent_again_then_given_up(connectors, monkeypatch):
    """A prefill that accepts connections but never answers: the Handshake is sent
    HANDSHAKE_TRIES times in all (each waits control_timeout_s), then forgotten; the request
    (its Acquire unanswered too) computes locally, counted once."""
    decode = connectors("decode-0", control_timeout_s=0.3)
    sent = count_handshakes(decode, monkeypatch)
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen()  # the kernel accepts; nothing ever reads or answers
        address = f"127.0.0.1:{frozen.getsockname()[1]}"
        ticket = Ticket(address, "frozen", ((1,), (2,), (3,), (4,)), PROMPT - 1, 1, "x")
        req = request("d6", ticket.to_params())
        decode.on_new_request(req)
        wait_for(lambda: decode.get_num_new_matched_tokens(req, 0) == (0, False), "local")
        sides = decode._scheduler.decode
        wait_for(lambda: (sides.poll() or True) and len(sent) == HANDSHAKE_TRIES, "all tries")
        wait_for(lambda: (sides.poll() or True) and not sides._prefills._known, "given up")
    assert sent == [address] * HANDSHAKE_TRIES
    assert sides.phase("d6") is PullPhase.LOCAL
    assert decode.get_kv_connector_stats().data["num_failed_transfers"] == [1]
