"""Prefix hits at 64-token granularity through the OpenAI API of `pdxfer up` with its default
flags (issue 35, part 2), for every tiny preset: their KV blocks are 112-256 tokens, so a hit
that ends inside a block needs the copy on write of that block and a checkpoint at a 64-token
position."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest

from tests.support.launch import MAIN, ROOT, assert_no_leftovers
from transfer.model.reference import reference_generate
from transfer.presets import get_preset
from transfer.serving.procs import LAUNCH_ID_ENV

pytestmark = pytest.mark.slow

STARTUP_S = 240
API_KEY = "sk-test-" + uuid.uuid4().hex[:8]
MAX_TOKENS = 4


@contextmanager
def _up(model: str) -> Iterator[str]:
    """`pdxfer up --model MODEL` with its defaults (but a free HTTP port); yields the base URL."""
    launch_id = uuid.uuid4().hex
    proc = subprocess.Popen(
        [sys.executable, "-c", MAIN, "up", "--model", model, "--http-port", "0"],
        cwd=ROOT,
        env={**os.environ, LAUNCH_ID_ENV: launch_id, "PDXFER_API_KEY": API_KEY},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    stderr: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("OpenAI API at"):
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
    try:
        if not ready.wait(STARTUP_S):
            pytest.fail(f"pdxfer up did not come up:\n{''.join(lines)}{''.join(stderr)[-3000:]}")
        yield re.search(r"OpenAI API at (http://\S+)/v1", "".join(lines)).group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
        assert_no_leftovers(launch_id)
    assert code == 0, "".join(stderr)[-3000:]


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
