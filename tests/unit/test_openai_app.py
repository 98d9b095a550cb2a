"""The OpenAI HTTP layer over an in-process engine (the end-to-end test runs real workers)."""

import json
import threading
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient

from transfer.errors import CapacityError
from transfer.model.tiny_tokenizer import write_tiny_tokenizer
from transfer.serving.openai.app import MAX_BODY_BYTES, build_app
from transfer.serving.openai.handler import ServedModel
from transfer.serving.openai.text import TextCodec


@dataclass(frozen=True)
class Event:
    token: int
    logprob: float | None
    finished: bool


class CountingEngine:
    """Token i of a request is (sum(prompt) + i) % 100 + 3, so outputs are checkable."""

    def __init__(self) -> None:
        self.calls = []
        self.closed = threading.Event()
        self.fail: Exception | None = None

    def generate(self, request_id, prompt_ids, sampling):
        self.calls.append((list(prompt_ids), sampling))
        if self.fail is not None:
            raise self.fail
        try:
            base = sum(prompt_ids)
            for i in range(sampling.max_tokens):
                token = (base + i) % 100 + 3
                yield Event(
                    token, -0.5 if sampling.logprobs else None, i == sampling.max_tokens - 1
                )
        finally:
            self.closed.set()

    def is_ready(self) -> bool:
        return True


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(path, 512)
    return TextCodec.from_dir(path)


def make_client(engine, codec=None, api_key=None, eos=()):
    model = ServedModel("tiny", max_model_len=64, eos_token_ids=eos, codec=codec)
    return TestClient(build_app(engine, model, api_key=api_key))


def expected(prompt, n):
    return [(sum(prompt) + i) % 100 + 3 for i in range(n)]


def test_completion_with_token_ids_returns_the_engine_tokens_and_usage():
    engine = CountingEngine()
    client = make_client(engine)
    reply = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}
    )
    assert reply.status_code == 200
    body = reply.json()
    assert body["choices"][0]["token_ids"] == expected([5, 6, 7], 4)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert engine.calls[0][1].temperature == 1.0


@dataclass(frozen=True)
class CachedEvent(Event):
    cached_prompt_tokens: int = 0


class PrefixHitEngine(CountingEngine):
    """The first event says the prefill side found 2 of the prompt's tokens cached."""

    def generate(self, request_id, prompt_ids, sampling):
        for i, e in enumerate(super().generate(request_id, prompt_ids, sampling)):
            yield CachedEvent(e.token, e.logprob, e.finished, 2 if i == 0 else 0)


def test_usage_reports_the_prefix_cache_hit_as_cached_tokens(codec):
    client = make_client(PrefixHitEngine(), codec)
    reply = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2}
    )
    assert reply.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 4}
    chat = client.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert chat.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}


def test_a_list_of_prompts_gives_one_choice_each():
    client = make_client(CountingEngine())
    body = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": [[1, 2], [9]], "max_tokens": 2}
    ).json()
    assert [c["token_ids"] for c in body["choices"]] == [expected([1, 2], 2), expected([9], 2)]
    assert [c["index"] for c in body["choices"]] == [0, 1]


def test_text_prompt_is_tokenized_and_the_answer_detokenized(codec):
    engine = CountingEngine()
    client = make_client(engine, codec)
    body = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": "Hello, world!", "max_tokens": 5}
    ).json()
    prompt = codec.encode("Hello, world!")
    assert engine.calls[0][0] == prompt
    assert body["choices"][0]["text"] == codec.decode(expected(prompt, 5))


