"""The two generation endpoints, /v1/completions and /v1/chat/completions: a parsed body
run through the `Handler`, answered whole or streamed as SSE chunks in OpenAI's shape."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request

from transfer.serving.openai.handler import Handler, ServedModel, usage
from transfer.serving.openai.schema import ApiError, parse_chat, parse_completion
from transfer.serving.openai.streams import admitted_stream, unless_disconnected


def check_model(model: ServedModel, name: str) -> None:
    """404 (model_not_found) unless the request names the model served here."""
    if name != model.name:
        raise ApiError(
            404,
            f"model: {name!r} is not served here; this server serves {model.name!r}",
            param="model",
            code="model_not_found",
        )


async def completions(handler: Handler, request: Request, payload: Any):
    """/v1/completions for the JSON `payload`: a text_completion, or its SSE stream."""
    model, gone = handler.model, handler.metrics.client_gone.inc
    body = parse_completion(payload, default_max_tokens=model.default_max_tokens)
    check_model(model, body.model)
    prompts = [await handler.encode(p, body.sampling, "prompt") for p in body.prompts]
    created, cid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
    wants_logprobs = body.sampling.logprobs is not None

    def chunk(index: int, text: str, finish: str | None, logprob=None, token=None) -> dict:
        choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
        if wants_logprobs and token is not None:
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
                counts = usage(sum(map(len, prompts)), completion_tokens, cached)
                await put({"id": cid, "object": "text_completion", "created": created,
                           "model": model.name, "choices": [], "usage": counts})  # fmt: skip

        return await admitted_stream(request, run, gone)

    choices, completion_tokens, cached = [], 0, 0
    for index, ids in enumerate(prompts):
        out = await unless_disconnected(request, handler.run(ids, body.sampling, None), gone)
        completion_tokens += len(out.ids)
        cached += out.cached_tokens
        choice = {"index": index, "text": out.text, "finish_reason": out.finish_reason,
                  "logprobs": None, "token_ids": out.ids}  # fmt: skip
        if wants_logprobs:
            choice["logprobs"] = {
                "tokens": [handler.token_text(t) for t in out.ids],
                "token_logprobs": out.logprobs,
            }
        choices.append(choice)
    return {"id": cid, "object": "text_completion", "created": created, "model": model.name,
            "choices": choices,
            "usage": usage(sum(map(len, prompts)), completion_tokens, cached)}  # fmt: skip


async def chat(handler: Handler, request: Request, payload: Any):
    """/v1/chat/completions for the JSON `payload`: a chat.completion, or its SSE stream."""
    model, gone = handler.model, handler.metrics.client_gone.inc
    body = parse_chat(payload, default_max_tokens=model.default_max_tokens)
    check_model(model, body.model)
    ids = await handler.encode_chat(list(body.messages), body.sampling)
    created, cid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
    wants_logprobs = body.sampling.logprobs is not None

    def chunk(delta: dict, finish: str | None, logprob=None, token=None) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        if wants_logprobs and token is not None:
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
                           "usage": usage(len(ids), len(out.ids), out.cached_tokens)})  # fmt: skip

        return await admitted_stream(request, run, gone)

    out = await unless_disconnected(request, handler.run(ids, body.sampling, None), gone)
    choice = {"index": 0, "message": {"role": "assistant", "content": out.text},
              "finish_reason": out.finish_reason, "logprobs": None}  # fmt: skip
    if wants_logprobs:
        choice["logprobs"] = {
            "content": [
                {"token": handler.token_text(t), "logprob": lp}
                for t, lp in zip(out.ids, out.logprobs, strict=False)
            ]
        }
    return {"id": cid, "object": "chat.completion", "created": created, "model": model.name,
            "choices": [choice], "usage": usage(len(ids), len(out.ids), out.cached_tokens)}  # fmt: skip
