"""PdxferConnector behind `pdxfer up --engine vllm` (its default connector), TP 1->1: a prompt
of two blocks through pdxfer's router gets the greedy tokens the prefill server computes alone
for it (colocated), alone and with eight requests at once; each concurrent request's cache
moved through pdxfer (its vllm:pdxfer_* histograms count every transfer).

One of the eight concurrent prompts answers an end token first, colocated too: the router
then answers no tokens and finish reason "stop" (it leaves end tokens out, vLLM keeps them).
That, not the connector, was the "one of 8 answers ends early" this test used to xfail on."""

import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.vllm.servers import post_json
from tests.vllm.up_stack import running_up
from transfer.bench.vllm_metrics import fetch_connector_totals
from transfer.serving.launch.vllm_servers import Connector
from transfer.serving.openai.vllm_backend import post_completion

# Longer than the stack's own start deadline (tests/vllm/up_stack.py), so a slow or hung
# start fails there, with the servers' logs in the message, not in pytest's timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

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


def _through_router(stack, prompt: list[int]) -> tuple[list[int], str]:
    """pdxfer's router's greedy answer: (token ids, finish reason). Like OpenAI's API it
    leaves the end token out of the answer; the reason says "stop"."""
    body = {"model": "qwen3-next", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    choice = post_json(stack.router + "/v1/completions", body)["choices"][0]
    return choice["token_ids"], choice["finish_reason"]


def _colocated(stack, prompt: list[int], salt: str, end_tokens: set[int]) -> tuple[list[int], str]:
    """The prefill server's own greedy answer (no connector involved; the salt keeps its
    blocks out of the P/D requests' prefix cache), as the router would answer it: vLLM keeps
    the end token in `token_ids`, the router does not."""
    choice = post_completion(stack.prefill, prompt, MAX_TOKENS, cache_salt=salt)["choices"][0]
    tokens, reason = choice["token_ids"], choice["finish_reason"]
    if reason == "stop":
        assert tokens and tokens[-1] in end_tokens, choice
        tokens = tokens[:-1]
    return tokens, reason


@pytest.fixture(scope="module")
def end_tokens(qwen3_next_checkpoint) -> set[int]:
    config = json.loads((qwen3_next_checkpoint / "config.json").read_text())
    eos = config["eos_token_id"]
    return set(eos) if isinstance(eos, list) else {eos}


def test_each_prompt_alone_through_the_router_equals_colocated(pdxfer_up, end_tokens):
    alone = PROMPTS[:ALONE]
    colocated = [
        _colocated(pdxfer_up, prompt, f"alone-{i}", end_tokens) for i, prompt in enumerate(alone)
    ]
    assert [_through_router(pdxfer_up, prompt) for prompt in alone] == colocated


def test_concurrent_requests_through_the_router_equal_colocated(pdxfer_up, end_tokens):
    prompts = PROMPTS[ALONE:]
    colocated = [
        _colocated(pdxfer_up, prompt, f"concurrent-{i}", end_tokens)
        for i, prompt in enumerate(prompts)
    ]
    before = fetch_connector_totals(pdxfer_up.decode, "pdxfer")
    with ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(pool.map(lambda p: _through_router(pdxfer_up, p), prompts))
    moved = fetch_connector_totals(pdxfer_up.decode, "pdxfer") - before

    # A greedy answer may end on an end token, even as its first token (one of these does),
    # colocated as well as through pdxfer: equality with colocated, not a length, is what a
    # correct transfer guarantees.
    assert answers == colocated
    assert moved.transfers == CONCURRENT and moved.bytes > 0, moved
