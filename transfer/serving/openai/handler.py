"""What the HTTP endpoints share per request: the served model's facts, a prompt checked
and tokenized (off the event loop), and one generation run over the engine's token stream,
with its stop strings, end tokens and latency histograms."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from transfer.serving.openai.metrics import HttpMetrics
from transfer.serving.openai.schema import ApiError, Sampling, bad
from transfer.serving.openai.streams import Engine, engine_tokens
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


def usage(prompt: int, completion: int, cached: int = 0) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
