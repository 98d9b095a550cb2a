"""`pdxfer plan`: cache sizes, crossover and the memory plan of one rank (or, with
`--transfer`, the transfer plan of one request between a prefill and a decode instance)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from transfer.memplan import MemoryPlan, PagePolicy, StatePlacement, plan_memory
from transfer.presets import PRESETS, load_geometry
from transfer.sizing import CacheDtypes, ModelSizing, size_model
from transfer.units import format_bytes, parse_size


def add_model_arguments(
    parser: argparse.ArgumentParser, default_model: str = "qwen3-next-80b-a3b"
) -> None:
    """--model / --hf-config, shared by every command that needs a geometry."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--model",
        metavar="NAME|DIR",
        help=f"preset name (default {default_model}): {', '.join(PRESETS)}; "
        "or a local checkpoint directory (config.json + *.safetensors)",
    )
    group.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json instead")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="cache sizes, crossover and memory plan for a model",
        description=(
            "Per-rank cache sizes of a hybrid model (docs/reference.md), the crossover length, "
            "and how a rank's memory splits into state slots and KV blocks. With --transfer, "
            "the transfer plan of one request from a prefill to a decode instance."
        ),
    )
    add_model_arguments(parser)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument(
        "--gpu-mem", default="80GiB", help="memory of one rank, e.g. 80GiB (default 80GiB)"
    )
    parser.add_argument(
        "--mem-fraction",
        type=float,
        default=0.9,
        help="fraction of --gpu-mem given to the cache (default 0.9)",
    )
    parser.add_argument(
        "--max-seqs",
        "--max-num-seqs",
        dest="max_seqs",
        type=int,
        default=256,
        help="max live requests: state slots (serve's --max-num-seqs; default 256)",
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="minimum KV block size in tokens (default 16)"
    )
    parser.add_argument(
        "--spec-tokens", type=int, default=0, help="speculative tokens per request (default 0)"
    )
    parser.add_argument(
        "--page-policy",
        choices=[p.value for p in PagePolicy],
        default=PagePolicy.SEED.value,
        help="seed: block whose KV page is nearest the state page, pad the smaller; "
        "vllm: smallest block whose KV page covers the state page, pad the state (default seed)",
    )
    parser.add_argument(
        "--placement",
        choices=[p.value for p in StatePlacement],
        default=StatePlacement.PER_REQUEST.value,
        help="linear state per request (one span, default) or per layer",
    )
    parser.add_argument(
        "--ssm-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="dtype of the recurrent state S; auto (default): the config's mamba_ssm_dtype, "
        "else the model dtype. KV and conv always use the model dtype",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (a public interface)")
    parser.add_argument("--plot", metavar="FILE.png", help="plot cache bytes against length")
    transfer = parser.add_argument_group("transfer plan (--transfer)")
    transfer.add_argument(
        "--transfer", action="store_true", help="plan one request's transfer instead"
    )
    transfer.add_argument("--prefill-tp", type=int, default=1, help="prefill TP size (default 1)")
    transfer.add_argument("--decode-tp", type=int, default=1, help="decode TP size (default 1)")
    transfer.add_argument(
        "--tokens", type=int, default=4096, help="request length in tokens (default 4096)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.transfer:
        from transfer.cli.plan_transfer import run_transfer_plan

        return run_transfer_plan(args)
    geometry = load_geometry(
        args.model or (None if args.hf_config else "qwen3-next-80b-a3b"), args.hf_config
    )
    if not 0.0 < args.mem_fraction <= 1.0:
        raise ValueError(f"--mem-fraction must be in (0, 1], got {args.mem_fraction}")
    dtypes = CacheDtypes.for_model(geometry, args.ssm_dtype)
    sizing = size_model(geometry, args.tp, dtypes, args.spec_tokens)
    budget = int(parse_size(args.gpu_mem, "--gpu-mem") * args.mem_fraction)
    plan = plan_memory(
        geometry,
        args.tp,
        budget,
        args.max_seqs,
        block_size=args.block_size,
        spec_tokens=args.spec_tokens,
        page_policy=args.page_policy,
        placement=args.placement,
        dtypes=dtypes,
    )
    report = plan_report(
        geometry.name,
        len(geometry.linear_layers),
        len(geometry.attention_layers),
        sizing,
        plan,
        geometry.dtype,
        dtypes,
    )
    if args.plot:
        from transfer.plotting import plot_crossover

        plot_crossover(geometry.name, sizing, args.plot)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        print(format_report(report, plan))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 0


def plan_report(
    model: str,
    num_linear: int,
    num_attention: int,
    sizing: ModelSizing,
    plan: MemoryPlan,
    model_dtype: str = "bfloat16",
    dtypes: CacheDtypes | None = None,
) -> dict[str, Any]:
    """The `--json` document. Its keys are a public interface."""
    state = sizing.linear_layer_state
    dtypes = dtypes or CacheDtypes()
    return {
        "model": model,
        "dtype": model_dtype,
        "cache_dtype_bytes": {"kv": dtypes.kv, "ssm": dtypes.ssm, "conv": dtypes.conv},
        "tp": sizing.tp,
        "num_linear_layers": num_linear,
        "num_attention_layers": num_attention,
        "linear_layer_state_bytes": {"ssm": state.ssm, "conv": state.conv} if state else None,
        "attention_layer_kv_bytes_per_token": sizing.attention_layer_kv_per_token,
        "crossover_tokens": sizing.crossover_tokens,
        "spec_tokens": sizing.spec_tokens,
        "state_bytes_per_request": sizing.state_bytes_per_request,
        "kv_bytes_per_token": sizing.kv_bytes_per_token,
        "memory_plan": {
            "budget_bytes": plan.budget_bytes,
            "placement": plan.placement.value,
            "page_policy": plan.page_policy.value,
            "num_kv_blocks": plan.num_kv_blocks,
            "num_state_slots": plan.num_state_slots,
            "block_size": plan.block_size,
            "page_bytes": plan.page_bytes,
            "kv_page_bytes": plan.kv_page_bytes,
            "state_page_bytes": plan.state_page_bytes,
            "padding_bytes": plan.padding_bytes,
            "padding_pct": round(plan.padding_pct, 4),
            "used_bytes": plan.used_bytes,
            "max_tokens_in_kv": plan.num_kv_blocks * plan.block_size,
        },
    }


def format_report(report: dict[str, Any], plan: MemoryPlan) -> str:
    state = report["linear_layer_state_bytes"]
    rows = [
        ("model", report["model"]),
        ("tp", report["tp"]),
        (
            "dtype (cache bytes)",
            f"{report['dtype']} (kv {report['cache_dtype_bytes']['kv']}, "
            f"ssm {report['cache_dtype_bytes']['ssm']}, "
            f"conv {report['cache_dtype_bytes']['conv']})",
        ),
        (
            "layers",
            f"{report['num_linear_layers']} linear + {report['num_attention_layers']} attention",
        ),
    ]
    if state:
        rows += [
            ("linear layer S (ssm)", f"{state['ssm']:,} B"),
            ("linear layer conv", f"{state['conv']:,} B"),
        ]
    if report["attention_layer_kv_bytes_per_token"]:
        rows.append(
            ("attention layer KV", f"{report['attention_layer_kv_bytes_per_token']:,} B/token")
        )
    if report["crossover_tokens"]:
        rows.append(("crossover", f"{report['crossover_tokens']:,} tokens"))
    rows += [
        ("state per request", format_bytes(report["state_bytes_per_request"])),
        ("KV per token (model)", f"{report['kv_bytes_per_token']:,} B"),
        ("", ""),
        ("cache budget", format_bytes(plan.budget_bytes)),
        ("placement / policy", f"{plan.placement.value} / {plan.page_policy.value}"),
        ("block size", f"{plan.block_size} tokens"),
        (
            "page",
            f"{plan.page_bytes:,} B (KV {plan.kv_page_bytes:,}, state {plan.state_page_bytes:,})",
        ),
        ("state slots", f"{plan.num_state_slots:,}"),
        ("KV blocks", f"{plan.num_kv_blocks:,} ({plan.num_kv_blocks * plan.block_size:,} tokens)"),
        ("padding waste", f"{format_bytes(plan.padding_bytes)} ({plan.padding_pct:.2f}%)"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" if name else "" for name, value in rows)
