"""`pdxfer make-tiny`: write a tiny random checkpoint of a real architecture."""

from __future__ import annotations

import argparse

from transfer.presets import TINY_HF_CONFIGS


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "make-tiny",
        help="write a tiny random checkpoint (config.json + model.safetensors)",
        description=(
            "Write a tiny config of a real architecture with seeded random weights, in the "
            "layout transformers saves and loads. Nothing is downloaded."
        ),
    )
    parser.add_argument(
        "--model",
        default="tiny-qwen3-next",
        choices=list(TINY_HF_CONFIGS),
        help="which tiny preset (default tiny-qwen3-next)",
    )
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("directory", metavar="DIR", help="where to write (created if missing)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transfer.model.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(args.model, args.directory, args.seed)
    print(f"wrote {args.model} (seed {args.seed}) to {path}")
    return 0
