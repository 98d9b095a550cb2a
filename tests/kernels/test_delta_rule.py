"""GDN and KDA, the two delta-rule kinds, through one set of tests: Triton (under
TRITON_INTERPRET=1, see conftest) against the torch reference, chunked against recurrent,
packed sequences, prefill-then-decode against one pass, and argument validation."""

import inspect
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined (conftest does too)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels  # noqa: E402
from kernels.delta_rule.naive import causal_mask, exp_where  # noqa: E402
from kernels.gdn import chunk_gdn, recurrent_gdn  # noqa: E402
from kernels.gdn.naive import naive_chunk_gdn, naive_recurrent_gdn  # noqa: E402
from kernels.kda import chunk_kda, recurrent_kda  # noqa: E402
from kernels.kda.naive import naive_chunk_kda, naive_recurrent_kda  # noqa: E402

FP32_BOUND = 1e-5
BF16_BOUND = 1e-2


@dataclass(frozen=True)
class Kind:
    """One delta-rule kind's ops; cu_dtype is the offsets dtype its varlen test uses (the two
    kinds use different ones, so both dtypes are covered)."""

    name: str
    chunk: Callable
    recurrent: Callable
    naive_chunk: Callable
    naive_recurrent: Callable
    decay_per_key: bool
    cu_dtype: torch.dtype

    def g_shape(self, B: int, T: int, HV: int, K: int) -> tuple[int, ...]:
        return (B, T, HV, K) if self.decay_per_key else (B, T, HV)


GDN = Kind(
    "gdn", chunk_gdn, recurrent_gdn, naive_chunk_gdn, naive_recurrent_gdn, False, torch.int32
)
KDA = Kind("kda", chunk_kda, recurrent_kda, naive_chunk_kda, naive_recurrent_kda, True, torch.int64)


