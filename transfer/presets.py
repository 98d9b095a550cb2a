"""Model presets (REFERENCE.md §1) and geometry from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transfer.geometry import (
    GDNSpec,
    GQASpec,
    KDASpec,
    KindSpec,
    LayerSpec,
    Mamba2Spec,
    MLASpec,
    ModelGeometry,
)


def _build(
    name: str, specs: Sequence[KindSpec | None], hidden_size: int, vocab_size: int
) -> ModelGeometry:
    """`specs[i]` is decoder layer i's cache-bearing spec, or None for an MLP-only layer."""
    layers = tuple(LayerSpec(i, spec) for i, spec in enumerate(specs) if spec is not None)
    return ModelGeometry(name, layers, hidden_size, vocab_size, num_hidden_layers=len(specs))


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


def _tiny_qwen3_next() -> ModelGeometry:
    gdn = GDNSpec(4, 8, 32, 32, 4)
    gqa = GQASpec(8, 2, 64)
    return _build("tiny-qwen3-next", _every_nth(8, 4, gqa, gdn), 256, 512)


def _tiny_kimi_linear() -> ModelGeometry:
    kda = KDASpec(4, 32, 4)
    mla = MLASpec(4, 64, 16, 32, 32)
    return _build("tiny-kimi-linear", _one_based(8, (4, 8), mla, kda), 256, 512)


def _tiny_nemotron_h() -> ModelGeometry:
    mamba = Mamba2Spec(8, 32, 32, 2, 4)
    gqa = GQASpec(8, 2, 64)
    return _build("tiny-nemotron-h", _pattern("MMM*MMM*", mamba, gqa), 256, 512)


PRESETS: dict[str, Callable[[], ModelGeometry]] = {
    "qwen3-next-80b-a3b": _qwen3_next_80b,
    "kimi-linear-48b-a3b": _kimi_linear_48b,
    "nemotron-nano-12b-v2": _nemotron_nano_12b,
    "tiny-qwen3-next": _tiny_qwen3_next,
    "tiny-kimi-linear": _tiny_kimi_linear,
    "tiny-nemotron-h": _tiny_nemotron_h,
}


def get_preset(name: str) -> ModelGeometry:
    """A preset by name; an unknown name raises ValueError listing the presets."""
    try:
        return PRESETS[name]()
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; presets: {', '.join(PRESETS)} (or pass --hf-config PATH)"
        ) from None


class _Config:
    """A config.json dict whose missing or ill-typed fields raise ValueError naming them."""

    def __init__(self, data: dict[str, Any], source: str) -> None:
        self.data = data
        self.source = source

    def get(self, key: str, default: Any = None, *, kind: type = int) -> Any:
        if key not in self.data or self.data[key] is None:
            if default is None:
                raise ValueError(f"{self.source}: missing field {key!r}")
            return default
        value = self.data[key]
        if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                f"{self.source}: field {key!r} must be a positive integer, got {value!r}"
            )
        if kind is not int and not isinstance(value, kind):
            raise ValueError(f"{self.source}: field {key!r} must be {kind.__name__}, got {value!r}")
        return value

    def sub(self, key: str) -> _Config:
        return _Config(self.get(key, kind=dict), f"{self.source}: {key}")


def _qwen3_next_from(cfg: _Config, name: str) -> ModelGeometry:
    num_layers = cfg.get("num_hidden_layers")
    gdn = GDNSpec(
        cfg.get("linear_num_key_heads"),
        cfg.get("linear_num_value_heads"),
        cfg.get("linear_key_head_dim"),
        cfg.get("linear_value_head_dim"),
        cfg.get("linear_conv_kernel_dim"),
    )
    num_heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim", cfg.get("hidden_size") // num_heads)
    gqa = GQASpec(num_heads, cfg.get("num_key_value_heads"), head_dim)
    if "layer_types" in cfg.data:
        layer_types = cfg.get("layer_types", kind=list)
        if len(layer_types) != num_layers:
            raise ValueError(
                f"{cfg.source}: field 'layer_types' has {len(layer_types)} entries "
                f"but num_hidden_layers is {num_layers}"
            )
        by_type = {"full_attention": gqa, "linear_attention": gdn}
        unknown = sorted(set(layer_types) - set(by_type))
        if unknown:
            raise ValueError(f"{cfg.source}: field 'layer_types' has unknown types {unknown}")
        layers = [by_type[t] for t in layer_types]
    else:
        layers = _every_nth(num_layers, cfg.get("full_attention_interval"), gqa, gdn)
    return _build(name, layers, cfg.get("hidden_size"), cfg.get("vocab_size", 151936))


