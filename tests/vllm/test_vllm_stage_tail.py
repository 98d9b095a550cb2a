"""The partial last attention block through stage slots (`transfer/vllm/stage_tail.py`),
over caches exactly as vLLM allocates them: the gather reads what vLLM's CPU kernel wrote,
and decode's block ends up as if the kernel had written the same tokens there."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from tests.vllm.test_vllm_layout import (
    BLOCK,
    GROUPS,
    HEAD,
    K_HEADS,
    KV_HEADS,
    NUM_BLOCKS,
    V_HEADS,
    _describe,
    _expected_decode,
)
from transfer.errors import InvalidInput
from transfer.vllm.load_plan import plan_load
from transfer.vllm.stage_tail import gather_copies, slot_bytes, tail_reads

GAP = 4096  # a stage or landing buffer sits this far past the described memory


class Memory:
    """One rank's described memory plus one extra buffer after it, addressed by virtual
    offsets (a reference memcpy, no transport)."""

    def __init__(self, region_map, flat: torch.Tensor, extra_bytes: int):
        self.map, self.flat = region_map, flat.numpy()
        self.extra_at = region_map.extent + GAP
        self.extra = np.zeros(extra_bytes, dtype=np.uint8)

    def _span(self, offset: int, n: int) -> np.ndarray:
        if offset >= self.extra_at:
            at = offset - self.extra_at
            return self.extra[at : at + n]
        at = int(self.map.addresses(np.array([offset]), np.array([n]), "offset")[0])
        at -= self.flat.ctypes.data
        return self.flat[at : at + n]

    def read(self, offset: int, n: int) -> np.ndarray:
        return self._span(offset, n).copy()

    def write(self, offset: int, data: np.ndarray) -> None:
        self._span(offset, len(data))[:] = data


def _run(copies, source: Memory, target: Memory) -> None:
    for s, d, n in zip(*(c.tolist() for c in copies), strict=True):
        target.write(d, source.read(s, n))


def _scatter(tail, decode: Memory) -> None:
    """Decode's side after the reads landed: zero the block's head runs, then copy."""
    _, copies = tail.shifted(decode.extra_at)
    for at, n in zip(*(c.tolist() for c in tail.clear), strict=True):
        decode.write(at, np.zeros(n, dtype=np.uint8))
    _run(copies, decode, decode)


def _stale(attention: torch.Tensor, block: int) -> None:
    """What a reused block may hold: a mamba page's bytes, here all NaN as bf16."""
    attention[block].view(torch.uint8).fill_(0xFF)


def _kernel_write(attention: torch.Tensor, block: int, key: torch.Tensor, value: torch.Tensor):
    """vLLM's CPU attention writing tokens 0.. of `block` (as `cpu_attn.py` calls it)."""
    blocks, heads, size, _ = attention.shape
    kv = attention.view(blocks, heads, size * 2, -1)
    key_cache, value_cache = kv.chunk(2, dim=2)
    slots = torch.arange(len(key), dtype=torch.int64) + block * size
    isa = _get_attn_isa(torch.bfloat16, size, HEAD)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)


@pytest.mark.parametrize("tokens", [1, 99, BLOCK - 1])
def test_gather_reads_what_the_kernel_wrote_and_scatter_writes_it_back(tokens):
    memory, flat, layers, _ = _describe(1)
    layout = memory.layout(0)
    gen = torch.Generator().manual_seed(tokens)
    key = torch.randn(tokens, KV_HEADS, HEAD, generator=gen).to(torch.bfloat16)
    value = torch.randn(tokens, KV_HEADS, HEAD, generator=gen).to(torch.bfloat16)
    _kernel_write(layers[3][1], 2, key, value)
    prefill = Memory(memory.region_map, flat, slot_bytes(layout))
    _run(gather_copies(layout, 2, tokens, prefill.extra_at), prefill, prefill)
    chunks = torch.from_numpy(prefill.extra[: 2 * KV_HEADS * tokens * HEAD * 2].copy())
    chunks = chunks.view(torch.bfloat16).view(KV_HEADS, 2, -1)
    for head in range(KV_HEADS):
        assert torch.equal(chunks[head, 0].view(HEAD, tokens).T, key[:, head])
        assert torch.equal(chunks[head, 1].view(tokens, HEAD), value[:, head])
    # Decode: its block 4 from the stage slot equals the kernel writing the tokens there.
    d_memory, d_flat, d_layers, _ = _describe(1)
    _stale(d_layers[3][1], 4)
    decode = Memory(d_memory.region_map, d_flat, 1 << 20)
    tail = tail_reads([layout], d_memory.layout(0), [prefill.extra_at], 4, tokens)
    reads, _ = tail.shifted(decode.extra_at)
    assert list(reads) == [0] and len(reads[0][2]) == 1  # both heads in one range
    _run(reads[0], prefill, decode)
    _scatter(tail, decode)
    _, e_flat, e_layers, _ = _describe(1)
    _kernel_write(e_layers[3][1], 4, key, value)
    assert torch.equal(d_flat, e_flat)


