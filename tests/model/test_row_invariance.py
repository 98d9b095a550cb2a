"""A prefill split at an aligned position leaves the caches of one pass over the whole
prompt, bit for bit, whatever the suffix's length: what a prefix-cache hit relies on
(docs/prefix-cache.md). Without `row_invariant` a suffix of a few rows took another GEMM
kernel and its caches differed in their last bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.model.batching_support import (
    ARCHS,
    BLOCK_SIZE,
    engines,
    model_of,
    random_prompt,
    request_caches,
)
from transfer.model.batch import SequenceStep
from transfer.model.row_invariant import (
    MIN_GEMM_ROWS,
    linear,
    row_invariant,
    sigmoid,
    silu,
    softplus,
)

SPLIT = 64  # a checkpoint position: a multiple of the scan chunk and of the block size


@pytest.mark.parametrize("k, n", [(16, 2), (64, 128), (256, 512), (512, 64), (128, 1024)])
def test_a_short_linear_gives_the_rows_of_a_long_one(k, n):
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(k * n)
    w, x = torch.randn(n, k, generator=gen), torch.randn(4 * MIN_GEMM_ROWS, k, generator=gen)
    long = x @ w.T
    with row_invariant(True):
        for rows in range(1, MIN_GEMM_ROWS):
            assert torch.equal(linear(x[:rows], w), long[:rows]), rows
            assert torch.equal(linear(x[-rows:], w), long[-rows:]), rows


@pytest.mark.parametrize("name", ["sigmoid", "silu", "softplus"])
def test_an_activation_gives_each_element_what_a_long_tensor_gives_it(name):
    ours, plain = {"sigmoid": (sigmoid, torch.sigmoid), "silu": (silu, F.silu),
                   "softplus": (softplus, F.softplus)}[name]  # fmt: skip
    x = torch.randn(4096, generator=torch.Generator().manual_seed(3)) * 4
    long = plain(x)  # 4,096 elements: all of them through the vector loop
    short = [n for n in range(1, 200) if not torch.equal(plain(x[:n]), long[:n])]
    assert short, "the scalar tail no longer differs: row_invariant may be unnecessary"
    with row_invariant(True):
        for start, n in ((0, 7), (3, 50), (100, 131), (5, 1)):
            got = ours(x[start : start + n].view(-1, 1))
            assert torch.equal(got.flatten(), long[start : start + n]), (start, n)


@pytest.fixture(scope="module", params=ARCHS)
def model(request, tmp_path_factory):
    return model_of(request.param, tmp_path_factory)


@pytest.mark.parametrize("suffix", [1, 2, 3, 5, 17, 69])
def test_a_prompt_resumed_at_an_aligned_position_leaves_the_caches_of_one_pass(model, suffix):
    prompt = random_prompt(model.geometry.vocab_size, SPLIT + suffix)
    blocks = list(range(-(-len(prompt) // BLOCK_SIZE)))
    whole = engines(model, num_slots=1)
    whole.batch.step([SequenceStep(prompt, 0, blocks)])
    split = engines(model, num_slots=1)
    split.batch.step([SequenceStep(prompt[:SPLIT], 0, blocks)])
    split.batch.step([SequenceStep(prompt[SPLIT:], 0, blocks, SPLIT)])
    want = request_caches(whole.caches, 0, blocks, len(prompt))
    got = request_caches(split.caches, 0, blocks, len(prompt))
    assert [key for key in want if not torch.equal(want[key], got[key])] == []
