import json

import pytest

from transfer.errors import InvalidInput, NotFound
from transfer.geometry import LayerKind, Role, Segment, Sharding, canonical_dtype
from transfer.hf_geometry import from_hf_config, from_hf_dict
from transfer.presets import PRESETS, TINY_HF_CONFIGS, get_preset, load_geometry

FIXTURES = __import__("pathlib").Path(__file__).parent / "fixtures"


@pytest.mark.parametrize(
    "name, num_linear, num_attention, linear_kind, attention_kind",
    [
        ("qwen3-next-80b-a3b", 36, 12, LayerKind.GDN, LayerKind.GQA),
        ("kimi-linear-48b-a3b", 20, 7, LayerKind.KDA, LayerKind.MLA),
        ("nemotron-nano-12b-v2", 28, 6, LayerKind.MAMBA2, LayerKind.GQA),
        ("tiny-qwen3-next", 6, 2, LayerKind.GDN, LayerKind.GQA),
        ("tiny-qwen3.5", 4, 2, LayerKind.GDN, LayerKind.GQA),
        ("tiny-kimi-linear", 6, 2, LayerKind.KDA, LayerKind.MLA),
        ("tiny-nemotron-h", 6, 2, LayerKind.MAMBA2, LayerKind.GQA),
    ],
)
def test_presets_layer_mix(name, num_linear, num_attention, linear_kind, attention_kind):
    geometry = get_preset(name)
    assert len(geometry.linear_layers) == num_linear
    assert len(geometry.attention_layers) == num_attention
    assert {layer.kind for layer in geometry.linear_layers} == {linear_kind}
    assert {layer.kind for layer in geometry.attention_layers} == {attention_kind}


def test_attention_positions_follow_each_family_rule():
    qwen = get_preset("qwen3-next-80b-a3b")
    assert [layer.index for layer in qwen.attention_layers] == [
        i for i in range(48) if (i + 1) % 4 == 0
    ]
    kimi = get_preset("kimi-linear-48b-a3b")
    assert [layer.index + 1 for layer in kimi.attention_layers] == [4, 8, 12, 16, 20, 24, 27]
    tiny_kimi = get_preset("tiny-kimi-linear")
    assert [layer.index + 1 for layer in tiny_kimi.attention_layers] == [4, 8]
    nemotron = get_preset("nemotron-nano-12b-v2")
    assert nemotron.num_hidden_layers == 62  # MLP-only layers cache nothing and are not listed
    assert nemotron.layers[4].index == 7 and nemotron.layers[4].kind is LayerKind.GQA


def test_tiny_qwen_dimensions_are_exact():
    geometry = get_preset("tiny-qwen3-next")
    gdn, gqa = geometry.layers[0].spec, geometry.layers[3].spec
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, gdn.conv_kernel) == (
        4,
        8,
        32,
        32,
        4,
    )
    assert (gqa.num_q_heads, gqa.num_kv_heads, gqa.head_dim) == (8, 2, 64)
    assert geometry.hidden_size == 256 and len(geometry.layers) == 8


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError) as info:
        get_preset("llama")
    for name in PRESETS:
        assert name in str(info.value)


def test_gqa_heads_replicate_when_fewer_than_ranks():
    heads = Segment("kv_heads", 2, 64, Sharding.SPLIT_OR_REPLICATE)
    assert [heads.units_on_rank(8, r) for r in range(8)] == [range(0, 1)] * 4 + [range(1, 2)] * 4
    assert heads.ranks_holding(1, 8) == range(4, 8)
    assert heads.units_on_rank(2, 1) == range(1, 2)
    assert heads.check_tp(8) is None


def test_mla_latent_is_on_every_rank():
    latent = get_preset("kimi-linear-48b-a3b").attention_layers[0].cache_tensors()[0].segments[0]
    assert latent.sharding is Sharding.REPLICATED
    assert all(latent.units_on_rank(8, r) == range(1) for r in range(8))
    assert latent.ranks_holding(0, 4) == range(4)


