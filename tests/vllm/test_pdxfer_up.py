"""PdxferConnector behind `pdxfer up --engine vllm` (its default connector), TP 1->1: a prompt
of two blocks alone through pdxfer's router gets the greedy tokens the prefill server computes
alone for it; eight concurrent requests all finish, each one's cache moved through pdxfer (its
vllm:pdxfer_* histograms count every transfer).

The concurrent answers are not compared token for token with alone runs: vLLM's CPU kernels
are not batch invariant, and which requests share a batch depends on timing."""

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.vllm.servers import post_json
from tests.vllm.up_stack import running_up
from transfer.bench.vllm_metrics import fetch_connector_totals
from transfer.serving.launch.vllm_servers import Connector
from transfer.serving.openai.vllm_backend import post_completion

pytestmark = pytest.mark.slow

CONCURRENT = 8
ALONE = 3
MAX_TOKENS = 8
# 400 tokens: two of vLLM's 384-token blocks on this model. Distinct prompts for the alone and
# the concurrent part, so that neither finds the other's blocks in a prefix cache.
PROMPTS = [[random.Random(seed).randrange(3, 512) for _ in range(400)]
           for seed in range(ALONE + CONCURRENT)]  # fmt: skip


@pytest.fixture(scope="module")
def pdxfer_up(qwen3_next_checkpoint):
    with running_up(qwen3_next_checkpoint, Connector.PDXFER) as stack:
        yield stack


def _through_router(stack, prompt: list[int]) -> list[int]:
    body = {"model": "qwen3-next", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return post_json(stack.router + "/v1/completions", body)["choices"][0]["token_ids"]


def test_each_prompt_alone_through_the_router_equals_colocated(pdxfer_up):
    alone = PROMPTS[:ALONE]
    colocated = [
        post_completion(pdxfer_up.prefill, prompt, MAX_TOKENS, cache_salt=f"alone-{i}")
        ["choices"][0]["token_ids"]
        for i, prompt in enumerate(alone)
    ]  # fmt: skip
    assert [_through_router(pdxfer_up, prompt) for prompt in alone] == colocated


@pytest.mark.xfail(
    reason="PdxferConnector under 8 concurrent requests: one of 8 answers ends early (still so "
    "on 2026-12-02 after the whole-block and lease fixes, which fixed single requests); a "
    "concurrency defect in the connector, not found yet (docs/vllm.md, 'Known limits').",
    strict=False,
)
def test_concurrent_requests_through_the_router_all_move_through_pdxfer(pdxfer_up):
    before = fetch_connector_totals(pdxfer_up.decode, "pdxfer")
    with ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(pool.map(lambda p: _through_router(pdxfer_up, p), PROMPTS[ALONE:]))

    assert [len(tokens) for tokens in answers] == [MAX_TOKENS] * CONCURRENT
    moved = fetch_connector_totals(pdxfer_up.decode, "pdxfer") - before
    assert moved.transfers == CONCURRENT and moved.bytes > 0, moved
