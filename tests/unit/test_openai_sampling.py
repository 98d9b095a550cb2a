"""Sampling on the rank: greedy is today's argmax, seeded sampling is one reproducible
stream whichever engine picks each token, top-p cuts the tail, logprobs are the model's."""

from __future__ import annotations

import pytest
import torch

from transfer.control import convert
from transfer.control.types import GenerateRequest, SamplingParams, Ticket, TokenEvent
from transfer.errors import InvalidInput
from transfer.model.caches import LocalCaches
from transfer.model.reference import reference_generate, reference_model
from transfer.model.runner import RankEngine
from transfer.model.sampling import (
    Sampler,
    choose,
    choose_rows,
    logprob_of,
    logprobs_of,
    stream_seed,
)
from transfer.presets import get_preset

PROMPT = [11, 400, 23, 5, 97, 310, 2, 64, 128, 7]
BLOCK_SIZE = 8
TOKENS = 6


def engine(geometry) -> RankEngine:
    caches = LocalCaches(geometry, num_blocks=4, block_size=BLOCK_SIZE, num_slots=2)
    return RankEngine(geometry, caches, model=reference_model(geometry))


def generate(geometry, sampler: Sampler, split_at: int | None = None) -> list:
    """The picks of TOKENS tokens; with `split_at`, a second engine (another "process")
    continues from a copy of the first's caches after that many tokens."""
    first = engine(geometry)
    picks = [first.prefill_pick(PROMPT, [0, 1], 0, sampler)]
    current = first
    for index in range(1, TOKENS):
        if index == split_at:
            current = engine(geometry)
            for key, tensor in first.caches.tensors.items():
                current.caches.tensors[key].copy_(tensor)
            current.mark_filling(0, [0, 1])
            current.mark_ready(0)
        position = len(PROMPT) + index - 1
        picks.append(current.decode_step_pick(picks[-1].token, position, [0, 1], 0, sampler, index))
    return picks


@pytest.fixture(scope="module")
def geometry():
    return get_preset("tiny-qwen3-next")


def test_greedy_picks_are_the_greedy_path_bit_for_bit(geometry):
    picks = generate(geometry, Sampler())
    assert [p.token for p in picks] == reference_generate(geometry, PROMPT, TOKENS)
    assert all(p.logprob <= 0 for p in picks)


def test_a_seed_gives_one_stream_whichever_engine_samples(geometry):
    hot = Sampler(temperature=1.5, seed=7)
    one = [p.token for p in generate(geometry, hot)]
    assert [p.token for p in generate(geometry, hot, split_at=1)] == one
    assert [p.token for p in generate(geometry, hot, split_at=3)] == one
    others = {tuple(p.token for p in generate(geometry, Sampler(1.5, seed=s))) for s in range(4)}
    assert len(others) > 1, "different seeds should give different tokens"


def test_top_p_keeps_the_smallest_set_reaching_it():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    drawn = {choose(logits, Sampler(1.0, top_p=0.75, seed=s), 0) for s in range(200)}
    assert drawn == {0, 1}
    assert {choose(logits, Sampler(1.0, top_p=1e-6, seed=s), 0) for s in range(50)} == {0}
    everything = {choose(logits, Sampler(1.0, seed=s), 0) for s in range(400)}
    assert everything == {0, 1, 2, 3}


def test_logprob_is_the_models_log_softmax():
    logits = torch.tensor([2.0, 0.0, -1.0])
    assert logprob_of(logits, 0) == pytest.approx(float(torch.log_softmax(logits, 0)[0]))


def test_stream_seeds_differ_by_seed_and_index():
    seeds = {stream_seed(s, i) for s in range(20) for i in range(20)}
    assert len(seeds) == 400
    assert all(0 <= s < 1 << 63 for s in seeds)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 1 << 64}, "seed"),
    ],
)
def test_bad_sampling_is_refused_naming_the_field(kwargs, field):
    with pytest.raises(InvalidInput, match=f"sampling.{field}"):
        SamplingParams(**kwargs)


def test_sampling_crosses_the_wire():
    request = GenerateRequest("r", (1, 2), 4, SamplingParams(0.7, 0.9, seed=(1 << 64) - 1))
    assert convert.generate_request_from_pb(convert.generate_request_to_pb(request)) == request
    greedy = GenerateRequest("r", (1,), 1)
    back = convert.generate_request_from_pb(convert.generate_request_to_pb(greedy))
    assert back.sampling == SamplingParams() and back.sampling.seed is None


def test_logprobs_cross_the_wire():
    ticket = Ticket("r", "p0", (1, 2), 0, 20, 5, 1e9, "h:1", first_logprob=-0.25)
    assert convert.ticket_from_pb(convert.ticket_to_pb(ticket)) == ticket
    event = TokenEvent("r", 5, 1, logprob=-1.5)
    assert convert.token_event_from_pb(convert.token_event_to_pb(event)) == event


def test_a_batch_of_rows_picks_and_scores_each_row_as_alone():
    """The batched step picks the greedy rows in one argmax and scores every row in one log
    softmax: the same tokens and logprob bits as row by row, sampled rows beside them."""
    logits = torch.randn(9, 512) * 4
    samplers = [Sampler() if i % 3 else Sampler(0.8, top_p=0.9, seed=i) for i in range(9)]
    indices = list(range(5, 14))
    tokens = choose_rows(logits, samplers, indices)
    assert tokens == [
        choose(row, s, i) for row, s, i in zip(logits, samplers, indices, strict=True)
    ]
    batched = logprobs_of(logits, tokens)
    assert batched.tolist() == [logprob_of(row, t) for row, t in zip(logits, tokens, strict=True)]