def _kimi_from(cfg: _Config, name: str) -> ModelGeometry:
    num_layers = cfg.get("num_hidden_layers")
    linear = cfg.sub("linear_attn_config")
    full = linear.get("full_attn_layers", kind=list)
    kda_layers = linear.get(
        "kda_layers", [i for i in range(1, num_layers + 1) if i not in full], kind=list
    )
    for field, values in (("full_attn_layers", full), ("kda_layers", kda_layers)):
        bad = [v for v in values if not isinstance(v, int) or not 1 <= v <= num_layers]
        if bad:
            raise ValueError(
                f"{linear.source}: field {field!r} holds {bad}, outside 1..{num_layers} (1-based)"
            )
    if set(full) & set(kda_layers) or len(set(full) | set(kda_layers)) != num_layers:
        raise ValueError(
            f"{linear.source}: fields 'full_attn_layers' and 'kda_layers' must partition "
            f"layers 1..{num_layers}"
        )
    kda = KDASpec(
        linear.get("num_heads"), linear.get("head_dim"), linear.get("short_conv_kernel_size")
    )
    mla = MLASpec(
        cfg.get("num_attention_heads"),
        cfg.get("kv_lora_rank"),
        cfg.get("qk_rope_head_dim"),
        cfg.get("qk_nope_head_dim", 128),
        cfg.get("v_head_dim", 128),
    )
    layers = _one_based(num_layers, full, mla, kda)
    return _build(name, layers, cfg.get("hidden_size"), cfg.get("vocab_size", 163840))


def _nemotron_h_from(cfg: _Config, name: str) -> ModelGeometry:
    pattern = cfg.get("hybrid_override_pattern", kind=str)
    bad = sorted(set(pattern) - set("M*-E"))
    if bad:
        raise ValueError(f"{cfg.source}: field 'hybrid_override_pattern' has unknown symbols {bad}")
    if "num_hidden_layers" in cfg.data and cfg.get("num_hidden_layers") != len(pattern):
        raise ValueError(
            f"{cfg.source}: field 'hybrid_override_pattern' has {len(pattern)} layers "
            f"but num_hidden_layers is {cfg.get('num_hidden_layers')}"
        )
    mamba = Mamba2Spec(
        cfg.get("mamba_num_heads"),
        cfg.get("mamba_head_dim"),
        cfg.get("ssm_state_size"),
        cfg.get("n_groups"),
        cfg.get("conv_kernel"),
    )
    num_heads = cfg.get("num_attention_heads")
    head_dim = cfg.get("head_dim", cfg.get("hidden_size") // num_heads)
    gqa = GQASpec(num_heads, cfg.get("num_key_value_heads"), head_dim)
    layers = _pattern(pattern, mamba, gqa)
    return _build(name, layers, cfg.get("hidden_size"), cfg.get("vocab_size", 131072))


_FAMILIES = {
    "qwen3_next": _qwen3_next_from,
    "kimi_linear": _kimi_from,
    "nemotron_h": _nemotron_h_from,
}


def from_hf_config(path: str | Path) -> ModelGeometry:
    """Geometry from a Hugging Face `config.json` of Qwen3-Next, Kimi-Linear or Nemotron-H."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    cfg = _Config(data, str(path))
    model_type = data.get("model_type")
    if model_type not in _FAMILIES:
        # Infer the family from its signature field when model_type is absent or unfamiliar.
        signatures = {
            "linear_num_value_heads": "qwen3_next",
            "linear_attn_config": "kimi_linear",
            "hybrid_override_pattern": "nemotron_h",
        }
        model_type = next((fam for key, fam in signatures.items() if key in data), None)
        if model_type is None:
            raise ValueError(
                f"{path}: field 'model_type' is {data.get('model_type')!r}; "
                f"supported: {', '.join(_FAMILIES)}"
            )
    name = data.get("_name_or_path") or path.parent.name or model_type
    return _FAMILIES[model_type](cfg, str(name))


def load_geometry(model: str | None = None, hf_config: str | None = None) -> ModelGeometry:
    """Exactly one of a preset name or a config path."""
    if (model is None) == (hf_config is None):
        raise ValueError("give exactly one of --model NAME or --hf-config PATH")
    return get_preset(model) if model else from_hf_config(hf_config)
