"""Geometry and cache dtypes from the config.json files transformers 5.23 writes for Qwen3.5
(the multimodal class nests text_config) and from the hub's own forms."""

from __future__ import annotations

import json

import pytest

from transfer.cli import main
from transfer.errors import InvalidInput
from transfer.geometry import LayerKind
from transfer.hf_geometry import from_hf_config
from transfer.presets import load_geometry
from transfer.sizing import CacheDtypes, size_model

TEXT = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)  # fmt: skip


NESTED = ("Qwen3_5Config", "Qwen3_5MoeConfig")  # the multimodal classes


def saved_config(tmp_path, cls_name: str, dtype: str, **extra):
    import transformers

    cls = getattr(transformers, cls_name)
    if cls_name in NESTED:
        config = cls(text_config={**TEXT, "dtype": dtype, **extra}, dtype=dtype)
    else:
        config = cls(**TEXT, dtype=dtype, **extra)
    config.save_pretrained(tmp_path)
    return tmp_path / "config.json"


@pytest.mark.parametrize(
    "cls_name", ["Qwen3_5Config", "Qwen3_5MoeConfig", "Qwen3_5TextConfig", "Qwen3NextConfig"]
)
def test_transformers_saved_configs(tmp_path, cls_name):
    path = saved_config(tmp_path, cls_name, "float32")
    data = json.loads(path.read_text())
    assert ("text_config" in data) == (cls_name in NESTED)
    geometry = from_hf_config(path)
    assert [layer.kind for layer in geometry.layers] == [LayerKind.GDN] * 3 + [LayerKind.GQA]
    gdn = geometry.layers[0].spec
    assert (gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim) == (2, 4, 16)
    assert (geometry.hidden_size, geometry.vocab_size, geometry.dtype) == (64, 320, "float32")
    sizing = size_model(geometry, 1, CacheDtypes.for_model(geometry))
    assert sizing.linear_layer_state.ssm == 4 * 16 * 16 * 4  # fp32: 4 bytes, not bf16's 2
    assert sizing.attention_layer_kv_per_token == 2 * 2 * 16 * 4


def test_directory_as_model_and_ssm_dtype(tmp_path, capsys):
    saved_config(tmp_path, "Qwen3_5Config", "bfloat16", mamba_ssm_dtype="float32")
    geometry = load_geometry(str(tmp_path))
    assert (geometry.dtype, geometry.ssm_dtype) == ("bfloat16", "float32")
    reports = {}
    for choice in ("auto", "bfloat16", "float32"):
        args = ["plan", "--model", str(tmp_path), "--ssm-dtype", choice, "--json"]
        assert main(args) == 0
        reports[choice] = json.loads(capsys.readouterr().out)
    ssm = {k: r["linear_layer_state_bytes"]["ssm"] for k, r in reports.items()}
    assert ssm == {"auto": 4096, "bfloat16": 2048, "float32": 4096}
    assert reports["auto"]["cache_dtype_bytes"] == {"kv": 2, "ssm": 4, "conv": 2}


def test_hub_forms(tmp_path):
    """The hub's Qwen3-Next config: torch_dtype, full_attention_interval, top-level rope."""
    hub = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
           "torch_dtype": "bfloat16", "full_attention_interval": 2, "rope_theta": 1e7,
           "partial_rotary_factor": 0.25, "rope_scaling": None, **TEXT}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hub))
    geometry = from_hf_config(path)
    assert [layer.kind for layer in geometry.layers] == [LayerKind.GDN, LayerKind.GQA] * 2
    assert (geometry.dtype, geometry.ssm_dtype) == ("bfloat16", None)
    assert CacheDtypes.for_model(geometry) == CacheDtypes(2, 2, 2)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"dtype": "int4"}, "dtype 'int4' unknown"),
        ({"text_config": 3}, "field 'text_config' must be dict"),
        ({"layer_types": ["linear_attention"] * 4}, "has 4 entries"),
        ({"linear_num_value_heads": 3}, "must be a multiple of 'linear_num_key_heads'"),
    ],
)
def test_bad_fields_are_named(tmp_path, change, message):
    data = {"model_type": "qwen3_5_text", **TEXT, "num_hidden_layers": 5, **change}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidInput, match=message):
        from_hf_config(path)
