"""vLLM's own KV cache allocation (real `allocate_kv_cache`, the tiny Qwen3-Next's specs as a
vLLM CPU server builds them) described as pdxfer layouts, and the packer's reads over it:
for random block ids and token counts, at TP pairs whose heads divide, the reads copy
exactly the tokens and state the request needs -- nothing of other blocks, other tokens or
the page padding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from transfer.agent import stage_small
from transfer.cache.explicit_layout import ExplicitLayout
from transfer.errors import InvalidInput
from transfer.hf_geometry import from_hf_dict
from transfer.vllm.layout_places import STATE_ORDER_DS, STATE_ORDER_SD
from transfer.vllm.layout_vllm import describe
from transfer.vllm.load_plan import CacheGroup, plan_load

BLOCK = 384  # what vLLM's CPU platform picks for this model (page unification)
NUM_BLOCKS = 5
K_HEADS, V_HEADS, KV_HEADS, HEAD = 2, 4, 2, 128
CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "head_dim": HEAD,
    "num_attention_heads": 4,
    "num_key_value_heads": KV_HEADS,
    "linear_key_head_dim": HEAD,
    "linear_value_head_dim": HEAD,
    "linear_num_key_heads": K_HEADS,
    "linear_num_value_heads": V_HEADS,
    "linear_conv_kernel_dim": 4,
    "intermediate_size": 512,
    "vocab_size": 512,
    "dtype": "bfloat16",
}
GEOMETRY = from_hf_dict(CONFIG, "tiny-qwen3-next-128")
NAMES = [f"model.layers.{i}.linear_attn" for i in range(3)] + ["model.layers.3.self_attn.attn"]
GROUPS = tuple(CacheGroup(frozenset({i}), i == 3) for i in range(4))


def _specs(tp: int, conv_order: str):
    conv_dim = (2 * K_HEADS * HEAD + V_HEADS * HEAD) // tp
    conv = (3, conv_dim) if conv_order == STATE_ORDER_SD else (conv_dim, 3)
    ssm = (V_HEADS // tp, HEAD, HEAD)
    attention = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=max(KV_HEADS // tp, 1), head_size=HEAD, dtype=torch.bfloat16
    )
    page = attention.page_size_bytes
    mamba = MambaSpec(
        block_size=BLOCK,
        shapes=(conv, ssm),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=page,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode="align",
    )
    return [mamba] * 3 + [attention], page


def vllm_rank(tp: int, conv_order: str = STATE_ORDER_SD, seed: int | None = None):
    """One rank's caches exactly as vLLM allocates them, filled with random bytes (seed)."""
    specs, page = _specs(tp, conv_order)
    size = NUM_BLOCKS * page
    config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[
            KVCacheTensor(size=size, layers=[n], layer_stride=size, block_stride=page)
            for n in NAMES
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=[n], kv_cache_spec=s)
            for n, s in zip(NAMES, specs, strict=True)
        ],
    )
    views = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBHNC)
    raw = views[NAMES[0]].untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(raw, 0, (raw.nbytes(),), (1,))
    if seed is not None:
        flat.random_(0, 256, generator=torch.Generator().manual_seed(seed))
    layers = {i: (specs[i], views[NAMES[i]]) for i in range(4)}
    return layers, flat, specs


def _describe(tp, conv_order=STATE_ORDER_SD, seed=None):
    layers, flat, specs = vllm_rank(tp, conv_order, seed)
    memory, regions = describe(GEOMETRY, tp, layers, conv_order, "vllm-test")
    assert len(regions) == 1 and regions[0].data_ptr() == flat.data_ptr()
    return memory, flat, layers, specs


def _apply(reads, prefill_flats, decode_flat, p_maps, d_map, staged=False):
    """A reference memcpy of every planned range (virtual offsets -> region bytes); with
    `staged`, small neighbouring ranges go through a staging area first, as the worker
    posts them. Returns the descriptors posted."""
    stage_at = d_map.extent + 4096
    staging = np.zeros(8 << 20, dtype=np.uint8)
    target = decode_flat.numpy()
    descriptors = 0
    for rank, (src, dst, nbytes) in reads.per_source.items():
        copies = None
        if staged:
            plan = stage_small(dst, src, nbytes, stage_at)
            (dst, src, nbytes), copies = plan.wire, plan.copies
            stage_at += plan.staging_bytes
        descriptors += len(nbytes)
        s_at = p_maps[rank].addresses(src, nbytes, "src") - prefill_flats[rank].data_ptr()
        source = prefill_flats[rank].numpy()
        for s, d, n in zip(s_at.tolist(), dst.tolist(), nbytes.tolist(), strict=True):
            if d >= d_map.extent:  # into staging
                at = d - d_map.extent - 4096
                staging[at : at + n] = source[s : s + n]
            else:
                at = int(d_map.addresses(np.array([d]), np.array([n]), "dst")[0])
                at -= decode_flat.data_ptr()
                target[at : at + n] = source[s : s + n]
        if copies is not None:
            for s, d, n in zip(*(c.tolist() for c in copies), strict=True):
                at = int(d_map.addresses(np.array([d]), np.array([n]), "dst")[0])
                at -= decode_flat.data_ptr()
                s -= d_map.extent + 4096
                target[at : at + n] = staging[s : s + n]
    return descriptors


