"""What the router's HTTP front end needs of a model: its name, tokenizer, end tokens and
context length, read from a checkpoint directory (or a preset, which has no tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

from transfer.errors import InvalidInput
from transfer.presets import TINY_HF_CONFIGS, load_geometry, looks_like_path
from transfer.serving.openai.handler import ServedModel
from transfer.serving.openai.text import TextCodec

DEFAULT_CONTEXT = 4096  # a preset that names no context length


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _ids(value) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _context(config: dict) -> int | None:
    for source in (config, config.get("text_config") or {}):
        value = source.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_served_model(
    model: str,
    *,
    name: str | None = None,
    max_model_len: int | None = None,
    default_max_tokens: int = 16,
) -> ServedModel:
    """`model` is a preset name or a checkpoint directory. The context is the config's
    max_position_embeddings, capped by `max_model_len` (what the decode instances hold);
    the end tokens are generation_config.json's and config.json's eos_token_id and the
    tokenizer's eos token."""
    if max_model_len is not None and max_model_len < 2:
        raise InvalidInput(f"max_model_len: must be >= 2, got {max_model_len}")
    geometry = load_geometry(model)  # checks that the model exists
    codec, eos = None, []
    if looks_like_path(model):
        path = Path(model)
        config = _json(path / "config.json")
        codec = TextCodec.from_dir(path)
        eos = _ids(_json(path / "generation_config.json").get("eos_token_id"))
        eos += _ids(config.get("eos_token_id"))
        if codec is not None and codec.eos_token:
            token = codec.tokenizer.token_to_id(codec.eos_token)
            eos += [] if token is None else [token]
        default_name = path.resolve().name
    else:
        config = TINY_HF_CONFIGS.get(model, {})
        default_name = model
    limits = [n for n in (_context(config), max_model_len) if n is not None]
    eos = [t for t in dict.fromkeys(eos) if 0 <= t < geometry.vocab_size]
    return ServedModel(
        name=name or default_name,
        max_model_len=min(limits) if limits else DEFAULT_CONTEXT,
        eos_token_ids=tuple(eos),
        codec=codec,
        default_max_tokens=default_max_tokens,
    )
