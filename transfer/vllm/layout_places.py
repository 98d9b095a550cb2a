"""One registered vLLM cache view, checked against the geometry, as places in its rank's
memory: where each attention tensor's heads (`KVPlace`) and each linear layer's states
(`StatePlace`) sit, as byte offsets into the registered regions plus strides.

The views vLLM (0.32) registers, per layer kind:
- attention: `[blocks, kv_heads, block_size, head_size + head_size_v]` in the KV dtype
  (LBHNC: a head's part of a block is one run). The CPU kernel reads that run as K
  dim-major (`[head_size][block_size]`) then V token-major, so a token's K is not one run:
  the units name the view's rows, and `load_plan` moves attention blocks whole;
- MLA: `[blocks, 1, block_size, kv_lora_rank + rope_dim]`;
- mamba-like (GDN, Mamba2): raw int8 pages `[blocks, 1, 1, page bytes]`; each page holds
  the layer's states back to back (`MambaSpec.shapes` / `dtypes`: conv, then SSM), and the
  page may be padded so that every group's pages are the same size.

A view of another shape (a head dim that is not innermost, a conv shape that is neither SD
nor DS, speculative conv slots) fails here, naming its layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from transfer.cache.head_units import rank_units
from transfer.dataplane.regions import RegionMap
from transfer.errors import InvalidInput
from transfer.geometry import LayerKind, Role

STATE_ORDER_SD = "SD"  # conv state per block: (state_len, dim), vLLM's default
STATE_ORDER_DS = "DS"  # (dim, state_len), VLLM_SSM_CONV_STATE_LAYOUT=DS


@dataclass(frozen=True)
class KVPlace:
    """One attention layer's cache tensor: local head `j` of block `b`, token `t` starts at
    `base + j * head_stride + b * block_stride + t * token_stride` (virtual bytes)."""

    layer: int
    tensor: str
    base: int
    head_stride: int
    block_stride: int
    token_stride: int
    nbytes: int  # one head's row of this tensor


@dataclass(frozen=True)
class StatePlace:
    """One linear layer's state tensor in its page: local channel `c` (conv) or head `c`
    (SSM), step `k` of slot `s` is at `base + s * slot_stride + c * elem_stride + k *
    step_stride` (virtual bytes; SSM: a head is one run of `unit_bytes`)."""

    layer: int
    tensor: str
    role: Role
    base: int
    slot_stride: int
    elem_stride: int
    step_stride: int
    elem_bytes: int


def _virtual(t: torch.Tensor, region_map: RegionMap) -> int:
    region = region_map.find_address(t.data_ptr())
    return region.start + t.data_ptr() - region.address


def _elem_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def attention_places(layer, spec, view, region_map, tp, where) -> tuple[list[KVPlace], int, int]:
    """An attention (GQA or MLA) layer's places, its block size and its KV element bytes."""
    if view.dim() != 4:
        raise InvalidInput(
            f"vLLM caches: {where}: expected a [B, H, N, C] view, got {tuple(view.shape)}"
        )
    blocks, heads, tokens, content = view.shape
    eb = view.element_size()
    b_stride, h_stride, n_stride, c_stride = (s * eb for s in view.stride())
    tensors = [t for t in layer.cache_tensors() if t.role is Role.KV]
    rank_heads = [sum(1 for _ in rank_units(t, tp, 0)) for t in tensors]
    if c_stride != eb:
        raise InvalidInput(
            f"vLLM caches: {where}: the head dim is not innermost (layout unsupported)"
        )
    base = _virtual(view, region_map)
    if layer.spec.kind is LayerKind.MLA:
        width = tensors[0].segments[0].unit_elems
        if (heads, content) != (1, width):
            raise InvalidInput(
                f"vLLM caches: {where}: expected [B, 1, N, {width}], got {tuple(view.shape)}"
            )
        return [KVPlace(layer.index, "kv", base, 0, b_stride, n_stride, width * eb)], tokens, eb
    head_dim = tensors[0].segments[0].unit_elems
    if heads != rank_heads[0] or content != 2 * head_dim:
        raise InvalidInput(
            f"vLLM caches: {where}: expected [B, {rank_heads[0]}, N, {2 * head_dim}] (K|V per "
            f"token), got {tuple(view.shape)}"
        )
    places = [
        KVPlace(
            layer.index, name, base + k * head_dim * eb, h_stride, b_stride, n_stride, head_dim * eb
        )
        for k, name in enumerate(("k", "v"))
    ]
    return places, tokens, eb


def linear_places(
    layer, spec, view, region_map, tp, conv_order, where
) -> tuple[list[StatePlace], int, int]:
    """A linear layer's conv and SSM places (`conv_order`: a STATE_ORDER_*), and its SSM and
    conv element bytes."""
    shapes, dtypes = getattr(spec, "shapes", None), getattr(spec, "dtypes", None)
    tensors = layer.cache_tensors()
    if shapes is None or len(shapes) != 2 or len(tensors) != 2:
        raise InvalidInput(
            f"vLLM caches: {where}: expected a conv and an SSM state (MambaSpec), got {spec!r}"
        )
    ssm, conv = (next(t for t in tensors if t.role is role) for role in (Role.SSM, Role.CONV))
    conv_shape, ssm_shape = tuple(shapes[0]), tuple(shapes[1])
    conv_eb, ssm_eb = _elem_bytes(dtypes[0]), _elem_bytes(dtypes[1])
    channels, steps = conv.rank_channels(tp), conv.steps
    expected_conv = (steps, channels) if conv_order == STATE_ORDER_SD else (channels, steps)
    if conv_shape != expected_conv:
        raise InvalidInput(
            f"vLLM caches: {where}: conv state {conv_shape}, expected {expected_conv} "
            f"({conv_order}; speculative conv slots are not supported)"
        )
    if math.prod(ssm_shape) != ssm.rank_channels(tp):
        raise InvalidInput(
            f"vLLM caches: {where}: SSM state {ssm_shape} holds {math.prod(ssm_shape)} "
            f"elements, the geometry {ssm.rank_channels(tp)}"
        )
    if view.dim() != 4 or view.shape[1:3] != (1, 1) or view.element_size() != 1:
        raise InvalidInput(
            f"vLLM caches: {where}: expected raw int8 pages [B, 1, 1, C], got {tuple(view.shape)}"
        )
    page_stride = view.stride(0)
    conv_bytes = math.prod(conv_shape) * conv_eb
    if view.shape[3] < conv_bytes + math.prod(ssm_shape) * ssm_eb:
        raise InvalidInput(
            f"vLLM caches: {where}: page of {view.shape[3]} B is smaller than its states"
        )
    base = _virtual(view, region_map)
    if conv_order == STATE_ORDER_SD:
        conv_elem, conv_step = conv_eb, channels * conv_eb
    else:
        conv_elem, conv_step = steps * conv_eb, conv_eb
    return (
        [
            StatePlace(
                layer.index, conv.name, Role.CONV, base, page_stride, conv_elem, conv_step, conv_eb
            ),
            StatePlace(
                layer.index,
                ssm.name,
                Role.SSM,
                base + conv_bytes,
                page_stride,
                ssm_eb,
                ssm_eb,
                ssm_eb,
            ),
        ],
        ssm_eb,
        conv_eb,
    )
