"""plan_reads: staged reads through a fake prefill instance, checked byte for byte.

The fake stager packs each rank's ranges back to back into an extent of its own
StagingPool, as the prefill instance does; the decode side then runs the returned READs
and scatters on byte arrays. The decode cache must end up exactly as `plan_direct`'s
READs leave it, and every way staging can be refused must fall back to direct reads with
nothing left held.
"""

from __future__ import annotations

import numpy as np
import pytest

from transfer.cache import Layout
from transfer.cache.staging_pool import StagingPool
from transfer.control.errors import ControlError
from transfer.control.types import StageRequest, Ticket
from transfer.errors import InvalidInput
from transfer.packer import StagingPolicy, TransferRequest, plan_transfer
from transfer.presets import get_preset
from transfer.serving.engine.reads import (
    STAGING_REFUSED,
    Reads,
    plan_direct,
    plan_reads,
    reads_of,
    transfer_request,
)
from transfer.serving.ranks.spec import STAGING_RESERVED_BYTES, WARMUP_BYTES, staging_area_bytes

STAGING = staging_area_bytes(1 << 20)  # STAGING_RESERVED_BYTES + 1 MiB
BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS, TOKENS = 8, 16, 4, 50
PAIRS = [(1, 1), (2, 1), (1, 2)]
PRESETS = ["tiny-qwen3-next", "tiny-kimi-linear"]
RID, HOLDER = "req-1", "decode-0"


def _layouts(name: str, tp: int, staging: int = STAGING) -> tuple[Layout, ...]:
    return Layout(
        get_preset(name), tp, 0, BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS, staging_bytes=staging
    ).all_ranks()


