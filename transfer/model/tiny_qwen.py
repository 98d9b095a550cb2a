"""Seeded tensors of a tiny Qwen3-Next / Qwen3.5 checkpoint, in the hub's names."""

from __future__ import annotations

import math

import torch

from transfer.geometry import LayerKind
from transfer.hf_geometry import from_hf_dict
from transfer.model.qwen_config import QwenConfig, qwen_config
from transfer.model.weights import SeededTensors

# RMSNorm weights of this family are offsets from one: drawn around zero.
NORM_STD = 0.1


def _gdn(t: SeededTensors, prefix: str, spec, hidden: int, grouped: bool) -> None:
    nk, nv, dk, dv = spec.num_k_heads, spec.num_v_heads, spec.head_k_dim, spec.head_v_dim
    if grouped:
        t.linear(prefix + "in_proj_qkvz.weight", nk * (2 * dk + 2 * (nv // nk) * dv), hidden)
        t.linear(prefix + "in_proj_ba.weight", 2 * nv, hidden)
    else:
        t.linear(prefix + "in_proj_qkv.weight", 2 * nk * dk + nv * dv, hidden)
        t.linear(prefix + "in_proj_z.weight", nv * dv, hidden)
        t.linear(prefix + "in_proj_b.weight", nv, hidden)
        t.linear(prefix + "in_proj_a.weight", nv, hidden)
    width = spec.conv_kernel
    t.normal(prefix + "conv1d.weight", (2 * nk * dk + nv * dv, 1, width), width**-0.5)
    t.uniform(prefix + "A_log", (nv,), 0.0, math.log(16.0))
    t.normal(prefix + "dt_bias", (nv,), 0.5, mean=1.0)
    t.normal(prefix + "norm.weight", (dv,), 0.1, mean=1.0)
    t.linear(prefix + "out_proj.weight", hidden, nv * dv)


def _attention(t: SeededTensors, prefix: str, spec, hidden: int) -> None:
    q_rows, kv_rows = spec.num_q_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    t.linear(prefix + "q_proj.weight", 2 * q_rows, hidden)
    t.linear(prefix + "k_proj.weight", kv_rows, hidden)
    t.linear(prefix + "v_proj.weight", kv_rows, hidden)
    t.linear(prefix + "o_proj.weight", hidden, q_rows)
    t.normal(prefix + "q_norm.weight", (spec.head_dim,), NORM_STD)
    t.normal(prefix + "k_norm.weight", (spec.head_dim,), NORM_STD)


def _moe(t: SeededTensors, prefix: str, cfg: QwenConfig) -> None:
    moe, hidden = cfg.moe, cfg.hidden_size
    t.linear(prefix + "gate.weight", moe.num_experts, hidden, gain=2.0)
    for e in range(moe.num_experts):
        t.swiglu(f"{prefix}experts.{e}.", hidden, moe.intermediate_size)
    t.swiglu(prefix + "shared_expert.", hidden, moe.shared_intermediate_size)
    t.linear(prefix + "shared_expert_gate.weight", 1, hidden)


def qwen_tensors(config: dict, seed: int, lm_head_gain: float) -> dict[str, torch.Tensor]:
    """The seeded fp32 tensors of a Qwen3-Next / Qwen3.5 config, by hub name."""
    cfg = qwen_config(config)
    geometry = from_hf_dict(config, "tiny")
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    t = SeededTensors(seed)
    t.normal("model.embed_tokens.weight", (vocab, hidden), 1.0)
    specs = {layer.index: layer.spec for layer in geometry.layers}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        spec = specs[i]
        if spec.kind is LayerKind.GDN:
            _gdn(t, p + "linear_attn.", spec, hidden, cfg.grouped_gdn)
        else:
            _attention(t, p + "self_attn.", spec, hidden)
        if i in cfg.sparse_layers:
            _moe(t, p + "mlp.", cfg)
        else:
            t.swiglu(p + "mlp.", hidden, cfg.intermediate_size)
        t.normal(p + "input_layernorm.weight", (hidden,), NORM_STD)
        t.normal(p + "post_attention_layernorm.weight", (hidden,), NORM_STD)
    t.normal("model.norm.weight", (hidden,), NORM_STD)
    if not cfg.tie_word_embeddings:
        t.linear("lm_head.weight", vocab, hidden, gain=lm_head_gain)
    return t.tensors()
