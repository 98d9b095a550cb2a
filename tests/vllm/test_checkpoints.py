"""The tiny checkpoints are ones vLLM's CPU build accepts: its config parser reads them and its
registry resolves their architecture (no server: the server tests start real ones)."""

import pytest
from safetensors import safe_open
from vllm.model_executor.models import ModelRegistry
from vllm.transformers_utils.config import get_config

from tests.vllm.checkpoints import VLLM_TINY_CONFIGS


@pytest.mark.parametrize("name", sorted(VLLM_TINY_CONFIGS))
def test_vllm_reads_the_tiny_checkpoint(vllm_checkpoint, name):
    directory = vllm_checkpoint(name)
    config = get_config(str(directory), trust_remote_code=False)
    written = VLLM_TINY_CONFIGS[name]
    # vLLM's CPU attention takes head dims of 128 only.
    for key in ("head_dim", "qk_nope_head_dim", "v_head_dim"):
        if key in written:
            assert getattr(config.get_text_config(), key) == written[key] == 128
    assert config.architectures[0] in ModelRegistry.get_supported_archs()
    assert (directory / "tokenizer.json").is_file()
    assert str(config.dtype).endswith("bfloat16")


def test_vllm_places_the_tiny_kimi_linear_layers_as_written(vllm_checkpoint):
    """vLLM's own KimiLinearConfig reads the hub's keys, not transformers 5's layer lists:
    without `linear_attn_config` every layer is MLA to it, and without
    `first_k_dense_replace` every layer is MoE (a dense layer's weights then have no
    parameter: "KeyError: 'layers.0.block_sparse_moe.down_proj.weight'")."""
    directory = vllm_checkpoint("kimi-linear")
    config = get_config(str(directory), trust_remote_code=False)
    written = VLLM_TINY_CONFIGS["kimi-linear"]
    kda = [config.is_kda_layer(i) for i in range(config.num_hidden_layers)]
    assert kda == [kind == "linear_attention" for kind in written["layer_types"]]
    # KimiDecoderLayer's rule for an MoE layer.
    moe = [
        i >= config.first_k_dense_replace and i % config.moe_layer_freq == 0
        for i in range(config.num_hidden_layers)
    ]
    assert moe == [kind == "sparse" for kind in written["mlp_layer_types"]]
    assert config.mla_use_nope
    with safe_open(str(directory / "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    for layer, is_moe in enumerate(moe):
        prefix = f"model.layers.{layer}."
        assert (prefix + "block_sparse_moe.gate.weight" in names) == is_moe
        assert (prefix + "mlp.down_proj.weight" in names) == (not is_moe)
