"""Mamba2 (SSD): Triton (under TRITON_INTERPRET=1, see conftest) against the torch reference, the
reference against transformers' Nemotron-H torch fallback, chunked against recurrent, packed
sequences, prefill-then-decode against one pass, and argument validation."""

import inspect
import os
from itertools import pairwise

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined (conftest does too)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.mamba2 import chunk_mamba2, recurrent_mamba2  # noqa: E402
from kernels.mamba2.naive import naive_chunk_mamba2, naive_recurrent_mamba2  # noqa: E402

FP32_BOUND = 1e-5
BF16_BOUND = 1e-2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_inputs(B=1, T=70, H=4, P=12, G=2, N=24, dtype=torch.float32, n_states=None, dt_shift=-1.0):
    """Random x, dt (softplus, > 0), A (< 0), B, C, D and an fp32 initial state."""
    return dict(
        x=torch.randn(B, T, H, P).to(dtype),
        dt=F.softplus(torch.randn(B, T, H) + dt_shift),
        A=-(torch.rand(H) * 3 + 0.5),
        B=torch.randn(B, T, G, N).to(dtype),
        C=torch.randn(B, T, G, N).to(dtype),
        D=torch.randn(H),
        initial_state=torch.randn(n_states or B, H, P, N) * 0.5,
    )


def tokens(x: dict, start: int, stop: int) -> dict:
    """The token slice [start, stop) of every per-token input (A, D and the state are kept)."""
    per_token = ("x", "dt", "B", "C")
    return {name: t[:, start:stop] if name in per_token else t for name, t in x.items()}


CASES = {
    "fp32-B2-T80-G2-h0": dict(B=2, T=80, H=4, P=12, G=2, N=24, dtype=torch.float32, h0=True),
    "bf16-T90-G1-noD": dict(B=1, T=90, H=2, P=16, G=1, N=32, dtype=torch.bfloat16, h0=False),
}


@pytest.mark.kernels
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_triton_chunk_and_recurrent_match_naive(case, backend, rel_err):
    backend("triton")
    spec = dict(CASES[case])
    dtype, h0 = spec.pop("dtype"), spec.pop("h0")
    x = make_inputs(**spec, dtype=dtype)
    if not h0:
        x["initial_state"], x["D"] = None, None
    bound = FP32_BOUND if dtype == torch.float32 else BF16_BOUND
    fp32 = {name: t if t is None else t.float() for name, t in x.items()}
    ref_y, ref_s = naive_chunk_mamba2(**fp32, output_final_state=True)

    y, s = chunk_mamba2(**x, output_final_state=True)
    assert y.dtype == dtype and s.dtype == torch.float32
    assert rel_err(y, ref_y) < bound and rel_err(s, ref_s) < bound

    y_rec, s_rec = recurrent_mamba2(**x, output_final_state=True)
    assert rel_err(y_rec, ref_y) < bound and rel_err(s_rec, ref_s) < bound


@pytest.mark.kernels
@pytest.mark.parametrize("chunk_size", [16, 32])
def test_triton_strong_decay_stays_finite_and_exact(chunk_size, backend, rel_err):
    """dt A around -20 a token: a chunk spans exp(-600), so any decay formed outside the causal
    mask, exp(+600), overflows."""
    backend("triton")
    x = make_inputs(T=45, dt_shift=2.0)
    x["A"] = torch.full_like(x["A"], -8.0)
    ref_y, ref_s = naive_recurrent_mamba2(**x, output_final_state=True)
    y, s = chunk_mamba2(**x, output_final_state=True, chunk_size=chunk_size)
    assert rel_err(y, ref_y) < FP32_BOUND and rel_err(s, ref_s) < FP32_BOUND


@pytest.mark.kernels
def test_triton_varlen_matches_separate_sequences(backend, rel_err):
    backend("triton")
    cu = torch.tensor([0, 37, 101, 101, 130], dtype=torch.int32)  # lengths 37, 64, 0, 29
    x = make_inputs(B=1, T=130, H=2, P=16, G=1, N=16, n_states=4)
    y, s = chunk_mamba2(**x, output_final_state=True, cu_seqlens=cu)
    y_rec, s_rec = recurrent_mamba2(**x, output_final_state=True, cu_seqlens=cu.long())
    for n, (bos, eos) in enumerate(pairwise(cu.tolist())):
        one = {**tokens(x, bos, eos), "initial_state": x["initial_state"][n : n + 1]}
        ref_y, ref_s = naive_recurrent_mamba2(**one, output_final_state=True)
        assert rel_err(s[n : n + 1], ref_s) < FP32_BOUND
        assert rel_err(s_rec[n : n + 1], ref_s) < FP32_BOUND
        if eos > bos:
            assert rel_err(y[:, bos:eos], ref_y) < FP32_BOUND
            assert rel_err(y_rec[:, bos:eos], ref_y) < FP32_BOUND