@settings(max_examples=12, deadline=None, phases=[Phase.explicit, Phase.generate])
@given(
    pair=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2)]),
    num_tokens=st.integers(1, 2 * BLOCK).filter(lambda n: n % BLOCK),
    data=st.data(),
)
def test_staged_reads_copy_exactly_the_prompts_tokens(pair, num_tokens, data):
    tp_p, tp_d = pair
    blocks = -(-num_tokens // BLOCK)
    partial = num_tokens % BLOCK
    ids = st.permutations(range(NUM_BLOCKS))
    src_perm, dst_perm = data.draw(ids), data.draw(ids)
    src_ids = [(src_perm[blocks + i],) for i in range(3)] + [tuple(src_perm[:blocks])]
    dst_ids = [(dst_perm[blocks + i],) for i in range(3)] + [tuple(dst_perm[:blocks])]
    prefill = [_describe(tp_p, seed=10 + p) for p in range(tp_p)]
    p_layouts = [m.layout(p) for p, (m, *_) in enumerate(prefill)]
    p_layers = [{i: (specs[i], layers[i][1]) for i in layers} for _, _, layers, specs in prefill]
    sources, offsets = [], []
    for p, (memory, flat, _, _) in enumerate(prefill):
        source = Memory(memory.region_map, flat, 3 * slot_bytes(p_layouts[p]))
        at = source.extra_at + slot_bytes(p_layouts[p])  # slot 1 of 3
        _run(gather_copies(p_layouts[p], src_ids[3][-1], partial, at), source, source)
        sources.append(source)
        offsets.append(at)
    for rank in range(tp_d):
        memory, flat, d_layers, _ = _describe(tp_d)
        _stale(d_layers[3][1], dst_ids[3][-1])
        d_layouts = [memory.layout(r) for r in range(tp_d)]
        reads = plan_load(GROUPS, p_layouts, d_layouts, rank, src_ids, dst_ids, num_tokens, offsets)
        decode = Memory(memory.region_map, flat, 1 << 20)
        assert reads.tail is not None
        tail_sources, _ = reads.tail.shifted(decode.extra_at)
        for p, columns in [*reads.per_source.items(), *tail_sources.items()]:
            _run(columns, sources[p], decode)
        _scatter(reads.tail, decode)
        expected = _expected_decode(
            tp_p, tp_d, rank, p_layers, src_ids, dst_ids, num_tokens, "SD"
        ).view(-1)
        _, e_flat, e_layers, _ = _describe(tp_d)
        e_flat.copy_(expected)
        _keep_first_tokens(e_layers[3][1], dst_ids[3][-1], partial)
        assert torch.equal(flat, e_flat)
        heads = KV_HEADS // tp_d
        useful = ((blocks - 1) * BLOCK + partial) * 2 * heads * HEAD * 2
        useful += 3 * (
            3 * (2 * K_HEADS + V_HEADS) * HEAD // tp_d * 2 + V_HEADS // tp_d * HEAD * HEAD * 4
        )
        assert reads.nbytes == useful
        tail_descriptors = sum(len(c[2]) for c in reads.tail.per_source.values())
        assert tail_descriptors == max(1, tp_p // tp_d)  # one range per prefill rank


def _keep_first_tokens(attention: torch.Tensor, block: int, tokens: int) -> None:
    """Zero a block except its first `tokens` tokens as the kernel lays them out (K
    dim-major, then V token-major), per head."""
    heads, size = attention.shape[1], attention.shape[2]
    for head in range(heads):
        run = attention[block, head].reshape(-1)
        k, v = run[: HEAD * size].view(HEAD, size), run[HEAD * size :].view(size, HEAD)
        k[:, tokens:] = 0
        v[tokens:] = 0


def test_the_issue_prompt_moves_its_tokens_only():
    """A 100-token prompt (99 cross) at P = D = 1: one range of both heads' 99 tokens plus the
    three unpadded states: 4 descriptors, 0.757x the 1,198,080 B of whole blocks."""
    prefill, _, _, _ = _describe(1)
    decode, _, _, _ = _describe(1)
    src = [(1,), (2,), (3,), (0,)]
    dst = [(4,), (0,), (1,), (2,)]
    layouts = [prefill.layout(0)], [decode.layout(0)]
    whole = plan_load(GROUPS, *layouts, 0, src, dst, 99)
    staged = plan_load(GROUPS, *layouts, 0, src, dst, 99, [1 << 30])
    assert whole.nbytes == 1_198_080
    assert staged.descriptors == whole.descriptors == 4
    assert staged.nbytes == 99 * 2 * 2 * HEAD * 2 + 3 * (3 * 1024 * 2 + 4 * HEAD * HEAD * 4)
    assert staged.nbytes / whole.nbytes < 0.76


def test_bad_tails_fail_naming_the_field():
    memory, _, _, _ = _describe(1)
    layout = memory.layout(0)
    with pytest.raises(InvalidInput, match="partial block"):
        gather_copies(layout, 0, BLOCK, 0)
    with pytest.raises(InvalidInput, match="staged_offsets"):
        tail_reads([layout], layout, [0, 1], 0, 5)
