import pytest

from transfer.presets import get_preset
from transfer.sizing import CacheDtypes, size_model

# Expected values written out by hand from docs/reference.md #2's formulas, not by this code.
# (ssm, conv, attention bytes per token) per TP degree.
EXPECTED = {
    "qwen3-next-80b-a3b": {
        1: (1_048_576, 49_152, 2_048),
        2: (524_288, 24_576, 1_024),
        4: (262_144, 12_288, 1_024),  # 2 KV heads over 4 ranks: each rank holds one whole head
        8: (131_072, 6_144, 1_024),
    },
    "kimi-linear-48b-a3b": {
        1: (1_048_576, 73_728, 1_152),
        2: (524_288, 36_864, 1_152),  # MLA latent replicated: full size on every rank
        4: (262_144, 18_432, 1_152),
        8: (131_072, 9_216, 1_152),
    },
    "nemotron-nano-12b-v2": {
        1: (2_621_440, 73_728, 4_096),
        2: (1_310_720, 36_864, 2_048),
        4: (655_360, 18_432, 1_024),
        8: (327_680, 9_216, 512),
    },
    "tiny-qwen3-next": {1: (16_384, 3_072, 512), 2: (8_192, 1_536, 256), 4: (4_096, 768, 256)},
    "tiny-kimi-linear": {1: (8_192, 2_304, 160), 2: (4_096, 1_152, 160), 4: (2_048, 576, 160)},
    "tiny-nemotron-h": {
        1: (16_384, 1_920, 512),  # one group: conv (256 x + 2 x 32 B|C) x 3 steps x 2 bytes
        2: (8_192, 1_152, 256),  # B and C replicated on every rank from TP 2 on
        4: (4_096, 768, 256),
        8: (2_048, 576, 256),
    },
}


@pytest.mark.parametrize(
    "name, tp", [(name, tp) for name, by_tp in EXPECTED.items() for tp in by_tp]
)
def test_per_rank_bytes(name, tp):
    sizing = size_model(get_preset(name), tp)
    ssm, conv, kv = EXPECTED[name][tp]
    assert (sizing.linear_layer_state.ssm, sizing.linear_layer_state.conv) == (ssm, conv)
    assert sizing.attention_layer_kv_per_token == kv


def test_reference_crossovers():
    assert size_model(get_preset("qwen3-next-80b-a3b"), 1).crossover_tokens == 536
    assert size_model(get_preset("kimi-linear-48b-a3b"), 1).crossover_tokens == 975


def test_whole_model_totals_and_spec_tokens():
    geometry = get_preset("qwen3-next-80b-a3b")
    sizing = size_model(geometry, 1, spec_tokens=2)
    assert sizing.state_bytes_per_slot == 36 * (1_048_576 + 49_152)
    assert sizing.state_bytes_per_request == 3 * sizing.state_bytes_per_slot
    assert sizing.kv_bytes_per_token == 12 * 2_048


def test_fp32_state_doubles_only_ssm():
    sizing = size_model(get_preset("qwen3-next-80b-a3b"), 1, CacheDtypes.from_names(ssm="fp32"))
    assert sizing.linear_layer_state.ssm == 2 * 1_048_576
    assert sizing.linear_layer_state.conv == 49_152


def test_unknown_dtype_names_field():
    with pytest.raises(ValueError, match="state_dtype 'int3'"):
        CacheDtypes.from_names(ssm="int3")
