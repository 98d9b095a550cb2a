"""What a transport checks of the memory it registers and of its own name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from transfer.errors import InvalidInput


@dataclass(frozen=True)
class ArenaInfo:
    address: int
    nbytes: int
    device: str
    device_index: int


def arena_info(arena: Any) -> ArenaInfo:
    """Validate an arena tensor: uint8, 1-D, contiguous, non-empty, on CPU or CUDA."""
    if not isinstance(arena, torch.Tensor):
        raise InvalidInput(f"arena: expected a torch.Tensor, got {type(arena).__name__}")
    if arena.dtype != torch.uint8 or arena.dim() != 1:
        raise InvalidInput(
            f"arena: expected a 1-D uint8 tensor, got {arena.dtype} {tuple(arena.shape)}"
        )
    if not arena.is_contiguous() or arena.numel() == 0:
        raise InvalidInput("arena: must be contiguous and non-empty")
    if arena.device.type not in ("cpu", "cuda"):
        raise InvalidInput(f"arena: device {arena.device} is neither cpu nor cuda")
    index = arena.device.index if arena.device.type == "cuda" else 0
    return ArenaInfo(arena.data_ptr(), arena.numel(), arena.device.type, index or 0)


def check_agent_name(name: Any) -> str:
    if not isinstance(name, str) or not name or len(name) > 128 or not name.isprintable():
        raise InvalidInput(f"agent_name: expected 1-128 printable characters, got {name!r}")
    return name
