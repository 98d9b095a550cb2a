"""`pdxfer bench serve`: a local P/D pair (as `launch` runs it) under closed-loop load at
several concurrencies: throughput and TTFT / ITL / end-to-end / transfer latencies."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from transfer.cli.int_args import positive_ints, require_positive
from transfer.cli.model_args import (
    add_local_prefix_cache_arguments,
    add_local_transfer_mode_arguments,
    add_served_model_arguments,
)
from transfer.errors import InvalidInput
from transfer.serving.engine.serve_options import serve_default


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="throughput and latency of a local P/D pair under closed-loop load",
        description="Start a prefill instance, a decode instance and a router on this machine, "
        "then, for each concurrency C, let C clients send requests back to back until "
        "--requests were served. Reports output tokens/s and p50/p99 TTFT, inter-token latency, "
        "end-to-end latency and transfer time per concurrency, and the decode instance's "
        "mean batch size and step time (from its /metrics), and CPU ms per generated token "
        "(from /proc) of the decode instance with its ranks, of its own process alone "
        "(control: engine, gRPC, transfers) and of the router.",
    )
    add_served_model_arguments(parser)
    parser.add_argument(
        "--concurrency",
        default="1,4,16,32",
        help="comma-separated client counts (default 1,4,16,32)",
    )
    parser.add_argument(
        "--requests", type=int, default=64, help="requests per concurrency (default 64)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the concurrency levels this many times in turn, each round with fresh "
        "prompts; each level reports the median over its rounds, and the ratios to the first "
        "level are taken within each round (default 1)",
    )
    parser.add_argument(
        "--prompt-len",
        type=int,
        default=64,
        help="prompt tokens; with --workload multiturn, the first turn's (default 64)",
    )
    parser.add_argument(
        "--workload",
        choices=["single", "multiturn"],
        default="single",
        help="single: independent random prompts; multiturn: conversations of --turns turns "
        "that all start with the same --system-len tokens, each turn resending the last one "
        "and its answer plus --turn-len new tokens (--requests counts turns; default single)",
    )
    parser.add_argument("--turns", type=int, default=4, help="multiturn: turns (default 4)")
    parser.add_argument(
        "--system-len",
        type=int,
        default=48,
        help="multiturn: the shared system prompt's tokens, part of --prompt-len (default 48)",
    )
    parser.add_argument(
        "--turn-len",
        type=int,
        default=16,
        help="multiturn: tokens each later turn adds (default 16)",
    )
    add_local_prefix_cache_arguments(parser)
    add_local_transfer_mode_arguments(parser)
    parser.add_argument(
        "--max-tokens", type=int, default=32, help="tokens per request (default 32)"
    )
    parser.add_argument(
        "--prefill-tp", type=int, default=serve_default("tp"), help="(default %(default)s)"
    )
    parser.add_argument(
        "--decode-tp", type=int, default=serve_default("tp"), help="(default %(default)s)"
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="live requests per instance (default: the largest concurrency); 1 turns batching off",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=serve_default("max_num_batched_tokens"),
        help="prompt tokens per prefill step (serve's flag; default %(default)s)",
    )
    parser.add_argument(
        "--transport",
        choices=["nixl", "ucx"],
        default=serve_default("transport"),
        help="(default %(default)s)",
    )
    parser.add_argument(
        "--gpu-mem",
        default=serve_default("gpu_mem"),
        help="cache memory per rank (default %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=serve_default("seed"),
        help="weights and prompts seed (default %(default)s)",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per concurrency level (default 600)"
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="also report where TTFT goes, hop by hop (p50 / p90 ms per concurrency): the "
        "router, prefill and decode processes log the points each request passes (see "
        "PDXFER_TRACE_DIR in docs/workers.md); adds a write per point",
    )
    parser.add_argument("--json", action="store_true", help='print {"results": [...]}')
    parser.add_argument("--plot", metavar="FILE", help="PNG: throughput and latency vs concurrency")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transfer.bench.serve_report import format_report, plot_results
    from transfer.bench.serve_rounds import throughput_ratios
    from transfer.presets import load_geometry
    from transfer.serving.launch.local import LocalPair, LocalPairConfig
    from transfer.trace import TRACE_DIR_ENV

    levels = positive_ints(args.concurrency, "--concurrency", "1,4,16")
    require_positive(args, ("requests", "rounds", "prompt_len", "max_tokens",
                            "max_num_batched_tokens", "turns", "turn_len", "stream_layers"))  # fmt: skip
    if args.workload == "multiturn" and not 0 <= args.system_len <= args.prompt_len:
        raise InvalidInput(f"--system-len must be in [0, --prompt-len], got {args.system_len}")
    geometry = load_geometry(args.model)
    max_seqs = args.max_num_seqs or max(levels)
    run_dir = Path(tempfile.mkdtemp(prefix="pdxfer-bench-serve-"))
    config = LocalPairConfig(
        args.model, args.prefill_tp, args.decode_tp, args.ssm_dtype, args.transport,
        args.gpu_mem, "cpu", max_seqs, seed=args.seed, timeout_s=args.timeout,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefix_cache=args.prefix_cache, checkpoint_interval=args.checkpoint_interval,
        transfer_mode=args.transfer_mode, stream_layers=args.stream_layers, metrics=True,
    )  # fmt: skip
    trace_dir = run_dir / "trace" if args.trace else None
    pair = LocalPair(config, run_dir, {TRACE_DIR_ENV: str(trace_dir)} if trace_dir else None)
    try:
        print(f"bench serve: starting {args.model} P={args.prefill_tp} D={args.decode_tp} "
              f"max_num_seqs={max_seqs}; logs in {run_dir}", file=sys.stderr)  # fmt: skip
        pair.start_workers()
        rounds, windows = _measure(args, pair, pair.start_router(), levels, geometry.vocab_size)
        results, hops = _results(rounds, levels, windows, trace_dir)
    finally:
        pair.close()
        shutil.rmtree(run_dir, ignore_errors=True)
    report = {
        "model": args.model,
        "prefill_tp": args.prefill_tp,
        "decode_tp": args.decode_tp,
        "max_num_seqs": max_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "workload": args.workload,
        "prefix_cache": args.prefix_cache,
        "transfer_mode": args.transfer_mode,
        "rounds": args.rounds,
        "results": results,
        "throughput_ratios": throughput_ratios(rounds),
    }
    if args.plot:
        plot_results(results, args.plot, f"{args.model} P={args.prefill_tp} D={args.decode_tp}")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report, levels, hops))
    return 0 if all(r["failed"] == 0 for r in results) else 1


Windows = dict[int, list[tuple[float, float]]]  # level -> (start, end) unix seconds per round


def _measure(
    args: argparse.Namespace, pair, address: str, levels: list[int], vocab: int
) -> tuple[list[list[dict]], Windows]:
    """Every round at every level: rounds[i][j] is round i at levels[j]; and when each ran."""
    from transfer.bench.decode_steps import read_step_totals
    from transfer.bench.serve_load import run_load

    rounds: list[list[dict]] = []
    windows: Windows = {level: [] for level in levels}
    decode_metrics = pair.procs[1].metrics_port
    for round_index in range(args.rounds):
        conversations = _conversations(args, vocab, round_index)
        rounds.append([])
        for level in levels:
            before = read_step_totals(decode_metrics)
            cpu_before = _cpu_seconds(pair)
            began = time.time()
            result = run_load(
                address, pair.token, conversations, args.max_tokens, level, args.timeout
            )
            windows[level].append((began, time.time()))
            cpu = _cpu_seconds(pair)
            steps = read_step_totals(decode_metrics).since(before)
            steps |= {key: round(cpu[key] - cpu_before[key], 3) for key in cpu}
            label = f" (round {round_index + 1}/{args.rounds})" if args.rounds > 1 else ""
            print(f"bench serve: concurrency {level}{label}: "
                  f"{result.output_tokens_per_s:.1f} tok/s, "
                  f"ttft p50 {result.ttft_ms['p50']:.0f} ms, itl p50 {result.itl_ms['p50']:.1f} ms, "
                  f"decode batch mean {steps['decode_batch_mean']:.1f}, "
                  f"{result.failed} failed", file=sys.stderr)  # fmt: skip
            rounds[-1].append(result.to_dict() | steps)
    return rounds, windows


def _results(
    rounds: list[list[dict]], levels: list[int], windows: Windows, trace_dir: Path | None
) -> tuple[list[dict], dict]:
    """Each level's result over its rounds, with CPU per token and, from `trace_dir`, its
    hops; and the hops as `format_hops` takes them (none without a trace)."""
    from transfer.bench.hops import hop_table, in_window
    from transfer.bench.serve_rounds import CPU_SIDES, combine_rounds
    from transfer.trace import read_traces

    results = [combine_rounds([r[j] for r in rounds]) for j in range(len(levels))]
    for r in results:
        for side in CPU_SIDES:
            per_token = 1e3 * r[f"{side}_cpu_s"] / max(1, r["output_tokens"])
            r[f"{side}_cpu_ms_per_token"] = round(per_token, 3)
    hops = {}
    if trace_dir is not None:
        traces = read_traces(trace_dir)
        for level, r in zip(levels, results, strict=True):
            table = hops[f"C={level}"] = hop_table(in_window(traces, windows[level]))
            r["hops_ms"] = [hop.to_dict() for hop in table]
    return results, hops


def _cpu_seconds(pair) -> dict[str, float]:
    """CPU seconds so far of each of `CPU_SIDES`, keyed "<side>_cpu_s"."""
    from transfer.bench.proc_cpu import process_cpu_seconds, tree_cpu_seconds

    decode, router = pair.procs[1].popen.pid, pair.procs[2].popen.pid
    return {
        "decode_cpu_s": tree_cpu_seconds(decode),
        "decode_control_cpu_s": process_cpu_seconds(decode),
        "router_cpu_s": tree_cpu_seconds(router),
    }


def _conversations(
    args: argparse.Namespace, vocab: int, round_index: int = 0
) -> list[list[list[int]]]:
    """Each conversation's first prompt, then each later turn's new tokens; every round
    draws its own (round 0 those of a run without rounds)."""
    suffix = f":round{round_index}" if round_index else ""
    rng = random.Random(f"pdxfer-bench-serve:{args.seed}{suffix}")

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    if args.workload == "single":
        return [[tokens(args.prompt_len)] for _ in range(args.requests)]
    system = tokens(args.system_len)
    count = -(-args.requests // args.turns)
    return [
        [system + tokens(args.prompt_len - args.system_len)]
        + [tokens(args.turn_len) for _ in range(args.turns - 1)]
        for _ in range(count)
    ]
