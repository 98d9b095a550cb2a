"""The HTTP engine over the router: what a request becomes, and readiness."""

from __future__ import annotations

from transfer.control.types import GenerateRequest, SamplingParams
from transfer.net import free_port
from transfer.serving.openai.engine import RouterEngine
from transfer.serving.openai.router import Router
from transfer.serving.openai.schema import Sampling


class _Recorder:
    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    def generate(self, request: GenerateRequest):
        self.requests.append(request)
        return iter(())


def test_a_request_becomes_one_generate_with_its_sampling():
    router = _Recorder()
    engine = RouterEngine(router)
    list(engine.generate("r1", [5, 6], Sampling(max_tokens=3, temperature=0.5, top_p=0.9, seed=-1)))
    list(engine.generate("r2", [7], Sampling(max_tokens=1, temperature=0.0)))
    first, second = router.requests
    assert first == GenerateRequest("r1", (5, 6), 3, SamplingParams(0.5, 0.9, (1 << 64) - 1))
    assert second.sampling == SamplingParams(0.0, 1.0, None) and second.sampling.greedy


def test_not_ready_when_no_instance_answers():
    nobody = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    router = Router(nobody[:1], nobody[1:])
    try:
        assert RouterEngine(router).is_ready() is False
    finally:
        router.close()
