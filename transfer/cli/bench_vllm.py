"""`pdxfer bench vllm`: the same requests through vLLM P/D with NixlConnector and with
PdxferConnector, in one run, at each TP pair."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from transfer.cli.vllm_args import (
    add_vllm_server_arguments,
    kv_cache_bytes,
    vllm_model_dir,
    vllm_python,
)
from transfer.errors import InvalidInput
from transfer.serving.launch.vllm_servers import Connector

DEFAULT_PAIRS = "1:1,2:1"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "vllm",
        help="vLLM P/D: NixlConnector against PdxferConnector on the same requests",
        description="For each TP pair and each connector: start a vLLM prefill and a vLLM "
        "decode server with that connector, send the same greedy requests one at a time "
        "through vLLM's two-step P/D protocol, and report per request the bytes, descriptors "
        "and transfer time (from the connector's vllm:* histograms on the servers' /metrics), "
        "TTFT p50/p99, whether the tokens equal a colocated run's, and pdxfer/nixl ratios. "
        "Two servers run at a time.",
    )
    parser.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory")
    parser.add_argument(
        "--connectors",
        default="nixl,pdxfer",
        help="comma-separated, in run order (default nixl,pdxfer)",
    )
    parser.add_argument(
        "--tp-pairs",
        default=DEFAULT_PAIRS,
        metavar="P:D,...",
        help=f"prefill:decode TP sizes (default {DEFAULT_PAIRS})",
    )
    parser.add_argument("--requests", type=int, default=8, help="per connector (default 8)")
    parser.add_argument(
        "--prompt-tokens", type=int, default=100, help="tokens per prompt (default 100)"
    )
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per request (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds to wait for a server (default 600)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    add_vllm_server_arguments(parser)
    parser.set_defaults(func=run)


def tp_pairs(text: str) -> list[tuple[int, int]]:
    pairs = []
    for item in text.split(","):
        p, sep, d = item.strip().partition(":")
        if not sep or not p.isdigit() or not d.isdigit() or int(p) < 1 or int(d) < 1:
            raise InvalidInput(f"--tp-pairs: expected P:D pairs like 1:1,2:1, got {item!r}")
        pairs.append((int(p), int(d)))
    return pairs


def connectors(text: str) -> list[Connector]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    known = [c.value for c in Connector]
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise InvalidInput(f"--connectors: choose from {', '.join(known)}, got {text!r}")
    return [Connector(n) for n in names]


def run(args: argparse.Namespace) -> int:
    from transfer.bench.vllm_pd import BenchRequests, run_connector
    from transfer.bench.vllm_report import report
    from transfer.serving.launch.vllm_stack import VllmPdPlan

    for flag in ("requests", "prompt_tokens", "max_tokens"):
        if getattr(args, flag) < 1:
            raise InvalidInput(f"--{flag.replace('_', '-')} must be >= 1")
    model, python = vllm_model_dir(args.model), vllm_python(args.vllm_python)
    requests = BenchRequests(args.requests, args.prompt_tokens, args.max_tokens, args.seed)
    if requests.prompt_tokens + requests.max_tokens > args.vllm_max_model_len:
        raise InvalidInput("--prompt-tokens: prompt + --max-tokens exceed --vllm-max-model-len")
    root = Path(tempfile.mkdtemp(prefix="pdxfer-bench-vllm-"))
    runs = []
    for prefill_tp, decode_tp in tp_pairs(args.tp_pairs):
        for connector in connectors(args.connectors):
            plan = VllmPdPlan(
                model, connector, python, prefill_tp, decode_tp,
                max_model_len=args.vllm_max_model_len,
                kv_cache_bytes=kv_cache_bytes(args.vllm_kv_cache),
            )  # fmt: skip
            log_dir = root / f"{connector.value}-{prefill_tp}-{decode_tp}"
            runs.append(run_connector(plan, requests, log_dir, args.timeout, _progress))
    print(f"bench vllm: {model.name}, {requests.count} requests of {requests.prompt_tokens} "
          f"prompt tokens, {requests.max_tokens} greedy tokens each (logs in {root})")  # fmt: skip
    print(report(runs))
    if args.json:
        document = [{**asdict(r), "connector": r.connector.value} for r in runs]
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return 0 if all(r.error is None for r in runs) else 1


def _progress(text: str) -> None:
    print(f"bench vllm: {text}", file=sys.stderr, flush=True)
