"""A model's geometry from its Hugging Face `config.json`: Qwen3-Next and Qwen3.5 (dense and
MoE), Kimi-Linear and Nemotron-H, told apart by `model_type` or, failing that, by a field
only one family has. A field that is missing or of the wrong type is an InvalidInput that
names it and the file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transfer.errors import InvalidInput, NotFound
from transfer.geometry import (
    GDNSpec,
    GQASpec,
    KDASpec,
    KindSpec,
    LayerSpec,
    Mamba2Spec,
    MLASpec,
    ModelGeometry,
    canonical_dtype,
)


def build_geometry(
    name: str,
    specs: Sequence[KindSpec | None],
    hidden_size: int,
    vocab_size: int,
    dtype: str = "bfloat16",
    ssm_dtype: str | None = None,
) -> ModelGeometry:
    """`specs[i]` is decoder layer i's cache-bearing spec, or None for an MLP-only layer."""
    layers = tuple(LayerSpec(i, spec) for i, spec in enumerate(specs) if spec is not None)
    return ModelGeometry(
        name, layers, hidden_size, vocab_size, len(specs), dtype=dtype, ssm_dtype=ssm_dtype
    )


def layer_pattern(pattern: str, mamba: KindSpec, attention: KindSpec) -> list:
    """Nemotron-H's `hybrid_override_pattern`, a spec per layer: M Mamba2, * attention;
    - (MLP) and E (MoE) hold no cache."""
    by_char = {"M": mamba, "*": attention, "-": None, "E": None}
    return [by_char[c] for c in pattern]


_LINEAR, _FULL = "linear_attention", "full_attention"


class ConfigFields:
    """A config.json dict whose missing or ill-typed fields raise InvalidInput naming them."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        self.data = data
        self.source = source

    def get(self, key: str, default: Any = None, *, kind: type = int) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is None:
                raise InvalidInput(f"{self.source}: missing field {key!r}")
            return default
        value = self.data[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InvalidInput(
                f"{self.source}: field {key!r} must be a positive integer, got {value!r}"
            )
        if kind is not int and not isinstance(value, kind):
            raise InvalidInput(
                f"{self.source}: field {key!r} must be {kind.__name__}, got {value!r}"
            )
        return value

    def sub(self, key: str) -> ConfigFields:
        return ConfigFields(self.get(key, kind=dict), f"{self.source}: {key}")

    def first(self, *keys: str) -> tuple[str, Any] | None:
        """The first of `keys` present and not null, with its value."""
        return next(((k, self.data[k]) for k in keys if self.data.get(k) is not None), None)


def _model_dtypes(cfg: ConfigFields, outer: ConfigFields | None = None) -> dict[str, str | None]:
    """ModelGeometry's dtype and ssm_dtype: transformers writes `dtype`, older configs and
    the hub `torch_dtype`; a nested text_config may carry its own. Absent means bf16."""
    dtype, ssm = None, None
    for where in (cfg, outer):
        if where is None:
            continue
        found = where.first("dtype", "torch_dtype")
        if dtype is None and found:
            dtype = canonical_dtype(found[1], f"{where.source}: field {found[0]!r}")
        found = where.first("mamba_ssm_dtype", "mamba_ssm_cache_dtype")
        if ssm is None and found:
            ssm = canonical_dtype(found[1], f"{where.source}: field {found[0]!r}")
    return {"dtype": dtype or "bfloat16", "ssm_dtype": ssm}


QWEN_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")


def qwen_text_config(data: dict[str, Any], source: str) -> tuple[dict[str, Any], str]:
    """The language model's config of a Qwen3-Next / Qwen3.5 config.json (the multimodal
    Qwen3.5 nests it under text_config) and where it came from."""
    text = data.get("text_config")
    if text is None:
        return data, source
    if not isinstance(text, dict):
        raise InvalidInput(f"{source}: field 'text_config' must be dict, got {text!r}")
    return text, f"{source}: text_config"


def qwen_layer_types(cfg: ConfigFields) -> list[str]:
    """ "full_attention" / "linear_attention" per decoder layer: transformers' layer_types,
    else the hub's full_attention_interval (every n-th layer is attention; default 4)."""
    num_layers = cfg.get("num_hidden_layers")
    if "layer_types" not in cfg.data:
        interval = cfg.get("full_attention_interval", 4)
        return [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(num_layers)
        ]
    layer_types = cfg.get("layer_types", kind=list)
    if len(layer_types) != num_layers:
        raise InvalidInput(
            f"{cfg.source}: field 'layer_types' has {len(layer_types)} entries "
            f"but num_hidden_layers is {num_layers}"
        )
    unknown = sorted({str(t) for t in layer_types} - {"full_attention", "linear_attention"})
    if unknown:
        raise InvalidInput(f"{cfg.source}: field 'layer_types' has unknown types {unknown}")
    return layer_types


