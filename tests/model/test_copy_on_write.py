"""A prefix hit that ends inside a KV block (issue 35): the engine copies that block's rows
into the request's own block, restores the checkpoint, and resumes; the request's caches
are then those of one pass over its prompt, bit for bit. Blocks of 48 and 112 tokens: 64
divides neither, like the tiny Nemotron-H's 112."""

from __future__ import annotations

import pytest
import torch

from tests.model.batching_support import ARCHS, engines, model_of, random_prompt, request_caches
from transfer.model.batch import SequenceStep

HIT = 128  # a checkpoint position: a multiple of 64


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    return model_of(request.param, tmp_path_factory)


@pytest.mark.parametrize("block_size", [48, 112])
def test_a_hit_inside_a_block_copies_its_rows_and_resumes_exactly(model, block_size):
    vocab = model.geometry.vocab_size
    cached = random_prompt(vocab, HIT + 20)
    prompt = cached[:HIT] + random_prompt(vocab, 30)
    blocks = -(-len(prompt) // block_size)
    whole, shared = HIT // block_size, list(range(HIT // block_size))

    e = engines(model, num_slots=3, block_size=block_size)
    first = list(range(blocks))  # the cached prompt's table; its checkpoint goes to slot 2
    e.batch.step([SequenceStep(cached[:HIT], 0, first)])
    e.engine.copy_state(0, 2)
    e.batch.step([SequenceStep(cached[HIT:], 0, first, HIT)])
    # the hit: whole blocks shared, the one it ends in copied into a block of its own
    table = shared + list(range(blocks, 2 * blocks - whole))
    e.engine.copy_state(2, 1)
    e.engine.copy_kv_rows(first[whole], table, HIT)
    e.batch.step([SequenceStep(prompt[HIT:], 1, table, HIT)])

    fresh = engines(model, num_slots=1, block_size=block_size)
    fresh.batch.step([SequenceStep(prompt, 0, list(range(blocks)))])
    want = request_caches(fresh.caches, 0, range(blocks), len(prompt))
    got = request_caches(e.caches, 1, table, len(prompt))
    assert [key for key in want if not torch.equal(want[key], got[key])] == []


def test_a_copy_that_ends_on_a_block_boundary_is_refused(model):
    e = engines(model, num_slots=1, block_size=64)
    with pytest.raises(ValueError, match="block boundary"):
        e.engine.copy_kv_rows(0, [1, 2], HIT)