@pytest.mark.kernels
def test_triton_prefill_then_decode_equals_one_pass(backend, rel_err):
    """Prefill 67 tokens, decode one token, then two at once (a speculative step)."""
    backend("triton")
    T = 67
    x = make_inputs(B=2, T=T + 3, H=4, P=8, G=2, N=16)
    full_y, full_s = naive_recurrent_mamba2(**x, output_final_state=True)
    y, state = chunk_mamba2(**tokens(x, 0, T), output_final_state=True)
    outs = [y]
    for start, stop in [(T, T + 1), (T + 1, T + 3)]:
        step = {**tokens(x, start, stop), "initial_state": state}
        y_t, state = recurrent_mamba2(**step, output_final_state=True)
        outs.append(y_t)
    assert rel_err(torch.cat(outs, dim=1), full_y) < FP32_BOUND
    assert rel_err(state, full_s) < FP32_BOUND


@pytest.mark.kernels
def test_triton_no_tokens_returns_initial_state(backend):
    backend("triton")
    x = make_inputs(B=2, T=0)
    for op in (chunk_mamba2, recurrent_mamba2):
        y, s = op(**x, output_final_state=True)
        assert y.shape == (2, 0, 4, 12) and torch.equal(s, x["initial_state"])


def test_naive_matches_transformers_nemotron_h_fallback(rel_err):
    """The reference is the maths of transformers' Nemotron-H torch path: its chunk scan for
    prefill, its selective state update for a decode step (dt already softplus'd here)."""
    nemotron = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    x = make_inputs(B=2, T=70, H=4, P=8, G=2, N=16)
    y, s = naive_chunk_mamba2(**x, output_final_state=True)
    ref_y, ref_s = nemotron.mamba2_chunk_scan.__wrapped__(
        x["x"], x["dt"], x["A"], x["B"], x["C"], chunk_size=32, D=x["D"],
        initial_states=x["initial_state"], return_final_states=True,
    )  # fmt: skip
    assert rel_err(y, ref_y) < 1e-6 and rel_err(s, ref_s) < 1e-6

    state, (P, N) = x["initial_state"].clone(), x["initial_state"].shape[2:]
    ref_y = nemotron.mamba2_selective_state_update.__wrapped__(
        state, x["x"][:, 0], x["dt"][:, 0, :, None].expand(-1, -1, P),
        x["A"][:, None, None].expand(-1, P, N), x["B"][:, 0], x["C"][:, 0],
        x["D"][:, None].expand(-1, P),
    )  # fmt: skip
    y, s = naive_recurrent_mamba2(**tokens(x, 0, 1), output_final_state=True)
    assert rel_err(y[:, 0], ref_y) < 1e-6 and rel_err(s, state) < 1e-6


def test_naive_chunk_equals_naive_recurrent(rel_err):
    x = make_inputs(B=2, T=100)
    ref_y, ref_s = naive_recurrent_mamba2(**x, output_final_state=True)
    for chunk_size in (16, 64):
        y, s = naive_chunk_mamba2(**x, output_final_state=True, chunk_size=chunk_size)
        assert rel_err(y, ref_y) < FP32_BOUND and rel_err(s, ref_s) < FP32_BOUND


def test_torch_backend_runs_the_naive_reference(backend):
    backend("torch")
    x = make_inputs(T=20)
    y, s = chunk_mamba2(**x, output_final_state=True)
    ref_y, ref_s = naive_chunk_mamba2(**x, output_final_state=True)
    assert torch.equal(y, ref_y) and torch.equal(s, ref_s)


def test_bound_catches_plausible_bugs(rel_err):
    """Few tokens, so the initial state still weighs: a strong decay forgets it within ~10."""
    x = make_inputs(B=2, T=8, H=4, G=2)
    ref_y, _ = naive_recurrent_mamba2(**x)
    # head h reads group h // (H/G); a kernel reading h % G (B tiled, not interleaved) is wrong
    tiled = torch.arange(4) % 2
    bugs = {
        "group read as h % G": naive_recurrent_mamba2(
            **{**x, "B": x["B"][:, :, tiled], "C": x["C"][:, :, tiled]}
        )[0],
        "B and C swapped": naive_recurrent_mamba2(**{**x, "B": x["C"], "C": x["B"]})[0],
        "D skip dropped": naive_recurrent_mamba2(**{**x, "D": None})[0],
        "dt applied to x twice": naive_recurrent_mamba2(**{**x, "x": x["x"] * x["dt"][..., None]})[
            0
        ],
        "state dropped": naive_recurrent_mamba2(**{**x, "initial_state": None})[0],
    }
    for bug, wrong in bugs.items():
        assert rel_err(wrong, ref_y) > 10 * BF16_BOUND, bug