def _qwen_from(cfg: ConfigFields, name: str) -> ModelGeometry:
    text = ConfigFields(*qwen_text_config(cfg.data, cfg.source))
    gdn = GDNSpec(
        text.get("linear_num_key_heads"),
        text.get("linear_num_value_heads"),
        text.get("linear_key_head_dim"),
        text.get("linear_value_head_dim"),
        text.get("linear_conv_kernel_dim", 4),
    )
    if gdn.num_v_heads % gdn.num_k_heads:
        raise InvalidInput(
            f"{text.source}: field 'linear_num_value_heads' ({gdn.num_v_heads}) must be a "
            f"multiple of 'linear_num_key_heads' ({gdn.num_k_heads})"
        )
    num_heads, num_kv = text.get("num_attention_heads"), text.get("num_key_value_heads")
    if num_heads % num_kv:
        raise InvalidInput(
            f"{text.source}: field 'num_attention_heads' ({num_heads}) must be a multiple of "
            f"'num_key_value_heads' ({num_kv})"
        )
    gqa = GQASpec(num_heads, num_kv, text.get("head_dim", 256))  # transformers' default
    by_type = {"full_attention": gqa, "linear_attention": gdn}
    layers = [by_type[t] for t in qwen_layer_types(text)]
    default_vocab = 151936 if cfg.data.get("model_type") == "qwen3_next" else 248320
    return build_geometry(
        name,
        layers,
        text.get("hidden_size"),
        text.get("vocab_size", default_vocab),
        **_model_dtypes(text, cfg if text.data is not cfg.data else None),
    )


def _listed_types(cfg: ConfigFields, key: str, allowed: Sequence[str]) -> list[str]:
    """The per-layer type list `key` (transformers' spelling), checked against `allowed`."""
    types = cfg.get(key, kind=list)
    unknown = sorted({str(t) for t in types} - set(allowed))
    if unknown:
        raise InvalidInput(f"{cfg.source}: field {key!r} has unknown types {unknown}")
    return types


def _kimi_layer_types(cfg: ConfigFields, num_layers: int) -> list[str]:
    """transformers' layer_types, else the hub's 1-based linear_attn_config lists, else
    transformers' default (attention on 0-based layers 4, 8, ...)."""
    if "layer_types" in cfg.data:
        types = _listed_types(cfg, "layer_types", (_FULL, _LINEAR))
        if len(types) != num_layers:
            raise InvalidInput(
                f"{cfg.source}: field 'layer_types' has {len(types)} entries "
                f"but num_hidden_layers is {num_layers}"
            )
        return types
    if "linear_attn_config" not in cfg.data:
        return [_FULL if i and i % 4 == 0 else _LINEAR for i in range(num_layers)]
    linear = cfg.sub("linear_attn_config")
    full = linear.get("full_attn_layers", kind=list)
    kda_layers = linear.get(
        "kda_layers", [i for i in range(1, num_layers + 1) if i not in full], kind=list
    )
    for field, values in (("full_attn_layers", full), ("kda_layers", kda_layers)):
        bad = [v for v in values if not isinstance(v, int) or not 1 <= v <= num_layers]
        if bad:
            raise InvalidInput(
                f"{linear.source}: field {field!r} holds {bad}, outside 1..{num_layers} (1-based)"
            )
    if set(full) & set(kda_layers) or len(set(full) | set(kda_layers)) != num_layers:
        raise InvalidInput(
            f"{linear.source}: fields 'full_attn_layers' and 'kda_layers' must partition "
            f"layers 1..{num_layers}"
        )
    return [_FULL if i + 1 in set(full) else _LINEAR for i in range(num_layers)]


