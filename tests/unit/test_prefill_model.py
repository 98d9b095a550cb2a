"""The modelled prefill of the layer-wise benchmark: groups in layer order, ready times
that add up to the prompt's time, attention layers heavier at long prompts."""

from __future__ import annotations

import pytest

from transfer.bench.prefill_model import layer_flops, stream_groups
from transfer.errors import InvalidInput
from transfer.presets import get_preset


@pytest.mark.parametrize("name", ["qwen3-next-80b-a3b", "kimi-linear-48b-a3b"])
@pytest.mark.parametrize("layer_group", [0, 1, 4])
@pytest.mark.parametrize("chunk_tokens", [0, 4096, 5000])
def test_parts_follow_the_order_of_work_and_end_with_the_prefill(name, layer_group, chunk_tokens):
    geometry = get_preset(name)
    parts = stream_groups(geometry, 16384, 50_000.0, layer_group, chunk_tokens)
    chunks = sorted({p.tokens for p in parts})
    assert chunks[0][0] == 0 and chunks[-1][1] == 16384
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
    assert len(chunks) == (1 if not chunk_tokens else -(-16384 // chunk_tokens))
    for chunk in chunks:  # each chunk runs every layer once, groups in layer order
        layers = [i for p in parts if p.tokens == chunk for i in p.layers]
        assert layers == [layer.index for layer in geometry.layers]
    assert [p.with_state for p in parts] == [p.tokens[1] == 16384 for p in parts]
    ready = [p.ready_s for p in parts]
    assert ready == sorted(ready) and len(set(ready)) == len(ready)
    assert ready[-1] == pytest.approx(16384 / 50_000.0)
    if layer_group:
        assert all(len(p.layers) <= layer_group for p in parts)
        assert all(len({i // layer_group for i in p.layers}) == 1 for p in parts)
    else:
        assert len(parts) == len(chunks)


def test_chunks_cost_what_the_whole_prompt_costs():
    """Later chunks attend to more context: they take longer, and all of them together
    take what one pass over the prompt takes."""
    geometry = get_preset("kimi-linear-48b-a3b")
    parts = stream_groups(geometry, 65536, 50_000.0, 0, 8192)
    spans = [b.ready_s - a.ready_s for a, b in zip(parts, parts[1:], strict=False)]
    assert spans == sorted(spans)
    whole = sum(layer_flops(geometry, 65536).values())
    chunked = sum(sum(layer_flops(geometry, e, s).values()) for s, e in {p.tokens for p in parts})
    assert chunked == pytest.approx(whole)


def test_attention_layers_weigh_more_as_prompts_grow():
    geometry = get_preset("qwen3-next-80b-a3b")
    attention = geometry.attention_layers[0].index
    linear = geometry.linear_layers[0].index
    short, long = layer_flops(geometry, 1024), layer_flops(geometry, 65536)
    assert short[attention] / short[linear] < long[attention] / long[linear]
    assert long[attention] > 2 * long[linear]


def test_a_scaled_model_gets_its_layers_share_of_the_time():
    whole = get_preset("qwen3-next-80b-a3b")
    scaled = whole.with_num_layers(12)
    flops = layer_flops(whole, 4096)
    share = sum(flops[layer.index] for layer in scaled.layers) / sum(flops.values())
    groups = stream_groups(scaled, 4096, 50_000.0, 4, whole_model=whole)
    assert groups[-1].ready_s == pytest.approx(4096 / 50_000.0 * share)
    assert share < 0.5


@pytest.mark.parametrize(
    ("tokens", "speed", "field"), [(0, 1.0, "tokens"), (8, 0.0, "tokens_per_s")]
)
def test_bad_input_names_the_field(tokens, speed, field):
    with pytest.raises(InvalidInput, match=field):
        stream_groups(get_preset("tiny-qwen3-next"), tokens, speed, 2)
