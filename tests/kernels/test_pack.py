"""Pack/unpack: Triton (interpreted) vs torch, bit-exact, including arenas past 2 GiB."""

from __future__ import annotations

import pytest
import torch

from kernels.pack import copy_ranges, gather_blocks, gather_ranges, scatter_blocks, scatter_ranges

BACKENDS = ["torch", "triton"]


def _random_bytes(n: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8)


def _ranges(*values):
    return torch.tensor(values, dtype=torch.int64)


def _expected_gather(src, offsets, lengths):
    return torch.cat(
        [src[o : o + n] for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)]
    )


def _disjoint_ranges(arena_size: int, count: int, unit: int, max_units: int):
    """Shuffled, non-adjacent, non-overlapping ranges of whole `unit`s (some empty)."""
    lengths = torch.randint(0, max_units + 1, (count,)) * unit
    gaps = torch.randint(1, 4, (count,)) * unit + unit
    starts = torch.cumsum(gaps + lengths, 0) - lengths
    assert starts[-1] + lengths[-1] <= arena_size
    order = torch.randperm(count)
    return starts[order].to(torch.int64), lengths[order].to(torch.int64)


# unit 8 takes the int64-word path, 2 the int16 one, 1 (odd offsets) the byte path; the
# 9000-unit range at unit 8 spans two pieces of CHUNK_WORDS words
@pytest.mark.kernels
@pytest.mark.parametrize("unit", [8, 2, 1])
@pytest.mark.parametrize("name", BACKENDS)
def test_gather_scatter_ranges_bit_exact(backend, name, unit):
    backend(name)
    src = _random_bytes(300_000)
    offsets, lengths = _disjoint_ranges(src.numel(), 12, unit, 600)
    # plus one long range over the others: gather allows overlap
    offsets, lengths = (
        torch.cat([offsets, _ranges(8000)]),
        torch.cat([lengths, _ranges(9000 * unit)]),
    )
    staging = gather_ranges(src, offsets, lengths)
    assert torch.equal(staging, _expected_gather(src, offsets, lengths))

    offsets, lengths = offsets[:-1], lengths[:-1]
    staging = _random_bytes(int(lengths.sum()))
    dst = _random_bytes(src.numel())
    before = dst.clone()
    scatter_ranges(staging, dst, offsets, lengths)
    assert torch.equal(_expected_gather(dst, offsets, lengths), staging)
    outside = torch.ones_like(dst, dtype=torch.bool)
    for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True):
        outside[o : o + n] = False
    assert torch.equal(dst[outside], before[outside])


@pytest.mark.kernels
@pytest.mark.parametrize("name", BACKENDS)
def test_gather_ranges_into_given_out_and_empty(backend, name):
    backend(name)
    src = _random_bytes(4096)
    offsets, lengths = torch.tensor([4000, 3], dtype=torch.int64), torch.tensor([96, 5])
    out = _random_bytes(101)
    assert gather_ranges(src, offsets, lengths, out) is out
    assert torch.equal(out, torch.cat([src[4000:], src[3:8]]))
    empty = torch.empty(0, dtype=torch.int64)
    assert gather_ranges(src, empty, empty).numel() == 0


# unit 8: int64 words; 1: odd offsets on one side only, so Triton must fall back to bytes
@pytest.mark.kernels
@pytest.mark.parametrize("unit, skew", [(8, 0), (1, 0), (8, 3)])
@pytest.mark.parametrize("name", BACKENDS)
def test_copy_ranges_equals_gather_then_scatter(backend, name, unit, skew):
    backend(name)
    src = _random_bytes(200_000)
    src_offsets, lengths = _disjoint_ranges(src.numel() - skew, 40, unit, 300)
    src_offsets = src_offsets + skew
    dst_offsets, _ = _disjoint_ranges(src.numel(), 40, unit, 300)
    dst_offsets = dst_offsets[torch.randperm(40)]
    # every destination range gets a length its slot can hold
    gaps = torch.sort(dst_offsets).values
    room = torch.cat([gaps[1:] - gaps[:-1], torch.tensor([src.numel()]) - gaps[-1:]])
    room_of = dict(zip(gaps.tolist(), room.tolist(), strict=True))
    lengths = torch.tensor(
        [min(n, room_of[o]) for o, n in zip(dst_offsets.tolist(), lengths.tolist(), strict=True)]
    )
    dst = _random_bytes(src.numel())
    expected = dst.clone()
    scatter_ranges(gather_ranges(src, src_offsets, lengths), expected, dst_offsets, lengths)
    copy_ranges(src, dst, src_offsets, dst_offsets, lengths)
    assert torch.equal(dst, expected)


