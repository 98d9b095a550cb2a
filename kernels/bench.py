"""`pdxfer bench kernels`: Triton vs the torch reference for every public op, on a GPU.

Times the public op (validation and dispatch included): CUDA events, warmup, median of
repeats. Bytes and FLOPs come from simple per-op models (see `bench_cases`), so GB/s and
TFLOP/s compare kernels and shapes, not hardware peaks. Never run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import kernels
from kernels.bench_cases import Case, make_case

OPS = tuple(name for name in kernels.__all__ if name != "use_triton")
DTYPES = ("bf16", "fp32")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "kernels",
        help="Triton vs torch reference for every kernel op (needs a GPU)",
        description="Time the Triton kernels against the torch references at serving-like "
        "shapes; report GB/s and TFLOP/s. Needs CUDA unless --allow-cpu.",
    )
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS), metavar="OP",
                        help=f"ops to time (default all): {', '.join(OPS)}")  # fmt: skip
    parser.add_argument("--dtype", choices=DTYPES, default="bf16", help="input dtype")
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per op and backend")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--allow-cpu", action="store_true",
                        help="without CUDA: a tiny smoke run (Triton interpreter), no real figures")  # fmt: skip
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    if args.repeats < 1:
        raise ValueError(f"--repeats: expected >= 1, got {args.repeats}")
    if not torch.cuda.is_available() and not args.allow_cpu:
        print(
            "pdxfer bench kernels: needs a CUDA GPU (none found); "
            "use --allow-cpu for a tiny smoke run without meaningful figures",
            file=sys.stderr,
        )
        return 2
    scale = "serving" if torch.cuda.is_available() else "tiny"
    results = run_benchmarks(args.ops, args.dtype, scale, args.repeats)
    print(json.dumps(results, indent=2) if args.json else format_table(results))
    return 0


def run_benchmarks(ops, dtype: str, scale: str, repeats: int = 20) -> list[dict]:
    """Time each op with both backends; one result dict per op."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is jitted
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    results = []
    for op in ops:
        case = make_case(op, dtype, scale, device)
        row = {"op": op, "shape": case.shape, "dtype": dtype, "device": device_name}
        for backend in ("triton", "torch"):
            ms = _median_ms(case, backend, repeats, device)
            row[f"{backend}_ms"] = round(ms, 4)
            row[f"{backend}_gb_s"] = round(case.bytes / ms / 1e6, 2)
            row[f"{backend}_tflop_s"] = round(case.flops / ms / 1e9, 4)
        row["speedup"] = round(row["torch_ms"] / row["triton_ms"], 2)
        results.append(row)
        del case
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def format_table(results: list[dict]) -> str:
    header = f"{'op':<22}{'triton ms':>11}{'GB/s':>9}{'TFLOP/s':>9}{'torch ms':>11}{'GB/s':>9}{'x':>7}  shape"
    lines = [header]
    for r in results:
        lines.append(
            f"{r['op']:<22}{r['triton_ms']:>11.3f}{r['triton_gb_s']:>9.1f}"
            f"{r['triton_tflop_s']:>9.3f}{r['torch_ms']:>11.3f}{r['torch_gb_s']:>9.1f}"
            f"{r['speedup']:>7.1f}  {r['shape']}"
        )
    return "\n".join(lines)


def with_backend(backend: str, fn: Callable[[], Any]) -> Any:
    """Run fn with PDXFER_KERNEL_BACKEND forced, restoring the previous value."""
    from kernels.backend import ENV_VAR

    previous = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = backend
    try:
        return fn()
    finally:
        if previous is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = previous


def _median_ms(case: Case, backend: str, repeats: int, device: str, budget_s: float = 3.0) -> float:
    import torch

    def timed() -> float:
        if device != "cuda":
            start = time.perf_counter()
            case.fn(**case.inputs)
            return (time.perf_counter() - start) * 1e3
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        case.fn(**case.inputs)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)

    def measure() -> float:
        for _ in range(2):  # warmup: compile, autotune caches, allocator
            timed()
        times, start = [], time.perf_counter()
        while len(times) < repeats and (len(times) < 3 or time.perf_counter() - start < budget_s):
            times.append(timed())
        return statistics.median(times)

    return with_backend(backend, measure)
