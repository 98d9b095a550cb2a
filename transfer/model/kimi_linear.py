"""Kimi-Linear (transformers' KimiLinearForCausalLM) for one TP rank, from a checkpoint.

Decoder layer i: input_layernorm -> KDA or MLA (the geometry's layer i) -> residual;
post_attention_layernorm -> dense SwiGLU or MoE (config `mlp_layer_types`, else the hub's
`first_k_dense_replace`) -> residual. Weights live under "model." (MLPs under either
"mlp." or the hub's "block_sparse_moe.", which save_pretrained also writes), plus "lm_head.".
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
from transfer.model.layers.kda_attention import KimiDeltaAttention
from transfer.model.layers.kimi_moe import KimiMoE, Routing
from transfer.model.layers.mla_attention import KimiMLA
from transfer.model.layers.mlp import SwiGLU
from transfer.model.layers.sigmoid_router import routing_from_config
from transfer.model.rank_weights import RankWeights

MLP_PREFIXES = ("mlp.", "block_sparse_moe.")


def mlp_layer_types(config: dict, num_layers: int) -> list[str]:
    """ "dense" or "sparse" for each decoder layer, as transformers decides."""
    types = config.get("mlp_layer_types")
    if types is None:
        first_dense = field(config, "first_k_dense_replace", default=1, kind=int)
        return ["dense" if i < first_dense else "sparse" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise InvalidInput(f"config: field 'mlp_layer_types' must list {num_layers} layer types")
    unknown = sorted(set(types) - {"dense", "sparse"})
    if unknown:
        raise InvalidInput(f"config: field 'mlp_layer_types' has unknown types {unknown}")
    return list(types)


def routing(config: dict) -> Routing:
    """The MoE routing fields, under transformers' or the hub's names."""
    return routing_from_config(config)


def _mlp_prefix(w: RankWeights, layer: str, probe: str) -> str:
    for prefix in MLP_PREFIXES:
        if w.has(layer + prefix + probe):
            return layer + prefix
    raise InvalidInput(f"model: no {probe!r} under {layer}{{{', '.join(MLP_PREFIXES)}}}")


def _check(geometry: ModelGeometry, config: dict, tp: TPGroup) -> int:
    num_layers = field(config, "num_hidden_layers", kind=int)
    if geometry.num_hidden_layers != num_layers or len(geometry.layers) != num_layers:
        raise InvalidInput(
            f"geometry: {geometry.name!r} has {len(geometry.layers)} of "
            f"{geometry.num_hidden_layers} layers, the checkpoint {num_layers}"
        )
    kinds = {layer.kind for layer in geometry.layers}
    if not kinds <= {LayerKind.KDA, LayerKind.MLA}:
        raise InvalidInput(f"geometry: Kimi-Linear has KDA and MLA layers, not {sorted(kinds)}")
    act = field(config, "hidden_act", default="silu", kind=str)
    if act != "silu":
        raise InvalidInput(f"config: field 'hidden_act' must be 'silu', got {act!r}")
    geometry.check_tp(tp.size)
    return num_layers


def build_kimi_linear(
    checkpoint: Checkpoint,
    geometry: ModelGeometry | None = None,
    tp: TPGroup | None = None,
    device: torch.device | str = "cpu",
) -> CausalLM:
    """Rank `tp.rank`'s fp32 shard of a Kimi-Linear checkpoint, reading only its slices.

    `geometry` defaults to the one `from_hf_config` gives for the checkpoint's config.
    """
    config, tp = checkpoint.config, tp or TPGroup.single()
    geometry = geometry or from_hf_dict(config, checkpoint.path.name)
    num_layers = _check(geometry, config, tp)
    hidden = geometry.hidden_size
    eps = float(field(config, "rms_norm_eps", default=1e-5, kind=(int, float)))
    w = RankWeights(checkpoint, tp.size, tp.rank, device)
    types = mlp_layer_types(config, num_layers)
    sublayers = []
    for spec in geometry.layers:
        p = f"model.layers.{spec.index}."
        if spec.kind is LayerKind.KDA:
            mixer = KimiDeltaAttention(spec.index, spec.spec, p + "self_attn.", w, hidden, eps)
        else:
            mixer = KimiMLA(spec.index, spec.spec, p + "self_attn.", w, hidden)
        if types[spec.index] == "dense":
            inter = field(config, "intermediate_size", kind=int)
            mlp = SwiGLU(w, _mlp_prefix(w, p, "gate_proj.weight"), hidden, inter)
        else:
            mlp = KimiMoE(
                w,
                _mlp_prefix(w, p, "gate.weight"),
                hidden,
                routing(config),
                field(config, "moe_intermediate_size", kind=int),
                field(config, "num_shared_experts", "n_shared_experts", default=1, kind=int),
            )
        input_norm = w.full(p + "input_layernorm.weight", (hidden,))
        post_norm = w.full(p + "post_attention_layernorm.weight", (hidden,))
        sublayers.append(Residual(input_norm, eps, mixer, tp, layer=spec.index))
        sublayers.append(Residual(post_norm, eps, mlp, tp, stateless=True))
    table = (geometry.vocab_size, hidden)
    embed = w.full("model.embed_tokens.weight", table)
    return CausalLM(
        geometry,
        tp,
        device,
        embed=embed,
        sublayers=sublayers,
        norm=w.full("model.norm.weight", (hidden,)),
        eps=eps,
        lm_head=w.full("lm_head.weight", table) if w.has("lm_head.weight") else embed,
    )
