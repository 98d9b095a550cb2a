"""`pdxfer launch`: router + one prefill + one decode instance on localhost, N requests at once.

Prints a per-request table (or `--json`, a public interface) and, with `--verify`, checks
every request two ways: the decode ranks' caches right after the transfer equal the prefill
caches re-sliced by the geometry's shard functions, and the greedy tokens equal a colocated
TP=1 run. Exits 1 when a request fails or fails verification.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from transfer.cli.launch_config import LaunchConfig
from transfer.cli.launch_report import format_table, summarize
from transfer.cli.launch_run import Progress, References, cut_at_end, send_all, verify_outcomes
from transfer.cli.model_args import (
    add_local_prefix_cache_arguments,
    add_local_transfer_mode_arguments,
    add_served_model_arguments,
)
from transfer.errors import InvalidInput
from transfer.serving.engine.serve_options import serve_default


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "launch",
        help="run router, prefill and decode locally and send requests",
        description="Start a router, one prefill and one decode instance as separate processes "
        "on localhost, send N requests at once, print TTFT, transfer time, bytes, descriptors "
        "and tokens/s per request, and shut everything down (Ctrl-C included).",
    )
    add_served_model_arguments(parser)
    parser.add_argument(
        "--prompts",
        metavar="FILE",
        default=None,
        help='JSONL, one request per line: {"prompt_token_ids": [...]} or {"prompt": "text"} '
        "(text needs the checkpoint's tokenizer.json); default: --requests random prompts",
    )
    parser.add_argument(
        "--prefill-tp",
        type=int,
        default=serve_default("tp"),
        help="prefill TP ranks (default %(default)s)",
    )
    parser.add_argument(
        "--decode-tp",
        type=int,
        default=serve_default("tp"),
        help="decode TP ranks (default %(default)s)",
    )
    parser.add_argument(
        "--transport",
        choices=["nixl", "ucx"],
        default=serve_default("transport"),
        help="data plane (default %(default)s)",
    )
    parser.add_argument("--requests", type=int, default=4, help="requests sent at once (default 4)")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens (default 64)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=16,
        help="most tokens generated per request; a request ends earlier at the checkpoint's "
        "eos_token_id, which is kept as its last token (default 16)",
    )
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate all --max-tokens tokens, past any end token (fixed lengths, for benchmarks)",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="check caches bit for bit after each transfer and tokens against a TP=1 run",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (a public interface)")
    parser.add_argument(
        "--seed",
        type=int,
        default=serve_default("seed"),
        help="weights and prompts seed (default %(default)s)",
    )
    parser.add_argument(
        "--gpu-mem",
        default=serve_default("gpu_mem"),
        help="cache memory per rank (default %(default)s)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=serve_default("block_size"),
        help="min KV block size (default %(default)s)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=serve_default("device"),
        help="(default %(default)s)",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds for startup and for the requests"
    )
    parser.add_argument(
        "--staging-mib",
        type=int,
        default=serve_default("staging_mib"),
        help="each worker's staging pool per rank; 0 reads every range directly "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--staging-min-packed",
        type=int,
        default=serve_default("staging_min_packed"),
        help="stage a transfer only when it packs at least this many ranges (default %(default)s)",
    )
    add_local_prefix_cache_arguments(parser)
    add_local_transfer_mode_arguments(parser)
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="N",
        help="the random prompts share their first N tokens; the first request then runs "
        "alone, so that the others can find its prefix cached (default 0)",
    )
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the run directory (logs, cache dumps)"
    )
    parser.set_defaults(func=run)


def _config(args: argparse.Namespace) -> LaunchConfig:
    """The flags as a checked `LaunchConfig` (every field is named after its flag)."""
    names = [f.name for f in dataclasses.fields(LaunchConfig)]
    return LaunchConfig(**{name: getattr(args, name) for name in names})


def _prompts(n: int, length: int, vocab: int, seed: int, shared: int = 0) -> list[list[int]]:
    common = random.Random(f"pdxfer-launch:{seed}:shared")
    prefix = [common.randrange(vocab) for _ in range(shared)]
    return [
        prefix + [rng.randrange(vocab) for _ in range(length - shared)]
        for rng in (random.Random(f"pdxfer-launch:{seed}:{i}") for i in range(n))
    ]


def run(args: argparse.Namespace) -> int:
    return launch(_config(args))


def launch(config: LaunchConfig) -> int:
    """Run the workers, send the requests, print the report; 0 when every request passed."""
    from transfer.cli.prompts import load_prompts
    from transfer.presets import load_geometry, looks_like_path
    from transfer.serving.openai.served import load_served_model
    from transfer.serving.openai.text import TextCodec

    geometry = load_geometry(config.model)
    codec = TextCodec.from_dir(config.model) if looks_like_path(config.model) else None
    if config.prompts:
        encode = codec.encode if codec is not None else None
        prompts = load_prompts(config.prompts, geometry.vocab_size, encode)
    else:
        prompts = _prompts(config.requests, config.prompt_len, geometry.vocab_size, config.seed,
                           config.shared_prefix)  # fmt: skip
    # The end tokens the HTTP API stops at (none for a preset, which names none).
    end_tokens = () if config.ignore_eos else load_served_model(config.model).eos_token_ids
    _check_room(config, geometry, prompts)
    run_dir = Path(tempfile.mkdtemp(prefix="pdxfer-launch-"))
    dump_dir = run_dir / "caches" if config.verify else None
    pair = _local_pair(config, len(prompts), run_dir, dump_dir)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    ok = keep = False  # the run directory is kept when something failed, not on Ctrl-C
    try:
        say = Progress()
        say.line(
            f"starting prefill (tp {config.prefill_tp}) and decode (tp {config.decode_tp}) "
            f"with {config.transport}; logs in {run_dir}"
        )
        pair.start_workers()
        if config.verify:
            references = References(
                config.model, prompts, config.max_tokens, config.seed, config.ssm_dtype
            )
        address = pair.start_router()
        say.line(f"router at {address}; sending {len(prompts)} requests")
        first = 1 if config.shared_prefix else 0  # it fills the cache the others may hit
        outcomes = send_all(address, pair.token, prompts[:first], config.max_tokens,
                            config.timeout, say, end_tokens=end_tokens)  # fmt: skip
        outcomes += send_all(address, pair.token, prompts[first:], config.max_tokens,
                             config.timeout, say, start_index=first,
                             end_tokens=end_tokens)  # fmt: skip
        if config.verify:
            say.line("verifying")
            verify_outcomes(
                geometry,
                outcomes,
                [cut_at_end(tokens, end_tokens) for tokens in references.get(config.timeout)],
                dump_dir,
                config.prefill_tp,
                config.decode_tp,
            )
        ok = all(o.ok for o in outcomes)
        keep = not ok
        say.line("stopping workers")
    except RuntimeError as exc:  # a worker that would not start: its log tail is in the message
        keep = True
        print(f"launch: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        pair.close()
        if keep or config.keep_logs:
            print(f"launch: run directory kept at {run_dir}", file=sys.stderr)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    summary = summarize(outcomes, config, codec)
    if config.json:
        print(json.dumps(summary, indent=2))
    else:
        print(format_table(outcomes, summary))
    return 0 if ok else 1


def _check_room(config: LaunchConfig, geometry, prompts: list[list[int]]) -> None:
    """What each serve process will plan, checked before anything starts: InvalidInput names
    the flag when an instance cannot hold every request at once."""
    from transfer.serving.engine.instance import InstanceConfig, plan_for
    from transfer.units import parse_size

    budget = parse_size(config.gpu_mem, "--gpu-mem")
    for role, tp in (("prefill", config.prefill_tp), ("decode", config.decode_tp)):
        try:
            sizes = {"max_seqs": len(prompts), "min_block_size": config.block_size}
            sizes["prefix_cache"] = config.prefix_cache
            instance = InstanceConfig(
                role, geometry, model=config.model, ssm_dtype=config.ssm_dtype, tp=tp,
                budget_bytes=budget, **sizes,
            )  # fmt: skip
            plan = plan_for(instance)
        except ValueError as exc:
            raise InvalidInput(f"--{role}-tp {tp}: {exc}") from None
        longest = max(map(len, prompts)) + config.max_tokens
        if (
            plan.num_kv_blocks * plan.block_size < longest * len(prompts)
            and geometry.attention_layers
        ):
            raise InvalidInput(
                f"--gpu-mem {config.gpu_mem}: {role} holds {plan.num_kv_blocks} blocks of "
                f"{plan.block_size} tokens, too few for {len(prompts)} requests of up to "
                f"{longest} tokens; raise --gpu-mem"
            )


def _local_pair(config: LaunchConfig, num_requests: int, run_dir: Path, dump_dir: Path | None):
    """The prefill and decode instances `config` describes, each with room for every request."""
    from transfer.serving.launch.local import LocalPair, LocalPairConfig

    return LocalPair(
        LocalPairConfig(
            config.model, config.prefill_tp, config.decode_tp, config.ssm_dtype,
            config.transport, config.gpu_mem, config.device, max_seqs=num_requests,
            block_size=config.block_size, seed=config.seed, dump_dir=dump_dir,
            timeout_s=config.timeout, staging_mib=config.staging_mib,
            staging_min_packed=config.staging_min_packed,
            prefix_cache=config.prefix_cache, checkpoint_interval=config.checkpoint_interval,
            transfer_mode=config.transfer_mode, stream_layers=config.stream_layers,
        ),
        run_dir,
    )  # fmt: skip


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt
