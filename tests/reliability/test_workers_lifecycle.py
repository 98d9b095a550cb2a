"""A prefill and a decode instance in this process (their TP ranks are real processes):
the request lifecycle, its failure paths, and regression tests for docs/bugs.md #4
and 6. Every test ends with both instances' pools back at their totals and no live ticket.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests.support.ucx_env import pristine_ucx_env
from tests.support.worker_sides import Side, one_thread, prompt  # noqa: F401 (fixture)
from transfer.cache.layout import Layout
from transfer.control.client import ClientOptions
from transfer.control.errors import NotPermitted
from transfer.control.server import serve
from transfer.control.types import DecodeRequest, GenerateRequest, PrefillRequest
from transfer.errors import PeerUnavailable, TransferFailed
from transfer.model.caches import LocalCaches
from transfer.model.reference import reference_generate
from transfer.model.runner import RankEngine
from transfer.model.slots import CacheFillingError
from transfer.net import free_port
from transfer.presets import get_preset
from transfer.serving.engine.decode import DecodeWorker
from transfer.serving.engine.instance import Instance, InstanceConfig
from transfer.serving.engine.prefill import PrefillWorker
from transfer.serving.engine.reads import plan_direct, transfer_request
from transfer.serving.launch.verify import check_request
from transfer.serving.openai.router import Router
from transfer.serving.ranks.commands import (
    AddPeers,
    DecodeBatch,
    DecodeStep,
    Release,
    Snapshot,
    TransferEnd,
    TransferPoll,
    TransferSettled,
    TransferStart,
    TransferState,
)
from transfer.serving.ranks.rank_protocol import RankCommandError

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-next"
MAX_TOKENS = 6
LEASE_S = 30.0


# Each test runs on instances with the bare engine (no prefix cache, every READ direct),
# and again with the production defaults (`serve`'s, which InstanceConfig's are: the prefix
# cache and staging on).
SETTINGS = {"bare": {"prefix_cache": False, "staging_bytes": 0}, "production": {}}


def one_step(token: int | None, position: int, blocks, slot: int) -> DecodeBatch:
    """One request's decode step, sent as the decode batcher sends steps: a batch of one."""
    return DecodeBatch((DecodeStep(token, position, tuple(blocks), slot),))


def start_prefill(dump_dir: Path, name: str, settings: dict) -> Side:
    instance = Instance(config("prefill", dump_dir, settings))
    address = f"127.0.0.1:{free_port()}"
    worker = PrefillWorker(instance, name, address, LEASE_S)
    server = serve(address, store=worker.store, identity=worker.identity, prefill=worker.prefill)
    worker.start()
    return Side(instance, worker, server, address)


def config(role: str, dump_dir: Path, settings: dict) -> InstanceConfig:
    geometry = get_preset(MODEL)
    return InstanceConfig(
        role, geometry, tp=1, budget_bytes=16 << 20, max_seqs=3, dump_dir=str(dump_dir),
        **settings,
    )  # fmt: skip


@pytest.fixture(scope="module", params=sorted(SETTINGS))
def prefill_a(request, tmp_path_factory):
    dump_dir = tmp_path_factory.mktemp("caches")
    settings = SETTINGS[request.param]
    with pristine_ucx_env():
        side = start_prefill(dump_dir, "prefill-a", settings)
    production = request.param == "production"
    assert (side.instance.prefix is not None) == production  # serve's default: on
    assert (side.instance.config.staging_bytes > 0) == production
    yield side, dump_dir, settings
    side.close()


@pytest.fixture
def cluster(prefill_a):
    """A fresh decode instance per test: the stopped-peer tests leave UCX endpoints to a
    frozen peer behind, and later tests must not depend on how those settle."""
    prefill, dump_dir, settings = prefill_a
    with pristine_ucx_env():
        instance = Instance(config("decode", dump_dir, settings))
    address = f"127.0.0.1:{free_port()}"
    worker = DecodeWorker(
        instance, "decode-a", ClientOptions(timeout_s=60.0), known_prefill=[prefill.address]
    )
    server = serve(address, decode=worker.decode, register_prefill=worker.register_prefill)
    decode = Side(instance, worker, server, address)
    yield prefill, decode, dump_dir
    decode.close()