def _expected_decode(tp_p, tp_d, rank, p_layers, src_ids, dst_ids, num_tokens, conv_order):
    """What decode rank `rank` must hold: its heads of the needed tokens and states, by
    slicing vLLM's own views (zeros everywhere else)."""
    layers, flat, specs = vllm_rank(tp_d, conv_order)
    attention = layers[3][1]
    heads_d, heads_p = KV_HEADS // tp_d, KV_HEADS // tp_p
    # Attention blocks cross whole (vLLM's CPU kernel keeps K dim-major inside a block).
    for t in range(-(-num_tokens // BLOCK) * BLOCK):
        sb, db = src_ids[3][t // BLOCK], dst_ids[3][t // BLOCK]
        for h in range(heads_d):
            g = rank * heads_d + h
            attention[db, h, t % BLOCK] = p_layers[g // heads_p][3][1][sb, g % heads_p, t % BLOCK]
    for i in range(3):
        _copy_state(
            i,
            specs[i],
            layers[i][1],
            p_layers,
            src_ids[i][-1],
            dst_ids[i][-1],
            (tp_p, tp_d, rank),
            conv_order,
        )
    return flat


def _state_views(spec, page_view):
    conv_shape, ssm_shape = spec.shapes
    conv_bytes = int(np.prod(conv_shape)) * 2
    pages = page_view.squeeze(1).squeeze(1)
    conv = pages[:, :conv_bytes].view(torch.bfloat16).view(-1, *conv_shape)
    ssm = pages[:, conv_bytes : conv_bytes + int(np.prod(ssm_shape)) * 4].view(torch.float32)
    return conv, ssm.view(-1, *ssm_shape)


def _copy_state(i, spec_d, view_d, p_layers, s_slot, d_slot, tps, conv_order):
    tp_p, tp_d, rank = tps
    conv_d, ssm_d = _state_views(spec_d, view_d)
    # Global channel order of the conv state: [q | k | v], each sharded over TP.
    parts = [("q", K_HEADS * HEAD), ("k", K_HEADS * HEAD), ("v", V_HEADS * HEAD)]
    for p in range(tp_p):
        conv_p, ssm_p = _state_views(p_layers[p][i][0], p_layers[p][i][1])
        if conv_order == STATE_ORDER_DS:
            conv_p, conv_dd = conv_p.transpose(1, 2), conv_d.transpose(1, 2)
        else:
            conv_dd = conv_d
        d_off = p_off = 0
        for _, width in parts:
            w_p, w_d = width // tp_p, width // tp_d
            for c in range(w_d):
                g = rank * w_d + c
                if g // w_p == p:
                    conv_dd[d_slot, :, d_off + c] = conv_p[s_slot, :, p_off + g % w_p]
            d_off += w_d
            p_off += w_p
        h_p, h_d = V_HEADS // tp_p, V_HEADS // tp_d
        for h in range(h_d):
            g = rank * h_d + h
            if g // h_p == p:
                ssm_d[d_slot, h] = ssm_p[s_slot, g % h_p]


@pytest.mark.parametrize("conv_order", [STATE_ORDER_SD, STATE_ORDER_DS])
def test_layout_matches_vllm_views(conv_order):
    memory, flat, layers, specs = _describe(1, conv_order)
    layout = memory.layout(0)
    assert layout.block_size == BLOCK and layout.num_blocks == NUM_BLOCKS
    attention = layers[3][1]
    base = flat.data_ptr()
    for unit in layout.kv_units():
        offset = 0 if unit.tensor == "k" else HEAD
        element = attention[2, unit.unit, 7, offset:]
        assert (
            unit.base + 2 * unit.block_stride + 7 * unit.token_stride == element.data_ptr() - base
        )
    for unit in layout.state_units():
        conv, ssm = _state_views(specs[unit.layer], layers[unit.layer][1])
        if unit.tensor == "ssm":
            assert unit.base + 3 * unit.slot_stride == ssm[3, unit.unit].data_ptr() - base
    # The layout survives the handshake's JSON round trip.
    assert ExplicitLayout.from_dict(layout.to_dict()) == layout


@settings(max_examples=10, deadline=None, phases=[Phase.explicit, Phase.generate])
@given(
    pair=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2)]),
    num_tokens=st.integers(1, 2 * BLOCK),
    conv_order=st.sampled_from([STATE_ORDER_SD, STATE_ORDER_DS]),
    staged=st.booleans(),
    data=st.data(),
)
def test_reads_copy_exactly_the_needed_bytes(pair, num_tokens, conv_order, staged, data):
    tp_p, tp_d = pair
    blocks = -(-num_tokens // BLOCK)
    ids = st.permutations(range(NUM_BLOCKS))
    src_perm, dst_perm = data.draw(ids), data.draw(ids)
    # Attention blocks and the state blocks share one pool: disjoint ids, like vLLM's.
    src_ids = [(src_perm[blocks + i],) for i in range(3)] + [tuple(src_perm[:blocks])]
    dst_ids = [(dst_perm[blocks + i],) for i in range(3)] + [tuple(dst_perm[:blocks])]
    prefill = [_describe(tp_p, conv_order, seed=10 + p) for p in range(tp_p)]
    p_layouts = [m.layout(p) for p, (m, *_) in enumerate(prefill)]
    p_layers = [{i: (specs[i], layers[i][1]) for i in layers} for _, _, layers, specs in prefill]
    for rank in range(tp_d):
        memory, flat, _, _ = _describe(tp_d, conv_order)
        d_layouts = [memory.layout(r) for r in range(tp_d)]
        reads = plan_load(GROUPS, p_layouts, d_layouts, rank, src_ids, dst_ids, num_tokens)
        posted = _apply(
            reads,
            [f for _, f, _, _ in prefill],
            flat,
            [m.region_map for m, *_ in prefill],
            memory.region_map,
            staged,
        )
        assert posted <= reads.descriptors
        expected = _expected_decode(
            tp_p, tp_d, rank, p_layers, src_ids, dst_ids, num_tokens, conv_order
        )
        assert torch.equal(flat, expected)
        useful = blocks * BLOCK * 2 * (KV_HEADS // tp_d) * HEAD * 2
        useful += 3 * (
            3 * (2 * K_HEADS + V_HEADS) * HEAD // tp_d * 2 + V_HEADS // tp_d * HEAD * HEAD * 4
        )
        assert reads.nbytes == useful


def test_one_range_per_block_and_state_at_tp1():
    """100 tokens at P = D = 1: the attention block crosses whole (both heads: one run),
    each layer's conv+SSM state one run without the page padding: 1 + 3 ranges."""
    prefill, _, _, _ = _describe(1)
    decode, _, _, _ = _describe(1)
    src = [(1,), (2,), (3,), (0,)]
    dst = [(4,), (0,), (1,), (2,)]
    reads = plan_load(GROUPS, [prefill.layout(0)], [decode.layout(0)], 0, src, dst, 99)
    assert reads.descriptors == 4
    state = 3 * (3 * 1024 * 2 + 4 * HEAD * HEAD * 4)
    assert reads.nbytes == BLOCK * 2 * 2 * HEAD * 2 + state


@pytest.mark.parametrize("tp_p, tp_d", [(2, 1), (1, 2)])
def test_staging_keeps_descriptors_at_or_below_nixl(tp_p, tp_d):
    """Across TP sizes vLLM's default (time-major) conv state splits into a piece per step
    and head; staged, each source's state pieces cross as one span: per decode rank at most
    NixlConnector's 13 descriptors per source (its measured count at 2 -> 1)."""
    prefill = [_describe(tp_p) for _ in range(tp_p)]
    p_layouts = [m.layout(p) for p, (m, *_) in enumerate(prefill)]
    memory, flat, _, _ = _describe(tp_d)
    d_layouts = [memory.layout(r) for r in range(tp_d)]
    src = [(1,), (2,), (3,), (0,)]
    dst = [(4,), (0,), (1,), (2,)]
    for rank in range(tp_d):
        reads = plan_load(GROUPS, p_layouts, d_layouts, rank, src, dst, 99)
        posted = _apply(
            reads, [f for _, f, _, _ in prefill], flat, [m.region_map for m, *_ in prefill],
            memory.region_map, staged=True,
        )  # fmt: skip
        assert posted < reads.descriptors
        assert posted <= 13 * len(reads.per_source)


def test_a_layout_it_cannot_read_fails_naming_it():
    layers, _, specs = vllm_rank(1)
    spec, view = layers[3]
    layers[3] = (spec, view.transpose(1, 2))  # tokens outside heads: not LBHNC
    with pytest.raises(InvalidInput, match="layer 3"):
        describe(GEOMETRY, 1, layers, STATE_ORDER_SD, "vllm-test")
    layers, _, _ = vllm_rank(1)
    with pytest.raises(InvalidInput, match="layer 0.*conv state"):
        describe(GEOMETRY, 1, layers, STATE_ORDER_DS, "vllm-test")  # SD memory read as DS
    layers, _, _ = vllm_rank(1)
    del layers[2]
    with pytest.raises(InvalidInput, match=r"layers \[2\] have no cache"):
        describe(GEOMETRY, 1, layers, STATE_ORDER_SD, "vllm-test")
