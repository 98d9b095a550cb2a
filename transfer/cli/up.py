"""`pdxfer up`: a router with the OpenAI HTTP API, prefill and decode instances on this
machine, serving until Ctrl-C or SIGTERM; then every process is stopped."""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import uuid
from pathlib import Path

from transfer.cli.model_args import add_served_model_arguments
from transfer.cli.serve import add_http_arguments, add_instance_arguments, instance_option_names
from transfer.cli.vllm_args import add_connector_argument, add_vllm_server_arguments
from transfer.errors import InvalidInput
from transfer.serving.engine.serve_options import RouterBackend, serve_default, serve_flags
from transfer.serving.launch.supervise import RestartPolicy


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "up",
        help="serve the OpenAI API from a local router, prefill and decode instances",
        description="Start prefill and decode instances (each with its own TP) and a router "
        "with the OpenAI-compatible HTTP API on this machine, print the URL, and serve until "
        "Ctrl-C or SIGTERM; then stop everything, leaving no process. A prefill or decode "
        "instance that dies is started again (see --max-restarts) while the router serves "
        "the others; restarts are counted at the printed `up` metrics URL. Logs go to a "
        "folder printed at start-up, removed on a clean stop (a killed `up` leaves it). "
        "With --engine vllm the instances are vLLM OpenAI servers (--vllm-python) whose KV "
        "connector (--connector) moves the cache, and --model must be a checkpoint directory.",
    )
    parser.add_argument(
        "--engine",
        choices=[engine.value for engine in RouterBackend],
        default=serve_default("engine").value,
        help="pdxfer (default): pdxfer's own workers; vllm: one vLLM prefill and one vLLM "
        "decode server with a KV connector (the flags of pdxfer's workers, e.g. --transport, "
        "--gpu-mem, --max-seqs, do not apply)",
    )
    add_connector_argument(parser)
    add_vllm_server_arguments(parser)
    add_served_model_arguments(parser)
    parser.add_argument("--prefill-instances", type=int, default=1, help="(default 1)")
    parser.add_argument("--decode-instances", type=int, default=1, help="(default 1)")
    parser.add_argument(
        "--prefill-tp",
        type=int,
        default=serve_default("tp"),
        help="TP of each prefill (default %(default)s)",
    )
    parser.add_argument(
        "--decode-tp",
        type=int,
        default=serve_default("tp"),
        help="TP of each decode (default %(default)s)",
    )
    parser.add_argument(
        "--host",
        default=serve_default("host"),
        help="bind address of every process (default %(default)s): the HTTP API, and each "
        "instance's gRPC, data plane and /metrics. gRPC gets a fresh token; off loopback the "
        "HTTP API needs --api-key-file unless --insecure; /metrics is open to whoever "
        "reaches it",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="serve the HTTP API on a non-loopback --host without an API key",
    )
    add_instance_arguments(parser)  # serve's, passed to every instance
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds to wait for start-up (default 300)"
    )
    policy = RestartPolicy()
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=policy.max_restarts,
        metavar="N",
        help=f"{policy.describe()} (default {policy.max_restarts})",
    )
    http = parser.add_argument_group("HTTP")
    add_http_arguments(http, default_port=8000)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transfer.serving.engine.serve_options import ServeOptions
    from transfer.serving.openai.http_front import api_key
    from transfer.serving.role import ServeRole
    from transfer.serving.services.serve_security import check_http_exposure

    key = api_key(ServeOptions(ServeRole.ROUTER, api_key_file=args.api_key_file))
    check_http_exposure(args.host, key, args.insecure)
    if RouterBackend(args.engine) is RouterBackend.VLLM:
        from transfer.cli.up_vllm import run_vllm_up

        return run_vllm_up(args)
    from transfer.presets import looks_like_path
    from transfer.serving.launch.procs import (
        LAUNCH_ID_ENV,
        check_health,
        start_serve,
        wait_ready,
    )
    from transfer.serving.launch.supervise import Supervisor
    from transfer.serving.role import ServeRole

    for flag in ("prefill_instances", "decode_instances", "prefill_tp", "decode_tp", "max_seqs"):
        if getattr(args, flag) < 1:
            raise InvalidInput(f"--{flag.replace('_', '-')} must be >= 1")
    if args.max_restarts < 0:
        raise InvalidInput(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if looks_like_path(args.model):  # the children resolve it from their own directory
        args.model = str(Path(args.model).resolve())
    context = _context_held(args)
    if args.max_model_len is not None:
        context = min(context, args.max_model_len)
    run_dir = Path(tempfile.mkdtemp(prefix="pdxfer-up-"))
    env = {
        LAUNCH_ID_ENV: os.environ.get(LAUNCH_ID_ENV) or uuid.uuid4().hex,
        "PDXFER_AUTH_TOKEN": uuid.uuid4().hex,  # the control plane's, not the API key
    }
    # Without --port: the supervisor picks it (any at first, the same one on a restart).
    common = serve_flags(
        {"host": args.host, "model": args.model, "ssm_dtype": args.ssm_dtype}
        | {name: getattr(args, name) for name in instance_option_names()}
    )
    policy = RestartPolicy(max_restarts=args.max_restarts)
    supervisor = Supervisor(run_dir, env, policy, _say, start_timeout_s=args.timeout)
    router, keep = None, False
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        _say(f"starting {args.prefill_instances} prefill (tp {args.prefill_tp}) and "
             f"{args.decode_instances} decode (tp {args.decode_tp}); logs in {run_dir} "
             "(removed on a clean stop, left behind if `up` is killed)")  # fmt: skip
        for role, count, tp in (
            (ServeRole.PREFILL, args.prefill_instances, args.prefill_tp),
            (ServeRole.DECODE, args.decode_instances, args.decode_tp),
        ):
            for i in range(count):
                name = f"{role}-{i}"
                flags = [*common, "--tp", str(tp), "--instance-id", name,
                         "--metrics-port", "any"]  # fmt: skip
                supervisor.start(role, name, flags)
        supervisor.wait_ready(args.timeout)
        workers = supervisor.processes
        router_flags = [
            "--host", args.host, "--port", "0", "--metrics-port", "0", "--model", args.model,
            "--http-port", str(args.http_port or 0), "--max-model-len", str(context),
            *(["--served-model-name", args.served_model_name] if args.served_model_name else []),
            *(["--api-key-file", args.api_key_file] if args.api_key_file else []),
            *(["--insecure"] if args.insecure else []),
            *[f for w in workers for f in (f"--{w.role}", w.address)],
        ]  # fmt: skip
        router = start_serve(ServeRole.ROUTER, router_flags, run_dir / "router", env)
        wait_ready([router], args.timeout)
        check_health([*workers, router], args.timeout)
        metrics_port = supervisor.serve_metrics(args.host)
        _print_ready(args, workers, router, metrics_port, run_dir)
        supervisor.watch(router)
    except KeyboardInterrupt:
        _say("stopping")
    except RuntimeError as exc:  # a process that would not start or died: its log tail
        keep = True
        print(f"pdxfer up: error: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        supervisor.stop([router] if router is not None else [])
        if keep:
            print(f"pdxfer up: logs kept in {run_dir}", file=sys.stderr)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
    return 0


def _context_held(args: argparse.Namespace) -> int:
    """The longest request (prompt + max_tokens) every instance's memory plan holds."""
    from transfer.presets import load_geometry
    from transfer.serving.engine.instance import InstanceConfig, plan_for
    from transfer.units import parse_size

    geometry = load_geometry(args.model)
    budget = parse_size(args.gpu_mem, "--gpu-mem")
    held = []
    for role, tp in (("prefill", args.prefill_tp), ("decode", args.decode_tp)):
        try:
            config = InstanceConfig(
                role, geometry, model=args.model, ssm_dtype=args.ssm_dtype, tp=tp,
                budget_bytes=budget, max_seqs=args.max_seqs, min_block_size=args.block_size,
                prefix_cache=args.prefix_cache, state_checkpoints=args.state_checkpoints,
            )  # fmt: skip
            plan = plan_for(config)
        except ValueError as exc:
            raise InvalidInput(f"--{role}-tp {tp}: {exc}") from None
        if geometry.attention_layers:
            held.append(plan.num_kv_blocks * plan.block_size)
    return min(held) if held else 1 << 30


def _print_ready(args, workers, router, metrics_port: int, run_dir) -> None:
    from transfer.serving.addresses import join_address

    # the router bound its HTTP port itself (any free one for --http-port 0): a port picked
    # here before the workers started could be taken by one of their sockets by then
    base = f"http://{join_address(args.host, router.http_port)}"
    for proc in workers:
        metrics = f"http://{join_address(args.host, proc.metrics_port)}/metrics"
        print(f"{proc.role:8s} {proc.address}  metrics {metrics}", flush=True)
    print(f"router   {router.address}", flush=True)
    up_metrics = f"http://{join_address(args.host, metrics_port)}/metrics"
    print(f"up       restarts at {up_metrics}; logs in {run_dir}", flush=True)
    print(f"OpenAI API at {base}/v1 (health {base}/health); Ctrl-C to stop", flush=True)


def _say(text: str) -> None:
    print(f"pdxfer up: {text}", file=sys.stderr, flush=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt
