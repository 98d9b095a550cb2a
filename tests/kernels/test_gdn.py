"""Gated DeltaNet: Triton (under TRITON_INTERPRET=1, see conftest) against the torch reference,
chunked against recurrent, prefill-then-decode against one pass, and argument validation."""

import inspect
import os
from itertools import pairwise

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined (conftest does too)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.gdn import chunk_gdn, recurrent_gdn  # noqa: E402
from kernels.gdn.naive import naive_chunk_gdn, naive_recurrent_gdn  # noqa: E402

FP32_BOUND = 1e-5
BF16_BOUND = 1e-2


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny shapes gain nothing from threads, and on a shared 2-core box they thrash (40x)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_inputs(B=1, T=70, H=1, HV=2, K=16, V=32, dtype=torch.float32, n_states=None) -> dict:
    """Fresh random q, k, v, g (logsigmoid, < 0), beta (sigmoid) and an fp32 initial state."""
    return dict(
        q=torch.randn(B, T, H, K).to(dtype),
        k=torch.randn(B, T, H, K).to(dtype),
        v=torch.randn(B, T, HV, V).to(dtype),
        g=F.logsigmoid(torch.randn(B, T, HV) + 2).to(dtype),
        beta=torch.sigmoid(torch.randn(B, T, HV)).to(dtype),
        initial_state=torch.randn(n_states or B, HV, K, V) * 0.5,
    )


def tokens(x: dict, start: int, stop: int) -> dict:
    """The token slice [start, stop) of every per-token input (the state is dropped)."""
    return {name: t[:, start:stop] for name, t in x.items() if name != "initial_state"}


CASES = {
    "fp32-B2-T100-h0": dict(B=2, T=100, H=1, HV=2, K=16, V=32, dtype=torch.float32, h0=True),
    "bf16-T90-HV4": dict(B=1, T=90, H=2, HV=4, K=32, V=16, dtype=torch.bfloat16, h0=False),
}


