"""The OpenAI-compatible HTTP front end of the router (FastAPI on uvicorn, as vLLM uses).

It turns a request into token ids, streams `Engine.generate`'s tokens back as OpenAI
completions or chat completions (SSE when `stream`), and stops early on a stop string or
EOS. A client that disconnects, streaming or not, closes the token stream, which cancels
the request on the workers (the router aborts what it started). A stream is answered only
once its request is admitted, so a refusal is a 429, not a stream that ends in an error.
Text is length-checked before it is tokenized, and tokenized off the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from transfer.serving.openai.metrics import HttpMetrics
from transfer.serving.openai.schema import ApiError, Sampling, bad, parse_chat, parse_completion
from transfer.serving.openai.streams import (
    Engine,
    admitted_stream,
    engine_tokens,
    unless_disconnected,
)
from transfer.serving.openai.text import StreamingText, TextCodec


@dataclass(frozen=True)
class ServedModel:
    name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...] = ()
    codec: TextCodec | None = None
    default_max_tokens: int = 16


@dataclass
class Outcome:
    ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str
    cached_tokens: int = 0  # prompt tokens the prefill side found in its prefix cache


class Handler:
    """Per-request work shared by both endpoints."""

    def __init__(self, engine: Engine, model: ServedModel, metrics: HttpMetrics) -> None:
        self.engine = engine
        self.model = model
        self.metrics = metrics

    def check_chars(self, chars: int, sampling: Sampling, param: str) -> None:
        """Refuse a text that cannot fit the context whatever it tokenizes to, before
        tokenizing it: no token spells more than `codec.max_token_chars` characters."""
        codec = self.model.codec
        room = self.model.max_model_len - sampling.max_tokens
        if codec is not None and chars > room * codec.max_token_chars:
            raise ApiError(
                400,
                f"{param}: {chars} characters are more than {room} tokens can spell (the "
                f"model's context of {self.model.max_model_len} tokens less max_tokens "
                f"{sampling.max_tokens}; a token here spells at most {codec.max_token_chars})",
                param=param,
                code="context_length_exceeded",
            )

    async def encode(self, prompt: str | tuple[int, ...], sampling: Sampling, param: str):
        """Token ids of a prompt; text is length-checked, then tokenized on a worker
        thread so that a large one does not stall the event loop (other streams, /health)."""
        if isinstance(prompt, tuple):
            ids = list(prompt)
        elif self.model.codec is None:
            raise bad(param, "this model has no tokenizer: send token ids")
        else:
            self.check_chars(len(prompt), sampling, param)
            ids = await asyncio.to_thread(self.model.codec.encode, prompt)
        if not ids:
            raise bad(param, "is empty")
        self.check_length(ids, sampling, param)
        return ids

    async def encode_chat(self, messages: list[dict], sampling: Sampling) -> list[int]:
        codec = self.model.codec
        if codec is None:
            raise bad("messages", "this model has no tokenizer; use /v1/completions with ids")
        contents = [m.get("content") for m in messages]
        self.check_chars(sum(len(c) for c in contents if isinstance(c, str)), sampling, "messages")
        try:
            ids = await asyncio.to_thread(codec.encode_chat, messages)
        except ValueError as exc:
            raise bad("messages", str(exc).removeprefix("messages: ")) from None
        self.check_length(ids, sampling, "messages")
        return ids

    def token_text(self, token: int) -> str:
        """A token as the tokenizer spells it; one it has no entry for (the model's
        vocabulary can be larger than the tokenizer's), or any token when there is no
        tokenizer, as "token_id:N", vLLM's spelling of a token by its id."""
        codec = self.model.codec
        text = codec.tokenizer.id_to_token(token) if codec is not None else None
        return text if text is not None else f"token_id:{token}"

    def check_length(self, ids: list[int], sampling: Sampling, param: str) -> None:
        limit = self.model.max_model_len
        if len(ids) + sampling.max_tokens > limit:
            raise ApiError(
                400,
                f"{param}: {len(ids)} prompt tokens + max_tokens {sampling.max_tokens} exceed "
                f"the model's context of {limit} tokens",
                param=param,
                code="context_length_exceeded",
            )

    async def run(
        self,
        ids: list[int],
        sampling: Sampling,
        emit: Callable | None,
        admit: Callable[[], None] | None = None,
    ) -> Outcome:
        """Generate; `emit(text, token, logprob)` is awaited for each streamed delta, and
        `admit()` called at the first token event (the workers took the request)."""
        request_id = uuid.uuid4().hex
        text = StreamingText(self.model.codec, sampling.stop) if self.model.codec else None
        out = Outcome([], "", [], "length")
        start = last = time.perf_counter()
        stream = engine_tokens(self.engine, request_id, ids, sampling)
        try:
            async for event in stream:
                now = time.perf_counter()
                if out.ids:
                    self.metrics.itl.observe(now - last)
                else:
                    self.metrics.ttft.observe(now - start)
                    out.cached_tokens = getattr(event, "cached_prompt_tokens", 0)
                    if admit is not None:
                        admit()
                last = now
                if event.token in self.model.eos_token_ids:
                    out.finish_reason = "stop"
                    break
                out.ids.append(event.token)
                if event.logprob is not None:
                    out.logprobs.append(event.logprob)
                delta = text.push(event.token) if text is not None else ""
                # A token whose text is held back (a partial character or stop string) is
                # sent only when the client sees tokens: no tokenizer, or logprobs.
                if emit is not None and (delta or text is None or sampling.logprobs is not None):
                    await emit(delta, event.token, event.logprob)
                if text is not None and text.stopped:
                    out.finish_reason = "stop"
                    break
                if event.finished:
                    break
        finally:
            await stream.aclose()
            self.metrics.e2e.observe(time.perf_counter() - start)
        if text is not None:
            tail = text.flush()
            if tail and emit is not None:
                await emit(tail, None, None)
            out.text = text.text
        return out


def _usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


MAX_BODY_BYTES = 4 << 20  # far above any prompt the context allows; bounds what one call buffers


def build_app(
    engine: Engine,
    model: ServedModel,
    *,
    api_key: str | None = None,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """The HTTP app over `engine`; `registry` gets the latency histograms and is served
    at /metrics (the router's own series live there too)."""
    registry = registry or CollectorRegistry()
    handler = Handler(engine, model, HttpMetrics(registry))
    gone = handler.metrics.client_gone.inc
    app = FastAPI(title="pdxfer", docs_url=None, redoc_url=None)

    @app.middleware("http")
    async def errors_and_auth(request: Request, call_next):
        try:
            if api_key and request.url.path.startswith("/v1/"):
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    raise ApiError(401, "missing or wrong API key", type="authentication_error")
            return await call_next(request)
        except ApiError as exc:
            return _error_response(exc)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException):
        # Unknown routes and wrong methods, in the OpenAI shape rather than {"detail": ...}.
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = ApiError(exc.status_code, str(exc.detail), code=code)
        return _error_response(error)

    async def body_of(request: Request):
        too_large = ApiError(
            413,
            f"the request body is larger than {MAX_BODY_BYTES} bytes",
            code="request_too_large",
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise too_large
        raw = bytearray()
        async for piece in request.stream():  # a chunked body has no length to check first
            raw += piece
            if len(raw) > MAX_BODY_BYTES:
                raise too_large
        try:
            return json.loads(raw)
        except RecursionError:
            raise ApiError(400, "the request body nests too deeply", code="invalid_json") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ApiError(400, "the request body is not valid JSON", code="invalid_json") from None

    def check_model(name: str) -> None:
        if name != model.name:
            raise ApiError(
                404,
                f"model: {name!r} is not served here; this server serves {model.name!r}",
                param="model",
                code="model_not_found",
            )

    @app.get("/health")
    async def health():
        """503 when no prefill or no decode instance serves; 200 otherwise, with
        "degraded" naming instances that serve but have a TP rank missing heartbeats."""
        if not await asyncio.to_thread(engine.is_ready):
            return JSONResponse({"status": "unavailable"}, status_code=503)
        degraded = getattr(engine, "degraded", None)
        stalled = await asyncio.to_thread(degraded) if degraded is not None else []
        if stalled:
            return {"status": "degraded", "degraded": stalled}
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(registry).decode())

    @app.get("/v1/models")
    async def models():
        card = {"id": model.name, "object": "model", "created": 0, "owned_by": "pdxfer"}
        card["max_model_len"] = model.max_model_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_completion(await body_of(request), default_max_tokens=model.default_max_tokens)
        check_model(body.model)
        prompts = [await handler.encode(p, body.sampling, "prompt") for p in body.prompts]
        created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"

        def chunk(index: int, text: str, finish: str | None, logprob=None, token=None) -> dict:
            choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
            if body.sampling.logprobs is not None and token is not None:
                choice["logprobs"] = {
                    "tokens": [handler.token_text(token)],
                    "token_logprobs": [logprob],
                }
            return {"id": cid, "object": "text_completion", "created": created,
                    "model": model.name, "choices": [choice]}  # fmt: skip

        if body.stream:

            async def run(put, admit) -> None:
                completion_tokens = cached = 0
                for index, ids in enumerate(prompts):

                    async def emit(text, token, logprob, index=index):
                        await put(chunk(index, text, None, logprob, token))

                    out = await handler.run(ids, body.sampling, emit, admit)
                    completion_tokens += len(out.ids)
                    cached += out.cached_tokens
                    await put(chunk(index, "", out.finish_reason))
                if body.include_usage:
                    usage = _usage(sum(map(len, prompts)), completion_tokens, cached)
                    await put({"id": cid, "object": "text_completion", "created": created,
                               "model": model.name, "choices": [], "usage": usage})  # fmt: skip

            return await admitted_stream(request, run, gone)

        choices, completion_tokens, cached = [], 0, 0
        for index, ids in enumerate(prompts):
            out = await unless_disconnected(request, handler.run(ids, body.sampling, None), gone)
            completion_tokens += len(out.ids)
            cached += out.cached_tokens
            choice = {"index": index, "text": out.text, "finish_reason": out.finish_reason,
                      "logprobs": None, "token_ids": out.ids}  # fmt: skip
            if body.sampling.logprobs is not None:
                choice["logprobs"] = {
                    "tokens": [handler.token_text(t) for t in out.ids],
                    "token_logprobs": out.logprobs,
                }
            choices.append(choice)
        return {"id": cid, "object": "text_completion", "created": created, "model": model.name,
                "choices": choices,
                "usage": _usage(sum(map(len, prompts)), completion_tokens, cached)}  # fmt: skip

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = parse_chat(await body_of(request), default_max_tokens=model.default_max_tokens)
        check_model(body.model)
        ids = await handler.encode_chat(list(body.messages), body.sampling)
        created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"

        def chunk(delta: dict, finish: str | None, logprob=None, token=None) -> dict:
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            if body.sampling.logprobs is not None and token is not None:
                choice["logprobs"] = {
                    "content": [{"token": handler.token_text(token), "logprob": logprob}]
                }
            return {"id": cid, "object": "chat.completion.chunk", "created": created,
                    "model": model.name, "choices": [choice]}  # fmt: skip

        if body.stream:

            async def run(put, admit) -> None:
                await put(chunk({"role": "assistant", "content": ""}, None))

                async def emit(text, token, logprob):
                    await put(chunk({"content": text}, None, logprob, token))

                out = await handler.run(ids, body.sampling, emit, admit)
                await put(chunk({}, out.finish_reason))
                if body.include_usage:
                    await put({"id": cid, "object": "chat.completion.chunk", "created": created,
                               "model": model.name, "choices": [],
                               "usage": _usage(len(ids), len(out.ids), out.cached_tokens)})  # fmt: skip

            return await admitted_stream(request, run, gone)

        out = await unless_disconnected(request, handler.run(ids, body.sampling, None), gone)
        choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
                  "finish_reason": out.finish_reason, "logprobs": None}  # fmt: skip
        if body.sampling.logprobs is not None:
            choice["logprobs"] = {
                "content": [
                    {"token": handler.token_text(t), "logprob": lp}
                    for t, lp in zip(out.ids, out.logprobs, strict=False)
                ]
            }
        return {"id": cid, "object": "chat.completion", "created": created, "model": model.name,
                "choices": [choice], "usage": _usage(len(ids), len(out.ids), out.cached_tokens)}  # fmt: skip

    return app


RETRY_AFTER_S = 1  # what a refused (429) client is told to wait


def _error_response(exc: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)
