"""`pdxfer` command line: one module per subcommand, each exposing `register(subparsers)`."""

from __future__ import annotations

import argparse
import sys

from transfer.cli import bench, launch, make_tiny, plan, serve, trace, up
from transfer.errors import CapacityError, NotFound


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdxfer",
        description=(
            "Move a request's cache (paged KV blocks + linear-attention S&Conv state) "
            "from prefill workers to decode workers, for hybrid models."
        ),
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (plan, serve, launch, up, bench, trace, make_tiny):
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point. Bad input, or a request that cannot fit, exits 2 with a message."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, CapacityError, NotFound, FileNotFoundError) as exc:
        print(f"pdxfer {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pdxfer {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
