"""Layout: views tile the arena without overlap, shapes, options, memplan sizing, the spec."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch

from transfer.cache import Arena, ConvOrder, KVOrder, Layout, LayoutOptions, SSMOrder
from transfer.geometry import LayerKind, Role
from transfer.memplan import StatePlacement, plan_memory
from transfer.presets import get_preset
from transfer.sizing import CacheDtypes, size_model

TINY = ("tiny-qwen3-next", "tiny-kimi-linear", "tiny-nemotron-h")
ALL_OPTIONS = [
    LayoutOptions(*combo)
    for combo in itertools.product(KVOrder, StatePlacement, ConvOrder, SSMOrder, (0, 2))
]
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _views(layout, buffer):
    for layer in layout.geometry.layers:
        for tensor in layer.cache_tensors():
            dtype = INT[layout.dtypes.of(tensor.role)]
            if tensor.role is Role.KV:
                yield layout.kv_view(buffer, layer.index, tensor.name, dtype)
            elif tensor.role is Role.SSM:
                yield layout.ssm_view(buffer, layer.index, dtype)
            else:
                yield layout.conv_view(buffer, layer.index, tensor.name, dtype)


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize(
    "options",
    ALL_OPTIONS,
    ids=lambda o: "-".join(str(getattr(v, "value", v)) for v in vars(o).values()),
)
def test_views_tile_the_regions_without_overlap(name, options):
    geometry = get_preset(name)
    dtypes = CacheDtypes(2, 4, 2)
    for tp in geometry.valid_tps((1, 2)):
        layout = Layout(geometry, tp, tp - 1, 3, 5, 4, dtypes, options, staging_bytes=100)
        buffer = torch.zeros(layout.arena_bytes, dtype=torch.uint8)
        views = list(_views(layout, buffer))
        for view in views:
            view.fill_(-1)
        # The views cover exactly the units' bytes, packed tightly; staging is untouched.
        kv, state = 5 * 3 * layout.kv_bytes_per_token, 4 * layout.state_bytes_per_slot
        assert int((buffer == 255).sum()) == kv + state
        assert (layout.kv_region_bytes, layout.state_region_bytes) == (kv, state)
        values = [
            torch.randint(-(2**7), 2**7, v.shape, dtype=torch.int32).to(v.dtype) for v in views
        ]
        for view, value in zip(views, values, strict=True):
            view.copy_(value)
        for view, value in zip(views, values, strict=True):  # no view overwrote another
            assert torch.equal(view, value)
        assert not buffer[layout.staging_offset :].any()


@pytest.mark.parametrize("name", TINY)
def test_view_shapes_follow_the_geometry(name):
    geometry = get_preset(name)
    tp = 2
    layout = Layout(geometry, tp, 1, 16, 6, 3)
    arena = Arena.allocate(layout)
    for layer in geometry.layers:
        spec = layer.spec
        if layer.kind is LayerKind.GQA:
            heads = max(1, spec.num_kv_heads // tp)
            assert arena.kv(layer.index, "k").shape == (6, 16, heads, spec.head_dim)
        elif layer.kind is LayerKind.MLA:
            latent = spec.kv_lora_rank + spec.qk_rope_head_dim
            assert arena.kv(layer.index, "kv").shape == (6, 16, latent)
        else:
            ssm = arena.ssm(layer.index)
            conv_names = [t.name for t in layer.cache_tensors() if t.role is Role.CONV]
            for tensor in layer.cache_tensors():
                if tensor.role is Role.CONV:
                    shape = (3, tensor.rank_channels(tp), tensor.steps)
                    assert arena.conv(layer.index, tensor.name).shape == shape
            assert ssm.shape[:2] == (3, layer.cache_tensors()[0].segments[0].num_units // tp)
            assert ssm.dtype == torch.bfloat16 and conv_names
    assert arena.staging.numel() == 0


def test_time_major_conv_is_a_transposed_view():
    geometry = get_preset("tiny-qwen3-next")
    channels_time = Layout(geometry, 1, 0, 8, 2, 2)
    time_channels = Layout(
        geometry, 1, 0, 8, 2, 2, options=LayoutOptions(conv_order="time_channels")
    )
    a = channels_time.conv_view(torch.empty(channels_time.arena_bytes, dtype=torch.uint8), 0)
    b = time_channels.conv_view(torch.empty(time_channels.arena_bytes, dtype=torch.uint8), 0)
    assert a.shape == b.shape and a.stride()[1:] == (3, 1) and b.stride()[1:] == (1, a.shape[1])


def test_head_major_keeps_one_heads_layers_and_tokens_together():
    geometry = get_preset("qwen3-next-80b-a3b")
    layout = Layout(geometry, 1, 0, 16, 10, 2)
    lane0 = [u for u in layout.kv_units() if u.unit == 0]
    row = sum(u.nbytes for u in lane0)  # one token of one head: every layer's K and V
    assert sorted(u.base for u in lane0) == list(range(0, row, lane0[0].nbytes))
    assert {u.token_stride for u in lane0} == {row} and {u.block_stride for u in lane0} == {
        16 * row
    }
    ssm = [u for u in layout.state_units() if u.role is Role.SSM and u.unit == 0]
    assert max(u.base for u in ssm) - min(u.base for u in ssm) == (len(ssm) - 1) * ssm[0].nbytes


def test_from_memplan_sizes_the_arena_like_the_plan():
    geometry = get_preset("qwen3-next-80b-a3b")
    for placement in StatePlacement:
        plan = plan_memory(geometry, 2, 2**30, 4, placement=placement)
        layout = Layout.from_memplan(geometry, 2, 1, plan, staging_bytes=4096)
        assert layout.options.state_placement is placement
        assert layout.kv_region_bytes == plan.num_kv_blocks * plan.kv_block_bytes
        assert layout.state_region_bytes == plan.num_state_slots * plan.state_slot_bytes
        assert layout.arena_bytes <= plan.used_bytes + 4096 + 3 * 64
        sizing = size_model(geometry, 2)
        assert layout.kv_bytes_per_token == sizing.kv_bytes_per_token
        assert layout.state_bytes_per_slot == sizing.state_bytes_per_slot


def test_spec_round_trips_through_json_and_compat_fields_name_what_must_match():
    geometry = get_preset("tiny-nemotron-h")
    options = LayoutOptions(KVOrder.BLOCKS_FIRST, StatePlacement.PER_LAYER, ConvOrder.TIME_CHANNELS)
    layout = Layout(geometry, 2, 1, 32, 9, 4, CacheDtypes(2, 4, 2), options, 10**6, None, 512)
    again = Layout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert again == layout and again.kv_units() == layout.kv_units()
    fields = layout.compat_fields()
    assert fields["geometry"] == geometry.name and fields["block_size"] == 32
    assert fields["layout_version"] == 1 and fields["dtypes"] == "kv=2,ssm=4,conv=2"
    other = get_preset("tiny-qwen3-next")
    assert Layout(other, 2, 1, 32, 9, 4).compat_fields()["geometry_hash"] != fields["geometry_hash"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("tp"), "missing fields"),
        (lambda d: d.update(rank=5), "rank 5 out of range"),
        (lambda d: d.update(num_blocks=-1), "num_blocks must be"),
        (lambda d: d.update(options={"kv_order": "diagonal"}), "kv_order"),
        (lambda d: d["geometry"]["layers"][0].update(head_dim=0), r"layers\[0\]\.head_dim"),
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d.update(kv_reserved_bytes=10), "kv_reserved_bytes=10 is below"),
    ],
)
def test_bad_specs_are_rejected_naming_the_field(change, message):
    data = Layout(get_preset("tiny-kimi-linear"), 2, 1, 8, 4, 2).to_dict()
    change(data)
    with pytest.raises(ValueError, match=message):
        Layout.from_dict(data)


def test_bad_layouts_are_rejected():
    geometry = get_preset("tiny-qwen3-next")
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        Layout(geometry, 3, 0, 8, 4, 2)
    with pytest.raises(ValueError, match="arena has 10 B"):
        Layout(geometry, 1, 0, 8, 4, 2).kv_view(torch.empty(10, dtype=torch.uint8), 3, "k")
    with pytest.raises(ValueError, match="no KV tensor"):
        Layout(geometry, 1, 0, 8, 4, 2).kv_view(torch.empty(10**6, dtype=torch.uint8), 0, "k")


def test_mixed_dtypes_keep_every_tensor_aligned():
    geometry = get_preset("tiny-kimi-linear")
    for dtypes in (CacheDtypes(2, 4, 2), CacheDtypes(1, 4, 2), CacheDtypes(4, 2, 4)):
        layout = Layout(geometry, 1, 0, 5, 3, 3, dtypes)
        for unit in layout.state_units():
            assert unit.base % unit.elem_bytes == 0 and unit.slot_stride % 4 == 0
        arena = Arena.allocate(layout)
        assert arena.ssm(0).dtype == {2: torch.bfloat16, 4: torch.float32}[dtypes.ssm]
        assert np.all([v.numel() for v in _views(layout, arena.buffer)])
