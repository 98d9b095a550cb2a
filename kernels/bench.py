"""`pdxfer bench kernels`: Triton vs the torch reference for every public op, on a GPU.

Times the public op (validation and dispatch included): CUDA events, warmup, median of
repeats. Bytes and FLOPs come from simple per-op models (see `_CASES`), so GB/s and
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
from dataclasses import dataclass
from typing import Any

import kernels

OPS = tuple(name for name in kernels.__all__ if name != "use_triton")
DTYPES = ("bf16", "fp32")
# serving: Qwen3-Next / Kimi-Linear-like shapes; medium: the GPU correctness check;
# tiny: a CPU smoke run through the Triton interpreter.
SCALES = {
    "serving": dict(T=8192, seqs=1, B=256, H=16, HV=32, KH=32, K=128, D=8192, pack=1 << 30,
                    blocks=65536, head_dim=256),
    "medium": dict(T=1000, seqs=3, B=16, H=4, HV=8, KH=8, K=128, D=1000, pack=64 << 20,
                   blocks=2048, head_dim=256),
    "tiny": dict(T=40, seqs=2, B=2, H=1, HV=2, KH=2, K=16, D=64, pack=256 << 10,
                 blocks=16, head_dim=32),
}  # fmt: skip
CHUNK = 64  # chunk size of the chunked delta rule, for the FLOP model
CONV_WIDTH = 4
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Case:
    """One op at one shape: fn(**inputs) runs the public op and returns what it produced
    (outputs, and the tensors it wrote in place); exact: compare bits, not rel error."""

    op: str
    shape: str
    fn: Callable[..., tuple]
    inputs: dict[str, Any]
    bytes: int
    flops: int
    exact: bool = False


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


def make_case(op: str, dtype: str, scale: str, device: str) -> Case:
    """Inputs for op at a scale ("serving", "medium", "tiny") on device."""
    import torch

    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    return _CASES[op](SCALES[scale], torch_dtype, torch.device(device))


def _cu_seqlens(total: int, seqs: int, device):
    """Offsets of `seqs` sequences of uneven lengths summing to total (None for one)."""
    import torch

    if seqs == 1:
        return None
    cuts = sorted(total * (2 * i + 1) // (2 * seqs + 1) for i in range(1, seqs))
    return torch.tensor([0, *cuts, total], dtype=torch.int64, device=device)


def _conv_case(s, dtype, device) -> Case:
    import torch

    from kernels.conv1d import causal_conv1d

    T, D, W = s["T"], s["D"], CONV_WIDTH
    cu = _cu_seqlens(T, s["seqs"], device)
    n = s["seqs"]
    inputs = dict(
        x=torch.randn(1, T, D, device=device, dtype=dtype),
        weight=torch.randn(D, W, device=device, dtype=dtype),
        bias=torch.randn(D, device=device, dtype=dtype),
        initial_state=torch.randn(n, D, W - 1, device=device, dtype=dtype),
        cu_seqlens=cu,
    )
    size = torch.finfo(dtype).bits // 8

    def fn(**kw):
        return causal_conv1d(**kw, output_final_state=True)

    return Case("causal_conv1d", f"T={T} D={D} W={W} seqs={n}", fn, inputs,
                bytes=size * (2 * T * D + 2 * n * D * (W - 1)), flops=2 * W * T * D)  # fmt: skip


def _conv_update_case(s, dtype, device) -> Case:
    import torch

    from kernels.conv1d import causal_conv1d_update

    B, D, W = s["B"], s["D"], CONV_WIDTH
    # time-major arena slots seen through a [B, D, W-1] view, as a decode engine holds them
    arena = torch.randn(B, W - 1, D, device=device, dtype=dtype)
    inputs = dict(
        x=torch.randn(B, D, device=device, dtype=dtype),
        conv_state=arena.transpose(1, 2),
        weight=torch.randn(D, W, device=device, dtype=dtype),
        bias=torch.randn(D, device=device, dtype=dtype),
    )

    def fn(**kw):
        return causal_conv1d_update(**kw), kw["conv_state"]

    size = torch.finfo(dtype).bits // 8
    return Case("causal_conv1d_update", f"B={B} D={D} W={W} state time-major", fn, inputs,
                bytes=size * B * D * (2 + 2 * (W - 1)), flops=2 * W * B * D)  # fmt: skip


def _delta_case(op: str, per_key: bool, chunked: bool):
    def build(s, dtype, device) -> Case:
        import torch
        import torch.nn.functional as F

        import kernels

        K = s["K"]
        H, HV = (s["KH"], s["KH"]) if per_key else (s["H"], s["HV"])
        if chunked:
            B, T, n = 1, s["T"], s["seqs"]
            cu = _cu_seqlens(T, n, device)
        else:
            B, T, n, cu = s["B"], 1, s["B"], None
        g_shape = (B, T, HV, K) if per_key else (B, T, HV)
        inputs = dict(
            q=F.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dtype),
            k=F.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dtype),
            v=torch.randn(B, T, HV, K, device=device, dtype=dtype),
            g=F.logsigmoid(torch.randn(g_shape, device=device) + 3).to(dtype),
            beta=torch.sigmoid(torch.randn(B, T, HV, device=device)).to(dtype),
            initial_state=0.1 * torch.randn(n, HV, K, K, device=device),
        )
        if cu is not None:
            inputs["cu_seqlens"] = cu
        op_fn = getattr(kernels, op)

        def fn(**kw):
            return op_fn(**kw, output_final_state=True)

        size = torch.finfo(dtype).bits // 8
        tokens = B * T
        per_token = 2 * H * K + 2 * HV * K + HV + (HV * K if per_key else HV)  # q k v o g beta
        state = 2 * n * HV * K * K * 4  # fp32 state in and out
        # chunked: 6KV + 4C(K+V) per token and value head (WY form, solve excluded);
        # recurrent: 7KV (decay, S^T k, rank-1 update, S^T q)
        flops = tokens * HV * (6 * K * K + 8 * CHUNK * K if chunked else 7 * K * K)
        shape = f"B={B} T={T} H={H} HV={HV} K=V={K} seqs={n}"
        return Case(op, shape, fn, inputs, bytes=size * tokens * per_token + state, flops=flops)

    return build


def _range_layout(total: int, device):
    """Shuffled, non-adjacent 4 KiB..64 KiB ranges covering about `total` bytes."""
    import torch

    page = 4096
    count = max(1, total // (page * 8))
    lengths = torch.randint(1, 17, (count,)) * page
    gaps = torch.randint(1, 4, (count,)) * page
    offsets = torch.cumsum(lengths + gaps, 0) - lengths
    order = torch.randperm(count)
    arena_bytes = int(offsets[-1] + lengths[-1])
    return offsets[order].to(device), lengths[order].to(device), arena_bytes


def _ranges_case(op: str):
    def build(s, dtype, device) -> Case:
        import torch

        import kernels

        offsets, lengths, arena_bytes = _range_layout(s["pack"], device)
        total = int(lengths.sum())
        arena = torch.randint(0, 256, (arena_bytes,), dtype=torch.uint8, device=device)
        staging = torch.randint(0, 256, (total,), dtype=torch.uint8, device=device)
        if op == "gather_ranges":
            inputs = dict(src=arena, offsets=offsets, lengths=lengths, out=staging)

            def fn(**kw):
                return (kernels.gather_ranges(**kw),)
        else:
            inputs = dict(staging=staging, dst=arena, offsets=offsets, lengths=lengths)

            def fn(**kw):
                kernels.scatter_ranges(**kw)
                return (kw["dst"],)

        shape = f"{total / 2**20:.2f} MiB in {len(offsets)} ranges of 4-64 KiB"
        return Case(op, shape, fn, inputs, bytes=2 * total, flops=0, exact=True)

    return build


def _blocks_case(op: str):
    def build(s, dtype, device) -> Case:
        import torch

        import kernels

        heads, head_dim, num_blocks = 2, s["head_dim"], s["blocks"]
        # head-major arena (a rank's heads outermost), seen as [blocks, block_size, heads, dim]
        arena = torch.randn(heads, num_blocks, BLOCK_SIZE, head_dim, device=device).to(dtype)
        cache = arena.permute(1, 2, 0, 3)
        ids = torch.randperm(num_blocks, device=device)[: num_blocks // 2]
        staging = torch.randn(len(ids), BLOCK_SIZE, 1, head_dim, device=device).to(dtype)
        if op == "gather_blocks":
            inputs = dict(cache=cache, block_ids=ids, head_start=1, head_end=2, out=staging)

            def fn(**kw):
                return (kernels.gather_blocks(**kw),)
        else:
            inputs = dict(staging=staging, cache=cache, block_ids=ids, head_start=1, head_end=2)

            def fn(**kw):
                kernels.scatter_blocks(**kw)
                return (kw["cache"],)

        moved = staging.numel() * staging.element_size()
        shape = (
            f"{len(ids)} of {num_blocks} blocks x{BLOCK_SIZE}, head 1 of {heads}, dim {head_dim}"
        )
        return Case(op, shape, fn, inputs, bytes=2 * moved, flops=0, exact=True)

    return build


_CASES = {
    "causal_conv1d": _conv_case,
    "causal_conv1d_update": _conv_update_case,
    "chunk_gdn": _delta_case("chunk_gdn", per_key=False, chunked=True),
    "recurrent_gdn": _delta_case("recurrent_gdn", per_key=False, chunked=False),
    "chunk_kda": _delta_case("chunk_kda", per_key=True, chunked=True),
    "recurrent_kda": _delta_case("recurrent_kda", per_key=True, chunked=False),
    "gather_ranges": _ranges_case("gather_ranges"),
    "scatter_ranges": _ranges_case("scatter_ranges"),
    "gather_blocks": _blocks_case("gather_blocks"),
    "scatter_blocks": _blocks_case("scatter_blocks"),
}
