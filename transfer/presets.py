"""Model presets (docs/reference.md) and geometry from a Hugging Face `config.json`.

The tiny presets (`TINY_HF_CONFIGS`, in `transfer.tiny_presets`) are config.json documents
of the transformers classes; their geometry is read from that document like any checkpoint's.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
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
from transfer.tiny_presets import TINY_HF_CONFIGS


def _build(
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


def _every_nth(num_layers: int, interval: int, attention: KindSpec, linear: KindSpec) -> list:
    return [attention if (i + 1) % interval == 0 else linear for i in range(num_layers)]


def _one_based(num_layers: int, attention_layers: Sequence[int], attention, linear) -> list:
    chosen = set(attention_layers)
    return [attention if i + 1 in chosen else linear for i in range(num_layers)]


def _pattern(pattern: str, mamba: KindSpec, attention: KindSpec) -> list:
    by_char = {"M": mamba, "*": attention, "-": None, "E": None}
    return [by_char[c] for c in pattern]


NEMOTRON_NANO_12B_V2_PATTERN = "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-"


def _qwen3_next_80b() -> ModelGeometry:
    gdn = GDNSpec(16, 32, 128, 128, 4)
    gqa = GQASpec(16, 2, 256)
    return _build("qwen3-next-80b-a3b", _every_nth(48, 4, gqa, gdn), 2048, 151936)


def _kimi_linear_48b() -> ModelGeometry:
    kda = KDASpec(32, 128, 4)
    mla = MLASpec(32, 512, 64, 128, 128)
    layers = _one_based(27, (4, 8, 12, 16, 20, 24, 27), mla, kda)
    return _build("kimi-linear-48b-a3b", layers, 2304, 163840)


def _nemotron_nano_12b() -> ModelGeometry:
    mamba = Mamba2Spec(128, 80, 128, 8, 4)
    gqa = GQASpec(40, 8, 128)
    layers = _pattern(NEMOTRON_NANO_12B_V2_PATTERN, mamba, gqa)
    return _build("nemotron-nano-12b-v2", layers, 5120, 131072)


# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B's published config.json (as copied in public repos and
# in NeMo Megatron-Bridge's Nemotron3NanoProvider): 52 blocks, 23 MoE (128 routed relu²
# experts of 1856, top 6, scaling 2.5, n_group 1, one shared expert of 3712), 23 Mamba2
# (64 heads of 64, state 128, 8 groups, conv 4) and 6 GQA (32 q / 2 kv heads of 128);
# hidden 2688, vocab 131072, mamba_ssm_cache_dtype float32. See docs/models.md.
NEMOTRON_3_NANO_30B_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def _nemotron_3_nano_30b() -> ModelGeometry:
    mamba = Mamba2Spec(64, 64, 128, 8, 4)
    gqa = GQASpec(32, 2, 128)
    layers = _pattern(NEMOTRON_3_NANO_30B_PATTERN, mamba, gqa)
    return _build("nemotron-3-nano-30b-a3b", layers, 2688, 131072, ssm_dtype="float32")


_LINEAR, _FULL = "linear_attention", "full_attention"


PRESETS: dict[str, Callable[[], ModelGeometry]] = {
    "qwen3-next-80b-a3b": _qwen3_next_80b,
    "kimi-linear-48b-a3b": _kimi_linear_48b,
    "nemotron-nano-12b-v2": _nemotron_nano_12b,
    "nemotron-3-nano-30b-a3b": _nemotron_3_nano_30b,
}


def _tiny(name: str) -> Callable[[], ModelGeometry]:
    return lambda: from_hf_dict(TINY_HF_CONFIGS[name], name)


PRESETS.update({name: _tiny(name) for name in TINY_HF_CONFIGS})


def get_preset(name: str) -> ModelGeometry:
    """A preset by name; an unknown name raises InvalidInput listing the presets."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise InvalidInput(
            f"unknown model {name!r}; presets: {', '.join(PRESETS)} "
            "(or pass a checkpoint directory, or --hf-config PATH)"
        ) from None


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
    return _build(
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
    return _build(
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
    layers = _pattern(pattern, mamba, gqa)
    return _build(
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


def looks_like_path(model: str) -> bool:
    """A --model value that names a directory rather than a preset."""
    return "/" in model or model.startswith(".") or Path(model).is_dir()


def load_geometry(model: str | None = None, hf_config: str | None = None) -> ModelGeometry:
    """Exactly one of a preset name (or a checkpoint directory) or a config.json path."""
    if (model is None) == (hf_config is None):
        raise InvalidInput("give exactly one of --model NAME|DIR or --hf-config PATH")
    if hf_config is not None:
        return from_hf_config(hf_config)
    if model in PRESETS or not looks_like_path(model):
        return get_preset(model)
    if not Path(model).exists():
        raise NotFound(f"model: {model!r} does not exist (nothing is downloaded)")
    if not Path(model).is_dir():
        raise InvalidInput(f"model: {model!r} is not a checkpoint directory")
    return from_hf_config(model)