@pytest.fixture
def spare(tmp_path_factory, prefill_a, cluster):
    """A second prefill instance that talks TCP only (over loopback), where a READ needs the
    target to make progress: stopping its rank (SIGSTOP) holds a transfer in flight as long
    as we like. Fresh per test, like the decode instance."""
    with pristine_ucx_env(UCX_TLS="tcp", UCX_NET_DEVICES="lo"):  # the rank process inherits
        side = start_prefill(tmp_path_factory.mktemp("spare"), "prefill-spare", prefill_a[2])
    cluster[1].worker.register_prefill([side.address])
    yield side
    side.close()


def assert_idle(*sides: Side) -> None:
    for side in sides:
        if isinstance(side.worker, PrefillWorker):
            assert side.worker.settle(), "prefill frees still running after 30 s"
        pools = side.instance.pools
        # cached blocks no request holds count as free (the prefix cache evicts on demand)
        assert side.instance.free_kv_blocks == pools.blocks.num_total, side.worker
        assert pools.slots.num_free == pools.slots.num_total, side.worker
        if isinstance(side.worker, PrefillWorker):
            assert len(side.worker.store) == 0


def wait_done(decode: Side, request_id: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    poll = TransferPoll(request_id)
    while (states := [s.state for s in decode.instance.ranks.call(poll)]) != [TransferState.DONE]:
        assert time.monotonic() < deadline and states == [TransferState.PENDING], states
        time.sleep(0.001)


def claim_by_hand(decode: Side, ticket, rid: str, num_tokens: int, read_blocks: int | None):
    """What `DecodeWorker.decode` does before its transfer, step by step: acquire `ticket`,
    allocate `num_tokens` of cache and plan the READs of its first `read_blocks` blocks
    (all when None). Returns (peer, acquired ticket, blocks, slot, blocks read, reads)."""
    peer = decode.worker.peer(ticket.address)
    ticket = peer.client.acquire(rid, decode.worker.instance_id)
    cache = decode.instance.pools.allocate(rid, num_tokens)
    blocks, slot = tuple(cache.block_ids), cache.slot_ids[0]
    read = blocks[:read_blocks]
    reads = plan_direct(peer.layouts, decode.instance.layouts, transfer_request(ticket, read, slot))
    return peer, ticket, blocks, slot, read, reads


def test_router_retries_on_another_prefill_instance(cluster):
    prefill, decode, _ = cluster
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    router = Router([dead, prefill.address], [decode.address], ClientOptions(timeout_s=60.0))
    try:
        ids = prompt(1)
        events = list(router.generate(GenerateRequest("router-retry", tuple(ids), MAX_TOKENS)))
    finally:
        router.close()
    assert [e.index for e in events] == list(range(MAX_TOKENS)) and events[-1].finished
    assert [e.token for e in events] == reference_generate(get_preset(MODEL), ids, MAX_TOKENS)
    first = events[0]
    assert first.ttft_ms > 0 and first.transfer_ms > 0 and first.descriptors > 0
    assert first.kv_bytes > 0 and first.state_bytes > 0
    retries = router.metrics.registry.get_sample_value("pdxfer_router_prefill_retries_total")
    assert retries == 1
    assert_idle(prefill, decode)


def test_transferred_state_is_not_reset_as_a_new_request(cluster):
    """Bug 4: decode continues from the transferred S&Conv, bit for bit, never from zeros."""
    prefill, decode, dump_dir = cluster
    geometry, ids = get_preset(MODEL), prompt(2)
    ticket = prefill.worker.prefill(PrefillRequest("bug4", tuple(ids), MAX_TOKENS))
    tokens = [e.token for e in decode.worker.decode(DecodeRequest(ticket, MAX_TOKENS))]
    assert check_request(geometry, dump_dir, "bug4", 1, 1).problems == ()
    expected = reference_generate(geometry, ids, MAX_TOKENS)
    assert tokens == expected
    # The token check can see a reset: decoding from a zeroed state diverges.
    assert reset_state_tokens(geometry, ids) != expected
    assert_idle(prefill, decode)


def test_a_client_leaving_mid_batch_frees_exactly_its_request(cluster):
    """Three requests decode in shared steps; one client goes away after two tokens. Its
    blocks and slot go back at once (while the others still run), and the others' tokens
    are those of a colocated run."""
    prefill, decode, _ = cluster
    geometry, long_run = get_preset(MODEL), 40
    ids = {name: prompt(20 + i) for i, name in enumerate(("stay-a", "leave", "stay-b"))}
    streams = {
        name: iter(decode.worker.decode(DecodeRequest(
            prefill.worker.prefill(PrefillRequest(name, tuple(p), long_run)), long_run)))
        for name, p in ids.items()
    }  # fmt: skip
    tokens = {name: [next(s).token, next(s).token] for name, s in streams.items()}
    pools = decode.instance.pools
    before = decode.instance.free_kv_blocks, pools.slots.num_free
    leaving = pools.get("leave")
    streams.pop("leave").close()
    assert pools.slots.num_free == before[1] + 1
    assert decode.instance.free_kv_blocks == before[0] + len(leaving.block_ids)
    del tokens["leave"]
    for name, stream in streams.items():
        tokens[name] += [e.token for e in stream]
        assert tokens[name] == reference_generate(geometry, ids[name], long_run), name
    assert_idle(prefill, decode)


def reset_state_tokens(geometry, ids: list[int]) -> list[int]:
    caches = LocalCaches(geometry, num_blocks=1, block_size=64, num_slots=1)
    engine = RankEngine(geometry, caches)
    first = engine.prefill(ids, [0], 0)
    for layer in geometry.linear_layers:
        caches.ssm(layer.index)[0].zero_()
        for tensor in layer.cache_tensors()[1:]:
            caches.conv(layer.index, tensor.name)[0].zero_()
    return [first] + engine.decode(first, len(ids), [0], 0, MAX_TOKENS - 1)


def test_no_step_touches_a_slot_while_a_transfer_fills_it(cluster, spare):
    """Bug 6: while a READ is in flight, decode steps on its slot are refused, and other
    requests keep decoding; once DONE, decode continues from the transferred bytes. The
    READ is held in flight by stopping the prefill rank it reads from."""
    prefill, decode, _ = cluster
    geometry, ranks, holder = get_preset(MODEL), decode.instance.ranks, decode.worker.instance_id
    bystander = prefill.worker.prefill(PrefillRequest("bystander", tuple(prompt(6)), MAX_TOKENS))
    other = iter(decode.worker.decode(DecodeRequest(bystander, MAX_TOKENS)))
    next(other)  # transferred and decoding
    stalled = spare
    rank = stalled.instance.ranks.procs[0].pid
    ids = prompt(3)
    try:
        ticket = stalled.worker.prefill(PrefillRequest("bug6", tuple(ids), MAX_TOKENS))
        peer, ticket, blocks, slot, read, reads = claim_by_hand(
            decode, ticket, "bug6", len(ids) + MAX_TOKENS - 1, 1
        )
        os.kill(rank, signal.SIGSTOP)
        try:
            # the start answers at once, though it polls a small transfer for a moment
            started = ranks.call(
                TransferStart("bug6", peer.instance_id, reads.per_rank, slot, read, 60.0)
            )
            assert started[0].state is TransferState.PENDING
            time.sleep(0.5)
            assert ranks.call(TransferPoll("bug6"))[0].state is TransferState.PENDING
            with pytest.raises(RankCommandError) as refused:
                ranks.call(one_step(ticket.first_token, len(ids), blocks, slot))
            assert refused.value.kind is CacheFillingError
            rest = [event.token for event in other]  # the other request is not held up
            assert len(rest) == MAX_TOKENS - 1
            assert ranks.call(TransferPoll("bug6"))[0].state is TransferState.PENDING
        finally:
            os.kill(rank, signal.SIGCONT)
        wait_done(decode, "bug6")
        ranks.call(TransferEnd("bug6"))
        peer.client.release("bug6", holder, ticket.block_ids, ticket.slot_id)
        tokens = [ticket.first_token]
        for i in range(MAX_TOKENS - 1):
            tokens.append(ranks.call(one_step(tokens[-1], len(ids) + i, blocks, slot))[0][0].token)
        assert tokens == reference_generate(geometry, ids, MAX_TOKENS)
        ranks.call(Release(slot))
        decode.instance.pools.free("bug6")
        assert_idle(prefill, decode, stalled)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rank, signal.SIGCONT)


