"""Decode's read-side staging buffer: registered with the transport next to vLLM's memory,
it holds the staged spans and digest tables of the loads in flight until they are copied
into place (or checked). Holds are first fit; a load that finds no room reads directly.
"""

from __future__ import annotations

import numpy as np
import torch

# Room for the staged spans of the loads in flight.
STAGING_BYTES = 8 << 20


class StagingBuffer:
    """`tensor` (uint8) is registered at virtual offset `start`; holds are keyed by name."""

    def __init__(self, tensor: torch.Tensor, start: int) -> None:
        self.tensor = tensor
        self.start = start
        self._held: dict[str, tuple[int, int]] = {}  # key -> (offset, bytes)

    def hold(self, key: str, nbytes: int) -> int | None:
        """First fit: the held span's offset in the buffer, or None when there is no room."""
        cursor = 0
        for start, size in sorted(self._held.values()):
            if start - cursor >= nbytes:
                break
            cursor = max(cursor, start + size)
        if cursor + nbytes > self.tensor.numel():
            return None
        self._held[key] = (cursor, nbytes)
        return cursor

    def free(self, *keys: str) -> None:
        for key in keys:
            self._held.pop(key, None)

    def read(self, offset: int, nbytes: int) -> np.ndarray:
        """`nbytes` at `offset` on the host (a view of a CPU buffer: read it while held)."""
        return self.tensor[offset : offset + nbytes].cpu().numpy()
