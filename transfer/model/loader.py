"""Build one TP rank's model from a checkpoint directory or a preset name.

- a checkpoint directory: its config.json says the architecture; each rank reads its slices.
- a tiny preset (`TINY_HF_CONFIGS`): its seeded checkpoint is written once into the cache
  directory ($PDXFER_CACHE, else ~/.cache/pdxfer) and loaded through the same path.
- a real-size preset has no weights: pass its checkpoint directory. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from transfer.errors import InvalidInput
from transfer.geometry import ModelGeometry
from transfer.hf_geometry import QWEN_MODEL_TYPES
from transfer.model.batch import Batch
from transfer.model.checkpoint import Checkpoint
from transfer.model.distributed import TPGroup
from transfer.model.layers.common import AfterLayer, Step
from transfer.presets import PRESETS, TINY_HF_CONFIGS, get_preset, looks_like_path

TINY_FORMAT = 1  # bump when tiny weights change, so stale cached checkpoints are not reused


class RankModel(Protocol):
    """What `RankEngine` runs: one TP rank's shard of a causal LM."""

    geometry: ModelGeometry
    tp: TPGroup
    device: torch.device
    seed: int | None

    def forward(self, token_ids: torch.Tensor, step: Step, all_logits: bool = False): ...

    def forward_batch(
        self, batch: Batch, all_logits: bool = False, after_layer: AfterLayer | None = None
    ) -> torch.Tensor: ...


def _qwen(checkpoint: Checkpoint, tp: TPGroup, device, geometry, seed) -> RankModel:
    from transfer.model.qwen3_next import QwenHybridLM

    return QwenHybridLM(checkpoint, tp, device, geometry=geometry, seed=seed)


def _kimi_linear(checkpoint: Checkpoint, tp: TPGroup, device, geometry, seed) -> RankModel:
    from transfer.model.kimi_linear import build_kimi_linear

    model = build_kimi_linear(checkpoint, geometry, tp, device)
    model.seed = seed
    return model


def _nemotron_h(checkpoint: Checkpoint, tp: TPGroup, device, geometry, seed) -> RankModel:
    from transfer.model.nemotron_h import build_nemotron_h

    model = build_nemotron_h(checkpoint, geometry, tp, device)
    model.seed = seed
    return model


# model_type -> builder(checkpoint, tp, device, geometry or None, seed or None); `seed` only
# records which tiny weights a model holds.
ARCHITECTURES: dict[str, Callable[..., RankModel]] = {
    **dict.fromkeys(QWEN_MODEL_TYPES, _qwen),
    "kimi_linear": _kimi_linear,
    "nemotron_h": _nemotron_h,
}
# Multimodal Qwen3.5 checkpoints keep the language model under this prefix; vision and MTP
# weights are never read.
RENAME = {"model.language_model.": "model."}


def cache_root() -> Path:
    return Path(os.environ.get("PDXFER_CACHE") or Path.home() / ".cache" / "pdxfer")


def tiny_checkpoint(name: str, seed: int = 0) -> Path:
    """The directory of preset `name`'s seeded checkpoint, written on first use.

    Several rank processes may race here: each writes a private temporary directory and
    renames it into place; a loser of the race discards its copy and uses the winner's.
    """
    from transfer.model.tiny import write_tiny_checkpoint

    if name not in TINY_HF_CONFIGS:
        raise InvalidInput(f"model: {name!r} is not a tiny preset ({', '.join(TINY_HF_CONFIGS)})")
    text = json.dumps([TINY_FORMAT, TINY_HF_CONFIGS[name]], sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:10]
    final = cache_root() / "tiny" / f"{name}-seed{seed}-{digest}"
    if (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        write_tiny_checkpoint(name, scratch, seed)
        os.rename(scratch, final)
    except OSError:
        if not (final / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


def load_checkpoint_model(
    path: str | Path,
    tp: TPGroup | None = None,
    device: torch.device | str = "cpu",
    *,
    geometry: ModelGeometry | None = None,
    seed: int | None = None,
) -> RankModel:
    """The model of a checkpoint directory (errors name the field `model`)."""
    with Checkpoint(path, rename=RENAME) as checkpoint:
        model_type = checkpoint.config.get("model_type")
        build = ARCHITECTURES.get(model_type)
        if build is None:
            raise InvalidInput(
                f"model: {str(path)!r} has model_type {model_type!r}; model code exists for "
                f"{', '.join(ARCHITECTURES)}"
            )
        return build(checkpoint, tp or TPGroup.single(), torch.device(device), geometry, seed)


def load_model(
    source: str | Path,
    tp: TPGroup | None = None,
    device: torch.device | str = "cpu",
    *,
    seed: int = 0,
) -> RankModel:
    """Rank `tp.rank`'s model for `source`: a checkpoint directory or a preset name.

    `seed` picks the random weights of tiny presets and is ignored for checkpoints.
    """
    tp = tp or TPGroup.single()
    text = str(source)
    if text in TINY_HF_CONFIGS:
        path = tiny_checkpoint(text, seed)
        return load_checkpoint_model(path, tp, device, geometry=get_preset(text), seed=seed)
    if text in PRESETS:
        raise InvalidInput(
            f"model: preset {text!r} has no weights; pass its checkpoint directory "
            f"(config.json + *.safetensors), or a tiny preset ({', '.join(TINY_HF_CONFIGS)})"
        )
    if not looks_like_path(text):
        get_preset(text)  # raises, listing the presets
    return load_checkpoint_model(text, tp, device)


def model_for_geometry(
    geometry: ModelGeometry, tp: TPGroup, seed: int = 0, device: torch.device | str = "cpu"
) -> RankModel:
    """The model of a preset geometry: only a tiny preset's (exactly that preset) has weights."""
    if geometry.name in TINY_HF_CONFIGS and geometry == get_preset(geometry.name):
        return load_model(geometry.name, tp, device, seed=seed)
    if geometry.name in PRESETS and geometry.name not in TINY_HF_CONFIGS:
        load_model(geometry.name, tp, device, seed=seed)  # raises: a real-size preset
    raise InvalidInput(
        f"model: no weights for geometry {geometry.name!r} (not a tiny preset's geometry); "
        "pass a checkpoint directory"
    )
