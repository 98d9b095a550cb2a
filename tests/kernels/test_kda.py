"""What only KDA has, its decay per key channel: a strong decay stays finite, a channel-constant
decay is GDN, and the bound sees channels mixed up. The rest is in test_delta_rule.py."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined (conftest does too)

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from kernels.gdn.naive import naive_recurrent_gdn  # noqa: E402
from kernels.kda import chunk_kda  # noqa: E402
from kernels.kda.naive import kda_intra, naive_chunk_kda, naive_recurrent_kda  # noqa: E402
from kernels.kda.subchunk import subchunk_kda_intra  # noqa: E402

FP32_BOUND = 1e-5
BF16_BOUND = 1e-2


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_inputs(B=1, T=70, H=1, HV=2, K=32, V=16, decay=1.0) -> dict:
    """Random q, k, v, per-channel g (logsigmoid * decay, < 0), beta and an fp32 state."""
    return dict(
        q=torch.randn(B, T, H, K),
        k=torch.randn(B, T, H, K),
        v=torch.randn(B, T, HV, V),
        g=F.logsigmoid(torch.randn(B, T, HV, K) + 2) * decay,
        beta=torch.sigmoid(torch.randn(B, T, HV)),
        initial_state=torch.randn(B, HV, K, V) * 0.5,
    )


@pytest.mark.kernels
@pytest.mark.parametrize("chunk_size", [16, 32, 64])
def test_triton_strong_decay_stays_finite_and_exact(chunk_size, backend, rel_err):
    """Per-token log-decay around -20: a 16-token sub-chunk spans exp(+-300), far past fp32, so
    any decay ratio formed outside the causal mask or before the sub-chunk split overflows."""
    backend("triton")
    x = make_inputs(B=1, T=75, H=1, HV=2, K=32, V=16, decay=20.0)
    x["q"], x["k"] = F.normalize(x["q"], dim=-1), F.normalize(x["k"], dim=-1)
    ref_o, ref_s = naive_recurrent_kda(**x, output_final_state=True)
    o, s = chunk_kda(**x, output_final_state=True, chunk_size=chunk_size)
    assert rel_err(o, ref_o) < FP32_BOUND and rel_err(s, ref_s) < FP32_BOUND


def test_kda_with_channel_constant_decay_is_gdn(rel_err):
    x = make_inputs(B=1, T=40, H=1, HV=2, K=16, V=16)
    x["g"] = x["g"][..., :1].expand_as(x["g"])
    o, s = naive_chunk_kda(**x, output_final_state=True, use_qk_l2norm=True)
    gdn = {**x, "g": x["g"][..., 0]}
    ref_o, ref_s = naive_recurrent_gdn(**gdn, output_final_state=True, use_qk_l2norm=True)
    assert rel_err(o, ref_o) < FP32_BOUND and rel_err(s, ref_s) < FP32_BOUND


def test_bound_catches_decay_channels_reversed(rel_err):
    x = make_inputs(B=2, T=100, H=1, HV=2, K=16, V=16)
    x["q"], x["k"] = x["q"] * 0.3, x["k"] * 0.3
    ref_o, _ = naive_recurrent_kda(**x, use_qk_l2norm=True)
    wrong, _ = naive_recurrent_kda(**{**x, "g": x["g"].flip(-1)}, use_qk_l2norm=True)
    assert rel_err(wrong, ref_o) > 10 * BF16_BOUND


def intra_inputs(N=5, C=32, K=32, decay=1.0, padded_rows=0):
    """Chunks' l2-normalised q, k [N,C,K] and cumulative log-decay G; the last `padded_rows`
    rows of each chunk are the zero padding that ends a sequence (q = k = g = 0)."""
    q, k = F.normalize(torch.randn(N, C, K), dim=-1), F.normalize(torch.randn(N, C, K), dim=-1)
    g = F.logsigmoid(torch.randn(N, C, K) + 2) * decay
    if padded_rows:
        for x in (q, k, g):
            x[:, C - padded_rows :] = 0
    return q, k, g.cumsum(1)


@pytest.mark.parametrize("C", [16, 32, 64])
@pytest.mark.parametrize("sub_chunk", [4, 8, 16])
@pytest.mark.parametrize("decay", [1.0, 20.0])
def test_subchunk_intra_matches_the_reference(C, sub_chunk, decay, rel_err):
    """Per-token log-decay around -20 spans exp(+-300) within a sub-chunk: a decay ratio formed
    outside the causal mask, or through a reference row after the column, overflows."""
    q, k, G = intra_inputs(C=C, decay=decay, padded_rows=C // 4 + 1)
    for got, ref in zip(subchunk_kda_intra(q, k, G, sub_chunk), kda_intra(q, k, G), strict=True):
        assert rel_err(got, ref) < FP32_BOUND
        assert torch.equal(got.triu(1), torch.zeros_like(got))


def test_subchunk_intra_bound_catches_an_off_by_one_reference_row(rel_err):
    """The off-diagonal decay factored through the row before the sub-chunk's first: the
    values move by one token's decay, which the bound must see."""
    q, k, G = intra_inputs(C=32)
    shifted = torch.cat([G[:, :1], G[:, :-1]], dim=1)
    wrong, _ = subchunk_kda_intra(q, k, shifted)
    right, _ = kda_intra(q, k, G)
    assert rel_err(wrong, right) > 100 * FP32_BOUND
