"""Seeded tensors of a tiny Nemotron-H checkpoint, in the hub's names (under "backbone.")."""

from __future__ import annotations

import math

import torch

from transfer.geometry import GQASpec, Mamba2Spec
from transfer.hf_geometry import from_hf_dict
from transfer.model.hf_config import field
from transfer.model.layers.sigmoid_router import routing_from_config
from transfer.model.nemotron_h import block_types
from transfer.model.weights import SeededTensors

NORM_STD = 0.1  # plain RMSNorm weights, drawn around one


def _mamba2(t: SeededTensors, prefix: str, spec: Mamba2Spec, hidden: int) -> None:
    heads, inner = spec.num_heads, spec.num_heads * spec.head_dim
    conv_dim = inner + 2 * spec.n_groups * spec.state_size
    width = spec.conv_kernel
    t.linear(prefix + "in_proj.weight", inner + conv_dim + heads, hidden)  # z | x B C | dt
    t.normal(prefix + "conv1d.weight", (conv_dim, 1, width), width**-0.5)
    t.normal(prefix + "conv1d.bias", (conv_dim,), 0.1)
    # dt = softplus(dt + dt_bias) around 0.1 and |A| in 1..4: a state that lasts tokens.
    t.normal(prefix + "dt_bias", (heads,), 0.5, mean=-2.0)
    t.uniform(prefix + "A_log", (heads,), 0.0, math.log(4.0))
    t.normal(prefix + "D", (heads,), 0.1, mean=1.0)
    t.normal(prefix + "norm.weight", (inner,), NORM_STD, mean=1.0)
    t.linear(prefix + "out_proj.weight", hidden, inner)


def _attention(t: SeededTensors, prefix: str, spec: GQASpec, hidden: int) -> None:
    q_rows, kv_rows = spec.num_q_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    t.linear(prefix + "q_proj.weight", q_rows, hidden)
    t.linear(prefix + "k_proj.weight", kv_rows, hidden)
    t.linear(prefix + "v_proj.weight", kv_rows, hidden)
    t.linear(prefix + "o_proj.weight", hidden, q_rows)


def _moe(t: SeededTensors, prefix: str, config: dict, hidden: int) -> None:
    experts = routing_from_config(config).num_experts
    inter = field(config, "moe_intermediate_size", kind=int)
    shared = field(config, "moe_shared_expert_intermediate_size", kind=int)
    t.linear(prefix + "gate.weight", experts, hidden, gain=2.0)
    t.normal(prefix + "gate.e_score_correction_bias", (experts,), 0.05)
    for e in range(experts):
        t.linear(f"{prefix}experts.{e}.up_proj.weight", inter, hidden)
        t.linear(f"{prefix}experts.{e}.down_proj.weight", hidden, inter)
    t.linear(prefix + "shared_experts.up_proj.weight", shared, hidden)
    t.linear(prefix + "shared_experts.down_proj.weight", hidden, shared)


def nemotron_tensors(config: dict, seed: int, lm_head_gain: float) -> dict[str, torch.Tensor]:
    """The seeded fp32 tensors of a Nemotron-H config (Mamba2, attention, MLP, MoE blocks)."""
    geometry = from_hf_dict(config, "tiny")
    hidden, vocab = geometry.hidden_size, geometry.vocab_size
    specs = {layer.index: layer.spec for layer in geometry.layers}
    t = SeededTensors(seed)
    t.normal("backbone.embeddings.weight", (vocab, hidden), 1.0)
    for i, block in enumerate(block_types(config)):
        p = f"backbone.layers.{i}."
        if block == "linear_attention":
            _mamba2(t, p + "mixer.", specs[i], hidden)
        elif block == "full_attention":
            _attention(t, p + "mixer.", specs[i], hidden)
        elif block == "moe":
            _moe(t, p + "mixer.", config, hidden)
        else:
            inter = field(config, "intermediate_size", kind=int)
            t.linear(p + "mixer.up_proj.weight", inter, hidden)
            t.linear(p + "mixer.down_proj.weight", hidden, inter)
        t.normal(p + "norm.weight", (hidden,), NORM_STD, mean=1.0)
    t.normal("backbone.norm_f.weight", (hidden,), NORM_STD, mean=1.0)
    t.linear("lm_head.weight", vocab, hidden, gain=lm_head_gain)
    return t.tensors()
