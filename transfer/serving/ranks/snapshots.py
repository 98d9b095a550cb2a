"""One rank's cache of one request as a snapshot (what `launch --verify` checks), and its
file under the run's dump directory: written inside the ranks, read by `verify`.

A snapshot maps every cache tensor `"L{layer}.{name}"` to a `[rows, rank_channels]` CPU
tensor in its native dtype: rows are the request's tokens for KV, the conv window steps for
conv, one row for the recurrent state.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import torch

from transfer.geometry import CacheTensor, ModelGeometry, Role
from transfer.model.caches import CacheAccess
from transfer.serving.role import INSTANCE_ROLES, ServeRole

RankTensors = dict[str, torch.Tensor]


def tensor_key(layer_index: int, name: str) -> str:
    return f"L{layer_index}.{name}"


def cache_tensors(geometry: ModelGeometry) -> list[tuple[str, int, CacheTensor]]:
    """(key, layer index, tensor) of every cache tensor, in layer order."""
    return [
        (tensor_key(layer.index, t.name), layer.index, t)
        for layer in geometry.layers
        for t in layer.cache_tensors()
    ]


def snapshot_request(
    geometry: ModelGeometry,
    caches: CacheAccess,
    block_ids: Sequence[int],
    slot: int,
    num_tokens: int,
) -> RankTensors:
    """One rank's cache of one request, copied to CPU, in its native dtypes.

    KV: `[num_tokens, rank_channels]` gathered through the block table; SSM:
    `[1, rank_heads * k * v]`; conv: `[conv_kernel - 1, rank_channels]`.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    snap: RankTensors = {}
    for key, index, tensor in cache_tensors(geometry):
        if tensor.role is Role.KV:
            cache = caches.kv(index, tensor.name)  # [NB, BS, ...]
            blocks = torch.as_tensor(list(block_ids), dtype=torch.long, device=cache.device)
            if blocks.numel() * caches.block_size < num_tokens:
                raise ValueError(
                    f"block_ids: {blocks.numel()} blocks cannot hold {num_tokens} tokens"
                )
            pos = torch.arange(num_tokens, device=cache.device)
            rows = cache[blocks[pos // caches.block_size], pos % caches.block_size]
            snap[key] = rows.reshape(num_tokens, -1)
        elif tensor.role is Role.SSM:
            snap[key] = caches.ssm(index)[slot].reshape(1, -1)
        else:
            snap[key] = caches.conv(index, tensor.name)[slot].transpose(0, 1)
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in snap.items()}


def request_dir(root: str | Path, request_id: str) -> Path:
    """Where the snapshots of `request_id` live under the run's dump directory."""
    return Path(root) / re.sub(r"[^A-Za-z0-9._-]", "_", request_id)


def save_snapshot(
    root: str | Path, request_id: str, side: ServeRole, rank: int, snap: RankTensors
) -> Path:
    """Write one rank's snapshot; `side` is PREFILL or DECODE."""
    if side not in INSTANCE_ROLES:
        raise ValueError(f"side must be 'prefill' or 'decode', got {side!r}")
    path = request_dir(root, request_id) / f"{side}-rank{rank}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(snap, tmp)
    tmp.replace(path)
    return path


def load_side(root: str | Path, request_id: str, side: ServeRole) -> list[RankTensors]:
    """All ranks' snapshots of one side, in rank order (empty when none was written)."""
    folder = request_dir(root, request_id)
    paths = sorted(folder.glob(f"{side}-rank*.pt"), key=lambda p: int(p.stem.rsplit("rank", 1)[1]))
    return [torch.load(p, weights_only=True) for p in paths]
