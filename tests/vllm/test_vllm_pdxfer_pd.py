"""Real vLLM on both sides with PdxferConnector: a prefill and a decode server at TP pairs
1 -> 1, 2 -> 1 and 1 -> 2 on the tiny bf16 Qwen3-Next; decode's greedy tokens for a prompt of
several blocks equal the same server's colocated tokens, and the transfer's bytes and
descriptors (summed over decode ranks) are reported."""

from __future__ import annotations

import re

import pytest

from tests.vllm.servers import get_text, greedy_completion, pd_completion, running_pd_pair
from transfer.serving.vllm_servers import Connector

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 12
# 900 tokens: three of vLLM's 384-token blocks on this model (the last one partly filled).
PROMPT = [(7 * i + 3) % 500 + 5 for i in range(900)]


def _metric(text: str, name: str) -> float:
    """The sum of `name` over its labels in Prometheus text (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if re.match(rf"^{re.escape(name)}(\{{.*\}})? ", line):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 1), (2, 1), (1, 2)])
def test_pd_tokens_equal_colocated(qwen3_next_checkpoint, prefill_tp, decode_tp):
    pair = running_pd_pair(
        qwen3_next_checkpoint, Connector.PDXFER, prefill_tp=prefill_tp, decode_tp=decode_tp
    )
    with pair as (prefill, decode):
        colocated = greedy_completion(decode, PROMPT, MAX_TOKENS)["choices"][0]["token_ids"]
        response, params = pd_completion(prefill, decode, PROMPT, MAX_TOKENS)
        tokens = response["choices"][0]["token_ids"]
        metrics = get_text(decode.url + "/metrics")
    assert "pdxfer" in params
    assert tokens == colocated
    moved = _metric(metrics, "vllm:pdxfer_bytes_transferred_sum")
    descriptors = _metric(metrics, "vllm:pdxfer_num_descriptors_sum")
    print(
        f"\npdxfer {prefill_tp}->{decode_tp}: {moved:.0f} B in {descriptors:.0f} descriptors for {len(PROMPT)} tokens"
    )
    # 899 tokens of 2 KV heads (K and V, bf16) plus 3 GDN states (bf16 conv, fp32 SSM), over
    # all decode ranks: every byte once, whatever the TP pair, plus the few gap bytes of
    # staged spans (a decode rank's conv channels sit between its peer's at the source).
    expected = 899 * 2 * 2 * 128 * 2 + 3 * (3 * 1024 * 2 + 4 * 128 * 128 * 4)
    assert expected <= moved <= expected * 1.01
    assert 0 < descriptors <= 13 * max(prefill_tp, decode_tp)  # NixlConnector: 13 per source
