"""The HTTP app's `Engine` over the router: each request is one `Router.generate`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from transfer.control.types import GenerateRequest, SamplingParams, TokenEvent
from transfer.serving.openai.router import Router
from transfer.serving.openai.schema import Sampling


class RouterEngine:
    """Generates through `router`. Closing a stream (the client left, a stop string was
    seen) closes the router's: the decode call is cancelled, which frees the decode
    instance's blocks and slot; a request dropped before its first token is Aborted at
    its prefill instance."""

    def __init__(self, router: Router) -> None:
        self.router = router

    def generate(
        self, request_id: str, prompt_ids: list[int], sampling: Sampling
    ) -> Iterator[TokenEvent]:
        return self.router.generate(_request(request_id, prompt_ids, sampling))

    def agenerate(
        self, request_id: str, prompt_ids: list[int], sampling: Sampling
    ) -> AsyncIterator[TokenEvent]:
        return self.router.agenerate(_request(request_id, prompt_ids, sampling))

    def is_ready(self) -> bool:
        return self.router.is_ready()

    def degraded(self) -> list[str]:
        return self.router.degraded()


def _request(request_id: str, prompt_ids: list[int], sampling: Sampling) -> GenerateRequest:
    seed = None if sampling.seed is None else sampling.seed % (1 << 64)
    params = SamplingParams(sampling.temperature, sampling.top_p, seed)
    return GenerateRequest(request_id, tuple(prompt_ids), sampling.max_tokens, params)