def test_stop_string_ends_the_text_before_it(codec):
    engine = CountingEngine()
    client = make_client(engine, codec)
    prompt = codec.encode("Hello")
    full = codec.decode(expected(prompt, 8))
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    body = client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "Hello", "max_tokens": 8, "stop": stop},
    ).json()
    assert body["choices"][0]["text"] == full[: full.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_streaming_chat_sends_role_deltas_finish_and_done(codec):
    client = make_client(CountingEngine(), codec)
    with client.stream(
        "POST",
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as reply:
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    prompt = codec.encode(codec.render_chat([{"role": "user", "content": "hi"}]))
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == codec.decode(expected(prompt, 6))


def test_eos_token_finishes_with_stop():
    client = make_client(CountingEngine(), eos=(expected([1], 3)[2],))
    body = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 6}
    ).json()
    assert body["choices"][0]["token_ids"] == expected([1], 2)
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "other", "prompt": [1]}, 404, "model"),
        ({"model": "tiny", "prompt": [1], "n": 2}, 400, "n"),
        ({"model": "tiny", "prompt": list(range(1, 60)), "max_tokens": 10}, 400, "prompt"),
        ({"model": "tiny", "prompt": "text without a tokenizer"}, 400, "prompt"),
        ({"model": "tiny", "prompt": [1], "temperature": 5}, 400, "temperature"),
        ({"model": "tiny", "prompt": [1], "echo": True}, 400, "echo"),
        ({"model": "tiny", "prompt": {"x": 1}}, 400, "prompt"),
        ({"prompt": [1]}, 400, "model"),
    ],
)
def test_bad_requests_get_named_openai_errors(body, status, param):
    reply = make_client(CountingEngine()).post("/v1/completions", json=body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert error["param"] == param
    assert param in error["message"]


def test_a_body_that_is_not_json_is_a_named_400():
    reply = make_client(CountingEngine()).post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert reply.status_code == 400
    assert "not valid JSON" in reply.json()["error"]["message"]


def test_a_body_over_the_limit_gets_413_before_it_is_parsed():
    client = make_client(CountingEngine())
    big = b'{"model": "tiny", "prompt": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}'
    reply = client.post(
        "/v1/completions", content=big, headers={"content-type": "application/json"}
    )
    assert reply.status_code == 413
    error = reply.json()["error"]
    assert error["code"] == "request_too_large" and str(MAX_BODY_BYTES) in error["message"]

    def chunks():  # no Content-Length: the limit still holds while reading
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(MAX_BODY_BYTES // (1 << 20) + 1):
            yield b"x" * (1 << 20)
        yield b'"}'

    reply = client.post("/v1/chat/completions", content=chunks())
    assert reply.status_code == 413


def test_api_key_is_required_when_configured():
    client = make_client(CountingEngine(), api_key="s3cret")
    body = {"model": "tiny", "prompt": [1], "max_tokens": 1}
    assert client.post("/v1/completions", json=body).status_code == 401
    wrong = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer x"})
    assert wrong.status_code == 401
    right = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cret"})
    assert right.status_code == 200
    assert client.get("/health").status_code == 200  # probes need no key


def test_worker_capacity_error_is_429():
    engine = CountingEngine()
    engine.fail = CapacityError("no free slot")
    reply = make_client(engine).post("/v1/completions", json={"model": "tiny", "prompt": [1]})
    assert reply.status_code == 429
    assert reply.json()["error"]["code"] == "resource_exhausted"


def test_models_and_metrics():
    client = make_client(CountingEngine())
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
    client.post("/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 3})
    text = client.get("/metrics").text
    assert "pdxfer_router_ttft_seconds_count 1.0" in text
    assert "pdxfer_router_itl_seconds_count 2.0" in text


@pytest.mark.parametrize(
    "body, param",
    [
        ({"max_tokens": 1e309}, "max_tokens"),
        ({"max_tokens": float("nan")}, "max_tokens"),
        ({"n": True}, "n"),
        ({"prompt": [2**31]}, "prompt"),
        ({"prompt": [2**70]}, "prompt"),
        ({"prompt": [[1]] * 257}, "prompt"),
    ],
)
def test_probe_inputs_are_named_400s(body, param):
    client = make_client(CountingEngine())
    raw = json.dumps({"model": "tiny", "prompt": [1, 2], **body})
    reply = client.post("/v1/completions", content=raw.replace("NaN", "NaN"))
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_lone_surrogates_are_named_400s(codec):
    client = make_client(CountingEngine(), codec=codec)
    raw = '{"model": "tiny", "prompt": "a\\ud800b"}'
    reply = client.post("/v1/completions", content=raw)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    raw = '{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}'
    reply = client.post("/v1/chat/completions", content=raw)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "messages[0].content"


def test_chat_logprobs_must_be_a_boolean(codec):
    client = make_client(CountingEngine(), codec=codec)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "logprobs"


def test_deeply_nested_json_is_a_400():
    client = make_client(CountingEngine())
    reply = client.post("/v1/completions", content="[" * 100_000 + "]" * 100_000)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "invalid_json"


def test_unknown_routes_and_methods_get_openai_errors():
    client = make_client(CountingEngine())
    for reply, status in ((client.get("/v1/nope"), 404), (client.get("/v1/completions"), 405)):
        assert reply.status_code == status
        assert reply.json()["error"]["type"] == "invalid_request_error"


def test_refused_non_streaming_request_is_429_with_retry_after():
    engine = CountingEngine()
    engine.fail = CapacityError("pool full")
    reply = make_client(engine).post(
        "/v1/completions", json={"model": "tiny", "prompt": [1], "max_tokens": 2}
    )
    assert reply.status_code == 429 and reply.headers["retry-after"] == "1"
