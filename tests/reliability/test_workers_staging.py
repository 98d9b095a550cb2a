"""Staged transfers between a prefill and a decode instance in this process (their TP ranks
are real processes): the prefill ranks pack a ticket's small ranges into a staging extent,
decode reads it as one range per rank and unpacks it. The caches verify bit for bit, and
every staging extent goes back with its ticket, whatever ends it. Every test ends with both
instances idle: pools, tickets and staging.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.ucx_env import pristine_ucx_env
from tests.support.worker_sides import Side, one_thread, prompt  # noqa: F401 (fixture)
from transfer.control.client import ClientOptions, TransferClient
from transfer.control.errors import ControlError
from transfer.control.server import serve
from transfer.control.types import DecodeRequest, PrefillRequest, RankGather, StageRequest
from transfer.model.reference import reference_generate
from transfer.net import free_port
from transfer.presets import get_preset
from transfer.serving.engine.decode import DecodeWorker
from transfer.serving.engine.instance import Instance, InstanceConfig
from transfer.serving.engine.prefill import PrefillWorker
from transfer.serving.launch.verify import check_request

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-next"
MAX_TOKENS = 4
STAGING_BYTES = 1 << 20
PREFILL_TP = 2  # re-slicing heads: many small ranges per prefill rank, so the packer stages


def config(role: str, dump_dir: Path) -> InstanceConfig:
    return InstanceConfig(
        role,
        get_preset(MODEL),
        tp=PREFILL_TP if role == "prefill" else 1,
        budget_bytes=16 << 20,
        max_seqs=3,
        dump_dir=str(dump_dir),
        staging_bytes=STAGING_BYTES,
        staging_min_packed=1,  # these tests are about staging: stage however few ranges
        prefix_cache=False,
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    dump_dir = tmp_path_factory.mktemp("caches")
    with pristine_ucx_env():
        p_instance = Instance(config("prefill", dump_dir))
        d_instance = Instance(config("decode", dump_dir))
    p_address, d_address = (f"127.0.0.1:{free_port()}" for _ in range(2))
    p_worker = PrefillWorker(p_instance, "prefill-s", p_address, 30.0)
    p_server = serve(
        p_address,
        store=p_worker.store,
        identity=p_worker.identity,
        stage=p_worker.stage,
        prefill=p_worker.prefill,
    )
    p_worker.start()
    d_worker = DecodeWorker(
        d_instance, "decode-s", ClientOptions(timeout_s=60.0), known_prefill=[p_address]
    )
    d_server = serve(d_address, decode=d_worker.decode)
    prefill = Side(p_instance, p_worker, p_server, p_address)
    decode = Side(d_instance, d_worker, d_server, d_address)
    yield prefill, decode, dump_dir
    decode.close()
    prefill.close()


def assert_idle(*sides: Side) -> None:
    for side in sides:
        if isinstance(side.worker, PrefillWorker):
            assert side.worker.settle(), "prefill frees still running after 30 s"
        pools, staging = side.instance.pools, side.instance.staging
        assert pools.blocks.num_free == pools.blocks.num_total, side.worker
        assert pools.slots.num_free == pools.slots.num_total, side.worker
        assert staging.free_bytes == staging.capacity_bytes == STAGING_BYTES, side.worker
        assert staging.largest_free_bytes == STAGING_BYTES, side.worker
        if isinstance(side.worker, PrefillWorker):
            assert len(side.worker.store) == 0


def generate(prefill: Side, decode: Side, rid: str, ids: list[int]):
    ticket = prefill.worker.prefill(PrefillRequest(rid, tuple(ids), MAX_TOKENS))
    return list(decode.worker.decode(DecodeRequest(ticket, MAX_TOKENS)))


def direct_descriptors(prefill: Side, decode: Side, ids: list[int]) -> int:
    """What the same request posts without staging (the decode pool lent to nobody)."""
    hog = decode.instance.staging
    assert hog.allocate("hog", STAGING_BYTES) is not None
    try:
        return generate(prefill, decode, "direct", ids)[0].descriptors
    finally:
        hog.free("hog")


def test_a_staged_transfer_verifies_and_returns_both_extents(pair):
    prefill, decode, dump_dir = pair
    geometry, ids = get_preset(MODEL), prompt(1)
    events = generate(prefill, decode, "staged", ids)
    assert [e.token for e in events] == reference_generate(geometry, ids, MAX_TOKENS)
    assert check_request(geometry, dump_dir, "staged", PREFILL_TP, 1).problems == ()
    staged = events[0].descriptors
    assert staged <= 8
    assert direct_descriptors(prefill, decode, ids) > staged
    assert_idle(prefill, decode)


def test_a_full_prefill_pool_means_direct_reads_not_a_failure(pair):
    prefill, decode, dump_dir = pair
    geometry, ids = get_preset(MODEL), prompt(2)
    pool = prefill.instance.staging
    assert pool.allocate("hog", STAGING_BYTES) is not None
    try:
        events = generate(prefill, decode, "unstaged", ids)
    finally:
        pool.free("hog")
    assert [e.token for e in events] == reference_generate(geometry, ids, MAX_TOKENS)
    assert check_request(geometry, dump_dir, "unstaged", PREFILL_TP, 1).problems == ()
    assert events[0].descriptors > 8
    assert_idle(prefill, decode)


def test_a_stage_refused_during_a_prefill_batch_means_correct_direct_reads(pair):
    """Issue 33: a Stage that comes while a prefill batch runs is refused at once
    (RESOURCE_EXHAUSTED) rather than wait for it; decode reads the ranges directly and its
    cache and tokens are exactly right. The batch is marked running the way the engine
    marks its own, so the refusal does not depend on timing."""
    prefill, decode, dump_dir = pair
    geometry, ids = get_preset(MODEL), prompt(5)
    ticket = prefill.worker.prefill(PrefillRequest("refused", tuple(ids), MAX_TOKENS))
    stages = prefill.worker.engine._stages
    assert stages.next_step(lambda: ["a batch"]) == ([], ["a batch"])  # "running" from now
    try:
        events = list(decode.worker.decode(DecodeRequest(ticket, MAX_TOKENS)))
    finally:
        stages.batch_answered()
    assert [e.token for e in events] == reference_generate(geometry, ids, MAX_TOKENS)
    assert check_request(geometry, dump_dir, "refused", PREFILL_TP, 1).problems == ()
    assert events[0].descriptors > 8  # refused, so read directly (staged: at most 8)
    assert_idle(prefill, decode)


def stage_request(prefill: Side, rid: str, holder: str, lengths=(64, 128)) -> StageRequest:
    """Small ranges of the KV region (what they hold does not matter here)."""
    offsets = tuple(4096 * i for i in range(len(lengths)))
    return StageRequest(rid, holder, (RankGather(offsets, tuple(lengths)),) * PREFILL_TP)


@pytest.mark.parametrize("ending", ["release", "abort", "lease expiry"])
def test_the_prefill_extent_goes_back_with_its_ticket(pair, ending):
    prefill, decode, _ = pair
    rid, holder = f"stage-{ending.replace(' ', '-')}", "decode-x"
    ticket = prefill.worker.prefill(PrefillRequest(rid, tuple(prompt(3)), MAX_TOKENS))
    pool, layout = prefill.instance.staging, prefill.instance.layouts[0]
    with TransferClient(prefill.address, timeout_s=30.0) as client:
        with pytest.raises(ControlError) as not_held:
            client.stage(stage_request(prefill, rid, holder))
        assert not_held.value.code == "FAILED_PRECONDITION"
        assert not pool.holds(rid)
        client.acquire(rid, holder)
        offset = client.stage(stage_request(prefill, rid, holder))
        assert layout.staging_offset < offset < layout.staging_offset + layout.staging_bytes
        assert pool.holds(rid) and pool.free_bytes == STAGING_BYTES - pool.page_bytes
        with pytest.raises(ControlError) as twice:
            client.stage(stage_request(prefill, rid, holder))
        assert twice.value.code == "FAILED_PRECONDITION"  # one extent per ticket
        if ending == "release":
            client.release(rid, holder, ticket.block_ids, ticket.slot_id)
        elif ending == "abort":
            client.abort(rid, ticket.abort_key, "test")
        else:
            assert [t.request_id for t in prefill.worker.store.reap(time.time() + 3600)] == [rid]
    assert_idle(prefill, decode)


def test_ranges_outside_the_cache_are_refused_and_take_nothing(pair):
    prefill, decode, _ = pair
    rid, holder = "stage-bad", "decode-x"
    ticket = prefill.worker.prefill(PrefillRequest(rid, tuple(prompt(4)), MAX_TOKENS))
    layout = prefill.instance.layouts[0]
    with TransferClient(prefill.address, timeout_s=30.0) as client:
        client.acquire(rid, holder)
        for src in (layout.staging_offset, layout.arena_bytes - 8):  # staging itself; past the end
            bad = StageRequest(rid, holder, (RankGather((src,), (64,)),) * PREFILL_TP)
            with pytest.raises(ControlError) as refused:
                client.stage(bad)
            assert refused.value.code == "INVALID_ARGUMENT", refused.value
            assert "cache regions" in refused.value.details
            assert not prefill.instance.staging.holds(rid)
        wrong_tp = StageRequest(rid, holder, ())
        with pytest.raises(ControlError, match=f"tp {PREFILL_TP}"):
            client.stage(wrong_tp)
        client.release(rid, holder, ticket.block_ids, ticket.slot_id)
    assert_idle(prefill, decode)