def test_each_prefill_instance_is_read_from_its_own_memory(cluster, spare):
    """Two prefill instances in one process: the decode side reads each one's bytes (their
    agents once shared a name, and the peer connected last took every READ), and a second
    instance that claims agent names already taken is refused at AddPeers."""
    prefill, decode, _ = cluster
    geometry = get_preset(MODEL)
    decode.worker.peer(spare.address)  # the spare is connected first, then prefill-a
    for name, side, ids in (("mine-a", prefill, prompt(6)), ("mine-s", spare, prompt(3))):
        ticket = side.worker.prefill(PrefillRequest(name, tuple(ids), MAX_TOKENS))
        tokens = [e.token for e in decode.worker.decode(DecodeRequest(ticket, MAX_TOKENS))]
        assert tokens == reference_generate(geometry, ids, MAX_TOKENS), name
    reply = decode.worker.peer(spare.address).client.handshake("impostor", decode.instance.compat)
    staging = tuple(Layout.from_dict(json.loads(b)).staging_offset for b in reply.rank_layouts)
    with pytest.raises(RankCommandError, match="its own agent prefix"):
        decode.instance.ranks.call(AddPeers("impostor", tuple(reply.rank_metadata), staging))
    assert_idle(prefill, decode, spare)


def test_pipelined_decode_steps_feed_the_previous_pick(cluster):
    """Steps sent before the previous one answered name no token: the rank feeds the pick
    its previous step made for that slot, and refuses one whose position does not follow."""
    prefill, decode, _ = cluster
    geometry, ranks, holder = get_preset(MODEL), decode.instance.ranks, decode.worker.instance_id
    ids = prompt(5)
    ticket = prefill.worker.prefill(PrefillRequest("pipe", tuple(ids), MAX_TOKENS))
    peer, ticket, blocks, slot, read, reads = claim_by_hand(
        decode, ticket, "pipe", len(ids) + MAX_TOKENS - 1, 1
    )
    ranks.call(TransferStart("pipe", peer.instance_id, reads.per_rank, slot, read, 60.0))
    wait_done(decode, "pipe")
    ranks.call(TransferEnd("pipe"))
    peer.client.release("pipe", holder, ticket.block_ids, ticket.slot_id)
    n = len(ids)
    sent = [ranks.submit(one_step(ticket.first_token, n, blocks, slot))]
    sent += [ranks.submit(one_step(None, n + i, blocks, slot)) for i in range(1, MAX_TOKENS - 1)]
    tokens = [ticket.first_token] + [p.result()[0][0].token for p in sent]
    assert tokens == reference_generate(geometry, ids, MAX_TOKENS)
    with pytest.raises(RankCommandError, match="token"):  # the last pick is for n + 5
        ranks.call(one_step(None, n + 2, blocks, slot))
    ranks.call(Release(slot))
    decode.instance.pools.free("pipe")
    assert_idle(prefill, decode)