@pytest.mark.kernels
def test_copy_ranges_refuses_overlapping_destinations():
    src, dst = _random_bytes(64), _random_bytes(64)
    offsets = _ranges(0, 8)
    with pytest.raises(ValueError, match="overlap"):
        copy_ranges(src, dst, offsets, _ranges(0, 4), _ranges(8, 8))


@pytest.fixture(scope="module")
def big_arena():
    """An uninitialised arena just past 2 GiB: its pages stay untouched (memory-light);
    tests write and read only small ranges near the top."""
    size = 2**31 + 2**20
    try:
        return torch.empty(size, dtype=torch.uint8)
    except RuntimeError as exc:
        pytest.skip(f"cannot reserve a {size}-byte arena for the int64-offset test: {exc}")


@pytest.mark.kernels
@pytest.mark.parametrize("skew", [0, 1])  # 1: odd offsets, so Triton indexes bytes, not words
@pytest.mark.parametrize("name", BACKENDS)
def test_ranges_past_2_gib(backend, name, big_arena, skew):
    backend(name)
    top = 2**31 + 4096 + skew
    offsets = torch.tensor([top + 65536, 2**31 - 16, top], dtype=torch.int64)
    lengths = torch.tensor([70_000, 48, 40_000], dtype=torch.int64)  # one straddles 2^31
    staging = _random_bytes(int(lengths.sum()))
    scatter_ranges(staging, big_arena, offsets, lengths)
    assert torch.equal(big_arena[top : top + 40_000], staging[-40_000:])
    assert torch.equal(gather_ranges(big_arena, offsets, lengths), staging)


@pytest.mark.kernels
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("name", BACKENDS)
def test_blocks_past_2_gib(backend, name, big_arena, head_major):
    """An fp8 cache over the arena; the blocks read and written lie past 2^31 bytes
    (block-major: block id x block stride alone passes 2^31)."""
    backend(name)
    heads, block_size, head_dim = 4, 16, 64
    num_blocks = big_arena.numel() // (heads * block_size * head_dim)
    flat = big_arena[: heads * num_blocks * block_size * head_dim].view(torch.float8_e4m3fn)
    if head_major:
        cache = flat.view(heads, num_blocks, block_size, head_dim).permute(1, 2, 0, 3)
    else:
        cache = flat.view(num_blocks, block_size, heads, head_dim)
    ids = torch.tensor([num_blocks - 1, num_blocks - 7])
    staging = _random_bytes(2 * block_size * head_dim).view(torch.float8_e4m3fn)
    staging = staging.view(2, block_size, 1, head_dim)
    scatter_blocks(staging, cache, ids, head_start=3)
    assert torch.equal(_bits(cache[num_blocks - 7, :, 3]), _bits(staging[1, :, 0]))
    assert torch.equal(_bits(gather_blocks(cache, ids, head_start=3, head_end=4)), _bits(staging))


def _cache(dtype: torch.dtype, head_major: bool, num_blocks=9, block_size=16, heads=6, dim=40):
    """A paged cache of random bit patterns (NaN payloads included), as an arena view."""
    shape = (
        (heads, num_blocks, block_size, dim) if head_major else (num_blocks, block_size, heads, dim)
    )
    size = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
    cache = _random_bytes(size).view(dtype).view(shape)
    return cache.permute(1, 2, 0, 3) if head_major else cache


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, element for element (NaN payloads compare equal)."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
    return t.contiguous().view(as_int)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize("heads", [(0, None), (2, 5)])
@pytest.mark.parametrize("name", BACKENDS)
def test_gather_scatter_blocks_bit_exact(backend, name, dtype, head_major, heads):
    backend(name)
    head_start, head_end = heads
    cache = _cache(dtype, head_major)
    ids = torch.tensor([7, 0, 4])
    stop = head_end or cache.shape[2]
    staging = gather_blocks(cache, ids, head_start, head_end)
    assert torch.equal(_bits(staging), _bits(cache[ids, :, head_start:stop]))

    target = _cache(dtype, head_major)
    before = _bits(target).clone()
    scatter_blocks(staging, target, ids, head_start, head_end)
    assert torch.equal(_bits(target[ids, :, head_start:stop]), _bits(staging))
    untouched = torch.ones(target.shape, dtype=torch.bool)
    untouched[ids, :, head_start:stop] = False
    assert torch.equal(_bits(target)[untouched], before[untouched])


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ((_ranges(-1), _ranges(4)), "offsets"),
        ((_ranges(0), _ranges(-4)), "lengths"),
        ((_ranges(60), _ranges(5)), "range end 65 past src of 64 bytes"),
        ((_ranges(0, 8), _ranges(4)), "same shape"),
        ((_ranges(0).int(), _ranges(4)), "offsets: expected int64"),
        ((_ranges(0), _ranges(4).float()), "lengths: expected int64"),
        ((_ranges(0), _ranges(4).to("meta")), "lengths: expected the CPU"),
    ],
)
def test_ranges_reject_bad_input(backend, args, field):
    backend("torch")
    with pytest.raises(ValueError, match=field):
        gather_ranges(_random_bytes(64), *args)