@pytest.mark.kernels
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_triton_chunk_and_recurrent_match_naive(case, backend, rel_err):
    backend("triton")
    spec = dict(CASES[case])
    dtype, h0 = spec.pop("dtype"), spec.pop("h0")
    x = make_inputs(**spec, dtype=dtype)
    if not h0:
        x["initial_state"] = None
    bound = FP32_BOUND if dtype == torch.float32 else BF16_BOUND
    fp32 = {name: t if t is None else t.float() for name, t in x.items()}
    ref_o, ref_s = naive_chunk_gdn(**fp32, output_final_state=True, use_qk_l2norm=True)

    o, s = chunk_gdn(**x, output_final_state=True, use_qk_l2norm=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert rel_err(o, ref_o) < bound and rel_err(s, ref_s) < bound

    o_rec, s_rec = recurrent_gdn(**x, output_final_state=True, use_qk_l2norm=True)
    assert rel_err(o_rec, ref_o) < bound and rel_err(s_rec, ref_s) < bound
    assert rel_err(o_rec, o) < bound and rel_err(s_rec, s) < bound


@pytest.mark.kernels
def test_triton_chunk_without_l2norm_at_other_chunk_sizes(backend, rel_err):
    backend("triton")
    x = make_inputs(B=1, T=45, H=2, HV=2, K=32, V=16)
    x["q"], x["k"] = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
    ref_o, ref_s = naive_recurrent_gdn(**x, scale=0.3, output_final_state=True)
    o, s = chunk_gdn(**x, scale=0.3, output_final_state=True, chunk_size=32)
    assert rel_err(o, ref_o) < FP32_BOUND and rel_err(s, ref_s) < FP32_BOUND
    o, no_state = chunk_gdn(**x, scale=0.3, chunk_size=16)
    assert no_state is None and rel_err(o, ref_o) < FP32_BOUND


@pytest.mark.kernels
def test_triton_varlen_matches_separate_sequences(backend, rel_err):
    backend("triton")
    cu = torch.tensor([0, 37, 101, 101, 130], dtype=torch.int32)  # lengths 37, 64, 0, 29
    x = make_inputs(B=1, T=130, H=1, HV=2, K=16, V=16, n_states=4)
    o, s = chunk_gdn(**x, output_final_state=True, use_qk_l2norm=True, cu_seqlens=cu)
    o_rec, s_rec = recurrent_gdn(**x, output_final_state=True, use_qk_l2norm=True, cu_seqlens=cu)
    for n, (bos, eos) in enumerate(pairwise(cu.tolist())):
        h0 = x["initial_state"][n : n + 1]
        ref_o, ref_s = naive_recurrent_gdn(
            **tokens(x, bos, eos), initial_state=h0, output_final_state=True, use_qk_l2norm=True
        )
        assert rel_err(s[n : n + 1], ref_s) < FP32_BOUND
        assert rel_err(s_rec[n : n + 1], ref_s) < FP32_BOUND
        if eos > bos:
            assert rel_err(o[:, bos:eos], ref_o) < FP32_BOUND
            assert rel_err(o_rec[:, bos:eos], ref_o) < FP32_BOUND


@pytest.mark.kernels
def test_triton_prefill_then_decode_equals_one_pass(backend, rel_err):
    backend("triton")
    T, n = 67, 3
    x = make_inputs(B=2, T=T + n, H=1, HV=2, K=16, V=16)
    full_o, full_s = naive_recurrent_gdn(**x, output_final_state=True, use_qk_l2norm=True)
    o, state = chunk_gdn(
        **tokens(x, 0, T), initial_state=x["initial_state"], output_final_state=True,
        use_qk_l2norm=True,
    )  # fmt: skip
    outs = [o]
    for t in range(T, T + n):
        o_t, state = recurrent_gdn(
            **tokens(x, t, t + 1), initial_state=state, output_final_state=True, use_qk_l2norm=True
        )
        outs.append(o_t)
    assert rel_err(torch.cat(outs, dim=1), full_o) < FP32_BOUND
    assert rel_err(state, full_s) < FP32_BOUND


@pytest.mark.kernels
def test_triton_no_tokens_returns_initial_state(backend):
    backend("triton")
    x = make_inputs(B=2, T=0)
    for op in (chunk_gdn, recurrent_gdn):
        o, s = op(**x, output_final_state=True)
        assert o.shape == (2, 0, 2, 32) and torch.equal(s, x["initial_state"])


def test_naive_chunk_equals_naive_recurrent(rel_err):
    x = make_inputs(B=2, T=100, H=1, HV=2, K=16, V=32)
    ref_o, ref_s = naive_recurrent_gdn(**x, output_final_state=True, use_qk_l2norm=True)
    for chunk_size in (16, 64):
        o, s = naive_chunk_gdn(
            **x, output_final_state=True, use_qk_l2norm=True, chunk_size=chunk_size
        )
        assert rel_err(o, ref_o) < FP32_BOUND and rel_err(s, ref_s) < FP32_BOUND


def test_torch_backend_runs_the_naive_reference(backend):
    backend("torch")
    x = make_inputs(T=20)
    o, s = chunk_gdn(**x, output_final_state=True, use_qk_l2norm=True)
    ref_o, ref_s = naive_chunk_gdn(**x, output_final_state=True, use_qk_l2norm=True)
    assert torch.equal(o, ref_o) and torch.equal(s, ref_s)


def test_bound_catches_plausible_bugs(rel_err):
    x = make_inputs(B=2, T=100, H=1, HV=2, K=16, V=16)
    x["q"], x["k"] = x["q"] * 0.3, x["k"] * 0.3
    ref_o, _ = naive_recurrent_gdn(**x, use_qk_l2norm=True)
    bugs = {
        "l2norm omitted": naive_recurrent_gdn(**x)[0],
        "decay applied twice": naive_recurrent_gdn(**{**x, "g": 2 * x["g"]}, use_qk_l2norm=True)[0],
        "state dropped": naive_recurrent_gdn(**{**x, "initial_state": None}, use_qk_l2norm=True)[0],
    }
    for bug, wrong in bugs.items():
        assert rel_err(wrong, ref_o) > 10 * BF16_BOUND, bug
    assert rel_err(torch.full_like(ref_o, float("nan")), ref_o) == float("inf")


def good_args(B=1, T=8, H=1, HV=2, K=16, V=16) -> dict:
    return dict(
        q=torch.randn(B, T, H, K),
        k=torch.randn(B, T, H, K),
        v=torch.randn(B, T, HV, V),
        g=-torch.rand(B, T, HV),
        beta=torch.rand(B, T, HV),
        initial_state=torch.zeros(B, HV, K, V),
    )


BAD_ARGS = {
    "k shape": (dict(k=torch.randn(1, 8, 2, 16)), r"k: .*\(1, 8, 1, 16\).*\(1, 8, 2, 16\)"),
    "HV not multiple": ({**good_args(H=2, HV=3), "initial_state": None}, r"HV=3 .*H=2"),
    "g shape": (dict(g=torch.randn(1, 8, 2, 16)), r"g: expected shape \(1, 8, 2\)"),
    "beta shape": (dict(beta=torch.rand(1, 7, 2)), r"beta: expected shape \(1, 8, 2\)"),
    "q dtype": (dict(q=torch.randn(1, 8, 1, 16).double()), r"q: dtype torch.float64"),
    "v int": (dict(v=torch.ones(1, 8, 2, 16, dtype=torch.int32)), r"v: dtype torch.int32"),
    "state dtype": (
        dict(initial_state=torch.zeros(1, 2, 16, 16, dtype=torch.bfloat16)),
        r"initial_state: dtype",
    ),
    "state shape": (
        dict(initial_state=torch.zeros(2, 2, 16, 16)),
        r"initial_state: expected shape \(1, 2, 16, 16\).*\(2, 2, 16, 16\)",
    ),
    "device": (dict(g=torch.randn(1, 8, 2, device="meta")), r"g: on device meta"),
    "cu_seqlens B": (
        {**good_args(B=2), "cu_seqlens": torch.tensor([0, 8])},
        r"cu_seqlens: requires B == 1.*\(2, 8, 1, 16\)",
    ),
    "cu_seqlens dtype": (dict(cu_seqlens=torch.tensor([0.0, 8.0])), r"cu_seqlens: dtype"),
    "cu_seqlens end": (dict(cu_seqlens=torch.tensor([0, 5])), r"cu_seqlens: .*T=8"),
}


@pytest.mark.parametrize("op", [chunk_gdn, recurrent_gdn], ids=["chunk", "recurrent"])
@pytest.mark.parametrize("bad", BAD_ARGS, ids=list(BAD_ARGS))
def test_bad_arguments_raise_value_error(op, bad):
    override, pattern = BAD_ARGS[bad]
    with pytest.raises(ValueError, match=pattern):
        op(**{**good_args(), **override})


def test_bad_chunk_size_and_too_large_head_dim(backend):
    with pytest.raises(ValueError, match="chunk_size: expected one of"):
        chunk_gdn(**make_inputs(T=8), chunk_size=48)
    backend("triton")
    x = make_inputs(T=8, K=320)
    for op in (chunk_gdn, recurrent_gdn):
        with pytest.raises(ValueError, match="K=320"):
            op(**x)


def sm90_job(module: str, name: str, constexprs: dict, dtype: str = "*bf16") -> tuple:
    """A compile job for the conftest's compile_sm90: every tensor argument 16-byte aligned."""
    types = dict(cu_seqlens="*i64", chunk_indices="*i32", chunk_offsets="*i64")
    types |= dict(n_rows="i32", scale="fp32") | dict.fromkeys(
        ("q", "k", "v", "g", "beta", "o", "x"), dtype
    )
    kernel = getattr(__import__(module, fromlist=[name]), name)
    signature = {
        arg: "constexpr" if arg in constexprs else types.get(arg, "*fp32")
        for arg in inspect.signature(getattr(kernel, "fn", kernel)).parameters
    }
    aligned = [arg for arg, kind in signature.items() if kind.startswith("*")]
    return module, name, signature, constexprs, aligned


@pytest.mark.kernels
def test_kernels_compile_for_sm90(compile_sm90):
    """bf16 inputs (tf32 products) at Qwen3-Next serving shapes: H=16, HV=32, K=V=128."""
    wy, gdn, state = "kernels.gdn.triton_wy", "kernels.gdn.triton", "kernels.gdn.triton_state"
    heads = dict(H=16, HV=32, K=128)
    chunk = dict(heads, V=128, BT=64, BK=64, BV=64, PREC="tf32")
    flags = dict(HAS_H0=True, STORE_FINAL=True)
    jobs = [
        sm90_job(wy, "l2norm_kernel", dict(D=128, BD=128, BR=16, EPS=1e-6)),
        sm90_job(wy, "chunk_cumsum_kernel", dict(HV=32, K=1, BT=64, BK=1, PER_K=False)),
        sm90_job(gdn, "gdn_kkt_kernel", dict(heads, BT=64, BK=64, PREC="tf32")),
        sm90_job(wy, "solve_unit_lower_kernel", dict(HV=32, BT=64)),
        sm90_job(wy, "wy_kernel", dict(chunk, PER_K=False)),
        sm90_job(gdn, "gdn_output_kernel", chunk),
        sm90_job(
            state, "state_passing_kernel",
            dict(chunk, BS=32, BK=128, BV=32, PER_K=False, **flags),
        ),
        sm90_job(
            state, "recurrent_kernel",
            dict(heads, V=128, BK=128, BV=64, PER_K=False, L2NORM=True, EPS=1e-6, **flags),
        ),
    ]  # fmt: skip
    assert all(".entry" in ptx for ptx in compile_sm90(jobs))
