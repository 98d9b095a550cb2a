"""--model and --ssm-dtype for the commands that run a model (serve, launch, up)."""

from __future__ import annotations

import argparse
import os

from transfer.presets import PRESETS

SSM_DTYPES = ("auto", "float32", "bfloat16")


def model_source(value: str) -> str:
    """A directory becomes absolute, since worker processes run in other directories."""
    return os.path.abspath(value) if os.path.isdir(value) else value


def add_served_model_arguments(parser: argparse.ArgumentParser, default_model: str) -> None:
    parser.add_argument(
        "--model",
        metavar="NAME|DIR",
        type=model_source,
        default=default_model,
        help=f"a local checkpoint directory (config.json + *.safetensors, optionally "
        f"tokenizer.json; nothing is downloaded) or a tiny preset with seeded random weights "
        f"(default {default_model}; presets: {', '.join(n for n in PRESETS if n.startswith('tiny-'))})",
    )
    parser.add_argument(
        "--ssm-dtype",
        choices=SSM_DTYPES,
        default="auto",
        help="dtype of the cached recurrent state; auto (default): the config's "
        "mamba_ssm_dtype if it has one, else the model's dtype",
    )
