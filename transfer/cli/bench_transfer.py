"""`pdxfer bench transfer`: flags -> `TransferBenchConfig`, then the report's outputs
(the benchmark itself is `transfer.bench.transfer_bench`)."""

from __future__ import annotations

import argparse
import json
import sys

from transfer.units import parse_size

DEFAULT_TOKENS = "1k,4k,16k,64k"
DEFAULT_MAX_ARENA = "6GiB"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "transfer",
        help="one request's KV + state transfer: ours vs raw vs naive",
        description=_description(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model", default="qwen3-next-80b-a3b", help="preset name (default qwen3-next-80b-a3b)"
    )
    parser.add_argument("--prefill-tp", type=int, default=1, help="prefill TP size (default 1)")
    parser.add_argument("--decode-tp", type=int, default=1, help="decode TP size (default 1)")
    parser.add_argument(
        "--tp-pairs",
        help="sweep several P:D pairs, e.g. 1:1,2:1,1:2,2:2 (overrides --prefill-tp/--decode-tp)",
    )
    parser.add_argument(
        "--tokens",
        default=DEFAULT_TOKENS,
        help=f"request lengths, e.g. 1024,4k (k = 1024; default {DEFAULT_TOKENS})",
    )
    parser.add_argument(
        "--transport", choices=("nixl", "ucx"), default="nixl", help="data plane (default nixl)"
    )
    parser.add_argument(
        "--nodes",
        choices=("loopback", "netns"),
        default="loopback",
        help="loopback: all ranks in this network namespace; netns: prefill and decode in two "
        "namespaces joined by a veth pair (needs root)",
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        choices=(0, 1),
        help="two-node mode (with --peer): 0 hosts the prefill ranks on --peer's port, "
        "1 runs the decode ranks and the driver and prints the results",
    )
    parser.add_argument(
        "--peer", metavar="HOST:PORT", help="two-node mode: where node 0 listens (with --node-rank)"
    )
    parser.add_argument(
        "--auth-token-file",
        help="two-node mode: file holding the token both nodes share "
        "(env PDXFER_AUTH_TOKEN_FILE; PDXFER_AUTH_TOKEN gives the token itself)",
    )
    parser.add_argument(
        "--insecure-peer",
        action="store_true",
        help="two-node mode without a token: anyone who reaches the port can run code on node 0",
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed repeats per token count (default 5)"
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="KV block size in tokens (default 16)"
    )
    parser.add_argument(
        "--max-arena-bytes",
        default=DEFAULT_MAX_ARENA,
        help=f"cap on all ranks' arenas together; layers are scaled down to fit (default {DEFAULT_MAX_ARENA})",
    )
    parser.add_argument(
        "--tls",
        help="UCX transports, e.g. tcp or shm,cma,tcp (default: UCX's choice; tcp for netns)",
    )
    parser.add_argument(
        "--deadline", type=float, default=120.0, help="per-transfer deadline in s (default 120)"
    )
    parser.add_argument(
        "--control-tickets",
        type=int,
        default=1000,
        help="control-plane round trips to time (0: skip; default 1000)",
    )
    parser.add_argument(
        "--control-concurrency", type=int, default=16, help="control-plane clients (default 16)"
    )
    parser.add_argument(
        "--hole-blocks",
        type=int,
        default=8,
        help="fragmentation: earlier requests held 1..N blocks each, and the measured request "
        "fills the holes they left (default 8: the most fragmented)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed for bytes and fragmentation (default 0)"
    )
    parser.add_argument(
        "--layerwise",
        action="store_true",
        help="also time layer-wise streaming against a modelled prefill: each group of "
        "--stream-layers layers is read as soon as the prefill finishes it (keys exposed_ms, "
        "whole_exposed_ms, exposed_ratio)",
    )
    parser.add_argument(
        "--stream-layers",
        type=int,
        default=4,
        help="layers per streaming group with --layerwise (default 4)",
    )
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=50_000.0,
        help="the modelled prefill's speed with --layerwise, spread over the layers by their "
        "FLOPs (default 50000: about an H200 on a 3B-active MoE)",
    )
    parser.add_argument(
        "--stream-chunk-tokens",
        type=int,
        default=8192,
        help="with --layerwise, the modelled prefill runs in chunks of this many tokens (as "
        "serve's --max-num-batched-tokens; 0: one chunk), and each chunk's KV streams as "
        "soon as it is final (default 8192)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--csv", metavar="FILE", help="write one row per (TP pair, tokens)")
    parser.add_argument(
        "--plot", metavar="FILE.png", help="plot throughput, descriptors and efficiency"
    )
    parser.set_defaults(func=run)


