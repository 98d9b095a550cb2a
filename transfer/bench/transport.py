"""`pdxfer bench transport`: GB/s of one transport, N ranges against one contiguous buffer.

Two agents in two processes. A target process owns an arena of --size bytes; this process
owns another and READs (or WRITEs) it as --ranges ranges of size/ranges bytes each. The
remote side is visited in reverse order, so no two neighbouring ranges touch on both sides
and none can be merged. In the same run the ceiling moves the same bytes as one range.
Each figure is the time from `post` to DONE, posting included; each series is one warm-up
then --repeats timed transfers. The last transfer's bytes are checked against the target.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from typing import Any

from transfer.units import format_bytes, parse_size

DEADLINE_S = 600.0
START_TIMEOUT_S = 120.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "transport",
        help="GB/s of one transport: N ranges vs one contiguous buffer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--backend", choices=["nixl", "ucx"], default="nixl", help="(default nixl)")
    parser.add_argument(
        "--size", default="256MiB", help="bytes per transfer, e.g. 256MiB (default)"
    )
    parser.add_argument(
        "--ranges", type=int, default=4096, help="ranges per transfer (default 4096)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed transfers per series (default 5)"
    )
    parser.add_argument("--op", choices=["read", "write"], default="read", help="(default read)")
    parser.add_argument("--tls", help="UCX transports, e.g. tcp (default: UCX's choice)")
    parser.add_argument(
        "--granule", help="nixl only: prepared-descriptor granule in bytes, 0 = per transfer"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    size = parse_size(args.size, "--size")
    if args.ranges < 1 or size // args.ranges < 1:
        raise ValueError(f"--ranges: need 1 <= ranges <= size ({size}), got {args.ranges}")
    if args.repeats < 1:
        raise ValueError(f"--repeats: must be >= 1, got {args.repeats}")
    options: dict[str, Any] = {"tls": args.tls} if args.tls else {}
    if args.granule is not None:
        if args.backend != "nixl":
            raise ValueError("--granule: only for --backend nixl")
        options["granule"] = 0 if args.granule == "0" else parse_size(args.granule, "--granule")
    result = measure(args.backend, size, args.ranges, args.repeats, args.op, options)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0


def _progress(message: str) -> None:
    print(f"[bench transport] {message}", file=sys.stderr, flush=True)


def _target(conn: Any, backend: str, size: int, options: dict) -> None:
    """The passive agent: an arena of random bytes, served until told to stop."""
    import torch

    from transfer.dataplane import make_transport

    transport = make_transport(backend, "bench-target", **options)
    arena = torch.randint(
        0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    conn.send(transport.register(arena))
    while True:
        if not conn.poll(0.1):
            continue
        command = conn.recv()
        if command is None:
            break
        offsets, nbytes = command
        conn.send(_digest(arena.numpy(), offsets, nbytes))
    transport.close()


def _digest(data: Any, offsets: Any, nbytes: Any) -> str:
    h = hashlib.blake2b(digest_size=16)
    for offset, n in zip(offsets.tolist(), nbytes.tolist(), strict=True):
        h.update(data[offset : offset + n].data)
    return h.hexdigest()


def _series(transport: Any, op: Any, ranges: Any, repeats: int, label: str) -> dict:
    from transfer.dataplane import wait

    seconds, posts = [], []
    for i in range(repeats + 1):
        start = time.perf_counter()
        handle = transport.post(op, "bench-target", ranges, deadline_s=DEADLINE_S)
        posted = time.perf_counter()
        status = wait(transport, handle, interval_s=0.0001)
        end = time.perf_counter()
        transport.release(handle)
        if not status.done:
            raise RuntimeError(f"{label}: transfer failed: {status.reason}")
        if i:  # the first is the warm-up
            seconds.append(end - start)
            posts.append(posted - start)
            _progress(f"{label}: {i}/{repeats}  {ranges.total_bytes / seconds[-1] / 1e9:.2f} GB/s")
    rates = sorted(ranges.total_bytes / s / 1e9 for s in seconds)
    return {
        "ranges": len(ranges),
        "median_gbps": statistics.median(rates),
        "min_gbps": rates[0],
        "max_gbps": rates[-1],
        "median_post_ms": statistics.median(posts) * 1e3,
        "gbps": rates,
    }


def measure(backend: str, size: int, count: int, repeats: int, op_name: str, options: dict) -> dict:
    import numpy as np
    import torch

    from transfer.dataplane import Op, RangeBatch, make_transport

    op = Op.READ if op_name == "read" else Op.WRITE
    piece = size // count
    local = np.arange(count, dtype=np.int64) * piece
    many = RangeBatch(local, local[::-1].copy(), np.full(count, piece, dtype=np.int64))
    one = RangeBatch.single(0, 0, piece * count)

    _progress(f"starting the {backend} target process ({format_bytes(size)} arena)")
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    target = ctx.Process(target=_target, args=(child, backend, size, options), daemon=True)
    target.start()
    transport = None
    try:
        if not conn.poll(START_TIMEOUT_S):
            raise RuntimeError("the target process did not start")
        transport = make_transport(backend, "bench-initiator", **options)
        arena = torch.randint(
            0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)
        )
        transport.register(arena)
        transport.add_peer(conn.recv())
        ceiling = _series(transport, op, one, repeats, "ceiling, 1 range")
        spread = _series(transport, op, many, repeats, f"{count} ranges")
        conn.send((many.remote, many.nbytes))
        verified = conn.recv() == _digest(arena.numpy(), many.local, many.nbytes)
        if not verified:
            raise RuntimeError("bytes differ between the two arenas after the last transfer")
        conn.send(None)
        target.join(30)
    finally:
        if transport is not None:
            transport.close()
        if target.is_alive():
            target.kill()
            target.join(10)
    return {
        "backend": backend,
        "op": op.value,
        "options": options,
        "size_bytes": piece * count,
        "range_bytes": piece,
        "repeats": repeats,
        "ranges": spread,
        "ceiling": ceiling,
        "fraction_of_ceiling": spread["median_gbps"] / ceiling["median_gbps"],
        "verified": verified,
        "granule": getattr(transport, "granule", None),
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
    }


def _print_table(result: dict) -> None:
    options = ", ".join(f"{k}={v}" for k, v in result["options"].items()) or "defaults"
    print(
        f"transport {result['backend']} ({options}), {result['op']} "
        f"{format_bytes(result['size_bytes'])}, {result['repeats']} repeats"
    )
    for label, series in (
        (f"{result['ranges']['ranges']} x {format_bytes(result['range_bytes'])}", result["ranges"]),
        ("1 range (ceiling)", result["ceiling"]),
    ):
        print(
            f"  {label:<26} median {series['median_gbps']:6.2f} GB/s  "
            f"(min {series['min_gbps']:.2f}, max {series['max_gbps']:.2f})  "
            f"post {series['median_post_ms']:.2f} ms"
        )
    print(f"  ranges reach {result['fraction_of_ceiling']:.0%} of the ceiling; bytes verified")