def good_args(B=1, T=8, H=4, P=8, G=2, N=16) -> dict:
    return dict(
        x=torch.randn(B, T, H, P),
        dt=torch.rand(B, T, H),
        A=-torch.rand(H),
        B=torch.randn(B, T, G, N),
        C=torch.randn(B, T, G, N),
        D=torch.randn(H),
        initial_state=torch.zeros(B, H, P, N),
    )


BAD_ARGS = {
    "x ndim": (dict(x=torch.randn(8, 4, 8)), r"x: expected \[B,T,H,P\]"),
    "dt shape": (dict(dt=torch.rand(1, 8, 4, 8)), r"dt: expected shape \(1, 8, 4\)"),
    "G not dividing H": (dict(B=torch.randn(1, 8, 3, 16)), r"G=3 .*H=4"),
    "C shape": (dict(C=torch.randn(1, 8, 2, 8)), r"C: expected shape \(1, 8, 2, 16\)"),
    "A shape": (dict(A=-torch.rand(4, 1)), r"A: expected shape \(4,\)"),
    "D shape": (dict(D=torch.randn(2)), r"D: expected shape \(4,\)"),
    "x dtype": (dict(x=torch.randn(1, 8, 4, 8).double()), r"x: dtype torch.float64"),
    "B dtype differs": (dict(B=torch.randn(1, 8, 2, 16).bfloat16()), r"B: dtype .*x's"),
    "state dtype": (
        dict(initial_state=torch.zeros(1, 4, 8, 16).bfloat16()),
        "initial_state: dtype",
    ),
    "state layout [H,N,P]": (
        dict(initial_state=torch.zeros(1, 4, 16, 8)),
        r"initial_state: expected shape \(1, 4, 8, 16\) \(N_seq, H, P, N\)",
    ),
    "device": (dict(dt=torch.rand(1, 8, 4, device="meta")), r"dt: on device meta"),
    "cu_seqlens B": (
        {**good_args(B=2), "cu_seqlens": torch.tensor([0, 8])},
        r"cu_seqlens: requires B == 1.*x of shape \(2, 8, 4, 8\)",
    ),
    "cu_seqlens end": (dict(cu_seqlens=torch.tensor([0, 5])), r"cu_seqlens: .*T=8"),
}


@pytest.mark.parametrize("op", [chunk_mamba2, recurrent_mamba2], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("bad", BAD_ARGS, ids=list(BAD_ARGS))
def test_bad_arguments_raise_value_error(op, bad):
    override, pattern = BAD_ARGS[bad]
    with pytest.raises(ValueError, match=pattern):
        op(**{**good_args(), **override})


def test_bad_chunk_size_and_too_large_state(backend):
    with pytest.raises(ValueError, match="chunk_size: expected one of"):
        chunk_mamba2(**good_args(), chunk_size=128)
    backend("triton")
    for op in (chunk_mamba2, recurrent_mamba2):
        with pytest.raises(ValueError, match="N=320"):
            op(**{**good_args(N=320), "initial_state": None})


def sm90_job(name: str, constexprs: dict) -> tuple:
    """A compile job for the conftest's compile_sm90: bf16 inputs, every tensor 16-byte aligned."""
    module = "kernels.mamba2.triton"
    types = dict(x="*bf16", B="*bf16", C="*bf16", y="*bf16", cu_seqlens="*i64")
    types |= dict(chunk_indices="*i32", chunk_offsets="*i64")
    kernel = getattr(__import__(module, fromlist=[name]), name)
    signature = {
        arg: "constexpr" if arg in constexprs else types.get(arg, "*fp32")
        for arg in inspect.signature(kernel.fn).parameters
    }
    aligned = [arg for arg, kind in signature.items() if kind.startswith("*")]
    return module, name, signature, constexprs, aligned


@pytest.mark.kernels
def test_kernels_compile_for_sm90(compile_sm90):
    """Nemotron-Nano-12B-v2 at TP=2: 64 heads of P=80, N=128, 8 groups; tf32 products."""
    shape = dict(H=64, G=8, P=80, N=128, BP=32)
    flags = dict(HAS_H0=True, STORE_FINAL=True)
    jobs = [
        sm90_job("state_passing_kernel", dict(shape, BT=64, BS=32, BN=128, PREC="tf32", **flags)),
        sm90_job("output_kernel", dict(shape, BT=64, BN=64, HAS_D=True, PREC="tf32")),
        sm90_job("recurrent_kernel", dict(shape, BN=128, HAS_D=True, **flags)),
    ]
    assert all(".entry" in ptx for ptx in compile_sm90(jobs))
