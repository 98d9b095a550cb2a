"""What the connector does with Kimi-Linear's KDA layers (no server: vLLM does not start the
model on CPU, docs/vllm.md "Models"): vLLM 0.32 keeps a KDA layer's q, k and v short-conv
states as one fused conv state next to the recurrent state (its own `kda_state_shape`),
pdxfer's geometry has three conv tensors and the state, so `describe` refuses the layer,
naming it, instead of reading it wrongly."""

from __future__ import annotations

import pytest
import torch
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import MambaSpec, MLAAttentionSpec

from tests.vllm.checkpoints import KIMI_LINEAR
from transfer.errors import InvalidInput
from transfer.hf_geometry import from_hf_dict
from transfer.vllm.layout_places import STATE_ORDER_SD
from transfer.vllm.layout_vllm import describe

BLOCK, NUM_BLOCKS = 64, 3


def test_kda_layer_is_refused_naming_it():
    geometry = from_hf_dict(KIMI_LINEAR, "tiny-kimi-linear-128")
    shapes = MambaStateShapeCalculator.kda_state_shape(
        1, KIMI_LINEAR["linear_num_heads"], KIMI_LINEAR["linear_head_dim"]
    )
    kda = MambaSpec(
        block_size=BLOCK,
        shapes=shapes,
        dtypes=(torch.bfloat16, torch.float32),
        mamba_type=MambaAttentionBackendEnum.LINEAR,
    )
    page = kda.page_size_bytes
    mla = MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=192, dtype=torch.bfloat16)
    memory = torch.zeros(4 * NUM_BLOCKS * max(page, mla.page_size_bytes), dtype=torch.int8)
    layers = {}
    for index, kind in enumerate(KIMI_LINEAR["layer_types"]):
        if kind == "linear_attention":
            view = memory[index * NUM_BLOCKS * page :][: NUM_BLOCKS * page]
            layers[index] = (kda, view.view(NUM_BLOCKS, 1, 1, page))
        else:
            view = memory[index * NUM_BLOCKS * page :].view(torch.bfloat16)
            layers[index] = (mla, view[: NUM_BLOCKS * BLOCK * 192].view(NUM_BLOCKS, 1, BLOCK, 192))
    assert len(shapes) == 2  # one fused conv state and the recurrent state
    with pytest.raises(InvalidInput, match=r"layer 0 \(kda\).*expected a conv and an SSM state"):
        describe(geometry, 1, layers, STATE_ORDER_SD, "vllm-test")
