"""`pdxfer bench step`: wall time of one rank's prefill and decode steps, in-process."""

from __future__ import annotations

import argparse
import json
import sys

from transfer.cli.int_args import positive_ints, require_positive
from transfer.cli.model_args import model_source


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "step",
        help="wall time of one rank's prefill and decode steps, without serving around them",
        description="Load the model as one TP rank does (one thread on a CPU), then, for each "
        "batch size B: time prefill steps of B fresh random prompts of --prompt-len tokens, "
        "then decode steps of those B sequences. Reports the p50 and the fastest step of "
        "each. What a serving rank's step costs on this host; `bench serve` adds the "
        "instances, transfers and clients around it.",
    )
    parser.add_argument(
        "--model",
        type=model_source,
        default="tiny-qwen3-next",
        metavar="NAME|DIR",
        help="a checkpoint directory or a tiny preset (default tiny-qwen3-next)",
    )
    parser.add_argument(
        "--batch",
        default="1,8,32",
        help="comma-separated sequences per step (default 1,8,32)",
    )
    parser.add_argument(
        "--prompt-len", type=int, default=64, help="tokens of each prompt (default 64)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=20,
        help="measured steps of each kind per batch size, after 2 unmeasured (default 20)",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompts' and tiny weights' seed")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transfer.bench.model_steps import format_timings, time_model_steps

    batches = positive_ints(args.batch, "--batch", "1,8,32")
    require_positive(args, ("prompt_len", "steps"))
    timings = time_model_steps(
        args.model, batches, args.prompt_len, args.steps, seed=args.seed,
        progress=lambda line: print(f"bench step: {line}", file=sys.stderr, flush=True),
    )  # fmt: skip
    if args.json:
        report = {
            "model": args.model,
            "prompt_len": args.prompt_len,
            "results": [t.to_dict() for t in timings],
        }
        print(json.dumps(report, indent=2))
    else:
        print(format_timings(timings))
    return 0
