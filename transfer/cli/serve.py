"""`pdxfer serve prefill|decode|router`: long-running worker processes."""

from __future__ import annotations

import argparse
import os

from transfer.cli.model_args import add_served_model_arguments
from transfer.serving.engine.serve_options import ANY_PORT, RouterBackend
from transfer.serving.engine.serve_options import serve_default as _D
from transfer.serving.ranks.progress import TRANSFER_MODES
from transfer.serving.role import ServeRole

ROLES = tuple(ServeRole)


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("control-plane security")
    group.add_argument(
        "--auth-token-file",
        metavar="PATH",
        default=os.environ.get("PDXFER_AUTH_TOKEN_FILE"),
        help="file holding the shared token sent/required in gRPC metadata "
        "(env PDXFER_AUTH_TOKEN_FILE; PDXFER_AUTH_TOKEN gives the token itself)",
    )
    group.add_argument("--tls-cert", metavar="PATH", help="PEM certificate of this server")
    group.add_argument("--tls-key", metavar="PATH", help="PEM private key of this server")
    group.add_argument(
        "--insecure",
        action="store_true",
        help="serve a non-loopback --host/--data-host without a token or mutual TLS, and "
        "the router's HTTP API without an API key (refused otherwise; /metrics never "
        "asks for either)",
    )
    group.add_argument(
        "--tls-ca",
        metavar="PATH",
        help="PEM CA bundle: verifies peers; on a server it also requires client certs (mTLS)",
    )


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    add_served_model_arguments(parser)
    parser.add_argument(
        "--tp", type=int, default=_D("tp"), help="tensor-parallel ranks (default %(default)s)"
    )
    parser.add_argument(
        "--data-host",
        default=_D("data_host"),
        help="address the data plane listens on and advertises (default: --host); its "
        "interface becomes UCX_NET_DEVICES",
    )
    add_instance_arguments(parser)
    parser.add_argument(
        "--instance-id",
        default=_D("instance_id"),
        help="name of this instance (default: host:port); a boot id is appended per start",
    )
    parser.add_argument(
        "--dump-dir",
        metavar="PATH",
        default=_D("dump_dir"),
        help="write each request's per-rank caches here (prefill: after prefill, decode: "
        "right after the transfer) for `pdxfer launch --verify`; off by default",
    )
    dist = parser.add_argument_group("multi-node TP")
    dist.add_argument(
        "--nnodes", type=int, default=_D("nnodes"), help="nodes this instance's TP spans"
    )
    dist.add_argument(
        "--node-rank", type=int, default=_D("node_rank"), help="this node's index (0 = leader)"
    )
    dist.add_argument(
        "--dist-addr",
        default=_D("dist_addr"),
        help="host:port of the leader's torch.distributed rendezvous (default: local)",
    )


def add_instance_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of one instance's engine and cache, which `up` also takes and passes on."""
    parser.add_argument(
        "--transport",
        choices=["nixl", "ucx"],
        default=_D("transport"),
        help="data plane (default %(default)s)",
    )
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=_D("device"), help="(default %(default)s)"
    )
    parser.add_argument(
        "--gpu-mem", default=_D("gpu_mem"), help="cache memory per rank (default %(default)s)"
    )
    parser.add_argument(
        "--max-seqs",
        "--max-num-seqs",
        dest="max_seqs",
        type=int,
        default=_D("max_seqs"),
        help="max live requests: state slots, and the decode batch's cap (default %(default)s; 1 "
        "switches batching off)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=_D("max_num_batched_tokens"),
        help="prompt tokens per prefill step; longer prompts run in chunks of this size "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--staging-mib",
        type=int,
        default=_D("staging_mib"),
        help="per rank, a pool (beyond --gpu-mem) into which a transfer's many small ranges "
        "are packed so they cross as one READ; 0 sends every range directly (default %(default)s)",
    )
    parser.add_argument(
        "--staging-min-ranges",
        type=int,
        default=_D("staging_min_ranges"),
        help="decode stages a prefill rank's ranges under 64 KiB once there are this many "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--staging-min-packed",
        type=int,
        default=_D("staging_min_packed"),
        help="decode stages a transfer only when it would pack at least this many ranges in "
        "all; fewer are read directly, saving the Stage round trip (default %(default)s)",
    )
    parser.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=_D("prefix_cache"),
        help="keep full KV blocks by the hash of their tokens. Prefill also keeps state "
        "checkpoints at block boundaries and computes only what a prompt adds to a cached "
        "prefix; decode reads only the blocks it does not hold yet. The tokens and caches "
        "are those of a run without it (default %(default)s; docs/prefix-cache.md)",
    )
    parser.add_argument(
        "--state-checkpoints",
        type=int,
        default=_D("state_checkpoints"),
        help="prefill with --prefix-cache: state slots reserved for checkpoints, beyond "
        "--max-num-seqs and inside --gpu-mem (default %(default)s)",
    )
    parser.add_argument(
        "--checkpoint-interval",
        type=int,
        default=_D("checkpoint_interval"),
        help="prefill with --prefix-cache: also checkpoint every this many prompt tokens, a "
        "multiple of 64; 0 checkpoints prompt ends only (default %(default)s)",
    )
    parser.add_argument(
        "--transfer-mode",
        choices=TRANSFER_MODES,
        default=_D("transfer_mode"),
        help="whole: decode reads a request once prefill has finished it. "
        "layerwise: prefill publishes the ticket when the cache is allocated and each group "
        "of layers of each chunk as it finishes; decode reads them meanwhile (on decode, "
        "layerwise reads a streamed ticket as it goes, whole waits for its end). Lays the "
        "cache out per group (default %(default)s; docs/streaming.md)",
    )
    parser.add_argument(
        "--stream-layers",
        type=int,
        default=_D("stream_layers"),
        metavar="N",
        help="with --transfer-mode layerwise: layers per streaming group; smaller groups "
        "overlap more and cost more descriptors (default %(default)s)",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=_D("max_queue"),
        help="requests that wait for room beyond --max-seqs; more are refused with "
        "RESOURCE_EXHAUSTED (default %(default)s)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=_D("block_size"),
        help="minimum KV block size in tokens (default %(default)s)",
    )
    parser.add_argument(
        "--lease-seconds",
        type=float,
        default=_D("lease_seconds"),
        help="ticket lease before auto-free (default %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=_D("seed"), help="model weight seed (default %(default)s)"
    )


