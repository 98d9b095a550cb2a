"""What the Qwen3-Next / Qwen3.5 model code needs from a config.json, checked once.

Reads transformers 5.23's forms (rope_parameters, layer_types, text_config nesting) and the
hub's (top-level rope_theta / partial_rotary_factor, full_attention_interval).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transfer.errors import InvalidInput
from transfer.hf_geometry import QWEN_MODEL_TYPES, qwen_layer_types, qwen_text_config
from transfer.hf_geometry import ConfigFields as Fields

GROUPED_GDN_TYPES = ("qwen3_next",)  # in_proj_qkvz / in_proj_ba, grouped per key head
ALL_MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")  # every layer sparse, top-k renormalised


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    norm_topk_prob: bool


@dataclass(frozen=True)
class QwenConfig:
    """The language model of a Qwen3-Next, Qwen3.5 or Qwen3.5-MoE checkpoint."""

    model_type: str
    grouped_gdn: bool
    hidden_size: int
    vocab_size: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope_theta: float
    partial_rotary_factor: float
    intermediate_size: int | None  # dense MLP layers; None when every layer is MoE
    moe: MoEConfig | None
    sparse_layers: frozenset[int]
    tie_word_embeddings: bool

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)


def _number(fields: Fields, key: str, default: float | None = None) -> float:
    value = fields.data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise InvalidInput(
            f"{fields.source}: field {key!r} must be a positive number, got {value!r}"
        )
    return float(value)


def _flag(fields: Fields, key: str, default: bool) -> bool:
    value = fields.data.get(key, default)
    if not isinstance(value, bool):
        raise InvalidInput(f"{fields.source}: field {key!r} must be true or false, got {value!r}")
    return value


def _rope(text: Fields) -> tuple[float, float]:
    """(theta, partial_rotary_factor) from rope_parameters, or the hub's top-level fields."""
    params = text.data.get("rope_parameters") or text.data.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise InvalidInput(f"{text.source}: field 'rope_parameters' must be an object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise InvalidInput(
            f"{text.source}: field 'rope_parameters.rope_type' is {rope_type!r}; "
            "only 'default' RoPE is supported"
        )
    merged = Fields({**text.data, **params}, text.source)
    return _number(merged, "rope_theta", 10000.0), _number(merged, "partial_rotary_factor", 0.25)


def _moe(model_type: str, text: Fields, num_layers: int) -> tuple[MoEConfig | None, frozenset]:
    if model_type in ALL_MOE_TYPES:
        sparse = frozenset(range(num_layers))
        norm_topk = True
    elif model_type == "qwen3_next" and text.data.get("num_experts", 0):
        step = text.get("decoder_sparse_step", 1)
        only_mlp = text.data.get("mlp_only_layers") or []
        if not isinstance(only_mlp, list):
            raise InvalidInput(f"{text.source}: field 'mlp_only_layers' must be a list")
        sparse = frozenset(
            i for i in range(num_layers) if i not in only_mlp and (i + 1) % step == 0
        )
        norm_topk = _flag(text, "norm_topk_prob", True)
    else:
        return None, frozenset()
    if not sparse:
        return None, sparse
    moe = MoEConfig(
        text.get("num_experts"),
        text.get("num_experts_per_tok"),
        text.get("moe_intermediate_size"),
        text.get("shared_expert_intermediate_size"),
        norm_topk,
    )
    if moe.top_k > moe.num_experts:
        raise InvalidInput(
            f"{text.source}: field 'num_experts_per_tok' ({moe.top_k}) exceeds "
            f"num_experts ({moe.num_experts})"
        )
    return moe, sparse


def qwen_config(data: dict[str, Any], source: str = "config.json") -> QwenConfig:
    """Parse a Qwen3-Next / Qwen3.5 (+MoE) config.json dict; InvalidInput names bad fields."""
    model_type = data.get("model_type")
    if model_type not in QWEN_MODEL_TYPES:
        raise InvalidInput(
            f"{source}: field 'model_type' is {model_type!r}; the Qwen model code reads "
            f"{', '.join(QWEN_MODEL_TYPES)}"
        )
    text = Fields(*qwen_text_config(data, source))
    if text.data.get("hidden_act", "silu") != "silu":
        raise InvalidInput(f"{text.source}: field 'hidden_act' must be 'silu'")
    layer_types = tuple(qwen_layer_types(text))
    theta, partial = _rope(text)
    moe, sparse = _moe(model_type, text, len(layer_types))
    dense_needed = len(sparse) < len(layer_types)
    tie = data.get("tie_word_embeddings", text.data.get("tie_word_embeddings", False))
    default_vocab = 151936 if model_type == "qwen3_next" else 248320
    return QwenConfig(
        model_type=model_type,
        grouped_gdn=model_type in GROUPED_GDN_TYPES,
        hidden_size=text.get("hidden_size"),
        vocab_size=text.get("vocab_size", default_vocab),
        layer_types=layer_types,
        rms_norm_eps=_number(text, "rms_norm_eps", 1e-6),
        num_attention_heads=text.get("num_attention_heads"),
        num_key_value_heads=text.get("num_key_value_heads"),
        head_dim=text.get("head_dim", 256),
        attention_bias=_flag(text, "attention_bias", False),
        rope_theta=theta,
        partial_rotary_factor=partial,
        intermediate_size=text.get("intermediate_size") if dense_needed else None,
        moe=moe,
        sparse_layers=sparse,
        tie_word_embeddings=bool(tie),
    )
