"""--model and --ssm-dtype for the commands that run a model (serve, launch, up), and the
prefix-cache and transfer-mode flags of the commands that start local instances (launch,
bench serve, up)."""

from __future__ import annotations

import argparse
import os

from transfer.presets import PRESETS
from transfer.serving.engine.serve_options import serve_default
from transfer.serving.ranks.progress import TRANSFER_MODES

SSM_DTYPES = ("auto", "float32", "bfloat16")


def model_source(value: str) -> str:
    """A directory becomes absolute, since worker processes run in other directories."""
    return os.path.abspath(value) if os.path.isdir(value) else value


def add_served_model_arguments(parser: argparse.ArgumentParser) -> None:
    default_model = serve_default("model")
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
        default=serve_default("ssm_dtype"),
        help="dtype of the cached recurrent state (default %(default)s); auto: the config's "
        "mamba_ssm_dtype if it has one, else the model's dtype",
    )


def add_local_transfer_mode_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--transfer-mode",
        choices=TRANSFER_MODES,
        default=serve_default("transfer_mode"),
        help="both instances' (serve's flag; default %(default)s): whole reads a request once prefill "
        "finished it; layerwise streams each group of layers as prefill finishes it",
    )
    parser.add_argument(
        "--stream-layers",
        type=int,
        default=serve_default("stream_layers"),
        metavar="N",
        help="with --transfer-mode layerwise: layers per streaming group (default %(default)s)",
    )


def add_local_prefix_cache_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=serve_default("prefix_cache"),
        help="the instances' prefix caches (serve's flag; default %(default)s)",
    )
    parser.add_argument(
        "--checkpoint-interval",
        type=int,
        default=serve_default("checkpoint_interval"),
        metavar="TOKENS",
        help="with --prefix-cache: also checkpoint every TOKENS prompt tokens (serve's flag; "
        "default %(default)s; 0: prompt ends only)",
    )
