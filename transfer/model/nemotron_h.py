"""Nemotron-H (transformers' NemotronHForCausalLM) for one TP rank, from a checkpoint.

Block i is norm -> one mixer -> residual, the mixer being Mamba2 or attention (the
geometry's layer i), or the relu² MLP or the relu² MoE (layers the geometry leaves out). Weights live under
"backbone." on the hub and in what save_pretrained writes ("model." is accepted too).
"""

from __future__ import annotations

import torch

from transfer.errors import InvalidInput
from transfer.geometry import LayerKind, ModelGeometry
from transfer.hf_geometry import from_hf_dict
from transfer.model.causal_lm import CausalLM, Residual
from transfer.model.checkpoint import Checkpoint
from transfer.model.distributed import TPGroup
from transfer.model.hf_config import field
from transfer.model.layers.mamba2_mixer import Mamba2Mixer
from transfer.model.layers.nope_attention import NoPEAttention
from transfer.model.layers.relu2_mlp import Relu2MLP
from transfer.model.layers.relu2_moe import Relu2MoE
from transfer.model.layers.sigmoid_router import routing_from_config
from transfer.model.rank_weights import RankWeights

PREFIXES = ("backbone.", "model.")
PATTERN_TYPES = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


MIXER_KINDS = {"linear_attention": LayerKind.MAMBA2, "full_attention": LayerKind.GQA}


def block_types(config: dict) -> list[str]:
    """transformers' layers_block_type, else the hub's hybrid_override_pattern, spelled out."""
    if config.get("layers_block_type") is None:
        pattern = field(config, "hybrid_override_pattern", kind=str)
        unknown = sorted(set(pattern) - set(PATTERN_TYPES))
        if unknown:
            raise InvalidInput(f"config: field 'hybrid_override_pattern' has unknown {unknown}")
        return [PATTERN_TYPES[c] for c in pattern]
    types = field(config, "layers_block_type", kind=list)
    unknown = sorted({str(t) for t in types} - set(PATTERN_TYPES.values()))
    if unknown:
        raise InvalidInput(f"config: field 'layers_block_type' has unknown types {unknown}")
    return types


def _check(geometry: ModelGeometry, config: dict, types: list[str], tp: TPGroup) -> None:
    expected = {i: MIXER_KINDS[t] for i, t in enumerate(types) if t in MIXER_KINDS}
    actual = {layer.index: layer.kind for layer in geometry.layers}
    if geometry.num_hidden_layers != len(types) or actual != expected:
        raise InvalidInput(f"geometry: {geometry.name!r} does not match the checkpoint's layers")
    if "moe" in types and config.get("moe_latent_size") is not None:
        raise InvalidInput("config: field 'moe_latent_size' is set; latent MoE is not supported")
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if field(config, key, default=want, kind=str) != want:
            raise InvalidInput(f"config: field {key!r} must be {want!r}, got {config[key]!r}")
    for key in ("use_bias", "mlp_bias", "attention_bias"):
        if field(config, key, default=False, kind=bool):
            raise InvalidInput(f"config: field {key!r} is true; biases are not supported")
    geometry.check_tp(tp.size)


def _moe(config: dict, w: RankWeights, prefix: str, hidden: int) -> Relu2MoE:
    return Relu2MoE(
        w,
        prefix,
        hidden,
        routing_from_config(config),
        field(config, "moe_intermediate_size", kind=int),
        field(config, "moe_shared_expert_intermediate_size", kind=int),
    )


def build_nemotron_h(
    checkpoint: Checkpoint,
    geometry: ModelGeometry | None = None,
    tp: TPGroup | None = None,
    device: torch.device | str = "cpu",
) -> CausalLM:
    """Rank `tp.rank`'s fp32 shard of a Nemotron-H checkpoint, reading only its slices.

    `geometry` defaults to the one `from_hf_config` gives for the checkpoint's config.
    """
    config, tp = checkpoint.config, tp or TPGroup.single()
    geometry = geometry or from_hf_dict(config, checkpoint.path.name)
    types = block_types(config)
    _check(geometry, config, types, tp)
    root = next((p for p in PREFIXES if checkpoint.has(p + "embeddings.weight")), None)
    if root is None:
        raise InvalidInput(f"model: no embeddings under {' or '.join(PREFIXES)}")
    hidden = geometry.hidden_size
    eps = float(field(config, "layer_norm_epsilon", default=1e-5, kind=(int, float)))
    dt_min = float(field(config, "time_step_min", default=1e-3, kind=(int, float)))
    w = RankWeights(checkpoint, tp.size, tp.rank, device)
    specs = {layer.index: layer.spec for layer in geometry.layers}
    sublayers = []
    for i, block in enumerate(types):
        p = f"{root}layers.{i}."
        if block == "linear_attention":
            mixer = Mamba2Mixer(i, specs[i], p + "mixer.", w, tp, hidden, eps, dt_min)
        elif block == "full_attention":
            mixer = NoPEAttention(i, specs[i], p + "mixer.", w, hidden)
        elif block == "moe":
            mixer = _moe(config, w, p + "mixer.", hidden)
        else:
            inter = field(config, "intermediate_size", kind=int)
            mixer = Relu2MLP(w, p + "mixer.", hidden, inter)
        norm = w.full(p + "norm.weight", (hidden,))
        mlp = block in ("mlp", "moe")
        sublayers.append(Residual(norm, eps, mixer, tp, stateless=mlp, layer=None if mlp else i))
    table = (geometry.vocab_size, hidden)
    embed = w.full(root + "embeddings.weight", table)
    return CausalLM(
        geometry,
        tp,
        device,
        embed=embed,
        sublayers=sublayers,
        norm=w.full(root + "norm_f.weight", (hidden,)),
        eps=eps,
        lm_head=w.full("lm_head.weight", table) if w.has("lm_head.weight") else embed,
    )