def test_ranges_reject_bad_buffers(backend):
    backend("torch")
    offsets, lengths = _ranges(0, 10), _ranges(4, 4)
    with pytest.raises(ValueError, match="src: expected contiguous uint8"):
        gather_ranges(torch.randn(64), offsets, lengths)
    with pytest.raises(ValueError, match=r"out: expected \[8\]"):
        gather_ranges(_random_bytes(64), offsets, lengths, out=_random_bytes(9))
    with pytest.raises(ValueError, match="out: expected device"):
        gather_ranges(_random_bytes(64), offsets, lengths, out=_random_bytes(8).to("meta"))
    with pytest.raises(ValueError, match="staging: expected"):
        scatter_ranges(_random_bytes(7), _random_bytes(64), offsets, lengths)
    with pytest.raises(ValueError, match="overlap"):
        scatter_ranges(_random_bytes(8), _random_bytes(64), _ranges(0, 2), lengths)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"block_ids": torch.tensor([0, 9])}, r"block_ids: expected ids in \[0, 9\)"),
        ({"block_ids": torch.tensor([-1])}, "block_ids"),
        ({"block_ids": torch.tensor([0.0])}, "block_ids: expected int"),
        ({"head_start": 4, "head_end": 4}, "head_start, head_end"),
        ({"head_end": 7}, "num_heads=6"),
        ({"out": torch.empty(2, 16, 6, 40)}, "out: expected shape"),
        ({"out": torch.empty(1, 16, 6, 40, dtype=torch.float16)}, "like cache"),
    ],
)
def test_blocks_reject_bad_input(backend, kwargs, field):
    backend("torch")
    args = {"cache": _cache(torch.bfloat16, False), "block_ids": torch.tensor([3])} | kwargs
    with pytest.raises(ValueError, match=field):
        gather_blocks(**args)


def test_scatter_blocks_rejects_duplicates_and_bad_cache(backend):
    backend("torch")
    cache = _cache(torch.bfloat16, False)
    with pytest.raises(ValueError, match="distinct"):
        scatter_blocks(cache[:2].clone(), cache, torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="cache: expected"):
        gather_blocks(cache[0], torch.tensor([0]))


@pytest.mark.kernels
@pytest.mark.slow  # a subprocess that compiles with LLVM and ptxas
def test_kernels_compile_for_sm90_with_16_byte_vectors(compile_sm90):
    ranges = dict(src="*i64", dst="*i64", src_starts="*i64", dst_starts="*i64")
    ranges |= dict(piece_words="*i64", VEC="constexpr", BLOCK="constexpr")
    blocks = dict(src="*i16", dst="*i16", block_ids="*i64", num_heads="i32", head_dim="i32")
    blocks |= dict(block_size="i32", s_src0="i32", s_src1="i32", s_src2="i64", s_src3="constexpr")
    blocks |= dict(s_dst0="i32", s_dst1="i32", s_dst2="i32", s_dst3="constexpr")
    blocks |= dict.fromkeys(("GATHER", "BLOCK_T", "BLOCK_D"), "constexpr")
    aligned = ["src", "dst", "head_dim", "s_src0", "s_src1", "s_src2", "s_dst0", "s_dst1", "s_dst2"]
    module = "kernels.pack.triton"
    ranges_ptx, *blocks_ptx = compile_sm90(
        [
            (module, "_copy_pieces_kernel", ranges, dict(VEC=2, BLOCK=1024), ["src", "dst"]),
            *[
                (module, "_copy_blocks_kernel", blocks, flags, aligned)
                for flags in (
                    dict(s_src3=1, s_dst3=1, GATHER=gather, BLOCK_T=16, BLOCK_D=128)
                    for gather in (True, False)
                )
            ],
        ]
    )
    assert "ld.global.v2.b64" in ranges_ptx and "st.global.v2.b64" in ranges_ptx
    for ptx in blocks_ptx:  # 8 bf16 per access along head_dim
        assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
