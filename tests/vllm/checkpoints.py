"""Tiny bf16 checkpoints that vLLM's CPU build serves, written with transformers.

vLLM's CPU attention needs head dims of 128 (32 fails "Unexpected head dim size") and its CPU
GDN runs in bf16 only, so these differ from pdxfer's own tiny presets in head dims and dtype.
The weights are pdxfer's seeded tiny weights (`transfer.model.tiny`: clear greedy choices, so
P/D and colocated runs pick the same tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from transfer.model.tiny import tiny_tensors
from transfer.model.tiny_tokenizer import write_tiny_tokenizer
from transfer.tiny_presets import TINY_HF_CONFIGS

_LINEAR, _FULL = "linear_attention", "full_attention"

# Qwen3-Next and Qwen3.5 share this shape: 3 GDN layers (2 k / 4 v heads of 128) then one GQA
# layer (4 q / 2 kv heads of 128); at TP 2 every head count still divides.
_GDN_GQA_128 = {
    "layer_types": [_LINEAR, _LINEAR, _LINEAR, _FULL],
    "num_hidden_layers": 4,
    "head_dim": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}

# Qwen3-Next: MoE on odd layers.
QWEN3_NEXT = {**TINY_HF_CONFIGS["tiny-qwen3-next"], **_GDN_GQA_128}

# Qwen3.5: dense MLP, flat GDN projections.
QWEN3_5 = {
    **TINY_HF_CONFIGS["tiny-qwen3.5"],
    **_GDN_GQA_128,
    "hidden_size": 256,
    "intermediate_size": 512,
}

# Nemotron-H: Mamba2 (4 heads of 64, one group), MLP, Mamba2, GQA (4 q / 2 kv heads of 128).
NEMOTRON_H = {
    **TINY_HF_CONFIGS["tiny-nemotron-h"],
    "layers_block_type": [_LINEAR, "mlp", _LINEAR, _FULL],
    "num_hidden_layers": 4,
    "head_dim": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_num_heads": 4,
    "mamba_head_dim": 64,
}

# Kimi-Linear: KDA heads of 128 and MLA with 128-wide nope / value heads; a dense MLP on layer
# 0, MoE after it, as the published checkpoints. vLLM's own KimiLinearConfig reads the hub's
# keys only (`linear_attn_config`'s 1-based layer lists, `first_k_dense_replace` /
# `moe_layer_freq`, `mla_use_nope`), not transformers 5's `layer_types` / `mlp_layer_types`,
# so the config carries both spellings.
KIMI_LINEAR = {
    **TINY_HF_CONFIGS["tiny-kimi-linear"],
    "layer_types": [_LINEAR, _LINEAR, _LINEAR, _FULL],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "mla_use_nope": True,
    "linear_attn_config": {
        "kda_layers": [1, 2, 3],
        "full_attn_layers": [4],
        "num_heads": 2,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
    "num_hidden_layers": 4,
    "linear_head_dim": 128,
    "linear_num_heads": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    # Latent 512 + rope 64: vLLM's CPU_MLA decode kernel is built for a 576-wide latent only.
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}

VLLM_TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-next": QWEN3_NEXT,
    "qwen3.5": QWEN3_5,
    "nemotron-h": NEMOTRON_H,
    "kimi-linear": KIMI_LINEAR,
}


def write_vllm_checkpoint(name: str, directory: Path, seed: int = 0) -> Path:
    """Write `VLLM_TINY_CONFIGS[name]` as a bf16 checkpoint with a tokenizer into `directory`
    (created); returns it. The config goes through transformers (`save_pretrained`, so it is
    one transformers accepts); the weights keep the names of the published checkpoints, which
    vLLM's loaders read (transformers 5 renames some of them only when it loads)."""
    import transformers

    doc = {**VLLM_TINY_CONFIGS[name], "dtype": "bfloat16"}
    doc.pop("transformers_version", None)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        _published_name(doc, key): t.to(torch.bfloat16)
        for key, t in tiny_tensors(doc, seed).items()
    }
    save_file(tensors, directory / "model.safetensors", {"format": "pt"})
    doc["eos_token_id"] = list(write_tiny_tokenizer(directory, doc["vocab_size"]))
    transformers.AutoConfig.for_model(**doc).save_pretrained(directory)
    return directory


def _published_name(config: dict[str, Any], key: str) -> str:
    """`key` as the published checkpoints spell it: Kimi-Linear's dense MLPs are under
    "mlp." there (transformers 5 writes every MLP under "block_sparse_moe.")."""
    if config.get("model_type") != "kimi_linear" or "block_sparse_moe." not in key:
        return key
    layer = int(key.split("layers.")[1].split(".")[0])
    if config["mlp_layer_types"][layer] == "dense":
        return key.replace("block_sparse_moe.", "mlp.")
    return key
