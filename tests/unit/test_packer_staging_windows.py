"""Staging windows: where `plan_transfer` packs staged bytes, and the staged path end to end.

Every gather lands and every scatter reads inside its side's window; the default window is
the whole area; `staging_extents` / `prefill_gathers` describe what the plans pack; and
running gather -> wire -> scatter on byte arrays leaves the decode cache exactly as a
direct-only plan does.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from transfer.cache import Layout
from transfer.errors import InvalidInput
from transfer.packer import (
    Mode,
    StagingPolicy,
    StagingWindow,
    TransferPlan,
    TransferRequest,
    plan_transfer,
    prefill_gathers,
    staging_extents,
)
from transfer.presets import get_preset

STAGING = 4096 + (1 << 20)
BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS, TOKENS = 8, 16, 4, 50
EAGER = StagingPolicy(min_small_ranges=2)
PAIRS = [(1, 1), (2, 1), (1, 2)]
PRESETS = ["tiny-qwen3-next", "tiny-kimi-linear"]
CUT = st.one_of(st.integers(0, STAGING), st.integers(0, 1 << 18), st.just(STAGING))


def _layouts(name: str, tp: int, staging: int = STAGING) -> tuple[Layout, ...]:
    geometry = get_preset(name)
    return Layout(
        geometry, tp, 0, BLOCK_SIZE, NUM_BLOCKS, NUM_SLOTS, staging_bytes=staging
    ).all_ranks()


def _fragmented_request(tokens: int = TOKENS) -> TransferRequest:
    """Every other block on both sides (and out of order on decode): many small ranges."""
    need = -(-tokens // BLOCK_SIZE)
    src = list(range(0, NUM_BLOCKS, 2))[:need]
    dst = list(range(1, NUM_BLOCKS, 2))[:need][::-1]
    return TransferRequest(tokens, src, [1], dst, [2])


def _sides(name, p, d):
    return _layouts(name, p), _layouts(name, d)


def _staged_sources(plans):
    return [s for plan in plans for s in plan.sources if s.mode is not Mode.DIRECT]


def _ranges_equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a.arrays(), b.arrays(), strict=True))


def _same_plans(a: tuple[TransferPlan, ...], b: tuple[TransferPlan, ...]) -> bool:
    if len(a) != len(b):
        return False
    for pa, pb in zip(a, b, strict=True):
        if (pa.decode_rank, pa.num_tokens, pa.useful_bytes, pa.naive_descriptors) != (
            pb.decode_rank,
            pb.num_tokens,
            pb.useful_bytes,
            pb.naive_descriptors,
        ) or len(pa.sources) != len(pb.sources):
            return False
        for sa, sb in zip(pa.sources, pb.sources, strict=True):
            scalars = ("prefill_rank", "kv_bytes", "state_bytes", "direct_descriptors", "mode")
            if any(getattr(sa, f) != getattr(sb, f) for f in scalars + ("reason",)):
                return False
            if not all(
                _ranges_equal(getattr(sa, f), getattr(sb, f)) for f in ("wire", "gather", "scatter")
            ):
                return False
    return True


def _in_window(ranges, layout: Layout, window: StagingWindow, column: str) -> bool:
    start = layout.staging_offset + window.offset
    at = getattr(ranges, column)
    return bool(((at >= start) & (at + ranges.lengths <= start + window.nbytes)).all())


# --- windows -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize(("p", "d"), PAIRS)
def test_default_windows_are_the_whole_staging_area(name, p, d):
    prefill, decode = _sides(name, p, d)
    request = _fragmented_request()
    default = plan_transfer(prefill, decode, request, EAGER)
    explicit = plan_transfer(
        prefill,
        decode,
        request,
        EAGER,
        StagingWindow(0, prefill[0].staging_bytes),
        StagingWindow(0, decode[0].staging_bytes),
    )
    assert _staged_sources(default)
    assert _same_plans(default, explicit)
    shifted = plan_transfer(prefill, decode, request, EAGER, StagingWindow(64, STAGING - 64))
    assert not _same_plans(default, shifted)  # the comparison can tell plans apart


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    case=st.sampled_from([(n, p, d) for n in PRESETS for p, d in PAIRS]),
    p_cut=st.tuples(CUT, CUT),
    d_cut=st.tuples(CUT, CUT),
)
def test_staged_bytes_stay_inside_the_windows(case, p_cut, d_cut):
    name, p, d = case
    prefill, decode = _sides(name, p, d)
    p_window = StagingWindow(min(p_cut), max(p_cut) - min(p_cut))
    d_window = StagingWindow(min(d_cut), max(d_cut) - min(d_cut))
    request = _fragmented_request()
    plans = plan_transfer(prefill, decode, request, EAGER, p_window, d_window)
    direct = plan_transfer(prefill, decode, request, StagingPolicy(enabled=False))
    p_used, d_used = staging_extents(plans)
    assert p_used <= p_window.nbytes and d_used <= d_window.nbytes
    for plan, plain in zip(plans, direct, strict=True):
        assert plan.wire_bytes == plain.wire_bytes  # staged or not, the same bytes cross
        for source in plan.sources:
            assert _in_window(source.gather, prefill[source.prefill_rank], p_window, "dst")
            assert _in_window(source.scatter, decode[plan.decode_rank], d_window, "src")
            # and never into the other side's cache regions
            assert (source.gather.src + source.gather.lengths <= prefill[0].staging_offset).all()
            assert (source.scatter.dst + source.scatter.lengths <= decode[0].staging_offset).all()
            if source.mode is Mode.DIRECT:
                assert len(source.gather) == len(source.scatter) == 0
            else:
                assert source.gather.nbytes == source.scatter.nbytes > 0
    full = plan_transfer(prefill, decode, request, EAGER)
    smallest = min(s.gather.nbytes for s in _staged_sources(full))
    if min(p_window.nbytes, d_window.nbytes) < smallest:
        assert not _staged_sources(plans)  # no source fits
    p_full, d_full = staging_extents(full)
    if p_window.nbytes >= p_full and d_window.nbytes >= d_full:
        # room for all of it: the same sources stage as with the whole area
        assert [s.mode for x in plans for s in x.sources] == [
            s.mode for x in full for s in x.sources
        ]


def test_disjoint_windows_give_disjoint_staging():
    prefill, decode = _sides("tiny-qwen3-next", 1, 2)
    request = _fragmented_request()
    half = STAGING // 2
    a = plan_transfer(
        prefill, decode, request, EAGER, StagingWindow(0, half), StagingWindow(0, half)
    )
    b = plan_transfer(
        prefill,
        decode,
        request,
        EAGER,
        StagingWindow(half, STAGING - half),
        StagingWindow(half, STAGING - half),
    )
    (ga,), (gb,) = prefill_gathers(a, 1), prefill_gathers(b, 1)
    assert len(ga) and len(gb)
    assert ga.dst.max() + 1 <= prefill[0].staging_offset + half <= gb.dst.min()
    assert ga.dst[0] == prefill[0].staging_offset
    assert gb.dst[0] == prefill[0].staging_offset + half


def test_a_window_too_small_for_a_source_leaves_it_direct_naming_the_room():
    prefill, decode = _sides("tiny-qwen3-next", 2, 1)
    request = _fragmented_request()
    full = plan_transfer(prefill, decode, request, EAGER)
    first = full[0].sources[0].gather.nbytes
    # Room for the first source only, on the decode side (both sources land on rank 0).
    plans = plan_transfer(prefill, decode, request, EAGER, None, StagingWindow(128, first))
    modes = [s.mode for s in plans[0].sources]
    assert modes[0] is not Mode.DIRECT and modes[1] is Mode.DIRECT
    assert "free: prefill" in plans[0].sources[1].reason
    assert plans[0].sources[1].reason.endswith("decode 0 B")


@pytest.mark.parametrize(
    ("window", "side", "message"),
    [
        (StagingWindow(-1, 10), "prefill", r"prefill_window\.offset"),
        (StagingWindow(0, -1), "prefill", r"prefill_window\.nbytes"),
        (StagingWindow(True, 10), "prefill", r"prefill_window\.offset"),
        (StagingWindow(1.0, 10), "decode", r"decode_window\.offset"),
        (StagingWindow(-4096, 10), "decode", r"decode_window\.offset"),
        (StagingWindow(STAGING - 10, 11), "prefill", r"prefill_window: .* exceeds"),
        (StagingWindow(STAGING - 10, 11), "decode", r"decode_window: .* exceeds"),
        (StagingWindow(STAGING + 1, 0), "decode", "decode_window"),
        (StagingWindow(0, STAGING + 1), "decode", "decode_window"),
    ],
)
def test_bad_windows_are_rejected_naming_the_side(window, side, message):
    prefill, decode = _sides("tiny-qwen3-next", 1, 2)
    windows = {"prefill_window": window} if side == "prefill" else {"decode_window": window}
    with pytest.raises(InvalidInput, match=message):
        plan_transfer(prefill, decode, _fragmented_request(), EAGER, **windows)


def test_window_check_accepts_exactly_the_area():
    StagingWindow(0, 100).check(100, "w")
    StagingWindow(100, 0).check(100, "w")
    StagingWindow(40, 60).check(100, "w")
    with pytest.raises(InvalidInput, match=r"w: \[40, 101\) exceeds the staging area of 100"):
        StagingWindow(40, 61).check(100, "w")
    with pytest.raises(InvalidInput, match="x.nbytes"):
        StagingWindow(0, 1.5).check(100, "x")


def test_a_layout_without_staging_only_takes_empty_windows():
    prefill, decode = _layouts("tiny-kimi-linear", 1, 0), _layouts("tiny-kimi-linear", 2, 0)
    request = _fragmented_request()
    plans = plan_transfer(prefill, decode, request, EAGER)
    assert not _staged_sources(plans)
    assert staging_extents(plans) == (0, 0)
    with pytest.raises(InvalidInput, match="prefill_window"):
        plan_transfer(prefill, decode, request, EAGER, StagingWindow(0, 1))


# --- staging_extents / prefill_gathers ---------------------------------------------------


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize(("p", "d"), PAIRS)
@pytest.mark.parametrize("offsets", [(0, 0), (4096, 8192)])
def test_extents_and_gathers_describe_what_the_plans_pack(name, p, d, offsets):
    prefill, decode = _sides(name, p, d)
    p_window = StagingWindow(offsets[0], STAGING - offsets[0])
    d_window = StagingWindow(offsets[1], STAGING - offsets[1])
    plans = plan_transfer(prefill, decode, _fragmented_request(), EAGER, p_window, d_window)
    assert _staged_sources(plans)
    per_prefill = [0] * p
    per_decode = [0] * d
    for plan in plans:
        for source in plan.sources:
            per_prefill[source.prefill_rank] += source.gather.nbytes
            per_decode[plan.decode_rank] += source.scatter.nbytes
    assert staging_extents(plans) == (max(per_prefill), max(per_decode))
    if (p, d) == (1, 2):  # one prefill rank serves both decode ranks: it packs for both
        assert staging_extents(plans)[0] == sum(per_decode) > max(per_decode)
    if (p, d) == (2, 1):
        assert staging_extents(plans)[1] == sum(per_prefill) > max(per_prefill)

    gathers = prefill_gathers(plans, p)
    assert len(gathers) == p
    for rank, ranges in enumerate(gathers):
        assert ranges.nbytes == per_prefill[rank]
        if not len(ranges):
            continue
        start = prefill[rank].staging_offset + p_window.offset
        expected_dst = start + np.concatenate(([0], np.cumsum(ranges.lengths)[:-1]))
        np.testing.assert_array_equal(ranges.dst, expected_dst)  # back to back from the start
        # exactly the plans' gather ranges for this rank, nothing more or less
        ours = sorted(ranges.entries())
        theirs = sorted(
            e
            for plan in plans
            for s in plan.sources
            if s.prefill_rank == rank
            for e in s.gather.entries()
        )
        assert ours == theirs


def test_no_staging_means_zero_extents_and_empty_gathers():
    prefill, decode = _sides("tiny-qwen3-next", 2, 1)
    plans = plan_transfer(prefill, decode, _fragmented_request(), StagingPolicy(enabled=False))
    assert staging_extents(plans) == (0, 0)
    gathers = prefill_gathers(plans, 2)
    assert len(gathers) == 2 and all(len(g) == 0 and g.nbytes == 0 for g in gathers)
    assert staging_extents(()) == (0, 0)
    assert [len(g) for g in prefill_gathers((), 3)] == [0, 0, 0]


# --- the staged path on bytes ------------------------------------------------------------


def _arenas(layouts, rng) -> list[np.ndarray]:
    arenas = []
    for layout in layouts:
        arena = rng.integers(0, 256, layout.arena_bytes, dtype=np.uint8)
        arena[:16] |= 1  # never all zero
        arenas.append(arena)
    return arenas


def _copy(dst_arena, src_arena, src, dst, lengths) -> None:
    for s, t, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
        dst_arena[t : t + n] = src_arena[s : s + n]


def _run_staged(plans, p_arenas, d_arenas) -> None:
    for plan in plans:  # every prefill rank packs first...
        for source in plan.sources:
            arena = p_arenas[source.prefill_rank]
            _copy(arena, arena.copy(), *source.gather.arrays())
    for plan in plans:  # ...then the READs...
        for source in plan.sources:
            _copy(d_arenas[plan.decode_rank], p_arenas[source.prefill_rank], *source.wire.arrays())
    for plan in plans:  # ...then every decode rank unpacks
        arena = d_arenas[plan.decode_rank]
        for source in plan.sources:
            _copy(arena, arena.copy(), *source.scatter.arrays())


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize(("p", "d"), PAIRS)
@pytest.mark.parametrize("windows", [None, (8192, 4096)])
def test_the_staged_path_leaves_the_same_cache_bytes_as_direct_reads(name, p, d, windows):
    prefill, decode = _sides(name, p, d)
    request = _fragmented_request()
    window_args = ()
    if windows is not None:
        window_args = (
            StagingWindow(windows[0], STAGING - windows[0]),
            StagingWindow(windows[1], STAGING - windows[1]),
        )
    staged = plan_transfer(prefill, decode, request, EAGER, *window_args)
    direct = plan_transfer(prefill, decode, request, StagingPolicy(enabled=False))
    sources = _staged_sources(staged)
    assert sources, "the fragmented request should stage at least one source"
    assert sum(p.descriptors for p in staged) < sum(p.descriptors for p in direct)
    assert all(s.mode is Mode.DIRECT for plan in direct for s in plan.sources)

    rng = np.random.default_rng(p * 10 + d)
    p_arenas = _arenas(prefill, rng)
    p_caches = [a[: prefill[0].staging_offset].copy() for a in p_arenas]
    d_start = _arenas(decode, rng)
    d_staged = [a.copy() for a in d_start]
    d_direct = [a.copy() for a in d_start]

    for plan in direct:
        for source in plan.sources:
            _copy(d_direct[plan.decode_rank], p_arenas[source.prefill_rank], *source.wire.arrays())
    _run_staged(staged, p_arenas, d_staged)

    cache = decode[0].staging_offset
    for rank in range(d):
        assert not np.array_equal(d_direct[rank][:cache], d_start[rank][:cache])  # it moved
        np.testing.assert_array_equal(d_staged[rank][:cache], d_direct[rank][:cache])
        # the staging area holds the packed bytes; the KV/state regions hold them unpacked
    for rank in range(p):  # packing only wrote the prefill staging area
        np.testing.assert_array_equal(p_arenas[rank][: prefill[0].staging_offset], p_caches[rank])


def test_the_byte_comparison_catches_a_wrong_scatter():
    prefill, decode = _sides("tiny-qwen3-next", 1, 1)
    request = _fragmented_request()
    staged = plan_transfer(prefill, decode, request, EAGER)
    direct = plan_transfer(prefill, decode, request, StagingPolicy(enabled=False))
    rng = np.random.default_rng(3)
    p_arenas, d_start = _arenas(prefill, rng), _arenas(decode, rng)
    d_staged, d_direct = [d_start[0].copy()], [d_start[0].copy()]
    for source in direct[0].sources:
        _copy(d_direct[0], p_arenas[0], *source.wire.arrays())
    # Skip the gather: the READ then carries stale staging bytes.
    for source in staged[0].sources:
        _copy(d_staged[0], p_arenas[0], *source.wire.arrays())
        _copy(d_staged[0], d_staged[0].copy(), *source.scatter.arrays())
    cache = decode[0].staging_offset
    assert not np.array_equal(d_staged[0][:cache], d_direct[0][:cache])
