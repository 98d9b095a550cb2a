"""Tiny random checkpoints of the real architectures (`pdxfer make-tiny`): a transformers
config.json and a model.safetensors with seeded weights, in the names transformers loads.

Scales are chosen for clear greedy choices (unit-gain projections, an LM head of gain 8), not
to resemble a trained model: random tiny models otherwise have near-tied logits, which fp32
reduction order between TP degrees would flip.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from transfer.errors import InvalidInput
from transfer.hf_geometry import QWEN_MODEL_TYPES
from transfer.model.tiny_kimi import kimi_tensors
from transfer.model.tiny_nemotron import nemotron_tensors
from transfer.model.tiny_qwen import qwen_tensors
from transfer.model.tiny_tokenizer import write_tiny_tokenizer
from transfer.presets import TINY_HF_CONFIGS

LM_HEAD_GAIN = 8.0
TENSORS = {
    **dict.fromkeys(QWEN_MODEL_TYPES, qwen_tensors),
    "kimi_linear": kimi_tensors,
    "nemotron_h": nemotron_tensors,
}


def tiny_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """The seeded fp32 tensors of a tiny config, by the names its checkpoint holds."""
    model_type = config.get("model_type")
    if model_type not in TENSORS:
        raise InvalidInput(f"config: field 'model_type' is {model_type!r}; tiny weights exist "
                           f"for {', '.join(TENSORS)}")  # fmt: skip
    return TENSORS[model_type](config, seed, LM_HEAD_GAIN)


def write_tiny_checkpoint(name: str, directory: str | Path, seed: int = 0) -> Path:
    """Write preset `name`'s config.json, seeded model.safetensors and a small tokenizer
    (tokenizer.json, tokenizer_config.json with a ChatML template) into `directory`."""
    if name not in TINY_HF_CONFIGS:
        raise InvalidInput(f"model: {name!r} is not a tiny preset; choose from "
                           f"{', '.join(TINY_HF_CONFIGS)}")  # fmt: skip
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = dict(TINY_HF_CONFIGS[name])
    save_file(tiny_tensors(config, seed), directory / "model.safetensors", {"format": "pt"})
    config["eos_token_id"] = list(write_tiny_tokenizer(directory, config["vocab_size"]))
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory
