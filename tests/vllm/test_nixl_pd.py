"""The anchor: vLLM P/D with its own NixlConnector at TP 1->1 decodes the same greedy tokens as
one vLLM server doing both phases, on a prompt of several (384-token) blocks. It proves the
harness (real servers, the two-step protocol) and is the reference side of `bench vllm`.

The same two servers then sit behind `pdxfer serve router --engine vllm`: pdxfer's OpenAI front
end speaking the two-step protocol gives those tokens too, streamed or not."""

import json
import random
import urllib.request

import pytest

from tests.vllm.servers import (
    get_text,
    greedy_completion,
    pd_completion,
    post_json,
    running_pd_pair,
)
from transfer.bench.vllm_metrics import fetch_connector_totals, histogram_sums
from transfer.serving.procs import group_alive, start_serve, stop_all, wait_ready
from transfer.serving.vllm_servers import Connector

pytestmark = pytest.mark.slow

# vLLM's CPU build aligns the tiny Qwen3-Next's attention blocks to 384 tokens.
PROMPT = [random.Random(7).randrange(3, 512) for _ in range(900)]
MAX_TOKENS = 12
ROUTER_START_S = 60.0


@pytest.fixture(scope="module")
def nixl_pair(qwen3_next_checkpoint):
    with running_pd_pair(qwen3_next_checkpoint, Connector.NIXL) as pair:
        yield pair
    for server in pair:
        assert not group_alive(server.popen.pid), f"{server.spec.name} left processes behind"


@pytest.fixture(scope="module")
def colocated_tokens(nixl_pair):
    """Greedy tokens of the prefill server running the whole request itself; a cache salt
    keeps it from sharing prefix-cache blocks with the P/D requests."""
    prefill, _ = nixl_pair
    response = greedy_completion(prefill, PROMPT, MAX_TOKENS, cache_salt="colocated")
    tokens = response["choices"][0]["token_ids"]
    assert len(tokens) == MAX_TOKENS
    return tokens


@pytest.fixture(scope="module")
def router(nixl_pair, qwen3_next_checkpoint, tmp_path_factory):
    """`pdxfer serve router --engine vllm` over the pair; yields its base URL."""
    prefill, decode = nixl_pair
    args = ["--engine", "vllm", "--prefill", prefill.url, "--decode", decode.url,
            "--http-port", "0", "--model", str(qwen3_next_checkpoint)]  # fmt: skip
    proc = start_serve("router", args, tmp_path_factory.mktemp("router"))
    try:
        wait_ready([proc], ROUTER_START_S)
        yield "http://" + proc.address
    finally:
        stop_all([proc])


def test_nixl_pd_tokens_equal_colocated(nixl_pair, colocated_tokens):
    prefill, decode = nixl_pair
    before = fetch_connector_totals(decode.url, "nixl")

    response, params = pd_completion(prefill, decode, PROMPT, MAX_TOKENS)

    assert response["choices"][0]["token_ids"] == colocated_tokens
    # One block list per KV cache group: the attention group's spans several blocks.
    assert max(map(len, params["remote_block_ids"])) >= 2, params
    moved = fetch_connector_totals(decode.url, "nixl") - before
    assert moved.transfers >= 1 and moved.bytes > 0 and moved.descriptors > 0, moved


def _router_completion(base: str, **body) -> dict:
    return post_json(base + "/v1/completions", {"model": "qwen3-next", **body})


def test_router_over_vllm_gives_the_colocated_tokens(router, colocated_tokens):
    answer = _router_completion(router, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert answer["choices"][0]["token_ids"] == colocated_tokens
    assert answer["usage"]["prompt_tokens"] == len(PROMPT)


def test_router_stream_and_chat_over_vllm(router):
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


def test_router_health_and_metrics_over_vllm(router):
    with urllib.request.urlopen(router + "/health", timeout=30) as response:
        assert response.status == 200
    text = get_text(router + "/metrics")
    assert 'pdxfer_router_vllm_requests_total{outcome="ok"}' in text
    _, first_tokens = histogram_sums(text, "pdxfer_router_ttft_seconds")
    assert first_tokens >= 1
