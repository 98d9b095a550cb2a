"""A rank's staging copies: pack a held request's cache ranges into its staging area
(prefill, before the decode side READs them), and unpack staged bytes into the cache
(decode, once they landed). Every copy is checked against the arena's layout first."""

from __future__ import annotations

import numpy as np
import torch

from transfer.cache.layout import Layout
from transfer.serving.spec import Copies


def gather_to_staging(buffer: torch.Tensor, layout: Layout, copies: Copies) -> None:
    """Pack cache ranges of `buffer` (uint8, the rank's arena) back to back into its staging
    area (`copies.dst` consecutive); done when this returns."""
    if not len(copies):
        return
    from kernels import gather_ranges

    start, total = check_copies(layout, copies, packed="dst")
    src, lengths = torch.from_numpy(copies.src), torch.from_numpy(copies.nbytes)
    gather_ranges(buffer, src, lengths, out=buffer[start : start + total])
    if buffer.is_cuda:
        torch.cuda.synchronize(buffer.device)


def scatter_from_staging(buffer: torch.Tensor, layout: Layout, copies: Copies) -> None:
    """Unpack staged bytes (`copies.src` consecutive) into the cache ranges `copies.dst`."""
    from kernels import scatter_ranges

    start, total = check_copies(layout, copies, packed="src")
    dst, lengths = torch.from_numpy(copies.dst), torch.from_numpy(copies.nbytes)
    scatter_ranges(buffer[start : start + total], buffer, dst, lengths)


def check_copies(layout: Layout, copies: Copies, packed: str) -> tuple[int, int]:
    """(start, bytes) of the packed side (`packed`: "src" or "dst"), which must lie in the
    staging area; the other side must lie in the KV and state regions. Raises ValueError
    naming what is wrong."""
    lengths = copies.nbytes
    packed_at = copies.dst if packed == "dst" else copies.src
    cache_at = copies.src if packed == "dst" else copies.dst
    if (lengths < 1).any():
        raise ValueError("staging copies: every length must be >= 1")
    start, total = int(packed_at[0]), int(lengths.sum())
    expected = start + np.concatenate(([0], np.cumsum(lengths)[:-1]))
    if not np.array_equal(packed_at, expected):
        raise ValueError(f"staging copies: {packed} offsets are not back to back")
    area = (layout.staging_offset, layout.staging_offset + layout.staging_bytes)
    if start < area[0] or start + total > area[1]:
        raise ValueError(f"staging copies: [{start}, {start + total}) outside staging {area}")
    if (cache_at < 0).any() or (cache_at + lengths > layout.progress_offset).any():
        raise ValueError("staging copies: a cache range lies outside the cache regions")
    return start, total
