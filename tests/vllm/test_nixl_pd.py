"""The anchor: vLLM P/D with its own NixlConnector at TP 1->1 decodes the same greedy tokens as
one vLLM server doing both phases, on a prompt of several (384-token) blocks. It proves the
harness (real servers, the two-step protocol) and is the reference side of `bench vllm`.

The servers come from `pdxfer up --engine vllm --connector nixl`, so the same run covers `up`
(it prints where things are; Ctrl-C leaves no process) and `pdxfer serve router --engine vllm`
in front (pdxfer's OpenAI API speaking the two-step protocol: the same tokens, streamed or
not)."""

import json
import random
import urllib.request

import pytest

from tests.vllm.servers import get_text, post_json
from tests.vllm.up_stack import running_up
from transfer.bench.vllm_metrics import fetch_connector_totals, histogram_sums
from transfer.serving.launch.vllm_servers import Connector
from transfer.serving.openai.vllm_backend import post_completion

# Longer than the stack's own start deadline (tests/vllm/up_stack.py), so a slow or hung
# start fails there, with the servers' logs in the message, not in pytest's timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

# vLLM's CPU build aligns the tiny Qwen3-Next's attention blocks to 384 tokens.
PROMPT = [random.Random(7).randrange(3, 512) for _ in range(900)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def nixl_up(qwen3_next_checkpoint):
    with running_up(qwen3_next_checkpoint, Connector.NIXL) as stack:
        yield stack


@pytest.fixture(scope="module")
def colocated_tokens(nixl_up):
    """Greedy tokens of the prefill server running the whole request itself; a cache salt
    keeps it from sharing prefix-cache blocks with the P/D requests."""
    response = post_completion(nixl_up.prefill, PROMPT, MAX_TOKENS, cache_salt="colocated")
    tokens = response["choices"][0]["token_ids"]
    assert len(tokens) == MAX_TOKENS
    return tokens


def test_nixl_pd_tokens_equal_colocated(nixl_up, colocated_tokens):
    before = fetch_connector_totals(nixl_up.decode, "nixl")

    first = post_completion(
        nixl_up.prefill, PROMPT, 1, kv_transfer_params={"do_remote_decode": True}
    )
    params = first["kv_transfer_params"]
    response = post_completion(nixl_up.decode, PROMPT, MAX_TOKENS, kv_transfer_params=params)

    assert response["choices"][0]["token_ids"] == colocated_tokens
    # One block list per KV cache group: the attention group's spans several blocks.
    assert max(map(len, params["remote_block_ids"])) >= 2, params
    moved = fetch_connector_totals(nixl_up.decode, "nixl") - before
    assert moved.transfers >= 1 and moved.bytes > 0 and moved.descriptors > 0, moved


def _router_completion(base: str, **body) -> dict:
    return post_json(base + "/v1/completions", {"model": "qwen3-next", **body})


def test_router_over_vllm_gives_the_colocated_tokens(nixl_up, colocated_tokens):
    answer = _router_completion(nixl_up.router, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert answer["choices"][0]["token_ids"] == colocated_tokens
    assert answer["usage"]["prompt_tokens"] == len(PROMPT)


def test_router_stream_and_chat_over_vllm(nixl_up):
    router = nixl_up.router
    whole = _router_completion(router, prompt="Hello, world!", max_tokens=8, temperature=0)
    request = urllib.request.Request(
        router + "/v1/completions",
        data=json.dumps(
            {
                "model": "qwen3-next",
                "prompt": "Hello, world!",
                "max_tokens": 8,
                "temperature": 0,
                "stream": True,
            }
        ).encode(),  # fmt: skip
        headers={"Content-Type": "application/json"},
    )
    pieces = []
    with urllib.request.urlopen(request, timeout=240) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                chunk = json.loads(line[len("data:") :])
                assert "error" not in chunk, chunk
                pieces += [c["text"] for c in chunk["choices"]]
    assert "".join(pieces) == whole["choices"][0]["text"]
    chat = post_json(
        router + "/v1/chat/completions",
        {
            "model": "qwen3-next",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "temperature": 0,
        },  # fmt: skip
    )
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["completion_tokens"] >= 1


def test_router_health_and_metrics_over_vllm(nixl_up):
    router = nixl_up.router
    with urllib.request.urlopen(router + "/health", timeout=30) as response:
        assert response.status == 200
    text = get_text(router + "/metrics")
    assert 'pdxfer_router_vllm_requests_total{outcome="ok"}' in text
    _, first_tokens = histogram_sums(text, "pdxfer_router_ttft_seconds")
    assert first_tokens >= 1
