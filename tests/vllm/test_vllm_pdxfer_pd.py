"""Real vLLM on both sides with PdxferConnector: a prefill and a decode server at TP pairs
1 -> 1, 2 -> 1 and 1 -> 2 on the tiny bf16 Qwen3-Next; decode's greedy tokens for a prompt of
several blocks, and for one of a single partial block, equal the same server's colocated
tokens, and the transfer's bytes and descriptors (summed over decode ranks) are reported."""

from __future__ import annotations

import pytest

from tests.vllm.servers import (
    assert_pd_equals_colocated,
    get_text,
    metric_sum,
    running_pd_pair,
)
from transfer.serving.launch.vllm_servers import Connector

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 12
BLOCK = 384  # vLLM's attention block on this model (page unification)
# 900 tokens: three blocks, the last one partly filled; 300: one partial block only.
PROMPTS = [[(7 * i + 3) % 500 + 5 for i in range(n)] for n in (900, 300)]


# TP 2 on either side runs on the 2-core host because each server keeps a CPU of its own
# (`omp_binds`: a TP-2 server's two ranks share one): pinned beside the other server's
# spinning idle worker, a decode rank's NIXL connect hung (docs/vllm.md, Known limits).
@pytest.mark.parametrize(
    "prefill_tp, decode_tp",
    [(1, 1), (2, 1), (1, 2)],
)
def test_pd_tokens_equal_colocated(qwen3_next_checkpoint, prefill_tp, decode_tp):
    pair = running_pd_pair(
        qwen3_next_checkpoint, Connector.PDXFER, prefill_tp=prefill_tp, decode_tp=decode_tp
    )
    with pair as (prefill, decode):
        assert_pd_equals_colocated(prefill, decode, PROMPTS, MAX_TOKENS)
        metrics = get_text(decode.url + "/metrics")
    moved = metric_sum(metrics, "vllm:pdxfer_bytes_transferred_sum")
    descriptors = metric_sum(metrics, "vllm:pdxfer_num_descriptors_sum")
    print(f"\npdxfer {prefill_tp}->{decode_tp}: {moved:.0f} B in {descriptors:.0f} descriptors")
    # The prompt's tokens (full attention blocks whole, the partial last one's tokens from
    # prefill's stage slots; 2 KV heads, K and V, bf16) plus 3 GDN states (bf16 conv, fp32
    # SSM) without page padding, over all decode ranks: every byte once, whatever the TP
    # pair. Only a decode rank's conv channels sit between its peers' at the source, so at
    # decode TP > 1 each rank may also read the gaps of its span: at most one whole conv
    # state per layer and request for every rank beyond the first (1 -> 2 read 32256 gap
    # bytes of the 36864 allowed, 2026-12-05).
    conv = 3 * 1024 * 2
    state = 3 * (conv + 4 * 128 * 128 * 4)
    expected = sum((len(p) - 1) * 2 * 2 * 128 * 2 + state for p in PROMPTS)
    gaps = (decode_tp - 1) * 3 * conv * len(PROMPTS)
    assert expected <= moved <= expected + gaps
    # NixlConnector: 13 descriptors per request and source.
    assert 0 < descriptors <= 13 * max(prefill_tp, decode_tp) * len(PROMPTS)