def _kimi_from(cfg: ConfigFields, name: str) -> ModelGeometry:
    num_layers = cfg.get("num_hidden_layers")
    # The hub nests the KDA dims in linear_attn_config; transformers writes them flat.
    hub = cfg.sub("linear_attn_config") if "linear_attn_config" in cfg.data else None
    kda = KDASpec(
        hub.get("num_heads") if hub else cfg.get("linear_num_heads", 32),
        hub.get("head_dim") if hub else cfg.get("linear_head_dim", 128),
        hub.get("short_conv_kernel_size") if hub else cfg.get("linear_conv_kernel_dim", 4),
    )
    mla = MLASpec(
        cfg.get("num_attention_heads"),
        cfg.get("kv_lora_rank"),
        cfg.get("qk_rope_head_dim"),
        cfg.get("qk_nope_head_dim", 128),
        cfg.get("v_head_dim", 128),
    )
    by_type = {_FULL: mla, _LINEAR: kda}
    layers = [by_type[t] for t in _kimi_layer_types(cfg, num_layers)]
    return build_geometry(
        name, layers, cfg.get("hidden_size"), cfg.get("vocab_size", 163840), **_model_dtypes(cfg)
    )


# transformers' layers_block_type names, as hybrid_override_pattern symbols.
_NEMOTRON_BLOCKS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def _spelled(cfg: ConfigFields, key: str, old: str) -> str:
    """`key`, or its older spelling `old` (which transformers still accepts) when only that
    is present."""
    return old if key not in cfg.data and old in cfg.data else key


def _nemotron_h_from(cfg: ConfigFields, name: str) -> ModelGeometry:
    if cfg.data.get("layers_block_type") is not None:  # as transformers (and nemotron_h)
        types = _listed_types(cfg, "layers_block_type", tuple(_NEMOTRON_BLOCKS))
        pattern, field = "".join(_NEMOTRON_BLOCKS[t] for t in types), "layers_block_type"
    else:
        pattern, field = cfg.get("hybrid_override_pattern", kind=str), "hybrid_override_pattern"
    bad = sorted(set(pattern) - set("M*-E"))
    if bad:
        raise InvalidInput(f"{cfg.source}: field {field!r} has unknown symbols {bad}")
    if "num_hidden_layers" in cfg.data and cfg.get("num_hidden_layers") != len(pattern):
        raise InvalidInput(
            f"{cfg.source}: field {field!r} has {len(pattern)} layers "
            f"but num_hidden_layers is {cfg.get('num_hidden_layers')}"
        )
    mamba = Mamba2Spec(
        cfg.get("mamba_num_heads"),
        cfg.get("mamba_head_dim"),
        cfg.get("ssm_state_size"),
        cfg.get(_spelled(cfg, "n_groups", "mamba_n_groups")),
        cfg.get(_spelled(cfg, "conv_kernel", "mamba_d_conv")),
    )
    num_heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim", cfg.get("hidden_size") // num_heads)
    gqa = GQASpec(num_heads, cfg.get("num_key_value_heads"), head_dim)
    layers = layer_pattern(pattern, mamba, gqa)
    return build_geometry(
        name, layers, cfg.get("hidden_size"), cfg.get("vocab_size", 131072), **_model_dtypes(cfg)
    )


_FAMILIES = {
    **dict.fromkeys(QWEN_MODEL_TYPES, _qwen_from),
    "kimi_linear": _kimi_from,
    "nemotron_h": _nemotron_h_from,
}
# The family of a config whose model_type is absent or unfamiliar, by its signature field.
_SIGNATURES = {
    "linear_num_value_heads": "qwen3_next",
    "text_config": "qwen3_5",
    "linear_attn_config": "kimi_linear",
    "hybrid_override_pattern": "nemotron_h",
}


def from_hf_dict(data: Any, name: str, source: str | None = None) -> ModelGeometry:
    """Geometry of a parsed config.json (Qwen3-Next, Qwen3.5 (+MoE), Kimi-Linear, Nemotron-H)."""
    source = source or name
    if not isinstance(data, dict):
        raise InvalidInput(f"{source}: expected a JSON object")
    model_type = data.get("model_type")
    if model_type not in _FAMILIES:
        model_type = next((fam for key, fam in _SIGNATURES.items() if key in data), None)
        if model_type is None:
            raise InvalidInput(
                f"{source}: field 'model_type' is {data.get('model_type')!r}; "
                f"supported: {', '.join(_FAMILIES)}"
            )
    return _FAMILIES[model_type](ConfigFields(data, source), name)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """A config.json as a dict; a missing file is NotFound, bad JSON InvalidInput."""
    path = Path(path)
    if not path.is_file():
        raise NotFound(f"hf_config: {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: expected a JSON object")
    return data


def from_hf_config(path: str | Path) -> ModelGeometry:
    """Geometry from a Hugging Face `config.json` (or a checkpoint directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise InvalidInput(f"model: {str(path.parent)!r} has no config.json")
    data = read_hf_config(path)
    name = data.get("_name_or_path") or path.parent.name or str(data.get("model_type"))
    return from_hf_dict(data, str(name), str(path))
