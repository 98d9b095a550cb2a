"""`Arena`: one rank's single contiguous cache buffer, registered once with a transport."""

from __future__ import annotations

import torch

from transfer.cache.layout import Layout
from transfer.cache.views import check_arena


class Arena:
    """A flat uint8 buffer of `layout.arena_bytes`, allocated once (uninitialised), plus the
    layout's typed views into it. `buffer` is what a transport registers."""

    def __init__(self, layout: Layout, buffer: torch.Tensor) -> None:
        self.layout = layout
        self.buffer = check_arena(layout, buffer)

    @classmethod
    def allocate(cls, layout: Layout, device: torch.device | str = "cpu") -> Arena:
        return cls(layout, torch.empty(layout.arena_bytes, dtype=torch.uint8, device=device))

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def data_ptr(self) -> int:
        return self.buffer.data_ptr()

    def kv(self, layer: int, tensor: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """See `Layout.kv_view`."""
        return self.layout.kv_view(self.buffer, layer, tensor, dtype)

    def ssm(self, layer: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """See `Layout.ssm_view`."""
        return self.layout.ssm_view(self.buffer, layer, dtype)

    def conv(
        self, layer: int, tensor: str = "conv", dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """See `Layout.conv_view`."""
        return self.layout.conv_view(self.buffer, layer, tensor, dtype)

    @property
    def staging(self) -> torch.Tensor:
        """uint8 `[staging_bytes]`, inside the registered buffer."""
        return self.layout.staging_view(self.buffer)
