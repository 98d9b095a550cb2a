"""Seeded tensors of a tiny Kimi-Linear checkpoint, in the names save_pretrained writes
(MLPs, dense or MoE, under "block_sparse_moe.")."""

from __future__ import annotations

import math

import torch

from transfer.geometry import KDASpec, LayerKind, MLASpec
from transfer.hf_geometry import from_hf_dict
from transfer.model.hf_config import field
from transfer.model.kimi_linear import mlp_layer_types, routing
from transfer.model.weights import SeededTensors

NORM_STD = 0.1  # plain RMSNorm weights, drawn around one


def _kda(t: SeededTensors, prefix: str, spec: KDASpec, hidden: int) -> None:
    heads, dim, width = spec.num_heads, spec.head_dim, spec.conv_kernel
    for x in ("q", "k", "v"):
        t.linear(f"{prefix}{x}_proj.weight", heads * dim, hidden)
        t.normal(f"{prefix}{x}_conv1d.weight", (heads * dim, 1, width), width**-0.5)
    # Per-channel decay -exp(A_log) * softplus(f + dt_bias): mostly 0.1 to 1 per token, so
    # the state carries several tokens back.
    t.linear(prefix + "f_a_proj.weight", dim, hidden)
    t.linear(prefix + "f_b_proj.weight", heads * dim, dim)
    t.normal(prefix + "dt_bias", (heads * dim,), 0.5, mean=-1.0)
    t.uniform(prefix + "A_log", (1, 1, heads, 1), 0.0, math.log(4.0))
    t.linear(prefix + "b_proj.weight", heads, hidden)
    t.linear(prefix + "g_a_proj.weight", dim, hidden)
    t.linear(prefix + "g_b_proj.weight", heads * dim, dim)
    t.normal(prefix + "o_norm.weight", (dim,), NORM_STD, mean=1.0)
    t.linear(prefix + "o_proj.weight", hidden, heads * dim)


def _mla(t: SeededTensors, prefix: str, spec: MLASpec, hidden: int) -> None:
    heads, latent, rope = spec.num_q_heads, spec.kv_lora_rank, spec.qk_rope_head_dim
    nope, v = spec.qk_nope_head_dim, spec.v_head_dim
    t.linear(prefix + "q_proj.weight", heads * (nope + rope), hidden)
    t.linear(prefix + "kv_a_proj_with_mqa.weight", latent + rope, hidden)
    t.normal(prefix + "kv_a_layernorm.weight", (latent,), NORM_STD, mean=1.0)
    t.linear(prefix + "kv_b_proj.weight", heads * (nope + v), latent)
    t.linear(prefix + "o_proj.weight", hidden, heads * v)


def _moe(t: SeededTensors, prefix: str, config: dict, hidden: int) -> None:
    experts = routing(config).num_experts
    inter = field(config, "moe_intermediate_size", kind=int)
    shared = field(config, "num_shared_experts", "n_shared_experts", default=1, kind=int)
    t.linear(prefix + "gate.weight", experts, hidden, gain=2.0)
    t.normal(prefix + "gate.e_score_correction_bias", (experts,), 0.05)
    for e in range(experts):
        t.linear(f"{prefix}experts.{e}.w1.weight", inter, hidden)
        t.linear(f"{prefix}experts.{e}.w3.weight", inter, hidden)
        t.linear(f"{prefix}experts.{e}.w2.weight", hidden, inter)
    if shared:
        t.swiglu(prefix + "shared_experts.", hidden, inter * shared)


def kimi_tensors(config: dict, seed: int, lm_head_gain: float) -> dict[str, torch.Tensor]:
    """The seeded fp32 tensors of a Kimi-Linear config, by the names save_pretrained writes."""
    geometry = from_hf_dict(config, "tiny")
    hidden, vocab = geometry.hidden_size, geometry.vocab_size
    mlps = mlp_layer_types(config, geometry.num_hidden_layers)
    t = SeededTensors(seed)
    t.normal("model.embed_tokens.weight", (vocab, hidden), 1.0)
    for layer in geometry.layers:
        p = f"model.layers.{layer.index}."
        if layer.kind is LayerKind.KDA:
            _kda(t, p + "self_attn.", layer.spec, hidden)
        else:
            _mla(t, p + "self_attn.", layer.spec, hidden)
        if mlps[layer.index] == "dense":
            t.swiglu(p + "block_sparse_moe.", hidden, field(config, "intermediate_size", kind=int))
        else:
            _moe(t, p + "block_sparse_moe.", config, hidden)
        t.normal(p + "input_layernorm.weight", (hidden,), NORM_STD, mean=1.0)
        t.normal(p + "post_attention_layernorm.weight", (hidden,), NORM_STD, mean=1.0)
    t.normal("model.norm.weight", (hidden,), NORM_STD, mean=1.0)
    t.linear("lm_head.weight", vocab, hidden, gain=lm_head_gain)
    return t.tensors()