def test_gdn_conv_is_three_sharded_segments():
    conv = [
        t for t in get_preset("qwen3-next-80b-a3b").layers[0].cache_tensors() if t.role is Role.CONV
    ]
    (tensor,) = conv
    assert [s.name for s in tensor.segments] == ["q", "k", "v"]
    assert tensor.steps == 3
    # rank 1 of 4 holds key heads 4..7 of q and of k, and value heads 8..15 of v
    assert [s.units_on_rank(4, 1) for s in tensor.segments] == [
        range(4, 8),
        range(4, 8),
        range(8, 16),
    ]


def test_kda_has_four_state_tensors():
    names = [t.name for t in get_preset("kimi-linear-48b-a3b").layers[0].cache_tensors()]
    assert names == ["ssm", "conv_q", "conv_k", "conv_v"]


def test_mamba2_groups_shard_or_replicate():
    x, b, _ = get_preset("tiny-nemotron-h").layers[0].cache_tensors()[1].segments
    assert b.units_on_rank(2, 1) == range(0, 1)  # its one group on both ranks: replicated
    assert x.units_on_rank(8, 5) == range(5, 6)
    _, b, _ = get_preset("nemotron-nano-12b-v2").layers[0].cache_tensors()[1].segments
    assert b.units_on_rank(2, 1) == range(4, 8)  # 8 groups over 2 ranks: sharded
    assert b.units_on_rank(16, 5) == range(2, 3)  # 8 groups over 16 ranks: replicated 2x


