"""The connector's start-up guard on vLLM's CPU attention kernel, with vLLM's own layers and
metadata builder (no server): the `vec` kernel this machine gets passes; the `amx` kernel
vLLM picks on a CPU with AMX tiles, and `vec16` (head size 80), are refused, naming the
kernel and the layer."""

from __future__ import annotations

import pytest
import torch
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)

from transfer.errors import InvalidInput
from transfer.vllm.attn_isa import (
    AttentionKernel,
    attention_layer_names,
    check_attention_layers,
    check_kernels,
)

BLOCK = 384
ATTENTION = "model.layers.3.self_attn.attn"
LINEAR = "model.layers.0.linear_attn"


@pytest.fixture(scope="module")
def model_config(tmp_path_factory):
    from tests.vllm.checkpoints import write_vllm_checkpoint

    model = write_vllm_checkpoint("qwen3-next", tmp_path_factory.mktemp("ckpt") / "qwen3-next")
    return ModelConfig(model=str(model), dtype="bfloat16")


def _served(model_config, head_size: int = 128) -> tuple[VllmConfig, KVCacheConfig]:
    """One attention layer as vLLM builds it (layer, then its group's metadata builder, which
    sets the layer's ISA), next to a mamba group; and the KV cache config naming both."""
    config = VllmConfig(model_config=model_config)
    attention = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=2, head_size=head_size, dtype=torch.bfloat16
    )
    mamba = MambaSpec(
        block_size=BLOCK,
        shapes=((3, 1024), (4, 128, 128)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
    )
    with set_current_vllm_config(config):
        Attention(num_heads=4, head_size=head_size, scale=1.0, num_kv_heads=2, prefix=ATTENTION)
        CPUAttentionMetadataBuilder(attention, [ATTENTION], config, torch.device("cpu"))
    kv_cache_config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=[LINEAR], kv_cache_spec=mamba),
            KVCacheGroupSpec(layer_names=[ATTENTION], kv_cache_spec=attention),
        ],
    )
    return config, kv_cache_config


def test_attention_layers_are_those_of_attention_groups(model_config):
    _, kv_cache_config = _served(model_config)
    assert attention_layer_names(kv_cache_config) == [ATTENTION]


def test_vec_kernel_passes(model_config):
    config, kv_cache_config = _served(model_config)
    layer = config.compilation_config.static_forward_context[ATTENTION]
    if torch.cpu._is_amx_tile_supported():
        pytest.skip("this CPU has AMX tiles: vLLM picks amx")
    assert layer.isa == "vec"
    check_attention_layers(config, kv_cache_config)


def test_amx_kernel_is_refused(model_config, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    config, kv_cache_config = _served(model_config)
    assert config.compilation_config.static_forward_context[ATTENTION].isa == "amx"
    with pytest.raises(InvalidInput, match=rf"CPU_ATTN isa='amx' on {ATTENTION}"):
        check_attention_layers(config, kv_cache_config)


def test_vec16_kernel_is_refused(model_config):
    config, kv_cache_config = _served(model_config, head_size=80)
    with pytest.raises(InvalidInput, match=r"isa='vec16'"):
        check_attention_layers(config, kv_cache_config)


def test_unknown_backends_are_refused_with_their_layers():
    check_kernels({"a": AttentionKernel("CPU_ATTN", "vec"), "m": AttentionKernel("CPU_MLA")})
    kernels = {
        "x.1": AttentionKernel("AMX_MLA"),
        "x.0": AttentionKernel("AMX_MLA"),
        "y": AttentionKernel("CPU_ATTN", "neon"),
        "z": AttentionKernel("CPU_ATTN", "vec"),
    }
    with pytest.raises(InvalidInput) as error:
        check_kernels(kernels)
    message = str(error.value)
    assert "AMX_MLA on x.0, x.1" in message and "CPU_ATTN isa='neon' on y" in message
    assert " on z" not in message