@pytest.fixture(params=[GDN, KDA], ids=["gdn", "kda"])
def kind(request) -> Kind:
    return request.param


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_inputs(kind: Kind, B=1, T=70, H=1, HV=2, K=16, V=32, dtype=torch.float32, n_states=None):
    """Random q, k, v, g (logsigmoid, < 0), beta (sigmoid) and an fp32 initial state."""
    return dict(
        q=torch.randn(B, T, H, K).to(dtype),
        k=torch.randn(B, T, H, K).to(dtype),
        v=torch.randn(B, T, HV, V).to(dtype),
        g=F.logsigmoid(torch.randn(kind.g_shape(B, T, HV, K)) + 2).to(dtype),
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
def test_triton_chunk_and_recurrent_match_naive(kind, case, backend, rel_err):
    backend("triton")
    spec = dict(CASES[case])
    dtype, h0 = spec.pop("dtype"), spec.pop("h0")
    x = make_inputs(kind, **spec, dtype=dtype)
    if not h0:
        x["initial_state"] = None
    bound = FP32_BOUND if dtype == torch.float32 else BF16_BOUND
    fp32 = {name: t if t is None else t.float() for name, t in x.items()}
    ref_o, ref_s = kind.naive_chunk(**fp32, output_final_state=True, use_qk_l2norm=True)

    o, s = kind.chunk(**x, output_final_state=True, use_qk_l2norm=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert rel_err(o, ref_o) < bound and rel_err(s, ref_s) < bound

    o_rec, s_rec = kind.recurrent(**x, output_final_state=True, use_qk_l2norm=True)
    assert rel_err(o_rec, ref_o) < bound and rel_err(s_rec, ref_s) < bound
    assert rel_err(o_rec, o) < bound and rel_err(s_rec, s) < bound


@pytest.mark.kernels
def test_triton_chunk_without_l2norm_at_other_chunk_sizes(kind, backend, rel_err):
    backend("triton")
    x = make_inputs(kind, B=1, T=45, H=2, HV=2, K=32, V=16)
    x["q"], x["k"] = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
    ref_o, ref_s = kind.naive_recurrent(**x, scale=0.3, output_final_state=True)
    o, s = kind.chunk(**x, scale=0.3, output_final_state=True, chunk_size=32)
    assert rel_err(o, ref_o) < FP32_BOUND and rel_err(s, ref_s) < FP32_BOUND
    o, no_state = kind.chunk(**x, scale=0.3, chunk_size=16)
    assert no_state is None and rel_err(o, ref_o) < FP32_BOUND


@pytest.mark.kernels
def test_triton_varlen_matches_separate_sequences(kind, backend, rel_err):
    backend("triton")
    cu = torch.tensor([0, 37, 101, 101, 130], dtype=kind.cu_dtype)  # lengths 37, 64, 0, 29
    x = make_inputs(kind, B=1, T=130, H=1, HV=2, K=16, V=16, n_states=4)
    common = dict(output_final_state=True, use_qk_l2norm=True, cu_seqlens=cu)
    o, s = kind.chunk(**x, **common)
    o_rec, s_rec = kind.recurrent(**x, **common)
    for n, (bos, eos) in enumerate(pairwise(cu.tolist())):
        h0 = x["initial_state"][n : n + 1]
        ref_o, ref_s = kind.naive_recurrent(
            **tokens(x, bos, eos), initial_state=h0, output_final_state=True, use_qk_l2norm=True
        )
        assert rel_err(s[n : n + 1], ref_s) < FP32_BOUND
        assert rel_err(s_rec[n : n + 1], ref_s) < FP32_BOUND
        if eos > bos:
            assert rel_err(o[:, bos:eos], ref_o) < FP32_BOUND
            assert rel_err(o_rec[:, bos:eos], ref_o) < FP32_BOUND


@pytest.mark.kernels
def test_triton_prefill_then_decode_equals_one_pass(kind, backend, rel_err):
    backend("triton")
    T, n = 67, 3
    x = make_inputs(kind, B=2, T=T + n, H=1, HV=2, K=16, V=16)
    full_o, full_s = kind.naive_recurrent(**x, output_final_state=True, use_qk_l2norm=True)
    o, state = kind.chunk(
        **tokens(x, 0, T), initial_state=x["initial_state"], output_final_state=True,
        use_qk_l2norm=True,
    )  # fmt: skip
    outs = [o]
    for t in range(T, T + n):
        o_t, state = kind.recurrent(
            **tokens(x, t, t + 1), initial_state=state, output_final_state=True, use_qk_l2norm=True
        )
        outs.append(o_t)
    assert rel_err(torch.cat(outs, dim=1), full_o) < FP32_BOUND
    assert rel_err(state, full_s) < FP32_BOUND


@pytest.mark.kernels
def test_triton_no_tokens_returns_initial_state(kind, backend):
    backend("triton")
    x = make_inputs(kind, B=2, T=0)
    for op in (kind.chunk, kind.recurrent):
        o, s = op(**x, output_final_state=True)
        assert o.shape == (2, 0, 2, 32) and torch.equal(s, x["initial_state"])


@pytest.mark.parametrize("T", [100, 128])  # a padded last chunk, and whole chunks only
def test_naive_chunk_equals_naive_recurrent(kind, rel_err, T):
    x = make_inputs(kind, B=2, T=T, H=1, HV=2, K=16, V=32)
    ref_o, ref_s = kind.naive_recurrent(**x, output_final_state=True, use_qk_l2norm=True)
    for chunk_size in (16, 64):
        o, s = kind.naive_chunk(
            **x, output_final_state=True, use_qk_l2norm=True, chunk_size=chunk_size
        )
        assert rel_err(o, ref_o) < FP32_BOUND and rel_err(s, ref_s) < FP32_BOUND


def test_torch_backend_runs_the_torch_path(kind, backend, rel_err):
    """Without Triton the chunked op is the naive chunk driver with the kind's torch intra:
    the reference's own for GDN (bit for bit), KDA's sub-chunked one (within the bound)."""
    backend("torch")
    x = make_inputs(kind, T=70)
    o, s = kind.chunk(**x, output_final_state=True, use_qk_l2norm=True, chunk_size=32)
    ref_o, ref_s = kind.naive_chunk(**x, output_final_state=True, use_qk_l2norm=True, chunk_size=32)
    if kind.name == "gdn":
        assert torch.equal(o, ref_o) and torch.equal(s, ref_s)
    else:
        assert rel_err(o, ref_o) < FP32_BOUND and rel_err(s, ref_s) < FP32_BOUND
        assert not torch.equal(o, ref_o)  # the sub-chunked intra ran, not the reference


def one_token_each(kind: Kind, N: int) -> dict:
    """A decode step's inputs: N sequences of one token each, packed along T."""
    x = make_inputs(kind, B=1, T=N, n_states=N)
    return x | {"cu_seqlens": torch.arange(N + 1)}


def test_batched_decode_step_equals_each_sequence_alone(kind, rel_err):
    """The one-token-each path (a decode step, as batched matrix products) against the token loop."""
    x = one_token_each(kind, N=5)
    o, s = kind.naive_recurrent(**x, output_final_state=True, use_qk_l2norm=True)
    for n in range(5):
        alone = {name: t[:, n : n + 1] for name, t in x.items() if name != "cu_seqlens"}
        alone["initial_state"] = x["initial_state"][n : n + 1]
        ref_o, ref_s = kind.naive_recurrent(**alone, output_final_state=True, use_qk_l2norm=True)
        assert rel_err(o[:, n : n + 1], ref_o) < FP32_BOUND
        assert rel_err(s[n : n + 1], ref_s) < FP32_BOUND


@pytest.mark.parametrize(
    "backend_name", ["torch", pytest.param("triton", marks=pytest.mark.kernels)]
)
@pytest.mark.parametrize("layout", ["decode", "decode-strided-state", "tokens"])
def test_state_in_place_writes_the_final_state_into_the_initial_one(
    kind, backend, backend_name, layout
):
    backend(backend_name)
    if layout == "tokens":  # several tokens per sequence: the token loop
        x = make_inputs(kind, B=1, T=12, n_states=3) | {"cu_seqlens": torch.tensor([0, 5, 6, 12])}
    else:
        x = one_token_each(kind, N=4)
    if layout == "decode-strided-state":  # as a cache's slots are: rows apart, not one tensor
        rows = torch.randn(4, 3, *x["initial_state"].shape[1:])
        rows[:, 1] = x["initial_state"]
        x["initial_state"] = rows[:, 1]
        neighbours = rows[:, 0::2].clone()
    entering = x["initial_state"].clone()
    o, s = kind.recurrent(**x, output_final_state=True, use_qk_l2norm=True)
    assert torch.equal(x["initial_state"], entering)  # by default only read
    o_in_place, s_in_place = kind.recurrent(
        **x, output_final_state=True, use_qk_l2norm=True, state_in_place=True
    )
    assert s_in_place is x["initial_state"]
    assert torch.equal(o_in_place, o) and torch.equal(s_in_place, s)
    assert not torch.equal(s, entering)
    if layout == "decode-strided-state":  # the slot's rows changed, and nothing around them
        assert torch.equal(rows[:, 1], s) and torch.equal(rows[:, 0::2], neighbours)


def test_state_in_place_needs_a_state_to_write(kind):
    x = one_token_each(kind, N=2)
    with pytest.raises(ValueError, match="state_in_place"):
        kind.recurrent(**(x | {"initial_state": None}), output_final_state=True,
                       state_in_place=True)  # fmt: skip
    with pytest.raises(ValueError, match="state_in_place"):
        kind.recurrent(**x, state_in_place=True)


def test_bound_catches_plausible_bugs(kind, rel_err):
    x = make_inputs(kind, B=2, T=100, H=1, HV=2, K=16, V=16)
    x["q"], x["k"] = x["q"] * 0.3, x["k"] * 0.3
    run = kind.naive_recurrent
    ref_o, _ = run(**x, use_qk_l2norm=True)
    bugs = {
        "l2norm omitted": run(**x)[0],
        "decay applied twice": run(**{**x, "g": 2 * x["g"]}, use_qk_l2norm=True)[0],
        "state dropped": run(**{**x, "initial_state": None}, use_qk_l2norm=True)[0],
    }
    for bug, wrong in bugs.items():
        assert rel_err(wrong, ref_o) > 10 * BF16_BOUND, bug
    assert rel_err(torch.full_like(ref_o, float("nan")), ref_o) == float("inf")


def test_public_ops_keep_their_names_and_signatures(kind):
    chunk_params = ["q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state",
                    "use_qk_l2norm", "chunk_size", "cu_seqlens"]  # fmt: skip
    for form, op, params in [
        ("chunk", kind.chunk, chunk_params),
        (
            "recurrent",
            kind.recurrent,
            [p for p in chunk_params if p != "chunk_size"] + ["state_in_place"],
        ),
    ]:
        assert getattr(kernels, f"{form}_{kind.name}") is op
        assert op.__name__ == f"{form}_{kind.name}" and op.__module__ == f"kernels.{kind.name}"
        assert list(inspect.signature(op).parameters) == params
    assert "q, k [B,T,H,K]" in kind.chunk.__doc__ and f"chunk_{kind.name}" in kind.recurrent.__doc__


def good_args(kind: Kind, B=1, T=8, H=1, HV=2, K=16, V=16) -> dict:
    return dict(
        q=torch.randn(B, T, H, K),
        k=torch.randn(B, T, H, K),
        v=torch.randn(B, T, HV, V),
        g=-torch.rand(kind.g_shape(B, T, HV, K)),
        beta=torch.rand(B, T, HV),
        initial_state=torch.zeros(B, HV, K, V),
    )


BAD_ARGS = {
    "k shape": (dict(k=torch.randn(1, 8, 2, 16)), r"k: .*\(1, 8, 1, 16\).*\(1, 8, 2, 16\)"),
    "beta shape": (dict(beta=torch.rand(1, 7, 2)), r"beta: expected shape \(1, 8, 2\)"),
    "q dtype": (dict(q=torch.randn(1, 8, 1, 16).double()), r"q: dtype torch.float64"),
    "v int": (dict(v=torch.ones(1, 8, 2, 16, dtype=torch.int32)), r"v: dtype torch.int32"),
    "v dtype differs": (dict(v=torch.randn(1, 8, 2, 16).bfloat16()), r"v: dtype .*q's"),
    "beta int": (dict(beta=torch.ones(1, 8, 2, dtype=torch.int64)), r"beta: dtype torch.int64"),
    "state dtype": (
        dict(initial_state=torch.zeros(1, 2, 16, 16, dtype=torch.bfloat16)),
        r"initial_state: dtype",
    ),
    "state shape": (
        dict(initial_state=torch.zeros(2, 2, 16, 16)),
        r"initial_state: expected shape \(1, 2, 16, 16\).*\(2, 2, 16, 16\)",
    ),
    "device": (dict(beta=torch.rand(1, 8, 2, device="meta")), r"beta: on device meta"),
    "cu_seqlens dtype": (dict(cu_seqlens=torch.tensor([0.0, 8.0])), r"cu_seqlens: dtype"),
    "cu_seqlens end": (dict(cu_seqlens=torch.tensor([0, 5])), r"cu_seqlens: .*T=8"),
    "cu_seqlens decreasing": (dict(cu_seqlens=torch.tensor([0, 6, 4, 8])), r"cu_seqlens: .*T=8"),
}


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("bad", BAD_ARGS, ids=list(BAD_ARGS))
def test_bad_arguments_raise_value_error(kind, form, bad):
    override, pattern = BAD_ARGS[bad]
    with pytest.raises(ValueError, match=pattern):
        getattr(kind, form)(**{**good_args(kind), **override})


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_shape_errors_name_the_kinds_decay_and_batch(kind, form):
    op = getattr(kind, form)
    expected = re.escape(f"g: expected shape {kind.g_shape(1, 8, 2, 16)}")
    other_kinds_g = (1, 8, 2) if kind.decay_per_key else (1, 8, 2, 16)
    with pytest.raises(ValueError, match=expected):
        op(**{**good_args(kind), "g": -torch.rand(other_kinds_g)})
    with pytest.raises(ValueError, match=r"HV=3 .*H=2"):
        op(**{**good_args(kind, H=2, HV=3), "initial_state": None})
    with pytest.raises(ValueError, match=r"cu_seqlens: requires B == 1.*\(2, 8, 1, 16\)"):
        op(**good_args(kind, B=2), cu_seqlens=torch.tensor([0, 8]))


def test_bad_chunk_size_and_too_large_head_dim(kind, backend):
    with pytest.raises(ValueError, match="chunk_size: expected one of"):
        kind.chunk(**make_inputs(kind, T=8), chunk_size=48)
    backend("triton")
    x = make_inputs(kind, T=8, K=320)
    for op in (kind.chunk, kind.recurrent):
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


def compile_jobs(kind: Kind) -> list[tuple]:
    """bf16 inputs (tf32 products) at serving shapes: Qwen3-Next's GDN (H=16, HV=32, K=V=128),
    Kimi-Linear's KDA (H=HV=32, K=V=128). The kind-free kernels are compiled once, with GDN."""
    wy, state = "kernels.delta_rule.triton_wy", "kernels.delta_rule.triton_state"
    shared = "kernels.delta_rule.triton"
    per_k = kind.decay_per_key
    heads = dict(H=32, HV=32, K=128) if per_k else dict(H=16, HV=32, K=128)
    chunk = dict(heads, V=128, BT=64, BK=64, BV=64, PREC="tf32")
    flags = dict(HAS_H0=True, STORE_FINAL=True)
    jobs = [
        sm90_job(wy, "chunk_cumsum_kernel",
                 dict(HV=32, K=128 if per_k else 1, BT=64, BK=128 if per_k else 1, PER_K=per_k)),
        sm90_job(wy, "wy_kernel", dict(chunk, PER_K=per_k)),
        sm90_job(shared, "output_kernel", dict(chunk, BK=32 if per_k else 64, PER_K=per_k)),
        sm90_job(state, "state_passing_kernel",
                 dict(chunk, BS=32, BK=128, BV=32, PER_K=per_k, **flags)),
        sm90_job(state, "recurrent_kernel",
                 dict(heads, V=128, BK=128, BV=64, PER_K=per_k, L2NORM=True, EPS=1e-6, **flags)),
    ]  # fmt: skip
    if per_k:
        intra = dict(heads, BT=64, BC=16)
        return jobs + [
            sm90_job("kernels.kda.triton", "kda_intra_offdiag_kernel",
                     dict(intra, BK=64, PREC="tf32")),
            sm90_job("kernels.kda.triton", "kda_intra_diag_kernel", dict(intra, BK=32)),
        ]  # fmt: skip
    return jobs + [
        sm90_job(wy, "l2norm_kernel", dict(D=128, BD=128, BR=16, EPS=1e-6)),
        sm90_job(wy, "solve_unit_lower_kernel", dict(HV=32, BT=64)),
        sm90_job("kernels.gdn.triton", "gdn_kkt_kernel", dict(heads, BT=64, BK=64, PREC="tf32")),
    ]


@pytest.mark.kernels
def test_kernels_compile_for_sm90(kind, compile_sm90):
    assert all(".entry" in ptx for ptx in compile_sm90(compile_jobs(kind)))


def test_exp_where_is_exp_of_minus_inf_masking_bit_for_bit():
    """The intra-chunk decays zero their masked entries without an exp of -inf (slow on the
    CPU): the kept entries have exp's bits, the masked ones exactly 0, even where exp of the
    masked value would overflow."""
    x = torch.randn(6, 32, 32) * 30  # above the diagonal, exp overflows in places
    keep = causal_mask(32, x.device)
    assert torch.isinf(x.exp()[:, ~keep]).any()
    ours = exp_where(x, keep)
    assert torch.equal(ours, x.masked_fill(~keep, float("-inf")).exp())
    assert torch.equal(ours[:, keep], x.exp()[:, keep])
