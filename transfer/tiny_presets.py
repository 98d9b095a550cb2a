"""The tiny presets: config.json documents of the real transformers classes, small enough to
run on a CPU (fp32, vocabulary 512), every one valid at TP 2.

`transfer.presets` reads their geometry like any checkpoint's; `transfer.model.tiny` writes
seeded weights for them (`pdxfer make-tiny`).
"""

from __future__ import annotations

from typing import Any

_LINEAR, _FULL = "linear_attention", "full_attention"


def _qwen_common(layer_types: list[str]) -> dict[str, Any]:
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "dtype": "float32",
        "eos_token_id": None,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 4096,
        "num_hidden_layers": len(layer_types),
        "pad_token_id": None,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000.0,
            "rope_type": "default",
        },
        "tie_word_embeddings": False,
        "transformers_version": "5.23.0",
        "use_cache": True,
    }


# Qwen3NextForCausalLM: GDN 4 k / 8 v heads of 32, GQA 8 q / 2 kv heads of 64, attention
# every 4th of 8 layers, hidden 256; MoE on odd layers (decoder_sparse_step 2), dense SwiGLU
# on even ones.
TINY_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    **_qwen_common([_LINEAR, _LINEAR, _LINEAR, _FULL] * 2),
    "decoder_sparse_step": 2,
    "head_dim": 64,
    "hidden_size": 256,
    "intermediate_size": 512,
    "linear_key_head_dim": 32,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_value_head_dim": 32,
    "mlp_only_layers": [],
    "moe_intermediate_size": 128,
    "norm_topk_prob": True,
    "num_attention_heads": 8,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "num_key_value_heads": 2,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "shared_expert_intermediate_size": 128,
    "vocab_size": 512,
}

# Qwen3_5ForCausalLM (flat GDN projections, dense MLP): one KV head, so at TP 2 both ranks
# hold it (replicated), and 2 k / 4 v GDN heads split at TP 2.
TINY_QWEN3_5 = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    **_qwen_common([_LINEAR, _LINEAR, _LINEAR, _FULL, _LINEAR, _FULL]),
    "head_dim": 32,
    "hidden_size": 128,
    "intermediate_size": 256,
    "linear_key_head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_value_head_dim": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "vocab_size": 512,
}

# KimiLinearForCausalLM: KDA 4 heads of 32, MLA 4 heads (latent 64, rope 16, nope 32, v 32)
# on the 4th and 8th of 8 layers, hidden 256. Dense SwiGLU on even layers, MoE on odd ones:
# 8 experts in 2 groups (one group chosen, then 2 experts), one shared expert.
TINY_KIMI_LINEAR = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "dtype": "float32",
    "eos_token_id": None,
    "hidden_act": "silu",
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "kv_lora_rank": 64,
    "layer_types": [_LINEAR, _LINEAR, _LINEAR, _FULL] * 2,
    "linear_conv_kernel_dim": 4,
    "linear_head_dim": 32,
    "linear_num_heads": 4,
    "mlp_layer_types": ["dense", "sparse"] * 4,
    "model_max_length": 4096,
    "moe_intermediate_size": 128,
    "moe_renormalize": True,
    "num_attention_heads": 4,
    "num_expert_group": 2,
    "num_experts": 8,
    "num_experts_per_token": 2,
    "num_hidden_layers": 8,
    "num_key_value_heads": 4,
    "num_shared_experts": 1,
    "pad_token_id": None,
    "q_lora_rank": None,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "rms_norm_eps": 1e-05,
    "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "transformers_version": "5.23.0",
    "use_cache": True,
    "v_head_dim": 32,
    "vocab_size": 512,
}

# NemotronHForCausalLM: Mamba2 8 heads of 32, state 32, ONE group (at TP 2 and 4 the B and C
# channels are replicated and the gated norm's group spans the ranks), GQA 8 q / 2 kv heads
# of 64 without RoPE, and two relu² MLP blocks, hidden 256.
TINY_NEMOTRON_H = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": None,
    "chunk_size": 64,
    "conv_kernel": 4,
    "dtype": "float32",
    "eos_token_id": None,
    "expand": 1,
    "head_dim": 64,
    "hidden_size": 256,
    "initializer_range": 0.02,
    "intermediate_size": 512,
    "layer_norm_epsilon": 1e-05,
    "layers_block_type": [
        _LINEAR,
        "mlp",
        _LINEAR,
        _LINEAR,
        _FULL,
        _LINEAR,
        "mlp",
        _LINEAR,
        _LINEAR,
        _FULL,
    ],  # fmt: skip
    "mamba_head_dim": 32,
    "mamba_hidden_act": "silu",
    "mamba_num_heads": 8,
    "mamba_proj_bias": False,
    "mamba_ssm_cache_dtype": "float32",
    "max_position_embeddings": 4096,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
    "n_groups": 1,
    "num_attention_heads": 8,
    "num_hidden_layers": 10,
    "num_key_value_heads": 2,
    "pad_token_id": None,
    "residual_in_fp32": False,
    "ssm_state_size": 32,
    "tie_word_embeddings": False,
    "time_step_min": 0.001,
    "transformers_version": "5.23.0",
    "use_bias": False,
    "use_cache": True,
    "use_conv_bias": True,
    "vocab_size": 512,
}

TINY_HF_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-qwen3-next": TINY_QWEN3_NEXT,
    "tiny-qwen3.5": TINY_QWEN3_5,
    "tiny-kimi-linear": TINY_KIMI_LINEAR,
    "tiny-nemotron-h": TINY_NEMOTRON_H,
}
