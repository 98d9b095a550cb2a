"""One script for a GPU box: Triton vs torch on CUDA at medium shapes, then the benchmark.

    python -m kernels.gpu_check [--skip-bench] [--json-out results.json]

Prints the worst relative error per op and dtype (the fraction of differing elements
for the bit-exact pack ops) against the test bounds, then the `pdxfer bench kernels
--json` figures (bf16, serving shapes) and a summary table. Exits 1 when a comparison
fails, 2 without CUDA. Budget: about 5 minutes on an H200, Triton compilation included.
`--cpu-smoke` runs the comparisons at tiny shapes through the Triton interpreter, to
check the script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from kernels.bench import OPS, format_table, run_benchmarks, with_backend
from kernels.bench_cases import make_case

BOUNDS = {"fp32": 1e-4, "bf16": 1e-2}
INT_DTYPES = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def compare(op: str, dtype: str, scale: str, device: str) -> tuple[float, float, str]:
    """(worst error, bound, shape) of Triton vs torch over every output of op.

    Error: ‖out−ref‖/‖ref‖ with NaN -> inf; for exact ops the fraction of elements whose
    bits differ, with bound 0.
    """
    import torch

    case = make_case(op, dtype, scale, device)

    def run(backend: str):
        inputs = {k: v.clone() if torch.is_tensor(v) else v for k, v in case.inputs.items()}
        outputs = with_backend(backend, lambda: case.fn(**inputs))
        if device == "cuda":
            torch.cuda.synchronize()
        return outputs

    worst = 0.0
    for ref, out in zip(run("torch"), run("triton"), strict=True):
        if case.exact:
            as_int = getattr(torch, INT_DTYPES[ref.element_size()])
            differ = ref.contiguous().view(as_int) != out.contiguous().view(as_int)
            err = differ.float().mean().item()
        elif not torch.isfinite(out).all():
            err = float("inf")
        else:
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
        worst = max(worst, err)
    return worst, 0.0 if case.exact else BOUNDS[dtype], case.shape


def check_all(scale: str, device: str) -> list[str]:
    """Print one line per op and dtype; return the failing ones."""
    import torch

    failures = []
    print(f"{'op':<22}{'dtype':<6}{'error':>11}{'bound':>8}  result  shape")
    for dtype in BOUNDS:
        for op in OPS:
            torch.manual_seed(0)
            try:
                err, bound, shape = compare(op, dtype, scale, device)
            except Exception as exc:  # report every op, even when one is broken
                failures.append(f"{op}/{dtype}")
                print(f"{op:<22}{dtype:<6}{'-':>11}{'-':>8}  ERROR   {type(exc).__name__}: {exc}")
                continue
            ok = err <= bound if bound == 0.0 else err < bound
            if not ok:
                failures.append(f"{op}/{dtype}")
            print(
                f"{op:<22}{dtype:<6}{err:>11.2e}{bound:>8.0e}  {'ok' if ok else 'FAIL':<6}  {shape}"
            )
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernels.gpu_check",
        description="Triton vs torch on CUDA at medium shapes, then the kernel benchmark.",
    )
    parser.add_argument("--skip-bench", action="store_true", help="comparisons only")
    parser.add_argument("--json-out", help="also write the benchmark JSON to this file")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="no GPU: tiny comparisons through the Triton interpreter, no bench")  # fmt: skip
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is jitted

    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("kernels.gpu_check: needs a CUDA GPU (none found); see --cpu-smoke", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu_smoke else "cuda"
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    print(f"device: {name}  torch {torch.__version__}")
    start = time.perf_counter()
    failures = check_all("tiny" if args.cpu_smoke else "medium", device)
    print(f"comparisons: {time.perf_counter() - start:.0f} s, failures: {failures or 'none'}")

    if not (args.skip_bench or args.cpu_smoke):
        results = []
        for op in OPS:
            try:
                results += run_benchmarks([op], "bf16", "serving")
            except Exception as exc:
                failures.append(f"bench {op}")
                print(f"bench {op}: ERROR {type(exc).__name__}: {exc}")
            torch.cuda.empty_cache()
        print(json.dumps(results, indent=2))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(results, f, indent=2)
        print(format_table(results))
        print(f"total: {time.perf_counter() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