def parse_tokens(text: str) -> tuple[int, ...]:
    values = []
    for item in str(text).split(","):
        item = item.strip().lower()
        scale = 1024 if item.endswith("k") else 1
        try:
            value = int(item[:-1] if scale > 1 else item) * scale
        except ValueError:
            raise ValueError(f"--tokens: cannot parse {item!r} (examples: 1024, 4k)") from None
        if value < 1:
            raise ValueError(f"--tokens: lengths must be >= 1, got {item!r}")
        values.append(value)
    if not values:
        raise ValueError("--tokens: give at least one length")
    return tuple(values)


def parse_pairs(args: argparse.Namespace) -> tuple[tuple[int, int], ...]:
    if not args.tp_pairs:
        return ((args.prefill_tp, args.decode_tp),)
    pairs = []
    for item in args.tp_pairs.split(","):
        try:
            p, d = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(
                f"--tp-pairs: cannot parse {item!r} (expected P:D, e.g. 2:1)"
            ) from None
        pairs.append((p, d))
    return tuple(pairs)


def _two_node(args: argparse.Namespace):
    """The RemotePeer of two-node mode (token b"" with --insecure-peer and none), or None."""
    if (args.node_rank is None) != (args.peer is None):
        missing = "--peer" if args.peer is None else "--node-rank"
        raise ValueError(f"{missing}: two-node mode needs both --node-rank and --peer")
    if args.node_rank is None:
        return None
    if args.nodes == "netns":
        raise ValueError("--nodes netns: cannot be combined with --node-rank/--peer")
    from transfer.bench.transfer_remote import RemotePeer, parse_peer, read_token

    host, port = parse_peer(args.peer)
    token = read_token(args.auth_token_file)
    if token is None and not args.insecure_peer:
        raise ValueError(
            "--auth-token-file: two-node mode needs a token shared by both nodes "
            "(--auth-token-file, PDXFER_AUTH_TOKEN_FILE or PDXFER_AUTH_TOKEN): node 0 runs "
            "pickled commands from the network. --insecure-peer runs without one"
        )
    return RemotePeer(host, port, token or b"")


def _description() -> str:
    from transfer.bench import transfer_bench

    return transfer_bench.__doc__ + "\n`--json` prints that report."


def config_from(args: argparse.Namespace, peer=None):
    """The typed config of these flags (`peer`: node 0, in two-node mode)."""
    from transfer.bench.transfer_bench import TransferBenchConfig
    from transfer.presets import get_preset

    return TransferBenchConfig(
        geometry=get_preset(args.model),
        pairs=parse_pairs(args),
        tokens=parse_tokens(args.tokens),
        transport=args.transport,
        nodes=args.nodes,
        peer=peer,
        repeats=args.repeats,
        block_size=args.block_size,
        max_arena_bytes=parse_size(args.max_arena_bytes, "--max-arena-bytes"),
        tls=args.tls,
        deadline_s=args.deadline,
        control_tickets=args.control_tickets,
        control_concurrency=args.control_concurrency,
        hole_blocks=args.hole_blocks,
        seed=args.seed,
        stream_layers=args.stream_layers if args.layerwise else 0,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        stream_chunk_tokens=args.stream_chunk_tokens,
    )


def run(args: argparse.Namespace) -> int:
    from transfer.bench.transfer_bench import measure, serve_ranks, with_sigterm_as_interrupt

    peer = _two_node(args)
    config = config_from(args, peer)
    if args.node_rank == 0:
        return serve_ranks(peer.port, peer.token or None)
    if args.nodes == "netns":
        from transfer.bench.netns import check_can_create

        try:
            check_can_create()
        except RuntimeError as exc:
            print(f"pdxfer bench transfer: error: {exc}", file=sys.stderr)
            return 2
    report = with_sigterm_as_interrupt(lambda: measure(config))
    if args.csv:
        from transfer.bench.transfer_report import write_csv

        write_csv(report, args.csv)
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.plot:
        from transfer.bench.transfer_report import plot

        plot(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from transfer.bench.transfer_report import format_table

        print(format_table(report))
    return 0
