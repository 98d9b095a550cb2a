"""The kernel benchmark's inputs: one `Case` per public op at a scale, with the byte and FLOP
models behind its GB/s and TFLOP/s. Torch is imported only when a case is built."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# serving: Qwen3-Next / Kimi-Linear-like shapes, Nemotron-Nano-12B-v2's Mamba2 at TP=2 (MH heads
# of MP, state MN, MG groups); medium: the GPU correctness check; tiny: a CPU smoke run through
# the Triton interpreter.
SCALES = {
    "serving": dict(T=8192, seqs=1, B=256, H=16, HV=32, KH=32, K=128, D=8192, pack=1 << 30,
                    blocks=65536, head_dim=256, MH=64, MP=80, MN=128, MG=4),
    "medium": dict(T=1000, seqs=3, B=16, H=4, HV=8, KH=8, K=128, D=1000, pack=64 << 20,
                   blocks=2048, head_dim=256, MH=8, MP=80, MN=128, MG=2),
    "tiny": dict(T=40, seqs=2, B=2, H=1, HV=2, KH=2, K=16, D=64, pack=256 << 10,
                 blocks=16, head_dim=32, MH=2, MP=12, MN=16, MG=1),
}  # fmt: skip
CHUNK = 64  # chunk size of the chunked scans (delta rule, Mamba2), for the FLOP models
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


def _scan_batch(s, chunked: bool, device):
    """(B, T, sequences, cu_seqlens) of a scan: the chunked (prefill) ops pack s["seqs"]
    sequences into s["T"] tokens, the recurrent (decode) ones step s["B"] requests one token."""
    if chunked:
        return 1, s["T"], s["seqs"], _cu_seqlens(s["T"], s["seqs"], device)
    return s["B"], 1, s["B"], None


def _with_final_state(op: str, inputs: dict, cu_seqlens) -> Callable[..., tuple]:
    """The scan op asked for its final state; cu_seqlens joins the inputs when sequences are
    packed."""
    import kernels

    if cu_seqlens is not None:
        inputs["cu_seqlens"] = cu_seqlens
    op_fn = getattr(kernels, op)

    def fn(**kw):
        return op_fn(**kw, output_final_state=True)

    return fn


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

        K = s["K"]
        H, HV = (s["KH"], s["KH"]) if per_key else (s["H"], s["HV"])
        B, T, n, cu = _scan_batch(s, chunked, device)
        g_shape = (B, T, HV, K) if per_key else (B, T, HV)
        inputs = dict(
            q=F.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dtype),
            k=F.normalize(torch.randn(B, T, H, K, device=device), dim=-1).to(dtype),
            v=torch.randn(B, T, HV, K, device=device, dtype=dtype),
            g=F.logsigmoid(torch.randn(g_shape, device=device) + 3).to(dtype),
            beta=torch.sigmoid(torch.randn(B, T, HV, device=device)).to(dtype),
            initial_state=0.1 * torch.randn(n, HV, K, K, device=device),
        )
        fn = _with_final_state(op, inputs, cu)
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


def _mamba2_case(op: str, chunked: bool):
    def build(s, dtype, device) -> Case:
        import torch
        import torch.nn.functional as F

        H, P, N, G = s["MH"], s["MP"], s["MN"], s["MG"]
        B, T, n, cu = _scan_batch(s, chunked, device)
        inputs = dict(
            x=torch.randn(B, T, H, P, device=device, dtype=dtype),
            dt=F.softplus(torch.randn(B, T, H, device=device) - 3),
            A=-torch.rand(H, device=device) * 8 - 1,
            B=torch.randn(B, T, G, N, device=device, dtype=dtype),
            C=torch.randn(B, T, G, N, device=device, dtype=dtype),
            D=torch.randn(H, device=device),
            initial_state=0.1 * torch.randn(n, H, P, N, device=device),
        )
        fn = _with_final_state(op, inputs, cu)
        size = torch.finfo(dtype).bits // 8
        tokens = B * T
        moved = size * tokens * (2 * H * P + 2 * G * N) + 4 * tokens * H  # x y B C, fp32 dt
        state = 2 * n * H * P * N * 4  # fp32 state in and out
        # chunked: 4PN (state update, C S) + 2C(N+P) (C B^T, its product with x) per token and
        # head; recurrent: 5PN (decay, rank-1 update, S C)
        flops = tokens * H * (4 * P * N + 2 * CHUNK * (N + P) if chunked else 5 * P * N)
        shape = f"B={B} T={T} H={H} P={P} N={N} G={G} seqs={n}"
        return Case(op, shape, fn, inputs, bytes=moved + state, flops=flops)

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
    "chunk_mamba2": _mamba2_case("chunk_mamba2", chunked=True),
    "recurrent_mamba2": _mamba2_case("recurrent_mamba2", chunked=False),
    "gather_ranges": _ranges_case("gather_ranges"),
    "scatter_ranges": _ranges_case("scatter_ranges"),
    "gather_blocks": _blocks_case("gather_blocks"),
    "scatter_blocks": _blocks_case("scatter_blocks"),
}
