"""Tiny random checkpoints of the real architectures (`pdxfer make-tiny`): a transformers
config.json and a model.safetensors with seeded weights, in the hub's tensor names.

Scales are chosen for clear greedy choices (unit-gain projections, an LM head of gain 8), not
to resemble a trained model: random tiny models otherwise have near-tied logits, which fp32
reduction order between TP degrees would flip.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from transfer.errors import InvalidInput
from transfer.geometry import LayerKind
from transfer.model.qwen_config import QwenConfig, qwen_config
from transfer.model.tiny_tokenizer import write_tiny_tokenizer
from transfer.model.weights import WeightSource
from transfer.presets import TINY_HF_CONFIGS, from_hf_dict

LM_HEAD_GAIN = 8.0


class _Tensors:
    def __init__(self, seed: int) -> None:
        self.w = WeightSource(seed)
        self.out: dict[str, torch.Tensor] = {}

    def linear(self, name: str, rows: int, cols: int, gain: float = 1.0) -> None:
        self.out[name] = self.w.linear(name, rows, cols, gain)

    def normal(self, name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> None:
        self.out[name] = self.w.normal(name, shape, std, mean)


def _swiglu(t: _Tensors, prefix: str, hidden: int, inter: int) -> None:
    t.linear(prefix + "gate_proj.weight", inter, hidden)
    t.linear(prefix + "up_proj.weight", inter, hidden)
    t.linear(prefix + "down_proj.weight", hidden, inter)


def _gdn(t: _Tensors, prefix: str, spec, hidden: int, grouped: bool) -> None:
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
    t.out[prefix + "A_log"] = t.w.uniform(prefix + "A_log", (nv,), 0.0, math.log(16.0))
    t.normal(prefix + "dt_bias", (nv,), 0.5, mean=1.0)
    t.normal(prefix + "norm.weight", (dv,), 0.1, mean=1.0)
    t.linear(prefix + "out_proj.weight", hidden, nv * dv)


def _attention(t: _Tensors, prefix: str, spec, hidden: int) -> None:
    q_rows, kv_rows = spec.num_q_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    t.linear(prefix + "q_proj.weight", 2 * q_rows, hidden)
    t.linear(prefix + "k_proj.weight", kv_rows, hidden)
    t.linear(prefix + "v_proj.weight", kv_rows, hidden)
    t.linear(prefix + "o_proj.weight", hidden, q_rows)
    t.normal(prefix + "q_norm.weight", (spec.head_dim,), 0.1)
    t.normal(prefix + "k_norm.weight", (spec.head_dim,), 0.1)


def _moe(t: _Tensors, prefix: str, cfg: QwenConfig) -> None:
    moe, hidden = cfg.moe, cfg.hidden_size
    t.linear(prefix + "gate.weight", moe.num_experts, hidden, gain=2.0)
    for e in range(moe.num_experts):
        _swiglu(t, f"{prefix}experts.{e}.", hidden, moe.intermediate_size)
    _swiglu(t, prefix + "shared_expert.", hidden, moe.shared_intermediate_size)
    t.linear(prefix + "shared_expert_gate.weight", 1, hidden)


def tiny_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """The seeded fp32 tensors of a Qwen3-Next / Qwen3.5 config, by hub name."""
    cfg = qwen_config(config)
    geometry = from_hf_dict(config, "tiny")
    hidden, vocab = cfg.hidden_size, cfg.vocab_size
    t = _Tensors(seed)
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
            _swiglu(t, p + "mlp.", hidden, cfg.intermediate_size)
        t.normal(p + "input_layernorm.weight", (hidden,), 0.1)
        t.normal(p + "post_attention_layernorm.weight", (hidden,), 0.1)
    t.normal("model.norm.weight", (hidden,), 0.1)
    if not cfg.tie_word_embeddings:
        t.linear("lm_head.weight", vocab, hidden, gain=LM_HEAD_GAIN)
    return {name: tensor.contiguous() for name, tensor in t.out.items()}


def write_tiny_checkpoint(name: str, directory: str | Path, seed: int = 0) -> Path:
    """Write preset `name`'s config.json, seeded model.safetensors and a small tokenizer
    (tokenizer.json, tokenizer_config.json with a ChatML template) into `directory`."""
    if name not in TINY_HF_CONFIGS:
        raise InvalidInput(f"model: {name!r} is not a tiny real-architecture preset; choose from "
                           f"{', '.join(TINY_HF_CONFIGS)}")  # fmt: skip
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(TINY_HF_CONFIGS[name])
    save_file(tiny_tensors(config, seed), directory / "model.safetensors", {"format": "pt"})
    config["eos_token_id"] = list(write_tiny_tokenizer(directory, config["vocab_size"]))
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory
