"""`index_copy_rows_` leaves exactly the bytes `index_copy_` leaves, word-wise or not."""

from __future__ import annotations

import pytest
import torch

from kernels import rows
from kernels.rows import WORD, as_words, index_copy_rows_


def random_bits(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Arbitrary bit patterns (NaNs with payloads, infinities, subnormals among them)."""
    words = torch.randint(-(2**31), 2**31 - 1, (*shape,), dtype=torch.int64).to(torch.int32)
    return words.view(torch.float32).view(dtype) if dtype == torch.float32 else words.view(dtype)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.uint8)


# (destination built from a backing tensor, source row shape): what the caches look like
DESTINATIONS = {
    "contiguous": (lambda: random_bits(12, 8, 32), (8, 32)),
    "heads-apart": (lambda: random_bits(12, 4, 2, 4, 16)[:, :, 1], (4, 4, 16)),  # SSM slots
    "conv-window": (lambda: random_bits(12, 2, 40, 3)[:, 0], (40, 3)),  # merged trailing dims
    "bf16": (lambda: random_bits(12, 16, dtype=torch.bfloat16), (16,)),
    "odd-row": (lambda: random_bits(12, 3, 5), (3, 5)),  # 60 bytes: not whole words
    "odd-offset": (lambda: random_bits(12 * 33 + 1)[1:].view(12, 33)[:, :32], (32,)),
}


@pytest.mark.parametrize("word_path", [True, False], ids=["words", "elements"])
@pytest.mark.parametrize("name", DESTINATIONS)
def test_same_bytes_as_index_copy(name, word_path, monkeypatch):
    # these copies are small: the word path takes them only with the size floor lowered
    monkeypatch.setattr(rows, "MIN_WORD_BYTES", 0 if word_path else 1 << 30)
    build, row_shape = DESTINATIONS[name]
    dest = build()
    src = random_bits(5, *row_shape, dtype=dest.dtype)
    index = torch.tensor([7, 0, 11, 3, 4])
    expected = dest.clone().index_copy_(0, index, src)
    assert index_copy_rows_(dest, index, src) is dest
    assert torch.equal(bits(dest), bits(expected))


def test_only_whole_aligned_words_take_the_word_path():
    for name in ("contiguous", "heads-apart", "conv-window", "bf16"):
        x = DESTINATIONS[name][0]()
        words = as_words(x)
        assert words is not None and words.dtype == WORD and words.data_ptr() == x.data_ptr()
        assert words.shape[0] == x.shape[0]
        assert words[0].numel() * 16 == x[0].numel() * x.element_size()
    for name in ("odd-row", "odd-offset"):
        assert as_words(DESTINATIONS[name][0]()) is None
    assert as_words(random_bits(8)) is None  # no rows
    assert as_words(random_bits(4, 8)[:, ::2]) is None  # elements apart


def test_source_is_cast_and_empty_sources_copy_nothing():
    dest = torch.zeros(4, 8)
    index_copy_rows_(dest, torch.tensor([2]), torch.arange(8, dtype=torch.float64)[None])
    assert (
        torch.equal(dest[2], torch.arange(8, dtype=torch.float32)) and dest[[0, 1, 3]].eq(0).all()
    )
    index_copy_rows_(dest, torch.tensor([], dtype=torch.long), torch.empty(0, 8))
    assert torch.equal(dest[2], torch.arange(8, dtype=torch.float32))