def instance_option_names() -> tuple[str, ...]:
    """The `ServeOptions` fields `add_instance_arguments` sets."""
    parser = argparse.ArgumentParser(add_help=False)
    add_instance_arguments(parser)
    return tuple(action.dest for action in parser._actions)


def _metrics_port(text: str) -> int:
    if text == "any":
        return ANY_PORT
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535] or 'any', got {text!r}")
    return port


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run a prefill, decode or router worker",
        description="Run one worker process: its TP ranks, gRPC control server, transport "
        "and Prometheus metrics endpoint. Stops cleanly on SIGINT/SIGTERM.",
    )
    parser.add_argument("role", choices=ROLES, help="which worker to run")
    parser.add_argument(
        "--host",
        default=_D("host"),
        help="bind address of the gRPC server, the Prometheus /metrics and the router's HTTP "
        "API (default %(default)s). Off loopback, gRPC needs a token or mutual TLS and HTTP an "
        "API key, unless --insecure; /metrics is open to whoever reaches it",
    )
    parser.add_argument(
        "--port", type=int, default=_D("port"), help="gRPC port (default %(default)s; 0 = any)"
    )
    parser.add_argument(
        "--metrics-port",
        type=_metrics_port,
        default=_D("metrics_port"),
        help="Prometheus /metrics port (default %(default)s; 0 = off; 'any' = one the OS picks, "
        "announced on the READY line)",
    )
    add_security_arguments(parser)
    add_worker_arguments(parser)
    router = parser.add_argument_group("router")
    router.add_argument(
        "--engine",
        choices=[engine.value for engine in RouterBackend],
        default=_D("engine").value,
        help="what the router fronts: pdxfer's workers (gRPC HOST:PORT) or vLLM OpenAI servers "
        "with a KV connector (http://HOST:PORT; vLLM's two-step P/D protocol; needs "
        f"--http-port) (default {_D('engine').value})",
    )
    router.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="a prefill instance, HOST:PORT (--engine vllm: http://HOST:PORT) (repeat; DNS "
        "names of headless Services resolve to all pods)",
    )
    router.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="a decode instance, like --prefill (repeat)",
    )
    decode = parser.add_argument_group("decode")
    decode.add_argument(
        "--prefill-peers",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a prefill instance this decode may read from (repeat); the router registers "
        "the ones it uses, and a ticket naming any other address is refused",
    )
    add_http_arguments(router)
    parser.set_defaults(func=run)


def add_http_arguments(group, default_port: int | None = None) -> None:
    """The router's OpenAI-compatible HTTP front end (also used by `pdxfer up`)."""
    group.add_argument(
        "--http-port",
        type=int,
        default=default_port,
        help="serve the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models, "
        f"/health, /metrics) on this port (default: {default_port or 'no HTTP'}; 0 = any "
        "free port)",
    )
    group.add_argument(
        "--api-key-file",
        metavar="PATH",
        default=_D("api_key_file"),
        help="file holding the API key HTTP clients must send as 'Authorization: Bearer KEY' "
        "(env PDXFER_API_KEY gives the key itself; not the control-plane token)",
    )
    group.add_argument(
        "--served-model-name",
        default=_D("served_model_name"),
        help="the model name clients send (default: the preset, or the checkpoint "
        "directory's name)",
    )
    group.add_argument(
        "--max-model-len",
        type=int,
        default=_D("max_model_len"),
        help="longest prompt + max_tokens accepted (default: the config's max_position_embeddings)",
    )


def run(args: argparse.Namespace) -> int:
    from transfer.serving.engine.serve_options import ServeOptions
    from transfer.serving.services.serve import serve

    return serve(ServeOptions.from_values(vars(args)))
