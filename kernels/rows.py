"""Row scatters that move 16 bytes per element.

On the CPU, torch's `index_copy_` steps through its rows one element at a time, so a float32
scatter viewed as complex128 words moves the same bytes 2-4x faster (docs/benchmarks.md,
"Decode steps at batch", eighth round). Only bytes are copied: no value passes through
arithmetic.
"""

from __future__ import annotations

import torch

WORD = torch.complex128  # the widest element type index_copy_ moves whole
# Below this many bytes the word view's own cost (some 10-20 us of Python) outweighs it.
MIN_WORD_BYTES = 1 << 16


def index_copy_rows_(dest: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dest[index[i]] = src[i] along dim 0 and returns dest; dest [N, ...] (any strides),
    src [n, ...] with dest's trailing shape, cast to dest's dtype."""
    src = src.to(dest.dtype)
    large = src.numel() * src.element_size() >= MIN_WORD_BYTES
    words = as_words(dest) if large and dest.device.type == "cpu" else None
    if words is not None:
        flat = src.contiguous().view(src.shape[0], -1).view(WORD)
        words.index_copy_(0, index, flat.view(src.shape[0], *words.shape[1:]))
        return dest
    return dest.index_copy_(0, index, src)


def as_words(x: torch.Tensor) -> torch.Tensor | None:
    """x [N, ...] viewed as [N, ..., W] 16-byte words (its trailing dims merged where they are
    one contiguous run), or None when its rows are not whole, aligned words."""
    if x.dim() < 2 or x.dtype.is_complex or 16 % x.element_size():
        return None
    per_word = 16 // x.element_size()
    first = x.dim() - 1  # the first of the trailing dims that lie back to back
    while first > 1 and x.stride(first - 1) == x.stride(first) * x.shape[first]:
        first -= 1
    if x.stride(-1) != 1:
        return None
    x = x.flatten(first)
    if x.shape[-1] % per_word or x.storage_offset() % per_word:
        return None
    if any(stride % per_word for stride in x.stride()[:-1]):
        return None
    return x.view(WORD)
