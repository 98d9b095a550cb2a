"""`pdxfer bench transfer`: one request's cache moved from prefill to decode rank processes.

Prefill and decode ranks are separate processes, each with one arena laid out from the
real model geometry (layers scaled down when the arenas would not fit), blocks and slots
allocated from fragmented pools. Per token count it times ours (the packer's plan), raw
(the same bytes per rank pair as one contiguous range: the ceiling) and naive (one
descriptor per layer, block and K/V region, as vLLM's NixlConnector posts), after checking
that each moved the right bytes. `--json` is a public interface (key `results`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

from transfer.units import parse_size

DEFAULT_TOKENS = "1k,4k,16k,64k"
DEFAULT_MAX_ARENA = "6GiB"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "transfer",
        help="one request's KV + state transfer: ours vs raw vs naive",
        description=__doc__,
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


def _check(args: argparse.Namespace, geometry, pairs) -> None:
    for field, value, low in (
        ("--repeats", args.repeats, 1),
        ("--block-size", args.block_size, 1),
        ("--hole-blocks", args.hole_blocks, 1),
        ("--control-tickets", args.control_tickets, 0),
        ("--control-concurrency", args.control_concurrency, 1),
    ):
        if value < low:
            raise ValueError(f"{field}: must be >= {low}, got {value}")
    if not args.deadline > 0:
        raise ValueError(f"--deadline: must be positive, got {args.deadline}")
    for p, d in pairs:
        for field, tp in (("--prefill-tp", p), ("--decode-tp", d)):
            if tp < 1:
                raise ValueError(f"{field}: must be >= 1, got {tp}")
            try:
                geometry.check_tp(tp)
            except ValueError as exc:
                raise ValueError(f"{field} {tp}: {geometry.name}: {exc}") from None


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


def _log(message: str) -> None:
    print(f"[bench transfer {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _machine() -> dict:
    import platform

    import torch

    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "cpus": os.cpu_count(),
        "memory_gib": round(memory / 2**30, 1),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": platform.platform(),
    }


def _control(tickets: int, concurrency: int) -> dict:
    from transfer.bench.control import measure

    result = measure(tickets, concurrency)
    serial, loaded = result["serial"], result["loaded"]
    return {
        "definition": result["definition"],
        "tickets": tickets,
        "concurrency": concurrency,
        "p50_ms": serial["p50_ms"],
        "p99_ms": serial["p99_ms"],
        "loaded_p50_ms": loaded["p50_ms"],
        "loaded_p99_ms": loaded["p99_ms"],
        "tickets_per_s": loaded["tickets_per_s"],
    }


def run(args: argparse.Namespace) -> int:
    from transfer.presets import get_preset

    geometry = get_preset(args.model)
    tokens, pairs = parse_tokens(args.tokens), parse_pairs(args)
    max_arena = parse_size(args.max_arena_bytes, "--max-arena-bytes")
    _check(args, geometry, pairs)
    peer = _two_node(args)
    if args.node_rank == 0:
        from transfer.bench.transfer_host import RankHost

        host = RankHost(peer.port, peer.token or None, _log)
        _with_sigterm_as_interrupt(host.serve)
        return 0
    if args.nodes == "netns":
        from transfer.bench.netns import check_can_create

        try:
            check_can_create()
        except RuntimeError as exc:
            print(f"pdxfer bench transfer: error: {exc}", file=sys.stderr)
            return 2
    report = _with_sigterm_as_interrupt(
        lambda: measure(args, geometry, tokens, pairs, max_arena, peer)
    )
    if args.csv:
        from transfer.bench.transfer_report import write_csv

        write_csv(report, args.csv)
        _log(f"wrote {args.csv}")
    if args.plot:
        from transfer.bench.transfer_report import plot

        plot(report, args.plot)
        _log(f"wrote {args.plot}")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from transfer.bench.transfer_report import format_table

        print(format_table(report))
    return 0


def _with_sigterm_as_interrupt(work):
    """SIGTERM unwinds like Ctrl-C, so rank processes and namespaces are always removed."""
    if threading.current_thread() is not threading.main_thread():
        return work()

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        return work()
    finally:
        signal.signal(signal.SIGTERM, previous)


def measure(args: argparse.Namespace, geometry, tokens, pairs, max_arena: int, peer=None) -> dict:
    from transfer.bench.transfer_driver import Settings, placement, run_pair
    from transfer.bench.transfer_setup import fit_geometry

    scaled = fit_geometry(geometry, pairs, args.block_size, max(tokens), max_arena)
    if len(scaled.layers) < len(geometry.layers):
        _log(
            f"scaled {geometry.name} from {len(geometry.layers)} to {len(scaled.layers)} layers "
            f"to fit --max-arena-bytes {args.max_arena_bytes} at {max(tokens)} tokens"
        )
    nodes = "two-node" if peer is not None else args.nodes
    settings = Settings(
        args.transport,
        nodes,
        tokens,
        args.repeats,
        args.block_size,
        args.tls,
        args.deadline,
        args.seed,
        args.hole_blocks,
    )
    results, arenas = [], {}
    with placement(nodes, peer) as where:
        for p, d in pairs:
            pair_results, arena_bytes = run_pair(scaled, p, d, settings, where, _log)
            results += pair_results
            arenas[f"{p}:{d}"] = arena_bytes
    report = {
        "model": geometry.name,
        "layers": len(scaled.layers),
        "model_layers": len(geometry.layers),
        "transport": args.transport,
        "nodes": nodes,
        "tls": args.tls or ("tcp" if args.nodes == "netns" else "ucx default"),
        "block_size": args.block_size,
        "hole_blocks": args.hole_blocks,
        "repeats": args.repeats,
        "arena_bytes": arenas,
        "definitions": {
            "time": "one request: slowest prefill gather (if staged) + slowest decode post..DONE..scatter",
            "gbps": "bytes / median time, 1 GB = 1e9 B",
            "raw": "the same bytes per (decode rank, prefill rank) pair as one contiguous range",
            "naive": "one descriptor per (layer, block, K/V region) and per (layer, state tensor, slot), vLLM-like layout",
            "efficiency": "gbps / raw_gbps",
            "speedup": "gbps / naive_gbps",
        },
        "results": results,
        "machine": _machine(),
    }
    if args.control_tickets:
        _log(f"control plane: {args.control_tickets} ticket round trips")
        report["control"] = _control(args.control_tickets, args.control_concurrency)
    return report
