"""Model presets (docs/reference.md), and a `--model` or `--hf-config` value to its geometry.

The tiny presets (`TINY_HF_CONFIGS`, in `transfer.tiny_presets`) are config.json documents
of the transformers classes; their geometry is read from that document like any checkpoint's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from transfer.errors import InvalidInput, NotFound
from transfer.geometry import (
    GDNSpec,
    GQASpec,
    KDASpec,
    KindSpec,
    Mamba2Spec,
    MLASpec,
    ModelGeometry,
)
from transfer.hf_geometry import build_geometry, from_hf_config, from_hf_dict, layer_pattern
from transfer.tiny_presets import TINY_HF_CONFIGS


def _every_nth(num_layers: int, interval: int, attention: KindSpec, linear: KindSpec) -> list:
    return [attention if (i + 1) % interval == 0 else linear for i in range(num_layers)]


def _one_based(num_layers: int, attention_layers: Sequence[int], attention, linear) -> list:
    chosen = set(attention_layers)
    return [attention if i + 1 in chosen else linear for i in range(num_layers)]


NEMOTRON_NANO_12B_V2_PATTERN = "M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M*-M-M-M-M-"


def _qwen3_next_80b() -> ModelGeometry:
    gdn = GDNSpec(16, 32, 128, 128, 4)
    gqa = GQASpec(16, 2, 256)
    return build_geometry("qwen3-next-80b-a3b", _every_nth(48, 4, gqa, gdn), 2048, 151936)


def _kimi_linear_48b() -> ModelGeometry:
    kda = KDASpec(32, 128, 4)
    mla = MLASpec(32, 512, 64, 128, 128)
    layers = _one_based(27, (4, 8, 12, 16, 20, 24, 27), mla, kda)
    return build_geometry("kimi-linear-48b-a3b", layers, 2304, 163840)


def _nemotron_nano_12b() -> ModelGeometry:
    mamba = Mamba2Spec(128, 80, 128, 8, 4)
    gqa = GQASpec(40, 8, 128)
    layers = layer_pattern(NEMOTRON_NANO_12B_V2_PATTERN, mamba, gqa)
    return build_geometry("nemotron-nano-12b-v2", layers, 5120, 131072)


# nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B's published config.json (as copied in public repos and
# in NeMo Megatron-Bridge's Nemotron3NanoProvider): 52 blocks, 23 MoE (128 routed relu²
# experts of 1856, top 6, scaling 2.5, n_group 1, one shared expert of 3712), 23 Mamba2
# (64 heads of 64, state 128, 8 groups, conv 4) and 6 GQA (32 q / 2 kv heads of 128);
# hidden 2688, vocab 131072, mamba_ssm_cache_dtype float32. See docs/models.md.
NEMOTRON_3_NANO_30B_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"


def _nemotron_3_nano_30b() -> ModelGeometry:
    mamba = Mamba2Spec(64, 64, 128, 8, 4)
    gqa = GQASpec(32, 2, 128)
    layers = layer_pattern(NEMOTRON_3_NANO_30B_PATTERN, mamba, gqa)
    return build_geometry("nemotron-3-nano-30b-a3b", layers, 2688, 131072, ssm_dtype="float32")


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