def _ticket(tokens: int = TOKENS) -> Ticket:
    need = -(-tokens // BLOCK_SIZE)
    return Ticket(
        request_id=RID,
        instance_id="prefill-0",
        block_ids=tuple(range(0, NUM_BLOCKS, 2))[:need],  # every other block
        slot_id=1,
        num_tokens=tokens,
        first_token=7,
        lease_deadline=1e12,
    )


def _request(tokens: int = TOKENS) -> TransferRequest:
    need = -(-tokens // BLOCK_SIZE)
    dst = tuple(range(1, NUM_BLOCKS, 2))[:need][::-1]
    return transfer_request(_ticket(tokens), dst, 2)


def _arenas(layouts, rng) -> list[np.ndarray]:
    arenas = []
    for layout in layouts:
        arena = rng.integers(0, 256, layout.arena_bytes, dtype=np.uint8)
        arena[:16] |= 1  # never all zero
        arenas.append(arena)
    return arenas


class FakeStager:
    """The prefill instance's `Stage`, on byte arrays: packs `ranks[r]` back to back into
    an extent of its pool on every rank, returns the extent's arena offset."""

    def __init__(self, layouts, arenas, occupied: int = 0, error: BaseException | None = None):
        self.layouts, self.arenas, self.error = layouts, arenas, error
        self.pool = StagingPool(layouts[0].staging_bytes, STAGING_RESERVED_BYTES)
        if occupied:  # someone else's extent first: ours does not start at the pool's base
            assert self.pool.allocate("someone-else", occupied) is not None
        self.requests: list[StageRequest] = []
        self.offset: int | None = None

    def stage(self, request: StageRequest) -> int:
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        assert len(request.ranks) == len(self.layouts)
        offset = self.pool.allocate(request.request_id, request.nbytes)
        if offset is None:
            raise ControlError("RESOURCE_EXHAUSTED", "staging: no extent free")
        base = self.layouts[0].staging_offset + offset
        for arena, gather in zip(self.arenas, request.ranks, strict=True):
            at = base
            for src, n in zip(gather.src_offsets, gather.lengths, strict=True):
                arena[at : at + n] = arena[src : src + n]
                at += n
        self.offset = base
        return base


def _apply(reads: Reads, p_arenas, d_arenas) -> None:
    """Every decode rank's READs, then its scatter."""
    for rank, share in enumerate(reads.per_rank):
        arena = d_arenas[rank]
        for batch in share.batches:
            remote = p_arenas[batch.prefill_rank]
            for local, src, n in zip(
                batch.local.tolist(), batch.remote.tolist(), batch.nbytes.tolist(), strict=True
            ):
                arena[local : local + n] = remote[src : src + n]
    for rank, share in enumerate(reads.per_rank):
        arena = d_arenas[rank]
        scatter = share.scatter
        for src, dst, n in zip(
            scatter.src.tolist(), scatter.dst.tolist(), scatter.nbytes.tolist(), strict=True
        ):
            arena[dst : dst + n] = arena[src : src + n].copy()


def _same_reads(a: Reads, b: Reads) -> bool:
    if (a.kv_bytes, a.state_bytes, a.descriptors, a.staged_bytes) != (
        b.kv_bytes,
        b.state_bytes,
        b.descriptors,
        b.staged_bytes,
    ) or len(a.per_rank) != len(b.per_rank):
        return False
    for ra, rb in zip(a.per_rank, b.per_rank, strict=True):
        if len(ra.batches) != len(rb.batches) or len(ra.scatter) != len(rb.scatter):
            return False
        for ba, bb in zip(ra.batches, rb.batches, strict=True):
            if ba.prefill_rank != bb.prefill_rank or not all(
                np.array_equal(getattr(ba, f), getattr(bb, f))
                for f in ("local", "remote", "nbytes")
            ):
                return False
    return True


def _decode_pool(decode, occupied: int = 0) -> StagingPool:
    pool = StagingPool(decode[0].staging_bytes, STAGING_RESERVED_BYTES)
    if occupied:
        assert pool.allocate("other-request", occupied) is not None
    return pool


# --- staged reads, bytes -------------------------------------------------------------------


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize(("p", "d"), PAIRS)
@pytest.mark.parametrize("occupied", [0, 3 * 4096 + 1])
def test_staged_reads_leave_the_same_cache_bytes_as_direct_reads(name, p, d, occupied):
    prefill, decode = _layouts(name, p), _layouts(name, d)
    request = _request()
    rng = np.random.default_rng(p * 10 + d + occupied)
    p_arenas = _arenas(prefill, rng)
    p_caches = [a[: prefill[0].staging_offset].copy() for a in p_arenas]
    stager = FakeStager(prefill, p_arenas, occupied)
    pool = _decode_pool(decode, occupied)
    free_before = pool.free_bytes

    reads = plan_reads(
        prefill,
        decode,
        request,
        request_id=RID,
        holder=HOLDER,
        stager=stager,
        pool=pool,
        min_small_ranges=2,
    )
    direct = plan_direct(prefill, decode, request)

    # One Stage call, for this request, one gather per prefill rank, reading cache bytes.
    (staged,) = stager.requests
    assert (staged.request_id, staged.holder) == (RID, HOLDER)
    assert len(staged.ranks) == p
    assert reads.staged_bytes == sum(g.nbytes for g in staged.ranks) > 0
    for g in staged.ranks:
        assert all(
            s + n <= prefill[0].staging_offset
            for s, n in zip(g.src_offsets, g.lengths, strict=True)
        )
    # Fewer READs, the same bytes.
    assert reads.descriptors < direct.descriptors
    assert (reads.kv_bytes, reads.state_bytes) == (direct.kv_bytes, direct.state_bytes)
    assert direct.staged_bytes == 0
    assert any(len(share.scatter) for share in reads.per_rank)
    # The decode extent is held by the request until the caller frees it.
    assert pool.holds(RID)
    assert pool.free_bytes < free_before
    # Staged READs come from the stager's extent and land past the decode pool's reserve
    # and clear of the other request's extent.
    p_extent = (stager.offset, stager.offset + staged.nbytes)
    d_area = decode[0].staging_offset
    other_pages = -(-occupied // pool.page_bytes)
    other = (d_area + pool.base, d_area + pool.base + other_pages * pool.page_bytes)
    for share in reads.per_rank:
        for batch in share.batches:
            remote_end = batch.remote + batch.nbytes
            in_staging = batch.remote >= prefill[0].staging_offset
            assert ((batch.remote >= p_extent[0]) & (remote_end <= p_extent[1]))[in_staging].all()
        sc = share.scatter
        assert (sc.src >= d_area + pool.base).all()
        assert (sc.src + sc.nbytes <= d_area + decode[0].staging_bytes).all()
        if occupied:
            assert ((sc.src + sc.nbytes <= other[0]) | (sc.src >= other[1])).all()
        assert (np.diff(sc.src) == sc.nbytes[:-1]).all()  # one extent, back to back

    rng_d = np.random.default_rng(99)
    d_start = _arenas(decode, rng_d)
    d_staged = [a.copy() for a in d_start]
    d_direct = [a.copy() for a in d_start]
    _apply(reads, p_arenas, d_staged)
    _apply(direct, p_arenas, d_direct)
    cache = decode[0].staging_offset
    for rank in range(d):
        assert not np.array_equal(d_direct[rank][:cache], d_start[rank][:cache])
        np.testing.assert_array_equal(d_staged[rank][:cache], d_direct[rank][:cache])
    for rank in range(p):  # staging wrote only the prefill staging areas
        np.testing.assert_array_equal(p_arenas[rank][: prefill[0].staging_offset], p_caches[rank])


def test_transfer_request_follows_the_ticket():
    ticket = _ticket()
    request = transfer_request(ticket, [9, 8, 7, 6, 5, 4, 3], 3)
    assert request.num_tokens == ticket.num_tokens
    assert tuple(request.src_blocks) == ticket.block_ids
    assert tuple(request.src_slots) == (ticket.slot_id,)
    assert tuple(request.dst_blocks) == (9, 8, 7, 6, 5, 4, 3)
    assert tuple(request.dst_slots) == (3,)


# --- falling back to direct reads ----------------------------------------------------------


def _plan(prefill, decode, stager, pool, **kwargs):
    return plan_reads(
        prefill,
        decode,
        _request(),
        request_id=RID,
        holder=HOLDER,
        stager=stager,
        pool=pool,
        **({"min_small_ranges": 2} | kwargs),
    )


@pytest.mark.parametrize("code", STAGING_REFUSED)
def test_a_refused_stage_reads_directly_and_holds_nothing(code):
    assert set(STAGING_REFUSED) == {"RESOURCE_EXHAUSTED", "UNIMPLEMENTED"}
    prefill, decode = _layouts("tiny-qwen3-next", 2), _layouts("tiny-qwen3-next", 1)
    stager = FakeStager(prefill, _arenas(prefill, np.random.default_rng(0)))
    stager.error = ControlError(code, "staging: no room")
    pool = _decode_pool(decode)
    reads = _plan(prefill, decode, stager, pool)
    assert len(stager.requests) == 1  # it was asked
    assert _same_reads(reads, plan_direct(prefill, decode, _request()))
    assert reads.staged_bytes == 0 and all(len(s.scatter) == 0 for s in reads.per_rank)
    assert not pool.holds(RID)
    assert pool.free_bytes == pool.largest_free_bytes == pool.capacity_bytes


def test_a_full_prefill_pool_reads_directly():
    prefill, decode = _layouts("tiny-kimi-linear", 1), _layouts("tiny-kimi-linear", 2)
    stager = FakeStager(prefill, _arenas(prefill, np.random.default_rng(0)))
    stager.pool.allocate("everything", stager.pool.capacity_bytes)
    pool = _decode_pool(decode)
    reads = _plan(prefill, decode, stager, pool)
    assert len(stager.requests) == 1
    assert _same_reads(reads, plan_direct(prefill, decode, _request()))
    assert not pool.holds(RID) and pool.free_bytes == pool.capacity_bytes


@pytest.mark.parametrize(
    "error",
    [
        ControlError("UNAVAILABLE", "prefill instance gone"),
        ControlError("NOT_FOUND", "request_id: unknown"),
        ControlError("INVALID_ARGUMENT", "ranks[0]: bad"),
        RuntimeError("the stager broke"),
        KeyboardInterrupt(),
    ],
)
def test_other_stage_errors_propagate_and_hold_nothing(error):
    prefill, decode = _layouts("tiny-qwen3-next", 1), _layouts("tiny-qwen3-next", 1)
    stager = FakeStager(prefill, _arenas(prefill, np.random.default_rng(0)), error=error)
    pool = _decode_pool(decode)
    with pytest.raises(type(error)) as info:
        _plan(prefill, decode, stager, pool)
    assert info.value is error
    assert len(stager.requests) == 1
    assert not pool.holds(RID)
    assert pool.free_bytes == pool.largest_free_bytes == pool.capacity_bytes


class OutOfAreaStager(FakeStager):
    """A prefill instance that answers an offset outside its own staging area."""

    def __init__(self, layouts, arenas, answer: int):
        super().__init__(layouts, arenas)
        self.answer = answer

    def stage(self, request: StageRequest) -> int:
        super().stage(request)
        return self.answer


@pytest.mark.parametrize("where", ["past the area", "below the area"])
def test_an_offset_outside_the_prefill_area_is_refused_and_holds_nothing(where):
    prefill, decode = _layouts("tiny-qwen3-next", 2), _layouts("tiny-qwen3-next", 1)
    layout = prefill[0]
    answer = layout.staging_offset + layout.staging_bytes if where == "past the area" else 0
    stager = OutOfAreaStager(prefill, _arenas(prefill, np.random.default_rng(0)), answer)
    pool = _decode_pool(decode)
    with pytest.raises(InvalidInput, match="prefill_window"):
        _plan(prefill, decode, stager, pool)
    assert not pool.holds(RID) and pool.free_bytes == pool.capacity_bytes


@pytest.mark.parametrize("left", [0, 4096])
def test_a_full_decode_pool_reads_directly_without_asking(left):
    prefill, decode = _layouts("tiny-qwen3-next", 2), _layouts("tiny-qwen3-next", 1)
    stager = FakeStager(prefill, _arenas(prefill, np.random.default_rng(0)))
    pool = _decode_pool(decode)
    assert pool.allocate("other-request", pool.capacity_bytes - left) is not None
    reads = _plan(prefill, decode, stager, pool)
    assert stager.requests == []
    assert _same_reads(reads, plan_direct(prefill, decode, _request()))
    assert not pool.holds(RID)
    assert pool.free_bytes == left


def test_a_fragmented_decode_pool_stages_only_what_its_largest_extent_holds():
    prefill, decode = _layouts("tiny-qwen3-next", 2), _layouts("tiny-qwen3-next", 1)
    # All the room the request would want, but no run long enough for both sources.
    first = FakeStager(prefill, _arenas(prefill, np.random.default_rng(0)))
    whole = _plan(prefill, decode, first, _decode_pool(decode))
    per_source = [g.nbytes for g in first.requests[0].ranks]
    assert len(per_source) == 2 and sum(per_source) == whole.staged_bytes
    pages = -(-max(per_source) // 4096)
    pool = _decode_pool(decode)
    assert pool.allocate("a", pages * 4096) is not None
    assert pool.allocate("gap", 4096) is not None
    assert pool.allocate("b", pages * 4096) is not None
    assert pool.allocate("rest", pool.largest_free_bytes) is not None
    pool.free("a")
    pool.free("b")
    assert pool.free_bytes == 2 * pages * 4096 >= whole.staged_bytes
    stager = FakeStager(prefill, _arenas(prefill, np.random.default_rng(0)))
    reads = _plan(prefill, decode, stager, pool)
    assert pool.holds(RID)
    assert 0 < reads.staged_bytes <= pages * 4096 < whole.staged_bytes
    assert (
        whole.descriptors < reads.descriptors < plan_direct(prefill, decode, _request()).descriptors
    )


def test_no_stager_or_no_pool_reads_directly():
    prefill, decode = _layouts("tiny-qwen3-next", 1), _layouts("tiny-qwen3-next", 2)
    direct = plan_direct(prefill, decode, _request())
    pool = _decode_pool(decode)
    assert _same_reads(_plan(prefill, decode, None, pool), direct)
    assert not pool.holds(RID) and pool.free_bytes == pool.capacity_bytes
    stager = FakeStager(prefill, _arenas(prefill, np.random.default_rng(0)))
    assert _same_reads(_plan(prefill, decode, stager, None), direct)
    assert stager.requests == []


@pytest.mark.parametrize(
    ("p_staging", "d_staging"),
    [(WARMUP_BYTES, STAGING), (STAGING, WARMUP_BYTES), (STAGING_RESERVED_BYTES, STAGING)],
)
def test_an_instance_without_a_staging_pool_reads_directly(p_staging, d_staging):
    prefill = _layouts("tiny-qwen3-next", 1, p_staging)
    decode = _layouts("tiny-qwen3-next", 1, d_staging)
    stager = FakeStager(prefill, _arenas(prefill, np.random.default_rng(0)))
    pool = _decode_pool(decode)
    reads = _plan(prefill, decode, stager, pool)
    assert stager.requests == []
    assert _same_reads(reads, plan_direct(prefill, decode, _request()))
    assert not pool.holds(RID)


def test_too_few_small_ranges_read_directly_without_asking():
    prefill, decode = _layouts("tiny-qwen3-next", 1), _layouts("tiny-qwen3-next", 1)
    stager = FakeStager(prefill, _arenas(prefill, np.random.default_rng(0)))
    pool = _decode_pool(decode)
    reads = _plan(prefill, decode, stager, pool, min_small_ranges=10_000)
    assert stager.requests == []
    assert _same_reads(reads, plan_direct(prefill, decode, _request()))
    assert not pool.holds(RID)


def test_fewer_packed_ranges_than_min_packed_read_directly_without_asking():
    """--staging-min-packed: a transfer packing fewer ranges skips the Stage round trip."""
    prefill, decode = _layouts("tiny-qwen3-next", 2), _layouts("tiny-qwen3-next", 1)
    stager = FakeStager(prefill, _arenas(prefill, np.random.default_rng(0)))
    pool = _decode_pool(decode)
    staged = _plan(prefill, decode, stager, pool)
    packed = sum(len(gather.src_offsets) for gather in stager.requests[0].ranks)
    assert staged.staged_bytes > 0 and packed >= 2
    for bound, stages in ((packed, True), (packed + 1, False)):
        pool.free(RID)
        stager.pool.free(RID)
        stager.requests.clear()
        reads = _plan(prefill, decode, stager, pool, min_packed=bound)
        assert (reads.staged_bytes > 0) == stages and len(stager.requests) == stages
    assert _same_reads(reads, plan_direct(prefill, decode, _request()))
    assert not pool.holds(RID)


# --- decode already holds the first blocks (prefix cache) ---------------------------------


def _written(reads: Reads, size: int) -> np.ndarray:
    """[rank, byte] True where `reads` writes (READ destinations and scatter targets)."""
    mask = np.zeros((len(reads.per_rank), size), dtype=bool)
    for rank, share in enumerate(reads.per_rank):
        for batch in share.batches:
            for local, n in zip(batch.local.tolist(), batch.nbytes.tolist(), strict=True):
                mask[rank, local : local + n] = True
        for dst, n in zip(share.scatter.dst.tolist(), share.scatter.nbytes.tolist(), strict=True):
            mask[rank, dst : dst + n] = True
    return mask


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize(("p", "d"), PAIRS)
def test_reused_blocks_are_never_written_and_the_rest_lands_as_a_whole_transfer(name, p, d):
    prefill, decode = _layouts(name, p), _layouts(name, d)
    request, reused = _request(), 3 * BLOCK_SIZE
    rng = np.random.default_rng(7 * p + d)
    p_arenas, d_start = _arenas(prefill, rng), _arenas(decode, rng)
    cache = decode[0].staging_offset
    whole = plan_direct(prefill, decode, request)
    stager = FakeStager(prefill, p_arenas)
    suffix = plan_reads(prefill, decode, request, request_id=RID, holder=HOLDER,
                        stager=stager, pool=_decode_pool(decode), min_small_ranges=2,
                        reused_tokens=reused)  # fmt: skip
    # the held blocks' KV, as an earlier transfer wrote it (no state: that crosses whole)
    held = reads_of(plan_transfer(prefill, decode, request, StagingPolicy(enabled=False),
                                  tokens=(0, reused), with_state=False))  # fmt: skip
    # what moved: the KV of the other tokens, all of the state
    assert suffix.kv_bytes == whole.kv_bytes * (TOKENS - reused) // TOKENS
    assert suffix.state_bytes == whole.state_bytes and held.state_bytes == 0
    assert held.kv_bytes + suffix.kv_bytes == whole.kv_bytes
    # the held blocks' bytes are never written by the suffix's READs or scatters
    assert not (_written(suffix, cache) & _written(held, cache)[:, :cache]).any()
    # held blocks (as an earlier transfer left them) + the suffix == one whole transfer
    expected = [a.copy() for a in d_start]
    _apply(whole, p_arenas, expected)
    got = [a.copy() for a in d_start]
    _apply(held, p_arenas, got)
    _apply(suffix, p_arenas, got)
    for want, have in zip(expected, got, strict=True):
        assert np.array_equal(want[:cache], have[:cache])
