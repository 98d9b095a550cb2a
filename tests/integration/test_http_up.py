"""The real `openai` client against `pdxfer up` on a tiny checkpoint with a tokenizer: one
`up` process per module (a router with HTTP, one prefill, one decode), shared by the tests."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.support.launch import MAIN, ROOT
from tests.support.up_process import up_process
from transfer.hf_geometry import from_hf_config
from transfer.model.reference import reference_generate
from transfer.serving.openai.text import TextCodec

pytestmark = pytest.mark.slow

STARTUP_S = 240
API_KEY = "sk-test-" + uuid.uuid4().hex[:8]
PROMPT = "Prefill computes the prompt"  # the tiny model does not end it early
LONG = 2000  # tokens: a request that would decode for a long while


class Up:
    def __init__(self, directory, proc, launch_id, base, metrics):
        self.directory = directory
        self.proc = proc
        self.launch_id = launch_id
        self.base = base  # http://host:port
        self.metrics = metrics  # role -> worker /metrics URL
        self.model = directory.name
        self.codec = TextCodec.from_dir(directory)
        self.eos = set(json.loads((directory / "config.json").read_text())["eos_token_id"])

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=api_key, max_retries=0,
                             timeout=120)  # fmt: skip

    def gauges(self) -> dict[str, dict[str, float]]:
        out = {}
        for role, url in self.metrics.items():
            text = httpx.get(url, timeout=10).text
            out[role] = {
                name: float(value)
                for name, value in re.findall(
                    r"^(pdxfer_(?:kv_blocks|state_slots)_(?:free|total)) (\S+)$", text, re.M
                )
            }
        return out


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    directory = tmp_path_factory.mktemp("http") / "tiny-ckpt"
    subprocess.run([sys.executable, "-c", MAIN, "make-tiny", str(directory)], cwd=ROOT,
                   check=True, capture_output=True)  # fmt: skip
    args = ["up", "--model", str(directory), "--http-port", "0", "--max-seqs", "32",
            "--gpu-mem", "64MiB"]  # fmt: skip
    env = {"PDXFER_API_KEY": API_KEY}
    with up_process(args, env=env, startup_s=STARTUP_S) as running:
        text = running.stdout
        base = re.search(r"OpenAI API at (http://\S+)/v1", text).group(1)
        metrics = dict(re.findall(r"^(prefill|decode)\s+\S+\s+metrics (\S+)$", text, re.M))
        yield Up(directory, running.proc, running.launch_id, base, metrics)


def complete(up: Up, prompt, max_tokens: int = 8, **kwargs):
    return up.client().completions.create(
        model=up.model, prompt=prompt, max_tokens=max_tokens, **kwargs
    )


def ids_of(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_models_health_and_metrics(up):
    assert [m.id for m in up.client().models.list().data] == [up.model]
    assert httpx.get(up.base + "/health", timeout=10).status_code == 200
    complete(up, PROMPT, max_tokens=2)
    text = httpx.get(up.base + "/metrics", timeout=10).text
    for series in ("ttft", "itl", "e2e"):
        count = re.search(rf"^pdxfer_router_{series}_seconds_count (\S+)$", text, re.M)
        assert count and float(count.group(1)) >= 1, series


def test_greedy_text_and_token_prompts_match_the_colocated_reference(up):
    ids = up.codec.encode(PROMPT)
    by_text = complete(up, PROMPT, temperature=0)
    by_ids = complete(up, ids, temperature=0)
    choice = by_text.choices[0]
    tokens = ids_of(choice)
    assert ids_of(by_ids.choices[0]) == tokens and by_ids.choices[0].text == choice.text
    reference = reference_generate(from_hf_config(up.directory), ids, 8, source=str(up.directory))
    if choice.finish_reason == "stop":  # ended on an end token, which is not returned
        assert reference[len(tokens)] in up.eos
    else:
        assert choice.finish_reason == "length" and len(tokens) == 8
    assert tokens == reference[: len(tokens)]
    assert choice.text == up.codec.decode(tokens)
    usage = by_text.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), len(tokens))
    assert usage.total_tokens == len(ids) + len(tokens)


def test_logprobs_are_the_chosen_tokens(up):
    choice = complete(up, PROMPT, temperature=0, logprobs=1).choices[0]
    logprobs = choice.logprobs.token_logprobs
    assert len(logprobs) == len(ids_of(choice)) and all(lp <= 0 for lp in logprobs)


def test_chat_and_its_stream_agree(up):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    client = up.client()
    reply = client.chat.completions.create(
        model=up.model, messages=messages, max_tokens=8, temperature=0
    )
    rendered = up.codec.render_chat(messages)
    assert reply.usage.prompt_tokens == len(up.codec.encode(rendered))
    assert reply.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model=up.model, messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == reply.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens


def test_streamed_completion_is_the_whole_completion(up):
    whole = complete(up, PROMPT, temperature=0, max_tokens=10).choices[0]
    chunks = list(complete(up, PROMPT, temperature=0, max_tokens=10, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.text


def test_stop_string_cuts_the_text(up):
    full = complete(up, PROMPT, temperature=0, max_tokens=16).choices[0].text
    visible = [i for i, ch in enumerate(full) if ch.isprintable() and ch != "\ufffd"]
    # Greedy on the seeded tiny checkpoint: the text is the same every run, so a text too
    # short to cut is a change to the model or the decoder, not bad luck.
    assert len(visible) >= 4, f"the tiny model's text is too short to cut: {full!r}"
    at = visible[len(visible) // 2]
    stop = full[at : at + 2]
    cut = complete(up, PROMPT, temperature=0, max_tokens=16, stop=[stop]).choices[0]
    assert cut.text == full[: full.index(stop)]
    assert cut.finish_reason == "stop"
    chunks = list(complete(up, PROMPT, temperature=0, max_tokens=16, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut.text


def test_a_seed_reproduces_its_tokens(up):
    def sampled(seed: int) -> list[int]:
        choice = complete(up, PROMPT, max_tokens=8, temperature=1.5, seed=seed).choices[0]
        return ids_of(choice)

    assert sampled(5) == sampled(5)
    assert len({tuple(sampled(seed)) for seed in range(4)}) > 1
    greedy = ids_of(complete(up, PROMPT, temperature=0).choices[0])
    assert any(sampled(seed)[: len(greedy)] != greedy for seed in range(4))


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"prompt": [7] * 4096}, openai.BadRequestError, "prompt"),
        ({"model": "no-such-model"}, openai.NotFoundError, "model"),
        ({"n": 2}, openai.BadRequestError, "n"),
    ],
    ids=["longer-than-context", "unknown-model", "n>1"],
)
def test_bad_requests_get_named_errors(up, kwargs, error, param):
    request = {"model": up.model, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(error) as caught:
        up.client().completions.create(**request)
    body = caught.value.body
    assert body["param"] == param and body["message"].startswith(param)
    if "prompt" in kwargs:
        assert body["code"] == "context_length_exceeded" and "4096" in body["message"]


def test_a_body_that_is_not_json_is_named(up):
    reply = httpx.post(
        up.base + "/v1/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "invalid_json"


def test_the_api_key_is_required(up):
    missing = httpx.get(up.base + "/v1/models", timeout=30)
    assert missing.status_code == 401
    assert missing.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        up.client(api_key="wrong").models.list()


def test_a_client_that_leaves_mid_stream_frees_both_sides(up):
    before = up.gauges()
    seen = 0
    with httpx.stream(
        "POST",
        up.base + "/v1/completions",
        json={"model": up.model, "prompt": PROMPT, "max_tokens": LONG, "stream": True,
              "temperature": 0},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    ) as reply:  # fmt: skip
        for line in reply.iter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                during = up.gauges()
                break
    assert seen == 3
    assert during["decode"]["pdxfer_state_slots_free"] < before["decode"]["pdxfer_state_slots_free"]
    deadline = time.monotonic() + 60
    while (now := up.gauges()) != before:
        assert time.monotonic() < deadline, f"caches not freed: {now} != {before}"
        time.sleep(0.2)
    for role in ("prefill", "decode"):
        free = now[role]
        assert free["pdxfer_kv_blocks_free"] == free["pdxfer_kv_blocks_total"], role
        assert free["pdxfer_state_slots_free"] == free["pdxfer_state_slots_total"], role


def test_32_concurrent_streaming_clients_all_finish(up):
    client = up.client()

    def one(i: int) -> tuple[str | None, int]:
        stream = client.completions.create(
            model=up.model, prompt=f"{PROMPT} {i}", max_tokens=6, stream=True, seed=i
        )
        chunks = list(stream)
        return chunks[-1].choices[0].finish_reason, len(chunks)

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, range(32)))
    assert all(finish in ("length", "stop") for finish, _ in results), results


def test_a_client_that_leaves_a_non_streaming_request_frees_both_sides(up):
    before = up.gauges()
    body = json.dumps({"model": up.model, "prompt": PROMPT, "max_tokens": LONG,
                       "temperature": 0}).encode()  # fmt: skip
    host, port = httpx.URL(up.base).host, httpx.URL(up.base).port
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
    # The client leaves once the request holds caches (not after a fixed time: an idle
    # machine may finish the whole request first).
    with socket.create_connection((host, port), timeout=10) as client:
        client.sendall(head.encode() + body)
        deadline = time.monotonic() + 60
        while up.gauges() == before:
            assert time.monotonic() < deadline, "the request never held a cache"
            time.sleep(0.05)
    deadline = time.monotonic() + 60
    while (now := up.gauges()) != before:
        assert time.monotonic() < deadline, f"caches not freed: {now} != {before}"
        time.sleep(0.2)
    gone = re.search(r"^pdxfer_router_http_client_gone_total (\S+)$",
                     httpx.get(up.base + "/metrics", timeout=10).text, re.M)  # fmt: skip
    assert gone and float(gone.group(1)) >= 1
