"""The TP=1 engine of each tiny preset (the real architectures) through its caches against
the cache-free full-sequence forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from transfer.errors import InvalidInput
from transfer.geometry import Role
from transfer.model.caches import LocalCaches, view_shape
from transfer.model.distributed import TPGroup
from transfer.model.loader import load_model, model_for_geometry
from transfer.model.reference import full_sequence_logits, reference_generate, reference_model
from transfer.model.runner import RankEngine
from transfer.presets import get_preset

MODELS = ("tiny-qwen3-next", "tiny-qwen3.5", "tiny-kimi-linear", "tiny-nemotron-h")
PROMPT = [5, 77, 301, 12, 9, 480, 33, 2, 141, 64, 7, 250, 18, 99, 3, 411, 27, 8, 300]
NEW_TOKENS = 6
BLOCK_SIZE = 8


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def generate_with_logits(engine: RankEngine, prompt, blocks, slot, new_tokens):
    logits = [engine.prefill_logits(prompt, blocks, slot)]
    tokens = [int(logits[0].argmax())]
    for i in range(new_tokens):
        logits.append(engine.decode_step_logits(tokens[-1], len(prompt) + i, blocks, slot))
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits)


class HeadMajorCaches:
    """Caches stored head-major (heads outermost, as the arena does): every view is strided."""

    def __init__(self, geometry, num_blocks, block_size, num_slots):
        self.block_size, self.num_blocks, self.num_slots = block_size, num_blocks, num_slots
        self.views = {}
        for layer in geometry.layers:
            for tensor in layer.cache_tensors():
                rows = num_blocks if tensor.role is Role.KV else num_slots
                shape = view_shape(layer, tensor.name, 1, rows, block_size)
                if tensor.role is Role.CONV:  # time-major storage [slots, W-1, C]
                    base = torch.full((shape[0], shape[2], shape[1]), float("nan"))
                    view = base.transpose(1, 2)
                else:  # dim 1 outermost (kv: the block offset for MLA, heads otherwise)
                    order = (2, 0, 1, 3) if len(shape) == 4 else (1, 0, 2)
                    base = torch.full([shape[i] for i in order], float("nan"))
                    view = base.permute(*[order.index(i) for i in range(len(shape))])
                assert view.shape == shape and (not view.is_contiguous() or 1 in shape)
                self.views[layer.index, tensor.name] = view

    def kv(self, layer, name):
        return self.views[layer, name]

    def ssm(self, layer):
        return self.views[layer, "ssm"]

    def conv(self, layer, name):
        return self.views[layer, name]


@pytest.fixture(scope="module", params=MODELS)
def geometry(request):
    return get_preset(request.param)


@pytest.fixture(scope="module")
def cached_run(geometry):
    caches = LocalCaches(geometry, num_blocks=6, block_size=BLOCK_SIZE, num_slots=3)
    engine = RankEngine(geometry, caches, model=reference_model(geometry))
    # Blocks out of order and a slot other than 0: the block table and slot index matter.
    blocks = [4, 1, 3, 0]
    return engine, generate_with_logits(engine, PROMPT, blocks, 2, NEW_TOKENS)


def test_cached_decode_matches_cache_free_forward(geometry, cached_run):
    engine, (tokens, logits) = cached_run
    # The model is causal, so one forward over the whole sequence yields, at each position,
    # the logits a from-scratch recompute at that step would: no cache is read or written.
    sequence = PROMPT + tokens[:-1]
    full = full_sequence_logits(engine.model, sequence)[len(PROMPT) - 1 :]
    assert [int(t) for t in full.argmax(-1)] == tokens
    assert rel_err(logits, full) < 1e-4
    assert len(set(tokens)) > 1, "a degenerate model would hide cache bugs"


def test_strided_head_major_caches_give_identical_results(geometry, cached_run):
    _, (tokens, logits) = cached_run
    caches = HeadMajorCaches(geometry, num_blocks=6, block_size=BLOCK_SIZE, num_slots=3)
    engine = RankEngine(geometry, caches, model=reference_model(geometry))
    got_tokens, got_logits = generate_with_logits(engine, PROMPT, [4, 1, 3, 0], 2, NEW_TOKENS)
    assert got_tokens == tokens
    assert rel_err(got_logits, logits) < 1e-5


def test_reference_generate_matches_engine(geometry, cached_run):
    _, (tokens, _) = cached_run
    assert reference_generate(geometry, PROMPT, NEW_TOKENS + 1, seed=0) == tokens


def test_seed_changes_the_model(geometry):
    a, b = reference_model(geometry, seed=0), reference_model(geometry, seed=1)
    la, lb = full_sequence_logits(a, PROMPT[:4]), full_sequence_logits(b, PROMPT[:4])
    assert rel_err(la, lb) > 0.1


def test_prompt_shorter_than_conv_window(geometry):
    caches = LocalCaches(geometry, num_blocks=2, block_size=BLOCK_SIZE, num_slots=1)
    engine = RankEngine(geometry, caches, model=reference_model(geometry))
    logits = [engine.prefill_logits([42], [0], 0)]
    token = int(logits[0].argmax())
    for position in (1, 2, 3):
        logits.append(engine.decode_step_logits(token, position, [0], 0))
        token = int(logits[-1].argmax())
    sequence = [42] + [int(x.argmax()) for x in logits[:-1]]
    assert rel_err(torch.stack(logits), full_sequence_logits(engine.model, sequence)) < 1e-4


@pytest.fixture(scope="module")
def small_engine():
    geometry = get_preset("tiny-qwen3-next")
    caches = LocalCaches(geometry, num_blocks=4, block_size=8, num_slots=2)
    return RankEngine(geometry, caches, model=reference_model(geometry))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda e: e.prefill([], [0], 0), "prompt_ids must not be empty"),
        (
            lambda e: e.prefill([1, 512], [0], 0),
            r"prompt_ids: token ids must be ints in \[0, 512\)",
        ),
        (lambda e: e.prefill([1, 2.0], [0], 0), "prompt_ids"),
        (lambda e: e.prefill(list(range(9)), [0], 0), "9 tokens need 2 blocks"),
        (lambda e: e.prefill([1], [7], 0), r"block_ids: block ids must be ints in \[0, 4\)"),
        (lambda e: e.prefill([1], [1, 1], 0), "block_ids: block ids must be distinct"),
        (lambda e: e.prefill([1], [0], 2), r"slot must be an int in \[0, 2\)"),
        (lambda e: e.decode_step(1, 1, [0], 0), "slot 0 holds no request state"),
        (lambda e: e.decode_step(1, 0, [0], 0), "position must be an int >= 1"),
        (lambda e: e.decode(1, 8, [0], 0, 2), "10 tokens need 2 blocks"),
        (lambda e: e.decode(1, 8, [0, 1], 0, -1), "max_new_tokens must be an int >= 0"),
    ],
)
def test_bad_requests_raise_naming_the_field(small_engine, call, match):
    with pytest.raises(ValueError, match=match):
        call(small_engine)


def test_models_without_weights_or_for_another_tp_are_refused():
    for name in ("qwen3-next-80b-a3b", "kimi-linear-48b-a3b", "nemotron-nano-12b-v2"):
        with pytest.raises(InvalidInput, match=f"preset '{name}' has no weights; pass its"):
            load_model(name)
        with pytest.raises(InvalidInput, match="pass its checkpoint directory"):
            model_for_geometry(get_preset(name), TPGroup.single())
    changed = dataclasses.replace(get_preset("tiny-kimi-linear"), hidden_size=128)
    with pytest.raises(InvalidInput, match="no weights for geometry 'tiny-kimi-linear'"):
        model_for_geometry(changed, TPGroup.single())
    with pytest.raises(InvalidInput, match="unknown model 'tiny-llama'"):
        load_model("tiny-llama")
    with pytest.raises(ValueError, match="tp=8 does not divide the 4"):
        load_model("tiny-qwen3-next", TPGroup(0, 8, distributed=False))
    geometry = get_preset("tiny-qwen3-next")
    caches = LocalCaches(geometry, num_blocks=1, block_size=8, num_slots=1)
    with pytest.raises(ValueError, match="model: built for another geometry"):
        RankEngine(geometry, caches, seed=1, model=reference_model(geometry, seed=0))
