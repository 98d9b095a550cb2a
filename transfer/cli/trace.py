"""`pdxfer trace DIR`: where requests' time to first token went, from a trace directory."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from transfer.errors import InvalidInput, NotFound
from transfer.trace import TRACE_DIR_ENV


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "trace",
        help="hop-by-hop latency to the first token, from PDXFER_TRACE_DIR's files",
        description=(
            f"Read the files that `pdxfer serve` processes (router, prefill, decode) write "
            f"while {TRACE_DIR_ENV} names a directory, join them by request id, and print, "
            "for each hop between consecutive points of a request's path, the p50 and p90 "
            "over the requests (docs/workers.md, 'Tracing a request'). The processes' "
            "clocks must agree: one host, or hosts synchronised far below the hops."
        ),
    )
    parser.add_argument("directory", metavar="DIR", help=f"the directory {TRACE_DIR_ENV} named")
    parser.add_argument(
        "--json", action="store_true", help="print the hops as JSON (with min, max and count)"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transfer.bench.hops import format_hops, hop_table
    from transfer.trace import read_traces

    directory = Path(args.directory)
    if not directory.is_dir():
        raise NotFound(f"DIR: {directory} is not a directory")
    traces = read_traces(directory)
    if not traces:
        raise InvalidInput(f"DIR: no trace lines in {directory}/*.trace")
    hops = hop_table(traces)
    if args.json:
        print(json.dumps({"requests": len(traces), "hops_ms": [h.to_dict() for h in hops]}))
    else:
        print(f"{len(traces)} requests traced in {directory}")
        print(format_hops({"all": hops}))
    return 0