@pytest.mark.parametrize(
    "name, tp, fragment",
    [
        ("qwen3-next-80b-a3b", 32, "layer 0 (gdn): tp=32 does not divide the 16 k_heads"),
        ("tiny-qwen3-next", 3, "tp=3 does not divide"),
        ("nemotron-nano-12b-v2", 16, "layer 7 (gqa): tp=16 does not divide the 40 q_heads"),
        ("tiny-kimi-linear", 8, "layer 0 (kda): tp=8 does not divide the 4 heads"),
    ],
)
def test_invalid_tp_names_layer_and_counts(name, tp, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        get_preset(name).check_tp(tp)


@pytest.mark.parametrize(
    "fixture, preset",
    [
        ("qwen3_next_config.json", "qwen3-next-80b-a3b"),
        ("kimi_linear_config.json", "kimi-linear-48b-a3b"),
        ("nemotron_h_config.json", "nemotron-nano-12b-v2"),
    ],
)
def test_hf_config_matches_preset(fixture, preset):
    loaded = from_hf_config(FIXTURES / fixture)
    expected = get_preset(preset)
    assert loaded.layers == expected.layers
    assert loaded.hidden_size == expected.hidden_size


def test_hf_config_layer_types(tmp_path):
    data = json.loads((FIXTURES / "qwen3_next_config.json").read_text())
    del data["full_attention_interval"]
    data["num_hidden_layers"] = 4
    data["layer_types"] = [
        "linear_attention",
        "full_attention",
        "linear_attention",
        "full_attention",
    ]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    assert [layer.kind for layer in from_hf_config(path).layers] == [
        LayerKind.GDN,
        LayerKind.GQA,
        LayerKind.GDN,
        LayerKind.GQA,
    ]


@pytest.mark.parametrize(
    "fixture, edit, message",
    [
        (
            "qwen3_next_config.json",
            lambda d: d.pop("linear_num_value_heads"),
            "missing field 'linear_num_value_heads'",
        ),
        (
            "qwen3_next_config.json",
            lambda d: d.update(num_key_value_heads="2"),
            "field 'num_key_value_heads' must be a positive integer",
        ),
        (
            "qwen3_next_config.json",
            lambda d: d.update(layer_types=["full_attention"]),
            "field 'layer_types' has 1 entries",
        ),
        (
            "kimi_linear_config.json",
            lambda d: d["linear_attn_config"].update(full_attn_layers=[4, 28]),
            "field 'full_attn_layers' holds [28]",
        ),
        (
            "kimi_linear_config.json",
            lambda d: d["linear_attn_config"].pop("num_heads"),
            "linear_attn_config: missing field 'num_heads'",
        ),
        (
            "nemotron_h_config.json",
            lambda d: d.update(hybrid_override_pattern="M-X"),
            "unknown symbols ['X']",
        ),
        (
            "nemotron_h_config.json",
            lambda d: d.update(num_hidden_layers=61),
            "has 62 layers but num_hidden_layers is 61",
        ),
        (
            "nemotron_h_config.json",
            lambda d: d.pop("model_type") and d.pop("hybrid_override_pattern"),
            "field 'model_type'",
        ),
    ],
)
def test_hf_config_errors_name_the_field(tmp_path, fixture, edit, message):
    data = json.loads((FIXTURES / fixture).read_text())
    edit(data)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as info:
        from_hf_config(path)
    assert message in str(info.value)


def test_tiny_real_presets_are_their_config_documents():
    for name, config in TINY_HF_CONFIGS.items():
        assert get_preset(name) == from_hf_dict(config, name)
        assert get_preset(name).dtype == "float32"
        get_preset(name).check_tp(2)
    kv = get_preset("tiny-qwen3.5").attention_layers[0].cache_tensors()[0].segments[0]
    assert kv.num_units == 1 and kv.units_on_rank(2, 0) == kv.units_on_rank(2, 1) == range(1)


def test_dtype_spellings():
    assert [canonical_dtype(x) for x in ("bf16", "torch.float32", "half", "BFloat16")] == [
        "bfloat16",
        "float32",
        "float16",
        "bfloat16",
    ]
    with pytest.raises(InvalidInput, match="torch_dtype: dtype 'int8' unknown"):
        canonical_dtype("int8", "torch_dtype")


@pytest.mark.parametrize(
    "fixture, edit, dtypes",
    [
        ("qwen3_next_config.json", {}, ("bfloat16", None)),
        ("qwen3_next_config.json", {"torch_dtype": "float32"}, ("float32", None)),
        (
            "qwen3_next_config.json",
            {"dtype": "bfloat16", "torch_dtype": "float32"},
            ("bfloat16", None),
        ),
        ("qwen3_next_config.json", {"mamba_ssm_dtype": "float32"}, ("bfloat16", "float32")),
        ("nemotron_h_config.json", {"mamba_ssm_cache_dtype": "float32"}, ("bfloat16", "float32")),
        ("kimi_linear_config.json", {"torch_dtype": "float16"}, ("float16", None)),
    ],
)
def test_hf_config_dtypes(tmp_path, fixture, edit, dtypes):
    data = {**json.loads((FIXTURES / fixture).read_text()), **edit}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    geometry = from_hf_config(path)
    assert (geometry.dtype, geometry.ssm_dtype) == dtypes


def test_nested_text_config(tmp_path):
    text = json.loads((FIXTURES / "qwen3_next_config.json").read_text())
    data = {"model_type": "qwen3_5", "text_config": {**text, "model_type": "qwen3_5_text"},
            "torch_dtype": "float32"}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    geometry = from_hf_config(path)
    assert geometry.layers == get_preset("qwen3-next-80b-a3b").layers
    assert geometry.dtype == "float32"  # the outer torch_dtype when text_config has none


def test_load_geometry_from_a_directory(tmp_path):
    (tmp_path / "config.json").write_text((FIXTURES / "qwen3_next_config.json").read_text())
    assert load_geometry(str(tmp_path)).layers == get_preset("qwen3-next-80b-a3b").layers
    with pytest.raises(NotFound, match="model: .*does not exist"):
        load_geometry(str(tmp_path / "missing"))
    (tmp_path / "config.json").unlink()
    with pytest.raises(InvalidInput, match="has no config.json"):
        load_geometry(str(tmp_path))
    with pytest.raises(InvalidInput, match="exactly one of"):
        load_geometry("tiny-qwen3.5", str(tmp_path))
