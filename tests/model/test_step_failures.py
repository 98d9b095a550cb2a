"""What a failed decode step leaves behind, for Qwen3-Next, Kimi-Linear and Nemotron-H: one
that fails its checks writes nothing (the decode engine may run its sequences again), and
one that fails after them may have advanced the linear-attention states in place, so it
raises `StepFailed`, of no error kind that says "changed nothing" (the engines end its
requests instead of running them again)."""

from __future__ import annotations

import pytest
import torch

from tests.model.batching_support import ARCHS, engines, model_of, random_prompt, request_caches
from transfer.errors import InvalidInput, WrongState
from transfer.model.batch import SequenceStep
from transfer.model.batch_runner import StepFailed
from transfer.serving.ranks.rank_protocol import kind_of

PROMPT = 20
BLOCKS = (3, 7)  # room for the prompt and a few decode tokens


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    return model_of(request.param, tmp_path_factory)


def prefilled(model, prompt: list[int]):
    """Engines with `prompt` prefilled into slot 0; the step that decodes its next token."""
    e = engines(model)
    out = e.batch.step([SequenceStep(prompt, 0, BLOCKS)])
    return e, SequenceStep.decode(out.tokens[0], 0, BLOCKS, PROMPT)


def first_linear_layer(model) -> int:
    return next(i for i, layer in enumerate(model.geometry.layers) if layer.kind.is_linear)


def test_a_step_that_fails_its_checks_writes_nothing(model):
    prompt = random_prompt(model.geometry.vocab_size, PROMPT)
    e, decode = prefilled(model, prompt)
    before = request_caches(e.caches, 0, BLOCKS, PROMPT + 1)
    free_slot = SequenceStep.decode(decode.tokens[0], 1, (9, 10), PROMPT)  # slot 1 holds nothing
    with pytest.raises(ValueError, match="holds no request state") as refused:
        e.batch.step([decode, free_slot])
    assert kind_of(refused.value) in (InvalidInput, WrongState)  # what a rank answers
    after = request_caches(e.caches, 0, BLOCKS, PROMPT + 1)
    assert [key for key in before if not torch.equal(before[key], after[key])] == []
    # so it runs again from the same state: the same token as a step that never failed
    again = e.batch.step([decode]).tokens
    fresh, decode_fresh = prefilled(model, prompt)
    assert again == fresh.batch.step([decode_fresh]).tokens


def test_a_step_that_fails_after_its_checks_raises_step_failed_with_states_advanced(model):
    e, decode = prefilled(model, random_prompt(model.geometry.vocab_size, PROMPT))
    linear = first_linear_layer(model)
    before = request_caches(e.caches, 0, BLOCKS, PROMPT)  # its states, and KV rows kept

    def fail_after(layer: int) -> None:
        if layer == linear:
            raise RuntimeError("the device failed mid-step")

    with pytest.raises(StepFailed, match="the device failed mid-step") as failed:
        e.batch.step([decode], after_layer=fail_after)
    assert kind_of(failed.value) is None  # an internal error: no engine runs it again
    after = request_caches(e.caches, 0, BLOCKS, PROMPT)
    changed = [key for key in before if not torch.equal(before[key], after[key])]
    assert changed, "the failed step left every state as it was"
