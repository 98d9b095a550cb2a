"""Tensor-parallel process groups: one process per TP rank, gloo on CPU, nccl on CUDA.

`TPGroup.single()` is the one-process path (TP=1, no torch.distributed at all); every
collective on it is a no-op, so the model code calls collectives unconditionally.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import torch
import torch.distributed as dist

from transfer.model.rendezvous import Rendezvous


class TPGroup:
    """The ranks of one model instance. `group` is None for the default (world) group."""

    def __init__(self, rank: int, size: int, group: Any = None, *, distributed: bool) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        if not 0 <= rank < size:
            raise ValueError(f"rank must be in [0, {size}), got {rank}")
        self.rank = rank
        self.size = size
        self.group = group
        self.distributed = distributed

    @classmethod
    def single(cls) -> TPGroup:
        """TP=1 in this process, without torch.distributed."""
        return cls(0, 1, distributed=False)

    @classmethod
    def from_group(cls, group: Any = None) -> TPGroup:
        """Wrap an already initialised torch.distributed group (None: the world group)."""
        if not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialised")
        return cls(dist.get_rank(group), dist.get_world_size(group), group, distributed=True)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks in place (row-parallel outputs); returns it."""
        if self.distributed and self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite `tensor` with rank `src`'s copy (`src` is a rank of this group)."""
        if self.distributed and self.size > 1:
            dist.broadcast(tensor, src=self._global_rank(src), group=self.group)
        return tensor

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """Rank `src`'s picklable `obj` on every rank (workers use it to fan out commands)."""
        if not (self.distributed and self.size > 1):
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self._global_rank(src), group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.distributed and self.size > 1:
            dist.barrier(group=self.group)

    def close(self) -> None:
        """Tear down the default group if this object created it (idempotent)."""
        if self.distributed and self.group is None and dist.is_initialized():
            dist.destroy_process_group()
        self.distributed = False

    def _global_rank(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size}, distributed={self.distributed})"


def default_backend(device: torch.device | str = "cpu") -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_tp_group(
    rank: int,
    world_size: int,
    init_method: str | None = None,
    *,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    device: torch.device | str = "cpu",
    timeout_s: float = 120.0,
) -> TPGroup:
    """Join the TP group of `world_size` processes as `rank` (the default process group).

    Give either `init_method` ("tcp://host:port", "file:///path") or `master_port` (with
    `master_addr`). A tcp rendezvous listens on `host` only, and on gloo only until the
    group has formed (`rendezvous.Rendezvous`). world_size 1 without either returns `TPGroup.single()`. On CUDA the
    caller sets the current device before this call; the backend is nccl there, else gloo.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if init_method is None and master_port is None:
        if world_size == 1:
            return TPGroup.single()
        raise ValueError("give init_method or master_port to join a group of world_size > 1")
    if init_method is not None and master_port is not None:
        raise ValueError("give only one of init_method and master_port")
    if init_method is None:
        if not 0 < master_port < 65536:
            raise ValueError(f"master_port must be in (0, 65536), got {master_port}")
        init_method = f"tcp://{master_addr}:{master_port}"
    if dist.is_initialized():
        raise ValueError("torch.distributed is already initialised; use TPGroup.from_group()")
    backend = default_backend(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    if not init_method.startswith("tcp://"):
        dist.init_process_group(backend, init_method=init_method, rank=rank,
                                world_size=world_size, timeout=timeout)  # fmt: skip
        return TPGroup(rank, world_size, distributed=True)
    rendezvous = Rendezvous(init_method, rank, world_size, timeout_s)
    dist.init_process_group(backend, store=rendezvous.store, rank=rank,
                            world_size=world_size, timeout=timeout)  # fmt: skip
    if backend == "gloo":
        # Every rank has joined once this returns; gloo needs no new store connection
        # after that. nccl may open one later (its communicators start lazily), so its
        # listener stays, bound to HOST.
        dist.barrier()
        rendezvous.stop_listening()
    return TPGroup(rank, world_size, distributed=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for launching a local group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
