"""`pdxfer bench ...`: benchmarks. Each benchmark module exposes `register(subparsers)`."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="transfer, transport, serving and kernel benchmarks",
        description="Benchmarks. Timing lives here, never in pass/fail tests.",
    )
    bench_subparsers = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for register_bench in _benchmarks():
        register_bench(bench_subparsers)


def _benchmarks() -> list:
    # Benchmark modules import their heavy dependencies (transports, Triton) inside
    # their run functions, so building this parser stays cheap.
    from kernels import bench as kernels_bench
    from transfer.bench import control as control_bench
    from transfer.bench import transport as transport_bench
    from transfer.cli import bench_serve as serve_bench
    from transfer.cli import bench_step as step_bench
    from transfer.cli import bench_transfer as transfer_bench
    from transfer.cli import bench_vllm as vllm_bench

    return [
        kernels_bench.register,
        control_bench.register,
        transport_bench.register,
        transfer_bench.register,
        serve_bench.register,
        step_bench.register,
        vllm_bench.register,
    ]