def test_an_unfinished_transfer_never_becomes_readable(cluster, spare):
    """Cancelling a transfer in flight leaves its slot FILLING until released, then FREE: no
    step ever reads half-written bytes; its READ is reported unsettled until it can no
    longer land. The prefill side frees on Abort."""
    _, decode, _ = cluster
    stalled, ranks = spare, decode.instance.ranks
    rank = stalled.instance.ranks.procs[0].pid
    ids = prompt(4)
    ticket = stalled.worker.prefill(PrefillRequest("cancelled", tuple(ids), MAX_TOKENS))
    peer, ticket, blocks, slot, _, reads = claim_by_hand(
        decode, ticket, "cancelled", len(ids), None
    )
    os.kill(rank, signal.SIGSTOP)
    try:
        ranks.call(TransferStart("cancelled", peer.instance_id, reads.per_rank, slot, blocks, 30.0))  # fmt: skip
        assert ranks.call(TransferEnd("cancelled")) == [False]  # still in flight
        with pytest.raises(RankCommandError) as filling:
            ranks.call(one_step(ticket.first_token, len(ids), blocks, slot))
        assert filling.value.kind is CacheFillingError
    finally:
        os.kill(rank, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while ranks.call(TransferSettled("cancelled")) != [True]:
        assert time.monotonic() < deadline, "the cancelled READ never settled"
        time.sleep(0.05)
    ranks.call(Release(slot))
    decode.instance.pools.free("cancelled")
    with pytest.raises(ValueError, match="holds no request state"):
        ranks.call(one_step(ticket.first_token, len(ids), blocks, slot))
    peer.client.abort("cancelled", ticket.abort_key, "test")
    assert_idle(decode, stalled)


def test_a_failed_read_that_may_still_land_holds_the_cache_until_settled(cluster, spare):
    """Bug 6 from the transport's side: NIXL cannot cancel a READ in flight, so when one
    fails at its deadline while the stopped peer may still answer, the decode blocks and
    slot stay out of the pools until the READ settles, then return."""
    prefill, decode, _ = cluster
    stalled = spare
    rank = stalled.instance.ranks.procs[0].pid
    ticket = stalled.worker.prefill(PrefillRequest("unsettled", tuple(prompt(7)), MAX_TOKENS))
    decode.worker.peer(ticket.address)  # handshake while it runs
    os.kill(rank, signal.SIGSTOP)
    try:
        decode.worker.transfer_deadline_s = 1.0
        with pytest.raises(TransferFailed) as failed:
            list(decode.worker.decode(DecodeRequest(ticket, MAX_TOKENS)))
        assert not failed.value.settled
        assert decode.worker.held_requests() == ["unsettled"]
        pools = decode.instance.pools
        assert pools.slots.num_free == pools.slots.num_total - 1
        # The router runs a failed request again under its id: while the held cache is
        # the last attempt's, the retry fails as a transfer (ABORTED), not as bad input,
        # and touches none of it.
        again = prefill.worker.prefill(PrefillRequest("unsettled", tuple(prompt(7)), MAX_TOKENS))
        with pytest.raises(TransferFailed, match="held until it settles"):
            list(decode.worker.decode(DecodeRequest(again, MAX_TOKENS)))
        assert decode.worker.held_requests() == ["unsettled"]
        assert pools.slots.num_free == pools.slots.num_total - 1
        assert prefill.worker.store.get("unsettled") is None  # the retry's ticket aborted
    finally:
        decode.worker.transfer_deadline_s = 60.0
        os.kill(rank, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while decode.worker.held_requests():
        assert time.monotonic() < deadline, "the held cache was never freed"
        time.sleep(0.1)
    assert_idle(prefill, stalled, decode)


def test_a_retry_under_the_same_id_waits_for_the_last_attempts_free(cluster):
    """The prefill engine frees an aborted ticket's cache on its own thread, not the
    caller's. A retry under the same request id (as the router sends after a failed decode)
    waits for that free instead of failing on the blocks and slot still allocated under its
    id."""
    prefill, _, _ = cluster
    ids = tuple(prompt(11))
    first = prefill.worker.prefill(PrefillRequest("again", ids, MAX_TOKENS))
    gate, queued = threading.Event(), threading.Event()
    # the engine's events (the free among them) wait behind this one
    prefill.worker.engine.call_soon(lambda: (queued.set(), gate.wait(30)))
    assert queued.wait(10)
    prefill.worker.store.abort("again", "test")
    outcome: list = []
    retry = threading.Thread(
        target=lambda: outcome.append(
            prefill.worker.prefill(PrefillRequest("again", ids, MAX_TOKENS))
        )
    )
    try:
        retry.start()
        retry.join(0.5)
        assert retry.is_alive() and not outcome  # waiting for the free, not failed
    finally:
        gate.set()
    retry.join(30)
    (second,) = outcome
    assert second.first_token == first.first_token and second.num_tokens == first.num_tokens
    prefill.worker.store.abort("again", "test")
    assert_idle(prefill)


def test_bug14_a_late_read_after_lease_expiry_never_lands_in_a_reused_cache(cluster, spare):
    """docs/bugs.md #14, deterministically: the prefill rank freezes mid-READ, the lease
    expires, so the decode's heartbeat fails (not a TransferFailed); a new request is then
    admitted; the rank resumes and its READ lands. It must land in held blocks, never in the
    new request's: the new request's caches and tokens are checked after the resume."""
    prefill, decode, dump_dir = cluster
    stalled, geometry = spare, get_preset(MODEL)
    rank = stalled.instance.ranks.procs[0].pid
    ticket = stalled.worker.prefill(PrefillRequest("late", tuple(prompt(8)), MAX_TOKENS))
    decode.worker.peer(ticket.address)  # handshake while it runs
    outcome: list[BaseException] = []

    def run_late() -> None:
        try:
            list(decode.worker.decode(DecodeRequest(ticket, MAX_TOKENS)))
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            outcome.append(exc)

    os.kill(rank, signal.SIGSTOP)
    try:
        decode.worker.heartbeat_s = 0.2
        late = threading.Thread(target=run_late)
        late.start()
        wait_posted(decode, "late")
        assert decode.instance.ranks.call(TransferPoll("late"))[0].state is TransferState.PENDING
        held = decode.instance.pools.get("late")
        # Expire the lease (its free waits on the frozen rank, hence the thread).
        expiry = threading.Thread(target=stalled.worker.store.reap, args=(time.time() + 3600,))
        expiry.start()
        late.join(30)
        assert not late.is_alive() and len(outcome) == 1
        assert getattr(outcome[0], "code", "") == "NOT_FOUND", outcome[0]
        assert decode.worker.held_requests() == ["late"]
        ids = prompt(9)
        after = prefill.worker.prefill(PrefillRequest("after", tuple(ids), MAX_TOKENS))
        events = iter(decode.worker.decode(DecodeRequest(after, MAX_TOKENS)))
        tokens = [next(events).token]  # transferred, not stepped yet
        cache = decode.instance.pools.get("after")
        assert not set(cache.block_ids) & set(held.block_ids)
        assert cache.slot_ids != held.slot_ids
    finally:
        decode.worker.heartbeat_s = None
        os.kill(rank, signal.SIGCONT)
    expiry.join(30)
    deadline = time.monotonic() + 30
    while decode.worker.held_requests():
        assert time.monotonic() < deadline, "the late READ never settled"
        time.sleep(0.05)
    # The late READ has landed (or settled): the new request's cache is still its own.
    decode.instance.ranks.call(
        Snapshot("after", "decode", cache.block_ids, cache.slot_ids[0], len(ids))
    )
    assert check_request(geometry, dump_dir, "after", 1, 1).problems == ()
    tokens += [event.token for event in events]
    assert tokens == reference_generate(geometry, ids, MAX_TOKENS)
    assert_idle(prefill, decode, stalled)


def wait_posted(decode: Side, request_id: str, timeout_s: float = 30.0) -> None:
    """Until `request_id`'s READs are posted on the decode ranks."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            decode.instance.ranks.call(TransferPoll(request_id))
            return
        except RankCommandError:
            assert time.monotonic() < deadline, f"{request_id}: no transfer posted"
            time.sleep(0.01)


def test_dead_prefill_ranks_fail_the_transfer_and_free_both_sides(cluster, spare):
    """Kills the spare instance's rank (a fresh one per test)."""
    _, decode, _ = cluster
    victim = spare
    try:
        ticket = victim.worker.prefill(PrefillRequest("orphan", tuple(prompt(5)), MAX_TOKENS))
        decode.worker.peer(ticket.address)  # handshake while it is whole
        for proc in victim.instance.ranks.procs:
            proc.kill()
            proc.wait(10)
        decode.worker.transfer_deadline_s = 5.0
        with pytest.raises((TransferFailed, PeerUnavailable)):
            list(decode.worker.decode(DecodeRequest(ticket, MAX_TOKENS)))
        assert_idle(victim, decode)  # the decode side aborted the ticket: prefill freed it
    finally:
        decode.worker.transfer_deadline_s = 60.0


def test_decode_dials_only_known_prefill_instances_and_no_lock_spans_a_handshake(cluster):
    """A ticket naming an unknown address is refused without dialling it; a known one that
    accepts TCP but never answers fails its own request at the handshake deadline, while
    another request goes through meanwhile (no lock is held across the handshake)."""
    prefill, decode, _ = cluster
    ticket = prefill.worker.prefill(PrefillRequest("stranger", tuple(prompt(10)), MAX_TOKENS))
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        mute = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(NotPermitted, match="not a known prefill instance"):
            list(decode.worker.decode(DecodeRequest(replace(ticket, address=mute), MAX_TOKENS)))
        decode.worker.register_prefill([mute])
        stuck: list[BaseException] = []

        def dial_mute() -> None:
            try:
                decode.worker.peer(mute, "mute")
            except BaseException as exc:  # noqa: BLE001 - inspected below
                stuck.append(exc)

        dialler = threading.Thread(target=dial_mute)
        dialler.start()
        time.sleep(0.5)  # the handshake to `mute` is in flight
        assert dialler.is_alive()
        tokens = [e.token for e in decode.worker.decode(DecodeRequest(ticket, MAX_TOKENS))]
        assert dialler.is_alive(), "the other request waited for the silent peer"
        dialler.join(30)
    assert tokens == reference_generate(get_preset(MODEL), prompt(10), MAX_TOKENS)
    assert len(stuck) == 1 and getattr(stuck[0], "code", "") in ("DEADLINE_EXCEEDED", "UNAVAILABLE")
    assert_idle(prefill, decode)
