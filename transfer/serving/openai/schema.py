"""OpenAI request bodies, checked and turned into frozen dataclasses.

Every rejection is an `ApiError` naming the parameter, in the OpenAI error shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

MAX_PROMPTS = 256  # prompts in one completion request: each is a request to the workers
TOKEN_ID_LIMIT = 1 << 31  # ids travel as int32; anything past this is outside every vocabulary


class ApiError(Exception):
    """An HTTP error in the OpenAI shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        type: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad(param: str, message: str, status: int = 400) -> ApiError:
    return ApiError(status, f"{param}: {message}", param=param)


@dataclass(frozen=True)
class Sampling:
    """What picks each token: temperature 0 is greedy; seed makes sampling reproducible."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; k: the chosen token's logprob (top-1)


@dataclass(frozen=True)
class CompletionBody:
    model: str
    prompts: tuple[str | tuple[int, ...], ...]  # each a text or token ids
    sampling: Sampling
    stream: bool
    include_usage: bool


@dataclass(frozen=True)
class ChatBody:
    model: str
    messages: tuple[dict, ...]
    sampling: Sampling
    stream: bool
    include_usage: bool


def _number(body: dict, name: str, default, low: float, high: float, kind=float):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(name, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise bad(name, f"must be a finite number, got {value!r}")
    if kind is int and int(value) != value:
        raise bad(name, f"must be an integer, got {value!r}")
    if not low <= value <= high:
        raise bad(name, f"must be in [{low:g}, {high:g}], got {value!r}")
    return kind(value)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise bad("stop", "must be a string or a list of at most 4 strings")


def _common(body: dict, *, default_max_tokens: int) -> tuple[Sampling, bool, bool]:
    n = body.get("n", 1)
    if isinstance(n, bool) or n != 1:
        raise ApiError(
            400, f"n: only n=1 is supported, got {n!r}", param="n", code="unsupported_parameter"
        )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = default_max_tokens
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", 16, 1, 1 << 20, int)
    seed = body.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 64
    ):
        raise bad("seed", f"must be an integer in [-2**63, 2**64), got {seed!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("stream", f"must be true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad("stream_options", "must be an object")
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-9, 1.0),
        seed=seed,
        stop=_stop(body),
    )
    return sampling, stream, bool(options.get("include_usage", False))


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required (GET /v1/models lists the served model)")
    return model


def _prompts(prompt: Any) -> tuple[str | tuple[int, ...], ...]:
    def is_ids(x) -> bool:
        return (
            isinstance(x, list)
            and bool(x)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        )

    if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and not is_ids(prompt):
        raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompt)}")
    if isinstance(prompt, str):
        return (_text("prompt", prompt),)
    if is_ids(prompt):
        return (_ids(tuple(prompt)),)
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return tuple(_text("prompt", p) for p in prompt)
        if all(is_ids(p) for p in prompt):
            return tuple(_ids(tuple(p)) for p in prompt)
    raise bad(
        "prompt",
        "must be a string, a list of strings, a list of token ids or a list of such lists",
    )


def _text(param: str, text: str) -> str:
    """`text` if it is valid Unicode (JSON lets a lone UTF-16 surrogate through)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(param, "contains a lone UTF-16 surrogate, not valid Unicode") from None
    return text


def _ids(prompt: tuple[int, ...]) -> tuple[int, ...]:
    if any(not 0 <= t < TOKEN_ID_LIMIT for t in prompt):
        raise bad("prompt", f"token ids must be in [0, 2**31), got {max(prompt, key=abs)}")
    return prompt


def parse_completion(body: Any, *, default_max_tokens: int = 16) -> CompletionBody:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("echo"):
        raise bad("echo", "echo=true is not supported")
    sampling, stream, include_usage = _common(body, default_max_tokens=default_max_tokens)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        if isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 1:
            raise bad("logprobs", f"only 0 or 1 (the chosen token) is supported, got {logprobs!r}")
        sampling = _with_logprobs(sampling, logprobs)
    return CompletionBody(
        _model(body), _prompts(body.get("prompt")), sampling, stream, include_usage
    )


def parse_chat(body: Any, *, default_max_tokens: int) -> ChatBody:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}]", "must be an object with a string 'role'")
        content = message.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise bad(f"messages[{i}].content", "only text parts are supported")
            content = "".join(str(p.get("text", "")) for p in content)
        if content is not None and not isinstance(content, str):
            raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
        if content is not None:
            _text(f"messages[{i}].content", content)
        checked.append({**message, "content": content or ""})
    sampling, stream, include_usage = _common(body, default_max_tokens=default_max_tokens)
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad("logprobs", f"must be true or false, got {logprobs!r}")
    if logprobs:
        top = body.get("top_logprobs") or 0
        if top not in (0, 1):
            raise bad("top_logprobs", f"only 0 or 1 is supported, got {top!r}")
        sampling = _with_logprobs(sampling, 1)
    return ChatBody(_model(body), tuple(checked), sampling, stream, include_usage)


def _with_logprobs(sampling: Sampling, k: int) -> Sampling:
    return replace(sampling, logprobs=k)
