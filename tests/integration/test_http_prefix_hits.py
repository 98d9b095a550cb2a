"""Prefix hits at 64-token granularity through the OpenAI API of `pdxfer up` with its default
flags (issue 35, part 2), for every tiny preset: their KV blocks are 112-256 tokens, so a hit
that ends inside a block needs the copy on write of that block and a checkpoint at a 64-token
position."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest

from tests.support.up_process import up_process
from transfer.model.reference import reference_generate
from transfer.presets import get_preset

pytestmark = pytest.mark.slow

STARTUP_S = 240
API_KEY = "sk-test-" + uuid.uuid4().hex[:8]
MAX_TOKENS = 4


@contextmanager
def _up(model: str) -> Iterator[str]:
    """`pdxfer up --model MODEL` with its defaults (but a free HTTP port); yields the base URL."""
    args = ["up", "--model", model, "--http-port", "0"]
    with up_process(args, env={"PDXFER_API_KEY": API_KEY}, startup_s=STARTUP_S) as running:
        yield re.search(r"OpenAI API at (http://\S+)/v1", running.stdout).group(1)


def _send(client: openai.OpenAI, model: str, ids: list[int]) -> tuple[list[int], int]:
    """The greedy completion's token ids and its `cached_tokens`."""
    out = client.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    return out.choices[0].model_extra["token_ids"], out.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize(
    "model", ["tiny-kimi-linear", "tiny-qwen3-next", "tiny-qwen3.5", "tiny-nemotron-h"]
)
def test_a_resent_and_an_extended_prompt_hit_at_64_token_granularity(model):
    prompt = [(7 * i + 3) % 500 for i in range(224)]
    extended = prompt + [(11 * i + 5) % 500 for i in range(32)]
    with _up(model) as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        first, first_cached = _send(client, model, prompt)
        second, second_cached = _send(client, model, prompt)
        third, third_cached = _send(client, model, extended)
        # 64 * floor(224 / 64) = 192, inside a block of 112, 128, 160 or 256 tokens; the
        # third shares all 224
        assert first_cached == 0
        assert second_cached >= 192 and third_cached >= 192
        assert second == first
        geometry = get_preset(model)
        assert first == reference_generate(geometry, prompt, MAX_TOKENS)
        assert third == reference_generate(geometry, extended, MAX_TOKENS)
